"""How the pages update (docs/dashboard.md has the picture): two callbacks shared by the pages,
each handing the active page its part (``render`` / ``tick`` in the page's module) and returning
named outputs (a dict keyed like the output dicts below).

- ``render`` builds the active page's figures whole, once: on sign-in, on a tab switch, on a new
  time range or node selection, and when the control plane comes back after the dashboard
  started without it. It asks the API for history downsampled to at most ~`MAX_POINTS` buckets.
- ``tick`` (a `dcc.Interval`, every ``refresh_s``) asks only for what is new since the last
  drawn bucket and sends partial updates: ``extendData`` (new points for every trace, trimmed to
  the range in the browser), `Patch` for the heatmap columns, the split bars and the burst
  shading, and AG Grid row transactions for new decisions (`dashboard.decisions_tab`). A tick
  that cannot reach the control plane (or gets a slow answer) raises the banner and marks the
  data with its age; the next good tick lowers it and fills the gap from the stored history,
  without a page reload.
"""

from __future__ import annotations

import hashlib
import json
import math
import time

import dash_bootstrap_components as dbc
from dash import Input, Output, State, html, no_update

from . import bursts_tab, overview_tab, routing_tab, split_tab
from . import details as D
from . import figures as F
from .client import ApiError, Unavailable, node_series
from .common import SLOW_MS, Deps, RenderInput, TickInput, fmt_age, fmt_t, step_for, unchanged

# each page's render: its module's function and the outputs it fills
PAGE_RENDER = {"overview": overview_tab.render, "split": split_tab.render, "bursts": bursts_tab.render,
               "decisions": routing_tab.render}  # the decision grid itself: dashboard.decisions_tab
RENDER_OUTPUTS = {**overview_tab.RENDER_OUTPUTS, **split_tab.RENDER_OUTPUTS, **bursts_tab.RENDER_OUTPUTS,
                  **routing_tab.RENDER_OUTPUTS,
                  "view": Output("view", "data"), "split_nodes": Output("split-nodes", "options"),
                  "override_nodes": Output("ov-node", "options"), "summary": Output("summary", "data"),
                  "nodes_data": Output("nodes-data", "data")}
TICK_OUTPUTS = {**overview_tab.TICK_OUTPUTS, **split_tab.TICK_OUTPUTS, **bursts_tab.TICK_OUTPUTS,
                "view": Output("view", "data", allow_duplicate=True), "banner_open": Output("banner", "is_open"),
                "banner": Output("banner", "children"), "banner_color": Output("banner", "color"),
                "reload": Output("reload", "data"), "summary": Output("summary", "data", allow_duplicate=True),
                "kpi_age": Output("kpi-age", "children"), "nodes_data": Output("nodes-data", "data"),
                "tick_done": Output("tick-done", "data")}
KPI_OUTPUTS = {"nodes": Output("kpi-nodes", "children"), "slo": Output("kpi-slo", "children"),
               "p99": Output("kpi-p99", "children"), "thr": Output("kpi-thr", "children"),
               "policy": Output("kpi-policy", "children"), "overrides": Output("kpi-overrides", "children"),
               "device": Output("kpi-device", "children")}

# Ticks never overlap: Dash drops the answer of a callback that is triggered again before it
# answered, so with a control plane slower than the refresh period no tick would ever land
# (not even the banner saying it is slow). The interval fires "tick-go" only when the last
# tick has answered ("tick-done"), or after 20 s.
TICK_GO_JS = """function(n) {
            const now = Date.now();
            if (window._racerTickBusy && now - window._racerTickBusy < 20000) {
                return window.dash_clientside.no_update;
            }
            window._racerTickBusy = now;
            return n;
        }"""
TICK_DONE_JS = """function(d) { window._racerTickBusy = 0; return window.dash_clientside.no_update; }"""


def render_page(deps: Deps, tok: str, tab: str, range_s, split_sel, weights_field) -> dict:
    """The active page drawn whole: every read at once (the summary, nodes, bursts and the
    history from the shared cache: the long one), then the page's own ``render``. The range ends
    at this server's clock, as the live ticks' do. The history is used only once the summary has
    accepted the user's token (the cache may answer from what other users' reads stored)."""
    client, pool = deps.client, deps.pool
    out = unchanged(RENDER_OUTPUTS)
    step = step_for(range_s)
    t_render = now = time.time()
    start = now - range_s
    try:
        f_summary = pool.submit(client.summary, tok)
        f_nodes = pool.submit(client.nodes, tok)
        f_bursts = pool.submit(client.bursts, tok, start_s=start)
        need_hist = tab in ("overview", "split", "bursts")
        f_rows = pool.submit(deps.cache.rows, tok, step, start, now) if need_hist else None
        try:
            summary = f_summary.result()
        except Exception:
            for f in (f_nodes, f_bursts, f_rows):
                if f is not None:
                    f.cancel()
            raise
        nodes = f_nodes.result()
        order = sorted(n["node_id"] for n in nodes)
        out["summary"], out["nodes_data"] = summary, overview_tab.node_rows(nodes)
        view = {"tab": tab, "range_s": range_s, "step_s": step, "order": order, "ok": True, "now_s": now,
                "fetched_at_s": t_render, "last_ok_s": t_render, "rendered": True}
        out["split_nodes"] = out["override_nodes"] = [{"label": n, "value": n} for n in order]
        rows = f_rows.result() if f_rows is not None else []
        bursts = f_bursts.result()
        view["last_t_s"] = max((r["ts_s"] for r in rows), default=None)
        view["burst_key"] = F.merge_periods(bursts)  # open bursts at their start: see tick
        view["open_burst"] = any(b.get("end_s") is None for b in bursts)
        if tab in PAGE_RENDER:
            out.update(PAGE_RENDER[tab](RenderInput(
                client=client, tok=tok, now=now, start=start, step=step, range_s=range_s, order=order,
                nodes=nodes, rows=rows, bursts=bursts, view=view, slo_ms=deps.slo_ms, slo_target=deps.slo_target,
                split_sel=split_sel, weights_field=weights_field)))
    except (Unavailable, ApiError) as e:
        error = e.message if isinstance(e, ApiError) else str(e)
        out["view"] = {"ok": False, "error": error, "rendered": False, "range_s": range_s, "tab": tab}
        return out
    out["view"] = view
    return out


def _unreachable(view: dict, wall: float, e: Exception) -> dict:
    """The tick's outputs when the summary could not be read: the banner, the data's age."""
    msg = e.message if isinstance(e, ApiError) else str(e)
    last_ok = view.get("last_ok_s")
    age = f"data shown is {fmt_age(wall - last_ok)} old (last update {fmt_t(last_ok)} UTC)" if last_ok \
        else "no data yet"
    view.update(ok=False, was_down=True, error=msg)
    return {"view": view, "banner_open": True, "banner_color": "danger",
            "banner": [html.Strong("Control plane unreachable. "), f"{msg}. {age}. ", "Retrying every tick."],
            "kpi_age": html.Span(fmt_age(wall - last_ok) + " (stale)" if last_ok else "–", className="text-danger")}


def _tick_charts(deps: Deps, tok: str, view: dict, futures: dict, now: float, out: dict) -> bool:
    """The overview's or the split page's partial updates from what the tick read, into ``out``;
    False: draw the page whole again (a node joined, or the heatmap holds a whole range more)."""
    tab, step, range_s = view.get("tab"), view.get("step_s") or 1, view.get("range_s") or 900
    last = view.get("last_t_s")
    rows = futures["rows"].result()  # complete buckets newer than the last drawn
    if rows:
        view["last_t_s"] = max(r["ts_s"] for r in rows)
    bursts = futures["bursts"].result()
    nodes_now = futures["nodes"].result()
    node_rows = overview_tab.node_rows(nodes_now)
    key = hashlib.sha1(json.dumps(node_rows, sort_keys=True).encode()).hexdigest()
    if key != view.get("nodes_key"):
        view["nodes_key"] = key
        out["nodes_data"] = node_rows
    # the shading changes when a burst starts, ends or merges with another; while one is on, its
    # band is extended to now when new points arrive (a complete bucket), not every tick: each
    # shapes Patch redraws the chart in the browser
    periods = F.merge_periods(bursts)
    shapes_changed = (json.dumps(periods) != json.dumps(view.get("burst_key"))
                      or (bool(rows) and any(b.get("end_s") is None for b in bursts)))
    view["burst_key"] = periods
    order = view.get("order") or []
    if set(node_series(rows)) - set(order):  # a node joined: re-render to add its traces
        return False
    t = TickInput(client=deps.client, tok=tok, now=now, step=step, range_s=range_s,
                  max_points=int(math.ceil(range_s / step)) + 1, order=order, rows=rows, last=last, bursts=bursts,
                  nodes=nodes_now, shapes_changed=shapes_changed, view=view, slo_ms=deps.slo_ms,
                  slo_target=deps.slo_target)
    return overview_tab.tick(t, out) if tab == "overview" else split_tab.tick(t, out)


def tick_page(deps: Deps, sid, view, reload_n) -> dict:
    """One live tick's named outputs (`TICK_OUTPUTS`, less ``tick_done``)."""
    out = unchanged(TICK_OUTPUTS)
    s = deps.sessions.get(sid)
    if s is None or not view:
        return out
    tok, wall, view = s.token, time.time(), dict(view)
    tab = view.get("tab")
    futures = {}
    if view.get("rendered") and tab in ("overview", "split"):  # fetched in parallel with the summary
        futures["rows"] = deps.pool.submit(deps.cache.since, tok, view.get("step_s") or 1, view.get("last_t_s"),
                                           wall - (view.get("range_s") or 900), wall)
        futures["bursts"] = deps.pool.submit(deps.client.bursts, tok, start_s=wall - (view.get("range_s") or 900))
        futures["nodes"] = deps.pool.submit(deps.client.nodes, tok)
    t0 = time.perf_counter()
    try:
        summary = deps.client.summary(tok)
        latency_ms = (time.perf_counter() - t0) * 1e3
    except (Unavailable, ApiError) as e:
        for f in futures.values():
            f.cancel()
        return {**out, **_unreachable(view, wall, e)}
    now = float(summary["now_s"])
    recovered = not view.get("ok", True) or not view.get("rendered")
    view.update(ok=True, last_ok_s=wall, now_s=now)
    # the control plane's data; whether requests are served: client_cards
    out.update(view=view, summary=summary, kpi_age="current")
    if latency_ms > SLOW_MS:
        out.update(banner_open=True, banner_color="warning",
                   banner=[html.Strong("Control plane slow: "), f"the last answer took {latency_ms:.0f} ms."])
    else:
        out["banner_open"] = False
    if not view.get("rendered") or (recovered and view.get("was_down")):
        # the first render failed (control plane was down), or the control plane is back after
        # an outage: nodes replay their buffered reports into buckets already read, so forget
        # them and draw the page whole again (a callback, not a page reload)
        deps.cache.clear()
        for f in futures.values():
            f.cancel()
        view["was_down"] = False
        return dict(out, reload=(reload_n or 0) + 1)
    try:
        if tab in ("overview", "split"):
            if not _tick_charts(deps, tok, view, futures, now, out):
                return dict(out, reload=(reload_n or 0) + 1)
        elif tab == "bursts":
            out["bursts_rows_tick"] = bursts_tab.tick(deps.client, tok, now, view.get("range_s") or 900)
    except (Unavailable, ApiError) as e:
        view["ok"] = False
        msg = e.message if isinstance(e, ApiError) else str(e)
        return {**out, "banner_open": True, "banner": [html.Strong("Control plane error: "), msg],
                "banner_color": "danger", "reload": no_update}
    if recovered:
        out.update(banner_open=False, banner=no_update, banner_color=no_update)
    return out


def register(app, deps: Deps) -> None:
    @app.callback(output=RENDER_OUTPUTS,
                  inputs=dict(tab=Input("tabs", "value"), split_sel=Input("split-nodes", "value"),
                              weights_field=Input("weights-field", "value"), _go=Input("render-go", "data")),
                  state=dict(range_s=State("range", "value"), sid=State("sid", "data")))
    def render(tab, split_sel, weights_field, _go, range_s, sid):
        # Every Input is a component of the tabs, which arrive on sign-in and trigger the first
        # render; a new range, a reload or an action reach it through "render-go" (in the tabs
        # too). An Input of the page itself (the session, the range) made Dash run this before
        # the tabs existed: "A nonexistent object was used in an Input" in the console.
        s = deps.sessions.get(sid)
        if s is None:
            return dict(unchanged(RENDER_OUTPUTS), view={})
        return render_page(deps, s.token, tab, range_s, split_sel, weights_field)

    @app.callback(output=KPI_OUTPUTS, inputs=dict(summary=Input("summary", "data"), nodes=Input("nodes-data", "data")),
                  prevent_initial_call=True)
    def show_kpis(summary, nodes):
        vals = overview_tab.kpi_values(summary or {})
        if nodes is not None:  # what the nodes run, not only what the registry calls active
            vals[4] = D.node_policies_text(nodes, (summary or {}).get("active_policy"))
        badge = overview_tab.device_badge(summary or {})
        return dict(zip(KPI_OUTPUTS, vals), device=None if badge is None else dbc.Badge(
            badge, id="kpi-device-badge", color="warning", text_color="dark", className="mb-2"))

    app.clientside_callback(  # a new range, a reload or an action: render again (see render)
        """function(range, reload, acted) { return Date.now(); }""",
        Output("render-go", "data"), Input("range", "value"), Input("reload", "data"), Input("acted", "data"),
        prevent_initial_call=True)

    @app.callback(output=TICK_OUTPUTS, inputs=dict(n=Input("tick-go", "data")),
                  state=dict(view=State("view", "data"), sid=State("sid", "data"), reload_n=State("reload", "data")),
                  prevent_initial_call=True)
    def tick(n, view, sid, reload_n):
        return dict(tick_page(deps, sid, view, reload_n), tick_done=n)

    app.clientside_callback(TICK_GO_JS, Output("tick-go", "data"), Input("tick", "n_intervals"),
                            prevent_initial_call=True)
    app.clientside_callback(TICK_DONE_JS, Output("tick-sink", "data"), Input("tick-done", "data"),
                            prevent_initial_call=True)
