"""The project's one way to run an ASGI app over HTTP: `serve_forever` (node agent, control
plane, gateway).

Why it exists: asyncio sets ``TCP_NODELAY`` on an accepted connection only when the listening
socket was created with ``proto=IPPROTO_TCP`` (``asyncio.base_events._set_nodelay`` checks
``sock.proto``). A socket made as ``socket(AF_INET, SOCK_STREAM)`` has proto 0, so every
connection kept Nagle's algorithm on; uvicorn writes a response's head and body separately, and
the second write waited for the client's delayed ACK: ~40 ms on every request after the first on
a kept-alive connection. `listen_socket` creates the socket with ``IPPROTO_TCP`` (so asyncio's
own check passes) and `serve_forever` also sets ``TCP_NODELAY`` on each accepted connection in
uvicorn's connection hook, so the fix does not hang on an asyncio detail.
``bench.engine`` reports keep-alive and fresh-connection p50 side by side; the tests check it.

Latency tuning: once the app's lifespan has started (its models, engines, routes and imported
modules exist), `serve_forever` runs `tune_runtime`:

- one full collection, ``gc.freeze()`` (every object alive then moves to the permanent
  generation, which later collections do not scan) and a larger first-generation threshold.
  Without it the control plane under 1,000 reports/s ran a full collection every ~7 s that
  scanned every module, model and ORM object and stopped the event loop for 200-250 ms each time
  (measured with ``gc.callbacks``: it was most of bench.ingest's p99);
- a GIL switch interval of 0.5 ms instead of 5 ms: a server's background thread (the control
  plane's scheduled jobs, the ingest writer) that runs Python for tens of ms otherwise makes the
  event loop wait up to 5 ms to get the GIL back after each of its I/O calls (the "convoy"
  effect); bench.ingest showed a ~100-200 ms stall each time the 10 s router-weights job ran.

    serve_forever(app, host, port, *, log_level="warning", ready=None) -> None

``app`` is any ASGI app (FastAPI, Starlette, a bare callable); ``port`` 0 binds a free port;
``ready(host, port)`` is called with the bound port before serving starts; SIGINT and SIGTERM
shut down gracefully (the app's lifespan runs its shutdown) and the call returns normally. It
installs signal handlers, so it must run in the process's main thread.

Request bodies are bounded here too, for all three servers: `read_body` reads a body while
counting the bytes received (a chunked body has no Content-Length to trust) and stops at the
cap; `BodyLimit` is the ASGI middleware made of it (the node agent and the gateway); the control
plane checks the token first and then calls `read_body` with the route's cap. A refusal sent
before the body was read closes the connection (`send_json` with ``close=True``), so the server
never reads the rest.

A request's head is bounded in size: past ``max_head_bytes`` (32 KiB by default, as nginx's four
8-KiB header buffers) of a head not yet complete, the server answers 431 and closes the
connection: the parser is handed at most the cap's worth of a head (a read that crosses it is cut
there), so one huge header costs its first 32 KiB (uvicorn with httptools sets no limit of its
own: a 100-MiB header was parsed whole).

Connections are bounded in time (`HttpTimeouts`, set in uvicorn's connection hook): a request's
head must arrive within ``header_timeout_s`` of the connection (or of the end of the previous
answer) however slowly its bytes trickle in; a body must not stall for more than
``body_idle_timeout_s`` between two reads; an idle kept-alive connection is closed after
``keep_alive_s`` (uvicorn's own timer). A half-open connection, or one opened and never used,
is closed by the server instead of being held forever. While the app works on a request
(its body all read) no timer runs: a slow answer is not cut.

Methods: `AllowedMethods` makes the app's 405 (a path whose routes do not take the request's
method) name every method they take in ``Allow``, and answers ``OPTIONS`` with 204 and that header.
`JsonOnly` refuses a body announced as something other than JSON with 415 before it is read.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable
from dataclasses import dataclass

from .config import ranged, validate

__all__ = ["AllowedMethods", "BodyLimit", "BodyTooLarge", "HttpTimeouts", "JsonOnly", "NativeRoute", "json_content_type", "declared_body_bytes", "finite_validation_errors", "json_safe", "listen_socket",
           "may_have_body", "read_body", "replay_body", "send_json", "serve_forever", "set_nodelay", "tune_runtime"]

#: generation-0 threshold while serving (CPython's default is 700): a request allocates a few
#: hundred container objects, so the default collected on almost every request.
GC_GEN0_THRESHOLD = 5_000


#: GIL switch interval while serving, s (CPython's default is 0.005).
SWITCH_INTERVAL_S = 0.0005


def tune_runtime() -> dict:
    """Collect once, freeze what is alive into the permanent generation, raise the generation-0
    threshold and shorten the GIL switch interval (see the module docstring); returns what it
    did. Call it once a server's start-up objects exist."""
    import gc
    import sys

    gc.collect()
    gc.freeze()
    _g0, g1, g2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, g1, g2)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return {"frozen_objects": gc.get_freeze_count(), "gc_threshold": gc.get_threshold(),
            "switch_interval_s": sys.getswitchinterval()}


def refreeze_runtime() -> int:
    """After a process replaced what `tune_runtime` froze (an agent's reset in place): move the
    frozen objects back, collect the replaced ones now, and freeze what is alive again, so their
    collection does not fall inside the next run (a full collection of a replaced engine holds
    the GIL for tens of milliseconds). Returns the objects frozen."""
    import gc

    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


ECHO_MAX_CHARS = 200  # most of a rejected input a 422 echoes back


def _safe_text(text: str) -> str:
    """``text`` as UTF-8-encodable text (a lone surrogate becomes its ``\\udXXX`` spelling), cut to
    `ECHO_MAX_CHARS`."""
    if len(text) > ECHO_MAX_CHARS:
        text = text[:ECHO_MAX_CHARS] + "..."
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def json_safe(value, _depth: int = 0):
    """``value`` made safe to echo in a JSON error body: every non-finite float replaced by its
    JSON-text spelling ("NaN", "Infinity", "-Infinity"), bytes decoded (invalid UTF-8 replaced),
    lone surrogates escaped, long strings cut and deep nesting elided, so a 422 that echoes a
    rejected input still encodes as JSON instead of becoming a 500."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (bytes, bytearray)):
        return _safe_text(bytes(value[:4 * ECHO_MAX_CHARS]).decode("utf-8", "replace"))
    if isinstance(value, str):
        return _safe_text(value)
    if _depth > 16 and isinstance(value, (dict, list, tuple)):
        return "..."
    if isinstance(value, dict):
        return {_safe_text(str(k)): json_safe(v, _depth + 1) for k, v in list(value.items())[:64]}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, _depth + 1) for v in value[:64]]
    return value


def finite_validation_errors(app) -> None:
    """Install on a FastAPI ``app`` a validation-error handler with FastAPI's own 422 shape
    (``{"detail": [{loc, msg, type, input, ...}]}``) whose echoed inputs are `json_safe`.

    FastAPI's default handler copies the rejected input into ``detail``; when that input is NaN
    or ±Infinity (JSON text the parser accepts) the response cannot be encoded and the client
    gets a plain-text 500 instead of a 422 naming the field."""
    from fastapi.encoders import jsonable_encoder
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        return JSONResponse(status_code=422, content={"detail": jsonable_encoder(json_safe(exc.errors()))})


class BodyTooLarge(Exception):
    """A request body over ``max_bytes``: ``received`` bytes were counted (or announced by
    Content-Length when ``declared``) when it was refused."""

    def __init__(self, max_bytes: int, received: int, declared: bool = False) -> None:
        what = f"{received} bytes" if declared else f"at least {received} bytes"
        super().__init__(f"request body of {what} exceeds {max_bytes} bytes")
        self.max_bytes, self.received, self.declared = max_bytes, received, declared


def declared_body_bytes(scope) -> int | None:
    """The request's Content-Length when it is a plain decimal number, else None (chunked, or
    a value not to be trusted: the bytes are counted as they come)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def may_have_body(scope) -> bool:
    """Whether the request announces a body (a Content-Length other than 0, or Transfer-Encoding)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.strip() not in (b"", b"0"):
            return True
        if name == b"transfer-encoding":
            return True
    return False


async def read_body(receive, max_bytes: int, scope=None) -> bytes | None:
    """The whole request body, read from ``receive`` while counting its bytes; raises
    `BodyTooLarge` as soon as more than ``max_bytes`` have arrived (or, given ``scope``, when its
    Content-Length announces more, before anything is read). None: the client went away."""
    if scope is not None:
        n = declared_body_bytes(scope)
        if n is not None and n > max_bytes:
            raise BodyTooLarge(max_bytes, n, declared=True)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(max_bytes, size)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay_body(body: bytes, receive):
    """A ``receive`` that hands the app ``body`` (already read) in one message, then defers to
    the original ``receive`` (which reports the client's disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def send_json(send, status: int, payload: dict, *, close: bool = False,
                    headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """Send a whole JSON answer. ``close``: ask the server to close the connection after it (the
    request's body was not read, and must not be)."""
    import json

    raw = list(headers)
    if close:
        raw.append((b"connection", b"close"))
    await send_json_bytes(send, status, json.dumps(payload).encode(), raw)


async def send_json_bytes(send, status: int, body: bytes, headers=()) -> None:
    """Send ``body``, already JSON, as a whole answer with ``headers`` (``(bytes, bytes)`` pairs, or a
    mapping of str to str) after its content type and length."""
    extra = [(k.encode(), v.encode()) for k, v in headers.items()] if hasattr(headers, "items") else list(headers)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: refuse an HTTP request body over ``max_bytes`` with 413 JSON
    (``{error_field: "request body of ... exceeds N bytes"}``) before the app parses it: a
    declared Content-Length over the limit without reading the body, a chunked one as soon as
    the bytes received pass it (`read_body`). The body (at most ``max_bytes``) is handed to the
    app unchanged.

    ``budget_bytes``: the most body bytes held at once over every request in progress (read, or
    in the app's hands); a request whose bytes would pass it gets 503, so many concurrent large
    bodies cannot add up past it either."""

    def __init__(self, app, max_bytes: int, error_field: str = "error", budget_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.error_field = error_field
        self.budget_bytes = budget_bytes
        self.held_bytes = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.budget_bytes is None:
            try:
                body = await read_body(receive, self.max_bytes, scope)
            except BodyTooLarge as e:
                await send_json(send, 413, {self.error_field: str(e)}, close=True)
                return
            if body is None:  # the client went away: nobody to answer
                return
            await self.app(scope, replay_body(body, receive), send)
            return
        held = 0

        async def counted():
            nonlocal held
            message = await receive()
            n = len(message.get("body", b""))
            if self.held_bytes + n > self.budget_bytes:
                raise _OverBudget
            held += n
            self.held_bytes += n
            return message

        try:
            try:
                body = await read_body(counted, self.max_bytes, scope)
            except BodyTooLarge as e:
                await send_json(send, 413, {self.error_field: str(e)}, close=True)
                return
            except _OverBudget:
                await send_json(send, 503, {self.error_field: f"busy: request bodies in progress hold "
                                                              f"{self.budget_bytes} bytes; retry later"},
                                close=True, headers=((b"retry-after", b"1"),))
                return
            if body is None:
                return
            await self.app(scope, replay_body(body, receive), send)
        finally:
            self.held_bytes -= held


class _OverBudget(Exception):
    pass


class AllowedMethods:
    """ASGI middleware over an app's ``routes`` (Starlette/FastAPI routes, read when needed, so
    routes added later count): when the app answers 405 (routes match the path, none takes the
    method), its answer is replaced: ``OPTIONS`` gets 204 and ``Allow`` (every method those
    routes take, and OPTIONS), any other method 405 with that ``Allow`` header and a JSON body
    (``{error_field: ...}``). Every other answer passes unchanged: a served request costs one
    wrapped ``send``, no route matching."""

    def __init__(self, app, routes, error_field: str = "error") -> None:
        self.app = app
        self.routes = routes
        self.error_field = error_field

    METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")

    def _match(self, scope):
        from starlette.routing import Match

        best = Match.NONE
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return match
            if match == Match.PARTIAL:
                best = match
        return best

    def allowed(self, scope) -> set[str] | None:
        """The methods the path's routes take, or None when one takes this method (or none matches).
        Each method is tried against the routes (included routers answer only "partial" for
        another method, without naming theirs)."""
        from starlette.routing import Match

        if self._match(scope) != Match.PARTIAL:
            return None
        return {m for m in self.METHODS if self._match({**scope, "method": m}) == Match.FULL} or None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        replaced = False

        async def send_or_replace(message) -> None:
            nonlocal replaced
            if replaced:  # the app's own 405 body: dropped
                return
            if message["type"] == "http.response.start" and message["status"] == 405:
                methods = self.allowed(scope)
                if methods is not None:
                    replaced = True
                    await self._answer(scope, methods, send)
                    return
            await send(message)

        await self.app(scope, receive, send_or_replace)

    async def _answer(self, scope, methods: set[str], send) -> None:
        allow = ", ".join(sorted(methods | {"OPTIONS"})).encode()
        if scope["method"] == "OPTIONS":
            await send({"type": "http.response.start", "status": 204,
                        "headers": [(b"allow", allow), (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await send_json(send, 405, {self.error_field: f"method {scope['method']} not allowed on {scope['path']}; "
                                                      f"allowed: {allow.decode()}"}, headers=((b"allow", allow),))


def json_content_type(scope) -> bool:
    """Whether the request's body is announced as JSON: no Content-Type (read as JSON), or
    ``application/json`` / ``application/<x>+json`` with any parameters."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))
    return True


class JsonOnly:
    """ASGI middleware: a request to one of ``paths`` whose body is announced as anything but JSON
    (`json_content_type`) gets 415 JSON (``{error_field: ...}``) before its body is read."""

    def __init__(self, app, paths, error_field: str = "error") -> None:
        self.app = app
        self.paths = frozenset(paths)
        self.error_field = error_field

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in self.paths and not json_content_type(scope):
            await send_json(send, 415, {self.error_field: unsupported_media_type(scope)},
                            close=may_have_body(scope))
            return
        await self.app(scope, receive, send)


def unsupported_media_type(scope) -> str:
    kind = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"content-type"), "")
    return f"Content-Type {kind[:100]!r} is not supported: send the body as application/json"


def set_nodelay(sock: socket.socket) -> None:
    """Turn off Nagle's algorithm on a connected TCP socket (no-op for other sockets)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket for ``host:port`` with proto ``IPPROTO_TCP``, so
    asyncio turns Nagle off on every connection it accepts; inheritable, ``SO_REUSEADDR``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


@dataclass(frozen=True)
class HttpTimeouts:
    """How long a server waits on a client, s, and how much of a request head it reads (see the
    module docstring). `from_env` reads ``RACER_HTTP_HEADER_TIMEOUT_S``,
    ``RACER_HTTP_BODY_IDLE_TIMEOUT_S``, ``RACER_HTTP_KEEP_ALIVE_S`` and
    ``RACER_HTTP_MAX_HEAD_BYTES`` over these defaults."""

    header_timeout_s: float = ranged(10.0, lo=0, lo_open=True, hi=3600, doc="a request head's deadline, s")
    body_idle_timeout_s: float = ranged(30.0, lo=0, lo_open=True, hi=3600, doc="most a body may stall, s")
    keep_alive_s: float = ranged(5.0, lo=0, lo_open=True, hi=3600, doc="an idle kept-alive connection's life, s")
    max_head_bytes: int = ranged(32 * 1024, lo=1024, hi=1 << 20, integer=True, doc="most bytes of a request head (line and headers)")

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_env(cls, environ=None) -> "HttpTimeouts":
        import os

        env = os.environ if environ is None else environ
        kw = {}
        for name in ("header_timeout_s", "body_idle_timeout_s", "keep_alive_s", "max_head_bytes"):
            raw = env.get(f"RACER_HTTP_{name.upper()}")
            if raw:
                try:
                    kw[name] = int(raw) if name == "max_head_bytes" else float(raw)
                except ValueError:
                    raise ValueError(f"RACER_HTTP_{name.upper()}: not a number: {raw!r}") from None
        return cls(**kw)


class _ConnectionGuard:
    """What `_guarded_protocol` puts over uvicorn's HTTP protocol class (a mixin ahead of it):
    ``TCP_NODELAY`` set on each new connection and the `HttpTimeouts` request-head and body-idle
    timers (uvicorn arms the keep-alive one itself).

    uvicorn's own keep-alive timer runs only after an answer, and data cancels it: a connection
    that never sends a whole request head was held forever. One timer per connection here: armed
    at the connection (head deadline), not moved by a trickle of head bytes, moved by each body
    read while the body is incomplete (idle deadline), stopped once the body is in (the app's
    turn). On expiry, a connection still waiting on its client is closed (the app, if it waits
    on the body, sees a disconnect).

    The head's size: the bytes received while no request body is expected (before the first
    head, between answers, or after the current request's last byte) are counted until a head
    is complete; a read that would pass ``max_head_bytes`` is cut at the cap, and a head that
    has not ended there gets 431 and a closed connection. A body is not counted here (the
    app's `BodyLimit` / `read_body` bound it). Pipelined requests sent in one burst count
    together until the first head is complete, so their heads share the cap.

    What it uses of uvicorn beyond its public API (the protocol's constructor, ``loop``,
    ``transport``, ``cycle.more_body``, ``cycle.response_complete``, the four hooks it overrides,
    the keep-alive timer armed in ``on_response_complete``) holds for the uvicorn range pinned in
    pyproject.toml; tests/test_http_server.py checks each on real sockets, for both of uvicorn's
    HTTP implementations."""

    _racer_header_s: float  # the limits, set by `_guarded_protocol` (`HttpTimeouts`)
    _racer_body_s: float
    _racer_max_head: int
    _racer_timer = None
    _racer_head_bytes = 0

    def connection_made(self, transport) -> None:  # noqa: D401 - asyncio hook
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                set_nodelay(sock)
            except OSError:  # the peer may already be gone
                pass
        super().connection_made(transport)
        self._racer_arm(self._racer_header_s)

    def _racer_arm(self, delay_s: float) -> None:
        if self._racer_timer is not None:
            self._racer_timer.cancel()
        self._racer_timer = self.loop.call_later(delay_s, self._racer_expired)

    def _racer_between_requests(self) -> bool:
        c = self.cycle
        return c is None or c.response_complete

    def _racer_expired(self) -> None:
        self._racer_timer = None
        c = self.cycle
        waiting = self._racer_between_requests() or c.more_body
        if waiting and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        c = self.cycle
        in_head = c is None or c.response_complete or not c.more_body  # no body expected: a head's bytes
        room = self._racer_max_head - self._racer_head_bytes
        if in_head and len(data) > room:  # the parser gets the cap's worth; the head must end within it
            super().data_received(data[:room])
            if self.transport.is_closing():
                return
            if self.cycle is c:
                self._racer_refuse_head()
                return
            self._racer_head_bytes = 0
            self.data_received(data[room:])  # the rest: a body, or the next head (counted afresh)
            return
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self.cycle is not c:  # a head is complete: the next one counts afresh
            self._racer_head_bytes = 0
        elif in_head:  # still within one head
            self._racer_head_bytes += len(data)
        if self._racer_between_requests():  # (part of) a head: its deadline stands
            if self._racer_timer is None:
                self._racer_arm(self._racer_header_s)
        elif self.cycle.more_body:  # the body is coming: it may not stall
            self._racer_arm(self._racer_body_s)
        elif self._racer_timer is not None:  # the request is in: the app's turn
            self._racer_timer.cancel()
            self._racer_timer = None

    def _racer_refuse_head(self) -> None:
        if self.transport.is_closing():
            return
        body = (b'{"error": "request head exceeds %d bytes (request line and headers)"}' % self._racer_max_head)
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                             b"content-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._racer_timer is not None:  # uvicorn's keep-alive timer takes over
            self._racer_timer.cancel()
            self._racer_timer = None

    def connection_lost(self, exc) -> None:
        if self._racer_timer is not None:
            self._racer_timer.cancel()
            self._racer_timer = None
        super().connection_lost(exc)


class NativeRoute:
    """A route the HTTP protocol answers itself, without the ASGI app: for a hot path whose
    requests are many and small (the control plane's report batches), where the ASGI request
    cycle (a task, the scope's middleware chain, the send and receive messages) costs a third of
    the request's CPU. ``serve_forever(..., native=route)``.

    `claim` sees each request's head (method, path, lower-cased header pairs) and returns what
    `handle` needs, or None: the request then goes to the ASGI app as usual. A route claims only
    requests it can answer whole without I/O before the body is in (a Content-Length within its
    cap, no chunked body, credentials it can check from memory); everything else, refusals
    included, takes the app's path, which holds the full checks. `handle` gets the claim and the
    body (at most the Content-Length the claim accepted) and answers through ``respond(status,
    body, headers)`` (``body`` JSON bytes, ``headers`` a str mapping), now or later; it returns a
    future when it answers later (a graceful shutdown waits for it), else None. Both run in the
    event loop and must not block. A route should claim POST (or other methods whose answers carry
    a body): the answer always has one."""

    def claim(self, method: str, path: str, headers: list) -> object | None:  # pragma: no cover - interface
        raise NotImplementedError

    def handle(self, claim, body: bytes, respond: Callable) -> object | None:  # pragma: no cover - interface
        raise NotImplementedError


class _NativeRoutes:
    """What `_guarded_protocol` puts over uvicorn's httptools protocol for a `NativeRoute`: at
    the point uvicorn would start the request's ASGI task (`_start_asgi_task`, after the head; a
    pipelined request after the answer before it), a request the route claims gets no task; once
    its body is in, the route handles it (in a later turn of the loop, as a task would) and its
    answer is written as uvicorn's `RequestResponseCycle.send` writes one (uvicorn's default
    headers, ``connection: close`` and the close when the request did not keep the connection
    alive, then ``on_response``: the keep-alive timer, the next pipelined request). A request
    waiting for ``100 Continue`` or asking to upgrade is never claimed. The request cycle object
    stays uvicorn's, so the connection guard's timers and head cap see it as any other.

    What it uses of uvicorn beyond its public API (``_start_asgi_task``, ``on_body``,
    ``on_message_complete``, ``parser``, ``flow``, ``tasks``, ``STATUS_LINE``, and the cycle's
    ``scope``, ``body``, ``more_body``, ``waiting_for_100_continue``, ``default_headers``,
    ``keep_alive``, ``response_complete``, ``disconnected``, ``message_event``, ``on_response``)
    holds for the uvicorn range pinned in pyproject.toml; tests/test_native_route.py checks it on
    real sockets, on uvloop and on asyncio's own loop."""

    _racer_native: NativeRoute | None = None

    def _start_asgi_task(self, cycle, app) -> None:
        claim = None
        # not a request uvicorn turned away (its limit_concurrency 503 app), nor one waiting to continue or upgrade
        if app is self.app and not cycle.waiting_for_100_continue and not self.parser.should_upgrade():
            try:
                scope = cycle.scope
                claim = self._racer_native.claim(scope["method"], scope["path"], scope["headers"])
            except Exception:  # noqa: BLE001 - the app's path answers it
                _log().exception("native route: claim failed")
        if claim is None:
            super()._start_asgi_task(cycle, app)
            return
        cycle.racer_claim = claim
        if not cycle.more_body:  # a pipelined request, its body already in
            self.loop.call_soon(self._racer_handle, cycle)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        c = self.cycle
        if getattr(c, "racer_claim", None) is not None:  # bounded by the claim's Content-Length
            self.flow.resume_reading()

    def on_message_complete(self) -> None:
        c = self.cycle
        super().on_message_complete()
        if getattr(c, "racer_claim", None) is not None and not c.more_body:
            self.loop.call_soon(self._racer_handle, c)

    def _racer_handle(self, c) -> None:
        if c.response_complete or c.disconnected:
            return

        def respond(status: int, body: bytes, headers=None) -> None:
            self._racer_respond(c, status, body, headers or {})

        c.body, body = bytearray(), bytes(c.body)
        try:
            pending = self._racer_native.handle(c.racer_claim, body, respond)
        except Exception:  # noqa: BLE001 - a bug in the route: a 500, the connection kept
            _log().exception("native route: handler failed")
            respond(500, b'{"detail": "internal error"}')
            return
        if pending is not None and not c.response_complete:  # a graceful shutdown waits for it
            tasks = self.tasks
            tasks.add(pending)
            pending.add_done_callback(tasks.discard)

    def _racer_respond(self, c, status: int, body: bytes, headers) -> None:
        if c.response_complete:
            return
        if self.flow.write_paused and not c.disconnected:
            # the client is not reading its answers: as uvicorn's send, wait for the buffer to
            # drain before this answer (and the next pipelined request) goes out
            task = self.loop.create_task(self._racer_drained(c, status, body, headers))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            return
        from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE

        extra = []
        for name, value in headers.items():
            n, v = name.encode("latin-1"), value.encode("latin-1")
            if HEADER_RE.search(n) or HEADER_VALUE_RE.search(v):
                raise ValueError(f"invalid header {name!r}: {value!r}")
            extra += [n, b": ", v, b"\r\n"]
        c.response_complete = True
        c.message_event.set()
        if c.disconnected or self.transport.is_closing():
            return
        parts = [STATUS_LINE[status]]
        for name, value in c.default_headers:
            parts += [name, b": ", value, b"\r\n"]
        parts.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
        parts += extra
        if not c.keep_alive:
            parts.append(b"connection: close\r\n")
        parts += [b"\r\n", body]
        self.transport.write(b"".join(parts))
        if not c.keep_alive:
            self.transport.close()
        c.on_response()

    async def _racer_drained(self, c, status: int, body: bytes, headers) -> None:
        await self.flow.drain()  # also released when the connection is lost
        self._racer_respond(c, status, body, headers)


def _log():
    import logging

    return logging.getLogger("racer.http_server")


def _guarded_protocol(base, timeouts: HttpTimeouts, native: NativeRoute | None = None):
    """uvicorn's HTTP protocol class ``base`` with `_ConnectionGuard` over it (``TCP_NODELAY``, the
    head cap and the head and body-idle timers of ``timeouts``), and `_NativeRoutes` for
    ``native`` (httptools' protocol only: h11's serves every request through the app)."""
    mixins = (_ConnectionGuard,)
    if native is not None and base.__name__ == "HttpToolsProtocol":
        mixins = (_ConnectionGuard, _NativeRoutes)

    class GuardedProtocol(*mixins, base):
        _racer_header_s = timeouts.header_timeout_s
        _racer_body_s = timeouts.body_idle_timeout_s
        _racer_max_head = timeouts.max_head_bytes
        _racer_native = native

    GuardedProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedProtocol


def serve_forever(app, host: str, port: int, *, log_level: str = "warning",
                  ready: Callable[[str, int], None] | None = None, timeouts: HttpTimeouts | None = None,
                  native: NativeRoute | None = None) -> None:
    """Bind ``host:port`` (0: a free port), report it through ``ready``, serve ``app`` (any
    ASGI app) until SIGINT/SIGTERM, then return normally after a graceful shutdown.

    Every accepted connection has ``TCP_NODELAY`` set and is bounded in time by ``timeouts``
    (default: `HttpTimeouts.from_env`; see the module docstring); ``native``: a `NativeRoute`
    answered without the app. Call it from the main thread.
    """
    import signal

    import uvicorn

    sock = listen_socket(host, port)
    bound = sock.getsockname()[1]
    if ready is not None:
        ready(host, bound)
    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in
    # place that re-raise is a no-op and the process exits with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: None)
    timeouts = timeouts or HttpTimeouts.from_env()
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=False,
                            timeout_keep_alive=timeouts.keep_alive_s)
    config.load()  # resolves config.http_protocol_class (h11 or httptools)
    config.http_protocol_class = _guarded_protocol(config.http_protocol_class, timeouts, native)
    _gc_tuned_server_class()(config).run(sockets=[sock])


def _gc_tuned_server_class():
    import uvicorn

    class GcTunedServer(uvicorn.Server):
        """uvicorn's server that runs `tune_runtime` once the app's lifespan startup has completed."""

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            tune_runtime()

    return GcTunedServer

