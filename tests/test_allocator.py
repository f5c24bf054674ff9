"""SmartAllocator runtime: loading and refusing policies, base decisions, guards, override, records."""

from __future__ import annotations

import io
import json
import math
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from node_agent.allocator import (DECISION_SOURCES, AllocatorConfig, GuardConfig, OnnxPolicy, PolicyLoadError,
                                  RecoveryConfig, ResidualConfig, SmartAllocator)
from policies.actor import make_initial_actor
from node_agent.artifact import sha256_file
from policies.export import export_actor, golden_inputs
from node_agent.features import NUM_FEATURES, SCHEMA_VERSION, WindowStats, build_features

# ----------------------------------------------------------------------------------------- helpers (shared)


def window(**kw) -> WindowStats:
    """A plain steady interval; keyword arguments override fields."""
    base = dict(interval_s=1.0, num_requests=1000, arrival_rate_rps=1000.0, hot_user_ratio=0.02,
                history_len_p50=80.0, history_len_p99=400.0, emb_lookups_per_request=120.0, emb_hit_rate=0.8,
                kv_hit_rate=0.6, kv_recompute_us_per_token=0.5, emb_transfer_us_per_row=2.0, emb_share=0.6,
                load=0.3, p99_ms=20.0, slo_ms=30.0, refill_bytes=0.0, arena_bytes=8e9)
    base.update(kw)
    return WindowStats(**base)


def constant_policy(out_dir: Path, share: float) -> Path:
    """Export a real actor whose head ignores the features: it always proposes ``share``."""
    actor = make_initial_actor(0)
    with torch.no_grad():
        actor.head.weight.zero_()
        actor.head.bias.fill_(math.log(share / (1 - share)))
    export_actor(actor, out_dir)
    return out_dir


def replace_onnx(artifact: Path, dest: Path, model_bytes: bytes, fix_sha: bool = True) -> Path:
    """A copy of ``artifact`` with another ONNX file (manifest sha256 updated unless told not to)."""
    shutil.copytree(artifact, dest)
    (dest / "policy.onnx").write_bytes(model_bytes)
    if fix_sha:
        m = json.loads((dest / "manifest.json").read_text())
        m["onnx_sha256"] = sha256_file(dest / "policy.onnx")
        (dest / "manifest.json").write_text(json.dumps(m))
    return dest


def nan_model_bytes() -> bytes:
    """A valid graph of the right shape, of a policy's operators, whose output is NaN for every
    input: ((x - x) / (x - x)) @ ones."""
    x = helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", NUM_FEATURES])
    y = helper.make_tensor_value_info("emb_share", TensorProto.FLOAT, ["batch", 1])
    ones = helper.make_tensor("ones", TensorProto.FLOAT, [NUM_FEATURES, 1], [1.0] * NUM_FEATURES)
    nodes = [helper.make_node("Sub", ["features", "features"], ["d"]),
             helper.make_node("Div", ["d", "d"], ["n"]),
             helper.make_node("Gemm", ["n", "ones"], ["emb_share"])]
    graph = helper.make_graph(nodes, "nan_policy", [x], [y], initializer=[ones])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


def narrow_model_bytes(num_inputs: int = 12) -> bytes:
    """A well-formed policy for the wrong feature width."""
    net = torch.nn.Sequential(torch.nn.Linear(num_inputs, 1), torch.nn.Sigmoid())
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(net, (torch.zeros(1, num_inputs),), buf, dynamo=False, opset_version=17,
                          input_names=["features"], output_names=["emb_share"],
                          dynamic_axes={"features": {0: "batch"}, "emb_share": {0: "batch"}})
    return buf.getvalue()


CPU = AllocatorConfig(device="cpu")


def no_layers(**guard) -> AllocatorConfig:
    """Base + guards only (residual and recovery off), for exact guard arithmetic."""
    return AllocatorConfig(guard=GuardConfig(**guard), residual=ResidualConfig(enabled=False),
                           recovery=RecoveryConfig(enabled=False), device="cpu")


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    real = root / "real"
    export_actor(make_initial_actor(11, head_gain=1.0), real)
    return {"real": real, "root": root,
            "c60": constant_policy(root / "c60", 0.6), "c99": constant_policy(root / "c99", 0.99),
            "c01": constant_policy(root / "c01", 0.01), "c30": constant_policy(root / "c30", 0.3)}


# ----------------------------------------------------------------------------------------- loading


def test_loads_on_cpu_with_one_thread_and_bound_io(policies):
    p = OnnxPolicy(policies["real"], device="auto")
    assert p.providers == ["CPUExecutionProvider"] or torch.cuda.is_available()
    assert OnnxPolicy(policies["real"], device="cpu").providers == ["CPUExecutionProvider"]
    assert p.input.shape == (1, NUM_FEATURES) and p.input.dtype == np.float32
    assert p.golden_max_abs_diff <= p.golden_tolerance
    # the bound path agrees with torch on real feature vectors
    actor = make_initial_actor(11, head_gain=1.0)
    for row in golden_inputs(8, seed=5):
        p.input_row[:] = row
        got = p.run()
        with torch.no_grad():
            want = float(actor(torch.from_numpy(row[None]))[0, 0])
        assert abs(got - want) <= 1e-5


def test_base_decision_is_the_policy_output_on_the_built_features(policies):
    alloc = SmartAllocator(no_layers(max_step_up=1.0, max_step_down=1.0), policy_dir=policies["real"])
    actor = make_initial_actor(11, head_gain=1.0)
    prev = None
    for t, s in enumerate([window(), window(arrival_rate_rps=1500.0, hot_user_ratio=0.05), window(p99_ms=40.0)]):
        d = alloc.decide(s, float(t))
        f = build_features(s, prev)
        np.testing.assert_array_equal(d.features, f)
        with torch.no_grad():
            want = float(actor(torch.from_numpy(f[None]))[0, 0])
        assert d.source == "base" and abs(d.emb_share - want) <= 1e-5 and d.base_emb_share == d.emb_share
        assert d.policy_id == alloc.policy.policy_id and d.residual == 0.0
        prev = s


@pytest.mark.cuda
def test_cuda_provider_when_torch_sees_a_gpu(policies):
    p = OnnxPolicy(policies["real"], device="auto")
    assert p.providers[0] == "CUDAExecutionProvider"
    assert p.golden_max_abs_diff <= p.golden_tolerance


# ----------------------------------------------------------------------------------------- refusals


def _assert_refused_and_previous_runs(alloc: SmartAllocator, bad: Path, words: str):
    before = alloc.policy.policy_id
    d0 = alloc.decide(window(), 100.0 + alloc._seq)
    with pytest.raises(PolicyLoadError) as e:
        alloc.load_policy(bad)
    assert words in str(e.value) and str(bad) in str(e.value)
    assert alloc.policy.policy_id == before
    assert alloc.last_load_error == str(e.value)
    assert alloc.state()["last_load_error"] == str(e.value)
    d1 = alloc.decide(window(), 101.0 + alloc._seq)
    assert d1.source == "base" and d1.policy_id == before and d1.emb_share == pytest.approx(d0.emb_share, abs=1e-7)


def test_refuses_a_corrupt_onnx_file(policies, tmp_path):
    alloc = SmartAllocator(no_layers(), policy_dir=policies["c60"])
    data = (policies["real"] / "policy.onnx").read_bytes()
    garbage = data[: len(data) // 3] + b"\x00garbage\xff" * 7
    # the manifest's sha256 catches it first ...
    _assert_refused_and_previous_runs(alloc, replace_onnx(policies["real"], tmp_path / "a", garbage, fix_sha=False),
                                      "does not match the manifest")
    # ... and with the sha "fixed", onnx itself refuses the bytes
    _assert_refused_and_previous_runs(alloc, replace_onnx(policies["real"], tmp_path / "b", garbage),
                                      "corrupt ONNX file")


def test_refuses_a_wrong_input_shape(policies, tmp_path):
    alloc = SmartAllocator(no_layers(), policy_dir=policies["c60"])
    bad = replace_onnx(policies["real"], tmp_path / "narrow", narrow_model_bytes(12))
    _assert_refused_and_previous_runs(alloc, bad, "wrong input")
    with pytest.raises(PolicyLoadError, match=rf"shape \[batch, {NUM_FEATURES}\]"):
        alloc.load_policy(bad)


def test_refuses_a_wrong_feature_schema_version(policies, tmp_path):
    alloc = SmartAllocator(no_layers(), policy_dir=policies["c60"])
    bad = tmp_path / "schema"
    shutil.copytree(policies["real"], bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["feature_schema_version"] = SCHEMA_VERSION + 1
    (bad / "manifest.json").write_text(json.dumps(m))
    _assert_refused_and_previous_runs(alloc, bad, f"feature schema version {SCHEMA_VERSION + 1} does not match")


def test_refuses_a_policy_that_outputs_nan(policies, tmp_path):
    alloc = SmartAllocator(no_layers(), policy_dir=policies["c60"])
    bad = replace_onnx(policies["real"], tmp_path / "nan", nan_model_bytes())
    _assert_refused_and_previous_runs(alloc, bad, "non-finite")


def test_refuses_other_broken_artifacts(policies, tmp_path):
    alloc = SmartAllocator(no_layers(), policy_dir=policies["c60"])
    _assert_refused_and_previous_runs(alloc, tmp_path / "does-not-exist", "not a policy artifact directory")
    no_manifest = tmp_path / "nomanifest"
    shutil.copytree(policies["real"], no_manifest)
    (no_manifest / "manifest.json").unlink()
    _assert_refused_and_previous_runs(alloc, no_manifest, "missing")
    broken_json = tmp_path / "brokenjson"
    shutil.copytree(policies["real"], broken_json)
    (broken_json / "manifest.json").write_text("{not json")
    _assert_refused_and_previous_runs(alloc, broken_json, "unreadable manifest")


def test_constructor_refuses_too():
    with pytest.raises(PolicyLoadError):
        SmartAllocator(CPU, policy_dir="/nonexistent/policy")


def test_hot_swap_to_a_good_policy(policies):
    alloc = SmartAllocator(no_layers(max_step_up=1.0, max_step_down=1.0), policy_dir=policies["c60"])
    assert alloc.decide(window(), 0.0).emb_share == pytest.approx(0.6, abs=1e-6)
    swap = alloc.load_policy(policies["c30"], now_s=1.0)
    assert swap.previous_policy_id != swap.policy_id == alloc.policy.policy_id
    d = alloc.decide(window(), 1.0)
    assert d.emb_share == pytest.approx(0.3, abs=1e-6) and d.policy_id == swap.policy_id


# ----------------------------------------------------------------------------------------- guards


def test_clamps_to_the_bounds(policies):
    hi = SmartAllocator(no_layers(min_emb_share=0.1, max_emb_share=0.9, max_step_up=1.0, max_step_down=1.0),
                        policy_dir=policies["c99"])
    d = hi.decide(window(), 0.0)
    assert d.emb_share == 0.9 and d.source == "guard" and "clamped to max_emb_share 0.9" in d.reason
    assert d.proposed_emb_share == pytest.approx(0.99, abs=1e-6) and "base" in d.reason
    lo = SmartAllocator(no_layers(min_emb_share=0.1, max_emb_share=0.9, max_step_up=1.0, max_step_down=1.0),
                        policy_dir=policies["c01"])
    d = lo.decide(window(), 0.0)
    assert d.emb_share == 0.1 and d.source == "guard" and "clamped to min_emb_share 0.1" in d.reason


def test_max_step_per_decision_up_and_down(policies):
    alloc = SmartAllocator(no_layers(max_step_up=0.05, max_step_down=0.1), policy_dir=policies["c99"])
    shares = [alloc.decide(window(emb_share=0.5), float(t)) for t in range(3)]
    assert [round(d.emb_share, 6) for d in shares] == [0.55, 0.6, 0.65]
    assert all(d.source == "guard" and "step limited to +0.05" in d.reason for d in shares)
    assert shares[1].prev_emb_share == pytest.approx(0.55)
    down = SmartAllocator(no_layers(max_step_up=0.05, max_step_down=0.1), policy_dir=policies["c01"])
    got = [round(down.decide(window(emb_share=0.5), float(t)).emb_share, 6) for t in range(5)]
    assert got == [0.4, 0.3, 0.2, 0.1, 0.05]  # the last step is cut by the bound (min 0.05)
    # bounds win over the step limit when the split starts outside them
    out = SmartAllocator(no_layers(min_emb_share=0.2, max_step_up=0.05), policy_dir=policies["c60"])
    d = out.decide(window(emb_share=0.0), 0.0)
    assert d.emb_share == 0.2 and "clamped to min_emb_share" in d.reason


def test_override_takes_precedence_and_expires(policies):
    alloc = SmartAllocator(no_layers(max_step_up=0.05, max_step_down=0.1), policy_dir=policies["c60"])
    assert alloc.decide(window(), 0.0).emb_share == pytest.approx(0.6, abs=1e-6)
    alloc.set_override(0.3, now_s=1.0, expires_at_s=4.0, reason="ticket 42")
    ds = [alloc.decide(window(), float(t)) for t in (1, 2, 3)]
    assert all(d.source == "override" and d.emb_share == 0.3 and d.override_active for d in ds)
    assert "operator override 0.3000 (ticket 42) until t=4s" in ds[0].reason  # no step limit for the operator
    d = alloc.decide(window(), 4.0)  # expired: back to the base, step-limited from 0.3
    assert d.source == "guard" and d.emb_share == pytest.approx(0.35) and "override 0.3000 expired at t=4s" in d.reason
    assert alloc.override is None and not d.override_active
    # no expiry: until cleared
    alloc.set_override(0.5, now_s=5.0)
    assert all(alloc.decide(window(), float(t)).source == "override" for t in (5, 6, 7))
    assert alloc.clear_override().emb_share == 0.5
    assert alloc.decide(window(), 8.0).source in ("base", "guard")
    with pytest.raises(ValueError, match="guard bounds"):
        alloc.set_override(0.99, now_s=9.0)
    with pytest.raises(ValueError, match="after now_s"):
        alloc.set_override(0.5, now_s=9.0, expires_at_s=9.0)


def test_override_beats_recovery_and_invalid_stats(policies):
    cfg = AllocatorConfig(recovery=RecoveryConfig(warmup_s=0.0), residual=ResidualConfig(enabled=False), device="cpu")
    alloc = SmartAllocator(cfg, policy_dir=policies["c60"])
    alloc.decide(window(), 0.0)
    alloc.set_override(0.7, now_s=1.0, expires_at_s=10.0)
    d = alloc.decide(window(arrival_rate_rps=5000.0, hot_user_ratio=0.2), 1.0)
    assert alloc.recovery.active and d.recovery_active
    assert d.source == "override" and d.emb_share == 0.7 and "via recovery" in d.reason
    d = alloc.decide(window(p99_ms=float("nan")), 2.0)
    assert d.source == "override" and d.emb_share == 0.7 and "p99_ms must be finite" in d.reason


def test_holds_on_invalid_stats_and_without_a_policy(policies):
    alloc = SmartAllocator(no_layers(), policy_dir=policies["c60"])
    first = alloc.decide(window(), 0.0)
    d = alloc.decide(window(hot_user_ratio=float("nan")), 1.0)
    assert d.source == "guard" and d.emb_share == first.emb_share
    assert "holding: invalid WindowStats: hot_user_ratio must be finite" in d.reason and math.isnan(d.base_emb_share)
    bare = SmartAllocator(no_layers())
    d = bare.decide(window(emb_share=0.42), 0.0)
    assert d.source == "guard" and d.emb_share == 0.42 and "no base policy loaded" in d.reason and d.policy_id is None
    with pytest.raises(ValueError, match="backwards"):
        bare.decide(window(), -1.0)


def test_decision_record_is_complete_and_json_able(policies):
    alloc = SmartAllocator(CPU, policy_dir=policies["real"])
    d = alloc.decide(window(), 0.0)
    rec = d.to_dict()
    json.dumps(rec, allow_nan=False)
    assert set(rec) == {"seq", "now_s", "emb_share", "source", "reason", "prev_emb_share", "proposed_emb_share",
                        "base_emb_share", "residual", "recovery_active", "override_active", "policy_id", "features",
                        "layer_source", "guard_action", "hold_reason", "recovery_phase", "recovery_event",
                        "recovery_cap", "override_reason", "notes", "tuner_offset", "tuner_step", "tuner_gradient",
                        "tuner_action", "layers"}
    assert [t["layer"] for t in rec["layers"]] == ["base", "residual", "recovery", "guard"]
    assert rec["layers"][-1]["proposal"] == rec["emb_share"] and rec["layers"][0]["proposal"] == rec["base_emb_share"]
    assert rec["tuner_action"] in (None, "emb_ward", "kv_ward", "deadband", "bound", "no_evidence")
    assert rec["layer_source"] in DECISION_SOURCES and rec["recovery_phase"] in ("warmup", "normal", "burst")
    assert rec["hold_reason"] is None and rec["override_reason"] is None
    assert rec["guard_action"] in (None, "step_up", "step_down", "max", "min")
    assert (rec["guard_action"] is None) == (rec["source"] != "guard")
    assert list(rec["features"]) == list(alloc.policy.manifest["feature_names"])
    assert d.source in DECISION_SOURCES and d.reason
    state = alloc.state()
    json.dumps(state, allow_nan=False)
    assert state["num_decisions"][d.source] == 1 and state["policy"]["providers"] == ["CPUExecutionProvider"]
    # the record keeps its own copy of the features
    alloc.decide(window(load=0.9), 1.0)
    assert rec["features"]["load"] == pytest.approx(0.3)


def test_structured_reasons_of_a_hold_an_override_and_a_guard(policies):
    alloc = SmartAllocator(CPU)  # no policy: the allocator holds
    d = alloc.decide(window(), 0.0)
    assert (d.source, d.layer_source, d.hold_reason, d.guard_action) == ("guard", "guard", "no base policy loaded",
                                                                        None)
    alloc.set_override(0.9, now_s=1.0, expires_at_s=5.0, reason="drill")
    d = alloc.decide(window(), 1.0)
    assert (d.source, d.layer_source, d.override_reason, d.emb_share) == ("override", "override", "drill", 0.9)
    d = alloc.decide(window(), 6.0)
    assert d.notes and "expired" in d.notes[0] and d.override_reason is None
    alloc = SmartAllocator(AllocatorConfig(guard=GuardConfig(max_step_up=0.01, max_emb_share=0.505), device="cpu",
                                           residual=ResidualConfig(enabled=False)), policy_dir=policies["c99"])
    d = alloc.decide(window(emb_share=0.49), 0.0)  # base 0.99: the step limit, 0.50
    assert (d.source, d.layer_source, d.guard_action) == ("guard", "base", "step_up")
    assert d.emb_share == pytest.approx(0.50) and d.proposed_emb_share == pytest.approx(0.99, abs=1e-3)
    d = alloc.decide(window(emb_share=0.50), 1.0)  # step to 0.51, then the bound 0.505
    assert (d.guard_action, d.emb_share) == ("max", 0.505)


def test_configs_are_validated():
    with pytest.raises(ValueError, match="min_emb_share < max_emb_share"):
        GuardConfig(min_emb_share=0.8, max_emb_share=0.2)
    with pytest.raises(ValueError, match="max_correction must be in"):
        ResidualConfig(max_correction=0.2)
    with pytest.raises(ValueError, match="exit_rate_ratio < enter_rate_ratio"):
        RecoveryConfig(enter_rate_ratio=1.2, exit_rate_ratio=1.3)
    with pytest.raises(ValueError, match="device"):
        AllocatorConfig(device="tpu")
    with pytest.raises(ValueError, match="max_step_up"):
        GuardConfig(max_step_up=0.0)
    assert replace(AllocatorConfig(), device="cpu").device == "cpu"


def test_docs_match_the_code():
    import dataclasses
    import re

    from node_agent.features import FEATURE_SPECS

    doc = (Path(__file__).resolve().parent.parent / "docs" / "allocator.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| (.+?) \| \[(-?[\d.]+), (-?[\d.]+)\] \|$", doc, flags=re.M)
    assert [(int(i), n) for i, n, *_ in rows] == list(enumerate(s.name for s in FEATURE_SPECS))
    for (_, _, _, lo, hi), spec in zip(rows, FEATURE_SPECS):
        assert (float(lo), float(hi)) == (spec.low, spec.high)
    for cls in (GuardConfig, ResidualConfig, RecoveryConfig):
        for f in dataclasses.fields(cls):
            m = re.search(rf"^\| `{f.name}` \| ([^|]+) \|", doc, flags=re.M)
            assert m, f"{cls.__name__}.{f.name} missing from docs/allocator.md"
            assert m.group(1).strip() == str(f.default), (cls.__name__, f.name)
