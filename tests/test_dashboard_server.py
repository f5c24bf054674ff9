"""The dashboard's own server against hostile clients, on a real `racer dashboard` process: it is
served by uvicorn through `common.http_server` (not Werkzeug's development server), so

- a chunked body with an absurd chunk size (``ffffffffffffffffff``) is refused at once and the
  process's memory does not grow (it grew ~550 MB/s on the development server);
- a body past the cap gets 413, counted as it comes, before a callback sees it;
- a huge request head gets 431;
- connections that never send a whole head are closed after the head timeout, and the page is
  served while hundreds of them are open;
- SIGTERM is a clean exit.

No control plane runs here: the page and the hostile requests never need one.
"""

from __future__ import annotations

import os
import socket
import time

import httpx
import pytest

from .procs import free_port, racer_cmd, spawn, stop

TIMEOUT_S = 2.0


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def dash(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash-server")
    port = free_port()
    log = tmp / "dashboard.log"
    proc = spawn(racer_cmd("dashboard", "--control-plane", f"http://127.0.0.1:{free_port()}", "--port", str(port)),
                 log, env={"RACER_HTTP_HEADER_TIMEOUT_S": str(TIMEOUT_S),
                           "RACER_HTTP_BODY_IDLE_TIMEOUT_S": str(TIMEOUT_S)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            if httpx.get(url + "/", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the dashboard did not answer within 90 s"
        time.sleep(0.3)
    yield {"url": url, "port": port, "proc": proc, "log": log}
    assert stop(proc) == 0, log.read_text()[-2000:]


def _read_all(s: socket.socket, timeout_s: float = 5.0) -> bytes:
    s.settimeout(timeout_s)
    out = b""
    try:
        while True:
            b = s.recv(65536)
            if not b:
                return out
            out += b
    except (socket.timeout, ConnectionResetError):
        return out


def test_an_absurd_chunk_size_is_refused_and_memory_stays_flat(dash):
    pid = dash["proc"].pid
    before = _rss_mb(pid)
    s = socket.create_connection(("127.0.0.1", dash["port"]), timeout=10)
    s.sendall(b"POST /_dash-update-component HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n")
    sent = 0
    try:
        for _ in range(64):  # up to 64 MiB more, unless the server has closed
            s.sendall(b"a" * 2**20)
            sent += 2**20
    except (BrokenPipeError, ConnectionResetError):
        pass
    answer = _read_all(s)
    s.close()
    assert sent < 32 * 2**20, sent  # the server stopped reading long before
    if answer:
        assert answer.split(b" ", 2)[1] in (b"400", b"413"), answer[:200]
    assert _rss_mb(pid) - before < 100, (before, _rss_mb(pid))
    assert httpx.get(dash["url"] + "/", timeout=10).status_code == 200


def test_a_chunked_body_past_the_cap_gets_413_before_a_callback_sees_it(dash):
    from dashboard.app import MAX_BODY_BYTES

    pid = dash["proc"].pid
    before = _rss_mb(pid)
    s = socket.create_connection(("127.0.0.1", dash["port"]), timeout=10)
    s.sendall(b"POST /_dash-update-component HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"100000\r\n" + b"a" * 2**20 + b"\r\n"  # 1 MiB chunks, well formed
    sent = 0
    try:
        while sent < MAX_BODY_BYTES + 8 * 2**20:
            s.sendall(chunk)
            sent += 2**20
    except (BrokenPipeError, ConnectionResetError):
        pass
    answer = _read_all(s)
    s.close()
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"exceeds" in answer
    assert _rss_mb(pid) - before < MAX_BODY_BYTES / 2**20 + 100


def test_a_body_announced_past_the_cap_gets_413_unread(dash):
    from dashboard.app import MAX_BODY_BYTES

    s = socket.create_connection(("127.0.0.1", dash["port"]), timeout=10)
    s.sendall(b"POST /_dash-update-component HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n{}" % (MAX_BODY_BYTES + 1))
    answer = _read_all(s)
    s.close()
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]


def test_a_huge_head_gets_431(dash):
    s = socket.create_connection(("127.0.0.1", dash["port"]), timeout=10)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
    answer = b""
    try:
        for _ in range(64):
            s.sendall(b"a" * 16384)
            s.settimeout(0.05)
            try:
                answer = s.recv(65536)
                if answer:
                    break
            except socket.timeout:
                pass
    except (BrokenPipeError, ConnectionResetError):
        pass
    answer += _read_all(s, 2.0)
    s.close()
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]


def test_slow_connections_are_closed_and_the_page_is_served_meanwhile(dash):
    socks = []
    try:
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", dash["port"]), timeout=10)
            if i % 2:
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the head never ends
            socks.append(s)
        t = time.perf_counter()
        assert httpx.get(dash["url"] + "/", timeout=10).status_code == 200
        assert time.perf_counter() - t < 5
        time.sleep(TIMEOUT_S + 2.0)
        closed = 0
        for s in socks:
            s.setblocking(False)
            try:
                closed += s.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        assert closed == len(socks), f"{closed} of {len(socks)} closed"
    finally:
        for s in socks:
            s.close()
    assert os.path.exists(f"/proc/{dash['proc'].pid}")


def test_bodies_in_progress_share_one_budget():
    """`BodyLimit`'s budget over concurrent requests: while one body holds most of it, a second
    that would pass it gets 503 with Retry-After; once the first is done its bytes are free."""
    import asyncio

    from common.http_server import BodyLimit

    async def app(scope, receive, send):
        body = (await receive())["body"]
        await gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})

    def request(n_chunks: int):
        msgs = [{"type": "http.request", "body": b"a" * 1000, "more_body": i < n_chunks - 1} for i in range(n_chunks)]

        async def receive():
            return msgs.pop(0) if msgs else {"type": "http.disconnect"}
        return receive

    async def call(mw, receive):
        out = []

        async def send(m):
            out.append(m)
        await mw({"type": "http", "headers": []}, receive, send)
        return out[0]["status"], dict(out[0].get("headers", [])), out[1]["body"]

    async def main():
        mw = BodyLimit(app, max_bytes=10_000, budget_bytes=6_000)
        first = asyncio.create_task(call(mw, request(5)))
        await asyncio.sleep(0.05)
        assert mw.held_bytes == 5_000
        status, headers, body = await call(mw, request(2))
        assert status == 503 and headers[b"retry-after"] == b"1" and b"busy" in body
        gate.set()
        assert (await first)[0] == 200
        assert mw.held_bytes == 0
        assert (await call(mw, request(2)))[0] == 200

    gate = None

    async def run():
        nonlocal gate
        gate = asyncio.Event()
        await main()
    asyncio.run(run())


def test_one_token_cannot_push_the_others_sessions_out_and_sessions_expire():
    """A viewer signed in 1,000 times in 6.6 s and pushed the operators' sessions out; sessions
    never expired. Now a token holds at most ``max_per_token`` sessions, and idle or old ones end."""
    from dashboard.signin import Session, SessionStore

    t = [1000.0]
    store = SessionStore(max_sessions=50, max_per_token=4, idle_s=60, max_age_s=600, clock=lambda: t[0])
    op = store.add(Session("op-token", "admin", "operator"))
    for _ in range(1000):
        store.add(Session("viewer-token", "v", "viewer"))
        t[0] += 0.001
    assert store.get(op) is not None and store.get(op).role == "operator"
    assert len(store) == 5  # the operator's one and the viewer's four
    # idle past idle_s: gone; used within it: kept, until max_age_s in all
    t[0] += 59
    assert store.get(op) is not None
    for _ in range(10):
        t[0] += 50
        assert store.get(op) is not None
    t[0] += 50  # 610 s since sign-in
    assert store.get(op) is None
    t[0] += 61
    assert store.add(Session("x", "x", "viewer")) and len(store) == 1  # the viewer's idle ones expired
