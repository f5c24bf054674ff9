"""What each layer of a decision did: `LayerTrace`, one per layer that ran, in order.

A decision composes the layers ``base -> residual -> curve -> recovery -> override -> guard``
(`common.contract.LAYERS`); each takes
the previous layer's proposal and returns its own with a trace: the layer's name, the proposal it
returned, whether it set the decision's source (``acted``) and ``detail``, the structured inputs
and figures it used (JSON-able scalars; their names per layer, and the bounds on what a report
carries of them, are the wire contract's: `common.contract.DETAIL_FIELDS`). The reason in words is rendered from the traces when it
is first read (`render_reason`), so the record is cheap and the dashboard can show one decision
layer by layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.contract import DETAIL_FIELDS  # each layer's detail by name, as reports carry it


@dataclass(slots=True, eq=False)
class LayerTrace:
    """One layer's part in a decision (a record: treat as read-only).

    ``proposal`` is the emb_share the layer hands on (NaN where it had none: a base policy that
    did not run); ``acted`` is True when the layer set the decision's source (the base ran, the
    residual moved the proposal, a burst is in force, an override is in force, a guard changed the
    value); ``values`` the layer's inputs and figures in the order of ``DETAIL_FIELDS[layer]``
    (a tuple: a decision is on the serving node's control path), ``detail`` the same by name.
    """

    layer: str
    proposal: float
    acted: bool
    values: tuple

    @property
    def detail(self) -> dict:
        return dict(zip(DETAIL_FIELDS[self.layer], self.values))

    def to_dict(self) -> dict:
        p = self.proposal
        return {"layer": self.layer, "proposal": None if p != p else p, "acted": self.acted,
                "detail": {k: (None if isinstance(v, float) and not math.isfinite(v)
                               else v if v is None or isinstance(v, (str, int, float, bool)) else str(v))
                           for k, v in self.detail.items()}}


def _base_words(d: dict) -> str:
    if d["hold_reason"] is not None:
        return f"holding: {d['hold_reason']}"
    return f"base policy {d['policy_id']} {d['output']:.4f}"


def _residual_words(d: dict, inner: str) -> str:
    if d["offset"] != 0.0 or d["tuner_step"] != 0.0:
        return (f"{inner} + residual {d['correction']:+.4f} + operating point {d['offset']:+.4f} "
                f"({d['tuner_action']} {d['tuner_step']:+.4f}, busy-time gradient {d['tuner_gradient']:+.4f}, "
                f"estimate {d['tuner_mean_gradient']:+.4f} +- {d['tuner_gradient_se']:.4f}"
                f"{' (sign test)' if d['tuner_sign_test'] else ''}, at load {d['load']:.2f})")
    if d["correction"] != 0.0:
        return f"{inner} + residual {d['correction']:+.4f}"
    return inner


def _curve_words(d: dict, inner: str) -> str:
    a = d["action"]
    if a == "to_minimum" or a == "jump":
        return (f"miss-ratio curves: expected {d['cost_min_us']:.0f} us per request at {d['min_share']:.2f} against "
                f"{d['cost_proposal_us']:.0f} at the proposal {d['proposal_in']:.4f} (saves {100 * d['gain']:.0f}%): "
                f"to the curve's minimum" + (f", at once (a cliff: {d['cost_prev_us']:.0f} us in force, the step-down "
                                             f"limit waived)" if a == "jump" else "") + f" ({inner})")
    if a == "refuse_step":
        return (f"miss-ratio curves: the step to {d['proposal_in']:.4f} costs {d['cost_proposal_us']:.0f} us per "
                f"request against {d['cost_prev_us']:.0f} in force (a cliff): step refused ({inner})")
    if a == "flat":
        return (f"miss-ratio curves: the split last chosen is within the dead band of the minimum's "
                f"{d['cost_min_us']:.0f} us per request at {d['min_share']:.2f}: held there, not moved to "
                f"{d['proposal_in']:.4f} ({inner})")
    return inner


def _recovery_words(d: dict, inner: str) -> str:
    if d["phase"] != "burst":
        return inner
    head = (f"burst {'entered at' if d['event'] == 'entered' else 'since'} t={d['burst_started_s']:g}s "
            f"(rate x{d['rate_ratio']:.2f}, hot-user ratio x{d['hot_ratio']:.2f} of baseline): ")
    if d["capped"]:
        return (f"{head}KV-ward cap {d['cap']:.4f} (entry {d['entry_emb_share']:.4f} - {d['kv_shift']:g}) under "
                f"{d['source_in']} proposal {d['proposal_in']:.4f} ({inner})")
    if d.get("cap_declined"):
        return (f"{head}KV-ward cap {d['cap']:.4f} declined (the miss-ratio curve says it saves next to "
                f"nothing): {d['source_in']} proposal {d['proposal_in']:.4f} kept ({inner})")
    return (f"{head}{d['source_in']} proposal {d['proposal_in']:.4f} already under the KV-ward cap "
            f"{d['cap']:.4f} ({inner})")


def _override_words(d: dict, inner: str) -> str:
    if not d["active"]:
        return inner
    until = "until cleared" if d["expires_at_s"] is None else f"until t={d['expires_at_s']:g}s"
    return (f"operator override {d['emb_share']:.4f} ({d['reason']}) {until}; layers proposed "
            f"{d['proposal_in']:.4f} via {d['source_in']} ({inner})")


def guard_words(action: str, limit: float, prev: float) -> str:
    """A guard action in words (``limit``: the step or bound that applied)."""
    if action == "step_up":
        return f"step limited to +{limit:g} from {prev:.4f}"
    if action == "step_down":
        return f"step limited to -{limit:g} from {prev:.4f}"
    return f"clamped to {action}_emb_share {limit:g}"


def _guard_text(d: dict, inner: str) -> str:
    r = inner
    if d["taken_back"] != 0.0:
        r = f"{r}; the step limit took back {d['taken_back']:+.4f} of the operating point's step"
    if d["action"] is not None:
        r = f"{guard_words(d['action'], d['limit'], d['prev'])}; {d['source_in']}: {r}"
    return r


_RENDER = {"residual": _residual_words, "curve": _curve_words, "recovery": _recovery_words, "override": _override_words,
           "guard": _guard_text}


def render_reason(layers: tuple[LayerTrace, ...], notes: tuple[str, ...]) -> str:
    """The decision's reason in words: the base layer's, wrapped by each later layer that acted,
    then the step's notes (an override expired, a burst ended) in brackets."""
    r = _base_words(layers[0].detail)
    for t in layers[1:]:
        r = _RENDER[t.layer](t.detail, r)
    if notes:
        r = f"{r} [{'; '.join(notes)}]"
    return r
