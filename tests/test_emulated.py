"""The emulated device: the engine's bookkeeping real, the device's time charged from a profile.

Engine-level tests drive a virtual clock (`VClock`: waits advance it), so every modelled duration
is exact; the process test starts a real ``racer node-agent --emulate`` and reads its answers,
``/healthz``, ``/v1/metrics`` and ``/metrics``.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from common.device_model import A100_HSTU, batch_duration_us, get_profile, request_compute_us
from node_agent.emulated import EmulatedLink, EmulationConfig, ScaledClock, emulated_refill
from node_agent.engine import Engine, EngineConfig, RecRequest


class VClock:
    """A virtual clock: ``wait_until`` jumps to the deadline; ``advance`` moves it by hand."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def advance(self, dt: float) -> None:
        self.t += dt


def _engine(clock, *, num_pages=64, emb_share=0.5, refill=None, profile="a100-hstu", **kw) -> Engine:
    prof = get_profile(profile)
    cfg = EngineConfig(num_items=5000, num_pages=num_pages, page_tokens=prof.page_tokens, emb_share=emb_share,
                       emulation=EmulationConfig(profile), refill=refill or emulated_refill(prof), **kw)
    return Engine(cfg, clock=clock, now_s=clock())


def _req(user, hist, new=(), cands=None, n=8):
    return RecRequest(user_id=user, history=list(hist), new_items=list(new),
                      candidates=None if cands is None else list(cands), num_candidates=None if cands else n)


def test_a_pass_takes_the_cost_models_time_to_the_microsecond():
    clk = VClock()
    eng = _engine(clk)
    p = A100_HSTU
    t0 = clk()
    r = eng.serve(_req(1, range(40), [41, 42], cands=range(100, 110)), now_s=t0)
    # a cold cache: every one of the 42 + 10 distinct ids misses
    comp = request_compute_us(p, np.array([0]), np.array([40]), np.array([2]), np.array([10]))
    want = batch_duration_us(p, 1, float(comp[0]), float(comp[0]), 52, 0)
    assert (clk() - t0) * 1e6 == pytest.approx(want, abs=1e-3)
    assert r.latency.total_us == pytest.approx(want, abs=1e-3)
    assert r.kv.outcome == "miss" and r.emb_hits == 0 and r.emb_rows == 52
    assert r.latency.link_us == pytest.approx(52 * p.emb_transfer_us_per_row, abs=1e-3)
    # the same user again with one new item: a KV hit, only the new token prefilled, rows hit
    t1 = clk()
    r2 = eng.serve(_req(1, list(range(40)) + [41, 42], [43], cands=range(100, 110)), now_s=t1)
    comp2 = request_compute_us(p, np.array([42]), np.array([42]), np.array([1]), np.array([10]))
    want2 = batch_duration_us(p, 1, float(comp2[0]), float(comp2[0]), 1, 10)
    assert r2.kv.outcome == "hit" and r2.kv_hit_tokens == 42 and r2.emb_hits == 10
    assert (clk() - t1) * 1e6 == pytest.approx(want2, abs=1e-3)
    assert eng.check_invariants() == []


def test_answers_say_emulated_and_rank_by_popularity_not_by_a_model():
    clk = VClock()
    pop = np.zeros(5000)
    pop[[7, 3, 9]] = [30, 20, 10]
    prof = get_profile("a100-hstu")
    cfg = EngineConfig(num_items=5000, num_pages=64, page_tokens=prof.page_tokens,
                       emulation=EmulationConfig("a100-hstu", 4.0), refill=emulated_refill(prof))
    eng = Engine(cfg, clock=clk, item_popularity=pop, now_s=clk())
    r = eng.serve(_req(5, [1, 2], cands=[1, 9, 3, 7, 4]), now_s=clk()).to_dict()
    assert r["items"][:3] == [7, 3, 9]
    assert r["device"]["mode"] == "emulated" and r["device"]["profile"] == "a100-hstu"
    assert r["device"]["time"] == "modelled" and r["device"]["calibrated"] is False
    assert r["device"]["time_scale"] == 4.0 and "emulated a100-hstu" in r["device"]["label"]
    assert r["link_emulated"] is False  # the CPU's link emulation is off: the device charges its own link
    assert eng.model is None and eng.mm.arena.payload is False
    d = eng.describe()
    assert d["device_mode"]["mode"] == "emulated" and d["emulation"]["profile_costs"]["token_us"] == prof.token_us


def test_a_real_engine_says_what_it_measures():
    from node_agent.engine import LinkEmulationConfig
    from node_agent.model import ModelConfig

    m = ModelConfig(embedding_dim=16, num_layers=1, num_heads=1, qk_dim=4, v_dim=4)
    on = Engine(EngineConfig(model=m, num_items=100, num_pages=16, page_tokens=4, device="cpu"))
    assert on.device_info()["mode"] == "link-emulated" and on.device_info()["time"] == "measured"
    off = Engine(EngineConfig(model=m, num_items=100, num_pages=16, page_tokens=4, device="cpu",
                              link=LinkEmulationConfig(mode="off")))
    assert off.device_info() == {"mode": "real", "time": "measured", "label": "cpu"}
    assert off.serve(_req(1, [1, 2], n=4)).to_dict()["device"]["mode"] == "real"


def test_the_link_serves_one_copy_at_a_time_first_come_first_served():
    link = EmulatedLink()
    assert link.transfer(1.0, 100.0, "refill") == (1.0, pytest.approx(1.0001))
    s, e = link.transfer(1.00004, 50.0, "demand")  # issued while the refill chunk holds the link
    assert s == pytest.approx(1.0001) and e == pytest.approx(1.00015)
    assert link.waited_us["demand"] == pytest.approx(60.0) and link.busy_us == {"demand": 50.0, "refill": 100.0}
    assert link.transfer(2.0, 0.0, "demand") == (2.0, 2.0)  # nothing to copy: no wait, no booking
    with pytest.raises(ValueError, match="kind"):
        link.transfer(2.0, 1.0, "upload")


def test_a_refill_chunk_slows_a_concurrent_demand_miss_by_what_the_profile_says():
    """Refill and demand share one link: a demand miss issued while a refill chunk is on the link
    waits for the chunk, and then takes its own rows' time."""
    clk = VClock()
    prof = get_profile("a100-hstu")
    rows_per_chunk = 512
    refill = replace(emulated_refill(prof), chunk_bytes=rows_per_chunk * prof.emb_row_bytes,
                     limit_bytes_per_s=1e6 * prof.emb_row_bytes)
    # a one-page slab (96 rows): the warm-up's 720 distinct ids evict most of themselves
    eng = _engine(clk, num_pages=64, emb_share=1 / 64, refill=refill)
    quiet = _engine(VClock(), num_pages=64, emb_share=1 / 64, refill=refill)
    for e in (eng, quiet):  # warm both with the same requests
        e.serve(_req(1, range(20), cands=range(1000, 1700)), now_s=e.clock())
    # grow the EMB slab: the evicted items become a refill on `eng`; `quiet` gets no refill
    eng.set_emb_share(0.5, clk())
    for _ in range(200):
        clk.advance(1e-3)
        eng.maintenance(clk())
        if eng.emu.link.num_transfers["refill"]:
            break
    assert eng.emu.link.num_transfers["refill"] == 1
    refill_rows = eng.emu.link.busy_us["refill"] / prof.emb_transfer_us_per_row
    assert refill_rows == pytest.approx(rows_per_chunk)
    quiet.clock.t = clk()
    # a demand miss right after the chunk was issued waits for it
    t0 = clk()
    r = eng.serve(_req(2, range(3000, 3010), cands=range(4000, 4005)), now_s=t0)
    rq = quiet.serve(_req(2, range(3000, 3010), cands=range(4000, 4005)), now_s=quiet.clock())
    chunk_us = rows_per_chunk * prof.emb_transfer_us_per_row
    fixed_us = prof.batch_overhead_us + prof.request_overhead_us
    waited = max(0.0, chunk_us - fixed_us)  # the chunk started at t0; the copy is issued after the fixed part
    assert r.latency.total_us - rq.latency.total_us == pytest.approx(waited, abs=1e-3)
    assert eng.emu.link.waited_us["demand"] == pytest.approx(waited, abs=1e-3)
    assert r.emb_hits == rq.emb_hits == 0


def test_the_scaled_clock_runs_k_times_slower_and_waits_in_modelled_time():
    wall = {"t": 50.0}
    clk = ScaledClock(10.0, wall=lambda: wall["t"])
    assert clk() == 50.0
    wall["t"] = 60.0
    assert clk() == pytest.approx(51.0) and clk.wall_elapsed_s(51.0) == pytest.approx(10.0)
    real = ScaledClock(20.0)
    t = real()
    real.wait_until(t + 0.002)  # 40 ms of wall time
    assert real() >= t + 0.002
    with pytest.raises(ValueError, match="time_scale"):
        ScaledClock(0.0)


def test_emulation_refuses_unknown_profiles_and_bad_scales(tmp_path):
    with pytest.raises(ValueError, match="unknown profile"):
        EmulationConfig("a200-nope").resolve()
    with pytest.raises(ValueError, match="time_scale"):
        EmulationConfig("a100-hstu", 0.0)
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"token_us": 1.0, "warp_factor": 9}))
    with pytest.raises(ValueError, match="unknown keys"):
        get_profile(str(bad))
    neg = tmp_path / "n.json"
    neg.write_text(json.dumps(A100_HSTU.to_json() | {"token_us": -1.0}))
    with pytest.raises(ValueError):
        get_profile(str(neg))
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(A100_HSTU.to_json() | {"name": "mine"}))
    assert get_profile(str(ok)).name == "mine"


def test_a_measured_profile_says_how_it_was_measured(tmp_path):
    from common.device_model import from_node_profile

    base = {"kv_recompute_us_per_token": {"128": 2.0, "512": 3.0}, "emb_transfer_us_per_row": 1.5}
    cases = [({"device": "cpu", "link_emulated": True}, "cpu+link-emulated", False),
             ({"device": "cpu", "link_emulated": False}, "cpu", False),
             ({"device": "cuda (NVIDIA H200)", "link_emulated": False}, "cuda", True),
             ({"device": "cuda (NVIDIA H200)", "link_emulated": True}, "cuda+link-emulated", False),
             ({"emulated": {"profile": "a100-hstu"}}, "emulated:a100-hstu", False)]
    for i, (extra, how, cal) in enumerate(cases):
        f = tmp_path / f"p{i}.json"
        f.write_text(json.dumps(base | extra | {"name": "node"}))
        prof = from_node_profile(f)
        assert prof.name == f"node [{how}]" and prof.calibrated is cal, (extra, prof.name)
    assert A100_HSTU.calibrated is False


def test_a_replay_can_send_the_simulators_candidates_so_both_rank_the_same_items():
    from workloads.candidates import CAND_POOL, StreamCandidates, candidate_pool
    from workloads.regimes import generate
    from workloads.replay import request_body
    from workloads.trace import synthetic_trace

    tr = synthetic_trace(num_users=30, num_items=400, seed=3)
    st = generate(tr, regime="steady", rate_rps=50, duration_s=2, seed=1, num_candidates=6)
    cands = StreamCandidates(st, tr, seed=5)
    pool = candidate_pool(tr, 5)
    assert len(pool) == CAND_POOL and pool.max() < tr.num_items
    b0, b1 = request_body(st, 0, 3, cands), request_body(st, 1, 3, cands)
    assert b0["candidates"] == pool[:6].tolist() and b1["candidates"] == pool[6:12].tolist()
    assert "num_candidates" not in b0 and request_body(st, 1, 3, cands) == b1  # deterministic
    plain = request_body(st, 0, 3)
    assert plain["num_candidates"] == 6 and "candidates" not in plain


def test_emulation_only_options_are_refused_without_emulate_and_a_profile_cannot_fake_its_types(tmp_path):
    from types import SimpleNamespace

    from node_agent.cli import _emulation

    for extra in ({"time_scale": 2.0}, {"refill_link_fraction": 0.2}):
        args = SimpleNamespace(emulate=None, time_scale=1.0, refill_link_fraction=None, allow_reset=False)
        for k, v in extra.items():
            setattr(args, k, v)
        with pytest.raises(ValueError, match="need --emulate"):
            _emulation(args)
    fake = tmp_path / "fake.json"
    fake.write_text(json.dumps(A100_HSTU.to_json() | {"calibrated": "false"}))
    with pytest.raises(ValueError, match="calibrated must be a JSON bool"):
        get_profile(str(fake))
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps(A100_HSTU.to_json() | {"kv_bytes_per_token": 12}))
    with pytest.raises(ValueError, match="multiple of 4"):
        EngineConfig(num_items=100, num_pages=16, emulation=EmulationConfig(str(odd)))


def test_a_late_host_thread_forms_the_batches_the_device_would_have():
    """The device is free at t=1.0; the host's worker gets round to it at t=1.3 with four
    requests queued: the next batch takes those that had arrived by 1.0 (or by the first
    arrival after it), and the ones that came later wait for the following batch, as on the
    device. A real engine (no emulation) takes all of them."""
    import asyncio

    from node_agent.admission import Job
    from node_agent.agent import NodeAgent

    loop = asyncio.new_event_loop()
    try:
        for emulated in (True, False):
            clk = VClock(1.3)
            eng = _engine(clk)
            if not emulated:
                eng.emu = None
            else:
                eng.emu.free_at_s = 1.0
            agent = NodeAgent(eng, clock=clk)
            for i, arrival in enumerate((0.90, 0.95, 1.05, 1.20)):
                req = replace(_req(10 + i, range(4)), arrival_s=arrival)
                agent._queue.put(Job(req, loop, loop.create_future()))
            first = agent.lanes.next_batch(0, eng)
            if not emulated:
                assert len(first) == 4
                continue
            assert [j.req.arrival_s for j in first] == [0.90, 0.95]
            eng.emu.free_at_s = 1.02  # the first batch's pass ended
            assert [j.req.arrival_s for j in agent.lanes.next_batch(0, eng)] == [1.05]  # the first arrival after it
            eng.emu.free_at_s = 1.25
            assert [j.req.arrival_s for j in agent.lanes.next_batch(0, eng)] == [1.20]
    finally:
        loop.close()
