"""A pooled HTTP/1.1 keep-alive client over `asyncio.Protocol`, one request at a time per
connection: the gateway's forwarding to node agents and the replay's load generator.

Why not httpx on these paths: per request the gateway parses, routes and forwards, and an httpx
``AsyncClient.post`` costs more CPU than the routing itself (its request/response models, header
normalisation, the httpcore pool's locks and events); a load generator that spends milliseconds
of CPU per request saturates before the fleet it measures when both share a machine. The gateway
keeps httpx for its background traffic (health checks, residency feeds, weights, the registry);
``bench.gateway`` measures the difference.

    pool = UpstreamPool("http://10.0.0.5:8000", max_connections=64, connect_timeout_s=1.0)
    status, body = await pool.post("/v1/recommend", body_bytes, timeout_s=10.0)
    await pool.close()

Semantics:

- answers are parsed by httptools' response parser (llhttp, the parser uvicorn serves with):
  ``Content-Length``, ``Transfer-Encoding: chunked`` (trailers ignored) or, with neither, a body
  read until the server closes; an answer that does not keep the connection alive
  (``Connection: close``, HTTP/1.0) closes it after the answer, and so do bytes after the answer;
  1xx interim answers are skipped; an answer that is not HTTP/1.x is refused;
- bounds: the head at 64 KiB, the body at ``max_body_bytes`` (64 MiB unless given; a larger
  ``Content-Length`` is refused before its body is read);
- at most ``max_connections`` requests in flight (more wait for a connection);
- a *reused* idle connection that the server closed before answering (keep-alive timeouts race
  with a new request) is retried once on a fresh connection: nothing of an answer was received;
- errors: `UpstreamTimeout` (connect or answer took too long; the connection is dropped, since
  a late answer would otherwise be read as the next request's), `UpstreamConnectError` (refused,
  reset, closed, malformed or oversized answer). Both are `UpstreamError`.
"""

from __future__ import annotations

import asyncio
import re
import socket
from urllib.parse import urlsplit

import httptools

__all__ = ["UpstreamConnectError", "UpstreamError", "UpstreamPool", "UpstreamTimeout"]

_MAX_HEAD = 64 * 1024
_MAX_BODY = 64 * 2**20  # an answer's body, unless the pool says otherwise (max_body_bytes)
_TOKEN_OK = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+").fullmatch  # an HTTP header name (RFC 9110 token)


class UpstreamError(Exception):
    """The node could not be reached or did not answer properly."""


class UpstreamTimeout(UpstreamError):
    """Connecting or waiting for the answer took longer than allowed."""


class UpstreamConnectError(UpstreamError):
    """Refused, reset or closed connection, or an answer that is not HTTP/1.x."""


class _Extra(Exception):
    """Bytes after a complete answer (pipelined, or after ``Connection: close``)."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; `request` sends one request and awaits its full answer.

    Answers are read by one httptools response parser (llhttp) per connection, whose callbacks
    are this object's ``on_*`` methods: it delimits the answer (``Content-Length``, chunked with
    trailers, or the server's close), skips 1xx interim answers and says whether the connection
    may be kept. What it does not bound is bounded here: the head at ``_MAX_HEAD`` bytes, the
    body at ``max_body_bytes``. A callback stops the parser by raising `UpstreamConnectError` (or
    `_Extra`), which httptools hands back as the context of its `HttpParserCallbackError`."""

    def __init__(self, max_body_bytes: int = _MAX_BODY) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = False  # served at least one answer (so a failure before any byte may be a stale socket)
        self.max_body_bytes = max_body_bytes
        self._parser = httptools.HttpResponseParser(self)
        self._fut: asyncio.Future | None = None
        self._begin_answer()

    def _begin_answer(self) -> None:
        self._status = 0
        self._body = bytearray()
        self._head_bytes = 0  # the head's bytes counted from the parser's callbacks (interim answers' too)
        self._raw_bytes = 0  # bytes received while the final answer's head was incomplete
        self._head_done = False
        self._complete = False
        self._keep_alive = False
        self._length: int | None = None
        self._chunked = False
        self._got_bytes = False

    # ---- asyncio.Protocol
    def connection_made(self, transport) -> None:  # noqa: D401 - asyncio hook
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def connection_lost(self, exc) -> None:  # noqa: D401 - asyncio hook
        self.closed = True
        fut = self._fut
        if fut is not None and not fut.done():
            if self._head_done and not self._complete and self._length is None and not self._chunked:
                fut.set_result((self._status, bytes(self._body)))  # body delimited by the close
            else:
                err = UpstreamConnectError(f"connection closed by the node{'' if exc is None else f': {exc}'}")
                err.before_answer = not self._got_bytes  # type: ignore[attr-defined]
                fut.set_exception(err)

    def data_received(self, data: bytes) -> None:  # noqa: D401 - asyncio hook
        fut = self._fut
        if fut is None or fut.done():
            self.close()  # bytes nobody asked for: the connection is out of step
            return
        try:
            self._feed(data)
        except _Extra:
            self._keep_alive = False  # the answer stands; the connection is out of step
        except UpstreamConnectError as e:
            fut.set_exception(e)
            self.close()
            return
        if self._complete:
            fut.set_result((self._status, bytes(self._body)))

    # ---- parsing: httptools' callbacks
    def on_message_begin(self) -> None:
        if self._complete:
            raise _Extra  # a second answer to one request
        self._length, self._chunked = None, False

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head_done:
            return  # a chunked answer's trailers: ignored
        self._head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self._head_bytes > _MAX_HEAD:
            raise UpstreamConnectError(f"answer head over {_MAX_HEAD // 1024} KiB")
        name = name.lower()
        if name == b"content-length":
            self._length = int(value)  # llhttp checked the digits
            if self._length > self.max_body_bytes:
                raise UpstreamConnectError(f"answer body of {self._length} bytes is over the "
                                           f"{self.max_body_bytes}-byte limit")
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            self._chunked = True

    def on_headers_complete(self) -> None:
        p = self._parser
        version = p.get_http_version()
        if not version.startswith("1."):
            raise UpstreamConnectError(f"not an HTTP/1.x answer: HTTP/{version}")
        status = p.get_status_code()
        if status >= 200:  # 1xx: an interim answer (100 Continue), the real one follows
            self._status, self._head_done, self._keep_alive = status, True, p.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if len(self._body) + len(body) > self.max_body_bytes:
            raise UpstreamConnectError(f"answer body over the {self.max_body_bytes}-byte limit")
        self._body += body

    def on_message_complete(self) -> None:
        if self._head_done:
            self._complete = True
            self._keep_alive = self._keep_alive and self._parser.should_keep_alive()

    def _feed(self, data: bytes) -> None:
        """Parse ``data``; raises `UpstreamConnectError` for a malformed or oversized answer and
        `_Extra` for bytes after a complete one."""
        first = not self._got_bytes
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            raise (e.__context__ if isinstance(e.__context__, (UpstreamConnectError, _Extra))
                   else UpstreamConnectError(f"malformed answer from the node: {e}")) from None
        except httptools.HttpParserUpgrade:
            raise UpstreamConnectError("the node switched protocols (101); an HTTP/1.x answer was expected") from None
        except httptools.HttpParserError as e:
            if self._complete:
                raise _Extra from None  # e.g. data after a `Connection: close` answer
            if first and not data.startswith(b"HTTP/"):
                raise UpstreamConnectError(f"not an HTTP/1.x answer: {bytes(data[:80])!r} ({e})") from None
            raise UpstreamConnectError(f"malformed answer from the node: {e}") from None
        if not self._head_done:
            self._raw_bytes += len(data)
            if self._raw_bytes > _MAX_HEAD:
                raise UpstreamConnectError(f"answer head over {_MAX_HEAD // 1024} KiB")

    # ---- use
    async def request(self, raw: bytes, timeout_s: float) -> tuple[int, bytes]:
        if self.closed or self.transport is None or self.transport.is_closing():
            err = UpstreamConnectError("connection already closed")
            err.before_answer = True  # type: ignore[attr-defined]
            raise err
        loop = asyncio.get_running_loop()
        self._begin_answer()
        self._fut = fut = loop.create_future()
        self.transport.write(raw)
        handle = loop.call_later(timeout_s, _expire, fut, timeout_s)
        try:
            out = await fut
        finally:
            handle.cancel()
            self._fut = None
        self.used = True
        if not (self._complete and self._keep_alive):
            self.close()
        return out

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(fut: asyncio.Future, timeout_s: float) -> None:
    if not fut.done():
        fut.set_exception(UpstreamTimeout(f"no answer within {timeout_s:g} s"))


class UpstreamPool:
    """Keep-alive connections to one node (see the module docstring)."""

    def __init__(self, base_url: str, *, max_connections: int = 64, connect_timeout_s: float = 1.0,
                 max_body_bytes: int = _MAX_BODY) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"upstream address must be http://host:port, got {base_url!r}")
        self.address = base_url
        self.host, self.port = u.hostname, u.port or 80
        self._host_header = f"{self.host}:{self.port}" if u.port else self.host
        self.connect_timeout_s = connect_timeout_s
        if max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be > 0, got {max_body_bytes}")
        self.max_body_bytes = max_body_bytes
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    def _raw(self, method: str, path: str, body: bytes, content_type: str,
             headers: dict[str, str] | None = None) -> bytes:
        extra = ""
        for name, value in (headers or {}).items():
            if not _TOKEN_OK(name) or any(c in value for c in "\r\n\0"):
                raise ValueError(f"header {name!r}: a name must be a token and a value one line")
            extra += f"{name}: {value}\r\n"
        return (f"{method} {path} HTTP/1.1\r\nHost: {self._host_header}\r\nContent-Type: {content_type}\r\n"
                f"{extra}Content-Length: {len(body)}\r\n\r\n").encode("latin-1") + body

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _t, conn = await loop.create_connection(lambda: _Conn(self.max_body_bytes), self.host, self.port)
        except TimeoutError:
            raise UpstreamTimeout(f"connect to {self.host}:{self.port} took over {self.connect_timeout_s:g} s") from None
        except OSError as e:
            raise UpstreamConnectError(f"connect to {self.host}:{self.port}: {e.strerror or e}") from None
        return conn

    async def post(self, path: str, body: bytes, *, timeout_s: float, content_type: str = "application/json",
                   headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """Send one request (``headers``: extra header lines, each a token name and a one-line
        latin-1 value, else `ValueError`); ``(status, body)`` of the answer, or an `UpstreamError`."""
        if self._closed:
            raise UpstreamConnectError("upstream pool closed")
        raw = self._raw("POST", path, body, content_type, headers)
        async with self._slots:
            conn = None
            while self._idle:
                c = self._idle.pop()
                if not c.closed:
                    conn = c
                    break
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            try:
                out = await conn.request(raw, timeout_s)
            except UpstreamConnectError as e:
                conn.close()
                if not (reused and getattr(e, "before_answer", False)):
                    raise
                conn = await self._connect()  # a stale keep-alive socket: once more on a fresh one
                try:
                    out = await conn.request(raw, timeout_s)
                except UpstreamError:
                    conn.close()
                    raise
            except BaseException:  # timeout or cancellation: a late answer must not reach the next request
                conn.close()
                raise
            if not conn.closed and not self._closed:
                self._idle.append(conn)
            else:
                conn.close()
            return out

    async def close(self) -> None:
        self._closed = True
        for c in self._idle:
            c.close()
        self._idle.clear()
