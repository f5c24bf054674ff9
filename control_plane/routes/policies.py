"""The policy registry: upload an artifact (checked as a node agent checks it before use), list,
read, download, activate. An artifact is the three files `racer policy export` writes, stored as
one canonical tar (`pack_artifact`: same files, same bytes, same digest)."""

from __future__ import annotations

import functools
import hashlib
import io
import os
import tarfile
import tempfile
import zlib

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from db import queries
from db.models import Policy

from .. import rollout_service
from ..rollout_service import Conflict
from ..schemas import PolicyId, PolicyOut, ReasonIn
from .deps import NODE, OPERATOR, VIEWER, begin, errors, get_or_404, invalid, now_s, principal, roles, session

ARTIFACT_FILES = ("manifest.json", "policy.onnx", "golden.npz")


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


#: most bytes of a tar extension header (a PAX ``x``/``g`` record set, a GNU ``L``/``K`` long name):
#: an artifact's names are short, and Python's tarfile parses these with a regular expression whose
#: cost grows with their size (CVE-2024-6232 in Python before 3.12.6 / 3.11.10: a 232-byte gzip
#: upload froze the control plane 12.9 s)
MAX_EXTENSION_BYTES = 4096
_EXTENSION_TYPES = {b"x": "PAX header", b"g": "PAX global header", b"L": "GNU long name", b"K": "GNU long link"}


def check_tar_headers(data: bytes, max_bytes: int, max_extension_bytes: int = MAX_EXTENSION_BYTES,
                      what: str = "policy artifact") -> None:
    """Walk the archive's 512-byte headers (inflating a gzip'd one: at most ``max_bytes`` of
    members and 1 MiB of headers and padding) before tarfile reads it: ValueError for an
    extension header past ``max_extension_bytes`` or an archive that unpacks past that. Linear
    in the archive's size; anything else (not a tar, truncated) is left to tarfile to refuse."""
    if data[:2] == b"\x1f\x8b":
        d = zlib.decompressobj(wbits=31)
        limit = max_bytes + 2**20
        try:
            raw = d.decompress(data, limit + 1)
        except zlib.error:
            return  # tarfile says what is wrong
        if len(raw) > limit or d.unconsumed_tail:
            raise ValueError(f"body: the archive unpacks to more than {max_bytes} bytes (a {what} is smaller)")
    else:
        raw = data
    pos = 0
    while pos + 512 <= len(raw):
        block = raw[pos:pos + 512]
        if block == bytes(512):
            return
        size_field = block[124:136]
        if size_field[:1] and size_field[0] & 0x80:  # base-256 (GNU): a size no artifact member has
            raise ValueError("body: a tar member declares a size in base-256 (over 8 GB)")
        try:
            size = int(size_field.split(b"\0", 1)[0].strip() or b"0", 8)
        except ValueError:
            return
        kind = _EXTENSION_TYPES.get(block[156:157])
        if kind is not None and size > max_extension_bytes:
            raise ValueError(f"body: a {kind} of {size} bytes (at most {max_extension_bytes})")
        pos += 512 + -(-size // 512) * 512


def unpack_artifact(data: bytes, *, max_members: int = MAX_ARTIFACT_MEMBERS,
                    max_bytes: int = MAX_ARTIFACT_UNPACKED_BYTES, names: tuple[str, ...] = ARTIFACT_FILES,
                    required: tuple[str, ...] | None = None, what: str = "policy artifact",
                    writer: str = "racer policy export") -> dict[str, bytes]:
    """The artifact's files (``names``; all of ``required``, default all of them) from an uploaded
    tar (optionally gzip'd; a top directory is allowed). Raises ValueError saying what is wrong:
    not a tar, truncated, more than ``max_members`` members, or members whose sizes add up to more
    than ``max_bytes`` (a decompression bomb is refused from its headers, before its bytes are
    inflated). The model registry unpacks checkpoints with it too (``what``, ``writer``)."""
    check_tar_headers(data, max_bytes, what=what)
    files: dict[str, bytes] = {}
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as tar:  # a stream: members in order, no seeking
            for k, m in enumerate(tar, start=1):
                if k > max_members:
                    raise ValueError(f"body: more than {max_members} members (a {what} has {len(names)})")
                total += max(0, int(m.size))
                if total > max_bytes:
                    raise ValueError(f"body: the archive unpacks to more than {max_bytes} bytes (a {what} is "
                                     f"smaller)")
                base = os.path.basename(m.name.rstrip("/"))
                if base not in names:
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
        raise ValueError(f"body: not a complete tar archive of a {what} ({type(e).__name__}: {e})") from None
    missing = [f for f in (names if required is None else required) if f not in files]
    if missing:
        raise ValueError(f"body: the {what} lacks {', '.join(missing)} (expected the files `{writer}` "
                         f"writes: {', '.join(names)})")
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
    import anyio.to_thread

    data = await request.body()  # at most max_policy_body_bytes (the gate refuses more with 413)
    if not data:
        raise invalid(["body"], "body: empty; send a tar of the artifact's files")
    try:
        files = await anyio.to_thread.run_sync(unpack_artifact, data)  # off the event loop
        manifest = await anyio.to_thread.run_sync(verify_files, files)
    except ValueError as e:
        raise invalid(["body"], f"policy artifact refused: {e}") from None
    packed = pack_artifact(files)
    digest = hashlib.sha256(packed).hexdigest()
    version = str(manifest["policy_id"])
    now = now_s(request)

    out, created = await anyio.to_thread.run_sync(functools.partial(
        _store, request, version=version, digest=digest, packed=packed, manifest=manifest, actor=p.name, now=now))
    return JSONResponse(out.model_dump(), status_code=201 if created else 200)


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
        x = get_or_404(s, Policy, version)
        return Response(x.artifact, media_type="application/x-tar",
                        headers={"X-Racer-Digest": x.digest,
                                 "Content-Disposition": f'attachment; filename="{version}.tar"'})


@router.post("/policies/{version}/activate", response_model=PolicyOut, responses=errors(404, 409),
             **roles(OPERATOR))
def activate_policy(version: PolicyId, body: ReasonIn, request: Request, p: principal(OPERATOR)):
    with begin(request) as s:
        return _policy_out(rollout_service.activate(s, version, actor=p.name, reason=body.reason,
                                                    now_s=now_s(request)))
