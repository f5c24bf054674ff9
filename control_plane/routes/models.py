"""The model registry: upload a checkpoint (the directory `racer model train` writes, as a tar),
list, read, download, activate. An upload is bounded as a policy upload is (members and unpacked
size checked from the tar headers while streaming), then verified by the node agent's own loader
(`node_agent.model.checkpoint.load_checkpoint`: every file's digest, the manifest's digest, the
config against the weights) before it is stored as one canonical tar. A model's version is its
checkpoint digest (what a node reports as the model it serves). When a model is active, a new one
must fit the nodes that serve it (the same model config and item mapping: `Engine.load_checkpoint`
refuses anything else) or it is refused at upload."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from db import queries
from db.models import ModelVersion

from .. import rollout_service
from ..schemas import ModelOut, ReasonIn
from .deps import NODE, OPERATOR, VIEWER, begin, errors, get_or_404, now_s, principal, roles, session
from .registry import checked_upload, stored_upload, tar_download

router = APIRouter()


def _model_out(m: ModelVersion) -> ModelOut:
    return ModelOut(version=m.version, digest=m.digest, status=m.status, uploaded_by=m.uploaded_by,
                    uploaded_at_s=m.uploaded_at_s, manifest=m.manifest, size_bytes=len(m.artifact))


def _active_manifest(request: Request) -> dict | None:
    with session(request) as s:
        a = queries.active_model(s)
        return None if a is None else dict(a.manifest)


def _store(request: Request, *, version: str, digest: str, packed: bytes, manifest: dict, actor: str,
           now: float) -> tuple[ModelOut, bool]:
    """Store an uploaded checkpoint (its own transaction): (the model, whether it is new)."""
    with begin(request) as s:
        old = s.get(ModelVersion, version)
        if old is not None:
            return _model_out(old), False  # same checkpoint digest: the same files
        m = ModelVersion(version=version, digest=digest, artifact=packed, manifest=manifest, status="registered",
                         uploaded_by=actor, uploaded_at_s=now)
        s.add(m)
        queries.audit(s, ts_s=now, actor=actor, action="model.upload", target=f"model:{version}",
                      after={"digest": digest, "size_bytes": len(packed), "num_items": manifest.get("num_items")},
                      reason="")
        s.flush()
        return _model_out(m), True


_UPLOAD_OPENAPI = {"x-racer-roles": [OPERATOR], "requestBody": {
    "required": True, "description": "tar (or tar.gz) of the checkpoint directory `racer model train` writes",
    "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}}}}


@router.post("/models", response_model=ModelOut, status_code=201, responses={
    **errors(409, 413), 200: {"model": ModelOut, "description": "this checkpoint is registered already"}},
    **{**roles(OPERATOR), "openapi_extra": _UPLOAD_OPENAPI})
async def upload_model(request: Request, p: principal(OPERATOR)):
    import json

    files, manifest = await checked_upload(request, "model", empty="a tar of the checkpoint directory",
                                           refused="model checkpoint", active_manifest=_active_manifest)
    manifest["model_config"] = json.loads(files["config.json"])  # what a later upload must match
    return await stored_upload(request, _store, version=str(manifest["digest"]), files=files, manifest=manifest,
                               actor=p.name)


@router.get("/models", response_model=list[ModelOut], **roles(OPERATOR, VIEWER))
def models(request: Request):
    with session(request) as s:
        return [_model_out(x) for x in queries.list_models(s)]


@router.get("/models/{version}", response_model=ModelOut, responses=errors(404), **roles(OPERATOR, VIEWER))
def model(version: str, request: Request):
    with session(request) as s:
        return _model_out(get_or_404(s, ModelVersion, version))


@router.get("/models/{version}/artifact", response_class=Response, responses={
    200: {"content": {"application/x-tar": {}}, "description": "the checkpoint's canonical tar"}, **errors(404)},
    **roles(NODE, OPERATOR, VIEWER))
def model_artifact(version: str, request: Request):
    with session(request) as s:
        return tar_download(get_or_404(s, ModelVersion, version), f"model-{version[:16]}.tar")


@router.post("/models/{version}/activate", response_model=ModelOut, responses=errors(404, 409), **roles(OPERATOR))
def activate_model(version: str, body: ReasonIn, request: Request, p: principal(OPERATOR)):
    with begin(request) as s:
        return _model_out(rollout_service.activate(s, version, actor=p.name, reason=body.reason,
                                                   now_s=now_s(request), kind="model"))

