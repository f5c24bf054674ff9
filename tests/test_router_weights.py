"""Weights from profiled miss costs: the derivation and the direction of change."""

from __future__ import annotations

import numpy as np
import pytest

from gateway import CostProfile, NodeReport, RouteRequest, derive_weights, expected_saving_us, make_router
from gateway.router import LOAD_AWARE_OFF


def profile(kv=2.0, emb=5.0, svc=100.0, cap=64):
    return CostProfile(kv_recompute_us_per_token=kv, emb_transfer_us_per_row=emb, service_time_us=svc,
                       queue_capacity=cap)


def test_derived_weights_are_miss_costs_times_request_size():
    w = derive_weights([profile(kv=2.0, emb=5.0, svc=100.0, cap=64), profile(kv=3.0, emb=1.0, svc=50.0, cap=32)])
    w_kv, w_emb, w_ld = w.for_request(history_len=1_000, num_items=20)
    np.testing.assert_allclose(w_kv, [2_000.0, 3_000.0])  # history_len * kv_recompute_us_per_token
    np.testing.assert_allclose(w_emb, [100.0, 20.0])  # num_items * emb_transfer_us_per_row
    np.testing.assert_allclose(w_ld, [6_400.0, 1_600.0])  # queue_capacity * service_time_us
    np.testing.assert_allclose(w.load_offset_us, [0.0, 4_800.0])  # max(w_ld) - w_ld
    assert w.ld_ref_us == 6_400.0


@pytest.mark.parametrize("field, term", [("kv", 0), ("emb", 1), ("svc", 2)])
def test_each_weight_grows_with_its_own_miss_cost_only(field, term):
    base = derive_weights([profile()]).for_request(500, 10)
    more = derive_weights([profile(**{field: {"kv": 4.0, "emb": 10.0, "svc": 200.0}[field]})]).for_request(500, 10)
    for i in range(3):
        if i == term:
            assert more[i][0] == pytest.approx(2 * base[i][0])
        else:
            assert more[i][0] == base[i][0]


def _leaves_holder_at(prof) -> int:
    """Smallest queue depth on the K/V holder (other node empty) at which a 1000-token user leaves."""
    r = make_router("racer", ["n0", "n1"], prof, guard_enabled=False, num_shards=4, residency_capacity=64,
                    load_aware=LOAD_AWARE_OFF)  # the plain expected-time rule
    for q in range(0, 65):
        r.report(NodeReport("n0", 0.0, queue_depth=q))
        r.report(NodeReport("n1", 0.0, queue_depth=0))
        r.state.kv.record(1, 0, 1_000, 0.0)
        if r.route(RouteRequest(1, 1_000, np.empty(0, dtype=np.int64)), 0.0).node_id == "n1":
            return q
    return 65


def test_decisions_move_in_the_documented_direction_when_miss_costs_change():
    # saved recompute 1000 * kv vs queueing q * svc: the user leaves once q * svc > 1000 * kv
    # (costs chosen so that no depth ties exactly)
    assert _leaves_holder_at(profile(kv=2.05, svc=100.0)) == 21
    assert _leaves_holder_at(profile(kv=3.05, svc=100.0)) == 31  # dearer recompute: more KV affinity
    assert _leaves_holder_at(profile(kv=1.05, svc=100.0)) == 11  # cheaper recompute: less
    assert _leaves_holder_at(profile(kv=2.05, svc=200.0)) == 11  # slower service: load weighs more
    assert _leaves_holder_at(profile(kv=0.01, svc=100.0)) == 1  # near-free recompute: load balancing


def test_emb_weight_direction():
    def pick(emb_cost):
        r = make_router("racer", ["n0", "n1"], profile(kv=2.0, emb=emb_cost), guard_enabled=False, num_shards=4,
                        residency_capacity=64)
        r.report(NodeReport("n0", 0.0, hot_shards=[0, 1, 2, 3]))
        r.state.kv.record(1, 1, 100, 0.0)  # n1 holds 100 tokens: 200 us of recompute
        return r.route(RouteRequest(1, 100, np.arange(40) % 4), 0.0).node_id  # 40 rows hot on n0

    assert pick(4.0) == "n1"  # 40 * 4 = 160 us of transfers < 200 us of recompute
    assert pick(6.0) == "n0"  # 40 * 6 = 240 us > 200 us: dearer transfers pull toward EMB locality


def test_offset_compares_nodes_of_different_capacity_by_their_wait():
    big, small = profile(svc=100.0, cap=64), profile(svc=100.0, cap=16)  # w_ld 6400 vs 1600
    r = make_router("racer", ["big", "small"], {"big": big, "small": small}, guard_enabled=False, num_shards=4)
    r.report(NodeReport("big", 0.0, queue_depth=10))  # 1000 us of wait
    r.report(NodeReport("small", 0.0, queue_depth=0))
    d = r.route(RouteRequest(1, 0, np.empty(0, dtype=np.int64)), 0.0)
    assert d.node_id == "small"  # without the offset the big node's larger w_ld would win
    b = d.breakdown()
    np.testing.assert_allclose(b.load_term_us + b.load_offset_us, [6_400.0 - 1_000.0, 6_400.0])
    for n, p in (("big", big), ("small", small)):
        i = r.state.index[n]
        q = [10, 0][i]
        assert b.score[i] - b.eps_us[i] - b.load_offset_us[i] == pytest.approx(
            expected_saving_us(p, cached_len=0, hot_items=0, queue_depth=q, history_len=0))


def test_profile_in_a_report_rederives_the_weights():
    r = make_router("racer", ["n0", "n1"], profile(kv=2.0, svc=100.0), guard_enabled=False, num_shards=4)
    old = r.state.weights
    r.report(NodeReport("n0", 0.0, profile=profile(kv=8.0, svc=100.0)))
    assert r.state.weights is not old
    np.testing.assert_allclose(r.state.weights.kv_us_per_token, [8.0, 2.0])
    np.testing.assert_allclose(old.kv_us_per_token, [2.0, 2.0])  # decisions made earlier keep their weights
    r.state.set_profile("n1", profile(kv=2.0, svc=300.0, cap=64))
    np.testing.assert_allclose(r.state.weights.ld_us, [6_400.0, 19_200.0])
    np.testing.assert_allclose(r.state.weights.load_offset_us, [12_800.0, 0.0])
    assert r.state.check_invariants() == []
