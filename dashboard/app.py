"""The operator dashboard: a Dash app that is a client of the control-plane API only.

    racer dashboard --control-plane http://127.0.0.1:8400 [--port 8050] [--refresh-s 2]

Pages (tabs), one module each with its layout and its callbacks: Overview (`overview_tab`,
with the clients' view from `client_cards`), EMB-KV split (`split_tab`), Bursts (`bursts_tab`),
Decisions & routing (`decisions_tab` and `routing_tab`), Override (`override_tab`), Policies
(`policies_tab`), What-if (`whatif_tab`). What they share: `common` (builders, formatting),
`signin` (sessions and the sign-in), `live` (the render and live-tick callbacks that hand the
active page its part), `confirm` (the confirmation dialog every action goes through). This module
builds the page shell and wires them together.

Sign-in: the user pastes a control-plane token; the dashboard keeps it **server side**
(`signin.SessionStore`); the browser holds only a random session id. A viewer sees everything
with every control disabled and a note saying why; an operator can act; every action asks for
confirmation first.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor

import dash
import dash_bootstrap_components as dbc
from dash import dcc, html

from . import alerts, bursts_tab, client_cards, confirm, decisions_tab, live, overview_tab, override_tab, policies_tab
from . import routing_tab, signin, split_tab, whatif_tab
from . import figures as F
from .client import ControlPlaneClient
from .common import (BUCKET_GRACE_S, DECISION_LIMIT, MAX_POINTS, RANGES, SLO_TARGET_DEFAULT, SLOW_MS, STEPS,
                     Deps, col, fmt_age, fmt_t, graph, grid, kpi, range_options, step_for, time_col)
from .history import HistoryCache

# what other modules and tests import from here (the pages' own names, kept where they were)
from .bursts_tab import burst_rows
from .overview_tab import kpi_values, node_rows as _node_rows
from .override_tab import ACTION_BUTTONS, current_share_text
from .signin import Session, SessionStore
from .split_tab import SPLIT_NODES_DEFAULT, split_rows as _split_rows

__all__ = ["create_app", "run", "build_layout", "build_tabs", "warm_figures", "step_for", "fmt_t", "fmt_age",
           "burst_rows", "kpi_values", "_node_rows", "_split_rows", "current_share_text", "Session", "SessionStore",
           "ACTION_BUTTONS", "SPLIT_NODES_DEFAULT", "RANGES", "STEPS", "MAX_POINTS", "SLOW_MS", "DECISION_LIMIT",
           "SLO_TARGET_DEFAULT", "BUCKET_GRACE_S"]

log = logging.getLogger("racer.dashboard")

OVERVIEW_GRAPHS = ("g-slo", "g-p99", "g-thr", "g-hits")
SPLIT_GRAPHS = ("g-heat", "g-lines", "g-split")
ALL_GRAPHS = OVERVIEW_GRAPHS + SPLIT_GRAPHS + ("g-bursts-p99", "g-weights", "g-rollout")


def build_tabs(viewer: bool) -> html.Div:
    """The pages (tabs), sent to the browser on sign-in (`signin.register`'s ``auth_ui``), not
    with the page: a page that has not signed in draws no chart or grid. ``viewer``: every action
    button disabled and the viewer's note shown."""
    decisions = html.Div(decisions_tab.layout(grid, col, time_col) + routing_tab.layout(), className="pt-2")
    return html.Div([dcc.Store(id="render-go"), dcc.Tabs(id="tabs", value="overview", children=[
        dcc.Tab(label="Overview", value="overview", children=overview_tab.layout()),
        dcc.Tab(label="EMB-KV split", value="split", children=split_tab.layout()),
        dcc.Tab(label="Bursts", value="bursts", children=bursts_tab.layout()),
        dcc.Tab(label="Decisions & routing", value="decisions", children=decisions),
        dcc.Tab(label="Override", value="override", children=override_tab.layout(viewer)),
        dcc.Tab(label="Policies", value="policies", children=policies_tab.layout(viewer, graph, grid, col, time_col)),
        dcc.Tab(label="What-if", value="whatif", children=whatif_tab.layout(viewer)),
    ])])


def _header(range_s: int) -> dbc.Navbar:
    return dbc.Navbar(dbc.Container([
        dbc.NavbarBrand("RACER operator dashboard", className="fw-bold"),
        html.Div([
            html.Span("range ", className="text-light small me-1"),
            dcc.Dropdown(id="range", options=range_options(range_s), value=range_s,
                         clearable=False, searchable=False,
                         style={"width": "110px", "display": "inline-block", "color": "#212529"}),
            html.Span(id="who", className="text-light small ms-3 me-2"),
            dbc.Button("Sign out", id="btn-logout", size="sm", color="secondary", className="ms-1",
                       style={"display": "none"}),
        ], className="d-flex align-items-center"),
    ], fluid=True), color="dark", dark=True, className="mb-2")


def build_layout(refresh_s: float, range_s: int = 900) -> html.Div:
    kpis = dbc.Row([kpi("kpi-nodes", "nodes up / down"), kpi("kpi-slo", "SLO attainment (mean of nodes, now)"),
                    kpi("kpi-p99", "P99 (mean of nodes, now)"), kpi("kpi-thr", "throughput"),
                    kpi("kpi-policy", "active policy"), kpi("kpi-overrides", "active overrides"),
                    kpi("kpi-age", "data age")], className="g-2 mb-2")
    return html.Div([
        _header(range_s),
        dbc.Container([
            signin.login_card(),
            dbc.Alert(id="banner", color="warning", is_open=False, className="py-2"),
            dbc.Alert(id="action-result", is_open=False, dismissable=True, className="py-2"),
            html.Div([alerts.section(), kpis, html.Div(id="kpi-device"), html.Div(id="role-note-policies"), html.Div(id="main-body")],
                     id="main",
                     style={"display": "none"}),
        ], fluid=True),
        confirm.modal(),
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
    """The Dash app for the control plane at ``control_plane_url``: the shell, then each page's
    callbacks (``register``)."""
    if not (isinstance(refresh_s, (int, float)) and math.isfinite(refresh_s) and refresh_s > 0):
        raise ValueError(f"refresh_s must be a positive number, got {refresh_s!r}")
    if not 0 < slo_target <= 1:
        raise ValueError(f"slo_target must be in (0, 1], got {slo_target!r}")
    client = ControlPlaneClient(control_plane_url, timeout_s=timeout_s)
    deps = Deps(client=client, sessions=SessionStore(),
                pool=ThreadPoolExecutor(max_workers=8, thread_name_prefix="racer-dashboard-fetch"),
                cache=HistoryCache(client.history, grace_s=BUCKET_GRACE_S), slo_ms=slo_ms, slo_target=slo_target)
    app = dash.Dash(__name__, title="RACER operator dashboard", update_title=None,
                    suppress_callback_exceptions=True)
    if not (isinstance(range_s, int) and range_s > 0):
        raise ValueError(f"range_s must be a positive integer of seconds, got {range_s!r}")
    app.layout = build_layout(refresh_s, range_s)
    warm_figures(slo_ms, slo_target)
    app.server.config["RACER_CLIENT"] = client
    app.server.config["RACER_SESSIONS"] = deps.sessions
    client_cards.register(app, client, deps.sessions)
    alerts.register(app, client, deps.sessions)
    policies_tab.register(app, client, deps.sessions, slo_ms=slo_ms, slo_target=slo_target, step_for=step_for,
                          default_range_s=range_s)
    decisions_tab.register(app, client, deps.sessions, default_range_s=range_s)
    signin.register(app, client, deps.sessions, build_tabs)
    live.register(app, deps)
    overview_tab.register(app)
    override_tab.register(app, client, deps.sessions)
    confirm.register(app, client, deps.sessions)
    whatif_tab.register(app, client, deps.sessions)
    return app


#: most bytes of one request body: a dropped upload (base64 in a JSON callback, 4/3 of the file)
#: with room for the callback's other state; anything past it gets 413 before a worker sees it
MAX_BODY_BYTES = policies_tab.MAX_UPLOAD_BYTES * 4 // 3 + 2 * 2**20
#: the most body bytes held at once over every request in progress (503 past it)
BODY_BUDGET_BYTES = 4 * MAX_BODY_BYTES
#: WSGI worker threads (the Dash callbacks); requests past them wait their turn, their bodies read
WORKERS = 16


def asgi_app(app: dash.Dash):
    """The Dash (Flask, WSGI) app as an ASGI app for `common.http_server.serve_forever`: its
    callbacks run on ``WORKERS`` threads, each body bounded by ``MAX_BODY_BYTES`` before a worker
    reads it (`BodyLimit` counts a chunked body's bytes as they come) and all of them together by
    ``BODY_BUDGET_BYTES``."""
    from a2wsgi import WSGIMiddleware

    from common.http_server import BodyLimit

    return BodyLimit(WSGIMiddleware(app.server, workers=WORKERS), MAX_BODY_BYTES, budget_bytes=BODY_BUDGET_BYTES)


def run(control_plane_url: str, *, host: str = "127.0.0.1", port: int = 8050, refresh_s: float = 2.0,
        timeout_s: float = 3.0, slo_ms: float = 30.0, range_s: int = 900, ready=None) -> None:
    """Serve the dashboard (``racer dashboard``) on the server the other processes use
    (`common.http_server.serve_forever`: uvicorn, request heads capped, slow clients timed out,
    SIGTERM a clean exit), the Flask app mounted through `asgi_app`. Call it from the main thread."""
    from common.http_server import serve_forever

    app = create_app(control_plane_url, refresh_s=refresh_s, timeout_s=timeout_s, slo_ms=slo_ms, range_s=range_s)

    def on_ready(h: str, bound: int) -> None:
        print(f"racer dashboard: http://{h}:{bound}/ (control plane {control_plane_url})", flush=True)
        if ready is not None:
            ready(h, bound)

    serve_forever(asgi_app(app), host, port, ready=on_ready)
