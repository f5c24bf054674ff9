"""Rollouts over real HTTP, judged by control_plane.rollout in the control plane's rollout job:
a worse policy is rolled back while the baseline keeps the active version; the same policy is never
failed; no traffic is inconclusive (paused, with the reason); a failed load rolls back; operators
pause, resume, promote and roll back by hand. Node traffic is simulated HTTP here (real node-agent
processes: tests/test_node_agent_control_plane*.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from .cp_util import REPO, ControlPlane, Database, artifact_tar, register, report, wait_for

DEFAULT_POLICY = REPO / "policies" / "default"
NODES = ["n1", "n2", "n3", "n4"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ro")
    d = Database("sqlite", tmp)
    cp = ControlPlane(d.url, tmp / "cp.log", env={"RACER_LIVENESS_MISSED_INTERVALS": "600"})
    node = {n: cp.node(n) for n in NODES}  # each node its own token (bound to its id)
    for v in ("ro-a", "ro-b", "ro-c", "ro-d", "ro-e", "ro-f"):
        r = cp.admin.post("/policies", content=artifact_tar(DEFAULT_POLICY, policy_id=v))
        assert r.status_code == 201, r.text
    assert cp.admin.post("/policies/ro-a/activate", json={"reason": "baseline"}).status_code == 200
    for n in NODES:
        register(node[n], n, policy_version="ro-a")
    yield cp, node
    cp.stop()


def _start(cp, node, version, **cfg):
    # no warm-up: these tests send their windows as soon as the bake starts (the warm-up's own test
    # is below)
    body = {"policy_version": version, "canary_fraction": 0.5, "bake_time_s": 3.0, "min_samples": 5,
            "load_timeout_s": 60.0, "warmup_s": 0.0, "reason": f"roll out {version}"}
    body.update(cfg)
    r = cp.admin.post("/rollouts", json=body)
    assert r.status_code == 201, r.text
    ro = r.json()
    canary = [x["node_id"] for x in ro["nodes"] if x["role"] == "canary"]
    baseline = [x["node_id"] for x in ro["nodes"] if x["role"] == "baseline"]
    assert len(canary) == 2 and len(baseline) == 2
    for n in canary:
        d = node[n].get(f"/nodes/{n}/directives").json()["policy"]
        assert (d["version"], d["rollout_id"]) == (version, ro["id"])
    for n in baseline:
        assert node[n].get(f"/nodes/{n}/directives").json()["policy"]["version"] == cp.admin.get(
            "/summary").json()["active_policy"]
    return ro, canary, baseline


def _confirm(node, nodes, version, status="loaded", error=None):
    for n in nodes:
        r = node[n].post(f"/nodes/{n}/policy", json={"policy_version": version, "status": status, "error": error})
        assert r.status_code == 200, r.text


def _wait_state(cp, rid, states, timeout_s=30):
    return wait_for(lambda: (lambda ro: ro if ro["state"] in states else None)(cp.admin.get(f"/rollouts/{rid}").json()),
                    timeout_s=timeout_s)


_seq: dict[str, int] = {}


def _send(node, n, version, p99s, slos, num_requests=100):
    reps = []
    for p99, slo in zip(p99s, slos):
        s = _seq.get(n, 0)
        _seq[n] = s + 1
        reps.append(report(s, ts_s=time.time(), p99_ms=p99, slo_attainment=slo, policy_version=version,
                           num_requests=num_requests))
    r = node[n].post(f"/nodes/{n}/reports", json={"reports": reps})
    assert r.status_code == 200, r.text


def test_worse_policy_is_rolled_back_and_baseline_keeps_the_active_version(env):
    cp, node = env
    ro, canary, baseline = _start(cp, node, "ro-b")
    _confirm(node, canary, "ro-b")
    _wait_state(cp, ro["id"], {"baking"})
    rng = np.random.default_rng(0)
    for n in canary:
        _send(node, n, "ro-b", rng.normal(40, 3, 10), rng.normal(0.80, 0.02, 10).clip(0, 1))
    for n in baseline:
        _send(node, n, "ro-a", rng.normal(10, 1, 10), rng.normal(0.99, 0.005, 10).clip(0, 1))
    done = _wait_state(cp, ro["id"], {"rolled_back", "promoted", "paused"})
    assert done["state"] == "rolled_back", done["verdict"]
    assert done["verdict"]["verdict"] == "fail"
    assert [s["to_state"] for s in done["steps"]] == ["pending", "baking", "rolled_back"]
    assert done["steps"][-1]["actor"] == "judge" and "canary worse" in done["steps"][-1]["reason"]
    for n in NODES:  # everyone (canary included) is told to run the active version again
        assert node[n].get(f"/nodes/{n}/directives").json()["policy"]["version"] == "ro-a"
    pols = {p["version"]: p["status"] for p in cp.admin.get("/policies").json()}
    assert pols["ro-a"] == "active" and pols["ro-b"] == "rolled_back"
    audit = cp.admin.get("/audit", params={"target": f"rollout:{ro['id']}"}).json()["items"]
    assert {"rollout.create", "rollout.bake", "rollout.rollback"} <= {a["action"] for a in audit}


def test_same_policy_is_never_failed(env):
    cp, node = env
    ro, canary, baseline = _start(cp, node, "ro-c")  # same ONNX and golden files as the active ro-a
    _confirm(node, canary, "ro-c")
    _wait_state(cp, ro["id"], {"baking"})
    rng = np.random.default_rng(1)
    for n in canary:
        _send(node, n, "ro-c", rng.normal(10, 1, 10), rng.normal(0.99, 0.005, 10).clip(0, 1))
    for n in baseline:
        _send(node, n, "ro-a", rng.normal(10, 1, 10), rng.normal(0.99, 0.005, 10).clip(0, 1))
    done = _wait_state(cp, ro["id"], {"rolled_back", "promoted", "paused"})
    assert done["state"] in ("promoted", "paused"), done["verdict"]
    assert done["verdict"]["verdict"] in ("pass", "inconclusive")
    if done["state"] == "paused":
        cp.admin.post(f"/rollouts/{ro['id']}/promote", json={"reason": "same policy"}).raise_for_status()
    assert cp.admin.get("/summary").json()["active_policy"] == "ro-c"
    for n in NODES:
        assert node[n].get(f"/nodes/{n}/directives").json()["policy"]["version"] == "ro-c"


def test_no_traffic_is_inconclusive_and_operators_act_by_hand(env):
    cp, node = env
    ro, canary, baseline = _start(cp, node, "ro-d")
    _confirm(node, canary, "ro-d")
    _wait_state(cp, ro["id"], {"baking"})
    for n in canary:  # idle windows: no requests, no P99 (null), no SLO figure
        _send(node, n, "ro-d", [None] * 6, [None] * 6, num_requests=0)
    for n in baseline:
        _send(node, n, "ro-c", [None] * 6, [None] * 6, num_requests=0)
    paused = _wait_state(cp, ro["id"], {"rolled_back", "promoted", "paused"})
    assert paused["state"] == "paused", paused["verdict"]
    assert paused["verdict"]["verdict"] == "inconclusive" and "too few windows" in paused["reason"]
    # manual: a paused rollout cannot be paused again; resume -> the judge pauses again (still no data)
    r = cp.admin.post(f"/rollouts/{ro['id']}/pause", json={"reason": "x"})
    assert r.status_code == 409 and "paused" in r.json()["detail"]
    cp.admin.post(f"/rollouts/{ro['id']}/resume", json={"reason": "look again"}).raise_for_status()
    again = _wait_state(cp, ro["id"], {"paused"})
    assert [s["action"] for s in again["steps"]][-2:] == ["resume", "pause"]
    r = cp.admin.post(f"/rollouts/{ro['id']}/rollback", json={"reason": "no traffic to judge"})
    assert r.status_code == 200 and r.json()["state"] == "rolled_back"
    assert r.json()["steps"][-1]["actor"] == "admin"
    assert cp.admin.post(f"/rollouts/{ro['id']}/promote", json={"reason": "late"}).status_code == 409
    assert cp.client(cp.token("viewer")).post(f"/rollouts/{ro['id']}/promote", json={"reason": "x"}).status_code == 403


def test_failed_load_shows_the_node_and_rolls_back(env):
    cp, node = env
    ro, canary, baseline = _start(cp, node, "ro-e")
    _confirm(node, canary[:1], "ro-e")
    _confirm(node, canary[1:], "ro-e", status="failed", error="PolicyLoadError: parity failed")
    done = _wait_state(cp, ro["id"], {"rolled_back", "promoted", "paused"})
    assert done["state"] == "rolled_back"
    st = {x["node_id"]: (x["status"], x["error"]) for x in done["nodes"] if x["role"] == "canary"}
    assert st[canary[1]] == ("failed", "PolicyLoadError: parity failed") and st[canary[0]][0] == "loaded"
    n = cp.admin.get(f"/nodes/{canary[1]}").json()
    assert n["policy_version"] != "ro-e" and "parity failed" in n["policy_error"]


def test_rollout_needs_a_known_policy_and_one_at_a_time(env):
    cp, node = env
    r = cp.admin.post("/rollouts", json={"policy_version": "nope"})
    assert r.status_code == 404 and "nope" in r.json()["detail"]
    r = cp.admin.post("/rollouts", json={"policy_version": "ro-b", "min_samples": 2})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "min_samples"]
    ro, canary, _ = _start(cp, node, "ro-b", bake_time_s=3600)
    r = cp.admin.post("/rollouts", json={"policy_version": "ro-d"})
    assert r.status_code == 409
    cp.admin.post(f"/rollouts/{ro['id']}/rollback", json={"reason": "cleanup"}).raise_for_status()


def test_a_node_under_a_manual_override_is_neither_canary_nor_baseline(env):
    """A canary once landed on a node pinned at 0.8 by hand, so the comparison measured the
    override. Pinned nodes are left out (the step says why); a cluster-wide override refuses."""
    cp, node = env
    o = cp.admin.post("/overrides", json={"node_id": "n1", "emb_share": 0.8, "reason": "pinned by hand"}).json()
    try:
        r = cp.admin.post("/rollouts", json={"policy_version": "ro-b", "canary_fraction": 0.5, "bake_time_s": 3600,
                                             "reason": "with a pinned node"})
        assert r.status_code == 201, r.text
        ro = r.json()
        assert "n1" not in {x["node_id"] for x in ro["nodes"]}
        assert {x["node_id"] for x in ro["nodes"]} == set(NODES) - {"n1"}
        steps = cp.admin.get(f"/rollouts/{ro['id']}").json()["steps"]
        assert "override" in steps[0]["details"]["excluded"]["n1"]
        # n1 keeps the active policy
        assert node["n1"].get("/nodes/n1/directives").json()["policy"]["version"] == cp.admin.get(
            "/summary").json()["active_policy"]
        cp.admin.post(f"/rollouts/{ro['id']}/rollback", json={"reason": "cleanup"}).raise_for_status()
        c = cp.admin.post("/overrides", json={"node_id": None, "emb_share": 0.4, "reason": "everyone"}).json()
        r = cp.admin.post("/rollouts", json={"policy_version": "ro-b", "reason": "under a cluster override"})
        assert r.status_code == 409 and f"override {c['id']}" in r.json()["detail"]
        cp.admin.post(f"/overrides/{c['id']}/clear", json={"reason": "cleanup"}).raise_for_status()
    finally:
        cp.admin.post(f"/overrides/{o['id']}/clear", json={"reason": "cleanup"})


def test_the_warm_up_s_windows_are_not_judged_the_bake_s_later_ones_are(env):
    """A canary much slower in its first seconds (cold caches after the change), then no different:
    with a 4-s warm-up the judge reads only the later windows and promotes; a warm-up longer than
    the bake is refused (422); the windows sent inside the warm-up stay stored."""
    cp, node = env
    r = cp.admin.post("/rollouts", json={"policy_version": "ro-f", "bake_time_s": 2.0, "warmup_s": 3.0,
                                         "reason": "too long a warm-up"})
    assert r.status_code in (409, 422) and "warmup_s" in r.text
    ro, canary, baseline = _start(cp, node, "ro-f", bake_time_s=6.0, warmup_s=4.0)
    _confirm(node, canary, "ro-f")
    _wait_state(cp, ro["id"], {"baking"})
    rng = np.random.default_rng(3)
    for n in canary:  # the warm-up: 4x slower, far lower attainment
        _send(node, n, "ro-f", rng.normal(40, 3, 10), rng.normal(0.80, 0.02, 10).clip(0, 1))
    for n in baseline:
        _send(node, n, ro["baseline_version"], rng.normal(10, 1, 10), rng.normal(0.99, 0.005, 10).clip(0, 1))
    time.sleep(4.5)  # past the warm-up: the same distribution on both sides
    for n in canary:
        _send(node, n, "ro-f", rng.normal(10, 1, 10), rng.normal(0.99, 0.005, 10).clip(0, 1))
    for n in baseline:
        _send(node, n, ro["baseline_version"], rng.normal(10, 1, 10), rng.normal(0.99, 0.005, 10).clip(0, 1))
    done = _wait_state(cp, ro["id"], {"rolled_back", "promoted", "paused"})
    assert done["state"] == "promoted", done["verdict"]
    judged = {j["metric"]: j for j in done["verdict"]["judgements"]}
    assert judged["p99_ms"]["n_canary"] == 20 and judged["p99_ms"]["n_baseline"] == 20  # the later 10 a node
