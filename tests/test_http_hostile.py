"""Hostile and careless clients against the node agent and the gateway, over real sockets and real
processes (`racer node-agent`, `racer gateway --nodes`):

- connections that never send a whole request (silent, a head trickled in, a body that stalls)
  are closed by the server after its timeouts (``RACER_HTTP_*``, short here), and a normal
  request is served while thousands of them are open;
- OPTIONS answers 204 with an ``Allow`` naming every method of the path, another method 405 with
  the same header;
- a body announced as ``text/plain`` gets 415 at the gateway and is never forwarded (the agent
  answers 415 too);
- booleans are not numbers, and times and sizes are bounded (422, never a 200 or a 500);
- a request head past ``max_head_bytes`` (one huge header, sent in chunks, or trickled after a
  request still being answered) gets 431 and a closed connection once past the cap, and a head under it is served.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from .procs import SMALL_AGENT_ARGS, free_port, racer_cmd, spawn, stop, wait_http
from .test_node_agent import write_taobao_csv

TIMEOUT_S = 2.0  # the servers' head and body-idle timeouts in these tests
ENV = {"RACER_HTTP_HEADER_TIMEOUT_S": str(TIMEOUT_S), "RACER_HTTP_BODY_IDLE_TIMEOUT_S": str(TIMEOUT_S)}
NUM_IDLE = 2000


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    csv = write_taobao_csv(tmp / "UserBehavior_small.csv")
    procs = []
    try:
        ap = free_port()
        agent = spawn(racer_cmd("node-agent", "--port", str(ap), "--trace", "taobao", "--path", str(csv),
                                *SMALL_AGENT_ARGS), tmp / "agent.log", env=ENV)
        procs.append(agent)
        agent_url = f"http://127.0.0.1:{ap}"
        wait_http(f"{agent_url}/healthz", agent, log=tmp / "agent.log")
        gp = free_port()
        gw = spawn(racer_cmd("gateway", "--nodes", agent_url, "--port", str(gp), "--health-interval-s", "0.5"),
                   tmp / "gateway.log", env=ENV)
        procs.append(gw)
        gw_url = f"http://127.0.0.1:{gp}"
        wait_http(f"{gw_url}/healthz", gw, log=tmp / "gateway.log")
        yield {"agent": agent_url, "gateway": gw_url}
    finally:
        for p in procs:
            stop(p)


BODY = {"user_id": 3, "history": [1, 2, 3], "new_items": [4], "top_k": 2}


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (EOF or reset), without waiting."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@pytest.mark.parametrize("which", ["agent", "gateway"])
def test_idle_and_half_open_connections_are_closed_and_a_normal_request_is_served(servers, which):
    url = servers[which]
    port = int(url.rsplit(":", 1)[1])
    socks: list[socket.socket] = []
    kinds: dict[str, list[socket.socket]] = {"silent": [], "partial_head": [], "stalled_body": []}
    try:
        for i in range(NUM_IDLE):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 20 == 1:
                s.sendall(b"POST /v1/recommend HTTP/1.1\r\nHost: x\r\n")  # the head never ends
                kinds["partial_head"].append(s)
            elif i % 20 == 2:
                s.sendall(b"POST /v1/recommend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 1000\r\n\r\n{\"user_id\": 1")  # the body stops
                kinds["stalled_body"].append(s)
            else:
                kinds["silent"].append(s)
            socks.append(s)
        opened = time.monotonic()
        # a normal request while they are all open
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/recommend", json=BODY, timeout=30)
        took_s = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert took_s < 5.0, took_s  # far below the timeouts' scale of things (a loaded 2-core box: lenient)
        # a trickle of head bytes does not move the head's deadline
        for s in kinds["partial_head"][:10]:
            s.sendall(b"X-Slow: 1\r\n")
        deadline = opened + TIMEOUT_S + 15.0
        while time.monotonic() < deadline:
            open_now = {k: sum(not _closed_by_server(s) for s in v) for k, v in kinds.items()}
            if not any(open_now.values()):
                break
            time.sleep(0.5)
        closed_after_s = time.monotonic() - opened
        assert not any(open_now.values()), f"still open after {closed_after_s:.1f} s: {open_now}"
        assert closed_after_s >= TIMEOUT_S - 0.5  # not before their time
        r = httpx.post(f"{url}/v1/recommend", json=BODY, timeout=30)
        assert r.status_code == 200, r.text
        print(f"{which}: {NUM_IDLE} idle connections, a request served in {took_s * 1e3:.0f} ms among them, "
              f"all closed by the server {closed_after_s:.1f} s after they were opened (timeout {TIMEOUT_S} s)")
    finally:
        for s in socks:
            s.close()


def test_a_kept_alive_connection_with_a_slow_answer_is_not_cut(servers):
    """The timers run while the server waits on the client, not while it works: requests on one
    kept-alive connection spaced by less than the keep-alive time are all served."""
    with httpx.Client(base_url=servers["gateway"], timeout=30) as c:
        for _ in range(3):
            assert c.post("/v1/recommend", json=BODY).status_code == 200
            time.sleep(TIMEOUT_S * 0.6)


@pytest.mark.parametrize("which,path,allow", [
    ("agent", "/v1/recommend", "OPTIONS, POST"), ("agent", "/healthz", "GET, OPTIONS"),
    ("gateway", "/v1/recommend", "OPTIONS, POST"), ("gateway", "/v1/router/weights", "OPTIONS, POST"),
    ("gateway", "/v1/router", "GET, OPTIONS")])
def test_options_and_a_wrong_method_name_every_allowed_method(servers, which, path, allow):
    url = servers[which] + path
    r = httpx.request("OPTIONS", url)
    assert r.status_code == 204 and r.headers["allow"] == allow, (r.status_code, r.headers, r.text)
    r = httpx.request("PUT", url, json={})
    assert r.status_code == 405 and r.headers["allow"] == allow and allow in r.json()["error"], r.text
    assert httpx.request("OPTIONS", servers[which] + "/no/such/path").status_code == 404


def test_a_text_plain_body_gets_415_at_the_gateway_and_is_never_forwarded(servers):
    def served() -> int:
        return httpx.get(servers["agent"] + "/healthz").json()["num_served"]

    before = served()
    body = json.dumps(BODY).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", "text/plain; charset=utf-8"):
        r = httpx.post(servers["gateway"] + "/v1/recommend", content=body, headers={"Content-Type": kind})
        assert r.status_code == 415 and r.json()["error"].startswith("gateway: Content-Type"), r.text
        r = httpx.post(servers["agent"] + "/v1/recommend", content=body, headers={"Content-Type": kind})
        assert r.status_code == 415 and "application/json" in r.json()["error"], r.text
    r = httpx.post(servers["gateway"] + "/v1/router/weights", content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    assert served() == before
    for kind in ("application/json", "application/json; charset=utf-8", None):  # JSON, or not said: served
        h = {"Content-Type": kind} if kind else {}
        r = httpx.post(servers["gateway"] + "/v1/recommend", content=body, headers=h)
        assert r.status_code == 200, (kind, r.text)


@pytest.mark.parametrize("field,value", [
    ("now_ts", 1e308), ("now_ts", -1e308), ("now_ts", False), ("top_k", 10**9), ("top_k", True),
    ("num_candidates", 10**9), ("timestamps", [1e308, 1.0, 2.0, 3.0]), ("timestamps", [True, 1.0, 2.0, 3.0]),
    ("user_id", False)])
@pytest.mark.parametrize("which", ["agent", "gateway"])
def test_booleans_are_not_numbers_and_times_and_sizes_are_bounded(servers, which, field, value):
    r = httpx.post(servers[which] + "/v1/recommend", json={**BODY, field: value}, timeout=30)
    assert r.status_code == 422 and field in r.text, (field, value, r.status_code, r.text[:300])


def _send_huge_header(port: int, chunk: int = 16 * 1024, total: int = 2**20, prefix: bytes = b"") -> tuple[int, bytes]:
    """Send ``prefix``, then a request whose one header grows in ``chunk``-byte writes up to
    ``total``, each followed by a short wait for an answer (so the server has read what was sent
    and a refusal closes cleanly, not with a reset); returns (bytes of the header sent when the
    server answered or closed, everything it answered)."""
    import select

    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    sent = 0
    try:
        s.sendall(prefix + b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
        part = b"a" * chunk
        answer = b""
        while sent < total:
            try:
                s.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += chunk
            if select.select([s], [], [], 0.05)[0]:
                try:
                    b = s.recv(65536)
                except ConnectionResetError:
                    break
                answer += b
                if not b or b"HTTP/1.1 431 " in answer:  # the status line: digits in a JSON body are not one
                    break
        s.settimeout(5)
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                answer += b
        except (ConnectionResetError, socket.timeout):
            pass
        return sent, answer
    finally:
        s.close()


@pytest.mark.parametrize("which", ["agent", "gateway"])
def test_a_huge_request_head_gets_431_once_past_the_cap(servers, which):
    from common.http_server import HttpTimeouts

    port = int(servers[which].rsplit(":", 1)[1])
    cap = HttpTimeouts().max_head_bytes
    sent, answer = _send_huge_header(port)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"request head exceeds" in answer
    assert sent <= cap + 2 * 16 * 1024, sent  # refused at the cap, not after the whole MiB
    # a head under the cap is served, and the server is still there
    r = httpx.get(servers[which] + "/healthz", headers={"X-Big": "a" * (cap // 2)}, timeout=10)
    assert r.status_code == 200


def test_a_head_trickled_after_a_request_still_being_answered_is_counted(servers):
    """The next head on a kept-alive connection counts from the current request's last byte,
    not only once its answer is sent."""
    port = int(servers["agent"].rsplit(":", 1)[1])
    body = json.dumps(BODY).encode()
    first = (b"POST /v1/recommend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    sent, answer = _send_huge_header(port, prefix=first)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]  # the first request was answered
    assert b"HTTP/1.1 431 " in answer, answer[-300:]
    assert sent <= 32 * 1024 + 2 * 16 * 1024, sent


def test_timeouts_from_the_environment_are_checked():
    from common.http_server import HttpTimeouts

    assert HttpTimeouts.from_env({}) == HttpTimeouts(10.0, 30.0, 5.0)
    assert HttpTimeouts.from_env({"RACER_HTTP_MAX_HEAD_BYTES": "4096"}).max_head_bytes == 4096
    assert HttpTimeouts.from_env({"RACER_HTTP_HEADER_TIMEOUT_S": "2.5"}).header_timeout_s == 2.5
    for env in ({"RACER_HTTP_HEADER_TIMEOUT_S": "soon"}, {"RACER_HTTP_BODY_IDLE_TIMEOUT_S": "0"},
                {"RACER_HTTP_KEEP_ALIVE_S": "-1"}, {"RACER_HTTP_KEEP_ALIVE_S": "inf"},
                {"RACER_HTTP_MAX_HEAD_BYTES": "1.5"}, {"RACER_HTTP_MAX_HEAD_BYTES": "10"}):
        with pytest.raises(ValueError, match="RACER_HTTP_|_s must be|max_head_bytes"):
            HttpTimeouts.from_env(env)


@pytest.mark.parametrize("kind,ok", [(None, True), (b"application/json", True), (b"Application/JSON; charset=utf-8", True),
                                     (b"application/problem+json", True), (b"text/plain", False),
                                     (b"application/x-www-form-urlencoded", False), (b"application/jsonx", False)])
def test_json_content_type(kind, ok):
    from common.http_server import json_content_type

    assert json_content_type({"headers": [] if kind is None else [(b"content-type", kind)]}) is ok
