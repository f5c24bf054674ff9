"""`common.http_server.NativeRoute`: requests a route claims are answered in the HTTP protocol,
without the ASGI app, and the connection behaves as uvicorn's own answers leave it (keep-alive,
pipelining in order, ``Connection: close``, HTTP/1.0, a client gone before the answer, a failing
handler, a graceful shutdown waiting for a pending answer); what the route does not claim goes to
the app. Then the control plane's report route on it (`control_plane.routes.report_ingest.
IngestNative`): a known node's batches take it and are stored once; a refused token, an
unregistered node, an over-cap or chunked body take the app's path and get its answers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from .conftest import REPO
from .cp_util import ControlPlane, Database, register, report, stop_process

TOY_SERVER = """
import asyncio, json, sys
if sys.argv[1] == "asyncio":
    sys.modules["uvloop"] = None  # asyncio's own loop
from common.http_server import NativeRoute, serve_forever


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        msg = await receive()
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
    out = json.dumps({"native": False, "len": len(body), "path": scope["path"]}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


class Toy(NativeRoute):
    def claim(self, method, path, headers):
        h = dict(headers)
        if method != "POST" or not path.startswith("/native") or b"transfer-encoding" in h:
            return None
        n = h.get(b"content-length", b"")
        if not n.isdigit() or int(n) > 64:
            return None
        return path

    def handle(self, claim, body, respond):
        out = json.dumps({"native": True, "len": len(body), "path": claim}).encode()
        if claim == "/native/boom":
            raise RuntimeError("boom")
        if claim == "/native/later":
            loop = asyncio.get_running_loop()
            fut = loop.create_future()

            def answer():
                respond(201, out, {"x-later": "yes"})
                print("later answered", flush=True, file=sys.stderr)
                fut.set_result(None)

            loop.call_later(0.5, answer)
            return fut
        respond(200, out)
        return None


serve_forever(app, "127.0.0.1", 0, ready=lambda h, p: print(p, flush=True), native=Toy())
"""


@pytest.fixture(params=["uvloop", "asyncio"])
def toy(request, tmp_path):
    script = tmp_path / "toy.py"
    script.write_text(TOY_SERVER)
    err = open(tmp_path / "toy.err", "w")
    proc = subprocess.Popen([sys.executable, str(script), request.param], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=err, text=True, env={**os.environ, "PYTHONPATH": str(REPO),
                                                        "RACER_HTTP_BODY_IDLE_TIMEOUT_S": "1"})
    try:
        port = int(proc.stdout.readline())
        yield proc, port, tmp_path / "toy.err"
    finally:
        stop_process(proc)
        err.close()


def connect(port: int) -> socket.socket:
    """A connection to the toy server (its port is bound before it listens: retried a while)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=10)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def post(path: str, body: bytes = b"{}", extra: str = "", version: str = "1.1") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def read_answer(sock: socket.socket, buf: bytearray) -> tuple[int, dict, bytes]:
    """One answer off ``sock`` (``buf``: bytes already read past the previous one)."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before an answer; got {bytes(buf)!r}")
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed inside a body")
        rest += chunk
    buf[:] = rest[n:]
    return int(lines[0].split()[1]), headers, rest[:n]


def closed_by_server(sock: socket.socket, within_s: float = 5.0) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except (socket.timeout, ConnectionResetError):
        return False


def test_a_claimed_request_is_answered_natively_and_the_connection_stays_usable(toy):
    _, port, err = toy
    with connect(port) as s:
        buf = bytearray()
        for i in range(3):  # keep-alive: one connection, several answers
            s.sendall(post("/native", b"x" * (10 + i)))
            status, headers, body = read_answer(s, buf)
            assert status == 200 and json.loads(body) == {"native": True, "len": 10 + i, "path": "/native"}
            assert headers["content-type"] == "application/json" and "date" in headers
            assert "connection" not in headers
        # not claimed: too large for the route, another path, a chunked body: the app answers
        s.sendall(post("/native", b"y" * 65))
        assert json.loads(read_answer(s, buf)[2]) == {"native": False, "len": 65, "path": "/native"}
        s.sendall(post("/other", b"z"))
        assert json.loads(read_answer(s, buf)[2])["native"] is False
        s.sendall(b"POST /native HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
        assert json.loads(read_answer(s, buf)[2]) == {"native": False, "len": 3, "path": "/native"}
        # a body trickled in three reads
        s.sendall(b"POST /native HTTP/1.1\r\nHost: t\r\nContent-Length: 9\r\n\r\nabc")
        time.sleep(0.05)
        s.sendall(b"def")
        time.sleep(0.05)
        s.sendall(b"ghi")
        assert json.loads(read_answer(s, buf)[2]) == {"native": True, "len": 9, "path": "/native"}
    assert "Traceback" not in err.read_text()


def test_pipelined_requests_are_answered_in_order_native_or_not(toy):
    _, port, _ = toy
    with connect(port) as s:
        s.sendall(post("/native/later", b"a") + post("/app", b"bb") + post("/native", b"ccc") + post("/native", b""))
        buf = bytearray()
        got = [read_answer(s, buf) for _ in range(4)]
    assert [(st, json.loads(b)["path"], json.loads(b)["len"]) for st, _, b in got] == [
        (201, "/native/later", 1), (200, "/app", 2), (200, "/native", 3), (200, "/native", 0)]
    assert got[0][1]["x-later"] == "yes"


@pytest.mark.parametrize("how", ["connection-close", "http-1.0"])
def test_a_request_that_does_not_keep_the_connection_gets_it_closed_after_the_answer(toy, how):
    _, port, _ = toy
    with connect(port) as s:
        s.sendall(post("/native", b"q", extra="Connection: close\r\n") if how == "connection-close"
                  else post("/native", b"q", version="1.0"))
        status, headers, body = read_answer(s, bytearray())
        assert status == 200 and json.loads(body)["native"] is True
        assert headers.get("connection") == "close"
        assert closed_by_server(s)


def test_a_failing_handler_is_a_500_and_a_client_gone_before_the_answer_harms_nothing(toy):
    _, port, err = toy
    with connect(port) as s:
        buf = bytearray()
        s.sendall(post("/native/boom"))
        status, _, body = read_answer(s, buf)
        assert status == 500 and json.loads(body) == {"detail": "internal error"}
        s.sendall(post("/native", b"after"))
        assert json.loads(read_answer(s, buf)[2])["native"] is True  # the connection still serves
    with connect(port) as s:
        s.sendall(post("/native/later", b"gone"))
    time.sleep(0.8)  # the deferred answer comes after the client left
    with connect(port) as s:
        s.sendall(post("/native", b"next"))
        assert json.loads(read_answer(s, bytearray())[2]) == {"native": True, "len": 4, "path": "/native"}
    assert "boom" in err.read_text()  # logged, with its traceback


def test_a_graceful_shutdown_waits_for_a_pending_native_answer(toy):
    proc, port, _ = toy
    with connect(port) as s:
        s.sendall(post("/native/later", b"wait"))
        time.sleep(0.1)  # the request is in, its answer 0.5 s away
        proc.send_signal(signal.SIGTERM)
        status, headers, body = read_answer(s, bytearray())
        assert status == 201 and json.loads(body)["len"] == 4
        assert headers.get("connection") == "close"  # the server is going: no keep-alive
    assert proc.wait(timeout=20) == 0


def test_a_request_waiting_to_continue_or_upgrading_is_never_claimed(toy):
    _, port, _ = toy
    with connect(port) as s:
        buf = bytearray()
        s.sendall(b"POST /native HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
        status, _, _ = read_answer(s, buf)
        assert status == 100  # the app asked for the body: it is the app's request
        s.sendall(b"ok")
        assert json.loads(read_answer(s, buf)[2]) == {"native": False, "len": 2, "path": "/native"}
    with connect(port) as s:
        s.sendall(post("/native", b"up", extra="Connection: Upgrade\r\nUpgrade: h2c\r\n"))
        assert json.loads(read_answer(s, bytearray())[2])["native"] is False


def test_a_claimed_body_that_stalls_is_cut_by_the_body_idle_timer(toy):
    _, port, _ = toy
    with connect(port) as s:
        s.sendall(b"POST /native HTTP/1.1\r\nHost: t\r\nContent-Length: 20\r\n\r\nhalf")
        t0 = time.monotonic()
        assert closed_by_server(s, within_s=10)  # RACER_HTTP_BODY_IDLE_TIMEOUT_S 1 in the fixture
        assert time.monotonic() - t0 < 8


def test_answers_to_a_client_that_reads_late_all_arrive_in_order(toy):
    """A client pipelining a thousand claimed requests into a small receive buffer: the server's
    write buffer fills (its answers wait for it to drain, as uvicorn's own do) and every answer
    still arrives, in order, once the client reads."""
    _, port, _ = toy
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    deadline = time.monotonic() + 20
    while True:
        try:
            s.connect(("127.0.0.1", port))
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    s.settimeout(30)
    with s:
        n = 1000
        s.sendall(b"".join(post("/native", b"%d" % i) for i in range(n)))
        time.sleep(1.0)  # the server answers into a full buffer meanwhile
        buf = bytearray()
        lens = [json.loads(read_answer(s, buf)[2])["len"] for _ in range(n)]
    assert lens == [len(b"%d" % i) for i in range(n)]


def test_a_graceful_shutdown_waits_for_a_pending_answer_of_a_client_gone(toy):
    proc, port, err = toy
    with connect(port) as s:
        s.sendall(post("/native/later", b"left"))
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # no connection is open: only the pending answer holds the server
    assert proc.wait(timeout=20) == 0
    assert "later answered" in err.read_text()


# ---- the control plane's report route


@pytest.fixture(scope="module")
def cp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("native")
    d = Database("sqlite", tmp)
    c = ControlPlane(d.url, tmp / "cp.log", env={"RACER_MAX_REPORT_BODY_BYTES": "65536"}, scheduler=False)
    yield c
    c.stop()
    d.drop()


def _native_count(cp) -> float:
    for line in httpx.get(cp.base + "/metrics").text.splitlines():
        if line.startswith("racer_cp_ingest_native_requests_total "):
            return float(line.split()[1])
    raise AssertionError("racer_cp_ingest_native_requests_total missing")


def test_a_known_nodes_batches_take_the_native_route_and_are_stored_once(cp):
    node = cp.node("nat-1")
    register(node, "nat-1")
    before = _native_count(cp)
    for seq in range(5):
        r = node.post("/nodes/nat-1/reports", json={"reports": [report(seq, ts_s=1000.0 + seq)]})
        assert r.status_code == 200 and r.json() == {"stored": 1, "duplicates": 0}, r.text
    r = node.post("/nodes/nat-1/reports", json={"reports": [report(3, ts_s=1003.0), report(5, ts_s=1005.0)]})
    assert r.json() == {"stored": 1, "duplicates": 1}  # a replay is stored once
    # every batch after the first (whose token the gate had not cached yet) was answered natively
    assert _native_count(cp) - before >= 5
    hist = cp.admin.get("/reports", params={"node_id": "nat-1"}).json()
    assert sorted(x["seq"] for x in hist) == [0, 1, 2, 3, 4, 5]
    # the node's latest figures are on /metrics (rendered at the scrape)
    assert 'racer_node_emb_share_ratio{node_id="nat-1"} 0.5' in httpx.get(cp.base + "/metrics").text


def test_what_the_native_route_does_not_claim_gets_the_apps_answers(cp):
    node = cp.node("nat-2")
    register(node, "nat-2")
    ok = {"reports": [report(0, ts_s=1000.0)]}
    assert node.post("/nodes/nat-2/reports", json=ok).status_code == 200
    before = _native_count(cp)
    other = cp.node("nat-3")
    register(other, "nat-3")
    assert other.post("/nodes/nat-2/reports", json=ok).status_code == 403  # another node's token
    assert cp.client("no-such-token").post("/nodes/nat-2/reports", json=ok).status_code == 401
    assert cp.client(None).post("/nodes/nat-2/reports", json=ok).status_code == 401
    big = {"reports": [report(i, ts_s=1000.0 + i, policy_version="v" * 200) for i in range(1, 200)]}
    r = node.post("/nodes/nat-2/reports", json=big)
    assert r.status_code == 413 and "max_report_body_bytes" in r.text
    chunks = iter([json.dumps({"reports": [report(1, ts_s=1001.0)]}).encode()])
    r = node.post("/nodes/nat-2/reports", content=chunks, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["stored"] == 1  # chunked: the app's path stores it
    r = node.post("/nodes/nat-2/reports", json={"reports": [report(2, ts_s=1002.0, emb_share=2.0)]})
    assert r.status_code == 422  # claimed, refused by validation natively
    assert _native_count(cp) - before == 1  # only the last one was claimed
    unregistered = cp.node("nat-ghost")
    assert unregistered.post("/nodes/nat-ghost/reports", json=ok).status_code == 404


def test_a_nodes_gauges_show_its_latest_report_and_no_sample_for_a_figure_it_lacks(cp):
    node = cp.node("nat-4")
    register(node, "nat-4")
    assert node.post("/nodes/nat-4/reports", json={"reports": [report(0, ts_s=1000.0, kv_hit_rate=0.25)]}).status_code == 200
    text = httpx.get(cp.base + "/metrics").text
    assert 'racer_node_kv_hit_ratio{node_id="nat-4"} 0.25' in text
    assert 'racer_node_latency_p99_seconds{node_id="nat-4"} 0.01' in text  # 10 ms
    assert node.post("/nodes/nat-4/reports", json={"reports": [report(1, ts_s=1001.0)]}).status_code == 200
    text = httpx.get(cp.base + "/metrics").text
    assert 'racer_node_kv_hit_ratio{node_id="nat-4"}' not in text  # the latest report has none
    assert 'racer_node_emb_share_ratio{node_id="nat-4"} 0.5' in text
