"""The control plane over real HTTP: a control-plane process (uvicorn) per module or test, its
jobs running on short periods. Node traffic here is simulated HTTP (the tests with real node-agent
processes are in tests/test_node_agent_control_plane*.py)."""

from __future__ import annotations

import http.server
import io
import tarfile
import json
import threading
import time

import httpx
import pytest

from .cp_util import REPO, ControlPlane, Database, artifact_tar, backends, register, report, wait_for

DEFAULT_POLICY = REPO / "policies" / "default"


@pytest.fixture(scope="module")
def cp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    d = Database("sqlite", tmp)
    c = ControlPlane(d.url, tmp / "cp.log")
    yield c
    c.stop()


@pytest.fixture(params=backends())
def cp_any(request, tmp_path):
    d = Database(request.param, tmp_path)
    c = ControlPlane(d.url, tmp_path / "cp.log")
    yield c
    c.stop()
    d.drop()


def test_replayed_batch_is_stored_once(cp_any):
    node = cp_any.node("r1")
    register(node, "r1")
    batch = {"reports": [report(i, ts_s=1000.0 + i, decision={"source": "base", "emb_share": 0.5, "reason": "x"})
                         for i in range(5)]}
    assert node.post("/nodes/r1/reports", json=batch).json() == {"stored": 5, "duplicates": 0}
    assert node.post("/nodes/r1/reports", json=batch).json() == {"stored": 0, "duplicates": 5}
    overlap = {"reports": batch["reports"][3:] + [report(5, ts_s=1005.0)]}
    assert node.post("/nodes/r1/reports", json=overlap).json() == {"stored": 1, "duplicates": 2}
    rows = cp_any.admin.get("/reports", params={"node_id": "r1"}).json()
    assert [r["seq"] for r in rows] == [0, 1, 2, 3, 4, 5]
    cl = cp_any.admin.get("/reports", params={"cluster": "true", "step_s": 100}).json()
    assert [(r["node_id"], r["ts_s"], r["num_reports"]) for r in cl] == [("*", 1000.0, 6)]
    r = cp_any.admin.get("/reports", params={"cluster": "true"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "step_s"]
    dec = cp_any.admin.get("/decisions", params={"node_id": "r1"}).json()
    assert dec["total"] == 5
    text = httpx.get(cp_any.base + "/metrics").text
    assert "racer_cp_reports_stored_total 6.0" in text and "racer_cp_reports_duplicate_total 7.0" in text


def test_bad_reports_get_422_naming_the_field_and_nothing_is_stored(cp):
    node = cp.node("bad1")
    register(node, "bad1")
    good, bad = report(0, ts_s=1.0), report(1, ts_s=2.0, emb_share=1.5)
    r = node.post("/nodes/bad1/reports", json={"reports": [good, bad]})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "reports", 1, "emb_share"]
    r = node.post("/nodes/bad1/reports", json={"reports": [report(0, ts_s=1.0, surprise=1)]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "reports", 0, "surprise"]
    r = node.post("/nodes/bad1/reports", content=b'{"reports": [{"seq": 0, "ts_s": NaN}]}')
    assert r.status_code == 422
    r = cp.node("nobody").post("/nodes/nobody/reports", json={"reports": [good]})
    assert r.status_code == 404 and "nobody" in r.json()["detail"]
    r = cp.node("x").post("/nodes/register", json={"node_id": "x", "address": "ftp://x", "device": "cpu",
                                           "cost_profile": {"kv_recompute_us_per_token": -1,
                                                            "emb_transfer_us_per_row": 1, "service_time_us": 1}})
    assert r.status_code == 422
    assert {tuple(e["loc"]) for e in r.json()["detail"]} == {("body", "address"),
                                                            ("body", "cost_profile", "kv_recompute_us_per_token")}
    assert cp.admin.get("/reports", params={"node_id": "bad1"}).json() == []
    assert cp.admin.get("/nodes/x").status_code == 404
    # a cost profile outside physical ranges (1e308 µs, a boolean) is refused, field by field
    r = cp.node("absurd").post("/nodes/register", json={"node_id": "absurd", "address": "http://127.0.0.1:1", "device": "cpu",
                                           "cost_profile": {"kv_recompute_us_per_token": 1e308,
                                                            "emb_transfer_us_per_row": 1e308,
                                                            "service_time_us": False, "queue_capacity": 64}})
    assert r.status_code == 422
    assert {tuple(e["loc"]) for e in r.json()["detail"]} == {
        ("body", "cost_profile", "kv_recompute_us_per_token"), ("body", "cost_profile", "emb_transfer_us_per_row"),
        ("body", "cost_profile", "service_time_us")}
    assert cp.admin.get("/nodes/absurd").status_code == 404
    r = node.post("/nodes/bad1/reports", json={"reports": [report(5, ts_s=5.0, kv_recompute_us_per_token=1e300)]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "reports", 0, "kv_recompute_us_per_token"]


def _fill(path: str, params: list[dict]) -> str:
    for p in params:
        if p.get("in") == "path":
            val = "1" if p["schema"].get("type") == "integer" else "n1"
            path = path.replace("{" + p["name"] + "}", val)
    return path


def test_every_mutating_route_refuses_missing_wrong_token_and_wrong_role(cp):
    spec = httpx.get(cp.base + "/openapi.json").json()
    tokens = {role: cp.token(role, node_id="n1" if role == "node" else None)
              for role in ("node", "operator", "viewer", "router")}
    checked = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            if method not in ("post", "put", "patch", "delete"):
                continue
            allowed = op["x-racer-roles"]  # every mutating route must declare its roles
            url = cp.base + _fill(path, op.get("parameters", []))
            for token, want in [(None, 401), ("racer_not-a-token", 401)] + [
                    (tokens[r], 403) for r in ("node", "operator", "viewer", "router") if r not in allowed]:
                h = {"Authorization": f"Bearer {token}"} if token else {}
                r = httpx.request(method.upper(), url, headers=h, json={}, timeout=30)
                assert r.status_code == want, (method, path, token and token[:10], r.status_code, r.text)
            checked.append((method, path))
    assert len(checked) >= 15, checked
    # and the reads: a viewer reads, a node token does not read operator history
    assert cp.client(tokens["viewer"]).get("/nodes").status_code == 200
    assert cp.client(tokens["node"]).get("/audit").status_code == 403
    assert cp.client(tokens["viewer"]).get("/whoami").json()["role"] == "viewer"
    # a gateway's token (role router): the node list, the weights and its own registration, no more
    gw = cp.client(tokens["router"])
    assert gw.get("/nodes").status_code == 200
    assert gw.get("/router/weights").status_code in (200, 404)  # 404: no weights computed yet
    assert gw.post("/routers", json={"url": "http://127.0.0.1:9"}).status_code == 200
    assert gw.delete("/routers", params={"url": "http://127.0.0.1:9"}).status_code == 403
    assert cp.admin.delete("/routers", params={"url": "http://127.0.0.1:9"}).status_code == 200  # the module's cp is shared
    for path in ("/reports", "/decisions", "/audit", "/overrides", "/policies", "/summary"):
        assert gw.get(path).status_code == 403, path
    assert [p for p, ops in spec["paths"].items() for m, op in ops.items()
            if "router" in op.get("x-racer-roles", [])] == ["/api/v1/whoami", "/api/v1/nodes", "/api/v1/routers",
                                                             "/api/v1/router/weights",
                                                             "/api/v1/gateways/{gateway_id}/reports",
                                                             "/api/v1/gateways/{gateway_id}/samples"]


def test_override_lifecycle_with_expiry_and_audit(cp):
    node, node2 = cp.node("o1"), cp.node("o2")
    register(node, "o1")
    register(node2, "o2")
    r = cp.admin.post("/overrides", json={"node_id": "o1", "emb_share": 0.99, "reason": "too high"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "emb_share"]
    assert "guard bounds" in r.json()["detail"][0]["msg"]
    r = cp.admin.post("/overrides", json={"node_id": "o1", "emb_share": 0.3})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "reason"]
    assert cp.admin.get("/overrides").json() == []
    # cluster-wide override, then a node override with a short expiry
    c = cp.admin.post("/overrides", json={"emb_share": 0.6, "reason": "cluster test"}).json()
    o = cp.admin.post("/overrides", json={"node_id": "o1", "emb_share": 0.3, "ttl_s": 1.5, "reason": "hot items"})
    assert o.status_code == 201
    o = o.json()
    d1 = node.get("/nodes/o1/directives").json()["override"]
    assert (d1["override_id"], d1["emb_share"], d1["scope"]) == (o["id"], 0.3, "node")
    assert node2.get("/nodes/o2/directives").json()["override"]["emb_share"] == 0.6
    wait_for(lambda: cp.admin.get("/overrides", params={"state": "expired"}).json(), timeout_s=15)
    assert node.get("/nodes/o1/directives").json()["override"]["emb_share"] == 0.6  # back to the cluster's
    r = cp.admin.post(f"/overrides/{c['id']}/clear", json={"reason": "done"})
    assert r.status_code == 200 and r.json()["state"] == "cleared"
    assert cp.admin.post(f"/overrides/{c['id']}/clear", json={"reason": "again"}).status_code == 409
    assert node2.get("/nodes/o2/directives").json()["override"] is None
    audit = cp.admin.get("/audit", params={"target": "override:"}).json()["items"]
    seen = {(a["action"], a["target"]) for a in audit}
    assert {("override.create", f"override:{c['id']}"), ("override.create", f"override:{o['id']}"),
            ("override.expire", f"override:{o['id']}"), ("override.clear", f"override:{c['id']}")} <= seen
    exp = next(a for a in audit if a["action"] == "override.expire")
    assert exp["actor"] == "system" and exp["before"]["emb_share"] == 0.3
    create = next(a for a in audit if a["target"] == f"override:{o['id']}" and a["action"] == "override.create")
    assert create["actor"] == "admin" and create["reason"] == "hot items"


class _Recorder(http.server.BaseHTTPRequestHandler):
    received: list = []
    token = None  # the push token the control plane gave at registration

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Authorization") != f"Bearer {type(self).token}":
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        type(self).received.append((self.path, json.loads(body)))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *a):
        pass


def test_router_weights_pushed_on_change_only_and_pullable(cp):
    """No timing assumptions: w1 and w2 are kept up by a reporting thread, the nodes of the earlier
    tests are waited down (their leaving is a real change of inputs), and "no new version with the
    same inputs" is checked over three runs of the weights job counted in `GET /jobs`."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    _Recorder.received = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    nodes = {nid: cp.node(nid) for nid in ("w1", "w2")}
    node = nodes["w1"]
    seqs, seq_lock, stop = iter(range(10**6)), threading.Lock(), threading.Event()

    def send(nid, **kw):  # one report; seqs increase per node whichever thread sends
        with seq_lock:
            seq = next(seqs)
            r = nodes[nid].post(f"/nodes/{nid}/reports", json={"reports": [report(seq, **kw)]})
        assert r.status_code == 200, r.text

    def keep_alive():  # well inside the liveness limit (5 report intervals), whatever the load
        while not stop.wait(0.3):
            for nid in ("w1", "w2"):
                send(nid)

    alive = threading.Thread(target=keep_alive, daemon=True)
    try:
        for nid, kv in (("w1", 2.0), ("w2", 4.0)):
            register(nodes[nid], nid, kv_recompute_us_per_token=kv)
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        assert node.post("/routers", json={"url": url}).status_code == 403  # a node token registers no router
        gw = cp.client(cp.token("router", "gw-push-test"))
        r = gw.post("/routers", json={"url": url})
        assert r.status_code == 200 and r.json()["push_token"].startswith("racer_push_"), r.text
        _Recorder.token = r.json()["push_token"]  # derived from the control plane's key: stored nowhere
        assert "push_token" not in cp.admin.get("/routers").json()[0]
        assert gw.post("/routers", json={"url": url}).json()["push_token"] == _Recorder.token  # the same again
        assert gw.post("/routers", json={"url": url, "push_token": "mine"}).status_code == 422  # not chosen by it
        alive.start()
        first = wait_for(lambda: [b for p, b in _Recorder.received if {"w1", "w2"} <= set(b["nodes"])])[0]
        assert first["nodes"]["w2"]["kv_recompute_us_per_token"] == 4.0
        assert "registered" in first["nodes"]["w2"]["reason"]
        # the nodes of the earlier tests no longer report: wait until the weights hold w1 and w2 only
        pulled = wait_for(lambda: (lambda w: w if set(w["nodes"]) == {"w1", "w2"} else None)(
            node.get("/router/weights").json()), timeout_s=60)
        assert pulled["version"] >= first["version"]
        v = pulled["version"]
        assert {n["node_id"] for n in cp.admin.get("/nodes").json() if n["status"] == "up"} == {"w1", "w2"}
        # three runs of the weights job with the same inputs: no new version
        since = time.time()
        wait_for(lambda: len([j for j in cp.admin.get("/jobs", params={"job": "router_weights", "since_s": since})
                              .json() if j["ok"]]) >= 3, timeout_s=60)
        assert node.get("/router/weights").json()["version"] == v
        assert {n["node_id"] for n in cp.admin.get("/nodes").json() if n["status"] == "up"} == {"w1", "w2"}
        # w2 reports a much higher KV recompute cost: a new version with the reason, pushed
        for _ in range(5):
            send("w2", kv_recompute_us_per_token=9.0)
            send("w1")
        new = wait_for(lambda: [b for p, b in _Recorder.received
                                if b["nodes"].get("w2", {}).get("kv_recompute_us_per_token") == 9.0])[0]
        assert new["version"] > v and "reported median" in new["nodes"]["w2"]["reason"]
        hist = cp.admin.get("/router/weights/history").json()
        change = next(h for h in hist if h["version"] == new["version"])
        assert "w2 kv_recompute_us_per_token 4 -> 9" in change["reason"]
        assert all(p == "/v1/router/weights" for p, _ in _Recorder.received)
        routers = cp.admin.get("/routers").json()
        assert any(r["url"] == url and r["pushed_version"] == new["version"] for r in routers)
    finally:
        stop.set()
        if alive.is_alive():
            alive.join(timeout=10)
        srv.shutdown()


def test_policy_upload_verify_download(cp):
    bad = artifact_tar(DEFAULT_POLICY, policy_id="corrupt-1", corrupt_onnx=True)
    r = cp.admin.post("/policies", content=bad, headers={"Content-Type": "application/x-tar"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body"] and "refused" in r.json()["detail"][0]["msg"]
    r = cp.admin.post("/policies", content=b"not a tar", headers={"Content-Type": "application/x-tar"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body"] and "tar" in r.json()["detail"][0]["msg"]
    assert cp.admin.get("/policies/corrupt-1").status_code == 404
    good = artifact_tar(DEFAULT_POLICY, policy_id="up-a")
    r = cp.admin.post("/policies", content=good, headers={"Content-Type": "application/x-tar"})
    assert r.status_code == 201, r.text
    p = r.json()
    assert p["version"] == "up-a" and p["status"] == "registered" and p["manifest"]["policy_id"] == "up-a"
    assert cp.admin.post("/policies", content=good).status_code == 200  # same files: idempotent
    other = artifact_tar(DEFAULT_POLICY)  # the default's own policy_id, different manifest bytes from up-a
    assert cp.admin.post("/policies", content=other).status_code == 201
    node = cp.node("art1")
    art = node.get("/policies/up-a/artifact")
    import hashlib

    assert art.status_code == 200 and hashlib.sha256(art.content).hexdigest() == p["digest"]
    assert art.headers["x-racer-digest"] == p["digest"]


def _gzip_bomb(size: int = 512 * 2**20) -> bytes:
    """A tar.gz whose policy.onnx is ``size`` bytes of zeros (about 0.1% of that compressed)."""
    import tarfile
    import zlib

    info = tarfile.TarInfo("policy.onnx")
    info.size = size
    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
    out = [z.compress(info.tobuf(format=tarfile.USTAR_FORMAT))]
    chunk = bytes(2**20)
    for _ in range(size // len(chunk)):
        out.append(z.compress(chunk))
    out.append(z.compress(bytes(1024)))  # the end-of-archive blocks
    out.append(z.flush())
    return b"".join(out)


def test_policy_uploads_that_unpack_too_far_or_are_cut_get_422(cp):
    """A decompression bomb is refused from its tar headers, before its bytes are inflated; a tar cut
    short, one with too many members, or garbage after a gzip header: a 422 naming the body, never
    a 500, and nothing stored."""
    from common.artifact_pack import MAX_ARTIFACT_UNPACKED_BYTES
    from common.artifact_pack import unpack_artifact

    bomb = _gzip_bomb()
    assert len(bomb) < 1_000_000
    with pytest.raises(ValueError, match="unpacks to more than"):
        unpack_artifact(bomb)
    good = artifact_tar(DEFAULT_POLICY, policy_id="cut-1")
    many = io.BytesIO()
    with tarfile.open(fileobj=many, mode="w") as tar:
        for i in range(70):
            tar.addfile(tarfile.TarInfo(f"junk{i}"), io.BytesIO(b""))
    cases = {"bomb": (bomb, "unpacks to more than"), "truncated": (good[: len(good) // 2], "not a complete tar"),
             "members": (many.getvalue(), "more than 64 members"),
             "gzip garbage": (b"\x1f\x8b\x08\x00" + bytes(range(200)), "not a complete tar")}
    for name, (body, words) in cases.items():
        r = cp.admin.post("/policies", content=body, headers={"Content-Type": "application/x-tar"})
        assert r.status_code == 422, (name, r.status_code, r.text[:300])
        assert r.json()["detail"][0]["loc"] == ["body"] and words in r.json()["detail"][0]["msg"], name
    assert cp.admin.get("/policies/cut-1").status_code == 404
    assert MAX_ARTIFACT_UNPACKED_BYTES == 64 * 2**20


def test_bodies_that_are_not_utf8_or_carry_a_lone_surrogate_get_422_not_500(cp):
    """The 422 echoes the refused input: bytes that are not UTF-8 and a lone surrogate (valid JSON
    text, not encodable as UTF-8) must still make a JSON answer; nothing is stored."""
    node = cp.node("utf1")
    register(node, "utf1")
    r = node.post("/nodes/utf1/reports", content=b"\xce\xe2", headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text[:300]
    op = cp.client(cp.token("operator"))
    for path, body, field in [("/tokens", b'{"name": "\\ud800", "role": "viewer"}', "name"),
                              ("/overrides", b'{"emb_share": 0.5, "reason": "\\ud800", "node_id": "utf1"}', None)]:
        r = op.post(path, content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500 and r.status_code != 401, (path, r.status_code, r.text[:300])
        r.json()  # a JSON body
        if field:
            assert ["body", field] in [e["loc"] for e in r.json()["detail"]]
    assert cp.admin.get("/reports", params={"node_id": "utf1"}).json() == []


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_get_422_naming_the_field_not_500(cp, text):
    """JSON's NaN/Infinity spellings parse; the 422 that echoes them must still encode as JSON."""
    op = cp.client(cp.token("operator"))
    for body, field in [(f'{{"emb_share": {text}, "reason": "x"}}', "emb_share"),
                        (f'{{"emb_share": 0.5, "ttl_s": {text}, "reason": "x"}}', "ttl_s")]:
        r = op.post("/overrides", content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert ["body", field] in [e["loc"] for e in r.json()["detail"]]
    stored = op.get("/overrides").json()
    assert not [o for o in (stored if isinstance(stored, list) else stored.get("items", [])) if o["reason"] == "x"]


def test_a_node_may_register_its_arena_size(cp):
    """``cost_profile.arena_bytes`` (optional, an integer in [1, 2^50]) is kept for the operators
    (the dashboard's split bars in MiB); a profile without it stores no such key."""
    node = cp.node("arena-1")
    register(node, "arena-1", arena_bytes=256 * 2**20)
    register(cp.node("arena-2"), "arena-2")
    nodes = {n["node_id"]: n for n in cp.admin.get("/nodes").json()}
    assert nodes["arena-1"]["cost_profile"]["arena_bytes"] == 256 * 2**20
    assert "arena_bytes" not in nodes["arena-2"]["cost_profile"]
    for bad in (0, 2**51, True, 1.5):
        r = node.post("/nodes/register", json={"node_id": "arena-1", "address": "http://127.0.0.1:9", "device": "cpu",
                                               "cost_profile": {"kv_recompute_us_per_token": 2.0,
                                                                "emb_transfer_us_per_row": 1.0,
                                                                "service_time_us": 500.0, "arena_bytes": bad}})
        assert r.status_code == 422, (bad, r.text)


EMULATED = {"mode": "emulated", "profile": "a100-hstu-api", "time_scale": 10.0, "calibrated": False,
            "time": "modelled", "label": "emulated a100-hstu-api (uncalibrated, modelled time, x10)"}


def test_what_a_nodes_figures_are_is_stored_returned_and_counted(cp):
    """A report's ``device_mode``/``device_profile`` are stored and read back with the raw
    reports; a node shows them from its latest report saying, else from its registration's
    ``cost_profile.device``, else null; the summary counts the up nodes per mode and the emulated
    ones' profiles. Values outside the contract get a 422 naming the field, and nothing is stored."""
    emu, link, mute = cp.node("dev-emu"), cp.node("dev-link"), cp.node("dev-mute")
    r = emu.post("/nodes/register", json={"node_id": "dev-emu", "address": "http://127.0.0.1:9",
                                          "device": EMULATED["label"],
                                          "cost_profile": {"kv_recompute_us_per_token": 2.0,
                                                           "emb_transfer_us_per_row": 1.0,
                                                           "service_time_us": 500.0, "device": EMULATED}})
    assert r.status_code == 200, r.text
    register(link, "dev-link", device={"mode": "link-emulated", "time": "measured", "label": "cpu (EMB link emulated)"})
    register(mute, "dev-mute")
    nodes = {n["node_id"]: n for n in cp.admin.get("/nodes").json()}
    assert nodes["dev-emu"]["device"] == EMULATED["label"] and nodes["dev-emu"]["cost_profile"]["device"] == EMULATED
    got = {k: (nodes[k]["device_mode"], nodes[k]["device_profile"]) for k in ("dev-emu", "dev-link", "dev-mute")}
    assert got == {"dev-emu": ("emulated", "a100-hstu-api"), "dev-link": ("link-emulated", None),
                   "dev-mute": (None, None)}  # from the registrations
    now = time.time()
    assert emu.post("/nodes/dev-emu/reports", json={"reports": [
        report(0, ts_s=now - 1, device_mode="emulated", device_profile="a100-hstu-api"),
        report(1, ts_s=now, device_mode="emulated", device_profile="a100-hstu-api")]}).status_code == 200
    assert mute.post("/nodes/dev-mute/reports", json={"reports": [report(0, ts_s=now, device_mode="real")]}).json() \
        == {"stored": 1, "duplicates": 0}
    assert link.post("/nodes/dev-link/reports", json={"reports": [report(0, ts_s=now)]}).status_code == 200
    rows = cp.admin.get("/reports", params={"node_id": "dev-emu"}).json()
    assert [(x["seq"], x["device_mode"], x["device_profile"]) for x in rows] == [
        (0, "emulated", "a100-hstu-api"), (1, "emulated", "a100-hstu-api")]
    assert [x["device_mode"] for x in cp.admin.get("/reports", params={"node_id": "dev-link"}).json()] == [None]
    one = cp.admin.get("/nodes/dev-mute").json()  # its report says real; its registration said nothing
    assert (one["device_mode"], one["device_profile"]) == ("real", None)
    assert cp.admin.get("/nodes/dev-link").json()["device_mode"] == "link-emulated"  # report silent: registration
    summ = cp.admin.get("/summary").json()
    assert summ["emulated_profiles"].get("a100-hstu-api") == 1
    assert summ["num_emulated"] == sum(summ["emulated_profiles"].values()) == summ["device_modes"].get("emulated")
    assert sum(summ["device_modes"].values()) == summ["num_up"]
    # outside the contract: 422 naming the field, nothing stored
    for bad, field in (({"device_mode": "gpu"}, "device_mode"), ({"device_mode": 1}, "device_mode"),
                       ({"device_profile": "p" * 129}, "device_profile"), ({"device_profile": ""}, "device_profile"),
                       ({"device_profile": 7}, "device_profile")):
        r = emu.post("/nodes/dev-emu/reports", json={"reports": [report(9, ts_s=now, **bad)]})
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["detail"][0]["loc"] == ["body", "reports", 0, field], r.text
    assert [x["seq"] for x in cp.admin.get("/reports", params={"node_id": "dev-emu"}).json()] == [0, 1]
    for bad, field in (({**EMULATED, "mode": "virtual"}, "mode"), ({**EMULATED, "time": "wall"}, "time"),
                       ({**EMULATED, "time_scale": 0}, "time_scale"), ({**EMULATED, "time_scale": True}, "time_scale"),
                       ({**EMULATED, "calibrated": "no"}, "calibrated"), ({**EMULATED, "label": "x" * 129}, "label"),
                       ({**EMULATED, "extra": 1}, "extra"), ({"profile": "p"}, "mode")):
        r = emu.post("/nodes/register", json={"node_id": "dev-emu", "address": "http://127.0.0.1:9", "device": "cpu",
                                              "cost_profile": {"kv_recompute_us_per_token": 2.0,
                                                               "emb_transfer_us_per_row": 1.0,
                                                               "service_time_us": 500.0, "device": bad}})
        assert r.status_code == 422, (bad, r.text)
        assert ["body", "cost_profile", "device", field] in [e["loc"] for e in r.json()["detail"]], r.text
    assert cp.admin.get("/nodes/dev-emu").json()["cost_profile"]["device"] == EMULATED
