"""The record of one decision (`AllocatorDecision`): the value, its source, every layer's trace."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from node_agent.allocator.trace import LayerTrace, render_reason
from node_agent.features import FEATURE_NAMES


@dataclass(slots=True, eq=False)
class AllocatorDecision:
    """One control interval's decision, with everything needed to explain it (a record: treat
    it as read-only; not frozen because a frozen dataclass costs ~2 µs more per decision).

    ``emb_share`` is what the memory manager should apply; ``source`` the layer that set it
    (one of `DECISION_SOURCES`); ``layers`` every layer's `LayerTrace` in the order they ran
    (base first, guard last); ``reason`` says why in words, rendered from the traces when first
    read. ``proposed_emb_share`` is the value before the guards, ``base_emb_share`` the policy's
    raw output (NaN when the base did not run), ``residual`` the adapter's correction,
    ``features`` a copy of the policy input (zeros when the stats were invalid and the allocator
    held the split).

    Flat summary fields (the same figures as in the traces, for tables and tests):
    ``layer_source`` the layer whose proposal reached the guards (``base``, ``residual``,
    ``recovery``, ``override``, or ``guard`` for a hold); ``guard_action`` the guard that changed
    the value (`GUARD_ACTIONS`) or None; ``hold_reason`` why the split was held (invalid stats, no
    policy, a bad base output) or None; ``recovery_phase`` (``warmup``, ``normal``, ``burst``),
    ``recovery_event`` (``entered``, ``ended``, ``new_regime`` or None) and ``recovery_cap`` (the
    KV-ward cap in a burst, else None); ``override_reason`` the operator's reason while an
    override is in force; ``notes`` other events of the step (an override expired, a burst ended).
    The operating-point tuner (part of the residual layer): ``tuner_offset`` its offset in the
    proposal (``proposed = base + residual + tuner_offset`` before recovery, override and guards),
    ``tuner_step`` how much this decision moved it (after the anti-windup), ``tuner_gradient`` the
    measured busy-time gradient (share of a request's device time that 10% of the arena moved
    toward the EMB slab would save; negative: toward the KV pool) and ``tuner_action``
    (`TUNER_ACTIONS`, or None when the tuner did not run: disabled, a hold, an override).
    """

    seq: int
    now_s: float
    emb_share: float
    source: str
    layers: tuple[LayerTrace, ...]
    prev_emb_share: float
    proposed_emb_share: float
    layer_source: str
    recovery_phase: str
    policy_id: str | None
    features: np.ndarray
    notes: tuple[str, ...] = ()
    _reason: str | None = None

    # the flat summary, read from the traces (nothing is stored twice)
    @property
    def base_emb_share(self) -> float:
        return self.layers[0].values[1]

    @property
    def hold_reason(self) -> str | None:
        return self.layers[0].values[2]

    @property
    def guard_action(self) -> str | None:
        return self.layers[-1].values[0]

    @property
    def recovery_active(self) -> bool:
        return self.recovery_phase == "burst"

    @property
    def override_active(self) -> bool:
        return self.layer_source == "override"

    @property
    def override_reason(self) -> str | None:
        return self.layers[-2].values[2] if self.layer_source == "override" else None

    def _values(self, name: str) -> tuple | None:
        for t in self.layers:
            if t.layer == name:
                return t.values
        return None

    @property
    def residual(self) -> float:
        v = self._values("residual")
        return v[0] if v is not None else 0.0

    @property
    def recovery_event(self) -> str | None:
        v = self._values("recovery")
        return v[1] if v is not None else None

    @property
    def recovery_cap(self) -> float | None:
        v = self._values("recovery")
        return v[2] if v is not None else None

    @property
    def tuner_action(self) -> str | None:
        v = self._values("residual")
        return v[2] if v is not None else None

    @property
    def tuner_gradient(self) -> float:
        v = self._values("residual")
        return v[4] if v is not None else 0.0

    def _taken_back(self) -> float:
        """The part of the tuner's step that later layers took back: a curve layer's hold and the
        guards' step limit (the anti-windup)."""
        c = self._values("curve")
        return self.layers[-1].values[6] + (c[-1] if c is not None else 0.0)

    @property
    def tuner_offset(self) -> float:
        """The offset after this decision (the anti-windup's take-back included)."""
        v = self._values("residual")
        return v[1] - self._taken_back() if v is not None else 0.0

    @property
    def tuner_step(self) -> float:
        """How much this decision moved the offset (the anti-windup's take-back included)."""
        v = self._values("residual")
        return v[3] - self._taken_back() if v is not None else 0.0

    @property
    def reason(self) -> str:
        """Why, in words, rendered from the layers' traces on first read (formatting a dozen
        numbers on every decision would cost more than the decision's arithmetic)."""
        if self._reason is None:
            self._reason = render_reason(self.layers, self.notes)
        return self._reason

    def layer(self, name: str) -> LayerTrace | None:
        """The trace of layer ``name`` (None when that layer did not run in this decision)."""
        for t in self.layers:
            if t.layer == name:
                return t
        return None

    def to_dict(self) -> dict:
        """JSON-able (NaN base becomes None; features as name -> value; layers as a list of dicts)."""
        d = {k: getattr(self, k) for k in _RECORD_FIELDS}
        d["reason"] = self.reason
        if math.isnan(d["base_emb_share"]):
            d["base_emb_share"] = None
        d["features"] = {n: float(v) for n, v in zip(FEATURE_NAMES, self.features)}
        d["notes"] = list(self.notes)
        d["layers"] = [t.to_dict() for t in self.layers]
        return d


_RECORD_FIELDS = ("seq", "now_s", "emb_share", "source", "prev_emb_share", "proposed_emb_share", "base_emb_share",
                  "residual", "recovery_active", "override_active", "policy_id", "layer_source", "guard_action",
                  "hold_reason", "recovery_phase", "recovery_event", "recovery_cap", "override_reason", "notes",
                  "tuner_offset", "tuner_step", "tuner_gradient", "tuner_action")
