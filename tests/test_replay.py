"""`racer replay`: the open-loop load generator against real node-agent processes over HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI

from racer.cli import main as racer_main
from workloads import load_trace
from workloads.replay import ReplayConfig, build_plan, replay

from .conftest import REPO
from .procs import free_port, start_agent, stop, wait_http
from .test_node_agent import write_taobao_csv


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    return write_taobao_csv(tmp / "UserBehavior_small.csv", num_users=60, num_items=400, seed=5)


@pytest.fixture(scope="module")
def agent(tmp_path_factory, small_trace):
    tmp = tmp_path_factory.mktemp("replay_agent")
    proc, base, log = start_agent(tmp, "agent", small_trace)
    try:
        wait_http(f"{base}/healthz", proc, log=log)
        yield base
    finally:
        stop(proc)


def test_replay_schedule_against_a_node_agent_serves_every_request(agent, small_trace):
    trace = load_trace("taobao", small_trace)
    cfg = ReplayConfig(schedule=("steady", "trend", "burst"), rate_rps=15, duration_s=4.5, slo_ms=200,
                       max_history_len=256, num_candidates=32)
    plan = build_plan(trace, cfg)
    assert [p.regime for p in plan] == ["steady", "trend", "burst"]
    assert [p.offset_s for p in plan] == [0.0, 1.5, 3.0]
    expected = sum(len(p.stream) for p in plan)
    out = replay([agent], trace, cfg)
    assert out["requests_sent"] == expected > 0
    assert out["requests_served"] == expected and out["requests_failed"] == 0 and out["requests_lost"] == 0
    assert set(out["regimes"]) == {"steady", "trend", "burst"}
    assert sum(r["requests_sent"] for r in out["regimes"].values()) == expected
    lat = out["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert 0.0 <= out["slo_attainment"] <= 1.0
    assert out["served_by"] == {agent: expected}
    # the agent saw exactly these requests, with their bodies accepted
    import httpx

    m = httpx.get(f"{agent}/v1/metrics").json()
    assert m["engine"]["num_served"] >= expected and m["metrics"]["num_rejected"] == 0


def test_replay_counts_every_failure_and_client_retries_on_the_next_target(agent, small_trace):
    trace = load_trace("taobao", small_trace)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = ReplayConfig(schedule=("steady",), rate_rps=20, duration_s=1.0, timeout_s=5.0)
    out = replay([dead], trace, cfg)
    assert out["requests_sent"] > 0 and out["requests_served"] == 0
    assert out["requests_failed"] == out["requests_sent"] and out["requests_lost"] == 0
    assert out["failures"] == {"connect": out["requests_sent"]} and out["slo_attainment"] == 0.0

    cfg = ReplayConfig(schedule=("steady",), rate_rps=20, duration_s=1.0, timeout_s=5.0, retries=1, slo_ms=500)
    out = replay([dead, agent], trace, cfg)
    n = out["requests_sent"]
    assert out["requests_served"] == n and out["requests_failed"] == 0
    # every other request went to the dead target first and was retried on the agent
    assert out["client_retries"] == out["requests_retried"] == (n + 1) // 2
    assert out["served_by"] == {agent: n}


def _slow_server(delay_s: float):
    app = FastAPI()
    seen = []

    @app.post("/v1/recommend")
    async def recommend(body: dict):
        seen.append(time.monotonic())
        k = len(seen)
        await asyncio.sleep(delay_s)
        return {"items": [1], "node_id": "slow-0", "retried": k % 5 == 0}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    return server, t, f"http://127.0.0.1:{sock.getsockname()[1]}", seen


def test_replay_is_open_loop_against_a_slow_server(small_trace):
    """Requests leave on schedule although none has returned yet: ~40 requests answered after 1 s
    each take ~2 s in all, not the ~40 s a closed-loop client would need."""
    trace = load_trace("taobao", small_trace)
    server, thread, base, seen = _slow_server(1.0)
    try:
        cfg = ReplayConfig(schedule=("steady",), rate_rps=40, duration_s=1.0, slo_ms=50, timeout_s=5.0)
        out = replay([base], trace, cfg)
    finally:
        server.should_exit = True
        thread.join(5)
    n = out["requests_sent"]
    assert n >= 20 and out["requests_served"] == n
    # a closed-loop client would spread them over n seconds (one answer per second); open loop, they
    # all arrive within the 1 s schedule plus whatever a loaded machine adds (bounded far below n s)
    assert max(seen) - min(seen) < n * 1.0 / 4
    assert out["wall_s"] < n * 1.0 / 4
    assert out["latency_ms"]["p50"] >= 1000 and out["slo_attainment"] == 0.0
    assert out["served_by"] == {"slow-0": n}
    assert out["requests_retried"] == n // 5  # the gateway-style "retried": true answers


def test_replay_cli_json_and_bad_input(agent, small_trace, capsys):
    rc = racer_main(["replay", "--trace", "taobao", "--path", str(small_trace), "--regime", "steady",
                     "--rate", "10", "--duration", "1", "--gateway", agent, "--json", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["requests_lost"] == 0 and out["config"]["schedule"] == ["steady"]
    assert out["requests_served"] == out["requests_sent"] > 0
    bad = [
        (["--regime", "steady", "--schedule", "steady,burst"], "one of --regime"),
        (["--schedule", "steady,spiky"], "unknown regime 'spiky'"),
        (["--regime", "steady", "--rate", "-3"], "rate_rps must be a positive number"),
        (["--regime", "steady", "--retries", "9"], "retries must be an integer in [0, 5]"),
    ]
    for args, words in bad:
        rc = racer_main(["replay", "--trace", "taobao", "--path", str(small_trace), "--gateway", agent,
                         "--duration", "1", *args])
        err = capsys.readouterr().err
        assert rc == 2 and words in err, (args, err)
    rc = racer_main(["replay", "--trace", "taobao", "--path", str(small_trace), "--regime", "steady",
                     "--gateway", "localhost:8000"])
    assert rc == 2 and "not an http:// or https:// URL" in capsys.readouterr().err


def test_replay_progress_bar_on_stderr_report_on_stdout(agent, small_trace):
    cmd = [sys.executable, "-m", "racer", "replay", "--trace", "taobao", "--path", str(small_trace),
           "--regime", "burst", "--rate", "10", "--duration", "1.5", "--gateway", agent, "--json"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["regimes"]["burst"]["requests_sent"] == out["requests_sent"]
    assert "racer replay" in p.stderr and "req" in p.stderr
