"""The gateway (`racer gateway`) in front of real `racer node-agent` processes, over HTTP:
routing with the residency feed, 4xx pass-through, weight pushes, no live node, and kill -9 of
one agent under load (retries, health checks out and back)."""

from __future__ import annotations

import asyncio
import json
import time

import threading

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from bench.gateway import Proc, free_port, make_bodies, start_agents, start_gateway
from node_agent.residency_feed import ResidencyFeed

TOKEN = "t0ken-16"
HEALTH_S = 0.4
REPORT_S = 0.3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    wd = tmp_path_factory.mktemp("gw")
    agents = start_agents(3, wd)
    gw = None
    try:
        gw = start_gateway([a.url for a in agents], wd, "racer", "taobao", extra=[
            "--health-interval-s", str(HEALTH_S), "--health-timeout-s", "0.4",
            "--report-interval-s", str(REPORT_S), "--request-timeout-s", "5"], env={"RACER_GATEWAY_PUSH_TOKEN": TOKEN})
        yield agents, gw, wd
    finally:
        if gw is not None:
            gw.stop()
        for a in agents:
            a.stop()


@pytest.fixture(scope="module")
def bodies():
    return make_bodies("taobao", None, 400, seed=5)


def state(gw: Proc, **params) -> dict:
    return httpx.get(gw.url + "/v1/router", params=params, timeout=5.0).json()


def post(url: str, body, timeout: float = 30.0, explain: str = "scores") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **({"x-racer-explain": explain} if explain else {})}
    return httpx.post(url + "/v1/recommend", content=content, headers=headers, timeout=timeout)


def test_routes_forwards_and_explains(cluster, bodies):
    agents, gw, _ = cluster
    served = []
    for b in bodies[:30]:
        r = post(gw.url, b)
        assert r.status_code == 200, r.text
        d = r.json()
        assert d["served_by"] in {a.url.split("://")[1] for a in agents}
        assert d["retried"] is False and len(d["items"]) == 10
        assert d["routing"]["policy"] == "racer" and d["routing"]["source"] in ("score", "guard")
        assert d["routing"]["reason"].startswith(("score:", "guard:"))
        assert set(d["routing"]["scores"]) == {a.url.split("://")[1] for a in agents}
        assert r.headers["x-racer-served-by"] == d["served_by"]
        # the gateway's own time from the request's first byte covers its round trip to the node
        assert 0 < d["gateway"]["upstream_ms"] <= d["gateway"]["gateway_ms"]
        served.append(d["served_by"])
    assert len(set(served)) >= 2  # the load term spreads cold users
    # the same user again: the node that holds its K/V wins and reuses it
    first = json.loads(bodies[0])
    again = {**first, "history": first["history"] + first["new_items"], "new_items": [1, 2]}
    d = post(gw.url, again).json()
    holder = state(gw, user=first["user_id"])["user"]["kv_holder"]
    assert d["routing"]["kv_holder"] is not None and d["served_by"] == d["routing"]["kv_holder"] == holder
    assert d["kv"]["outcome"] == "hit" and d["kv"]["hit_tokens"] > 0
    # x-racer-explain: reason gives the one line without the per-node table; no header, neither
    line = post(gw.url, bodies[30], explain="reason").json()["routing"]
    assert "scores" not in line and line["reason"].startswith(("score:", "guard:", "spill:"))
    plain = post(gw.url, bodies[31], explain="").json()["routing"]
    assert plain["policy"] == "racer" and "reason" not in plain and "scores" not in plain
    assert "reason" not in post(gw.url, bodies[32], explain="everything").json()["routing"]


def test_router_state_metrics_and_bad_input(cluster):
    _, gw, _ = cluster
    s = state(gw)
    assert s["router"] == "racer" and s["num_live_nodes"] == 3 and s["weights"]["version"] >= 1
    assert s["weights"]["source"] in ("node_metrics", "control_plane")
    n = s["nodes"][0]
    assert n["live"] and n["residency_feed"]["epoch"] and n["health"]["consecutive_failures"] == 0
    # a body the gateway cannot route: 422 naming the field, nothing forwarded
    r = post(gw.url, {"user_id": "u-1", "history": [1]})
    assert r.status_code == 422 and "user_id" in r.json()["error"]
    r = post(gw.url, b"{not json")
    assert r.status_code == 422 and "malformed JSON" in r.json()["error"]
    r = httpx.get(gw.url + "/v1/router", params={"user": -1})
    assert r.status_code == 422
    # a 4xx from the node passes through unchanged and is never retried
    bad = {"user_id": 5, "history": [10**9], "new_items": [1], "top_k": 3}
    g = post(gw.url, bad)
    d = post(cluster[0][0].url, bad)
    assert g.status_code == d.status_code == 422 and g.json() == d.json()
    m = httpx.get(gw.url + "/metrics").text
    assert 'racer_gateway_requests_total{node="none",outcome="bad_request",source="none"} 2.0' in m
    assert 'outcome="client_error"' in m and "racer_gateway_overhead_seconds_bucket" in m
    assert "racer_gateway_live_nodes 3.0" in m
    assert not any(line.startswith("racer_gateway_retries_total{") for line in m.splitlines())


def test_weight_push_needs_the_token_and_valid_fields(cluster):
    _, gw, _ = cluster
    ids = [n["node_id"] for n in state(gw)["nodes"]]
    prof = {"kv_recompute_us_per_token": 3.0, "emb_transfer_us_per_row": 7.0, "service_time_us": 4000.0,
            "queue_capacity": 32, "reason": "profiled on the device"}
    doc = {"version": 1000, "computed_at_s": 1.7e9, "nodes": {i: prof for i in ids}}
    url = gw.url + "/v1/router/weights"
    assert httpx.post(url, json=doc).status_code == 401
    assert httpx.post(url, json=doc, headers={"Authorization": "Bearer wrong"}).status_code == 401
    bad = {**doc, "nodes": {ids[0]: {**prof, "emb_transfer_us_per_row": -1.0}}}
    r = httpx.post(url, json=bad, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422 and "emb_transfer_us_per_row" in r.json()["error"]
    r = httpx.post(url, json={**doc, "version": "x"}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422 and "version" in r.json()["error"]
    assert state(gw)["weights"]["version"] != 1000  # nothing applied
    r = httpx.post(url, json={**doc, "nodes": {**doc["nodes"], "ghost:1": prof}},
                   headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json()["ignored_unknown_nodes"] == ["ghost:1"]
    s = state(gw)
    assert s["weights"]["version"] == 1000 and s["weights"]["source"] == "control_plane"
    w = s["weights"]["nodes"][ids[0]]
    assert w["emb_transfer_us_per_row"] == 7.0 and w["queue_capacity"] == 32 and w["reason"] == "profiled on the device"
    assert s["nodes"][0]["weights"]["ld_us"] == 32 * 4000.0
    r = httpx.post(url, json={**doc, "version": 999}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 409 and state(gw)["weights"]["version"] == 1000
    r = httpx.post(url, json=doc, headers={"Authorization": f"Bearer {TOKEN}"})  # the same version again
    assert r.status_code == 200 and r.json()["current"] is True and not r.json()["applied"]


def test_an_absurd_profile_is_refused_and_a_version_never_carries_an_older_ones_values(cluster):
    """A profile of 1e308 µs would give weights that are not JSON numbers and send every request to
    one node: it is outside the physical ranges and refused (422, nothing applied), and a weights
    version rebuilds every node's profile: a node it does not name is back on the defaults, not on
    what an older version said."""
    _, gw, _ = cluster
    ids = [n["node_id"] for n in state(gw)["nodes"]]
    url, auth = gw.url + "/v1/router/weights", {"Authorization": f"Bearer {TOKEN}"}
    absurd = {"kv_recompute_us_per_token": 1e308, "emb_transfer_us_per_row": 1e308, "service_time_us": 1.5e308,
              "queue_capacity": 64}
    before = state(gw)["weights"]["version"]
    r = httpx.post(url, json={"version": before + 1, "nodes": {ids[0]: absurd}}, headers=auth)
    assert r.status_code == 422 and "kv_recompute_us_per_token must be in [0, 100000], got 1e+308" in \
        r.json()["error"]
    assert state(gw)["weights"]["version"] == before
    odd = {"kv_recompute_us_per_token": 9e4, "emb_transfer_us_per_row": 1.0, "service_time_us": 5e7,
           "queue_capacity": 64}  # within range, but far from the others
    assert httpx.post(url, json={"version": before + 2, "nodes": {i: odd for i in ids}}, headers=auth).status_code \
        == 200
    assert state(gw)["weights"]["nodes"][ids[0]]["service_time_us"] == 5e7
    normal = {"kv_recompute_us_per_token": 3.0, "emb_transfer_us_per_row": 7.0, "service_time_us": 4000.0,
              "queue_capacity": 32}
    r = httpx.post(url, json={"version": before + 3, "nodes": {i: normal for i in ids[1:]}}, headers=auth)
    assert r.status_code == 200
    s = httpx.get(gw.url + "/v1/router")
    assert s.status_code == 200  # every figure a JSON number
    w = s.json()["weights"]["nodes"]
    assert w[ids[0]]["service_time_us"] == 2000.0 and w[ids[0]]["reason"] == f"not in weights version {before + 3}: " \
        "defaults"
    assert all(w[i]["service_time_us"] == 4000.0 for i in ids[1:])


def test_gateway_forgets_a_user_the_node_evicted_within_one_report_interval(cluster, bodies):
    agents, gw, _ = cluster
    user = 7_000_001
    body = {"user_id": user, "history": list(range(100, 160)), "new_items": [3, 4], "top_k": 3}
    d = post(gw.url, body).json()
    holder = d["served_by"]
    time.sleep(2 * REPORT_S)  # the node's feed confirms the holding (an "added" event)
    assert state(gw, user=user)["user"]["kv_holder"] == holder
    node = next(a for a in agents if a.url.endswith(holder.split(":")[1]))
    # other traffic straight to the node (as another gateway would send) fills its KV pool
    u = 8_000_000
    for k in range(80):
        r = post(node.url, {"user_id": u + k, "history": list(range(1000 + k, 1240 + k)), "new_items": [5],
                            "top_k": 1})
        assert r.status_code == 200
    feed = httpx.get(node.url + "/v1/residency", params={"cursor": 0}).json()
    assert feed["full"] and user not in feed["kv_added"]  # the node evicted it
    t_evicted = time.monotonic()
    # the first pull that covers the eviction (pulls run every report interval) forgets the holder
    deadline = t_evicted + 30
    while time.monotonic() < deadline:
        s = state(gw, user=user)
        if next(n for n in s["nodes"] if n["node_id"] == holder)["residency_feed"]["cursor"] >= feed["cursor"]:
            break
        time.sleep(0.02)
    took = time.monotonic() - t_evicted
    assert s["user"]["kv_holder"] is None
    print(f"eviction seen by the gateway after {took:.3f} s (report interval {REPORT_S} s)")
    assert took <= REPORT_S + 3.0, took  # one interval plus the pull's round trip on a shared machine
    # and the next request of the user is scored without a KV holder
    d = post(gw.url, {**body, "history": body["history"] + [3, 4], "new_items": [9]}).json()
    assert d["routing"]["kv_holder"] is None


def test_residency_feed_deltas_and_snapshots():
    """The feed over a real KV pool: deltas since a cursor (a user's last change wins), a full
    snapshot when the cursor fell off the ring, is ahead of it, or names another epoch."""
    from types import SimpleNamespace

    from node_agent.memory import KVLayout, MemoryConfig, MemoryManager

    layout = KVLayout(num_layers=1, num_heads=1, head_dim=4, page_tokens=2)
    mm = MemoryManager(MemoryConfig(num_pages=8, num_items=8, emb_dim=4, kv=layout, initial_emb_share=0.25,
                                    payload=False, device="cpu"))  # 6 KV pages of 2 tokens
    engine = SimpleNamespace(mm=mm)
    feed = ResidencyFeed(capacity=4)
    mm.kv.append(1, 4)
    mm.kv.append(2, 4)
    feed.collect(engine, 0.0)
    full = feed.since(0, None)
    assert full["full"] and full["kv_added"] == [1, 2] and full["kv_cached_lens"] == [4, 4]
    e = full["epoch"]
    d = feed.since(0, e)
    assert not d["full"] and d["kv_added"] == [1, 2] and d["kv_evicted"] == [] and d["cursor"] == 2
    assert mm.kv.append(3, 6).evicted_users == (1,)  # 3 pages: user 1 (LRU) goes
    feed.collect(engine, 0.1)
    mm.kv.append(1, 2)  # and comes back with 2 tokens
    feed.collect(engine, 0.2)
    d = feed.since(2, e)
    assert not d["full"] and d["cursor"] == 5
    assert sorted(zip(d["kv_added"], d["kv_cached_lens"])) == [(1, 2), (3, 6)] and d["kv_evicted"] == []
    assert feed.since(3, e)["kv_added"] == [3, 1]
    assert mm.kv.append(4, 4).evicted_users == (2,)  # 2 pages: user 2 (LRU) goes
    feed.collect(engine, 0.3)
    d = feed.since(5, e)
    assert d["kv_evicted"] == [2] and d["kv_added"] == [4] and d["cursor"] == 7
    # the ring keeps events 4..7: cursor 3 still gets a delta, cursor 2 a full snapshot
    assert not feed.since(3, e)["full"]
    d = feed.since(2, e)
    assert d["full"] and sorted(zip(d["kv_added"], d["kv_cached_lens"])) == [(1, 2), (3, 6), (4, 4)]
    assert d["kv_evicted"] == []
    assert feed.since(7, "another-epoch")["full"] and feed.since(99, e)["full"]
    d = feed.since(7, e)
    assert not d["full"] and d["kv_added"] == d["kv_evicted"] == []


def test_no_live_node_gets_503_with_a_reason(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    gw = Proc(["gateway", "--nodes", dead, "--health-interval-s", "0.2", "--health-timeout-s", "0.2"],
              tmp_path / "gw-dead.log", free_port()).start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # /healthz answers 503 once the only node is out
            try:
                if httpx.get(gw.url + "/healthz", timeout=1.0).status_code == 503:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        r = post(gw.url, {"user_id": 1, "history": [1, 2], "new_items": [3]})
        assert r.status_code == 503
        assert "no live node" in r.json()["error"] and dead.split("://")[1] in r.json()["error"]
        assert state(gw)["nodes"][0]["live"] is False
    finally:
        gw.stop()
    log = (tmp_path / "gw-dead.log").read_text()
    assert '"event": "node_out"' in log


async def _load(url: str, bodies: list[bytes], stop: asyncio.Event, timeout_s: float, out: list) -> None:
    async with httpx.AsyncClient(timeout=timeout_s) as c:
        i = 0
        while not stop.is_set():
            b = bodies[i % len(bodies)]
            i += 1
            t = time.monotonic()
            try:
                r = await c.post(url + "/v1/recommend", content=b, headers={"content-type": "application/json"})
                d = r.json()
                out.append((time.monotonic() - t, r.status_code, d.get("retried"), d.get("served_by"),
                            d.get("error")))
            except httpx.TimeoutException:
                out.append((time.monotonic() - t, "hung", None, None, None))
            except httpx.HTTPError as e:
                out.append((time.monotonic() - t, f"client:{type(e).__name__}", None, None, None))


@pytest.mark.slow
def test_kill_9_one_agent_under_load(cluster, bodies):
    agents, gw, wd = cluster
    victim = agents[1]
    vid = victim.url.split("://")[1]
    results: list = []
    timeline: dict = {}

    async def scenario():
        stop = asyncio.Event()
        workers = [asyncio.create_task(_load(gw.url, bodies[k::4], stop, 12.0, results)) for k in range(4)]
        await asyncio.sleep(1.5)
        victim.kill()  # kill -9
        timeline["killed"] = time.monotonic()
        async with httpx.AsyncClient(timeout=5.0) as c:
            while time.monotonic() - timeline["killed"] < 15:
                s = (await c.get(gw.url + "/v1/router")).json()
                if not next(n for n in s["nodes"] if n["node_id"] == vid)["live"]:
                    timeline["out"] = time.monotonic()
                    break
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.gather(*workers)

    asyncio.run(scenario())
    assert "out" in timeline, "the dead node never left rotation"
    # within 3 health intervals (+ one health timeout and scheduling slack on a shared machine)
    assert timeline["out"] - timeline["killed"] <= 3 * HEALTH_S + 0.4 + 3.0
    statuses = [r[1] for r in results]
    assert len(results) > 20
    assert "hung" not in statuses and not any(isinstance(s, str) for s in statuses), set(statuses)
    for lat, status, retried, served, err in results:
        assert lat < 2 * 5.0 + 1.0  # two attempts of request_timeout_s at most
        if status == 200:
            assert not retried or served != vid  # a retry never lands on the dead node
        else:  # an explicit error the client can count
            assert status in (502, 503, 504) and err
    ok = sum(s == 200 for s in statuses)
    assert ok >= 0.9 * len(results)
    print(f"kill -9 under load: {len(results)} requests, {ok} ok, {sum(bool(r[2]) for r in results)} retried, "
          f"errors {sorted(set(s for s in statuses if s != 200))}, out of rotation after "
          f"{timeline['out'] - timeline['killed']:.2f} s")
    # the node comes back after a restart on the same port and takes requests again
    victim.start()
    victim.wait_ready()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        n = next(n for n in state(gw)["nodes"] if n["node_id"] == vid)
        if n["live"]:
            break
        time.sleep(0.1)
    assert n["live"] and n["health"]["consecutive_successes"] >= 2
    served = {post(gw.url, b).json()["served_by"] for b in bodies[200:260]}
    assert vid in served
    log = (wd / "gateway-racer.log").read_text()
    events = [json.loads(line.split(" racer.gateway ", 1)[1]) for line in log.splitlines() if " racer.gateway {" in line]
    out = [e for e in events if e["event"] == "node_out" and e["node"] == vid]
    assert out and out[0]["failures"] == 3  # taken out on the 3rd failure in a row
    assert any(e["event"] == "node_in" and e["node"] == vid for e in events)
    assert all({"node", "kind", "error"} <= set(e) for e in events if e["event"] == "upstream_failure")


def test_node_list_and_weights_from_a_control_plane(cluster, tmp_path):
    """``--control-plane``: the node list from ``GET /api/v1/nodes``, weights pulled from
    ``GET /api/v1/router/weights``, the gateway registered with ``POST /api/v1/routers``; all
    with the bearer token. The control plane here is a minimal stand-in serving the contract
    (HELPERS.md / docs/control_plane.md) over real HTTP; the real one lives in control_plane.api."""
    agents, _, _ = cluster
    seen: dict = {"auth": set(), "routers": []}
    cp = FastAPI()
    weights = {"version": 7, "computed_at_s": 1.7e9, "nodes": {
        f"n{i}": {"kv_recompute_us_per_token": 2.0, "emb_transfer_us_per_row": 3.0, "service_time_us": 5000.0,
                  "queue_capacity": 16, "reason": "profiled"} for i in range(2)}}

    @cp.get("/api/v1/nodes")
    async def nodes(request: Request):
        seen["auth"].add(request.headers.get("authorization"))
        return [{"node_id": f"n{i}", "address": a.url, "device": "cpu", "status": "up", "last_seen_s": 0.0}
                for i, a in enumerate(agents[:2])]

    @cp.get("/api/v1/router/weights")
    async def get_weights(request: Request):
        seen["auth"].add(request.headers.get("authorization"))
        return weights

    @cp.post("/api/v1/routers")
    async def register(request: Request):
        seen["auth"].add(request.headers.get("authorization"))
        body = await request.json()
        seen["routers"].append(body["url"])
        seen["register_body"] = body
        return {"url": seen["routers"][-1], "push_token": "racer_push_given_by_the_control_plane"}

    cp_port = free_port()
    server = uvicorn.Server(uvicorn.Config(cp, host="127.0.0.1", port=cp_port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    gw_port = free_port()
    gw = Proc(["gateway", "--control-plane", f"http://127.0.0.1:{cp_port}", "--token", TOKEN, "--trace", "taobao",
               "--advertise-url", f"http://127.0.0.1:{gw_port}"], tmp_path / "gw-cp.log", gw_port)
    try:
        gw.start().wait_ready()
        s = state(gw)
        assert [n["node_id"] for n in s["nodes"]] == ["n0", "n1"]
        assert s["weights"]["version"] == 7 and s["weights"]["source"] == "control_plane"
        assert s["weights"]["nodes"]["n1"]["queue_capacity"] == 16 and s["registered_for_pushes"] is True
        assert seen["routers"] == [f"http://127.0.0.1:{gw_port}"] and seen["auth"] == {f"Bearer {TOKEN}"}
        assert seen["register_body"] == {"url": f"http://127.0.0.1:{gw_port}"}  # it sends no secret of its own
        assert httpx.post(gw.url + "/v1/router/weights", json={**weights, "version": 8},
                          headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 401
        push = httpx.post(gw.url + "/v1/router/weights", json={**weights, "version": 8},
                          headers={"Authorization": "Bearer racer_push_given_by_the_control_plane"})
        assert push.status_code == 200 and state(gw)["weights"]["version"] == 8
        d = post(gw.url, {"user_id": 3, "history": [1, 2, 3], "new_items": [4], "top_k": 2}).json()
        assert d["served_by"] in ("n0", "n1")
    finally:
        gw.stop()
        server.should_exit = True
        th.join(10)


def test_gateway_with_the_real_control_plane(cluster, tmp_path):
    """The control plane process (control_plane.main, SQLite): nodes registered there are the
    gateway's nodes; the gateway registers for pushes (the answer carries its push token) and gets the
    weights the control plane's job computes and pushes. A node an operator retires leaves the
    gateway's rotation at its next read of the node list; every request goes to the others."""
    from tests.cp_util import ControlPlane, Database, wait_for

    agents, _, _ = cluster
    db = Database("sqlite", tmp_path)
    cp = ControlPlane(db.url, tmp_path / "cp.log")
    gw = None
    try:
        for i, a in enumerate(agents[:2]):
            node = cp.node(f"node-{i}")  # each node its own token, bound to its id
            r = node.post("/nodes/register", json={
                "node_id": f"node-{i}", "address": a.url, "device": "cpu", "policy_version": None,
                "cost_profile": {"kv_recompute_us_per_token": 4.0, "emb_transfer_us_per_row": 2.0,
                                 "service_time_us": 3000.0, "queue_capacity": 48}})
            assert r.status_code == 200, r.text
        op = cp.token("router")  # a gateway's own role: nodes, weights, its registration
        gw_port = free_port()
        gw = Proc(["gateway", "--control-plane", cp.base, "--token", op, "--trace", "taobao",
                   "--advertise-url", f"http://127.0.0.1:{gw_port}"], tmp_path / "gw-realcp.log", gw_port)
        gw.start().wait_ready()
        routers = wait_for(lambda: [r for r in cp.admin.get("/routers").json()
                                    if r["pushed_version"] is not None and r["last_error"] is None], 60)
        assert routers[0]["url"] == f"http://127.0.0.1:{gw_port}" and "push_token" not in routers[0]
        s = state(gw)
        assert [n["node_id"] for n in s["nodes"]] == ["node-0", "node-1"] and s["registered_for_pushes"]
        assert s["weights"]["source"] == "control_plane" and s["weights"]["version"] >= routers[0]["pushed_version"]
        assert s["weights"]["nodes"]["node-0"]["queue_capacity"] == 48
        d = post(gw.url, {"user_id": 11, "history": [1, 2, 3], "new_items": [4], "top_k": 2}).json()
        assert d["served_by"] in ("node-0", "node-1")
        # retire node-1: out of the gateway's node list (read every 5 s), nothing more is sent to it
        r = cp.admin.post("/nodes/node-1/retire", json={"reason": "test: drain"})
        assert r.status_code == 200 and r.json()["status"] == "retired", r.text
        wait_for(lambda: [n["node_id"] for n in state(gw)["nodes"]] == ["node-0"], 30)
        served = {post(gw.url, {"user_id": u, "history": [1, 2, 3], "new_items": [4], "top_k": 2}).json()["served_by"]
                  for u in range(20)}
        assert served == {"node-0"}
    finally:
        if gw is not None:
            gw.stop()
        cp.stop()
        db.drop()


def test_hostile_bodies_get_a_4xx_from_the_agent_and_the_gateway_never_a_5xx(cluster):
    """A lone surrogate in a field (the agent's 422 echoes the input: it must still encode), a body
    that is not UTF-8, and JSON nested 100,000 deep: each a 4xx naming the problem, straight to the
    agent and through the gateway (a 4xx is never retried on another node)."""
    agents, gw, _ = cluster
    surrogate = b'{"user_id": "\\ud800", "history": [1], "new_items": [2], "top_k": 1}'
    for url in (agents[0].url, gw.url):
        r = post(url, surrogate)
        assert r.status_code in (400, 422), (url, r.status_code, r.text[:300])
        assert "user_id" in r.text
        r = post(url, b'{"user_id": 5, "history": [1], "new_items": [2], "top_k": 1, "x": "\xce\xe2"}')
        assert 400 <= r.status_code < 500, (url, r.status_code, r.text[:300])
    deep = b"[" * 100_000 + b"]" * 100_000
    r = post(gw.url, deep)
    assert r.status_code == 422 and "nested too deeply" in r.text
    r = httpx.post(gw.url + "/v1/router/weights", content=deep, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422 and "nested too deeply" in r.text


def test_a_body_over_the_gateways_cap_gets_its_own_413_and_is_never_forwarded(cluster):
    """--max-body-bytes (default 4 MiB, the agent's own default): a larger body, announced by
    Content-Length or chunked, gets the gateway's 413 (no node named: none was asked), as do
    weight pushes; the gateway counts the bytes it reads and stops at the cap."""
    from tests.procs import send_streaming

    agents, gw, _ = cluster
    cap = 4 * 2**20
    served_before = sum(httpx.get(a.url + "/healthz").json()["num_served"] for a in agents)
    for chunked in (False, True):
        out = send_streaming(gw.url, "POST", "/v1/recommend", total_bytes=cap + 2**20, chunked=chunked)
        assert out["status"] == 413, out
        assert f"exceeds {cap} bytes" in out["body"] and out["body"].startswith('{"error": "gateway:'), out
        if chunked:
            read = int(out["body"].split("at least ", 1)[1].split(" ", 1)[0])
            assert cap < read <= cap + 2**20, read
    out = send_streaming(gw.url, "POST", "/v1/router/weights", headers={"Authorization": f"Bearer {TOKEN}"},
                         total_bytes=cap + 1, chunked=False, declare_only=True)
    assert out["status"] == 413 and f"exceeds {cap} bytes" in out["body"], out
    assert sum(httpx.get(a.url + "/healthz").json()["num_served"] for a in agents) == served_before
    r = post(gw.url, {"user_id": 12, "history": [1, 2, 3], "new_items": [4], "top_k": 2})
    assert r.status_code == 200, r.text
    assert "served_by" in r.json()


def test_a_refused_client_report_costs_only_itself_and_the_bounds_match_the_control_plane():
    """A 422 on a batch of client reports halves it until the one report refused is alone: only
    that one is dropped (counted), the rest stored; an interval or SLO the control plane would
    refuse is refused at start-up."""
    from gateway.config import GatewayConfig
    from gateway.gateway import Gateway
    from gateway.uplink import CLIENT_REPORT_BATCH

    bad_seq = {}
    stored: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seqs = [r["seq"] for r in json.loads(request.content)["reports"]]
        if bad_seq["seq"] in seqs:
            return httpx.Response(422, json={"detail": [{"loc": ["body", "reports"], "msg": "bad"}]})
        stored.extend(seqs)
        return httpx.Response(200, json={"stored": len(seqs), "duplicates": 0})

    async def run():
        gw = Gateway([], control_plane="http://cp", token="tok", gateway_id="gw-1")
        gw.client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(503)))
        for _ in range(CLIENT_REPORT_BATCH + 9):  # the control plane away: a backlog of 69
            await gw.report_clients()
        seqs = [r["seq"] for r in gw.client_reports]
        bad_seq["seq"] = seqs[40]
        gw.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        await gw.report_clients()  # 70 pending: one of them refused
        assert len(gw.client_reports) == 0 and gw.client_reports_dropped == 1
        assert sorted(stored) == sorted(s for s in seqs + [seqs[-1] + 1] if s != seqs[40])
        assert gw.describe_clients()["reports_dropped"] == 1
        await gw.client.aclose()

    asyncio.run(run())
    GatewayConfig(client_report_interval_s=600, slo_ms=1e6)  # the largest taken
    for kw in ({"client_report_interval_s": 3600}, {"client_report_interval_s": 601}, {"slo_ms": 1e6 + 1}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            GatewayConfig(**kw)


def test_the_fleet_token_guards_who_holds_which_user_and_secrets_stay_out_of_argv(tmp_path):
    """Without a token, the gateway's GET /v1/router?user=N showed node addresses and which node
    holds a user's cache, and an agent's /v1/residency listed user ids; tokens could only be given
    on the command line (ps shows them). Now a fleet token, shared by the gateway and the agents
    and read from a file or the environment, guards both views (401 without it); a gateway with
    the wrong one reads no residency feed; without one, a process refuses to listen beyond
    loopback; a token on the command line still works, with a warning."""
    import subprocess
    import sys

    from tests.procs import REPO

    fleet = "racer_fleet_test_0123456789abcdef"
    token_file = tmp_path / "fleet"
    token_file.write_text(fleet + "\n")
    agents = start_agents(1, tmp_path, env={"RACER_FLEET_TOKEN": fleet})
    gws = []
    try:
        node = agents[0].url
        assert httpx.get(node + "/v1/residency").status_code == 401
        assert httpx.get(node + "/v1/residency", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(node + "/v1/residency", headers={"Authorization": f"Bearer {fleet}"}).status_code == 200
        gws.append(start_gateway([node], tmp_path, "racer", "taobao", extra=[
            "--fleet-token-file", str(token_file), "--report-interval-s", "0.2"]))
        gws.append(start_gateway([node], tmp_path, "least_load", "taobao", extra=["--report-interval-s", "0.2"],
                                 env={"RACER_FLEET_TOKEN": "racer_fleet_wrong"}))
        good, bad = gws
        assert post(good.url, {"user_id": 42, "history": [1, 2, 3], "new_items": [4], "top_k": 2}).status_code == 200
        for gw in gws:
            r = httpx.get(gw.url + "/v1/router", params={"user": 42})
            assert r.status_code == 401 and "fleet token" in r.json()["error"], r.text
            assert "127.0.0.1" not in r.text
        auth = {"Authorization": f"Bearer {fleet}"}

        def holder():
            s = httpx.get(good.url + "/v1/router", params={"user": 42}, headers=auth).json()
            return s if s["nodes"][0]["kv_resident_users"] >= 1 else None

        deadline = time.monotonic() + 20
        while holder() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert holder() is not None  # the good gateway reads the feed: user 42's cache is on the node
        wrong = httpx.get(bad.url + "/v1/router", headers={"Authorization": "Bearer racer_fleet_wrong"}).json()
        assert "401" in (wrong["nodes"][0]["residency_feed"]["report_error"] or ""), wrong["nodes"][0]
    finally:
        for p in [*gws, *agents]:
            p.stop()
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO)}
    env.pop("RACER_FLEET_TOKEN", None)
    for cmd in (["gateway", "--nodes", "http://127.0.0.1:9", "--host", "0.0.0.0", "--port", "0"],
                ["node-agent", "--trace", "taobao", "--host", "0.0.0.0", "--port", "0"]):
        r = subprocess.run([sys.executable, "-m", "racer", *cmd], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and "without a fleet token" in r.stderr, (cmd, r.returncode, r.stderr[-500:])
    r = subprocess.run([sys.executable, "-m", "racer", "gateway", "--control-plane", "http://127.0.0.1:9",
                        "--token", "racer_on_argv", "--push-token-file", str(token_file), "--port", "0"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert "shows in ps" in r.stderr and "without --control-plane only" in r.stderr and r.returncode == 2, r.stderr
