"""`racer override` and `racer rollout` against a real control plane (a process, over HTTP): the
control plane found through a `racer up` data folder's processes.json, the token from its file or
RACER_TOKEN (never argv), refusals with the API's reason and exit 1, an unreachable one exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .cp_util import REPO, ControlPlane, Database, artifact_tar, register
from .test_control_plane_api import DEFAULT_POLICY


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ops")
    d = Database("sqlite", tmp)
    cp = ControlPlane(d.url, tmp / "cp.log", env={"RACER_LIVENESS_MISSED_INTERVALS": "600"}, scheduler=False)
    data = tmp / "racer-data"
    data.mkdir()
    (data / "processes.json").write_text(json.dumps({"control-plane": {"url": cp.base, "pid": cp.proc.pid}}))
    (data / "operator_token").write_text(cp.ADMIN + "\n")
    for v in ("ops-a", "ops-b"):
        assert cp.admin.post("/policies", content=artifact_tar(DEFAULT_POLICY, policy_id=v)).status_code == 201
    assert cp.admin.post("/policies/ops-a/activate", json={"reason": "baseline"}).status_code == 200
    for n in ("n1", "n2"):
        register(cp.node(n), n, policy_version="ops-a")
    yield cp, data
    cp.stop()


def racer(data, *argv, env=None):
    e = {k: v for k, v in os.environ.items() if k != "RACER_TOKEN"}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "racer", *argv, "--data-dir", str(data)], cwd=REPO,
                          env=dict(e, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=60)


def test_overrides_set_list_clear_from_the_command_line(system):
    cp, data = system
    p = racer(data, "override", "set", "--node", "n1", "--emb-share", "0.7", "--ttl-s", "600", "--reason", "cli")
    assert p.returncode == 0 and "n1" in p.stdout and "0.7" in p.stdout, p.stderr
    p = racer(data, "override", "list", "--state", "active", "--json")
    active = json.loads(p.stdout)
    assert [(o["node_id"], o["emb_share"]) for o in active] == [("n1", 0.7)]
    p = racer(data, "override", "clear", str(active[0]["id"]), "--reason", "done")
    assert p.returncode == 0 and "cleared" in p.stdout
    assert [o["state"] for o in cp.admin.get("/overrides").json()] == ["cleared"]
    # a refusal: the API's reason, exit 1
    p = racer(data, "override", "set", "--cluster", "--emb-share", "1.5", "--reason", "too much")
    assert p.returncode == 1 and "emb_share" in p.stderr and "HTTP 422" in p.stderr


def test_rollouts_start_and_roll_back_from_the_command_line(system):
    cp, data = system
    p = racer(data, "rollout", "start", "--policy", "ops-b", "--canary-fraction", "0.5", "--bake-time-s", "3600",
              "--reason", "cli", "--json")
    assert p.returncode == 0, p.stderr
    ro = json.loads(p.stdout)
    assert ro["state"] == "pending" and ro["policy_version"] == "ops-b"
    p = racer(data, "rollout", "start", "--policy", "ops-b", "--reason", "again")
    assert p.returncode == 1 and "HTTP 409" in p.stderr
    p = racer(data, "rollout", "list")
    assert p.returncode == 0 and "ops-b" in p.stdout and "pending" in p.stdout
    p = racer(data, "rollout", "rollback", str(ro["id"]), "--reason", "cli says no")
    assert p.returncode == 0 and "rolled_back" in p.stdout, p.stderr
    assert cp.admin.get(f"/rollouts/{ro['id']}").json()["state"] == "rolled_back"


def test_the_token_comes_from_the_environment_or_a_file_and_a_dead_control_plane_is_exit_2(system, tmp_path):
    cp, data = system
    viewer = cp.token("viewer", "cli-viewer")
    p = racer(data, "override", "set", "--node", "n1", "--emb-share", "0.5", "--reason", "x",
              env={"RACER_TOKEN": viewer})
    assert p.returncode == 1 and "HTTP 403" in p.stderr  # the environment's token was the one used
    empty = tmp_path / "empty"
    empty.mkdir()
    p = racer(empty, "override", "list")
    assert p.returncode == 2 and "processes.json" in p.stderr
    p = racer(empty, "override", "list", "--control-plane", "http://127.0.0.1:9")
    assert p.returncode == 2 and "no token" in p.stderr
    p = racer(empty, "override", "list", "--control-plane", "http://127.0.0.1:9", env={"RACER_TOKEN": "x"})
    assert p.returncode == 2 and "ConnectError" in p.stderr
