"""Request streams: determinism per seed, history bookkeeping, and each regime's defining shape."""

from __future__ import annotations

import numpy as np
import pytest

from workloads import RegimeConfig, generate, synthetic_trace


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(num_users=400, num_items=3_000, mean_seq_len=50, seed=3)


def arrays(s):
    return (s.arrival_s, s.user, s.history_len, s.num_new_items, s.num_candidates, s.prev_request)


@pytest.mark.parametrize("regime", ["steady", "trend", "burst"])
def test_same_seed_same_stream_other_seed_other_stream(trace, regime):
    a = generate(trace, regime=regime, rate_rps=500, duration_s=30, seed=7)
    b = generate(trace, regime=regime, rate_rps=500, duration_s=30, seed=7)
    c = generate(trace, regime=regime, rate_rps=500, duration_s=30, seed=8)
    for x, y in zip(arrays(a), arrays(b)):
        assert np.array_equal(x, y)
    assert a.bursts == b.bursts
    assert not np.array_equal(a.user[:100], c.user[:100])


@pytest.mark.parametrize("regime", ["steady", "trend", "burst"])
def test_histories_continue_request_to_request(trace, regime):
    s = generate(trace, regime=regime, rate_rps=400, duration_s=20, seed=1, max_history_len=10_000)
    assert np.all(np.diff(s.arrival_s) >= 0)
    assert s.arrival_s.min() >= 0 and s.arrival_s.max() <= 20
    has_prev = np.flatnonzero(s.prev_request >= 0)
    p = s.prev_request[has_prev]
    assert np.all(s.user[p] == s.user[has_prev]) and np.all(p < has_prev)
    # the next request's history is the previous history plus the previous new items
    assert np.array_equal(s.history_len[has_prev], s.history_len[p] + s.num_new_items[p])
    # and the item ids agree: what the KV cache holds is a prefix of the next history
    for i in has_prev[:50]:
        j = s.prev_request[i]
        prev_seq = np.concatenate([s.history(j), s.new_items(j)])
        assert np.array_equal(s.history(i)[: len(prev_seq)], prev_seq)
    req, items = s.all_new_items()
    for i in range(0, len(s), max(1, len(s) // 40)):
        assert np.array_equal(items[req == i], s.new_items(i))
    r = s.request(5)
    assert r.user == s.user[5] and len(r.history) == s.history_len[5] and r.num_candidates == 256


def test_users_beyond_the_trace_are_resampled(trace):
    s = generate(trace, rate_rps=2_000, duration_s=10, num_users=5_000, seed=2)
    assert s.num_users == 5_000 and s.user.max() >= trace.num_users
    assert np.array_equal(s.base_user[: trace.num_users], np.arange(trace.num_users))
    assert s.base_user.max() < trace.num_users
    i = int(np.flatnonzero(s.user >= trace.num_users)[0])
    h = s.history(i)
    base = trace.history(int(s.base_user[s.user[i]]))
    assert set(h.tolist()) <= set(base.tolist())  # replays (a rotation of) its base user's items


def test_steady_rate_is_stationary(trace):
    s = generate(trace, regime="steady", rate_rps=1_000, duration_s=60, seed=0)
    st = s.window_stats(10.0)
    assert abs(len(s) / 60 - 1_000) < 30
    assert np.all(np.abs(st["rate_rps"] - 1_000) < 60)
    assert np.ptp(st["hot_user_ratio"]) < 0.05
    assert s.bursts == []


def test_trend_drifts_rate_hot_users_and_history(trace):
    s = generate(trace, regime="trend", rate_rps=1_000, duration_s=60, seed=0)
    st = s.window_stats(15.0)
    first, last = 0, len(st["t_s"]) - 1
    assert st["rate_rps"][last] > 1.6 * st["rate_rps"][first]  # 0.6x -> 1.4x
    assert abs(len(s) / 60 - 1_000) < 30  # the mean stays at rate_rps
    assert st["hot_user_ratio"][last] > 2 * st["hot_user_ratio"][first]
    assert st["history_len_p50"][last] > 1.5 * st["history_len_p50"][first]
    steady = generate(trace, regime="steady", rate_rps=1_000, duration_s=60, seed=0).window_stats(15.0)
    assert abs(steady["hot_user_ratio"][last] - steady["hot_user_ratio"][first]) < 0.05


def test_burst_spikes_are_bounded_and_hot(trace):
    cfg = RegimeConfig(regime="burst", rate_rps=1_000, duration_s=90, seed=4, num_bursts=3,
                       burst_duration_s=4.0, burst_rate_mult=5.0)
    s = generate(trace, cfg)
    assert len(s.bursts) == 3
    for (a, b), (c, _) in zip(s.bursts, s.bursts[1:]):
        assert b - a == pytest.approx(4.0) and b <= c  # bounded, never overlapping
    inside = s.in_burst()
    rate_in = inside.sum() / 12.0
    rate_out = (~inside).sum() / 78.0
    assert 4.0 < rate_in / rate_out < 6.0
    st = s.window_stats(1.0)
    burst_win = np.zeros(len(st["t_s"]), dtype=bool)
    for a, b in s.bursts:
        burst_win |= (st["t_s"] > a + 0.5) & (st["t_s"] < b - 0.5)
    assert st["hot_user_ratio"][burst_win].min() > 3 * np.median(st["hot_user_ratio"][~burst_win])
    # the extra requests come from each burst's small hot set
    for (a, b), hot in zip(s.bursts, s.burst_hot_users):
        in_b = (s.arrival_s >= a) & (s.arrival_s < b)
        assert np.isin(s.user[in_b], hot).mean() > 0.7
    # a user hammering in a burst brings few new items per request (items accrue with time)
    in_hot = inside & np.isin(s.user, np.concatenate(s.burst_hot_users)) & (s.prev_request >= 0)
    assert s.num_new_items[in_hot].mean() < 1.0


@pytest.mark.parametrize("bad, message", [
    (dict(regime="spiky"), "regime must be one of"),
    (dict(rate_rps=0), "rate_rps must be a positive number"),
    (dict(duration_s=float("nan")), "duration_s must be a positive number"),
    (dict(num_users=0), "num_users must be a positive integer or None"),
    (dict(hot_user_fraction=1.5), "hot_user_fraction must be in (0, 1]"),
    (dict(num_candidates=-1), "num_candidates must be an integer >= 0"),
    (dict(regime="burst", duration_s=10, num_bursts=5, burst_duration_s=3), "do not fit"),
])
def test_bad_config_is_refused(trace, bad, message):
    with pytest.raises(ValueError) as e:
        generate(trace, **bad)
    assert message in str(e.value)


def test_summary_and_window_stats_shape(trace):
    s = generate(trace, regime="burst", rate_rps=300, duration_s=60, seed=0)
    summ = s.summary()
    assert summ["num_requests"] == len(s) and summ["num_bursts"] == 2
    assert 0 < summ["burst_request_share"] < 1
    st = s.window_stats(2.0)
    assert all(len(v) == 30 for v in st.values())
    with pytest.raises(ValueError):
        s.window_stats(0)
