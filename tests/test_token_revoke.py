"""Revoking tokens (`racer token revoke`, `racer token list`) and what a revocation frees: a
gateway id claimed by a revoked token is claimed by the next token that reports as it, and only
by that one; strings with NUL are refused (422), never a database error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from tests.test_client_view import _report

from .cp_util import REPO

ADMIN = "test-admin-token-revoke"


def _racer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "racer.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture()
def api(tmp_path):
    from control_plane.api import create_app
    from control_plane.settings import Settings

    db = f"sqlite:///{tmp_path / 'cp.db'}"
    app = create_app(Settings(database_url=db, scheduler=False, admin_token=ADMIN), clock=lambda: 2000.0)
    with TestClient(app) as c:
        def token(role: str, **kw) -> tuple[int, dict]:
            r = c.post("/api/v1/tokens", json={"role": role, "name": role, **kw},
                       headers={"Authorization": f"Bearer {ADMIN}"})
            assert r.status_code == 201, r.text
            return r.json()["id"], {"Authorization": f"Bearer {r.json()['token']}"}
        yield c, token, db, app


def test_a_revoked_gateway_token_frees_its_id_for_the_next_token_only(api):
    c, token, db, app = api
    (id1, t1), (_, t2), (_, t3) = token("router"), token("router"), token("router")
    url = "/api/v1/gateways/gw-r/reports"
    assert c.post(url, json={"reports": [_report(1, 1999.0)]}, headers=t1).status_code == 200
    assert c.post(url, json={"reports": [_report(2, 1999.5)]}, headers=t2).status_code == 403
    out = _racer("token", "revoke", str(id1), "--db", db, "--reason", "gateway host retired")
    assert out.returncode == 0 and f"token {id1} (router, router): revoked" in out.stdout, out.stderr
    app.state.tokens.clear()  # the API process's token cache (a revocation from the CLI reaches it within its TTL)
    r = c.post(url, json={"reports": [_report(2, 1999.5)]}, headers=t2)
    assert r.status_code == 200, r.text
    # the id is t2's now: a third token is refused, t1 is refused outright
    assert c.post(url, json={"reports": [_report(3, 2000.0)]}, headers=t3).status_code == 403
    assert c.post(url, json={"reports": [_report(3, 2000.0)]}, headers=t1).status_code == 401
    audit = c.get("/api/v1/audit", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    rows = audit["items"] if isinstance(audit, dict) else audit
    assert any(a["action"] == "token.revoke" and a["reason"] == "gateway host retired" for a in rows)


def test_token_list_and_revoke_of_an_unknown_id(tmp_path):
    db = f"sqlite:///{tmp_path / 'cp.db'}"
    made = _racer("token", "create", "--role", "router", "--db", db, "--json")
    assert made.returncode == 0, made.stderr
    tid = json.loads(made.stdout)["id"]
    listed = _racer("token", "list", "--db", db, "--json")
    rows = [json.loads(x) for x in listed.stdout.splitlines()]
    assert [(r["id"], r["role"], r["revoked"]) for r in rows] == [(tid, "router", False)]
    assert "token" not in rows[0] and json.loads(made.stdout)["token"] not in listed.stdout
    bad = _racer("token", "revoke", str(tid), "999", "--db", db)
    assert bad.returncode == 2 and "no token with id 999 (nothing revoked)" in bad.stderr
    assert json.loads(_racer("token", "list", "--db", db, "--json").stdout)["revoked"] is False
    assert _racer("token", "revoke", str(tid), "--db", db).returncode == 0
    again = _racer("token", "revoke", str(tid), "--db", db)
    assert again.returncode == 0 and "already revoked" in again.stdout


@pytest.mark.parametrize("where", ["reason", "layer_detail", "feature_name"])
def test_nul_in_a_report_string_is_a_422_naming_it(api, where):
    c, token, _, _ = api
    _, node = token("node", node_id="nul1")
    r = c.post("/api/v1/nodes/register", headers=node, json={
        "node_id": "nul1", "address": "http://127.0.0.1:9", "device": "cpu",
        "cost_profile": {"kv_recompute_us_per_token": 2.0, "emb_transfer_us_per_row": 1.0, "service_time_us": 500.0}})
    assert r.status_code == 200, r.text
    decision = {"source": "base", "emb_share": 0.5, "reason": "ok"}
    if where == "reason":
        decision["reason"] = "bad\x00reason"
    elif where == "layer_detail":
        decision["layers"] = [{"layer": "base", "detail": {"hold_reason": "x\x00y"}}]
    else:
        decision["features"] = {"lo\x00ad": 0.5}
    rep = {"seq": 0, "ts_s": 10.0, "interval_s": 1.0, "emb_share": 0.5, "emb_share_target": 0.5, "decision": decision}
    r = c.post("/api/v1/nodes/nul1/reports", headers=node, json={"reports": [rep]})
    assert r.status_code == 422 and "NUL" in r.text, r.text
    assert c.get("/api/v1/decisions", params={"node_id": "nul1"},
                 headers={"Authorization": f"Bearer {ADMIN}"}).json()["total"] == 0
