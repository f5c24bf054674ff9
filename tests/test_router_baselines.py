"""Every baseline behaves as named, behind the one interface of `make_router`."""

from __future__ import annotations

import numpy as np
import pytest

from gateway import POLICIES, ROUTERS, CostProfile, NodeReport, RouteRequest, make_router

NODES = ["n0", "n1", "n2", "n3"]


def profile(cap=64):
    return CostProfile(kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=5.0, service_time_us=10.0,
                       queue_capacity=cap)


def cluster(name, nodes=NODES, prof=None, **cfg):
    cfg = {"guard_enabled": False, "num_shards": 8, "residency_capacity": 4096, **cfg}
    return make_router(name, nodes, prof or profile(), **cfg)


def req(user, history_len=100, shards=()):
    return RouteRequest(user, history_len, np.asarray(shards, dtype=np.int64))


def test_registry_has_every_policy_by_name():
    assert tuple(ROUTERS) == POLICIES
    for name in POLICIES:
        r = cluster(name)
        assert r.name == name
        d = r.route(req(1), 0.0)
        assert d.policy == name and d.node_id in NODES
        assert r.state.kv.lookup(1) == (d.node_index, 100)  # every policy records residency
        assert r.state.check_invariants() == []


def test_round_robin_cycles_and_skips_silent_nodes():
    r = cluster("round_robin", node_timeout_s=5.0)
    r.report(NodeReport("n0", 0.0, queue_depth=50))  # load and K/V do not matter
    r.state.kv.record(1, 3, 1_000, 0.0)
    assert [r.route(req(1), 0.0).node_id for _ in range(6)] == ["n0", "n1", "n2", "n3", "n0", "n1"]
    for n in ("n0", "n1", "n3"):
        r.report(NodeReport(n, 4.0))
    r.expire(6.0)  # n2 silent
    d = [r.route(req(2), 6.0) for _ in range(4)]
    assert [x.node_id for x in d] == ["n3", "n0", "n1", "n3"]
    assert "skipped 1 silent" in d[0].reason and d[0].breakdown() is None


def test_least_load_picks_the_lowest_queue_fraction():
    r = make_router("least_load", ["big", "small"], {"big": profile(cap=100), "small": profile(cap=10)},
                    num_shards=8, residency_capacity=64)
    r.report(NodeReport("big", 0.0, queue_depth=20))  # l = 0.2
    r.report(NodeReport("small", 0.0, queue_depth=3))  # l = 0.3
    r.state.kv.record(1, 1, 10_000, 0.0)  # K/V on small is ignored
    d = r.route(req(1, history_len=10_000), 0.0)
    assert d.node_id == "big" and d.source == "least_load" and "l=0.200" in d.reason
    r.report(NodeReport("big", 0.0, queue_depth=40))  # l = 0.4
    assert r.route(req(1), 0.0).node_id == "small"


def test_user_affinity_is_sticky_spread_and_consistent():
    r = cluster("user_affinity", node_timeout_s=5.0)
    r.report(NodeReport("n0", 0.0, queue_depth=60))  # load does not matter
    first = {u: r.route(req(u), 0.0).node_index for u in range(2_000)}
    again = {u: r.route(req(u), 0.0).node_index for u in range(2_000)}
    assert first == again == {u: r.owner(u) for u in range(2_000)}
    share = np.bincount(list(first.values()), minlength=4) / 2_000
    assert share.min() > 0.12 and share.max() < 0.40, share
    for n in ("n0", "n2", "n3"):
        r.report(NodeReport(n, 4.0))
    r.expire(6.0)  # n1 silent: only its users move
    after = {u: r.route(req(u), 6.0) for u in range(2_000)}
    for u, d in after.items():
        if first[u] != 1:
            assert d.node_index == first[u]
        else:
            assert d.node_index != 1 and "owner n1 silent" in d.reason


def test_kv_aware_follows_kv_and_ignores_embedding_locality():
    r = cluster("kv_aware")
    r.report(NodeReport("n0", 0.0, hot_shards=list(range(8)), queue_depth=1))
    for n in ("n1", "n2", "n3"):
        r.report(NodeReport(n, 0.0, queue_depth=2))
    r.state.kv.record(1, 2, 500, 0.0)  # 1000 us of recompute saved on n2
    d = r.route(req(1, history_len=500, shards=[0, 1, 2] * 20), 0.0)
    assert d.node_id == "n2"
    b = d.breakdown()
    assert np.isnan(b.h_emb).all() and (b.w_emb == 0).all() and (b.emb_term_us == 0).all()
    d = r.route(req(2, history_len=500, shards=[0, 1, 2] * 20), 0.0)  # no K/V anywhere: least wait wins
    assert d.node_id == "n0"
    r.report(NodeReport("n0", 0.0, queue_depth=3))
    assert r.route(req(3, history_len=500, shards=[0, 1, 2] * 20), 0.0).node_id != "n0"  # EMB pull ignored


def test_emb_aware_follows_hot_shards_and_ignores_kv():
    r = cluster("emb_aware")
    r.report(NodeReport("n3", 0.0, hot_shards=[5, 6]))
    r.state.kv.record(1, 0, 5_000, 0.0)  # 10 ms of recompute on n0: ignored
    d = r.route(req(1, history_len=5_000, shards=[5, 6, 6, 5]), 0.0)
    assert d.node_id == "n3"
    b = d.breakdown()
    assert b.h_kv[0] == 1.0 and (b.w_kv == 0).all() and (b.kv_term_us == 0).all()


def test_racer_weighs_both():
    r = cluster("racer")
    r.report(NodeReport("n3", 0.0, hot_shards=[5, 6]))
    r.state.kv.record(1, 0, 5_000, 0.0)
    assert r.route(req(1, history_len=5_000, shards=[5, 6, 6, 5]), 0.0).node_id == "n0"  # 10 ms > 20 us
    assert r.route(req(2, history_len=5_000, shards=[5, 6, 6, 5]), 0.0).node_id == "n3"


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_routes_many_requests_consistently(name):
    rng = np.random.default_rng(1)
    r = cluster(name, guard_enabled=True, guard_abs_threshold=16.0)
    for i, n in enumerate(NODES):
        r.report(NodeReport(n, 0.0, seq=0, hot_shards=rng.choice(8, 3, replace=False)))
    inflight = []
    for k in range(1_500):
        d = r.route(req(int(rng.integers(0, 300)), int(rng.integers(0, 400)), rng.integers(0, 8, 6)), k * 1e-3)
        inflight.append(d.node_index)
        if len(inflight) > 12:
            r.complete(inflight.pop(0))
        if k % 100 == 0:
            n = int(rng.integers(0, 4))
            r.report(NodeReport(NODES[n], k * 1e-3, seq=k + 1, queue_depth=float(r.state.queue[n]),
                                evicted_users=rng.integers(0, 300, 10)))
            assert r.state.check_invariants() == []
    assert r.state.queue.sum() == len(inflight)
