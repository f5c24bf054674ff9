"""Nodes and their reports: registration, report batches, the node list, retirement."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import Response

from common.contract import API, NodeId, RegisterIn, RegisterOut, ReportBatchOut
from db import queries
from db.models import Node

from ..auth import PRINCIPAL_STATE, node_route_refusal
from ..schemas import NodeOut, ReasonIn
from .deps import (NODE, OPERATOR, ROUTER, VIEWER, begin, errors, get_or_404, now_s, principal, roles, session,
                   settings)
from .report_ingest import ingest_batch, node_out

router = APIRouter()


@router.post("/nodes/register", response_model=RegisterOut, responses=errors(413), **roles(NODE))
def register(body: RegisterIn, request: Request, p: principal(NODE)):
    """Register (or re-register) the node the token is bound to. Another token may not take
    over a node id while the token that registered it is valid: retire the node (which
    revokes its tokens), or make its new token with ``replace``."""
    why = node_route_refusal(p, body.node_id)
    if why:
        raise HTTPException(403, why)
    interval_s, send_s = settings(request).report_interval_s, settings(request).send_period_s
    now = now_s(request)
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
                                           report_interval_s=interval_s, token_id=p.token_id,
                                           started_at_s=body.started_at_s)
        if before is not None and node.num_restarts and before.get("started_at_s") not in (None, body.started_at_s):
            queries.audit(s, ts_s=now, actor=p.name, action="node.restart", target=f"node:{body.node_id}",
                          before={"started_at_s": before["started_at_s"]},
                          after={"started_at_s": body.started_at_s, "num_restarts": node.num_restarts}, reason="")
        if before is None or before["address"] != body.address or before["cost_profile"] != node.cost_profile:
            queries.audit(s, ts_s=now, actor=p.name, action="node.register", target=f"node:{body.node_id}",
                          before=before, after=body.model_dump(), reason="")
        last_seq = queries.highest_report_seq(s, body.node_id)
    request.app.state.known_nodes.add(body.node_id)
    return RegisterOut(node_id=body.node_id, report_interval_s=interval_s, send_period_s=send_s,
                       last_report_seq=last_seq)


# roles checked by the gate (no dependency: the route reads the body itself); the body's schema
# is added to the OpenAPI document by `control_plane.api`
_INGEST_OPENAPI = {"x-racer-roles": [NODE], "requestBody": {
    "required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ReportBatchIn"}}}}}


@router.post("/nodes/{node_id}/reports", response_model=ReportBatchOut, responses=errors(404, 413, 503),
             openapi_extra=_INGEST_OPENAPI)
async def reports(node_id: NodeId, request: Request):
    """Store a batch of reports (idempotent on (node_id, seq)). The body is parsed by pydantic-core
    straight from the bytes (the hot path: one request per node per interval; `IngestFastPath`
    serves the same function without FastAPI's routing and dependency machinery)."""
    status, body, headers = await ingest_batch(request.app.state, node_id, await request.body(),
                                               request.app.state.clock, request.scope.get("state", {}).get(PRINCIPAL_STATE))
    return Response(body, status_code=status, media_type="application/json", headers=headers)


@router.get("/nodes", response_model=list[NodeOut], **roles(OPERATOR, VIEWER, ROUTER))
def nodes(request: Request, include_retired: Annotated[bool, Query(
        description="also the retired nodes (the gateway's list never has them)")] = False):
    with session(request) as s:
        ns = queries.list_nodes(s, include_retired=include_retired)
        devices, rates = queries.node_devices(s, ns), queries.latest_throughputs(s, ns)
        return [node_out(request.app.state, n, devices[n.node_id], rates.get(n.node_id)) for n in ns]


@router.post("/nodes/{node_id}/retire", response_model=NodeOut, responses=errors(404, 409, 413), **roles(OPERATOR))
def retire_node(node_id: NodeId, body: ReasonIn, request: Request, p: principal(OPERATOR)):
    """Drain and retire a node: it leaves the node list (gateways stop sending it requests at
    their next read of the list; those in flight finish) and the router weights, every token
    bound to it is revoked (its reports, directives and registration are refused from then
    on), its per-node overrides are cleared. Audited as ``node.retire``. Its history stays.
    A new token bound to its id brings it back by registering."""
    now = now_s(request)
    with begin(request) as s:
        node = get_or_404(s, Node, node_id)
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
        out = node_out(request.app.state, node, queries.node_devices(s, [node])[node_id])
    request.app.state.tokens.forget_node(node_id)
    request.app.state.known_nodes.discard(node_id)
    return out


@router.get("/nodes/{node_id}", response_model=NodeOut, responses=errors(404), **roles(OPERATOR, VIEWER))
def node(node_id: NodeId, request: Request):
    with session(request) as s:
        n = get_or_404(s, Node, node_id)
        return node_out(request.app.state, n, queries.node_devices(s, [n])[node_id],
                        queries.latest_throughputs(s, [n]).get(node_id))
