"""Actor checkpoints, ONNX export with checker + parity, the manifest, `racer policy` subcommands."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from policies.actor import (ActorConfig, CheckpointError, load_checkpoint, make_initial_actor,
                            save_checkpoint)
from node_agent.artifact import ArtifactError, check_manifest, probe_inputs, sha256_file
from policies.cli import add_policy_parser
from policies.export import ExportError, export_actor, export_checkpoint, golden_inputs, verify_artifact
from node_agent.features import FEATURE_HIGH, FEATURE_LOW, FEATURE_NAMES, NUM_FEATURES, SCHEMA_VERSION


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "policy"
    actor = make_initial_actor(3, head_gain=1.0)
    manifest = export_actor(actor, out, training_config={"total_steps": 10}, evaluation={"mean_abs_oracle_gap": 0.5})
    return out, actor, manifest


def test_actor_maps_features_to_a_share_in_0_1():
    actor = make_initial_actor(0, head_gain=1.0)
    x = torch.from_numpy(golden_inputs(16))
    y = actor(x)
    assert y.shape == (16, 1) and ((y > 0) & (y < 1)).all()
    assert torch.equal(torch.sigmoid(actor.logit(x)), y)
    dist = actor.logit_distribution(x)
    assert dist.mean.shape == (16, 1) and torch.allclose(dist.stddev, torch.full((16, 1), math.exp(-1.0)))
    # untrained default init: mean action near 0.5
    with torch.no_grad():
        assert abs(float(make_initial_actor(0)(x).mean()) - 0.5) < 0.05
    # deterministic for a seed, different across seeds, global RNG untouched
    torch.manual_seed(7)
    before = torch.rand(1)
    torch.manual_seed(7)
    a, b = make_initial_actor(5), make_initial_actor(5)
    assert torch.rand(1) == before
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(make_initial_actor(6).head.weight, a.head.weight)


def test_actor_config_validation():
    with pytest.raises(ValueError, match="num_features"):
        ActorConfig(num_features=12)
    with pytest.raises(ValueError, match="hidden_sizes"):
        ActorConfig(hidden_sizes=(0,))
    with pytest.raises(ValueError, match="activation"):
        ActorConfig(activation="gelu")
    assert ActorConfig.from_dict(ActorConfig(hidden_sizes=(32,)).to_dict()) == ActorConfig(hidden_sizes=(32,))


def test_checkpoint_roundtrip_and_refusals(tmp_path):
    actor = make_initial_actor(1, ActorConfig(hidden_sizes=(32, 16), activation="relu"), head_gain=1.0)
    path = save_checkpoint(tmp_path / "ckpt.pt", actor, training_config={"lr": 3e-4}, evaluation={"p99_ms": 21.5})
    ck = load_checkpoint(path)
    assert ck.config == actor.config and ck.training_config == {"lr": 3e-4} and ck.evaluation == {"p99_ms": 21.5}
    x = torch.from_numpy(golden_inputs(8))
    assert torch.equal(ck.actor(x), actor(x))

    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable torch checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")
    payload = torch.load(path, weights_only=True)
    payload["feature_schema_version"] = SCHEMA_VERSION + 1
    torch.save(payload, tmp_path / "other_schema.pt")
    with pytest.raises(CheckpointError, match="feature schema"):
        load_checkpoint(tmp_path / "other_schema.pt")
    with pytest.raises(ValueError, match="JSON-able"):
        save_checkpoint(tmp_path / "bad.pt", actor, evaluation={"x": float("nan")})


def test_golden_inputs_cover_the_box_and_are_deterministic():
    g = golden_inputs(64, seed=0)
    assert g.shape == (64, NUM_FEATURES) and g.dtype == np.float32
    np.testing.assert_array_equal(g[0], FEATURE_LOW)
    np.testing.assert_array_equal(g[1], FEATURE_HIGH)
    assert ((g >= FEATURE_LOW) & (g <= FEATURE_HIGH)).all()
    np.testing.assert_array_equal(g, golden_inputs(64, seed=0))
    assert not np.array_equal(g, golden_inputs(64, seed=1))


def test_export_writes_a_checked_artifact_with_parity(artifact):
    out, actor, manifest = artifact
    assert sorted(p.name for p in out.iterdir()) == ["golden.npz", "manifest.json", "policy.onnx"]
    assert not list(out.parent.glob(".policy.staging-*"))
    model = onnx.load(out / "policy.onnx")
    onnx.checker.check_model(model, full_check=True)
    # ORT vs torch on the stored golden inputs, recomputed here
    with np.load(out / "golden.npz") as z:
        gi, go = z["inputs"], z["outputs"]
    sess = ort.InferenceSession(str(out / "policy.onnx"), providers=["CPUExecutionProvider"])
    ort_out = sess.run(None, {"features": gi})[0]
    with torch.no_grad():
        torch_out = actor(torch.from_numpy(gi)).numpy()
    np.testing.assert_array_equal(go, torch_out)
    assert np.abs(ort_out - torch_out).max() <= 1e-5
    assert manifest["parity"]["max_abs_diff"] == pytest.approx(float(np.abs(ort_out - torch_out).max()), abs=1e-7)
    # dynamic batch
    assert sess.run(None, {"features": gi[:1]})[0].shape == (1, 1)


def test_manifest_contents(artifact):
    out, actor, manifest = artifact
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest
    assert check_manifest(on_disk) == []
    assert manifest["feature_schema_version"] == SCHEMA_VERSION
    assert manifest["feature_names"] == list(FEATURE_NAMES)
    assert manifest["inputs"] == [{"name": "features", "shape": ["batch", NUM_FEATURES], "dtype": "float32"}]
    assert manifest["outputs"] == [{"name": "emb_share", "shape": ["batch", 1], "dtype": "float32"}]
    assert manifest["onnx_sha256"] == sha256_file(out / "policy.onnx")
    assert manifest["golden_sha256"] == sha256_file(out / "golden.npz")
    assert manifest["policy_id"] == manifest["onnx_sha256"][:12]
    assert manifest["num_golden"] == 64 and manifest["parity"]["passed"] is True
    assert manifest["parity"]["tolerance"] == 1e-5
    assert manifest["training_config"] == {"total_steps": 10}
    assert manifest["evaluation"] == {"mean_abs_oracle_gap": 0.5}
    assert manifest["actor_config"] == actor.config.to_dict()
    assert manifest["action"]["kind"] == "absolute" and manifest["action"]["range"] == [0.0, 1.0]


def test_export_is_reproducible(tmp_path):
    a = export_actor(make_initial_actor(9, head_gain=1.0), tmp_path / "a")
    b = export_actor(make_initial_actor(9, head_gain=1.0), tmp_path / "b")
    assert a["onnx_sha256"] == b["onnx_sha256"] and a["golden_sha256"] == b["golden_sha256"]


def test_export_refuses_a_nan_actor_and_leaves_nothing(tmp_path):
    actor = make_initial_actor(0, head_gain=1.0)
    with torch.no_grad():
        actor.head.bias.fill_(float("nan"))
    with pytest.raises(ExportError, match="non-finite"):
        export_actor(actor, tmp_path / "nan")
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_to_overwrite_unless_asked(tmp_path, artifact):
    out = tmp_path / "p"
    first = export_actor(make_initial_actor(1, head_gain=1.0), out)
    with pytest.raises(FileExistsError):
        export_actor(make_initial_actor(2, head_gain=1.0), out)
    assert verify_artifact(out)["policy_id"] == first["policy_id"]
    second = export_actor(make_initial_actor(2, head_gain=1.0), out, overwrite=True)
    assert second["policy_id"] != first["policy_id"]
    assert verify_artifact(out)["policy_id"] == second["policy_id"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]


def test_verify_artifact_catches_tampering(tmp_path, artifact):
    import shutil

    src = artifact[0]
    # flipped byte in the ONNX file
    bad = tmp_path / "flip"
    shutil.copytree(src, bad)
    data = bytearray((bad / "policy.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "policy.onnx").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256"):
        verify_artifact(bad)
    # golden outputs edited (and the manifest's sha updated to match): parity fails
    edited = tmp_path / "golden"
    shutil.copytree(src, edited)
    with np.load(edited / "golden.npz") as z:
        gi, go = z["inputs"], z["outputs"]
    with open(edited / "golden.npz", "wb") as f:
        np.savez(f, inputs=gi, outputs=go + np.float32(1e-3))
    m = json.loads((edited / "manifest.json").read_text())
    m["golden_sha256"] = sha256_file(edited / "golden.npz")
    (edited / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="differs from the golden outputs"):
        verify_artifact(edited)
    # a manifest that claims parity failed is never accepted
    m["parity"]["passed"] = False
    assert any("parity did not pass" in p for p in check_manifest(m))


def test_probe_inputs_span_the_box():
    p = probe_inputs()
    np.testing.assert_array_equal(p[0], FEATURE_LOW)
    np.testing.assert_array_equal(p[1], FEATURE_HIGH)
    assert ((p >= FEATURE_LOW) & (p <= FEATURE_HIGH)).all()


def _parser():
    ap = argparse.ArgumentParser(prog="racer")
    sub = ap.add_subparsers(dest="command", required=True)
    add_policy_parser(sub)
    return ap


def test_cli_export_and_verify(tmp_path, capsys):
    ckpt = save_checkpoint(tmp_path / "ckpt.pt", make_initial_actor(4, head_gain=1.0),
                           training_config={"seed": 4}, evaluation={"slo_attainment": 0.99})
    out = tmp_path / "artifact"
    args = _parser().parse_args(["policy", "export", "--checkpoint", str(ckpt), "--out", str(out),
                                 "--num-golden", "32", "--json"])
    assert args.func(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_golden"] == 32 and summary["parity_max_abs_diff"] <= 1e-5
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["training_config"] == {"seed": 4} and manifest["evaluation"] == {"slo_attainment": 0.99}
    assert manifest["source"] == str(ckpt)
    assert manifest == export_checkpoint(ckpt, tmp_path / "again", num_golden=32) | {"source": str(ckpt)}

    args = _parser().parse_args(["policy", "verify", str(out), "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["accepted"] is True

    # errors racer's main prints as one line (ValueError / FileNotFoundError)
    args = _parser().parse_args(["policy", "export", "--checkpoint", str(ckpt), "--out", str(out)])
    with pytest.raises(ValueError, match="already exists"):
        args.func(args)
    args = _parser().parse_args(["policy", "export", "--checkpoint", str(tmp_path / "nope.pt"), "--out",
                                 str(tmp_path / "x")])
    with pytest.raises(FileNotFoundError):
        args.func(args)
    with pytest.raises(SystemExit):
        _parser().parse_args(["policy", "export", "--checkpoint", str(ckpt), "--out", "x", "--tolerance", "0"])


def test_a_schema2_policy_widens_to_schema3_exactly(tmp_path, capsys):
    """`racer policy widen` (and `--init-policy`) take a schema-2 artifact (16 features, schema 3's
    first 16) to schema 3: zero weights on the six new features, the same shares whatever they hold."""
    from policies.cli import cmd_policy_widen
    from policies.train_ppo import load_policy_weights

    old = Path(__file__).parent / "data" / "policy_schema2"
    actor = make_initial_actor(9)
    loaded = load_policy_weights(actor, old)
    assert loaded["widened_from"] == {"feature_schema_version": 2, "num_features": 16}
    assert loaded["golden_max_abs_diff"] <= 1e-6
    assert float(actor.body[0].weight.detach()[:, 16:].abs().max()) == 0.0
    out = tmp_path / "w"
    assert cmd_policy_widen(argparse.Namespace(src=str(old), out=str(out), force=False, json=True)) == 0
    summary = json.loads(capsys.readouterr().out)
    manifest = verify_artifact(out)
    assert manifest["feature_schema_version"] == SCHEMA_VERSION == 3 and summary["widened_from"] == loaded["policy_id"]
    assert manifest["training_config"]["widened_from"]["policy_id"] == loaded["policy_id"]
    g = golden_inputs(16, seed=3)
    new = ort.InferenceSession(str(out / "policy.onnx"), providers=["CPUExecutionProvider"])
    was = ort.InferenceSession(str(old / "policy.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(new.run(None, {"features": g})[0], was.run(None, {"features": g[:, :16]})[0], atol=1e-6)
    # an artifact already of this schema has nothing to widen; a schema-1 one is not a prefix
    with pytest.raises(ValueError, match="nothing to widen"):
        cmd_policy_widen(argparse.Namespace(src=str(out), out=str(tmp_path / "again"), force=False, json=True))
    with pytest.raises(ValueError, match="feature schema version 1"):
        load_policy_weights(make_initial_actor(9), Path(__file__).parent / "data" / "policy_schema1")


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(format="other"), "format is 'other'"),
    (lambda m: m.pop("golden_file"), "lacks 'golden_file'"),
    (lambda m: m.update(onnx_file="../policy.onnx"), "plain file name"),
    (lambda m: m["actor_config"].update(hidden_sizes=5), "hidden_sizes"),
    (lambda m: m["feature_names"].reverse(), "differ from schema 2's"),
])
def test_a_bad_schema2_artifact_is_refused_with_a_reason_not_widened(tmp_path, edit, words):
    import shutil

    from policies.train_ppo import load_policy_weights

    bad = tmp_path / "bad"
    shutil.copytree(Path(__file__).parent / "data" / "policy_schema2", bad)
    m = json.loads((bad / "manifest.json").read_text())
    edit(m)
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=words.replace("(", r"\(").replace("'", "'")):
        load_policy_weights(make_initial_actor(9), bad)
