"""What a node pulls and confirms: its directives (the override in force, the policy to run, the
model checkpoint to serve) and its confirmation that it loaded a policy or a model (or failed to)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from common.contract import (API, DirectivesOut, ModelDirective, ModelLoadedIn, NodeId, OverrideDirective,
                             PolicyDirective, PolicyLoadedIn)
from common.ids import path_segment
from db import queries
from db.models import Node

from .. import rollout_service
from ..schemas import NodeOut
from .deps import NODE, begin, errors, get_or_404, now_s, roles, session, settings

router = APIRouter()


@router.get("/nodes/{node_id}/directives", response_model=DirectivesOut, responses=errors(404), **roles(NODE))
def directives(node_id: NodeId, request: Request):
    now = now_s(request)
    with session(request) as s:
        get_or_404(s, Node, node_id)
        ovs = queries.active_overrides(s, node_id)
        ov = next((o for o in ovs if o.node_id == node_id), None) or next(
            (o for o in ovs if o.node_id is None), None)
        if ov is not None and ov.expires_at_s is not None and ov.expires_at_s <= now:
            ov = None  # past its expiry; the expiry job will mark it
        pol, rollout_id = rollout_service.policy_for_node(s, node_id)
        mdl, model_rollout_id = rollout_service.model_for_node(s, node_id)
        return DirectivesOut(
            node_id=node_id, now_s=now, report_interval_s=settings(request).report_interval_s,
            send_period_s=settings(request).send_period_s,
            override=None if ov is None else OverrideDirective(
                override_id=ov.id, emb_share=ov.emb_share, expires_at_s=ov.expires_at_s, reason=ov.reason,
                scope="node" if ov.node_id else "cluster"),
            policy=None if pol is None else PolicyDirective(
                version=pol.version, digest=pol.digest, rollout_id=rollout_id,
                download_url=f"{API}/policies/{path_segment(pol.version)}/artifact"),
            model=None if mdl is None else ModelDirective(
                version=mdl.version, digest=mdl.digest, rollout_id=model_rollout_id,
                download_url=f"{API}/models/{path_segment(mdl.version)}/artifact"))


@router.post("/nodes/{node_id}/policy", response_model=NodeOut, responses=errors(404, 409, 413), **roles(NODE))
def policy_loaded(node_id: NodeId, body: PolicyLoadedIn, request: Request):
    return _loaded(request, node_id, rollout_service.node_confirmed, body.policy_version, body)


@router.post("/nodes/{node_id}/model", response_model=NodeOut, responses=errors(404, 409, 413), **roles(NODE))
def model_loaded(node_id: NodeId, body: ModelLoadedIn, request: Request):
    return _loaded(request, node_id, rollout_service.node_model_confirmed, body.model_version, body, audited="model")


def _loaded(request: Request, node_id: str, confirm, version: str, body, *, audited: str | None = None) -> NodeOut:
    """A node's answer to a directive (``confirm``: `rollout_service.node_confirmed` or
    `node_model_confirmed`), in the audit log as ``AUDITED.<status>`` when ``audited`` is given."""
    now = now_s(request)
    with begin(request) as s:
        node = get_or_404(s, Node, node_id)
        confirm(s, node, version=version, status=body.status, error=body.error, now_s=now)
        if audited:
            queries.audit(s, ts_s=now, actor=f"node:{node_id}", action=f"{audited}.{body.status}",
                          target=f"node:{node_id}", after={audited: version, "error": body.error},
                          reason="node confirmation")
        return NodeOut.model_validate(node)
