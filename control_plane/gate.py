"""The control plane's front door: a request's token is checked, and its body capped, before any
route reads a byte of the body.

FastAPI reads and validates a route's body before it resolves the route's dependencies, so an
auth dependency alone lets a client with no token make the server buffer and parse any body
(and answers a malformed one 422 instead of 401). `RequestGate` is an ASGI middleware in front
of the routes; for each HTTP request it:

1. finds the API route (under ``/api/v1``) the request will reach, as the router finds it: of
   the app's routes in order (`fastapi.routing.iter_route_contexts`: an included router's
   routes with their full paths), the first whose Starlette ``matches`` answers ``Match.FULL``
   for the request's method and path. Its roles are the ``x-racer-roles`` it declares
   (`routes.deps.roles`), its path parameters those of that match;
2. checks the bearer token: 401 when it is missing, unknown or revoked; 403 when its role may
   not call the route, or when a node token calls a node route (``/api/v1/nodes/...``) for
   another node id or is bound to none (`control_plane.auth.node_route_refusal`). These answers
   carry ``Connection: close`` when a body was announced: the body is never read (503 when the
   token cannot be looked up: the database is unreachable);
3. caps the body (`body_caps`): a Content-Length over the cap gets 413 before reading, a chunked
   body 413 as soon as the bytes received pass it (`common.http_server.read_body`, the same
   reader the node agent and the gateway use);
4. hands the route the body it read and the principal it checked (``request.state``).

A path no route matches (404, 405) is passed on unauthenticated, its body capped at
``max_body_bytes``.
"""

from __future__ import annotations

from fastapi.routing import iter_route_contexts
from starlette.routing import Match

from common.contract import API
from common.http_server import BodyTooLarge, may_have_body, read_body, replay_body, send_json

from .auth import MISSING_TOKEN, PRINCIPAL_STATE, UNKNOWN_TOKEN, bearer_secret, node_route_refusal, role_refusal
from .settings import Settings


def body_caps(settings: Settings) -> dict[str, tuple[int, str]]:
    """Route path -> (most body bytes it takes, the setting that says so); every other request:
    ``max_body_bytes``."""
    return {f"{API}/nodes/{{node_id}}/reports": (settings.max_report_body_bytes, "max_report_body_bytes"),
            f"{API}/policies": (settings.max_policy_body_bytes, "max_policy_body_bytes"),
            f"{API}/models": (settings.max_policy_body_bytes, "max_policy_body_bytes"),
            f"{API}/gateways/{{gateway_id}}/samples": (settings.max_sample_body_bytes, "max_sample_body_bytes")}


class _RouteRule:
    __slots__ = ("path", "matches", "roles", "cap", "cap_name", "node_route")

    def __init__(self, route, roles: tuple[str, ...], cap: int, cap_name: str) -> None:
        self.path = route.path_format
        self.matches = route.matches  # Starlette's: (Match, child scope with the path parameters)
        self.roles, self.cap, self.cap_name = roles, cap, cap_name
        # the routes a node calls as itself: a node token must be bound, to the id in the path
        self.node_route = self.path.startswith(f"{API}/nodes/") and "node" in roles


class RequestGate:
    """ASGI middleware (see the module docstring). ``routes``: the app's routes (``app.router.routes``,
    read at the first request, so routes included after the gate is built count); ``state``: the
    app's state (its ``tokens`` cache); ``settings``: the body caps."""

    def __init__(self, app, routes, state, settings: Settings) -> None:
        self.app = app
        self.routes = routes
        self.state = state
        self.settings = settings
        self._rules: dict[str, list[_RouteRule]] | None = None

    def rules(self) -> dict[str, list[_RouteRule]]:
        """Method -> the API's routes taking it, in the router's order."""
        if self._rules is None:  # the routes exist once the app is built, before it serves
            caps = body_caps(self.settings)
            default = (self.settings.max_body_bytes, "max_body_bytes")
            rules: dict[str, list[_RouteRule]] = {}
            for route in iter_route_contexts(self.routes):
                path = route.path_format or ""
                if not path.startswith(API + "/"):
                    continue
                roles = tuple((getattr(route, "openapi_extra", None) or {}).get("x-racer-roles") or ())
                rule = _RouteRule(route, roles, *caps.get(path, default))
                for method in route.methods or ():
                    rules.setdefault(method, []).append(rule)
            self._rules = rules
        return self._rules

    def match(self, scope) -> tuple[_RouteRule, dict] | None:
        """The rule of the route the router will hand ``scope`` to, with its path parameters
        (None: no route takes this method at this path)."""
        for rule in self.rules().get(scope["method"], ()):
            m, child = rule.matches(scope)
            if m == Match.FULL:
                return rule, child.get("path_params", {})
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap, cap_name = self.settings.max_body_bytes, "max_body_bytes"
        hit = self.match(scope)
        if hit is not None:
            rule, params = hit
            cap, cap_name = rule.cap, rule.cap_name
            if rule.roles:
                close = may_have_body(scope)
                secret = None
                for name, value in scope.get("headers", ()):
                    if name == b"authorization":
                        secret = bearer_secret(value.decode("latin-1"))
                        break
                if secret is None:
                    await send_json(send, 401, {"detail": MISSING_TOKEN}, close=close,
                                    headers=((b"www-authenticate", b"Bearer"),))
                    return
                try:
                    p = await self.state.tokens.principal(secret)
                except Exception as e:  # noqa: BLE001 - the database is unreachable: the client retries
                    await send_json(send, 503, {"detail": f"database unavailable, retry later: {type(e).__name__}: "
                                                          f"{str(e)[:300]}"}, close=close)
                    return
                if p is None:
                    await send_json(send, 401, {"detail": UNKNOWN_TOKEN}, close=close,
                                    headers=((b"www-authenticate", b"Bearer"),))
                    return
                why = role_refusal(p, rule.roles) or (
                    node_route_refusal(p, params.get("node_id")) if rule.node_route else None)
                if why:
                    await send_json(send, 403, {"detail": why}, close=close)
                    return
                scope.setdefault("state", {})[PRINCIPAL_STATE] = p
        try:
            body = await read_body(receive, cap, scope)
        except BodyTooLarge as e:
            await send_json(send, 413, {"detail": f"body: {e} (the control plane's {cap_name}, "
                                                  f"RACER_{cap_name.upper()})"}, close=True)
            return
        if body is None:  # the client went away
            return
        await self.app(scope, replay_body(body, receive), send)
