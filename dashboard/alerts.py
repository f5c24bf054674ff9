"""The alerts firing now (``GET /api/v1/alerts``, `control_plane.alerts`), above every tab: one
line each, pages in red and tickets in amber, what fired, on what, since when and why. Read on
sign-in and every live tick; nothing shows while none fires."""

from __future__ import annotations

from dash import Input, Output, State, html, no_update

from .common import fmt_t


def section() -> html.Div:
    return html.Div(id="alerts", className="mb-2")


def alert_rows(alerts: list[dict]) -> list:
    """One line per firing alert (``alert-<name>`` its class, for a person's stylesheet and the tests)."""
    out = []
    for a in alerts:
        page = a.get("severity") == "page"
        since = a.get("since_s")
        out.append(html.Div([
            html.Strong(("PAGE " if page else "ticket ") + str(a.get("alert")), className="me-2"),
            html.Span(str(a.get("target")), className="me-2 font-monospace"),
            html.Span(f"since {fmt_t(since)} UTC " if isinstance(since, (int, float)) else "", className="me-1"),
            html.Span(str(a.get("summary", ""))),
        ], className=f"alert {'alert-danger' if page else 'alert-warning'} py-1 px-2 mb-1 small alert-{a.get('alert')}"))
    return out


def register(app, client, sessions) -> None:
    from .client import ApiError, Unavailable

    @app.callback(Output("alerts", "children"), Input("tick-go", "data"), Input("sid", "data"),
                  State("alerts", "children"), prevent_initial_call=True)
    def show(_n, sid, shown):
        s = sessions.get(sid)
        if s is None:
            return no_update
        try:
            alerts = client.get("/alerts", s.token)
        except (ApiError, Unavailable):
            return no_update  # the control plane's own banner says why
        rows = alert_rows(alerts)
        return rows if rows or shown else no_update
