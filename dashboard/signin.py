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
    last_used_s: float = 0.0


class SessionStore:
    """Server-side sign-ins: random session id -> `Session` (token, name, role). In memory.

    Bounded so one token cannot push the others' sessions out: at most ``max_per_token``
    sessions per token (a new sign-in with the same token drops that token's oldest), at most
    ``max_sessions`` in all (then the oldest session of the token holding the most goes). A
    session ends after ``idle_s`` unused or ``max_age_s`` in all (sign in again)."""

    def __init__(self, max_sessions: int = 1000, max_per_token: int = 16, idle_s: float = 12 * 3600,
                 max_age_s: float = 7 * 86400, clock=time.time):
        self._by_id: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.max_sessions, self.max_per_token = max_sessions, max_per_token
        self.idle_s, self.max_age_s, self.clock = idle_s, max_age_s, clock

    def add(self, session: Session) -> str:
        sid = secrets.token_urlsafe(24)
        now = self.clock()
        session.created_s = session.last_used_s = now
        with self._lock:
            self._expire(now)
            same = [k for k, v in self._by_id.items() if v.token == session.token]
            if len(same) >= self.max_per_token:
                del self._by_id[min(same, key=lambda k: self._by_id[k].created_s)]
            if len(self._by_id) >= self.max_sessions:
                counts: dict[str, int] = {}
                for v in self._by_id.values():
                    counts[v.token] = counts.get(v.token, 0) + 1
                top = max(counts, key=counts.get)
                del self._by_id[min((k for k, v in self._by_id.items() if v.token == top),
                                    key=lambda k: self._by_id[k].created_s)]
            self._by_id[sid] = session
        return sid

    def _expire(self, now: float) -> None:
        for k in [k for k, v in self._by_id.items()
                  if now - v.last_used_s > self.idle_s or now - v.created_s > self.max_age_s]:
            del self._by_id[k]

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        now = self.clock()
        with self._lock:
            s = self._by_id.get(sid)
            if s is None:
                return None
            if now - s.last_used_s > self.idle_s or now - s.created_s > self.max_age_s:
                del self._by_id[sid]
                return None
            s.last_used_s = now
            return s

    def drop(self, sid: str | None) -> None:
        with self._lock:
            self._by_id.pop(sid or "", None)

    def __len__(self) -> int:
        return len(self._by_id)


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
