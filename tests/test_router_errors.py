"""Bad input raises clear errors and leaves the router's state as it was."""

from __future__ import annotations

import numpy as np
import pytest

from gateway import (CostProfile, KvResidency, NodeReport, RequestBatch, RouteRequest, RouterConfig, derive_weights,
                     make_router)
from gateway.router import LoadAwareConfig

PROF = CostProfile(kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=5.0, service_time_us=10.0)


def cluster(name="racer", **cfg):
    return make_router(name, ["n0", "n1"], PROF, num_shards=8, residency_capacity=64, **cfg)


def no_items():
    return np.empty(0, dtype=np.int64)


def test_unknown_router_name():
    with pytest.raises(ValueError, match="unknown router 'random'; choose one of round_robin, least_load"):
        make_router("random", ["n0"], PROF)


def test_empty_or_repeated_node_set():
    with pytest.raises(ValueError, match="at least one node"):
        make_router("racer", [], PROF)
    with pytest.raises(ValueError, match="unique; repeated: \\['a'\\]"):
        make_router("racer", ["a", "b", "a"], PROF)
    with pytest.raises(ValueError, match="non-empty strings"):
        make_router("racer", ["a", 3], PROF)
    with pytest.raises(ValueError, match="2 nodes but 1 cost profiles"):
        make_router("racer", ["a", "b"], [PROF])
    with pytest.raises(ValueError, match="no cost profile for nodes \\['b'\\]"):
        make_router("racer", ["a", "b"], {"a": PROF})
    with pytest.raises(ValueError, match="needs at least one node"):
        derive_weights([])


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_recompute_us_per_token": -1.0}, r"kv_recompute_us_per_token must be in \[0, 100000\]"),
    ({"kv_recompute_us_per_token": 1e308}, r"kv_recompute_us_per_token must be in \[0, 100000\]"),
    ({"emb_transfer_us_per_row": float("nan")}, r"emb_transfer_us_per_row must be in \[0, 100000\]"),
    ({"service_time_us": float("inf")}, r"service_time_us must be in \[0, 6e\+07\]"),
    ({"service_time_us": 1.5e308}, r"service_time_us must be in \[0, 6e\+07\]"),
    ({"queue_capacity": 0}, r"queue_capacity must be an integer in \[1, 1000000\]"),
    ({"queue_capacity": 10**9}, r"queue_capacity must be an integer in \[1, 1000000\]"),
    ({"service_time_us": "fast"}, r"service_time_us must be in \[0, 6e\+07\], got .fast."),
])
def test_bad_cost_profile(kwargs, message):
    base = {"kv_recompute_us_per_token": 1.0, "emb_transfer_us_per_row": 1.0, "service_time_us": 1.0}
    with pytest.raises(ValueError, match=message):
        CostProfile(**{**base, **kwargs})


@pytest.mark.parametrize("field, value, message", [
    ("num_shards", 0, "num_shards must be a positive integer, got 0"),
    ("guard_rel_threshold", 0.5, "guard_rel_threshold must be a number >= 1, got 0.5"),
    ("guard_abs_threshold", -1.0, "guard_abs_threshold must be a number >= 0, got -1.0"),
    ("node_timeout_s", -1.0, "node_timeout_s must be a number >= 0, got -1.0"),
    ("tie_break_us", float("nan"), "tie_break_us must be a number >= 0, got nan"),
    ("residency_ways", 100, r"residency_ways must be an integer in \[1, 64\], got 100"),
    ("guard_enabled", 1, "guard_enabled must be a bool, got 1"),
    ("load_aware", LoadAwareConfig(hot_abs=float("inf")), "load_aware.hot_abs must be a number >= 0, got inf"),
])
def test_bad_config(field, value, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**{field: value}).validate()
    with pytest.raises(ValueError, match=message):
        make_router("racer", ["n0"], PROF, **{field: value})


def test_unknown_node_in_reports_and_completions():
    r = cluster()
    with pytest.raises(ValueError, match="unknown node 'n9' \\(known: n0, n1\\)"):
        r.report(NodeReport("n9", 0.0, queue_depth=1))
    with pytest.raises(ValueError, match="unknown node 'n9'"):
        r.complete("n9")
    with pytest.raises(ValueError, match="unknown node 5"):
        r.complete(5)
    with pytest.raises(ValueError, match="count must be an integer >= 0"):
        r.complete("n0", -1)


@pytest.mark.parametrize("kwargs, message", [
    ({"queue_depth": -1}, "queue_depth must be >= 0.0"),
    ({"queue_depth": float("nan")}, "queue_depth must be a finite number"),
    ({"evicted_users": [3, -2]}, "user ids must be >= 0"),
    ({"kv_users": [1, 2], "kv_cached_lens": [5]}, "differ in length"),
    ({"kv_users": [1]}, "kv_users and kv_cached_lens come together"),
    ({"kv_users": [1], "kv_cached_lens": [-5]}, "kv_cached_lens must be >= 0"),
])
def test_bad_report_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NodeReport("n0", 0.0, **kwargs)


def test_bad_hot_shards_change_nothing():
    r = cluster()
    with pytest.raises(ValueError, match="hot_shards of node 'n0' must be in \\[0, 8\\)"):
        r.report(NodeReport("n0", 1.0, seq=1, queue_depth=9, hot_shards=[1, 8]))
    with pytest.raises(ValueError, match="hot_shards of node 'n0' must be in"):
        r.report(NodeReport("n0", 1.0, seq=1, queue_depth=9, hot_shards=[-1]))
    assert r.state.queue[0] == 0 and r.state.last_seq[0] == -1 and not r.state.hot.hot.any()


@pytest.mark.parametrize("request_, error, message", [
    (RouteRequest(-1, 10, np.empty(0, dtype=np.int64)), ValueError, "user must be in \\[0, 2\\^63\\)"),
    (RouteRequest(1, -10, np.empty(0, dtype=np.int64)), ValueError, "history_len and num_new_items >= 0"),
    (RouteRequest(1, 10, np.empty(0, dtype=np.int64), -3), ValueError, "num_new_items >= 0"),
    (RouteRequest(1.5, 10, np.empty(0, dtype=np.int64)), TypeError, "user must be an integer"),
    (RouteRequest(1, 10, np.array([0, 9])), ValueError, "item_shards must be in \\[0, 8\\), got shard 9"),
    (RouteRequest(1, 10, np.array([0, -1])), ValueError, "non-negative integer shard ids"),
    (RouteRequest(1, 10, np.array([0.5])), ValueError, "non-negative integer shard ids"),
])
def test_bad_requests_raise_and_leave_state_unchanged(request_, error, message):
    r = cluster()
    with pytest.raises(error, match=message):
        r.route(request_, 0.0)
    assert r.state.queue.sum() == 0 and len(r.state.kv) == 0


def test_numpy_integers_are_accepted_and_bad_times_rejected():
    r = cluster()
    d = r.route(RouteRequest(np.int64(4), np.int32(10), np.array([1, 2]), np.int64(2)), 0.0)
    assert r.state.kv.lookup(4) == (d.node_index, 12)
    with pytest.raises(ValueError, match="now_s must be a finite number"):
        r.route(RouteRequest(4, 10, no_items()), float("nan"))


def test_bad_batches():
    with pytest.raises(ValueError, match="batch columns disagree"):
        RequestBatch([1, 2], [3], [0, 0], [0, 0, 0], [])
    with pytest.raises(ValueError, match="shard_offsets must start at 0"):
        RequestBatch([1], [3], [0], [0, 2], [1])
    with pytest.raises(ValueError, match="user ids must be >= 0"):
        RequestBatch([-1], [3], [0], [0, 0], [])
    r = cluster()
    with pytest.raises(ValueError, match="item shard ids must be in \\[0, 8\\)"):
        r.route_batch(RequestBatch([1], [3], [0], [0, 1], [12]), 0.0)
    with pytest.raises(TypeError, match="expected a RequestBatch"):
        r.route_batch([RouteRequest(1, 3, no_items())], 0.0)


def test_bad_residency_arguments():
    with pytest.raises(ValueError, match="capacity must be an integer >= 1"):
        KvResidency(capacity=0)
    with pytest.raises(ValueError, match="ways must be an integer >= 1"):
        KvResidency(capacity=8, ways=0)
    kv = KvResidency(capacity=8)
    with pytest.raises(ValueError, match="nodes and cached_lens must be >= 0"):
        kv.record_many([1, 2], [0, -1], [3, 3], 0.0)
    with pytest.raises(TypeError, match="user ids must be integers"):
        kv.find_many([1.5])
