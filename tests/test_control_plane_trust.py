"""The control plane's trust boundaries over real HTTP (a control-plane process on SQLite, and on
PostgreSQL when one is reachable): a node token acts as its own node only, a node id belongs to
the token that registered it, an operator drains and retires a node, and a request's token is
checked before its body is read, every body capped (413, chunked bodies included)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from racer.up import rss_bytes

from .cp_util import ControlPlane, Database, backends, register, report
from .procs import send_streaming

# small caps, so that the 413 tests send little
CAPS = {"RACER_MAX_BODY_BYTES": "16384", "RACER_MAX_REPORT_BODY_BYTES": "262144",
        "RACER_MAX_SAMPLE_BODY_BYTES": "65536", "RACER_MAX_POLICY_BODY_BYTES": "131072"}
API = "/api/v1"
PROFILE = {"kv_recompute_us_per_token": 2.0, "emb_transfer_us_per_row": 1.0, "service_time_us": 500.0,
           "queue_capacity": 64}


@pytest.fixture(scope="module", params=backends())
def cp(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trust")
    d = Database(request.param, tmp)
    c = ControlPlane(d.url, tmp / "cp.log", env=CAPS)
    c.db_url = d.url
    yield c
    c.stop()
    d.drop()


def _spec(cp) -> dict:
    return httpx.get(cp.base + "/openapi.json").json()


def _node_routes(cp) -> list[tuple[str, str]]:
    """(method, path) of every route a node calls as itself: under /api/v1/nodes/, role node."""
    return sorted((m.upper(), p) for p, ops in _spec(cp)["paths"].items() for m, op in ops.items()
                  if p.startswith(f"{API}/nodes/") and "node" in op.get("x-racer-roles", []))


def _body(path: str, node_id: str):
    """A valid body for each node route, acting as ``node_id``."""
    return {f"{API}/nodes/register": {"node_id": node_id, "address": "http://127.0.0.1:9", "device": "cpu",
                                      "cost_profile": PROFILE},
            f"{API}/nodes/{{node_id}}/reports": {"reports": [report(7, ts_s=1000.0)]},
            f"{API}/nodes/{{node_id}}/policy": {"policy_version": "forged", "status": "loaded"},
            f"{API}/nodes/{{node_id}}/model": {"model_version": "f" * 64, "status": "loaded"},
            f"{API}/nodes/{{node_id}}/directives": None}[path]


def _call(token: str | None, method: str, path: str, node_id: str, cp) -> httpx.Response:
    h = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, cp.base + path.replace("{node_id}", node_id), headers=h,
                         json=_body(path, node_id), timeout=30)


def _unbound_node_token(cp) -> str:
    """A node token bound to no node id, as databases made before the binding hold."""
    from control_plane.auth import new_secret
    from db import queries
    from db.engine import make_engine, session_factory

    engine = make_engine(cp.db_url)
    secret = new_secret()
    with session_factory(engine).begin() as s:
        queries.add_token(s, name="old-node-token", role="node", secret=secret, now_s=0.0)
    engine.dispose()
    return secret


def test_every_node_route_with_another_nodes_token_is_403(cp):
    """Table-driven over the API's own list of node routes: a token bound to another node, and a
    node token bound to none, are refused (403) on each; nothing of the victim changes; the
    victim's own token is served."""
    routes = _node_routes(cp)
    assert routes == [("GET", f"{API}/nodes/{{node_id}}/directives"), ("POST", f"{API}/nodes/register"),
                      ("POST", f"{API}/nodes/{{node_id}}/model"), ("POST", f"{API}/nodes/{{node_id}}/policy"),
                      ("POST", f"{API}/nodes/{{node_id}}/reports")]
    victim = cp.token("node", node_id="victim")
    assert register(cp.client(victim), "victim")["node_id"] == "victim"
    before = cp.admin.get("/nodes/victim").json()
    attacker, unbound = cp.token("node", node_id="attacker"), _unbound_node_token(cp)
    for method, path in routes:
        r = _call(attacker, method, path, "victim", cp)
        assert r.status_code == 403, (method, path, r.status_code, r.text)
        assert "bound to node 'attacker'" in r.json()["detail"] and "'victim'" in r.json()["detail"], r.text
        r = _call(unbound, method, path, "victim", cp)
        assert r.status_code == 403, (method, path, r.status_code, r.text)
        assert "racer token create --role node --node-id" in r.json()["detail"], r.text
    after = cp.admin.get("/nodes/victim").json()
    assert after == before  # same address, no report stored as it, no forged confirmation
    assert cp.admin.get("/reports", params={"node_id": "victim"}).json() == []
    # the unbound token is refused on the node routes even for an id no one has registered
    assert _call(unbound, "POST", f"{API}/nodes/register", "fresh", cp).status_code == 403
    for method, path in routes:  # the victim's own token may
        assert _call(victim, method, path, "victim", cp).status_code == 200, (method, path)
    who = cp.client(victim).get("/whoami").json()
    assert (who["role"], who["node_id"]) == ("node", "victim")


def test_a_node_token_needs_a_node_id_and_only_node_tokens_take_one(cp):
    for body in ({"role": "node", "name": "x"}, {"role": "viewer", "name": "x", "node_id": "n"},
                 {"role": "operator", "name": "x", "node_id": "n", "replace": True}):
        r = cp.admin.post("/tokens", json=body)
        assert r.status_code == 422 and "node_id" in r.text, (body, r.text)
    r = cp.admin.post("/tokens", json={"role": "node", "name": "x", "node_id": "bad id!"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "node_id"]


def test_re_registration_from_a_different_token_is_403_until_the_first_is_replaced(cp):
    first = cp.client(cp.token("node", node_id="owned"))
    register(first, "owned")
    second = cp.client(cp.token("node", node_id="owned"))  # bound to the same id, but not the registrar
    r = second.post("/nodes/register", json={"node_id": "owned", "address": "http://127.0.0.1:19199", "device": "cpu",
                                             "cost_profile": PROFILE})
    assert r.status_code == 403 and "registered by another token" in r.json()["detail"], r.text
    assert cp.admin.get("/nodes/owned").json()["address"] == "http://127.0.0.1:9"  # not re-pointed
    register(first, "owned")  # the registrar may, as often as it likes
    # a token made with replace revokes the others bound to the id: it may register, the first is gone
    r = cp.admin.post("/tokens", json={"role": "node", "name": "owned-new", "node_id": "owned", "replace": True})
    assert r.status_code == 201 and len(r.json()["replaced_token_ids"]) == 2, r.text
    third = cp.client(r.json()["token"])
    assert register(third, "owned")["node_id"] == "owned"
    assert first.get("/nodes/owned/directives").status_code == 401
    assert second.get("/nodes/owned/directives").status_code == 401


def test_retire_is_operator_only_drops_the_node_from_the_list_and_refuses_its_token(cp):
    tok = cp.token("node", node_id="old1")
    node = cp.client(tok)
    register(node, "old1")
    assert node.post("/nodes/old1/reports", json={"reports": [report(0, ts_s=1000.0)]}).status_code == 200
    ov = cp.admin.post("/overrides", json={"node_id": "old1", "emb_share": 0.4, "reason": "pin"}).json()
    url = cp.base + f"{API}/nodes/old1/retire"
    for token, want in [(None, 401), ("racer_not-a-token", 401), (tok, 403), (cp.token("viewer"), 403),
                        (cp.token("router"), 403)]:
        h = {"Authorization": f"Bearer {token}"} if token else {}
        assert httpx.post(url, json={"reason": "x"}, headers=h).status_code == want, token
    assert cp.admin.post("/nodes/old1/retire", json={}).status_code == 422  # a reason is required
    r = cp.admin.post("/nodes/old1/retire", json={"reason": "decommissioned"})
    assert r.status_code == 200 and r.json()["status"] == "retired", r.text
    # out of the list the gateway reads (a router token's view), still readable by id
    assert "old1" not in [n["node_id"] for n in cp.client(cp.token("router")).get("/nodes").json()]
    assert "old1" in [n["node_id"] for n in cp.admin.get("/nodes", params={"include_retired": "true"}).json()]
    assert cp.admin.get("/nodes/old1").json()["status"] == "retired"
    # its token is refused on every node route, at once
    for method, path in _node_routes(cp):
        assert _call(tok, method, path, "old1", cp).status_code == 401, (method, path)
    assert [o["state"] for o in cp.admin.get("/overrides").json() if o["id"] == ov["id"]] == ["cleared"]
    entry = cp.admin.get("/audit", params={"action": "node.retire"}).json()["items"][0]
    assert (entry["actor"], entry["target"], entry["reason"]) == ("admin", "node:old1", "decommissioned")
    assert entry["after"]["status"] == "retired" and entry["after"]["revoked_token_ids"]
    assert cp.admin.post("/nodes/old1/retire", json={"reason": "again"}).status_code == 409
    assert cp.admin.post("/nodes/nobody/retire", json={"reason": "x"}).status_code == 404
    # a new token for its id brings it back
    register(cp.node("old1"), "old1")
    assert cp.admin.get("/nodes/old1").json()["status"] == "up"


@pytest.mark.parametrize("path,token_role", [(f"{API}/nodes/x/reports", None), (f"{API}/tokens", None),
                                             (f"{API}/tokens", "viewer"), (f"{API}/policies", None)])
def test_a_refused_token_gets_its_answer_before_a_300_mb_chunked_body_is_read(cp, path, token_role):
    """401 (no token) or 403 (a viewer on an operator route) while the client is still sending:
    the server answered after far less than the body, and its memory did not grow by it."""
    headers = {"Authorization": f"Bearer {cp.token(token_role)}"} if token_role else {}
    rss0 = rss_bytes(cp.proc.pid)
    out = send_streaming(cp.base, "POST", path, headers=headers, total_bytes=300 * 2**20, chunk_bytes=256 * 1024)
    assert out["status"] == (403 if token_role else 401), out
    assert out["sent_bytes"] < 32 * 2**20, out["sent_bytes"]  # answered long before the 300 MB were sent
    assert rss_bytes(cp.proc.pid) - rss0 < 32 * 2**20
    assert httpx.get(cp.base + "/healthz").status_code == 200


def _mutating_routes(cp) -> list[tuple[str, str, list[str]]]:
    return [(m.upper(), p, op["x-racer-roles"]) for p, ops in _spec(cp)["paths"].items() for m, op in ops.items()
            if m in ("post", "put", "patch")]


def test_every_body_is_capped_with_413_declared_or_chunked(cp):
    """Every route that takes a body, with a token it accepts: a Content-Length over its cap gets
    413 before a byte is sent, a chunked body 413 once the bytes received pass the cap."""
    caps = {f"{API}/nodes/{{node_id}}/reports": 262144, f"{API}/policies": 131072, f"{API}/models": 131072,
            f"{API}/gateways/{{gateway_id}}/samples": 65536}
    node_tok = cp.token("node", node_id="capped")
    register(cp.client(node_tok), "capped")
    router_tok = cp.token("router", "capped-gw")
    routes = _mutating_routes(cp)
    assert len(routes) >= 15, routes
    for method, path, allowed in routes:
        token = node_tok if "node" in allowed else cp.ADMIN if "operator" in allowed else router_tok
        url_path = path.replace("{node_id}", "capped").replace("{override_id}", "1").replace(
            "{rollout_id}", "1").replace("{version}", "v1")
        cap = caps.get(path, 16384)
        h = {"Authorization": f"Bearer {token}"}
        out = send_streaming(cp.base, method, url_path, headers=h, total_bytes=cap + 1, chunked=False,
                             declare_only=True)
        assert out["status"] == 413 and f"{cap + 1} bytes exceeds {cap} bytes" in out["body"], (path, out)
        out = send_streaming(cp.base, method, url_path, headers=h, total_bytes=cap + 8 * 2**20, chunk_bytes=8192)
        assert out["status"] == 413 and f"exceeds {cap} bytes" in out["body"], (path, out)
        # the server stopped reading at the cap: it counted one read from the socket past it, at most
        read = int(re.search(r"at least (\d+) bytes", out["body"]).group(1))
        assert cap < read <= cap + 2**20, (path, read)
    # a report batch under its cap (but over the general one) is stored
    batch = {"reports": [report(i, ts_s=2000.0 + i, decision={"source": "base", "emb_share": 0.5, "reason": "r" * 150})
                         for i in range(100)]}
    node = cp.client(node_tok)
    r = node.post("/nodes/capped/reports", json=batch)
    assert 16384 < len(r.request.content) < 262144 and r.status_code == 200 and r.json()["stored"] == 100, r.text
    assert httpx.get(cp.base + "/healthz").status_code == 200


def _malformed(path: str) -> str:
    """``path`` with each path parameter given a value no route would accept, and a query string
    no route would accept either."""
    return re.sub(r"\{[^}]+\}", "%FF%FE-not-an-id", path) + "?limit=-5&start_s=not-a-number"


def test_without_a_token_every_route_answers_401_whatever_the_body_path_or_query(cp):
    """Table-driven over the API's own routes (every one that declares roles): no token, with a
    malformed JSON body, a body that is not JSON, malformed path parameters and query: 401 on
    each, never 422 (the token is checked first)."""
    ops = [(m.upper(), p) for p, item in _spec(cp)["paths"].items() for m, op in item.items()
           if op.get("x-racer-roles")]
    assert len(ops) >= 30, ops
    bodies = [(b'{"reports": [{"seq": tru', "application/json"), (b"\xce\xe2\x00", "application/json"),
              (b"name=x", "text/plain"), (b"[" * 10_000, "application/json")]
    refused = {}
    for method, path in ops:
        for url_path in (path.replace("{node_id}", "n1").replace("{override_id}", "1").replace(
                "{rollout_id}", "1").replace("{version}", "v1"), _malformed(path)):
            for content, kind in bodies if method != "GET" else [(None, None)]:
                r = httpx.request(method, cp.base + url_path, content=content,
                                  headers={"Content-Type": kind} if kind else {}, timeout=30)
                if r.status_code != 401:
                    refused[(method, url_path, kind)] = (r.status_code, r.text[:200])
                else:
                    assert r.headers.get("www-authenticate") == "Bearer"
    assert not refused, refused


BOOL_AS_NUMBER = [  # (role, method, path, body): a boolean where a number belongs
    ("node", "POST", "/nodes/{n}/reports", {"reports": [report(0, ts_s=1000.0, bursts=[
        {"start_s": 999.0, "magnitude": False}])]}),
    ("node", "POST", "/nodes/{n}/reports", {"reports": [report(0, ts_s=1000.0, interval_s=True)]}),
    ("node", "POST", "/nodes/{n}/reports", {"reports": [report(0, ts_s=1000.0, decision={
        "source": "base", "emb_share": 0.5, "features": {"x": True}})]}),
    ("node", "POST", "/nodes/{n}/reports", {"reports": [report(0, ts_s=True)]}),
    ("node", "POST", "/nodes/register", {"node_id": "{n}", "address": "http://127.0.0.1:9", "device": "cpu",
                                         "cost_profile": {**PROFILE, "service_time_us": False}}),
    ("node", "POST", "/nodes/register", {"node_id": "{n}", "address": "http://127.0.0.1:9", "device": "cpu",
                                         "cost_profile": {**PROFILE, "device": {"mode": "emulated",
                                                                                "time_scale": True}}}),
    ("operator", "POST", "/overrides", {"node_id": "{n}", "emb_share": False, "reason": "x"}),
    ("operator", "POST", "/overrides", {"node_id": "{n}", "emb_share": 0.5, "ttl_s": True, "reason": "x"}),
    ("operator", "POST", "/rollouts", {"policy_version": "v1", "canary_fraction": True}),
    ("operator", "POST", "/rollouts", {"policy_version": "v1", "min_samples": 10.0}),
    ("operator", "POST", "/tokens", {"role": "node", "name": "x", "node_id": "{n}", "replace": 1}),
]


@pytest.mark.parametrize("role,method,path,body", BOOL_AS_NUMBER)
def test_a_boolean_is_not_a_number_anywhere_in_the_api(cp, role, method, path, body):
    nid = "strict-node"
    tok = cp.token("node", node_id=nid)
    if cp.admin.get(f"/nodes/{nid}").status_code == 404:
        register(cp.client(tok), nid)
    client = cp.client(tok) if role == "node" else cp.admin
    raw = json.loads(json.dumps(body).replace("{n}", nid))
    r = client.request(method, path.replace("{n}", nid), json=raw)
    assert r.status_code == 422, (path, r.status_code, r.text[:300])
    assert cp.admin.get("/reports", params={"node_id": nid}).json() == []  # nothing stored


def test_options_names_every_method_of_the_path_and_a_wrong_method_gets_405_with_allow(cp):
    for path, allow in [(f"{API}/policies", "GET, OPTIONS, POST"), (f"{API}/nodes/n1", "GET, OPTIONS"),
                        (f"{API}/overrides", "GET, OPTIONS, POST"), ("/healthz", "GET, OPTIONS")]:
        r = httpx.request("OPTIONS", cp.base + path)
        assert r.status_code == 204 and r.headers["allow"] == allow, (path, r.status_code, r.headers)
        r = httpx.request("PATCH", cp.base + path, json={})
        assert r.status_code == 405 and r.headers["allow"] == allow and allow in r.json()["detail"], (path, r.text)


def test_a_nodes_drop_count_from_its_newest_report_is_shown_on_the_node_and_in_metrics(cp):
    """The count a node sends in its reports (`num_reports_dropped`): the newest report's value is
    on GET /nodes/{id}, in GET /nodes and in /metrics; an older report replayed later does not
    lower it, a report without it leaves it; a node that never sent it shows null (a gap, not 0)."""
    nid = "dropping"
    node = cp.client(cp.token("node", node_id=nid))
    register(node, nid)
    assert cp.admin.get(f"/nodes/{nid}").json()["num_reports_dropped"] is None
    for seq, dropped in ((5, 3), (2, 1)):
        r = node.post(f"/nodes/{nid}/reports", json={"reports": [report(seq, ts_s=1000.0 + seq,
                                                                        num_reports_dropped=dropped)]})
        assert r.status_code == 200, r.text
    assert node.post(f"/nodes/{nid}/reports", json={"reports": [report(6, ts_s=1006.0)]}).status_code == 200
    assert cp.admin.get(f"/nodes/{nid}").json()["num_reports_dropped"] == 3
    assert {n["node_id"]: n["num_reports_dropped"] for n in cp.admin.get("/nodes").json()}[nid] == 3
    assert f'racer_node_reports_dropped{{node_id="{nid}"}} 3.0' in httpx.get(cp.base + "/metrics").text
    r = node.post(f"/nodes/{nid}/reports", json={"reports": [report(7, ts_s=1007.0, num_reports_dropped=-1)]})
    assert r.status_code == 422 and "num_reports_dropped" in r.text


BAD_POLICY_IDS = ["a/b", "", "x?y#z", "pol-\u20ac", "a\r\nb", "..", ".hidden", "x" * 129, "sp ace", "a%2Fb"]


@pytest.mark.parametrize("policy_id", BAD_POLICY_IDS)
def test_a_policy_id_outside_the_id_grammar_is_refused_at_upload(cp, policy_id):
    """One id grammar (common.ids) for every registry, enforced at upload: an id that could not be
    one URL path segment is a 422 naming policy_id, and nothing is stored."""
    from .cp_util import artifact_tar
    from .test_control_plane_api import DEFAULT_POLICY

    r = cp.admin.post("/policies", content=artifact_tar(DEFAULT_POLICY, policy_id=policy_id))
    assert r.status_code == 422 and "policy_id" in r.text, (r.status_code, r.text[:300])
    assert all(p["version"] != policy_id for p in cp.admin.get("/policies").json())


def test_an_id_at_the_grammars_edge_round_trips_through_every_url(cp):
    from .cp_util import artifact_tar
    from .test_control_plane_api import DEFAULT_POLICY

    pid = "Pol_1.2:3-" + "z" * 118  # 128 characters, every allowed punctuation mark
    assert cp.admin.post("/policies", content=artifact_tar(DEFAULT_POLICY, policy_id=pid)).status_code in (200, 201)
    assert cp.admin.get(f"/policies/{pid}").json()["version"] == pid
    assert cp.admin.get(f"/policies/{pid}/artifact").status_code == 200
    assert cp.admin.get("/policies/a%2Fb").status_code == 404  # no such path (the server decodes it to a/b)
    assert cp.admin.get("/policies/" + "x" * 129).status_code == 422  # a path id outside the grammar


def test_only_router_tokens_register_routers_and_only_the_registrant_changes_one(cp):
    """A node token once replaced the real gateway's push token; any URL could be registered and
    the control plane echoed what it answered. Now: router tokens only, a URL bound to the token
    that registered it, a cap on routers, and a failed push says its status and nothing more."""
    from control_plane.routes.routers import MAX_ROUTERS

    url = "http://127.0.0.1:9/trust-router"
    node = cp.node("trust-router-node")
    assert node.post("/routers", json={"url": url}).status_code == 403
    assert cp.admin.post("/routers", json={"url": url}).status_code == 403  # an operator deletes, never registers
    first, second = (cp.client(cp.token("router", f"gw-{i}")) for i in (1, 2))
    r = first.post("/routers", json={"url": url})
    assert r.status_code == 200, r.text
    push_token = r.json()["push_token"]  # what the control plane's pushes to that URL carry
    from sqlalchemy import create_engine, text

    from db.engine import normalize_url

    engine = create_engine(normalize_url(cp.db_url))
    try:  # the database holds no push secret: every column of the routers table, read back
        with engine.connect() as c:
            rows = [tuple(map(str, row)) for row in c.execute(text("SELECT * FROM routers")).all()]
        assert rows and not any(push_token in v or push_token[len("racer_push_"):] in v for row in rows for v in row)
    finally:
        engine.dispose()
    if cp.db_url.startswith("sqlite"):  # the key beside the file, readable by its owner only
        key = __import__("pathlib").Path(cp.db_url.split("///", 1)[1] + ".key")
        assert key.stat().st_mode & 0o777 == 0o600
    r = second.post("/routers", json={"url": url})
    assert r.status_code == 403 and "another router token" in r.text
    assert first.post("/routers", json={"url": url}).status_code == 200  # its own: fine
    # the cap: registering past MAX_ROUTERS is refused
    have = len(cp.admin.get("/routers").json())
    extra = [f"http://127.0.0.1:9/cap-{i}" for i in range(MAX_ROUTERS - have)]
    for u in extra:
        assert first.post("/routers", json={"url": u}).status_code == 200
    r = first.post("/routers", json={"url": "http://127.0.0.1:9/one-too-many"})
    assert r.status_code == 409 and str(MAX_ROUTERS) in r.text
    for u in [*extra, url]:
        assert cp.admin.delete("/routers", params={"url": u}).status_code == 200


def test_routers_that_never_answer_cost_one_push_timeout_not_one_each(tmp_path):
    """20 registered URLs that accept and never answer stretched the weights job from 0.2 to
    41.6 s (2 s each, one after another); pushed at once they cost about one timeout."""
    import socket
    import time

    from control_plane.cp_metrics import ControlPlaneMetrics
    from control_plane.jobs import push_weights
    from control_plane.settings import Settings
    from db import queries
    from db.engine import make_engine, session_factory, upgrade

    engine = make_engine(f"sqlite:///{tmp_path}/cp.db")
    upgrade(engine)
    factory = session_factory(engine)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # accepts (the kernel does) and never answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    with factory.begin() as s:
        queries.add_weights(s, computed_at_s=1.0, nodes={}, inputs={}, reason="test")
        for i in range(20):
            queries.upsert_router(s, f"{url}/r{i}", 1.0)
    settings = Settings(push_timeout_s=0.5)
    t = time.perf_counter()
    out = push_weights(factory, settings, ControlPlaneMetrics())
    took = time.perf_counter() - t
    silent.close()
    # at once, not one after another (10 s): at least 2x quicker, a bound a loaded 2-core host meets
    assert out["failed"] == 20 and took < 0.5 * 20 / 2, took
    with factory() as s:
        assert {r.last_error for r in queries.list_routers(s)} == {"timeout after 0.5 s"}
    engine.dispose()


def test_any_token_is_revoked_over_http_and_stops_at_once(cp):
    """No HTTP revoke existed for operator, viewer or router tokens; a revoked one worked up to
    5 s. Now an operator revokes any token, audited, and it stops on this process at once."""
    for role in ("viewer", "router", "operator"):
        secret = cp.token(role, f"leaky-{role}")
        c = cp.client(secret)
        tid = c.get("/whoami").json()["token_id"]  # cached now
        listed = {t["id"]: t for t in cp.admin.get("/tokens").json()}
        assert listed[tid]["role"] == role and not listed[tid]["revoked"] and "token" not in listed[tid]
        r = cp.admin.post(f"/tokens/{tid}/revoke", json={"reason": "leaked"})
        assert r.status_code == 200 and r.json()["revoked"], r.text
        assert c.get("/whoami").status_code == 401  # at once, not after the cache's 5 s
        assert cp.admin.post(f"/tokens/{tid}/revoke", json={"reason": "again"}).status_code == 409
    assert cp.admin.post("/tokens/999999/revoke", json={"reason": "x"}).status_code == 404
    audit = cp.admin.get("/audit", params={"action": "token.revoke"}).json()["items"]
    assert len(audit) >= 3 and audit[0]["reason"] == "leaked"
    assert cp.client(cp.token("viewer")).get("/tokens").status_code == 403


def _pax_tar(key_bytes: int, gz: bool) -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=tarfile.PAX_FORMAT) as t:
        info = tarfile.TarInfo("manifest.json")
        info.pax_headers = {"comment": "a" * key_bytes}
        info.size = 2
        t.addfile(info, io.BytesIO(b"{}"))
    return buf.getvalue()


def _gnu_long_name_tar(name_bytes: int) -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        info = tarfile.TarInfo("d/" * (name_bytes // 2) + "manifest.json")
        info.size = 2
        t.addfile(info, io.BytesIO(b"{}"))
    return buf.getvalue()


@pytest.mark.parametrize("body,words", [
    (lambda: _pax_tar(64 * 1024, gz=False), "PAX header of"),
    (lambda: _pax_tar(2 * 2**20, gz=True), "PAX header of"),
    (lambda: _gnu_long_name_tar(100_000), "GNU long name of"),
])
def test_tar_extension_headers_past_a_small_size_are_refused_before_tarfile_reads_them(cp, body, words):
    """Python's tarfile parses PAX headers with a regular expression whose cost grows with their
    size (CVE-2024-6232): a 232-byte gzip froze the control plane 12.9 s. Such headers are refused
    from a linear walk of the archive's blocks first, for policies and models alike."""
    from common.artifact_pack import check_tar_headers

    data = body()
    for route in ("/policies", "/models"):
        r = cp.admin.post(route, content=data, headers={"Content-Type": "application/x-tar"})
        assert r.status_code in (413, 422) and (r.status_code == 413 or words in r.text), (route, r.status_code, r.text)
    with pytest.raises(ValueError, match=words):
        check_tar_headers(data, 2**28)
    check_tar_headers(_pax_tar(100, gz=True), 2**28)  # a small one is fine


def test_a_policy_graph_outside_the_allowlist_or_too_large_is_refused():
    """A 40-KB policy with ConstantOfShape took 2 GiB to check; one with an ONNX Loop, once
    active, raised node P50 from 6 to 2,319 ms. A policy is an MLP: its operators are
    allowlisted, subgraphs refused, and its weights bounded, before any session runs it."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from node_agent.artifact import MAX_GRAPH_ELEMENTS, check_graph

    def model(nodes, inits=()):
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["b", 22])],
                              [helper.make_tensor_value_info("emb_share", TensorProto.FLOAT, ["b", 1])],
                              initializer=list(inits))
        return helper.make_model(g)

    assert check_graph(onnx.load("policies/default/policy.onnx")) == []
    cos = model([helper.make_node("ConstantOfShape", ["features"], ["emb_share"])])
    assert "ConstantOfShape" in check_graph(cos)[0]
    body = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "body", [], [])
    loop = model([helper.make_node("Loop", ["", ""], ["emb_share"], body=body)])
    problems = check_graph(loop)
    assert any("Loop" in p for p in problems) and any("subgraph" in p for p in problems)
    big = model([helper.make_node("Gemm", ["features", "w"], ["emb_share"])],
                [numpy_helper.from_array(np.zeros((MAX_GRAPH_ELEMENTS // 22 + 1, 22), np.float32).T.copy(), "w")])
    assert "weight and constant elements" in " ".join(check_graph(big))


def test_a_model_config_field_past_its_cap_is_refused():
    from node_agent.model.hstu import ModelConfig

    for field, value in (("num_position_buckets", 2**27), ("num_position_buckets", 2**40), ("embedding_dim", 10**6),
                         ("num_layers", 1000)):
        with pytest.raises(ValueError, match=field):
            ModelConfig(**{field: value}).validate()


def test_a_node_whose_agent_restarted_shows_it_and_the_audit_says_when(cp):
    """A kill -9 of an agent was invisible: the dashboard showed 3/1 for one refresh, no restart
    count or event. Each registration says when its process started; another start time is a
    restart, counted on the node and audited."""
    from dashboard.overview_tab import node_rows

    client = cp.node("restarty")
    register(client, "restarty")  # an agent that does not say (an older one): nothing counted
    for started in (1_000.0, 1_000.0, 2_000.0):
        r = client.post("/nodes/register", json={
            "node_id": "restarty", "address": "http://127.0.0.1:9", "device": "cpu", "started_at_s": started,
            "cost_profile": {"kv_recompute_us_per_token": 2.0, "emb_transfer_us_per_row": 1.0,
                             "service_time_us": 500.0, "queue_capacity": 64}})
        assert r.status_code == 200, r.text
    node = next(n for n in cp.admin.get("/nodes").json() if n["node_id"] == "restarty")
    assert node["num_restarts"] == 1 and node["started_at_s"] == 2_000.0
    ev = cp.admin.get("/audit", params={"action": "node.restart"}).json()["items"]
    assert ev and ev[0]["target"] == "node:restarty" and ev[0]["after"]["started_at_s"] == 2_000.0
    row = node_rows([node])[0]
    assert row["num_restarts"] == 1 and row["started"].endswith("UTC")


def test_a_corrupted_table_fails_healthz_and_a_corrupted_file_is_one_line(tmp_path):
    """A corrupted table gave 500 on reads and 503 "retry later" on writes while /healthz said
    ok; a corrupted header gave a 117-line traceback. Now /healthz reads every main table and
    says which one failed (503), and a file that is no database is one line at start-up."""
    import sqlite3
    import subprocess
    import sys

    import httpx

    from .cp_util import REPO, ControlPlane

    db = tmp_path / "cp.db"
    cp = ControlPlane(f"sqlite:///{db}", tmp_path / "cp.log", scheduler=False)
    try:
        assert httpx.get(cp.base + "/healthz").json()["ok"] is True
        register(cp.node("c1"), "c1")
    finally:
        cp.stop()
    con = sqlite3.connect(db)
    root = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'nodes'").fetchone()[0]
    page = con.execute("PRAGMA page_size").fetchone()[0]
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    with open(db, "r+b") as f:  # the nodes table's root page overwritten
        f.seek((root - 1) * page)
        f.write(b"\xff" * page)
    from .procs import free_port, spawn, stop

    port = free_port()
    proc = spawn([sys.executable, "-m", "control_plane.main", "--db", f"sqlite:///{db}", "--port", str(port),
                  "--no-scheduler"], tmp_path / "cp2.log", env={"RACER_ADMIN_TOKEN": ControlPlane.ADMIN})
    try:
        r = None
        for _ in range(300):
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None, (tmp_path / "cp2.log").read_text()[-2000:]
                __import__("time").sleep(0.2)
        assert r is not None and r.status_code == 503 and r.json()["database"].startswith("nodes:"), r and r.text
    finally:
        stop(proc)
    bad = tmp_path / "header.db"
    bad.write_bytes(b"not a database at all" * 200)
    p = subprocess.run([sys.executable, "-m", "control_plane.main", "--db", f"sqlite:///{bad}", "--port", "0"],
                       cwd=REPO, capture_output=True, text=True, timeout=60, env={**__import__("os").environ,
                                                                                  "PYTHONPATH": str(REPO)})
    assert p.returncode == 2 and "is not usable" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_node_past_its_ingestion_quota_gets_429_with_retry_after_and_others_do_not(tmp_path):
    """One node token grew the database 45 MB/s. Now each node has a quota on reports and on
    body bytes (token buckets): past it, 429 with Retry-After and nothing stored; another node
    is not affected; after the wait the batch is stored."""
    import time

    env = {"RACER_NODE_REPORTS_PER_S": "200", "RACER_NODE_BURST_REPORTS": "1000",
           "RACER_NODE_REPORT_BYTES_PER_S": "2000", "RACER_NODE_BURST_REPORT_BYTES": str(16 * 2**20)}
    cp = ControlPlane(f"sqlite:///{tmp_path}/cp.db", tmp_path / "cp.log", env=env, scheduler=False)
    try:
        greedy, calm = cp.node("greedy"), cp.node("calm")
        register(greedy, "greedy")
        register(calm, "calm")
        batch = lambda first: {"reports": [report(first + j, ts_s=1000.0 + first + j) for j in range(1000)]}  # noqa: E731
        assert greedy.post("/nodes/greedy/reports", json=batch(0)).status_code == 200  # the burst
        r = greedy.post("/nodes/greedy/reports", json=batch(1000))
        assert r.status_code == 429 and "quota" in r.json()["detail"], r.text
        wait = int(r.headers["retry-after"])
        assert 1 <= wait <= 6, r.headers  # 1,000 reports at 200/s
        assert calm.post("/nodes/calm/reports", json={"reports": [report(1, ts_s=1000.0)]}).status_code == 200
        assert 'racer_cp_reports_throttled_total{what="reports"} 1.0' in httpx.get(cp.base + "/metrics").text
        time.sleep(wait)
        r = greedy.post("/nodes/greedy/reports", json=batch(1000))
        assert r.status_code == 200 and r.json() == {"stored": 1000, "duplicates": 0}, r.text
        # the bytes bucket: 2,000 bytes/s sustained; the burst (16 MiB) is spent by one 15 MiB body
        pad = {"reports": [report(3000, ts_s=1.0, padding="x" * (15 * 2**20))]}
        r = calm.post("/nodes/calm/reports", json=pad)
        assert r.status_code == 422, r.text[:300]  # refused by the schema, but its bytes were counted
        r = calm.post("/nodes/calm/reports", json=pad)
        assert r.status_code == 429 and int(r.headers["retry-after"]) > 60, (r.status_code, r.headers)
        assert calm.post("/nodes/calm/reports", json={"reports": [report(2, ts_s=1001.0)]}).status_code == 200
    finally:
        cp.stop()


def test_a_full_disk_stops_ingestion_with_503_and_freed_space_restores_it(tmp_path):
    """After a full disk, freeing 5 MB did not restore ingestion for long: the write-ahead log
    grew into the freed space before a checkpoint could use it, and the data stayed in the WAL.
    Now a full disk makes the writer reclaim the WAL (checkpoint, truncate) before writing again.
    A 16 MiB tmpfs holds the database and a 5 MiB ballast; ingestion runs until 503, the ballast
    is deleted, and ingestion runs until the next 503: by then the database file has grown by most
    of the freed space (before: it kept its size, 1.6 MB, and the WAL took the space)."""
    import os
    import subprocess
    import time

    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a 16 MiB tmpfs as a disk that fills")
    cp = None
    try:
        (mnt / "ballast").write_bytes(bytes(5 * 2**20))
        cp = ControlPlane(f"sqlite:///{mnt}/cp.db", tmp_path / "cp.log", scheduler=False,
                          env={"RACER_NODE_REPORTS_PER_S": "1e6", "RACER_NODE_REPORT_BYTES_PER_S": "1e9"})
        node = cp.node("n1")
        register(node, "n1")
        seq = 0

        def fill() -> tuple[int, str]:
            """Store 200-report batches until the disk refuses one: (reports stored, the refusal)."""
            nonlocal seq
            stored = 0
            for _ in range(2000):
                r = node.post("/nodes/n1/reports",
                              json={"reports": [report(seq + j, ts_s=1000.0 + seq + j) for j in range(200)]})
                if r.status_code != 200:
                    assert r.status_code == 503 and "full" in r.text, r.text[:300]
                    return stored, r.text
                assert r.json() == {"stored": 200, "duplicates": 0}
                stored += 200
                seq += 200
            raise AssertionError("the disk never filled")

        first, why = fill()
        assert first > 5000 and "retry later" in why
        db_at_first = (mnt / "cp.db").stat().st_size
        (mnt / "ballast").unlink()
        second, last = 0, ""
        deadline = time.monotonic() + 30
        while second == 0 and time.monotonic() < deadline:  # as a node's reporter retries its 503s
            second, last = fill()
            if second == 0:
                time.sleep(0.5)
        db_at_second = (mnt / "cp.db").stat().st_size
        # the freed space went to the database (the WAL checkpointed into it, then truncated), not
        # to a WAL that grew into it (before: the file kept its size). On a loaded machine the WAL
        # takes part of it between the 1-s checkpoints (seen in CI: 1.4 MB, 12,800 reports)
        assert db_at_second - db_at_first >= 2**20, (db_at_first, db_at_second, first, second)
        assert second >= 0.2 * first, (first, second, last[:300])
    finally:
        if cp is not None:
            cp.stop()
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_an_upload_is_checked_in_a_child_with_memory_and_time_limits(tmp_path):
    """Artifacts were unpacked and checked inside the control plane (a crafted policy took 2 GiB
    of its memory; a crafted tar froze it 10.9 s). Now a child process unpacks and checks each
    upload under an address-space limit, a CPU limit and a wall-clock timeout: past one, the
    upload gets a 422 naming the limit and the control plane is untouched. Here the limit is
    300 MiB: the policy's check fits, the checkpoint's (torch) does not; a 0.2-s timeout stops any."""
    from common.artifact_pack import ARTIFACT_FILES, CHECKPOINT_FILES, pack_artifact
    from control_plane.artifacts import CheckLimits, check_upload

    from .cp_util import REPO

    ckpt = REPO / "node_agent" / "model" / "checkpoints" / "taobao"
    model = pack_artifact({f: (ckpt / f).read_bytes() for f in CHECKPOINT_FILES if (ckpt / f).exists()})
    policy = pack_artifact({f: (REPO / "policies" / "default" / f).read_bytes() for f in ARTIFACT_FILES})
    with pytest.raises(ValueError, match="more than 0.2 s"):
        check_upload("policy", policy, limits=CheckLimits(wall_s=0.2))
    cp = ControlPlane(f"sqlite:///{tmp_path}/cp.db", tmp_path / "cp.log", scheduler=False,
                      env={"RACER_ARTIFACT_CHECK_MEMORY_BYTES": str(300 * 2**20)})
    try:
        rss0 = rss_bytes(cp.proc.pid)
        r = cp.admin.post("/models", content=model)
        assert r.status_code == 422 and "memory limit is 300 MiB" in r.text, r.text[:500]
        r = cp.admin.post("/policies", content=policy)
        assert r.status_code in (200, 201), r.text[:500]
        assert httpx.get(cp.base + "/healthz").json()["ok"] is True
        assert rss_bytes(cp.proc.pid) - rss0 < 100 * 2**20  # neither check's memory is the control plane's
    finally:
        cp.stop()


def test_a_policy_whose_control_step_is_slow_is_refused_at_load(tmp_path, monkeypatch):
    """A policy runs on the node's serving thread once per control step. Within the allowlist and
    the weight bound a graph can still be slow (one shared 1400 x 1400 weight used 200 times, 0.4
    G multiply-adds, tens of ms here): the loader times a step (median of 5) and refuses one past
    `MAX_POLICY_STEP_MS`; the shipped one takes microseconds. The bound is set to 5 ms here, so
    that a faster CPU than this one still trips it."""
    import hashlib
    import json
    import shutil

    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from node_agent.allocator import OnnxPolicy, PolicyLoadError
    from node_agent.allocator.base import MAX_POLICY_STEP_MS

    from .cp_util import REPO

    shipped = OnnxPolicy(REPO / "policies" / "default", device="cpu")
    assert shipped.step_ms < MAX_POLICY_STEP_MS / 100
    monkeypatch.setattr("node_agent.allocator.base.MAX_POLICY_STEP_MS", 5.0)
    d = tmp_path / "slow"
    shutil.copytree(REPO / "policies" / "default", d)
    m = onnx.load(str(d / "policy.onnx"))
    g = m.graph
    out = g.output[0].name
    for node in g.node:  # the MLP's result becomes an input of one more Add
        node.output[:] = ["base_out" if o == out else o for o in node.output]
    width = 1400
    g.initializer.extend([numpy_helper.from_array(np.zeros((22, width), np.float32), "side_in"),
                          numpy_helper.from_array(np.zeros((width, width), np.float32), "side_w"),
                          numpy_helper.from_array(np.zeros((width, 1), np.float32), "side_out"),
                          numpy_helper.from_array(np.zeros((1,), np.float32), "zero")])
    nodes = [helper.make_node("MatMul", [g.input[0].name, "side_in"], ["h0"])]
    for i in range(200):  # zeros all the way: the output (and the golden parity) is the MLP's
        nodes.append(helper.make_node("MatMul", [f"h{i}", "side_w"], [f"h{i + 1}"]))
    nodes += [helper.make_node("MatMul", ["h200", "side_out"], ["side"]),
              helper.make_node("Mul", ["side", "zero"], ["side0"]),
              helper.make_node("Add", ["base_out", "side0"], [out])]
    g.node.extend(nodes)
    onnx.save(m, str(d / "policy.onnx"))
    data = (d / "policy.onnx").read_bytes()
    man = json.loads((d / "manifest.json").read_text())
    man.update(onnx_sha256=hashlib.sha256(data).hexdigest(), onnx_bytes=len(data), policy_id="slow-step")
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(PolicyLoadError, match="one control step takes"):
        OnnxPolicy(d, device="cpu")
