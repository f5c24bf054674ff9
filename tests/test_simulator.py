"""The cluster simulator: hand-computed latencies, agreement with the real structures, determinism."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from node_agent.memory import MemoryManager
from simulator import (CostProfile, HeuristicAllocator, ScheduleAllocator, SimConfig, StaticAllocator, simulate)
from simulator.cluster import ClusterSim, memory_config, oracle_replay
from simulator.cost import batch_time_us, request_compute_us
from simulator.table import TableConfig, run_table
from workloads import RegimeConfig, generate, synthetic_trace
from workloads.regimes import RequestStream
from workloads.trace import build_trace

from .conftest import needs_samples

ROUND = CostProfile(
    name="round", token_us=10.0, attn_us_per_ctx=0.0, cand_us=5.0, emb_transfer_us_per_row=2.0,
    emb_hit_us_per_row=1.0, batch_overhead_us=100.0, request_overhead_us=10.0, batch_speedup=1.0, max_batch=64,
    emb_row_bytes=16, kv_bytes_per_token=16, page_tokens=2, hbm_cache_bytes=2048, link_bytes_per_s=1e9,
)


def tiny_stream(rows):
    """User 0's sequence is items 0,1,2,3; user 1's is 4,5,6. rows: (t, user, L, n_new, n_cand)."""
    trace = build_trace("tiny", "tiny", ["a"] * 4 + ["b"] * 3, [str(i) for i in range(7)], list(range(7)))
    t, u, L, n, c = (np.array(x) for x in zip(*rows))
    prev = np.full(len(rows), -1)
    for i in range(len(rows)):
        earlier = [j for j in range(i) if u[j] == u[i]]
        prev[i] = earlier[-1] if earlier else -1
    return RequestStream(trace=trace, config=RegimeConfig(duration_s=0.05), arrival_s=t.astype(float),
                         user=u.astype(np.int64), history_len=L.astype(np.int32), num_new_items=n.astype(np.int32),
                         num_candidates=c.astype(np.int32), prev_request=prev, base_user=np.array([0, 1], np.int32),
                         rotation=np.zeros(2, np.int32), hot_users=np.array([0]))


def test_two_nodes_match_hand_computed_latencies():
    s = tiny_stream([(0.001, 0, 2, 1, 0), (0.002, 1, 3, 0, 0), (0.015, 0, 3, 1, 0)])
    cfg = SimConfig(num_nodes=2, profile=ROUND, cache_bytes=64 * 32, batch_window_ms=10.0, control_interval_s=0.02)
    r = simulate(s, cfg, StaticAllocator(0.5), "round_robin")
    assert r.node.tolist() == [0, 1, 0]
    # r0 on node 0, batch at the slice end 10 ms: overhead 100 + request 10 + 3 misses x 2 + 3 tokens x 10 = 146 µs
    # r1 on node 1 likewise (3 history tokens, 3 misses)
    # r2 on node 0 at 20 ms: 3 tokens cached, 1 new token (10 µs), item 3 misses (2 µs): 100 + 10 + 2 + 10 = 122 µs
    assert r.latency_s == pytest.approx([0.010146 - 0.001, 0.010146 - 0.002, 0.020122 - 0.015], abs=1e-12)
    assert r.kv_hit_tokens == 3 and r.kv_history_tokens == 8
    assert (r.emb_lookups, r.emb_hits) == (7, 0)


def test_a_busy_node_queues_the_next_batch():
    prof = dataclasses.replace(ROUND, token_us=5_000.0)  # a 3-token prefill takes 15 ms
    s = tiny_stream([(0.001, 0, 2, 1, 0), (0.012, 0, 3, 1, 0)])
    cfg = SimConfig(num_nodes=1, profile=prof, cache_bytes=64 * 32, batch_window_ms=10.0, control_interval_s=0.02)
    r = simulate(s, cfg, StaticAllocator(0.5), "round_robin")
    first_end = 0.010 + (100 + 10 + 6 + 15_000) / 1e6
    second_end = first_end + (100 + 10 + 2 + 5_000) / 1e6  # starts when the node frees up, not at 20 ms
    assert r.latency_s == pytest.approx([first_end - 0.001, second_end - 0.012], abs=1e-12)


def test_cost_model_formulas():
    p = dataclasses.replace(ROUND, attn_us_per_ctx=0.5, batch_speedup=2.0)
    comp = request_compute_us(p, np.array([0, 4]), np.array([4, 4]), np.array([2, 2]), np.array([3, 0]))
    # request 0: 6 tokens at positions 0..5: 6*10 + 0.5*(0+1+..+5) = 67.5; 3 candidates x (5 + 0.5*6) = 24
    # request 1: 2 tokens at positions 4, 5: 20 + 0.5*9 = 24.5
    assert comp.tolist() == [91.5, 24.5]
    assert batch_time_us(p, comp, 3, 4) == 100 + 20 + 6 + 4 + max(91.5, 116 / 2)


@pytest.fixture(scope="module")
def small():
    trace = synthetic_trace(num_users=300, num_items=4_000, mean_seq_len=30, seed=2)
    stream = generate(trace, regime="burst", rate_rps=600, duration_s=6, num_users=2_000, seed=5, num_bursts=1,
                      history_scale=3.0,
                      burst_duration_s=2.0)
    cfg = SimConfig(num_nodes=4, cache_fraction=0.3, control_interval_s=1.0)
    return trace, stream, cfg


def test_sim_hits_equal_the_real_structures_fed_the_same_lookups(small):
    trace, stream, cfg = small
    record: list = []
    # a schedule that shrinks, then grows the EMB slab (boundary moves both ways, refill on the way up);
    # the heuristic followed the stream, which with bursts of users by activity only shrinks it
    res = simulate(stream, cfg, ScheduleAllocator([0.5, 0.2, 0.8, 0.8, 0.3, 0.6], cfg.control_interval_s),
                   "racer", record=record)
    batches = [r for r in record if r[0] == "batch"]
    assert sum(r[-1] for r in batches) == res.emb_hits
    # replay node 0's operations, boundary moves and refill included, on a payload-carrying
    # manager (real rows in a real arena, a real host table)
    mcfg = dataclasses.replace(memory_config(trace.num_items, cfg), payload=True)
    table = torch.randn(trace.num_items, mcfg.emb_dim)
    mm = MemoryManager(mcfg, table)
    moves = n_batches = cycled = 0
    for op in record:
        if op[1] != 0:
            continue
        if op[0] == "target":
            _, _, share, now_s, at_once = op
            mm.set_target(share, now_s)
            if at_once:
                mm.apply_plan(now_s)
            moves += 1
        elif op[0] == "step":
            mm.step(op[2])
        else:
            _, _, start_s, idx, cached, tail_ids, hits = op
            # the naive lookup: every recomputed history item, one id per token, then the rest
            hist = [np.asarray(stream.request(i).history[int(cached[j]):], dtype=np.int64)
                    for j, i in enumerate(idx.tolist())]
            ids = np.concatenate(hist + [tail_ids])
            cycled += sum(len(h) > len(np.unique(h)) for h in hist)  # the sim looked these up deduplicated
            for j, i in enumerate(idx.tolist()):
                u = int(stream.user[i])
                c = mm.kv.lookup(u)
                c = 0 if c > stream.history_len[i] else c
                assert c == cached[j]
                t = int(stream.history_len[i] + stream.num_new_items[i] - c)
                if t > 0:
                    mm.kv.append(u, t)
            out = mm.emb.lookup(torch.from_numpy(ids))
            assert out.num_hits == hits
            assert torch.equal(out.rows, table[torch.from_numpy(ids)])
            n_batches += 1
    assert n_batches > 10 and moves >= 1 and cycled > 10
    assert mm.emb_share == pytest.approx(res.shares[-1, 0])
    assert mm.stats().emb.refill_bytes > 0
    assert mm.check_invariants() == []


def test_same_seed_same_result_other_seed_other_result(small):
    trace, stream, cfg = small
    a = simulate(stream, cfg, StaticAllocator(0.4), "racer")
    b = simulate(stream, cfg, StaticAllocator(0.4), "racer")
    assert np.array_equal(a.latency_s, b.latency_s) and np.array_equal(a.node, b.node)
    other = generate(trace, dataclasses.replace(stream.config, seed=6))
    c = simulate(other, cfg, StaticAllocator(0.4), "racer")
    assert not np.array_equal(a.latency_s[:100], c.latency_s[:100])
    # the router's tie-break seed: the cluster's seed unless router_seed says otherwise
    same = simulate(stream, dataclasses.replace(cfg, router_seed=cfg.seed), StaticAllocator(0.4), "racer")
    assert np.array_equal(a.node, same.node)
    d = simulate(stream, dataclasses.replace(cfg, router_seed=cfg.seed + 1), StaticAllocator(0.4), "least_load")
    e = simulate(stream, cfg, StaticAllocator(0.4), "least_load")
    assert not np.array_equal(d.node, e.node)  # least_load's ties go elsewhere; the stream is the same
    # a simulated node batches by slice, so the router's queued-pass rule is off whatever the config says
    from gateway.router import LoadAwareConfig
    sim = ClusterSim(stream, dataclasses.replace(cfg, load_aware=LoadAwareConfig(pass_while_queued=True)), "racer",
                     initial_share=0.4)
    assert sim.rt.config.load_aware.pass_while_queued is False and sim.rt.config.load_aware.same_batch_s == 0.01


def test_allocators_and_boundary_moves(small):
    trace, stream, cfg = small
    sched = ScheduleAllocator([0.2, 0.8, 0.8, 0.2, 0.5, 0.5], cfg.control_interval_s)
    r = simulate(stream, cfg, sched, "racer")
    assert r.targets[:, 0].tolist() == [0.2, 0.8, 0.8, 0.2, 0.5, 0.5]
    assert r.shares[1, 0] > 0.7 and r.shares[3, 0] < 0.3  # the boundary follows within the window
    assert r.refill_bytes > 0  # growing the slab refilled it in the background
    with pytest.raises(ValueError, match="static share must be in"):
        StaticAllocator(1.5)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="num_nodes must be a positive integer"):
        SimConfig(num_nodes=0).validate()
    with pytest.raises(ValueError, match="batch_window_ms must be a positive number"):
        SimConfig(batch_window_ms=0).validate()


def test_quick_table_has_every_row_and_key(tmp_path):
    trace_file = tmp_path / "seq.txt"
    tr = synthetic_trace(num_users=120, num_items=2_000, mean_seq_len=25, seed=4)
    trace_file.write_text("".join(f"{u} {int(i)}\n" for u in range(tr.num_users) for i in tr.history(u)))
    cfg = TableConfig(trace="sequences", path=str(trace_file), regimes=("steady", "burst"), num_nodes=4,
                      rate_rps=300, duration_s=4, num_users=800, shares=(0.3, 0.7), routers=("racer", "least_load"),
                      jobs=1)
    res = run_table(cfg, tmp_path / "out", progress=False)
    keys = {"trace", "regime", "allocator", "router", "p50_ms", "p99_ms", "slo_attainment", "throughput_rps",
            "emb_hit_rate", "kv_hit_rate", "mean_share", "mean_abs_share_error"}
    got = {(r["regime"], r["allocator"], r["router"]) for r in res["rows"]}
    for rg in ("steady", "burst"):
        for a in ("static:0.30", "static:0.70", "best_static", "heuristic", "oracle"):
            assert (rg, a, "racer") in got
        assert (rg, "best_static", "least_load") in got and (rg, "oracle", "least_load") in got
    assert all(keys <= set(r) for r in res["rows"])
    oracle = [r for r in res["rows"] if r["allocator"] == "oracle" and r["router"] == "racer"]
    assert all(r["mean_abs_share_error"] < 0.1 for r in oracle)  # the oracle follows its own schedule
    assert (tmp_path / "out" / "paper_table_sequences.json").exists()
    assert (tmp_path / "out" / "paper_table_sequences.png").read_bytes()[:4] == b"\x89PNG"
    assert "oracle_mean_share_spread" in res["findings"]


def test_table_saves_each_run_and_resumes_from_them(tmp_path, capsys, monkeypatch):
    trace_file = tmp_path / "seq.txt"
    tr = synthetic_trace(num_users=100, num_items=1_500, mean_seq_len=20, seed=5)
    trace_file.write_text("".join(f"{u} {int(i)}\n" for u in range(tr.num_users) for i in tr.history(u)))
    cfg = TableConfig(trace="sequences", path=str(trace_file), regimes=("steady",), num_nodes=3, rate_rps=200,
                      duration_s=3, num_users=500, shares=(0.3, 0.7), routers=("racer", "least_load"), jobs=2)
    out = tmp_path / "out"
    first = run_table(cfg, out, progress=False)
    total = first["runs"]["total"]  # 2 static + oracle + heuristic + least_load x (best_static, oracle)
    assert first["runs"] == {"total": total, "computed": total, "reused": 0, "unreadable": 0} and total == 6
    saved = sorted((out / "runs").glob("*.json"))
    assert len(saved) == total  # one file per finished run

    again = run_table(dataclasses.replace(cfg, jobs=1), out, progress=False)
    assert again["runs"]["reused"] == total and again["runs"]["computed"] == 0
    assert again["rows"] == first["rows"] and again["oracle"] == first["oracle"]
    # from another working directory: the same keys (the code digest reads the repository's files)
    monkeypatch.chdir(tmp_path)
    elsewhere = run_table(dataclasses.replace(cfg, jobs=1), out, progress=False)
    assert elsewhere["runs"]["reused"] == total and elsewhere["rows"] == first["rows"]

    # another router: only its runs are computed
    more = run_table(dataclasses.replace(cfg, routers=("racer", "least_load", "round_robin"), jobs=1), out,
                     progress=False)
    assert more["runs"]["reused"] == total and more["runs"]["computed"] == 2
    assert [r for r in more["rows"] if r["router"] != "round_robin"] == first["rows"]

    # a damaged file is recomputed, to the same row
    saved[0].write_text("{not json")
    fixed = run_table(dataclasses.replace(cfg, jobs=1), out, progress=False)
    assert fixed["runs"]["unreadable"] == 1 and fixed["runs"]["computed"] == 1 and fixed["rows"] == first["rows"]

    # other settings share nothing; resume=False recomputes everything
    other = run_table(dataclasses.replace(cfg, rate_rps=250, jobs=1), out, progress=False)
    assert other["runs"]["reused"] == 0
    from workloads import generate, load_trace

    n250 = len(generate(load_trace("sequences", str(trace_file)), regime="steady", rate_rps=250, duration_s=3,
                        num_users=500, history_scale=cfg.history_scale, seed=0))
    assert {r["num_requests"] for r in other["rows"]} == {n250} != {r["num_requests"] for r in first["rows"]}
    fresh = run_table(dataclasses.replace(cfg, jobs=1), out, progress=False, resume=False)
    assert fresh["runs"]["computed"] == total and fresh["rows"] == first["rows"]

    # the trace's content is part of the key, whatever its file is called
    import simulator.table as table

    lines = trace_file.read_text().splitlines(keepends=True)
    u, i = lines[0].split()
    trace_file.write_text(f"{u} {int(i) + 1}\n" + "".join(lines[1:]))  # one item of one history
    table._STREAMS.clear()  # a new process would load the file again
    changed = run_table(dataclasses.replace(cfg, jobs=1), out, progress=False)
    assert changed["runs"]["reused"] == 0
    trace_file.write_text("".join(f"{u} {int(i)}\n" for u in range(tr.num_users) for i in tr.history(u)))
    table._STREAMS.clear()

    # the command line says what it reused, and --fresh recomputes
    from racer.cli import main

    args = ["bench", "paper-table", "--trace", "sequences", "--path", str(trace_file), "--nodes", "3",
            "--regimes", "steady", "--rate", "200", "--duration", "3", "--users", "500", "--shares", "0.3,0.7",
            "--routers", "racer,least_load", "--allocators", "none", "--jobs", "1", "--out", str(out),
            "--no-progress", "--json"]
    capsys.readouterr()
    assert main(args) == 0
    cap = capsys.readouterr()
    assert f"reused {total} of {total} runs" in cap.err and json.loads(cap.out)["runs"]["computed"] == 0
    assert main(args + ["--fresh"]) == 0
    cap = capsys.readouterr()
    assert "reused" not in cap.err and json.loads(cap.out)["runs"]["computed"] == total
    # without --allocators the table has the SmartAllocator row (racer): only that run is new
    default = [a for a in args if a not in ("--allocators", "none")]
    assert main(default) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["runs"]["computed"] == 1 and res["runs"]["reused"] == total
    assert [r["allocator"] for r in res["rows"] if r["router"] == "racer"].count("racer") == 1


def test_a_fork_continues_exactly_like_the_run_it_was_forked_from(small):
    trace, stream, cfg = small
    a = ClusterSim(stream, cfg, "racer", initial_share=0.4)
    a.start()
    a.advance([0.6] * cfg.num_nodes)
    b = a.fork()
    other = a.fork()
    other.advance([0.1] * cfg.num_nodes)  # a sibling moving elsewhere changes neither
    for sim in (a, b):
        out = sim.advance([0.3] * cfg.num_nodes)
        while out is not None:
            out = sim.advance([0.5] * cfg.num_nodes)
    ra, rb = a.result(), b.result()
    assert np.array_equal(ra.latency_s, rb.latency_s) and np.array_equal(ra.node, rb.node)
    assert np.array_equal(ra.shares, rb.shares) and ra.emb_hits == rb.emb_hits
    assert a.nodes[0].mm is not b.nodes[0].mm and a.rt is not b.rt


def test_replay_oracle_picks_each_window_best_share_from_its_own_state(small):
    trace, stream, cfg = small
    shares = [0.2, 0.5, 0.8]
    res, sched = oracle_replay(stream, cfg, shares, rel_tol=0.0)
    assert len(sched) == res.shares.shape[0] and set(sched) <= set(shares)
    # the run the oracle kept is the schedule, replayed: a fork is the same simulation
    again = simulate(stream, cfg, ScheduleAllocator(sched, cfg.control_interval_s), "racer")
    assert np.array_equal(again.latency_s, res.latency_s)
    # window by window, no other share would have done better from the oracle's state
    sim = ClusterSim(stream, cfg, "racer", initial_share=sched[0])
    out = sim.start()
    w = 1
    while out is not None:
        for s in shares:
            f = sim.fork()
            f.advance([s] * cfg.num_nodes)
            assert res.window_p99_ms[w] <= f.window_p99_ms(w) + 1e-9
        out = sim.advance([sched[w]] * cfg.num_nodes)
        w += 1
    with pytest.raises(ValueError, match="shares"):
        oracle_replay(stream, cfg, [1.5])
    # each window's band holds the shares whose P99 is within sampling error of the best: the
    # chosen one always, and the band error of the oracle's own schedule is 0
    bands = res.extra["oracle_bands"]
    assert len(bands) == len(sched) and all(s in b and set(b) <= set(shares) for s, b in zip(sched, bands))
    from simulator.table import band_error

    assert band_error(np.array(sched)[:, None], bands, shares) == 0.0
    # the sticky variant moves only beyond sampling error: every change of share leaves a band
    # that did not hold the previous share
    sticky, ssched = oracle_replay(stream, cfg, shares, ties="band")
    sb = sticky.extra["oracle_bands"]
    assert all(b == a or a not in band for a, b, band in zip(ssched, ssched[1:], sb[1:]))
    with pytest.raises(ValueError, match="ties"):
        oracle_replay(stream, cfg, shares, ties="noise")
    # held at the configured split for its first window (every online allocator starts there),
    # from the second window on it chooses from the grid like the oracle
    started, st_sched = oracle_replay(stream, cfg, shares, first_share=0.5, rel_tol=0.0)
    assert st_sched[0] == 0.5 and set(st_sched[1:]) <= set(shares) and len(st_sched) == len(sched)
    assert started.shares[0].tolist() == [0.5] * cfg.num_nodes
    with pytest.raises(ValueError, match="first_share"):
        oracle_replay(stream, cfg, shares, first_share=1.5)
    # the nearest share of the band is never farther than the oracle's own choice
    assert band_error(res.shares, bands, shares) <= np.mean(np.abs(res.shares - np.array(sched)[:, None])) + 1e-12


def test_window_p99_estimate_and_band_error_by_hand(small):
    _, stream, cfg = small
    sim = ClusterSim(stream, cfg, "racer", initial_share=0.5)
    sim.start()
    p99, se = sim.window_p99_estimate(0)
    assert p99 == pytest.approx(sim.window_p99_ms(0)) and se > 0
    from simulator.table import band_error

    grid = (0.2, 0.5, 0.8)
    shares = np.array([[0.3, 0.5], [0.9, 0.6], [0.6, 0.35]])  # 3 windows x 2 nodes
    bands = [[0.5], [0.2, 0.5, 0.8], [0.2, 0.8]]  # a point; the whole interval; two points
    assert band_error(shares, bands, grid) == pytest.approx((0.2 + 0.0 + 0.1 + 0.0 + 0.2 + 0.15) / 6)
    assert band_error(shares, [], grid) is None


class _Recording(StaticAllocator):
    """A static split that keeps every WindowStats its nodes are shown."""

    def __init__(self, share):
        super().__init__(share)
        self.seen = []

    def control(self, node, stats, manager, now_s):
        self.seen.append(stats)
        return super().control(node, stats, manager, now_s)


def test_ghost_lists_change_nothing_but_report_the_marginal_utilities(small):
    _, stream, cfg = small
    off, on = _Recording(0.5), _Recording(0.5)
    r_off = simulate(stream, cfg, off)
    r_on = simulate(stream, dataclasses.replace(cfg, ghost_probes=(0.05, 0.1, 0.2, 0.4)), on)
    np.testing.assert_array_equal(r_off.latency_s, r_on.latency_s)
    assert r_off.emb_hits == r_on.emb_hits and r_off.kv_hit_tokens == r_on.kv_hit_tokens
    assert all(s.emb_marginal_us == 0 and s.kv_marginal_us == 0 for s in off.seen)
    assert sum(s.emb_marginal_us > 0 for s in on.seen) > len(on.seen) // 2
    assert any(s.kv_marginal_us > 0 for s in on.seen)
    # the windows' other figures are those of the run without ghost lists
    assert all(a.emb_hit_rate == b.emb_hit_rate for a, b in zip(off.seen, on.seen))


@needs_samples
def test_bench_marginal_reports_each_regime(capsys):
    from bench.marginal import main

    out = main(["--json", "--duration", "3", "--share", "0.5"])
    assert set(out["regimes"]) == {"steady", "trend", "burst"}
    for v in out["regimes"].values():
        for part in ("first_half", "second_half"):
            assert v[part]["emb_marginal_us"] >= 0 and v[part]["kv_marginal_us"] >= 0
        assert v["p99_ms"] > 0
    assert sum(v["first_half"]["emb_marginal_us"] for v in out["regimes"].values()) > 0
    assert capsys.readouterr().out.startswith("{")
    with pytest.raises(SystemExit):
        main(["--share", "1.5"])
    with pytest.raises(SystemExit):  # too short for the burst regime: a usage error, not a traceback
        main(["--duration", "0.5"])
    assert "do not fit" in capsys.readouterr().err


@needs_samples
def test_bench_simulator_floor_replays_the_runs_calls():
    from bench.simulator import _fingerprint, _floor_regime, main
    from workloads import generate

    out = main(["--json", "--nodes", "4", "--rate", "300", "--duration", "3", "--users", "500", "--floor"])
    f = out["floor"]
    assert f["replay_identical"] is True and set(f["regimes"]) == {"steady", "trend", "burst"}
    for v in f["regimes"].values():
        assert v["mismatched_returns"] == 0
        assert set(v["parts"]) == {"emb_cache", "kv_pool", "memory_manager", "router"}
        assert v["parts"]["kv_pool"]["methods"]["lookup"] == v["num_requests"]  # one per request
        for part, meth in (("emb_cache", "lookup"), ("router", "route_batch"), ("memory_manager", "step")):
            assert v["parts"][part]["methods"][meth] > 0
    total_n = sum(v["num_requests"] for v in f["regimes"].values())
    assert total_n == sum(v["num_requests"] for v in out["regimes"].values())

    # the check sees a replay that differs: leave out the KV appends and lookups return otherwise
    trace, _ = __import__("bench").load_bench_trace("taobao", None)
    s = generate(trace, regime="steady", rate_rps=300, duration_s=3, num_users=500, seed=0)
    cfg = SimConfig(num_nodes=4, cache_fraction=TableConfig().cache_fraction)
    assert _floor_regime(s, cfg)["mismatched_returns"] == 0
    assert _floor_regime(s, cfg, omit="append")["mismatched_returns"] > 0
    assert _fingerprint(np.arange(3)) != _fingerprint(np.arange(1, 4))
    assert _fingerprint(torch.tensor([1, 2])) == _fingerprint(np.array([1, 2]))


@needs_samples
def test_bench_oracle_gap_small_sweep(capsys, tmp_path):
    from bench.oracle_gap import main

    out = main(["--json", "--traces", "taobao", "--kv-kib", "6,96", "--cache-fractions", "1", "--nodes", "2",
                "--rate", "150", "--duration", "3", "--users", "300", "--shares", "0.2,0.8", "--jobs", "1",
                "--out", str(tmp_path / "gap")])
    assert json.loads((tmp_path / "gap" / "oracle_gap.json").read_text())["rows"] == out["rows"]
    assert (tmp_path / "gap" / "oracle_gap.png").read_bytes()[:4] == b"\x89PNG"
    assert [(r["kv_kib"], r["regime"]) for r in out["rows"]] == [(6.0, "steady"), (96.0, "steady")]
    for r in out["rows"]:
        assert set(r["static"]) == {"0.20", "0.80"}
        assert r["best_static_p99_ms"] == min(v["p99_ms"] for v in r["static"].values())
        assert r["gap"] == pytest.approx(r["best_static_p99_ms"] / r["oracle_p99_ms"] - 1, abs=1e-3)
        assert 0.2 <= r["oracle_mean_share"] <= 0.8
    # smaller K/V per token: the same arena holds more histories
    assert out["rows"][0]["arena_holds_histories"] > 10 * out["rows"][1]["arena_holds_histories"]
    assert out["max_gap"]["steady"] == max(r["gap"] for r in out["rows"])
    assert out["one_split"]["settings"] == []  # one regime: nothing to share a split across
    capsys.readouterr()
    for bad, says in ((["--traces", "nope"], "unknown trace 'nope'"), (["--kv-kib", "1.5"], "--kv-kib 1.5"),
                      (["--kv-kib", "nan"], "--kv-kib nan"), (["--jobs", "-1"], "--jobs must be >= 0"),
                      (["--rate", "inf"], "--rate must be a finite number"),
                      (["--shares", "0.121,0.124"], "differ by at least 0.01"),
                      (["--regimes", "burst", "--duration", "1"], "do not fit"),
                      (["--out", str(tmp_path / "gap" / "oracle_gap.json" / "x")], "--out")):
        with pytest.raises(SystemExit):
            main(bad)
        assert says in capsys.readouterr().err


def test_oracle_gap_one_split_for_all_regimes():
    from bench.oracle_gap import one_split

    def row(regime, p99s, oracle):
        return {"trace": "t", "kv_kib": 6.0, "cache_fraction": 1.0, "regime": regime, "oracle_p99_ms": oracle,
                "static": {s: {"p99_ms": v} for s, v in p99s.items()}}

    rows = [row("steady", {"0.10": 11.0, "0.90": 10.0}, 10.0), row("trend", {"0.10": 20.0, "0.90": 40.0}, 20.0)]
    got = one_split(rows)
    # 0.10 costs 10% on steady, 0.90 costs 100% on trend: one split for both is 0.10
    assert got["settings"] == [{"trace": "t", "kv_kib": 6.0, "cache_fraction": 1.0, "share": "0.10",
                                "gap": {"steady": 0.1, "trend": 0.0}}]
    assert got["max_gap"] == 0.1


def test_table_across_seeds(tmp_path, capsys):
    from simulator.table import run_seeds

    trace_file = tmp_path / "seq.txt"
    tr = synthetic_trace(num_users=100, num_items=1_500, mean_seq_len=20, seed=6)
    trace_file.write_text("".join(f"{u} {int(i)}\n" for u in range(tr.num_users) for i in tr.history(u)))
    cfg = TableConfig(trace="sequences", path=str(trace_file), regimes=("steady",), num_nodes=3, rate_rps=200,
                      duration_s=3, num_users=500, shares=(0.3, 0.7), routers=("racer",), jobs=1)
    out = tmp_path / "out"
    res = run_seeds(cfg, [0, 3], out, progress=False)
    one = {sd: json.loads((out / f"seed{sd}" / "paper_table_sequences.json").read_text()) for sd in (0, 3)}
    assert one[0]["config"]["seed"] == 0 and one[3]["config"]["seed"] == 3
    by = {sd: {(r["regime"], r["allocator"], r["router"]): r for r in one[sd]["rows"]} for sd in (0, 3)}
    assert len(res["rows"]) == len(one[0]["rows"])
    for r in res["rows"]:
        k = (r["regime"], r["allocator"], r["router"])
        vals = [by[0][k]["p99_ms"], by[3][k]["p99_ms"]]
        assert r["p99_ms"]["per_seed"] == vals and r["p99_ms"]["min"] == min(vals)
        assert r["p99_ms"]["mean"] == pytest.approx(sum(vals) / 2, abs=1e-4)
    assert by[0] != by[3]  # other streams, other rows
    f = res["findings"]["steady"]["best_static_p99_over_oracle"]
    assert f["per_seed"] == [one[sd]["findings"]["steady"]["best_static_p99_over_oracle"] for sd in (0, 3)]
    assert json.loads((out / "paper_table_sequences_seeds.json").read_text())["rows"] == res["rows"]
    assert (out / "paper_table_sequences_seeds.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="distinct"):
        run_seeds(cfg, [1, 1])

    from racer.cli import main

    args = ["bench", "paper-table", "--trace", "sequences", "--path", str(trace_file), "--nodes", "3",
            "--regimes", "steady", "--rate", "200", "--duration", "3", "--users", "500", "--shares", "0.3,0.7",
            "--routers", "racer", "--allocators", "none", "--jobs", "1", "--out", str(out), "--no-progress"]
    capsys.readouterr()
    assert main(args + ["--seeds", "0,3"]) == 0  # every run saved: reused
    cap = capsys.readouterr()
    assert "reused 8 runs" in cap.err and "p99_ms mean [min, max]" in cap.out
    assert main(args + ["--seeds", "0,3", "--seed", "1"]) == 2
    assert "not both" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(args + ["--seeds", "1,x"])


def test_a_users_later_requests_in_a_batch_are_passes_of_their_own():
    from simulator.cost import extra_passes_us, user_passes
    from simulator.profiles import get_profile

    batch_of = np.array([0, 0, 0, 0, 1, 1, 1])
    users = np.array([5, 9, 5, 5, 5, 2, 2])
    assert user_passes(batch_of, users).tolist() == [0, 0, 1, 2, 0, 0, 1]
    p = get_profile("a100-hstu")
    comp = np.array([10.0, 30.0, 20.0, 40.0, 1.0, 1.0, 1.0])
    passes = user_passes(batch_of, users)[:4]
    assert extra_passes_us(p, comp[:4], passes) == pytest.approx(2 * p.batch_overhead_us + 20.0 + 40.0)
    assert extra_passes_us(p, comp[:2], np.zeros(2, dtype=np.int64)) == 0.0
