"""HTTP-level checks against a real `racer node-agent` process: keep-alive latency
(TCP_NODELAY, common.http_server), non-finite numbers, chunked bodies over the limit, item ids
out of range."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from .conftest import REPO
from .cp_util import stop_process
from .test_node_agent import free_port, wait_healthy, write_taobao_csv

MAX_BODY = 4 * 2**20  # the agent's default --max-body-bytes
# The servers run on asyncio's own event loop, as with a plain `pip install uvicorn` (the issue's
# setup): uvloop, when installed, sets TCP_NODELAY on every connection itself and hides the defect
# (measured here: healthz keep-alive p50 45.8 ms before the fix without uvloop, 4.4 ms after).
WITHOUT_UVLOOP = "import sys; sys.modules['uvloop'] = None; "


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent")
    csv = write_taobao_csv(tmp / "ub.csv")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    err = open(tmp / "agent.err", "w")
    cmd = [sys.executable, "-c", WITHOUT_UVLOOP + "from racer.cli import main; sys.exit(main(sys.argv[1:]))",
           "node-agent", "--port", str(port), "--trace", "taobao", "--path", str(csv),
           "--num-pages", "128", "--max-history-len", "256", "--embedding-dim", "16", "--num-layers", "1",
           "--head-dim", "8"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(base, proc)
        num_items = httpx.get(f"{base}/v1/metrics").json()["node"]["num_items"]
        yield base, num_items, tmp / "agent.err"
    finally:
        stop_process(proc)
        err.close()


def p50_ms(fn, n: int = 50) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def test_keepalive_requests_cost_no_more_than_fresh_connections(agent):
    base, _, _ = agent
    with httpx.Client(base_url=base) as client:
        assert client.get("/healthz").status_code == 200  # the connection is open from here on

        def keepalive():
            assert client.get("/healthz").status_code == 200

        keep = p50_ms(keepalive)
    clients = [httpx.Client(base_url=base) for _ in range(50)]  # made outside the timed part
    it = iter(clients)

    def fresh():
        c = next(it)
        assert c.get("/healthz").status_code == 200
        c.close()

    new = p50_ms(fresh)
    # before the fix every keep-alive request waited ~40 ms for a delayed ACK (Nagle)
    assert keep <= new + 5.0, (keep, new)


NODELAY_APP = """
import json, os, socket, sys
sys.modules["uvloop"] = None  # asyncio loop (see WITHOUT_UVLOOP)
from common.http_server import serve_forever


def nodelay_of_connection(client):
    # the server's end of the connection from `client` (host, port), found among the process's fds
    for fd in os.listdir("/proc/self/fd"):
        try:
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.getpeername()[:2] == tuple(client):
                return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        except OSError:
            pass
        finally:
            s.close()
    return None


async def app(scope, receive, send):  # a bare ASGI app: serve_forever takes any
    if scope["type"] != "http":
        return
    body = json.dumps({"nodelay": nodelay_of_connection(scope["client"])}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


serve_forever(app, "127.0.0.1", 0, ready=lambda h, p: print(p, flush=True))
"""


def test_serve_forever_sets_nodelay_on_accepted_connections(tmp_path):
    """Any ASGI app served through common.http_server: each accepted connection has TCP_NODELAY
    (read by the server process from its own socket), and keep-alive costs no more than a new
    connection. The socket option is the deterministic check: whether Nagle's algorithm costs
    ~40 ms on a kernel depends on its delayed-ACK behaviour on loopback."""
    script = tmp_path / "app.py"
    script.write_text(NODELAY_APP)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        port = int(proc.stdout.readline())
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            assert [client.get("/").json()["nodelay"] for _ in range(3)] == [1, 1, 1]  # one kept-alive connection
            keep = p50_ms(lambda: client.get("/"), 30)
        assert httpx.get(f"http://127.0.0.1:{port}/").json()["nodelay"] == 1  # a fresh one
        fresh = p50_ms(lambda: httpx.get(f"http://127.0.0.1:{port}/"), 30)
        assert keep <= fresh + 5.0, (keep, fresh)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


NON_FINITE = [
    ('{"user_id": 1, "history": [1, 2], "now_ts": NaN}', "now_ts"),
    ('{"user_id": 1, "history": [1, 2], "now_ts": Infinity}', "now_ts"),
    ('{"user_id": 1, "history": [1, 2], "now_ts": -Infinity}', "now_ts"),
    ('{"user_id": 1, "history": [1, 2], "timestamps": [NaN, 2.0]}', "timestamps.0"),
    ('{"user_id": 1, "history": [1, 2], "timestamps": [1.0, Infinity]}', "timestamps.1"),
    ('{"user_id": 1, "history": [1, 2], "timestamps": [-Infinity, 2.0]}', "timestamps.0"),
    ('{"user_id": 1, "history": [1, NaN]}', "history[1]"),
    ('{"user_id": NaN, "history": [1]}', "user_id"),
    ('{"user_id": 1, "history": [1], "top_k": Infinity}', "top_k"),
]


@pytest.mark.parametrize("text,field", NON_FINITE)
def test_non_finite_numbers_get_422_json_naming_the_field(agent, text, field):
    base, _, _ = agent
    r = httpx.post(f"{base}/v1/recommend", content=text.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    body = r.json()  # JSON, not a plain-text 500
    assert body["error"].startswith(field), body
    assert "NaN" not in r.text or '"NaN"' in r.text  # echoed as a string, never as a bare token


def test_chunked_body_over_the_limit_gets_413(agent):
    base, _, _ = agent

    def chunks():
        yield b'{"user_id": 1, "history": ['
        for _ in range(1500):  # 1500 x 3000 bytes: past the 4 MiB limit, never announced in a header
            yield b"1, " * 1000
        yield b"1]}"

    r = httpx.post(f"{base}/v1/recommend", content=chunks(), headers={"content-type": "application/json"})
    assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
    assert r.status_code == 413, r.text
    assert f"exceeds {MAX_BODY} bytes" in r.json()["error"]
    # a chunked body within the limit is still served
    r = httpx.post(f"{base}/v1/recommend", content=iter([b'{"user_id": 2, ', b'"history": [1, 2, 3]}']),
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert httpx.get(f"{base}/healthz").json()["status"] == "ok"


def test_item_id_out_of_range_names_the_element_and_the_range(agent):
    base, num_items, _ = agent
    for raw, elem in [(b'{"user_id": 1, "history": [1, 2, 1e23]}', "history[2] = 1e+23"),
                      (b'{"user_id": 1, "history": [1, 100000000000000000000000]}', "history[1] = 100000000000000000000000"),
                      (b'{"user_id": 1, "history": [1], "new_items": [3, %d]}' % num_items,
                       f"new_items[1] = {num_items}"),
                      (b'{"user_id": 1, "history": [1], "candidates": [-1]}', "candidates[0] = -1")]:
        r = httpx.post(f"{base}/v1/recommend", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        msg = r.json()["error"]
        assert msg.startswith(elem) and f"[0, {num_items})" in msg, msg


def test_agent_logged_no_traceback(agent):
    _, _, err = agent
    assert "Traceback" not in err.read_text()


def test_finite_validation_errors_answers_422_for_every_non_finite_form():
    """The handler every FastAPI app of the project installs (control plane, gateway)."""
    from fastapi import Body, FastAPI
    from fastapi.testclient import TestClient

    from common.http_server import finite_validation_errors

    app = FastAPI()
    finite_validation_errors(app)

    @app.post("/x")
    async def post_x(x: float = Body(..., embed=True, allow_inf_nan=False)):
        return {"x": x}

    client = TestClient(app)
    for text in ("NaN", "Infinity", "-Infinity"):
        r = client.post("/x", content=f'{{"x": {text}}}', headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "x"]
        assert r.json()["detail"][0]["input"] == text


# ------------------------------------------------------------------ uvicorn's internals, pinned
def _uvicorn_requirement():
    """The uvicorn line of pyproject.toml's dependencies (read as text: tomllib is Python 3.11+)."""
    import re

    from packaging.requirements import Requirement

    lines = re.findall(r'^\s*"(uvicorn[^"]*)",', (REPO / "pyproject.toml").read_text(), re.M)
    assert len(lines) == 1, lines
    return Requirement(lines[0])


def test_uvicorn_is_pinned_to_a_range_and_the_installed_one_is_in_it():
    import uvicorn

    req = _uvicorn_requirement()
    ops = {s.operator for s in req.specifier}
    assert ">=" in ops and "<" in ops, f"uvicorn needs a floor and a ceiling: {req}"
    assert req.specifier.contains(uvicorn.__version__), (uvicorn.__version__, str(req))


CONTRACT_APP_BODY = 10  # bytes the contract test's request body has; it sends them in two parts


async def _contract_app(scope, receive, send):
    """Reads the whole body, then answers it back."""
    body, more = b"", True
    while more:
        msg = await receive()
        body, more = body + msg.get("body", b""), msg.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_the_uvicorn_internals_the_guarded_protocol_uses_behave_as_it_expects(http):
    """`common.http_server._guarded_protocol` subclasses uvicorn's protocol and reads its state:
    the constructor uvicorn's server calls, ``loop``, ``transport``, ``cycle`` (None before the
    first request; ``more_body`` while a body is coming, ``response_complete`` after the
    answer), the hooks it overrides (``connection_made``, ``data_received``,
    ``on_response_complete``, ``connection_lost``) and uvicorn's own keep-alive timer
    (``timeout_keep_alive_task``, armed by ``on_response_complete``). A uvicorn that changes any of
    them fails here, on real sockets, before the servers' timeouts or head cap silently stop."""
    import asyncio
    import inspect
    import socket as socketlib

    import uvicorn
    from uvicorn.server import ServerState

    from common.http_server import HttpTimeouts, _guarded_protocol, listen_socket

    config = uvicorn.Config(_contract_app, http=http, lifespan="off", log_level="warning", timeout_keep_alive=5)
    config.load()
    base = config.http_protocol_class
    for hook in ("connection_made", "data_received", "on_response_complete", "connection_lost"):
        assert hook in vars(base), f"{base.__name__} no longer defines {hook}"
    assert list(inspect.signature(base.__init__).parameters)[1:] == ["config", "server_state", "app_state", "_loop"]
    assert "sockets" in inspect.signature(uvicorn.Server.startup).parameters
    assert inspect.iscoroutinefunction(uvicorn.Server.startup)
    cls = _guarded_protocol(base, HttpTimeouts())
    seen: dict = {}

    async def main():
        loop = asyncio.get_running_loop()
        protos = []

        def make():
            protos.append(cls(config=config, server_state=ServerState(), app_state={}, _loop=loop))
            return protos[-1]

        sock = listen_socket("127.0.0.1", 0)
        server = await loop.create_server(make, sock=sock)
        reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        try:
            await asyncio.sleep(0.05)
            p = protos[0]
            seen["before"] = (p.loop is loop, p.transport is not None, p.cycle, p._racer_timer is not None)
            writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\nhello" % CONTRACT_APP_BODY)
            await writer.drain()
            for _ in range(200):
                if p.cycle is not None:
                    break
                await asyncio.sleep(0.01)
            seen["during"] = (p.cycle.more_body, p.cycle.response_complete)
            writer.write(b"world")
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            seen["answer"] = head.split(b"\r\n")[0], await reader.readexactly(CONTRACT_APP_BODY)
            for _ in range(200):
                if p.cycle.response_complete:
                    break
                await asyncio.sleep(0.01)
            seen["after"] = (p.cycle.more_body, p.cycle.response_complete, p.timeout_keep_alive_task is not None,
                             p._racer_timer)
            nodelay = p.transport.get_extra_info("socket").getsockopt(socketlib.IPPROTO_TCP, socketlib.TCP_NODELAY)
            seen["nodelay"] = bool(nodelay)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())
    assert seen["before"] == (True, True, None, True)  # the head deadline armed at the connection
    assert seen["during"] == (True, False)  # a body is coming: the guard's idle timer applies
    assert seen["answer"] == (b"HTTP/1.1 200 OK", b"helloworld")
    assert seen["after"] == (False, True, True, None)  # uvicorn's keep-alive timer took over from the guard's
    assert seen["nodelay"] is True


def test_refreeze_collects_what_was_frozen_and_replaced():
    """A reset in place replaces objects `tune_runtime` froze: `refreeze_runtime` collects them
    (their cycles included) before the next run, and freezes what is alive."""
    import gc
    import weakref

    from common.http_server import refreeze_runtime

    class Node:
        pass

    old = Node()
    old.self = old  # a cycle: only the cyclic collector frees it
    gone = weakref.ref(old)
    try:
        gc.freeze()
        del old
        gc.collect()
        assert gone() is not None  # frozen: a collection does not free it
        assert refreeze_runtime() > 0
        assert gone() is None
    finally:
        gc.unfreeze()
