"""The Overview page: what clients see first (`dashboard.client_cards`), then the nodes' own
view: SLO attainment, throughput, P99 per node, hit rates, and the nodes table.

What a node's figures are shows in the nodes table's ``mode`` column (`mode_label`: emulated by
which profile, link emulated, real) and, when any up node runs an emulated device, on the KPI
cards (`kpi_values` marks the figures "modelled", `device_badge` says how many nodes).

``render`` draws the four charts whole; ``tick`` extends them with the new buckets
(``extendData``) and patches the burst shading (`Patch`) only when it moved. The nodes table is
drawn in the browser from the node rows (`register`)."""

from __future__ import annotations

import math
import time

import dash_bootstrap_components as dbc
from dash import Input, Output, Patch, html, no_update

from . import client_cards
from . import figures as F
from .client import cluster_series, node_series
from .common import RenderInput, TickInput, graph, pct

RENDER_OUTPUTS = {"slo_figure": Output("g-slo", "figure"), "p99_figure": Output("g-p99", "figure"),
                  "thr_figure": Output("g-thr", "figure"), "hits_figure": Output("g-hits", "figure")}
# the charts a tick extends, in this order (their `Patch` outputs: ``*_patch``)
TICK_GRAPHS = {"slo": "g-slo", "p99": "g-p99", "thr": "g-thr", "hits": "g-hits"}
TICK_OUTPUTS = {**{f"{k}_extend": Output(g, "extendData") for k, g in TICK_GRAPHS.items()},
                **{f"{k}_patch": Output(g, "figure", allow_duplicate=True) for k, g in TICK_GRAPHS.items()}}


def layout():
    return html.Div([
        client_cards.section(),  # what clients see leads, the nodes' own beside
        dbc.Row([dbc.Col(graph("g-slo"), lg=6), dbc.Col(graph("g-thr"), lg=6)]),
        dbc.Row([dbc.Col(graph("g-p99", 380), lg=12)]),
        dbc.Row([dbc.Col(graph("g-hits"), lg=6), dbc.Col(html.Div([
            html.H6("Nodes"), html.Div(id="nodes-table", style={"maxHeight": "300px", "overflowY": "auto"}),
        ]), lg=6)]),
    ], className="pt-2")


def node_rows(nodes: list[dict]) -> list[dict]:
    """The nodes table's rows (the ``nodes-data`` store)."""
    return [{"node_id": n["node_id"], "status": n.get("status"), "device": n.get("device"),
             "emb_share": None if n.get("emb_share") is None else round(n["emb_share"], 2),
             "policy_version": n.get("policy_version"), "num_reports_dropped": n.get("num_reports_dropped"),
             "model": model_label(n), "mode": mode_label(n), "started": started_label(n),
             "num_restarts": n.get("num_restarts"),
             "rate": None if n.get("throughput_rps") is None else f"{n['throughput_rps']:.1f}",
             "memory": memory_label(n.get("cost_profile") or {})}
            for n in sorted(nodes, key=lambda n: n["node_id"])]


def _gib(b) -> str:
    return f"{b / 2**30:.3g} GiB" if b >= 2**28 else f"{b / 2**20:.3g} MiB"


def memory_label(profile: dict) -> str | None:
    """A node's device memory as its registration gave it: "arena 1.2 GiB, metadata 40 MiB,
    device 71 GiB free of 80 GiB" (the device's figures only where it reports them: CUDA)."""
    parts = []
    for key, name in (("arena_bytes", "arena"), ("metadata_bytes", "metadata")):
        v = profile.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            parts.append(f"{name} {_gib(v)}")
    total, free = profile.get("device_total_bytes"), profile.get("device_free_bytes")
    if isinstance(total, int) and isinstance(free, int):
        parts.append(f"device {_gib(free)} free of {_gib(total)}")
    return ", ".join(parts) or None


def started_label(node: dict) -> str | None:
    """When the node's agent process started (UTC; a day back or more: with the date): a restart
    shows as a new time beside a higher restart count. A time, not an uptime, so the row does not
    change every second."""
    t = node.get("started_at_s")
    if not isinstance(t, (int, float)) or not math.isfinite(t):
        return None
    from datetime import datetime, timezone

    d = datetime.fromtimestamp(float(t), tz=timezone.utc)
    fmt = "%H:%M:%S" if abs(time.time() - float(t)) < 86400 else "%Y-%m-%d %H:%M"
    return d.strftime(fmt) + " UTC"


def mode_label(node: dict) -> str:
    """What a node's figures are (its ``device_mode``, from the control plane's node list):
    "emulated PROFILE (uncalibrated)" (modelled time; "calibrated" when its registration says the
    profile was measured on a device), "link emulated" (measured, the EMB link's time emulated),
    "real", or "–" when the node does not say."""
    mode = node.get("device_mode")
    if mode == "emulated":
        prof = node.get("device_profile") or "?"
        reg = (node.get("cost_profile") or {}).get("device") or {}
        cal = reg.get("calibrated") if reg.get("profile") == node.get("device_profile") else None
        return f"emulated {prof}" + ("" if cal is None else f" ({'calibrated' if cal else 'uncalibrated'})")
    return {"link-emulated": "link emulated", "real": "real"}.get(mode, "–")


def model_label(node: dict) -> str:
    """The model a node serves: its checkpoint's digest (first 12 hex digits), or random weights."""
    digest = (node.get("cost_profile") or {}).get("model_digest")
    return str(digest)[:12] if digest else "random weights"


def kpi_values(summary: dict) -> list[str]:
    """The KPI cards from the control plane's /summary (each node's latest report). When any up
    node runs an emulated device, the figures that come from its time (SLO attainment, P99,
    throughput) say "modelled"."""
    m = " (modelled)" if summary.get("num_emulated") else ""
    slo = pct(summary.get("mean_slo_attainment"))
    return [f"{summary.get('num_up', 0)} / {summary.get('num_down', 0)}", slo if slo == "–" else slo + m,
            "–" if summary.get("mean_p99_ms") is None else f"{summary['mean_p99_ms']:.1f} ms{m}",
            "–" if summary.get("total_throughput_rps") is None else f"{summary['total_throughput_rps']:.0f} req/s{m}",
            summary.get("active_policy") or "–", str(summary.get("num_active_overrides", 0))]


def device_badge(summary: dict) -> str | None:
    """The line under the KPI cards when any up node runs an emulated device: "emulated: 4 of 4
    nodes (a100-hstu), modelled time" (None: every up node's figures are measured, or unknown)."""
    n = summary.get("num_emulated") or 0
    if not n:
        return None
    profs = ", ".join(sorted(summary.get("emulated_profiles") or {}))
    return (f"emulated: {n} of {summary.get('num_up', n)} nodes" + (f" ({profs})" if profs else "")
            + ", modelled time")


def render(r: RenderInput) -> dict:
    cl = cluster_series(r.rows)
    ns = node_series(r.rows)
    return {"slo_figure": F.slo_attainment_figure(cl, r.slo_target, r.bursts, r.now, step_s=r.step),
            "p99_figure": F.p99_figure({n: ns.get(n, {"t_s": []}) for n in r.order}, r.slo_ms, r.bursts, r.now,
                                       step_s=r.step),
            "thr_figure": F.throughput_figure(cl, r.bursts, r.now, step_s=r.step),
            "hits_figure": F.hit_rate_figure(cl, r.bursts, r.now, step_s=r.step)}


def tick(t: TickInput, out: dict) -> bool:
    """New points for every trace, into ``out`` (named outputs); the shading patched (with the
    new points folded in) when it moved. True: drawn (the page never needs a whole redraw here)."""
    if t.rows:
        cl = cluster_series(t.rows)
        ns = node_series(t.rows)
        gap = {"last_t_s": t.last, "step_s": t.step}  # an outage between ticks: a gap
        out["slo_extend"] = F.extend_cluster(cl, ["slo_attainment"], t.max_points, scale=100.0, **gap) or no_update
        out["p99_extend"] = F.extend_nodes(ns, t.order, "p99_ms", t.max_points, **gap) or no_update
        out["thr_extend"] = F.extend_cluster(cl, ["throughput_rps"], t.max_points, **gap) or no_update
        out["hits_extend"] = F.extend_cluster(cl, ["emb_hit_rate", "kv_hit_rate"], t.max_points, scale=100.0,
                                              **gap) or no_update
    if t.shapes_changed:
        for k, hl in (("slo", [F.hline_shape(100 * t.slo_target, "target")]), ("p99", [F.hline_shape(t.slo_ms, "slo")]),
                      ("thr", []), ("hits", [])):
            p = Patch()
            p["layout"]["shapes"] = F.time_shapes(t.bursts, t.now, hl)
            if isinstance(out.get(f"{k}_extend"), list):  # never a figure change and extendData together
                F.fold_extend(p, out[f"{k}_extend"])
                out[f"{k}_extend"] = no_update
            out[f"{k}_patch"] = p
    return True


def register(app) -> None:
    # The nodes table: a plain HTML table drawn in the browser from the node rows (the server
    # sends only the rows, and only when they changed; a data grid's start-up would cost the
    # first render a few hundred ms), status in colour.
    app.clientside_callback(
        """function(rows) {
            if (!rows) { return window.dash_clientside.no_update; }
            const h = (type, props) => ({type: type, namespace: "dash_html_components", props: props});
            const cols = [["node_id", "node"], ["status", "status"], ["device", "device"],
                          ["emb_share", "emb_share"], ["rate", "req/s"], ["policy_version", "policy"],
                          ["mode", "mode"], ["model", "model"], ["started", "started"],
                          ["num_restarts", "restarts"], ["num_reports_dropped", "reports dropped"],
                          ["memory", "device memory (at registration)"]];
            const head = h("Thead", {children: h("Tr", {children: cols.map(c => h("Th", {children: c[1]}))})});
            const body = h("Tbody", {children: rows.map(r => h("Tr", {children: cols.map(c => h("Td", {
                children: r[c[0]] === null || r[c[0]] === undefined ? "\u2013" : String(r[c[0]]),
                className: (c[0] === "num_reports_dropped" || c[0] === "num_restarts")
                           ? (r[c[0]] > 0 ? "text-danger fw-semibold" : undefined)
                           : c[0] !== "status" ? undefined
                           : (r.status === "up" ? "text-success" : "text-danger fw-semibold")}))}))});
            return h("Table", {children: [head, body], id: "nodes-tbl",
                               className: "table table-sm table-striped table-hover small mb-0"});
        }""", Output("nodes-table", "children"), Input("nodes-data", "data"), prevent_initial_call=True)
