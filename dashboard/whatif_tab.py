"""The What-if page: the latest what-if run (`control_plane.whatif`), a stored window of the fleet's
sampled traffic replayed through the simulator.

- **Start** (operators; disabled for a viewer, and refused by the control plane too): a what-if over
  the chosen window ending now (``POST /api/v1/whatif-runs``). It changes nothing on the fleet, so
  no confirmation is asked; the control plane answers 409 while one runs and 422 for a window with
  no sample, and the message under the button says so.
- **Progress**: the run's stored progress (0-100%) and what it is running, read on every live tick
  while it runs.
- **The result**: one plain sentence (`control_plane.whatif.sentence`), the table (per
  configuration: P99, P50, SLO attainment, mean share; the best static split, the look-ahead
  oracle's and each policy's regret) and a chart of P99 per configuration per phase of the window
  (`whatif_figure`), with what the run was made from (window, cut, fleet, profile, code).
"""

from __future__ import annotations

import time

import dash_bootstrap_components as dbc
import plotly.graph_objects as go
from dash import Input, Output, State, dcc, html, no_update

from common.whatif_findings import findings_lines

from .client import ApiError, Unavailable

WINDOWS = {"last 15 min": 900, "last 1 h": 3600, "last 6 h": 6 * 3600, "last 24 h": 86400}
OUTPUTS = {"progress": Output("wi-progress", "value"), "progress_label": Output("wi-progress", "label"),
           "progress_note": Output("wi-progress-note", "children"), "sentence": Output("wi-sentence", "children"),
           "table": Output("wi-table", "children"), "figure": Output("wi-graph", "figure"),
           "meta": Output("wi-meta", "children"), "start_disabled": Output("wi-start", "disabled"),
           "state": Output("wi-state", "data")}


def layout(viewer: bool) -> html.Div:
    note = html.Div("a viewer cannot start a what-if: sign in with an operator token", className="text-muted small")
    return html.Div([
        dbc.Row([
            dbc.Col(dcc.Dropdown(id="wi-window", options=[{"label": k, "value": v} for k, v in WINDOWS.items()],
                                 value=6 * 3600, clearable=False, searchable=False), lg=2),
            dbc.Col(dbc.Button("Start what-if", id="wi-start", color="primary", disabled=viewer), width="auto"),
            dbc.Col(html.Div(id="wi-start-msg", className="small"), lg=6),
        ], className="g-2 align-items-center mb-2"),
        note if viewer else html.Div(),
        dbc.Progress(id="wi-progress", value=0, label="", striped=True, className="mb-1", style={"height": "22px"}),
        html.Div(id="wi-progress-note", className="text-muted small mb-2"),
        dbc.Alert(id="wi-sentence", color="info", className="py-2", children="No what-if result yet."),
        html.Div(id="wi-table"),
        dcc.Graph(id="wi-graph", figure=whatif_figure(None), config={"displaylogo": False, "responsive": True},
                  style={"minHeight": "360px"}),
        html.Div(id="wi-meta", className="text-muted small"),
        dcc.Store(id="wi-state", data=None), dcc.Store(id="wi-started", data=0),
    ], className="pt-2")


def table_rows(result: dict | None) -> list[dict]:
    """The result's rows as the table shows them (configuration, role, P99, P50, SLO, mean share, error)."""
    out = []
    for r in (result or {}).get("rows", []):
        out.append({"configuration": r["config"], "role": r.get("role") or r["kind"], "p99_ms": r.get("p99_ms"),
                    "p50_ms": r.get("p50_ms"), "slo_attainment": r.get("slo_attainment"),
                    "mean_share": r.get("mean_share"), "error": r.get("error")})
    return out


def _fmt(v, nd: int) -> str:
    return "–" if v is None else f"{v:.{nd}f}"


def table(result: dict | None) -> html.Div:
    rows = table_rows(result)
    if not rows:
        return html.Div()
    best = ((result or {}).get("findings") or {}).get("best_static")
    head = html.Thead(html.Tr([html.Th(h) for h in ("configuration", "role", "P99 ms", "P50 ms", "SLO attainment",
                                                    "mean emb_share")]))
    body = html.Tbody([html.Tr([html.Td(r["configuration"] + (" (best static)" if r["configuration"] == best else "")),
                                html.Td(r["role"]), html.Td(_fmt(r["p99_ms"], 2)), html.Td(_fmt(r["p50_ms"], 2)),
                                html.Td(_fmt(r["slo_attainment"], 4)),
                                html.Td(r["error"] if r["error"] else _fmt(r["mean_share"], 3))])
                       for r in rows])
    notes = findings_lines((result or {}).get("findings"), explain=True)
    return html.Div([dbc.Table([head, body], id="wi-table-grid", bordered=False, striped=True, size="sm",
                               className="mb-1"),
                     html.Ul([html.Li(n) for n in notes], className="small", id="wi-findings")])


def whatif_figure(result: dict | None) -> go.Figure:
    """P99 per configuration (one line each) per phase of the window (the x axis)."""
    fig = go.Figure()
    if not (result or {}).get("rows"):
        fig.add_annotation(text="no what-if result yet", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    for r in (result or {}).get("rows", []):
        ph = r.get("phases") or []
        if not ph:
            continue
        fig.add_trace(go.Scatter(x=[p["phase"] for p in ph], y=[p["p99_ms"] for p in ph], mode="lines+markers",
                                 name=r["config"], line={"dash": "dot" if r["kind"] == "static" else "solid"}))
    fig.update_layout(template="plotly_white", height=360, margin={"l": 50, "r": 10, "t": 30, "b": 40},
                      title="simulated P99 per phase of the window", yaxis_title="P99 (ms)", xaxis_title="phase",
                      legend={"font": {"size": 10}})
    return fig


def meta(run: dict | None) -> str:
    if not run:
        return ""
    prof = run.get("profile") or {}
    parts = [f"what-if #{run['id']} by {run['created_by']}",
             f"window {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(run['window_start_s']))} to "
             f"{time.strftime('%H:%M:%S', time.gmtime(run['window_end_s']))} UTC",
             f"{run.get('num_samples')} samples"]
    if run.get("cut"):
        parts.append(f"cut to {run['cut']['kept']} of {run['cut']['of']} ({run['cut']['why']})")
    if prof:
        parts.append(f"{prof.get('simulated_nodes')} simulated node(s) for {prof.get('fleet_nodes')}, profile "
                     f"{prof.get('name')}")
    if run.get("code_version"):
        parts.append(f"code {run['code_version']}")
    return "; ".join(parts) + ". The simulator, not the fleet: see docs/whatif.md."


def view(run: dict | None, shown: dict | None, operator: bool) -> dict:
    """The page's outputs for ``run`` (the newest; None: none yet); the result parts only when the
    shown run (``shown``: its id and state) changed."""
    key = None if run is None else {"id": run["id"], "state": run["state"]}
    out = {k: no_update for k in OUTPUTS}
    running = bool(run and run["state"] == "running")
    out["start_disabled"] = (not operator) or running
    if run is None:
        out.update(progress=0, progress_label="", progress_note="no what-if yet: start one")
    elif running:
        pct = round(100 * float(run["progress"]), 1)
        out.update(progress=pct, progress_label=f"{pct:.0f}%",
                   progress_note=f"what-if #{run['id']} running: {run['progress_note']}")
    elif run["state"] == "failed":
        out.update(progress=100, progress_label="failed", progress_note=f"what-if #{run['id']} failed: {run['error']}")
    else:
        out.update(progress=100, progress_label="100%", progress_note=f"what-if #{run['id']} done")
    if key != shown:
        out["state"] = key
        if run is not None and run["state"] == "done":
            out.update(sentence=run.get("sentence") or "", table=table(run.get("result")),
                       figure=whatif_figure(run.get("result")), meta=meta(run))
    return out


def register(app, client, sessions) -> None:
    @app.callback(output=OUTPUTS, inputs=dict(tab=Input("tabs", "value"), _tick=Input("tick-go", "data"),
                                              _started=Input("wi-started", "data")),
                  state=dict(sid=State("sid", "data"), shown=State("wi-state", "data")), prevent_initial_call=True)
    def refresh(tab, _tick, _started, sid, shown):
        s = sessions.get(sid)
        if s is None or tab != "whatif":
            return {k: no_update for k in OUTPUTS}
        try:
            latest = client.get("/whatif-runs", s.token, limit=1)
            run = latest[0] if latest else None
            if run is not None and run["state"] != "running" and shown != {"id": run["id"], "state": run["state"]}:
                run = client.get(f"/whatif-runs/{run['id']}", s.token)  # its result: read once
        except (Unavailable, ApiError):
            return {k: no_update for k in OUTPUTS}
        return view(run, shown, s.role == "operator")

    @app.callback(output=dict(msg=Output("wi-start-msg", "children"), started=Output("wi-started", "data")),
                  inputs=dict(_n=Input("wi-start", "n_clicks")),
                  state=dict(window_s=State("wi-window", "value"), sid=State("sid", "data"),
                             started=State("wi-started", "data")), prevent_initial_call=True)
    def start(_n, window_s, sid, started):
        s = sessions.get(sid)
        if s is None:
            return {"msg": no_update, "started": no_update}
        if s.role != "operator":
            return {"msg": html.Span("a viewer cannot start a what-if", className="text-danger"), "started": no_update}
        now = time.time()
        try:
            run = client.post("/whatif-runs", s.token, {"start_s": now - float(window_s or 3600), "end_s": now})
        except ApiError as e:
            return {"msg": html.Span(f"refused by the control plane: {e.message}", className="text-danger"),
                    "started": (started or 0) + 1}
        except Unavailable as e:
            return {"msg": html.Span(str(e), className="text-danger"), "started": no_update}
        return {"msg": html.Span(f"what-if #{run['id']} started over {run['num_samples']} samples",
                                 className="text-success"), "started": (started or 0) + 1}
