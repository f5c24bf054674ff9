"""The imbalance guard: absolute and relative thresholds, fallback to least-loaded, its reason."""

from __future__ import annotations

import numpy as np
import pytest

from gateway import CostProfile, NodeReport, RouteRequest, make_router
from gateway.router import LOAD_AWARE_OFF

ABS, REL = 8.0, 1.5


def cluster(name="racer", **cfg):
    prof = CostProfile(kv_recompute_us_per_token=10.0, emb_transfer_us_per_row=1.0, service_time_us=1.0,
                       queue_capacity=100)
    cfg = {"guard_abs_threshold": ABS, "guard_rel_threshold": REL, "num_shards": 4, "residency_capacity": 64,
           "load_aware": LOAD_AWARE_OFF, **cfg}
    return make_router(name, ["n0", "n1", "n2"], prof, **cfg)


def route_holder_request(r, depths, at_s=0.0):
    """User 1's K/V (1000 tokens = 10 ms) sits on n0, the most loaded node; the score wants n0."""
    for i, q in enumerate(depths):
        r.report(NodeReport(f"n{i}", at_s, queue_depth=q))
    r.state.kv.record(1, 0, 1_000, at_s)
    return r.route(RouteRequest(1, 1_000, np.empty(0, dtype=np.int64)), at_s)


@pytest.mark.parametrize("depths, fires", [
    ((10, 2, 5), False),   # max - min = 8, not > 8
    ((11, 2, 5), True),    # 9 > 8 and 11 > 1.5 * 2
    ((30, 21, 25), False),  # 9 > 8 but 30 <= 1.5 * 21 = 31.5
    ((32, 21, 25), True),  # 11 > 8 and 32 > 31.5
    ((9, 0, 0), True),     # 9 > 8 and 9 > 0
    ((8, 0, 0), False),
])
def test_guard_fires_strictly_above_both_thresholds(depths, fires):
    r = cluster()
    d = route_holder_request(r, depths)
    mx, mn = max(depths), min(depths)
    assert d.guard_check == (mx, mn, ABS, REL)
    assert d.guard_fired is fires
    if fires:
        assert d.source == "guard" and depths[d.node_index] == mn  # a least-loaded node
        assert d.reason.startswith(f"guard: max_load {mx:g} - min_load {mn:g} > {ABS:g} and {mx:g} > {REL:g} * {mn:g}")
    else:
        assert d.source == "score" and d.node_id == "n0"  # the K/V holder: 10 ms saved beats any wait here


def test_guard_fallback_breaks_ties_between_equally_loaded_nodes():
    seen = set()
    for seed in range(12):
        d = route_holder_request(cluster(seed=seed), (20, 1, 1))
        assert d.source == "guard"
        seen.add(d.node_id)
    assert seen == {"n1", "n2"}


def test_guard_disabled_never_fires():
    d = route_holder_request(cluster(guard_enabled=False), (60, 0, 0))
    assert d.source == "score" and d.node_id == "n0" and d.guard_check is None


def test_guard_ignores_silent_nodes():
    r = cluster(node_timeout_s=5.0, expiry_check_interval_s=0.0)
    r.report(NodeReport("n0", 4.0, queue_depth=12))
    r.report(NodeReport("n1", 4.0, queue_depth=10))
    # n2 was last heard from at 0 s: silent at 6 s; its empty queue must not count as the minimum
    d = r.route(RouteRequest(2, 0, np.empty(0, dtype=np.int64)), 6.0)
    assert r.state.alive.tolist() == [True, True, False]
    assert d.guard_check[:2] == (12.0, 10.0) and d.source == "score"


@pytest.mark.parametrize("name", ["kv_aware", "emb_aware"])
def test_the_other_scoring_routers_have_the_guard_too(name):
    d = route_holder_request(cluster(name), (11, 2, 5))
    assert d.source == "guard" and d.node_id == "n1"
