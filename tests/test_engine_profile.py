"""`racer node profile`: the cost profile's keys, each a positive number, read by the simulator."""

from __future__ import annotations

import json

import pytest
import torch

from node_agent.engine import LinkEmulationConfig
from node_agent.model import ModelConfig
from node_agent.profile import ProfileConfig, measure_profile, parse_lengths
from racer.cli import main
from simulator.profiles import from_node_profile

SMALL = ["--embedding-dim", "16", "--num-heads", "2", "--head-dim", "8", "--num-layers", "1", "--lengths", "16,64",
         "--repeats", "1", "--emb-batch-rows", "64", "--num-candidates", "16", "--no-progress"]

pytestmark = pytest.mark.usefixtures("one_thread")


def test_profile_keys_are_positive_numbers():
    prof = measure_profile(ProfileConfig(model=ModelConfig(embedding_dim=16, num_layers=1, qk_dim=8, v_dim=8),
                                         lengths=(8, 32), repeats=2, emb_batch_rows=32, hit_history_len=40,
                                         num_candidates=8))
    assert set(prof["kv_recompute_us_per_token"]) == {"8", "32"}
    figures = list(prof["kv_recompute_us_per_token"].values()) + [
        prof[k] for k in ("emb_transfer_us_per_row", "emb_hit_us_per_row", "kv_read_us_per_token",
                          "incremental_prefill_us_per_token", "rank_us_per_candidate")]
    assert all(isinstance(v, float) and v > 0 for v in figures)
    assert prof["link_emulated"] is True  # the CPU: auto emulates
    assert prof["emb_link_us_per_row"] == pytest.approx((10.0 + 32 * 64 / 25e3) / 32, rel=1e-3)
    assert prof["emb_transfer_us_per_row"] >= prof["emb_link_us_per_row"]
    off = measure_profile(ProfileConfig(model=ModelConfig(embedding_dim=16, num_layers=1, qk_dim=8, v_dim=8),
                                        lengths=(8,), repeats=1, emb_batch_rows=32, hit_history_len=16,
                                        num_candidates=8, link=LinkEmulationConfig(mode="off")))
    assert off["link_emulated"] is False and off["emb_link_us_per_row"] == 0.0


def test_racer_node_profile_writes_the_file_the_simulator_reads(tmp_path, capsys):
    out = tmp_path / "node_profile.json"
    assert main(["node", "profile", "--json", "--out", str(out)] + SMALL) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed
    assert set(printed["kv_recompute_us_per_token"]) == {"16", "64"}
    assert printed["emb_transfer_us_per_row"] > 0 and printed["emb_hit_us_per_row"] > 0
    assert printed["rank_us_per_candidate"] > 0 and printed["kv_read_us_per_token"] > 0
    prof = from_node_profile(out)
    assert prof.emb_transfer_us_per_row == printed["emb_transfer_us_per_row"]
    assert prof.emb_hit_us_per_row == printed["emb_hit_us_per_row"] and prof.token_us > 0


def test_profile_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_lengths("128,abc")
    with pytest.raises(ValueError, match="qk_dim"):
        ProfileConfig(model=ModelConfig(qk_dim=16, v_dim=8))
    assert main(["node", "profile", "--out", str(tmp_path / "no" / "such" / "p.json")] + SMALL) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["node", "profile", "--out", str(tmp_path / "p.json")] + SMALL + ["--lengths", "1,x"]) == 2
    assert "--lengths must be comma-separated integers" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_racer_node_profile_json_without_out_prints_only(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["node", "profile", "--json"] + SMALL) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["kv_recompute_us_per_token"]) == {"16", "64"}
    assert list(tmp_path.iterdir()) == []  # no node_profile.json in the current folder
    assert main(["node", "profile"] + SMALL) == 0  # the table, still no file
    assert "wrote" not in capsys.readouterr().out and list(tmp_path.iterdir()) == []


def test_profile_reports_every_device_byte_the_node_holds():
    """``device_memory``: the arena, the bookkeeping outside it and the model's weights, summed;
    a CPU reports no device memory of its own (null, not 0)."""
    from node_agent.model import HSTUModel

    m = ModelConfig(embedding_dim=16, num_layers=1, qk_dim=8, v_dim=8)
    prof = measure_profile(ProfileConfig(model=m, lengths=(8,), repeats=1, emb_batch_rows=32, hit_history_len=16,
                                         num_candidates=8))
    mem = prof["device_memory"]
    assert mem["device"] == "cpu"
    assert mem["arena_bytes"] > 0 and mem["metadata_bytes"] > 0 and mem["model_weights_bytes"] > 0
    model = HSTUModel(m)
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    assert mem["model_weights_bytes"] == weights
    assert mem["node_bytes"] == mem["arena_bytes"] + mem["metadata_bytes"] + mem["model_weights_bytes"]
    # the arena is whole pages; the metadata includes the catalogue-sized per-item maps
    assert mem["arena_bytes"] % (1 * 2 * 16 * 2 * 8 * 4) == 0  # layers x K/V x page_tokens x heads x head_dim x f32
    assert mem["metadata_bytes"] >= 64 * 32 * 8  # num_items (64 batches of 32) x an int64 slot map
    for k in ("device_total_bytes", "device_free_bytes", "max_memory_allocated_bytes"):
        assert k in mem and mem[k] is None
    assert mem["device_reports"].startswith("none")


def test_device_memory_budget_reads_what_cuda_reports():
    """On a CUDA arena the device's own figures are read (a stand-in for torch.cuda here)."""
    from types import SimpleNamespace

    from node_agent.memory import KVLayout, MemoryConfig, MemoryManager
    from node_agent.profile import device_memory_budget

    mm = MemoryManager(MemoryConfig(num_pages=8, num_items=100, emb_dim=4, emb_dtype="float32",
                                    kv=KVLayout(1, 1, 2, 4, "float32"), device="cpu"), torch.zeros(100, 4))
    cpu = device_memory_budget(mm, None)
    assert cpu["arena_bytes"] == 8 * mm.arena.page_bytes and cpu["model_weights_bytes"] == 0
    assert cpu["device_total_bytes"] is None
    mm.arena.device = torch.device("cuda", 0)  # pretend: only the device's own figures are asked for
    asked = []
    fake = SimpleNamespace(mem_get_info=lambda d: asked.append(d) or (3 * 2**30, 80 * 2**30),
                           max_memory_allocated=lambda d: 5 * 2**20)
    gpu = device_memory_budget(mm, None, cuda=fake)
    assert (gpu["device_total_bytes"], gpu["device_free_bytes"], gpu["max_memory_allocated_bytes"]) == (
        80 * 2**30, 3 * 2**30, 5 * 2**20)
    assert asked == [torch.device("cuda", 0)] and "mem_get_info" in gpu["device_reports"]


def test_racer_node_profile_json_reports_the_device_memory(capsys):
    assert main(["node", "profile", "--json", "--device", "cpu"] + SMALL) == 0
    mem = json.loads(capsys.readouterr().out)["device_memory"]
    assert mem["node_bytes"] == mem["arena_bytes"] + mem["metadata_bytes"] + mem["model_weights_bytes"] > 0
    assert mem["device_total_bytes"] is None and mem["max_memory_allocated_bytes"] is None
