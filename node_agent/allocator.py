"""SmartAllocator: one EMB:KV split decision per control interval (see docs/allocator.md).

    alloc = SmartAllocator(AllocatorConfig(), policy_dir="policies/default")
    every control interval, with the stats of the interval that just ended:
        alloc.observe(stats)                  # the residual adapter learns from the last decision
        decision = alloc.decide(stats, now_s) # -> AllocatorDecision; decision.emb_share feeds the memory manager

Layers, in order (each decision records which one set its value, as ``source``):

1. ``base``: the frozen PPO actor in onnxruntime (`OnnxPolicy`): CUDA provider only when
   ``torch.cuda.is_available()``, else CPU; one intra-op thread; input and output bound in advance
   (IOBinding) to preallocated numpy buffers, into which `build_features` writes directly.
2. ``residual``: `ResidualAdapter`, a linear model of the features trained online by normalised
   LMS after each interval; its correction is added to the base output, bounded by
   ``|correction| <= max_correction`` (0.1); and `OperatingPointTuner`, an offset added as well,
   moved every interval along the node's busy-time gradient measured by the caches' ghost lists
   (weighted by the queueing pressure), over the whole guard range: it finds a setting's
   operating point online where the base policy is far from it.
3. ``recovery``: `RecoveryController`, a burst detector with hysteresis over slow EWMA baselines
   of the arrival rate and the hot-user ratio; in a burst it caps emb_share at the split in force
   when the burst began minus ``kv_shift`` (memory moves to the KV cache), then hands control back.
4. ``override``: an operator's emb_share (validated against the bounds when set), which takes
   precedence over every layer until it expires (``expires_at_s``, compared with ``now_s``).
5. ``guard``: the max step per decision (asymmetric: growing EMB needs a background refill,
   shrinking it is metadata-only) and then the [min, max] bounds; the source becomes ``guard``
   when a guard changed the value, and also when the allocator had to hold the split (invalid
   stats, a non-finite base output, no policy loaded).

Pure over snapshots: nothing here reads the clock; ``now_s`` comes with every call.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from node_agent.artifact import (INPUT_NAME, OUTPUT_NAME, ArtifactError, check_outputs, probe_inputs, read_golden,
                               read_manifest, read_onnx_bytes)
from node_agent.features import (FEATURE_NAMES, NUM_FEATURES, FeatureError, WindowStats, build_features, imbalance,
                               marginal_imbalance, miss_costs_us)

DECISION_SOURCES = ("base", "residual", "recovery", "override", "guard")


class PolicyLoadError(ArtifactError):
    """A policy artifact was refused; the allocator keeps running its previous policy."""


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# --------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class GuardConfig:
    """Hard limits on every decision.

    - ``min_emb_share`` / ``max_emb_share``: bounds of the split (0 <= min < max <= 1);
    - ``max_step_up``: most emb_share may grow in one decision (new EMB pages need a background
      refill over PCIe, so growth is rate-limited);
    - ``max_step_down``: most it may shrink in one decision (giving pages to the KV pool is
      metadata-only, so this may be larger, which lets the recovery controller act fast).
    The step limit applies first, then the bounds, so the bounds always hold.
    """

    min_emb_share: float = 0.05
    max_emb_share: float = 0.95
    max_step_up: float = 0.05
    max_step_down: float = 0.10

    def __post_init__(self) -> None:
        problems = []
        for name in ("min_emb_share", "max_emb_share", "max_step_up", "max_step_down"):
            if not _num(getattr(self, name)):
                problems.append(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if not problems:
            if not 0 <= self.min_emb_share < self.max_emb_share <= 1:
                problems.append(f"need 0 <= min_emb_share < max_emb_share <= 1, got {self.min_emb_share}, "
                                f"{self.max_emb_share}")
            for name in ("max_step_up", "max_step_down"):
                if not 0 < getattr(self, name) <= 1:
                    problems.append(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if problems:
            raise ValueError("invalid GuardConfig: " + "; ".join(problems))


GUARD_ACTIONS = ("step_up", "step_down", "max", "min")


def _guard_words(action: str, g: "GuardConfig", prev: float) -> str:
    if action == "step_up":
        return f"step limited to +{g.max_step_up:g} from {prev:.4f}"
    if action == "step_down":
        return f"step limited to -{g.max_step_down:g} from {prev:.4f}"
    return f"clamped to max_emb_share {g.max_emb_share:g}" if action == "max" else \
        f"clamped to min_emb_share {g.min_emb_share:g}"


def guard_stage(proposed: float, prev: float, guard: GuardConfig, *, step_limit: bool = True) -> tuple[float, str | None]:
    """The guard stage, the one used by the runtime (`SmartAllocator.decide`) and by training
    (`policies.env.apply_guards`): the step limit from ``prev`` (``max_step_up`` /
    ``max_step_down``; skipped with ``step_limit=False``, as for an operator override), then the
    ``[min_emb_share, max_emb_share]`` bounds. Returns ``(emb_share, action)`` with ``action``
    the last guard that changed the value (one of `GUARD_ACTIONS`) or None."""
    share = proposed
    action = None
    if step_limit:
        if share > prev + guard.max_step_up:
            share, action = prev + guard.max_step_up, "step_up"
        elif share < prev - guard.max_step_down:
            share, action = prev - guard.max_step_down, "step_down"
    if share > guard.max_emb_share:
        share, action = guard.max_emb_share, "max"
    elif share < guard.min_emb_share:
        share, action = guard.min_emb_share, "min"
    return share, action


RESIDUAL_SIGNALS = ("ghost", "miss_cost")


@dataclass(frozen=True)
class ResidualConfig:
    """The online residual adapter (see `ResidualAdapter` for the target and update rule).

    - ``enabled``: False turns the layer off (correction 0, no learning): the ``ppo`` ablation;
    - ``max_correction``: bound on |correction| (0 < B <= 0.1);
    - ``learning_rate``: NLMS step size mu, in (0, 1];
    - ``leak``: per-update decay of the weights toward zero, in [0, 0.1);
    - ``gain``: emb_share moved per unit of (SLO pressure x miss-cost imbalance), in (0, 1];
    - ``relax``: with latency headroom, the target keeps ``1 - relax`` of the correction, in [0, 1];
    - ``target_p99_over_slo``: the P99/SLO the adapter steers below, in (0, 2];
    - ``pressure_max``: clip of the SLO pressure, in (0, 10];
    - ``reset_on_policy_swap``: zero the adapter when a new base policy is loaded (its corrections
      were learnt against the old policy's errors);
    - ``signal``: what says which cache needs memory: ``"miss_cost"`` (default: all miss time,
      `node_agent.features.miss_costs_us`, compulsory misses included) or ``"ghost"`` (the caches'
      marginal utilities from their ghost lists, `node_agent.features.marginal_imbalance`: only
      the misses that more memory would have turned into hits).
    """

    enabled: bool = True
    max_correction: float = 0.1
    learning_rate: float = 0.5
    leak: float = 0.001
    gain: float = 0.1
    relax: float = 0.1
    target_p99_over_slo: float = 0.9
    pressure_max: float = 1.0
    reset_on_policy_swap: bool = True
    signal: str = "miss_cost"

    def __post_init__(self) -> None:
        problems = [f"{n} must be a bool, got {getattr(self, n)!r}" for n in ("enabled", "reset_on_policy_swap")
                    if not isinstance(getattr(self, n), bool)]
        if self.signal not in RESIDUAL_SIGNALS:
            problems.append(f"signal must be one of {', '.join(RESIDUAL_SIGNALS)}, got {self.signal!r}")
        rules = {  # name: (test, range in words)
            "max_correction": (lambda v: 0 < v <= 0.1, "(0, 0.1]"),
            "learning_rate": (lambda v: 0 < v <= 1, "(0, 1]"),
            "leak": (lambda v: 0 <= v < 0.1, "[0, 0.1)"),
            "gain": (lambda v: 0 < v <= 1, "(0, 1]"),
            "relax": (lambda v: 0 <= v <= 1, "[0, 1]"),
            "target_p99_over_slo": (lambda v: 0 < v <= 2, "(0, 2]"),
            "pressure_max": (lambda v: 0 < v <= 10, "(0, 10]"),
        }
        for name, (ok, words) in rules.items():
            v = getattr(self, name)
            if not (_num(v) and ok(v)):
                problems.append(f"{name} must be in {words}, got {v!r}")
        if problems:
            raise ValueError("invalid ResidualConfig: " + "; ".join(problems))


@dataclass(frozen=True)
class TunerConfig:
    """The operating-point tuner, the residual layer's second part (see `OperatingPointTuner`).

    - ``enabled``: False turns it off (offset 0, no learning);
    - ``gain``: emb_share moved per unit of the latency gradient (the share of a request's
      latency that 10% of the arena moved would save), in (0, 10]; at the default 3 a gradient of
      1/30 (3.3% of the latency) is a full ``max_rate`` step;
    - ``max_rate``: most the offset moves in one interval, in (0, 0.5];
    - ``deadband``: a step smaller than this is not taken, in [0, 0.1);
    - ``headroom_floor``: floor of ``1 - load`` in the latency sensitivity ``1 / (1 - load)``
      (caps it at ``1 / headroom_floor``), in (0, 1);
    - ``smoothing``: weight of a new interval's gradient reading in the running (EWMA) estimate,
      in (0, 1] (1: the interval's own reading);
    - ``confidence``: ``z``, how many standard errors of the estimate a step first subtracts
      (a soft threshold: an estimate within ``z`` standard errors of 0 moves nothing), in
      [0, 10]; 0 turns the noise gate off;
    - ``noise_window``: readings whose successive differences give the robust noise estimate
      (their median) and over which the sign test counts, an integer in [4, 64]; with fewer than
      4 readings there is no noise estimate and only a strong estimate moves (with ``confidence``
      0, any);
    - ``strong_gradient``: an estimate (or this interval's reading, the estimate of the same sign)
      at least this large is taken whole, without the gate, in (0, 1] (1: always gated): a regime
      change moves the readings by more than their noise from one interval to the next, which the
      gate would otherwise read as noise;
    - ``sign_confidence``: the sign test's ``z``: when the gate finds the estimate within the noise
      but the window's nonzero readings agree in sign by at least ``sign_confidence * sqrt(n)``
      (n of them, at least 4), the median reading is taken: lumpy readings (a KV ghost hit is a
      whole user's history) whose direction is clear although their size scatters; in [0, 10],
      0 turns the sign test off;
    - ``sign_test_max_load``: the sign test runs only at or below this load, in [0, 1]: a lightly
      loaded node completes few requests per interval (lumpy readings) and a wrong step costs it
      little (its latency is its service time, and the next readings pull it back), while near
      saturation readings are dense, the magnitude gate suffices, and every step is a full one.
    """

    enabled: bool = True
    gain: float = 3.0
    max_rate: float = 0.1
    deadband: float = 0.005
    headroom_floor: float = 0.05
    smoothing: float = 0.5
    confidence: float = 4.0
    noise_window: int = 9
    strong_gradient: float = 0.1
    sign_confidence: float = 2.0
    sign_test_max_load: float = 0.5

    def __post_init__(self) -> None:
        problems = [] if isinstance(self.enabled, bool) else [f"enabled must be a bool, got {self.enabled!r}"]
        rules = {
            "gain": (lambda v: 0 < v <= 10, "(0, 10]"),
            "max_rate": (lambda v: 0 < v <= 0.5, "(0, 0.5]"),
            "deadband": (lambda v: 0 <= v < 0.1, "[0, 0.1)"),
            "headroom_floor": (lambda v: 0 < v < 1, "(0, 1)"),
            "smoothing": (lambda v: 0 < v <= 1, "(0, 1]"),
            "confidence": (lambda v: 0 <= v <= 10, "[0, 10]"),
            "strong_gradient": (lambda v: 0 < v <= 1, "(0, 1]"),
            "sign_confidence": (lambda v: 0 <= v <= 10, "[0, 10]"),
            "sign_test_max_load": (lambda v: 0 <= v <= 1, "[0, 1]"),
        }
        for name, (ok, words) in rules.items():
            v = getattr(self, name)
            if not (_num(v) and ok(v)):
                problems.append(f"{name} must be in {words}, got {v!r}")
        w = self.noise_window
        if isinstance(w, bool) or not isinstance(w, int) or not 4 <= w <= 64:
            problems.append(f"noise_window must be an integer in [4, 64], got {w!r}")
        if problems:
            raise ValueError("invalid TunerConfig: " + "; ".join(problems))


@dataclass(frozen=True)
class RecoveryConfig:
    """The burst recovery controller (see `RecoveryController`).

    Ratios compare the interval with slow EWMA baselines (time constant ``baseline_tau_s``, frozen
    during a burst). Enter when rate ratio >= ``enter_rate_ratio`` AND hot-user ratio ratio >=
    ``enter_hot_ratio`` (a spike of hot-user requests; not before ``warmup_s`` of baseline). Exit
    when both are <= their ``exit_*`` thresholds (lower than the enter ones: hysteresis) on every
    interval for ``exit_confirm_s``, and at least ``min_hold_s`` after entry; a burst longer than
    ``max_burst_s`` is a new regime: the baselines jump to the current values and control returns.
    In a burst emb_share is capped at (split at entry - ``kv_shift``).
    ``rate_floor_rps`` and ``hot_floor`` keep the ratios finite near zero baselines.
    """

    enabled: bool = True
    baseline_tau_s: float = 60.0
    warmup_s: float = 10.0
    enter_rate_ratio: float = 1.8
    enter_hot_ratio: float = 1.6
    exit_rate_ratio: float = 1.3
    exit_hot_ratio: float = 1.3
    min_hold_s: float = 3.0
    exit_confirm_s: float = 1.0
    max_burst_s: float = 60.0
    kv_shift: float = 0.15
    rate_floor_rps: float = 1.0
    hot_floor: float = 0.005

    def __post_init__(self) -> None:
        problems = [] if isinstance(self.enabled, bool) else [f"enabled must be a bool, got {self.enabled!r}"]
        names = ("baseline_tau_s", "warmup_s", "enter_rate_ratio", "enter_hot_ratio", "exit_rate_ratio",
                 "exit_hot_ratio", "min_hold_s", "exit_confirm_s", "max_burst_s", "kv_shift", "rate_floor_rps",
                 "hot_floor")
        bad = [n for n in names if not _num(getattr(self, n))]
        problems += [f"{n} must be a finite number, got {getattr(self, n)!r}" for n in bad]
        if not bad:
            for n in ("baseline_tau_s", "max_burst_s", "rate_floor_rps", "hot_floor"):
                if getattr(self, n) <= 0:
                    problems.append(f"{n} must be > 0, got {getattr(self, n)}")
            for n in ("warmup_s", "min_hold_s", "exit_confirm_s"):
                if getattr(self, n) < 0:
                    problems.append(f"{n} must be >= 0, got {getattr(self, n)}")
            if not 1 <= self.exit_rate_ratio < self.enter_rate_ratio:
                problems.append(f"need 1 <= exit_rate_ratio < enter_rate_ratio, got {self.exit_rate_ratio}, "
                                f"{self.enter_rate_ratio}")
            if not 1 <= self.exit_hot_ratio < self.enter_hot_ratio:
                problems.append(f"need 1 <= exit_hot_ratio < enter_hot_ratio, got {self.exit_hot_ratio}, "
                                f"{self.enter_hot_ratio}")
            if not 0 < self.kv_shift <= 1:
                problems.append(f"kv_shift must be in (0, 1], got {self.kv_shift}")
            if self.max_burst_s <= self.min_hold_s:
                problems.append(f"max_burst_s ({self.max_burst_s}) must exceed min_hold_s ({self.min_hold_s})")
        if problems:
            raise ValueError("invalid RecoveryConfig: " + "; ".join(problems))


@dataclass(frozen=True)
class AllocatorConfig:
    """The SmartAllocator's config: one block per layer plus the runtime's own settings.

    - ``initial_emb_share``: the split assumed before the first valid stats arrive;
    - ``device``: ``auto`` (CUDA execution provider when torch sees a GPU, else CPU), ``cpu``, ``cuda``;
    - ``intra_op_num_threads``: onnxruntime's intra-op threads (1: one decision on one core);
    - ``golden_tolerance``: max |ORT - golden| accepted when loading; None: the manifest's
      export tolerance on CPU, 1e-4 on CUDA (cuBLAS may sum in another order).
    """

    guard: GuardConfig = field(default_factory=GuardConfig)
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    tuner: TunerConfig = field(default_factory=TunerConfig)
    initial_emb_share: float = 0.5
    device: str = "auto"
    intra_op_num_threads: int = 1
    golden_tolerance: float | None = None

    def __post_init__(self) -> None:
        problems = []
        for name, cls in (("guard", GuardConfig), ("residual", ResidualConfig), ("recovery", RecoveryConfig),
                          ("tuner", TunerConfig)):
            if not isinstance(getattr(self, name), cls):
                problems.append(f"{name} must be a {cls.__name__}")
        if not (_num(self.initial_emb_share) and 0 <= self.initial_emb_share <= 1):
            problems.append(f"initial_emb_share must be in [0, 1], got {self.initial_emb_share!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"device must be auto, cpu or cuda, got {self.device!r}")
        if isinstance(self.intra_op_num_threads, bool) or not isinstance(self.intra_op_num_threads, int) \
                or self.intra_op_num_threads < 1:
            problems.append(f"intra_op_num_threads must be an integer >= 1, got {self.intra_op_num_threads!r}")
        tol = self.golden_tolerance
        if tol is not None and not (_num(tol) and 0 < tol <= 1e-2):
            problems.append(f"golden_tolerance must be None or in (0, 1e-2], got {self.golden_tolerance!r}")
        if problems:
            raise ValueError("invalid AllocatorConfig: " + "; ".join(problems))


# --------------------------------------------------------------------------------------------- base


def cuda_available() -> bool:
    """torch's view of the GPU (onnxruntime-gpu's own get_device() says GPU even without one)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class OnnxPolicy:
    """A loaded, accepted base policy: an onnxruntime session with its I/O bound in advance.

    Loading checks, in order (any failure raises `PolicyLoadError` naming the artifact and the reason):
    the manifest (format, feature schema version and names, I/O spec), the ONNX file's sha256,
    ``onnx.checker``, the session's input/output names, ranks, element types and widths, then runs
    the golden inputs (finite, in [0, 1], within tolerance of the stored outputs) and the probe
    inputs (finite, in [0, 1]).

    ``input_row`` (float32, NUM_FEATURES) is the bound input: write features there, call `run`.
    """

    def __init__(self, artifact_dir: str | Path, *, device: str = "auto", intra_op_num_threads: int = 1,
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
            onnx.checker.check_model(onnx.load_from_string(data), full_check=True)
        except Exception as e:  # DecodeError, ValidationError, ...
            raise ArtifactError(f"corrupt ONNX file {manifest['onnx_file']}: {type(e).__name__}: {e}") from None

        use_cuda = device == "cuda" or (device == "auto" and cuda_available())
        available = ort.get_available_providers()
        if use_cuda and "CUDAExecutionProvider" not in available:
            raise ArtifactError(f"device {device!r} wants CUDA but onnxruntime offers only {available}")
        providers = (["CUDAExecutionProvider", "CPUExecutionProvider"] if use_cuda else ["CPUExecutionProvider"])
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

    def run(self) -> float:
        """Run on ``input_row`` (already written) and return the emb_share the policy proposes."""
        self._run(self._binding)
        return float(self.output[0, 0])

    def describe(self) -> dict:
        return {"policy_id": self.policy_id, "artifact_dir": str(self.artifact_dir), "providers": self.providers,
                "feature_schema_version": self.manifest["feature_schema_version"],
                "golden_max_abs_diff": self.golden_max_abs_diff, "golden_tolerance": self.golden_tolerance}


# --------------------------------------------------------------------------------------------- residual


@dataclass(frozen=True)
class ResidualUpdate:
    """What `ResidualAdapter.update` (via `SmartAllocator.observe`) did with one outcome."""

    updated: bool
    reason: str
    target: float = 0.0
    prediction: float = 0.0
    error: float = 0.0
    slo_pressure: float = 0.0
    miss_imbalance: float = 0.0


@dataclass(frozen=True)
class ResidualState:
    enabled: bool
    weights: tuple[float, ...]
    bias: float
    num_updates: int
    num_skipped: int
    num_resets: int
    last_target: float
    last_error: float
    mean_abs_error: float
    last_reset_reason: str | None

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["weights"] = dict(zip(FEATURE_NAMES, self.weights))
        return d


class ResidualAdapter:
    """Online linear correction of the base policy: ``r(x) = clip(w . x + b, -B, B)``.

    Target. After a decision made on features ``x`` with correction ``r``, the next interval's
    stats (the outcome) say which way the split should have gone:

    - SLO pressure ``p = clip(p99_ms / slo_ms - target_p99_over_slo, -pressure_max, pressure_max)``;
    - imbalance ``m = (emb_us - kv_us) / (emb_us + kv_us)`` in [-1, 1] (0 when both are 0): with
      ``signal="miss_cost"`` (default) ``emb_us`` / ``kv_us`` are the observed miss time per
      request (`node_agent.features.miss_costs_us`), positive when embedding misses cost requests
      more time than KV recomputation; with ``signal="ghost"`` they are the caches' marginal
      utilities (time per request 10% more memory would have saved each, from their ghost lists:
      `node_agent.features.marginal_imbalance`), the rule of utility-based cache partitioning;
    - ``y = r + gain * p * m`` when ``p > 0`` (over the target: move toward the side whose misses
      cost more, in proportion to how far over), else ``y = (1 - relax) * r`` (headroom: fade the
      correction, giving control back to the base policy, which was trained for the long-horizon
      trade-off); finally ``y = clip(y, -B, B)``.

    Update (normalised LMS with leak): with ``x~ = [x, 1]`` and the unclipped prediction
    ``yhat = w~ . x~``, ``w~ <- (1 - leak) w~ + mu (y - yhat) x~ / (eps + |x~|^2)``. NLMS is stable
    for any input scale (mu in (0, 1]) and, unlike RLS, has no covariance to wind up when the
    features stop moving; the leak keeps the weights bounded without excitation. `reset` zeroes
    everything (the correction becomes 0 at once).
    """

    _EPS = 1e-6

    def __init__(self, config: ResidualConfig | None = None):
        self.config = config or ResidualConfig()
        self._w = np.zeros(NUM_FEATURES + 1, dtype=np.float64)  # last entry: bias
        self._w32 = np.zeros(NUM_FEATURES, dtype=np.float32)
        self._b = 0.0
        self.num_updates = 0
        self.num_skipped = 0
        self.num_resets = 0
        self.last_target = 0.0
        self.last_error = 0.0
        self.mean_abs_error = 0.0
        self.last_reset_reason: str | None = None

    def predict(self, x: np.ndarray) -> float:
        """The bounded correction for features ``x`` (0 when disabled)."""
        if not self.config.enabled:
            return 0.0
        r = float(self._w32 @ x) + self._b
        b = self.config.max_correction
        return b if r > b else (-b if r < -b else r)

    def target(self, correction: float, outcome: WindowStats) -> tuple[float, float, float]:
        """``(y, p, m)``: the target correction, SLO pressure and miss-cost imbalance (see class doc)."""
        c = self.config
        p = outcome.p99_ms / outcome.slo_ms - c.target_p99_over_slo
        p = max(-c.pressure_max, min(c.pressure_max, p))
        if c.signal == "ghost":
            m = marginal_imbalance(outcome)
        else:
            kv_us, emb_us = miss_costs_us(outcome)
            m = imbalance(emb_us, kv_us)
        y = correction + c.gain * p * m if p > 0 else (1.0 - c.relax) * correction
        return max(-c.max_correction, min(c.max_correction, y)), p, m

    def update(self, x: np.ndarray, correction: float, outcome: WindowStats) -> ResidualUpdate:
        y, p, m = self.target(correction, outcome)
        xa = np.append(x.astype(np.float64), 1.0)
        yhat = float(self._w @ xa)
        err = y - yhat
        c = self.config
        self._w *= 1.0 - c.leak
        self._w += (c.learning_rate * err / (self._EPS + float(xa @ xa))) * xa
        self._w32[:] = self._w[:-1]
        self._b = float(self._w[-1])
        self.num_updates += 1
        self.last_target, self.last_error = y, err
        weight = 0.05 if self.num_updates > 20 else 1.0 / self.num_updates  # running mean, then an EWMA
        self.mean_abs_error += (abs(err) - self.mean_abs_error) * weight
        return ResidualUpdate(True, f"target {y:+.4f} (slo pressure {p:+.3f}, miss imbalance {m:+.3f}); "
                                    f"prediction {yhat:+.4f} -> {float(self._w @ xa):+.4f}",
                              target=y, prediction=yhat, error=err, slo_pressure=p, miss_imbalance=m)

    def skip(self, reason: str) -> ResidualUpdate:
        self.num_skipped += 1
        return ResidualUpdate(False, reason)

    def reset(self, reason: str = "reset") -> None:
        self._w[:] = 0.0
        self._w32[:] = 0.0
        self._b = 0.0
        self.num_resets += 1
        self.last_target = self.last_error = self.mean_abs_error = 0.0
        self.last_reset_reason = reason

    def state(self) -> ResidualState:
        return ResidualState(enabled=self.config.enabled, weights=tuple(float(v) for v in self._w[:-1]),
                             bias=float(self._w[-1]), num_updates=self.num_updates, num_skipped=self.num_skipped,
                             num_resets=self.num_resets, last_target=self.last_target, last_error=self.last_error,
                             mean_abs_error=self.mean_abs_error, last_reset_reason=self.last_reset_reason)


# --------------------------------------------------------------------------------------------- tuner


def _median(values: list[float]) -> float:
    v = sorted(values)
    k = len(v)
    return v[k // 2] if k % 2 else 0.5 * (v[k // 2 - 1] + v[k // 2])


TUNER_ACTIONS = ("emb_ward", "kv_ward", "deadband", "uncertain", "bound", "no_evidence", "hold")


@dataclass(frozen=True)
class TunerState:
    enabled: bool
    offset: float
    num_updates: int
    num_holds: int
    num_resets: int
    last_action: str | None
    last_gradient: float
    last_step: float
    last_reset_reason: str | None
    mean_gradient: float = 0.0
    gradient_se: float = 0.0

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class OperatingPointTuner:
    """The setting's operating point, found online: an offset added to the base policy's share
    (with the adapter's bounded correction, the residual layer), moved every interval along the
    measured gradient of the node's busy time, over the whole guard range.

    Gradient (utility-based cache partitioning, Qureshi and Patt, MICRO 2006, on the ghost lists
    of both caches, `node_agent.features.marginal_utility_us`): from the interval's `WindowStats`,
    with ``busy_us = load * interval_s * 1e6 / num_requests`` the device time per completed request,

    - ``gradient = (emb_marginal_us - kv_marginal_us) / busy_us``: the share of a request's device
      time that moving 10% of the arena toward the EMB slab would save (negative: toward the KV
      pool). The marginal utilities are priced at the node's own profiled miss costs and counted
      per 10% of its own arena, so the gradient is dimensionless: the same number means the same
      thing on any node, model or arena size (nothing to re-tune per setting);
    - the estimate: one interval's ghost counts are a noisy reading (on the 32-node Taobao trend
      at load 0.9 a node's readings scatter by ~0.01 around a mean of ~0.003, and a 0.1 step on
      such noise at saturation sends nodes apart across the whole range), so the tuner steps on
      ``mean``, an EWMA of the readings (weight ``smoothing``), less ``confidence`` standard
      errors of it: ``estimate = sign(mean) * max(0, |mean| - confidence * se)``, with
      ``se = noise * sqrt(smoothing / (2 - smoothing))`` (the spread of an EWMA of independent
      readings) and ``noise = median |reading_i - reading_(i-1)| / 0.954`` over the last
      ``noise_window`` readings (for Gaussian noise the median absolute successive difference is
      0.954 of its standard deviation; unlike a variance, the median ignores the jump of a regime
      change, so a burst's first readings are not taken for noise). An estimate within the noise
      moves nothing (``uncertain``); until 4 readings exist there is no noise estimate and only a
      mean of at least ``strong_gradient`` moves; such a mean is taken whole at any time (a
      burst's readings swing as the split moves, which the gate would read as noise); when the
      gate gives 0 but the window's nonzero readings agree in sign beyond ``sign_confidence *
      sqrt(n)`` (the sign test, at loads up to ``sign_test_max_load``), their median is the
      estimate: at light load readings are lumpy (a KV ghost hit is a whole user's history) and
      scatter as much as they are large;
    - ``sensitivity = 1 / max(1 - load, headroom_floor)``: how a relative change of the service
      time moves the latency (M/M/1: ``T = S / (1 - rho)``, so ``(dT/T) / (dS/S) = 1 / (1 - rho)``):
      about 1 at light load, where the latency is the service time (a KV miss that recomputes a
      history is the tail), 10 at load 0.9;
    - ``step = clip(gain * estimate * sensitivity, -max_rate, max_rate)``, not taken when
      ``|step| < deadband``; a step never carries ``base + correction + offset`` past a guard
      bound (``bound``; a base output beyond a bound is left to the guard stage).

    Start-up hold: while every reading so far (at most ``noise_window`` of them) has one sign, a
    base move against it is held (``hold``: the offset cancels it, the split stays where it is):
    the shipped base policy, on a trace unlike its training settings, would otherwise carry the
    split the wrong way at the guards' full rate while the evidence against it accumulates. A hold
    is one interval's (``held``, released at the next update, which may hold again): once a
    reading of the other sign comes, the base move goes ahead; once the estimate confirms the
    readings (a step their way), the hold becomes part of the offset and the step is taken from
    there.

    So the offset climbs the busy-time gradient until the two caches' marginal utilities meet (or
    their difference drowns in its noise) or a bound is reached, at most ``max_rate`` per
    interval: from any base share, the far end of the guard range (0.9 of emb_share) is at most
    ``0.9 / max_rate`` intervals away. No evidence (no request served, no busy time, both ghost
    lists silent: the lists off or both caches cold) holds the offset and the estimate. The
    allocator also takes back the part of a step that the guards' step limit refused (anti-windup:
    the offset never runs ahead of the split in force). `reset` zeroes the offset and the estimate
    (an operator's `SmartAllocator.reset_residual`, or a new base policy when
    `ResidualConfig.reset_on_policy_swap`).
    """

    def __init__(self, config: TunerConfig | None = None):
        self.config = config or TunerConfig()
        self.offset = 0.0
        self.held = 0.0  # the part of the offset that is this interval's start-up hold (released next update)
        self.num_updates = 0
        self.num_holds = 0
        self.num_resets = 0
        self.last_action: str | None = None
        self.last_gradient = 0.0
        self.last_step = 0.0
        self.last_reset_reason: str | None = None
        self.mean_gradient = 0.0
        self.gradient_se = 0.0
        self.sign_test = False  # the last step's estimate came from the sign test
        self._readings: list[float] = []
        self._diffs: list[float] = []
        self._num_pos = self._num_neg = 0
        self._num_readings = 0  # since the last reset (the start-up hold's horizon)
        a = self.config.smoothing
        self._se_factor = math.sqrt(a / (2.0 - a)) / 0.954

    def update(self, stats: WindowStats, lo: float, hi: float, hold_at: float | None = None) -> str:
        """One interval: move the offset by this interval's step, kept in ``[lo, hi]``; returns
        the action (one of `TUNER_ACTIONS`); ``last_gradient`` (the interval's reading),
        ``mean_gradient`` / ``gradient_se`` (the estimate) and ``last_step`` hold the figures.
        ``hold_at``: the offset that keeps the split in force (the start-up hold, class doc)."""
        c = self.config
        if self.held != 0.0:  # last interval's start-up hold is released (this interval may hold again)
            self.offset -= self.held
            self.held = 0.0
        n = stats.num_requests
        em = stats.emb_marginal_us
        km = stats.kv_marginal_us
        rho = stats.load
        if n <= 0 or rho <= 0.0 or em + km <= 0.0:
            self.num_holds += 1
            self.last_gradient = self.last_step = 0.0
            action = "no_evidence"
            off = self.offset
        else:
            g = (em - km) * n / (rho * stats.interval_s * 1e6)
            a = c.smoothing
            r = self._readings
            dd = self._diffs  # |r[i] - r[i-1]| of the readings in the window, kept beside them
            if r:
                mean = self.mean_gradient + a * (g - self.mean_gradient)
                dd.append(g - r[-1] if g > r[-1] else r[-1] - g)
            else:
                mean = g
            r.append(g)
            self._num_readings += 1
            if g > 0.0:
                self._num_pos += 1
            elif g < 0.0:
                self._num_neg += 1
            if len(r) > c.noise_window:
                old = r.pop(0)
                dd.pop(0)
                if old > 0.0:
                    self._num_pos -= 1
                elif old < 0.0:
                    self._num_neg -= 1
            self.mean_gradient = mean
            if len(r) >= 4:
                self.gradient_se = _median(dd) * self._se_factor
            else:
                self.gradient_se = 0.0
            self.sign_test = False
            sg = c.strong_gradient
            if mean >= sg or mean <= -sg or (g >= sg and mean > 0.0) or (g <= -sg and mean < 0.0):
                est = mean  # a strong reading or mean: a regime change, not noise
            elif len(r) < 4 and c.confidence > 0.0:  # no noise estimate yet: only a strong reading moves
                est = 0.0
            else:
                cut = c.confidence * self.gradient_se
                est = mean - cut if mean > cut else (mean + cut if mean < -cut else 0.0)
                if est == 0.0 and c.sign_confidence > 0.0 and rho <= c.sign_test_max_load:
                    est = self._sign_estimate(r, self._num_pos, self._num_neg, c.sign_confidence)
                    self.sign_test = est != 0.0
            headroom = 1.0 - rho
            if headroom < c.headroom_floor:
                headroom = c.headroom_floor
            self.last_gradient = g
            self.num_updates += 1
            if est == 0.0:
                self.last_step = 0.0
                action = "uncertain"
                off = self.offset
            else:
                step = c.gain * est / headroom
                m = c.max_rate
                step = m if step > m else (-m if step < -m else step)
                if -c.deadband < step < c.deadband:
                    self.last_step = 0.0
                    action = "deadband"
                    off = self.offset
                else:
                    self.last_step = step
                    action = "emb_ward" if step > 0 else "kv_ward"
                    off = self.offset + step
        nr = len(self._readings)
        absorbed = 0.0
        if hold_at is not None and 0 < self._num_readings <= c.noise_window:
            # start-up: every reading so far points one way and the base moves the other way
            neg, pos = self._num_neg == nr, self._num_pos == nr
            if (neg and off > hold_at) or (pos and off < hold_at):
                if (action == "kv_ward" and neg) or (action == "emb_ward" and pos):
                    absorbed = hold_at - self.offset  # confirmed: the hold becomes the offset's own,
                    off = hold_at + self.last_step  # and the step is taken from there
                else:  # not yet judged: held for this interval (the split stays)
                    own = off
                    off, action = hold_at, "hold"
        if hi < 0.0:  # the bounds clip the offset's own push only; a base output beyond them is the guard's
            hi = 0.0
        if lo > 0.0:
            lo = 0.0
        if off > hi and off > self.offset:
            off, action = (hi if hi > self.offset else self.offset), "bound"
        elif off < lo and off < self.offset:
            off, action = (lo if lo < self.offset else self.offset), "bound"
        if action == "hold":
            self.held = off - own
        self.last_step = off - self.offset - absorbed - self.held  # the tuner's own step (no hold in it)
        self.offset = off
        self.last_action = action
        return action

    @staticmethod
    def _sign_estimate(readings: list[float], pos: int, neg: int, z: float) -> float:
        """The median reading when the ``pos`` positive and ``neg`` negative readings agree in sign
        beyond ``z * sqrt(n)`` (the normal approximation of the sign test, n = pos + neg, at least 4
        of them), else 0."""
        n = pos + neg
        if n < 4 or abs(pos - neg) < z * math.sqrt(n):
            return 0.0
        med = _median(readings)
        return med if (med > 0.0) == (pos > neg) and med != 0.0 else 0.0

    def take_back(self, amount: float) -> None:
        """Remove ``amount`` of the last step (the part the guards' step limit refused)."""
        self.offset -= amount
        self.last_step -= amount

    def reset(self, reason: str = "reset") -> None:
        self.offset = self.held = self.last_gradient = self.last_step = 0.0
        self.mean_gradient = self.gradient_se = 0.0
        self._readings.clear()
        self._diffs.clear()
        self._num_pos = self._num_neg = self._num_readings = 0
        self.last_action = None
        self.num_resets += 1
        self.last_reset_reason = reason

    def state(self) -> TunerState:
        return TunerState(enabled=self.config.enabled, offset=self.offset, num_updates=self.num_updates,
                          num_holds=self.num_holds, num_resets=self.num_resets, last_action=self.last_action,
                          last_gradient=self.last_gradient, last_step=self.last_step,
                          last_reset_reason=self.last_reset_reason, mean_gradient=self.mean_gradient,
                          gradient_se=self.gradient_se)


# --------------------------------------------------------------------------------------------- recovery


@dataclass(frozen=True)
class RecoveryState:
    phase: str  # "warmup", "normal", "burst"
    rate_baseline_rps: float | None
    hot_baseline: float | None
    rate_ratio: float
    hot_ratio: float
    burst_started_s: float | None
    entry_emb_share: float | None
    cap_emb_share: float | None
    num_bursts: int
    last_event: str | None

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class RecoveryController:
    """Burst detection with hysteresis; in a burst, a KV-ward cap on emb_share.

    Per decision (stats of the interval just ended, ``now_s``):

    - ``rate_ratio = arrival_rate_rps / max(rate_baseline, rate_floor_rps)`` and
      ``hot_ratio = hot_user_ratio / max(hot_baseline, hot_floor)``;
    - baselines: EWMAs with weight ``max(1 - exp(-dt / baseline_tau_s), 1 / n)`` (the running mean
      over the first samples, then a time-constant average), updated only outside bursts, so a
      burst never becomes its own baseline;
    - idle windows (`idle`: under ``rate_floor_rps``, or nothing served) are skipped outside a
      burst: they neither seed nor move the baselines and do not count toward the warmup;
    - phase ``warmup`` until ``warmup_s`` of baseline exist; ``normal`` -> ``burst`` when both ratios
      reach their enter thresholds; ``burst`` -> ``normal`` (hand back) when both ratios are at or
      below the exit thresholds on every interval for ``exit_confirm_s``, and ``min_hold_s`` has
      passed since entry; or after ``max_burst_s`` (a lasting shift, not a burst: the baselines
      are set to the current values);
    - in a burst the cap is ``max(0, entry_emb_share - kv_shift)`` with ``entry_emb_share`` the
      split in force at entry; the allocator uses ``min(proposal, cap)``.

    ``update`` returns the event of this step (``"entered"``, ``"ended"``, ``"expired"``) or None.
    """

    def __init__(self, config: RecoveryConfig | None = None):
        self.config = config or RecoveryConfig()
        self.reset()

    def reset(self) -> None:
        self.phase = "warmup"
        self.rate_baseline: float | None = None
        self.hot_baseline: float | None = None
        self.rate_ratio = 1.0
        self.hot_ratio = 1.0
        self.burst_started_s: float | None = None
        self.entry_emb_share: float | None = None
        self.cap: float | None = None
        self.num_bursts = 0
        self.last_event: str | None = None
        self._first_s: float | None = None
        self._last_s: float | None = None
        self._n = 0
        self._below_since_s: float | None = None

    @property
    def active(self) -> bool:
        return self.phase == "burst"

    def _baseline(self, rate: float, hot: float, now_s: float) -> None:
        self._n += 1
        dt = now_s - self._last_s if self._last_s is not None else 0.0
        a = max(1.0 - math.exp(-dt / self.config.baseline_tau_s), 1.0 / self._n)
        self.rate_baseline += a * (rate - self.rate_baseline)
        self.hot_baseline += a * (hot - self.hot_baseline)

    def idle(self, rate_rps: float, hot_user_ratio: float) -> bool:
        """A window that says nothing about the baseline: arrivals under ``rate_floor_rps`` or no
        request served (hot-user ratio 0: `top_share` of an empty window). Such a window neither
        seeds nor moves the baselines, does not count toward ``warmup_s`` and never enters a burst,
        so a node that idled before its load began sees the load's arrival as the start of its
        warmup, not as a burst against a zero baseline (in a burst it is judged as usual)."""
        return not (rate_rps >= self.config.rate_floor_rps and hot_user_ratio > 0.0)

    def update(self, rate_rps: float, hot_user_ratio: float, now_s: float, current_emb_share: float) -> str | None:
        c = self.config
        event = None
        if self.phase != "burst" and self.idle(rate_rps, hot_user_ratio):
            if self.rate_baseline is not None:
                rb = self.rate_baseline if self.rate_baseline > c.rate_floor_rps else c.rate_floor_rps
                hb = self.hot_baseline if self.hot_baseline > c.hot_floor else c.hot_floor
                self.rate_ratio, self.hot_ratio = rate_rps / rb, hot_user_ratio / hb
            return None
        if self.rate_baseline is None:
            self.rate_baseline, self.hot_baseline = rate_rps, hot_user_ratio
            self._first_s = self._last_s = now_s
            self._n = 1
            return None
        rb = self.rate_baseline if self.rate_baseline > c.rate_floor_rps else c.rate_floor_rps
        hb = self.hot_baseline if self.hot_baseline > c.hot_floor else c.hot_floor
        self.rate_ratio = rate_ratio = rate_rps / rb
        self.hot_ratio = hot_ratio = hot_user_ratio / hb
        if self.phase == "burst":
            held = now_s - self.burst_started_s
            below = rate_ratio <= c.exit_rate_ratio and hot_ratio <= c.exit_hot_ratio
            if not below:
                self._below_since_s = None
            elif self._below_since_s is None:
                self._below_since_s = now_s
            if held >= c.max_burst_s:
                self.phase, event = "normal", "expired"
                self.rate_baseline, self.hot_baseline = rate_rps, hot_user_ratio
                self._n = 1
            elif below and held >= c.min_hold_s and now_s - self._below_since_s >= c.exit_confirm_s:
                self.phase, event = "normal", "ended"
        else:
            if self.phase == "warmup" and now_s - self._first_s >= c.warmup_s:
                self.phase = "normal"
            if self.phase == "normal" and rate_ratio >= c.enter_rate_ratio and hot_ratio >= c.enter_hot_ratio:
                self.phase, event = "burst", "entered"
                self.burst_started_s = now_s
                self.entry_emb_share = current_emb_share
                self.cap = max(0.0, current_emb_share - c.kv_shift)
                self._below_since_s = None
                self.num_bursts += 1
            else:
                self._baseline(rate_rps, hot_user_ratio, now_s)
        self._last_s = now_s
        if event is not None:
            self.last_event = event
        return event

    def state(self) -> RecoveryState:
        return RecoveryState(phase=self.phase, rate_baseline_rps=self.rate_baseline, hot_baseline=self.hot_baseline,
                             rate_ratio=self.rate_ratio, hot_ratio=self.hot_ratio,
                             burst_started_s=self.burst_started_s if self.active else None,
                             entry_emb_share=self.entry_emb_share if self.active else None,
                             cap_emb_share=self.cap if self.active else None, num_bursts=self.num_bursts,
                             last_event=self.last_event)


# --------------------------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Override:
    """An operator's emb_share; in force from ``set_at_s`` until ``expires_at_s`` (None: until cleared)."""

    emb_share: float
    set_at_s: float
    expires_at_s: float | None
    reason: str


@dataclass(slots=True, eq=False)
class AllocatorDecision:
    """One control interval's decision, with everything needed to explain it (a record: treat
    it as read-only; not frozen because a frozen dataclass costs ~2 µs more per decision).

    ``emb_share`` is what the memory manager should apply; ``source`` the layer that set it
    (one of `DECISION_SOURCES`); ``reason`` says why in words (for people; built from the
    structured fields below). ``proposed_emb_share`` is the value before the guards,
    ``base_emb_share`` the policy's raw output (NaN when the base did not run), ``residual`` the
    adapter's correction, ``features`` a copy of the policy input (zeros when the stats were
    invalid and the allocator held the split).

    Structured reason fields: ``layer_source`` the layer whose proposal reached the guards
    (``base``, ``residual``, ``recovery``, ``override``, or ``guard`` for a hold);
    ``guard_action`` the guard that changed the value (`GUARD_ACTIONS`: ``step_up``,
    ``step_down``, ``max``, ``min``) or None; ``hold_reason`` why the split was held (invalid
    stats, no policy, a bad base output) or None; ``recovery_phase`` (``warmup``, ``normal``, ``burst``),
    ``recovery_event`` (``entered``, ``ended``, ``new_regime`` or None) and ``recovery_cap`` (the
    KV-ward cap in a burst, else None); ``override_reason`` the operator's reason while an
    override is in force; ``notes`` other events of the step (an override expired).
    The operating-point tuner (`OperatingPointTuner`, part of the residual layer):
    ``tuner_offset`` its offset in the proposal (``proposed = base + residual + tuner_offset``
    before recovery, override and guards), ``tuner_step`` how much this decision moved it,
    ``tuner_gradient`` the measured busy-time gradient (share of a request's device time that 10%
    of the arena moved toward the EMB slab would save; negative: toward the KV pool) and
    ``tuner_action`` (`TUNER_ACTIONS`, or None when the tuner did not run: disabled, a hold).
    """

    seq: int
    now_s: float
    emb_share: float
    source: str
    reason_renderers: list  # functions of the inner reason, innermost first (see `reason`)
    prev_emb_share: float
    proposed_emb_share: float
    base_emb_share: float
    residual: float
    recovery_active: bool
    override_active: bool
    policy_id: str | None
    features: np.ndarray
    layer_source: str = "guard"
    guard_action: str | None = None
    hold_reason: str | None = None
    recovery_phase: str = "normal"
    recovery_event: str | None = None
    recovery_cap: float | None = None
    override_reason: str | None = None
    notes: tuple[str, ...] = ()
    tuner_offset: float = 0.0
    tuner_step: float = 0.0
    tuner_gradient: float = 0.0
    tuner_action: str | None = None
    _reason: str | None = None

    @property
    def reason(self) -> str:
        """Why, in words, rendered from the structured fields on first read (formatting a dozen
        numbers on every decision would cost more than the decision's arithmetic)."""
        if self._reason is None:
            r = ""
            for f in self.reason_renderers:
                r = f(r)
            self._reason = r
        return self._reason

    def to_dict(self) -> dict:
        """JSON-able (NaN base becomes None; features as name -> value)."""
        d = {k: getattr(self, k) for k in self.__slots__ if k not in ("features", "reason_renderers", "_reason")}
        d["reason"] = self.reason
        if math.isnan(d["base_emb_share"]):
            d["base_emb_share"] = None
        d["features"] = {n: float(v) for n, v in zip(FEATURE_NAMES, self.features)}
        d["notes"] = list(self.notes)
        return d


@dataclass(frozen=True)
class PolicySwap:
    previous_policy_id: str | None
    policy_id: str
    providers: list[str]
    now_s: float | None


class SmartAllocator:
    """The node's EMB:KV split controller (see the module docstring for the layers).

    Call order per control interval: ``observe(stats)`` (learn from the previous decision's
    outcome), then ``decide(stats, now_s)``. ``load_policy`` swaps the base policy atomically: the
    new one is fully checked before it replaces the old, and a refused one raises
    `PolicyLoadError` while the old keeps running. ``set_override`` / ``clear_override`` are the
    operator's controls; ``reset_residual`` zeroes the adapter. ``state()`` reports everything.
    """

    def __init__(self, config: AllocatorConfig | None = None, policy_dir: str | Path | None = None):
        self.config = config or AllocatorConfig()
        self.residual = ResidualAdapter(self.config.residual)
        self.recovery = RecoveryController(self.config.recovery)
        self.tuner = OperatingPointTuner(self.config.tuner)
        self._policy: OnnxPolicy | None = None
        self._scratch = np.zeros(NUM_FEATURES, dtype=np.float32)  # feature buffer when no policy is loaded
        self._share: float | None = None
        self._prev_stats: WindowStats | None = None
        self._last_now_s: float | None = None
        self._seq = 0
        self._override: Override | None = None
        self._pending: AllocatorDecision | None = None
        self._pending_learnable = False
        self.last_decision: AllocatorDecision | None = None
        self.last_load_error: str | None = None
        self.num_decisions = {s: 0 for s in DECISION_SOURCES}
        self._lock = threading.Lock()  # serialises load_policy with itself (decide reads one reference)
        if policy_dir is not None:
            self.load_policy(policy_dir)

    # ---- policy
    @property
    def policy(self) -> OnnxPolicy | None:
        return self._policy

    def load_policy(self, artifact_dir: str | Path, now_s: float | None = None) -> PolicySwap:
        """Load, check and swap in a new base policy; on refusal raise `PolicyLoadError` and keep
        the previous policy running."""
        c = self.config
        with self._lock:
            try:
                new = OnnxPolicy(artifact_dir, device=c.device, intra_op_num_threads=c.intra_op_num_threads,
                                 golden_tolerance=c.golden_tolerance)
            except PolicyLoadError as e:
                self.last_load_error = str(e)
                raise
            old = self._policy
            self._policy = new
            self.last_load_error = None
            if old is not None and self.config.residual.reset_on_policy_swap:
                self.residual.reset(f"base policy swapped: {old.policy_id} -> {new.policy_id}")
                self.tuner.reset(f"base policy swapped: {old.policy_id} -> {new.policy_id}")
                self._pending = None  # the last decision's correction belongs to the old policy
        return PolicySwap(previous_policy_id=old.policy_id if old else None, policy_id=new.policy_id,
                          providers=new.providers, now_s=now_s)

    # ---- operator
    def set_override(self, emb_share: float, *, now_s: float, expires_at_s: float | None = None,
                     reason: str = "operator override") -> Override:
        g = self.config.guard
        if not (_num(emb_share) and g.min_emb_share <= emb_share <= g.max_emb_share):
            raise ValueError(f"override emb_share must be within the guard bounds [{g.min_emb_share}, "
                             f"{g.max_emb_share}], got {emb_share!r}")
        if not _num(now_s):
            raise ValueError(f"now_s must be a finite number, got {now_s!r}")
        if expires_at_s is not None and not (_num(expires_at_s) and expires_at_s > now_s):
            raise ValueError(f"expires_at_s must be a finite time after now_s={now_s}, got {expires_at_s!r}")
        self._override = Override(float(emb_share), float(now_s), expires_at_s, str(reason))
        return self._override

    def clear_override(self) -> Override | None:
        old, self._override = self._override, None
        return old

    @property
    def override(self) -> Override | None:
        return self._override

    def reset_residual(self, reason: str = "operator reset") -> None:
        """Zero the residual layer: the adapter's weights and the operating-point tuner's offset."""
        self.residual.reset(reason)
        self.tuner.reset(reason)

    # ---- the decision
    def decide(self, stats: WindowStats, now_s: float) -> AllocatorDecision:
        """One decision for the coming interval from ``stats`` of the interval that just ended."""
        if self._last_now_s is not None and not now_s >= self._last_now_s:
            raise ValueError(f"now_s went backwards or is not a number: {now_s!r} after {self._last_now_s!r}")
        self._last_now_s = now_s
        policy = self._policy
        row = policy.input_row if policy is not None else self._scratch
        base = math.nan
        residual = 0.0
        learnable = False
        notes = None
        hold_reason = None
        recovery_event = None
        recovery_cap = None
        override_reason = None
        offset = tuner_step = tuner_gradient = 0.0
        tuner_action = None
        note_list: list[str] = []
        render: list = []  # the reason, rendered only when read (`AllocatorDecision.reason`): each wraps the last
        try:
            build_features(stats, self._prev_stats, out=row)
            valid = True
        except FeatureError as e:
            valid = False
            row[:] = 0.0
            hold_reason = str(e)
        prev = self._share
        if prev is None:
            prev = stats.emb_share if valid else self.config.initial_emb_share
        g = self.config.guard

        # layers: base, residual, recovery
        if valid:
            self._prev_stats = stats
            if policy is not None:
                base = policy.run()
                if 0.0 <= base <= 1.0:  # False for NaN
                    residual = self.residual.predict(row)
                    tuner = self.tuner
                    if tuner.config.enabled:
                        ov = self._override
                        if ov is None or (ov.expires_at_s is not None and now_s >= ov.expires_at_s):
                            # the operator's split measures nothing about the layers: hold under it
                            tuner_action = tuner.update(stats, g.min_emb_share - base - residual,
                                                        g.max_emb_share - base - residual,
                                                        hold_at=prev - base - residual)
                            tuner_step, tuner_gradient = tuner.last_step, tuner.last_gradient
                        offset = tuner.offset
                    proposed = base + residual + offset
                    pid = policy.policy_id
                    if offset != 0.0 or tuner_step != 0.0:
                        source = "residual"
                        render.append(lambda r, pid=pid, b=base, res=residual, o=offset, a=tuner_action, st=tuner_step,
                                   gr=tuner_gradient, m=tuner.mean_gradient, se=tuner.gradient_se, ld=stats.load,
                                   sign=tuner.sign_test:
                                   f"base policy {pid} {b:.4f} + residual {res:+.4f} + operating point {o:+.4f} "
                                   f"({a} {st:+.4f}, busy-time gradient {gr:+.4f}, estimate {m:+.4f} +- {se:.4f}"
                                   f"{' (sign test)' if sign else ''}, at load {ld:.2f})")
                    elif residual != 0.0:
                        source = "residual"
                        render.append(lambda r, pid=pid, b=base, res=residual:
                                   f"base policy {pid} {b:.4f} + residual {res:+.4f}")
                    else:
                        source = "base"
                        render.append(lambda r, pid=pid, b=base: f"base policy {pid} {b:.4f}")
                    learnable = True
                else:
                    proposed, source = prev, "guard"
                    hold_reason = f"base policy {policy.policy_id} output {base!r} is not an emb_share"
                    render.append(lambda r, h=hold_reason: f"holding: {h}")
            else:
                hold_reason = "no base policy loaded"
                proposed, source = prev, "guard"
                render.append(lambda r, h=hold_reason: f"holding: {h}")
            if self.config.recovery.enabled:
                event = self.recovery.update(stats.arrival_rate_rps, stats.hot_user_ratio, now_s, prev)
                rec = self.recovery
                if event is not None:
                    recovery_event = event if event in ("entered", "ended") else "new_regime"
                if rec.phase == "burst":
                    learnable = False
                    recovery_cap = rec.cap
                    if proposed > rec.cap:
                        render.append(lambda r, e=event, t0=rec.burst_started_s, rr=rec.rate_ratio, hr=rec.hot_ratio,
                                   cap=rec.cap, en=rec.entry_emb_share, k=self.config.recovery.kv_shift, src=source,
                                   p=proposed:
                                   f"burst {'entered at' if e == 'entered' else 'since'} t={t0:g}s (rate x{rr:.2f}, "
                                   f"hot-user ratio x{hr:.2f} of baseline): KV-ward cap {cap:.4f} (entry {en:.4f} - "
                                   f"{k:g}) under {src} proposal {p:.4f} ({r})")
                        proposed = rec.cap
                    else:
                        render.append(lambda r, e=event, t0=rec.burst_started_s, rr=rec.rate_ratio, hr=rec.hot_ratio,
                                   cap=rec.cap, src=source, p=proposed:
                                   f"burst {'entered at' if e == 'entered' else 'since'} t={t0:g}s (rate x{rr:.2f}, "
                                   f"hot-user ratio x{hr:.2f} of baseline): {src} proposal {p:.4f} already under the "
                                   f"KV-ward cap {cap:.4f} ({r})")
                    source = "recovery"
                elif event is not None:
                    if event == "ended":
                        why = "burst ended"
                    else:
                        why = f"burst lasted {self.config.recovery.max_burst_s:g}s (new regime; baselines reset)"
                    note = f"{why} at t={now_s:g}s: control handed back to the base policy"
                    notes = note if notes is None else f"{notes}; {note}"
                    note_list.append(note)
        else:
            proposed, source = prev, "guard"
            render.append(lambda r, h=hold_reason: f"holding: {h}")

        # override
        ov = self._override
        override_active = False
        if ov is not None:
            if ov.expires_at_s is not None and now_s >= ov.expires_at_s:
                self._override = None
                note = f"override {ov.emb_share:.4f} expired at t={ov.expires_at_s:g}s"
                notes = note if notes is None else f"{notes}; {note}"
                note_list.append(note)
            else:
                override_active = True
                learnable = False
                until = "until cleared" if ov.expires_at_s is None else f"until t={ov.expires_at_s:g}s"
                render.append(lambda r, ov=ov, u=until, p=proposed, src=source:
                           f"operator override {ov.emb_share:.4f} ({ov.reason}) {u}; layers proposed {p:.4f} via "
                           f"{src} ({r})")
                proposed, source = ov.emb_share, "override"
                override_reason = ov.reason

        # guards (`guard_stage`): step limit (not for overrides), then bounds
        layer_source = source
        share, guard_action = guard_stage(proposed, prev, g, step_limit=not override_active)
        if tuner_step != 0.0 and layer_source == "residual" and (guard_action == "step_up" or
                                                                  guard_action == "step_down"):
            # anti-windup: take back the part of this step that the step limit refused
            refused = proposed - share
            back = (min(refused, tuner_step) if tuner_step > 0 else max(refused, tuner_step)) \
                if (refused > 0) == (tuner_step > 0) else 0.0
            if back != 0.0:
                self.tuner.take_back(back)
                offset, tuner_step = self.tuner.offset, self.tuner.last_step
                render.append(lambda r, b=back: f"{r}; the step limit took back {b:+.4f} of the operating point's step")
        if guard_action is not None:
            render.append(lambda r, a=guard_action, g=g, p=prev, src=source: f"{_guard_words(a, g, p)}; {src}: {r}")
            source = "guard"
        if notes is not None:
            render.append(lambda r, n=notes: f"{r} [{n}]")

        self._seq += 1
        d = AllocatorDecision(self._seq, now_s, share, source, render, prev, proposed, base, residual,
                              self.recovery.phase == "burst", override_active,
                              policy.policy_id if policy is not None else None, row.copy(),
                              layer_source=layer_source, guard_action=guard_action, hold_reason=hold_reason,
                              recovery_phase=self.recovery.phase, recovery_event=recovery_event,
                              recovery_cap=recovery_cap, override_reason=override_reason, notes=tuple(note_list),
                              tuner_offset=offset, tuner_step=tuner_step, tuner_gradient=tuner_gradient,
                              tuner_action=tuner_action)
        self._share = share
        self._pending = d
        self._pending_learnable = learnable and self.residual.config.enabled
        self.num_decisions[source] += 1
        self.last_decision = d
        return d

    def observe(self, outcome: WindowStats) -> ResidualUpdate:
        """Train the residual adapter on the outcome (the stats of the interval that ran under the
        last decision). Each decision is learnt from at most once; intervals run under an
        override, a burst, or a hold (invalid stats, no/failed base) are skipped, as are empty
        intervals (no requests: no latency evidence)."""
        d, self._pending = self._pending, None
        ra = self.residual
        if not ra.config.enabled:
            return ra.skip("residual adapter disabled")
        if d is None:
            return ra.skip("no decision to pair the outcome with")
        if not self._pending_learnable:
            return ra.skip(f"decision {d.seq} ran under {d.source}, not base + residual: its outcome does not "
                           "measure the correction")
        problems = outcome.problems()
        if problems:
            return ra.skip("invalid outcome: " + "; ".join(problems))
        if outcome.num_requests == 0:
            return ra.skip("no requests in the interval: no latency evidence")
        return ra.update(d.features, d.residual, outcome)

    # ---- reporting
    def state(self) -> dict:
        ov = self._override
        return {
            "emb_share": self._share,
            "policy": self._policy.describe() if self._policy is not None else None,
            "last_load_error": self.last_load_error,
            "override": None if ov is None else {"emb_share": ov.emb_share, "set_at_s": ov.set_at_s,
                                                 "expires_at_s": ov.expires_at_s, "reason": ov.reason},
            "residual": self.residual.state().to_dict(),
            "recovery": self.recovery.state().to_dict(),
            "tuner": self.tuner.state().to_dict(),
            "num_decisions": dict(self.num_decisions),
            "last_decision": self.last_decision.to_dict() if self.last_decision is not None else None,
        }
