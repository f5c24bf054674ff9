"""The feature contract: one control interval on one node -> the policy's state vector.

The same `build_features` runs in PPO training, in the simulator and in the node agent, so a
policy trained offline sees exactly the numbers it will see in production. It is pure (no clock,
no globals that change), cheap (a few microseconds: straight-line float arithmetic written into a
caller-supplied float32 buffer) and validating: a `WindowStats` with a NaN, an infinity, a value
of the wrong type or out of its range raises `FeatureError` naming every offending field. Nothing
is silently replaced: a node agent that gets a `FeatureError` holds its current split (the
allocator records that as a `guard` decision) instead of feeding garbage to the policy.

Normalisation (the constants below are part of the schema; changing one, or the order or meaning of
a feature, means a new `SCHEMA_VERSION`, and a policy trained on another version is refused):

- rates, lengths and per-unit costs span orders of magnitude: ``log1p(x) / log1p(REF)``, clipped
  to ``[0, LOG_FEATURE_MAX]``, so the reference value maps to 1;
- ratios (hit rates, hot-user ratio, emb_share, load, the KV share of the miss cost) are already
  in ``[0, 1]`` and pass through unchanged;
- ``p99_over_slo`` is ``p99_ms / slo_ms`` clipped to ``[0, P99_OVER_SLO_MAX]`` (1 = at the SLO);
- ``refill_fraction`` is ``refill_bytes / arena_bytes`` clipped to ``[0, 1]``;
- the two burst indicators are differences against the previous interval (``prev``): the hot-user
  ratio's difference in ``[-1, 1]`` and the log-rate feature's difference, in
  ``[-LOG_FEATURE_MAX, LOG_FEATURE_MAX]`` since both terms are clipped; both are 0 when ``prev``
  is None (first interval).

Schema 3 appends six features **normalised by the node's cost profile and arena size**, so that the
same number means the same thing on any model, node or arena (one policy for every setting; the
first 16 are schema 2's, unchanged, so a schema-2 policy is the schema-3 policy that ignores the
six: `SCHEMA_PREFIX`):

- arena size: ``table_over_arena_log`` (the embedding table's bytes over the arena's, log-scaled:
  how much of the table the arena could ever hold) and ``arena_users_log`` (how many median
  users' K/V fit in the arena, log-scaled); both 0 when the producer does not know the table's or
  a token's bytes (``table_bytes`` / ``kv_bytes_per_token`` left 0);
- cost profile: with ``busy_us = load * interval_s * 1e6 / num_requests`` (the node's device time
  per completed request), the expected miss time per request of each cache (`miss_costs_us`) and
  the marginal utility of 10% more arena for each cache (its ghost list, `marginal_utility_us`),
  each over ``busy_us``: shares of a request's device time, clipped to ``[0, 1]``, 0 when the node
  completed nothing or was never busy. Priced at the node's own profiled costs and counted per
  10% of its own arena, they carry no unit: a policy reads "KV misses take 60% of the device
  time, and 10% more KV pool would save 8% of it" the same way on an A100 and on a CPU.

The table in docs/allocator.md lists the features in order, generated from `FEATURE_SPECS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from common.shares import top_share  # noqa: F401  (the window statistics' hot-user ratio)

SCHEMA_VERSION = 3  # the feature contract's version (docs/allocator.md, "Feature contract")
SCHEMA_PREFIX = {2: 16}  # an older schema whose features are this schema's first N, unchanged

# normalisation references (part of the schema)
RATE_REF_RPS = 100_000.0
HISTORY_LEN_REF = 16_384.0
EMB_LOOKUPS_REF = 16_384.0
COST_REF_US = 100.0
LOG_FEATURE_MAX = 2.0
P99_OVER_SLO_MAX = 4.0
TABLE_OVER_ARENA_REF = 1_000.0
ARENA_USERS_REF = 10_000.0

_LOG_RATE_REF = math.log1p(RATE_REF_RPS)
_LOG_HISTORY_REF = math.log1p(HISTORY_LEN_REF)
_LOG_LOOKUPS_REF = math.log1p(EMB_LOOKUPS_REF)
_LOG_COST_REF = math.log1p(COST_REF_US)
_LOG_TABLE_REF = math.log1p(TABLE_OVER_ARENA_REF)
_LOG_USERS_REF = math.log1p(ARENA_USERS_REF)


class FeatureError(ValueError):
    """A `WindowStats` that cannot be turned into features; ``problems`` lists every bad field."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid WindowStats: " + "; ".join(self.problems))


@dataclass(frozen=True, slots=True)
class WindowStats:
    """What one node measured over one control interval ``[start, now]`` (a snapshot).

    Produced in one place, `node_agent.control.WindowAccumulator.close_window`, for the node agent
    and the simulator alike (these definitions are the contract; schema 2). "Completed" requests
    are those of the batches whose service ended inside the interval.

    - ``interval_s``: length of the interval, seconds (> 0);
    - ``num_requests``: requests completed in the interval (>= 0);
    - ``arrival_rate_rps``: requests that arrived at the node (were accepted) in the interval, per
      second (>= 0);
    - ``hot_user_ratio``: share of the completed requests sent by the top 1% of their distinct
      users, ranked by request count (at least one user; `top_share`); in [0, 1];
    - ``history_len_p50`` / ``history_len_p99``: percentiles of the completed requests' history
      lengths, tokens (p50 <= p99);
    - ``emb_lookups_per_request``: embedding rows the completed batches looked up (history items
      the KV cache did not cover, new items, candidates) per completed request;
    - ``emb_hit_rate``: share of those rows served by the EMB hot cache, in [0, 1];
    - ``kv_hit_rate``: share of the completed requests' history tokens whose K/V came from the KV
      cache (not recomputed), in [0, 1];
    - ``kv_recompute_us_per_token``: the node's profiled recompute cost, µs per token, at the
      interval's ``history_len_p50`` (nearest profiled length; a single profiled number as is);
      ``emb_transfer_us_per_row``: its profiled host -> device cost per row, µs (>= 0);
    - ``emb_share``: the split in effect at the end of the interval, in [0, 1];
    - ``load``: the **busy fraction**: seconds the node's device spent serving batches within the
      interval over ``interval_s``, clipped to [0, 1] (the node agent measures its device
      worker's time in ``serve_batch``; the simulator its batches' modelled durations);
    - ``p99_ms``: P99 of the completed requests' latencies (finish - arrival), ms (0 when none);
    - ``slo_ms``: the latency SLO, ms (> 0);
    - ``refill_bytes``: bytes the memory manager copied host -> device in the background to fill
      newly granted EMB pages in the interval (>= 0); ``arena_bytes``: the HBM arena's size (> 0);
    - ``emb_marginal_us`` / ``kv_marginal_us`` (optional, default 0; not policy features): the
      marginal utility of memory for the EMB slab / the KV pool: busy time per request that 10%
      more of the arena would have saved, read from the caches' ghost lists
      (`node_agent.memory.MemoryConfig.ghost_probes`) with `marginal_utility_us` (>= 0); 0 when
      the ghost lists are off;
    - ``table_bytes`` (optional, default 0: unknown): the embedding table's bytes (rows x row
      bytes); ``kv_bytes_per_token`` (optional, default 0: unknown): K and V bytes of one history
      token (all layers); both >= 0, read from the node's `MemoryConfig`;
    - ``arrival_hot_user_ratio`` (optional, default 0: not measured; not a policy feature): the
      hot-user ratio of the requests that *arrived* in the interval (``hot_user_ratio`` counts
      those completed, which on a saturated node arrived a backlog earlier), in [0, 1]; the burst
      detector reads it (`RecoveryConfig.hot_over_arrivals`).
    """

    interval_s: float
    num_requests: int
    arrival_rate_rps: float
    hot_user_ratio: float
    history_len_p50: float
    history_len_p99: float
    emb_lookups_per_request: float
    emb_hit_rate: float
    kv_hit_rate: float
    kv_recompute_us_per_token: float
    emb_transfer_us_per_row: float
    emb_share: float
    load: float
    p99_ms: float
    slo_ms: float
    refill_bytes: float
    arena_bytes: float
    emb_marginal_us: float = 0.0
    kv_marginal_us: float = 0.0
    table_bytes: float = 0.0
    kv_bytes_per_token: float = 0.0
    arrival_hot_user_ratio: float = 0.0

    def problems(self) -> list[str]:
        """Every violated constraint, as readable lines (empty when the snapshot is valid)."""
        out: list[str] = []
        bad_type: set[str] = set()
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                out.append(f"{f.name} must be a number, got {v!r}")
                bad_type.add(f.name)
            elif not math.isfinite(v):
                out.append(f"{f.name} must be finite, got {v!r}")
                bad_type.add(f.name)

        def check(name: str, ok, rule: str) -> None:
            if name not in bad_type and not ok(getattr(self, name)):
                out.append(f"{name} must be {rule}, got {getattr(self, name)!r}")

        for name in ("interval_s", "slo_ms", "arena_bytes"):
            check(name, lambda v: v > 0, "> 0")
        for name in ("num_requests", "arrival_rate_rps", "history_len_p50", "history_len_p99",
                     "emb_lookups_per_request", "kv_recompute_us_per_token", "emb_transfer_us_per_row",
                     "p99_ms", "refill_bytes", "emb_marginal_us", "kv_marginal_us", "table_bytes",
                     "kv_bytes_per_token"):
            check(name, lambda v: v >= 0, ">= 0")
        for name in ("hot_user_ratio", "emb_hit_rate", "kv_hit_rate", "emb_share", "load", "arrival_hot_user_ratio"):
            check(name, lambda v: 0 <= v <= 1, "in [0, 1]")
        if "num_requests" not in bad_type and float(self.num_requests) != int(self.num_requests):
            out.append(f"num_requests must be a whole number, got {self.num_requests!r}")
        if not ({"history_len_p50", "history_len_p99"} & bad_type) and self.history_len_p50 > self.history_len_p99:
            out.append(f"history_len_p50 must be <= history_len_p99, got {self.history_len_p50!r} > "
                       f"{self.history_len_p99!r}")
        return out

    def validate(self) -> None:
        """Raise `FeatureError` listing every problem; return None when valid."""
        p = self.problems()
        if p:
            raise FeatureError(p)


@dataclass(frozen=True)
class FeatureSpec:
    name: str
    normalisation: str
    low: float
    high: float


FEATURE_SPECS: tuple[FeatureSpec, ...] = (
    FeatureSpec("arrival_rate_log", "log1p(arrival_rate_rps) / log1p(1e5), clipped", 0.0, LOG_FEATURE_MAX),
    FeatureSpec("hot_user_ratio", "hot_user_ratio", 0.0, 1.0),
    FeatureSpec("history_len_p50_log", "log1p(history_len_p50) / log1p(16384), clipped", 0.0, LOG_FEATURE_MAX),
    FeatureSpec("history_len_p99_log", "log1p(history_len_p99) / log1p(16384), clipped", 0.0, LOG_FEATURE_MAX),
    FeatureSpec("emb_lookups_log", "log1p(emb_lookups_per_request) / log1p(16384), clipped", 0.0, LOG_FEATURE_MAX),
    FeatureSpec("emb_hit_rate", "emb_hit_rate", 0.0, 1.0),
    FeatureSpec("kv_hit_rate", "kv_hit_rate", 0.0, 1.0),
    FeatureSpec("kv_recompute_cost_log", "log1p(kv_recompute_us_per_token) / log1p(100), clipped", 0.0,
                LOG_FEATURE_MAX),
    FeatureSpec("emb_transfer_cost_log", "log1p(emb_transfer_us_per_row) / log1p(100), clipped", 0.0, LOG_FEATURE_MAX),
    FeatureSpec("kv_miss_cost_share", "kv_miss_us / (kv_miss_us + emb_miss_us), 0.5 when both are 0 "
                "(see miss_costs_us)", 0.0, 1.0),
    FeatureSpec("emb_share", "emb_share (in effect during the interval)", 0.0, 1.0),
    FeatureSpec("load", "load", 0.0, 1.0),
    FeatureSpec("p99_over_slo", "p99_ms / slo_ms, clipped to [0, 4]", 0.0, P99_OVER_SLO_MAX),
    FeatureSpec("refill_fraction", "refill_bytes / arena_bytes, clipped to [0, 1]", 0.0, 1.0),
    FeatureSpec("hot_user_ratio_delta", "hot_user_ratio - prev.hot_user_ratio (0 without prev)", -1.0, 1.0),
    FeatureSpec("arrival_rate_log_delta", "arrival_rate_log - prev's arrival_rate_log (both in [0, 2]; 0 without prev)",
                -LOG_FEATURE_MAX, LOG_FEATURE_MAX),
    # schema 3: normalised by the node's cost profile and arena size
    FeatureSpec("table_over_arena_log", "log1p(table_bytes / arena_bytes) / log1p(1e3), clipped (0: unknown)", 0.0,
                LOG_FEATURE_MAX),
    FeatureSpec("arena_users_log", "log1p(arena_bytes / (history_len_p50 * kv_bytes_per_token)) / log1p(1e4), clipped "
                "(0: unknown or no history)", 0.0, LOG_FEATURE_MAX),
    FeatureSpec("kv_miss_time_frac", "kv_miss_us / busy_us (busy_us = load * interval_s * 1e6 / num_requests), "
                "clipped to [0, 1]; 0 without requests or busy time", 0.0, 1.0),
    FeatureSpec("emb_miss_time_frac", "emb_miss_us / busy_us, clipped to [0, 1]", 0.0, 1.0),
    FeatureSpec("kv_marginal_frac", "kv_marginal_us / busy_us, clipped to [0, 1] (0: ghost lists off)", 0.0, 1.0),
    FeatureSpec("emb_marginal_frac", "emb_marginal_us / busy_us, clipped to [0, 1] (0: ghost lists off)", 0.0, 1.0),
)
FEATURE_NAMES: tuple[str, ...] = tuple(s.name for s in FEATURE_SPECS)
NUM_FEATURES = len(FEATURE_NAMES)
FEATURE_LOW = np.array([s.low for s in FEATURE_SPECS], dtype=np.float32)
FEATURE_HIGH = np.array([s.high for s in FEATURE_SPECS], dtype=np.float32)


def miss_costs_us(stats: WindowStats) -> tuple[float, float]:
    """Expected miss time per request, ``(kv_miss_us, emb_miss_us)``, from the observed hit rates:

    ``kv_miss_us  = (1 - kv_hit_rate)  * history_len_p50          * kv_recompute_us_per_token``
    ``emb_miss_us = (1 - emb_hit_rate) * emb_lookups_per_request  * emb_transfer_us_per_row``
    """
    kv = (1.0 - stats.kv_hit_rate) * stats.history_len_p50 * stats.kv_recompute_us_per_token
    emb = (1.0 - stats.emb_hit_rate) * stats.emb_lookups_per_request * stats.emb_transfer_us_per_row
    return kv, emb


def marginal_utility_us(probes, saved_us) -> float:
    """Busy time saved per 10% of the arena: ``max_k saved_us[k] / (probes[k] / 0.1)``.

    ``probes`` are the ghost probes (shares of the arena, ascending) and ``saved_us[k]`` the time
    per request that a cache ``probes[k]`` of the arena larger would have saved (ghost hits
    priced at the miss cost). Taking the best rate over the probes, not the first probe's,
    is the *lookahead* of utility-based cache partitioning (Qureshi and Patt, MICRO 2006): a
    cache whose gains come in steps (a KV pool holds a user's K/V whole or not at all) is
    valued by the next step it could reach, not by the first sliver of memory."""
    best = 0.0
    for f, v in zip(probes, saved_us):
        rate = v * 0.1 / f
        if rate > best:
            best = rate
    return best


def marginal_utilities_us(probes, emb_ghost_rows, kv_ghost_tokens, num_requests: int,
                          emb_transfer_us_per_row: float, kv_recompute_us_per_token: float) -> tuple[float, float]:
    """``(emb_marginal_us, kv_marginal_us)`` of one window from its ghost counts per probe: the
    row copies (``emb_ghost_rows[k]``) and recomputed tokens (``kv_ghost_tokens[k]``) that a cache
    ``probes[k]`` of the arena larger would have saved, priced at the node's miss costs, per
    request, then `marginal_utility_us`. Empty counts (ghost lists off) or no requests give 0."""
    if not num_requests or not probes:
        return 0.0, 0.0
    emb = [v * emb_transfer_us_per_row / num_requests for v in emb_ghost_rows]
    kv = [v * kv_recompute_us_per_token / num_requests for v in kv_ghost_tokens]
    return marginal_utility_us(probes, emb), marginal_utility_us(probes, kv)


def imbalance(emb_us: float, kv_us: float) -> float:
    """``(emb_us - kv_us) / (emb_us + kv_us)`` in [-1, 1] (0 when both are 0): positive when the
    EMB side weighs more."""
    total = emb_us + kv_us
    return (emb_us - kv_us) / total if total > 0 else 0.0


def marginal_imbalance(stats: WindowStats) -> float:
    """`imbalance` of the marginal utilities: positive when more EMB rows are worth more than
    more KV pages (0 when neither is worth anything)."""
    return imbalance(stats.emb_marginal_us, stats.kv_marginal_us)


def _check(s: WindowStats) -> None:
    """Fast validation: one sum for finiteness (NaN and inf propagate) and chained range tests;
    on any failure the slow `WindowStats.problems` names the fields (an overflowing sum of finite
    values finds no problem and passes)."""
    try:
        total = (s.interval_s + s.num_requests + s.arrival_rate_rps + s.hot_user_ratio + s.history_len_p50
                 + s.history_len_p99 + s.emb_lookups_per_request + s.emb_hit_rate + s.kv_hit_rate
                 + s.kv_recompute_us_per_token + s.emb_transfer_us_per_row + s.emb_share + s.load + s.p99_ms
                 + s.slo_ms + s.refill_bytes + s.arena_bytes + s.emb_marginal_us
                 + s.kv_marginal_us + s.table_bytes + s.kv_bytes_per_token + s.arrival_hot_user_ratio)
        ok = (math.isfinite(total) and s.interval_s > 0 and s.slo_ms > 0 and s.arena_bytes > 0
              and s.num_requests >= 0 and s.arrival_rate_rps >= 0 and 0 <= s.history_len_p50 <= s.history_len_p99
              and s.emb_lookups_per_request >= 0 and s.kv_recompute_us_per_token >= 0
              and s.emb_transfer_us_per_row >= 0 and s.p99_ms >= 0 and s.refill_bytes >= 0
              and s.emb_marginal_us >= 0 and s.kv_marginal_us >= 0 and s.table_bytes >= 0
              and s.kv_bytes_per_token >= 0 and 0 <= s.arrival_hot_user_ratio <= 1
              and 0 <= s.hot_user_ratio <= 1 and 0 <= s.emb_hit_rate <= 1 and 0 <= s.kv_hit_rate <= 1
              and 0 <= s.emb_share <= 1 and 0 <= s.load <= 1 and s.num_requests == int(s.num_requests))
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        problems = s.problems()
        if problems:
            raise FeatureError(problems)


check_stats = _check  # raises FeatureError naming every bad field; the check `build_features` makes


def _log_norm(x: float, log_ref: float) -> float:
    v = math.log1p(x) / log_ref
    return v if v < LOG_FEATURE_MAX else LOG_FEATURE_MAX


def build_features(stats: WindowStats, prev: WindowStats | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """The state vector of ``stats`` (float32, ``NUM_FEATURES`` long, in `FEATURE_NAMES` order).

    ``prev`` is the previous interval's snapshot (for the two burst-indicator deltas; None on the
    first interval). ``out``, when given, is a float32 vector of length ``NUM_FEATURES`` written in
    place and returned (the node agent passes its ONNX input buffer, so nothing is allocated).
    Raises `FeatureError` for an invalid ``stats`` or ``prev``.
    """
    _check(stats)
    log1p = math.log1p
    mx = LOG_FEATURE_MAX
    rate_log = log1p(stats.arrival_rate_rps) / _LOG_RATE_REF
    if rate_log > mx:
        rate_log = mx
    if prev is None:
        d_hot = 0.0
        d_rate = 0.0
    else:
        try:
            prev_ok = 0 <= prev.hot_user_ratio <= 1 and 0 <= prev.arrival_rate_rps < math.inf
        except TypeError:
            prev_ok = False
        if not prev_ok:  # the two fields read from prev; problems() names them
            raise FeatureError([f"prev.{p}" for p in prev.problems()])
        d_hot = stats.hot_user_ratio - prev.hot_user_ratio
        d_rate = rate_log - _log_norm(prev.arrival_rate_rps, _LOG_RATE_REF)
    kv_miss = (1.0 - stats.kv_hit_rate) * stats.history_len_p50 * stats.kv_recompute_us_per_token
    emb_miss = (1.0 - stats.emb_hit_rate) * stats.emb_lookups_per_request * stats.emb_transfer_us_per_row
    miss_total = kv_miss + emb_miss
    if 0 < miss_total < math.inf:
        kv_share = kv_miss / miss_total
    elif miss_total > 0:  # a product of finite fields overflowed: the infinite side takes the share
        kv_share = 0.5 if kv_miss == emb_miss else (1.0 if kv_miss > emb_miss else 0.0)
    else:
        kv_share = 0.5
    p99_over_slo = stats.p99_ms / stats.slo_ms
    arena = stats.arena_bytes
    refill = stats.refill_bytes / arena
    table_log = log1p(stats.table_bytes / arena) / _LOG_TABLE_REF
    user_kv = stats.history_len_p50 * stats.kv_bytes_per_token
    users_log = log1p(arena / user_kv) / _LOG_USERS_REF if user_kv > 0 else 0.0
    h50 = log1p(stats.history_len_p50) / _LOG_HISTORY_REF
    h99 = log1p(stats.history_len_p99) / _LOG_HISTORY_REF
    lookups = log1p(stats.emb_lookups_per_request) / _LOG_LOOKUPS_REF
    kv_cost = log1p(stats.kv_recompute_us_per_token) / _LOG_COST_REF
    emb_cost = log1p(stats.emb_transfer_us_per_row) / _LOG_COST_REF
    busy_us = stats.load * stats.interval_s * 1e6 / stats.num_requests if stats.num_requests else 0.0
    if busy_us > 0:
        fr = (kv_miss / busy_us, emb_miss / busy_us, stats.kv_marginal_us / busy_us, stats.emb_marginal_us / busy_us)
        kv_miss_fr, emb_miss_fr, kv_marg_fr, emb_marg_fr = (v if v < 1.0 else 1.0 for v in fr)
    else:
        kv_miss_fr = emb_miss_fr = kv_marg_fr = emb_marg_fr = 0.0
    values = (
        rate_log,
        stats.hot_user_ratio,
        h50 if h50 < mx else mx,
        h99 if h99 < mx else mx,
        lookups if lookups < mx else mx,
        stats.emb_hit_rate,
        stats.kv_hit_rate,
        kv_cost if kv_cost < mx else mx,
        emb_cost if emb_cost < mx else mx,
        kv_share,
        stats.emb_share,
        stats.load,
        p99_over_slo if p99_over_slo < P99_OVER_SLO_MAX else P99_OVER_SLO_MAX,
        refill if refill < 1.0 else 1.0,
        d_hot,
        d_rate,  # both operands lie in [0, LOG_FEATURE_MAX], so the difference is within range
        table_log if table_log < mx else mx,
        users_log if users_log < mx else mx,
        kv_miss_fr,
        emb_miss_fr,
        kv_marg_fr,
        emb_marg_fr,
    )
    if out is None:
        return np.array(values, dtype=np.float32)
    out[:] = values
    return out
