"""The control plane's HTTP API (FastAPI; base path ``/api/v1``; OpenAPI at ``/docs``).

Routes own their transactions (``with factory.begin() as s``) and call `db.queries` functions,
which never commit; inputs are pydantic models that forbid unknown fields, so a bad payload gets
a 4xx whose message names the field and nothing is stored. Every route declares the roles it
accepts in its OpenAPI operation (``x-racer-roles``); docs/control_plane.md lists them all.
Report ingestion goes through the group-commit writer (`control_plane.ingest`).

Every request passes `control_plane.gate.RequestGate` first: the token is checked (role, and a
node token's node id on the node routes) and the body capped before a route reads it.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import tarfile
import zlib
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from sqlalchemy.exc import DataError, IntegrityError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from db import queries
from node_agent.server import AllowedMethods, finite_validation_errors, json_safe
from db.engine import make_engine, session_factory, upgrade
from db.models import Node, Override, Policy, Rollout, Router

from . import rollout_service
from .auth import (PRINCIPAL_STATE, Principal, Require, TokenCache, ensure_admin_token, new_secret,
                   node_route_refusal, role_refusal)
from .cp_metrics import ControlPlaneMetrics
from .gate import RequestGate
from .ingest import IngestWriter
from .jobs import Scheduling
from .rollout_service import Conflict, NotFound
from .schemas import (INT64_MAX, AuditPage, BurstOut, DecisionPage, DirectivesOut, ErrorOut, NodeId, NodeOut, OverrideDirective,
                      OverrideIn, OverrideOut, PolicyDirective, PolicyLoadedIn, PolicyOut, ReasonIn, RegisterIn,
                      RegisterOut, ReportBatchIn, ReportBatchOut, ReportOut, RolloutIn, RolloutOut, RouterIn,
                      RouterOut, RouterWeightsHistoryOut, RouterWeightsOut, SummaryOut, TokenIn, TokenOut, WhoAmIOut)
from .settings import Settings

log = logging.getLogger("racer.control_plane")

API = "/api/v1"
ARTIFACT_FILES = ("manifest.json", "policy.onnx", "golden.npz")

NODE, OPERATOR, VIEWER, ROUTER = "node", "operator", "viewer", "router"


def roles(*r: str) -> dict:
    """Dependencies and OpenAPI marker of a route that accepts roles ``r``."""
    return {"dependencies": [Depends(Require(*r))], "openapi_extra": {"x-racer-roles": list(r)}}


def principal(*r: str):
    return Annotated[Principal, Depends(Require(*r))]


ERROR_DESCRIPTIONS = {
    401: "missing, unknown or revoked token", 403: "the token's role may not do this",
    404: "the named object does not exist", 409: "conflicts with the object's current state",
    413: "body too large", 422: "invalid input: `detail` lists each refused field (`loc`) and why (`msg`)",
    503: "database unavailable; retry later"}


def errors(*codes: int) -> dict:
    """OpenAPI ``responses`` for error statuses ``codes``: all answer the one error model, `ErrorOut`."""
    return {c: {"model": ErrorOut, "description": ERROR_DESCRIPTIONS[c]} for c in codes}


def invalid(loc: list, msg: str) -> HTTPException:
    """A 422 in the shape of pydantic's validation errors, naming the refused field (``loc``)."""
    return HTTPException(422, [{"loc": list(loc), "msg": msg, "type": "value_error"}])


Id64 = Annotated[int, Path(ge=0, le=INT64_MAX, description="an id (0 <= id < 2^63)")]
Offset = Annotated[int, Query(ge=0, le=INT64_MAX)]


# ------------------------------------------------------------------------------------ artifacts
def pack_artifact(files: dict[str, bytes]) -> bytes:
    """The canonical tar of an artifact (sorted names, zero times and owners): same files, same bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(files[name]), 0, 0o644
            tar.addfile(info, io.BytesIO(files[name]))
    return buf.getvalue()


# An artifact is three small files (a few KB to a few MB): bounds on what an upload may unpack to,
# checked from the tar headers while streaming, before a member's bytes are decompressed.
MAX_ARTIFACT_MEMBERS = 64
MAX_ARTIFACT_UNPACKED_BYTES = 64 * 2**20


def unpack_artifact(data: bytes, *, max_members: int = MAX_ARTIFACT_MEMBERS,
                    max_bytes: int = MAX_ARTIFACT_UNPACKED_BYTES) -> dict[str, bytes]:
    """The artifact's three files from an uploaded tar (optionally gzip'd; a top directory is
    allowed). Raises ValueError saying what is wrong: not a tar, truncated, more than
    ``max_members`` members, or members whose sizes add up to more than ``max_bytes`` (a
    decompression bomb is refused from its headers, before its bytes are inflated)."""
    files: dict[str, bytes] = {}
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as tar:  # a stream: members in order, no seeking
            for k, m in enumerate(tar, start=1):
                if k > max_members:
                    raise ValueError(f"body: more than {max_members} members (an artifact has {len(ARTIFACT_FILES)})")
                total += max(0, int(m.size))
                if total > max_bytes:
                    raise ValueError(f"body: the archive unpacks to more than {max_bytes} bytes (an artifact is a few "
                                     f"MB at most)")
                base = os.path.basename(m.name.rstrip("/"))
                if base not in ARTIFACT_FILES:
                    continue
                if not m.isreg():
                    raise ValueError(f"body: {m.name} is not a regular file")
                if base in files:
                    raise ValueError(f"body: {base} appears twice")
                f = tar.extractfile(m)
                files[base] = f.read(m.size + 1) if f is not None else b""
                if len(files[base]) != m.size:
                    raise ValueError(f"body: {m.name} is truncated ({len(files[base])} of {m.size} bytes)")
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise ValueError(f"body: not a complete tar archive of a policy artifact ({type(e).__name__}: {e})") from None
    missing = [f for f in ARTIFACT_FILES if f not in files]
    if missing:
        raise ValueError(f"body: the artifact lacks {', '.join(missing)} (expected the files `racer policy export` "
                         f"writes: {', '.join(ARTIFACT_FILES)})")
    return files


def verify_files(files: dict[str, bytes]) -> dict:
    """Check an artifact as the node agent does before using it (manifest, sha256, onnx.checker,
    I/O names/shapes/types, golden parity, finite probe outputs); returns the manifest."""
    from node_agent.allocator import OnnxPolicy, PolicyLoadError

    with tempfile.TemporaryDirectory(prefix="racer-policy-") as d:
        for name, data in files.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        try:
            pol = OnnxPolicy(d, device="cpu")
        except PolicyLoadError as e:
            raise ValueError(str(e).replace(d, "<upload>")) from None
        return dict(pol.manifest)


# ----------------------------------------------------------------------------------------- app

# 404 messages of the rows a route looks up by key (one wording per kind of row)
_NOT_FOUND = {Node: "node_id {!r} is not registered", Router: "url {!r} is not a registered router",
              Override: "override_id {} does not exist", Policy: "policy version {!r} is not in the registry",
              Rollout: "rollout_id {} does not exist"}


def _get_or_404(s, model, key):
    """The row of ``model`` with primary key ``key``, or a 404 that names the key."""
    row = s.get(model, key)
    if row is None:
        raise HTTPException(404, _NOT_FOUND[model].format(key))
    return row

def create_app(settings: Settings | None = None, *, clock=time.time) -> FastAPI:
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = make_engine(settings.database_url, background_checkpoint=True)
        upgrade(engine)
        factory = session_factory(engine)
        metrics = ControlPlaneMetrics()
        app.state.engine, app.state.factory, app.state.metrics = engine, factory, metrics
        app.state.tokens = TokenCache(factory)
        app.state.known_nodes = set()
        app.state.reports_dropped = {}  # node_id -> (seq, num_reports_dropped) of its latest report saying
        app.state.writer = IngestWriter(factory, metrics, settings.ingest_max_rows)
        secret = ensure_admin_token(factory, admin_token=settings.admin_token, now_s=clock())
        if secret is not None:
            print(f"racer control plane: admin operator token (shown once): {secret}", flush=True)
        instance = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        app.state.instance = instance
        app.state.scheduling = Scheduling(engine, factory, settings, metrics, instance, clock=clock)
        if settings.scheduler:
            app.state.scheduling.start()
        try:
            yield
        finally:
            app.state.scheduling.stop()
            app.state.writer.close()
            engine.dispose()

    app = FastAPI(title="RACER control plane", version="1", lifespan=lifespan,
                  description="Node registration, reports, directives, router weights, overrides, policy "
                              "registry and rollouts, audit log. See docs/control_plane.md.")
    app.state.settings, app.state.clock = settings, clock
    finite_validation_errors(app)  # a rejected NaN/Infinity gets its 422, not a 500

    @app.exception_handler(Conflict)
    async def _conflict(_req, e: Conflict):
        return JSONResponse({"detail": str(e)}, status_code=409)

    @app.exception_handler(NotFound)
    async def _notfound(_req, e: NotFound):
        return JSONResponse({"detail": str(e)}, status_code=404)

    r = APIRouter(prefix=API, responses=errors(401, 403, 413, 422))  # every route: auth, size and input errors

    def begin(request: Request):
        return request.app.state.factory.begin()

    # ---- identity
    @r.get("/whoami", response_model=WhoAmIOut, **roles(NODE, OPERATOR, VIEWER, ROUTER))
    def whoami(p: principal(NODE, OPERATOR, VIEWER, ROUTER)):
        return WhoAmIOut(token_id=p.token_id, name=p.name, role=p.role, node_id=p.node_id)

    @r.post("/tokens", response_model=TokenOut, status_code=201, responses=errors(413), **roles(OPERATOR))
    def create_token(body: TokenIn, request: Request, p: principal(OPERATOR)):
        secret = new_secret()
        now = clock()
        with begin(request) as s:
            replaced = queries.revoke_node_tokens(s, body.node_id) if body.replace else []
            t = queries.add_token(s, name=body.name, role=body.role, secret=secret, now_s=now, node_id=body.node_id)
            queries.audit(s, ts_s=now, actor=p.name, action="token.create", target=f"token:{t.id}",
                          before={"revoked_token_ids": replaced} if replaced else None,
                          after={"name": body.name, "role": body.role, "node_id": body.node_id}, reason="")
            out = TokenOut(id=t.id, name=t.name, role=t.role, node_id=t.node_id, token=secret,
                           replaced_token_ids=replaced)
        if replaced:
            request.app.state.tokens.forget_node(body.node_id)
        return out

    # ---- nodes
    @r.post("/nodes/register", response_model=RegisterOut, responses=errors(413), **roles(NODE))
    def register(body: RegisterIn, request: Request, p: principal(NODE)):
        """Register (or re-register) the node the token is bound to. Another token may not take
        over a node id while the token that registered it is valid: retire the node (which
        revokes its tokens), or make its new token with ``replace``."""
        why = node_route_refusal(p, body.node_id)
        if why:
            raise HTTPException(403, why)
        now = clock()
        with begin(request) as s:
            old = s.get(Node, body.node_id)
            if (old is not None and old.token_id is not None and old.token_id != p.token_id
                    and queries.token_valid(s, old.token_id)):
                raise HTTPException(403, f"node {body.node_id!r} is registered by another token (id {old.token_id}, "
                                         f"still valid): this token (id {p.token_id}) may not register it again; "
                                         f"retire the node (POST {API}/nodes/{body.node_id}/retire) or create this "
                                         f"node's token with replace, which revokes the other")
            node, before = queries.upsert_node(s, node_id=body.node_id, address=body.address, device=body.device,
                                               cost_profile=body.cost_profile.model_dump(exclude_none=True),
                                               policy_version=body.policy_version, now_s=now,
                                               report_interval_s=settings.report_interval_s, token_id=p.token_id)
            if before is None or before["address"] != body.address or before["cost_profile"] != node.cost_profile:
                queries.audit(s, ts_s=now, actor=p.name, action="node.register", target=f"node:{body.node_id}",
                              before=before, after=body.model_dump(), reason="")
            last_seq = queries.highest_report_seq(s, body.node_id)
        request.app.state.known_nodes.add(body.node_id)
        return RegisterOut(node_id=body.node_id, report_interval_s=settings.report_interval_s, last_report_seq=last_seq)

    ingest_roles = {"openapi_extra": {"x-racer-roles": [NODE]}}  # checked by the gate (no dependency)
    ingest_roles["openapi_extra"]["requestBody"] = {
        "required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ReportBatchIn"}}}}

    @r.post("/nodes/{node_id}/reports", response_model=ReportBatchOut, responses=errors(404, 413, 503),
            **ingest_roles)
    async def reports(node_id: NodeId, request: Request):
        """Store a batch of reports (idempotent on (node_id, seq)). The body is parsed by pydantic-core
        straight from the bytes (the hot path: one request per node per interval; `IngestFastPath`
        serves the same function without FastAPI's routing and dependency machinery)."""
        status, body = await ingest_batch(request.app.state, node_id, await request.body(), clock,
                                          request.scope.get("state", {}).get(PRINCIPAL_STATE))
        return Response(body, status_code=status, media_type="application/json")

    @r.get("/nodes/{node_id}/directives", response_model=DirectivesOut, responses=errors(404), **roles(NODE))
    def directives(node_id: NodeId, request: Request):
        now = clock()
        with request.app.state.factory() as s:
            _get_or_404(s, Node, node_id)
            ovs = queries.active_overrides(s, node_id)
            ov = next((o for o in ovs if o.node_id == node_id), None) or next(
                (o for o in ovs if o.node_id is None), None)
            if ov is not None and ov.expires_at_s is not None and ov.expires_at_s <= now:
                ov = None  # past its expiry; the expiry job will mark it
            pol, rollout_id = rollout_service.policy_for_node(s, node_id)
            return DirectivesOut(
                node_id=node_id, now_s=now, report_interval_s=settings.report_interval_s,
                override=None if ov is None else OverrideDirective(
                    override_id=ov.id, emb_share=ov.emb_share, expires_at_s=ov.expires_at_s, reason=ov.reason,
                    scope="node" if ov.node_id else "cluster"),
                policy=None if pol is None else PolicyDirective(
                    version=pol.version, digest=pol.digest, rollout_id=rollout_id,
                    download_url=f"{API}/policies/{pol.version}/artifact"))

    @r.post("/nodes/{node_id}/policy", response_model=NodeOut, responses=errors(404, 409, 413), **roles(NODE))
    def policy_loaded(node_id: NodeId, body: PolicyLoadedIn, request: Request):
        now = clock()
        with begin(request) as s:
            node = _get_or_404(s, Node, node_id)
            rollout_service.node_confirmed(s, node, version=body.policy_version, status=body.status,
                                           error=body.error, now_s=now)
            return NodeOut.model_validate(node)

    @r.get("/nodes", response_model=list[NodeOut], **roles(OPERATOR, VIEWER, ROUTER))
    def nodes(request: Request, include_retired: Annotated[bool, Query(
            description="also the retired nodes (the gateway's list never has them)")] = False):
        with request.app.state.factory() as s:
            return [node_out(request.app.state, n) for n in queries.list_nodes(s, include_retired=include_retired)]

    @r.post("/nodes/{node_id}/retire", response_model=NodeOut, responses=errors(404, 409, 413), **roles(OPERATOR))
    def retire_node(node_id: NodeId, body: ReasonIn, request: Request, p: principal(OPERATOR)):
        """Drain and retire a node: it leaves the node list (gateways stop sending it requests at
        their next read of the list; those in flight finish) and the router weights, every token
        bound to it is revoked (its reports, directives and registration are refused from then
        on), its per-node overrides are cleared. Audited as ``node.retire``. Its history stays.
        A new token bound to its id brings it back by registering."""
        now = clock()
        with begin(request) as s:
            node = _get_or_404(s, Node, node_id)
            if node.status == "retired":
                raise HTTPException(409, f"node {node_id!r} is already retired")
            before = {"status": node.status, "address": node.address, "token_id": node.token_id}
            revoked = queries.revoke_node_tokens(s, node_id)
            cleared = [o for o in queries.active_overrides(s, node_id) if o.node_id == node_id]
            for o in cleared:
                o.state, o.ended_at_s = "cleared", now
            node.status = "retired"
            queries.audit(s, ts_s=now, actor=p.name, action="node.retire", target=f"node:{node_id}", before=before,
                          after={"status": "retired", "revoked_token_ids": revoked,
                                 "cleared_override_ids": [o.id for o in cleared]}, reason=body.reason)
            out = NodeOut.model_validate(node)
        request.app.state.tokens.forget_node(node_id)
        request.app.state.known_nodes.discard(node_id)
        return out

    @r.get("/nodes/{node_id}", response_model=NodeOut, responses=errors(404), **roles(OPERATOR, VIEWER))
    def node(node_id: NodeId, request: Request):
        with request.app.state.factory() as s:
            n = _get_or_404(s, Node, node_id)
            return node_out(request.app.state, n)

    # ---- history
    Range = dict(start_s=Query(None, description="from (Unix s, inclusive)"),
                 end_s=Query(None, description="to (Unix s, exclusive)"))

    @r.get("/reports", response_model=list[ReportOut], **roles(OPERATOR, VIEWER))
    def report_history(request: Request, node_id: str | None = None, start_s: float | None = Range["start_s"],
                       end_s: float | None = Range["end_s"],
                       step_s: Annotated[float | None, Query(ge=1e-3, le=1e9, description=(
                           "downsample: one row per node and bucket, throughput time-weighted, hit rates "
                           "request-weighted (s, 1 ms to 1e9)"))] = None,
                       limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
                       cluster: Annotated[bool, Query(description="one row per bucket for the whole cluster "
                                                                   "(node_id '*'; needs step_s)")] = False):
        if cluster and (step_s is None or node_id is not None):
            raise invalid(["query", "step_s" if step_s is None else "node_id"],
                          "cluster=true needs step_s and no node_id")
        with request.app.state.factory() as s:
            if cluster:
                return [ReportOut(**d) for d in queries.cluster_history(s, start_s=start_s, end_s=end_s, step_s=step_s,
                                                                        limit=limit)]
            return [ReportOut(**d) for d in queries.report_history(s, node_id=node_id, start_s=start_s, end_s=end_s,
                                                                   step_s=step_s, limit=limit)]

    @r.get("/decisions", response_model=DecisionPage, **roles(OPERATOR, VIEWER))
    def decisions(request: Request, node_id: str | None = None,
                  source: Annotated[str | None, Query(pattern="^(base|residual|recovery|override|guard)$")] = None,
                  q: Annotated[str | None, Query(max_length=200, description="text in the reason or node id")] = None,
                  start_s: float | None = None, end_s: float | None = None,
                  offset: Offset = 0, limit: Annotated[int, Query(ge=1, le=1000)] = 100):
        with request.app.state.factory() as s:
            total, rows = queries.decisions_page(s, node_id=node_id, source=source, q=q, start_s=start_s,
                                                 end_s=end_s, offset=offset, limit=limit)
            return DecisionPage(total=total, offset=offset, limit=limit, items=rows)

    @r.get("/bursts", response_model=list[BurstOut], **roles(OPERATOR, VIEWER))
    def bursts(request: Request, node_id: str | None = None, start_s: float | None = None,
               end_s: float | None = None, limit: Annotated[int, Query(ge=1, le=10_000)] = 1000):
        with request.app.state.factory() as s:
            return [BurstOut.model_validate(b) for b in queries.bursts(s, node_id=node_id, start_s=start_s,
                                                                        end_s=end_s, limit=limit)]

    @r.get("/summary", response_model=SummaryOut, **roles(OPERATOR, VIEWER))
    def summary(request: Request):
        from db.models import SchedulerLease

        now = clock()
        with request.app.state.factory() as s:
            ns = queries.list_nodes(s)
            latest = queries.latest_reports(s, now - 10 * settings.report_interval_s)

            def mean(vals):
                vals = [v for v in vals if v is not None]
                return sum(vals) / len(vals) if vals else None

            ro = queries.open_rollout(s)
            act = queries.active_policy(s)
            w = queries.latest_weights(s)
            lease = s.get(SchedulerLease, "scheduler")
            return SummaryOut(
                now_s=now, num_nodes=len(ns), num_up=sum(n.status == "up" for n in ns),
                num_down=sum(n.status == "down" for n in ns),
                mean_emb_share=mean([x.emb_share for x in latest]), mean_p99_ms=mean([x.p99_ms for x in latest]),
                mean_slo_attainment=mean([x.slo_attainment for x in latest]),
                total_throughput_rps=sum(x.throughput_rps for x in latest) if latest else None,
                active_policy=act.version if act else None,
                active_rollout=None if ro is None else _rollout_out(s, ro),
                num_active_overrides=len(queries.active_overrides(s)),
                router_weights_version=w.version if w else None, leader=lease.holder if lease else None,
                decisions_by_source=queries.decisions_by_source(s, now - 300))

    @r.get("/jobs", **roles(OPERATOR, VIEWER))
    def jobs(request: Request, job: str | None = None, since_s: float | None = None,
             limit: Annotated[int, Query(ge=1, le=10_000)] = 500):
        with request.app.state.factory() as s:
            return [dict(job=j.job, instance=j.instance, started_s=j.started_s, duration_s=j.duration_s, ok=j.ok,
                         error=j.error, summary=j.summary) for j in queries.job_runs(s, job, since_s, limit)]

    # ---- routers and weights
    def _router_out(x: Router) -> RouterOut:
        return RouterOut(url=x.url, has_push_token=x.push_token is not None, registered_at_s=x.registered_at_s,
                         pushed_version=x.pushed_version, last_push_s=x.last_push_s, last_error=x.last_error)

    @r.post("/routers", response_model=RouterOut, **roles(NODE, OPERATOR, ROUTER))
    def register_router(body: RouterIn, request: Request, p: principal(NODE, OPERATOR, ROUTER)):
        now = clock()
        with begin(request) as s:
            router, new = queries.upsert_router(s, body.url, now, body.push_token)
            if new:
                queries.audit(s, ts_s=now, actor=p.name, action="router.register", target=f"router:{body.url}",
                              after={"url": body.url, "has_push_token": body.push_token is not None}, reason="")
            return _router_out(router)

    @r.get("/routers", response_model=list[RouterOut], **roles(OPERATOR, VIEWER))
    def routers(request: Request):
        with request.app.state.factory() as s:
            return [_router_out(x) for x in queries.list_routers(s)]

    @r.delete("/routers", response_model=RouterOut, responses=errors(404), **roles(OPERATOR))
    def delete_router(request: Request, p: principal(OPERATOR),
                      url: Annotated[str, Query(min_length=1, max_length=512)]):
        with begin(request) as s:
            router = _get_or_404(s, Router, url)
            out = _router_out(router)
            s.delete(router)
            queries.audit(s, ts_s=clock(), actor=p.name, action="router.delete", target=f"router:{url}",
                          before={"url": url}, reason="")
            return out

    @r.get("/router/weights", response_model=RouterWeightsOut, responses=errors(404), **roles(NODE, OPERATOR, VIEWER, ROUTER))
    def router_weights(request: Request):
        with request.app.state.factory() as s:
            w = queries.latest_weights(s)
            if w is None:
                raise HTTPException(404, "no router weights yet (no node has registered, or the weights job has "
                                         "not run)")
            return RouterWeightsOut(version=w.version, computed_at_s=w.computed_at_s, nodes=w.nodes)

    @r.get("/router/weights/history", response_model=list[RouterWeightsHistoryOut], **roles(OPERATOR, VIEWER))
    def router_weights_history(request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 100):
        with request.app.state.factory() as s:
            return [RouterWeightsHistoryOut.model_validate(w) for w in queries.weights_history(s, limit)]

    # ---- overrides
    @r.get("/overrides", response_model=list[OverrideOut], **roles(OPERATOR, VIEWER))
    def overrides(request: Request, state: Annotated[str | None, Query(pattern="^(active|cleared|expired)$")] = None,
                  limit: Annotated[int, Query(ge=1, le=10_000)] = 500):
        with request.app.state.factory() as s:
            return [OverrideOut.model_validate(o) for o in queries.list_overrides(s, state=state, limit=limit)]

    @r.post("/overrides", response_model=OverrideOut, status_code=201, responses=errors(404), **roles(OPERATOR))
    def create_override(body: OverrideIn, request: Request, p: principal(OPERATOR)):
        now = clock()
        lo, hi = settings.guard_bounds()
        if not lo <= body.emb_share <= hi:
            raise invalid(["body", "emb_share"], f"emb_share {body.emb_share} is outside the allocator's guard "
                                                   f"bounds [{lo}, {hi}]")
        if body.expires_at_s is not None and body.ttl_s is not None:
            raise invalid(["body", "ttl_s"], "give expires_at_s or ttl_s, not both")
        expires = body.expires_at_s if body.expires_at_s is not None else (
            now + body.ttl_s if body.ttl_s is not None else None)
        if expires is not None and expires <= now:
            raise invalid(["body", "expires_at_s" if body.expires_at_s is not None else "ttl_s"],
                          f"expires_at_s {expires} is not in the future (now {now:.3f})")
        with begin(request) as s:
            if body.node_id is not None:
                _get_or_404(s, Node, body.node_id)
            replaced = [o for o in queries.active_overrides(s) if o.node_id == body.node_id]
            for o in replaced:
                o.state, o.ended_at_s = "cleared", now
            o = Override(node_id=body.node_id, emb_share=body.emb_share, reason=body.reason, created_by=p.name,
                         created_at_s=now, expires_at_s=expires, state="active")
            s.add(o)
            s.flush()
            queries.audit(s, ts_s=now, actor=p.name, action="override.create", target=f"override:{o.id}",
                          before=None if not replaced else {"replaced": [x.id for x in replaced],
                                                            "emb_share": replaced[0].emb_share},
                          after={"node_id": o.node_id, "emb_share": o.emb_share, "expires_at_s": expires},
                          reason=body.reason)
            return OverrideOut.model_validate(o)

    @r.post("/overrides/{override_id}/clear", response_model=OverrideOut, responses=errors(404, 409),
            **roles(OPERATOR))
    def clear_override(override_id: Id64, body: ReasonIn, request: Request, p: principal(OPERATOR)):
        now = clock()
        with begin(request) as s:
            o = _get_or_404(s, Override, override_id)
            if o.state != "active":
                raise HTTPException(409, f"override {override_id} is already {o.state}")
            o.state, o.ended_at_s = "cleared", now
            queries.audit(s, ts_s=now, actor=p.name, action="override.clear", target=f"override:{o.id}",
                          before={"state": "active", "emb_share": o.emb_share, "node_id": o.node_id},
                          after={"state": "cleared"}, reason=body.reason)
            return OverrideOut.model_validate(o)

    # ---- audit
    @r.get("/audit", response_model=AuditPage, **roles(OPERATOR, VIEWER))
    def audit_log(request: Request, actor: str | None = None, action: str | None = None, target: str | None = None,
                  start_s: float | None = None, end_s: float | None = None,
                  offset: Offset = 0, limit: Annotated[int, Query(ge=1, le=1000)] = 100):
        with request.app.state.factory() as s:
            total, rows = queries.audit_page(s, start_s=start_s, end_s=end_s, actor=actor, action=action,
                                             target=target, offset=offset, limit=limit)
            return AuditPage(total=total, offset=offset, limit=limit, items=rows)

    # ---- policies
    def _policy_out(p: Policy) -> PolicyOut:
        return PolicyOut(version=p.version, digest=p.digest, status=p.status, uploaded_by=p.uploaded_by,
                         uploaded_at_s=p.uploaded_at_s, manifest=p.manifest, evaluation=p.evaluation,
                         size_bytes=len(p.artifact))

    @r.post("/policies", response_model=PolicyOut, status_code=201, responses={
        **errors(409, 413), 200: {"model": PolicyOut, "description": "the same files are registered already: "
                                                                    "the stored policy"}}, **{
        **roles(OPERATOR), "openapi_extra": {"x-racer-roles": [OPERATOR], "requestBody": {
            "required": True, "description": "tar (or tar.gz) of the files `racer policy export` writes",
            "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}}}}})
    async def upload_policy(request: Request, p: principal(OPERATOR)):
        import anyio.to_thread

        data = await request.body()  # at most max_policy_body_bytes (the gate refuses more with 413)
        if not data:
            raise invalid(["body"], "body: empty; send a tar of the artifact's files")
        try:
            files = unpack_artifact(data)
            manifest = await anyio.to_thread.run_sync(verify_files, files)
        except ValueError as e:
            raise invalid(["body"], f"policy artifact refused: {e}") from None
        packed = pack_artifact(files)
        digest = hashlib.sha256(packed).hexdigest()
        version = str(manifest["policy_id"])
        now = clock()

        def store():
            with begin(request) as s:
                old = s.get(Policy, version)
                if old is not None:
                    if old.digest != digest:
                        raise Conflict(f"policy_id {version!r} is already registered with other files (digest "
                                       f"{old.digest[:12]}); export the new policy under a new policy_id")
                    return _policy_out(old), False
                pol = Policy(version=version, digest=digest, artifact=packed, manifest=manifest,
                             evaluation=manifest.get("evaluation") or {}, status="registered", uploaded_by=p.name,
                             uploaded_at_s=now)
                s.add(pol)
                queries.audit(s, ts_s=now, actor=p.name, action="policy.upload", target=f"policy:{version}",
                              after={"digest": digest, "size_bytes": len(packed)}, reason="")
                s.flush()
                return _policy_out(pol), True

        out, created = await anyio.to_thread.run_sync(store)
        return JSONResponse(out.model_dump(), status_code=201 if created else 200)

    @r.get("/policies", response_model=list[PolicyOut], **roles(OPERATOR, VIEWER))
    def policies(request: Request):
        with request.app.state.factory() as s:
            return [_policy_out(x) for x in queries.list_policies(s)]

    @r.get("/policies/{version}", response_model=PolicyOut, responses=errors(404), **roles(OPERATOR, VIEWER))
    def policy(version: str, request: Request):
        with request.app.state.factory() as s:
            x = _get_or_404(s, Policy, version)
            return _policy_out(x)

    @r.get("/policies/{version}/artifact", response_class=Response, responses={
        200: {"content": {"application/x-tar": {}}, "description": "the artifact's canonical tar"}, **errors(404)},
        **roles(NODE, OPERATOR, VIEWER))
    def policy_artifact(version: str, request: Request):
        with request.app.state.factory() as s:
            x = _get_or_404(s, Policy, version)
            return Response(x.artifact, media_type="application/x-tar",
                            headers={"X-Racer-Digest": x.digest,
                                     "Content-Disposition": f'attachment; filename="{version}.tar"'})

    @r.post("/policies/{version}/activate", response_model=PolicyOut, responses=errors(404, 409), **roles(OPERATOR))
    def activate_policy(version: str, body: ReasonIn, request: Request, p: principal(OPERATOR)):
        with begin(request) as s:
            return _policy_out(rollout_service.activate(s, version, actor=p.name, reason=body.reason, now_s=clock()))

    # ---- rollouts
    def _rollout_out(s, ro: Rollout) -> RolloutOut:
        out = RolloutOut.model_validate(ro)
        out.nodes = queries.rollout_nodes(s, ro.id)
        out.steps = queries.rollout_steps(s, ro.id)
        return RolloutOut.model_validate(out.model_dump())

    @r.post("/rollouts", response_model=RolloutOut, status_code=201, responses=errors(404, 409), **roles(OPERATOR))
    def create_rollout(body: RolloutIn, request: Request, p: principal(OPERATOR)):
        with begin(request) as s:
            ro = rollout_service.create_rollout(s, body, actor=p.name, now_s=clock())
            return _rollout_out(s, ro)

    @r.get("/rollouts", response_model=list[RolloutOut], **roles(OPERATOR, VIEWER))
    def list_rollouts(request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 50):
        with request.app.state.factory() as s:
            return [_rollout_out(s, x) for x in queries.rollouts(s, limit)]

    @r.get("/rollouts/{rollout_id}", response_model=RolloutOut, responses=errors(404), **roles(OPERATOR, VIEWER))
    def get_rollout(rollout_id: Id64, request: Request):
        with request.app.state.factory() as s:
            ro = _get_or_404(s, Rollout, rollout_id)
            return _rollout_out(s, ro)

    def _event_route(event: str):
        def handler(rollout_id: Id64, body: ReasonIn, request: Request, p: principal(OPERATOR)):
            with begin(request) as s:
                ro = _get_or_404(s, Rollout, rollout_id)
                rollout_service.transition(s, ro, event, actor=p.name, reason=body.reason, now_s=clock())
                return _rollout_out(s, ro)

        handler.__name__ = f"rollout_{event}"
        r.add_api_route(f"/rollouts/{{rollout_id}}/{event}", handler, methods=["POST"], response_model=RolloutOut,
                        summary=f"{event} a rollout (operator)", responses=errors(404, 409), **roles(OPERATOR))

    for ev in ("promote", "pause", "resume", "rollback"):
        _event_route(ev)

    from .api_gateway_reports import router as gateway_reports  # what clients see (the gateways' reports)
    r.include_router(gateway_reports)
    app.include_router(r)
    # added last, so outermost: the gate checks the token and caps the body before the ingestion
    # fast path or any route reads it
    app.add_middleware(AllowedMethods, routes=app.router.routes, error_field="detail")  # 405 / OPTIONS: full Allow
    app.add_middleware(IngestFastPath, state=app.state)
    app.add_middleware(RequestGate, openapi=lambda: app.openapi(), state=app.state, settings=settings)

    def openapi():
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            comps = spec.setdefault("components", {}).setdefault("schemas", {})
            extra = ReportBatchIn.model_json_schema(ref_template="#/components/schemas/{model}")
            comps.update(extra.pop("$defs", {}))
            comps["ReportBatchIn"] = extra
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/healthz")
    def healthz(request: Request):
        sch = getattr(request.app.state, "scheduling", None)
        return {"ok": True, "instance": getattr(request.app.state, "instance", None),
                "leader": bool(sch and sch.leader)}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    def metrics(request: Request):
        return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


INGEST_PATH = re.compile(r"^/api/v1/nodes/([A-Za-z0-9_.:\-]{1,128})/reports$")


def node_out(state, node: Node) -> NodeOut:
    """A node as the API shows it: its row, and the drop count its latest report gave."""
    out = NodeOut.model_validate(node)
    dropped = state.reports_dropped.get(node.node_id)
    if dropped is not None:
        out.num_reports_dropped = dropped[1]
    return out


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


async def ingest_batch(state, node_id: str, raw: bytes, clock, principal: Principal | None) -> tuple[int, bytes]:
    """Validate and store one report batch of ``node_id`` sent by ``principal`` (the token
    `control_plane.gate` checked before the body was read; checked again here: role node, bound
    to ``node_id``); (HTTP status, JSON body)."""
    t0 = time.perf_counter()
    if principal is None:
        return 401, _json({"detail": "missing bearer token (Authorization: Bearer <token>)"})
    why = role_refusal(principal, (NODE,)) or node_route_refusal(principal, node_id)
    if why:
        return 403, _json({"detail": why})
    try:
        body = ReportBatchIn.model_validate_json(raw)
    except ValidationError as e:
        errs = [{**x, "loc": ["body", *x["loc"]]} for x in e.errors(include_url=False, include_context=False)]
        return 422, _json({"detail": jsonable_encoder(json_safe(errs))})
    if node_id not in state.known_nodes:
        import anyio.to_thread

        def known() -> bool:
            with state.factory() as s:
                return s.get(Node, node_id) is not None

        try:
            is_known = await anyio.to_thread.run_sync(known)
        except Exception as e:  # noqa: BLE001 - database unreachable: the node keeps the batch and retries
            return 503, _json({"detail": f"database unavailable, retry later: {type(e).__name__}: {str(e)[:300]}"})
        if not is_known:
            return 404, _json({"detail": f"node_id {node_id!r} is not registered (POST {API}/nodes/register first)"})
        state.known_nodes.add(node_id)
    now = clock()
    rows, decisions, bursts = [], [], []
    for rep in body.reports:
        d = rep.model_dump(exclude={"decision", "bursts"})
        d["node_id"], d["received_s"] = node_id, now
        d["decision_source"] = rep.decision.source if rep.decision is not None else None
        rows.append(d)
        if rep.decision is not None:
            decisions.append(dict(node_id=node_id, seq=rep.seq, ts_s=rep.ts_s, source=rep.decision.source,
                                  emb_share=rep.decision.emb_share, prev_emb_share=rep.decision.prev_emb_share,
                                  reason=rep.decision.reason, policy_version=rep.policy_version,
                                  features=rep.decision.features,
                                  layers=[t.model_dump() for t in rep.decision.layers] or None))
        for b in rep.bursts:
            bursts.append(dict(node_id=node_id, start_s=b.start_s, end_s=b.end_s, magnitude=b.magnitude))
    last = max(body.reports, key=lambda x: x.seq)
    try:
        stored, dup = await state.writer.submit(node_id, rows, decisions, bursts,
                                                (now, last.seq, last.emb_share, last.policy_version))
    except (IntegrityError, DataError) as e:  # the batch itself is wrong: the node drops it and counts it
        return 422, _json({"detail": f"reports refused by the database: {type(e).__name__}: {e}"})
    except Exception as e:  # noqa: BLE001 - database unreachable or failing: the node keeps the batch and retries
        return 503, _json({"detail": f"database unavailable, retry later: {type(e).__name__}: {str(e)[:300]}"})
    said = [x for x in body.reports if x.num_reports_dropped is not None]
    if said:
        newest = max(said, key=lambda x: x.seq)
        old = state.reports_dropped.get(node_id)
        if old is None or newest.seq >= old[0]:  # a replayed older report does not lower it
            state.reports_dropped[node_id] = (newest.seq, newest.num_reports_dropped)
            state.metrics.node_reports_dropped.labels(node_id).set(newest.num_reports_dropped)
    m = state.metrics
    m.reports_received.inc(len(rows))
    m.reports_stored.inc(stored)
    if dup:
        m.reports_duplicate.inc(dup)
    m.observe_report(node_id, last)
    m.ingest_request.observe(time.perf_counter() - t0)
    return 200, b'{"stored":%d,"duplicates":%d}' % (stored, dup)


class IngestFastPath:
    """ASGI middleware inside `RequestGate`: ``POST /api/v1/nodes/{node_id}/reports`` goes
    straight to `ingest_batch` (the gate has checked the token and read the body, capped),
    without FastAPI's routing and dependency machinery; everything else goes on to the routes."""

    def __init__(self, app, state) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            m = INGEST_PATH.match(scope["path"])
            if m is not None:
                chunks = []
                while True:  # one message: the gate hands the body on whole
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    chunks.append(msg.get("body", b""))
                    if not msg.get("more_body"):
                        break
                status, body = await ingest_batch(self.state, m.group(1), b"".join(chunks), self.state.clock,
                                                  scope.get("state", {}).get(PRINCIPAL_STATE))
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                if status == 401:
                    headers.append((b"www-authenticate", b"Bearer"))
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def asgi_app(settings: Settings | None = None, *, clock=time.time) -> FastAPI:
    """The app to serve (`create_app`: the gate and the ingestion fast path are in its middleware)."""
    return create_app(settings, clock=clock)
