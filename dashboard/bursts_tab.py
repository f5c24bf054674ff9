"""The Bursts page: the burst periods (shaded orange on every time chart) with what the recovery
controller did in each, and the cluster's P99 with the bursts shaded. ``render`` draws both;
``tick`` refreshes the table."""

from __future__ import annotations

import math

from dash import Output, html

from . import figures as F
from .client import cluster_series
from .common import DECISION_LIMIT, RenderInput, col, fmt_t, graph, grid, time_col

RENDER_OUTPUTS = {"bursts_rows": Output("grid-bursts", "rowData"), "bursts_p99_figure": Output("g-bursts-p99", "figure")}
TICK_OUTPUTS = {"bursts_rows_tick": Output("grid-bursts", "rowData", allow_duplicate=True)}


def layout():
    return html.Div([
        html.P("Burst periods (shaded orange on every time chart) and what the recovery controller did.",
               className="small text-muted"),
        grid("grid-bursts", [col("node_id", "node"), time_col("start", "start (UTC)"), time_col("end", "end (UTC)"),
                             col("duration_s", "duration (s)"), col("magnitude", "magnitude (× rate)"),
                             col("recovery_actions", "recovery actions", minWidth=260)], height=320),
        graph("g-bursts-p99", 340),
    ], className="pt-2")


def burst_rows(bursts: list[dict], decisions: list[dict] | None = None, now_s: float | None = None) -> list[dict]:
    """Burst table rows; recovery actions are the node's ``recovery`` decisions within the burst."""
    rows = []
    for b in sorted(bursts, key=lambda b: b["start_s"], reverse=True):
        end = b.get("end_s")
        actions = [d for d in (decisions or []) if d.get("node_id") == b["node_id"] and d.get("source") == "recovery"
                   and b["start_s"] <= d["ts_s"] <= (end if end is not None else math.inf)]
        summary = f"{len(actions)} recovery decisions"
        if actions:
            shares = [d["emb_share"] for d in actions]
            summary += f", emb_share {max(shares):.3f} → {min(shares):.3f}"
        dur = (end if end is not None else (now_s or b["start_s"])) - b["start_s"]
        rows.append({"id": b.get("id"), "node_id": b["node_id"], "start": fmt_t(b["start_s"]),
                     "end": fmt_t(end) if end is not None else "ongoing", "duration_s": round(dur, 1),
                     "magnitude": round(float(b.get("magnitude") or 0.0), 3), "recovery_actions": summary})
    return rows


def render(r: RenderInput) -> dict:
    dec = r.client.decisions(r.tok, start_s=r.start, source="recovery", limit=DECISION_LIMIT)["items"]
    fig = F.p99_figure({}, r.slo_ms, r.bursts, r.now, cluster=cluster_series(r.rows), step_s=r.step)
    fig.update_layout(title_text="Cluster P99 (worst node) with burst periods")
    return {"bursts_rows": burst_rows(r.bursts, dec, r.now), "bursts_p99_figure": fig}


def tick(client, tok: str, now: float, range_s: float) -> list[dict]:
    """The burst table's rows now."""
    bursts = client.bursts(tok, start_s=now - range_s)
    dec = client.decisions(tok, start_s=now - range_s, source="recovery", limit=DECISION_LIMIT)["items"]
    return burst_rows(bursts, dec, now)
