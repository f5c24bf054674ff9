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

- responses with ``Content-Length``, ``Transfer-Encoding: chunked`` (trailers ignored) or, with
  neither, a body read until the server closes; ``Connection: close`` from the server closes the
  connection after the answer; 1xx interim answers are skipped;
- at most ``max_connections`` requests in flight (more wait for a connection);
- a *reused* idle connection that the server closed before answering (keep-alive timeouts race
  with a new request) is retried once on a fresh connection: nothing of an answer was received;
- errors: `UpstreamTimeout` (connect or answer took too long; the connection is dropped, since
  a late answer would otherwise be read as the next request's), `UpstreamConnectError` (refused,
  reset, closed, malformed answer). Both are `UpstreamError`.
"""

from __future__ import annotations

import asyncio
import re
import socket
from urllib.parse import urlsplit

__all__ = ["UpstreamConnectError", "UpstreamError", "UpstreamPool", "UpstreamTimeout"]

_MAX_HEAD = 64 * 1024
_TOKEN_OK = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+").fullmatch  # an HTTP header name (RFC 9110 token)


class UpstreamError(Exception):
    """The node could not be reached or did not answer properly."""


class UpstreamTimeout(UpstreamError):
    """Connecting or waiting for the answer took longer than allowed."""


class UpstreamConnectError(UpstreamError):
    """Refused, reset or closed connection, or an answer that is not HTTP/1.x."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; `request` sends one request and awaits its full answer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = False  # served at least one answer (so a failure before any byte may be a stale socket)
        self._fut: asyncio.Future | None = None
        self._reset()

    def _reset(self) -> None:
        self._buf = bytearray()
        self._status = 0
        self._head_done = False
        self._length: int | None = None
        self._chunked = False
        self._close_after = False
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
            if self._head_done and self._length is None and not self._chunked:
                fut.set_result((self._status, bytes(self._buf)))  # body delimited by the close
            else:
                err = UpstreamConnectError(f"connection closed by the node{'' if exc is None else f': {exc}'}")
                err.before_answer = not self._got_bytes  # type: ignore[attr-defined]
                fut.set_exception(err)

    def data_received(self, data: bytes) -> None:  # noqa: D401 - asyncio hook
        fut = self._fut
        if fut is None or fut.done():
            self.close()  # bytes nobody asked for: the connection is out of step
            return
        self._got_bytes = True
        self._buf += data
        try:
            done = self._parse()
        except UpstreamConnectError as e:
            fut.set_exception(e)
            self.close()
            return
        if done is not None:
            fut.set_result(done)

    # ---- parsing
    def _parse(self) -> tuple[int, bytes] | None:
        while not self._head_done:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > _MAX_HEAD:
                    raise UpstreamConnectError("answer head over 64 KiB")
                return None
            head = bytes(self._buf[:end]).split(b"\r\n")
            del self._buf[:end + 4]
            parts = head[0].split(b" ", 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
                raise UpstreamConnectError(f"not an HTTP/1.x answer: {head[0][:80]!r}")
            status = int(parts[1])
            if 100 <= status < 200:
                continue  # interim answer (100 Continue): the real one follows
            self._status, self._head_done = status, True
            for line in head[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                value = value.strip().lower()
                if name == b"content-length":
                    if not value.isdigit():
                        raise UpstreamConnectError(f"bad Content-Length {value[:40]!r}")
                    self._length = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value:
                    self._chunked = True
                elif name == b"connection" and value == b"close":
                    self._close_after = True
            if status in (204, 304):
                self._length = 0
        if self._chunked:
            return self._parse_chunked()
        if self._length is not None and len(self._buf) >= self._length:
            return self._status, bytes(self._buf[:self._length])
        return None

    def _parse_chunked(self) -> tuple[int, bytes] | None:
        body, pos, buf = bytearray(), 0, self._buf
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            size_txt = bytes(buf[pos:eol]).split(b";", 1)[0].strip()
            try:
                size = int(size_txt, 16)
            except ValueError:
                raise UpstreamConnectError(f"bad chunk size {size_txt[:20]!r}") from None
            if size == 0:
                end = buf.find(b"\r\n\r\n", eol)  # trailers (usually none) end with an empty line
                if end < 0 and buf[eol:eol + 4] != b"\r\n\r\n":
                    return None
                return self._status, bytes(body)
            start = eol + 2
            if len(buf) < start + size + 2:
                return None
            body += buf[start:start + size]
            pos = start + size + 2

    # ---- use
    async def request(self, raw: bytes, timeout_s: float) -> tuple[int, bytes]:
        if self.closed or self.transport is None or self.transport.is_closing():
            err = UpstreamConnectError("connection already closed")
            err.before_answer = True  # type: ignore[attr-defined]
            raise err
        loop = asyncio.get_running_loop()
        self._reset()
        self._fut = fut = loop.create_future()
        self.transport.write(raw)
        handle = loop.call_later(timeout_s, _expire, fut, timeout_s)
        try:
            out = await fut
        finally:
            handle.cancel()
            self._fut = None
        self.used = True
        if self._close_after:
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

    def __init__(self, base_url: str, *, max_connections: int = 64, connect_timeout_s: float = 1.0) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"upstream address must be http://host:port, got {base_url!r}")
        self.address = base_url
        self.host, self.port = u.hostname, u.port or 80
        self._host_header = f"{self.host}:{self.port}" if u.port else self.host
        self.connect_timeout_s = connect_timeout_s
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
                _t, conn = await loop.create_connection(_Conn, self.host, self.port)
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
