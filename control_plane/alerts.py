"""What an operator must be woken for, from the control plane's own records.

`evaluate` gives the alerts firing now (``GET /api/v1/alerts``; the dashboard's banner). The same
conditions over the processes' Prometheus metrics ship as rules, `deploy/prometheus/racer-alerts.yml`
(one name per condition, the ``alert`` names below), for a Prometheus that pages.

- ``RacerSLOBurnFast`` / ``RacerSLOBurnSlow``: the clients' SLO (the gateways' reports,
  request-weighted; failures count as misses) burns its error budget ``1 - slo_objective`` too
  fast, as a multiwindow burn-rate alert (the SRE workbook's, chapter 5): the miss ratio over the
  budget at least 14.4 over both the last 5 minutes and the last hour (page: 2% of a 30-day
  budget in an hour), or at least 6 over both 30 minutes and 6 hours (ticket). The short window
  makes it stop soon after the burn stops; the long one keeps a blip from paging.
- ``RacerNodeDown``: a node the liveness job marked down (no report for
  ``liveness_missed_intervals`` intervals).
- ``RacerNodePinnedAtBound``: a node whose allocator ran into one of its guard bounds (the guard
  clamped its proposal to ``min_emb_share`` or ``max_emb_share``) in at least ``pinned_fraction``
  of its decisions over the last ``alert_window_s`` (and at least `MIN_PINNED_DECISIONS`): the
  policy wants a split it may not have, so either the traffic left the range it was trained
  for or the bound is wrong for this fleet.
- ``RacerReportsDropped``: a node whose count of dropped reports rose within the last
  ``alert_window_s`` (as this replica saw it: a replica that starts takes the count it first sees
  as the baseline, the nodes table shows the total).
- ``RacerRolloutRolledBack``: a rollout rolled back within the last hour (automatically or by
  an operator): its candidate is what to look at.

Each alert: ``{"alert", "severity" ("page" or "ticket"), "target", "since_s", "summary"}``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from db.models import Decision, GatewayReport, Node, Rollout

#: burn-rate windows (seconds) and thresholds: (short, long, burn, severity)
BURN_WINDOWS = ((300.0, 3600.0, 14.4, "page"), (1800.0, 21600.0, 6.0, "ticket"))
MIN_PINNED_DECISIONS = 10
ROLLBACK_WINDOW_S = 3600.0
BOUND_ACTIONS = ("min", "max")
ALERTS = ("RacerSLOBurnFast", "RacerSLOBurnSlow", "RacerNodeDown", "RacerNodePinnedAtBound", "RacerReportsDropped",
          "RacerRolloutRolledBack")


@dataclass(frozen=True)
class AlertConfig:
    slo_objective: float = 0.99
    window_s: float = 600.0
    pinned_fraction: float = 0.5


def _alert(name: str, severity: str, target: str, since_s: float | None, summary: str) -> dict:
    return {"alert": name, "severity": severity, "target": target, "since_s": since_s, "summary": summary}


def client_miss_ratio(s: Session, since_s: float) -> tuple[float | None, int]:
    """The share of the clients' requests since ``since_s`` that missed the SLO (the gateways'
    reports, request-weighted; None without a request) and the requests counted."""
    n, within = s.execute(select(func.sum(GatewayReport.num_requests),
                                 func.sum(GatewayReport.num_requests * GatewayReport.slo_attainment))
                          .where(GatewayReport.ts_s >= since_s, GatewayReport.slo_attainment.is_not(None))).one()
    if not n:
        return None, 0
    return max(0.0, 1.0 - float(within) / float(n)), int(n)


def slo_burn(s: Session, now_s: float, objective: float) -> list[dict]:
    budget = 1.0 - objective
    out = []
    for (short, long_, burn, severity), name in zip(BURN_WINDOWS, ("RacerSLOBurnFast", "RacerSLOBurnSlow")):
        rates = [client_miss_ratio(s, now_s - w) for w in (short, long_)]
        if any(r is None for r, _ in rates):
            continue
        burns = [r / budget for r, _ in rates]
        if min(burns) >= burn:
            out.append(_alert(name, severity, "clients", None,
                              f"the clients' SLO misses burn the error budget ({100 * budget:g}% at objective "
                              f"{objective:g}) {burns[0]:.1f}x over {short / 60:g} min and {burns[1]:.1f}x over "
                              f"{long_ / 3600:g} h (alert at {burn:g}x in both; {rates[0][1]} requests in the short "
                              f"window)"))
    return out


def nodes_down(s: Session) -> list[dict]:
    return [_alert("RacerNodeDown", "page", f"node:{n.node_id}", n.last_seen_s,
                   f"node {n.node_id} has sent no report since its last at {n.last_seen_s:.0f} (status down)")
            for n in s.scalars(select(Node).where(Node.status == "down").order_by(Node.node_id))]


def _bound_of(layers) -> tuple[str, float] | None:
    """The guard bound a decision was clamped to, from its layer trace (None: not clamped to one)."""
    for layer in layers or ():
        if isinstance(layer, dict) and layer.get("layer") == "guard":
            d = layer.get("detail") or {}
            if d.get("action") in BOUND_ACTIONS and isinstance(d.get("limit"), (int, float)):
                return str(d["action"]), float(d["limit"])
    return None


def pinned_nodes(s: Session, now_s: float, cfg: AlertConfig) -> list[dict]:
    by: dict[str, list] = {}
    rows = s.execute(select(Decision.node_id, Decision.ts_s, Decision.layers)
                     .join(Node, Node.node_id == Decision.node_id)
                     .where(Decision.ts_s >= now_s - cfg.window_s, Node.status != "retired")
                     .order_by(Decision.node_id, Decision.ts_s))
    for node_id, ts, layers in rows:
        by.setdefault(node_id, []).append((ts, _bound_of(layers)))
    out = []
    for node_id, ds in by.items():
        if len(ds) < MIN_PINNED_DECISIONS:
            continue
        counts: dict = {}
        for _, b in ds:
            if b is not None:
                counts[b] = counts.get(b, 0) + 1
        if not counts:
            continue
        (action, limit), k = max(counts.items(), key=lambda kv: kv[1])
        if k >= cfg.pinned_fraction * len(ds):
            first = next(ts for ts, b in ds if b == (action, limit))
            out.append(_alert("RacerNodePinnedAtBound", "ticket", f"node:{node_id}", first,
                              f"node {node_id}'s allocator was held at its {action} emb_share {limit:g} in {k} of "
                              f"its {len(ds)} decisions over the last {cfg.window_s / 60:g} min: the policy wants "
                              f"a split past the guard bound"))
    return out


def reports_dropped(dropped: dict, now_s: float, cfg: AlertConfig) -> list[dict]:
    """``dropped``: node_id -> (seq, count, rose_at_s or None) as the ingest route keeps it."""
    out = []
    for node_id, rec in sorted(dropped.items()):
        rose = rec[2] if len(rec) > 2 else None
        if rose is not None and rose >= now_s - cfg.window_s:
            out.append(_alert("RacerReportsDropped", "ticket", f"node:{node_id}", rose,
                              f"node {node_id} dropped reports (now {rec[1]} in all): its history has a gap"))
    return out


def rolled_back(s: Session, now_s: float) -> list[dict]:
    rs = s.scalars(select(Rollout).where(Rollout.state == "rolled_back",
                                         Rollout.updated_at_s >= now_s - ROLLBACK_WINDOW_S)
                   .order_by(Rollout.updated_at_s))
    return [_alert("RacerRolloutRolledBack", "ticket", f"rollout:{r.id}", r.updated_at_s,
                   f"{r.kind} rollout {r.id} of {(r.model_version or r.policy_version or '?')[:16]} was rolled back: "
                   f"{(r.reason or '')[:300]}") for r in rs]


def evaluate(s: Session, now_s: float, cfg: AlertConfig, dropped: dict) -> list[dict]:
    """Every alert firing at ``now_s``, pages first."""
    out = (slo_burn(s, now_s, cfg.slo_objective) + nodes_down(s) + pinned_nodes(s, now_s, cfg)
           + reports_dropped(dropped, now_s, cfg) + rolled_back(s, now_s))
    return sorted(out, key=lambda a: (a["severity"] != "page", ALERTS.index(a["alert"]), a["target"]))
