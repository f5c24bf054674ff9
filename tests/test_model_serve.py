"""Serving a trained checkpoint: the engine ranks with it, its K/V cache equals recompute, a
checkpoint that does not fit is refused (the engine keeps its model; the agent exits at start),
the profile measures it, and a real node agent started with --model ranks held-out items better
than random weights."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from node_agent.engine import Engine, EngineConfig, LinkEmulationConfig, RecRequest
from node_agent.model import ModelConfig
from node_agent.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from node_agent.model.train import leave_one_out
from workloads.loaders import load_sequences

from .procs import SMALL_AGENT_ARGS, free_port, racer_cmd, spawn, stop, wait_http
from .test_model_train import trained_checkpoint


@pytest.fixture(scope="module")
def ckpt_setup(tmp_path_factory):
    trace_path, out, _ = trained_checkpoint(tmp_path_factory)
    trace = load_sequences(trace_path)
    return trace_path, out, trace, load_checkpoint(out, item_keys=list(trace.item_keys))


def engine_for(ckpt, trace, **kw) -> Engine:
    cfg = EngineConfig(model=ckpt.config, num_items=trace.num_items, num_pages=128, page_tokens=4,
                       max_history_len=64, max_candidates=trace.num_items, default_num_candidates=16,
                       link=LinkEmulationConfig(mode="off"), device="cpu")
    return Engine(cfg, item_popularity=trace.item_popularity(), **kw)


def test_engine_ranks_with_the_checkpoint(ckpt_setup):
    _, _, trace, ckpt = ckpt_setup
    eng = engine_for(ckpt, trace, checkpoint=ckpt)
    assert eng.model_info == {"kind": "checkpoint", "digest": ckpt.digest, "path": ckpt.path, "trace": "sequences"}
    assert eng.describe()["model_source"]["digest"] == ckpt.digest
    assert torch.equal(eng.mm.emb.host_table, ckpt.item_table)
    hist = trace.history(3)[:-1].astype(np.int64)
    cands = np.arange(trace.num_items)
    r = eng.serve(RecRequest(user_id=3, history=hist, candidates=cands, top_k=trace.num_items))
    with torch.no_grad():
        rows = ckpt.item_table[torch.from_numpy(hist)]
        _, kv = ckpt.model(ckpt.model.tokens(rows), torch.zeros(len(hist), dtype=torch.float64))
        ref = ckpt.model.rank(ckpt.item_table, kv, now_ts=0.0)
    assert len(r.items) == trace.num_items and r.scores == sorted(r.scores, reverse=True)
    assert np.allclose(r.scores, ref[r.items].numpy(), atol=1e-5)


def test_kv_hit_equals_recompute_with_trained_weights(ckpt_setup):
    _, _, trace, ckpt = ckpt_setup
    hist = trace.history(5).astype(np.int64)
    cands = np.arange(40)
    warm = engine_for(ckpt, trace, checkpoint=ckpt)
    warm.serve(RecRequest(user_id=5, history=hist[:6], candidates=cands, top_k=40))
    hit = warm.serve(RecRequest(user_id=5, history=hist[:6], new_items=hist[6:], candidates=cands, top_k=40))
    assert hit.kv.outcome == "hit" and hit.kv_hit_tokens == 6
    cold = engine_for(ckpt, trace, checkpoint=ckpt)
    miss = cold.serve(RecRequest(user_id=5, history=hist, candidates=cands, top_k=40))
    assert miss.kv.outcome == "miss"
    assert hit.items == miss.items
    assert np.allclose(hit.scores, miss.scores, atol=1e-5)
    assert warm.check_invariants() == [] and cold.check_invariants() == []


def test_runtime_load_refuses_a_mismatch_and_keeps_serving(ckpt_setup, tmp_path):
    _, out, trace, ckpt = ckpt_setup
    eng = engine_for(ckpt, trace)  # random weights
    assert eng.model_info["kind"] == "random"
    req = RecRequest(user_id=1, history=trace.history(1)[:-1].astype(np.int64), candidates=np.arange(30), top_k=30)
    before = eng.serve(req)
    # another shape: refused, nothing changes
    other = ModelConfig(embedding_dim=16, num_layers=2, num_heads=2, qk_dim=8, v_dim=8)
    from node_agent.model import HSTUModel

    bad_dir = tmp_path / "other_shape"
    save_checkpoint(bad_dir, HSTUModel(other), torch.zeros(trace.num_items, 16), list(trace.item_keys))
    with pytest.raises(CheckpointError, match="model config differs from the one this node serves"):
        eng.load_checkpoint(load_checkpoint(bad_dir))
    fewer = tmp_path / "fewer_items"
    save_checkpoint(fewer, ckpt.model, ckpt.item_table[:-5], list(trace.item_keys)[:-5])
    with pytest.raises(CheckpointError, match="trained on 145 items, this node serves 150"):
        eng.load_checkpoint(load_checkpoint(fewer))
    assert eng.model_info["kind"] == "random"
    again = eng.serve(req)
    assert again.items == before.items and again.kv.outcome == "hit"
    # a checkpoint that fits: loaded, the cached rows rewritten, the old K/V dropped
    info = eng.load_checkpoint(ckpt)
    assert info["digest"] == ckpt.digest and eng.model_info["digest"] == ckpt.digest
    assert eng.check_invariants() == []  # every cached EMB row equals the new table's
    after = eng.serve(req)
    assert after.kv.outcome == "miss"
    fresh = engine_for(ckpt, trace, checkpoint=ckpt).serve(req)
    assert after.items == fresh.items and np.allclose(after.scores, fresh.scores, atol=1e-5)


def test_profile_measures_the_loaded_model(ckpt_setup):
    from node_agent.profile import ProfileConfig, measure_profile

    _, _, _, ckpt = ckpt_setup
    cfg = ProfileConfig(model=ckpt.config, lengths=(16,), repeats=1, emb_batch_rows=32, hit_history_len=16,
                        new_tokens=2, num_candidates=8, page_tokens=4, link=LinkEmulationConfig(mode="off"),
                        device="cpu")
    prof = measure_profile(cfg, checkpoint=ckpt)
    assert prof["model_source"] == {"kind": "checkpoint", "digest": ckpt.digest, "path": ckpt.path}
    assert measure_profile(cfg)["model_source"]["kind"] == "random"
    with pytest.raises(ValueError, match="differs from the profile's"):
        measure_profile(ProfileConfig(model=ModelConfig(embedding_dim=16, num_layers=2, num_heads=2, qk_dim=8,
                                                        v_dim=8), lengths=(16,), repeats=1), checkpoint=ckpt)


def test_agent_with_a_mismatched_checkpoint_exits_at_start(ckpt_setup, tmp_path, capsys):
    from racer.cli import main
    from tests.test_model_train import write_sequential_trace

    _, out, _, _ = ckpt_setup
    other = write_sequential_trace(tmp_path / "other.txt", num_items=120)
    rc = main(["node-agent", "--port", "0", "--trace", "sequences", "--path", str(other), "--model", str(out)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "racer: error: checkpoint" in err and "trained on 150 items, the trace served here has 120" in err


def _held_out_ranks(url: str, trace, users) -> list[int]:
    split = leave_one_out(trace)
    ranks = []
    with httpx.Client(timeout=30.0) as client:
        for u in users:
            hist, _ = split.history(u, "test")
            r = client.post(f"{url}/v1/recommend", json={
                "user_id": int(u), "history": hist[-20:].tolist(), "candidates": list(range(trace.num_items)),
                "top_k": trace.num_items})
            assert r.status_code == 200, r.text
            ranks.append(r.json()["items"].index(int(split.test[u])))
    return ranks


def test_real_agent_serves_the_checkpoint_and_beats_random_weights(ckpt_setup, tmp_path):
    trace_path, out, trace, ckpt = ckpt_setup
    procs = []
    try:
        urls = {}
        for name, extra in (("trained", ["--model", str(out)]), ("random", [])):
            port = free_port()
            log = tmp_path / f"{name}.log"
            cmd = racer_cmd("node-agent", "--port", str(port), "--trace", "sequences", "--path", str(trace_path),
                            *SMALL_AGENT_ARGS, *extra)
            procs.append((spawn(cmd, log), log))
            urls[name] = f"http://127.0.0.1:{port}"
        for (proc, log), url in zip(procs, urls.values()):
            wait_http(f"{url}/healthz", proc, log=log)
        users = np.flatnonzero(leave_one_out(trace).test >= 0)[:60]
        trained = _held_out_ranks(urls["trained"], trace, users)
        random = _held_out_ranks(urls["random"], trace, users)
        assert np.mean(trained) < 0.5 * np.mean(random), (np.mean(trained), np.mean(random))
        assert np.mean(np.array(trained) < 10) > np.mean(np.array(random) < 10) + 0.2
        metrics = httpx.get(f"{urls['trained']}/v1/metrics", timeout=10).json()
        assert json.dumps(metrics).count(ckpt.digest) >= 1
        assert ckpt.digest[:16] in procs[0][1].read_text()
    finally:
        for proc, _ in procs:
            stop(proc)


def test_bench_engine_compares_the_checkpoint_with_random_weights(ckpt_setup, capsys):
    from bench.engine import main

    _, out, _, ckpt = ckpt_setup
    assert main(["--model", str(out), "--reps", "1", "--json", "--device", "cpu"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["checkpoint"] == ckpt.digest and set(res["lengths"]) == {"128", "512", "2048"}
    row = res["lengths"]["128"]
    assert set(row) == {"random", "trained", "ratio_trained_over_random"}
    assert row["ratio_trained_over_random"]["hit"]["p50_ms"] > 0


def test_racer_up_picks_the_shipped_checkpoint(tmp_path):
    from node_agent.model.shipped import SHIPPED_DIR, resolve_model, shipped_checkpoint

    assert resolve_model("none", "taobao", None) is None
    assert resolve_model(str(tmp_path), "taobao", None) == tmp_path
    assert resolve_model("auto", "taobao", "/some/other/file.csv") is None  # another file: random weights
    assert resolve_model("auto", "movielens", None) is None  # nothing shipped for it
    shipped = shipped_checkpoint("taobao")
    assert shipped == SHIPPED_DIR / "taobao" and resolve_model("auto", "taobao", None) == shipped
    assert sum(f.stat().st_size for f in shipped.iterdir()) < 5 * 2**20  # a few MB at most
    try:
        from workloads.loaders import load_trace

        trace = load_trace("taobao")
    except FileNotFoundError:
        pytest.skip("the bundled taobao sample is not here (../shared/data)")
    ckpt = load_checkpoint(shipped, item_keys=list(trace.item_keys))  # fits the sample it was trained on
    assert ckpt.num_items == trace.num_items


def test_the_node_registers_its_model_digest_and_the_dashboard_shows_it(ckpt_setup, tmp_path):
    from pydantic import ValidationError

    from common.contract import CostProfileIn
    from dashboard.app import _node_rows
    from node_agent.agent import AgentConfig, NodeAgent
    from node_agent.reporter import Reporter, ReporterConfig

    _, _, trace, ckpt = ckpt_setup
    costs = {"kv_recompute_us_per_token": {"128": 2.0}, "emb_transfer_us_per_row": 1.0, "emb_hit_us_per_row": 0.1}
    profiles = {}
    for name, kw in (("trained", {"checkpoint": ckpt}), ("random", {})):
        agent = NodeAgent(engine_for(ckpt, trace, **kw), AgentConfig(), miss_costs=costs)
        rep = Reporter(agent, ReporterConfig(control_plane_url="http://127.0.0.1:9", token="tok", node_id="n0",
                                             advertise_url="http://127.0.0.1:9", state_dir=str(tmp_path / name)))
        profiles[name] = rep.registration_profile()
    assert profiles["trained"]["model_digest"] == ckpt.digest
    assert "model_digest" not in profiles["random"]
    assert CostProfileIn(**profiles["trained"]).model_digest == ckpt.digest  # the control plane takes it
    with pytest.raises(ValidationError):
        CostProfileIn(**{**profiles["trained"], "model_digest": "not a digest"})
    rows = _node_rows([{"node_id": "n1", "cost_profile": profiles["random"]},
                       {"node_id": "n0", "cost_profile": profiles["trained"]}])
    assert [r["model"] for r in rows] == [ckpt.digest[:12], "random weights"]
