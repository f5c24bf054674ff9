"""The HTTP floor under the ingestion benchmark: the control plane's HTTP stack with nothing behind it.

    python -m bench.ingest --json --db sqlite --http-floor     # this server beside the control plane

Serves, through `common.http_server.serve_forever` (the uvicorn configuration, connection guards
and runtime tuning the control plane runs on), the calls `bench.ingest` makes: a token for every
token request and an empty answer to a registration (a raw ASGI app), and to each report batch,
answered in the HTTP protocol as the control plane answers a known node's batches (a
`common.http_server.NativeRoute`), ``{"stored": N, "duplicates": 0}`` with N counted by a byte scan
(no JSON parse, no validation, no token, no database, no metrics). Its CPU per request is what the
control plane cannot go below while it serves reports over this HTTP server, one request per
report batch. ``RACER_BENCH_FLOOR_ASGI=1``: the batches go through the ASGI app instead (the floor
of a server without the native route). Run as ``python bench/ingest_floor.py DB_URL PORT`` (the
bench's server-command hook; the database URL is ignored).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.http_server import NativeRoute, send_json_bytes, serve_forever  # noqa: E402

_MAX_BODY = 1 << 20


async def app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        msg = await receive()
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
        if len(body) > _MAX_BODY:
            await send_json_bytes(send, 413, b'{"detail": "too large"}')
            return
    path = scope["path"]
    if path.endswith("/reports"):
        out = _batch_answer(body)
    elif path == "/api/v1/tokens":
        out = b'{"token": "floor"}'
    else:
        out = b"{}"
    await send_json_bytes(send, 200, out)


def _batch_answer(body: bytes) -> bytes:
    return b'{"stored": %d, "duplicates": 0}' % body.count(b'"seq"')


class Batches(NativeRoute):
    """Every report batch with a Content-Length within `_MAX_BODY`, answered in the protocol."""

    def claim(self, method, path, headers):
        if method != "POST" or not path.endswith("/reports"):
            return None
        for name, value in headers:
            if name == b"content-length":
                return True if value.isdigit() and int(value) <= _MAX_BODY else None
        return None

    def handle(self, claim, body, respond):
        respond(200, _batch_answer(body))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python bench/ingest_floor.py DB_URL PORT", file=sys.stderr)
        return 2
    from control_plane.main import http_timeouts  # the control plane's keep-alive for its send period
    from control_plane.settings import Settings

    native = None if os.environ.get("RACER_BENCH_FLOOR_ASGI") == "1" else Batches()
    serve_forever(app, "127.0.0.1", int(argv[1]), timeouts=http_timeouts(Settings.from_env()), native=native)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
