"""The overview's lead: what clients see, from the gateways' reports (``GET /api/v1/gateways``),
beside what the nodes see of themselves (``/summary``).

- `client_state` (pure): the gateways' newest reports -> the figures of the cards (SLO attainment
  as clients see it, P99/P50 end to end, requests, 5xx, 503s, retries, the load phase) and the
  state: ``live`` (requests served in the last interval), ``idle`` (gateways report, no request),
  ``failing`` (requests, none served), ``stalled`` (no gateway report for more than one whole
  interval) or ``none`` (no gateway has ever reported). A figure with no data is None (drawn as
  a gap, "–"), never 0; a stalled gateway's old figures are not shown as current.
- `clients_figure` (pure): the clients' P99 end to end (worst gateway per bucket) and failed
  requests over the chosen range, at most `MAX_BUCKETS` buckets; a bucket with no report is a
  gap, a bucket whose requests all failed has errors and no P99.
- `section`: the banner, the cards and the chart (layout); `register`: the callback that fills
  them every tick (``GET /gateways`` and the reports since the last tick, `_History`) and the
  nodes' own figures beside the cards from the summary store.
"""

from __future__ import annotations

import math
import threading
import time

import dash_bootstrap_components as dbc
import plotly.graph_objects as go
from dash import Input, Output, Patch, State, dcc, html, no_update

GAP = "–"
GONE_S = 600.0  # a gateway silent this long is taken as gone (replaced) while another one reports
MAX_BUCKETS = 180
STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600)


def client_state(gateways: list[dict]) -> dict:
    """The client-side figures over the gateways that are not stalled (their newest report each):
    counts summed, P99 the worst gateway's, P50 and SLO attainment weighted by requests; a
    banner ``(text, color)`` when a gateway stalled or clients got no answer served. A gateway
    silent for over `GONE_S` is taken as gone (no banner) while another one reports; when none
    reports, the one heard from last is the stalled one."""
    fresh = [g for g in gateways if not g.get("stalled") and g.get("last_report")]
    silent = [g for g in gateways if g.get("stalled")]
    stalled = [g for g in silent if (g.get("age_s") or 0.0) <= GONE_S]
    if silent and not stalled and not fresh:
        stalled = [min(silent, key=lambda g: g.get("age_s") or 0.0)]
    out = {"state": "none", "num_gateways": len(gateways), "num_gone": len(silent) - len(stalled),
           "num_requests": None, "num_ok": None, "num_failed": None,
           "num_503": None, "num_retried": None, "throughput_rps": None, "p50_ms": None, "p99_ms": None,
           "slo_attainment": None, "slo_ms": None, "load_phase": None, "banner": None}
    msgs = []
    if stalled:
        parts = [f"{g['gateway_id']} (no report for {g.get('age_s', 0):.0f} s; interval {g.get('interval_s', 0):g} s)"
                 for g in stalled]
        msgs.append("Gateway reports stalled: " + ", ".join(parts) + ". What clients see there is unknown.")
    if not gateways:
        return out
    if not fresh:
        out["state"] = "stalled"
        out["banner"] = (" ".join(msgs), "danger")
        return out
    reps = [g["last_report"] for g in fresh]
    for k in ("num_requests", "num_ok", "num_failed", "num_503", "num_retried"):
        out[k] = sum(int(r.get(k) or 0) for r in reps)
    out["throughput_rps"] = sum((r.get("num_requests") or 0) / r["interval_s"] for r in reps if r.get("interval_s"))
    p99 = [r["p99_ms"] for r in reps if r.get("p99_ms") is not None]
    out["p99_ms"] = max(p99) if p99 else None
    for key, weight in (("p50_ms", "num_ok"), ("slo_attainment", "num_requests")):
        pairs = [(r[key], r.get(weight) or 0) for r in reps if r.get(key) is not None]
        w = sum(x for _, x in pairs)
        out[key] = (sum(v * x for v, x in pairs) / w) if w > 0 else None
    out["slo_ms"] = reps[0].get("slo_ms")
    newest = sorted(reps, key=lambda r: -r.get("ts_s", 0))
    out["load_phase"] = next((r["load_phase"] for r in newest if r.get("load_phase")), None)
    n, ok = out["num_requests"], out["num_ok"]
    if ok > 0:
        out["state"] = "live"
    elif n > 0:
        out["state"] = "failing"
        msgs.insert(0, f"Clients: no request served in the last interval ({n} answered with errors: "
                       f"{out['num_503']} × 503 no live node, {out['num_failed'] - out['num_503']} other 5xx, "
                       f"{n - out['num_failed']} × 4xx).")
    else:
        out["state"] = "idle"
    if msgs:
        out["banner"] = (" ".join(msgs), "danger")
    return out


def bucket_step(range_s: float) -> int:
    """The bucket (s) that gives at most `MAX_BUCKETS` over ``range_s``."""
    return next((s for s in STEPS if range_s / s <= MAX_BUCKETS), STEPS[-1])


MAX_BANDS = 60


def load_bursts(rows: list[dict]) -> list[tuple[float, float]]:
    """The spans (start_s, end_s) in which clients named a ``burst`` load phase: each report's
    interval ``[ts_s - interval_s, ts_s]`` whose ``load_phase`` is ``burst[...]`` (or ``burst``),
    overlapping or touching spans merged (0.1 s of slack); at most the newest `MAX_BANDS`."""
    spans = sorted((r["ts_s"] - (r.get("interval_s") or 0.0), r["ts_s"]) for r in rows
                   if (r.get("load_phase") or "").split("[", 1)[0] == "burst")
    out: list[list[float]] = []
    for a, b in spans:
        if out and a <= out[-1][1] + 0.1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out[-MAX_BANDS:]]


def clients_figure(rows: list[dict], now_s: float, range_s: float, slo_ms: float | None = None) -> go.Figure:
    """P99 end to end (line, ms; the worst gateway's in each bucket) and failed requests (bars,
    5xx answers per bucket) from gateway reports (``ts_s``, ``p99_ms``, ``num_failed``) over
    ``[now_s - range_s, now_s]``, from the first bucket with a report on. A bucket with no report: no point and no bar (a gap); with
    reports but nothing served: a bar and no P99. The load generator's burst phases (as clients
    named them) are shaded purple (shapes named ``load_burst``)."""
    step = bucket_step(range_s)
    # from the first bucket holding a report, as the nodes' charts start at their first report: an
    # empty stretch before the first gateway report would give this chart another time axis
    lo = now_s - range_s
    first = math.floor(min((r["ts_s"] for r in rows if r["ts_s"] >= lo), default=lo) / step) * step
    n = max(1, int(math.ceil((now_s - first) / step)))
    p99: list[float | None] = [None] * n
    failed: list[int | None] = [None] * n
    for r in rows:
        k = int((r["ts_s"] - first) // step)
        if not 0 <= k < n:
            continue
        failed[k] = (failed[k] or 0) + int(r.get("num_failed") or 0)
        if r.get("p99_ms") is not None:
            p99[k] = r["p99_ms"] if p99[k] is None else max(p99[k], r["p99_ms"])
    xs = [int(round((first + k * step) * 1000.0)) for k in range(n)]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=xs, y=p99, mode="lines+markers", name="P99 end to end (ms)", connectgaps=False,
                             marker=dict(size=3), line=dict(color="#1f77b4", width=2)))
    fig.add_trace(go.Bar(x=xs, y=failed, name=f"failed requests (5xx) per {step} s", yaxis="y2",
                         marker=dict(color="rgba(214,39,40,0.55)")))
    shapes = []
    if slo_ms:
        shapes.append(dict(type="line", xref="paper", x0=0, x1=1, yref="y", y0=slo_ms, y1=slo_ms, name="slo",
                           line=dict(color="#d62728", dash="dash", width=1.5)))
    for a, b in load_bursts(rows):
        shapes.append(dict(type="rect", xref="x", yref="paper", x0=int(round(a * 1000.0)), x1=int(round(b * 1000.0)),
                           y0=0, y1=1, name="load_burst", fillcolor="rgba(148,103,189,0.15)", line=dict(width=0),
                           layer="below"))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="load phase: burst", hoverinfo="skip",
                             showlegend=any(sh["name"] == "load_burst" for sh in shapes),
                             marker=dict(symbol="square", size=12, color="rgba(148,103,189,0.35)")))
    fig.update_layout(template="plotly_white", height=260, margin=dict(l=60, r=60, t=40, b=40), shapes=shapes,
                      title=dict(text="What clients see: P99 end to end and failed requests (all gateways)",
                                 font=dict(size=14)),
                      xaxis=dict(type="date", title_text="time (UTC)"),
                      yaxis=dict(title_text="P99 (ms)", rangemode="tozero"),
                      # a count: whole ticks, and 0-1 while nothing failed (not 0.254 / 0.508)
                      yaxis2=dict(title_text="failed", overlaying="y", side="right", rangemode="tozero",
                                  showgrid=False, tickformat="d",
                                  **({"range": [0, 1], "dtick": 1} if max((f or 0) for f in failed) == 0 else {})),
                      legend=dict(orientation="h", y=1.0, x=1, xanchor="right", yanchor="bottom"),
                      uirevision="clients", bargap=0.1)
    return fig


def node_rows(gateways: list[dict]) -> list[dict]:
    """Per node, as the gateways that are not stalled saw it in their last interval: attempts,
    failed attempts, the queueing before the node (P50: the mean over gateways, P99: the worst)
    and whether any gateway has it in rotation. None where no gateway measured it."""
    by: dict[str, dict] = {}
    for g in gateways:
        if g.get("stalled") or not g.get("last_report"):
            continue
        for n in (g["last_report"].get("details") or {}).get("nodes") or []:
            d = by.setdefault(n["node_id"], {"node_id": n["node_id"], "num_attempts": 0, "num_failed": 0,
                                             "p50": [], "pre_node_p99_ms": None, "live": None})
            d["num_attempts"] += int(n.get("num_attempts") or 0)
            d["num_failed"] += int(n.get("num_failed") or 0)
            if n.get("pre_node_p50_ms") is not None:
                d["p50"].append(n["pre_node_p50_ms"])
            if n.get("pre_node_p99_ms") is not None:
                d["pre_node_p99_ms"] = max(d["pre_node_p99_ms"] or 0.0, n["pre_node_p99_ms"])
            if n.get("live") is not None:
                d["live"] = bool(d["live"]) or bool(n["live"])
    out = []
    for nid in sorted(by):
        d = by[nid]
        p50 = d.pop("p50")
        d["pre_node_p50_ms"] = sum(p50) / len(p50) if p50 else None
        out.append(d)
    return out


def nodes_table(rows: list[dict]):
    """The per-node rows as a small HTML table (an empty list: a line saying so)."""
    if not rows:
        return html.Div("no node seen by a gateway in its last interval", className="small text-muted")
    head = html.Tr([html.Th(h) for h in ("node", "in rotation", "attempts", "failed",
                                          "queueing before the node P50", "P99")])
    body = [html.Tr([html.Td(r["node_id"]),
                     html.Td(GAP if r["live"] is None else ("yes" if r["live"] else "no"),
                             className="" if r["live"] is not False else "text-danger fw-semibold"),
                     html.Td(str(r["num_attempts"])),
                     html.Td(str(r["num_failed"]), className="text-danger fw-semibold" if r["num_failed"] else ""),
                     html.Td(_ms(r["pre_node_p50_ms"])), html.Td(_ms(r["pre_node_p99_ms"]))]) for r in rows]
    return html.Table([html.Thead(head), html.Tbody(body)], className="table table-sm small mb-2", id="cv-nodes-tbl")


def _pct(v) -> str:
    return GAP if v is None else f"{100 * v:.1f}%"


def _ms(v) -> str:
    return GAP if v is None else f"{v:.1f} ms"


def _n(v) -> str:
    return GAP if v is None else str(v)


STATE_TEXT = {"live": ("live: requests served", "text-success"), "idle": ("idle: no requests", "text-muted"),
              "failing": ("failing: nothing served", "text-danger"), "stalled": ("stalled: no report", "text-danger"),
              "none": ("no gateway reports", "text-muted")}


def range_slo(rows: list[dict]) -> float | None:
    """The clients' SLO attainment over the reports ``rows`` (every gateway's, over the range
    shown): weighted by each report's requests, as the clients experienced it, not a mean of
    intervals or of nodes. None: no request in the range."""
    pairs = [(float(r["slo_attainment"]), int(r.get("num_requests") or 0)) for r in rows
             if r.get("slo_attainment") is not None]
    n = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / n if n > 0 else None


def card_values(s: dict) -> dict:
    """Card id -> text of `client_state`'s figures."""
    thr = s.get("throughput_rps")
    return {"cv-state": STATE_TEXT[s["state"]][0],
            "cv-slo": _pct(s["slo_attainment"]), "cv-p99": _ms(s["p99_ms"]), "cv-p50": _ms(s["p50_ms"]),
            "cv-req": GAP if s["num_requests"] is None else f"{s['num_requests']} ({thr:.1f}/s)",
            "cv-errors": _n(s["num_failed"]), "cv-503": _n(s["num_503"]), "cv-retries": _n(s["num_retried"]),
            "cv-phase": s["load_phase"] or GAP}


CARDS = (("cv-state", "clients"), ("cv-slo", "SLO attainment (clients, over the range)"), ("cv-p99", "P99 end to end"),
         ("cv-p50", "P50 end to end"), ("cv-req", "requests (last interval)"), ("cv-errors", "errors (5xx)"),
         ("cv-503", "503 (no live node)"), ("cv-retries", "retried"), ("cv-phase", "load phase"))
BESIDE = {"cv-slo": ("nv-slo", "nodes' own"), "cv-p99": ("nv-p99", "nodes' own (mean)")}


def _card(cid: str, label: str) -> dbc.Col:
    body = [html.Div(label, className="text-muted small"), html.Div(GAP, id=cid, className="fs-5 fw-semibold")]
    if cid in BESIDE:
        nid, nlabel = BESIDE[cid]
        body.append(html.Div([html.Span(nlabel + ": ", className="text-muted"), html.Span(GAP, id=nid)],
                             className="small"))
    return dbc.Col(dbc.Card(dbc.CardBody(body, className="py-2"), className="h-100"), xs=6, md=4, lg=True)


def section() -> html.Div:
    """The overview's first row: the client-side banner and cards."""
    return html.Div([
        dbc.Alert(id="client-banner", color="danger", is_open=False, className="py-2 mb-2"),
        html.Div([html.Span("What clients see", className="fw-semibold me-2"),
                  html.Span("(SLO attainment over the range shown, request-weighted; the other figures the "
                            "gateways' last report interval; the nodes' own beside. A gateway times a request "
                            "from reading it: the wait before that, in the client or the network, is not in "
                            "these figures)", className="small text-muted", id="cv-note")], className="mb-1"),
        dbc.Row([_card(cid, label) for cid, label in CARDS], className="g-2 mb-2", id="client-cards"),
        html.Details([html.Summary("per node, as the gateways saw it (last interval)", className="small"),
                      html.Div(id="cv-nodes")], open=True, className="mb-2"),
        dcc.Graph(id="g-clients", figure={"data": [], "layout": {"height": 260, "template": "plotly_white"}},
                  config={"displaylogo": False, "responsive": True}, style={"minHeight": "260px"}),
        dcc.Store(id="cv-drawn", data=None),  # the range the chart was drawn whole for (this page)
    ])


def register(app, client, sessions) -> None:
    """The callbacks: client cards and banner every tick (``GET /gateways``), the nodes' figures
    beside them from the summary store."""
    from .client import ApiError, Unavailable

    ids = [cid for cid, _ in CARDS]
    history = _History()

    @app.callback(*[Output(cid, "children") for cid in ids], Output("client-banner", "is_open"),
                  Output("client-banner", "children"), Output("cv-state", "className"),
                  Output("g-clients", "figure"), Output("cv-drawn", "data"), Output("cv-nodes", "children"),
                  Input("tick-go", "data"), Input("sid", "data"), State("range", "value"), State("cv-drawn", "data"),
                  prevent_initial_call=True)
    def client_cards(_n, sid, range_s, drawn):
        s = sessions.get(sid)
        if s is None:
            return [no_update] * (len(ids) + 6)
        now = time.time()
        range_s = float(range_s or 900)
        def fetch(start_s: float, end_s: float | None, limit: int) -> list[dict]:
            params = {"start_s": start_s, "details": "false", "limit": limit}
            if end_s is not None:
                params["end_s"] = end_s
            return client.get("/gateway-reports", s.token, **params)

        try:
            gws = client.get("/gateways", s.token)
            rows, changed = history.update(sid, range_s, now, fetch, gws)
        except (ApiError, Unavailable):
            return [no_update] * (len(ids) + 6)  # the control plane's own banner says why
        st = client_state(gws)
        vals = card_values(st)
        slo = range_slo([r for r in rows if r.get("ts_s", 0.0) >= now - range_s])
        vals["cv-slo"] = _pct(slo)  # the headline: the clients' over the range, request-weighted
        banner = st["banner"]
        fig = no_update
        if changed or drawn != range_s:  # the whole figure once per page and range, then its data only
            full = clients_figure(rows, now, range_s, st.get("slo_ms"))
            if changed == "new" or drawn != range_s:
                fig = full
            else:
                fig = Patch()
                for i in (0, 1):
                    fig["data"][i]["x"] = list(full.data[i].x)
                    fig["data"][i]["y"] = list(full.data[i].y)
                fig["data"][1]["name"] = full.data[1].name
                fig["data"][2]["showlegend"] = full.data[2].showlegend
                fig["layout"]["shapes"] = [sh.to_plotly_json() for sh in full.layout.shapes]
                fig["layout"]["yaxis2"] = full.layout.yaxis2.to_plotly_json()  # 0-1 until something fails
        return (*[vals[cid] for cid in ids], banner is not None, banner[0] if banner else no_update,
                "fs-5 fw-semibold " + STATE_TEXT[st["state"]][1], fig, range_s, nodes_table(node_rows(gws)))

    @app.callback(Output("nv-slo", "children"), Output("nv-p99", "children"), Input("summary", "data"),
                  prevent_initial_call=True)
    def node_beside(summary):
        summary = summary or {}
        return _pct(summary.get("mean_slo_attainment")), _ms(summary.get("mean_p99_ms"))


PAGE_ROWS = 20_000  # reports per request (the API's newest `limit` of a time span)
MAX_PAGES = 20  # requests for one read at most: 400,000 reports (24 h of 4 gateways at 1 s)
LOOKBACK_INTERVALS = 10  # each tick re-reads this many report intervals before the newest held...
MIN_LOOKBACK_S = 30.0  # ...and at least this long: a report stored late is drawn, not left a gap
BACKLOG_REPORTS = 600  # the most a gateway keeps unsent (gateway.uplink.MAX_PENDING_CLIENT_REPORTS)


def read_span(fetch, start_s: float, max_pages: int = MAX_PAGES, page_rows: int = PAGE_ROWS) -> tuple[list, bool]:
    """Every report with ``ts_s >= start_s``, read newest page first: ``fetch(start_s, end_s,
    limit)`` answers the newest ``limit`` reports of ``[start_s, end_s)`` (``end_s`` None: no end),
    oldest first, as ``GET /gateway-reports`` does. A full page continues below its oldest
    ``ts_s`` (that instant read again: reports sharing it may have been cut; duplicates are for the
    caller to drop by key). Returns (rows, complete); at most ``max_pages`` requests."""
    out: list[dict] = []
    end: float | None = None
    for _ in range(max_pages):
        page = fetch(start_s, end, page_rows)
        out.extend(page)
        if len(page) < page_rows:
            return out, True
        oldest, newest = page[0]["ts_s"], page[-1]["ts_s"]
        # all in one instant: below it (the rest of that instant cannot be told apart by time)
        end = oldest if newest == oldest else math.nextafter(oldest, math.inf)
    return out, False


class _History:
    """Per signed-in session: the gateway reports of the chosen range (without details), read
    once (`read_span`: page by page, the whole range), then each tick those since a look-back
    before the newest held (`LOOKBACK_INTERVALS` report intervals, at least `MIN_LOOKBACK_S`: a
    gateway that posts late is still drawn) or, for a gateway whose newest sequence number
    (``GET /gateways``) is past the newest read of it (a gateway replaying its backlog), since its
    own newest report held (a gateway new here: `BACKLOG_REPORTS` intervals before it was first
    seen); reports are kept once by (gateway id, seq). ``update`` says whether
    the chart must be drawn again (new reports, a new range, or a bucket boundary passed)."""

    def __init__(self, max_sessions: int = 200) -> None:
        self._by_sid: dict[str, dict] = {}
        self._lock = threading.Lock()
        self.max_sessions = max_sessions

    def update(self, sid: str, range_s: float, now_s: float, fetch,
               gateways: list[dict] | None = None) -> tuple[list[dict], bool | str]:
        """(the range's rows, False / True / "new": nothing to draw / new data / draw it whole).
        ``fetch(start_s, end_s, limit)``: see `read_span`; ``gateways``: ``GET /gateways``."""
        with self._lock:
            h = self._by_sid.get(sid)
        fresh = h is None or h["range_s"] != range_s
        if fresh:
            h = {"range_s": range_s, "rows": [], "keys": set(), "newest": None, "drawn_bucket": None,
                 "held": {}, "seen_seq": {}}  # held: gateway id -> (its newest seq read, that report's ts_s)
        cut = now_s - range_s
        since = cut
        if h["newest"] is not None:
            step = max((r.get("interval_s") or 0.0 for r in h["rows"][-200:]), default=0.0)
            since = h["newest"] - max(MIN_LOOKBACK_S, LOOKBACK_INTERVALS * step)
            held = h["held"]
            for g in gateways or ():
                last = g.get("last_seq")
                gid = g.get("gateway_id")
                if last is not None and last > h["seen_seq"].get(gid, -1) and last > held.get(gid, (-1, 0.0))[0]:
                    # its backlog: from its newest held, else (new here) what it may have kept unsent
                    # before it was first heard from
                    since = min(since, held[gid][1] if gid in held else (
                        (g.get("first_seen_s") or cut) - BACKLOG_REPORTS * (g.get("interval_s") or 1.0)))
        got, _complete = read_span(fetch, max(since, cut))
        for g in gateways or ():
            if g.get("last_seq") is not None:
                h["seen_seq"][g.get("gateway_id")] = g["last_seq"]
        new = []
        for r in got:
            if (r["gateway_id"], r["seq"]) in h["keys"]:
                continue  # held already, or read twice where pages meet
            new.append(r)
            h["keys"].add((r["gateway_id"], r["seq"]))
            h["rows"].append({"gateway_id": r["gateway_id"], "seq": r["seq"], "ts_s": r["ts_s"],
                              "interval_s": r.get("interval_s"), "p99_ms": r.get("p99_ms"),
                              "num_failed": r.get("num_failed"), "load_phase": r.get("load_phase"),
                              "slo_attainment": r.get("slo_attainment"), "num_requests": r.get("num_requests")})
            h["newest"] = r["ts_s"] if h["newest"] is None else max(h["newest"], r["ts_s"])
            g = h["held"].get(r["gateway_id"])
            if g is None or r["seq"] > g[0]:
                h["held"][r["gateway_id"]] = (r["seq"], r["ts_s"])
        if new:
            h["rows"].sort(key=lambda r: r["ts_s"])  # a late report, or pages read newest first: time order
        if h["rows"] and h["rows"][0]["ts_s"] < cut:
            h["rows"] = [r for r in h["rows"] if r["ts_s"] >= cut]
            h["keys"] = {(r["gateway_id"], r["seq"]) for r in h["rows"]}
        bucket = math.floor(now_s / bucket_step(range_s))
        changed = "new" if fresh else bool(new) or h["drawn_bucket"] != bucket
        h["drawn_bucket"] = bucket
        with self._lock:
            if sid not in self._by_sid and len(self._by_sid) >= self.max_sessions:
                self._by_sid.pop(next(iter(self._by_sid)))
            self._by_sid[sid] = h
        return list(h["rows"]), changed
