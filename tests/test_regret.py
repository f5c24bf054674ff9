"""The schedule's rows in the paper table, and bench.regret on a small grid (process pool and a
local Ray instance)."""

import os

import pytest

from tests.conftest import needs_samples


def _small(cfg):
    from dataclasses import replace

    return replace(cfg, num_nodes=4, rate_rps=300.0, num_users=1_500, history_scale=2.0, shares=(0.2, 0.8))


@needs_samples
def test_schedule_rows_have_phases_and_the_best_single_static_split(tmp_path):
    from simulator.table import TableConfig, run_table

    cfg = _small(TableConfig.quick(trace="taobao", regimes=("schedule",), schedule="steady:2,burst:3,steady:2",
                                   routers=("racer",), other_router_allocators=(), jobs=1))
    res = run_table(cfg, tmp_path, progress=False)
    phases = ["steady[0-2s]", "burst[2-5s]", "steady[5-7s]", "all"]
    for alloc in ("static:0.20", "static:0.80", "best_static", "oracle", "heuristic"):
        rows = [r for r in res["rows"] if r["allocator"] == alloc]
        assert [r["phase"] for r in rows] == phases
        for r in rows:
            assert set(("allocator", "router", "phase", "p99_ms", "slo_attainment", "mean_share")) <= set(r)
            assert r["p99_ms"] > 0 and 0 <= r["slo_attainment"] <= 1
        # the phases partition the run's requests
        assert sum(r["num_requests"] for r in rows[:-1]) == rows[-1]["num_requests"]
    f = res["findings"]
    statics = {r["allocator"]: r["p99_ms"] for r in res["rows"] if r["phase"] == "all"}
    best = min((0.2, 0.8), key=lambda s: statics[f"static:{s:.2f}"])
    assert f["best_single_static_share"] == best
    assert f["best_single_static_over_oracle_pct"] == pytest.approx(
        100 * (statics[f"static:{best:.2f}"] / statics["oracle"] - 1), abs=0.01)


def _small_setting(st, quick, smart, policy=None):
    from dataclasses import replace

    from simulator.table import TableConfig

    cfg = _small(TableConfig.quick(trace=st.trace, seed=st.seed, routers=("racer",), other_router_allocators=(),
                                   extra_allocators=smart, jobs=1, duration_s=2.0))
    return replace(cfg, regimes=(st.regime,))


@needs_samples
@pytest.mark.slow
def test_regret_on_a_local_ray_instance_matches_the_process_pool(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    import bench.regret as rg

    settings = rg.grid(seeds=(0, 1), traces=("taobao",), paper_traces=(), regimes=("steady",))
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", os.getcwd())}})
    try:
        res = rg.run_grid(settings, True, str(tmp_path / "ray"), executor="ray", smart=(), progress=False,
                          make_config=_small_setting)
    finally:
        ray.shutdown()
    assert res["settings"] == 2
    a = res["allocators"]
    assert {"static:0.20", "static:0.80", "heuristic"} <= set(a)
    for v in a.values():
        assert v["settings"] == 2 and v["max_regret_pct"] >= v["mean_regret_pct"]
    # the same grid in-process gives the same figures (deterministic runs), from the saved runs
    again = rg.run_grid(settings, True, str(tmp_path / "ray"), executor="process", jobs=1, smart=(), progress=False,
                        make_config=_small_setting)
    assert again["allocators"] == a and again["runs"]["reused"] == again["runs"]["total"]


def test_regret_arithmetic_against_the_best_known_p99():
    from bench.regret import best_known, regret

    # setting 1: a static split beats the oracle (9 < 10): everyone is judged against 9
    # setting 2: the oracle is best (20)
    res = regret([{"p99_ms": {"oracle": 10.0, "static:0.20": 9.0, "static:0.50": 11.0, "racer": 10.0}},
                  {"p99_ms": {"oracle": 20.0, "static:0.20": 30.0, "static:0.50": 21.0, "racer": 23.0}}])
    assert best_known({"oracle": 10.0, "static:0.20": 9.0, "racer": 1.0}) == (9.0, "static:0.20")
    assert res["oracle"] == {"max_regret_pct": 11.11, "mean_regret_pct": 5.56, "settings": 2}
    assert res["static:0.20"] == {"max_regret_pct": 50.0, "mean_regret_pct": 25.0, "settings": 2}
    assert res["static:0.50"] == {"max_regret_pct": 22.22, "mean_regret_pct": 13.61, "settings": 2}
    assert res["racer"] == {"max_regret_pct": 15.0, "mean_regret_pct": 13.06, "settings": 2}
    # the minimax static split: the lowest worst regret (0.5's 22.22 < 0.2's 50), named by its share
    assert res["minimax_static"] == {**res["static:0.50"], "share": 0.5}


def test_holdout_findings_report_the_start_up_floor():
    """``oracle_start`` (the oracle held at the configured split for its first window) is not a
    candidate for the best known P99; its regret is each setting's start-up floor, and racer is
    also judged against the better of the two."""
    from bench.regret import holdout_findings, regret

    per = [{"setting": "a", "p99_ms": {"oracle": 10.0, "static:0.10": 11.0, "oracle_start": 15.0, "racer": 16.5}},
           {"setting": "b", "p99_ms": {"oracle": 20.0, "static:0.10": 20.0, "oracle_start": 19.0, "racer": 21.0}}]
    res = {"allocators": regret(per), "per_setting": per}
    h = holdout_findings(res, [])
    a, b = h["per_setting"]
    assert (a["best_known_p99_ms"], a["best_known_by"], a["startup_floor_pct"]) == (10.0, "oracle", 50.0)
    assert a["racer_over_startup_floor_pct"] == 10.0 and a["regret_pct"]["racer"] == 65.0
    # a start-constrained oracle that does better than the best known (greedy oracles can): floor < 0
    assert b["startup_floor_pct"] == -5.0 and b["racer_over_startup_floor_pct"] == 5.0
    assert (h["startup_floor_max_pct"], h["racer_max_over_startup_floor_pct"],
            h["racer_mean_over_startup_floor_pct"]) == (50.0, 10.0, 7.5)
    assert h["racer_max_regret_pct"] == 65.0 and not h["racer_max_within_5pct"]


def test_share_grid_and_the_cliff_family():
    from bench.regret import holdout_config, holdout_grid, share_grid

    assert share_grid(0.1) == (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    g = share_grid(0.05)
    assert len(g) == 19 and g[0] == 0.05 and g[-1] == 0.95 and 0.25 in g
    with pytest.raises(ValueError):
        share_grid(0.0)
    settings = holdout_grid(True)
    cliffs = [st for st in settings if st.family.startswith("cliff-")]
    assert sorted({st.family for st in cliffs}) == ["cliff-a", "cliff-b"]
    assert {(st.load, st.regime) for st in cliffs} == {(ld, rg) for ld in ("light", "busy") for rg in ("steady", "trend")}
    assert holdout_config(cliffs[0], True, ()).shares == share_grid(0.1)
    assert holdout_config(cliffs[0], True, ("racer",)).extra_allocators == ("racer", "oracle_start")
    assert holdout_config(cliffs[0], False, ()).shares == share_grid(0.05)
    assert holdout_config(cliffs[0], True, (), share_step=0.05).shares == share_grid(0.05)
    # the cliff's K/V working set: two users of 1,000 tokens (63 pages of 16 tokens) against the arena
    from simulator.profiles import A100_HSTU as prof

    pages = {st.family: st.cache_fraction * 20_000 * prof.emb_row_bytes / prof.page_bytes for st in cliffs}
    need = 2 * 63
    assert 0.2 < 1 - need / pages["cliff-a"] < 0.35 and 0.5 < 1 - need / pages["cliff-b"] < 0.7


def test_paper_scale_regime_length_and_its_schedule():
    from bench.regret import PAPER_REGIME_S, Setting, main, table_config

    st = Setting("taobao", "paper-scale", "schedule", 0)
    assert PAPER_REGIME_S == 20.0
    assert table_config(st, True, ()).schedule == "steady:20,trend:20,burst:16,steady:20"
    assert table_config(st, False, ()).schedule == "steady:20,trend:20,burst:10,steady:20"
    short = table_config(st, True, (), paper_regime_s=5)
    assert short.schedule == "steady:5,trend:5,burst:4,steady:5"  # the grid's former 5-s paper-scale regimes
    burst = table_config(Setting("taobao", "paper-scale", "burst", 1), True, (), paper_regime_s=5)
    assert burst.duration_s == 5.0 and burst.regimes == ("burst",) and burst.num_nodes == 1
    # the sample settings do not follow it
    assert table_config(Setting("taobao", "sample", "burst", 0), True, (), paper_regime_s=5).duration_s == 4.0
    with pytest.raises(SystemExit) as e:
        main(["--paper-regime-s", "0"])
    assert e.value.code == 2


def test_reachable_path_follows_the_oracle_at_the_guards_step_limits():
    from bench.reachable import main, reachable_path

    assert reachable_path([0.8, 0.8, 0.8, 0.2, 0.2], 0.5, 0.05, 0.1) == [0.5, 0.55, 0.6, 0.5, 0.4]
    assert reachable_path([0.2], 0.5, 0.05, 0.1) == [0.5]
    for argv in (["--settings", "taobao-paper-burst-s0"], ["--settings", "in-sample", "--jobs", "0"],
                 ["--settings", "taobao-sample-burst-s0", "--router-seeds", "a"],
                 ["--settings", "taobao-sample-burst-s0", "--router-seeds", "1", "--shares", "1.5"],
                 ["--settings", "holdout-random-9-busy-nope-s0"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


def test_reachable_names_held_out_settings_and_compares_medians_over_router_seeds():
    from bench.reachable import _setting, over_router_seeds
    from bench.regret import HoldoutSetting
    from simulator import SimConfig
    from workloads.regimes import generate
    from workloads.trace import synthetic_trace

    st = _setting("holdout-random-9-busy-trend-s0")
    assert isinstance(st, HoldoutSetting) and st.family == "random-9" and st.load == "busy"
    assert _setting("holdout-kv-heavy-light-steady-s0").known == "kv"
    # the tuning draw: the held-out random ranges from seeds of its own, never a held-out setting's
    tune = _setting("holdout-tune-9-busy-trend-s0")
    assert tune.family == "tune-9" and tune.load == "busy" and tune.path != st.path
    with pytest.raises(ValueError, match="no held-out setting"):
        _setting("holdout-tune-9-busy-sideways-s0")
    trace = synthetic_trace(num_users=200, num_items=3_000, mean_seq_len=20, seed=2)
    stream = generate(trace, regime="steady", rate_rps=400, duration_s=2, num_users=500, seed=5)
    out = over_router_seeds(stream, SimConfig(num_nodes=3, cache_fraction=0.3), (0.3, 0.7), (), (0, 1))
    rows = out["rows"]
    assert set(rows) == {"static:0.3", "static:0.7"} and all(len(v["p99_ms"]) == 2 for v in rows.values())
    assert out["best_static"] == min(rows, key=lambda k: rows[k]["median"]) and out["over_best_static_pct"] == {}
    # with the setting's windows: the best static split reached from 0.5 at the guards' steps
    out = over_router_seeds(stream, SimConfig(num_nodes=3, cache_fraction=0.3), (0.3, 0.7), (), (0, 1), windows=6)
    best = float(out["best_static"].split(":")[1])
    path = out["rows"]["start_to_best"]["path"]
    assert path[0] == 0.5 and path[-1] == best and len(path) == 6 and "start_to_best" in out["over_best_static_pct"]
    # the start-up floor: one interval at 0.5, then the best static split at once
    assert out["rows"]["start_floor"]["path"] == [0.5] + [best] * 5
    assert len(out["rows"]["start_floor"]["p99_ms"]) == 2 and "start_floor" in out["over_best_static_pct"]
    assert out["over_start_floor_pct"] == {}
    # held at 0.5 from the start, it is the static split 0.5 itself
    out = over_router_seeds(stream, SimConfig(num_nodes=3, cache_fraction=0.3), (0.5,), (), (0,), windows=4)
    assert out["rows"]["start_to_best"]["path"] == [0.5] * 4
    assert out["rows"]["start_to_best"]["p99_ms"] == out["rows"]["static:0.5"]["p99_ms"]
    assert out["rows"]["start_floor"]["p99_ms"] == out["rows"]["static:0.5"]["p99_ms"]
    # a SmartAllocator row is judged over the larger of the two medians
    from bench.reachable import start_floor_path

    assert start_floor_path(0.1, 3) == [0.5, 0.1, 0.1] and start_floor_path(0.2, 1) == [0.5]
    out = over_router_seeds(stream, SimConfig(num_nodes=3, cache_fraction=0.3), (0.3, 0.7), ("racer",), (0,),
                            windows=2)
    rows = out["rows"]
    bar = max(rows[out["best_static"]]["median"], rows["start_floor"]["median"])
    assert out["over_start_floor_pct"]["racer"] == round(100.0 * (rows["racer"]["median"] / bar - 1.0), 2)
    # the in-sample grid by one name: the quick regret grid's 36 settings, paper-scale ones included
    from bench.reachable import setting_names
    from bench.regret import grid

    names = setting_names("in-sample")
    assert names == [g.name for g in grid()] and len(names) == 36
    assert [_setting(n) for n in names] == grid()
    assert setting_names("a,,b") == ["a", "b"]
    with pytest.raises(ValueError, match="paper-scale"):
        _setting("taobao-paper-steady-s0")


@pytest.mark.timeout(120)
def test_reachable_out_keeps_each_setting_and_a_rerun_takes_them_instead_of_running(tmp_path, capsys):
    """``bench.reachable --out``: rows saved for the same allocators, seeds and shares are taken,
    not run again (a run that ran any would take minutes here); a row saved with other seeds is
    not; a cut last line is refused with a clear message."""
    import json

    from bench import reachable

    out = tmp_path / "rows.jsonl"
    names = ["taobao-sample-steady-s0", "amazon-sample-burst-s1"]
    key = {"allocators": ["racer"], "router_seeds": [0, 1], "shares": None}

    def row(name, worst):
        return {"setting": name, "oracle_p99_ms": 10.0, "oracle_schedule": [0.5], "reachable_path": [0.5],
                "reachable_p99_ms": 10.0, "regret_pct": {"reachable": 0.0, "racer": 1.0},
                "over_router_seeds": {"router_seeds": [0, 1], "rows": {}, "best_static": "static:0.5",
                                      "over_best_static_pct": {"racer": worst}}}

    reachable._saved(str(out), {**key, "router_seeds": [0, 1, 2]}, row(names[0], 99.0))  # other seeds: not taken
    for n, w in zip(names, (2.5, 7.0)):
        reachable._saved(str(out), key, row(n, w))
    assert sorted(reachable._saved_rows(str(out), key)) == sorted(names)
    assert reachable._saved_rows(str(tmp_path / "none.jsonl"), key) == {}
    assert reachable.main(["--settings", ",".join(names), "--allocators", "racer", "--router-seeds", "0,1",
                           "--json", "--out", str(out)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["setting"] for r in got["settings"]] == names
    assert got["worst_over_best_static_pct"] == {"racer": 7.0} and got["settings_within_5pct"] == {"racer": 1}
    with open(out, "a") as f:
        f.write('{"key": {"allocators"')  # a run cut while writing its last row
    with pytest.raises(SystemExit):
        reachable.main(["--settings", names[0], "--router-seeds", "0,1", "--allocators", "racer", "--out", str(out)])
    assert "not JSON" in capsys.readouterr().err


def test_saturation_bench_names_its_grids_and_finds_no_change_where_no_node_saturates(capsys):
    """``bench.saturation``: the grids by name, bad names refused, and on a stream that never
    saturates a node nor bursts (3 s, under the burst detector's warm-up) `racer` with the terms
    off and on is one and the same run."""
    from bench import saturation
    from simulator import SimConfig
    from workloads.regimes import generate
    from workloads.trace import synthetic_trace

    held = saturation.setting_names("held-out")
    assert len(held) == 36 and all(n.startswith("holdout-") for n in held)
    fresh = saturation.setting_names("random:24:2")
    assert len(fresh) == 8 and fresh[0].startswith("holdout-random-24-") and fresh[-1].startswith("holdout-random-25-")
    for bad in ("random:24", "random:x:2", "random:24:0"):
        with pytest.raises(ValueError, match="random:FROM:COUNT"):
            saturation.setting_names(bad)
    with pytest.raises(SystemExit):
        saturation.main(["--settings", "random:1"])
    assert "random:FROM:COUNT" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown variant"):
        saturation.allocator_config("half")
    off, on = saturation.allocator_config("off"), saturation.allocator_config("on")
    assert off.curve.saturation is False and off.recovery.paced is True and off.recovery.hot_over_arrivals is False
    assert on == type(on)()  # the shipped config: all three on
    assert on.curve.saturation is True and on.recovery.paced is False and on.recovery.hot_over_arrivals is True
    from simulator.smart import make_smart_allocator  # the variant's config reaches the runtime's
    built = make_smart_allocator("racer", None, off).config
    assert built.curve.saturation is False and built.recovery.paced is True and built.curve.enabled
    assert built.recovery.hot_over_arrivals is False
    trace = synthetic_trace(num_users=200, num_items=3_000, mean_seq_len=20, seed=2)
    stream = generate(trace, regime="steady", rate_rps=200, duration_s=3, num_users=500, seed=5)
    out = saturation.compare(stream, SimConfig(num_nodes=2, cache_fraction=0.3), (0, 1))
    assert out["router_seeds"] == [0, 1] and all(len(v) == 2 for v in out["p99_ms"].values())
    assert out["same"] and out["change_pct"] == [0.0, 0.0]
    assert saturation.compare(stream, SimConfig(num_nodes=2, cache_fraction=0.3, seed=3))["router_seeds"] == [3]


def test_reachable_path_specs():
    """``bench.reachable --path``: ``SHARExN`` runs, a bad share or count refused with a clear error."""
    from bench.reachable import main, parse_path

    assert parse_path("0.5x3,0.1x2") == [0.5, 0.5, 0.5, 0.1, 0.1]
    assert parse_path("0.3") == [0.3] and parse_path("0.2, 0.4x2") == [0.2, 0.4, 0.4]
    for bad in ("1.5x2", "0.5x0", "0.5xq", "half", ""):
        with pytest.raises(ValueError, match="--path"):
            parse_path(bad)
    with pytest.raises(SystemExit):
        main(["--settings", "taobao-sample-steady-s0", "--path", "0.5x-1"])
