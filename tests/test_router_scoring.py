"""Scripted scoring tests: KV return vs load, EMB locality, the breakdown, tie-breaks, batches."""

from __future__ import annotations

import numpy as np
import pytest

from gateway import (CostProfile, NodeReport, RequestBatch, RouteRequest, expected_saving_us, make_router,
                     score_nodes)
from gateway.router import LOAD_AWARE_OFF

KV_US, EMB_US, SVC_US, CAP = 2.0, 5.0, 100.0, 64


def profile(kv=KV_US, emb=EMB_US, svc=SVC_US, cap=CAP):
    return CostProfile(kv_recompute_us_per_token=kv, emb_transfer_us_per_row=emb, service_time_us=svc,
                       queue_capacity=cap)


def cluster(name="racer", n=2, prof=None, **cfg):
    cfg.setdefault("guard_enabled", False)
    cfg.setdefault("load_aware", LOAD_AWARE_OFF)  # the plain expected-time rule (tests/test_router_load.py: under load)
    cfg.setdefault("num_shards", 8)
    cfg.setdefault("residency_capacity", 1024)
    return make_router(name, [f"n{i}" for i in range(n)], prof or profile(), **cfg)


def req(user, history_len=1_000, shards=(), new=0):
    return RouteRequest(user, history_len, np.asarray(shards, dtype=np.int64), new)


def depth(router, node, q, at_s=0.0):
    router.report(NodeReport(node, at_s, queue_depth=q))


def test_returning_user_goes_back_to_its_kv_holder_until_the_load_outweighs_the_saved_recompute():
    r = cluster()
    depth(r, "n1", 1)  # n0 is less loaded: the first request lands there
    first = r.route(req(7, history_len=990, new=10), now_s=0.0)
    assert first.node_id == "n0" and first.kv_holder == -1
    assert r.state.kv.lookup(7) == (0, 1_000)  # optimistic: n0 now holds history + new items
    # the return saves 1000 tokens * 2 us = 2000 us of recompute; each queued request costs 100 us
    for q, want in [(0, "n0"), (10, "n0"), (19, "n0"), (21, "n1"), (40, "n1")]:
        depth(r, "n0", q)
        depth(r, "n1", 0)
        d = r.route(req(7, history_len=1_000), now_s=0.0)
        assert d.node_id == want, (q, d.reason)
        r.state.kv.record(7, 0, 1_000, 0.0)  # put the K/V back on n0 for the next step
        assert r.state.check_invariants() == []


def test_score_difference_is_the_expected_time_saved():
    r = cluster()
    r.report(NodeReport("n0", 0.0, queue_depth=3, hot_shards=[0, 1]))
    r.report(NodeReport("n1", 0.0, queue_depth=5, hot_shards=[1, 2, 3]))
    r.state.kv.record(11, 1, 400, 0.0)
    request = req(11, history_len=600, shards=[0, 0, 1, 2, 3, 3, 7])
    d = r.route(request, now_s=0.0)
    b = d.breakdown()
    p = profile()
    # n0: 3 of the 7 items hot (0, 0, 1), no K/V; n1: 4 hot (1, 2, 3, 3) and 400 of 600 tokens
    want = [expected_saving_us(p, cached_len=0, hot_items=3, queue_depth=3, history_len=600),
            expected_saving_us(p, cached_len=400, hot_items=4, queue_depth=5, history_len=600)]
    np.testing.assert_allclose(b.score - b.eps_us - b.load_offset_us, want)
    assert d.node_id == "n1" and d.source == "score"
    np.testing.assert_allclose(b.h_kv, [0.0, 400 / 600])
    np.testing.assert_allclose(b.h_emb, [3 / 7, 4 / 7])
    np.testing.assert_allclose(b.load, [3 / CAP, 5 / CAP])
    np.testing.assert_allclose(b.w_kv, [600 * KV_US] * 2)
    np.testing.assert_allclose(b.w_emb, [7 * EMB_US] * 2)
    np.testing.assert_allclose(b.w_ld, [CAP * SVC_US] * 2)
    np.testing.assert_allclose(b.kv_term_us + b.emb_term_us + b.load_term_us + b.load_offset_us + b.eps_us, b.score)
    assert "holder n1" in d.reason and d.reason.startswith("score: node n1")
    rows = b.rows()
    assert [row["node"] for row in rows] == ["n0", "n1"] and rows[1]["h_kv"] == pytest.approx(2 / 3)


def test_emb_locality_picks_the_node_with_the_request_shards_hot():
    r = cluster(n=3)
    r.report(NodeReport("n0", 0.0, hot_shards=[0, 1]))
    r.report(NodeReport("n1", 0.0, hot_shards=[4, 5, 6]))
    r.report(NodeReport("n2", 0.0, hot_shards=[]))
    assert r.route(req(1, shards=[4, 5, 6, 6, 0]), 0.0).node_id == "n1"
    assert r.route(req(2, shards=[0, 1, 1, 7]), 0.0).node_id == "n0"


def test_user_kv_outweighs_emb_locality_when_recompute_is_the_bigger_saving():
    r = cluster(n=2)
    r.report(NodeReport("n0", 0.0, hot_shards=list(range(8))))  # every item hot on n0: 10 rows * 5 us = 50 us
    r.state.kv.record(3, 1, 1_000, 0.0)  # n1 holds 1000 tokens: 2000 us
    assert r.route(req(3, history_len=1_000, shards=range(8)), 0.0).node_id == "n1"
    r.state.kv.record(3, 1, 10, 0.0)  # n1 holds only 10 tokens: 20 us < 40 us of EMB on n0
    assert r.route(req(3, history_len=1_000, shards=range(8)), 0.0).node_id == "n0"


def test_cached_length_beyond_the_history_counts_as_the_whole_history():
    r = cluster()
    r.state.kv.record(5, 0, 5_000, 0.0)
    b = r.route(req(5, history_len=100), 0.0).breakdown()
    assert b.h_kv[0] == 1.0 and b.kv_term_us[0] == pytest.approx(100 * KV_US)


def test_tie_break_is_seeded_and_spreads_equal_nodes():
    def choices(seed):
        r = cluster(n=4, seed=seed)
        out = []
        for u in range(200):
            d = r.route(req(u, history_len=0), 0.0)
            r.complete(d.node_index)  # keep every node empty: all scores tie but for eps
            out.append(d.node_index)
        return out

    a, b, c = choices(0), choices(0), choices(1)
    assert a == b and a != c
    assert set(a) == {0, 1, 2, 3}


def test_score_nodes_is_pure():
    r = cluster(n=3)
    st = r.state
    st.kv.record(9, 2, 50, 0.0)
    before = (st.queue.copy(), st.kv.lookup(9), len(st.kv), st.ld_term.copy())
    eps = np.zeros(3)
    d1 = score_nodes(st, req(9, history_len=50), eps, eps)
    d2 = score_nodes(st, req(9, history_len=50), eps, eps)
    assert d1.node_index == d2.node_index == 2
    np.testing.assert_array_equal(d1.score, d2.score)
    after = (st.queue, st.kv.lookup(9), len(st.kv), st.ld_term)
    np.testing.assert_array_equal(before[0], after[0])
    assert before[1:3] == after[1:3]
    np.testing.assert_array_equal(before[3], after[3])


def test_breakdown_describes_the_state_the_decision_was_made_in():
    r = cluster()
    depth(r, "n1", 4)
    d = r.route(req(1, history_len=10), 0.0)
    depth(r, "n0", 30)
    depth(r, "n1", 0)
    b = d.breakdown()
    np.testing.assert_allclose(b.load, [0.0, 4 / CAP])


@pytest.mark.parametrize("name", ["racer", "kv_aware", "emb_aware", "round_robin", "least_load", "user_affinity"])
def test_route_batch_decides_like_routing_one_by_one(name):
    rng = np.random.default_rng(3)
    requests = [req(int(rng.integers(0, 30)), int(rng.integers(0, 500)), rng.integers(0, 8, int(rng.integers(0, 12))),
                    int(rng.integers(0, 4))) for _ in range(120)]

    def fresh():
        r = cluster(name, n=5, prof=profile(svc=0.01), guard_enabled=True, guard_abs_threshold=6.0)
        for i in range(5):
            r.report(NodeReport(f"n{i}", 0.0, queue_depth=i, hot_shards=rng_sets[i]))
        return r

    rng_sets = [np.random.default_rng(i).choice(8, 3, replace=False) for i in range(5)]
    one, many = fresh(), fresh()
    seq = [one.route(q, 1.0) for q in requests]
    batch = many.route_batch(RequestBatch.from_requests(requests), 1.0)
    assert batch.node_index.tolist() == [d.node_index for d in seq]
    assert batch.guard_fired.tolist() == [d.guard_fired for d in seq]
    assert batch.kv_holder.tolist() == [d.kv_holder for d in seq]
    np.testing.assert_array_equal(one.state.queue, many.state.queue)
    assert one.state.check_invariants() == [] and many.state.check_invariants() == []
    if name == "racer":  # KV + EMB piles requests up until the guard steps in
        assert any(d.source == "guard" for d in seq)


def test_completion_lowers_the_load():
    r = cluster()
    for _ in range(3):
        r.route(req(1), 0.0)
    assert r.state.queue.sum() == 3
    r.complete("n0", int(r.state.queue[0]))
    r.complete(1, int(r.state.queue[1]))
    assert r.state.queue.tolist() == [0.0, 0.0]
    r.complete("n0")  # never below zero
    assert r.state.queue[0] == 0.0 and r.state.check_invariants() == []


def test_request_from_items_uses_the_trace_shard_map():
    from workloads import shard_map

    item_shard = shard_map(1_000, 8)
    items = np.array([3, 14, 159, 265])
    r = RouteRequest.from_items(5, 40, items, item_shard, num_new_items=4)
    assert r.item_shards.tolist() == item_shard[items].tolist() and r.num_new_items == 4
    router = cluster()
    router.report(NodeReport("n1", 0.0, hot_shards=np.unique(item_shard[items])))
    d = router.route(r, 0.0)
    assert d.node_id == "n1" and d.breakdown().h_emb.tolist() == [0.0, 1.0]
