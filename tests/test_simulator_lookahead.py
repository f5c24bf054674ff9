"""The look-ahead oracle (the best per-phase schedule, chosen jointly) and the capacity rule the
paper-scale load sweep starts from (`simulator.table.steady_capacity`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from simulator.allocators import StaticAllocator
from simulator.cluster import lookahead_segments, oracle_lookahead, simulate
from simulator.table import TableConfig, _stream, sim_config, steady_capacity

TRACE = "users=60,items=3000,len=60,zipf=1.1,seed=11"


def _tiny(**kw):
    base = dict(trace="synthetic", path=TRACE, num_nodes=1, rate_rps=40.0, num_users=60, history_scale=3.0,
                routers=("racer",), other_router_allocators=(), jobs=1, shares=(0.2, 0.8))
    base.update(kw)
    return TableConfig.quick(**base)


def test_segments_follow_the_schedule_phases_or_cut_a_regime_in_parts():
    cfg = _tiny(regimes=("schedule",), schedule="steady:2,burst:3,steady:2")
    stream = _stream(cfg, "schedule")
    assert lookahead_segments(stream, sim_config(cfg)) == [(0, 2), (2, 5), (5, 7)]
    one = _tiny(regimes=("steady",), duration_s=8.0)
    assert lookahead_segments(_stream(one, "steady"), sim_config(one), 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_exhaustive_lookahead_is_never_worse_than_any_single_split():
    """With a beam as wide as every schedule (2 shares ^ 3 phases), the constant schedules are among
    the candidates, so the look-ahead oracle's P99 is at most every static split's."""
    cfg = _tiny(regimes=("schedule",), schedule="steady:2,burst:3,steady:2")
    stream = _stream(cfg, "schedule")
    scfg = sim_config(cfg)
    res, per_window = oracle_lookahead(stream, scfg, cfg.shares, beam=8)
    assert len(per_window) == 7 and set(per_window) <= {0.2, 0.8}
    assert res.extra["lookahead_segment_shares"] == [per_window[0], per_window[2], per_window[5]]
    statics = [simulate(stream, scfg, StaticAllocator(s)).summary()["p99_ms"] for s in cfg.shares]
    assert res.summary()["p99_ms"] <= min(statics) + 1e-9
    with pytest.raises(ValueError, match="beam must be >= 1"):
        oracle_lookahead(stream, scfg, cfg.shares, beam=0)


def test_capacity_is_the_highest_rate_that_meets_the_slo():
    cfg = replace(_tiny(regimes=("steady",)), slo_ms=20.0)
    cap = steady_capacity(cfg, duration_s=3.0, iters=3)
    probes = cap["probes"]
    passed = [r for r, p99 in probes if p99 <= 20.0]
    failed = [r for r, p99 in probes if p99 > 20.0]
    assert passed and failed and cap["capacity_rps"] == max(passed) and max(passed) < min(failed)
    assert cap["capacity_rps_per_node"] == cap["capacity_rps"]  # one node
    assert cap["rule"] == "slo" and cap["limit_ms"] == 20.0
    # an SLO the service time alone misses at every rate: the knee rule (P99 within 2x the
    # light-load P99, the P99 at the lowest rate probed)
    knee = steady_capacity(replace(cfg, slo_ms=1e-6), duration_s=3.0, iters=3)
    light_rate, light_p99 = min(knee["probes"])
    assert knee["rule"] == "knee" and knee["light_load_p99_ms"] == light_p99
    assert knee["limit_ms"] == pytest.approx(2 * light_p99, abs=1e-3)
    ok = [r for r, p99 in knee["probes"] if p99 <= knee["limit_ms"]]
    bad = [r for r, p99 in knee["probes"] if p99 > knee["limit_ms"]]
    assert bad and knee["capacity_rps"] == max(ok) and max(ok) < min(bad)
