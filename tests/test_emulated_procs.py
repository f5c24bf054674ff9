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
        with cp.api() as api:
            r = api.post("/tokens", json={"role": "node", "name": "node-e0", "node_id": "e0"})
            assert r.status_code == 201, r.text
            token = r.json()["token"]
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
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        cp.stop()
