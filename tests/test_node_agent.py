"""The node agent: a real `racer node-agent` process over HTTP, micro-batching on the device
worker, the control step with a SmartAllocator policy."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from node_agent.agent import AgentConfig, NodeAgent
from node_agent.engine import Engine, EngineConfig, LinkEmulationConfig, RecRequest
from node_agent.model import ModelConfig
from racer.cli import main as racer_main
from tests.test_admission import run_queued
from workloads import generate, load_trace

from .conftest import REPO

pytestmark = pytest.mark.usefixtures("one_thread")


def write_taobao_csv(path: Path, num_users: int = 40, num_items: int = 300, seed: int = 0) -> Path:
    """A small file in the Taobao UserBehavior format: user_id,item_id,category_id,behavior,timestamp."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(num_users):
        n = int(rng.integers(5, 60))
        ts = np.sort(rng.integers(1_511_000_000, 1_512_000_000, n))
        items = rng.zipf(1.3, n) % num_items
        beh = rng.choice(["pv", "pv", "pv", "cart", "fav", "buy"], n)
        rows += [f"{1000 + u},{5000 + i},{i % 17},{b},{t}" for i, b, t in zip(items, beh, ts)]
    path.write_text("\n".join(rows) + "\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"node agent exited with {proc.returncode} before becoming healthy")
        try:
            r = httpx.get(f"{base}/healthz", timeout=1.0)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("node agent did not become healthy in time")


def test_node_agent_process_serves_a_taobao_shaped_workload(tmp_path):
    csv = write_taobao_csv(tmp_path / "UserBehavior_small.csv")
    trace = load_trace("taobao", csv)
    stream = generate(trace, regime="steady", rate_rps=40, duration_s=2.0, num_candidates=24, seed=3,
                      max_history_len=200)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    out, err = open(tmp_path / "agent.out", "w"), open(tmp_path / "agent.err", "w")
    cmd = [sys.executable, "-m", "racer", "node-agent", "--port", str(port), "--trace", "taobao", "--path", str(csv),
           "--emb-share", "0.5", "--slo-ms", "30", "--seed", "1", "--num-pages", "256", "--max-history-len", "256",
           "--control-interval-s", "0.2"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        health = wait_healthy(base, proc)
        assert health["status"] == "ok" and health["worker_alive"] and health["link_emulated"] is True
        ok = bad = 0
        outcomes = []
        with httpx.Client(base_url=base, timeout=30.0) as client:
            for i in range(min(60, len(stream))):
                req = stream.request(i)
                body = {"user_id": req.user, "history": req.history.tolist(), "new_items": req.new_items.tolist(),
                        "num_candidates": int(req.num_candidates), "top_k": 5}
                r = client.post("/v1/recommend", json=body)
                assert r.status_code == 200, r.text
                d = r.json()
                ok += 1
                assert len(d["items"]) == 5 and all(0 <= it < trace.num_items for it in d["items"])
                assert d["scores"] == sorted(d["scores"], reverse=True)
                assert d["link_emulated"] is True and d["num_candidates"] == 24
                assert d["kv"]["hit_tokens"] + d["kv"]["recomputed_tokens"] == len(req.history)
                assert set(d["latency_us"]) >= {"queue_us", "emb_lookup_us", "kv_read_us", "prefill_us", "rank_us",
                                                "compute_us", "total_us"}
                outcomes.append(d["kv"]["outcome"])
            assert "hit" in outcomes and "miss" in outcomes and "mismatch" not in outcomes
            # explicit candidates and timestamps
            r = client.post("/v1/recommend", json={"user_id": 7, "history": [1, 2, 3], "new_items": [4],
                                                   "timestamps": [10.0, 20.0, 30.0, 40.0],
                                                   "candidates": [5, 6, 7, 8], "top_k": 2})
            assert r.status_code == 200 and set(r.json()["items"]) <= {5, 6, 7, 8}
            ok += 1

            too_long = [i % trace.num_items for i in range(257)]
            bad_bodies = [
                ({"user_id": "u-17", "history": [1]}, "user_id"),
                ({"user_id": -5, "history": [1]}, "user_id"),
                ({"user_id": 1.5, "history": [1]}, "user_id"),
                ({"history": [1]}, "user_id"),
                ({"user_id": 1, "history": [1, trace.num_items]}, "out of range"),
                ({"user_id": 1, "history": [1], "num_candidates": -3}, "num_candidates"),
                ({"user_id": 1, "history": too_long}, "exceeds max_history_len 256"),
                ({"user_id": 1, "history": [1, 2], "timestamps": [1.0]}, "timestamps"),
                ({"user_id": 1, "history": ["a"]}, "history"),
                ({"user_id": 1, "histroy": [1]}, "histroy"),
            ]
            for body, words in bad_bodies:
                r = client.post("/v1/recommend", json=body)
                assert r.status_code == 422, (body, r.text)
                assert words in r.json()["error"], (words, r.json())
                bad += 1
            r = client.post("/v1/recommend", content=b'{"user_id": 1, "history": [1,', headers={
                "content-type": "application/json"})
            assert r.status_code == 422 and "JSON" in r.json()["error"]
            bad += 1
            # still serving
            assert client.get("/healthz").json()["status"] == "ok"
            r = client.post("/v1/recommend", json={"user_id": 3, "history": [1, 2, 3]})
            assert r.status_code == 200 and len(r.json()["items"]) == 10
            ok += 1
            time.sleep(0.5)  # a few control steps
            m = client.get("/v1/metrics").json()
        assert m["metrics"]["num_requests"] == ok and m["metrics"]["num_rejected"] == bad
        assert m["metrics"]["link_emulated"] is True and m["link_emulated"] is True
        assert m["emb_share"] == 0.5 and m["allocator"]["enabled"] is False
        assert m["node"]["num_items"] == trace.num_items and m["node"]["trace"] == "taobao"
        assert 0 < m["metrics"]["lifetime_kv_hit_rate"] < 1 and m["metrics"]["slo_ms"] == 30.0
        assert m["memory"]["kv"]["num_lookups"] == ok and m["control"]["num_steps"] >= 2
        assert m["metrics"]["kv_outcomes"]["hit"] >= 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.close()
        err.close()
    assert code == 0, (tmp_path / "agent.err").read_text()
    log = (tmp_path / "agent.out").read_text()
    assert f"serving on http://127.0.0.1:{port}" in log and "stopped" in log


def small_engine(**kw) -> Engine:
    cfg = EngineConfig(model=ModelConfig(embedding_dim=16, num_layers=1, num_heads=2, qk_dim=8, v_dim=8),
                       num_items=200, num_pages=64, page_tokens=4, emb_share=0.5, max_history_len=64,
                       max_candidates=32, default_num_candidates=8, link=LinkEmulationConfig(mode="off"), **kw)
    return Engine(cfg)


def test_device_worker_micro_batches_requests_that_arrive_together():
    agent = NodeAgent(small_engine(), AgentConfig(max_batch=8, control_interval_s=0.05))
    ref = small_engine()
    rng = np.random.default_rng(0)
    reqs = [RecRequest(u, rng.integers(0, 200, 10).tolist(), rng.integers(0, 200, 2).tolist(), top_k=3)
            for u in (1, 2, 3, 1, 4)]
    out = run_queued(agent, reqs)  # every request is queued before the worker starts
    assert [r.batch_size for r in out] == [5] * 5
    expected = ref.serve_batch(reqs)
    for a, b in zip(out, expected):
        assert a.items == b.items and np.allclose(a.scores, b.scores, atol=1e-5)
    snap = agent.metrics_snapshot()
    assert snap["metrics"]["num_requests"] == 5 and snap["engine"]["num_served"] == 5
    assert snap["link_emulated"] is False and snap["metrics"]["link_emulated"] is False


def test_the_window_counts_the_hot_user_ratio_of_the_requests_submit_accepted():
    """`submit` records each accepted request's user; the window's close gives their hot-user
    ratio (`WindowStats.arrival_hot_user_ratio`: top 1% of 4 users is one, user 1 with 2 of 5)
    and starts the next window empty."""
    from common.shares import top_share

    users = (1, 2, 3, 1, 4)
    agent = NodeAgent(small_engine(), AgentConfig(max_batch=8, control_interval_s=3600.0))
    rng = np.random.default_rng(0)
    reqs = [RecRequest(u, rng.integers(0, 200, 10).tolist(), rng.integers(0, 200, 2).tolist(), top_k=3)
            for u in users]
    run_queued(agent, reqs)
    stats, arrivals = agent.window_stats(agent.clock())
    assert arrivals == 5 and stats.arrival_hot_user_ratio == top_share(np.array(users), 0.01) == 0.4
    stats, arrivals = agent.window_stats(agent.clock())
    assert arrivals == 0 and stats.arrival_hot_user_ratio == 0.0


def test_control_step_runs_the_allocator_and_moves_the_boundary(tmp_path):
    from node_agent.allocator import AllocatorConfig, SmartAllocator
    from policies.actor import make_initial_actor
    from policies.export import export_actor

    actor = make_initial_actor(0)
    with torch.no_grad():
        actor.head.weight.zero_()
        actor.head.bias.fill_(math.log(0.8 / 0.2))  # always proposes emb_share 0.8
    export_actor(actor, tmp_path / "policy")
    eng = small_engine()
    alloc = SmartAllocator(AllocatorConfig(initial_emb_share=0.5), policy_dir=tmp_path / "policy")
    t = [0.0]
    agent = NodeAgent(eng, AgentConfig(), allocator=alloc, clock=lambda: t[0],
                      miss_costs={"kv_recompute_us_per_token": {"128": 5.0, "512": 9.0}, "emb_transfer_us_per_row": 0.3})
    loop = asyncio.new_event_loop()
    from node_agent.admission import Job

    for u in range(6):  # served through the device worker's code, one batch each, 0.1 s busy
        t[0] = 0.3 + 0.1 * u
        job = Job(RecRequest(u, list(range(u, u + 12)), [], top_k=2, arrival_s=0.25), loop, loop.create_future())
        agent._arrivals += 1
        clock_reads = iter([t[0], t[0] + 0.1])
        agent.clock = lambda: next(clock_reads)
        agent._serve([job])
    loop.close()
    agent.clock = lambda: t[0]
    t[0] = 1.0
    step = agent.control_step(1.0)
    w = step["window"]
    assert w["num_requests"] == 6 and w["history_len_p50"] == 12 and w["kv_recompute_us_per_token"] == 5.0
    assert w["arrival_rate_rps"] == 6.0 and w["load"] == pytest.approx(0.6)  # the busy fraction
    assert w["p99_ms"] == pytest.approx(1e3 * np.percentile([0.4 + 0.1 * u - 0.25 for u in range(6)], 99))  # end - arrival
    assert w["emb_transfer_us_per_row"] == 0.3 and w["emb_share"] == 0.5
    # marginal utilities of memory: the engine's ghost counters over the window, priced
    from node_agent.features import marginal_utilities_us

    emb_ghost, kv_ghost = eng.mm.ghost_counters()
    assert len(emb_ghost) == len(eng.mm.config.ghost_probes) == 4
    assert (w["emb_marginal_us"], w["kv_marginal_us"]) == marginal_utilities_us(
        eng.mm.config.ghost_probes, emb_ghost, kv_ghost, 6, 0.3, 5.0)
    d = step["decision"]
    assert d["base_emb_share"] == pytest.approx(0.8, abs=1e-4)
    assert d["emb_share"] == pytest.approx(0.55)  # the guard's max step up of 0.05
    assert eng.mm.boundary_moving and "grow EMB" in step["boundary_plan"]
    while eng.mm.boundary_moving:  # the worker is not running: apply the plan by hand
        eng.maintenance(1.0)
    assert eng.mm.emb_share == 35 / 64  # 0.55 of 64 pages, rounded to a page
    assert eng.check_invariants() == []
    assert json.dumps(agent.metrics_snapshot())  # JSON-able


def test_node_agent_cli_errors_are_one_line(tmp_path, capsys):
    assert racer_main(["node-agent", "--trace", "taobao", "--path", str(tmp_path / "missing.csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("racer: error: trace file not found") and err.count("\n") == 1


def test_oversize_body_gets_413_before_parsing():
    from node_agent.agent import create_app

    agent = NodeAgent(small_engine(), AgentConfig(max_body_bytes=1000))

    async def run():
        transport = httpx.ASGITransport(app=create_app(agent))
        async with httpx.AsyncClient(transport=transport, base_url="http://agent") as client:
            big = await client.post("/v1/recommend", json={"user_id": 1, "history": list(range(150)) * 2})
            small = await client.post("/v1/recommend", json={"user_id": 1, "history": [1], "top_k": 0})
            return big, small

    big, small = asyncio.run(run())
    assert big.status_code == 413 and "exceeds 1000 bytes" in big.json()["error"]
    assert small.status_code == 422 and small.json()["error"] == "top_k: Input should be greater than or equal to 1"


def test_agent_refuses_a_policy_of_the_old_schema_and_runs_on_without_it(tmp_path, caplog):
    """The schema-1 policy shipped before the control core (tests/data/policy_schema1) is refused
    by this runtime (schema 3) with a message naming both versions; the agent still serves and
    its control steps hold the split."""
    import argparse
    import logging

    from node_agent.cli import add_node_parser, build_agent
    from node_agent.features import SCHEMA_VERSION

    old = REPO / "tests" / "data" / "policy_schema1"
    assert json.loads((old / "manifest.json").read_text())["feature_schema_version"] == 1 != SCHEMA_VERSION
    csv = write_taobao_csv(tmp_path / "UserBehavior_small.csv")
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"kv_recompute_us_per_token": {"128": 2.0}, "emb_transfer_us_per_row": 0.5}))
    p = argparse.ArgumentParser()
    add_node_parser(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["node-agent", "--trace", "taobao", "--path", str(csv), "--policy", str(old), "--device", "cpu",
                         "--embedding-dim", "16", "--num-layers", "1", "--head-dim", "8", "--num-pages", "64",
                         "--page-tokens", "4", "--max-history-len", "64", "--num-candidates", "8",
                         "--emb-share", "0.4", "--profile", str(prof)])
    said = []
    with caplog.at_level(logging.WARNING, logger="racer.node_agent"):
        agent = build_agent(args, announce=said.append)
    msg = agent.allocator.last_load_error
    assert agent.allocator.policy is None and "feature schema version 1 does not match this runtime's 3" in msg
    assert any("policy refused, running without it" in m and "version 1" in m for m in said)
    assert any("version 1" in r.getMessage() for r in caplog.records)
    r = agent.engine.serve(RecRequest(1000, [1, 2, 3], [4], top_k=2), now_s=0.1)  # it serves
    assert len(r.items) == 2
    step = agent.control_step(agent.clock())
    d = step["decision"]
    assert (d["source"], d["hold_reason"]) == ("guard", "no base policy loaded")
    assert d["emb_share"] == agent.engine.mm.emb_share == pytest.approx(0.4, abs=1 / 64)  # the split held
