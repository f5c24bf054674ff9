"""An emulated agent over real processes: every output says emulated, and by which profile.

A real control plane (SQLite) and a real ``racer node-agent --emulate a100-hstu --time-scale 4``
reporting to it, a few requests over HTTP; then the agent's answers, ``/healthz``,
``/v1/metrics``, ``/metrics``, the reports the control plane stored, the node it lists and the
dashboard's nodes table built from that list all say emulated, the profile and modelled time. The
link's shared budget is checked on the engine (tests/test_emulated.py), where time is exact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.test_node_agent import free_port, wait_healthy, write_taobao_csv
from tests.test_node_reporter import ADMIN, REPO, ControlPlane, wait_for

pytestmark = pytest.mark.slow


def test_an_emulated_agent_says_so_in_answers_reports_metrics_and_the_nodes_table(tmp_path):
    from dashboard.overview_tab import node_rows

    cp = ControlPlane(tmp_path)
    cp.start()
    proc = None
    try:
        token = cp.node_token("e0")
        csv = write_taobao_csv(tmp_path / "UserBehavior_small.csv")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "racer", "node-agent", "--port", str(port), "--trace", "taobao", "--path",
               str(csv), "--emulate", "a100-hstu", "--time-scale", "4", "--num-pages", "64",
               "--control-interval-s", "0.5", "--control-plane", cp.url, "--node-id", "e0",
               "--state-dir", str(tmp_path / "state")]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(tmp_path / "agent.out", "w"),
                                stderr=subprocess.STDOUT, env={**os.environ, "RACER_NODE_TOKEN": token})
        wait_healthy(base, proc, timeout_s=120)
        with httpx.Client(base_url=base, timeout=30) as c:
            answers = [c.post("/v1/recommend", json={"user_id": u % 3, "history": list(range(u % 3, 20)),
                                                      "num_candidates": 8}).json() for u in range(6)]
            health = c.get("/healthz").json()
            assert c.post("/v1/admin/reset", json={"emb_share": 0.3}).status_code in (404, 405)  # no --allow-reset
            metrics = c.get("/v1/metrics").json()
            prom = c.get("/metrics").text
        for a in answers:
            assert a["device"]["mode"] == "emulated" and a["device"]["profile"] == "a100-hstu", a
            assert a["device"]["time"] == "modelled" and a["device"]["calibrated"] is False
            assert a["device"]["time_scale"] == 4.0
        assert health["device_mode"]["mode"] == "emulated"
        assert metrics["device_mode"]["label"].startswith("emulated a100-hstu")
        assert metrics["node"]["emulation"]["profile"] == "a100-hstu"
        assert 'racer_node_device_info{mode="emulated",profile="a100-hstu"' in prom
        assert "modelled" in prom
        with cp.api() as api:
            reports = wait_for(lambda: [r for r in api.get("/reports", params={"node_id": "e0"}).json()
                                        if r.get("num_requests")], 60, "a report with requests")
            nodes = api.get("/nodes").json()
            summary = api.get("/summary").json()
        assert {(r["device_mode"], r["device_profile"]) for r in reports} == {("emulated", "a100-hstu")}
        node = next(n for n in nodes if n["node_id"] == "e0")
        assert node["device_mode"] == "emulated" and node["device"].startswith("emulated a100-hstu")
        assert summary["num_emulated"] == 1
        row = next(r for r in node_rows(nodes) if r["node_id"] == "e0")
        assert "emulated a100-hstu" in row["mode"] and "uncalibrated" in row["mode"]
        # its memory as registered: the arena and the bookkeeping beside it; an emulated device
        # reports no device memory of its own
        prof = node["cost_profile"]
        assert prof["arena_bytes"] > 0 and prof["metadata_bytes"] > 0 and "device_total_bytes" not in prof
        assert row["memory"].startswith("arena ") and "metadata" in row["memory"] and "device" not in row["memory"]
        assert float(row["rate"]) >= 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        cp.stop()


def test_an_agent_started_with_allow_reset_goes_back_to_a_cold_start_in_place(tmp_path):
    from tests.procs import racer_cmd, spawn, stop
    from tests.test_reporter_parts import export_constant_policy

    csv = write_taobao_csv(tmp_path / "UserBehavior_small.csv")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    policy = export_constant_policy(tmp_path / "p03", 0.3)
    proc = spawn(racer_cmd("node-agent", "--port", str(port), "--trace", "taobao", "--path", str(csv),
                           "--emulate", "a100-hstu", "--time-scale", "2", "--num-pages", "64", "--allow-reset",
                           "--policy", str(policy), "--control-interval-s", "0.2"), tmp_path / "agent.log")
    try:
        wait_healthy(base, proc, timeout_s=120)
        body = {"user_id": 7, "history": list(range(30)), "num_candidates": 8}
        with httpx.Client(base_url=base, timeout=30) as c:
            assert c.post("/v1/recommend", json=body).json()["kv"]["outcome"] == "miss"
            body2 = {**body, "history": list(range(30)), "new_items": [31]}
            assert c.post("/v1/recommend", json=body2).json()["kv"]["outcome"] == "hit"
            r = c.post("/v1/admin/reset", json={"emb_share": 0.25, "allocator": False})
            assert r.status_code == 200, r.text
            assert r.json()["emb_share"] == 0.25 and r.json()["allocator"] is False
            m = c.get("/v1/metrics").json()
            assert m["engine"]["num_served"] == 0 and m["allocator"]["enabled"] is False
            assert m["emb_share"] == 0.25 and m["device_mode"]["mode"] == "emulated"
            assert c.post("/v1/recommend", json=body2).json()["kv"]["outcome"] == "miss"  # cold again
            r = c.post("/v1/admin/reset", json={"emb_share": 0.5, "allocator": True})
            assert r.status_code == 200 and r.json()["allocator"] is True
            wait_for(lambda: c.get("/v1/metrics").json()["allocator"].get("num_decisions"), 30, "a decision")
            for bad in ({"emb_share": 1.5}, {"emb_share": "0.5"}, {"emb_share": 0.5, "allocator": 1},
                        {"emb_share": 0.5, "extra": 1}, {}):
                assert c.post("/v1/admin/reset", json=bad).status_code == 422, bad
            assert c.post("/v1/admin/reset", content=b"emb_share=0.5",
                          headers={"content-type": "text/plain"}).status_code == 415
    finally:
        stop(proc)
