"""The residual layer: the online adapter (`ResidualAdapter`) and the operating-point tuner
(`node_agent.allocator.tuner.OperatingPointTuner`) added to the base policy's proposal."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from node_agent.allocator.config import GuardConfig, ResidualConfig
from node_agent.allocator.trace import LayerTrace
from node_agent.allocator.tuner import OperatingPointTuner
from node_agent.features import (FEATURE_NAMES, NUM_FEATURES, WindowStats, imbalance, marginal_imbalance,
                               miss_costs_us)



@dataclass(frozen=True)
class ResidualUpdate:
    """What `ResidualAdapter.update` (via `SmartAllocator.observe`) did with one outcome."""

    updated: bool
    reason: str
    target: float = 0.0
    prediction: float = 0.0
    error: float = 0.0
    slo_pressure: float = 0.0
    miss_imbalance: float = 0.0


@dataclass(frozen=True)
class ResidualState:
    enabled: bool
    weights: tuple[float, ...]
    bias: float
    num_updates: int
    num_skipped: int
    num_resets: int
    last_target: float
    last_error: float
    mean_abs_error: float
    last_reset_reason: str | None

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["weights"] = dict(zip(FEATURE_NAMES, self.weights))
        return d


class ResidualAdapter:
    """Online linear correction of the base policy: ``r(x) = clip(w . x + b, -B, B)``.

    Target. After a decision made on features ``x`` with correction ``r``, the next interval's
    stats (the outcome) say which way the split should have gone:

    - SLO pressure ``p = clip(p99_ms / slo_ms - target_p99_over_slo, -pressure_max, pressure_max)``;
    - imbalance ``m = (emb_us - kv_us) / (emb_us + kv_us)`` in [-1, 1] (0 when both are 0): with
      ``signal="miss_cost"`` (default) ``emb_us`` / ``kv_us`` are the observed miss time per
      request (`node_agent.features.miss_costs_us`), positive when embedding misses cost requests
      more time than KV recomputation; with ``signal="ghost"`` they are the caches' marginal
      utilities (time per request 10% more memory would have saved each, from their ghost lists:
      `node_agent.features.marginal_imbalance`), the rule of utility-based cache partitioning;
    - ``y = r + gain * p * m`` when ``p > 0`` (over the target: move toward the side whose misses
      cost more, in proportion to how far over), else ``y = (1 - relax) * r`` (headroom: fade the
      correction, giving control back to the base policy, which was trained for the long-horizon
      trade-off); finally ``y = clip(y, -B, B)``.

    Update (normalised LMS with leak): with ``x~ = [x, 1]`` and the unclipped prediction
    ``yhat = w~ . x~``, ``w~ <- (1 - leak) w~ + mu (y - yhat) x~ / (eps + |x~|^2)``. NLMS is stable
    for any input scale (mu in (0, 1]) and, unlike RLS, has no covariance to wind up when the
    features stop moving; the leak keeps the weights bounded without excitation. `reset` zeroes
    everything (the correction becomes 0 at once).
    """

    _EPS = 1e-6

    def __init__(self, config: ResidualConfig | None = None):
        self.config = config or ResidualConfig()
        self._w = np.zeros(NUM_FEATURES + 1, dtype=np.float64)  # last entry: bias
        self._w32 = np.zeros(NUM_FEATURES, dtype=np.float32)
        self._xa = np.ones(NUM_FEATURES + 1, dtype=np.float64)  # [features, 1]: the update's input buffer
        self._b = 0.0
        self.num_updates = 0
        self.num_skipped = 0
        self.num_resets = 0
        self.last_target = 0.0
        self.last_error = 0.0
        self.mean_abs_error = 0.0
        self.last_reset_reason: str | None = None

    def predict(self, x: np.ndarray) -> float:
        """The bounded correction for features ``x`` (0 when disabled)."""
        if not self.config.enabled:
            return 0.0
        r = float(self._w32 @ x) + self._b
        b = self.config.max_correction
        return b if r > b else (-b if r < -b else r)

    def target(self, correction: float, outcome: WindowStats) -> tuple[float, float, float]:
        """``(y, p, m)``: the target correction, SLO pressure and miss-cost imbalance (see class doc)."""
        c = self.config
        p = outcome.p99_ms / outcome.slo_ms - c.target_p99_over_slo
        p = max(-c.pressure_max, min(c.pressure_max, p))
        if c.signal == "ghost":
            m = marginal_imbalance(outcome)
        else:
            kv_us, emb_us = miss_costs_us(outcome)
            m = imbalance(emb_us, kv_us)
        y = correction + c.gain * p * m if p > 0 else (1.0 - c.relax) * correction
        return max(-c.max_correction, min(c.max_correction, y)), p, m

    def update(self, x: np.ndarray, correction: float, outcome: WindowStats) -> ResidualUpdate:
        y, p, m = self.target(correction, outcome)
        xa = self._xa
        xa[:-1] = x
        yhat = float(self._w @ xa)
        err = y - yhat
        c = self.config
        self._w *= 1.0 - c.leak
        self._w += (c.learning_rate * err / (self._EPS + float(xa @ xa))) * xa
        self._w32[:] = self._w[:-1]
        self._b = float(self._w[-1])
        self.num_updates += 1
        self.last_target, self.last_error = y, err
        weight = 0.05 if self.num_updates > 20 else 1.0 / self.num_updates  # running mean, then an EWMA
        self.mean_abs_error += (abs(err) - self.mean_abs_error) * weight
        return ResidualUpdate(True, f"target {y:+.4f} (slo pressure {p:+.3f}, miss imbalance {m:+.3f}); "
                                    f"prediction {yhat:+.4f} -> {float(self._w @ xa):+.4f}",
                              target=y, prediction=yhat, error=err, slo_pressure=p, miss_imbalance=m)

    def skip(self, reason: str) -> ResidualUpdate:
        self.num_skipped += 1
        return ResidualUpdate(False, reason)

    def load_weights(self, w) -> None:
        """Set the weights and bias (``NUM_FEATURES + 1`` finite values, bias last): a restart
        resumes what the adapter had learned (`SmartAllocator.restore`)."""
        a = np.asarray(w, dtype=np.float64)
        if a.shape != self._w.shape or not np.isfinite(a).all():
            raise ValueError(f"residual weights: {self._w.shape[0]} finite values expected")
        self._w[:] = a
        self._w32[:] = a[:-1]
        self._b = float(a[-1])

    def reset(self, reason: str = "reset") -> None:
        self._w[:] = 0.0
        self._w32[:] = 0.0
        self._b = 0.0
        self.num_resets += 1
        self.last_target = self.last_error = self.mean_abs_error = 0.0
        self.last_reset_reason = reason

    def state(self) -> ResidualState:
        return ResidualState(enabled=self.config.enabled, weights=tuple(float(v) for v in self._w[:-1]),
                             bias=float(self._w[-1]), num_updates=self.num_updates, num_skipped=self.num_skipped,
                             num_resets=self.num_resets, last_target=self.last_target, last_error=self.last_error,
                             mean_abs_error=self.mean_abs_error, last_reset_reason=self.last_reset_reason)



def residual_layer(adapter: ResidualAdapter, tuner: OperatingPointTuner, row: np.ndarray, stats: WindowStats,
                   base: float, prev: float, guard: GuardConfig, tune: bool) -> tuple[float, LayerTrace]:
    """``base + correction + offset``: the adapter's bounded correction for the features ``row``
    and the tuner's offset, moved by this window's reading when ``tune`` (not under an operator's
    override: the operator's split measures nothing about the layers), kept within the guard range
    around ``base + correction`` and held at the split in force (``prev``) while the start-up hold
    lasts. Detail: ``correction``, ``offset``, ``tuner_action`` (None when the tuner did not run),
    ``tuner_step``, ``tuner_gradient`` (this window's reading), ``tuner_mean_gradient`` /
    ``tuner_gradient_se`` (the estimate), ``tuner_sign_test``, ``load``."""
    correction = adapter.predict(row)
    offset = step = gradient = 0.0
    action = None
    if tuner.config.enabled:
        if tune:
            action = tuner.update(stats, guard.min_emb_share - base - correction,
                                  guard.max_emb_share - base - correction, hold_at=prev - base - correction)
            step, gradient = tuner.last_step, tuner.last_gradient
        offset = tuner.offset
    proposal = base + correction + offset
    return proposal, LayerTrace("residual", proposal, offset != 0.0 or step != 0.0 or correction != 0.0,
                                (correction, offset, action, step, gradient, tuner.mean_gradient, tuner.gradient_se,
                                 tuner.sign_test, stats.load))
