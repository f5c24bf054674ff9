"""The recovery layer: burst detection with hysteresis (`RecoveryController`) and, in a burst, a
KV-ward cap on the proposal (`recovery_layer`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from node_agent.allocator.config import RecoveryConfig
from node_agent.allocator.trace import LayerTrace



@dataclass(frozen=True)
class RecoveryState:
    phase: str  # "warmup", "normal", "burst"
    rate_baseline_rps: float | None
    hot_baseline: float | None
    rate_ratio: float
    hot_ratio: float
    burst_started_s: float | None
    entry_emb_share: float | None
    cap_emb_share: float | None
    num_bursts: int
    last_event: str | None

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class RecoveryController:
    """Burst detection with hysteresis; in a burst, a KV-ward cap on emb_share.

    Per decision (stats of the interval just ended, ``now_s``):

    - ``rate_ratio = arrival_rate_rps / max(rate_baseline, rate_floor_rps)`` and
      ``hot_ratio = hot_user_ratio / max(hot_baseline, hot_floor)``;
    - baselines: EWMAs with weight ``max(1 - exp(-dt / baseline_tau_s), 1 / n)`` (the running mean
      over the first samples, then a time-constant average), updated only outside bursts, so a
      burst never becomes its own baseline;
    - idle windows (`idle`: under ``rate_floor_rps``, or nothing served) are skipped outside a
      burst: they neither seed nor move the baselines and do not count toward the warmup;
    - phase ``warmup`` until ``warmup_s`` of baseline exist; ``normal`` -> ``burst`` when both ratios
      reach their enter thresholds; ``burst`` -> ``normal`` (hand back) when either ratio is at or
      below its exit threshold on every interval for ``exit_confirm_s``, and ``min_hold_s`` has
      passed since entry; or after ``max_burst_s`` (a lasting shift, not a burst: the baselines
      are set to the current values);
    - in a burst the cap is ``max(0, entry_emb_share - kv_shift)`` with ``entry_emb_share`` the
      split in force at entry; the allocator uses ``min(proposal, cap)``.

    ``update`` returns the event of this step (``"entered"``, ``"ended"``, ``"expired"``) or None.
    """

    def __init__(self, config: RecoveryConfig | None = None):
        self.config = config or RecoveryConfig()
        self.reset()

    def reset(self) -> None:
        self.phase = "warmup"
        self.rate_baseline: float | None = None
        self.hot_baseline: float | None = None
        self.rate_ratio = 1.0
        self.hot_ratio = 1.0
        self.burst_started_s: float | None = None
        self.entry_emb_share: float | None = None
        self.cap: float | None = None
        self.num_bursts = 0
        self.last_event: str | None = None
        self._first_s: float | None = None
        self._last_s: float | None = None
        self._n = 0
        self._below_since_s: float | None = None

    @property
    def active(self) -> bool:
        return self.phase == "burst"

    def _baseline(self, rate: float, hot: float, now_s: float) -> None:
        self._n += 1
        dt = now_s - self._last_s if self._last_s is not None else 0.0
        a = max(1.0 - math.exp(-dt / self.config.baseline_tau_s), 1.0 / self._n)
        self.rate_baseline += a * (rate - self.rate_baseline)
        self.hot_baseline += a * (hot - self.hot_baseline)

    def idle(self, rate_rps: float, hot_user_ratio: float) -> bool:
        """A window that says nothing about the baseline: arrivals under ``rate_floor_rps`` or no
        request served (hot-user ratio 0: `top_share` of an empty window). Such a window neither
        seeds nor moves the baselines, does not count toward ``warmup_s`` and never enters a burst,
        so a node that idled before its load began sees the load's arrival as the start of its
        warmup, not as a burst against a zero baseline (in a burst it is judged as usual)."""
        return not (rate_rps >= self.config.rate_floor_rps and hot_user_ratio > 0.0)

    def update(self, rate_rps: float, hot_user_ratio: float, now_s: float, current_emb_share: float) -> str | None:
        c = self.config
        event = None
        if self.phase != "burst" and self.idle(rate_rps, hot_user_ratio):
            if self.rate_baseline is not None:
                rb = self.rate_baseline if self.rate_baseline > c.rate_floor_rps else c.rate_floor_rps
                hb = self.hot_baseline if self.hot_baseline > c.hot_floor else c.hot_floor
                self.rate_ratio, self.hot_ratio = rate_rps / rb, hot_user_ratio / hb
            return None
        if self.rate_baseline is None:
            self.rate_baseline, self.hot_baseline = rate_rps, hot_user_ratio
            self._first_s = self._last_s = now_s
            self._n = 1
            return None
        rb = self.rate_baseline if self.rate_baseline > c.rate_floor_rps else c.rate_floor_rps
        hb = self.hot_baseline if self.hot_baseline > c.hot_floor else c.hot_floor
        self.rate_ratio = rate_ratio = rate_rps / rb
        self.hot_ratio = hot_ratio = hot_user_ratio / hb
        if self.phase == "burst":
            held = now_s - self.burst_started_s
            # a burst is both at once (more requests, and more of them from hot users): it is over
            # when either is back, so the time after the burst is not shaded as one
            below = rate_ratio <= c.exit_rate_ratio or hot_ratio <= c.exit_hot_ratio
            if not below:
                self._below_since_s = None
            elif self._below_since_s is None:
                self._below_since_s = now_s
            if held >= c.max_burst_s:
                self.phase, event = "normal", "expired"
                self.rate_baseline, self.hot_baseline = rate_rps, hot_user_ratio
                self._n = 1
            elif below and held >= c.min_hold_s and now_s - self._below_since_s >= c.exit_confirm_s:
                self.phase, event = "normal", "ended"
        else:
            if self.phase == "warmup" and now_s - self._first_s >= c.warmup_s:
                self.phase = "normal"
            if self.phase == "normal" and rate_ratio >= c.enter_rate_ratio and hot_ratio >= c.enter_hot_ratio:
                self.phase, event = "burst", "entered"
                self.burst_started_s = now_s
                self.entry_emb_share = current_emb_share
                self.cap = max(0.0, current_emb_share - c.kv_shift)
                self._below_since_s = None
                self.num_bursts += 1
            else:
                self._baseline(rate_rps, hot_user_ratio, now_s)
        self._last_s = now_s
        if event is not None:
            self.last_event = event
        return event

    def state(self) -> RecoveryState:
        return RecoveryState(phase=self.phase, rate_baseline_rps=self.rate_baseline, hot_baseline=self.hot_baseline,
                             rate_ratio=self.rate_ratio, hot_ratio=self.hot_ratio,
                             burst_started_s=self.burst_started_s if self.active else None,
                             entry_emb_share=self.entry_emb_share if self.active else None,
                             cap_emb_share=self.cap if self.active else None, num_bursts=self.num_bursts,
                             last_event=self.last_event)



def recovery_layer(controller: RecoveryController, rate_rps: float, hot_user_ratio: float, now_s: float,
                   prev: float, proposal: float, source_in: str, cost=None,
                   decline_gain: float = 0.0) -> tuple[float, LayerTrace, str | None]:
    """Update the burst detector with this window and, in a burst, cap the proposal at the
    controller's KV-ward cap. ``cost`` (optional, the curve layer's `CostCurve` of this decision):
    the cap is declined where that curve says it saves less than ``decline_gain`` of the cost at
    the proposal (the KV-ward pages would buy nothing: no K/V the burst's users reuse fits there
    that does not fit already). Returns ``(proposal, trace, note)``: ``note`` says when a burst
    ended or lasted into a new regime (control handed back to the base policy), else None.
    Detail: ``phase``, ``event`` (``entered``, ``ended``, ``new_regime`` or None), ``cap`` (None
    outside a burst), ``capped`` (the cap lowered the proposal), ``rate_ratio``, ``hot_ratio``,
    ``burst_started_s``, ``entry_emb_share``, ``kv_shift``, ``proposal_in``, ``source_in``,
    ``cap_declined`` (the curve said the cap saves nothing)."""
    event = controller.update(rate_rps, hot_user_ratio, now_s, prev)
    c = controller.config
    ev = None if event is None else (event if event in ("entered", "ended") else "new_regime")
    burst = controller.phase == "burst"
    cap = controller.cap if burst else None
    capped = burst and proposal > cap
    declined = False
    if capped and cost is not None and decline_gain > 0.0:
        at_p = float(np.interp(proposal, cost.shares, cost.cost))
        at_cap = float(np.interp(cap, cost.shares, cost.cost))
        declined = at_p > 0 and at_p - at_cap < decline_gain * at_p
        capped = not declined
    out = cap if capped else proposal
    note = None
    if not burst and event is not None:
        why = "burst ended" if event == "ended" else f"burst lasted {c.max_burst_s:g}s (new regime; baselines reset)"
        note = f"{why} at t={now_s:g}s: control handed back to the base policy"
    return out, LayerTrace("recovery", out, burst,
                           (controller.phase, ev, cap, capped, controller.rate_ratio, controller.hot_ratio,
                            controller.burst_started_s if burst else None,
                            controller.entry_emb_share if burst else None, c.kv_shift, proposal, source_in,
                            declined)), note
