"""Sign-in: the user pastes a control-plane token; the dashboard checks it (``/auth/whoami``) and
keeps it **server side** in `SessionStore`; the browser holds only a random session id (the
``sid`` store). The token never goes into a URL or a log. On sign-in the pages (tabs) are sent
to the browser (`auth_ui`): a page that has not signed in draws no chart or grid."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field

import dash_bootstrap_components as dbc
from dash import Input, Output, State, html, no_update

from .client import ApiError, Unavailable


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


def login_card() -> dbc.Card:
    return dbc.Card(dbc.CardBody([
        html.H5("Sign in"),
        html.P("Paste a control-plane token (operator or viewer). It stays on the dashboard server; "
               "the browser keeps only a session id.", className="small text-muted"),
        dbc.InputGroup([dbc.Input(id="login-token", type="password", placeholder="token", autoComplete="off"),
                        dbc.Button("Sign in", id="btn-login", color="primary")]),
        html.Div(id="login-error", className="text-danger small mt-2"),
    ]), id="login-card", className="my-3", style={"maxWidth": "560px"})


LOGIN_OUTPUTS = {"sid": Output("sid", "data"), "error": Output("login-error", "children"),
                 "token_field": Output("login-token", "value")}
UI_OUTPUTS = {"login_style": Output("login-card", "style"), "main_style": Output("main", "style"),
              "who": Output("who", "children"), "logout_style": Output("btn-logout", "style"),
              "tick_disabled": Output("tick", "disabled"), "body": Output("main-body", "children"),
              "role_note": Output("role-note-policies", "children")}


def register(app, client, sessions: SessionStore, build_tabs) -> None:
    """Sign in, sign out, and the page's look for the session (``build_tabs(viewer)``: the pages)."""

    @app.callback(output=LOGIN_OUTPUTS, inputs=dict(_n=Input("btn-login", "n_clicks"),
                                                   _s=Input("login-token", "n_submit")),
                  state=dict(token=State("login-token", "value")), prevent_initial_call=True)
    def login(_n, _s, token):
        def refused(why: str) -> dict:
            return {"sid": no_update, "error": why, "token_field": ""}

        token = (token or "").strip()
        if not token:
            return refused("enter a token")
        try:
            who = client.whoami(token)
        except ApiError as e:
            return refused("token not accepted" if e.status in (401, 403) else e.message)
        except Unavailable as e:
            return refused(str(e))
        if who.get("role") not in ("operator", "viewer"):
            return refused(f"a {who.get('role')} token cannot sign in to the dashboard")
        sid = sessions.add(Session(token, str(who.get("name")), str(who.get("role"))))
        return {"sid": sid, "error": "", "token_field": ""}

    @app.callback(Output("sid", "data", allow_duplicate=True), Input("btn-logout", "n_clicks"),
                  State("sid", "data"), prevent_initial_call=True)
    def logout(_n, sid):
        sessions.drop(sid)
        return None

    @app.callback(output=UI_OUTPUTS, inputs=dict(sid=Input("sid", "data")))
    def auth_ui(sid):
        s = sessions.get(sid)
        if s is None:
            return {"login_style": {"maxWidth": "560px"}, "main_style": {"display": "none"}, "who": "",
                    "logout_style": {"display": "none"}, "tick_disabled": True, "body": [], "role_note": None}
        viewer = s.role != "operator"
        note = None
        if viewer:
            note = dbc.Alert("Viewer: read-only. Override and rollout controls are disabled.",
                             color="secondary", className="py-1 small", id="viewer-banner")
        return {"login_style": {"display": "none"}, "main_style": {"display": "block"},
                "who": f"{s.name} ({s.role})", "logout_style": {"display": "inline-block"},
                "tick_disabled": False, "body": build_tabs(viewer), "role_note": note}
