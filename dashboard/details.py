"""Pure helpers behind the dashboard's tables and dialogs: data in, plain values out.

No I/O, no clock, no Dash: `dashboard.app` fetches through `dashboard.client` and renders what
these return; tests/test_dashboard_figures.py calls them directly.

- which rollout actions the control plane would accept in a state (`rollout_actions`);
- a registry row's validation, training and evaluation as short text (`validation_text`,
  `training_text`, `flat_text`);
- what the nodes run, for the "active policy" card (`node_policies_text`);
- node-local times in decision reasons rendered in UTC too (`clock_offset`, `reason_utc`);
- one decision's drill-down: its fields, layers, features, miss costs and context
  (`decision_detail`), and the expected cost against share its curve layer used
  (`decision_curve`);
- an artifact's files as the tar the control plane's ``POST /policies`` takes (`upload_body`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone

from common.artifact_pack import ARTIFACT_FILES, pack_artifact
from common.contract import parse_curve_text  # the curve layer's trace as reports carry it

# What each operator action on a rollout is allowed from (the control plane's
# `control_plane.rollout._ALLOWED`; a test checks that the two agree). A rollout in none of these
# states (promoted, rolled_back) has ended: every action is refused.
ROLLOUT_ACTIONS: dict[str, frozenset[str]] = {
    "promote": frozenset({"pending", "baking", "paused"}),
    "rollback": frozenset({"pending", "baking", "paused"}),
    "pause": frozenset({"pending", "baking"}),
    "resume": frozenset({"paused"}),
}
OPEN_ROLLOUT_STATES = frozenset({"pending", "baking", "paused"})


def rollout_actions(state: str | None) -> set[str]:
    """The actions (`ROLLOUT_ACTIONS`) valid for a rollout in ``state`` (none for no rollout)."""
    return {a for a, states in ROLLOUT_ACTIONS.items() if state in states}


def can_start_rollout(current: Mapping | None) -> bool:
    """A new rollout (or an activation) is accepted only when no rollout is open."""
    return current is None or current.get("state") not in OPEN_ROLLOUT_STATES


# ------------------------------------------------------------------------------ registry ---


def _num(v, nd: int = 3) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return str(v)
    return f"{v:.{nd}g}"


def validation_text(manifest: Mapping | None) -> str:
    """How the artifact was checked, in a line: the loader's acceptance (the control plane stores
    only artifacts the node agent's loader accepted), feature schema, ONNX parity against torch,
    golden inputs, size and opset."""
    m = manifest or {}
    parts = ["accepted by the agent's loader"]
    if m.get("feature_schema_version") is not None:
        parts.append(f"feature schema {m['feature_schema_version']}")
    par = m.get("parity") or {}
    if par:
        ok = "passed" if par.get("passed", True) else "FAILED"
        diff, tol = par.get("max_abs_diff"), par.get("tolerance")
        if diff is not None and tol is not None:
            parts.append(f"parity {ok} (|ort - torch| {float(diff):.1e} <= {float(tol):g})")
        else:
            parts.append(f"parity {ok}")
    if m.get("num_golden") is not None:
        parts.append(f"{m['num_golden']} golden inputs")
    if m.get("onnx_bytes") is not None:
        parts.append(f"{int(m['onnx_bytes']) / 1024:.1f} KiB ONNX")
    if m.get("opset") is not None:
        parts.append(f"opset {m['opset']}")
    return " · ".join(parts)


def training_text(evaluation: Mapping | None) -> str:
    """How an artifact's base policy was trained, from its manifest's ``evaluation``:
    ``behaviour-cloned (13528 samples), no PPO update, from 254463a5cc71``, ``PPO: 50 updates
    (7200 transitions), after cloning (900 samples)``, ``not trained: <why>`` for an artifact that
    says it was derived, or ``training not recorded``."""
    ev = evaluation or {}
    im, updates, warm = ev.get("imitation") or {}, ev.get("num_updates"), ev.get("warm_start") or {}
    if not im and updates is None:
        skipped = str(ev.get("skipped") or "")
        return f"not trained: {skipped[:80]}" if "not trained" in skipped else "training not recorded"
    cloned = f"behaviour-cloned ({im.get('samples', '?')} samples)" if im else ""
    if updates:
        text = f"PPO: {updates} update{'s' if updates != 1 else ''} ({ev.get('transitions', '?')} transitions)"
        text += f", after cloning ({im.get('samples', '?')} samples)" if im else ""
    else:
        text = (cloned or "untrained") + ", no PPO update"
    if warm.get("policy_id"):
        text += f", from {warm['policy_id']}"
    return text


def _leaves(d, prefix: str = ""):
    if isinstance(d, Mapping):
        for k, v in d.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(d, (list, tuple)):
        if d and len(d) <= 4 and all(isinstance(x, (int, float, str)) for x in d):
            yield prefix, ", ".join(_num(x) for x in d)
    elif d is not None and d != "" and not (isinstance(d, float) and not math.isfinite(d)):
        yield prefix, _num(d)


def flat_text(d, max_items: int = 6) -> str:
    """A nested dict as ``a.b 0.12 · c 3`` (its first ``max_items`` leaves, zeros and empties
    left out), for a table cell; '' for nothing."""
    items = [(k, v) for k, v in _leaves(d) if v not in ("0", "0.0", "")]
    text = " · ".join(f"{k} {v}" for k, v in items[:max_items])
    if len(items) > max_items:
        text += f" · (+{len(items) - max_items} more)"
    return text


def node_policies_text(nodes: Sequence[Mapping], active: str | None = None) -> str:
    """What the nodes run, for the "active policy" card: ``v1 on all 4 nodes`` or ``v1 on 3 of 4
    nodes · v2 on 1`` (the two most common, then how many more);
    the registry's active version is named when no node runs it (or nodes run none)."""
    up = [n for n in nodes if n.get("status", "up") != "retired"]
    counts: dict[str, int] = {}
    for n in up:
        v = n.get("policy_version")
        if v:
            counts[str(v)] = counts.get(str(v), 0) + 1
    if not counts:
        return f"{active} (no node reports it yet)" if active else "–"
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    total = sum(counts.values())
    (top, k), rest = ranked[0], ranked[1:]
    text = f"{top} on all {total} nodes" if not rest else f"{top} on {k} of {total} nodes"
    text += "".join(f" · {v} on {n}" for v, n in rest[:1])
    if len(rest) > 1:
        text += f" · +{len(rest) - 1} more"
    if active and active not in counts:
        text += f" (registry: {active})"
    return text


# -------------------------------------------------------------------------- node clocks ---

_T_RE = re.compile(r"\bt=(-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)s\b")
_ANCHOR_RE = re.compile(r"\b(?:entered at|ended at|lasted [^ ]+ \(new regime; baselines reset\) at) "
                        r"t=(-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)s\b")
_SINCE_RE = re.compile(r"\bburst since t=(-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)s\b")


def clock_offset(decision: Mapping, bursts: Sequence[Mapping] = ()) -> float | None:
    """Seconds to add to the node-local times (``t=...s``) in ``decision``'s reason to get Unix
    time, or None when the reason gives no way to tell.

    Reasons name times on the node's own clock; a decision's ``ts_s`` is on the wall clock. An
    event of the decision's own step (``burst entered at t=X``, ``burst ended at t=X``) happened
    at ``ts_s``; ``burst since t=X`` is the start of the node's burst that holds ``ts_s`` (the
    burst table has that start in wall time)."""
    reason = str(decision.get("reason") or "")
    ts = decision.get("ts_s", decision.get("t_s"))
    if ts is None:
        return None
    m = _ANCHOR_RE.search(reason)
    if m:
        return float(ts) - float(m.group(1))
    m = _SINCE_RE.search(reason)
    if m:
        node = decision.get("node_id")
        for b in bursts:
            end = b.get("end_s")
            if b.get("node_id") == node and b["start_s"] <= float(ts) and (end is None or float(ts) <= end + 1.0):
                return float(b["start_s"]) - float(m.group(1))
    return None


def reason_utc(reason: str, offset_s: float | None) -> str:
    """``reason`` with each node-local ``t=X s`` followed by its UTC time: ``t=4578.5s (12:01:02 UTC)``."""
    if offset_s is None or not reason:
        return reason

    def sub(m: re.Match) -> str:
        try:
            at = datetime.fromtimestamp(float(m.group(1)) + offset_s, tz=timezone.utc)
        except (OverflowError, OSError, ValueError):
            return m.group(0)
        return f"{m.group(0)} ({at.strftime('%H:%M:%S')} UTC)"

    return _T_RE.sub(sub, reason)


def reasons_utc(decisions: Sequence[Mapping], bursts: Sequence[Mapping] = ()) -> list[str]:
    """Every decision's reason with UTC renderings; a decision whose own reason gives no offset
    borrows the nearest (in time) offset found for the same node."""
    own = [clock_offset(d, bursts) for d in decisions]
    by_node: dict[str, list[tuple[float, float]]] = {}
    for d, off in zip(decisions, own):
        if off is not None:
            by_node.setdefault(str(d.get("node_id")), []).append((float(d.get("ts_s", d.get("t_s")) or 0.0), off))
    out = []
    for d, off in zip(decisions, own):
        reason = str(d.get("reason") or "")
        if off is None and _T_RE.search(reason):
            cands = by_node.get(str(d.get("node_id"))) or []
            ts = float(d.get("ts_s", d.get("t_s")) or 0.0)
            if cands:
                off = min(cands, key=lambda c: abs(c[0] - ts))[1]
        out.append(reason_utc(reason, off))
    return out


# --------------------------------------------------------------------------- drill-down ---

DECISION_FIELDS = ("id", "node_id", "seq", "ts_s", "source", "emb_share", "prev_emb_share", "policy_version",
                   "reason", "features", "layers")
MISS_COST_FIELDS = ("kv_recompute_us_per_token", "emb_transfer_us_per_row")
CONTEXT_FIELDS = ("kv_hit_rate", "emb_hit_rate", "p50_ms", "p99_ms", "slo_attainment", "throughput_rps",
                  "num_requests", "queue_depth", "emb_share", "emb_share_target", "refill_bytes")


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v)
    if isinstance(v, Mapping):
        return flat_text(v, 8)
    return str(v)


def _pairs(d: Mapping, skip: Sequence[str] = ()) -> list[tuple[str, str]]:
    return [(str(k), _fmt(v)) for k, v in d.items() if k not in skip]


def decision_detail(decision: Mapping, report: Mapping | None = None, bursts: Sequence[Mapping] = (),
                    offset_s: float | None = None) -> dict:
    """One decision, laid out for the drill-down: ``{"title", "reason", "summary": [(k, v)],
    "layers": [(name, [(k, v)])], "features": [(k, v)], "miss_costs": [(k, v)], "context": [(k, v)],
    "other": [(k, v)]}``.

    ``decision`` is the API's stored decision; a ``layers`` list (one dict per allocator layer,
    each with a ``layer`` or ``name``) becomes one key/value table per layer; any field this
    function does not know goes to ``other`` as it is. ``report`` is the node's report of the
    same control interval (the miss costs and the context at that moment: hit rates, latency,
    load); ``bursts`` / ``offset_s`` render node-local times in the reason in UTC too."""
    ts = decision.get("ts_s")
    when = "" if ts is None else datetime.fromtimestamp(float(ts), tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    if offset_s is None:
        offset_s = clock_offset(decision, bursts)
    prev, new = decision.get("prev_emb_share"), decision.get("emb_share")
    summary = [("time (UTC)", when), ("node", _fmt(decision.get("node_id"))), ("source", _fmt(decision.get("source"))),
               ("emb_share", f"{_fmt(prev)} → {_fmt(new)}" if prev is not None else _fmt(new)),
               ("policy", _fmt(decision.get("policy_version"))), ("report seq", _fmt(decision.get("seq")))]
    layers = []
    for i, layer in enumerate(decision.get("layers") or []):
        if isinstance(layer, Mapping):
            name = str(layer.get("layer") or layer.get("name") or f"layer {i + 1}")
            layers.append((name, _pairs(layer, ("layer", "name"))))
    feats = decision.get("features") or {}
    feats = feats if isinstance(feats, Mapping) else {}
    features = _pairs(feats)
    rep = report or {}
    miss = [(k, _fmt(rep.get(k))) for k in MISS_COST_FIELDS if k in rep]
    miss += [(k, _fmt(v)) for k, v in feats.items() if "miss" in k]
    context = [(k, _fmt(rep.get(k))) for k in CONTEXT_FIELDS if k in rep]
    if rep.get("ts_s") is not None:
        context.insert(0, ("report time (UTC)", datetime.fromtimestamp(float(rep["ts_s"]), tz=timezone.utc)
                           .strftime("%Y-%m-%d %H:%M:%S")))
    other = [(str(k), _fmt(v)) for k, v in decision.items() if k not in DECISION_FIELDS]
    return {"title": f"Decision #{decision.get('id')} · {decision.get('node_id')} · {decision.get('source')}",
            "reason": reason_utc(str(decision.get("reason") or ""), offset_s), "summary": summary,
            "layers": layers, "features": features, "miss_costs": miss, "context": context, "other": other,
            "curve": decision_curve(decision)}


def decision_curve(decision: Mapping) -> dict | None:
    """The expected cost against share that the decision's curve layer used
    (`node_agent.allocator.curve`; its ``curve`` detail read by `common.contract.parse_curve_text`):
    ``{"shares", "cost_us", "chosen", "min_share", "proposal_in", "action"}``, or None when the
    decision has no curve layer with a curve (curves off, too little evidence)."""
    for layer in decision.get("layers") or []:
        if not isinstance(layer, Mapping) or (layer.get("layer") or layer.get("name")) != "curve":
            continue
        det = layer.get("detail") if isinstance(layer.get("detail"), Mapping) else {}
        pts = parse_curve_text(str(det.get("curve") or ""))
        if not pts:
            return None

        def num(v):
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

        return {"shares": [x for x, _ in pts], "cost_us": [y for _, y in pts], "chosen": num(decision.get("emb_share")),
                "min_share": num(det.get("min_share")), "proposal_in": num(det.get("proposal_in")),
                "action": det.get("action")}
    return None


# ----------------------------------------------------------------------------- uploads ---


def upload_body(named: Sequence[tuple[str, bytes]]) -> bytes:
    """What the policies tab sends for the files an operator chose: one tar (or tar.gz) as it is,
    else the artifact's files (``manifest.json``, ``policy.onnx``, ``golden.npz``) packed into one.
    Raises ValueError saying what is missing."""
    if len(named) == 1 and named[0][0].endswith((".tar", ".tgz", ".tar.gz")):
        return named[0][1]
    files = {name.rsplit("/", 1)[-1]: data for name, data in named}
    missing = [f for f in ARTIFACT_FILES if f not in files]
    if missing:
        raise ValueError(f"choose a .tar of the artifact or its three files ({', '.join(ARTIFACT_FILES)}); "
                         f"missing: {', '.join(missing)}")
    return pack_artifact({f: files[f] for f in ARTIFACT_FILES})
