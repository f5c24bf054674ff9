"""The operating-point tuner (the residual layer's second part): its gradient and step, the
bounds, anti-windup, holds, and a synthetic setting whose optimum it must reach from a base
policy that is 0.4 away from it."""

from __future__ import annotations

import json

import pytest

from node_agent.allocator.tuner import HOLD_MIN_READINGS
from node_agent.allocator import (AllocatorConfig, GuardConfig, OperatingPointTuner, RecoveryConfig, ResidualConfig,
                                  SmartAllocator, TunerConfig)
from node_agent.control import decide_step
from tests.test_allocator import constant_policy, window


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("tuner")
    return {"c60": constant_policy(root / "c60", 0.6), "c30": constant_policy(root / "c30", 0.3)}


def cfg(tuner: TunerConfig | None = None, **guard) -> AllocatorConfig:
    """Base + tuner + guards (the adapter and the burst controller off, for exact arithmetic)."""
    return AllocatorConfig(guard=GuardConfig(**guard), residual=ResidualConfig(enabled=False),
                           recovery=RecoveryConfig(enabled=False), tuner=tuner or TunerConfig(), device="cpu")


def marginal_window(emb_us: float, kv_us: float, *, load: float, n: int = 100, **kw):
    return window(num_requests=n, arrival_rate_rps=float(n), emb_marginal_us=emb_us, kv_marginal_us=kv_us, load=load,
                  **kw)


# ------------------------------------------------------------------------------------- the step


def test_step_is_the_latency_weighted_busy_time_gradient():
    # each reading taken as it is (no smoothing, no noise gate): the step's own arithmetic
    t = OperatingPointTuner(TunerConfig(gain=1.0, max_rate=0.1, deadband=0.0, smoothing=1.0, confidence=0.0))
    # busy per request = 0.5 * 1 s / 100 = 5,000 us; gradient (10 - 110) / 5,000 = -0.02;
    # latency sensitivity 1 / (1 - 0.5) = 2: step -0.04 (toward the KV pool)
    assert t.update(marginal_window(10.0, 110.0, load=0.5), -1.0, 1.0) == "kv_ward"
    assert t.last_gradient == pytest.approx(-0.02) and t.last_step == pytest.approx(-0.04)
    assert t.offset == pytest.approx(-0.04)
    # EMB-ward by the same rule: (210 - 10) / 5,000 * 2 = +0.08
    assert t.update(marginal_window(210.0, 10.0, load=0.5), -1.0, 1.0) == "emb_ward"
    assert t.offset == pytest.approx(0.04)


def test_saturation_and_light_load_both_move_and_a_tiny_gradient_does_not():
    # one reading each, taken at face value (confidence 0: no noise gate); the default gate waits for a
    # noise estimate (4 readings) unless a reading is strong
    assert OperatingPointTuner(TunerConfig()).update(marginal_window(10.0, 110.0, load=0.99), -1.0, 1.0) == "uncertain"
    sat = OperatingPointTuner(TunerConfig(max_rate=0.1, confidence=0.0))
    # load 0.99: 1 - load floored at 0.05 -> sensitivity 20; gradient -0.0202 -> clipped to -0.1
    sat.update(marginal_window(10.0, 110.0, load=0.99), -1.0, 1.0)
    assert sat.last_step == pytest.approx(-0.1)
    # load 0.05 (busy 500 us per request): gradient -100 / 500 = -0.2 of the service time, and at light
    # load the latency is the service time: 3 x -0.2 / 0.95 clipped to a full step
    light = OperatingPointTuner(TunerConfig(max_rate=0.1, deadband=0.005, confidence=0.0))
    assert light.update(marginal_window(10.0, 110.0, load=0.05), -1.0, 1.0) == "kv_ward"
    assert light.last_step == pytest.approx(-0.1) and light.last_gradient == pytest.approx(-0.2)
    # a gradient of 0.1% of the service time: 3 x 0.001 / 0.95 = 0.0032, inside the deadband
    tiny = OperatingPointTuner(TunerConfig(max_rate=0.1, deadband=0.005, confidence=0.0))
    assert tiny.update(marginal_window(10.5, 10.0, load=0.05), -1.0, 1.0) == "deadband"
    assert tiny.offset == 0.0


def test_start_up_hold_is_one_intervals_released_by_a_reading_of_the_other_sign_kept_once_confirmed():
    t = OperatingPointTuner(TunerConfig(max_rate=0.1))
    # a weak KV-ward reading (0.002 of the service time; no noise estimate yet): the base has moved
    # the split up by 0.3 (hold_at = -0.3 keeps the split in force). One reading is not evidence:
    # the base's move goes ahead; a second that agrees makes the hold
    weak_kv = marginal_window(10.0, 20.0, load=0.1)  # (10 - 20) * 100 / (0.1 * 1e6) = -0.01
    assert HOLD_MIN_READINGS == 2
    assert t.update(weak_kv, -1.0, 1.0, hold_at=-0.3) == "uncertain" and t.offset == 0.0
    assert t.update(weak_kv, -1.0, 1.0, hold_at=-0.3) == "hold"
    assert t.offset == pytest.approx(-0.3) and t.held == pytest.approx(-0.3)
    # the next interval starts from the tuner's own offset (0): the hold is re-made, not accumulated
    assert t.update(weak_kv, -1.0, 1.0, hold_at=-0.25) == "hold"
    assert t.offset == pytest.approx(-0.25) and t.held == pytest.approx(-0.25)
    # a reading of the other sign: not every reading points one way any more, nothing is held and
    # the offset is the tuner's own again (the base's move goes ahead)
    assert t.update(marginal_window(20.0, 10.0, load=0.1), -1.0, 1.0, hold_at=-0.25) == "uncertain"
    assert t.offset == 0.0 and t.held == 0.0
    # 4 agreeing readings give a noise estimate (here 0: identical readings) and the estimate confirms
    # them: the hold becomes the offset's own and the KV-ward step is taken from there
    u = OperatingPointTuner(TunerConfig(max_rate=0.1, sign_confidence=0.0))
    assert [u.update(weak_kv, -1.0, 1.0, hold_at=-0.3) for _ in range(3)] == ["uncertain", "hold", "hold"]
    assert u.update(weak_kv, -1.0, 1.0, hold_at=-0.3) == "kv_ward" and u.held == 0.0
    step = 3.0 * -0.01 / 0.9
    assert u.last_step == pytest.approx(step) and u.offset == pytest.approx(-0.3 + step)
    # kept: the next interval starts from it (nothing to release)
    assert u.update(weak_kv, -1.0, 1.0, hold_at=-0.3 + step) == "kv_ward"
    assert u.offset == pytest.approx(-0.3 + 2 * step)
    # past noise_window readings no hold is made, even when every reading agrees
    w = OperatingPointTuner(TunerConfig(max_rate=0.1, noise_window=4, confidence=10.0, sign_confidence=0.0))
    noisy = [marginal_window(10.0, 20.0 + 10 * (i % 2), load=0.1) for i in range(5)]
    assert [w.update(x, -1.0, 1.0, hold_at=-0.3) for x in noisy] == ["uncertain"] + ["hold"] * 3 + ["uncertain"]
    assert w.held == 0.0 and w.offset == 0.0


def test_no_evidence_holds_and_bounds_clip_only_the_offsets_own_push():
    t = OperatingPointTuner(TunerConfig(max_rate=0.1, confidence=0.0))
    t.offset = -0.2
    assert t.update(marginal_window(0.0, 0.0, load=0.9), -1.0, 1.0) == "no_evidence"  # ghost lists off / cold
    assert t.update(marginal_window(5.0, 50.0, load=0.9, n=0), -1.0, 1.0) == "no_evidence"  # nothing served
    assert t.offset == -0.2 and t.state().num_holds == 2
    # a KV-ward step that would carry the proposal under the lower bound stops at it
    assert t.update(marginal_window(0.0, 500.0, load=0.99), -0.25, 1.0) == "bound"
    assert t.offset == pytest.approx(-0.25) and t.last_step == pytest.approx(-0.05)
    # an offset already past a bound (the base moved) is not pulled back by the tuner: the guard clamps
    assert t.update(marginal_window(0.0, 500.0, load=0.99), -0.1, 1.0) == "bound"
    assert t.offset == pytest.approx(-0.25) and t.last_step == 0.0
    t.reset("test")
    assert t.offset == 0.0 and t.state().num_resets == 1 and t.state().last_reset_reason == "test"


def test_config_is_validated():
    with pytest.raises(ValueError, match="gain must be in"):
        TunerConfig(gain=0.0)
    with pytest.raises(ValueError, match="max_rate must be in"):
        TunerConfig(max_rate=0.9)
    with pytest.raises(ValueError, match="headroom_floor must be in"):
        TunerConfig(headroom_floor=1.0)
    with pytest.raises(ValueError, match="enabled must be a bool"):
        TunerConfig(enabled=1)
    with pytest.raises(ValueError, match=r"smoothing must be in \(0, 1\]"):
        TunerConfig(smoothing=0.0)
    with pytest.raises(ValueError, match=r"confidence must be in \[0, 10\]"):
        TunerConfig(confidence=-1.0)
    with pytest.raises(ValueError, match=r"noise_window must be an integer in \[4, 64\]"):
        TunerConfig(noise_window=3)
    with pytest.raises(ValueError, match="noise_window must be an integer"):
        TunerConfig(noise_window=9.0)
    with pytest.raises(ValueError, match="tuner must be a TunerConfig"):
        AllocatorConfig(tuner={"gain": 1.0})


# ------------------------------------------------------------------------------------- the estimate


def reading(g: float, load: float = 0.95, n: int = 100):
    """A window whose busy-time gradient reading is ``g`` (busy per request: load * 1e4 us)."""
    busy = load * 1e6 / n
    return marginal_window(max(0.0, g) * busy + 1.0, max(0.0, -g) * busy + 1.0, load=load, n=n)


def test_the_estimate_is_an_ewma_and_the_noise_its_median_successive_difference():
    t = OperatingPointTuner(TunerConfig(smoothing=0.5, confidence=0.0, deadband=0.0))
    t.update(reading(0.02), -1.0, 1.0)
    assert t.mean_gradient == pytest.approx(0.02) and t.gradient_se == 0.0  # first reading: face value
    t.update(reading(-0.02), -1.0, 1.0)
    assert t.mean_gradient == pytest.approx(0.0, abs=1e-12)
    t.update(reading(0.02), -1.0, 1.0)
    assert t.gradient_se == 0.0  # three readings: no noise estimate yet
    t.update(reading(0.0), -1.0, 1.0)
    # successive differences 0.04, 0.04, 0.02: median 0.04; se = 0.04 / 0.954 * sqrt(0.5 / 1.5)
    assert t.gradient_se == pytest.approx(0.04 / 0.954 * (1 / 3) ** 0.5)
    assert t.state().mean_gradient == t.mean_gradient and t.state().gradient_se == t.gradient_se
    t.reset("test")
    assert t.mean_gradient == 0.0 and t.gradient_se == 0.0
    t.update(reading(-0.03), -1.0, 1.0)
    assert t.mean_gradient == pytest.approx(-0.03)  # the history went with the reset


def test_noise_does_not_walk_the_split_and_a_regime_change_still_moves_it_at_once():
    """At saturation (pressure ~18) readings that scatter by 0.01 around 0, as a node's do on the
    32-node Taobao trend, send an ungated tuner across the range in ±0.1 steps; the default one
    stays put (``uncertain``). A jump to a strong KV-ward reading (a burst of returning users) is
    not noise: the median of the successive differences ignores it, and the step is taken at once."""
    import numpy as np

    g = np.random.default_rng(7).normal(0.0, 0.01, size=40)
    gated = OperatingPointTuner(TunerConfig())
    raw = OperatingPointTuner(TunerConfig(smoothing=1.0, confidence=0.0))
    acts, raw_path = [], []
    for x in g:
        acts.append(gated.update(reading(float(x)), -1.0, 1.0))
        raw.update(reading(float(x)), -1.0, 1.0)
        raw_path.append(raw.offset)
    assert max(abs(v) for v in raw_path) >= 0.3  # the ungated tuner random-walks
    assert abs(gated.offset) <= 0.1 and acts[4:].count("uncertain") >= 30
    assert gated.update(reading(-0.2), -1.0, 1.0) == "kv_ward" and gated.last_step == pytest.approx(-0.1)


def test_a_strong_gradient_is_taken_whole_while_a_burst_swings_it():
    """The paper-scale KV-ward burst's readings as the split falls: +0.001, -0.17, -0.56, -0.34.
    Their successive differences are the burst, not noise; a mean beyond ``strong_gradient`` (0.1)
    is taken whole, so the offset falls every interval; gated throughout, the fourth is refused."""
    seq = (0.001, -0.17, -0.56, -0.34)
    t = OperatingPointTuner(TunerConfig())
    acts = [t.update(reading(g, load=0.99), -1.0, 1.0) for g in seq]
    # the first reading is weak and alone (no noise estimate yet): it waits; the second is strong
    assert acts == ["uncertain"] + ["kv_ward"] * 3 and t.offset == pytest.approx(-0.3)
    always = OperatingPointTuner(TunerConfig(strong_gradient=1.0))
    assert [always.update(reading(g, load=0.99), -1.0, 1.0) for g in seq][-1] == "uncertain"
    with pytest.raises(ValueError, match=r"strong_gradient must be in \(0, 1\]"):
        TunerConfig(strong_gradient=0.0)


# ------------------------------------------------------------------------------------- in the allocator


def test_decision_carries_the_tuner_and_anti_windup(policies):
    alloc = SmartAllocator(cfg(TunerConfig(confidence=0.0), max_step_up=0.05), policy_dir=policies["c60"])
    # saturated, EMB-ward: the tuner asks +0.1, the step limit allows +0.05 from 0.6: the offset keeps +0.05
    d = alloc.decide(marginal_window(400.0, 0.0, load=0.99, emb_share=0.6), 0.0)
    assert d.source == "guard" and d.layer_source == "residual" and d.guard_action == "step_up"
    assert d.emb_share == pytest.approx(0.65) and d.tuner_action == "emb_ward"
    assert d.tuner_offset == pytest.approx(0.05, abs=1e-6) and d.tuner_step == pytest.approx(0.05, abs=1e-6)
    assert d.tuner_gradient == pytest.approx(400.0 * 100 / (0.99 * 1e6))
    assert "operating point +0.1000 (emb_ward +0.1000, busy-time gradient +0.0404, estimate +0.0404 +- 0.0000, " \
           "at load 0.99)" in d.reason
    assert "the step limit took back +0.0500 of the operating point's step" in d.reason
    assert alloc.state()["tuner"]["offset"] == pytest.approx(0.05, abs=1e-6)
    json.dumps(d.to_dict(), allow_nan=False)
    # an override holds the tuner (its interval says nothing about the layers)
    alloc.set_override(0.4, now_s=1.0)
    d = alloc.decide(marginal_window(0.0, 400.0, load=0.99, emb_share=0.4), 1.0)
    assert d.source == "override" and d.tuner_action is None and d.tuner_offset == pytest.approx(0.05, abs=1e-6)
    alloc.clear_override()
    alloc.reset_residual("operator reset")
    assert alloc.tuner.offset == 0.0


def test_disabled_tuner_leaves_the_base(policies):
    alloc = SmartAllocator(cfg(TunerConfig(enabled=False)), policy_dir=policies["c60"])
    d = alloc.decide(marginal_window(0.0, 400.0, load=0.99, emb_share=0.6), 0.0)
    assert d.source == "base" and d.tuner_action is None and d.tuner_offset == 0.0 and d.emb_share == pytest.approx(0.6)


# ------------------------------------------------------------------------------------- a known optimum


def synthetic_node(share: float, s_star: float, n: int):
    """One interval of a synthetic node whose device time per request is convex in the split,
    ``busy(s) = 9,000 + 20,000 (s - s_star)^2`` µs, with the ghost lists' readings that follow
    from it: what 10% more of the arena saves the EMB slab (``busy(s) - busy(s + 0.1)``) and the
    KV pool (``busy(s) - busy(s - 0.1)``), never negative."""

    def busy(s):
        return 9_000.0 + 20_000.0 * (s - s_star) ** 2

    emb = max(0.0, busy(share) - busy(share + 0.1))
    kv = max(0.0, busy(share) - busy(share - 0.1))
    load = min(1.0, n * busy(share) / 1e6)
    return marginal_window(emb, kv, load=load, n=n, emb_share=share)


def run_synthetic(alloc: SmartAllocator, s_star: float, n: int, windows: int) -> list[float]:
    share, path = 0.5, []
    for t in range(windows):
        d = decide_step(alloc, synthetic_node(share, s_star, n), float(t))
        share = d.emb_share
        path.append(share)
    return path


@pytest.mark.parametrize("s_star, policy, within", [(0.2, "c60", 8), (0.85, "c30", 16)])
def test_reaches_a_known_optimum_the_base_policy_misses(policies, s_star, policy, within):
    """A saturated node (load ~1) whose optimum lies 0.4-0.55 from the base policy's constant
    share: the full allocator (default config: adapter, burst controller, guards) gets within
    0.06 of it in ``within`` intervals and stays there; with the tuner off it stays at the base."""
    alloc = SmartAllocator(AllocatorConfig(device="cpu"), policy_dir=policies[policy])
    path = run_synthetic(alloc, s_star, n=110, windows=30)
    assert all(abs(s - s_star) <= 0.06 for s in path[within:]), path
    off = SmartAllocator(AllocatorConfig(device="cpu", tuner=TunerConfig(enabled=False)), policy_dir=policies[policy])
    base = 0.6 if policy == "c60" else 0.3
    assert abs(run_synthetic(off, s_star, n=110, windows=30)[-1] - base) <= 0.11  # the bounded adapter alone


def test_a_lightly_loaded_node_finds_the_optimum_too(policies):
    """The same convex node at ~12% load: no request waits, so the latency is the service time,
    and the 20,000 (s - s*)^2 µs it loses at the base's split is 1.4x the service time at the
    optimum. The tuner moves as at saturation (the sensitivity 1 / (1 - load) is ~1.1, not ~0):
    within 0.06 of s* = 0.2 in 8 intervals and there to stay."""
    alloc = SmartAllocator(cfg(), policy_dir=policies["c60"])
    path = run_synthetic(alloc, 0.2, n=10, windows=30)
    assert all(abs(s - 0.2) <= 0.06 for s in path[8:]), path


def test_lumpy_readings_of_one_sign_pass_the_sign_test():
    """At light load a node's ghost readings are lumpy (a KV ghost hit is a whole user's history):
    -0.03, -0.002, -0.05, -0.01 scatter as much as they are large, so the magnitude gate finds
    them within the noise; all of one sign, the sign test (4 of 4 at z = 2) takes their median.
    Near saturation the sign test does not run: the same readings wait for the magnitude gate."""
    seq = (-0.03, -0.002, -0.05, -0.01)
    t = OperatingPointTuner(TunerConfig())
    acts = [t.update(reading(g, load=0.1), -1.0, 1.0) for g in seq]
    assert acts == ["uncertain"] * 3 + ["kv_ward"] and t.sign_test
    # the median of the four, -0.02, x 3 / (1 - 0.1): -0.0667
    assert t.offset == pytest.approx(3 * -0.02 / 0.9)
    busy = OperatingPointTuner(TunerConfig())
    assert [busy.update(reading(g, load=0.9), -1.0, 1.0) for g in seq][-1] == "uncertain"
    off = OperatingPointTuner(TunerConfig(sign_confidence=0.0))
    assert [off.update(reading(g, load=0.1), -1.0, 1.0) for g in seq][-1] == "uncertain"
    # mixed signs are no evidence
    mixed = OperatingPointTuner(TunerConfig())
    assert [mixed.update(reading(g, load=0.1), -1.0, 1.0) for g in (-0.03, 0.002, -0.05, 0.01, -0.02)][-1] \
        == "uncertain"
    with pytest.raises(ValueError, match=r"sign_confidence must be in \[0, 10\]"):
        TunerConfig(sign_confidence=-1.0)
    with pytest.raises(ValueError, match=r"sign_test_max_load must be in \[0, 1\]"):
        TunerConfig(sign_test_max_load=1.5)
