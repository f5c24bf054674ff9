"""Rollouts of a policy or a model: create (canary nodes get the candidate), list, read, and the operators' events
(promote, pause, resume, rollback); the judge (`control_plane.rollout`) runs in the
``rollout_evaluation`` job."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request

from db import queries
from db.models import Rollout

from .. import rollout_service
from ..schemas import ReasonIn, RolloutIn, RolloutOut
from .deps import OPERATOR, VIEWER, Id64, PageLimit, begin, errors, get_or_404, now_s, principal, roles, session

router = APIRouter()


def rollout_out(s, ro: Rollout) -> RolloutOut:
    out = RolloutOut.model_validate(ro)
    out.nodes = queries.rollout_nodes(s, ro.id)
    out.steps = queries.rollout_steps(s, ro.id)
    return RolloutOut.model_validate(out.model_dump())


@router.post("/rollouts", response_model=RolloutOut, status_code=201, responses=errors(404, 409), **roles(OPERATOR))
def create_rollout(body: RolloutIn, request: Request, p: principal(OPERATOR)):
    with begin(request) as s:
        ro = rollout_service.create_rollout(s, body, actor=p.name, now_s=now_s(request))
        return rollout_out(s, ro)


@router.get("/rollouts", response_model=list[RolloutOut], **roles(OPERATOR, VIEWER))
def list_rollouts(request: Request, limit: PageLimit = 50,
                  kind: Literal["policy", "model", "all"] = "policy"):
    with session(request) as s:
        return [rollout_out(s, x) for x in queries.rollouts(s, limit, None if kind == "all" else kind)]


@router.get("/rollouts/{rollout_id}", response_model=RolloutOut, responses=errors(404), **roles(OPERATOR, VIEWER))
def get_rollout(rollout_id: Id64, request: Request):
    with session(request) as s:
        ro = get_or_404(s, Rollout, rollout_id)
        return rollout_out(s, ro)


def _event_handler(event: str):
    """The route of an operator's ``event`` on a rollout (`rollout_service.transition`)."""
    def handler(rollout_id: Id64, body: ReasonIn, request: Request, p: principal(OPERATOR)):
        with begin(request) as s:
            ro = get_or_404(s, Rollout, rollout_id)
            rollout_service.transition(s, ro, event, actor=p.name, reason=body.reason, now_s=now_s(request))
            return rollout_out(s, ro)

    handler.__name__ = f"rollout_{event}"
    return handler


for _event in ("promote", "pause", "resume", "rollback"):
    router.add_api_route(f"/rollouts/{{rollout_id}}/{_event}", _event_handler(_event), methods=["POST"],
                         response_model=RolloutOut, summary=f"{_event} a rollout (operator)",
                         responses=errors(404, 409), **roles(OPERATOR))
