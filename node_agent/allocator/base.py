"""The base layer: the frozen actor in onnxruntime (`OnnxPolicy`; trained by behaviour cloning, PPO or
both: the shipped one is behaviour-cloned) and `base_layer`."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from node_agent.allocator.trace import LayerTrace
from node_agent.artifact import (INPUT_NAME, OUTPUT_NAME, ArtifactError, check_graph, check_outputs, probe_inputs,
                               read_golden, read_manifest, read_onnx_bytes)
from node_agent.features import NUM_FEATURES


class PolicyLoadError(ArtifactError):
    """A policy artifact was refused; the allocator keeps running its previous policy."""


#: most ms one control step of a policy may take (the median of 5 at load; the shipped MLP takes
#: tens of µs): it runs on the node's serving thread
MAX_POLICY_STEP_MS = 20.0


def cuda_available() -> bool:
    """torch's view of the GPU (onnxruntime-gpu's own get_device() says GPU even without one)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def session_providers(device: str, available: list[str], cuda: bool) -> list[str]:
    """onnxruntime's providers for a policy on ``device``: ``cpu`` (the default) the CPU provider
    only, ``cuda`` the CUDA provider first, ``auto`` CUDA first when ``cuda`` (torch sees a GPU).
    One decision per control step takes tens of µs on the CPU; on the GPU it would queue behind
    the serving kernels. ``available``: onnxruntime's providers (CUDA asked for and missing raises
    `ArtifactError`)."""
    if device not in ("cpu", "cuda", "auto"):
        raise ArtifactError(f"policy device must be cpu, cuda or auto, got {device!r}")
    use_cuda = device == "cuda" or (device == "auto" and cuda)
    if use_cuda and "CUDAExecutionProvider" not in available:
        raise ArtifactError(f"device {device!r} wants CUDA but onnxruntime offers only {available}")
    return ["CUDAExecutionProvider", "CPUExecutionProvider"] if use_cuda else ["CPUExecutionProvider"]


class OnnxPolicy:
    """A loaded, accepted base policy: an onnxruntime session with its I/O bound in advance.

    Loading checks, in order (any failure raises `PolicyLoadError` naming the artifact and the reason):
    the manifest (format, feature schema version and names, I/O spec), the ONNX file's sha256,
    ``onnx.checker``, the session's input/output names, ranks, element types and widths, then runs
    the golden inputs (finite, in [0, 1], within tolerance of the stored outputs) and the probe
    inputs (finite, in [0, 1]), and times one control step (at most `MAX_POLICY_STEP_MS`).

    ``input_row`` (float32, NUM_FEATURES) is the bound input: write features there, call `run`.
    ``device``: which provider runs it (`session_providers`; the CPU's unless asked otherwise).
    """

    def __init__(self, artifact_dir: str | Path, *, device: str = "cpu", intra_op_num_threads: int = 1,
                 golden_tolerance: float | None = None):
        self.artifact_dir = Path(artifact_dir)
        try:
            self._load(device, intra_op_num_threads, golden_tolerance)
        except ArtifactError as e:
            raise PolicyLoadError(f"policy {self.artifact_dir} refused: {e}") from None
        except Exception as e:  # anything unforeseen still refuses the policy instead of crashing the agent
            raise PolicyLoadError(f"policy {self.artifact_dir} refused: {type(e).__name__}: {e}") from None

    def _load(self, device: str, threads: int, golden_tolerance: float | None) -> None:
        import onnx
        import onnxruntime as ort

        manifest = read_manifest(self.artifact_dir)
        data = read_onnx_bytes(self.artifact_dir, manifest)
        try:
            model = onnx.load_from_string(data)
            problems = check_graph(model)  # before the checker's shape inference and the session
            if not problems:
                onnx.checker.check_model(model, full_check=True)
        except Exception as e:  # DecodeError, ValidationError, ...
            raise ArtifactError(f"corrupt ONNX file {manifest['onnx_file']}: {type(e).__name__}: {e}") from None
        if problems:
            raise ArtifactError(f"{manifest['onnx_file']} is not a graph this runtime runs: {'; '.join(problems)}")

        providers = session_providers(device, ort.get_available_providers(), device != "cpu" and cuda_available())
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        try:
            sess = ort.InferenceSession(data, so, providers=providers)
        except Exception as e:
            raise ArtifactError(f"onnxruntime cannot load {manifest['onnx_file']}: {type(e).__name__}: {e}") from None

        ins, outs = sess.get_inputs(), sess.get_outputs()
        if len(ins) != 1 or ins[0].name != INPUT_NAME or ins[0].type != "tensor(float)" or len(ins[0].shape) != 2 \
                or ins[0].shape[1] != NUM_FEATURES:
            got = [(i.name, i.shape, i.type) for i in ins]
            raise ArtifactError(f"wrong input: the model takes {got}, the runtime feeds one {INPUT_NAME!r} "
                                f"float tensor of shape [batch, {NUM_FEATURES}] (feature schema "
                                f"{manifest['feature_schema_version']})")
        if len(outs) != 1 or outs[0].name != OUTPUT_NAME or outs[0].type != "tensor(float)" \
                or len(outs[0].shape) != 2 or outs[0].shape[1] != 1:
            got = [(o.name, o.shape, o.type) for o in outs]
            raise ArtifactError(f"wrong output: the model gives {got}, expected one {OUTPUT_NAME!r} float tensor "
                                f"of shape [batch, 1]")
        batch_dim = ins[0].shape[0]
        dynamic_batch = batch_dim is None or isinstance(batch_dim, str)
        if not dynamic_batch and batch_dim != 1:
            raise ArtifactError(f"input batch dimension is {batch_dim}, expected 1 or dynamic")

        providers_used = sess.get_providers()
        on_cuda = providers_used[0] == "CUDAExecutionProvider"
        tol = golden_tolerance if golden_tolerance is not None else (
            max(1e-4, manifest["parity"]["tolerance"]) if on_cuda else manifest["parity"]["tolerance"])
        golden_in, golden_out = read_golden(self.artifact_dir, manifest)

        def run_rows(x: np.ndarray, what: str) -> np.ndarray:
            try:
                if dynamic_batch:
                    return sess.run([OUTPUT_NAME], {INPUT_NAME: x})[0]
                return np.concatenate([sess.run([OUTPUT_NAME], {INPUT_NAME: x[i:i + 1]})[0] for i in range(len(x))])
            except Exception as e:
                raise ArtifactError(f"onnxruntime fails on the {what} inputs: {type(e).__name__}: {e}") from None

        got = run_rows(golden_in, "golden")
        check_outputs(got, "golden")
        diff = float(np.max(np.abs(got.astype(np.float64) - golden_out.astype(np.float64))))
        if not diff <= tol:
            raise ArtifactError(f"parity failed: onnxruntime ({providers_used[0]}) differs from the golden outputs "
                                f"by {diff:.3g} > {tol:g}")
        check_outputs(run_rows(probe_inputs(), "probe"), "probe")

        self.input = np.zeros((1, NUM_FEATURES), dtype=np.float32)
        self.input_row = self.input[0]
        self.output = np.zeros((1, 1), dtype=np.float32)
        binding = sess.io_binding()
        binding.bind_input(INPUT_NAME, "cpu", 0, np.float32, [1, NUM_FEATURES], self.input.ctypes.data)
        binding.bind_output(OUTPUT_NAME, "cpu", 0, np.float32, [1, 1], self.output.ctypes.data)
        self._session = sess
        self._binding = binding
        self._run = sess.run_with_iobinding
        self.manifest = manifest
        self.policy_id: str = manifest["policy_id"]
        self.providers: list[str] = providers_used
        self.golden_max_abs_diff = diff
        self.golden_tolerance = tol
        self.input_row[:] = golden_in[0]
        self.run()  # warm-up through the binding
        if not abs(float(self.output[0, 0]) - float(golden_out[0, 0])) <= tol:
            raise ArtifactError("the IOBinding path disagrees with the golden output")
        # the policy runs on the thread that serves requests, once per control step: bounded in time
        took = []
        for _ in range(5):
            t0 = time.perf_counter()
            self.run()
            took.append(time.perf_counter() - t0)
        step_ms = 1000.0 * sorted(took)[2]
        if step_ms > MAX_POLICY_STEP_MS:
            raise ArtifactError(f"one control step takes {step_ms:.1f} ms (median of 5), more than "
                                f"{MAX_POLICY_STEP_MS:g} ms: the policy runs on the node's serving thread")
        self.step_ms = step_ms

    def run(self) -> float:
        """Run on ``input_row`` (already written) and return the emb_share the policy proposes."""
        self._run(self._binding)
        return float(self.output[0, 0])

    def describe(self) -> dict:
        return {"policy_id": self.policy_id, "artifact_dir": str(self.artifact_dir), "providers": self.providers,
                "feature_schema_version": self.manifest["feature_schema_version"],
                "golden_max_abs_diff": self.golden_max_abs_diff, "golden_tolerance": self.golden_tolerance}



def base_layer(policy: OnnxPolicy | None, hold_reason: str | None, prev: float) -> tuple[float, LayerTrace]:
    """The base policy's proposal on the features already written to its ``input_row``.

    Holds the split in force (``prev``) when the window's stats were invalid (``hold_reason``
    given), when no policy is loaded, or when the policy's output is not an emb_share in [0, 1].
    Detail: ``policy_id``, ``output`` (the raw output; NaN when the policy did not run) and
    ``hold_reason`` (None when the base proposed)."""
    if hold_reason is not None:
        return prev, LayerTrace("base", prev, False, (None, math.nan, hold_reason))
    if policy is None:
        return prev, LayerTrace("base", prev, False, (None, math.nan, "no base policy loaded"))
    out = policy.run()
    pid = policy.policy_id
    if 0.0 <= out <= 1.0:  # False for NaN
        return out, LayerTrace("base", out, True, (pid, out, None))
    return prev, LayerTrace("base", prev, False, (pid, out, f"base policy {pid} output {out!r} is not an emb_share"))
