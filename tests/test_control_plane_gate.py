"""`control_plane.gate.RequestGate` in process, in front of a small FastAPI app whose routes
declare their roles only as the gate reads them (``x-racer-roles``, no dependency of their own):
what the gate lets through is what reaches a route. The route a request gets is the one the
router dispatches it to (Starlette's matching over the included routers, in order), so a route
declared later, or left out of the OpenAPI document, is gated by its own roles; a refused token
is answered before the body is read; each route's body cap applies."""

from __future__ import annotations

import pytest
from fastapi import APIRouter, FastAPI, Request
from fastapi.testclient import TestClient

from control_plane.auth import PRINCIPAL_STATE, Principal
from control_plane.gate import RequestGate
from control_plane.settings import Settings

API = "/api/v1"
TOKENS = {"op": Principal(1, "op", "operator"), "view": Principal(2, "view", "viewer"),
          "n1": Principal(3, "n1", "node", node_id="n1")}


class _Tokens:
    """The app state's token cache: a dict, or a database that cannot be reached."""

    def __init__(self) -> None:
        self.down = False

    async def principal(self, secret: str) -> Principal | None:
        if self.down:
            raise ConnectionError("connection refused")
        return TOKENS.get(secret)


def _roles(*r: str) -> dict:
    return {"openapi_extra": {"x-racer-roles": list(r)}}


@pytest.fixture()
def gate():
    """(client, calls): ``calls`` lists (route, principal name, body length) of each route reached."""
    calls: list[tuple[str, str | None, int]] = []
    things, nodes = APIRouter(), APIRouter()

    async def reached(name: str, request: Request) -> dict:
        p = request.scope.get("state", {}).get(PRINCIPAL_STATE)
        calls.append((name, p.name if p else None, len(await request.body())))
        return {"route": name}

    # the OpenAPI document groups operations by path, so it lists POST /things/{thing_id} (first
    # declared for GET) before POST /things/special; the router tries routes in their order
    @things.get("/things/{thing_id}", **_roles("viewer"))
    async def get_thing(thing_id: str, request: Request):
        return await reached("get_thing", request)

    @things.post("/things/special", **_roles("operator"))
    async def special(request: Request):
        return await reached("special", request)

    @things.post("/things/{thing_id}", **_roles("viewer"))
    async def post_thing(thing_id: str, request: Request):
        return await reached("post_thing", request)

    @things.post("/hidden", include_in_schema=False, **_roles("operator"))
    async def hidden(request: Request):
        return await reached("hidden", request)

    @things.post("/policies", **_roles("operator"))
    async def policies(request: Request):
        return await reached("policies", request)

    @nodes.post("/nodes/{node_id}/reports", **_roles("node"))
    async def reports(node_id: str, request: Request):
        return await reached("reports", request)

    @things.post("/open")
    async def open_route(request: Request):  # declares no roles: no token needed
        return await reached("open", request)

    app = FastAPI()
    api = APIRouter(prefix=API)
    api.include_router(things)
    api.include_router(nodes)
    app.include_router(api)

    @app.post("/outside")
    async def outside(request: Request):
        return await reached("outside", request)

    tokens = _Tokens()
    app.state.tokens = tokens
    settings = Settings(max_body_bytes=2048, max_policy_body_bytes=8192, max_report_body_bytes=4096)
    front = RequestGate(app, routes=app.router.routes, state=app.state, settings=settings)
    with TestClient(front) as c:
        yield c, calls, tokens


def _auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_the_route_is_the_one_the_router_dispatches_to(gate):
    c, calls, _ = gate
    paths = list(c.app.app.openapi()["paths"])
    assert paths.index(f"{API}/things/{{thing_id}}") < paths.index(f"{API}/things/special")
    r = c.post(f"{API}/things/special", headers=_auth("view"), content=b"x" * 100)
    assert r.status_code == 403 and r.json() == {"detail": "role 'viewer' may not do this (needs operator)"}
    assert r.headers["connection"] == "close" and calls == []  # refused before its body was read
    assert c.post(f"{API}/things/special", headers=_auth("op")).json() == {"route": "special"}
    assert c.post(f"{API}/things/other", headers=_auth("view")).json() == {"route": "post_thing"}
    assert [x[:2] for x in calls] == [("special", "op"), ("post_thing", "view")]


def test_a_route_left_out_of_the_document_is_gated_by_its_roles(gate):
    c, calls, _ = gate
    assert f"{API}/hidden" not in c.app.app.openapi()["paths"]
    r = c.post(f"{API}/hidden", content=b"{}")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert c.post(f"{API}/hidden", headers=_auth("view")).status_code == 403
    assert c.post(f"{API}/hidden", headers=_auth("op")).json() == {"route": "hidden"}
    assert [x[:2] for x in calls] == [("hidden", "op")]


def test_missing_unknown_and_unreachable_tokens(gate):
    c, calls, tokens = gate
    r = c.get(f"{API}/things/t1")
    assert (r.status_code, r.json()["detail"]) == (401, "missing bearer token (Authorization: Bearer <token>)")
    assert "connection" not in r.headers  # no body was announced: the connection stays
    r = c.get(f"{API}/things/t1", headers=_auth("stolen"))
    assert (r.status_code, r.json()["detail"], r.headers["www-authenticate"]) == (401, "unknown or revoked token",
                                                                                  "Bearer")
    tokens.down = True
    r = c.post(f"{API}/things/t1", headers=_auth("view"), content=b"{}")
    assert r.status_code == 503 and r.json()["detail"].startswith("database unavailable, retry later: ConnectionError")
    assert r.headers["connection"] == "close"
    # a route that declares no roles, or a path outside the API, needs no token (nor the database)
    assert c.post(f"{API}/open").json() == {"route": "open"}
    assert c.post("/outside").json() == {"route": "outside"}
    assert [x[:2] for x in calls] == [("open", None), ("outside", None)]


def test_a_node_token_acts_as_the_node_in_the_matched_path_only(gate):
    c, calls, _ = gate
    r = c.post(f"{API}/nodes/n2/reports", headers=_auth("n1"), content=b"{}")
    assert r.status_code == 403 and "bound to node 'n1'" in r.json()["detail"] and "'n2'" in r.json()["detail"]
    assert c.post(f"{API}/nodes/n2/reports", headers=_auth("op")).status_code == 403  # an operator is no node
    assert c.post(f"{API}/nodes/n1/reports", headers=_auth("n1"), content=b"{}").json() == {"route": "reports"}
    assert calls == [("reports", "n1", 2)]


@pytest.mark.parametrize("path,token,cap,setting", [
    (f"{API}/policies", "op", 8192, "max_policy_body_bytes"),
    (f"{API}/nodes/n1/reports", "n1", 4096, "max_report_body_bytes"),
    (f"{API}/things/special", "op", 2048, "max_body_bytes"),
    (f"{API}/no-such-route", None, 2048, "max_body_bytes"),
])
def test_each_route_has_its_body_cap(gate, path, token, cap, setting):
    c, calls, _ = gate
    h = _auth(token) if token else {}
    r = c.post(path, headers=h, content=b"x" * (cap + 1))
    assert r.status_code == 413 and r.headers["connection"] == "close"
    assert f"exceeds {cap} bytes" in r.json()["detail"] and f"RACER_{setting.upper()}" in r.json()["detail"], r.text
    r = c.post(path, headers=h, content=b"x" * cap)
    assert r.status_code == (404 if token is None else 200), r.text
    assert calls == ([] if token is None else [(calls[0][0], token, cap)])
