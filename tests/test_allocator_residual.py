"""The online residual adapter: target, update rule, bound, reset, state, and when it learns."""

from __future__ import annotations

import numpy as np
import pytest

from node_agent.allocator import (AllocatorConfig, RecoveryConfig, ResidualAdapter, ResidualConfig, SmartAllocator)
from node_agent.features import NUM_FEATURES, build_features
from tests.test_allocator import constant_policy, window

# p99 45 ms over a 30 ms SLO: pressure 1.5 - 0.9 = 0.6. Miss time per request: KV (1-0.6)*80*0.5 = 16 us,
# EMB (1-0.8)*120*2 = 48 us -> imbalance (48 - 16) / 64 = +0.5 (embedding misses dominate: more EMB)
OVER = window(p99_ms=45.0)
# p99 15 ms: pressure 0.5 - 0.9 = -0.4 (headroom)
UNDER = window(p99_ms=15.0)


@pytest.fixture(scope="module")
def c60(tmp_path_factory):
    return constant_policy(tmp_path_factory.mktemp("res") / "c60", 0.6)


def test_target_follows_pressure_and_imbalance():
    ra = ResidualAdapter(ResidualConfig(gain=0.1, relax=0.1))
    y, p, m = ra.target(0.02, OVER)
    assert p == pytest.approx(0.6) and m == pytest.approx(0.5) and y == pytest.approx(0.02 + 0.1 * 0.6 * 0.5)
    y, p, m = ra.target(0.02, UNDER)
    assert p == pytest.approx(-0.4) and y == pytest.approx(0.9 * 0.02)  # headroom: fade toward the base
    # KV misses dominate -> negative imbalance -> toward KV
    y, _, m = ra.target(0.0, window(p99_ms=45.0, kv_hit_rate=0.0, emb_hit_rate=0.95))
    assert m == pytest.approx((12 - 40) / 52) and y < 0
    # the target itself is bounded, and the pressure is clipped
    y, p, _ = ra.target(0.099, window(p99_ms=1e4))
    assert p == 1.0 and y == 0.1


def test_one_nlms_step_is_exact():
    cfg = ResidualConfig(learning_rate=0.5, leak=0.0)
    ra = ResidualAdapter(cfg)
    x = build_features(window())
    upd = ra.update(x, 0.0, OVER)
    y = 0.1 * 0.6 * 0.5
    xa = np.append(x.astype(np.float64), 1.0)
    w = 0.5 * y * xa / (1e-6 + xa @ xa)
    np.testing.assert_allclose(ra.state().weights, w[:-1], rtol=1e-12)
    assert ra.state().bias == pytest.approx(w[-1], rel=1e-12)
    assert upd.updated and upd.target == pytest.approx(y) and upd.prediction == 0.0 and upd.error == pytest.approx(y)
    assert ra.predict(x) == pytest.approx(0.5 * y * (xa @ xa) / (1e-6 + xa @ xa), rel=1e-6)


def test_correction_is_bounded_and_grows_then_fades():
    ra = ResidualAdapter(ResidualConfig(learning_rate=1.0))
    x = build_features(window())
    seen = []
    for _ in range(60):  # over the SLO every interval: the correction integrates toward +B
        r = ra.predict(x)
        ra.update(x, r, OVER)
        seen.append(ra.predict(x))
    assert all(-0.1 <= r <= 0.1 for r in seen)
    assert seen[0] > 0 and seen[-1] == pytest.approx(0.1, abs=2e-3)
    assert all(b >= a - 1e-3 for a, b in zip(seen, seen[1:]))  # rises, then sits at the bound
    for _ in range(40):  # headroom: it fades back toward the base policy
        ra.update(x, ra.predict(x), UNDER)
    assert 0 <= ra.predict(x) < 0.03
    # whatever the weights, the output stays within the bound
    ra._w32[:] = 100.0
    assert ra.predict(x) == 0.1
    ra._w32[:] = -100.0
    assert ra.predict(x) == -0.1


def test_reset_and_state():
    ra = ResidualAdapter()
    x = build_features(window())
    for _ in range(5):
        ra.update(x, ra.predict(x), OVER)
    st = ra.state()
    assert st.num_updates == 5 and st.enabled and any(w != 0 for w in st.weights) and st.mean_abs_error > 0
    assert len(st.to_dict()["weights"]) == NUM_FEATURES
    ra.reset("drift detected")
    st = ra.state()
    assert ra.predict(x) == 0.0 and all(w == 0 for w in st.weights) and st.bias == 0.0
    assert st.num_resets == 1 and st.last_reset_reason == "drift detected" and st.num_updates == 5


def test_allocator_applies_and_learns_the_residual(c60):
    cfg = AllocatorConfig(recovery=RecoveryConfig(enabled=False), device="cpu")
    alloc = SmartAllocator(cfg, policy_dir=c60)
    d = alloc.decide(OVER, 0.0)
    assert d.source == "base" and d.residual == 0.0
    for t in range(1, 30):
        upd = alloc.observe(OVER)
        assert upd.updated, upd.reason
        d = alloc.decide(OVER, float(t))
    assert d.source == "residual" and 0.05 < d.residual <= 0.1
    assert d.emb_share == pytest.approx(d.base_emb_share + d.residual)
    assert f"+ residual {d.residual:+.4f}" in d.reason
    assert alloc.state()["residual"]["num_updates"] == 29
    alloc.reset_residual("operator reset")
    d = alloc.decide(OVER, 30.0)
    assert d.residual == 0.0 and d.source == "base"
    assert alloc.state()["residual"]["last_reset_reason"] == "operator reset"


def test_disabled_adapter_never_corrects(c60):
    alloc = SmartAllocator(AllocatorConfig(residual=ResidualConfig(enabled=False), device="cpu"), policy_dir=c60)
    for t in range(5):
        assert not alloc.observe(OVER).updated
        assert alloc.decide(OVER, float(t)).residual == 0.0


def test_outcomes_that_do_not_measure_the_correction_are_skipped(c60):
    cfg = AllocatorConfig(recovery=RecoveryConfig(warmup_s=0.0), device="cpu")
    alloc = SmartAllocator(cfg, policy_dir=c60)
    assert "no decision" in alloc.observe(OVER).reason
    alloc.decide(window(), 0.0)
    assert "no requests" in alloc.observe(window(num_requests=0)).reason
    alloc.decide(window(), 1.0)
    assert "invalid outcome" in alloc.observe(window(p99_ms=float("nan"))).reason
    alloc.decide(window(), 2.0)
    assert alloc.observe(OVER).updated
    assert "no decision" in alloc.observe(OVER).reason  # each decision is learnt from once
    alloc.set_override(0.5, now_s=3.0, expires_at_s=4.0)
    alloc.decide(window(), 3.0)
    assert "ran under override" in alloc.observe(OVER).reason
    alloc.decide(window(arrival_rate_rps=5000.0, hot_user_ratio=0.2), 4.0)
    assert alloc.recovery.active and "ran under" in alloc.observe(OVER).reason
    st = alloc.state()["residual"]
    assert st["num_updates"] == 1 and st["num_skipped"] == 6


def test_a_policy_swap_resets_the_adapter(c60, tmp_path):
    other = constant_policy(tmp_path / "c50", 0.5)
    alloc = SmartAllocator(AllocatorConfig(recovery=RecoveryConfig(enabled=False), device="cpu"), policy_dir=c60)
    alloc.decide(OVER, 0.0)
    for t in range(1, 5):
        alloc.observe(OVER)
        alloc.decide(OVER, float(t))
    assert alloc.residual.predict(build_features(OVER, OVER)) > 0
    alloc.load_policy(other)
    st = alloc.state()["residual"]
    assert st["num_resets"] == 1 and "base policy swapped" in st["last_reset_reason"]
    assert "no decision" in alloc.observe(OVER).reason
    keep = SmartAllocator(AllocatorConfig(residual=ResidualConfig(reset_on_policy_swap=False),
                                          recovery=RecoveryConfig(enabled=False), device="cpu"), policy_dir=c60)
    keep.decide(OVER, 0.0)
    keep.observe(OVER)
    keep.load_policy(other)
    assert keep.state()["residual"]["num_resets"] == 0 and keep.state()["residual"]["num_updates"] == 1


def test_ghost_signal_follows_the_marginal_utilities_not_the_miss_time():
    # miss time says EMB (+0.5, as in OVER), the ghost lists say more KV pages are worth more
    outcome = window(p99_ms=45.0, emb_marginal_us=10.0, kv_marginal_us=30.0)
    ghost = ResidualAdapter(ResidualConfig(gain=0.1, signal="ghost"))
    y, p, m = ghost.target(0.0, outcome)
    assert m == pytest.approx((10 - 30) / 40) and y == pytest.approx(0.1 * 0.6 * -0.5)
    y, _, m = ResidualAdapter(ResidualConfig(gain=0.1)).target(0.0, outcome)  # default: miss time
    assert m == pytest.approx(0.5) and y > 0
    # no ghost information (lists off, or nothing within reach): no push either way
    y, _, m = ghost.target(0.03, window(p99_ms=45.0))
    assert m == 0.0 and y == pytest.approx(0.03)
    with pytest.raises(ValueError, match="signal"):
        ResidualConfig(signal="oracle")


def test_marginal_utility_takes_the_best_rate_over_the_probes():
    from node_agent.features import marginal_utilities_us, marginal_utility_us

    # a KV pool that saves nothing with 5% more but 40 us with 20% more is worth 20 us per 10%
    assert marginal_utility_us((0.05, 0.1, 0.2), (0.0, 0.0, 40.0)) == pytest.approx(20.0)
    assert marginal_utility_us((0.05, 0.1), (6.0, 8.0)) == pytest.approx(12.0)  # the first step's rate
    emb, kv = marginal_utilities_us((0.1, 0.2), (20, 30), (0, 400), 10, 1.5, 0.5)
    assert emb == pytest.approx(max(20 * 1.5 / 10, 30 * 1.5 / 10 / 2)) and kv == pytest.approx(400 * 0.5 / 10 / 2)
    assert marginal_utilities_us((), (), (), 10, 1.0, 1.0) == (0.0, 0.0)
    assert marginal_utilities_us((0.1,), (5,), (5,), 0, 1.0, 1.0) == (0.0, 0.0)
