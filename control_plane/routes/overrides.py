"""Operators' overrides of a node's (or the whole cluster's) ``emb_share``: list, create, clear.
An override expires at ``expires_at_s`` (the ``override_expiry`` job marks it)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request

from db import queries
from db.models import Node, Override

from ..rollout_service import flush_or_conflict
from ..schemas import OverrideIn, OverrideOut, ReasonIn
from .deps import OPERATOR, VIEWER, Id64, begin, errors, get_or_404, invalid, now_s, principal, roles, session, settings

router = APIRouter()


@router.get("/overrides", response_model=list[OverrideOut], **roles(OPERATOR, VIEWER))
def overrides(request: Request, state: Annotated[str | None, Query(pattern="^(active|cleared|expired)$")] = None,
              limit: Annotated[int, Query(ge=1, le=10_000)] = 500):
    with session(request) as s:
        return [OverrideOut.model_validate(o) for o in queries.list_overrides(s, state=state, limit=limit)]


def _expiry(body: OverrideIn, now: float, bounds: tuple[float, float]) -> float | None:
    """When an override asked for now expires (None: never); a 422 naming the field when the share
    is outside the guard ``bounds``, both expiry fields are given, or the expiry is not in the future."""
    lo, hi = bounds
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
    return expires


@router.post("/overrides", response_model=OverrideOut, status_code=201, responses=errors(404, 409), **roles(OPERATOR))
def create_override(body: OverrideIn, request: Request, p: principal(OPERATOR)):
    now = now_s(request)
    expires = _expiry(body, now, settings(request).guard_bounds())
    with begin(request) as s:
        if body.node_id is not None:
            get_or_404(s, Node, body.node_id)
        replaced = [o for o in queries.active_overrides(s) if o.node_id == body.node_id]
        for o in replaced:
            o.state, o.ended_at_s = "cleared", now
        o = Override(node_id=body.node_id, emb_share=body.emb_share, reason=body.reason, created_by=p.name,
                     created_at_s=now, expires_at_s=expires, state="active")
        s.add(o)
        flush_or_conflict(s, f"another override of {body.node_id or 'the cluster'} was set at the same moment: "
                             f"read the overrides again and retry")
        queries.audit(s, ts_s=now, actor=p.name, action="override.create", target=f"override:{o.id}",
                      before=None if not replaced else {"replaced": [x.id for x in replaced],
                                                        "emb_share": replaced[0].emb_share},
                      after={"node_id": o.node_id, "emb_share": o.emb_share, "expires_at_s": expires},
                      reason=body.reason)
        return OverrideOut.model_validate(o)


@router.post("/overrides/{override_id}/clear", response_model=OverrideOut, responses=errors(404, 409),
             **roles(OPERATOR))
def clear_override(override_id: Id64, body: ReasonIn, request: Request, p: principal(OPERATOR)):
    now = now_s(request)
    with begin(request) as s:
        o = get_or_404(s, Override, override_id)
        if o.state != "active":
            raise HTTPException(409, f"override {override_id} is already {o.state}")
        o.state, o.ended_at_s = "cleared", now
        queries.audit(s, ts_s=now, actor=p.name, action="override.clear", target=f"override:{o.id}",
                      before={"state": "active", "emb_share": o.emb_share, "node_id": o.node_id},
                      after={"state": "cleared"}, reason=body.reason)
        return OverrideOut.model_validate(o)
