"""The training environment's settings: one drawn per episode ("one policy for every setting")."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace

from node_agent.features import NUM_FEATURES
from node_agent.memory import DEFAULT_GHOST_PROBES

import numpy as np
import pytest

from policies.env import (
    CALIBRATION_CACHE_FRACTIONS,
    CALIBRATION_HISTORY_SCALE,
    CALIBRATION_KV_KIB,
    CALIBRATION_RATE_RPS_PER_NODE,
    CALIBRATION_USERS_PER_NODE,
    PAPER_TRACE_SEED,
    AllocatorEnv,
    EnvConfig,
    EnvSetting,
    calibration_settings,
    parse_settings,
)
from tests.conftest import needs_samples

TINY = dict(traces=("synthetic",), num_nodes=2, rate_rps=200.0, rate_spread=0.0, duration_s=5.0, num_users=300,
            history_scale=1.0, cache_fraction=0.5)
THREE = (EnvSetting(), EnvSetting(cache_fraction=0.25, kv_kib=6.0),
         EnvSetting(cache_fraction=4.0, rate_rps_per_node=50.0, users_per_node=100, history_scale=2.0))


def test_the_default_single_setting_draws_exactly_as_before():
    """No settings: no extra draw, so the episodes (and the shipped recipe) are unchanged. The
    old draw order, written out: trace, regime, stream seed, rate, initial share."""
    cfg = EnvConfig(**{**TINY, "traces": ("synthetic", "taobao"), "rate_spread": 0.5})
    env = AllocatorEnv(cfg)
    rng = np.random.default_rng(7)
    for e in range(6):
        _, _, meta = env.draw_episode(seed=7 if e == 0 else None, options={"trace": "synthetic"})
        trace = cfg.traces[int(rng.integers(2))]
        regime = cfg.regimes[int(rng.integers(3))]
        stream_seed = int(rng.integers(2**31 - 1))
        rate = math.exp(rng.uniform(math.log(200 / 1.5), math.log(200 * 1.5)))
        share = rng.uniform(0.2, 0.8)
        assert trace in cfg.traces
        assert (meta["regime"], meta["stream_seed"]) == (regime, stream_seed)
        assert meta["rate_rps"] == pytest.approx(rate) and meta["initial_share"] == pytest.approx(share)
        assert (meta["setting"], meta["setting_name"]) == (0, "sample")


def test_the_draw_covers_every_setting_and_applies_it():
    env = AllocatorEnv(EnvConfig(**TINY, settings=THREE))
    drawn = []
    for e in range(30):
        stream, scfg, meta = env.draw_episode(seed=3 if e == 0 else None)
        st = THREE[meta["setting"]]
        assert meta["setting_name"] == st.name
        drawn.append(meta["setting"])
        # the setting's calibration reaches the simulator and the stream
        assert scfg.cache_fraction == (st.cache_fraction or 0.5)
        assert scfg.profile.kv_bytes_per_token == (int(st.kv_kib * 1024) if st.kv_kib else 96 * 1024)
        assert stream.config.num_users == (st.users_per_node * 2 if st.users_per_node else 300)
        assert stream.config.history_scale == (st.history_scale or 1.0)
        assert meta["rate_rps"] == pytest.approx(st.rate_rps_per_node * 2 if st.rate_rps_per_node else 200.0)
    counts = Counter(drawn)
    assert sorted(counts) == [0, 1, 2] and min(counts.values()) >= 5, counts
    # the same seed draws the same settings
    env2 = AllocatorEnv(EnvConfig(**TINY, settings=THREE))
    again = [env2.draw_episode(seed=3 if e == 0 else None)[2]["setting"] for e in range(30)]
    assert again == drawn


def test_options_fix_the_setting_and_info_names_it():
    env = AllocatorEnv(EnvConfig(**TINY, settings=THREE))
    obs, info = env.reset(seed=0, options={"setting": 2, "regime": "steady"})
    assert (info["setting"], info["setting_name"]) == (2, "sample[cf=4,hs=2,rps/node=50,users/node=100]")
    assert obs.shape == (2, NUM_FEATURES)
    _, _, _, trunc, step = env.step(np.array([0.5, 0.5]))
    assert step["setting_name"] == info["setting_name"]
    while not trunc:
        _, _, _, trunc, step = env.step(np.array([0.5, 0.5]))
    assert step["episode"]["setting_name"] == info["setting_name"] and step["episode"]["setting"] == 2
    _, info = env.reset(options={"setting": "sample[cf=0.25,kv=6KiB]"})
    assert info["setting"] == 1
    for _ in range(5):  # fixed whatever the generator draws
        assert env.draw_episode(options={"setting": 1})[2]["setting"] == 1
    with pytest.raises(ValueError, match="out of range"):
        env.reset(options={"setting": 3})
    with pytest.raises(ValueError, match="unknown setting 'nope'"):
        env.reset(options={"setting": "nope"})
    with pytest.raises(ValueError, match="out of range"):  # one implicit setting: index 0 only
        AllocatorEnv(EnvConfig(**TINY)).reset(options={"setting": 1})


def test_bad_settings_are_refused_naming_the_field():
    def problems(*settings, **kw):
        with pytest.raises(ValueError) as e:
            EnvConfig(**{**TINY, **kw}, settings=tuple(settings)).validate()
        return str(e.value)

    assert "setting must be one of" in problems(EnvSetting(setting="huge"))
    assert "cache_fraction must be None or a positive number" in problems(EnvSetting(cache_fraction=-1.0))
    assert "users_per_node must be None or an integer >= 1" in problems(EnvSetting(users_per_node=0))
    assert "kv_kib must be a whole number of bytes" in problems(EnvSetting(kv_kib=0.001))
    msg = problems(EnvSetting(setting="paper-scale", cache_fraction=1.0, traces=("taobao",)))
    assert "cache_fraction must be None" in msg and "PaperScale" in msg
    assert "paper_scale" in problems(EnvSetting(setting="paper-scale", paper_scale=2.0, traces=("taobao",)))
    assert "multiple of 8" in problems(EnvSetting(setting="paper-scale", paper_scale=1 / 100, traces=("taobao",)))
    # paper-scale is built from a sample's sequences: the synthetic trace is refused
    assert "taobao or amazon" in problems(EnvSetting(setting="paper-scale"))
    assert "taobao or amazon" in problems(EnvSetting(setting="paper-scale", traces=("synthetic",)))
    assert "more than once" in problems(EnvSetting(), EnvSetting())
    assert "tuple of EnvSetting" in problems({"setting": "sample"})
    with pytest.raises(ValueError, match="unknown setting 'big'"):
        parse_settings("calibration+big")
    with pytest.raises(ValueError, match="joined by"):
        parse_settings("calibration++paper-scale")
    with pytest.raises(ValueError, match="paper-scale/N"):
        parse_settings("paper-scale/x")


def test_parse_settings_and_the_calibration_grid_of_bench_oracle_gap():
    from bench import oracle_gap

    # the grid is bench.oracle_gap's defaults, per node
    assert CALIBRATION_KV_KIB == oracle_gap.KV_KIB and CALIBRATION_CACHE_FRACTIONS == oracle_gap.CACHE_FRACTIONS
    assert CALIBRATION_RATE_RPS_PER_NODE == oracle_gap.RATE_RPS / oracle_gap.NODES
    assert CALIBRATION_USERS_PER_NODE == oracle_gap.USERS // oracle_gap.NODES
    assert CALIBRATION_HISTORY_SCALE == oracle_gap.HISTORY_SCALE
    cal = calibration_settings()
    assert len(cal) == 9 and {(s.kv_kib, s.cache_fraction) for s in cal} == {
        (kv, cf) for kv in oracle_gap.KV_KIB for cf in oracle_gap.CACHE_FRACTIONS}
    mixed = parse_settings("calibration+paper-scale")
    assert mixed[:9] == cal and mixed[9].setting == "paper-scale" and mixed[9].paper_scale == 1 / 384
    assert mixed[9].traces == ("taobao",) and mixed[9].name == "paper-scale/384"
    assert parse_settings("table+paper-scale/192") == (EnvSetting(), EnvSetting(setting="paper-scale",
                                                                                 paper_scale=1 / 192,
                                                                                 traces=("taobao",)))
    # on 8 nodes a calibration setting runs bench.oracle_gap's cluster load
    env = AllocatorEnv(EnvConfig(**{**TINY, "num_nodes": 8}, settings=cal))
    assert env.setting_load(cal[4]) == (oracle_gap.RATE_RPS, oracle_gap.USERS, oracle_gap.HISTORY_SCALE)
    d = EnvConfig(**TINY, settings=cal).to_dict()
    assert json.loads(json.dumps(d))["settings"][0]["name"] == cal[0].name


@needs_samples
def test_a_paper_scale_episode_is_the_paper_tables_setting():
    """SimConfig from `simulator.table.sim_config`, trace from `simulator.table.setting_trace`, and
    (with the stream seed equal to the trace seed) the very stream the table replays."""
    from simulator.table import TableConfig, _stream, setting_trace, sim_config

    cfg = EnvConfig(traces=("taobao",), num_nodes=1, duration_s=3.0, rate_spread=0.0, slo_ms=30.0,
                    settings=parse_settings("table+paper-scale"))
    env = AllocatorEnv(cfg)
    stream, scfg, meta = env.draw_episode(seed=0, options={"setting": "paper-scale/384", "regime": "trend",
                                                             "stream_seed": 17})
    table = TableConfig.paper(quick=True, num_nodes=1, paper_scale=1 / 384, trace="taobao", seed=17, duration_s=3.0)
    assert (meta["setting"], meta["setting_name"], meta["trace"]) == (1, "paper-scale/384", "taobao")
    assert scfg == replace(sim_config(table), ghost_probes=DEFAULT_GHOST_PROBES)  # training reads the ghost lists
    assert scfg.cache_bytes == sim_config(table).cache_bytes and scfg.profile.name.endswith("@paper-scale/384")
    assert meta["rate_rps"] == pytest.approx(table.rate_rps) and stream.config.num_users == table.num_users
    assert stream.config.history_scale == 1.0
    trace = setting_trace(replace(table, seed=PAPER_TRACE_SEED))
    assert env._setting_trace(cfg.settings[1], "taobao") is trace  # built once, by the table's function
    # stream seed = trace seed: the table's own stream, request for request
    stream2, _, _ = env.draw_episode(options={"setting": 1, "regime": "trend", "stream_seed": PAPER_TRACE_SEED,
                                              "rate_rps": table.rate_rps})
    ref = _stream(replace(table, seed=PAPER_TRACE_SEED), "trend")
    assert len(stream2) == len(ref) and np.array_equal(stream2.user, ref.user)
    assert stream2.trace is ref.trace and stream2.config == ref.config
    assert np.array_equal(stream2.arrival_s, ref.arrival_s) and np.array_equal(stream2.history_len, ref.history_len)
    # and it runs: one step (3 windows of 1 s)
    obs, info = env.reset(options={"setting": 1, "regime": "steady"})
    _, reward, _, trunc, step = env.step(np.array([0.5]))
    assert trunc and np.isfinite(reward).all() and step["episode"]["setting_name"] == "paper-scale/384"


def test_training_cli_on_a_mixture_and_bad_settings(tmp_path, capsys):
    from racer.cli import main

    run = tmp_path / "run"
    rc = main(["policy", "train", "--trace", "synthetic", "--regimes", "steady", "--nodes", "2", "--rate", "200",
               "--rate-spread", "0", "--duration", "3", "--users", "300", "--history-scale", "1",
               "--cache-fraction", "0.5", "--settings", "table+calibration", "--total-steps", "4", "--num-steps", "2",
               "--update-epochs", "1", "--num-minibatches", "2", "--seed", "0", "--eval-static-shares", "",
               "--init-policy", "policies/default", "--out", str(run), "--no-progress", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ev = summary["evaluation"]
    assert len(ev["by_setting"]) == 10 and "sample" in ev["by_setting"]  # one held-out episode per setting
    assert ev["warm_start"]["policy_id"] == json.loads(open("policies/default/manifest.json").read())["policy_id"]
    assert ev["warm_start"]["golden_max_abs_diff"] <= 1e-6
    curve = json.loads((run / "curve.json").read_text())
    assert all("setting_name" in e for e in curve["episodes"])
    ckpt_env = json.loads((run / "evaluation.json").read_text())
    assert ckpt_env["episodes"] and len({e["setting_name"] for e in ckpt_env["episodes"]}) == 10
    assert main(["policy", "train", "--settings", "calibration+huge", "--out", str(tmp_path / "bad")]) == 2
    assert "unknown setting 'huge'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_warm_start_loads_the_artifacts_actor_and_refuses_others(tmp_path):
    import torch

    from node_agent.artifact import read_golden, read_manifest
    from policies.actor import ActorConfig, make_initial_actor
    from policies.train_ppo import load_policy_weights

    actor = make_initial_actor(3, ActorConfig())
    got = load_policy_weights(actor, "policies/default")
    X, y = read_golden("policies/default", read_manifest("policies/default"))
    with torch.no_grad():
        out = actor(torch.from_numpy(X.astype(np.float32))).reshape(-1).numpy()
    assert np.max(np.abs(out - y.reshape(-1))) <= 1e-6 and got["golden_max_abs_diff"] <= 1e-6
    with pytest.raises(ValueError, match="feature schema version 1"):
        load_policy_weights(make_initial_actor(3, ActorConfig()), "tests/data/policy_schema1")
    with pytest.raises(ValueError, match="hidden-sizes"):
        load_policy_weights(make_initial_actor(3, ActorConfig(hidden_sizes=(32,))), "policies/default")
