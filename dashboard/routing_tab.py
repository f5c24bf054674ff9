"""The router weights, on the Decisions & routing page below the decision grid
(`dashboard.decisions_tab`): one weight field over time per node, and the table of weight
versions with the reason each was computed. ``render`` draws both (no live tick)."""

from __future__ import annotations

import dash_bootstrap_components as dbc
from dash import Output, dcc, html

from . import figures as F
from .common import RenderInput, col, fmt_t, graph, grid, time_col

WEIGHT_FIELDS = ["service_time_us", "kv_recompute_us_per_token", "emb_transfer_us_per_row", "queue_capacity"]
RENDER_OUTPUTS = {"weights_figure": Output("g-weights", "figure"), "weights_rows": Output("grid-weights", "rowData")}


def layout() -> list:
    return [
        dbc.Row([dbc.Col([html.Span("router weight field: ", className="small me-2"),
                          dcc.Dropdown(id="weights-field", clearable=False, value="service_time_us",
                                       options=WEIGHT_FIELDS)], lg=4)],
                className="mt-3"),
        graph("g-weights", 340),
        grid("grid-weights", [col("version"), time_col("time", "computed (UTC)"), col("reason", minWidth=500, flex=3)],
             height=240, page_size=5),
    ]


def render(r: RenderInput) -> dict:
    hist = [h for h in r.client.router_weights_history(r.tok) if h["computed_at_s"] >= r.start]
    hist = [dict(h, t_s=h["computed_at_s"]) for h in hist]
    return {"weights_figure": F.router_weights_figure(sorted(hist, key=lambda h: h["t_s"]),
                                                      r.weights_field or "service_time_us", r.now),
            "weights_rows": [{"version": h["version"], "time": fmt_t(h["t_s"]), "reason": h.get("reason", "")}
                             for h in sorted(hist, key=lambda h: -h["version"])]}
