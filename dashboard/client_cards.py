"""The overview's lead: what clients see, from the gateways' reports (``GET /api/v1/gateways``),
beside what the nodes see of themselves (``/summary``).

- `client_state` (pure): the gateways' newest reports -> the figures of the cards (SLO attainment
  as clients see it, P99/P50 end to end, requests, 5xx, 503s, retries, the load phase) and the
  state: ``live`` (requests served in the last interval), ``idle`` (gateways report, no request),
  ``failing`` (requests, none served), ``stalled`` (no gateway report for more than one whole
  interval) or ``none`` (no gateway has ever reported). A figure with no data is None (drawn as
  a gap, "–"), never 0; a stalled gateway's old figures are not shown as current.
- `section`: the cards and the banner (layout); `register`: the callback that fills them every
  tick (one API read) and the nodes' own figures beside them from the summary store.
"""

from __future__ import annotations

import dash_bootstrap_components as dbc
from dash import Input, Output, State, html, no_update

GAP = "–"


def client_state(gateways: list[dict]) -> dict:
    """The client-side figures over the gateways that are not stalled (their newest report each):
    counts summed, P99 the worst gateway's, P50 and SLO attainment weighted by requests; a
    banner ``(text, color)`` when a gateway stalled or clients got no answer served."""
    fresh = [g for g in gateways if not g.get("stalled") and g.get("last_report")]
    stalled = [g for g in gateways if g.get("stalled")]
    out = {"state": "none", "num_gateways": len(gateways), "num_requests": None, "num_ok": None, "num_failed": None,
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
                       f"{out['num_503']} × 503 no live node, {out['num_failed'] - out['num_503']} other 5xx).")
    else:
        out["state"] = "idle"
    if msgs:
        out["banner"] = (" ".join(msgs), "danger")
    return out


def _pct(v) -> str:
    return GAP if v is None else f"{100 * v:.1f}%"


def _ms(v) -> str:
    return GAP if v is None else f"{v:.1f} ms"


def _n(v) -> str:
    return GAP if v is None else str(v)


STATE_TEXT = {"live": ("live: requests served", "text-success"), "idle": ("idle: no requests", "text-muted"),
              "failing": ("failing: nothing served", "text-danger"), "stalled": ("stalled: no report", "text-danger"),
              "none": ("no gateway reports", "text-muted")}


def card_values(s: dict) -> dict:
    """Card id -> text of `client_state`'s figures."""
    thr = s.get("throughput_rps")
    return {"cv-state": STATE_TEXT[s["state"]][0],
            "cv-slo": _pct(s["slo_attainment"]), "cv-p99": _ms(s["p99_ms"]), "cv-p50": _ms(s["p50_ms"]),
            "cv-req": GAP if s["num_requests"] is None else f"{s['num_requests']} ({thr:.1f}/s)",
            "cv-errors": _n(s["num_failed"]), "cv-503": _n(s["num_503"]), "cv-retries": _n(s["num_retried"]),
            "cv-phase": s["load_phase"] or GAP}


CARDS = (("cv-state", "clients"), ("cv-slo", "SLO attainment (clients)"), ("cv-p99", "P99 end to end"),
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
                  html.Span("(the gateways' last report interval; the nodes' own figures beside)",
                            className="small text-muted", id="cv-note")], className="mb-1"),
        dbc.Row([_card(cid, label) for cid, label in CARDS], className="g-2 mb-2", id="client-cards"),
    ])


def register(app, client, sessions) -> None:
    """The callbacks: client cards and banner every tick (``GET /gateways``), the nodes' figures
    beside them from the summary store."""
    from .client import ApiError, Unavailable

    ids = [cid for cid, _ in CARDS]

    @app.callback(*[Output(cid, "children") for cid in ids], Output("client-banner", "is_open"),
                  Output("client-banner", "children"), Output("cv-state", "className"),
                  Input("tick-go", "data"), Input("sid", "data"), prevent_initial_call=True)
    def client_cards(_n, sid):
        s = sessions.get(sid)
        if s is None:
            return [no_update] * (len(ids) + 3)
        try:
            gws = client.get("/gateways", s.token)
        except (ApiError, Unavailable):
            return [no_update] * (len(ids) + 3)  # the control plane's own banner says why
        st = client_state(gws)
        vals = card_values(st)
        banner = st["banner"]
        return (*[vals[cid] for cid in ids], banner is not None, banner[0] if banner else no_update,
                "fs-5 fw-semibold " + STATE_TEXT[st["state"]][1])

    @app.callback(Output("nv-slo", "children"), Output("nv-p99", "children"), Input("summary", "data"),
                  prevent_initial_call=True)
    def node_beside(summary):
        summary = summary or {}
        return _pct(summary.get("mean_slo_attainment")), _ms(summary.get("mean_p99_ms"))
