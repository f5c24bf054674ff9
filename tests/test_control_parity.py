"""Parity of the node agent's and the simulator's control paths (node_agent/control.py).

One sequence of served requests (real requests served by a real engine through the agent's
device-worker code) and one sequence of manager states go through

- the agent's path: `NodeAgent._serve` -> `NodeAgent._record_batch` -> `WindowAccumulator`, then
  `NodeAgent.control_step` (SmartAllocator, half-page apply rule on the engine's manager);
- the simulator's path: `simulator.cluster.feed_batches` (what `ClusterSim._serve_slice` calls)
  -> `WindowAccumulator`, then `SmartAllocatorSim.control` (decide, then the half-page apply
  rule: what `ClusterSim.control` calls) on a copy of the same manager,

and the test checks identical `WindowStats` and identical decisions. A test double of the agent
that computes one feature differently is caught by the same check.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import asdict

import numpy as np
import pytest
import torch

from node_agent.admission import Job
from node_agent.agent import AgentConfig, NodeAgent
from node_agent.allocator import AllocatorConfig, SmartAllocator, TunerConfig
from node_agent.control import WindowAccumulator, current_target, stats_differences
from node_agent.engine import Engine, EngineConfig, LinkEmulationConfig, RecRequest
from node_agent.model import ModelConfig
from simulator.cluster import feed_batches

# the tuner takes every reading at face value (no noise gate), so that three windows give it a step to compare
ALLOC_CONFIG = AllocatorConfig(initial_emb_share=0.5, device="cpu", tuner=TunerConfig(confidence=0.0))

COSTS = {"kv_recompute_us_per_token": {"8": 3.0, "32": 6.0}, "emb_transfer_us_per_row": 0.4}
DT = 0.003  # the test clock advances this much on every reading


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from policies.actor import make_initial_actor
    from policies.export import export_actor

    d = tmp_path_factory.mktemp("parity") / "policy"
    export_actor(make_initial_actor(11, head_gain=1.0), d)
    return d


def small_engine() -> Engine:
    cfg = EngineConfig(model=ModelConfig(embedding_dim=16, num_layers=1, num_heads=2, qk_dim=8, v_dim=8),
                       num_items=200, num_pages=64, page_tokens=4, emb_share=0.5, max_history_len=64,
                       max_candidates=32, default_num_candidates=8, link=LinkEmulationConfig(mode="off"))
    return Engine(cfg)


class SimSide:
    """The simulator's path for one node: its accumulator, allocator and a manager kept in the
    agent's manager's state (a copy taken before each window closes)."""

    def __init__(self, policy_dir, start_s: float):
        from simulator.smart import SmartAllocatorSim

        self.acc = WindowAccumulator(start_s)
        self.alloc = SmartAllocatorSim("racer", policy_dir, ALLOC_CONFIG)
        self.alloc.reset(1, 0.5)
        self.batches: list[dict] = []

    def serve(self, batch: dict, arrivals: list[int]) -> None:
        """One batch and its arrivals' users, as `ClusterSim._serve_slice` hands them to
        `feed_batches` and `WindowAccumulator.add_arrivals`."""
        self.acc.add_arrivals(len(arrivals), np.array(arrivals))
        n = len(batch["users"])
        feed_batches([self.acc], np.array([0]), np.array([batch["start"]]), np.array([batch["end"]]), np.array([0]),
                     np.array([n]), np.array(batch["arrival"]), np.array(batch["users"]), np.array(batch["L"]),
                     np.array(batch["cached"]), np.array([batch["emb_rows"]]), np.array([batch["emb_hits"]]))

    def close_and_decide(self, now_s: float, manager):
        stats = self.acc.close_window(now_s, manager, _costs(), 30.0)
        effect = self.alloc.control(0, stats, manager, now_s)  # as ClusterSim.control runs it
        return stats, effect.decision, effect


def _costs():
    from node_agent.control import MissCosts

    return MissCosts.from_dict(COSTS)


def run_parity(agent_cls, policy_dir, num_windows: int = 3, seed: int = 0):
    """Serve a random sequence through both paths; returns per window ``(stats differences,
    agent decision, sim decision, agent target, sim target)``."""
    torch.manual_seed(0)
    eng = small_engine()
    t = [0.0]
    seen: dict = {}

    def clock() -> float:
        t[0] += DT
        if seen.get("end") is None and "start" in seen:  # the first reading after the batch was served
            seen["end"] = t[0]
        return t[0]

    alloc = SmartAllocator(ALLOC_CONFIG, policy_dir=policy_dir)
    agent = agent_cls(eng, AgentConfig(slo_ms=30.0), allocator=alloc, miss_costs=COSTS, clock=clock)
    sim = SimSide(policy_dir, agent.started_s)
    rng = np.random.default_rng(seed)
    loop = asyncio.new_event_loop()
    out = []
    histories: dict[int, list[int]] = {}
    try:
        for w in range(num_windows):
            for _ in range(int(rng.integers(3, 7))):  # batches of the window
                size = int(rng.integers(1, 5))
                t_before = t[0]
                reqs = []
                for _ in range(size):
                    u = int(rng.integers(0, 6))  # few users, histories that grow: KV hits happen
                    hist = histories.setdefault(u, rng.integers(0, 200, int(rng.integers(4, 20))).tolist())
                    new = rng.integers(0, 200, 2).tolist()
                    arrival = t_before - float(rng.uniform(0.0, 0.02))
                    reqs.append(RecRequest(u, list(hist), new, top_k=3, arrival_s=arrival))
                    histories[u] = (hist + new) if len(hist) < 50 else new
                jobs = [Job(r, loop, loop.create_future()) for r in reqs]
                agent._arrival_users.extend(r.user_id for r in reqs)  # what NodeAgent.submit records
                agent._arrivals += len(jobs)
                resps_box = {}
                real_serve = eng.serve_batch

                def serve_batch(batch, now, _real=real_serve):  # the batch's clock readings, raw
                    resps_box["r"] = _real(batch, now)
                    seen.clear()
                    seen.update(start=now, end=None)
                    return resps_box["r"]

                eng.serve_batch = serve_batch
                agent._serve(jobs)
                eng.serve_batch = real_serve
                resps = resps_box["r"]
                sim.serve({"start": seen["start"], "end": seen["end"], "arrival": [r.arrival_s for r in reqs],
                           "users": [r.user_id for r in resps], "L": [r.num_history for r in resps],
                           "cached": [r.kv_hit_tokens for r in resps],
                           "emb_rows": sum(r.emb_rows for r in resps), "emb_hits": sum(r.emb_hits for r in resps)},
                          [r.user_id for r in reqs])
                seen.clear()
                for _ in range(3):  # the boundary moves and refills between batches, on both sides
                    step = eng.maintenance(t[0])
                    if step.refill_bytes:
                        agent.window.add_refill_bytes(step.refill_bytes)
                        sim.acc.add_refill_bytes(step.refill_bytes)
            now = clock()
            mm_copy = copy.deepcopy(eng.mm)  # the same manager state for the simulator's side
            stats_sim, d_sim, _ = sim.close_and_decide(now, mm_copy)
            agent.control_step(now)
            eff = agent.last_effect
            out.append((stats_differences(eff.stats, stats_sim), eff.decision, d_sim, current_target(eng.mm),
                        current_target(mm_copy), eff.stats))
    finally:
        loop.close()
    return out


def _decision_record(d) -> dict:
    rec = d.to_dict()
    rec["features"] = [round(v, 7) for v in rec["features"].values()]
    return rec


def test_agent_and_simulator_paths_give_identical_stats_and_decisions(policy_dir):
    rounds = run_parity(NodeAgent, policy_dir)
    assert len(rounds) == 3
    for w, (diffs, d_agent, d_sim, tgt_agent, tgt_sim, stats) in enumerate(rounds):
        assert diffs == [], f"window {w}: {diffs}"
        assert stats.num_requests > 0 and 0 < stats.load <= 1 and stats.p99_ms > 0 and stats.arrival_hot_user_ratio > 0
        assert _decision_record(d_agent) == _decision_record(d_sim)
        assert np.array_equal(d_agent.features, d_sim.features)
        assert tgt_agent == tgt_sim
    # the windows were not trivial: KV hits, a varying split and the profiled cost at p50
    assert any(r[5].kv_hit_rate > 0 for r in rounds)
    assert all(r[5].kv_recompute_us_per_token in (3.0, 6.0) for r in rounds)
    # the ghost lists (on in the engine) gave the operating-point tuner a step, identical on both paths
    # (its own step, in the residual layer's trace: the curve layer's dead band may take it back)
    assert any(r[1].tuner_action in ("kv_ward", "emb_ward") and r[1].layer("residual").detail["tuner_step"] != 0.0
               for r in rounds)


class QueueBlindAgent(NodeAgent):
    """A test double: latency measured from the batch's start (queueing left out)."""

    def _record_batch(self, jobs, resps, start_s, end_s):
        self.window.add_batch(start_s, end_s, [end_s - start_s for _ in jobs], [r.user_id for r in resps],
                              [r.num_history for r in resps], [r.kv_hit_tokens for r in resps],
                              sum(r.emb_rows for r in resps), sum(r.emb_hits for r in resps))


class IdleLoadAgent(NodeAgent):
    """A test double: busy time not measured (the batch recorded as instantaneous)."""

    def _record_batch(self, jobs, resps, start_s, end_s):
        super()._record_batch(jobs, resps, end_s, end_s)


@pytest.mark.parametrize("double, field", [(QueueBlindAgent, "p99_ms"), (IdleLoadAgent, "load")])
def test_the_parity_check_catches_a_feature_computed_differently(policy_dir, double, field):
    rounds = run_parity(double, policy_dir, num_windows=2)
    diffs = [d for r in rounds for d in r[0]]
    assert diffs and all(d.startswith(f"{field}:") for d in diffs), diffs
    # and the policy's input differs, so the decisions can differ
    assert any(not np.array_equal(r[1].features, r[2].features) for r in rounds)


def test_pending_batches_count_when_they_end_and_busy_time_by_overlap():
    from node_agent.memory import KVLayout, MemoryConfig, MemoryManager

    mm = MemoryManager(MemoryConfig(num_pages=8, num_items=100, emb_dim=4, emb_dtype="float32",
                                    kv=KVLayout(1, 1, 2, 4, "float32"), payload=False, device="cpu"))
    acc = WindowAccumulator(0.0)
    acc.add_arrivals(3, [5, 5, 6])
    acc.add_arrivals(1, [7])
    acc.add_batch(0.2, 0.6, [0.5], [1], [10], [4], 20, 10)
    acc.add_batch(0.8, 1.4, [0.9, 0.7], [2, 3], [20, 30], [0, 30], 40, 0)  # ends after the first close
    s1 = acc.close_window(1.0, mm, _costs(), 30.0)
    assert (s1.num_requests, s1.arrival_rate_rps) == (1, 4.0)
    # the hot-user ratio of the completed requests (one, user 1) and of the arrivals (user 5: 2 of 4)
    assert (s1.hot_user_ratio, s1.arrival_hot_user_ratio) == (1.0, 0.5)
    assert s1.load == pytest.approx(0.4 + 0.2) and s1.p99_ms == pytest.approx(500.0)
    assert (s1.emb_lookups_per_request, s1.emb_hit_rate, s1.kv_hit_rate) == (20.0, 0.5, 0.4)
    assert s1.kv_recompute_us_per_token == 3.0 and s1.emb_share == mm.emb_share  # p50 10: nearest profiled 8
    # schema 3's sizes from the manager's config: 100 rows x 4 float32; K and V of 1 layer x 1 head x dim 2
    assert (s1.table_bytes, s1.kv_bytes_per_token) == (100 * 4 * 4, 2 * 1 * 1 * 2 * 4)
    s2 = acc.close_window(2.0, mm, _costs(), 30.0)
    assert (s2.num_requests, s2.arrival_rate_rps, s2.arrival_hot_user_ratio) == (2, 0.0, 0.0)
    assert s2.load == pytest.approx(0.4) and s2.kv_hit_rate == pytest.approx(30 / 50)
    assert asdict(acc.close_window(3.0, mm, _costs(), 30.0))["num_requests"] == 0


def test_the_window_statistics_and_the_trace_generator_share_one_top_share():
    from common.shares import top_share
    from node_agent.features import top_share as runtime_top_share
    from workloads.regimes import top_share as gen_top_share

    assert runtime_top_share is top_share and gen_top_share is top_share
    rng = np.random.default_rng(1)
    assert top_share(np.array([], dtype=np.int64)) == 0.0
    ids = np.array([3] * 6 + [1, 2, 4, 5])  # 5 distinct values: the top 1% is one value, the top 40% two
    assert top_share(ids, 0.01) == pytest.approx(0.6) and top_share(ids, 0.4) == pytest.approx(0.7)
    for n in (1, 7, 500):
        ids = rng.zipf(1.5, n) % 97
        assert 0.0 < top_share(ids, 0.01) <= top_share(ids, 0.1) <= 1.0
