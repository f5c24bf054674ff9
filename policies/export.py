"""Export an actor to a policy artifact: ONNX, onnx.checker, ORT-vs-torch parity, manifest.

    export_checkpoint(checkpoint_path, out_dir)   # what `racer policy export` runs
    export_actor(actor, out_dir, training_config=..., evaluation=...)
    verify_artifact(out_dir)                      # re-check an artifact offline

Acceptance. The artifact is assembled in a staging directory beside ``out_dir`` and moved into
place only after every check passed, so a failed export leaves no artifact behind (and an
existing one untouched unless ``overwrite``):

1. ``torch.onnx.export(..., dynamo=False)`` of the actor's mean action (opset 17, dynamic batch);
2. ``onnx.checker.check_model(full_check=True)``;
3. torch's outputs on the golden inputs are finite and in [0, 1];
4. onnxruntime (CPUExecutionProvider) reproduces them within ``tolerance`` (default 1e-5);
5. the probe inputs (`node_agent.artifact.probe_inputs`) give finite outputs in [0, 1];
6. the written directory passes `verify_artifact` (manifest schema, sha256 of both files, parity
   again from the files on disk).

Golden inputs (`golden_inputs`): feature vectors built by `build_features` from random but
plausible `WindowStats` pairs (so they lie where real inputs lie), plus the feature box's corners
(all-low, all-high, midpoint).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np

from .actor import Actor, _json_dict, load_checkpoint
from node_agent.artifact import (ACTION, GOLDEN_FILE, INPUT_NAME, MANIFEST_FILE, MANIFEST_FORMAT, MANIFEST_VERSION, ONNX_FILE,
                       OUTPUT_NAME, PARITY_TOLERANCE, ArtifactError, check_outputs, io_spec, probe_inputs,
                       read_golden, read_manifest, read_onnx_bytes, sha256_file)
from node_agent.features import (FEATURE_HIGH, FEATURE_LOW, FEATURE_NAMES, NUM_FEATURES, SCHEMA_VERSION, WindowStats,
                       build_features)

OPSET = 17


class ExportError(ValueError):
    """The actor could not be turned into an accepted artifact; nothing was written at out_dir."""


def random_window_stats(rng: np.random.Generator) -> WindowStats:
    """A plausible interval: rates 10..50k rps, histories 10..20k tokens, costs 0.01..20 us, tables
    0.1 GB..5 TB, ghost lists off on a fifth of the draws."""
    p50 = float(np.exp(rng.uniform(np.log(10), np.log(8_000))))
    interval_s = float(rng.choice([0.5, 1.0, 2.0]))
    rate = float(np.exp(rng.uniform(np.log(10), np.log(50_000))))
    return WindowStats(
        interval_s=interval_s,
        num_requests=int(rate * interval_s),
        arrival_rate_rps=rate,
        hot_user_ratio=float(rng.beta(1.2, 12)),
        history_len_p50=p50,
        history_len_p99=p50 * float(rng.uniform(1.0, 8.0)),
        emb_lookups_per_request=float(np.exp(rng.uniform(np.log(5), np.log(5_000)))),
        emb_hit_rate=float(rng.uniform(0, 1)),
        kv_hit_rate=float(rng.uniform(0, 1)),
        kv_recompute_us_per_token=float(np.exp(rng.uniform(np.log(0.01), np.log(20)))),
        emb_transfer_us_per_row=float(np.exp(rng.uniform(np.log(0.01), np.log(20)))),
        emb_share=float(rng.uniform(0, 1)),
        load=float(rng.uniform(0, 1)),
        p99_ms=float(rng.uniform(0, 120)),
        slo_ms=float(rng.choice([20.0, 30.0, 50.0])),
        refill_bytes=float(rng.uniform(0, 2e9)) * float(rng.random() < 0.5),
        arena_bytes=float(rng.choice([8e9, 40e9, 80e9])),
        emb_marginal_us=float(np.exp(rng.uniform(np.log(0.1), np.log(1e4)))) * float(rng.random() < 0.8),
        kv_marginal_us=float(np.exp(rng.uniform(np.log(0.1), np.log(1e4)))) * float(rng.random() < 0.8),
        table_bytes=float(np.exp(rng.uniform(np.log(1e8), np.log(5e12)))),
        kv_bytes_per_token=float(rng.choice([0.0, 8.0 * 1024, 96.0 * 1024])),
    )


def golden_inputs(num: int = 64, seed: int = 0) -> np.ndarray:
    """``num`` golden feature vectors (float32 [num, NUM_FEATURES]); deterministic for ``seed``."""
    if num < 3:
        raise ValueError(f"num must be >= 3 (the box corners come first), got {num}")
    rng = np.random.default_rng(seed)
    rows = [FEATURE_LOW, FEATURE_HIGH, (FEATURE_LOW + FEATURE_HIGH) / 2]
    while len(rows) < num:
        prev, cur = random_window_stats(rng), random_window_stats(rng)
        rows.append(build_features(cur, prev))
    return np.stack(rows).astype(np.float32)


def _torch_outputs(actor: Actor, inputs: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return actor(torch.from_numpy(inputs)).numpy().astype(np.float32)


def _ort_cpu_outputs(onnx_bytes: bytes, inputs: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    try:
        sess = ort.InferenceSession(onnx_bytes, so, providers=["CPUExecutionProvider"])
        return sess.run([OUTPUT_NAME], {INPUT_NAME: inputs})[0]
    except Exception as e:  # onnxruntime raises its own exception types (Fail, InvalidArgument, ...)
        raise ArtifactError(f"onnxruntime cannot run the model: {type(e).__name__}: {e}") from None


def _onnx_bytes(actor: Actor) -> bytes:
    import torch

    buf = io.BytesIO()
    dummy = torch.zeros(1, NUM_FEATURES, dtype=torch.float32)
    with warnings.catch_warnings():  # the TorchScript exporter is deprecated (TOOLCHAIN.md: fast, needs only onnx)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(actor, (dummy,), buf, dynamo=False, opset_version=OPSET, input_names=[INPUT_NAME],
                          output_names=[OUTPUT_NAME],
                          dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                          do_constant_folding=True)
    return buf.getvalue()


def _check_onnx(onnx_bytes: bytes) -> None:
    import onnx

    try:
        model = onnx.load_from_string(onnx_bytes)
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:  # onnx raises DecodeError, ValidationError, ...
        raise ArtifactError(f"onnx.checker refused the model: {type(e).__name__}: {e}") from None


def export_actor(actor: Actor, out_dir: str | Path, *, training_config: dict | None = None,
                 evaluation: dict | None = None, num_golden: int = 64, seed: int = 0,
                 tolerance: float = PARITY_TOLERANCE, overwrite: bool = False, source: str | None = None) -> dict:
    """Export ``actor`` to the artifact directory ``out_dir`` and return its manifest.

    Raises `ExportError` (nothing written at ``out_dir``) when any acceptance check fails, and
    FileExistsError when ``out_dir`` exists and ``overwrite`` is False.
    """
    import onnx
    import onnxruntime as ort
    import torch

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir}: already exists (pass overwrite=True / --force to replace it)")
    if not (0 < tolerance <= 1e-3):
        raise ValueError(f"tolerance must be in (0, 1e-3], got {tolerance}")
    if actor.config.feature_schema_version != SCHEMA_VERSION:
        raise ExportError(f"actor is for feature schema {actor.config.feature_schema_version}, not {SCHEMA_VERSION}")
    actor = actor.eval()
    inputs = golden_inputs(num_golden, seed)
    try:
        torch_out = _torch_outputs(actor, inputs)
        check_outputs(torch_out, "golden (torch)")
        onnx_bytes = _onnx_bytes(actor)
        _check_onnx(onnx_bytes)
        ort_out = _ort_cpu_outputs(onnx_bytes, inputs)
        check_outputs(ort_out, "golden (onnxruntime)")
        max_abs_diff = float(np.max(np.abs(ort_out.astype(np.float64) - torch_out.astype(np.float64))))
        if not max_abs_diff <= tolerance:
            raise ArtifactError(f"onnxruntime differs from torch by {max_abs_diff:.3g} > tolerance {tolerance:g} "
                                "on the golden inputs")
        check_outputs(_ort_cpu_outputs(onnx_bytes, probe_inputs()), "probe")
    except ArtifactError as e:
        raise ExportError(f"export refused: {e}") from None

    inputs_spec, outputs_spec = io_spec()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    try:
        (staging / ONNX_FILE).write_bytes(onnx_bytes)
        with open(staging / GOLDEN_FILE, "wb") as f:
            np.savez(f, inputs=inputs, outputs=torch_out)
        onnx_sha = sha256_file(staging / ONNX_FILE)
        manifest = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_VERSION,
            "policy_id": onnx_sha[:12],
            "feature_schema_version": SCHEMA_VERSION,
            "feature_names": list(FEATURE_NAMES),
            "action": ACTION,
            "inputs": inputs_spec,
            "outputs": outputs_spec,
            "onnx_file": ONNX_FILE,
            "onnx_sha256": onnx_sha,
            "onnx_bytes": len(onnx_bytes),
            "opset": OPSET,
            "golden_file": GOLDEN_FILE,
            "golden_sha256": sha256_file(staging / GOLDEN_FILE),
            "num_golden": int(num_golden),
            "golden_seed": int(seed),
            "parity": {"passed": True, "tolerance": float(tolerance), "max_abs_diff": max_abs_diff,
                       "provider": "CPUExecutionProvider"},
            "actor_config": actor.config.to_dict(),
            "training_config": _json_dict(training_config, "training_config"),
            "evaluation": _json_dict(evaluation, "evaluation"),
            "source": source,
            "versions": {"torch": torch.__version__.split("+")[0], "onnx": onnx.__version__,
                         "onnxruntime": ort.__version__},
        }
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        try:
            verify_artifact(staging)
        except ArtifactError as e:
            raise ExportError(f"export refused on re-check: {e}") from None
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
            os.replace(staging, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return manifest


def export_checkpoint(checkpoint_path: str | Path, out_dir: str | Path, **kwargs) -> dict:
    """`export_actor` of a checkpoint written by `policies.actor.save_checkpoint`; the manifest
    carries the checkpoint's training config and evaluation figures."""
    ckpt = load_checkpoint(checkpoint_path)
    return export_actor(ckpt.actor, out_dir, training_config=ckpt.training_config, evaluation=ckpt.evaluation,
                        source=str(checkpoint_path), **kwargs)


def verify_artifact(artifact_dir: str | Path, tolerance: float | None = None) -> dict:
    """Check an artifact from its files alone (manifest, sha256, onnx.checker, I/O names and shapes
    in the graph, ORT-vs-golden parity, probe outputs); return the manifest or raise `ArtifactError`."""
    import onnx

    manifest = read_manifest(artifact_dir)
    data = read_onnx_bytes(artifact_dir, manifest)
    _check_onnx(data)
    graph = onnx.load_from_string(data).graph
    ins = [(i.name, [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]) for i in graph.input]
    outs = [(o.name, [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim]) for o in graph.output]
    if len(ins) != 1 or ins[0][0] != INPUT_NAME or len(ins[0][1]) != 2 or ins[0][1][1] != NUM_FEATURES:
        raise ArtifactError(f"graph inputs {ins}, expected one {INPUT_NAME!r} of shape [batch, {NUM_FEATURES}]")
    if len(outs) != 1 or outs[0][0] != OUTPUT_NAME or len(outs[0][1]) != 2 or outs[0][1][1] != 1:
        raise ArtifactError(f"graph outputs {outs}, expected one {OUTPUT_NAME!r} of shape [batch, 1]")
    inputs, golden_out = read_golden(artifact_dir, manifest)
    tol = manifest["parity"]["tolerance"] if tolerance is None else tolerance
    ort_out = _ort_cpu_outputs(data, inputs)
    check_outputs(ort_out, "golden")
    diff = float(np.max(np.abs(ort_out.astype(np.float64) - golden_out.astype(np.float64))))
    if not diff <= tol:
        raise ArtifactError(f"onnxruntime differs from the golden outputs by {diff:.3g} > tolerance {tol:g}")
    check_outputs(_ort_cpu_outputs(data, probe_inputs()), "probe")
    return manifest
