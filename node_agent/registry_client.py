"""Pushing an artifact to the control plane's registry over HTTP (`racer policy push`, `racer
model push`): the files as one tar, ``POST /api/v1/<kind>``, then, when asked, the activation.
`add_push_arguments` and `push_from_args` are the two commands' shared options and call."""

from __future__ import annotations

import sys
from urllib.parse import quote

from common.secrets_args import add_secret_arguments, read_secret

from .argtypes import positive_float


def add_push_arguments(p, *, prog: str, timeout_s: float, timeout_type=positive_float) -> None:
    """A push command's options after its directory: ``--control-plane``, the operator token,
    ``--activate``, ``--reason`` (default "pushed with PROG"), ``--timeout-s`` and ``--json``."""
    p.add_argument("--control-plane", required=True, help="control plane URL, e.g. http://127.0.0.1:8400")
    add_secret_arguments(p, "token", "RACER_TOKEN", "operator token")
    p.add_argument("--activate", action="store_true", help="activate it once registered")
    p.add_argument("--reason", default=f"pushed with {prog}", help="the audit log's reason")
    p.add_argument("--timeout-s", type=timeout_type, default=timeout_s, help=f"per request (default {timeout_s:g})")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def push_from_args(kind: str, body: bytes, args, *, prog: str) -> tuple[int, dict | None]:
    """`push` with the options `add_push_arguments` declared; ValueError when no token is given."""
    token = read_secret(args, "token", "RACER_TOKEN", prog=prog)
    if not token:
        raise ValueError("a token is needed: --token-file F or RACER_TOKEN (an operator token)")
    return push(kind, body, control_plane=args.control_plane, token=token, activate=args.activate,
                reason=args.reason, timeout_s=args.timeout_s, prog=prog)


def push(kind: str, body: bytes, *, control_plane: str, token: str, activate: bool, reason: str,
         timeout_s: float, prog: str) -> tuple[int, dict | None]:
    """Upload ``body`` (a tar) to ``/api/v1/<kind>`` (``policies`` or ``models``) and activate the
    version with ``activate``. Returns ``(0, {version, digest, status, created})`` or ``(1, None)``
    when the control plane refused it (its reason printed on stderr as ``prog: ...``); raises
    ValueError when it cannot be reached."""
    import httpx

    base = control_plane.rstrip("/") + "/api/v1"
    headers = {"Authorization": f"Bearer {token}"}

    def fail(what: str, r) -> tuple[int, None]:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        if isinstance(detail, list):
            detail = "; ".join(str(d.get("msg", d)) if isinstance(d, dict) else str(d) for d in detail)
        print(f"{prog}: {what} refused (HTTP {r.status_code}): {detail}", file=sys.stderr)
        return 1, None

    try:
        r = httpx.post(f"{base}/{kind}", content=body, timeout=timeout_s,
                       headers={**headers, "Content-Type": "application/x-tar"})
        if r.status_code >= 400:
            return fail("upload", r)
        m = r.json()
        out = {"version": m["version"], "digest": m["digest"], "status": m["status"], "created": r.status_code == 201}
        if activate:
            r = httpx.post(f"{base}/{kind}/{quote(m['version'], safe='')}/activate", timeout=timeout_s,
                           headers=headers, json={"reason": reason})
            if r.status_code >= 400:
                return fail("activation", r)
            out["status"] = r.json()["status"]
    except httpx.HTTPError as e:
        raise ValueError(f"control plane at {control_plane} unreachable: {type(e).__name__}: {e}") from None
    return 0, out
