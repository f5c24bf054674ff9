"""The SmartAllocator's configs: one typed, validated block per layer plus the runtime's own."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DECISION_SOURCES = ("base", "residual", "recovery", "override", "guard")


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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


