"""The feature contract: exact values on hand-made stats, validation, the in-place buffer."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from node_agent.features import (FEATURE_HIGH, FEATURE_LOW, FEATURE_NAMES, FEATURE_SPECS, NUM_FEATURES, SCHEMA_PREFIX,
                               SCHEMA_VERSION, FeatureError, WindowStats, build_features, miss_costs_us)


def stats(**kw) -> WindowStats:
    base = dict(interval_s=1.0, num_requests=1000, arrival_rate_rps=1e5, hot_user_ratio=0.25,
                history_len_p50=math.sqrt(16385.0) - 1, history_len_p99=16384.0, emb_lookups_per_request=0.0,
                emb_hit_rate=0.75, kv_hit_rate=0.5, kv_recompute_us_per_token=100.0,
                emb_transfer_us_per_row=math.sqrt(101.0) - 1, emb_share=0.4, load=0.3, p99_ms=45.0, slo_ms=30.0,
                refill_bytes=2e9, arena_bytes=8e9)
    base.update(kw)
    return WindowStats(**base)


def test_schema_names_are_ordered_unique_and_versioned():
    assert SCHEMA_VERSION == 3
    assert NUM_FEATURES == 22 == len(set(FEATURE_NAMES))
    assert FEATURE_NAMES == (
        "arrival_rate_log", "hot_user_ratio", "history_len_p50_log", "history_len_p99_log", "emb_lookups_log",
        "emb_hit_rate", "kv_hit_rate", "kv_recompute_cost_log", "emb_transfer_cost_log", "kv_miss_cost_share",
        "emb_share", "load", "p99_over_slo", "refill_fraction", "hot_user_ratio_delta", "arrival_rate_log_delta",
        "table_over_arena_log", "arena_users_log", "kv_miss_time_frac", "emb_miss_time_frac", "kv_marginal_frac",
        "emb_marginal_frac")
    assert SCHEMA_PREFIX == {2: 16}  # schema 2's features are schema 3's first 16, unchanged
    assert [s.name for s in FEATURE_SPECS] == list(FEATURE_NAMES)
    assert (FEATURE_LOW < FEATURE_HIGH).all()


def test_exact_values_on_hand_made_stats_without_prev():
    f = build_features(stats())
    assert f.dtype == np.float32 and f.shape == (NUM_FEATURES,)
    expected = {
        "arrival_rate_log": 1.0,              # log1p(1e5) / log1p(1e5)
        "hot_user_ratio": 0.25,
        "history_len_p50_log": 0.5,           # log1p(sqrt(16385) - 1) = log(16385) / 2
        "history_len_p99_log": 1.0,
        "emb_lookups_log": 0.0,
        "emb_hit_rate": 0.75,
        "kv_hit_rate": 0.5,
        "kv_recompute_cost_log": 1.0,         # log1p(100) / log1p(100)
        "emb_transfer_cost_log": 0.5,         # log1p(sqrt(101) - 1) = log(101) / 2
        "kv_miss_cost_share": 1.0,            # no embedding lookups: all miss time is KV recompute
        "emb_share": 0.4,
        "load": 0.3,
        "p99_over_slo": 1.5,                  # 45 / 30
        "refill_fraction": 0.25,              # 2e9 / 8e9
        "hot_user_ratio_delta": 0.0,          # no prev
        "arrival_rate_log_delta": 0.0,
        "table_over_arena_log": 0.0,          # table and token bytes unknown (left 0)
        "arena_users_log": 0.0,
        # busy_us = 0.3 * 1 s / 1000 requests = 300 us; kv_miss_us = 0.5 * 127.0 * 100 = 6350 us
        "kv_miss_time_frac": 1.0,             # clipped
        "emb_miss_time_frac": 0.0,            # no embedding lookups
        "kv_marginal_frac": 0.0,              # ghost lists off
        "emb_marginal_frac": 0.0,
    }
    np.testing.assert_allclose(f, np.array([expected[n] for n in FEATURE_NAMES], np.float32), rtol=0, atol=1e-7)


def test_deltas_against_prev_and_miss_cost_share():
    prev = stats(hot_user_ratio=0.1, arrival_rate_rps=math.sqrt(100001.0) - 1)
    cur = stats(kv_hit_rate=0.5, history_len_p50=100.0, history_len_p99=400.0, kv_recompute_us_per_token=0.2,
                emb_hit_rate=0.75, emb_lookups_per_request=40.0, emb_transfer_us_per_row=1.0)
    assert miss_costs_us(cur) == pytest.approx((10.0, 10.0))  # 0.5*100*0.2 and 0.25*40*1
    f = dict(zip(FEATURE_NAMES, build_features(cur, prev)))
    assert f["kv_miss_cost_share"] == pytest.approx(0.5, abs=1e-7)
    assert f["hot_user_ratio_delta"] == pytest.approx(0.15, abs=1e-7)
    assert f["arrival_rate_log_delta"] == pytest.approx(0.5, abs=1e-7)  # 1.0 - 0.5
    # no misses at all: the share is neutral
    f0 = dict(zip(FEATURE_NAMES, build_features(stats(kv_hit_rate=1.0, emb_hit_rate=1.0))))
    assert f0["kv_miss_cost_share"] == 0.5


def test_schema3_features_are_normalised_by_cost_profile_and_arena():
    # arena 8e9 B; table 8e12 B; median user 100 tokens x 8e5 B = 8e7 B -> 100 users fit
    st = stats(table_bytes=8e9 * 1e3, kv_bytes_per_token=8e5, history_len_p50=100.0, history_len_p99=400.0,
               kv_hit_rate=0.5, kv_recompute_us_per_token=0.2, emb_hit_rate=0.75, emb_lookups_per_request=40.0,
               emb_transfer_us_per_row=1.0, load=0.5, num_requests=10_000, emb_marginal_us=5.0, kv_marginal_us=20.0)
    f = dict(zip(FEATURE_NAMES, build_features(st)))
    assert f["table_over_arena_log"] == pytest.approx(1.0, abs=1e-6)  # log1p(1e3) / log1p(1e3)
    assert f["arena_users_log"] == pytest.approx(math.log1p(100) / math.log1p(1e4), abs=1e-6)
    # busy_us = 0.5 * 1e6 / 1e4 = 50 us; miss times 10 us each (see the test above); marginals 20 and 5 us
    assert f["kv_miss_time_frac"] == pytest.approx(0.2, abs=1e-7)
    assert f["emb_miss_time_frac"] == pytest.approx(0.2, abs=1e-7)
    assert f["kv_marginal_frac"] == pytest.approx(0.4, abs=1e-7)
    assert f["emb_marginal_frac"] == pytest.approx(0.1, abs=1e-7)
    # the same node on a model twice as fast and an arena twice as large reads the same shares of its time
    g = dict(zip(FEATURE_NAMES, build_features(replace(
        st, kv_recompute_us_per_token=0.1, emb_transfer_us_per_row=0.5, load=0.25, emb_marginal_us=2.5,
        kv_marginal_us=10.0, arena_bytes=16e9, table_bytes=16e9 * 1e3, kv_bytes_per_token=16e5))))
    for k in ("table_over_arena_log", "arena_users_log", "kv_miss_time_frac", "emb_miss_time_frac",
              "kv_marginal_frac", "emb_marginal_frac"):
        assert g[k] == pytest.approx(f[k], abs=1e-6), k
    # no request completed, or never busy: no evidence, 0
    idle = dict(zip(FEATURE_NAMES, build_features(replace(st, num_requests=0))))
    assert idle["kv_miss_time_frac"] == idle["kv_marginal_frac"] == 0.0
    assert dict(zip(FEATURE_NAMES, build_features(replace(st, load=0.0))))["emb_miss_time_frac"] == 0.0


def test_clipping_keeps_every_feature_in_its_box():
    big = stats(arrival_rate_rps=1e30, history_len_p50=1e30, history_len_p99=1e31, emb_lookups_per_request=1e30,
                kv_recompute_us_per_token=1e30, emb_transfer_us_per_row=1e30, p99_ms=1e9, refill_bytes=1e15,
                table_bytes=1e30, kv_bytes_per_token=1e-30, emb_marginal_us=1e30, kv_marginal_us=1e30)
    f = build_features(big, prev=stats(arrival_rate_rps=0.0, hot_user_ratio=1.0))
    d = dict(zip(FEATURE_NAMES, f))
    assert d["arrival_rate_log"] == 2.0 and d["history_len_p99_log"] == 2.0 and d["p99_over_slo"] == 4.0
    assert d["refill_fraction"] == 1.0 and d["arrival_rate_log_delta"] == 2.0
    assert d["table_over_arena_log"] == 2.0 and d["kv_marginal_frac"] == d["emb_miss_time_frac"] == 1.0
    assert d["hot_user_ratio_delta"] == pytest.approx(-0.75)
    assert (f >= FEATURE_LOW).all() and (f <= FEATURE_HIGH).all()


def test_miss_costs_that_overflow_keep_every_feature_in_its_box():
    # each field finite, their product not: the share goes to the infinite side, never NaN
    f = dict(zip(FEATURE_NAMES, build_features(stats(history_len_p50=1e200, history_len_p99=1e200,
                                                       kv_recompute_us_per_token=1e200, kv_hit_rate=0.0))))
    assert f["kv_miss_cost_share"] == 1.0 and f["kv_miss_time_frac"] == 1.0
    both = build_features(stats(history_len_p50=1e200, history_len_p99=1e200, kv_recompute_us_per_token=1e200,
                                kv_hit_rate=0.0, emb_lookups_per_request=1e200, emb_transfer_us_per_row=1e200,
                                emb_hit_rate=0.0))
    assert dict(zip(FEATURE_NAMES, both))["kv_miss_cost_share"] == 0.5
    assert np.all(np.isfinite(both)) and (both >= FEATURE_LOW).all() and (both <= FEATURE_HIGH).all()


def test_writes_in_place_into_the_callers_buffer():
    buf = np.full((1, NUM_FEATURES), -9.0, np.float32)
    out = build_features(stats(), out=buf[0])
    assert out is buf[0] or np.shares_memory(out, buf)
    np.testing.assert_array_equal(buf[0], build_features(stats()))


@pytest.mark.parametrize("field,value,words", [
    ("p99_ms", float("nan"), "p99_ms must be finite"),
    ("arrival_rate_rps", float("inf"), "arrival_rate_rps must be finite"),
    ("hot_user_ratio", 1.2, "hot_user_ratio must be in [0, 1]"),
    ("emb_share", -0.1, "emb_share must be in [0, 1]"),
    ("slo_ms", 0.0, "slo_ms must be > 0"),
    ("refill_bytes", -1.0, "refill_bytes must be >= 0"),
    ("table_bytes", -1.0, "table_bytes must be >= 0"),
    ("kv_bytes_per_token", float("nan"), "kv_bytes_per_token must be finite"),
    ("arrival_hot_user_ratio", 1.5, "arrival_hot_user_ratio must be in [0, 1]"),
    ("arrival_hot_user_ratio", float("nan"), "arrival_hot_user_ratio must be finite"),
    ("history_len_p50", 20000.0, "history_len_p50 must be <= history_len_p99"),
    ("load", "high", "load must be a number"),
    ("num_requests", 2.5, "num_requests must be a whole number"),
])
def test_invalid_stats_raise_naming_the_field(field, value, words):
    bad = replace(stats(), **{field: value})
    with pytest.raises(FeatureError) as e:
        build_features(bad)
    assert words in str(e.value)


def test_validate_is_the_full_check():
    # a bool is arithmetically 1 and passes build_features' fast path; validate() names it
    with pytest.raises(FeatureError, match="kv_hit_rate must be a number"):
        replace(stats(), kv_hit_rate=True).validate()


def test_every_problem_is_listed_and_prev_is_checked():
    bad = replace(stats(), p99_ms=float("nan"), load=2.0)
    with pytest.raises(FeatureError) as e:
        build_features(bad)
    assert len(e.value.problems) == 2
    with pytest.raises(FeatureError, match=r"prev\.hot_user_ratio must be finite"):
        build_features(stats(), prev=replace(stats(), hot_user_ratio=float("nan")))
    assert stats().problems() == []
