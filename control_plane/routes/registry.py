"""What the policy and model registries' routes share: reading an upload and checking it in a
child process with limits (`control_plane.artifacts.check_upload`), storing it as one canonical
tar with its answer (201 new, 200 already registered), and the tar's download."""

from __future__ import annotations

import functools
import hashlib
from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from common.artifact_pack import pack_artifact

from ..artifacts import check_upload
from .deps import invalid, now_s


async def checked_upload(request: Request, kind: str, *, empty: str, refused: str,
                         active_manifest: Callable[[Request], dict | None] | None = None) -> tuple[dict, dict]:
    """The request body's files and manifest as ``check_upload(kind, ...)`` accepts them, awaited off
    the event loop; 422 ``body: empty; send EMPTY`` for no body, ``REFUSED refused: why`` for a
    refused one. ``active_manifest(request)``, when given, is read first and passed on."""
    import anyio.to_thread

    data = await request.body()  # at most max_policy_body_bytes (the gate refuses more with 413)
    if not data:
        raise invalid(["body"], f"body: empty; send {empty}")
    try:  # in a child process with limits, awaited off the event loop
        active = None if active_manifest is None else await anyio.to_thread.run_sync(active_manifest, request)
        return await anyio.to_thread.run_sync(functools.partial(
            check_upload, kind, data, active_manifest=active, limits=request.app.state.settings.check_limits()))
    except ValueError as e:
        raise invalid(["body"], f"{refused} refused: {e}") from None


async def stored_upload(request: Request, store, *, version: str, files: dict, manifest: dict,
                        actor: str) -> JSONResponse:
    """Pack ``files`` into the canonical tar and ``store(request, version=, digest=, packed=,
    manifest=, actor=, now=) -> (out, created)`` it off the event loop: ``out`` with 201 when new,
    200 when it was registered already."""
    import anyio.to_thread

    packed = pack_artifact(files)
    out, created = await anyio.to_thread.run_sync(functools.partial(
        store, request, version=version, digest=hashlib.sha256(packed).hexdigest(), packed=packed, manifest=manifest,
        actor=actor, now=now_s(request)))
    return JSONResponse(out.model_dump(), status_code=201 if created else 200)


def tar_download(row, filename: str) -> Response:
    """A stored artifact's canonical tar, with its digest in ``X-Racer-Digest``."""
    return Response(row.artifact, media_type="application/x-tar",
                    headers={"X-Racer-Digest": row.digest, "Content-Disposition": f'attachment; filename="{filename}"'})
