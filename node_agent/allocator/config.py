"""The SmartAllocator's configs: one typed, validated block per layer plus the runtime's own."""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.config import ranged, require, validate
from common.contract import DEFAULT_MAX_EMB_SHARE, DEFAULT_MIN_EMB_SHARE


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

    min_emb_share: float = ranged(DEFAULT_MIN_EMB_SHARE, lo=0, hi=1)
    max_emb_share: float = ranged(DEFAULT_MAX_EMB_SHARE, lo=0, hi=1)
    max_step_up: float = ranged(0.05, lo=0, hi=1, lo_open=True)
    max_step_down: float = ranged(0.10, lo=0, hi=1, lo_open=True)

    def __post_init__(self) -> None:
        validate(self)
        require(self, self.min_emb_share < self.max_emb_share,
                f"need min_emb_share < max_emb_share, got {self.min_emb_share}, {self.max_emb_share}")



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

    enabled: bool = ranged(True, kind=bool)
    max_correction: float = ranged(0.1, lo=0, hi=0.1, lo_open=True)
    learning_rate: float = ranged(0.5, lo=0, hi=1, lo_open=True)
    leak: float = ranged(0.001, lo=0, hi=0.1, hi_open=True)
    gain: float = ranged(0.1, lo=0, hi=1, lo_open=True)
    relax: float = ranged(0.1, lo=0, hi=1)
    target_p99_over_slo: float = ranged(0.9, lo=0, hi=2, lo_open=True)
    pressure_max: float = ranged(1.0, lo=0, hi=10, lo_open=True)
    reset_on_policy_swap: bool = ranged(True, kind=bool)
    signal: str = ranged("miss_cost", choices=RESIDUAL_SIGNALS)

    def __post_init__(self) -> None:
        validate(self)


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

    enabled: bool = ranged(True, kind=bool)
    gain: float = ranged(3.0, lo=0, hi=10, lo_open=True)
    max_rate: float = ranged(0.1, lo=0, hi=0.5, lo_open=True)
    deadband: float = ranged(0.005, lo=0, hi=0.1, hi_open=True)
    headroom_floor: float = ranged(0.05, lo=0, hi=1, lo_open=True, hi_open=True)
    smoothing: float = ranged(0.5, lo=0, hi=1, lo_open=True)
    confidence: float = ranged(4.0, lo=0, hi=10)
    noise_window: int = ranged(9, lo=4, hi=64, integer=True)
    strong_gradient: float = ranged(0.1, lo=0, hi=1, lo_open=True)
    sign_confidence: float = ranged(2.0, lo=0, hi=10)
    sign_test_max_load: float = ranged(0.5, lo=0, hi=1)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class RecoveryConfig:
    """The burst recovery controller (see `RecoveryController`).

    Ratios compare the interval with slow EWMA baselines (time constant ``baseline_tau_s``, frozen
    during a burst). Enter when rate ratio >= ``enter_rate_ratio`` AND hot-user ratio ratio >=
    ``enter_hot_ratio`` (a spike of hot-user requests; not before ``warmup_s`` of baseline). Exit
    when either is <= its ``exit_*`` threshold (lower than the enter ones: hysteresis) on every
    interval for ``exit_confirm_s``, and at least ``min_hold_s`` after entry; a burst longer than
    ``max_burst_s`` is a new regime: the baselines jump to the current values and control returns.
    In a burst emb_share is capped at (split at entry - ``kv_shift``); with ``paced`` off (the
    default) a KV-ward step is then taken at once, the guards' step-down limit waived (shrinking
    the EMB slab is metadata-only, and every interval above the split the burst needs costs its
    hot users their K/V; on an overloaded node it also builds backlog), and on a saturated node
    (busy fraction at least ``CurveConfig.rho_max``) the cap is not declined by the curve (whose
    histograms still hold the reuse from before the burst). ``hot_over_arrivals`` (on
    by default): on a saturated node the hot-user ratio is that of the requests that arrived in the
    interval (`WindowStats.arrival_hot_user_ratio`, where measured), not of those completed, which
    it serves a backlog late; a node that keeps up reads the completed requests' ratio.
    ``rate_floor_rps`` and ``hot_floor`` keep the ratios finite near zero baselines.
    """

    enabled: bool = ranged(True, kind=bool)
    baseline_tau_s: float = ranged(60.0, lo=0, lo_open=True)
    warmup_s: float = ranged(10.0, lo=0)
    enter_rate_ratio: float = ranged(1.8, lo=1, lo_open=True)
    enter_hot_ratio: float = ranged(1.6, lo=1, lo_open=True)
    exit_rate_ratio: float = ranged(1.3, lo=1)
    exit_hot_ratio: float = ranged(1.3, lo=1)
    min_hold_s: float = ranged(3.0, lo=0)
    exit_confirm_s: float = ranged(1.0, lo=0)
    max_burst_s: float = ranged(60.0, lo=0, lo_open=True)
    kv_shift: float = ranged(0.15, lo=0, hi=1, lo_open=True)
    paced: bool = ranged(False, kind=bool)
    hot_over_arrivals: bool = ranged(True, kind=bool)
    rate_floor_rps: float = ranged(1.0, lo=0, lo_open=True)
    hot_floor: float = ranged(0.005, lo=0, lo_open=True)

    def __post_init__(self) -> None:
        validate(self)
        for exit_, enter in (("exit_rate_ratio", "enter_rate_ratio"), ("exit_hot_ratio", "enter_hot_ratio")):
            require(self, getattr(self, exit_) < getattr(self, enter),
                    f"need {exit_} < {enter}, got {getattr(self, exit_)}, {getattr(self, enter)}")
        require(self, self.max_burst_s > self.min_hold_s,
                f"max_burst_s ({self.max_burst_s}) must exceed min_hold_s ({self.min_hold_s})")


@dataclass(frozen=True)
class CurveConfig:
    """The curve layer's settings (`node_agent.allocator.curve`: ``move_gain`` / ``hold_gain`` the
    saving that moves the proposal to the curve's minimum / keeps it there, ``busy_move_gain`` the
    saving that moves it on a busy node (busy fraction at least ``busy_load``; set to ``move_gain`` to
    turn it off), ``jump_gain`` the saving
    over the split in force that waives the step-down limit for a KV-ward move there, ``cliff_gain`` the
    cost rise that refuses a step, ``flat_gain`` the dead band (the split in force within it of the
    curve's minimum is held; 0 turns it off), ``rho_max`` the utilisation cap of the queueing term,
    ``min_emb_refs`` / ``min_kv_lookups`` the evidence needed, ``tail`` whether the cost adds the
    tail's extra recompute (the longest histories' KV curve) to the mean time, ``saturation``
    whether the queueing term reads a saturated node's offered load and grows past ``rho_max`` at
    any share that reaches it, instead of stopping there (a saturated node then also jumps where
    the capped cost would), ``flat_holds_split`` (opt-in) whether the dead band holds the split the
    guards let through rather than the layer's own last choice), ``first_jump`` whether the layer's
    first decision on evidence waives the step-down limit to reach a KV-ward minimum it moves to
    (the split in force then has no curve behind it)."""

    enabled: bool = True
    tail: bool = True
    saturation: bool = True
    flat_holds_split: bool = False
    first_jump: bool = True
    move_gain: float = 0.25
    busy_move_gain: float = 0.1
    busy_load: float = 0.5
    hold_gain: float = 0.1
    cliff_gain: float = 0.25
    jump_gain: float = 0.5
    flat_gain: float = 0.01
    rho_max: float = 0.95
    min_emb_refs: float = 200.0
    min_kv_lookups: float = 30.0

    def __post_init__(self) -> None:
        for name in ("move_gain", "busy_move_gain", "hold_gain", "cliff_gain", "jump_gain"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 0.0 < v < 10.0):
                raise ValueError(f"CurveConfig.{name} must be in (0, 10), got {v!r}")
        if not (isinstance(self.flat_gain, (int, float)) and 0.0 <= self.flat_gain < min(self.move_gain,
                                                                                           self.busy_move_gain)):
            raise ValueError(f"CurveConfig.flat_gain must be in [0, min(move_gain, busy_move_gain)), "
                             f"got {self.flat_gain!r}")
        if not (isinstance(self.busy_load, (int, float)) and 0.0 <= self.busy_load <= 1.0):
            raise ValueError(f"CurveConfig.busy_load must be in [0, 1], got {self.busy_load!r}")
        if self.hold_gain > self.move_gain:
            raise ValueError("CurveConfig.hold_gain must be at most move_gain")
        if not (0.0 < self.rho_max < 1.0):
            raise ValueError(f"CurveConfig.rho_max must be in (0, 1), got {self.rho_max!r}")
        if not (self.min_emb_refs >= 0 and self.min_kv_lookups >= 0):
            raise ValueError("CurveConfig.min_emb_refs and min_kv_lookups must be >= 0")


@dataclass(frozen=True)
class AllocatorConfig:
    """The SmartAllocator's config: one block per layer plus the runtime's own settings.

    - ``initial_emb_share``: the split assumed before the first valid stats arrive;
    - ``device``: ``cpu`` (default: a decision takes about 17 µs on the CPU provider and would
      otherwise queue behind the serving kernels), ``cuda``, or ``auto`` (CUDA when torch sees a GPU);
    - ``intra_op_num_threads``: onnxruntime's intra-op threads (1: one decision on one core);
    - ``golden_tolerance``: max |ORT - golden| accepted when loading; None: the manifest's
      export tolerance on CPU, 1e-4 on CUDA (cuBLAS may sum in another order).
    """

    guard: GuardConfig = ranged(factory=GuardConfig, kind=GuardConfig)
    residual: ResidualConfig = ranged(factory=ResidualConfig, kind=ResidualConfig)
    recovery: RecoveryConfig = ranged(factory=RecoveryConfig, kind=RecoveryConfig)
    tuner: TunerConfig = ranged(factory=TunerConfig, kind=TunerConfig)
    curve: CurveConfig = ranged(factory=CurveConfig, kind=CurveConfig)
    initial_emb_share: float = ranged(0.5, lo=0, hi=1)
    device: str = ranged("cpu", choices=("auto", "cpu", "cuda"))
    intra_op_num_threads: int = ranged(1, lo=1, integer=True)
    golden_tolerance: float | None = ranged(None, lo=0, hi=1e-2, lo_open=True, optional=True)

    def __post_init__(self) -> None:
        validate(self)
