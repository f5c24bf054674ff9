"""The gateway's HTTP app (`create_app`): ``POST /v1/recommend`` on a direct ASGI path
(`GatewayApp`), the rest (``GET /v1/router``, ``POST /v1/router/weights``, ``GET /v1/clients``,
``GET /healthz``, ``GET /metrics``, the lifespan that starts and stops the gateway) on FastAPI."""

from __future__ import annotations

import contextlib
import json
import time
from typing import TYPE_CHECKING, Annotated

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from common.http_server import (AllowedMethods, BodyLimit, BodyTooLarge, JsonOnly, finite_validation_errors,
                                json_content_type, may_have_body, read_body, send_json, send_json_bytes,
                                unsupported_media_type)
from common.secrets_args import bearer_ok

from .client_view import PHASE_HEADER, clean_phase

if TYPE_CHECKING:
    from .gateway import Gateway


class GatewayApp:
    """The ASGI app: ``POST /v1/recommend`` handled directly (no framework layers on the request
    path: it reads the body, at most ``max_body_bytes``, calls `Gateway.recommend`, sends the
    answer), everything else (including the lifespan) by the FastAPI app ``fastapi``, behind
    the same body cap (`BodyLimit`)."""

    def __init__(self, gateway: Gateway, fastapi_app: FastAPI) -> None:
        self.gateway = gateway
        self.max_body_bytes = gateway.config.max_body_bytes
        # behind the cap: a JSON-only weights push, and 405 / OPTIONS naming every allowed method
        self.fastapi = AllowedMethods(JsonOnly(BodyLimit(fastapi_app, self.max_body_bytes, error_field="error"),
                                               {"/v1/router/weights"}), fastapi_app.router.routes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/recommend" and scope["method"] == "POST":
            t0 = time.perf_counter()
            phase = None
            explain = ""
            for name, value in scope.get("headers", ()):
                if name == _PHASE_HEADER_B:
                    phase = clean_phase(value)
                elif name == _EXPLAIN_HEADER_B:
                    explain = _explain_level(value.decode("latin-1"))
            if not json_content_type(scope):  # refused here, never forwarded for the node to refuse
                self.gateway.metrics.requests.labels("none", "bad_request", "none").inc()
                self.gateway.client_view.record(415, time.perf_counter() - t0, phase=phase)
                await send_json(send, 415, {"error": f"gateway: {unsupported_media_type(scope)}"},
                                close=may_have_body(scope))
                return
            try:
                body = await read_body(receive, self.max_body_bytes, scope)
            except BodyTooLarge as e:
                self.gateway.metrics.requests.labels("none", "too_large", "none").inc()
                self.gateway.client_view.record(413, time.perf_counter() - t0, phase=phase)
                await send_json(send, 413, {"error": f"gateway: {e} (its --max-body-bytes)"}, close=True)
                return
            if body is None:  # the client went away
                return
            status, content, headers = await self.gateway.serve(body, phase, t0, explain)
            await send_json_bytes(send, status, content, headers)
            return
        await self.fastapi(scope, receive, send)


_PHASE_HEADER_B = PHASE_HEADER.encode()
#: ``x-racer-explain: reason`` on ``POST /v1/recommend``: the answer's ``routing`` carries the
#: decision's one-line reason; ``scores``: the reason and the per-node score terms
#: (`RoutingDecision.breakdown`); anything else: neither
EXPLAIN_HEADER = "x-racer-explain"
_EXPLAIN_HEADER_B = EXPLAIN_HEADER.encode()


def _explain_level(value: str | None) -> str:
    v = (value or "").strip().lower()
    return v if v in ("reason", "scores") else ""


class GatewayError(BaseModel):
    """The body of the gateway's own error answers (a node's error answer is passed on as the node
    sent it, which has the same ``error`` field)."""
    error: str


def _errors(descriptions: dict[int, str]) -> dict:
    return {c: {"model": GatewayError, "description": d} for c, d in descriptions.items()}


def create_app(gateway: Gateway) -> GatewayApp:
    """The gateway's ASGI app; its lifespan starts and stops the gateway's loops and client."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="RACER gateway", version="1", lifespan=lifespan)
    finite_validation_errors(app)  # a rejected NaN/Infinity gets its 422, not a 500

    @app.post("/v1/recommend", responses=_errors({
        413: "request body over --max-body-bytes (not forwarded)",
        415: "the body is not announced as JSON (not forwarded)",
        422: "invalid request body (the field is named in `error`)", 502: "the node failed twice",
        503: "no live node", 504: "the node did not answer in time"}))
    async def recommend(request: Request):
        status, content, headers = await gateway.serve(
            await request.body(), clean_phase(request.headers.get(PHASE_HEADER)),
            explain=_explain_level(request.headers.get(EXPLAIN_HEADER)))
        return Response(content, status_code=status, headers=headers, media_type="application/json")

    @app.get("/v1/router", responses=_errors({401: "the gateway has a fleet token and the request does not carry "
                                                   "it (the view names node addresses and where a user's cache is)"}))
    async def router_state(request: Request, user: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None):
        if not bearer_ok(request.headers.get("authorization"), gateway.fleet_token):
            return JSONResponse(status_code=401, headers={"www-authenticate": "Bearer"}, content={
                "error": "this view needs the fleet token (Authorization: Bearer <RACER_FLEET_TOKEN>)"})
        return gateway.describe(user)

    @app.post("/v1/router/weights", responses={
        **_errors({401: "missing or wrong bearer token", 403: "weight pushes are disabled on this gateway",
                   413: "body over --max-body-bytes",
                   422: "invalid weights document (the field is named in `error`)"}),
        409: {"description": "not applied: the version is older than the gateway's", "content": {
            "application/json": {"schema": {"type": "object", "properties": {"applied": {"type": "boolean"}}}}}}})
    async def push_weights(request: Request):
        if not gateway.push_token:
            return JSONResponse(status_code=403, content={
                "error": "weight pushes are disabled: the gateway has no push token (--push-token-file without a "
                         "control plane; with one, --advertise-url and a registration the control plane answered)"})
        if not bearer_ok(request.headers.get("authorization"), gateway.push_token):
            return JSONResponse(status_code=401, content={"error": "missing or wrong bearer token"})
        try:
            payload = json.loads(await request.body())
            result = gateway.apply_weights(payload)
        except ValueError as e:
            return JSONResponse(status_code=422, content={"error": str(e)[:1000]})
        except RecursionError:
            return JSONResponse(status_code=422, content={"error": "body: JSON nested too deeply"})
        return JSONResponse(status_code=200 if result["applied"] or result.get("current") else 409, content=result)

    @app.get("/v1/clients")
    async def clients():
        return gateway.describe_clients()

    @app.get("/healthz")
    async def healthz():
        live = sum(l.live for l in gateway.links)
        return JSONResponse(status_code=200 if live else 503, content={
            "status": "ok" if live else "no_live_node", "num_nodes": len(gateway.links), "num_live_nodes": live})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def metrics():
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return GatewayApp(gateway, app)
