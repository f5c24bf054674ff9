"""Imitation warm start: the replay oracle's samples, behaviour cloning, and PPO with the clone loss."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from policies.actor import ActorConfig, make_initial_actor
from policies.env import EnvConfig
from node_agent.features import NUM_FEATURES
from policies.imitation import behaviour_clone, collect_oracle_data, oracle_samples
from policies.train_ppo import Args, train

TINY = dict(traces=("synthetic",), num_nodes=2, rate_rps=300.0, rate_spread=0.0, duration_s=5.0, num_users=300,
            history_scale=1.0, cache_fraction=0.5)


@pytest.fixture(scope="module")
def data():
    cfg = EnvConfig(regimes=("steady", "burst"), **TINY)
    return collect_oracle_data(cfg, 3, (0.2, 0.8), seed=1, progress=False)


def test_oracle_data_has_one_sample_per_node_and_decision(data):
    # 5 windows of 1 s: the oracle decides windows 1..4 after seeing the one before, on 2 nodes
    assert data["X"].shape == (3 * 4 * 2, NUM_FEATURES) and data["X"].dtype == np.float32
    assert np.all(np.isfinite(data["X"]))
    assert set(np.unique(data["y"]).tolist()) <= {np.float32(0.2), np.float32(0.8)}
    assert data["episode"].tolist() == sorted(data["episode"].tolist()) and int(data["episode"].max()) == 2
    for e, ep in enumerate(data["episodes"]):
        assert len(ep["schedule"]) == 5
        # both nodes of a window carry the cluster-wide choice that followed it
        ys = data["y"][data["episode"] == e].reshape(4, 2)
        assert np.allclose(ys[:, 0], ys[:, 1]) and np.allclose(ys[:, 0], ep["schedule"][1:])
    # the same seed draws the same episodes
    again = collect_oracle_data(EnvConfig(regimes=("steady", "burst"), **TINY), 1, (0.2, 0.8), seed=1,
                                progress=False)
    assert again["episodes"][0]["stream_seed"] == data["episodes"][0]["stream_seed"]


def test_oracle_samples_checks_lengths_and_clips_to_the_guards():
    with pytest.raises(ValueError, match="one more share"):
        oracle_samples([], [])
    X, y = oracle_samples([], [0.5])
    assert X.shape == (0, NUM_FEATURES) and y.shape == (0,)


def test_behaviour_cloning_fits_the_oracle(data):
    actor = make_initial_actor(0, ActorConfig(hidden_sizes=(16, 16)))
    rep = behaviour_clone(actor, data, epochs=150, lr=1e-2, holdout=0.0, seed=0)
    assert rep["samples"] == len(data["y"])
    assert rep["after"]["train_mae"] < rep["before"]["train_mae"]
    assert rep["after"]["train_mae"] <= rep["constant_heldout_mae"] if rep["constant_heldout_mae"] else True
    with torch.no_grad():
        pred = torch.sigmoid(actor.logit(torch.from_numpy(data["X"])).squeeze(-1)).numpy()
    assert float(np.mean(np.abs(pred - data["y"]))) == pytest.approx(rep["after"]["train_mae"], abs=1e-4)


def test_training_with_the_warm_start_records_it(tmp_path):
    out = tmp_path / "bc"
    args = Args(**TINY, regimes=("steady",), seed=2, out=str(out), total_steps=4, num_steps=2, update_epochs=1,
                num_minibatches=1, progress=False, eval_static_shares=(), bc_episodes=2, bc_shares=(0.2, 0.8),
                bc_epochs=20)
    summary = train(args)
    rep = json.loads((out / "imitation.json").read_text())
    assert rep["samples"] > 0 and len(rep["oracle_episodes"]) == 2
    assert summary["evaluation"]["imitation"]["samples"] == rep["samples"]
    curve = json.loads((out / "curve.json").read_text())
    assert all(r["clone_loss"] is not None for r in curve["updates"])
    with pytest.raises(ValueError, match="bc_episodes"):
        Args(**TINY, bc_episodes=-1).validate()


def test_imitation_only_clones_from_a_warm_start_without_ppo_or_evaluation(data, tmp_path):
    """``--total-steps 0 --no-eval --init-policy OLD --bc-data FILE``: the widened schema-2 policy
    cloned onto the labels, no PPO update, no evaluation episode."""
    from pathlib import Path

    from policies.actor import load_checkpoint
    from policies.imitation import save_oracle_data

    save_oracle_data(data, tmp_path / "d.npz")
    out = tmp_path / "only"
    old = Path(__file__).parent / "data" / "policy_schema2"
    summary = train(Args(**TINY, regimes=("steady",), out=str(out), total_steps=0, evaluate=False, progress=False,
                         init_policy=str(old), bc_data=(str(tmp_path / "d.npz"),), bc_epochs=30, bc_lr=1e-2))
    ev = summary["evaluation"]
    assert ev["num_updates"] == 0 and ev["num_episodes"] == 0 and ev["by_regime"] == {} and "skipped" in ev
    assert ev["warm_start"]["widened_from"]["feature_schema_version"] == 2
    assert ev["imitation"]["after"]["train_mae"] < ev["imitation"]["before"]["train_mae"]
    assert json.loads((out / "curve.json").read_text())["updates"] == []
    assert load_checkpoint(out / "actor.pt").actor.config.num_features == NUM_FEATURES
    with pytest.raises(ValueError, match="0 only with --bc-data"):
        Args(**TINY, total_steps=0).validate()


def test_oracle_data_files_round_trip_and_bad_files_are_refused(data, tmp_path):
    from policies.imitation import load_oracle_data, save_oracle_data

    save_oracle_data(data, tmp_path / "a.npz")
    save_oracle_data(data, tmp_path / "b.npz")
    both = load_oracle_data([tmp_path / "a.npz", tmp_path / "b.npz"])
    n = len(data["y"])
    assert np.array_equal(both["X"][:n], data["X"]) and np.array_equal(both["y"][n:], data["y"])
    assert int(both["episode"].max()) == 2 * (int(data["episode"].max()) + 1) - 1
    assert len(both["episodes"]) == 2 * len(data["episodes"])
    with pytest.raises(FileNotFoundError, match="no oracle data"):
        load_oracle_data([tmp_path / "missing.npz"])
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not an oracle data file"):
        load_oracle_data([tmp_path / "bad.npz"])


def test_best_static_label_uses_p99_then_device_time():
    from policies.imitation import best_static_label

    # one clear P99 winner
    assert best_static_label({0.1: 50.0, 0.5: 30.0, 0.9: 80.0}) == 0.5
    # within 5% of the best P99 the device time per request decides; a flat pair is averaged
    p99 = {0.1: 30.0, 0.5: 30.5, 0.9: 31.0, 0.3: 40.0}
    assert best_static_label(p99, {0.1: 900.0, 0.5: 800.0, 0.9: 805.0, 0.3: 100.0}) == pytest.approx(0.7)
    # no device times: the admissible shares' mean when they are neighbours on the grid ...
    assert best_static_label({0.1: 30.0, 0.5: 30.5, 0.9: 31.0, 0.3: 30.2}) == pytest.approx(0.45)
    # ... and the lowest P99 when they are not (0.3 lies between 0.1 and 0.5, 33% worse)
    assert best_static_label(p99) == 0.1
    # shares that are not neighbours on the grid are not averaged (0.5 between them is 33% worse)
    assert best_static_label({0.1: 30.0, 0.5: 40.0, 0.9: 30.5}) == 0.1
    with pytest.raises(ValueError, match="no runs"):
        best_static_label({})


def test_static_sweep_labels_every_state_of_every_run_with_the_episodes_best_split():
    from policies.imitation import busy_us_per_request, collect_static_sweep_data, main

    cfg = EnvConfig(regimes=("steady",), **TINY)
    data = collect_static_sweep_data(cfg, 2, (0.2, 0.8), seed=4, progress=False)
    # 5 windows: the simulator reports 4 of them, on 2 nodes, for each of the 2 shares, per episode
    assert data["X"].shape == (2 * 2 * 4 * 2, NUM_FEATURES) and np.all(np.isfinite(data["X"]))
    for e, ep in enumerate(data["episodes"]):
        p99 = {float(k): v for k, v in ep["p99_by_share"].items()}
        assert set(p99) == {0.2, 0.8} and ep["label"] in (0.2, 0.5, 0.8)
        assert np.all(data["y"][data["episode"] == e] == np.float32(ep["label"]))
        # states seen at both shares: the emb_share feature says which run each came from
        assert set(np.round(data["X"][data["episode"] == e, 10].astype(float), 3).tolist()) == {0.2, 0.8}
        assert all(v > 0 for v in ep["busy_us_by_share"].values())
    assert busy_us_per_request([]) == float("inf")
    with pytest.raises(ValueError, match="guard bounds"):
        collect_static_sweep_data(cfg, 1, (0.0, 0.5), seed=4, progress=False)
    with pytest.raises(SystemExit):  # the command line says so before running anything
        main(["--episodes", "1", "--out", "x.npz", "--labels", "best-static", "--shares", "0,1"])
