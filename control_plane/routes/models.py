"""The model registry: upload a checkpoint (the directory `racer model train` writes, as a tar),
list, read, download, activate. An upload is bounded as a policy upload is (members and unpacked
size checked from the tar headers while streaming), then verified by the node agent's own loader
(`node_agent.model.checkpoint.load_checkpoint`: every file's digest, the manifest's digest, the
config against the weights) before it is stored as one canonical tar. A model's version is its
checkpoint digest (what a node reports as the model it serves). When a model is active, a new one
must fit the nodes that serve it (the same model config and item mapping: `Engine.load_checkpoint`
refuses anything else) or it is refused at upload."""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from db import queries
from db.models import ModelVersion

from .. import rollout_service
from ..schemas import ModelOut, ReasonIn
from .deps import NODE, OPERATOR, VIEWER, begin, errors, get_or_404, invalid, now_s, principal, roles, session
from .policies import pack_artifact, unpack_artifact

CHECKPOINT_FILES = ("manifest.json", "weights.pt", "config.json", "items.json", "figures.json")
REQUIRED_FILES = ("manifest.json", "weights.pt", "config.json", "items.json")
MAX_CHECKPOINT_MEMBERS = 32
MAX_CHECKPOINT_UNPACKED_BYTES = 256 * 2**20


def unpack_checkpoint(data: bytes, *, max_members: int = MAX_CHECKPOINT_MEMBERS,
                      max_bytes: int = MAX_CHECKPOINT_UNPACKED_BYTES) -> dict[str, bytes]:
    """A checkpoint's files from an uploaded tar (or tar.gz); ValueError says what is wrong."""
    return unpack_artifact(data, max_members=max_members, max_bytes=max_bytes, names=CHECKPOINT_FILES,
                           required=REQUIRED_FILES, what="model checkpoint", writer="racer model train")


def verify_checkpoint(files: dict[str, bytes], active_manifest: dict | None) -> dict:
    """Load the checkpoint as a node agent does (every digest checked); when a model is active,
    the new one must have its item count, item mapping and model config. Returns the manifest."""
    from node_agent.model.checkpoint import CheckpointError, load_checkpoint

    with tempfile.TemporaryDirectory(prefix="racer-model-") as d:
        for name, data in files.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        try:
            ck = load_checkpoint(d)
        except CheckpointError as e:
            raise ValueError(str(e).replace(d, "<upload>")) from None
        m = dict(ck.manifest)
    if active_manifest is not None:
        a = active_manifest
        if a.get("num_items") != m.get("num_items"):
            raise ValueError(f"trained on {m.get('num_items')} items, the active model (and the nodes serving it) "
                             f"on {a.get('num_items')}: train it on the trace the fleet serves")
        if a.get("item_keys_sha256") != m.get("item_keys_sha256"):
            raise ValueError("its item-id mapping differs from the active model's (another trace or item order)")
        ca, cm = a.get("model_config"), _config(files.get("config.json"))
        if ca is not None and cm is not None and ca != cm:
            raise ValueError(f"its model config differs from the active model's ({cm} vs {ca}): the nodes' memory "
                             "layout holds the active one")
    return m


def _config(raw: bytes | None) -> dict | None:
    import json

    try:
        return json.loads(raw) if raw is not None else None
    except ValueError:
        return None


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

    import anyio.to_thread

    data = await request.body()  # at most max_policy_body_bytes (the gate refuses more with 413)
    if not data:
        raise invalid(["body"], "body: empty; send a tar of the checkpoint directory")
    try:
        files = await anyio.to_thread.run_sync(unpack_checkpoint, data)  # off the event loop
        active = await anyio.to_thread.run_sync(_active_manifest, request)
        manifest = await anyio.to_thread.run_sync(verify_checkpoint, files, active)
    except ValueError as e:
        raise invalid(["body"], f"model checkpoint refused: {e}") from None
    manifest["model_config"] = json.loads(files["config.json"])  # what a later upload must match
    packed = pack_artifact(files)
    digest = hashlib.sha256(packed).hexdigest()
    out, created = await anyio.to_thread.run_sync(functools.partial(
        _store, request, version=str(manifest["digest"]), digest=digest, packed=packed, manifest=manifest,
        actor=p.name, now=now_s(request)))
    return JSONResponse(out.model_dump(), status_code=201 if created else 200)


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
        x = get_or_404(s, ModelVersion, version)
        return Response(x.artifact, media_type="application/x-tar",
                        headers={"X-Racer-Digest": x.digest,
                                 "Content-Disposition": f'attachment; filename="model-{version[:16]}.tar"'})


@router.post("/models/{version}/activate", response_model=ModelOut, responses=errors(404, 409), **roles(OPERATOR))
def activate_model(version: str, body: ReasonIn, request: Request, p: principal(OPERATOR)):
    with begin(request) as s:
        return _model_out(rollout_service.activate(s, version, actor=p.name, reason=body.reason,
                                                   now_s=now_s(request), kind="model"))

