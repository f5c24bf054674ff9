"""The session model (`workloads.sessions`) and the fleet workloads (`workloads.fleet_workloads`):
fitting recovers known gaps, streams are deterministic, time-ordered and at their declared rate,
trace order keeps each user's order, `describe` states its figures, bad inputs are refused."""

from __future__ import annotations

import numpy as np
import pytest

from workloads import synthetic_trace
from workloads.fleet_workloads import WORKLOADS, describe, workload_stream
from workloads.loaders import load_synthetic
from workloads.sessions import (StreamShape, fit_sessions, modelled_trace_order_stream, session_stream,
                                trace_order_stream, trace_requests)
from workloads.trace import build_trace

WITHIN_MEDIAN_S, WITHIN_LOG_SD = 40.0, 1.0
BETWEEN_MEDIAN_S, BETWEEN_LOG_SD = 8 * 3600.0, 0.7
SESSION_LEN_MEAN = 5.0


def session_trace(num_users: int = 60, sessions_per_user: int = 20, seed: int = 0):
    """Users with known sessions: geometric lengths (mean 5), lognormal gaps inside a session
    (median 40 s, log-sd 1.0) and between sessions (median 8 h, log-sd 0.7)."""
    rng = np.random.default_rng(seed)
    users, items, times = [], [], []
    for u in range(num_users):
        t = rng.uniform(0, 86_400)
        for _ in range(sessions_per_user):
            n = rng.geometric(1 / SESSION_LEN_MEAN)
            for k in range(n):
                if k:
                    t += rng.lognormal(np.log(WITHIN_MEDIAN_S), WITHIN_LOG_SD)
                users.append(str(u))
                items.append(str(rng.integers(0, 500)))
                times.append(t)
            t += rng.lognormal(np.log(BETWEEN_MEDIAN_S), BETWEEN_LOG_SD)
    return build_trace("sessions", "test", users, items, times)


@pytest.fixture(scope="module")
def strace():
    return session_trace()


@pytest.fixture(scope="module")
def synth():
    return synthetic_trace(num_users=120, num_items=2_000, mean_seq_len=40, seed=1)


def test_fit_recovers_the_known_gaps_and_lengths(strace):
    m = fit_sessions(strace)
    assert m.threshold_rule == "valley"
    assert 600 < m.threshold_s < 7200  # between the two modes, far from both
    assert m.within_gap_median_s == pytest.approx(WITHIN_MEDIAN_S, rel=0.15)
    assert m.within_gap_log_sd == pytest.approx(WITHIN_LOG_SD, abs=0.1)
    assert m.session_len_mean == pytest.approx(SESSION_LEN_MEAN, rel=0.1)
    assert m.between_gap_median_s == pytest.approx(BETWEEN_MEDIAN_S, rel=0.2)
    assert m.num_sessions == pytest.approx(60 * 20, rel=0.02)
    assert m.items_per_request == 1.0
    # the model's own sampler reproduces what it was fitted on
    rng = np.random.default_rng(0)
    assert np.median(m.sample_within_gaps(rng, 20_000)) == pytest.approx(WITHIN_MEDIAN_S, rel=0.15)
    assert m.sample_session_lengths(rng, 20_000).mean() == pytest.approx(SESSION_LEN_MEAN, rel=0.12)
    js = m.to_json()
    assert js["threshold_s"] == m.threshold_s and isinstance(js["within_gap_q_s"], list)


def test_fit_with_a_given_threshold_and_without_a_valley(strace, synth):
    m = fit_sessions(strace, threshold_s=600.0)
    assert (m.threshold_s, m.threshold_rule) == (600.0, "given")
    # exponential-like gaps (uniform times over a day) have no valley: the 30-minute rule
    s = fit_sessions(synth)
    assert (s.threshold_s, s.threshold_rule) == (1800.0, "default")
    assert s.num_requests == len(trace_requests(synth))


def test_requests_group_a_users_interactions_at_one_timestamp():
    tr = build_trace("t", "test", ["a", "a", "a", "b"], ["1", "2", "3", "1"], [10.0, 10.0, 20.0, 5.0])
    req = trace_requests(tr)
    assert req.num_items.tolist() == [2, 1, 1] and req.position.tolist() == [0, 2, 0]
    assert req.user.tolist() == [0, 0, 1]


def arrays(s):
    return (s.arrival_s, s.user, s.history_len, s.num_new_items, s.prev_request, s.base_user, s.rotation)


def test_session_stream_is_deterministic_ordered_and_at_its_rate(strace):
    a = session_stream(strace, rate_rps=200, duration_s=10, seed=3)
    b = session_stream(strace, rate_rps=200, duration_s=10, seed=3)
    c = session_stream(strace, rate_rps=200, duration_s=10, seed=4)
    for x, y in zip(arrays(a), arrays(b)):
        assert np.array_equal(x, y)
    assert not np.array_equal(a.arrival_s, c.arrival_s)
    assert len(a) == 2000  # with num_users: the first rate x duration requests
    assert np.all(np.diff(a.arrival_s) >= 0) and a.arrival_s.min() >= 0 and a.arrival_s.max() < 10
    has_prev = np.flatnonzero(a.prev_request >= 0)
    p = a.prev_request[has_prev]
    assert np.all(a.user[p] == a.user[has_prev]) and np.all(p < has_prev)
    assert np.array_equal(a.history_len[has_prev], a.history_len[p] + a.num_new_items[p])


def test_session_stream_over_a_modelled_span_has_its_rate_in_expectation(strace):
    n = [len(session_stream(strace, rate_rps=100, duration_s=20, seed=s, modelled_span_s=86_400.0))
         for s in range(4)]
    assert np.mean(n) == pytest.approx(2000, rel=0.1)


def test_sessions_keep_a_users_requests_close_in_time(strace):
    """Most of a user's next requests come within the session (10 modelled minutes) when
    sessions are drawn, far fewer when the same users are drawn independently."""
    from workloads.regimes import generate
    from workloads.sessions import modelled_session_stream, recent_share

    m = modelled_session_stream(strace, rate_rps=200, duration_s=10, seed=0)
    ind = generate(strace, regime="steady", rate_rps=200, duration_s=10, seed=0)
    window = 600.0 / m.modelled_s_per_s
    assert m.recent_share() > 0.6
    assert recent_share(ind, window) < 0.5 * m.recent_share()


def test_trace_order_keeps_each_users_order_and_the_relative_gaps(strace):
    m = modelled_trace_order_stream(strace, rate_rps=100, duration_s=10, start_s=86_400.0)
    s = m.stream
    assert len(s) == 1000 and np.all(np.diff(s.arrival_s) >= 0) and s.arrival_s.max() < 10
    req = trace_requests(strace)
    order = np.argsort(req.time_s, kind="stable")
    i0 = int(np.searchsorted(req.time_s[order], 86_400.0))
    sel = order[i0:i0 + 1000]
    assert np.array_equal(s.user, req.user[sel])
    t = req.time_s[sel]
    assert np.allclose(s.arrival_s * m.modelled_s_per_s, t - t[0])
    # each user's requests in their real order: history positions strictly increase
    for u in np.unique(s.user)[:20]:
        h = s.history_len[s.user == u]
        assert np.all(np.diff(h) > 0)
    has_prev = np.flatnonzero(s.prev_request >= 0)
    p = s.prev_request[has_prev]
    assert np.array_equal(s.history_len[has_prev], s.history_len[p] + s.num_new_items[p])
    # the history a request carries is the trace's items before it
    i = int(has_prev[0])
    u = int(s.user[i])
    pos = int(s.history_len[i])
    assert np.array_equal(s.history(i), strace.history(u)[:pos])


def test_trace_order_with_a_longer_history_tiles_older_items_in_front(strace):
    s = trace_order_stream(strace, rate_rps=100, duration_s=5, start_s=86_400.0, seed=2,
                           shape=StreamShape(history_scale=3.0))
    req = trace_requests(strace)
    order = np.argsort(req.time_s, kind="stable")
    sel = order[int(np.searchsorted(req.time_s[order], 86_400.0)):][:len(s)]
    lens = strace.seq_lens[s.user]
    j = req.position[sel]
    prefix = s.history_len - j
    assert np.all(prefix >= np.floor(lens * 2 * 0.5) - 1) and np.all(prefix <= lens * 2 + 1)
    for i in np.flatnonzero(j > 0)[:20]:  # the trace's own items come last, in their order
        h = s.history(int(i))
        assert np.array_equal(h[len(h) - j[i]:], strace.history(int(s.user[i]))[:j[i]])


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workloads_are_deterministic_and_at_their_rate(synth, name):
    a = workload_stream(name, synth, rate_rps=200, duration_s=10, seed=1)
    b = workload_stream(name, synth, rate_rps=200, duration_s=10, seed=1)
    for x, y in zip(arrays(a), arrays(b)):
        assert np.array_equal(x, y)
    assert np.all(np.diff(a.arrival_s) >= 0) and a.arrival_s.max() < 10
    # day's count is the rate in expectation (a fixed modelled day, the users from the rate);
    # kv-heavy and trace-order take exactly rate x duration requests; emb-heavy is Poisson
    assert len(a) == pytest.approx(2000, rel=0.2 if name == "day" else 0.1)


def test_describe_states_each_workloads_figures(synth):
    d = {name: describe(name, synth, rate_rps=200, duration_s=10) for name in WORKLOADS}
    for name, f in d.items():
        assert f["workload"] == name and f["description"] == WORKLOADS[name].description
        assert f["num_requests"] == pytest.approx(2000, rel=0.2)
        assert f["catalogue_size"] == 2_000 and 0 < f["num_distinct_items"] <= 2_000
        assert 0 <= f["recent_share_10min"] <= 1 and f["history_len_p90"] >= f["history_len_mean"] * 0.5
    # emb-heavy: nearly every request from a new user; kv-heavy: almost none
    assert d["emb-heavy"]["new_user_share"] > 0.8
    assert d["kv-heavy"]["new_user_share"] < 0.1 and d["kv-heavy"]["num_users"] < d["trace-order"]["num_users"]
    assert d["kv-heavy"]["user_return_p50_s"] < d["emb-heavy"]["user_return_p50_s"]
    assert d["day"]["modelled_span_h"] == 24.0
    assert d["day"]["trace_day"]["hour_swing"] >= 1.0 and len(d["day"]["trace_day"]["hour_counts"]) == 24


def test_day_follows_the_hour_curve():
    """On a trace whose requests all fall in the first half of the day, the day workload's
    requests do too (session starts laid on the curve)."""
    rng = np.random.default_rng(5)
    users, items, times = [], [], []
    for u in range(80):
        for d in range(5):
            t = d * 86_400 + rng.uniform(0, 40_000)
            for _ in range(rng.integers(1, 6)):
                users.append(str(u))
                items.append(str(rng.integers(0, 300)))
                times.append(t)
                t += rng.uniform(5, 120)
    tr = build_trace("half-day", "test", users, items, times)
    s = workload_stream("day", tr, rate_rps=50, duration_s=24, seed=0)
    assert np.mean(s.arrival_s < 12.5) > 0.9


def test_synthetic_spec_traces_work(synth):
    tr = load_synthetic("users=50,items=500,len=20,seed=2")
    assert len(session_stream(tr, rate_rps=20, duration_s=5)) == 100
    assert len(trace_order_stream(tr, rate_rps=20, duration_s=5)) == 100


@pytest.mark.parametrize("rate, duration", [(0, 10), (-1, 10), (10, 0), (float("nan"), 10), (10, float("inf")),
                                            (True, 10), ("10", 10)])
def test_non_positive_rate_or_duration_is_refused(synth, rate, duration):
    with pytest.raises(ValueError, match="rate_rps|duration_s"):
        workload_stream("day", synth, rate_rps=rate, duration_s=duration)
    with pytest.raises(ValueError, match="rate_rps|duration_s"):
        session_stream(synth, rate_rps=rate, duration_s=duration)
    with pytest.raises(ValueError, match="rate_rps|duration_s"):
        trace_order_stream(synth, rate_rps=rate, duration_s=duration)


def test_bad_inputs_give_clear_errors(synth, strace):
    with pytest.raises(ValueError, match="unknown workload 'nope'; choose one of kv-heavy, emb-heavy, day, "
                                         "trace-order"):
        workload_stream("nope", synth, rate_rps=10, duration_s=10)
    with pytest.raises(ValueError, match="unknown workload"):
        describe("steady", synth)
    with pytest.raises(ValueError, match="holds .* requests"):
        trace_order_stream(synth, rate_rps=1_000, duration_s=100)
    with pytest.raises(ValueError, match="threshold_s"):
        fit_sessions(synth, threshold_s=-5)
    with pytest.raises(ValueError, match="not both"):
        session_stream(strace, rate_rps=10, duration_s=10, num_users=5, modelled_span_s=3600)
    with pytest.raises(ValueError, match="num_users"):
        session_stream(strace, rate_rps=10, duration_s=10, num_users=0)
    with pytest.raises(ValueError, match="hour_curve"):
        session_stream(strace, rate_rps=10, duration_s=10, modelled_span_s=86_400, hour_curve=[1.0] * 23)
    days = build_trace("days", "test", ["a", "a", "b", "b"], ["1", "2", "1", "3"], [0.0, 86_400.0, 0.0, 172_800.0])
    with pytest.raises(ValueError, match="finer than hours"):
        workload_stream("day", days, rate_rps=1, duration_s=2)
    with pytest.raises(ValueError, match="history_scale"):
        trace_order_stream(strace, rate_rps=10, duration_s=10, shape=StreamShape(history_scale=0.5))
    with pytest.raises(ValueError, match="num_candidates"):
        StreamShape(num_candidates=-1)


def test_the_shuffled_control_keeps_each_users_sequence(strace):
    from bench.workload_splits import shuffled

    s = trace_order_stream(strace, rate_rps=100, duration_s=10, start_s=86_400.0)
    x = shuffled(s, seed=0)
    assert len(x) == len(s) and np.array_equal(np.sort(x.arrival_s), np.sort(s.arrival_s))
    assert not np.array_equal(x.user, s.user)
    for u in np.unique(s.user)[:20]:
        assert np.array_equal(x.history_len[x.user == u], s.history_len[s.user == u])
