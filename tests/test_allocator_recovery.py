"""The burst recovery controller: hysteresis on scripted sequences (enter, hold, exit, hand back)."""

from __future__ import annotations

import numpy as np
import pytest

from node_agent.allocator import (AllocatorConfig, GuardConfig, RecoveryConfig, RecoveryController, ResidualConfig,
                                  SmartAllocator)
from tests.test_allocator import constant_policy, window

NORMAL = dict(arrival_rate_rps=1000.0, hot_user_ratio=0.02)
BURST = dict(arrival_rate_rps=4000.0, hot_user_ratio=0.12)    # x4 rate, x6 hot-user ratio
BETWEEN = dict(arrival_rate_rps=1500.0, hot_user_ratio=0.03)  # x1.5 both: above exit (1.3), below enter


@pytest.fixture(scope="module")
def c60(tmp_path_factory):
    return constant_policy(tmp_path_factory.mktemp("rec") / "c60", 0.6)


def allocator(policy, **recovery) -> SmartAllocator:
    cfg = AllocatorConfig(recovery=RecoveryConfig(**recovery), residual=ResidualConfig(enabled=False), device="cpu")
    return SmartAllocator(cfg, policy_dir=policy)


def run(alloc, script, t0=0):
    return {t0 + i: alloc.decide(window(**kw), float(t0 + i)) for i, kw in enumerate(script)}


@pytest.mark.parametrize("paced, load", [(False, 0.3), (True, 0.3), (True, 1.0), (False, 1.0)])
def test_scripted_burst_enter_hold_exit_hand_back(c60, paced, load):
    alloc = allocator(c60, paced=paced)
    at_once = not paced  # a KV-ward step in a burst is not paced, saturated node or not
    script = [NORMAL] * 12 + [BETWEEN] + [NORMAL] * 7 + [BURST, BURST] + [BETWEEN] * 4 + [NORMAL] * 4
    d = {}
    for t, kw in enumerate(script):
        d[t] = alloc.decide(window(**kw, load=load), float(t))
        if t == 19:
            baseline = (alloc.recovery.rate_baseline, alloc.recovery.hot_baseline)
        if t == 26:
            assert (alloc.recovery.rate_baseline, alloc.recovery.hot_baseline) == baseline  # frozen in the burst
    share = {t: round(x.emb_share, 6) for t, x in d.items()}
    source = {t: x.source for t, x in d.items()}

    # steady, and the in-between level does not start a burst (enter thresholds are higher)
    assert all(source[t] == "base" and share[t] == 0.6 for t in range(20))
    assert not d[12].recovery_active
    # enter at t=20: cap = 0.6 - kv_shift 0.15 = 0.45, at once (the step-down limit waived), or in
    # two steps (max_step_down 0.1) when paced
    assert "burst entered at t=20s" in d[20].reason and "KV-ward cap 0.4500" in d[20].reason
    if at_once:
        assert d[20].recovery_active and source[20] == "recovery" and share[20] == 0.45
        assert "KV-ward step 0.1500 taken at once, not paced by max_step_down 0.1" in d[20].reason
    else:
        assert d[20].recovery_active and source[20] == "guard" and share[20] == 0.5
        assert "not paced" not in d[20].reason
    assert source[21] == "recovery" and share[21] == 0.45
    # hold: the in-between level keeps the burst (above the exit thresholds), past min_hold_s
    assert all(d[t].recovery_active and source[t] == "recovery" and share[t] == 0.45 for t in range(22, 26))
    # back to normal at t=26: exit needs it for exit_confirm_s (1 s) -> exit at t=27
    assert d[26].recovery_active and share[26] == 0.45
    assert not d[27].recovery_active and "burst ended at t=27s: control handed back" in d[27].reason
    # hand back: the base's 0.6 again, step-limited upward (max_step_up 0.05)
    assert [share[t] for t in (27, 28, 29)] == [0.5, 0.55, 0.6]
    assert [source[t] for t in (27, 28, 29)] == ["guard", "guard", "base"]
    st = alloc.recovery.state()
    assert st.phase == "normal" and st.num_bursts == 1 and st.last_event == "ended" and st.cap_emb_share is None
    assert alloc.num_decisions["recovery"] == (7 if at_once else 6)  # t = 21..26 (20..26 at once)


def test_min_hold_keeps_a_short_burst_for_three_seconds(c60):
    alloc = allocator(c60)
    d = run(alloc, [NORMAL] * 20 + [BURST] + [NORMAL] * 4)
    assert [d[t].recovery_active for t in range(20, 25)] == [True, True, True, False, False]
    assert "burst ended at t=23s" in d[23].reason  # below since 21 (confirmed at 22), held 3 s at 23


def test_no_burst_during_warmup(c60):
    alloc = allocator(c60)
    d = run(alloc, [NORMAL] * 5 + [BURST] + [NORMAL] * 4)
    assert not any(x.recovery_active for x in d.values())
    assert alloc.recovery.state().phase == "warmup"  # warm-up lasts 10 s from t=0; t=9 is the last here
    alloc2 = allocator(c60, warmup_s=0.0)
    d2 = run(alloc2, [NORMAL, BURST])
    assert d2[1].recovery_active


def test_a_burst_that_lasts_becomes_the_new_baseline(c60):
    alloc = allocator(c60, max_burst_s=10.0)
    d = run(alloc, [NORMAL] * 20 + [BURST] * 14)
    assert all(d[t].recovery_active for t in range(20, 30))
    assert not d[30].recovery_active and "burst lasted 10s (new regime; baselines reset)" in d[30].reason
    assert alloc.recovery.rate_baseline == 4000.0 and alloc.recovery.hot_baseline == 0.12
    assert not any(d[t].recovery_active for t in range(30, 34))  # the same level is no longer a burst
    assert alloc.recovery.last_event == "expired"


def test_both_signals_are_needed_to_enter(c60):
    alloc = allocator(c60)
    d = run(alloc, [NORMAL] * 20 + [dict(arrival_rate_rps=4000.0, hot_user_ratio=0.02),
                                    dict(arrival_rate_rps=1000.0, hot_user_ratio=0.12)])
    assert not d[20].recovery_active and not d[21].recovery_active


def test_disabled_recovery_never_acts(c60):
    alloc = allocator(c60, enabled=False)
    d = run(alloc, [NORMAL] * 20 + [BURST] * 5)
    assert all(x.source == "base" and not x.recovery_active for x in d.values())


def test_a_base_already_below_the_cap_is_kept(tmp_path):
    low = constant_policy(tmp_path / "c30", 0.3)
    cfg = AllocatorConfig(recovery=RecoveryConfig(warmup_s=0.0), residual=ResidualConfig(enabled=False),
                          guard=GuardConfig(max_step_down=0.5), device="cpu")
    alloc = SmartAllocator(cfg, policy_dir=low)
    alloc.set_override(0.6, now_s=0.0)  # the split in force when the burst begins: 0.6
    run(alloc, [NORMAL] * 3)
    alloc.clear_override()
    d = alloc.decide(window(**BURST), 3.0)  # cap 0.6 - 0.15 = 0.45; the base wants 0.3 anyway
    assert d.source == "recovery" and round(d.emb_share, 6) == 0.3
    assert "base proposal 0.3000 already under the KV-ward cap 0.4500" in d.reason


def test_controller_alone_returns_events_and_uses_the_floors():
    rc = RecoveryController(RecoveryConfig(warmup_s=0.0, min_hold_s=0.0, exit_confirm_s=0.0))
    assert rc.update(0.0, 0.0, 0.0, 0.5) is None  # zero baselines: ratios use the floors (1 rps, 0.005)
    assert rc.update(1.0, 0.005, 1.0, 0.5) is None and rc.rate_ratio == 1.0
    assert rc.update(100.0, 0.5, 2.0, 0.5) == "entered" and rc.cap == pytest.approx(0.35)
    assert rc.update(0.5, 0.001, 3.0, 0.35) == "ended"
    assert rc.state().num_bursts == 1
    rc.reset()
    assert rc.state().phase == "warmup" and rc.state().num_bursts == 0


@pytest.mark.parametrize("num_users,seed", [(10_000, 0), (100_000, 1)])
def test_detects_the_burst_regimes_bursts_and_nothing_else(num_users, seed):
    """The controller on the workload generator's own 1-s window statistics."""
    import math

    from workloads import generate, synthetic_trace

    trace = synthetic_trace(num_users=1000, num_items=20_000, mean_seq_len=80)
    stream = generate(trace, regime="burst", rate_rps=1000, duration_s=120, num_users=num_users, seed=seed)
    w = stream.window_stats(1.0)
    rc = RecoveryController()
    active = set()
    for i, (rate, hot) in enumerate(zip(w["rate_rps"], w["hot_user_ratio"])):
        rc.update(float(rate), float(hot), float(i + 1), 0.5)  # window i ends at t = i + 1
        if rc.active:
            active.add(i)
    allowed = set()
    for start, end in stream.bursts:
        full = set(range(math.ceil(start), math.floor(end)))  # windows wholly inside the burst
        assert full <= active, (start, end, sorted(active))
        allowed |= set(range(math.floor(start), math.floor(end) + 3))  # hand back within 2 s of the end
    assert active <= allowed, sorted(active - allowed)
    assert rc.num_bursts == len(stream.bursts)


IDLE = dict(num_requests=0, arrival_rate_rps=0.0, hot_user_ratio=0.0)


def test_idle_then_ramp_then_steady_is_no_burst(c60):
    """A node that idled before its load began (zero-request windows), then a ramp from idle to
    the steady rate: the ramp is the start of the warmup, not a burst against a zero baseline."""
    alloc = allocator(c60)
    ramp = [dict(arrival_rate_rps=100.0 * k, hot_user_ratio=0.02) for k in range(1, 11)]  # 100 -> 1000 rps in 10 s
    script = [IDLE] * 20 + ramp + [NORMAL] * 40
    d = run(alloc, script)
    assert not any(x.recovery_active for x in d.values())
    st = alloc.recovery.state()
    assert st.num_bursts == 0 and st.phase == "normal" and st.last_event is None
    # the warmup began with the first served window (t=20), not with the idle ones
    assert [d[t].recovery_phase for t in (19, 29, 30)] == ["warmup", "warmup", "normal"]


def test_steady_burst_steady_is_one_burst_that_ends(c60):
    """Idle, then steady, a burst, steady again (with idle windows inside the steady stretches):
    one burst, entered at the burst and ended when the rate and hot-user ratio are back."""
    alloc = allocator(c60)
    steady = [NORMAL] * 7 + [IDLE] + [NORMAL] * 7
    script = [IDLE] * 10 + steady + [BURST] * 3 + steady
    d = run(alloc, script)
    events = {t: x.recovery_event for t, x in d.items() if x.recovery_event}
    assert events == {25: "entered", 29: "ended"}
    assert [d[t].recovery_active for t in (24, 25, 28, 29, 40)] == [False, True, True, False, False]
    assert alloc.recovery.state().num_bursts == 1


def test_the_burst_cap_asks_the_curve_and_is_declined_where_it_saves_nothing():
    """In a burst the cap takes the proposal KV-ward unless the curve layer's cost says the pages
    buy less than ``decline_gain`` there; without a curve the cap stands."""
    from node_agent.allocator.curve import CostCurve
    from node_agent.allocator.recovery import recovery_layer
    from node_agent.allocator.trace import _recovery_words

    def in_burst():
        ctl = RecoveryController(RecoveryConfig(warmup_s=2.0))
        for t in range(5):
            recovery_layer(ctl, 100.0, 0.1, float(t), 0.8, 0.8, "base")
        return ctl

    shares = np.array([0.1, 0.3, 0.5, 0.7, 0.9])
    flat = CostCurve(shares, np.array([1000.0, 1000.0, 999.0, 998.0, 998.0]))
    kv_ward = CostCurve(shares, np.array([600.0, 700.0, 800.0, 900.0, 1000.0]))
    for cost, gain, want, declined in ((None, 0.01, 0.65, False), (flat, 0.01, 0.8, True),
                                       (kv_ward, 0.01, 0.65, False), (flat, 0.0, 0.65, False)):
        ctl = in_burst()
        out, t, _ = recovery_layer(ctl, 400.0, 0.5, 5.0, 0.8, 0.8, "base", cost, gain)
        assert ctl.phase == "burst" and t.detail["event"] == "entered"
        assert out == pytest.approx(want) and t.detail["cap_declined"] is declined
        assert t.detail["capped"] is (not declined) and t.detail["cap"] == pytest.approx(0.65)
        words = _recovery_words(t.detail, "base")  # the decision's reason says which
        assert ("KV-ward cap 0.6500 declined" in words) is declined and "already under" not in words


def test_an_override_in_a_saturated_burst_is_the_operators_step_not_an_unpaced_one(c60):
    """An operator's override skips the step limit by itself: in a burst on a saturated node the
    decision is the override's, and its reason does not claim the burst's unpaced step."""
    alloc = allocator(c60, warmup_s=0.0, paced=False)
    run(alloc, [dict(NORMAL, load=1.0)] * 3)
    alloc.set_override(0.2, now_s=3.0)
    d = alloc.decide(window(**BURST, load=1.0), 3.0)
    assert d.recovery_active and d.source == "override" and round(d.emb_share, 6) == 0.2
    assert "not paced" not in d.reason


@pytest.mark.parametrize("over_arrivals, load", [(False, 1.0), (True, 1.0), (True, 0.5)])
def test_a_saturated_nodes_burst_is_seen_in_its_arrivals_an_interval_before_its_completions(c60, over_arrivals,
                                                                                             load):
    """A saturated node completes requests that arrived a backlog earlier: in the burst's first
    interval the arrivals show the hot users (x6) while the completed requests still show the
    baseline. On a saturated node with `hot_over_arrivals` the burst is entered then; otherwise
    (off, or a node that keeps up, which reads the completed requests' ratio) one interval later.
    A window without the arrivals' ratio (0: not measured) falls back to the completions'."""
    alloc = allocator(c60, hot_over_arrivals=over_arrivals)
    normal = dict(NORMAL, arrival_hot_user_ratio=0.02, load=load)
    first = dict(arrival_rate_rps=4000.0, hot_user_ratio=0.02, arrival_hot_user_ratio=0.12, load=load)
    d = run(alloc, [normal] * 20 + [first, dict(BURST, arrival_hot_user_ratio=0.12, load=load)])
    assert d[20].recovery_active is (over_arrivals and load >= 0.95)
    assert d[21].recovery_active
    unmeasured = allocator(c60, hot_over_arrivals=True)
    d = run(unmeasured, [dict(NORMAL, load=load)] * 20 + [dict(BURST, load=load)])  # the completions' ratio
    assert d[20].recovery_active
