"""Rollouts of a policy or a model: the canary judge and the rollout state machine (pure; no clock, no I/O).

A rollout gives a candidate (a policy version, or a model checkpoint) to a canary fraction of the nodes and keeps the rest on
the active version, so canary and baseline serve the same traffic at the same time. Every control
interval each node reports one window; the judge compares the per-window values of the canary
nodes with those of the baseline nodes on two metrics, as Kayenta's Mann-Whitney judge does:

- ``slo_attainment`` (higher is better): fraction of the window's requests inside the SLO;
- ``p99_ms`` (lower is better): the window's P99 latency;
- ``model_quality`` (higher is better; judged in model rollouts only, ``MODEL_METRICS``): the
  window's mean of ``1 - rank / num_candidates`` of the item each user requested next, among the
  candidates ranked for that user's previous request (computed by the node agent).

For each metric the verdict is

- ``inconclusive`` when either side has fewer than ``min_samples`` finite window values (no data,
  or only NaN windows: a window without requests has no P99), or any figure of the test is not
  finite: never a pass;
- ``fail`` when the canary is worse with significance (one-sided Mann-Whitney U, normal
  approximation with tie and continuity correction, ``p < alpha``) *and* by more than the metric's
  guardrail (``max_p99_regression_pct`` on the relative change of the median P99,
  ``max_slo_attainment_drop`` / ``max_model_quality_drop`` on the difference of the means): a
  difference must be both real and large enough to matter. ``alpha`` is shared by the judged
  metrics (Bonferroni: each is tested at ``alpha / number of metrics``), so a canary no different from the baseline is failed with probability
  at most ``alpha``;
- ``inconclusive`` too when the canary is worse by more than the guardrail but not significantly
  (a regression is never passed for want of windows): the bake goes on for them, up to
  ``max_bake_factor`` times ``bake_time_s``;
- ``pass`` otherwise.

The rollout's verdict is the worst of the metrics' (fail > inconclusive > pass, as Argo Rollouts
ranks analysis phases). The action depends on the state (see `evaluate_rollout`):

    pending ──bake──▶ baking ──promote──▶ promoted
       │                │ ╲──rollback──▶ rolled_back
       │                ╰──pause──▶ paused ──resume──▶ baking
       ╰──rollback (candidate failed to load)──▶ rolled_back

Operators may promote, pause or roll back any rollout that has not ended, and resume a paused one
(`apply_event`). Every transition returns a `RolloutStep` (from, to, event, actor, reason, time)
for the rollout's history.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np

from common.config import ranged, validate


class RolloutState(str, Enum):
    """Where a rollout is. ``promoted`` and ``rolled_back`` are final."""

    PENDING = "pending"  # candidate handed to the canary nodes; waiting for them to confirm loading it
    BAKING = "baking"  # canary nodes run the candidate; collecting windows until the bake time has passed
    PAUSED = "paused"  # judged inconclusive or paused by an operator; waits for an operator
    PROMOTED = "promoted"  # the candidate became the active version on every node
    ROLLED_BACK = "rolled_back"  # canary nodes went back to the active version


TERMINAL_STATES = frozenset({RolloutState.PROMOTED, RolloutState.ROLLED_BACK})


class Verdict(str, Enum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


_VERDICT_ORDER = {Verdict.PASS: 0, Verdict.INCONCLUSIVE: 1, Verdict.FAIL: 2}


class Action(str, Enum):
    """What the judge asks for. ``bake`` starts the bake clock once the canary nodes loaded the candidate."""

    WAIT = "wait"
    BAKE = "bake"
    PROMOTE = "promote"
    ROLLBACK = "rollback"
    PAUSE = "pause"


class NodeLoad(str, Enum):
    """A canary node's answer to the candidate version."""

    ASSIGNED = "assigned"  # told to load it, no confirmation yet
    LOADED = "loaded"  # confirmed it runs the candidate
    FAILED = "failed"  # could not load it and keeps the active version


@dataclass(frozen=True)
class RolloutConfig:
    """Guardrails and timing of the canary judge (one per rollout; validated).

    - ``bake_time_s``: how long the canary runs the candidate before it is judged;
    - ``min_samples``: fewest finite per-window values per side (canary, baseline) per metric;
    - ``alpha``: the chance of failing a canary that is no different from the baseline (each of the
      judged metrics' one-sided Mann-Whitney tests runs at ``alpha`` over their number);
    - ``max_p99_regression_pct``: the largest tolerated rise of the canary's median window P99 over
      the baseline's, in percent;
    - ``max_slo_attainment_drop``: the largest tolerated fall of the canary's mean window SLO
      attainment below the baseline's (absolute, attainment is a 0-1 fraction);
    - ``load_timeout_s``: canary nodes that have not confirmed loading the candidate this long after
      the rollout started count as failed;
    - ``max_failed_canary_fraction``: the largest fraction of canary nodes that may fail to load the
      candidate before the rollout is rolled back (0: any load failure rolls back);
    - ``max_model_quality_drop``: the largest tolerated fall of the canary's mean window model
      quality below the baseline's (absolute, quality is in [0, 1]; model rollouts only);
    - ``max_bake_factor``: while the canary is worse past a guardrail but not significantly (a
      pass would ship a regression, a pause would wait for an operator), the bake goes on, up to
      ``bake_time_s`` times this, judged again every period; then it pauses;
    - ``warmup_s``: the first seconds of the bake whose windows are not judged, on either side: a
      canary starts with cold caches (a new model drops every user's K/V; a new policy moves the
      split), a cost of any change that would otherwise be charged to the candidate; None (the
      default): a fifth of ``bake_time_s``. At most ``bake_time_s``.
    """

    bake_time_s: float = ranged(300.0, lo=0)
    min_samples: int = ranged(10, lo=3, integer=True)
    alpha: float = ranged(0.01, lo=0, hi=0.5, lo_open=True)
    max_p99_regression_pct: float = ranged(10.0, lo=0)
    max_slo_attainment_drop: float = ranged(0.02, lo=0, hi=1)
    load_timeout_s: float = ranged(120.0, lo=0)
    max_failed_canary_fraction: float = ranged(0.0, lo=0, hi=1)
    max_model_quality_drop: float = ranged(0.02, lo=0, hi=1)
    max_bake_factor: float = ranged(4.0, lo=1)
    warmup_s: float | None = ranged(None, lo=0, optional=True)

    def __post_init__(self) -> None:
        validate(self)
        if self.warmup_s is not None and self.warmup_s > self.bake_time_s:
            raise ValueError(f"warmup_s ({self.warmup_s:g} s) must be at most bake_time_s ({self.bake_time_s:g} s): "
                             "the bake would end before any window is judged")

    @property
    def warmup(self) -> float:
        """Seconds from the start of the bake before windows are judged (`warmup_s`)."""
        return self.bake_time_s / 5.0 if self.warmup_s is None else self.warmup_s


# --------------------------------------------------------------------------------------------
# Mann-Whitney U


@dataclass(frozen=True)
class MannWhitney:
    """``u`` is the U statistic of ``x`` (pairs with x > y, ties counting one half)."""

    u: float
    z: float
    p_value: float
    n_x: int
    n_y: int
    alternative: str


def rank_average(values: np.ndarray) -> np.ndarray:
    """1-based ranks of ``values``, ties sharing the mean of the ranks they span."""
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, kind="mergesort")
    sorted_v = values[order]
    # start index of each run of equal values
    starts = np.flatnonzero(np.r_[True, sorted_v[1:] != sorted_v[:-1]])
    ends = np.r_[starts[1:], len(sorted_v)]
    avg = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks_sorted = np.repeat(avg, ends - starts)
    ranks = np.empty_like(ranks_sorted)
    ranks[order] = ranks_sorted
    return ranks


def _normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def mann_whitney_u(x: Sequence[float], y: Sequence[float], alternative: str = "two-sided",
                   continuity: bool = True) -> MannWhitney:
    """Mann-Whitney U test of ``x`` against ``y`` by the normal approximation.

    ``alternative``: ``"greater"`` (x tends to be larger than y), ``"less"`` or ``"two-sided"``.
    The variance carries the tie correction
    ``n_x n_y / 12 * ((n + 1) - sum(t^3 - t) / (n (n - 1)))`` over the tie groups of sizes ``t``,
    and ``continuity`` shifts ``|U - mean|`` by 0.5 toward the mean (as scipy's default does).
    When every value is equal the variance is 0 and there is no evidence either way: ``z = 0``,
    ``p = 1``. Values must be finite and both samples non-empty.
    """
    if alternative not in ("greater", "less", "two-sided"):
        raise ValueError(f"alternative must be 'greater', 'less' or 'two-sided', got {alternative!r}")
    xa = np.asarray(x, dtype=np.float64).ravel()
    ya = np.asarray(y, dtype=np.float64).ravel()
    n_x, n_y = len(xa), len(ya)
    if n_x == 0 or n_y == 0:
        raise ValueError(f"mann_whitney_u needs two non-empty samples, got sizes {n_x} and {n_y}")
    if not (np.isfinite(xa).all() and np.isfinite(ya).all()):
        raise ValueError("mann_whitney_u needs finite values (drop NaN windows first)")
    n = n_x + n_y
    ranks = rank_average(np.concatenate([xa, ya]))
    u = float(ranks[:n_x].sum() - n_x * (n_x + 1) / 2.0)
    mean = n_x * n_y / 2.0
    _, counts = np.unique(np.concatenate([xa, ya]), return_counts=True)
    tie_term = float((counts.astype(np.float64) ** 3 - counts).sum())
    var = n_x * n_y / 12.0 * ((n + 1) - tie_term / (n * (n - 1))) if n > 1 else 0.0
    if var <= 0.0:
        return MannWhitney(u=u, z=0.0, p_value=1.0, n_x=n_x, n_y=n_y, alternative=alternative)
    sd = math.sqrt(var)
    cc = 0.5 if continuity else 0.0
    if alternative == "greater":
        z = (u - mean - cc) / sd
        p = _normal_sf(z)
    elif alternative == "less":
        z = (u - mean + cc) / sd
        p = 1.0 - _normal_sf(z)
    else:
        z = (abs(u - mean) - cc) / sd
        z = max(z, 0.0)
        p = min(1.0, 2.0 * _normal_sf(z))
        z = math.copysign(z, u - mean) if u != mean else 0.0
    return MannWhitney(u=u, z=float(z), p_value=float(min(max(p, 0.0), 1.0)), n_x=n_x, n_y=n_y,
                       alternative=alternative)


# --------------------------------------------------------------------------------------------
# The judge


@dataclass(frozen=True)
class WindowSamples:
    """Per-window values of one side (canary or baseline), pooled over that side's nodes."""

    slo_attainment: Sequence[float] = ()
    p99_ms: Sequence[float] = ()
    model_quality: Sequence[float] = ()


METRICS = ("slo_attainment", "p99_ms")  # what a policy rollout is judged on
MODEL_METRICS = ("slo_attainment", "p99_ms", "model_quality")  # a model rollout: latency and quality
_ALL_METRICS = MODEL_METRICS


@dataclass(frozen=True)
class RolloutStats:
    """What the judge sees at one evaluation.

    ``bake_started_at_s`` is when the rollout entered ``baking`` (None before); ``canary_nodes``
    maps each canary node to its `NodeLoad`; samples hold only windows reported while the node ran
    the version of its side (the control plane selects them).
    """

    state: RolloutState
    started_at_s: float
    canary: WindowSamples = field(default_factory=WindowSamples)
    baseline: WindowSamples = field(default_factory=WindowSamples)
    canary_nodes: Mapping[str, NodeLoad] = field(default_factory=dict)
    bake_started_at_s: float | None = None
    pause_reason: str = ""
    metrics: tuple[str, ...] = METRICS  # the judged metrics: METRICS (policy) or MODEL_METRICS (model)


@dataclass(frozen=True)
class MetricJudgement:
    """One metric's comparison, with every figure the dashboard shows."""

    metric: str
    verdict: Verdict
    reason: str
    n_canary: int
    n_baseline: int
    num_dropped_canary: int  # non-finite windows left out
    num_dropped_baseline: int
    median_canary: float | None
    median_baseline: float | None
    mean_canary: float | None
    mean_baseline: float | None
    change: float | None  # p99_ms: relative change of the medians in %; the others: drop of the means
    p_value: float | None  # one-sided, "canary worse"
    u: float | None
    #: inconclusive because the canary is worse past the guardrail but not yet significantly:
    #: the bake goes on (up to ``bake_time_s * max_bake_factor``) for the windows that decide it
    worse_unproven: bool = False


@dataclass(frozen=True)
class RolloutAction:
    """The judge's answer: what to do, the verdict it rests on, why, and the figures."""

    action: Action
    verdict: Verdict | None  # None while nothing was judged (pending, baking, paused)
    reason: str
    judgements: tuple[MetricJudgement, ...] = ()
    failed_nodes: tuple[str, ...] = ()
    loaded_nodes: tuple[str, ...] = ()
    bake_elapsed_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures (enums as their values) for storage and the dashboard."""
        return {
            "action": self.action.value,
            "verdict": None if self.verdict is None else self.verdict.value,
            "reason": self.reason,
            "failed_nodes": list(self.failed_nodes),
            "loaded_nodes": list(self.loaded_nodes),
            "bake_elapsed_s": self.bake_elapsed_s,
            "judgements": [{**asdict(j), "verdict": j.verdict.value} for j in self.judgements],
        }


def _finite(values: Sequence[float]) -> tuple[np.ndarray, int]:
    try:
        a = np.asarray(list(values), dtype=np.float64).ravel()
    except (TypeError, ValueError):
        raise ValueError("window values must be numbers") from None
    keep = np.isfinite(a)
    return a[keep], int((~keep).sum())


def judge_metric(metric: str, canary: Sequence[float], baseline: Sequence[float],
                 config: RolloutConfig, alpha: float | None = None) -> MetricJudgement:
    """Compare one metric's canary windows with the baseline's (see the module docstring).

    ``alpha`` is this test's significance level, ``config.alpha / len(METRICS)`` unless given.
    """
    alpha = config.alpha / len(METRICS) if alpha is None else alpha
    if metric not in _ALL_METRICS:
        raise ValueError(f"metric must be one of {_ALL_METRICS}, got {metric!r}")
    c, drop_c = _finite(canary)
    b, drop_b = _finite(baseline)
    base = dict(metric=metric, n_canary=len(c), n_baseline=len(b), num_dropped_canary=drop_c,
                num_dropped_baseline=drop_b)
    med_c = float(np.median(c)) if len(c) else None
    med_b = float(np.median(b)) if len(b) else None
    mean_c = float(c.mean()) if len(c) else None
    mean_b = float(b.mean()) if len(b) else None
    figs = dict(median_canary=med_c, median_baseline=med_b, mean_canary=mean_c, mean_baseline=mean_b)
    if len(c) < config.min_samples or len(b) < config.min_samples:
        dropped = f" ({drop_c} canary and {drop_b} baseline windows without a value left out)" if drop_c or drop_b else ""
        return MetricJudgement(verdict=Verdict.INCONCLUSIVE, **base, **figs, change=None, p_value=None, u=None,
                               reason=f"{metric}: too few windows: canary {len(c)}, baseline {len(b)}, "
                                      f"need {config.min_samples} on each side{dropped}")
    if metric == "p99_ms":
        # canary worse = canary larger
        test = mann_whitney_u(c, b, alternative="greater")
        change = (med_c - med_b) / med_b * 100.0 if med_b > 0 else math.nan  # a 0 ms baseline P99: no scale
        limit = config.max_p99_regression_pct
        big = change > limit
        effect = f"median P99 {med_c:.3f} ms vs {med_b:.3f} ms ({change:+.1f} %, limit +{limit:g} %)"
    else:
        # canary worse = canary smaller
        test = mann_whitney_u(c, b, alternative="less")
        change = mean_b - mean_c
        limit = config.max_slo_attainment_drop if metric == "slo_attainment" else config.max_model_quality_drop
        big = change > limit
        what = "SLO attainment" if metric == "slo_attainment" else "model quality"
        effect = f"mean {what} {mean_c:.4f} vs {mean_b:.4f} (drop {change:+.4f}, limit {limit:g})"
    figs_all = dict(**figs, change=float(change), p_value=test.p_value, u=test.u)
    numbers = [med_c, med_b, mean_c, mean_b, test.p_value, test.u]
    if not all(math.isfinite(v) for v in numbers + [change]):
        figs_all = {k: (v if v is None or math.isfinite(v) else None) for k, v in figs_all.items()}
        return MetricJudgement(verdict=Verdict.INCONCLUSIVE, **base, **figs_all,
                               reason=f"{metric}: a figure is not finite ({effect}, p={test.p_value})")
    significant = test.p_value < alpha
    sig = f"p={test.p_value:.3g} {'<' if significant else '>='} {alpha:g}"
    if significant and big:
        return MetricJudgement(verdict=Verdict.FAIL, **base, **figs_all,
                               reason=f"{metric}: canary worse: {effect}; {sig}; n={len(c)}/{len(b)}")
    if big:  # worse by more than the guardrail, not significant yet: never a pass
        return MetricJudgement(verdict=Verdict.INCONCLUSIVE, **base, **figs_all, worse_unproven=True,
                               reason=f"{metric}: canary worse past the guardrail but not significant yet: {effect}; "
                                      f"{sig}; n={len(c)}/{len(b)}")
    return MetricJudgement(verdict=Verdict.PASS, **base, **figs_all,
                           reason=f"{metric}: within the guardrail: {effect}; {sig}; n={len(c)}/{len(b)}")


def judge(canary: WindowSamples, baseline: WindowSamples, config: RolloutConfig,
          metrics: Sequence[str] = METRICS) -> tuple[Verdict, tuple[MetricJudgement, ...]]:
    """Each of ``metrics``' judgements (each tested at ``alpha / len(metrics)``) and the worst verdict."""
    alpha = config.alpha / len(metrics)
    js = tuple(judge_metric(m, getattr(canary, m), getattr(baseline, m), config, alpha=alpha) for m in metrics)
    worst = max((j.verdict for j in js), key=_VERDICT_ORDER.__getitem__)
    return worst, js


def evaluate_rollout(stats: RolloutStats, now_s: float, config: RolloutConfig | None = None) -> RolloutAction:
    """The action a rollout needs now.

    - final states: ``wait`` (nothing left to do);
    - no canary node: inconclusive -> ``pause``;
    - pending or baking: too many canary nodes failed to load the candidate (``max_failed_canary_fraction``;
      after ``load_timeout_s`` an unconfirmed node counts as failed) -> ``rollback``;
    - ``pending``: every canary node answered (loaded or failed) -> ``bake``, else ``wait``;
    - ``baking``: before ``bake_time_s`` -> ``wait``; then the verdict decides: pass -> ``promote``,
      fail -> ``rollback``, inconclusive -> ``pause`` (an operator decides, as in Argo Rollouts);
    - ``paused``: ``wait`` for an operator (the reason says why it paused), load failures included.
    """
    config = config or RolloutConfig()
    if not math.isfinite(now_s):
        raise ValueError(f"now_s must be finite, got {now_s!r}")
    state = RolloutState(stats.state)
    if state in TERMINAL_STATES:
        return RolloutAction(Action.WAIT, None, f"rollout {state.value}; nothing to do")
    loads = {str(k): NodeLoad(v) for k, v in stats.canary_nodes.items()}
    timed_out = now_s - stats.started_at_s >= config.load_timeout_s
    failed = sorted(n for n, s in loads.items() if s is NodeLoad.FAILED or (timed_out and s is NodeLoad.ASSIGNED))
    loaded = sorted(n for n, s in loads.items() if s is NodeLoad.LOADED)
    waiting = sorted(n for n, s in loads.items() if s is NodeLoad.ASSIGNED and not timed_out)
    common = dict(failed_nodes=tuple(failed), loaded_nodes=tuple(loaded))
    if not loads:
        if state is RolloutState.PAUSED:
            return RolloutAction(Action.WAIT, None, "paused: the rollout has no canary node", **common)
        return RolloutAction(Action.PAUSE, Verdict.INCONCLUSIVE, "inconclusive: the rollout has no canary node",
                             **common)
    if state is RolloutState.PAUSED:
        return RolloutAction(Action.WAIT, None, f"paused: {stats.pause_reason or 'by an operator'}; "
                                                "waiting for an operator to resume, promote or roll back", **common)
    if failed:
        frac = len(failed) / len(loads)
        if frac > config.max_failed_canary_fraction or (not loaded and not waiting):
            late = (" (a node that did not confirm within load_timeout_s "
                    f"{config.load_timeout_s:g} s counts as failed)") if timed_out else ""
            return RolloutAction(Action.ROLLBACK, Verdict.FAIL,
                                 f"fail: candidate failed to load on {len(failed)} of {len(loads)} canary nodes "
                                 f"({', '.join(failed)}); at most {config.max_failed_canary_fraction:g} of them "
                                 f"may fail{late}", **common)
    if state is RolloutState.PENDING:
        if waiting:
            return RolloutAction(Action.WAIT, None,
                                 f"waiting for {len(waiting)} of {len(loads)} canary nodes to confirm the candidate "
                                 f"({', '.join(waiting)})", **common)
        return RolloutAction(Action.BAKE, None,
                             f"{len(loaded)} of {len(loads)} canary nodes loaded the candidate; baking "
                             f"{config.bake_time_s:g} s", **common)
    # baking
    if stats.bake_started_at_s is None:
        raise ValueError("a baking rollout needs bake_started_at_s")
    elapsed = now_s - stats.bake_started_at_s
    if elapsed < config.bake_time_s:
        return RolloutAction(Action.WAIT, None, f"baking: {elapsed:.0f} s of {config.bake_time_s:g} s",
                             bake_elapsed_s=elapsed, **common)
    verdict, js = judge(stats.canary, stats.baseline, config, stats.metrics)
    detail = "; ".join(j.reason for j in js if j.verdict is verdict)
    longest = config.bake_time_s * config.max_bake_factor
    if verdict is Verdict.INCONCLUSIVE and elapsed < longest and all(
            j.worse_unproven for j in js if j.verdict is Verdict.INCONCLUSIVE):
        return RolloutAction(Action.WAIT, None, f"baking on ({elapsed:.0f} s of at most {longest:g} s): {detail}",
                             judgements=js, bake_elapsed_s=elapsed, **common)
    action = {Verdict.PASS: Action.PROMOTE, Verdict.FAIL: Action.ROLLBACK, Verdict.INCONCLUSIVE: Action.PAUSE}[verdict]
    return RolloutAction(action, verdict, f"{verdict.value}: {detail}", judgements=js, bake_elapsed_s=elapsed, **common)


# --------------------------------------------------------------------------------------------
# The state machine


class InvalidTransition(ValueError):
    """An event that the rollout's state does not allow (the API answers 409 with the message)."""


EVENTS = ("bake", "promote", "rollback", "pause", "resume")

# event -> states it may leave
_ALLOWED: dict[str, frozenset[RolloutState]] = {
    "bake": frozenset({RolloutState.PENDING}),
    "promote": frozenset({RolloutState.PENDING, RolloutState.BAKING, RolloutState.PAUSED}),
    "rollback": frozenset({RolloutState.PENDING, RolloutState.BAKING, RolloutState.PAUSED}),
    "pause": frozenset({RolloutState.PENDING, RolloutState.BAKING}),
    "resume": frozenset({RolloutState.PAUSED}),
}
_TARGET = {"bake": RolloutState.BAKING, "promote": RolloutState.PROMOTED, "rollback": RolloutState.ROLLED_BACK,
           "pause": RolloutState.PAUSED, "resume": RolloutState.BAKING}


@dataclass(frozen=True)
class RolloutStatus:
    """A rollout's state and clocks (what the rollouts table stores)."""

    state: RolloutState
    started_at_s: float
    updated_at_s: float
    bake_started_at_s: float | None = None
    paused_from: RolloutState | None = None  # the state a pause left, to resume into
    reason: str = ""

    @staticmethod
    def new(now_s: float, reason: str = "created") -> RolloutStatus:
        return RolloutStatus(RolloutState.PENDING, started_at_s=now_s, updated_at_s=now_s, reason=reason)


@dataclass(frozen=True)
class RolloutStep:
    """One transition, for the rollout's history (and the audit log when an operator made it)."""

    from_state: RolloutState
    to_state: RolloutState
    event: str
    actor: str  # "judge" or the operator's name
    reason: str
    at_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"from_state": self.from_state.value, "to_state": self.to_state.value, "event": self.event,
                "actor": self.actor, "reason": self.reason, "at_s": self.at_s}


def apply_event(status: RolloutStatus, event: str, now_s: float, *, actor: str = "judge",
                reason: str = "") -> tuple[RolloutStatus, RolloutStep]:
    """The rollout after ``event``; raises `InvalidTransition` (saying which states allow it) if not allowed.

    ``resume`` goes back to ``baking`` (a rollout paused while pending resumes into pending) and
    keeps the bake clock: the judge decides at once on everything collected so far, and pauses
    again if that is still inconclusive.
    """
    if event not in _ALLOWED:
        raise InvalidTransition(f"unknown rollout event {event!r}; known: {', '.join(EVENTS)}")
    state = RolloutState(status.state)
    if state not in _ALLOWED[event]:
        allowed = ", ".join(s.value for s in sorted(_ALLOWED[event], key=lambda s: s.value))
        raise InvalidTransition(f"cannot {event} a rollout that is {state.value} (allowed from: {allowed})")
    target = _TARGET[event]
    new = replace(status, state=target, updated_at_s=now_s, reason=reason or event)
    if event == "bake":
        new = replace(new, bake_started_at_s=now_s)
    elif event == "pause":
        new = replace(new, paused_from=state)
    elif event == "resume":
        back = status.paused_from or RolloutState.BAKING
        if back is RolloutState.PENDING or status.bake_started_at_s is None:
            back = RolloutState.PENDING
        new = replace(new, state=back, paused_from=None)
        target = back
    return new, RolloutStep(from_state=state, to_state=target, event=event, actor=actor, reason=new.reason, at_s=now_s)


def apply_action(status: RolloutStatus, action: RolloutAction, now_s: float
                 ) -> tuple[RolloutStatus, RolloutStep | None]:
    """Carry out the judge's action: the new status and its step, or ``(status, None)`` for ``wait``."""
    if action.action is Action.WAIT:
        return status, None
    return apply_event(status, action.action.value, now_s, actor="judge", reason=action.reason)
