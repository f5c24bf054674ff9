"""The policy registry: upload an artifact (unpacked and checked as a node agent checks it before
use, in a child process with limits: `control_plane.artifacts`), list, read, download, activate.
An artifact is the three files `racer policy export` writes, stored as one canonical tar."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from common.contract import PolicyId
from db import queries
from db.models import Policy

from .. import rollout_service
from ..rollout_service import Conflict
from ..schemas import PolicyOut, ReasonIn
from .deps import NODE, OPERATOR, VIEWER, begin, errors, get_or_404, now_s, principal, roles, session
from .registry import checked_upload, stored_upload, tar_download

# --------------------------------------------------------------------------------------- routes
router = APIRouter()


def _policy_out(p: Policy) -> PolicyOut:
    return PolicyOut(version=p.version, digest=p.digest, status=p.status, uploaded_by=p.uploaded_by,
                     uploaded_at_s=p.uploaded_at_s, manifest=p.manifest, evaluation=p.evaluation,
                     size_bytes=len(p.artifact))


def _store(request: Request, *, version: str, digest: str, packed: bytes, manifest: dict, actor: str,
           now: float) -> tuple[PolicyOut, bool]:
    """Store an uploaded policy in a transaction of its own: (the policy, whether it is new). The
    same files again: the stored one; other files under a stored policy_id: `Conflict`."""
    with begin(request) as s:
        old = s.get(Policy, version)
        if old is not None:
            if old.digest != digest:
                raise Conflict(f"policy_id {version!r} is already registered with other files (digest "
                               f"{old.digest[:12]}); export the new policy under a new policy_id")
            return _policy_out(old), False
        pol = Policy(version=version, digest=digest, artifact=packed, manifest=manifest,
                     evaluation=manifest.get("evaluation") or {}, status="registered", uploaded_by=actor,
                     uploaded_at_s=now)
        s.add(pol)
        queries.audit(s, ts_s=now, actor=actor, action="policy.upload", target=f"policy:{version}",
                      after={"digest": digest, "size_bytes": len(packed)}, reason="")
        s.flush()
        return _policy_out(pol), True


_UPLOAD_OPENAPI = {"x-racer-roles": [OPERATOR], "requestBody": {
    "required": True, "description": "tar (or tar.gz) of the files `racer policy export` writes",
    "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}}}}


@router.post("/policies", response_model=PolicyOut, status_code=201, responses={
    **errors(409, 413), 200: {"model": PolicyOut, "description": "the same files are registered already: "
                                                                "the stored policy"}},
    **{**roles(OPERATOR), "openapi_extra": _UPLOAD_OPENAPI})
async def upload_policy(request: Request, p: principal(OPERATOR)):
    files, manifest = await checked_upload(request, "policy", empty="a tar of the artifact's files",
                                           refused="policy artifact")
    return await stored_upload(request, _store, version=str(manifest["policy_id"]), files=files, manifest=manifest,
                               actor=p.name)


@router.get("/policies", response_model=list[PolicyOut], **roles(OPERATOR, VIEWER))
def policies(request: Request):
    with session(request) as s:
        return [_policy_out(x) for x in queries.list_policies(s)]


@router.get("/policies/{version}", response_model=PolicyOut, responses=errors(404), **roles(OPERATOR, VIEWER))
def policy(version: PolicyId, request: Request):
    with session(request) as s:
        x = get_or_404(s, Policy, version)
        return _policy_out(x)


@router.get("/policies/{version}/artifact", response_class=Response, responses={
    200: {"content": {"application/x-tar": {}}, "description": "the artifact's canonical tar"}, **errors(404)},
    **roles(NODE, OPERATOR, VIEWER))
def policy_artifact(version: PolicyId, request: Request):
    with session(request) as s:
        return tar_download(get_or_404(s, Policy, version), f"{version}.tar")


@router.post("/policies/{version}/activate", response_model=PolicyOut, responses=errors(404, 409),
             **roles(OPERATOR))
def activate_policy(version: PolicyId, body: ReasonIn, request: Request, p: principal(OPERATOR)):
    with begin(request) as s:
        return _policy_out(rollout_service.activate(s, version, actor=p.name, reason=body.reason,
                                                    now_s=now_s(request)))
