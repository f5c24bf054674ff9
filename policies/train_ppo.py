"""PPO for the SmartAllocator's base policy, in one file (CleanRL ``ppo_continuous_action.py`` style).

    racer policy train --total-steps 6000 --out out/ppo --seed 1
    python -m policies.train_ppo --total-steps 6000 --out out/ppo      # the same

Environment: `policies.env.AllocatorEnv`, one step = one control interval of the simulated
cluster; every node is an agent sharing the policy (so a rollout of ``num_steps`` steps holds
``num_steps * num_nodes`` transitions). Actor: `policies.actor.Actor`: PPO samples the logit
``z' ~ Normal(mlp(x), exp(log_std))`` and the environment receives ``sigmoid(z')``, the target
emb_share. Critic: centralised, as in MAPPO (Yu et al., "The Surprising Effectiveness of PPO in
Cooperative Multi-Agent Games", NeurIPS 2022): a separate MLP of the node's features and the
cluster's mean features (`critic_input`). The reward is a team reward (`policies.env.RewardConfig`),
so the critic must see the cluster to predict it; the actor, which is exported and runs on one
node, sees only that node's features.

The loop is flat: collect a rollout (`collect_rollout`: auto-reset at episode ends,
bootstrapping the truncated episode's final observation), `compute_gae` (`rollout_advantages`),
then ``update_epochs`` passes of minibatch SGD on `ppo_loss` (`ppo_update`). Everything is
seeded (``seed``: the actor's and critic's init, the action noise, the episodes); torch runs on
one thread. Outputs in ``out``: ``actor.pt`` (`policies.actor`'s checkpoint format, with the
training config and the evaluation figures inside), ``curve.json`` and ``curve.csv`` (one row per
update), ``curve.png`` (the learning curve), ``evaluation.json``.

Imitation warm start (``bc_episodes > 0`` or ``bc_data``, `policies.imitation`): before PPO the
actor is cloned from the simulator's replay oracle on that many episodes (drawn like the
environment's, from ``bc_seed``; or on samples collected beforehand, possibly on a larger cluster,
by ``python -m policies.imitation``), and every PPO minibatch keeps ``bc_coef`` x the clone loss
on those samples, so PPO refines the oracle's behaviour against the reward rather than
rediscovering it by trial and error. The figures of the cloning go to ``imitation.json`` and into
the evaluation.

Evaluation (after training): the mean action (what the ONNX artifact runs) on held-out episodes,
one per (trace, regime), each starting at emb_share 0.5 as the paper table's runs do, beside the
static splits ``eval_static_shares`` on the same streams: mean reward, P99, SLO attainment and the
mean emb_share per regime. With ``settings`` (``--settings calibration+paper-scale``: one setting
drawn per episode, `policies.env.parse_settings`) the held-out episodes are one per (setting,
regime), at the setting's own rate, and ``by_setting`` gives the figures per setting.

Warm start from a policy artifact (``init_policy``, ``--init-policy policies/default``): the
actor starts from the artifact's weights (`load_policy_weights`, checked against its golden
outputs) instead of a fresh initialisation.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from torch import nn

from common.config import ranged, require
from common.config import validate as validate_fields

from .actor import Actor, ActorConfig, make_initial_actor, save_checkpoint
from .env import AllocatorEnv, EnvConfig, parse_settings
from node_agent.features import NUM_FEATURES


@dataclass
class Args:
    # run
    seed: int = 1
    out: str = "out/ppo"
    total_steps: int = ranged(6_000, lo=0, integer=True)  # control intervals simulated for training (each gives num_nodes transitions)
    progress: bool = True
    torch_threads: int = ranged(1, lo=1, integer=True)
    # environment (policies.env.EnvConfig.like_table: None = the paper table's value, per node)
    traces: tuple[str, ...] = ("taobao", "amazon")
    regimes: tuple[str, ...] = ("steady", "trend", "burst")
    num_nodes: int = 4
    rate_rps: float | None = None  # cluster-wide; None: the table's rate_rps * num_nodes / its num_nodes
    rate_spread: float = 0.5
    duration_s: float = 20.0
    num_users: int | None = None  # None: the table's num_users * num_nodes / its num_nodes
    history_scale: float | None = None
    cache_fraction: float | None = None
    slo_ms: float | None = None
    profile: str | None = None
    # settings drawn per episode (`policies.env.parse_settings`: "calibration+paper-scale", ...;
    # None: the one setting above)
    settings: str | None = None
    # warm start: a policy artifact directory whose actor weights PPO starts from (None: a fresh actor)
    init_policy: str | None = None
    # PPO
    num_steps: int = ranged(36, lo=1, integer=True)  # env steps per rollout (two 18-step episodes of 20 s)
    learning_rate: float = ranged(1e-3, lo=0, lo_open=True)
    anneal_lr: bool = True
    gamma: float = ranged(0.5, lo=0, hi=1)
    gae_lambda: float = ranged(0.8, lo=0, hi=1)
    update_epochs: int = ranged(10, lo=1, integer=True)
    num_minibatches: int = ranged(4, lo=1, integer=True)
    norm_adv: bool = True
    clip_coef: float = ranged(0.2, lo=0, lo_open=True)
    clip_vloss: bool = False  # value clipping at clip_coef would stall a critic whose returns are O(1)
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = 0.05
    reward_scale: float = ranged(1.0, lo=0, lo_open=True)  # rewards are multiplied by this before GAE (the curve reports unscaled)
    # networks
    hidden_sizes: tuple[int, ...] = (64, 64)
    init_log_std: float = 0.0
    # imitation warm start (policies.imitation): clone the replay oracle before PPO
    bc_episodes: int = ranged(0, lo=0, integer=True)  # oracle-replayed episodes to clone (0: PPO from a random actor)
    bc_shares: tuple[float, ...] = ranged((0.1, 0.3, 0.5, 0.7, 0.9), lo=0, hi=1, length=(1, None))  # the oracle's grid (the paper table's)
    bc_epochs: int = ranged(200, lo=1, integer=True)
    bc_lr: float = ranged(3e-3, lo=0, lo_open=True)
    bc_coef: float = ranged(1.0, lo=0)  # weight of the clone loss kept in every PPO minibatch (0: none)
    bc_seed: int = 20_000  # seed of the oracle's episodes (apart from PPO's and the evaluation's)
    bc_data: tuple[str, ...] = ()  # .npz files of `python -m policies.imitation` instead of collecting here
    # evaluation
    eval_seed: int = 10_000
    eval_static_shares: tuple[float, ...] = ranged((0.5, 0.9), lo=0, hi=1, length=(0, None))
    evaluate: bool = True  # False: no held-out evaluation (judge the export with `python -m bench.regret --policy`)

    def validate(self) -> "Args":
        validate_fields(self, "PPO Args")
        require(self, self.total_steps >= 1 or bool(self.bc_episodes or self.bc_data),
                f"total_steps must be an integer >= 1 (0 only with --bc-data or --bc-episodes: clone without PPO), "
                f"got {self.total_steps!r}", "PPO Args")
        require(self, self.num_steps * self.num_nodes >= self.num_minibatches,
                "num_steps * num_nodes must be at least num_minibatches", "PPO Args")
        if self.settings is not None:
            try:
                parse_settings(self.settings)
            except ValueError as e:
                raise ValueError(f"invalid PPO Args: {e}") from None
        return self

    def env_config(self) -> EnvConfig:
        """`EnvConfig.like_table` with every field given here (not None) replacing the table's."""
        kw = {k: getattr(self, k) for k in ("rate_rps", "num_users", "history_scale", "cache_fraction", "slo_ms",
                                             "profile") if getattr(self, k) is not None}
        if self.settings is not None:
            kw["settings"] = parse_settings(self.settings)
        return EnvConfig.like_table(num_nodes=self.num_nodes, traces=tuple(self.traces), regimes=tuple(self.regimes),
                                    rate_spread=self.rate_spread, duration_s=self.duration_s, **kw).validate()

    def to_dict(self) -> dict:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d


# --------------------------------------------------------------------------------------------- pure parts


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor, terminated: torch.Tensor,
                episode_end: torch.Tensor, gamma: float, gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over a rollout; tensors are [T, ...] (time first).

    ``next_values[t]`` is the value of the observation after step ``t`` (for the last step of an
    episode: its final observation, so truncated episodes are bootstrapped); ``terminated[t]``
    zeroes that bootstrap (a true terminal state); ``episode_end[t]`` (terminated or truncated)
    stops the advantage from flowing back across the reset:

        delta_t = r_t + gamma * (1 - terminated_t) * next_values_t - values_t
        A_t     = delta_t + gamma * lambda * (1 - episode_end_t) * A_{t+1},   A_T = 0

    Returns ``(advantages, returns = advantages + values)``.
    """
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[0])
    for t in range(rewards.shape[0] - 1, -1, -1):
        delta = rewards[t] + gamma * (1.0 - terminated[t]) * next_values[t] - values[t]
        last = delta + gamma * gae_lambda * (1.0 - episode_end[t]) * last
        adv[t] = last
    return adv, adv + values


def ppo_loss(new_logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
             new_values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, entropy: torch.Tensor, *,
             clip_coef: float, vf_coef: float, ent_coef: float, clip_vloss: bool = True
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped objective (to minimise) and its diagnostics.

        ratio   = exp(new_logprob - old_logprob)
        pg_loss = mean(max(-A * ratio, -A * clip(ratio, 1 - c, 1 + c)))
        v_loss  = 0.5 * mean(max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2))   (clip_vloss)
                  0.5 * mean((V - R)^2)                                                 (otherwise)
        loss    = pg_loss - ent_coef * mean(entropy) + vf_coef * v_loss

    Diagnostics: ``approx_kl`` = mean((ratio - 1) - log ratio) (Schulman's k3 estimator) and
    ``clipfrac`` = share of |ratio - 1| > c.
    """
    logratio = new_logprob - old_logprob
    ratio = logratio.exp()
    pg_loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
    if clip_vloss:
        v_clipped = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
        v_loss = 0.5 * torch.max((new_values - returns) ** 2, (v_clipped - returns) ** 2).mean()
    else:
        v_loss = 0.5 * ((new_values - returns) ** 2).mean()
    ent = entropy.mean()
    loss = pg_loss - ent_coef * ent + vf_coef * v_loss
    with torch.no_grad():
        stats = {"pg_loss": float(pg_loss), "v_loss": float(v_loss), "entropy": float(ent),
                 "approx_kl": float(((ratio - 1) - logratio).mean()),
                 "clipfrac": float(((ratio - 1.0).abs() > clip_coef).float().mean())}
    return loss, stats


def explained_variance(pred: np.ndarray, target: np.ndarray) -> float:
    var = float(np.var(target))
    return float("nan") if var == 0 else 1.0 - float(np.var(target - pred)) / var


# --------------------------------------------------------------------------------------------- networks


def critic_input(obs: torch.Tensor) -> torch.Tensor:
    """The centralised critic's input: each node's features beside the cluster's mean features,
    ``[nodes, F] -> [nodes, 2F]`` (``[T, nodes, F] -> [T, nodes, 2F]``)."""
    mean = obs.mean(dim=-2, keepdim=True).expand_as(obs)
    return torch.cat([obs, mean], dim=-1)


class Critic(nn.Module):
    """critic_input [batch, 2 * NUM_FEATURES] -> value [batch]; CleanRL's init (orthogonal, head gain 1)."""

    def __init__(self, hidden_sizes: tuple[int, ...], generator: torch.Generator):
        super().__init__()
        layers: list[nn.Module] = []
        width = 2 * NUM_FEATURES
        for h in hidden_sizes:
            lin = nn.Linear(width, h)
            nn.init.orthogonal_(lin.weight, gain=math.sqrt(2), generator=generator)
            nn.init.zeros_(lin.bias)
            layers += [lin, nn.Tanh()]
            width = h
        head = nn.Linear(width, 1)
        nn.init.orthogonal_(head.weight, gain=1.0, generator=generator)
        nn.init.zeros_(head.bias)
        self.net = nn.Sequential(*layers, head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


# --------------------------------------------------------------------------------------------- evaluation


def run_episode(env: AllocatorEnv, policy, options: dict) -> dict:
    """One episode with ``policy(obs [nodes, F]) -> actions [nodes]``; the episode's summary."""
    obs, _ = env.reset(options=options)
    while True:
        obs, _, term, trunc, info = env.step(policy(obs))
        if term or trunc:
            return info["episode"]


def evaluate(actor: Actor, env_cfg: EnvConfig, *, seed: int, static_shares: tuple[float, ...] = (),
             progress: bool = False) -> dict:
    """The mean action on one held-out episode per (trace, regime), beside static splits on the
    same streams. Every run starts at emb_share 0.5 (the table's start for adaptive allocators;
    a static split starts at its own value)."""
    from tqdm import tqdm

    env = AllocatorEnv(env_cfg)
    rng = np.random.default_rng(seed)
    if env_cfg.settings:  # one episode per (setting, regime), the trace drawn from the setting's
        cases = []
        for k, st in enumerate(env_cfg.settings):
            traces = env_cfg.setting_traces(st)
            for r in env_cfg.regimes:
                cases.append((traces[int(rng.integers(len(traces)))], r, int(rng.integers(2**31 - 1)), k))
    else:
        cases = [(t, r, int(rng.integers(2**31 - 1)), None) for t in env_cfg.traces for r in env_cfg.regimes]
    runs = ["policy"] + [f"static:{s:.2f}" for s in static_shares]
    bar = tqdm(total=len(cases) * len(runs), desc="evaluate", unit="episode", disable=not progress, leave=False)

    def mean_action(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return actor(torch.from_numpy(obs)).squeeze(-1).double().numpy()

    out: dict = {"episodes": []}
    for trace, regime, stream_seed, k in cases:
        opts = {"trace": trace, "regime": regime, "stream_seed": stream_seed, "rate_rps": env_cfg.rate_rps}
        if k is not None:  # the setting's own rate (the centre of its drawn range)
            opts.update(setting=k, rate_rps=env.setting_load(env_cfg.settings[k])[0])
        for name in runs:
            if name == "policy":
                ep = run_episode(env, mean_action, {**opts, "initial_share": 0.5})
            else:
                s = float(name.split(":")[1])
                ep = run_episode(env, lambda obs, s=s: np.full(len(obs), s), {**opts, "initial_share": s})
            bar.update(1)
            out["episodes"].append({"allocator": name, **{k: ep[k] for k in (
                "trace", "regime", "stream_seed", "rate_rps", "setting_name", "mean_reward", "p99_ms", "p50_ms",
                "slo_attainment", "mean_share", "emb_hit_rate", "kv_hit_rate")}})
    bar.close()
    env.close()
    by_regime = {}
    for regime in env_cfg.regimes:
        eps = [e for e in out["episodes"] if e["regime"] == regime]
        row = {}
        for name in runs:
            mine = [e for e in eps if e["allocator"] == name]
            row[name] = {k: round(float(np.mean([e[k] for e in mine])), 5)
                         for k in ("mean_reward", "p99_ms", "slo_attainment", "mean_share")}
        by_regime[regime] = row
    out["by_regime"] = by_regime
    pol = [e for e in out["episodes"] if e["allocator"] == "policy"]
    out["policy_mean_reward"] = round(float(np.mean([e["mean_reward"] for e in pol])), 5)
    out["policy_mean_share_by_regime"] = {r: by_regime[r]["policy"]["mean_share"] for r in env_cfg.regimes}
    if env_cfg.settings:  # per setting and run (policy, each static split): reward, P99 and share, mean over regimes
        by_setting = {}
        for st in env_cfg.settings:
            eps = [e for e in out["episodes"] if e["setting_name"] == st.name]
            row = {name: {k: round(float(np.mean([e[k] for e in eps if e["allocator"] == name])), 5)
                          for k in ("mean_reward", "p99_ms", "mean_share")} for name in runs}
            by_setting[st.name] = row
        out["by_setting"] = by_setting
    return out


def load_policy_weights(actor: Actor, artifact_dir) -> dict:
    """Start ``actor`` from a policy artifact (`racer policy export`): its ONNX initialisers are
    the actor's own parameters (``body.*``, ``head.*``; the exploration ``log_std`` keeps its
    initial value). The artifact is verified first (`policies.export.verify_artifact`: manifest,
    checksum, checker, parity), then the loaded actor's shares are checked against onnxruntime's
    on the artifact's golden inputs (the outputs stored with them). Returns the policy id and that
    check's max difference.

    An artifact of an older feature schema whose features are this schema's first ``N``
    (`node_agent.features.SCHEMA_PREFIX`: schema 2's 16) is **widened**: its first layer gets
    zero weights for the features it never saw, so the actor is that policy exactly (it ignores
    the new features until training moves those weights). Checked the same way, on the golden
    inputs with the new features filled with uniform draws of their range (``widened_from``)."""
    import onnx
    from onnx import numpy_helper

    from node_agent.artifact import read_golden
    from node_agent.features import FEATURE_HIGH, FEATURE_LOW, SCHEMA_PREFIX

    from .export import verify_artifact

    d = Path(artifact_dir)
    old_schema = artifact_schema(d)
    if old_schema in SCHEMA_PREFIX:
        manifest, data, golden = read_older_artifact(d, old_schema)
    else:
        manifest = verify_artifact(d)
        data = (d / manifest["onnx_file"]).read_bytes()
        golden = None
    cfg = manifest.get("actor_config", {})
    if tuple(cfg.get("hidden_sizes", ())) != tuple(actor.config.hidden_sizes) or cfg.get("activation") != actor.config.activation:
        raise ValueError(f"{d}: its actor ({cfg.get('hidden_sizes')}, {cfg.get('activation')}) is not this run's "
                         f"({list(actor.config.hidden_sizes)}, {actor.config.activation}); set --hidden-sizes to match")
    weights = {i.name: torch.from_numpy(numpy_helper.to_array(i).copy()) for i in onnx.load_from_string(data).graph.initializer}
    state = actor.state_dict()
    want = {k for k in state if k != "log_std"}
    if set(weights) != want:
        raise ValueError(f"{d}: initialisers {sorted(weights)} are not the actor's parameters {sorted(want)}")
    first = "body.0.weight"
    if golden is not None:  # widen: zero weights for the features the older schema lacks
        w = weights[first]
        if w.shape[1] != SCHEMA_PREFIX[old_schema]:
            raise ValueError(f"{d}: {first} takes {w.shape[1]} features, schema {old_schema} has {SCHEMA_PREFIX[old_schema]}")
        weights[first] = torch.cat([w, torch.zeros(w.shape[0], state[first].shape[1] - w.shape[1], dtype=w.dtype)], 1)
    for k, v in weights.items():
        if tuple(v.shape) != tuple(state[k].shape):
            raise ValueError(f"{d}: {k} has shape {tuple(v.shape)}, the actor's is {tuple(state[k].shape)}")
        state[k] = v.to(state[k].dtype)
    actor.load_state_dict(state)
    if golden is None:
        X, golden_y = read_golden(d, manifest)  # the artifact's inputs and its ONNX outputs on them
    else:
        X, golden_y = golden
        n = X.shape[1]
        rng = np.random.default_rng(0)
        extra = FEATURE_LOW[n:] + (FEATURE_HIGH[n:] - FEATURE_LOW[n:]) * rng.random((len(X), len(FEATURE_LOW) - n))
        X = np.concatenate([X, extra], 1)
    X, ort_y = X.astype(np.float32), golden_y.reshape(-1).astype(np.float64)
    with torch.no_grad():
        torch_y = actor(torch.from_numpy(X)).reshape(-1).double().numpy()
    diff = float(np.max(np.abs(torch_y - ort_y)))
    if diff > 1e-5:
        raise ValueError(f"{d}: the loaded actor differs from the artifact by {diff:.2e} on its golden inputs")
    out = {"policy_id": manifest["policy_id"], "artifact": str(d), "golden_max_abs_diff": diff}
    if golden is not None:
        out["widened_from"] = {"feature_schema_version": old_schema, "num_features": SCHEMA_PREFIX[old_schema]}
    return out


def artifact_schema(d: Path):
    """The feature schema an artifact's manifest names (None when unreadable: `verify_artifact`
    then says why)."""
    import json

    try:
        v = json.loads((d / "manifest.json").read_text()).get("feature_schema_version")
    except (OSError, ValueError, AttributeError):
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def read_older_artifact(d: Path, schema: int):
    """Manifest, ONNX bytes and golden ``(inputs, outputs)`` of an artifact of an older schema whose
    features are this schema's first ``SCHEMA_PREFIX[schema]``: the runtime's manifest checks
    against that schema (its names must be this schema's first ones), the files' sha256, and
    onnxruntime's outputs on the golden inputs."""
    import json

    from node_agent.artifact import ArtifactError, check_manifest, read_golden, read_onnx_bytes
    from node_agent.features import FEATURE_NAMES, SCHEMA_PREFIX

    from .export import _ort_cpu_outputs

    manifest = json.loads((d / "manifest.json").read_text())
    n = SCHEMA_PREFIX[schema]
    problems = check_manifest(manifest, schema=schema, feature_names=FEATURE_NAMES[:n])
    cfg = manifest.get("actor_config") if isinstance(manifest, dict) else None
    if not (isinstance(cfg, dict) and isinstance(cfg.get("hidden_sizes"), list)
            and all(isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in cfg["hidden_sizes"])):
        problems.append(f"actor_config.hidden_sizes must be a list of positive integers, got {cfg!r}")
    if problems:
        raise ArtifactError(f"{d / 'manifest.json'}: " + "; ".join(problems))
    data = read_onnx_bytes(d, manifest)
    X, y = read_golden(d, manifest, n)
    if float(np.max(np.abs(_ort_cpu_outputs(data, X) - y))) > 1e-5:
        raise ArtifactError(f"{d}: its ONNX model does not reproduce its golden outputs on {n} features")
    return manifest, data, (X, y)


# --------------------------------------------------------------------------------------------- outputs


def training_progress(episodes: list[dict]) -> dict:
    """Per regime: the mean training-episode reward of the first and the last fifth of that
    regime's episodes, and the mean sampled target share of each (regimes differ too much in
    reward for one pooled figure to mean anything)."""
    out = {}
    for regime in sorted({e["regime"] for e in episodes}):
        eps = [e for e in episodes if e["regime"] == regime]
        k = max(1, len(eps) // 5)
        out[regime] = {"episodes": len(eps),
                       "reward_first_fifth": round(float(np.mean([e["mean_reward"] for e in eps[:k]])), 5),
                       "reward_last_fifth": round(float(np.mean([e["mean_reward"] for e in eps[-k:]])), 5),
                       "share_first_fifth": round(float(np.mean([e["mean_target_share"] for e in eps[:k]])), 4),
                       "share_last_fifth": round(float(np.mean([e["mean_target_share"] for e in eps[-k:]])), 4)}
    return out



CURVE_KEYS = ("update", "global_step", "transitions", "episodes", "episode_reward", "rollout_reward", "mean_action",
              "action_std", "learning_rate", "pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac",
              "clone_loss", "explained_variance", "wall_s")


def write_curve(rows: list[dict], episodes: list[dict], out: Path, plot: bool = True) -> dict:
    """curve.json (updates and episodes), curve.csv (updates) and, with ``plot``, curve.png; returns
    the paths."""

    (out / "curve.json").write_text(json.dumps({"updates": rows, "episodes": episodes}, indent=1))
    with open(out / "curve.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CURVE_KEYS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in CURVE_KEYS})
    paths = {"json": str(out / "curve.json"), "csv": str(out / "curve.csv")}
    if not plot:
        return paths
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"steady": "tab:blue", "trend": "tab:orange", "burst": "tab:red"}
    for regime in sorted({e["regime"] for e in episodes}):
        pts = [(e["global_step"], e["mean_reward"]) for e in episodes if e["regime"] == regime]
        xs, ys = zip(*pts)
        axes[0].scatter(xs, ys, s=12, alpha=0.5, color=colors.get(regime), label=regime)
        if len(ys) >= 3:
            k = min(5, len(ys))
            axes[0].plot(xs[k - 1:], np.convolve(ys, np.ones(k) / k, mode="valid"), color=colors.get(regime))
    all_r = np.array([e["mean_reward"] for e in episodes])
    if len(all_r):
        lo, hi = float(np.percentile(all_r, 5)), float(all_r.max())
        pad = 0.25 * (hi - lo) + 1e-3
        axes[0].set_ylim(lo - pad, hi + pad)  # a few burst episodes far below would flatten the rest
    axes[0].set_title("episode mean reward per node-step (training; 5th pct and up)")
    axes[0].set_xlabel("control intervals")
    axes[0].legend(fontsize=8)
    steps = [r["global_step"] for r in rows]
    axes[1].plot(steps, [r["mean_action"] for r in rows], label="mean target emb_share")
    axes[1].plot(steps, [r["action_std"] for r in rows], label="logit std")
    axes[1].set_title("actions")
    axes[1].set_xlabel("control intervals")
    axes[1].legend(fontsize=8)
    axes[2].plot(steps, [r["approx_kl"] for r in rows], label="approx KL")
    axes[2].plot(steps, [r["clipfrac"] for r in rows], label="clip fraction")
    axes[2].plot(steps, [r["explained_variance"] for r in rows], label="explained variance")
    axes[2].set_ylim(-1.0, 1.0)
    axes[2].set_title("PPO diagnostics (clipped to [-1, 1])")
    axes[2].set_xlabel("control intervals")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=90)
    plt.close(fig)
    return {**paths, "png": str(out / "curve.png")}


# --------------------------------------------------------------------------------------------- training


@dataclass
class RolloutBuffers:
    """One rollout's tensors, time first: ``[T, nodes, ...]`` per transition, ``terminated`` and
    ``episode_end`` ``[T]`` (the environment's episode is the cluster's). Allocated once, refilled
    by every rollout."""

    obs: torch.Tensor
    critic_obs: torch.Tensor
    z: torch.Tensor
    logprob: torch.Tensor
    reward: torch.Tensor
    value: torch.Tensor
    next_value: torch.Tensor
    terminated: torch.Tensor
    episode_end: torch.Tensor

    @classmethod
    def zeros(cls, T: int, n: int) -> "RolloutBuffers":
        return cls(obs=torch.zeros((T, n, NUM_FEATURES)), critic_obs=torch.zeros((T, n, 2 * NUM_FEATURES)),
                   z=torch.zeros((T, n)), logprob=torch.zeros((T, n)), reward=torch.zeros((T, n)),
                   value=torch.zeros((T, n)), next_value=torch.zeros((T, n)), terminated=torch.zeros(T),
                   episode_end=torch.zeros(T))


EPISODE_KEYS = ("global_step", "trace", "regime", "stream_seed", "rate_rps", "initial_share", "mean_reward",
                "mean_target_share", "p99_ms", "slo_attainment", "mean_share")


def collect_rollout(env, actor: Actor, critic: Critic, obs: torch.Tensor, buf: RolloutBuffers, gen: torch.Generator,
                    *, reward_scale: float, global_step: int, episodes: list[dict], bar
                    ) -> tuple[torch.Tensor, int, list[dict]]:
    """Fill ``buf`` with one rollout from ``obs``: the logit sampled with ``gen``'s noise, rewards
    times ``reward_scale``, an episode's end bootstrapped from its final observation and followed
    by a reset. Each finished episode's summary is appended to ``episodes``. Returns (the
    observation after the last step, the global step, the episodes this rollout finished)."""
    done_eps: list[dict] = []
    for t in range(buf.z.shape[0]):
        buf.obs[t] = obs
        with torch.no_grad():
            mean = actor.logit(obs).squeeze(-1)
            std = actor.log_std.exp()
            z = mean + std * torch.randn(mean.shape, generator=gen)
            buf.logprob[t] = torch.distributions.Normal(mean, std).log_prob(z)
            buf.critic_obs[t] = critic_input(obs)
            buf.value[t] = critic(buf.critic_obs[t])
        buf.z[t] = z
        action = torch.sigmoid(z).double().numpy()
        next_np, reward, term, trunc, info = env.step(action)
        global_step += 1
        buf.reward[t] = torch.from_numpy(reward) * reward_scale
        buf.terminated[t] = float(term)
        buf.episode_end[t] = float(term or trunc)
        next_obs = torch.from_numpy(next_np)
        if term or trunc:
            with torch.no_grad():
                buf.next_value[t] = critic(critic_input(next_obs))  # bootstrap the final observation (zeroed if terminated)
            ep = info["episode"]
            ep["global_step"] = global_step
            done_eps.append(ep)
            episodes.append({k: ep[k] for k in EPISODE_KEYS} | {"setting_name": ep.get("setting_name", "sample")})
            next_np, _ = env.reset()
            next_obs = torch.from_numpy(next_np)
        obs = next_obs
        bar.update(1)
    return obs, global_step, done_eps


def rollout_advantages(buf: RolloutBuffers, critic: Critic, obs: torch.Tensor, gamma: float, gae_lambda: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_gae` over the rollout in ``buf``, once the steps inside an episode have their
    ``next_value``: the value of the next step's observation (after the last step: of ``obs``)."""
    T, n = buf.value.shape
    with torch.no_grad():
        last_val = critic(critic_input(obs))
    # next_values[t] = V(obs after step t): values[t + 1] inside an episode
    for t in range(T):
        if buf.episode_end[t] == 0:
            buf.next_value[t] = buf.value[t + 1] if t + 1 < T else last_val
    return compute_gae(buf.reward, buf.value, buf.next_value, buf.terminated[:, None].expand(T, n),
                       buf.episode_end[:, None].expand(T, n), gamma, gae_lambda)


def ppo_update(args: Args, actor: Actor, critic: Critic, optimizer: torch.optim.Optimizer, params: list,
               buf: RolloutBuffers, adv: torch.Tensor, ret: torch.Tensor, gen: torch.Generator,
               clone: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, list[float]]:
    """``update_epochs`` passes of minibatch SGD on `ppo_loss` over the rollout (minibatch order
    from ``gen``; the passes stop once a pass ends past ``target_kl``). ``clone``: the imitation
    samples ``(X, y)``, whose clone loss every minibatch keeps at ``bc_coef``. Returns each
    diagnostic's values, one per minibatch."""
    batch = buf.z.numel()
    minibatch = batch // args.num_minibatches
    b_obs = buf.obs.reshape(-1, NUM_FEATURES)
    b_cobs = buf.critic_obs.reshape(-1, 2 * NUM_FEATURES)
    b_z, b_logp = buf.z.reshape(-1), buf.logprob.reshape(-1)
    b_adv, b_ret, b_val = adv.reshape(-1), ret.reshape(-1), buf.value.reshape(-1)
    if clone is not None:
        from .imitation import clone_loss
    stats: dict[str, list[float]] = {}
    for _epoch in range(args.update_epochs):
        perm = torch.randperm(batch, generator=gen)
        for start in range(0, batch - minibatch + 1, minibatch):
            mb = perm[start:start + minibatch]
            dist = actor.logit_distribution(b_obs[mb])
            new_logp = dist.log_prob(b_z[mb][:, None]).squeeze(-1)
            entropy = dist.entropy().squeeze(-1)
            mb_adv = b_adv[mb]
            if args.norm_adv:
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
            loss, st = ppo_loss(new_logp, b_logp[mb], mb_adv, critic(b_cobs[mb]), b_val[mb], b_ret[mb], entropy,
                                clip_coef=args.clip_coef, vf_coef=args.vf_coef, ent_coef=args.ent_coef,
                                clip_vloss=args.clip_vloss)
            if clone is not None and args.bc_coef > 0:  # keep what was cloned (DQfD-style)
                bc_X, bc_y = clone
                bi = torch.randint(len(bc_y), (minibatch,), generator=gen)
                bc = clone_loss(actor, bc_X[bi], bc_y[bi])
                loss = loss + args.bc_coef * bc
                st["clone_loss"] = float(bc.detach())
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            for k, v in st.items():
                stats.setdefault(k, []).append(v)
        if args.target_kl is not None and stats["approx_kl"][-1] > args.target_kl:
            break
    return stats


def imitation_warm_start(args: Args, actor: Actor, env_cfg: EnvConfig, out: Path
                         ) -> tuple[dict | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """With ``bc_episodes`` or ``bc_data``: clone the replay oracle into ``actor`` (module doc),
    write ``imitation.json``; returns (the cloning's figures, the samples ``(X, y)``), else
    ``(None, None)``."""
    if not (args.bc_episodes or args.bc_data):
        return None, None
    from .imitation import behaviour_clone, collect_oracle_data, load_oracle_data

    if args.bc_data:
        data = load_oracle_data(args.bc_data)
    else:
        data = collect_oracle_data(env_cfg, args.bc_episodes, args.bc_shares, seed=args.bc_seed,
                                   progress=args.progress)
    imitation = behaviour_clone(actor, data, epochs=args.bc_epochs, lr=args.bc_lr, seed=args.seed)
    imitation.update({"collect_wall_s": data["wall_s"], "oracle_episodes": data["episodes"]})
    (out / "imitation.json").write_text(json.dumps(imitation, indent=1))
    return imitation, (torch.from_numpy(data["X"]).float(), torch.from_numpy(data["y"]).float())


def final_evaluation(args: Args, actor: Actor, env_cfg: EnvConfig, imitation: dict | None,
                     warm_start: dict | None) -> dict:
    """The held-out evaluation of the trained actor (or why it was skipped), with the cloning's
    and the warm start's figures beside it."""
    if args.evaluate:
        evaluation = evaluate(actor, env_cfg, seed=args.eval_seed, static_shares=tuple(args.eval_static_shares),
                              progress=args.progress)
    else:
        evaluation = {"by_regime": {}, "skipped": "--no-eval: judge the exported policy with python -m bench.regret "
                                                  "--policy DIR"}
    if imitation is not None:
        evaluation["imitation"] = {k: v for k, v in imitation.items() if k != "oracle_episodes"}
    if warm_start is not None:
        evaluation["warm_start"] = warm_start
    return evaluation


def train(args: Args, env=None) -> dict:
    """Train, evaluate, save; return a summary (paths, figures). ``env``: an environment with
    `AllocatorEnv`'s interface to train on instead of ``AllocatorEnv(args.env_config())`` (tests
    use a bandit with a known best split); the evaluation runs on the simulator either way."""
    from tqdm import tqdm

    args.validate()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.torch_threads)
    env_cfg = args.env_config()
    env = env if env is not None else AllocatorEnv(env_cfg)
    n = env.num_agents
    gen = torch.Generator().manual_seed(args.seed)  # action noise and minibatch order
    actor = make_initial_actor(args.seed, ActorConfig(hidden_sizes=tuple(args.hidden_sizes),
                                                      init_log_std=args.init_log_std)).train()
    critic = Critic(tuple(args.hidden_sizes), torch.Generator().manual_seed(args.seed + 1))
    warm_start = load_policy_weights(actor, args.init_policy) if args.init_policy else None
    imitation, clone = imitation_warm_start(args, actor, env_cfg, out)
    params = list(actor.parameters()) + list(critic.parameters())
    optimizer = torch.optim.Adam(params, lr=args.learning_rate, eps=1e-5)

    T = args.num_steps
    num_updates = max(1, args.total_steps // T) if args.total_steps else 0  # 0: imitation only
    buf = RolloutBuffers.zeros(T, n)
    wall0 = time.perf_counter()
    if num_updates:
        obs_np, _ = env.reset(seed=args.seed)
        obs = torch.from_numpy(obs_np)
    global_step = 0
    rows: list[dict] = []
    episodes: list[dict] = []
    bar = tqdm(total=num_updates * T, desc="ppo", unit="step", disable=not args.progress, mininterval=1.0)
    for update in range(1, num_updates + 1):
        lr = args.learning_rate * (1.0 - (update - 1) / num_updates if args.anneal_lr else 1.0)
        for g in optimizer.param_groups:
            g["lr"] = lr
        obs, global_step, done_eps = collect_rollout(env, actor, critic, obs, buf, gen, reward_scale=args.reward_scale,
                                                     global_step=global_step, episodes=episodes, bar=bar)
        adv, ret = rollout_advantages(buf, critic, obs, args.gamma, args.gae_lambda)
        stats = ppo_update(args, actor, critic, optimizer, params, buf, adv, ret, gen, clone)
        row = {
            "update": update, "global_step": global_step, "transitions": global_step * n, "episodes": len(episodes),
            "episode_reward": (round(float(np.mean([e["mean_reward"] for e in done_eps])), 6) if done_eps else None),
            "rollout_reward": round(float(buf.reward.mean()) / args.reward_scale, 6),
            "mean_action": round(float(torch.sigmoid(buf.z).mean()), 5),
            "action_std": round(float(actor.log_std.detach().exp()), 5), "learning_rate": lr,
            **{k: round(float(np.mean(v)), 6) for k, v in stats.items()},
            "explained_variance": round(explained_variance(buf.value.reshape(-1).numpy(), ret.reshape(-1).numpy()),
                                        5),
            "wall_s": round(time.perf_counter() - wall0, 1),
        }
        rows.append(row)
        write_curve(rows, episodes, out, plot=False)  # the figures so far survive an interrupted run
        bar.set_postfix(reward=row["rollout_reward"], share=row["mean_action"], kl=row["approx_kl"])
    bar.close()
    env.close()
    train_wall_s = time.perf_counter() - wall0

    actor.eval()
    evaluation = final_evaluation(args, actor, env_cfg, imitation, warm_start)
    evaluation.update({"train_wall_s": round(train_wall_s, 1), "num_updates": num_updates,
                       "num_episodes": len(episodes), "transitions": global_step * n,
                       "train_reward_by_regime": training_progress(episodes)})
    curve = write_curve(rows, episodes, out, plot=bool(rows))  # nothing to plot when only cloning
    (out / "evaluation.json").write_text(json.dumps(evaluation, indent=1))
    training_config = {"algorithm": "ppo", "args": args.to_dict(), "env": env_cfg.to_dict()}
    # the checkpoint carries the per-regime summary, not every episode (it ends up in the manifest)
    ckpt_eval = {k: v for k, v in evaluation.items() if k != "episodes"}
    ckpt = save_checkpoint(out / "actor.pt", actor, training_config=training_config, evaluation=ckpt_eval)
    return {"checkpoint": str(ckpt), "curve": curve, "evaluation": ckpt_eval,
            "wall_s": round(time.perf_counter() - wall0, 1)}


# --------------------------------------------------------------------------------------------- command line


def _list(cast):
    def parse(text: str):
        try:
            vals = tuple(cast(x.strip()) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"want a comma-separated list, got {text!r}") from None
        return vals
    return parse


_FLAGS = {  # Args field -> (flag, type, help)
    "seed": ("--seed", int, "seed of the networks, the action noise and the episodes"),
    "out": ("--out", str, "output directory (checkpoint, curve, evaluation)"),
    "total_steps": ("--total-steps", int, "control intervals to simulate for training"),
    "traces": ("--trace", _list(str), "comma-separated traces: taobao, amazon, synthetic"),
    "regimes": ("--regimes", _list(str), "comma-separated regimes"),
    "num_nodes": ("--nodes", int, "simulated nodes (agents sharing the policy)"),
    "rate_rps": ("--rate", float, "cluster request rate, req/s (centre of the drawn range; default: the paper "
                                  "table's per-node rate x nodes)"),
    "rate_spread": ("--rate-spread", float, "rates drawn log-uniformly in rate/(1+s) .. rate*(1+s)"),
    "duration_s": ("--duration", float, "simulated seconds per episode"),
    "num_users": ("--users", int, "users per stream (default: the paper table's users per node x nodes)"),
    "history_scale": ("--history-scale", float, "stretch trace histories (default: the paper table's)"),
    "cache_fraction": ("--cache-fraction", float, "cache bytes per node as a fraction of the embedding table "
                                                  "(default: the paper table's)"),
    "slo_ms": ("--slo-ms", float, "latency SLO (default: the paper table's)"),
    "profile": ("--profile", str, "cost profile name or racer node profile JSON (default: the paper table's)"),
    "settings": ("--settings", str, "settings drawn per episode, joined by '+': table (the setting above), "
                                    "calibration (bench.oracle_gap's 9 calibrations), paper-scale[/N] (Taobao at "
                                    "scale 1/N, default 384); e.g. calibration+paper-scale (default: the table's "
                                    "setting only)"),
    "init_policy": ("--init-policy", str, "start the actor from this policy artifact's weights (e.g. "
                                          "policies/default; default: a fresh actor)"),
    "num_steps": ("--num-steps", int, "env steps per rollout"),
    "learning_rate": ("--learning-rate", float, "Adam step size (annealed to 0)"),
    "gamma": ("--gamma", float, "discount"),
    "gae_lambda": ("--gae-lambda", float, "GAE lambda"),
    "update_epochs": ("--update-epochs", int, "passes over each rollout"),
    "num_minibatches": ("--num-minibatches", int, "minibatches per pass"),
    "init_log_std": ("--init-log-std", float, "initial log std of the logit's Gaussian"),
    "bc_episodes": ("--bc-episodes", int, "clone the replay oracle on this many episodes before PPO (0: off)"),
    "bc_shares": ("--bc-shares", _list(float), "the oracle's share grid"),
    "bc_data": ("--bc-data", _list(str), "comma-separated .npz files of `python -m policies.imitation` to clone "
                                        "instead of collecting (--bc-episodes is then ignored)"),
    "bc_epochs": ("--bc-epochs", int, "behaviour-cloning passes over the oracle's samples"),
    "bc_lr": ("--bc-lr", float, "behaviour cloning's Adam learning rate"),
    "bc_coef": ("--bc-coef", float, "weight of the clone loss kept in PPO's minibatches"),
    "eval_seed": ("--eval-seed", int, "seed of the held-out evaluation streams"),
    "eval_static_shares": ("--eval-static-shares", _list(float), "static splits evaluated beside the policy"),
}


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    defaults = Args()
    for name, (flag, typ, text) in _FLAGS.items():
        d = getattr(defaults, name)
        shown = ",".join(map(str, d)) if isinstance(d, tuple) else d
        p.add_argument(flag, dest=name, type=typ, default=d, help=text if d is None else f"{text} (default {shown})")
    p.add_argument("--no-eval", dest="evaluate", action="store_false",
                   help="skip the held-out evaluation (with many settings it simulates every setting x regime; "
                        "judge the exported policy with `python -m bench.regret --policy DIR` instead)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def args_from_namespace(ns: argparse.Namespace) -> Args:
    kw = {f.name: getattr(ns, f.name) for f in fields(Args) if hasattr(ns, f.name)}
    kw["progress"] = not getattr(ns, "no_progress", False)
    return Args(**kw)


def cmd_train(ns: argparse.Namespace) -> int:
    summary = train(args_from_namespace(ns))
    if getattr(ns, "json", False):
        print(json.dumps(summary))
    else:
        ev = summary["evaluation"]
        print(f"trained in {ev['train_wall_s']} s ({ev['num_updates']} updates, {ev['num_episodes']} episodes, "
              f"{ev['transitions']} transitions); checkpoint {summary['checkpoint']}")
        if "imitation" in ev:
            im = ev["imitation"]
            print(f"cloned {im['samples']} samples of {im['episodes']} episodes: mean |share - label| "
                  f"{im['before']['train_mae']} -> {im['after']['train_mae']} (train), {im['before']['heldout_mae']} -> "
                  f"{im['after']['heldout_mae']} ({im['heldout_episodes']} held-out episodes; one constant share: "
                  f"{im['constant_heldout_mae']})")
        if "png" in summary["curve"]:
            print(f"curve {summary['curve']['png']}; training episodes, first fifth -> last fifth:")
        for regime, p in ev["train_reward_by_regime"].items():
            print(f"  {regime:<7} reward {p['reward_first_fifth']:.4f} -> {p['reward_last_fifth']:.4f}, "
                  f"sampled share {p['share_first_fifth']:.3f} -> {p['share_last_fifth']:.3f} "
                  f"({p['episodes']} episodes)")
        print("evaluation (held-out streams, mean action from emb_share 0.5):" if ev["by_regime"] else
              f"evaluation skipped ({ev.get('skipped', 'none')})")
        for regime, row in ev["by_regime"].items():
            print(f"  {regime:<7} " + "  ".join(f"{k}: reward {v['mean_reward']:.4f} p99 {v['p99_ms']:.2f} ms "
                                                  f"slo {v['slo_attainment']:.4f} share {v['mean_share']:.3f}"
                                                  for k, v in row.items()))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m policies.train_ppo", description=__doc__.split("\n")[0])
    add_train_arguments(p)
    return cmd_train(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
