"""Residency metadata: the bounded user -> node map, node reports, silent nodes."""

from __future__ import annotations

import numpy as np
import pytest

from gateway import CostProfile, KvResidency, NodeReport, NoLiveNodeError, RouteRequest, make_router
from gateway.residency import EMPTY, ENTRY_BYTES


def users_in_set(kv: KvResidency, set_index: int, count: int) -> list[int]:
    out, u = [], 0
    while len(out) < count:
        if kv._set_base(u) == set_index * kv.ways:
            out.append(u)
        u += 1
    return out


def test_lru_within_a_set_exact_eviction_order():
    kv = KvResidency(capacity=4, ways=2)
    assert (kv.num_sets, kv.capacity) == (2, 4)
    a, b, c, d = users_in_set(kv, 0, 4)
    (x,) = users_in_set(kv, 1, 1)
    assert kv.record(a, 0, 10, now_s=1.0) == EMPTY
    assert kv.record(b, 1, 20, now_s=2.0) == EMPTY
    assert kv.record(x, 1, 5, now_s=0.5) == EMPTY  # another set: never competes with a, b
    assert kv.keys[0:2].tolist() == [a, b] and len(kv) == 3
    assert kv.record(c, 0, 30, now_s=3.0) == a  # a is the oldest of set 0
    assert kv.keys[0:2].tolist() == [c, b]
    assert kv.lookup(a) == (-1, 0) and kv.lookup(c) == (0, 30)
    assert kv.record(b, 0, 25, now_s=4.0) == EMPTY  # b moves to node 0 and becomes the newest
    assert kv.lookup(b) == (0, 25)
    assert kv.record(d, 1, 40, now_s=5.0) == c  # now c is the oldest
    assert kv.keys[0:2].tolist() == [d, b] and kv.lookup(x) == (1, 5)
    assert len(kv) == 3 and kv.check_invariants(num_nodes=2) == []


def test_memory_is_bounded_and_recent_users_survive():
    kv = KvResidency(capacity=1024, ways=8)
    for t, u in enumerate(range(100_000)):
        kv.record(u, u % 3, 7, now_s=float(t))
    assert len(kv) == kv.capacity == 1024
    assert kv.nbytes == 1024 * ENTRY_BYTES
    recent = np.arange(100_000 - 100, 100_000)
    assert (kv.find_many(recent) >= 0).all()
    assert kv.check_invariants(num_nodes=3) == []


def test_record_many_matches_recording_one_by_one():
    rng = np.random.default_rng(0)
    users = rng.integers(0, 3_000, 5_000)
    nodes = rng.integers(0, 4, 5_000)
    lens = rng.integers(0, 900, 5_000)
    for cap in (64, 8192):  # 64: sets overflow, the rest goes through the LRU path
        one, many = KvResidency(cap, 4), KvResidency(cap, 4)
        many.record_many(users, nodes, lens, now_s=1.0)
        last = {}
        for u, n, c in zip(users.tolist(), nodes.tolist(), lens.tolist()):
            last[u] = (n, c)
        for u, (n, c) in last.items():
            one.record(u, n, c, now_s=1.0)
        assert one.check_invariants(4) == [] and many.check_invariants(4) == []
        assert len(one) == len(many)
        if cap == 8192:  # no overflow: identical content
            assert {u: many.lookup(u) for u in last} == last
        else:  # what survives agrees with the last write
            kept = [u for u in last if many.lookup(u)[0] >= 0]
            assert kept and all(many.lookup(u) == last[u] for u in kept)


def test_forget_many_respects_holder_and_time():
    kv = KvResidency(capacity=256)
    kv.record(1, 0, 10, now_s=5.0)
    kv.record(2, 1, 10, now_s=5.0)
    kv.record(3, 0, 10, now_s=9.0)
    # node 0 reports 1, 2, 3 evicted as of 6 s: 2 is on node 1, 3 was re-routed at 9 s
    assert kv.forget_many([1, 2, 3, 99], node=0, at_s=6.0) == 1
    assert kv.lookup(1) == (-1, 0) and kv.lookup(2) == (1, 10) and kv.lookup(3) == (0, 10)
    assert kv.forget_node(0) == 1 and kv.lookup(3) == (-1, 0)
    assert len(kv) == 1 and kv.check_invariants(2) == []


def router(**cfg):
    prof = CostProfile(kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=5.0, service_time_us=10.0,
                       queue_capacity=64)
    cfg = {"guard_enabled": False, "num_shards": 4, "residency_capacity": 256, **cfg}
    return make_router("racer", ["n0", "n1", "n2"], prof, **cfg)


def req(user, history_len=500):
    return RouteRequest(user, history_len, np.empty(0, dtype=np.int64))


def test_eviction_report_makes_the_router_forget_the_user():
    r = router()
    r.state.kv.record(5, 2, 500, 1.0)
    r.report(NodeReport("n0", 1.0, queue_depth=1))
    r.report(NodeReport("n1", 1.0, queue_depth=1))
    r.report(NodeReport("n2", 1.0, queue_depth=2))
    assert r.route(req(5), 2.0).node_id == "n2"  # returns to its K/V despite one more queued request
    out = r.report(NodeReport("n2", 3.0, seq=1, queue_depth=3, evicted_users=[5]))
    assert out.applied and out.num_forgotten == 1 and "forgot 1 evicted users" in out.reason
    assert r.state.kv.lookup(5) == (-1, 0)
    d = r.route(req(5), 4.0)
    assert d.kv_holder == -1 and d.node_id != "n2"
    assert r.state.check_invariants() == []


def test_eviction_report_does_not_undo_a_newer_routing_decision():
    r = router()
    d = r.route(req(8), now_s=10.0)
    out = r.report(NodeReport(d.node_id, 9.5, evicted_users=[8]))  # describes the node before the route
    assert out.num_forgotten == 0 and r.state.kv.lookup(8)[0] == d.node_index


def test_kv_confirmation_report_records_users():
    r = router()
    r.route(req(4), now_s=10.0)  # user 4 routed at 10 s
    out = r.report(NodeReport("n1", 12.0, kv_users=[1, 2, 3], kv_cached_lens=[100, 200, 300]))
    assert out.num_recorded == 3
    assert [r.state.kv.lookup(u) for u in (1, 2, 3)] == [(1, 100), (1, 200), (1, 300)]
    holder = r.state.kv.lookup(4)
    r.report(NodeReport("n2" if holder[0] != 2 else "n0", 9.0, kv_users=[4], kv_cached_lens=[50]))
    assert r.state.kv.lookup(4) == holder  # older than the routing decision: ignored
    assert r.state.check_invariants() == []


def test_silent_node_expires_forgets_its_users_and_comes_back_on_report():
    r = router(node_timeout_s=5.0, expiry_check_interval_s=1.0)
    r.report(NodeReport("n1", 0.0, hot_shards=[0, 1]))
    r.state.kv.record(1, 1, 400, 0.0)
    r.state.kv.record(2, 0, 400, 0.0)
    for t in (2.0, 4.0, 6.0):
        r.report(NodeReport("n0", t))
        r.report(NodeReport("n2", t))
    assert r.expire(5.0) == []  # n1 silent for exactly 5 s: not yet
    assert r.expire(6.0) == ["n1"]
    assert r.state.alive.tolist() == [True, False, True]
    assert r.state.kv.lookup(1) == (-1, 0) and r.state.kv.lookup(2) == (0, 400)
    assert r.state.hot.shards_of(1).tolist() == []
    assert r.state.check_invariants() == []
    for u in range(30):
        assert r.route(req(100 + u), 6.5).node_id != "n1"
    out = r.report(NodeReport("n1", 7.0, seq=3, queue_depth=0, hot_shards=[3]))
    assert out.revived and "back from silence" in out.reason
    assert r.state.alive.all() and r.state.hot.shards_of(1).tolist() == [3]
    assert r.state.check_invariants() == []


def test_routing_checks_expiry_at_its_interval():
    r = router(node_timeout_s=1.0, expiry_check_interval_s=10.0)
    r.route(req(1), 0.0)  # the first call checks (nothing silent); the next check is due at 10 s
    for t in (5.0, 9.5):
        r.report(NodeReport("n0", t))
        r.report(NodeReport("n1", t))
    r.route(req(2), 5.0)
    assert r.state.alive.all()  # n2 is silent, but no check was due
    r.route(req(3), 10.0)
    assert r.state.alive.tolist() == [True, True, False]


def test_all_nodes_silent_raises():
    r = router(node_timeout_s=1.0)
    r.expire(3.0)
    with pytest.raises(NoLiveNodeError, match="no live node"):
        r.route(req(1), 3.0)


def test_stale_and_replayed_reports_are_ignored():
    r = router()
    assert r.report(NodeReport("n0", 1.0, seq=5, queue_depth=7)).applied
    out = r.report(NodeReport("n0", 2.0, seq=5, queue_depth=0))
    assert not out.applied and out.reason == "stale: seq 5 <= last applied 5"
    assert r.state.queue[0] == 7
    assert not r.report(NodeReport("n0", 2.0, seq=4, queue_depth=0)).applied
    assert r.report(NodeReport("n0", 2.0, seq=6, queue_depth=1)).applied and r.state.queue[0] == 1


def test_bulk_views_of_the_map():
    kv = KvResidency(capacity=256)
    kv.record_many([10, 11, 12, 13], [0, 2, 2, 1], [5, 6, 7, 8], now_s=0.0)
    nodes, lens = kv.lookup_many([12, 99, 10])
    assert nodes.tolist() == [2, -1, 0] and lens.tolist() == [7, 0, 5]
    assert kv.count_by_node(3).tolist() == [1, 1, 2]
