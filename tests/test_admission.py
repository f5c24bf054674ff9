"""Admission: one huge KV miss cannot hold the device queue for everyone.
A real NodeAgent on a real (small) engine; the order is asserted, never wall-clock thresholds."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from node_agent.agent import AgentConfig, NodeAgent
from node_agent.engine import Engine, EngineConfig, LinkEmulationConfig, RecRequest
from node_agent.model import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def engine() -> Engine:
    cfg = EngineConfig(model=ModelConfig(embedding_dim=16, num_layers=1, num_heads=2, qk_dim=8, v_dim=8),
                       num_items=500, num_pages=512, page_tokens=8, emb_share=0.5, max_history_len=1200,
                       max_candidates=32, default_num_candidates=8, link=LinkEmulationConfig(mode="off"))
    return Engine(cfg)


def run_queued(agent: NodeAgent, reqs: list[RecRequest]):
    """Queue every request before the device worker starts, then serve; responses in request order."""

    async def run():
        tasks = [asyncio.create_task(agent.submit(r)) for r in reqs]
        await asyncio.sleep(0)
        agent.start()
        return await asyncio.gather(*tasks)

    try:
        return asyncio.run(run())
    finally:
        agent.stop()


def test_small_requests_queued_behind_huge_misses_are_served_first():
    rng = np.random.default_rng(0)
    agent = NodeAgent(engine(), AgentConfig(max_batch=8))  # the default admission: large from 1024 tokens
    big = [RecRequest(100 + i, rng.integers(0, 500, 1100).tolist(), [], top_k=3) for i in range(2)]
    small = [RecRequest(u, rng.integers(0, 500, 6).tolist(), [1], top_k=3) for u in range(5)]
    # arrival order: two huge misses first, then the small requests
    out = run_queued(agent, big + small)
    b0, b1, s = out[0], out[1], out[2:]
    assert all(r.kv.outcome == "miss" and r.prefill_tokens == 1100 for r in (b0, b1))
    # every small request finished before the first huge miss did, in one micro-batch of its own
    assert max(r.finished_s for r in s) < b0.finished_s < b1.finished_s
    assert [r.batch_size for r in out] == [1, 1] + [5] * 5
    # what a small request waited is less than what one huge miss takes on the device
    assert max(r.latency.queue_us for r in s) < b0.latency.prefill_us
    snap = agent.metrics_snapshot()["admission"]
    assert snap["num_large_batches"] == 2 and snap["large_lane_depth"] == 0


def test_large_misses_alternate_with_small_batches_and_a_kv_hit_is_small():
    rng = np.random.default_rng(1)
    eng = engine()
    agent = NodeAgent(eng, AgentConfig(max_batch=8, large_prefill_tokens=256, max_prefill_tokens_per_batch=450))
    long_hist = rng.integers(0, 500, 800).tolist()
    eng.serve(RecRequest(7, long_hist, [], top_k=3))  # user 7's 800 tokens are cached now
    reqs = [RecRequest(100, rng.integers(0, 500, 900).tolist(), [], top_k=3),    # large miss
            RecRequest(101, rng.integers(0, 500, 900).tolist(), [], top_k=3),    # large miss
            RecRequest(7, long_hist, [3, 4], top_k=3)]                           # KV hit: 2 tokens to prefill
    reqs += [RecRequest(u, rng.integers(0, 500, 200).tolist(), [], top_k=3) for u in range(4)]  # 200 each
    out = run_queued(agent, reqs)
    assert out[2].kv.outcome == "hit" and out[2].prefill_tokens == 2
    order = sorted(range(len(out)), key=lambda i: out[i].finished_s)
    # small batch (the hit and two 200s: 402 of the 450-token budget), one large miss, the other
    # two small ones, the second large miss
    assert order == [2, 3, 4, 0, 5, 6, 1], order
    assert [out[i].batch_size for i in order] == [3, 3, 3, 1, 2, 2, 1]


def test_a_request_that_timed_out_in_the_queue_is_not_served():
    rng = np.random.default_rng(2)
    agent = NodeAgent(engine(), AgentConfig(large_prefill_tokens=256, request_timeout_s=0.05))

    async def run():
        task = asyncio.create_task(agent.submit(RecRequest(1, rng.integers(0, 500, 900).tolist(), [])))
        with pytest.raises(asyncio.TimeoutError):
            await task  # the worker is not running: the caller gives up (504)
        agent.start()
        return await agent.submit(RecRequest(2, [1, 2, 3], []))

    try:
        r = asyncio.run(run())
    finally:
        agent.stop()
    assert r.batch_size == 1 and agent.lanes.num_expired == 1 and agent.engine.num_served == 1


def test_admission_config_is_checked():
    with pytest.raises(ValueError, match="large_prefill_tokens must be a positive integer"):
        AgentConfig(large_prefill_tokens=0)
    with pytest.raises(ValueError, match="max_prefill_tokens_per_batch"):
        AgentConfig(max_prefill_tokens_per_batch=-1)
