"""Training the GR model: the batched training paths equal the serving paths, the leave-one-out
split, a tiny training run that beats popularity, checkpoints (digest, refusals), resumption, the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from node_agent.model import HSTUModel, ModelConfig
from node_agent.model.checkpoint import CheckpointError, load_checkpoint, read_manifest
from node_agent.model.eval import evaluate
from node_agent.model.train import (TrainConfig, candidate_scores, causal_forward, leave_one_out, sample_slots,
                                    train)
from workloads.loaders import load_sequences

TINY = ModelConfig(embedding_dim=16, num_layers=1, num_heads=2, qk_dim=8, v_dim=8, seed=0)


def write_sequential_trace(path: Path, num_users: int = 240, num_items: int = 150, seed: int = 0) -> Path:
    """``user item timestamp`` lines: the items fall in 10 groups of equal size; each user draws
    nine items in ten from a group of its own and the rest from all items, so a user's next item
    follows from its history (a model can learn it) while every item is about equally popular
    (popularity cannot)."""
    rng = np.random.default_rng(seed)
    group_size = num_items // 10
    lines = []
    for u in range(num_users):
        group = int(rng.integers(0, 10))
        for j in range(int(rng.integers(10, 21))):
            item = (group * group_size + int(rng.integers(0, group_size)) if rng.random() < 0.9
                    else int(rng.integers(0, num_items)))
            lines.append(f"u{u} i{item} {1_500_000_000 + 60 * j}")
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_config(**kw) -> TrainConfig:
    base = dict(model=TINY, max_seq_len=20, batch_size=16, max_epochs=20, patience=20, lr=1e-2, dropout=0.0,
                num_negatives=32, positions_per_seq=8, device="cpu", seed=0)
    base.update(kw)
    return TrainConfig(**base)


def trained_checkpoint(tmp_path_factory) -> tuple[Path, Path, object]:
    """(trace file, checkpoint directory, TrainResult or None): trained once per test session and
    shared by the test modules that need a trained model."""
    base = tmp_path_factory.getbasetemp() / "model_walks"
    trace_path = base / "walks.txt"
    out = base / "ckpt"
    res = None
    if not (out / "manifest.json").is_file():
        base.mkdir(exist_ok=True)
        write_sequential_trace(trace_path)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            res = train(load_sequences(trace_path), tiny_config(), out, progress=False)
        finally:
            torch.set_num_threads(threads)
    return trace_path, out, res


@pytest.fixture(scope="module")
def seq_trace(tmp_path_factory):
    p, _, _ = trained_checkpoint(tmp_path_factory)
    return p, load_sequences(p)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    _, out, res = trained_checkpoint(tmp_path_factory)
    return out, res


# ------------------------------------------------------------------------ paths and split ---


@pytest.mark.parametrize("use_ts", [False, True])
def test_batched_training_paths_equal_the_serving_paths(use_ts):
    m = HSTUModel(ModelConfig(embedding_dim=16, num_layers=2, num_heads=2, qk_dim=8, v_dim=8, seed=3))
    g = torch.Generator().manual_seed(0)
    B, T, K = 3, 7, 5
    rows = torch.randn(B, T, 16, generator=g)
    cands = torch.randn(B, 4, K, 16, generator=g)
    ts = torch.cumsum(torch.rand(B, T, generator=g, dtype=torch.float64) * 100, 1)
    slots = torch.tensor([[0, 2, 5, 6], [1, 3, 4, 6], [0, 1, 2, 3]])
    cand_ts = ts.gather(1, slots) + 7.0
    kvs = causal_forward(m, m.tokens(rows), ts if use_ts else None)
    scores = candidate_scores(m, kvs, cands, slots, ts if use_ts else None, cand_ts if use_ts else None)
    for b in range(B):
        _, full = m(m.tokens(rows[b]), ts[b] if use_ts else torch.zeros(T, dtype=torch.float64))
        for li in range(2):
            assert torch.allclose(kvs[li][0][b], full.k[li], atol=1e-5)
            assert torch.allclose(kvs[li][1][b], full.v[li], atol=1e-5)
        for p in range(4):
            t = int(slots[b, p])
            ref = m.rank(cands[b, p], full.prefix(t + 1), now_ts=float(cand_ts[b, p]) if use_ts else 0.0)
            assert torch.allclose(scores[b, p], ref, atol=1e-5), (b, p)


def test_leave_one_out_split(seq_trace):
    trace = seq_trace[1]
    split = leave_one_out(trace)
    for u in (0, 7, trace.num_users - 1):
        h = trace.history(u)
        assert split.test[u] == h[-1] and split.valid[u] == h[-2]
        assert split.train[u].tolist() == h[:-2].tolist()
        assert split.history(u, "test")[0].tolist() == h[:-1].tolist()
        assert split.history(u, "valid")[0].tolist() == h[:-2].tolist()
    # popularity for the test targets counts training items and validation targets, never test ones
    pop = split.popularity("test")
    assert pop.sum() == trace.num_interactions - (split.test >= 0).sum()


def test_sample_slots_picks_distinct_slots_with_targets():
    rng = np.random.default_rng(0)
    slots, ok = sample_slots(np.array([3, 30, 2]), 8, rng)
    assert slots.shape == (3, 8)
    assert slots[0][ok[0]].tolist() == [0, 1] and ok[2].sum() == 1 and slots[2, 0] == 0
    s1 = slots[1][ok[1]]
    assert len(set(s1.tolist())) == 8 and s1.max() < 29


# ------------------------------------------------------------------------------- training ---


def test_training_beats_popularity_and_writes_a_verified_checkpoint(trained, seq_trace):
    out, res = trained
    trace = seq_trace[1]
    figures = json.loads((out / "figures.json").read_text())
    assert figures["best_epoch"] >= 1 and figures["history"]
    assert all(k in figures["history"][0] for k in ("loss", "valid_ndcg@10_sampled", "elapsed_s"))
    for name in ("weights.pt", "config.json", "items.json", "figures.json", "manifest.json"):
        assert (out / name).is_file()
    ckpt = load_checkpoint(out, item_keys=list(trace.item_keys))
    assert ckpt.config == TINY and ckpt.num_items == trace.num_items
    assert ckpt.digest == read_manifest(out)["digest"] and len(ckpt.digest) == 64
    split = leave_one_out(trace)
    figs = evaluate(ckpt.model, ckpt.item_table, split, "test", max_seq_len=20, popularity=True)
    pop = figs["popularity"]
    for k in ("hr@10_sampled", "ndcg@10_sampled", "hr@10_full", "ndcg@10_full"):
        assert figs[k] > pop[k] + 0.1, (k, figs, pop)
    assert figs["hr@10_sampled"] >= figs["hr@10_full"]


def test_checkpoint_refusals(trained, seq_trace, tmp_path):
    out, _ = trained
    keys = list(seq_trace[1].item_keys)
    with pytest.raises(CheckpointError, match="trained on 150 items, the trace served here has 149"):
        load_checkpoint(out, item_keys=keys[:-1])
    swapped = keys[:]
    swapped[3], swapped[4] = swapped[4], swapped[3]
    with pytest.raises(CheckpointError, match="item-id mapping differs .*dense id 3"):
        load_checkpoint(out, item_keys=swapped)
    with pytest.raises(CheckpointError, match="model config differs"):
        load_checkpoint(out, config=ModelConfig(embedding_dim=16, num_layers=2, num_heads=2, qk_dim=8, v_dim=8))
    with pytest.raises(CheckpointError, match="digest"):
        load_checkpoint(out, digest="0" * 64)
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    with open(bad / "weights.pt", "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointError, match="weights.pt has digest .* the file changed"):
        load_checkpoint(bad)
    with pytest.raises(CheckpointError, match="no such directory"):
        load_checkpoint(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        load_checkpoint(tmp_path / "empty")


def test_training_resumes_from_its_state(seq_trace, tmp_path):
    trace = seq_trace[1]
    cfg = tiny_config(max_epochs=2, patience=10)
    first = train(trace, cfg, tmp_path / "r", progress=False)
    assert first.resumed_from_epoch == 0 and len(first.history) == 2
    msgs = []
    again = train(trace, tiny_config(max_epochs=3, patience=10), tmp_path / "r", progress=False, log=msgs.append)
    assert again.resumed_from_epoch == 2 and [h["epoch"] for h in again.history] == [1, 2, 3]
    assert again.history[:2] == first.history
    assert any("resuming after epoch 2" in m for m in msgs)
    # another config does not resume from it
    other = train(trace, tiny_config(max_epochs=1, lr=5e-3), tmp_path / "r", progress=False, log=msgs.append)
    assert other.resumed_from_epoch == 0 and any("starting afresh" in m for m in msgs)


def test_bad_train_config():
    with pytest.raises(ValueError, match="negatives must be one of"):
        tiny_config(negatives="hard")
    with pytest.raises(ValueError, match="positions_per_seq must be a positive integer"):
        tiny_config(positions_per_seq=0)


# ------------------------------------------------------------------------------------ CLI ---


def test_cli_train_eval_show(seq_trace, tmp_path, capsys):
    from racer.cli import main

    path = seq_trace[0]
    out = tmp_path / "cli"
    rc = main(["model", "train", "--trace", "sequences", "--path", str(path), "--out", str(out), "--embedding-dim",
               "16", "--num-layers", "1", "--head-dim", "8", "--epochs", "2", "--batch-size", "64",
               "--max-seq-len", "20", "--no-progress", "--json", "--device", "cpu"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["epochs_run"] == 2 and res["digest"] == read_manifest(out)["digest"]
    rc = main(["model", "eval", str(out), "--trace", "sequences", "--path", str(path), "--json", "--no-progress"])
    assert rc == 0
    figs = json.loads(capsys.readouterr().out)
    assert set(figs["popularity"]) == {"hr@10_sampled", "ndcg@10_sampled", "hr@10_full", "ndcg@10_full"}
    assert figs["digest"] == res["digest"] and figs["num_users"] == 240 and figs["max_seq_len"] == 20
    assert main(["model", "show", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_items"] == 150
    # the wrong trace: one line, exit 2
    other = write_sequential_trace(tmp_path / "other.txt", num_items=120)
    assert main(["model", "eval", str(out), "--trace", "sequences", "--path", str(other), "--no-progress"]) == 2
    assert "trained on 150 items, the trace served here has 120" in capsys.readouterr().err
