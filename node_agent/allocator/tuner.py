"""The operating-point tuner, the residual layer's second part (`OperatingPointTuner`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from node_agent.allocator.config import TunerConfig
from node_agent.features import WindowStats



def _median(values: list[float]) -> float:
    v = sorted(values)
    k = len(v)
    return v[k // 2] if k % 2 else 0.5 * (v[k // 2 - 1] + v[k // 2])


# The start-up hold needs this many readings that agree: one interval's ghost counts are one
# lumpy reading (a KV ghost hit is a whole user's history), not evidence against the base policy.
HOLD_MIN_READINGS = 2

TUNER_ACTIONS = ("emb_ward", "kv_ward", "deadband", "uncertain", "bound", "no_evidence", "hold")


@dataclass(frozen=True)
class TunerState:
    enabled: bool
    offset: float
    num_updates: int
    num_holds: int
    num_resets: int
    last_action: str | None
    last_gradient: float
    last_step: float
    last_reset_reason: str | None
    mean_gradient: float = 0.0
    gradient_se: float = 0.0

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class OperatingPointTuner:
    """The setting's operating point, found online: an offset added to the base policy's share
    (with the adapter's bounded correction, the residual layer), moved every interval along the
    measured gradient of the node's busy time, over the whole guard range.

    Gradient (utility-based cache partitioning, Qureshi and Patt, MICRO 2006, on the ghost lists
    of both caches, `node_agent.features.marginal_utility_us`): from the interval's `WindowStats`,
    with ``busy_us = load * interval_s * 1e6 / num_requests`` the device time per completed request,

    - ``gradient = (emb_marginal_us - kv_marginal_us) / busy_us``: the share of a request's device
      time that moving 10% of the arena toward the EMB slab would save (negative: toward the KV
      pool). The marginal utilities are priced at the node's own profiled miss costs and counted
      per 10% of its own arena, so the gradient is dimensionless: the same number means the same
      thing on any node, model or arena size (nothing to re-tune per setting);
    - the estimate: one interval's ghost counts are a noisy reading (near saturation a node's
      readings can scatter by several times their mean, and a full step on such noise sends
      nodes apart across the whole range; docs/results.md), so the tuner steps on
      ``mean``, an EWMA of the readings (weight ``smoothing``), less ``confidence`` standard
      errors of it: ``estimate = sign(mean) * max(0, |mean| - confidence * se)``, with
      ``se = noise * sqrt(smoothing / (2 - smoothing))`` (the spread of an EWMA of independent
      readings) and ``noise = median |reading_i - reading_(i-1)| / 0.954`` over the last
      ``noise_window`` readings (for Gaussian noise the median absolute successive difference is
      0.954 of its standard deviation; unlike a variance, the median ignores the jump of a regime
      change, so a burst's first readings are not taken for noise). An estimate within the noise
      moves nothing (``uncertain``); until 4 readings exist there is no noise estimate and only a
      mean of at least ``strong_gradient`` moves; such a mean is taken whole at any time (a
      burst's readings swing as the split moves, which the gate would read as noise); when the
      gate gives 0 but the window's nonzero readings agree in sign beyond ``sign_confidence *
      sqrt(n)`` (the sign test, at loads up to ``sign_test_max_load``), their median is the
      estimate: at light load readings are lumpy (a KV ghost hit is a whole user's history) and
      scatter as much as they are large;
    - ``sensitivity = 1 / max(1 - load, headroom_floor)``: how a relative change of the service
      time moves the latency (M/M/1: ``T = S / (1 - rho)``, so ``(dT/T) / (dS/S) = 1 / (1 - rho)``):
      about 1 at light load, where the latency is the service time (a KV miss that recomputes a
      history is the tail), 10 at load 0.9;
    - ``step = clip(gain * estimate * sensitivity, -max_rate, max_rate)``, not taken when
      ``|step| < deadband``; a step never carries ``base + correction + offset`` past a guard
      bound (``bound``; a base output beyond a bound is left to the guard stage).

    Start-up hold: while every reading so far (at least `HOLD_MIN_READINGS`, at most
    ``noise_window`` of them) has one sign, a base move against it is held (``hold``: the offset
    cancels it, the split stays where it is): the shipped base policy, on a trace unlike its
    training settings, would otherwise carry the split the wrong way at the guards' full rate
    while the evidence against it accumulates. A hold
    is one interval's (``held``, released at the next update, which may hold again): once a
    reading of the other sign comes, the base move goes ahead; once the estimate confirms the
    readings (a step their way), the hold becomes part of the offset and the step is taken from
    there.

    So the offset climbs the busy-time gradient until the two caches' marginal utilities meet (or
    their difference drowns in its noise) or a bound is reached, at most ``max_rate`` per
    interval: from any base share, the far end of the guard range (0.9 of emb_share) is at most
    ``0.9 / max_rate`` intervals away. No evidence (no request served, no busy time, both ghost
    lists silent: the lists off or both caches cold) holds the offset and the estimate. The
    allocator also takes back the part of a step that the guards' step limit refused (anti-windup:
    the offset never runs ahead of the split in force). `reset` zeroes the offset and the estimate
    (an operator's `SmartAllocator.reset_residual`, or a new base policy when
    `ResidualConfig.reset_on_policy_swap`).
    """

    def __init__(self, config: TunerConfig | None = None):
        self.config = config or TunerConfig()
        self.offset = 0.0
        self.held = 0.0  # the part of the offset that is this interval's start-up hold (released next update)
        self.num_updates = 0
        self.num_holds = 0
        self.num_resets = 0
        self.last_action: str | None = None
        self.last_gradient = 0.0
        self.last_step = 0.0
        self.last_reset_reason: str | None = None
        self.mean_gradient = 0.0
        self.gradient_se = 0.0
        self.sign_test = False  # the last step's estimate came from the sign test
        self._readings: list[float] = []
        self._diffs: list[float] = []
        self._num_pos = self._num_neg = 0
        self._num_readings = 0  # since the last reset (the start-up hold's horizon)
        a = self.config.smoothing
        self._se_factor = math.sqrt(a / (2.0 - a)) / 0.954

    def update(self, stats: WindowStats, lo: float, hi: float, hold_at: float | None = None) -> str:
        """One interval: move the offset by this interval's step, kept in ``[lo, hi]``; returns
        the action (one of `TUNER_ACTIONS`); ``last_gradient`` (the interval's reading),
        ``mean_gradient`` / ``gradient_se`` (the estimate) and ``last_step`` hold the figures.
        ``hold_at``: the offset that keeps the split in force (the start-up hold, class doc)."""
        if self.held != 0.0:  # last interval's start-up hold is released (this interval may hold again)
            self.offset -= self.held
            self.held = 0.0
        action, off = self._propose(stats)
        own = off  # the tuner's own proposal (a start-up hold replaces it for this interval)
        off, action, absorbed = self._start_up_hold(off, action, hold_at)
        if hi < 0.0:  # the bounds clip the offset's own push only; a base output beyond them is the guard's
            hi = 0.0
        if lo > 0.0:
            lo = 0.0
        if off > hi and off > self.offset:
            off, action = (hi if hi > self.offset else self.offset), "bound"
        elif off < lo and off < self.offset:
            off, action = (lo if lo < self.offset else self.offset), "bound"
        if action == "hold":
            self.held = off - own
        self.last_step = off - self.offset - absorbed - self.held  # the tuner's own step (no hold in it)
        self.offset = off
        self.last_action = action
        return action

    def _propose(self, stats: WindowStats) -> tuple[str, float]:
        """The interval's reading and step: ``(action, the offset it proposes)``, before the start-up
        hold and the bounds; counts the interval (``num_holds`` or ``num_updates``) and sets
        ``last_gradient`` and ``last_step``."""
        c = self.config
        n = stats.num_requests
        em = stats.emb_marginal_us
        km = stats.kv_marginal_us
        rho = stats.load
        if n <= 0 or rho <= 0.0 or em + km <= 0.0:
            self.num_holds += 1
            self.last_gradient = self.last_step = 0.0
            return "no_evidence", self.offset
        g = (em - km) * n / (rho * stats.interval_s * 1e6)
        mean = self._record_reading(g)
        est = self._estimate(g, mean, rho)
        headroom = 1.0 - rho
        if headroom < c.headroom_floor:
            headroom = c.headroom_floor
        self.last_gradient = g
        self.num_updates += 1
        if est == 0.0:
            self.last_step = 0.0
            return "uncertain", self.offset
        step = c.gain * est / headroom
        m = c.max_rate
        step = m if step > m else (-m if step < -m else step)
        if -c.deadband < step < c.deadband:
            self.last_step = 0.0
            return "deadband", self.offset
        self.last_step = step
        return ("emb_ward" if step > 0 else "kv_ward"), self.offset + step

    def _record_reading(self, g: float) -> float:
        """Take the reading ``g`` into the window (its successive differences and sign counts beside
        it) and the EWMA; sets ``mean_gradient`` and ``gradient_se`` and returns the mean."""
        c = self.config
        a = c.smoothing
        r = self._readings
        dd = self._diffs  # |r[i] - r[i-1]| of the readings in the window, kept beside them
        if r:
            mean = self.mean_gradient + a * (g - self.mean_gradient)
            dd.append(g - r[-1] if g > r[-1] else r[-1] - g)
        else:
            mean = g
        r.append(g)
        self._num_readings += 1
        if g > 0.0:
            self._num_pos += 1
        elif g < 0.0:
            self._num_neg += 1
        if len(r) > c.noise_window:
            old = r.pop(0)
            dd.pop(0)
            if old > 0.0:
                self._num_pos -= 1
            elif old < 0.0:
                self._num_neg -= 1
        self.mean_gradient = mean
        if len(r) >= 4:
            self.gradient_se = _median(dd) * self._se_factor
        else:
            self.gradient_se = 0.0
        return mean

    def _estimate(self, g: float, mean: float, rho: float) -> float:
        """The gradient the step is taken on (class doc): the mean when it or the reading ``g`` is
        strong, else the mean less its noise, else the sign test's median (sets ``sign_test``)."""
        c = self.config
        r = self._readings
        self.sign_test = False
        sg = c.strong_gradient
        if mean >= sg or mean <= -sg or (g >= sg and mean > 0.0) or (g <= -sg and mean < 0.0):
            return mean  # a strong reading or mean: a regime change, not noise
        if len(r) < 4 and c.confidence > 0.0:  # no noise estimate yet: only a strong reading moves
            return 0.0
        cut = c.confidence * self.gradient_se
        est = mean - cut if mean > cut else (mean + cut if mean < -cut else 0.0)
        if est == 0.0 and c.sign_confidence > 0.0 and rho <= c.sign_test_max_load:
            est = self._sign_estimate(r, self._num_pos, self._num_neg, c.sign_confidence)
            self.sign_test = est != 0.0
        return est

    def _start_up_hold(self, off: float, action: str, hold_at: float | None) -> tuple[float, str, float]:
        """The start-up hold (class doc) on the proposal ``off``: ``(offset, action, absorbed)``, where
        ``absorbed`` is the part of a confirmed hold that becomes the offset's own."""
        c = self.config
        nr = len(self._readings)
        absorbed = 0.0
        if hold_at is not None and HOLD_MIN_READINGS <= self._num_readings <= c.noise_window:
            # start-up: every reading so far points one way and the base moves the other way
            neg, pos = self._num_neg == nr, self._num_pos == nr
            if (neg and off > hold_at) or (pos and off < hold_at):
                if (action == "kv_ward" and neg) or (action == "emb_ward" and pos):
                    absorbed = hold_at - self.offset  # confirmed: the hold becomes the offset's own,
                    off = hold_at + self.last_step  # and the step is taken from there
                else:  # not yet judged: held for this interval (the split stays)
                    off, action = hold_at, "hold"
        return off, action, absorbed

    @staticmethod
    def _sign_estimate(readings: list[float], pos: int, neg: int, z: float) -> float:
        """The median reading when the ``pos`` positive and ``neg`` negative readings agree in sign
        beyond ``z * sqrt(n)`` (the normal approximation of the sign test, n = pos + neg, at least 4
        of them), else 0."""
        n = pos + neg
        if n < 4 or abs(pos - neg) < z * math.sqrt(n):
            return 0.0
        med = _median(readings)
        return med if (med > 0.0) == (pos > neg) and med != 0.0 else 0.0

    def take_back(self, amount: float) -> None:
        """Remove ``amount`` of the last step (the part the guards' step limit refused)."""
        self.offset -= amount
        self.last_step -= amount

    def reset(self, reason: str = "reset") -> None:
        self.offset = self.held = self.last_gradient = self.last_step = 0.0
        self.mean_gradient = self.gradient_se = 0.0
        self._readings.clear()
        self._diffs.clear()
        self._num_pos = self._num_neg = self._num_readings = 0
        self.last_action = None
        self.num_resets += 1
        self.last_reset_reason = reason

    def state(self) -> TunerState:
        return TunerState(enabled=self.config.enabled, offset=self.offset, num_updates=self.num_updates,
                          num_holds=self.num_holds, num_resets=self.num_resets, last_action=self.last_action,
                          last_gradient=self.last_gradient, last_step=self.last_step,
                          last_reset_reason=self.last_reset_reason, mean_gradient=self.mean_gradient,
                          gradient_se=self.gradient_se)


