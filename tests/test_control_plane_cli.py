"""`racer token create` and the admin token printed once on first start (real processes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx

from db import queries
from db.engine import make_engine, session_factory

from .cp_util import REPO, ControlPlane, wait_for


def test_token_create_stores_only_the_hash(tmp_path):
    url = f"sqlite:///{tmp_path}/cp.db"
    out = subprocess.run([sys.executable, "-m", "racer", "token", "create", "--role", "viewer", "--name", "grafana",
                          "--db", url, "--json"], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    tok = json.loads(out.stdout)
    assert tok["role"] == "viewer" and tok["name"] == "grafana" and tok["token"].startswith("racer_")
    engine = make_engine(url)
    with session_factory(engine)() as s:
        t = queries.token_by_secret(s, tok["token"])
        assert t is not None and t.role == "viewer" and t.token_sha256 != tok["token"]
        assert tok["token"] not in json.dumps([t.name, t.role, t.token_sha256])
    engine.dispose()
    bad = subprocess.run([sys.executable, "-m", "racer", "token", "create", "--role", "root", "--db", url],
                         cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "root" in bad.stderr


def test_admin_token_is_printed_once_on_first_start(tmp_path, monkeypatch):
    monkeypatch.delenv("RACER_ADMIN_TOKEN", raising=False)
    url = f"sqlite:///{tmp_path}/cp.db"
    cp = ControlPlane(url, tmp_path / "first.log", env={"RACER_ADMIN_TOKEN": ""})
    try:
        m = wait_for(lambda: re.search(r"admin operator token \(shown once\): (\S+)", (tmp_path / "first.log").read_text()))
        secret = m.group(1)
        who = httpx.get(cp.base + "/api/v1/whoami", headers={"Authorization": f"Bearer {secret}"}).json()
        assert who["role"] == "operator" and who["name"] == "admin"
    finally:
        cp.stop()
    cp = ControlPlane(url, tmp_path / "second.log", env={"RACER_ADMIN_TOKEN": ""})
    try:
        assert httpx.get(cp.base + "/api/v1/whoami", headers={"Authorization": f"Bearer {secret}"}).status_code == 200
    finally:
        cp.stop()
    assert "shown once" not in (tmp_path / "second.log").read_text()


def test_policy_push_registers_and_activates_an_artifact_and_reports_a_refusal(tmp_path):
    """`racer policy push DIR --control-plane URL --token T [--activate]`: the artifact goes through
    POST /policies (the agent's loader checks it) and is activated; a broken one exits 1 with the
    control plane's reason; a directory without the files is a usage error (2)."""
    import shutil

    cp = ControlPlane(f"sqlite:///{tmp_path}/cp.db", tmp_path / "cp.log", scheduler=False)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RACER_TOKEN", None)

    def push(*args):
        return subprocess.run([sys.executable, "-m", "racer", "policy", "push", *args, "--control-plane", cp.base],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    try:
        out = push(str(REPO / "policies" / "default"), "--token", cp.ADMIN, "--activate", "--json")
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["status"] == "active" and got["created"]
        assert cp.admin.get(f"/policies/{got['version']}").json()["status"] == "active"
        broken = tmp_path / "broken"
        shutil.copytree(REPO / "policies" / "default", broken)
        (broken / "policy.onnx").write_bytes(b"not an onnx model")
        out = push(str(broken), "--token", cp.ADMIN)
        assert out.returncode == 1 and "refused" in out.stderr and "422" in out.stderr, out.stderr
        out = push(str(tmp_path), "--token", cp.ADMIN)
        assert out.returncode == 2 and "lacks" in out.stderr
    finally:
        cp.stop()


def test_a_revoked_admin_token_stays_revoked_and_the_control_plane_still_starts(tmp_path):
    """`racer up` starts the control plane with RACER_ADMIN_TOKEN; once an operator revokes that
    token (it leaked), later starts with it must neither fail nor bring it back."""
    url = f"sqlite:///{tmp_path}/cp.db"
    leaked = "racer_leaked-admin-token"
    cp = ControlPlane(url, tmp_path / "first.log", env={"RACER_ADMIN_TOKEN": leaked})
    try:
        assert httpx.get(cp.base + "/api/v1/whoami", headers={"Authorization": f"Bearer {leaked}"}).status_code == 200
    finally:
        cp.stop()
    engine = make_engine(url)
    with session_factory(engine)() as s:
        tid = queries.token_by_secret(s, leaked).id
    engine.dispose()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "racer", "token", "revoke", str(tid), "--db", url, "--reason", "leaked"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cp = ControlPlane(url, tmp_path / "second.log", env={"RACER_ADMIN_TOKEN": leaked})  # starts (it raised before)
    try:
        assert httpx.get(cp.base + "/api/v1/whoami", headers={"Authorization": f"Bearer {leaked}"}).status_code == 401
    finally:
        cp.stop()
    log = (tmp_path / "second.log").read_text()
    assert "RACER_ADMIN_TOKEN is token" in log and "revoked" in log and "racer token create" in log


def test_kept_alive_connections_outlive_the_send_period():
    """A node sends once a send period on its kept-alive connection: the control plane keeps an
    idle connection open past that (else one closed as the node sends costs a failed request),
    unless the operator set RACER_HTTP_KEEP_ALIVE_S."""
    from control_plane.main import http_timeouts
    from control_plane.settings import Settings

    assert http_timeouts(Settings(), {}).keep_alive_s == 5.0
    assert http_timeouts(Settings(send_period_s=5.0), {}).keep_alive_s == 10.0
    assert http_timeouts(Settings(send_period_s=60.0), {}).keep_alive_s == 65.0
    assert http_timeouts(Settings(send_period_s=5.0), {"RACER_HTTP_KEEP_ALIVE_S": "3"}).keep_alive_s == 3.0
