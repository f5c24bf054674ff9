"""PPO training: GAE and the clipped loss by hand, the environment's contract, a smoke run, export."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from node_agent.allocator import GuardConfig
from policies.actor import load_checkpoint
from policies.env import AllocatorEnv, EnvConfig, RewardConfig, apply_guards, node_reward, team_rewards
from policies.export import export_checkpoint, verify_artifact
from node_agent.features import NUM_FEATURES, WindowStats
from policies.train_ppo import Args, compute_gae, ppo_loss, train

TINY = dict(traces=("synthetic",), num_nodes=2, rate_rps=200.0, rate_spread=0.0, duration_s=5.0, num_users=300,
            history_scale=1.0, cache_fraction=0.5)


def stats(**kw) -> WindowStats:
    base = dict(interval_s=1.0, num_requests=100, arrival_rate_rps=100.0, hot_user_ratio=0.05, history_len_p50=100.0,
                history_len_p99=400.0, emb_lookups_per_request=300.0, emb_hit_rate=0.5, kv_hit_rate=0.5,
                kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=1.0, emb_share=0.5, load=0.3, p99_ms=15.0,
                slo_ms=30.0, refill_bytes=0.0, arena_bytes=1e9)
    base.update(kw)
    return WindowStats(**base)


# ------------------------------------------------------------------------------------------ GAE


def test_gae_matches_hand_computation():
    # one agent, three steps; the episode ends (truncated) after step 1, a new one starts at step 2
    r = torch.tensor([[1.0], [2.0], [3.0]])
    v = torch.tensor([[0.5], [1.0], [2.0]])
    nv = torch.tensor([[1.0], [4.0], [5.0]])  # step 0 -> V(s1)=1.0; step 1 -> V(final obs)=4.0; step 2 -> V(s3)=5.0
    term = torch.zeros(3, 1)
    end = torch.tensor([[0.0], [1.0], [0.0]])
    g, lam = 0.9, 0.8
    adv, ret = compute_gae(r, v, nv, term, end, g, lam)
    d2 = 3.0 + 0.9 * 5.0 - 2.0  # 5.5; last step of the rollout: no A_{t+1}
    d1 = 2.0 + 0.9 * 4.0 - 1.0  # 4.6; bootstrapped, and the chain stops here
    d0 = 1.0 + 0.9 * 1.0 - 0.5  # 1.4
    a0 = d0 + 0.9 * 0.8 * d1  # 4.712
    assert adv[:, 0].tolist() == pytest.approx([a0, d1, d2])
    assert ret[:, 0].tolist() == pytest.approx([a0 + 0.5, d1 + 1.0, d2 + 2.0])


def test_gae_terminated_drops_the_bootstrap_and_handles_many_agents():
    r = torch.tensor([[1.0, 0.0]])
    v = torch.tensor([[0.0, 1.0]])
    nv = torch.tensor([[10.0, 10.0]])
    adv, _ = compute_gae(r, v, nv, torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]]), 0.5, 1.0)
    assert adv[0].tolist() == pytest.approx([1.0, 0.0 + 0.5 * 10.0 - 1.0])


def test_gae_lambda_one_is_the_discounted_return_minus_value():
    torch.manual_seed(0)
    r, v = torch.randn(6, 3), torch.randn(6, 3)
    nv = torch.cat([v[1:], torch.zeros(1, 3)])
    adv, ret = compute_gae(r, v, nv, torch.zeros(6, 3), torch.zeros(6, 3), 0.7, 1.0)
    disc = torch.zeros(3)
    expect = torch.zeros(6, 3)
    for t in range(5, -1, -1):
        disc = r[t] + 0.7 * disc
        expect[t] = disc
    assert torch.allclose(ret, expect, atol=1e-6)


# ------------------------------------------------------------------------------------------ loss


def test_ppo_loss_matches_hand_computation():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.9]))  # ratios 1.5, 0.5, 1.1, 0.9
    adv = torch.tensor([1.0, 1.0, -2.0, -2.0])
    # per sample max(-A r, -A clip(r, 0.8, 1.2)): -1.2, -0.5, 2.2, 1.8 -> mean 0.575
    nv, ov, ret = torch.tensor([1.0, 2.0, 0.0, 0.0]), torch.zeros(4), torch.tensor([0.0, 0.0, 1.0, 1.0])
    ent = torch.full((4,), 0.3)
    loss, st = ppo_loss(new, old, adv, nv, ov, ret, ent, clip_coef=0.2, vf_coef=0.5, ent_coef=0.1, clip_vloss=False)
    v_loss = 0.5 * (1 + 4 + 1 + 1) / 4  # 0.875
    assert st["pg_loss"] == pytest.approx(0.575)
    assert st["v_loss"] == pytest.approx(v_loss)
    assert float(loss) == pytest.approx(0.575 - 0.1 * 0.3 + 0.5 * v_loss)
    assert st["clipfrac"] == pytest.approx(0.5)  # 1.5 and 0.5 are outside [0.8, 1.2]
    k3 = [(r - 1) - math.log(r) for r in (1.5, 0.5, 1.1, 0.9)]
    assert st["approx_kl"] == pytest.approx(sum(k3) / 4, rel=1e-5)


def test_ppo_loss_value_clipping_takes_the_larger_error():
    z = torch.zeros(2)
    nv, ov, ret = torch.tensor([1.0, 0.1]), torch.zeros(2), torch.tensor([1.0, 1.0])
    _, st = ppo_loss(z, z, z, nv, ov, ret, z, clip_coef=0.2, vf_coef=1.0, ent_coef=0.0, clip_vloss=True)
    # sample 0: unclipped 0, clipped (0.2 - 1)^2 = 0.64; sample 1: both 0.81
    assert st["v_loss"] == pytest.approx(0.5 * (0.64 + 0.81) / 2)
    assert st["pg_loss"] == 0.0


def test_ppo_loss_gradient_only_inside_the_clip_range():
    adv = torch.tensor([1.0, 1.0])
    new = torch.log(torch.tensor([1.0, 1.5])).requires_grad_(True)
    loss, _ = ppo_loss(new, torch.zeros(2), adv, torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2),
                       clip_coef=0.2, vf_coef=0.0, ent_coef=0.0)
    loss.backward()
    assert new.grad.tolist() == pytest.approx([-0.5, 0.0])  # d(-A r / 2)/d logr = -A r / 2 = -0.5; clipped: 0


# ------------------------------------------------------------------------------------------ reward and guards


def test_reward_formula():
    cfg = RewardConfig(w_p99=1.0, w_over=4.0, w_slo_miss=1.0, w_miss_time=2.0, w_refill=3.0)
    s = stats(p99_ms=45.0, refill_bytes=2e8)  # x = 1.5; miss time (0.5*100*2 + 0.5*300*1) us = 250 us
    r, t = node_reward(s, cfg)
    m = 250.0 / 30_000.0
    lx = math.log(1.5)
    assert t == pytest.approx({"p99_over_slo": 1.5, "log_p99_over_slo": lx, "log_over_slo": lx, "slo_miss": 1.0,
                               "miss_time_over_slo": m, "refill_fraction": 0.2})
    assert r == pytest.approx(-(lx + 4 * lx + 1.0 + 2 * m + 3 * 0.2))
    r_ok, t_ok = node_reward(stats(p99_ms=15.0), cfg)  # under the SLO: the log is negative, no hinge, no miss
    assert t_ok["log_p99_over_slo"] == pytest.approx(math.log(0.5))
    assert t_ok["slo_miss"] == 0.0 and t_ok["log_over_slo"] == 0.0 and r_ok > r
    # scale-free: 10% lower P99 is worth the same at 6 ms as at 300 ms
    gain = lambda p: node_reward(stats(p99_ms=0.9 * p), cfg)[0] - node_reward(stats(p99_ms=p), cfg)[0]
    assert gain(6.0) == pytest.approx(-math.log(0.9))
    assert gain(300.0) == pytest.approx(-5 * math.log(0.9))  # over the SLO the log-hinge (w_over) adds its slope
    assert node_reward(stats(p99_ms=0.3), cfg)[1]["log_p99_over_slo"] == pytest.approx(math.log(0.1))  # floor
    r_idle, t_idle = node_reward(stats(num_requests=0, arrival_rate_rps=0.0, p99_ms=0.0), cfg)
    assert r_idle == 0.0 and t_idle["log_p99_over_slo"] == 0.0


def test_team_reward_is_the_request_weighted_mean():
    own = np.array([-1.0, -0.5, -0.2])
    n = np.array([100.0, 300.0, 0.0])
    team = (-1.0 * 100 - 0.5 * 300) / 400  # -0.625: the idle node does not count
    assert team_rewards(own, n, 1.0).tolist() == pytest.approx([team] * 3)
    assert team_rewards(own, n, 0.0).tolist() == pytest.approx(own.tolist())
    assert team_rewards(own, n, 0.5).tolist() == pytest.approx((0.5 * team + 0.5 * own).tolist())
    assert team_rewards(own, np.zeros(3), 1.0).tolist() == pytest.approx([own.mean()] * 3)
    with pytest.raises(ValueError, match="team_weight"):
        RewardConfig(team_weight=1.5).validate()


def test_guards_match_the_runtime(tmp_path):
    """`apply_guards` (training) against the runtime's own decisions: a real SmartAllocator (ONNX
    policy, residual and recovery off) with tight guards, on varied stats; each decision's value
    is `apply_guards` of its proposal and its previous split, and every guard binds somewhere."""
    from node_agent.allocator import AllocatorConfig, RecoveryConfig, ResidualConfig, SmartAllocator
    from policies.actor import make_initial_actor
    from policies.export import export_actor

    g = GuardConfig(min_emb_share=0.45, max_emb_share=0.6, max_step_up=0.04, max_step_down=0.08)
    rng = np.random.default_rng(0)
    actions = set()
    for bias in (-1.2, 0.8):  # one policy proposing mostly below the bounds, one mostly above
        actor = make_initial_actor(5, head_gain=4.0)
        with torch.no_grad():
            actor.head.bias.fill_(bias)
        export_actor(actor, tmp_path / str(bias))
        alloc = SmartAllocator(AllocatorConfig(guard=g, residual=ResidualConfig(enabled=False),
                                               recovery=RecoveryConfig(enabled=False), device="cpu"),
                               policy_dir=tmp_path / str(bias))
        for k in range(150):
            st = WindowStats(interval_s=1.0, num_requests=int(rng.integers(0, 500)),
                             arrival_rate_rps=float(rng.uniform(0, 3e3)), hot_user_ratio=float(rng.uniform()),
                             history_len_p50=50.0, history_len_p99=float(rng.uniform(50, 5e3)),
                             emb_lookups_per_request=float(rng.uniform(0, 2e3)), emb_hit_rate=float(rng.uniform()),
                             kv_hit_rate=float(rng.uniform()), kv_recompute_us_per_token=3.0,
                             emb_transfer_us_per_row=1.4, emb_share=0.5, load=float(rng.uniform()),
                             p99_ms=float(rng.uniform(0, 90)), slo_ms=30.0, refill_bytes=0.0, arena_bytes=1e9)
            d = alloc.decide(st, float(k))
            want = apply_guards(np.array([d.proposed_emb_share]), np.array([d.prev_emb_share]), g)[0]
            assert d.emb_share == want, (d.proposed_emb_share, d.prev_emb_share, d.emb_share, want)
            actions.add(d.guard_action)
    assert {"step_up", "step_down", "max", "min"} <= actions, actions
    # without the step limit (the env's default) only the bounds apply, as np.clip
    out = apply_guards(np.array([0.9, 0.1, 0.52]), np.array([0.5, 0.5, 0.5]), g, step_limit=False)
    assert out.tolist() == [0.6, 0.45, 0.52]


class SplitBandit:
    """A tiny setting with a known best split: every node's reward is ``-8 (a - 0.8)^2`` whatever
    it observes (random features in the feature box), episodes of 8 steps."""

    def __init__(self, num_agents: int = 2, seed: int = 0):
        self.num_agents = num_agents
        self.rng = np.random.default_rng(seed)
        self.t = 0
        self.rewards: list[float] = []
        self.actions: list[float] = []

    def _obs(self):
        from node_agent.features import FEATURE_HIGH, FEATURE_LOW

        u = self.rng.random((self.num_agents, NUM_FEATURES), dtype=np.float32)
        return (FEATURE_LOW + (FEATURE_HIGH - FEATURE_LOW) * u).astype(np.float32)

    def reset(self, seed=None, options=None):
        self.t = 0
        self.rewards, self.actions = [], []
        return self._obs(), {}

    def step(self, action):
        a = np.asarray(action, dtype=np.float64)
        r = (-8.0 * (a - 0.8) ** 2).astype(np.float32)
        self.t += 1
        self.rewards.append(float(r.mean()))
        self.actions.append(float(a.mean()))
        info = {}
        trunc = self.t >= 8
        if trunc:
            info["episode"] = {"trace": "bandit", "regime": "steady", "stream_seed": 0, "rate_rps": 0.0,
                               "initial_share": 0.5, "mean_reward": float(np.mean(self.rewards)),
                               "mean_target_share": float(np.mean(self.actions)), "p99_ms": 0.0,
                               "slo_attainment": 1.0, "mean_share": float(np.mean(self.actions))}
        return self._obs(), r, False, trunc, info

    def close(self):
        pass


def test_ppo_moves_toward_the_known_best_split(tmp_path):
    args = Args(**TINY, regimes=("steady",), seed=2, out=str(tmp_path), total_steps=480, num_steps=32,
                update_epochs=4, num_minibatches=2, progress=False, eval_static_shares=())
    probe = SplitBandit(seed=9)._obs()

    def mean_action(actor) -> float:
        with torch.no_grad():
            return float(torch.sigmoid(actor.logit(torch.from_numpy(probe))).mean())

    from policies.actor import ActorConfig, make_initial_actor

    before = mean_action(make_initial_actor(args.seed, ActorConfig(hidden_sizes=tuple(args.hidden_sizes),
                                                                   init_log_std=args.init_log_std)))
    train(args, env=SplitBandit(seed=1))
    after = mean_action(load_checkpoint(tmp_path / "actor.pt").actor)
    assert abs(before - 0.5) < 0.1  # the initial actor proposes about 0.5
    assert abs(after - 0.8) < abs(before - 0.8) - 0.1, (before, after)  # and training moved it toward 0.8
    curve = json.loads((tmp_path / "curve.json").read_text())
    rewards = [r["rollout_reward"] for r in curve["updates"]]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3])


# ------------------------------------------------------------------------------------------ environment


def test_env_reset_and_step_shapes_and_episode_length():
    env = AllocatorEnv(EnvConfig(**TINY))
    obs, info = env.reset(seed=3)
    assert obs.shape == (2, NUM_FEATURES) and obs.dtype == np.float32
    assert info["regime"] in ("steady", "trend", "burst") and info["now_s"] == pytest.approx(1.0)
    assert np.all(obs[:, 14:16] == 0)  # no previous interval on the first observation: the deltas are 0
    steps = 0
    while True:
        obs, reward, term, trunc, info = env.step(np.array([0.9, 0.1]))
        steps += 1
        assert obs.shape == (2, NUM_FEATURES) and reward.shape == (2,) and reward.dtype == np.float32
        assert np.all(np.isfinite(obs)) and np.all(np.isfinite(reward))
        assert reward[0] == reward[1]  # the team reward (team_weight 1)
        own, n = info["reward_terms"]["own_reward"], [st.num_requests for st in info["stats"]]
        assert reward[0] == pytest.approx(np.dot(own, n) / sum(n), rel=1e-6)
        assert term is False
        if trunc:
            break
    assert steps == 3  # 5 windows of 1 s: observations at t = 1..4, the last window runs under the held split
    assert info["targets"].tolist() == pytest.approx([0.9, 0.1])  # within the bounds: applied as they are
    ep = info["episode"]
    assert ep["steps"] == 3 and ep["p99_ms"] > 0 and 0 <= ep["slo_attainment"] <= 1
    with pytest.raises(RuntimeError):
        env.step(np.array([0.5, 0.5]))
    with pytest.raises(ValueError):
        env.reset(seed=3)
        env.step(np.array([0.5, 1.5]))


def test_env_step_limit_applies_the_runtime_guards():
    env = AllocatorEnv(EnvConfig(**TINY, step_limit=True))
    _, info = env.reset(seed=3, options={"initial_share": 0.5})
    targets = []
    for a in ([1.0, 0.0], [1.0, 0.0], [0.52, 0.45]):
        _, _, _, _, step = env.step(np.array(a))
        targets.append(step["targets"].tolist())
    # +0.05 / -0.1 per decision from the previous one, then the bounds [0.05, 0.95]
    assert targets == [pytest.approx([0.55, 0.4]), pytest.approx([0.6, 0.3]), pytest.approx([0.52, 0.35])]


def test_env_is_deterministic_per_seed():
    def rollout(seed):
        env = AllocatorEnv(EnvConfig(**TINY))
        obs, info = env.reset(seed=seed)
        out = [obs]
        rewards = []
        for a in ([0.7, 0.3], [0.2, 0.8]):
            obs, r, _, _, _ = env.step(np.array(a))
            out.append(obs)
            rewards.append(r)
        return info["stream_seed"], np.stack(out), np.stack(rewards)

    s1, o1, r1 = rollout(5)
    s2, o2, r2 = rollout(5)
    s3, o3, _ = rollout(6)
    assert s1 == s2 and np.array_equal(o1, o2) and np.array_equal(r1, r2)
    assert s1 != s3


def test_env_options_fix_the_episode():
    env = AllocatorEnv(EnvConfig(**TINY))
    obs, info = env.reset(seed=0, options={"regime": "burst", "initial_share": 0.3, "stream_seed": 11})
    assert (info["regime"], info["initial_share"], info["stream_seed"]) == ("burst", 0.3, 11)
    assert obs[:, 10] == pytest.approx([0.3, 0.3])  # the split in effect during the first interval
    with pytest.raises(ValueError, match="unknown reset options"):
        env.reset(options={"nodes": 3})
    with pytest.raises(ValueError, match="invalid EnvConfig"):
        EnvConfig(traces=("nope",)).validate()


# ------------------------------------------------------------------------------------------ smoke run + export


def test_training_smoke_run_writes_a_checkpoint_that_exports(tmp_path, capsys):
    from racer.cli import main

    run = tmp_path / "run"
    rc = main(["policy", "train", "--trace", "synthetic", "--regimes", "steady,burst", "--nodes", "2", "--rate", "200",
               "--rate-spread", "0", "--duration", "5", "--users", "300",
               "--history-scale", "1", "--cache-fraction", "0.5", "--total-steps", "6", "--num-steps", "3",
               "--update-epochs", "2", "--num-minibatches", "2", "--seed", "0", "--eval-static-shares", "0.5",
               "--out", str(run), "--no-progress", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["checkpoint"] == str(run / "actor.pt")
    for f in ("actor.pt", "curve.json", "curve.csv", "curve.png", "evaluation.json"):
        assert (run / f).is_file(), f
    curve = json.loads((run / "curve.json").read_text())
    assert [r["update"] for r in curve["updates"]] == [1, 2]
    assert curve["updates"][-1]["global_step"] == 6 and len(curve["episodes"]) == 2
    ckpt = load_checkpoint(run / "actor.pt")
    assert ckpt.training_config["args"]["total_steps"] == 6
    assert ckpt.training_config["env"]["traces"] == ["synthetic"]
    ev = ckpt.evaluation
    assert set(ev["by_regime"]) == {"steady", "burst"}
    assert set(ev["by_regime"]["steady"]) == {"policy", "static:0.50"}
    assert summary["evaluation"]["num_updates"] == 2
    manifest = export_checkpoint(run / "actor.pt", tmp_path / "artifact")
    assert manifest["parity"]["passed"] and manifest["parity"]["max_abs_diff"] <= 1e-5
    assert manifest["evaluation"]["by_regime"] == ev["by_regime"]
    assert verify_artifact(tmp_path / "artifact")["policy_id"] == manifest["policy_id"]


def test_training_is_reproducible_for_a_seed(tmp_path):
    def run(out):
        args = Args(**TINY, regimes=("steady",), seed=4, out=str(out), total_steps=4, num_steps=2, update_epochs=1,
                    num_minibatches=1, progress=False, eval_static_shares=())
        train(args)
        return load_checkpoint(out / "actor.pt").actor.state_dict()

    a, b = run(tmp_path / "a"), run(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
