"""The Decisions & routing tab's decision grid and its drill-down.

- The grid holds the allocator decisions of the time range that match the search (the API's
  ``q``: node id or text in the reason). One callback owns it: a new search or range refills it
  whole, and a live tick adds only newer decisions *of the same search* (the search the grid
  shows is kept with it in the ``dec-view`` store, so a tick can never add rows of another
  filter). Reasons are whole (a tooltip and wrapped text, never cut), and node-local times in them
  (``t=4578.5s``) get their UTC time beside them (`dashboard.details.reasons_utc`).
- Clicking a row opens the drill-down (`dashboard.details.decision_detail`): the full reason, the
  decision's fields, a key/value table per allocator layer where the stored decision has a
  ``layers`` list, the features the policy saw, the miss costs, and the node's report of that
  control interval (hit rates, latency, load) as context; where the decision's curve layer ran,
  the expected cost against share from the caches' miss-ratio curves (time per request plus
  the tail's extra recompute), with the share chosen, the curve's minimum and the layers'
  proposal marked (`curve_figure`).
"""

from __future__ import annotations

import time

import dash_bootstrap_components as dbc
from dash import Input, Output, State, ctx, dcc, html, no_update

from . import details as D
from . import figures as F
from .client import ApiError, ControlPlaneClient, Unavailable

DECISION_LIMIT = 500
TICK_LIMIT = 100


def _t(t_s) -> str:
    return "" if t_s is None else F.x_to_text(F.to_x(t_s))


def grid_columns(col, time_col) -> list[dict]:
    return [time_col("time", "time (UTC)"), col("node_id", "node"), col("source"), col("emb_share", "emb_share"),
            col("prev_emb_share", "previous"), col("policy_version", "policy"),
            col("reason", "reason (click a row for details)", minWidth=420, flex=3, tooltipField="reason",
                wrapText=True, autoHeight=True, cellStyle={"lineHeight": "1.35", "paddingTop": "4px",
                                                           "paddingBottom": "4px"})]


def search_box() -> dbc.Row:
    return dbc.Row([dbc.Col(dbc.Input(id="dec-search", placeholder="search decisions (node, source, reason…)",
                                      debounce=True, type="search"), lg=6),
                    dbc.Col(html.Div(id="dec-count", className="small text-muted mt-2", role="status"), lg=6)],
                   className="mb-2")


def count_text(total: int, shown: int, search: str | None) -> str:
    what = f"decisions matching “{search}”" if search else "decisions"
    if total > shown:
        return f"the newest {shown:,} of {total:,} {what} in the range"
    return f"{total:,} {what} in the range"


def drill_down_modal() -> dbc.Modal:
    return dbc.Modal([dbc.ModalHeader(dbc.ModalTitle(id="dec-detail-title")), dbc.ModalBody(id="dec-detail")],
                     id="dec-modal", is_open=False, size="xl", scrollable=True)


def decision_rows(items: list[dict], bursts: list[dict] | None = None) -> list[dict]:
    """Grid rows; ``rid`` (the row id) carries what the drill-down needs: ``id|node_id|ts_s``."""
    reasons = D.reasons_utc(items, bursts or [])
    return [{"rid": f"{d['id']}|{d['node_id']}|{d['ts_s']!r}", "id": str(d["id"]), "time": _t(d["ts_s"]),
             "node_id": d["node_id"], "source": d["source"], "emb_share": round(d["emb_share"], 4),
             "prev_emb_share": None if d.get("prev_emb_share") is None else round(d["prev_emb_share"], 4),
             "policy_version": d.get("policy_version"), "reason": r} for d, r in zip(items, reasons)]


def _kv_table(pairs, label: str) -> html.Table:
    return html.Table([html.Tbody([html.Tr([html.Th(k, className="fw-normal text-muted pe-3"), html.Td(v)])
                                   for k, v in pairs])],
                      className="table table-sm small mb-2", **{"aria-label": label})


def curve_figure(curve: dict):
    """Expected cost (µs: time per request plus the tail's extra recompute) against emb_share from
    `dashboard.details.decision_curve`, the chosen share (solid), the curve's minimum (dotted) and
    the proposal the curve layer got (dashed) marked."""
    import plotly.graph_objects as go

    fig = go.Figure(go.Scatter(x=curve["shares"], y=curve["cost_us"], mode="lines+markers", name="expected cost",
                               hovertemplate="emb_share %{x:.2f}: %{y:.1f} µs<extra></extra>"))
    for key, dash, label in (("chosen", "solid", "chosen"), ("min_share", "dot", "curve minimum"),
                             ("proposal_in", "dash", "proposal in")):
        x = curve.get(key)
        if x is not None:
            fig.add_vline(x=x, line_dash=dash, annotation_text=f"{label} {x:.2f}", annotation_position="top")
    fig.update_layout(height=260, margin=dict(l=50, r=10, t=30, b=40), showlegend=False,
                      xaxis_title="emb_share", yaxis_title="expected µs (mean + tail)", xaxis_range=[0, 1])
    return fig


def detail_body(d: dict) -> list:
    """The drill-down's content from `dashboard.details.decision_detail`."""
    sec = [html.H6("Reason"), html.Pre(d["reason"] or "–", className="small", style={"whiteSpace": "pre-wrap"}),
           dbc.Row([dbc.Col([html.H6("Decision"), _kv_table(d["summary"], "decision")], lg=6),
                     dbc.Col([html.H6("Context at that moment (the node's report)"),
                              _kv_table(d["context"], "context") if d["context"]
                              else html.Div("no report of that interval", className="small text-muted")], lg=6)])]
    if d.get("curve"):
        c = d["curve"]
        sec.append(html.H6(f"Expected cost against share (miss-ratio curves; action {c.get('action')})"))
        sec.append(dcc.Graph(figure=curve_figure(c), config={"displayModeBar": False}, id="dec-curve"))
    if d["layers"]:
        sec.append(html.H6("Layers (in order)"))
        sec.append(dbc.Row([dbc.Col([html.Div(name, className="fw-semibold small"), _kv_table(pairs, f"layer {name}")],
                                    lg=4) for name, pairs in d["layers"]]))
    sec.append(dbc.Row([
        dbc.Col([html.H6("Miss costs"), _kv_table(d["miss_costs"], "miss costs") if d["miss_costs"]
                 else html.Div("not reported", className="small text-muted")], lg=4),
        dbc.Col([html.H6("Features the policy saw"), _kv_table(d["features"], "features") if d["features"]
                 else html.Div("none stored", className="small text-muted")], lg=8)]))
    if d["other"]:
        sec.append(html.H6("Other fields"))
        sec.append(_kv_table(d["other"], "other fields"))
    return sec


GRID_OUTPUTS = {"rows": Output("grid-decisions", "rowData", allow_duplicate=True),
                "added": Output("grid-decisions", "rowTransaction"), "dv": Output("dec-view", "data"),
                "count": Output("dec-count", "children")}
DETAIL_OUTPUTS = {"open": Output("dec-modal", "is_open"), "title": Output("dec-detail-title", "children"),
                  "body": Output("dec-detail", "children")}


def register(app, client: ControlPlaneClient, sessions, *, default_range_s: int = 900) -> None:
    @app.callback(output=GRID_OUTPUTS,
                  inputs=dict(tab=Input("tabs", "value"), search=Input("dec-search", "value"),
                              _tick=Input("tick-go", "data")),
                  state=dict(range_s=State("range", "value"), sid=State("sid", "data"), dv=State("dec-view", "data")),
                  prevent_initial_call=True)
    def decisions_grid(tab, search, _tick, range_s, sid, dv):
        """The grid refilled whole (a new search or range, the tab opened) or its newer rows added."""
        unchanged = {k: no_update for k in GRID_OUTPUTS}
        s = sessions.get(sid)
        if s is None or tab != "decisions":
            return unchanged
        tok = s.token
        search = (search or "").strip() or None
        range_s = range_s or default_range_s
        now = time.time()
        dv = dict(dv or {})
        try:
            if ctx.triggered_id != "tick-go" or dv.get("search") != search or dv.get("range_s") != range_s:
                page = client.decisions(tok, start_s=now - range_s, q=search, limit=DECISION_LIMIT)
                items = page["items"]
                bursts = client.bursts(tok, start_s=now - range_s - 3600)
                dv = {"search": search, "range_s": range_s, "last_id": max((d["id"] for d in items), default=0),
                      "shown": len(items)}
                return {"rows": decision_rows(items, bursts), "added": no_update, "dv": dv,
                        "count": count_text(int(page.get("total", len(items))), len(items), search)}
            page = client.decisions(tok, start_s=now - range_s, q=search, limit=TICK_LIMIT)
            items = page["items"]
        except (Unavailable, ApiError):
            return unchanged
        new = sorted((d for d in items if d["id"] > dv.get("last_id", 0)), key=lambda d: -d["id"])
        if not new:
            return unchanged
        dv["last_id"] = new[0]["id"]
        dv["shown"] = dv.get("shown", 0) + len(new)
        bursts = []
        if any("t=" in (d.get("reason") or "") for d in new):  # node-local times: the bursts anchor them
            try:
                bursts = client.bursts(tok, start_s=now - range_s - 3600)
            except (Unavailable, ApiError):
                bursts = []
        return {"rows": no_update, "added": {"add": decision_rows(new, bursts), "addIndex": 0}, "dv": dv,
                "count": count_text(int(page.get("total", 0)), dv["shown"], search)}

    @app.callback(output=DETAIL_OUTPUTS, inputs=dict(cell=Input("grid-decisions", "cellClicked")),
                  state=dict(sid=State("sid", "data")), prevent_initial_call=True)
    def drill_down(cell, sid):
        unchanged = {k: no_update for k in DETAIL_OUTPUTS}
        s = sessions.get(sid)
        if s is None or not cell or not cell.get("rowId"):
            return unchanged
        try:
            did, node_id, ts = str(cell["rowId"]).split("|", 2)
            ts_s = float(ts)
        except ValueError:
            return unchanged
        tok = s.token
        try:
            dec = client.decision(tok, {"id": did, "node_id": node_id, "ts_s": ts_s})
            if dec is None:
                return {"open": True, "title": f"Decision #{did}",
                        "body": html.Div("this decision is no longer stored", className="text-muted")}
            report = client.report_at(tok, node_id, ts_s)
            bursts = client.bursts(tok, start_s=ts_s - 3600, end_s=ts_s + 1)
        except (Unavailable, ApiError) as e:
            return {"open": True, "title": f"Decision #{did}",
                    "body": html.Div(getattr(e, "message", str(e)), className="text-danger")}
        d = D.decision_detail(dec, report, bursts)
        return {"open": True, "title": d["title"], "body": detail_body(d)}


def store() -> dcc.Store:
    return dcc.Store(id="dec-view", data={})


def layout(grid, col, time_col) -> list:
    """The grid's part of the Decisions & routing page (the router weights below it: `dashboard.routing_tab`)."""
    return [search_box(),
            grid("grid-decisions", grid_columns(col, time_col), height=460, page_size=15, row_id="rid"),
            drill_down_modal(), store()]
