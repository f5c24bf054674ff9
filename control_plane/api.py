"""The control plane's HTTP API (FastAPI; base path ``/api/v1``; OpenAPI at ``/docs``).

`create_app` builds the app: the settings and the state the routes reach through
``request.app.state`` (session factory, clock, token cache, ingest writer, metrics, scheduler),
the middleware, the routers (`control_plane.routes`, one module per resource) and the exception
handlers. Routes own their transactions (``with begin(request) as s``) and call `db.queries`
functions, which never commit; inputs are pydantic models that forbid unknown fields, so a bad
payload gets a 4xx whose message names the field and nothing is stored. Every route declares the
roles it accepts in its OpenAPI operation (``x-racer-roles``); docs/control_plane.md lists them
all. Report ingestion goes through the group-commit writer (`control_plane.ingest`).

Every request passes `control_plane.gate.RequestGate` first: the token is checked (role, and a
node token's node id on the node routes) and the body capped before a route reads it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from common.contract import API, ReportBatchIn
from common.http_server import AllowedMethods, finite_validation_errors
from db.engine import make_engine, session_factory, upgrade

from .auth import TokenCache, ensure_admin_token
from .cp_metrics import ControlPlaneMetrics
from .gate import RequestGate
from .ingest import IngestWriter
from .jobs import Scheduling, secret_key_of
from .quota import NodeQuota
from .rollout_service import Conflict, NotFound
from .routes import (audit, directives, gateways, health, history, models, nodes, overrides, policies, rollouts,
                     routers, tokens, whatif)
from .routes.deps import errors
from .routes.report_ingest import IngestFastPath, IngestNative
from .settings import Settings

log = logging.getLogger("racer.control_plane")

#: the API's routers, in the order their operations appear (and the gate matches them)
API_ROUTERS = (tokens, nodes, directives, history, routers, overrides, audit, policies, models, rollouts,
               gateways, whatif)


def _open_database(app: FastAPI, *, background_checkpoint: bool, who: str):
    """The database (migrated), its session factory and the metrics, in ``app.state``; says once
    when weight pushes are off for want of a secret key (made now beside a SQLite file)."""
    settings = app.state.settings
    engine = make_engine(settings.database_url, background_checkpoint=background_checkpoint)
    upgrade(engine)
    factory = session_factory(engine)
    metrics = ControlPlaneMetrics()
    app.state.engine, app.state.factory, app.state.metrics = engine, factory, metrics
    if secret_key_of(settings, factory) is None:
        print(f"{who}: no secret key (RACER_SECRET_KEY or --secret-key-file): weight pushes are off, gateways "
              "pull the weights", flush=True)
    return engine, factory, metrics


def _scheduling(app: FastAPI, suffix: str = "") -> Scheduling:
    """This process's instance name and its part in the scheduler election (not started), in
    ``app.state``."""
    st = app.state
    st.instance = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}{suffix}"
    st.scheduling = Scheduling(st.engine, st.factory, st.settings, st.metrics, st.instance, clock=st.clock)
    return st.scheduling


@asynccontextmanager
async def lifespan(app: FastAPI):
    """Open the database (migrated), build the state the routes use, start the scheduler (when
    ``settings.scheduler``); on the way out stop it, drain the ingest writer, close the engine."""
    settings, clock = app.state.settings, app.state.clock
    engine, factory, metrics = _open_database(app, background_checkpoint=True, who="racer control plane")
    app.state.tokens = TokenCache(factory, refresh_s=settings.token_refresh_s)
    app.state.tokens.start()
    app.state.known_nodes = set()
    app.state.reports_dropped = {}  # node_id -> (seq, num_reports_dropped, rose_at_s) of its latest report saying
    app.state.writer = IngestWriter(factory, metrics, settings.ingest_max_rows, settings.ingest_linger_s)
    app.state.quota = NodeQuota(settings.node_reports_per_s, settings.node_burst_reports,
                                settings.node_report_bytes_per_s, settings.node_burst_report_bytes)
    secret = ensure_admin_token(factory, admin_token=settings.admin_token, now_s=clock())
    if secret is not None:
        print(f"racer control plane: admin operator token (shown once): {secret}", flush=True)
    scheduling = _scheduling(app)
    if settings.scheduler:
        scheduling.start()
    try:
        yield
    finally:
        scheduling.stop()
        app.state.tokens.stop()
        app.state.writer.close()
        engine.dispose()


@asynccontextmanager
async def jobs_lifespan(app: FastAPI):
    """A ``--jobs-only`` process (``settings.serve_api`` False): the database (migrated), the
    metrics and the election with its scheduler; no ingestion writer, token cache or admin token."""
    engine, _, _ = _open_database(app, background_checkpoint=False, who="racer control plane (jobs)")
    scheduling = _scheduling(app, ":jobs")
    scheduling.start()
    try:
        yield
    finally:
        scheduling.stop()
        engine.dispose()


async def _conflict(_req, e: Conflict):
    return JSONResponse({"detail": str(e)}, status_code=409)


async def _notfound(_req, e: NotFound):
    return JSONResponse({"detail": str(e)}, status_code=404)


def openapi_document(app: FastAPI) -> dict:
    """The app's OpenAPI document (built once), with the schema of the report batch, whose route
    reads its body itself (`routes.nodes.reports`)."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        comps = spec.setdefault("components", {}).setdefault("schemas", {})
        extra = ReportBatchIn.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(extra.pop("$defs", {}))
        comps["ReportBatchIn"] = extra
        app.openapi_schema = spec
    return app.openapi_schema


class ControlPlaneApp(FastAPI):
    """FastAPI whose HTTP requests pass `RequestGate` and `IngestFastPath` (``front``) before the
    framework's own stack (its error handler, telemetry and body-limit wrappers, the routes): the
    gate sees every request first, and a report batch is stored without a frame of that stack."""

    front = None  # set by `create_app`

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.front is not None:
            await self.front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def framework(self, scope, receive, send) -> None:
        """The framework's stack (what ``front`` hands a request on to)."""
        await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None, *, clock=time.time) -> FastAPI:
    settings = settings or Settings.from_env()
    if not settings.serve_api:
        return jobs_app(settings, clock=clock)
    app = ControlPlaneApp(title="RACER control plane", version="1", lifespan=lifespan,
                  description="Node registration, reports, directives, router weights, overrides, policy "
                              "registry and rollouts, audit log. See docs/control_plane.md.")
    app.state.settings, app.state.clock = settings, clock
    finite_validation_errors(app)  # a rejected NaN/Infinity gets its 422, not a 500
    app.add_exception_handler(Conflict, _conflict)
    app.add_exception_handler(NotFound, _notfound)
    api = APIRouter(prefix=API, responses=errors(401, 403, 413, 422))  # every route: auth, size and input errors
    for module in API_ROUTERS:
        api.include_router(module.router)
    app.include_router(api)
    app.add_middleware(AllowedMethods, routes=app.router.routes, error_field="detail")  # 405 / OPTIONS: full Allow
    # in front of everything: the gate checks the token and caps the body before the ingestion
    # fast path or any route reads it
    app.front = RequestGate(IngestFastPath(app.framework, state=app.state), routes=app.router.routes,
                            state=app.state, settings=settings)
    # report batches of known nodes with cached tokens: answered in the HTTP protocol (serve_forever)
    app.native = IngestNative(app.state, settings.max_report_body_bytes)
    app.openapi = lambda: openapi_document(app)
    app.include_router(health.router)
    return app


def jobs_app(settings: Settings, *, clock=time.time) -> FastAPI:
    """The app of a ``--jobs-only`` process: ``/healthz`` (whether it leads) and ``/metrics`` (the
    jobs' runs and durations); every other path is 404."""
    app = FastAPI(title="RACER control plane (jobs)", version="1", lifespan=jobs_lifespan, openapi_url=None,
                  docs_url=None, redoc_url=None)
    app.state.settings, app.state.clock = settings, clock
    app.include_router(health.router)
    return app


def asgi_app(settings: Settings | None = None, *, clock=time.time) -> FastAPI:
    """The app to serve (`create_app`: the gate and the ingestion fast path are in its middleware)."""
    return create_app(settings, clock=clock)
