"""The HTTP layer itself fuzzed over raw sockets, on every server as it runs (`racer node-agent`,
`racer gateway`, the control plane, `racer dashboard`): request heads from a few bytes to 256 KiB
(one huge header or many), chunked bodies with chunk sizes valid, negative, non-hex or past 2^64
(``ffffffffffffffffff``), declared lengths that lie, bodies of up to 4 MiB. `tests/test_fuzz.py`
fuzzes each API's operations in-process and never reaches this layer, which is where one huge
header once stalled a server and one chunk size grew the dashboard's memory without bound.

A chunk size no body can have must be refused with a 4xx at once. Every answer a generated
request gets within 1 s must have a status below 500 (a request whose
body is short of what it declared gets none: it is closed unanswered), the server must still answer ``/healthz`` (``/`` for the dashboard)
quickly afterwards, and its memory must not have grown by more than 200 MB over the whole run.
``FUZZ_HTTP_EXAMPLES`` (default 25) requests per server: about 15 s each on two cores."""

from __future__ import annotations

import os
import select
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .procs import SMALL_AGENT_ARGS, free_port, racer_cmd, spawn, stop, wait_http
from .test_node_agent import write_taobao_csv

EXAMPLES = int(os.environ.get("FUZZ_HTTP_EXAMPLES", "25"))
ANSWER_S = 1.0  # how long a request waits for an answer (one whose body is short of what it declared
#               waits for its body until the server's body timeout: it is closed after this, unanswered)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from .cp_util import ControlPlane

    tmp = tmp_path_factory.mktemp("fuzz-http")
    procs = []
    cp = ControlPlane(f"sqlite:///{tmp}/cp.db", tmp / "cp.log", scheduler=False)
    try:
        csv = write_taobao_csv(tmp / "ub.csv")
        ap = free_port()
        agent = spawn(racer_cmd("node-agent", "--port", str(ap), "--trace", "taobao", "--path", str(csv),
                                *SMALL_AGENT_ARGS), tmp / "agent.log")
        procs.append(agent)
        wait_http(f"http://127.0.0.1:{ap}/healthz", agent, log=tmp / "agent.log")
        gp = free_port()
        gw = spawn(racer_cmd("gateway", "--nodes", f"http://127.0.0.1:{ap}", "--port", str(gp)), tmp / "gw.log")
        procs.append(gw)
        wait_http(f"http://127.0.0.1:{gp}/healthz", gw, log=tmp / "gw.log")
        dp = free_port()
        dash = spawn(racer_cmd("dashboard", "--control-plane", cp.base, "--port", str(dp)), tmp / "dash.log")
        procs.append(dash)
        deadline = time.monotonic() + 90
        while True:
            assert dash.poll() is None, (tmp / "dash.log").read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{dp}/", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.3)
        yield {
            "agent": (ap, agent.pid, "/v1/recommend", "/healthz"),
            "gateway": (gp, gw.pid, "/v1/recommend", "/healthz"),
            "control_plane": (cp.port, cp.proc.pid, "/api/v1/nodes/n1/reports", "/healthz"),
            "dashboard": (dp, dash.pid, "/_dash-update-component", "/"),
        }
    finally:
        for p in procs:
            stop(p)
        cp.stop()


CHUNK_SIZES = st.one_of(st.integers(0, 2**20).map(lambda n: f"{n:x}"),
                        st.sampled_from(["ffffffffffffffffff", "-1", "zz", "1" * 40, "0x10", "", " 5", "5;ext=1"]))

requests = st.fixed_dictionaries({
    "method": st.sampled_from(["GET", "POST"]),
    "header_bytes": st.one_of(st.integers(0, 64), st.integers(16 * 1024, 48 * 1024), st.integers(0, 256 * 1024)),
    "num_headers": st.integers(0, 60),
    "body": st.sampled_from(["none", "length", "lying_length", "chunked"]),
    "body_bytes": st.one_of(st.integers(0, 1024), st.integers(0, 4 * 2**20)),
    "chunk_size": CHUNK_SIZES,
})


def _valid_chunk_size(text: str) -> bool:
    """Whether ``text`` is a chunk-size line a body could have (hex digits, optionally ``;ext``, under 2^63)."""
    size = text.split(";", 1)[0]
    return bool(size) and all(c in "0123456789abcdefABCDEF" for c in size) and int(size, 16) < 2**63


def _send(port: int, path: str, req: dict) -> bytes:
    """Send one generated request; everything the server answered before closing or ``ANSWER_S``."""
    head = [f"{req['method']} {path} HTTP/1.1", "Host: x", "Content-Type: application/json"]
    head += [f"X-F{i}: {'v' * 8}" for i in range(req["num_headers"])]
    if req["header_bytes"]:
        head.append("X-Big: " + "a" * req["header_bytes"])
    body = b""
    n = req["body_bytes"]
    if req["body"] == "length":
        head.append(f"Content-Length: {n}")
        body = b" " * n
    elif req["body"] == "lying_length":
        head.append(f"Content-Length: {n + 100}")
        body = b" " * n
    elif req["body"] == "chunked":
        head.append("Transfer-Encoding: chunked")
        body = f"{req['chunk_size']}\r\n".encode() + b"a" * min(n, 2**20) + b"\r\n0\r\n\r\n"
    data = ("\r\n".join(head) + "\r\n\r\n").encode() + body
    s = socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S)
    answer = b""
    try:
        try:  # the head's region in pieces, each followed by a look for an answer: a server that
            # refuses mid-way has read what came before, so its answer arrives (not a reset)
            k = 0
            while k < len(data):
                piece = 64 * 1024 if k < 512 * 1024 else len(data) - k
                s.sendall(data[k:k + piece])
                k += piece
                if k < len(data) and select.select([s], [], [], 0.02)[0]:
                    break
        except OSError:  # the server refused the rest (and closed): read what it said
            pass
        s.settimeout(ANSWER_S)
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                answer += b
                if len(answer) > 12 and answer.startswith(b"HTTP/1.1 "):
                    break  # the status line is all that is checked
        except (socket.timeout, ConnectionResetError):
            pass
    finally:
        s.close()
    return answer


@pytest.mark.parametrize("name", ["agent", "gateway", "control_plane", "dashboard"])
def test_the_http_layer_survives_generated_heads_and_bodies(servers, name):
    port, pid, path, health = servers[name]
    rss0 = _rss_mb(pid)
    seen: list[tuple[dict, bytes]] = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests)
    def one(req):
        t = time.monotonic()
        answer = _send(port, path, req)
        took = time.monotonic() - t
        seen.append((req, answer[:40]))
        assert took < ANSWER_S + 2, (req, took)
        if answer:
            status = int(answer[9:12])
            assert status < 500, (req, answer[:200])
        if req["body"] == "chunked" and not _valid_chunk_size(req["chunk_size"]) and req["header_bytes"] < 30_000:
            # a chunk size no body can have (not hex, or past 2^63): refused at once, never waited on
            assert answer[9:10] == b"4", (req, answer[:200])
        t = time.monotonic()
        assert httpx.get(f"http://127.0.0.1:{port}{health}", timeout=5).status_code == 200, req
        assert time.monotonic() - t < 2.0, (req, "health check slow after it")

    one()
    grew = _rss_mb(pid) - rss0
    assert grew < 200, (name, grew)
    assert len(seen) >= min(EXAMPLES, 10)
    assert any(a.startswith(b"HTTP/1.1 431") for _, a in seen), ("no generated head passed the cap", [(r["header_bytes"], r["num_headers"], r["body"], a[:12]) for r, a in seen])
