""""Only one" under parallel requests, on a real control plane over SQLite and PostgreSQL: 8
activations of 8 policies at once leave one policy active (one 200, the others 409), 8 rollouts
started at once leave one open, 12 overrides of one node at once leave one active, and two
parallel events on one rollout do not both apply. The database holds it (partial unique indexes,
migration 0009; the rollout's state as its row version), so no interleaving of the requests can
break it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from .cp_util import ControlPlane, Database, artifact_tar, backends, register
from .test_control_plane_api import DEFAULT_POLICY

N = 8


@pytest.fixture(params=backends())
def cp(request, tmp_path):
    d = Database(request.param, tmp_path)
    cp = ControlPlane(d.url, tmp_path / "cp.log", env={"RACER_LIVENESS_MISSED_INTERVALS": "600"}, scheduler=False)
    try:
        yield cp
    finally:
        cp.stop()
        d.drop()


def _fire(fns) -> list[int]:
    """Run ``fns`` at once (one thread and one connection each); their status codes."""
    with ThreadPoolExecutor(len(fns)) as pool:
        return [f.result() for f in [pool.submit(fn) for fn in fns]]


def _statuses(cp, method: str, calls: list[tuple[str, dict]]) -> list[int]:
    clients = [cp.client(cp.ADMIN) for _ in calls]
    try:
        return _fire([lambda c=c, p=p, b=b: getattr(c, method)(p, json=b).status_code
                      for c, (p, b) in zip(clients, calls)])
    finally:
        for c in clients:
            c.close()


def test_parallel_activations_leave_one_policy_active(cp):
    for i in range(N):
        assert cp.admin.post("/policies", content=artifact_tar(DEFAULT_POLICY, policy_id=f"par-{i}")).status_code == 201
    codes = _statuses(cp, "post", [(f"/policies/par-{i}/activate", {"reason": "race"}) for i in range(N)])
    assert set(codes) <= {200, 409}, codes
    active = [p["version"] for p in cp.admin.get("/policies").json() if p["status"] == "active"]
    assert len(active) == 1, active
    audited = cp.admin.get("/audit", params={"action": "policy.activate", "limit": 100}).json()["items"]
    assert len(audited) == codes.count(200)  # a refused activation is not audited
    assert audited[0]["after"]["active"] == active[0]  # the last one audited is the one active


def test_parallel_rollouts_leave_one_open_and_parallel_events_one_outcome(cp):
    for i in range(N + 1):
        assert cp.admin.post("/policies", content=artifact_tar(DEFAULT_POLICY, policy_id=f"ro-{i}")).status_code == 201
    assert cp.admin.post("/policies/ro-0/activate", json={"reason": "baseline"}).status_code == 200
    for n in ("n1", "n2"):
        register(cp.node(n), n, policy_version="ro-0")
    codes = _statuses(cp, "post", [("/rollouts", {"policy_version": f"ro-{i + 1}", "canary_fraction": 0.5,
                                                   "reason": "race"}) for i in range(N)])
    assert codes.count(201) == 1 and set(codes) <= {201, 409}, codes
    rollouts = cp.admin.get("/rollouts").json()
    open_ = [r for r in rollouts if r["state"] in ("pending", "baking", "paused")]
    assert len(open_) == 1, rollouts
    rid = open_[0]["id"]
    codes = _statuses(cp, "post", [(f"/rollouts/{rid}/promote", {"reason": "race"}),
                                   (f"/rollouts/{rid}/rollback", {"reason": "race"})] * 2)
    assert codes.count(200) == 1 and set(codes) <= {200, 409}, codes
    r = cp.admin.get(f"/rollouts/{rid}").json()
    active = [p["version"] for p in cp.admin.get("/policies").json() if p["status"] == "active"]
    assert len(active) == 1
    assert active == ([r["policy_version"]] if r["state"] == "promoted" else ["ro-0"]), (r["state"], active)


def test_parallel_overrides_of_one_node_leave_one_active(cp):
    register(cp.node("n1"), "n1")
    codes = _statuses(cp, "post", [("/overrides", {"node_id": "n1", "emb_share": 0.3 + 0.02 * i, "reason": "race"})
                                   for i in range(12)])
    assert codes.count(201) >= 1 and set(codes) <= {201, 409}, codes
    active = [o for o in cp.admin.get("/overrides").json() if o["state"] == "active" and o["node_id"] == "n1"]
    assert len(active) == 1, active
    # the cluster-wide override (no node) is its own "one"
    codes = _statuses(cp, "post", [("/overrides", {"node_id": None, "emb_share": 0.4, "reason": "race"})] * 6)
    active = [o for o in cp.admin.get("/overrides").json() if o["state"] == "active" and o["node_id"] is None]
    assert len(active) == 1 and set(codes) <= {201, 409}, (codes, active)
