"""The operator dashboard: a Dash app that is a client of the control-plane API only.

    racer dashboard --control-plane http://127.0.0.1:8400 [--port 8050] [--refresh-s 2]

Pages (tabs): Overview, EMB-KV split, Bursts, Decisions & routing, Override, Policies.

How it updates (docs/dashboard.md has the picture):

- ``render`` builds the active tab's figures whole, once: on sign-in, on a tab switch, on a new
  time range or node selection, and when the control plane comes back after the dashboard
  started without it. It asks the API for history downsampled to at most ~`MAX_POINTS` buckets.
- ``tick`` (a `dcc.Interval`, every ``refresh_s``) asks only for what is new since the last
  drawn bucket and sends partial updates: ``extendData`` (new points for every trace, trimmed to
  the range in the browser), `Patch` for the heatmap columns, the split bars and the burst
  shading, and AG Grid row transactions for new decisions. A tick that cannot reach the control
  plane (or gets a slow answer) raises the banner and marks the data with its age; the next good
  tick lowers it and fills the gap from the stored history, without a page reload.

Sign-in: the user pastes a control-plane token. The dashboard checks it (``/auth/whoami``) and
keeps it **server side** in `SessionStore`; the browser holds only a random session id. The
token never goes into a URL or a log. A viewer sees everything with every control disabled and
a note saying why; an operator can act; every action asks for confirmation first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import dash
import dash_ag_grid as dag
import dash_bootstrap_components as dbc
from dash import Input, Output, Patch, State, ctx, dcc, html, no_update

from . import client_cards
from . import decisions_tab, policies_tab
from . import details as D
from . import figures as F
from .history import HistoryCache
from .client import ApiError, ControlPlaneClient, Unavailable, cluster_series, node_series

log = logging.getLogger("racer.dashboard")

RANGES = [("5 min", 300), ("15 min", 900), ("1 h", 3600), ("6 h", 6 * 3600), ("24 h", 86400)]
STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600)
MAX_POINTS = 180
SLOW_MS = 1500.0
SLO_TARGET_DEFAULT = 0.99
SPLIT_NODES_DEFAULT = 3
DECISION_LIMIT = 500
BUCKET_GRACE_S = 5.0  # a bucket is drawn 5 s after its end: reports (1 s interval) arrive late under load

OVERVIEW_GRAPHS = ("g-slo", "g-p99", "g-thr", "g-hits")
SPLIT_GRAPHS = ("g-heat", "g-lines", "g-split")
ALL_GRAPHS = OVERVIEW_GRAPHS + SPLIT_GRAPHS + ("g-bursts-p99", "g-weights", "g-rollout")
ACTION_BUTTONS = ("btn-ov-submit", "btn-ov-clear")  # the policies tab's: dashboard.policies_tab


def step_for(range_s: float) -> int:
    """The bucket size (s) that gives at most `MAX_POINTS` points over ``range_s``."""
    for s in STEPS:
        if range_s / s <= MAX_POINTS:
            return s
    return STEPS[-1]


# ------------------------------------------------------------------------------ sessions ---


@dataclass
class Session:
    token: str
    name: str
    role: str
    created_s: float = field(default_factory=time.time)


class SessionStore:
    """Server-side sign-ins: random session id -> `Session` (token, name, role). In memory."""

    def __init__(self, max_sessions: int = 1000):
        self._by_id: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.max_sessions = max_sessions

    def add(self, session: Session) -> str:
        sid = secrets.token_urlsafe(24)
        with self._lock:
            if len(self._by_id) >= self.max_sessions:
                oldest = min(self._by_id, key=lambda k: self._by_id[k].created_s)
                del self._by_id[oldest]
            self._by_id[sid] = session
        return sid

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        with self._lock:
            return self._by_id.get(sid)

    def drop(self, sid: str | None) -> None:
        with self._lock:
            self._by_id.pop(sid or "", None)


# -------------------------------------------------------------------------------- layout ---


def _graph(gid: str, height: int = 320) -> dcc.Graph:
    return dcc.Graph(id=gid, figure={"data": [], "layout": {"height": height, "template": "plotly_white"}},
                     config={"displaylogo": False, "responsive": True}, style={"minHeight": f"{height}px"})


def _kpi(kid: str, label: str) -> dbc.Col:
    return dbc.Col(dbc.Card(dbc.CardBody([html.Div(label, className="text-muted small"),
                                          html.Div("–", id=kid, className="fs-5 fw-semibold")]), className="h-100"),
                   xs=6, md=3, lg=True)


def _grid(gid: str, columns: list[dict], *, page_size: int = 10, height: int = 360, selectable: bool = False,
          row_id: str | None = None) -> dag.AgGrid:
    opts: dict = {"pagination": True, "paginationPageSize": page_size, "paginationPageSizeSelector": False,
                  "animateRows": False, "enableCellTextSelection": True}
    if selectable:
        opts["rowSelection"] = {"mode": "singleRow", "checkboxes": True, "enableClickSelection": True}
    extra = {"getRowId": f"params.data.{row_id}"} if row_id else {}  # row ids are strings
    return dag.AgGrid(id=gid, columnDefs=columns, rowData=[], dashGridOptions=opts, **extra,
                      defaultColDef={"resizable": True, "sortable": True, "filter": True, "minWidth": 90},
                      columnSize="responsiveSizeToFit", style={"height": f"{height}px"})


def _col(name: str, header: str | None = None, **kw) -> dict:
    return {"field": name, "headerName": header or name, **kw}


def _time_col(name: str, header: str) -> dict:
    return {"field": name, "headerName": header, "minWidth": 170}


def _source_legend() -> html.Div:
    return html.Div([html.Span("decision sources: ", className="text-muted small me-1")] + [
        html.Span([html.Span("●", style={"color": c, "fontSize": "18px"}), f" {s}"], className="me-3 small")
        for s, c in F.SOURCE_COLORS.items()], className="mb-2")


def _range_options(range_s: int) -> list[dict]:
    opts = [{"label": lbl, "value": v} for lbl, v in RANGES]
    if range_s not in {v for _, v in RANGES}:
        opts.append({"label": fmt_age(range_s), "value": range_s})
        opts.sort(key=lambda o: o["value"])
    return opts


def build_tabs(viewer: bool) -> html.Div:
    """The pages (tabs), sent to the browser on sign-in (`auth_ui`), not with the page: a page
    that has not signed in draws no chart or grid. ``viewer``: every action button disabled and
    the viewer's note shown."""
    overview = html.Div([
        client_cards.section(),  # what clients see leads, the nodes' own beside
        dbc.Row([dbc.Col(_graph("g-slo"), lg=6), dbc.Col(_graph("g-thr"), lg=6)]),
        dbc.Row([dbc.Col(_graph("g-p99", 380), lg=12)]),
        dbc.Row([dbc.Col(_graph("g-hits"), lg=6), dbc.Col(html.Div([
            html.H6("Nodes"), html.Div(id="nodes-table", style={"maxHeight": "300px", "overflowY": "auto"}),
        ]), lg=6)]),
    ], className="pt-2")

    split = html.Div([
        _graph("g-heat", 260),
        dbc.Row([dbc.Col(html.Div([html.Span("nodes for target vs applied: ", className="small me-2"),
                                   dcc.Dropdown(id="split-nodes", multi=True, placeholder="first nodes")]), lg=8)],
                className="my-2"),
        _source_legend(),
        _graph("g-lines", 420),
        _graph("g-split", 320),
    ], className="pt-2")

    bursts = html.Div([
        html.P("Burst periods (shaded orange on every time chart) and what the recovery controller did.",
               className="small text-muted"),
        _grid("grid-bursts", [_col("node_id", "node"), _time_col("start", "start (UTC)"), _time_col("end", "end (UTC)"),
                              _col("duration_s", "duration (s)"), _col("magnitude", "magnitude (× rate)"),
                              _col("recovery_actions", "recovery actions", minWidth=260)], height=320),
        _graph("g-bursts-p99", 340),
    ], className="pt-2")

    decisions = html.Div([
        decisions_tab.search_box(),
        _grid("grid-decisions", decisions_tab.grid_columns(_col, _time_col), height=460, page_size=15, row_id="rid"),
        decisions_tab.drill_down_modal(), decisions_tab.store(),
        dbc.Row([dbc.Col([html.Span("router weight field: ", className="small me-2"),
                          dcc.Dropdown(id="weights-field", clearable=False, value="service_time_us",
                                       options=["service_time_us", "kv_recompute_us_per_token",
                                                "emb_transfer_us_per_row", "queue_capacity"])], lg=4)],
                className="mt-3"),
        _graph("g-weights", 340),
        _grid("grid-weights", [_col("version"), _time_col("time", "computed (UTC)"), _col("reason", minWidth=500, flex=3)],
              height=240, page_size=5),
    ], className="pt-2")

    viewer_note = dbc.Alert("Signed in as a viewer: you can see everything, and every control is disabled "
                            "(an operator token is needed to act).", id="viewer-note", color="secondary",
                            is_open=viewer, className="py-2")
    override = html.Div([
        dbc.Card(dbc.CardBody([
            html.H6("Set an emb_share override"),
            dbc.Row([
                dbc.Col([dbc.Label("scope"), dbc.RadioItems(id="ov-scope", value="node", inline=True, options=[
                    {"label": "one node", "value": "node"}, {"label": "cluster-wide", "value": "cluster"}])], lg=3),
                dbc.Col([dbc.Label("node", html_for="ov-node"),
                         dcc.Dropdown(id="ov-node", placeholder="node"),
                         html.Div(id="ov-current", className="small text-muted mt-1")], lg=3),
                dbc.Col([dbc.Label("emb_share (0-1)"), dbc.Input(id="ov-share", type="number", min=0, max=1,
                                                                  step=0.01, value=0.5)], lg=2),
                dbc.Col([dbc.Label("expires after (min, empty = never)"),
                         dbc.Input(id="ov-ttl", type="number", min=0, step=1)], lg=2),
            ]),
            dbc.Row([dbc.Col([dbc.Label("reason"), dbc.Input(id="ov-reason", placeholder="why (required)")], lg=8),
                     dbc.Col(dbc.Button("Submit override…", id="btn-ov-submit", disabled=viewer, color="danger",
                                        className="mt-4"),
                             lg=2)]),
            html.Div(id="ov-error", className="text-danger small mt-2"),
        ]), className="mb-3"),
        html.H6("Active overrides"),
        _grid("grid-overrides", [_col("id"), _col("scope"), _col("emb_share", "emb_share"), _col("reason", flex=2),
                                 _col("created_by", "by"), _time_col("created", "created (UTC)"),
                                 _time_col("expires", "expires (UTC)")], height=220, selectable=True, row_id="id"),
        dbc.Row([dbc.Col(dbc.Input(id="ov-clear-reason", placeholder="why clear it (required)"), lg=6),
                 dbc.Col(dbc.Button("Clear selected override…", id="btn-ov-clear", disabled=viewer,
                                    color="secondary"), lg=3)], className="my-2"),
        dbc.Card(dbc.CardBody([
            html.H6("Drain and retire a node"),
            html.Div("The node leaves the gateways' node list (requests in flight finish), its tokens are revoked "
                     "and its overrides cleared; its history stays. A new token for its id brings it back.",
                     className="small text-muted mb-2"),
            dbc.Row([dbc.Col([dbc.Label("node"), dcc.Dropdown(id="retire-node", placeholder="node")], lg=3),
                     dbc.Col([dbc.Label("reason"), dbc.Input(id="retire-reason", placeholder="why (required)")], lg=5),
                     dbc.Col(dbc.Button("Retire node…", id="btn-node-retire", disabled=viewer, color="danger",
                                        className="mt-4"), lg=2)]),
            html.Div(id="retire-error", className="text-danger small mt-2"),
        ]), className="my-3"),
        html.H6("Audit log", className="mt-3"),
        _grid("grid-audit", [_time_col("time", "time (UTC)"), _col("actor"), _col("action"), _col("target"),
                             _col("before", minWidth=160), _col("after", minWidth=160), _col("reason", flex=2)],
              height=360, page_size=10),
    ], className="pt-2")

    policies = policies_tab.layout(viewer, _graph, _grid, _col, _time_col)

    return html.Div([dcc.Store(id="render-go"), dcc.Tabs(id="tabs", value="overview", children=[
        dcc.Tab(label="Overview", value="overview", children=overview),
        dcc.Tab(label="EMB-KV split", value="split", children=split),
        dcc.Tab(label="Bursts", value="bursts", children=bursts),
        dcc.Tab(label="Decisions & routing", value="decisions", children=decisions),
        dcc.Tab(label="Override", value="override", children=[viewer_note, override]),
        dcc.Tab(label="Policies", value="policies", children=policies),
    ])])


def build_layout(refresh_s: float, range_s: int = 900) -> html.Div:
    login = dbc.Card(dbc.CardBody([
        html.H5("Sign in"),
        html.P("Paste a control-plane token (operator or viewer). It stays on the dashboard server; "
               "the browser keeps only a session id.", className="small text-muted"),
        dbc.InputGroup([dbc.Input(id="login-token", type="password", placeholder="token", autoComplete="off"),
                        dbc.Button("Sign in", id="btn-login", color="primary")]),
        html.Div(id="login-error", className="text-danger small mt-2"),
    ]), id="login-card", className="my-3", style={"maxWidth": "560px"})

    header = dbc.Navbar(dbc.Container([
        dbc.NavbarBrand("RACER operator dashboard", className="fw-bold"),
        html.Div([
            html.Span("range ", className="text-light small me-1"),
            dcc.Dropdown(id="range", options=_range_options(range_s), value=range_s,
                         clearable=False, searchable=False,
                         style={"width": "110px", "display": "inline-block", "color": "#212529"}),
            html.Span(id="who", className="text-light small ms-3 me-2"),
            dbc.Button("Sign out", id="btn-logout", size="sm", color="secondary", className="ms-1",
                       style={"display": "none"}),
        ], className="d-flex align-items-center"),
    ], fluid=True), color="dark", dark=True, className="mb-2")

    kpis = dbc.Row([_kpi("kpi-nodes", "nodes up / down"), _kpi("kpi-slo", "SLO attainment (mean of nodes, now)"),
                    _kpi("kpi-p99", "P99 (mean of nodes, now)"), _kpi("kpi-thr", "throughput"),
                    _kpi("kpi-policy", "active policy"), _kpi("kpi-overrides", "active overrides"),
                    _kpi("kpi-age", "data age")], className="g-2 mb-2")

    modal = dbc.Modal([dbc.ModalHeader(dbc.ModalTitle("Confirm")), dbc.ModalBody(id="confirm-body"),
                       dbc.ModalFooter([dbc.Button("Cancel", id="btn-cancel", color="secondary"),
                                        dbc.Button("Confirm", id="btn-confirm", color="danger")])],
                      id="confirm-modal", is_open=False)

    return html.Div([
        header,
        dbc.Container([
            login,
            dbc.Alert(id="banner", color="warning", is_open=False, className="py-2"),
            dbc.Alert(id="action-result", is_open=False, dismissable=True, className="py-2"),
            html.Div([kpis, html.Div(id="role-note-policies"), html.Div(id="main-body")], id="main",
                     style={"display": "none"}),
        ], fluid=True),
        modal,
        dcc.Interval(id="tick", interval=int(refresh_s * 1000), disabled=True),
        dcc.Store(id="sid", storage_type="session"),
        dcc.Store(id="view", data={}),
        dcc.Store(id="pending", data=None),
        dcc.Store(id="reload", data=0),
        dcc.Store(id="summary", data=None),
        dcc.Store(id="nodes-data", data=None),
        dcc.Store(id="tables-key", data={}),
        dcc.Store(id="tick-go"), dcc.Store(id="tick-done"), dcc.Store(id="tick-sink"),
        dcc.Store(id="acted", data=0),
    ])


# ---------------------------------------------------------------------------- formatting ---


def fmt_t(t_s) -> str:
    """Unix seconds as 'YYYY-MM-DD HH:MM:SS' (UTC)."""
    return "" if t_s is None else F.x_to_text(F.to_x(t_s))


def fmt_age(age_s: float) -> str:
    if age_s < 90:
        return f"{age_s:.0f} s"
    if age_s < 5400:
        return f"{age_s / 60:.0f} min"
    return f"{age_s / 3600:.1f} h"


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.2f}%"


def _short(d) -> str:
    if d is None:
        return ""
    s = json.dumps(d, separators=(",", ":"), default=str)
    return s if len(s) <= 160 else s[:157] + "…"


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


def kpi_values(summary: dict) -> list[str]:
    """The KPI cards from the control plane's /summary (each node's latest report)."""
    return [f"{summary.get('num_up', 0)} / {summary.get('num_down', 0)}", _pct(summary.get("mean_slo_attainment")),
            "–" if summary.get("mean_p99_ms") is None else f"{summary['mean_p99_ms']:.1f} ms",
            "–" if summary.get("total_throughput_rps") is None else f"{summary['total_throughput_rps']:.0f} req/s",
            summary.get("active_policy") or "–", str(summary.get("num_active_overrides", 0))]


# ------------------------------------------------------------------------------- the app ---


def warm_figures(slo_ms: float = 30.0, slo_target: float = SLO_TARGET_DEFAULT) -> None:
    """Build and serialise each kind of figure once, on made-up data. plotly loads its figure
    classes and property validators on first use (a few hundred ms on a slow machine); done at
    start-up, that cost does not land on the first operator's first render."""
    from plotly.io.json import to_json_plotly

    t = [0.0, 30.0]
    cl = {"t_s": t, "slo_attainment": [1.0, 0.99], "p99_ms": [5.0, 6.0], "throughput_rps": [1.0, 2.0],
          "emb_hit_rate": [0.5, 0.6], "kv_hit_rate": [0.5, 0.6]}
    ns = {"n": {"t_s": t, "p99_ms": [5.0, 6.0], "emb_share": [0.5, 0.4], "target_emb_share": [0.5, 0.4]}}
    bursts = [{"node_id": "n", "start_s": 0.0, "end_s": 10.0, "magnitude": 2.0}]
    dec = [{"node_id": "n", "t_s": 0.0, "source": "base", "emb_share": 0.5, "reason": "warm-up"}]
    figs = [F.slo_attainment_figure(cl, slo_target, bursts, 60.0), F.p99_figure(ns, slo_ms, bursts, 60.0),
            F.p99_figure({}, slo_ms, bursts, 60.0, cluster=cl), F.throughput_figure(cl, bursts, 60.0),
            F.hit_rate_figure(cl, bursts, 60.0), F.emb_share_heatmap(ns, bursts, 60.0),
            F.share_lines_figure(ns, dec, bursts, 60.0), F.split_bar_figure([{"node_id": "n", "emb_share": 0.5}]),
            F.router_weights_figure([], "service_time_us", 60.0), F.rollout_figure([], slo_ms, slo_target)]
    for f in figs:
        to_json_plotly(f)


def create_app(control_plane_url: str, *, refresh_s: float = 2.0, timeout_s: float = 3.0,
               slo_target: float = SLO_TARGET_DEFAULT, slo_ms: float = 30.0, range_s: int = 900) -> dash.Dash:
    """The Dash app for the control plane at ``control_plane_url`` (see the module docstring)."""
    if not (isinstance(refresh_s, (int, float)) and math.isfinite(refresh_s) and refresh_s > 0):
        raise ValueError(f"refresh_s must be a positive number, got {refresh_s!r}")
    if not 0 < slo_target <= 1:
        raise ValueError(f"slo_target must be in (0, 1], got {slo_target!r}")
    client = ControlPlaneClient(control_plane_url, timeout_s=timeout_s)
    pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="racer-dashboard-fetch")
    cache = HistoryCache(client.history, grace_s=BUCKET_GRACE_S)
    sessions = SessionStore()
    app = dash.Dash(__name__, title="RACER operator dashboard", update_title=None,
                    suppress_callback_exceptions=True)
    if not (isinstance(range_s, int) and range_s > 0):
        raise ValueError(f"range_s must be a positive integer of seconds, got {range_s!r}")
    app.layout = build_layout(refresh_s, range_s)
    warm_figures(slo_ms, slo_target)
    app.server.config["RACER_CLIENT"] = client
    app.server.config["RACER_SESSIONS"] = sessions
    state = {"slo_ms": slo_ms}
    client_cards.register(app, client, sessions)

    def _slo_ms(_tok: str) -> float:
        return state["slo_ms"]  # the --slo-ms option (the control plane's API does not publish the SLO)

    policies_tab.register(app, client, sessions, slo_ms=slo_ms, slo_target=slo_target, step_for=step_for,
                          default_range_s=range_s)
    decisions_tab.register(app, client, sessions, default_range_s=range_s)

    # ----------------------------------------------------------------------- sign in/out ---
    @app.callback(Output("sid", "data"), Output("login-error", "children"), Output("login-token", "value"),
                  Input("btn-login", "n_clicks"), Input("login-token", "n_submit"), State("login-token", "value"),
                  prevent_initial_call=True)
    def login(_n, _s, token):
        token = (token or "").strip()
        if not token:
            return no_update, "enter a token", ""
        try:
            who = client.whoami(token)
        except ApiError as e:
            return no_update, ("token not accepted" if e.status in (401, 403) else e.message), ""
        except Unavailable as e:
            return no_update, str(e), ""
        if who.get("role") not in ("operator", "viewer"):
            return no_update, f"a {who.get('role')} token cannot sign in to the dashboard", ""
        return sessions.add(Session(token, str(who.get("name")), str(who.get("role")))), "", ""

    @app.callback(Output("sid", "data", allow_duplicate=True), Input("btn-logout", "n_clicks"),
                  State("sid", "data"), prevent_initial_call=True)
    def logout(_n, sid):
        sessions.drop(sid)
        return None

    @app.callback(Output("login-card", "style"), Output("main", "style"), Output("who", "children"),
                  Output("btn-logout", "style"), Output("tick", "disabled"), Output("main-body", "children"),
                  Output("role-note-policies", "children"),
                  Input("sid", "data"))
    def auth_ui(sid):
        s = sessions.get(sid)
        if s is None:
            return {"maxWidth": "560px"}, {"display": "none"}, "", {"display": "none"}, True, [], None
        viewer = s.role != "operator"
        note = None
        if viewer:
            note = dbc.Alert("Viewer: read-only. Override and rollout controls are disabled.",
                             color="secondary", className="py-1 small", id="viewer-banner")
        return ({"display": "none"}, {"display": "block"}, f"{s.name} ({s.role})", {"display": "inline-block"},
                False, build_tabs(viewer), note)

    # --------------------------------------------------------------------- full render ---
    graph_outputs = [Output(g, "figure") for g in ALL_GRAPHS]

    @app.callback(*graph_outputs, Output("view", "data"), Output("split-nodes", "options"),
                  Output("ov-node", "options"), Output("grid-bursts", "rowData"), Output("grid-decisions", "rowData"),
                  Output("grid-weights", "rowData"), Output("summary", "data"), Output("nodes-data", "data"),
                  Input("tabs", "value"), Input("split-nodes", "value"), Input("weights-field", "value"),
                  Input("render-go", "data"), State("range", "value"), State("sid", "data"))
    def render(tab, split_sel, weights_field, _go, range_s, sid):
        # Every Input is a component of the tabs, which arrive on sign-in and trigger the first
        # render; a new range, a reload or an action reach it through "render-go" (in the tabs
        # too). An Input of the page itself (the session, the range) made Dash run this before
        # the tabs existed: "A nonexistent object was used in an Input" in the console.
        s = sessions.get(sid)
        outs = {g: no_update for g in ALL_GRAPHS}
        extra = [no_update] * 7
        if s is None:
            return *outs.values(), {}, *extra
        tok = s.token
        step = step_for(range_s)
        t_render = time.time()
        try:
            # every read at once: the summary, nodes, bursts and the history (from the shared
            # cache: the long one). The range ends at this server's clock, as the live ticks' do.
            # The history is used only once the summary has accepted the user's token (the cache
            # may answer from what other users' reads stored).
            now = time.time()
            start = now - range_s
            need_hist = tab in ("overview", "split", "bursts")
            f_summary = pool.submit(client.summary, tok)
            f_nodes = pool.submit(client.nodes, tok)
            f_bursts = pool.submit(client.bursts, tok, start_s=start)
            f_rows = pool.submit(cache.rows, tok, step, start, now) if need_hist else None
            try:
                summary = f_summary.result()
            except Exception:
                for f in (f_nodes, f_bursts, f_rows):
                    if f is not None:
                        f.cancel()
                raise
            nodes = f_nodes.result()
            order = sorted(n["node_id"] for n in nodes)
            extra[5] = summary
            extra[6] = _node_rows(nodes)
            view = {"tab": tab, "range_s": range_s, "step_s": step, "order": order, "ok": True, "now_s": now,
                    "fetched_at_s": t_render, "last_ok_s": t_render, "rendered": True}
            node_opts = [{"label": n, "value": n} for n in order]
            extra[0] = extra[1] = node_opts
            rows = f_rows.result() if f_rows is not None else []
            bursts = f_bursts.result()
            view["last_t_s"] = max((r["ts_s"] for r in rows), default=None)
            view["burst_key"] = F.merge_periods(bursts)  # open bursts at their start: see tick
            view["open_burst"] = any(b.get("end_s") is None for b in bursts)
            slo = _slo_ms(tok)
            if tab == "overview":
                cl = cluster_series(rows)
                ns = node_series(rows)
                outs["g-slo"] = F.slo_attainment_figure(cl, slo_target, bursts, now, step_s=step)
                outs["g-p99"] = F.p99_figure({n: ns.get(n, {"t_s": []}) for n in order}, slo, bursts, now,
                                             step_s=step)
                outs["g-thr"] = F.throughput_figure(cl, bursts, now, step_s=step)
                outs["g-hits"] = F.hit_rate_figure(cl, bursts, now, step_s=step)
            elif tab == "split":
                ns = node_series(rows)
                sel = [n for n in (split_sel or []) if n in order] or order[:SPLIT_NODES_DEFAULT]
                view["split_sel"] = sel
                dec = [d for n in sel for d in client.decisions(tok, start_s=start, node_id=n, limit=1000)["items"]]
                view["last_dec_id"] = max((d["id"] for d in dec), default=0)
                view["dec_since_s"] = max((d["ts_s"] for d in dec), default=None)
                outs["g-heat"] = F.emb_share_heatmap({n: ns.get(n, {"t_s": []}) for n in order}, bursts, now,
                                                     step_s=step)
                outs["g-lines"] = F.share_lines_figure({n: ns.get(n, {"t_s": []}) for n in sel},
                                                       [dict(d, t_s=d["ts_s"], reason=r)  # node-local times in UTC too
                                                        for d, r in zip(dec, D.reasons_utc(dec, bursts))],
                                                       bursts, now, step_s=step)
                outs["g-split"] = F.split_bar_figure(_split_rows(nodes))
            elif tab == "bursts":
                dec = client.decisions(tok, start_s=start, source="recovery", limit=DECISION_LIMIT)["items"]
                extra[2] = burst_rows(bursts, dec, now)
                cl = cluster_series(rows)
                outs["g-bursts-p99"] = F.p99_figure({}, slo, bursts, now, cluster=cl, step_s=step)
                outs["g-bursts-p99"].update_layout(title_text="Cluster P99 (worst node) with burst periods")
            elif tab == "decisions":  # the decision grid: dashboard.decisions_tab
                hist = [h for h in client.router_weights_history(tok) if h["computed_at_s"] >= start]
                hist = [dict(h, t_s=h["computed_at_s"]) for h in hist]
                outs["g-weights"] = F.router_weights_figure(sorted(hist, key=lambda h: h["t_s"]),
                                                            weights_field or "service_time_us", now)
                extra[4] = [{"version": h["version"], "time": fmt_t(h["t_s"]), "reason": h.get("reason", "")}
                            for h in sorted(hist, key=lambda h: -h["version"])]
        except Unavailable as e:
            return *outs.values(), {"ok": False, "error": str(e), "rendered": False, "range_s": range_s,
                                    "tab": tab}, *extra
        except ApiError as e:
            return *outs.values(), {"ok": False, "error": e.message, "rendered": False, "range_s": range_s,
                                    "tab": tab}, *extra
        return *outs.values(), view, *extra

    @app.callback(Output("kpi-nodes", "children"), Output("kpi-slo", "children"), Output("kpi-p99", "children"),
                  Output("kpi-thr", "children"), Output("kpi-policy", "children"), Output("kpi-overrides", "children"),
                  Input("summary", "data"), Input("nodes-data", "data"), prevent_initial_call=True)
    def show_kpis(summary, nodes):
        vals = kpi_values(summary or {})
        if nodes is not None:  # what the nodes run, not only what the registry calls active
            vals[4] = D.node_policies_text(nodes, (summary or {}).get("active_policy"))
        return vals

    app.clientside_callback(  # a new range, a reload or an action: render again (see render)
        """function(range, reload, acted) { return Date.now(); }""",
        Output("render-go", "data"), Input("range", "value"), Input("reload", "data"), Input("acted", "data"),
        prevent_initial_call=True)

    # -------------------------------------------------------------------------- live tick ---
    tick_graph_outputs = [Output(g, "extendData") for g in ("g-slo", "g-p99", "g-thr", "g-hits", "g-lines")]
    patch_outputs = [Output(g, "figure", allow_duplicate=True) for g in ("g-slo", "g-p99", "g-thr", "g-hits",
                                                                       "g-heat", "g-lines", "g-split")]

    @app.callback(*tick_graph_outputs, *patch_outputs, Output("view", "data", allow_duplicate=True),
                  Output("banner", "is_open"), Output("banner", "children"), Output("banner", "color"),
                  Output("reload", "data"),
                  Output("summary", "data", allow_duplicate=True), Output("kpi-age", "children"),
                  Output("nodes-data", "data"),
                  Output("grid-bursts", "rowData", allow_duplicate=True),
                  Output("tick-done", "data"),
                  Input("tick-go", "data"), State("view", "data"), State("sid", "data"), State("reload", "data"),
                  prevent_initial_call=True)
    def tick(n, view, sid, reload_n):
        return (*tick_updates(view, sid, reload_n), n)

    # Ticks never overlap: Dash drops the answer of a callback that is triggered again before it
    # answered, so with a control plane slower than the refresh period no tick would ever land
    # (not even the banner saying it is slow). The interval fires "tick-go" only when the last
    # tick has answered ("tick-done"), or after 20 s.
    app.clientside_callback(
        """function(n) {
            const now = Date.now();
            if (window._racerTickBusy && now - window._racerTickBusy < 20000) {
                return window.dash_clientside.no_update;
            }
            window._racerTickBusy = now;
            return n;
        }""", Output("tick-go", "data"), Input("tick", "n_intervals"), prevent_initial_call=True)
    app.clientside_callback(
        """function(d) { window._racerTickBusy = 0; return window.dash_clientside.no_update; }""",
        Output("tick-sink", "data"), Input("tick-done", "data"), prevent_initial_call=True)
    # The overview's nodes table: a plain HTML table drawn in the browser from the node rows (the
    # server sends only the rows, and only when they changed; a data grid's start-up would cost
    # the first render a few hundred ms), status in colour.
    app.clientside_callback(
        """function(rows) {
            if (!rows) { return window.dash_clientside.no_update; }
            const h = (type, props) => ({type: type, namespace: "dash_html_components", props: props});
            const cols = [["node_id", "node"], ["status", "status"], ["device", "device"],
                          ["emb_share", "emb_share"], ["policy_version", "policy"],
                          ["model", "model"], ["num_reports_dropped", "reports dropped"]];
            const head = h("Thead", {children: h("Tr", {children: cols.map(c => h("Th", {children: c[1]}))})});
            const body = h("Tbody", {children: rows.map(r => h("Tr", {children: cols.map(c => h("Td", {
                children: r[c[0]] === null || r[c[0]] === undefined ? "\u2013" : String(r[c[0]]),
                className: c[0] === "num_reports_dropped" ? (r[c[0]] > 0 ? "text-danger fw-semibold" : undefined)
                           : c[0] !== "status" ? undefined
                           : (r.status === "up" ? "text-success" : "text-danger fw-semibold")}))}))});
            return h("Table", {children: [head, body], id: "nodes-tbl",
                               className: "table table-sm table-striped table-hover small mb-0"});
        }""", Output("nodes-table", "children"), Input("nodes-data", "data"), prevent_initial_call=True)

    def tick_updates(view, sid, reload_n):
        n_ext, n_patch = 5, 7
        ext = [no_update] * n_ext
        patches = [no_update] * n_patch
        kpis = [no_update] * 2
        tail = [no_update] * 2
        s = sessions.get(sid)
        if s is None or not view:
            return *ext, *patches, no_update, no_update, no_update, no_update, no_update, *kpis, *tail
        tok = s.token
        wall = time.time()
        view = dict(view)
        tab = view.get("tab")
        step = view.get("step_s") or 1
        range_s = view.get("range_s") or 900
        futures = {}
        if view.get("rendered") and tab in ("overview", "split"):
            # what this tick needs, fetched in parallel with the summary
            last = view.get("last_t_s")
            futures["rows"] = pool.submit(cache.since, tok, step, last, wall - range_s, wall)
            futures["bursts"] = pool.submit(client.bursts, tok, start_s=wall - range_s)
            futures["nodes"] = pool.submit(client.nodes, tok)
        t0 = time.perf_counter()
        try:
            summary = client.summary(tok)
            latency_ms = (time.perf_counter() - t0) * 1e3
        except (Unavailable, ApiError) as e:
            for f in futures.values():
                f.cancel()
            msg = e.message if isinstance(e, ApiError) else str(e)
            last_ok = view.get("last_ok_s")
            age = f"data shown is {fmt_age(wall - last_ok)} old (last update {fmt_t(last_ok)} UTC)" if last_ok \
                else "no data yet"
            view["ok"] = False
            view["was_down"] = True
            view["error"] = msg
            kpis[1] = html.Span(fmt_age(wall - last_ok) + " (stale)" if last_ok else "–", className="text-danger")
            return (*ext, *patches, view, True, [html.Strong("Control plane unreachable. "), f"{msg}. {age}. ",
                                                 "Retrying every tick."], "danger", no_update, *kpis, *tail)
        now = float(summary["now_s"])
        recovered = not view.get("ok", True) or not view.get("rendered")
        view.update(ok=True, last_ok_s=wall, now_s=now)
        kpis = [summary, "current"]  # the control plane's data; whether requests are served: client_cards
        if latency_ms > SLOW_MS:
            banner = (True, [html.Strong("Control plane slow: "), f"the last answer took {latency_ms:.0f} ms."],
                      "warning")
        else:
            banner = (False, no_update, no_update)
        if not view.get("rendered") or (recovered and view.get("was_down")):
            # the first render failed (control plane was down), or the control plane is back after
            # an outage: nodes replay their buffered reports into buckets already read, so forget
            # them and draw the page whole again (a callback, not a page reload)
            cache.clear()
            for f in futures.values():
                f.cancel()
            view["was_down"] = False
            return (*ext, *patches, view, *banner, (reload_n or 0) + 1, *kpis, *tail)
        order = view.get("order") or []
        max_points = int(math.ceil(range_s / step)) + 1
        try:
            if tab in ("overview", "split"):
                rows = futures["rows"].result()  # complete buckets newer than the last drawn
                if rows:
                    view["last_t_s"] = max(r["ts_s"] for r in rows)
                bursts = futures["bursts"].result()
                nodes_now = futures["nodes"].result()
                node_rows = _node_rows(nodes_now)
                key = hashlib.sha1(json.dumps(node_rows, sort_keys=True).encode()).hexdigest()
                if key != view.get("nodes_key"):
                    view["nodes_key"] = key
                    tail[0] = node_rows
                # the shading changes when a burst starts, ends or merges with another; while one
                # is on, its band is extended to now when new points arrive (a complete bucket),
                # not every tick: each shapes Patch redraws the chart in the browser
                periods = F.merge_periods(bursts)
                shapes_changed = (json.dumps(periods) != json.dumps(view.get("burst_key"))
                                  or (bool(rows) and any(b.get("end_s") is None for b in bursts)))
                view["burst_key"] = periods
                ns = node_series(rows)
                new_nodes = sorted(set(ns) - set(order))
                if new_nodes:  # a node joined: re-render to add its traces
                    return (*ext, *patches, view, *banner, (reload_n or 0) + 1, *kpis, *tail)
                slo = _slo_ms(tok)
                if tab == "overview":
                    if rows:
                        cl = cluster_series(rows)
                        gap = {"last_t_s": last, "step_s": step}  # an outage between ticks: a gap
                        ext[0] = F.extend_cluster(cl, ["slo_attainment"], max_points, scale=100.0, **gap) or no_update
                        ext[1] = F.extend_nodes(ns, order, "p99_ms", max_points, **gap) or no_update
                        ext[2] = F.extend_cluster(cl, ["throughput_rps"], max_points, **gap) or no_update
                        ext[3] = F.extend_cluster(cl, ["emb_hit_rate", "kv_hit_rate"], max_points,
                                                  scale=100.0, **gap) or no_update
                    if shapes_changed:
                        for i, hl in ((0, [F.hline_shape(100 * slo_target, "target")]),
                                      (1, [F.hline_shape(slo, "slo")]), (2, []), (3, [])):
                            p = Patch()
                            p["layout"]["shapes"] = F.time_shapes(bursts, now, hl)
                            if isinstance(ext[i], list):  # never a figure change and extendData together
                                F.fold_extend(p, ext[i])
                                ext[i] = no_update
                            patches[i] = p
                else:  # split
                    sel = view.get("split_sel") or []
                    if rows:
                        p = Patch()
                        times = F.gap_times(sorted({t for s_ in ns.values() for t in s_["t_s"]}), last, step)
                        view["heat_cols"] = view.get("heat_cols", 0) + len(times)
                        if view["heat_cols"] > max_points:
                            # the heatmap has no browser-side trimming: once a whole range has been
                            # appended, redraw it whole (bounded at twice the range)
                            return (*ext, *patches, view, *banner, (reload_n or 0) + 1, *kpis, *tail)
                        p["data"][0]["x"].extend(F.to_xs(times))
                        for i, node_id in enumerate(order):
                            s_ = ns.get(node_id, {"t_s": [], "emb_share": []})
                            by_t = dict(zip(s_["t_s"], s_["emb_share"]))
                            p["data"][0]["z"][i].extend([by_t.get(t) for t in times])
                        if shapes_changed:
                            p["layout"]["shapes"] = F.time_shapes(bursts, now, outline=True)
                        patches[4] = p
                        xs, ys, texts, idx = [], [], [], []
                        for i, node_id in enumerate(sel):
                            s_ = ns.get(node_id)
                            if not s_:
                                continue
                            x, (applied, target) = F.gapped_extension(s_["t_s"], [s_["emb_share"],
                                                                                  s_["target_emb_share"]], last, step)
                            xs += [x, x]
                            ys += [applied, target]
                            texts += [[""] * len(x)] * 2
                            idx += [2 * i, 2 * i + 1]
                        since = view.get("dec_since_s") or (now - 2 * step - 5)
                        dec = [d for n in sel for d in client.decisions(tok, start_s=since, node_id=n,
                                                                         limit=1000)["items"]]
                        view["dec_since_s"] = max([d["ts_s"] for d in dec] + [since])
                        new = [d for d in dec if d["id"] > view.get("last_dec_id", 0)]
                        view["last_dec_id"] = max([d["id"] for d in dec] + [view.get("last_dec_id", 0)])
                        base = 2 * len(sel)
                        reasons = D.reasons_utc(new, bursts)
                        for j, src in enumerate(F.DECISION_SOURCES):
                            ds = [dict(d, reason=r) for d, r in zip(new, reasons) if d["source"] == src]
                            if ds:
                                xs.append(F.to_xs(d["ts_s"] for d in ds))
                                ys.append([d["emb_share"] for d in ds])
                                texts.append([F.decision_hover(d) for d in ds])  # the reason on hover
                                idx.append(base + j)
                        if idx:
                            ext[4] = [{"x": xs, "y": ys, "text": texts}, idx, max_points]
                    elif shapes_changed:
                        p = Patch()
                        p["layout"]["shapes"] = F.time_shapes(bursts, now, outline=True)
                        patches[4] = p
                    p = Patch()
                    bar = F.split_bar_figure(_split_rows(nodes_now))
                    p["data"][0]["x"] = list(bar.data[0].x)
                    p["data"][1]["x"] = list(bar.data[1].x)
                    patches[6] = p
                    if shapes_changed and sel:
                        p = Patch()
                        p["layout"]["shapes"] = F.time_shapes(bursts, now)
                        if isinstance(ext[4], list):  # never a figure change and extendData together
                            F.fold_extend(p, ext[4])
                            ext[4] = no_update
                        patches[5] = p
            elif tab == "bursts":
                bursts = client.bursts(tok, start_s=now - range_s)
                dec = client.decisions(tok, start_s=now - range_s, source="recovery", limit=DECISION_LIMIT)["items"]
                tail[1] = burst_rows(bursts, dec, now)
        except (Unavailable, ApiError) as e:
            msg = e.message if isinstance(e, ApiError) else str(e)
            view["ok"] = False
            return (*ext, *patches, view, True, [html.Strong("Control plane error: "), msg], "danger", no_update,
                    *kpis, *tail)
        if recovered:
            banner = (False, no_update, no_update)
        return (*ext, *patches, view, *banner, no_update, *kpis, *tail)

    # ---------------------------------------------------------------- override tables ---
    @app.callback(Output("grid-overrides", "rowData"), Output("grid-audit", "rowData"), Output("tables-key", "data"),
                  Input("tick-go", "data"), Input("tabs", "value"), Input("acted", "data"),
                  State("sid", "data"), State("tables-key", "data"), prevent_initial_call=True)
    def action_tables(_n, tab, _acted, sid, keys):
        """The override page's tables (the policies page's: dashboard.policies_tab); each is sent
        only when it changed since the last tick (a hash per output in the tables-key store)."""
        s = sessions.get(sid)
        out = [no_update] * 2
        if s is None or tab != "override":
            return *out, no_update
        keys = dict(keys or {}) if ctx.triggered_id == "tick-go" else {}
        tok = s.token
        try:
            ovs = client.overrides(tok, state="active")
            out[0] = [{"id": str(o["id"]), "scope": o.get("node_id") or "cluster", "emb_share": o["emb_share"],
                       "reason": o["reason"], "created_by": o.get("created_by"), "created": fmt_t(o["created_at_s"]),
                       "expires": fmt_t(o.get("expires_at_s")) or "never"}
                      for o in ovs if o.get("state", "active") == "active"]
            audit = client.audit(tok, limit=200)
            out[1] = [{"id": a["id"], "time": fmt_t(a["ts_s"]), "actor": a["actor"], "action": a["action"],
                       "target": a["target"], "before": _short(a.get("before")), "after": _short(a.get("after")),
                       "reason": a.get("reason", "")} for a in audit["items"]]
        except (Unavailable, ApiError):
            return *out, no_update
        for i, v in enumerate(out):
            h = hashlib.sha1(json.dumps(v, sort_keys=True, default=_jsonable).encode()).hexdigest()[:16]
            if keys.get(str(i)) == h:
                out[i] = no_update
            keys[str(i)] = h
        return *out, keys

    @app.callback(Output("ov-current", "children"), Input("ov-node", "value"), Input("ov-scope", "value"),
                  Input("nodes-data", "data"), prevent_initial_call=True)
    def override_current(node, scope, nodes):
        return current_share_text(nodes or [], node if scope == "node" else None)

    # ---------------------------------------------------------------- confirm and act ---
    @app.callback(Output("pending", "data"), Output("confirm-modal", "is_open"), Output("confirm-body", "children"),
                  Output("ov-error", "children"),
                  *[Input(b, "n_clicks") for b in ACTION_BUTTONS], Input("btn-cancel", "n_clicks"),
                  State("ov-scope", "value"), State("ov-node", "value"), State("ov-share", "value"),
                  State("ov-ttl", "value"), State("ov-reason", "value"), State("grid-overrides", "selectedRows"),
                  State("ov-clear-reason", "value"), State("nodes-data", "data"), State("sid", "data"),
                  prevent_initial_call=True)
    def ask(*args):
        """The override form's confirmation (naming the node's current emb_share), or what is missing."""
        scope, node, share, ttl, reason, selected, clear_reason, nodes, sid = args[len(ACTION_BUTTONS) + 1:]
        trig = ctx.triggered_id
        if trig == "btn-cancel" or not ctx.triggered or not ctx.triggered[0].get("value"):
            return None, False, no_update, no_update
        s = sessions.get(sid)
        if s is None or s.role != "operator":
            return None, False, no_update, "an operator token is needed"
        if trig == "btn-ov-submit":
            problems = []
            if share is None or not (0 <= float(share) <= 1):
                problems.append("emb_share must be a number in [0, 1]")
            if scope == "node" and not node:
                problems.append("choose a node (or cluster-wide scope)")
            if not (reason or "").strip():
                problems.append("a reason is required")
            if ttl is not None and float(ttl) <= 0:
                problems.append("expiry must be positive minutes or empty")
            if problems:
                return None, False, no_update, "; ".join(problems)
            target = f"node {node}" if scope == "node" else "every node (cluster-wide)"
            exp = f"for {float(ttl):g} min" if ttl else "until cleared"
            payload = {"emb_share": float(share), "reason": reason.strip(),
                       "node_id": node if scope == "node" else None,
                       "ttl_s": float(ttl) * 60 if ttl else None}
            now_text = current_share_text(nodes or [], node if scope == "node" else None)
            return ({"kind": "override", "payload": payload}, True,
                    f"Set emb_share to {float(share):.3f} on {target} {exp}? {now_text}. Reason: {reason.strip()}",
                    "")
        if trig == "btn-ov-clear":
            if not selected:
                return None, False, no_update, "select an active override in the table first"
            if not (clear_reason or "").strip():
                return None, False, no_update, "a reason for clearing is required"
            o = selected[0]
            scope_node = o["scope"] if o["scope"] != "cluster" else None
            return ({"kind": "clear", "id": int(o["id"]), "reason": clear_reason.strip()}, True,
                    f"Clear override #{o['id']} ({o['scope']}, emb_share {o['emb_share']})? "
                    f"{current_share_text(nodes or [], scope_node)}; the allocator takes over again. "
                    f"Reason: {clear_reason.strip()}", "")
        return None, False, no_update, no_update

    @app.callback(Output("retire-node", "options"), Input("ov-node", "options"), prevent_initial_call=True)
    def retire_options(options):
        return options  # the node list the override form shows

    @app.callback(Output("pending", "data", allow_duplicate=True), Output("confirm-modal", "is_open", allow_duplicate=True),
                  Output("confirm-body", "children", allow_duplicate=True), Output("retire-error", "children"),
                  Input("btn-node-retire", "n_clicks"), State("retire-node", "value"), State("retire-reason", "value"),
                  State("sid", "data"), prevent_initial_call=True)
    def ask_retire(n, node, reason, sid):
        s = sessions.get(sid)
        if not n:
            return no_update, no_update, no_update, no_update
        if s is None or s.role != "operator":
            return None, False, no_update, "an operator token is needed"
        if not node or not (reason or "").strip():
            return None, False, no_update, "choose a node and give a reason"
        return ({"kind": "retire", "node_id": node, "reason": reason.strip()}, True,
                f"Retire node {node}? It leaves the node list (the gateways stop sending it requests), its "
                f"tokens are revoked and its overrides cleared. Reason: {reason.strip()}", "")

    @app.callback(Output("confirm-modal", "is_open", allow_duplicate=True), Output("pending", "data", allow_duplicate=True),
                  Output("action-result", "is_open"), Output("action-result", "children"),
                  Output("action-result", "color"), Output("acted", "data"),
                  Input("btn-confirm", "n_clicks"), State("pending", "data"), State("sid", "data"),
                  State("acted", "data"), prevent_initial_call=True)
    def execute(_n, pending, sid, acted):
        s = sessions.get(sid)
        if not pending or s is None:
            return False, None, no_update, no_update, no_update, no_update
        if s.role != "operator":  # the buttons are disabled for viewers; the control plane refuses too
            return False, None, True, "a viewer cannot act: sign in with an operator token", "danger", no_update
        tok = s.token
        try:
            kind = pending["kind"]
            if kind == "override":
                p = pending["payload"]
                o = client.create_override(tok, emb_share=p["emb_share"], reason=p["reason"], node_id=p["node_id"],
                                           ttl_s=p["ttl_s"])
                msg = f"override #{o['id']} set: emb_share {o['emb_share']} on {o.get('node_id') or 'the cluster'}"
            elif kind == "clear":
                client.clear_override(tok, pending["id"], pending.get("reason") or "cleared from the dashboard")
                msg = f"override #{pending['id']} cleared"
            elif kind == "retire":
                n = client.retire_node(tok, pending["node_id"], pending["reason"])
                msg = f"node {n['node_id']} retired"
            elif kind == "activate":
                p = client.activate_policy(tok, pending["version"], pending["reason"])
                msg = f"policy {p['version']} is {p['status']}: every node loads it"
            elif kind == "rollout":
                r = client.start_rollout(tok, **pending["payload"])
                msg = f"rollout #{r['id']} of {r['policy_version']} started ({r['state']})"
            else:
                r = client.rollout_action(tok, pending["id"], pending["action"], f"{pending['action']} from the dashboard")
                msg = f"rollout #{r['id']}: {pending['action']} → {r['state']}"
            color = "success"
        except ApiError as e:
            msg, color = f"refused by the control plane: {e.message}", "danger"
        except Unavailable as e:
            msg, color = str(e), "danger"
        return False, None, True, msg, color, (acted or 0) + 1

    return app


def _jsonable(o):
    """Figures and components as JSON (for change hashes)."""
    if hasattr(o, "to_plotly_json"):
        return o.to_plotly_json()
    return str(o)


def _node_rows(nodes: list[dict]) -> list[dict]:
    return [{"node_id": n["node_id"], "status": n.get("status"), "device": n.get("device"),
             "emb_share": None if n.get("emb_share") is None else round(n["emb_share"], 2),
             "policy_version": n.get("policy_version"), "num_reports_dropped": n.get("num_reports_dropped"),
             "model": _model_label(n)}
            for n in sorted(nodes, key=lambda n: n["node_id"])]


def _model_label(node: dict) -> str:
    """The model a node serves: its checkpoint's digest (first 12 hex digits), or random weights."""
    digest = (node.get("cost_profile") or {}).get("model_digest")
    return str(digest)[:12] if digest else "random weights"


def _split_rows(nodes: list[dict]) -> list[dict]:
    rows = []
    for n in sorted(nodes, key=lambda n: n["node_id"]):
        row = {"node_id": n["node_id"], "emb_share": n.get("emb_share")}
        arena = n.get("arena_bytes") or (n.get("cost_profile") or {}).get("arena_bytes")
        if arena:
            row["arena_bytes"] = arena
        rows.append(row)
    return rows


def current_share_text(nodes: list[dict], node_id: str | None) -> str:
    """What the override dialogs show of the nodes' present emb_share (``nodes``: the node rows);
    ``node_id`` None: the cluster's range."""
    if node_id is not None:
        n = next((n for n in nodes if n.get("node_id") == node_id), None)
        if n is None or n.get("emb_share") is None:
            return f"{node_id} has reported no emb_share yet"
        return f"{node_id} is at emb_share {float(n['emb_share']):.3f} now"
    vals = [float(n["emb_share"]) for n in nodes if n.get("emb_share") is not None]
    if not vals:
        return "no node has reported an emb_share yet"
    return f"the {len(vals)} nodes are at emb_share {min(vals):.3f}-{max(vals):.3f} now"


def run(control_plane_url: str, *, host: str = "127.0.0.1", port: int = 8050, refresh_s: float = 2.0,
        timeout_s: float = 3.0, slo_ms: float = 30.0, range_s: int = 900, ready=None) -> None:
    """Serve the dashboard (``racer dashboard``): Flask's threaded server, request lines logged
    at warning level only (they hold no token anyway)."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    app = create_app(control_plane_url, refresh_s=refresh_s, timeout_s=timeout_s, slo_ms=slo_ms, range_s=range_s)
    from werkzeug.serving import make_server

    server = make_server(host, port, app.server, threaded=True)
    print(f"racer dashboard: http://{host}:{server.server_port}/ (control plane {control_plane_url})", flush=True)
    if ready is not None:
        ready(host, server.server_port)
    previous = None
    if threading.current_thread() is threading.main_thread():  # SIGTERM (racer up's stop): a clean exit, status 0
        def _on_term(signum, frame):
            raise KeyboardInterrupt
        previous = signal.signal(signal.SIGTERM, _on_term)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
