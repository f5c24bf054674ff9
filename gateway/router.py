"""The EMB-KV-aware request router and its baselines (pure logic; no HTTP, no clock).

For a request and each live node ``n`` the scheduler computes (PAPER.md, "EMB-KV-Aware
Scheduler"; derivation of the weights in docs/router.md and `common.weights`)::

    score(n) = w_kv(n) * h_kv(n) + w_emb(n) * h_emb(n) + w_ld(n) * (1 - l(n)) + offset(n) + eps(n)

- ``h_kv(n)``: the fraction of the user's history whose K/V node ``n`` holds. The residency map
  names one holder per user (`KvResidency`), so only that node has ``h_kv > 0``: the term is one
  scalar added to one entry, never a loop over nodes.
- ``h_emb(n)``: the fraction of the request's looked-up items whose embedding shard is hot on
  ``n``: ``hot[n, :] @ shard_counts / num_items`` for all nodes at once (`HotShardTable`).
- ``l(n) = min(queue_depth(n) / queue_capacity(n), 1)``; ``offset(n)`` equalises the load terms
  of nodes with different capacities (zero on a homogeneous cluster).
- ``eps(n)``: a seeded tie-break in ``[0, tie_break_us)``, far below any real difference.

The score is the expected time the request saves on ``n`` (µs). An imbalance guard in the style
of SGLang's cache-aware router overrides it: when ``max_load - min_load > guard_abs_threshold``
and ``max_load > guard_rel_threshold * min_load`` (queue depths over live nodes), the request
goes to the least-loaded node and the decision says so.

Everything a decision depends on is a `ClusterState` (arrays the router mutates only through
its own methods: dispatch, completion, node report, expiry) plus the request; `score_nodes` is a
pure function of the two. Routers (`make_router(name, ...)`) wrap a state, a policy and a
tie-break stream; each decision updates the state optimistically (queue depth + 1, the user's
K/V now on the chosen node), and node reports correct it.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from common.config import problems, ranged
from common.config import validate as validate_fields
from common.weights import CostProfile, RouterWeights, derive_weights

from .residency import EMPTY, MAX_USER, ArrayViews, HotShardTable, KvResidency, _as_users

POLICIES = ("round_robin", "least_load", "user_affinity", "kv_aware", "emb_aware", "racer")
SOURCES = ("score", "spill", "guard", "round_robin", "least_load", "user_affinity")
_INF = math.inf
_EPS_POOL = 1 << 16
_EPS_STRIDE = 7919  # odd, so the window start visits every pool position
_LOAD_TIE_BREAK = 1e-9  # tie-break added to l(n) in least-load choices (l differs by >= 1/capacity)
_I32_MAX = np.iinfo(np.int32).max


class NoLiveNodeError(RuntimeError):
    """Every node is silent (expired): there is nowhere to route."""


def _finite(name: str, v, *, minimum: float | None = None, problems: list[str]) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
        problems.append(f"{name} must be a finite number, got {v!r}")
    elif minimum is not None and v < minimum:
        problems.append(f"{name} must be >= {minimum}, got {v!r}")


@dataclass(frozen=True)
class LoadAwareConfig:
    """How the scoring routers behave under load (docs/router.md, "Under load"); `validate` checks
    ranges. ``q(n)`` is a node's requests in flight as the router counts them (its queue depth),
    ``q_min`` the least among live nodes, ``mean`` their mean, ``Q`` their sum and ``N`` the live
    nodes.

    - ``credit_decay_requests`` ``D`` (> 0, ``inf`` switches it off; default 2): the locality
      credit of a node (its KV and EMB terms, the time its caches save) is scaled by
      ``max(0, 1 - (q(n) - q_min) / D)``, so a node ``D`` or more requests ahead of the least
      loaded earns no credit and competes on its wait alone (Dynamo's KV router scores one cost,
      prefill left after the cached overlap plus queued work, and lowers the overlap credit of a
      worker already ahead). The chosen node is then never ``D`` or more requests ahead of
      ``least_load``'s choice;
    - ``cap_factor`` ``c`` (>= 1, ``inf`` off; default 1.25): consistent hashing with bounded
      loads: no node takes a request that would put it above ``ceil(c (Q + 1) / N)`` in flight;
      the best score under the cap wins (the least loaded node is always under it);
    - ``hot_rel`` / ``hot_abs`` (>= 1 / >= 0; ``hot_rel = inf`` off; defaults 1.5 / 2): SGLang's
      spill: when the chosen node is hot, ``q > hot_rel * mean`` and ``q > mean + hot_abs``, the
      request goes to the least-waiting node instead (which then holds the user's K/V);
    - ``same_batch_s`` (>= 0, 0 off; default 0.01): a request whose user's previous request went
      to the user's K/V holder less than this before (the nodes' batching window) likely joins
      that request's batch, and a node agent serves one user's requests in a batch one after
      another, each in a pass of its own: the holder's score pays one service time
      (``service_time_us``) for it. A request already running costs no extra pass (the queue
      depth counts it), hence the window and not the requests in flight;
    - ``pass_while_queued`` (default True): a node agent's batch is every request queued when
      its device frees, so the user's previous request still waiting in the holder's queue
      (sent while the holder was busy, and the holder has completed nothing since) means the
      new one joins its batch: the holder pays the same pass. The simulator's nodes batch by
      time slice instead (a later slice's request never joins an earlier slice's batch), and the
      simulator runs with it off (`simulator.cluster.SimConfig.load_aware`);
    - ``near_equal_fraction`` (in [0, 1]; default 0): nodes whose score is within this fraction
      of one service time (the fastest live node's ``service_time_us``) of the best are equal
      for the choice, which is then uniform among them from the router's seeded stream. At 0
      only exact ties are (the seeded ``eps``); each gateway seeds its router differently, so
      gateways that see the same loads break ties differently and do not herd onto one node.
      Positive values cost P99 in the simulator (the EMB term's small differences are what keep
      shards hot), hence the default.

    ``enabled=False`` gives the plain argmax of the expected time saved (the paper's rule).
    """

    enabled: bool = ranged(True, kind=bool)
    credit_decay_requests: float = ranged(2.0, lo=0, lo_open=True, finite=False)  # inf: off
    cap_factor: float = ranged(1.25, lo=1, finite=False)  # inf: off
    hot_rel: float = ranged(1.5, lo=1, finite=False)  # inf: off
    hot_abs: float = ranged(2.0, lo=0)
    same_batch_s: float = ranged(0.01, lo=0, hi=60)
    pass_while_queued: bool = ranged(True, kind=bool)
    near_equal_fraction: float = ranged(0.0, lo=0, hi=1)

    def validate(self) -> "LoadAwareConfig":
        validate_fields(self, "router config")
        return self


LOAD_AWARE_OFF = LoadAwareConfig(enabled=False)
_LAST_DISPATCH_MAX = 1 << 16


@dataclass(frozen=True)
class RouterConfig:
    """The router's settings; `validate` checks ranges and returns the config.

    - ``num_shards``: embedding shards (``workloads.trace.shard_map``), columns of the hot matrix;
    - ``residency_capacity`` / ``residency_ways``: entries of the user -> node K/V map (rounded up
      to a power-of-two number of sets; 24 bytes an entry, so the default 2^21 is 48 MiB) and its
      associativity (LRU within a set of this many entries);
    - ``node_timeout_s``: a node silent for longer is expired: it takes no requests and the
      router forgets its residency until it reports again; expiry is checked on routing calls at
      most every ``expiry_check_interval_s`` (and whenever `Router.expire` is called);
    - ``guard_*``: the imbalance guard (queue depths, requests); SGLang's defaults are 64 and 1.5;
    - ``tie_break_us``: magnitude of the seeded tie-break ``eps``; ``seed`` seeds it;
    - ``affinity_vnodes``: points per node on the consistent-hash ring of ``user_affinity``;
    - ``load_aware``: the scoring routers' rules under load (`LoadAwareConfig`).
    """

    num_shards: int = ranged(64, lo=1, integer=True)
    residency_capacity: int = ranged(1 << 21, lo=1, integer=True)
    residency_ways: int = ranged(8, lo=1, hi=64, integer=True)
    node_timeout_s: float = ranged(10.0, lo=0, finite=False)  # inf: never expire
    expiry_check_interval_s: float = ranged(1.0, lo=0)
    guard_enabled: bool = ranged(True, kind=bool)
    guard_abs_threshold: float = ranged(64.0, lo=0)
    guard_rel_threshold: float = ranged(1.5, lo=1)
    tie_break_us: float = ranged(1e-3, lo=0)
    affinity_vnodes: int = ranged(64, lo=1, integer=True)
    seed: int = ranged(0, integer=True)
    load_aware: LoadAwareConfig = ranged(LoadAwareConfig(), kind=LoadAwareConfig)

    def validate(self) -> "RouterConfig":
        found = problems(self)
        if isinstance(self.load_aware, LoadAwareConfig):
            found += ["load_aware." + x for x in problems(self.load_aware)]
        if found:
            raise ValueError("invalid router config: " + "; ".join(found))
        return self


# --------------------------------------------------------------------------------------- inputs
@dataclass(slots=True)
class RouteRequest:
    """What the router needs of one request.

    ``history_len``: tokens of the user's history the request attends over (what a K/V hit
    spares recomputing); ``item_shards``: the embedding shard of every item the request looks up
    (``trace.item_shard[items]``), so ``len(item_shards)`` is its number of looked-up items;
    ``num_new_items``: items appended after the history, so after serving, the chosen node holds
    ``history_len + num_new_items`` tokens of the user's K/V.
    """

    user: int
    history_len: int
    item_shards: np.ndarray
    num_new_items: int = 0

    @classmethod
    def from_items(cls, user: int, history_len: int, items: np.ndarray, item_shard: np.ndarray,
                   num_new_items: int = 0) -> "RouteRequest":
        """Build from item ids and the item -> shard map (``Trace.item_shard``)."""
        return cls(user, history_len, item_shard[np.asarray(items, dtype=np.int64)], num_new_items)


@dataclass
class RequestBatch:
    """Requests in arrival order, column-wise (CSR for the item shards), for `Router.route_batch`."""

    user: np.ndarray  # int64 [B]
    history_len: np.ndarray  # int64 [B]
    num_new_items: np.ndarray  # int64 [B]
    shard_offsets: np.ndarray  # int64 [B + 1]; request i's shards: item_shards[off[i]:off[i+1]]
    item_shards: np.ndarray  # int [total]

    def __post_init__(self) -> None:
        self.user = _as_users(self.user)
        self.history_len = np.asarray(self.history_len, dtype=np.int64).reshape(-1)
        self.num_new_items = np.asarray(self.num_new_items, dtype=np.int64).reshape(-1)
        self.shard_offsets = np.asarray(self.shard_offsets, dtype=np.int64).reshape(-1)
        self.item_shards = np.asarray(self.item_shards).reshape(-1)
        b = len(self.user)
        if len(self.history_len) != b or len(self.num_new_items) != b or len(self.shard_offsets) != b + 1:
            raise ValueError(f"batch columns disagree: {b} users, {len(self.history_len)} history_len, "
                             f"{len(self.num_new_items)} num_new_items, {len(self.shard_offsets)} offsets "
                             f"(want {b + 1})")
        if b and (self.history_len.min() < 0 or self.num_new_items.min() < 0):
            raise ValueError("history_len and num_new_items must be >= 0")
        off = self.shard_offsets
        if off[0] != 0 or off[-1] != len(self.item_shards) or (b and np.any(np.diff(off) < 0)):
            raise ValueError("shard_offsets must start at 0, be non-decreasing and end at len(item_shards)")
        if self.item_shards.size and self.item_shards.dtype.kind not in "iu":
            raise TypeError(f"item_shards must be integers, got dtype {self.item_shards.dtype}")

    def __len__(self) -> int:
        return len(self.user)

    def request(self, i: int) -> RouteRequest:
        off = self.shard_offsets
        return RouteRequest(int(self.user[i]), int(self.history_len[i]),
                            self.item_shards[off[i]:off[i + 1]], int(self.num_new_items[i]))

    @classmethod
    def from_requests(cls, requests: Sequence[RouteRequest]) -> "RequestBatch":
        lens = [len(r.item_shards) for r in requests]
        off = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(lens, out=off[1:])
        shards = (np.concatenate([np.asarray(r.item_shards).reshape(-1) for r in requests])
                  if requests else np.empty(0, dtype=np.int64))
        return cls(np.array([r.user for r in requests], dtype=np.int64),
                   np.array([r.history_len for r in requests], dtype=np.int64),
                   np.array([r.num_new_items for r in requests], dtype=np.int64), off, shards)

    def shard_counts(self, num_shards: int) -> np.ndarray:
        """``[B, num_shards]`` float64: looked-up items per shard of every request."""
        s = self.item_shards.astype(np.int64, copy=False)
        if s.size and (int(s.min()) < 0 or int(s.max()) >= num_shards):
            raise ValueError(f"item shard ids must be in [0, {num_shards}), got {int(s.min())}..{int(s.max())}")
        req = np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.shard_offsets))
        flat = np.bincount(req * num_shards + s, minlength=len(self) * num_shards)
        return flat.reshape(len(self), num_shards).astype(np.float64)


@dataclass
class NodeReport:
    """What a node agent tells the router; fields left ``None`` are unchanged.

    - ``at_s``: the router-clock time the report describes (the gateway stamps it on receipt);
    - ``seq``: the node's report sequence number; a report not newer than the last applied one
      is ignored (reports are replayed after outages, so they must be idempotent);
    - ``queue_depth``: requests queued or running on the node, replacing the router's count;
    - ``hot_shards``: the node's hot embedding shards, replacing its previous set;
    - ``evicted_users``: users whose K/V the node dropped;
    - ``kv_users`` / ``kv_cached_lens``: users whose K/V the node holds, and for how many tokens;
    - ``profile``: a newly profiled cost profile (the router re-derives its weights).
    """

    node_id: str
    at_s: float
    seq: int | None = None
    queue_depth: float | None = None
    hot_shards: Sequence[int] | np.ndarray | None = None
    evicted_users: Sequence[int] | np.ndarray | None = None
    kv_users: Sequence[int] | np.ndarray | None = None
    kv_cached_lens: Sequence[int] | np.ndarray | None = None
    profile: CostProfile | None = None

    def __post_init__(self) -> None:
        problems: list[str] = []
        _finite("at_s", self.at_s, problems=problems)
        if self.seq is not None and (isinstance(self.seq, bool) or not isinstance(self.seq, (int, np.integer))):
            problems.append(f"seq must be an integer, got {self.seq!r}")
        if self.queue_depth is not None:
            _finite("queue_depth", self.queue_depth, minimum=0.0, problems=problems)
        if (self.kv_users is None) != (self.kv_cached_lens is None):
            problems.append("kv_users and kv_cached_lens come together")
        if self.profile is not None and not isinstance(self.profile, CostProfile):
            problems.append(f"profile must be a CostProfile, got {type(self.profile).__name__}")
        if problems:
            raise ValueError(f"invalid report from node {self.node_id!r}: " + "; ".join(problems))
        if self.evicted_users is not None:
            self.evicted_users = _as_users(self.evicted_users)
        if self.kv_users is not None:
            self.kv_users = _as_users(self.kv_users)
            lens = np.asarray(self.kv_cached_lens).reshape(-1)
            if lens.size and lens.dtype.kind not in "iu":
                raise TypeError(f"kv_cached_lens must be integers, got dtype {lens.dtype}")
            lens = lens.astype(np.int64)
            if len(lens) != len(self.kv_users):
                raise ValueError(f"kv_users ({len(self.kv_users)}) and kv_cached_lens ({len(lens)}) differ in length")
            if lens.size and int(lens.min()) < 0:
                raise ValueError(f"kv_cached_lens must be >= 0, got {int(lens.min())}")
            self.kv_cached_lens = np.minimum(lens, _I32_MAX)


@dataclass(frozen=True)
class ReportOutcome:
    """What applying a report did (its reason)."""

    node_id: str
    applied: bool
    reason: str
    revived: bool = False
    num_forgotten: int = 0
    num_recorded: int = 0


# ---------------------------------------------------------------------------------------- state
class ClusterState(ArrayViews):
    """The router's view of the cluster: the snapshot every decision is a pure function of.

    Per node (arrays of length ``num_nodes``): queue depth, liveness and last report time, the
    derived ``load`` (``l(n)``, ``+inf`` on a silent node) and ``ld_term`` (``w_ld * (1 - l) +
    offset``, ``-inf`` on a silent node, so a silent node never wins a score), the hot-shard
    matrix, and the user -> node K/V map. Mutated only through `dispatch`, `complete`,
    `apply_report`, `expire` and `set_profile`, which keep the derived arrays in step.
    """

    def __init__(self, node_ids: Sequence[str], profiles: Sequence[CostProfile], config: RouterConfig,
                 now_s: float = 0.0) -> None:
        config.validate()
        node_ids = tuple(node_ids)
        if not node_ids:
            raise ValueError("a router needs at least one node (got an empty node set)")
        for nid in node_ids:
            if not isinstance(nid, str) or not nid:
                raise ValueError(f"node ids must be non-empty strings, got {nid!r}")
        if len(set(node_ids)) != len(node_ids):
            dup = sorted({n for n in node_ids if node_ids.count(n) > 1})
            raise ValueError(f"node ids must be unique; repeated: {dup}")
        profiles = list(profiles)
        if len(profiles) != len(node_ids):
            raise ValueError(f"{len(node_ids)} nodes but {len(profiles)} cost profiles")
        if not math.isfinite(now_s):
            raise ValueError(f"now_s must be finite, got {now_s!r}")
        n = len(node_ids)
        self.config = config
        self.node_ids = node_ids
        self.index = {nid: i for i, nid in enumerate(node_ids)}
        self.profiles = profiles
        self.weights: RouterWeights = derive_weights(profiles)
        self.queue = np.zeros(n, dtype=np.float64)
        self.alive = np.ones(n, dtype=bool)
        self.last_seen_s = np.full(n, float(now_s))
        self.last_seq = np.full(n, -1, dtype=np.int64)
        self.load = np.zeros(n, dtype=np.float64)
        self.ld_term = np.zeros(n, dtype=np.float64)
        self.q_for_max = np.zeros(n, dtype=np.float64)  # queue depth, -inf on silent nodes
        self.q_for_min = np.zeros(n, dtype=np.float64)  # queue depth, +inf on silent nodes
        self.wait_term = np.zeros(n, dtype=np.float64)  # max_m w_ld(m) - q(n) s(n), uncapped; -inf silent
        self.fill = np.zeros(n, dtype=np.float64)  # q(n) / queue_capacity(n), uncapped; +inf silent
        self.hot = HotShardTable(n, config.num_shards)
        self.kv = KvResidency(config.residency_capacity, config.residency_ways)
        self.now_s = float(now_s)  # the decision's time, set by the router before each one
        # user -> (node, time, node busy then, node's completions then) of its last request, the oldest first
        self.last_dispatch: OrderedDict[int, tuple[int, float, bool, int]] = OrderedDict()
        self.completed = [0] * n  # requests each node completed, as the router saw them
        self._bind_views()
        self._ones = np.ones(1024, dtype=np.float64)
        self._refresh_all()

    _VIEWS = {"_queue_mv": "queue", "_alive_mv": "alive", "_load_mv": "load", "_ld_term_mv": "ld_term",
              "_qmax_mv": "q_for_max", "_qmin_mv": "q_for_min", "_wait_mv": "wait_term",
              "_fill_mv": "fill"}  # see `ArrayViews`

    @property
    def num_nodes(self) -> int:
        return len(self.node_ids)

    @property
    def num_shards(self) -> int:
        return self.hot.num_shards

    def node_index(self, node: str | int) -> int:
        """The index of a node given its id (or an index, checked)."""
        if isinstance(node, str):
            try:
                return self.index[node]
            except KeyError:
                shown = ", ".join(self.node_ids[:8]) + (", ..." if len(self.node_ids) > 8 else "")
                raise ValueError(f"unknown node {node!r} (known: {shown})") from None
        if isinstance(node, (int, np.integer)) and not isinstance(node, bool) and 0 <= node < len(self.node_ids):
            return int(node)
        raise ValueError(f"unknown node {node!r}: not an id, nor an index in [0, {len(self.node_ids)})")

    # -------------------------------------------------------------- derived arrays
    def _refresh(self, n: int) -> None:
        if self._alive_mv[n]:
            q = self._queue_mv[n]
            f = l = q / self._cap[n]
            if l > 1.0:
                l = 1.0
            self._load_mv[n] = l
            self._fill_mv[n] = f
            self._ld_term_mv[n] = self._ld_ref - self._ld[n] * l
            self._wait_mv[n] = self._ld_ref - self._ld[n] * f
            self._qmax_mv[n] = q
            self._qmin_mv[n] = q
        else:
            self._load_mv[n] = _INF
            self._fill_mv[n] = _INF
            self._ld_term_mv[n] = -_INF
            self._wait_mv[n] = -_INF
            self._qmax_mv[n] = -_INF
            self._qmin_mv[n] = _INF

    def _refresh_all(self) -> None:
        w = self.weights
        self._cap = w.queue_capacity.tolist()
        self._ld = w.ld_us.tolist()
        self._ld_ref = w.ld_ref_us
        self._kv_rate = w.kv_us_per_token.tolist()
        self._svc = w.service_time_us.tolist()
        self._svc_min = float(w.service_time_us.min())
        for i in range(self.num_nodes):
            self._refresh(i)

    # -------------------------------------------------------------- mutations
    def dispatch(self, n: int, user: int, cached_len: int, now_s: float) -> None:
        """Optimistic update for a request routed to node ``n``: one more queued request, and the
        node will hold ``cached_len`` tokens of the user's K/V."""
        busy = self._queue_mv[n] > 0.0
        self._queue_mv[n] += 1.0
        self._refresh(n)
        self.kv.record(user, n, cached_len if cached_len < _I32_MAX else _I32_MAX, now_s)
        last = self.last_dispatch  # in dispatch order: the oldest first
        if user in last:
            last.move_to_end(user)
        last[user] = (n, now_s, busy, self.completed[n])
        if len(last) > _LAST_DISPATCH_MAX:  # bounded: the older half goes (far older than any batching window)
            for _ in range(_LAST_DISPATCH_MAX // 2):
                last.popitem(last=False)

    def complete(self, node: str | int, count: int = 1) -> None:
        """``count`` requests left node ``node``'s queue (the router saw them finish)."""
        n = self.node_index(node)
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        q = self._queue_mv[n] - count
        self._queue_mv[n] = q if q > 0.0 else 0.0
        self.completed[n] += int(count)
        self._refresh(n)

    def set_profile(self, node: str | int, profile: CostProfile) -> None:
        """Replace one node's cost profile and re-derive the weights."""
        n = self.node_index(node)
        if not isinstance(profile, CostProfile):
            raise TypeError(f"profile must be a CostProfile, got {type(profile).__name__}")
        self.profiles[n] = profile
        self.weights = derive_weights(self.profiles)
        self._refresh_all()

    def apply_report(self, report: NodeReport) -> ReportOutcome:
        """Correct the optimistic state with a node's report (see `NodeReport`)."""
        if not isinstance(report, NodeReport):
            raise TypeError(f"expected a NodeReport, got {type(report).__name__}")
        n = self.node_index(report.node_id)
        shards = None
        if report.hot_shards is not None:  # validate before changing anything
            shards = np.asarray(report.hot_shards if isinstance(report.hot_shards, np.ndarray)
                                else list(report.hot_shards)).reshape(-1)
            if shards.size and shards.dtype.kind not in "iu":
                raise TypeError(f"hot_shards must be integers, got dtype {shards.dtype}")
            if shards.size and (int(shards.min()) < 0 or int(shards.max()) >= self.num_shards):
                raise ValueError(f"hot_shards of node {report.node_id!r} must be in [0, {self.num_shards}), "
                                 f"got {int(shards.min())}..{int(shards.max())}")
        if report.seq is not None:
            last = int(self.last_seq[n])
            if report.seq <= last:
                return ReportOutcome(report.node_id, False, f"stale: seq {report.seq} <= last applied {last}")
            self.last_seq[n] = report.seq
        self.last_seen_s[n] = max(float(self.last_seen_s[n]), float(report.at_s))
        revived = not self._alive_mv[n]
        self._alive_mv[n] = True
        if report.profile is not None:
            self.profiles[n] = report.profile
            self.weights = derive_weights(self.profiles)
            self._refresh_all()
        if report.queue_depth is not None:
            self._queue_mv[n] = float(report.queue_depth)
        self._refresh(n)
        if shards is not None:
            self.hot.set_hot(n, shards)
        forgotten = recorded = 0
        if report.evicted_users is not None and len(report.evicted_users):
            forgotten = self.kv.forget_many(report.evicted_users, n, report.at_s)
        if report.kv_users is not None and len(report.kv_users):
            users, lens = report.kv_users, report.kv_cached_lens
            slots = self.kv.find_many(users)
            # a confirmation older than the user's last routing decision must not undo it
            fresh = (slots < 0) | (self.kv.touched_s[np.maximum(slots, 0)] <= report.at_s)
            self.kv.record_many(users[fresh], n, lens[fresh], report.at_s)
            recorded = int(fresh.sum())
        parts = ["applied"]
        if revived:
            parts.append("node back from silence")
        if forgotten:
            parts.append(f"forgot {forgotten} evicted users")
        return ReportOutcome(report.node_id, True, ", ".join(parts), revived, forgotten, recorded)

    def set_down(self, node: str | int) -> None:
        """Take a node out of rotation now (the gateway's health checks failed): like expiry, it
        gets no requests and its K/V residency and hot shards are forgotten; a report revives it."""
        n = self.node_index(node)
        self._alive_mv[n] = False
        self._refresh(n)
        self.kv.forget_node(n)
        self.hot.clear(n)

    def expire(self, now_s: float) -> list[str]:
        """Mark nodes silent for longer than ``node_timeout_s`` as expired and forget their K/V
        residency and hot shards. Returns the ids of the nodes expired by this call."""
        if not math.isfinite(now_s):
            raise ValueError(f"now_s must be finite, got {now_s!r}")
        stale = np.flatnonzero(self.alive & (now_s - self.last_seen_s > self.config.node_timeout_s))
        for n in stale.tolist():
            self._alive_mv[n] = False
            self._refresh(n)
            self.kv.forget_node(n)
            self.hot.clear(n)
        return [self.node_ids[n] for n in stale.tolist()]

    # -------------------------------------------------------------- helpers for scoring
    def shard_counts(self, item_shards: np.ndarray) -> np.ndarray:
        """Looked-up items per shard (float64 ``[num_shards]``), with clear errors for bad ids."""
        m = len(item_shards)
        ones = self._ones
        if m > len(ones):
            self._ones = ones = np.ones(max(m, 2 * len(ones)), dtype=np.float64)
        try:
            counts = np.bincount(item_shards, weights=ones[:m], minlength=self.hot.num_shards)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"item_shards must be non-negative integer shard ids in [0, {self.num_shards}): "
                             f"{exc}") from None
        if len(counts) != self.hot.num_shards:
            raise ValueError(f"item_shards must be in [0, {self.num_shards}), got shard {len(counts) - 1}")
        return counts

    def check_invariants(self) -> list[str]:
        """Violations of the state's invariants (empty when consistent)."""
        out = self.kv.check_invariants(self.num_nodes)
        if (self.queue < 0).any():
            out.append("a negative queue depth")
        live = self.alive
        want_l = np.minimum(self.queue / self.weights.queue_capacity, 1.0)
        if not np.allclose(self.load[live], want_l[live]) or np.isfinite(self.load[~live]).any():
            out.append("load out of step with queue depth / liveness")
        want_ld = self.weights.ld_ref_us - self.weights.ld_us * want_l
        if not np.allclose(self.ld_term[live], want_ld[live]) or (self.ld_term[~live] != -_INF).any():
            out.append("ld_term out of step with load")
        used = self.kv.keys != EMPTY
        if used.any() and (~live[self.kv.node[used]]).any():
            out.append("K/V residency on a silent node")
        if self.hot.hot[~live].any():
            out.append("hot shards on a silent node")
        return out


# ------------------------------------------------------------------------------------- decisions
@dataclass(frozen=True, eq=False)
class ScoreBreakdown:
    """The per-node terms of one scoring decision (arrays of length ``num_nodes``).

    ``score = kv_term_us + emb_term_us + credit_decay_us + pass_us + load_term_us + load_offset_us
    + eps_us``, where ``kv_term_us = w_kv * h_kv``, ``emb_term_us = w_emb * h_emb``,
    ``load_term_us = w_ld * (1 - l)`` and ``credit_decay_us = -(1 - credit_factor) * (kv_term_us +
    emb_term_us)``: the locality credit a node loses for being ahead of the least loaded
    (`LoadAwareConfig`; factor 1 and no decay when the rule is off). ``under_cap``: whether the
    node was under the bounded-load cap (all true when the cap did not bind). ``pass_us``: minus
    one service time on the K/V holder when the user's previous request went there within
    ``same_batch_s`` or still waits in its queue (`LoadAwareConfig`). A term the policy ignores
    has weight 0 (``h_emb`` is NaN
    where it was not computed). Silent nodes have ``l = inf`` and a score of ``-inf``.
    """

    node_ids: tuple[str, ...]
    h_kv: np.ndarray
    h_emb: np.ndarray
    load: np.ndarray
    w_kv: np.ndarray
    w_emb: np.ndarray
    w_ld: np.ndarray
    kv_term_us: np.ndarray
    emb_term_us: np.ndarray
    load_term_us: np.ndarray
    load_offset_us: np.ndarray
    eps_us: np.ndarray
    score: np.ndarray
    credit_factor: np.ndarray
    credit_decay_us: np.ndarray
    under_cap: np.ndarray
    pass_us: np.ndarray

    def rows(self) -> list[dict]:
        """One plain dict per node (JSON-able; the dashboard's table)."""
        cols = ("h_kv", "h_emb", "load", "w_kv", "w_emb", "w_ld", "kv_term_us", "emb_term_us", "credit_factor",
                "credit_decay_us", "pass_us", "load_term_us", "load_offset_us", "eps_us", "score", "under_cap")
        arrays = [getattr(self, c).tolist() for c in cols]
        return [{"node": nid, **{c: a[i] for c, a in zip(cols, arrays)}} for i, nid in enumerate(self.node_ids)]


@dataclass(slots=True, eq=False)
class RoutingDecision:
    """Where a request goes and why.

    ``source`` is one of `SOURCES`: ``score`` (highest score, under the load-aware rules),
    ``spill`` (the scored choice was hot and the request went to the least-waiting node),
    ``guard`` (the imbalance guard fired and overrode the score with the least-loaded node) or the
    baseline's own rule. ``load_check`` (`LoadCheck`): what the load-aware rules saw and did.
    ``kv_holder``/``kv_cached_len``: the residency map's holder of the user's K/V at decision time
    (``-1``/``0`` if none). ``guard_check``: ``(max_load, min_load, abs_threshold,
    rel_threshold)`` when the guard was evaluated. `breakdown` and `reason` are computed on demand
    from what the decision kept, so they describe the state it was made in.
    """

    node_index: int
    node_id: str
    policy: str
    source: str
    kv_holder: int
    kv_cached_len: int
    guard_check: tuple[float, float, float, float] | None = None
    score: np.ndarray | None = None
    load: np.ndarray | None = None
    _detail: tuple | None = None  # (weights, node_ids, history_len, num_items, hot_rows, eps, use_kv, use_emb)
    _note: str = ""
    load_check: LoadCheck | None = None
    _breakdown: ScoreBreakdown | None = None  # computed once, on the first `breakdown` call

    @property
    def guard_fired(self) -> bool:
        return self.source == "guard"

    def breakdown(self) -> ScoreBreakdown | None:
        """Per-node score terms, or ``None`` for policies that do not score nodes (computed on
        the first call, then kept: `reason` and a gateway's explained answer share it)."""
        if self._detail is None:
            return None
        if self._breakdown is None:
            self._breakdown = self._compute_breakdown()
        return self._breakdown

    def _compute_breakdown(self) -> ScoreBreakdown:
        w, node_ids, history_len, num_items, hot_rows, eps, use_kv, use_emb = self._detail
        n = len(node_ids)
        h_kv = np.zeros(n)
        if self.kv_holder >= 0 and history_len > 0:
            h_kv[self.kv_holder] = min(self.kv_cached_len, history_len) / history_len
        if hot_rows is not None:
            h_emb = hot_rows / num_items
        elif use_emb:  # a request with no looked-up items
            h_emb = np.zeros(n)
        else:
            h_emb = np.full(n, np.nan)
        w_kv = history_len * w.kv_us_per_token if use_kv else np.zeros(n)
        w_emb = num_items * w.emb_us_per_row if use_emb else np.zeros(n)
        emb_term = w_emb * h_emb if use_emb else np.zeros(n)
        w_ld = w.ld_us.copy()
        load = self.load
        with np.errstate(invalid="ignore"):
            load_term = np.where(np.isfinite(load), w_ld * (1.0 - load), -_INF)
        kv_term = w_kv * h_kv
        lc = self.load_check
        pass_us = np.zeros(n)
        if lc is not None and lc.same_batch and self.kv_holder >= 0:
            pass_us[self.kv_holder] = -w.service_time_us[self.kv_holder]
        factor = np.ones(n) if lc is None or lc.credit_factor is None else lc.credit_factor.copy()
        under = np.ones(n, dtype=bool)
        if lc is not None and lc.capped:
            under = lc.queue + 1.0 <= lc.cap
        return ScoreBreakdown(
            node_ids=node_ids, h_kv=h_kv, h_emb=h_emb, load=load.copy(), w_kv=w_kv, w_emb=w_emb, w_ld=w_ld,
            kv_term_us=kv_term, emb_term_us=emb_term,
            load_term_us=load_term, load_offset_us=w.load_offset_us.copy(), eps_us=np.array(eps),
            score=self.score.copy(), credit_factor=factor, credit_decay_us=-(1.0 - factor) * (kv_term + emb_term),
            under_cap=under, pass_us=pass_us,
        )

    @property
    def reason(self) -> str:
        """One line saying why this node was chosen."""
        nid = self.node_id
        if self.source == "guard":
            mx, mn, a, r = self.guard_check
            return (f"guard: max_load {mx:g} - min_load {mn:g} > {a:g} and {mx:g} > {r:g} * {mn:g}; "
                    f"least-loaded node {nid} (l={self.load[self.node_index]:.3f})")
        if self.source == "spill":
            lc = self.load_check
            la, h = lc.config, lc.spilled_from
            return (f"spill: node {self._detail[1][h]} is hot ({lc.queue[h]:g} in flight > {la.hot_rel:g} x mean "
                    f"{lc.mean:.2f} and > mean + {la.hot_abs:g}); least-waiting node {nid} "
                    f"({lc.queue[self.node_index]:g} in flight)")
        if self.source == "score":
            b = self.breakdown()
            i = self.node_index
            holder = f"holder {b.node_ids[self.kv_holder]}" if self.kv_holder >= 0 else "no holder"
            out = (f"score: node {nid} saves {b.score[i]:.1f} us = kv {b.kv_term_us[i]:.1f} ({holder}) + "
                   f"emb {b.emb_term_us[i]:.1f} (h_emb {b.h_emb[i]:.3f}) + load {b.load_term_us[i]:.1f} "
                   f"(l {b.load[i]:.3f}) + offset {b.load_offset_us[i]:.1f}")
            lc = self.load_check
            if lc is None:
                return out
            parts = []
            if lc.same_batch and self.kv_holder >= 0:
                h = self.kv_holder
                why = ("is still queued there (sent while it was busy, nothing completed since)"
                       if lc.same_batch == "queued" else f"went there within {lc.config.same_batch_s * 1e3:g} ms")
                parts.append(f"holder {b.node_ids[h]} {b.pass_us[h]:.1f} us: the user's previous request {why} "
                             "(its batch: a pass of its own)")
            for j in dict.fromkeys((i, self.kv_holder)):
                if j >= 0 and b.credit_factor[j] < 1.0 and b.kv_term_us[j] + b.emb_term_us[j] > 0.0:
                    who = "its" if j == i else f"holder {b.node_ids[j]}'s"
                    parts.append(f"{who} credit x{b.credit_factor[j]:.2f} ({lc.queue[j] - lc.q_min:g} ahead of the "
                                 f"least loaded: {b.credit_decay_us[j]:.1f} us)")
            if lc.capped:
                f = lc.first
                parts.append(f"cap: {b.node_ids[f]} at {lc.queue[f]:g} in flight would pass ceil({lc.config.cap_factor:g}"
                             f" x (Q + 1) / {lc.num_live}) = {lc.cap}; best under the cap")
            if lc.num_near > 1:
                parts.append(f"{lc.num_near} nodes within {lc.near_us:.1f} us of the best: seeded random choice")
            return out + "".join("; " + p for p in parts)
        if self.source == "least_load":
            return f"least_load: node {nid} has the lowest load l={self.load[self.node_index]:.3f}"
        if self.source == "user_affinity":
            return f"user_affinity: node {nid} owns the user on the hash ring{self._note}"
        return f"round_robin: node {nid} is next in the cycle{self._note}"


@dataclass
class BatchRouting:
    """The decisions of `Router.route_batch`, column-wise."""

    node_index: np.ndarray  # int64 [B]
    guard_fired: np.ndarray  # bool [B]
    kv_holder: np.ndarray  # int64 [B], -1 where no node held the user's K/V


def _as_int(name: str, v) -> int:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return int(v)
    raise TypeError(f"{name} must be an integer, got {v!r}")


def _normalised(request: RouteRequest) -> RouteRequest:
    if not isinstance(request, RouteRequest):
        raise TypeError(f"expected a RouteRequest, got {type(request).__name__}")
    return RouteRequest(_as_int("user", request.user), _as_int("history_len", request.history_len),
                        request.item_shards, _as_int("num_new_items", request.num_new_items))


@dataclass(frozen=True, eq=False)
class LoadCheck:
    """What the load-aware rules (`LoadAwareConfig`) saw and did in one decision.

    ``queue``: in flight per node (``inf`` on silent nodes); ``credit_factor``: the locality
    credit's scale per node (``None`` when the decay is off); ``first``: the best score before the
    cap; ``cap``: ``ceil(c (Q + 1) / N)`` (``None`` off) and ``capped`` whether it moved the choice;
    ``num_near``/``near_us``: the nodes tied within ``near_us`` of the best (a seeded random one
    of them was taken when more than one); ``spilled_from``: the hot node the spill moved the
    request off (``-1`` when it did not fire); ``same_batch``: the user's previous request went to
    its holder within ``same_batch_s`` (True) or still waits in the holder's queue
    (``"queued"``, ``pass_while_queued``), and the holder's score paid one service time for the
    pass; False otherwise.
    """

    config: LoadAwareConfig
    queue: np.ndarray
    q_min: float
    mean: float
    num_live: int
    credit_factor: np.ndarray | None
    first: int
    cap: int | None
    capped: bool
    num_near: int
    near_us: float
    spilled_from: int = -1
    same_batch: bool | str = False


def _pick(state: ClusterState, user: int, history_len: int, emb_us, eps_us: np.ndarray, eps_load: np.ndarray,
          use_kv: bool, guard: tuple[float, float] | None, load_aware: LoadAwareConfig | None = None,
          explain: bool = False):
    """The scoring rule, shared by `score_nodes` (one request) and `ScoringRouter.route_batch`
    (the EMB term precomputed for the whole batch). Score = load term + tie-break + locality
    credit (the EMB term ``emb_us``, per node or None, + the KV term on the user's holder); with
    ``load_aware`` (enabled) the credit decays with the node's lead over the least loaded, the
    argmax is taken under the bounded-load cap, near-equal nodes are chosen among at random, and
    a hot choice spills to the least-waiting node; then the imbalance guard. Returns ``(best,
    source, holder, cached, guard_check, score, load_check)`` (``load_check`` only when
    ``explain``)."""
    holder, cached = state.kv.lookup(user)
    kv_us = 0.0
    if use_kv and holder >= 0 and history_len > 0:
        kv_us = (cached if cached < history_len else history_len) * state._kv_rate[holder]
    source = "score"
    lc = None
    q = state.q_for_min
    q_min = float(q.min())
    if load_aware is None or not load_aware.enabled or q_min == _INF:
        score = state.ld_term + eps_us
        if emb_us is not None:
            score += emb_us
        if kv_us:
            score[holder] += kv_us
        best = int(score.argmax())
    else:
        la = load_aware
        credit = emb_us.copy() if emb_us is not None else np.zeros(state.num_nodes)
        if kv_us:
            credit[holder] += kv_us
        factor = None
        if la.credit_decay_requests != _INF:
            factor = 1.0 - (q - q_min) / la.credit_decay_requests
            np.clip(factor, 0.0, 1.0, out=factor)
            credit *= factor
        score = state.wait_term + eps_us  # the whole wait, also past queue_capacity
        score += credit
        same_batch = False
        if holder >= 0 and (la.same_batch_s > 0.0 or la.pass_while_queued):
            last = state.last_dispatch.get(user)
            if last is not None and last[0] == holder:
                if state.now_s - last[1] < la.same_batch_s:
                    same_batch = True  # a pass of its own after the user's request in the same batch
                elif la.pass_while_queued and last[2] and state.completed[holder] == last[3]:
                    same_batch = "queued"  # the previous request still waits: the same batch
                if same_batch:
                    score[holder] -= state._svc[holder]
        best = first = int(score.argmax())
        alive = state.alive
        num_live = int(np.count_nonzero(alive))
        q_sum = float(np.dot(state.queue, alive))
        mean = q_sum / num_live
        cap = None
        eligible = None
        if la.cap_factor != _INF:
            cap = math.ceil(la.cap_factor * (q_sum + 1.0) / num_live - 1e-9)
            if q[best] + 1.0 > cap:
                eligible = q + 1.0 <= cap  # the least loaded node always is: q_min + 1 <= ceil((Q + 1) / N)
                best = int(np.where(eligible, score, -_INF).argmax())
        num_near = 1
        near_us = la.near_equal_fraction * state._svc_min
        if near_us > 0.0:
            near = score >= score[best] - near_us
            if eligible is not None:
                near &= eligible
            num_near = int(np.count_nonzero(near))
            if num_near > 1:  # uniform among them: the largest of their seeded tie-breaks
                best = int(np.where(near, eps_us, -_INF).argmax())
        spilled_from = -1
        if la.hot_rel != _INF:
            qb = q[best]
            if qb > la.hot_rel * mean and qb > mean + la.hot_abs:
                spilled_from = best
                best = int((state.fill + eps_load).argmin())
                source = "spill"
        if explain:
            lc = LoadCheck(la, q.copy(), q_min, mean, num_live, factor, first, cap, eligible is not None, num_near,
                           near_us, spilled_from, same_batch)
    check = None
    if guard is not None:
        qmax = float(state.q_for_max.max())
        check = (qmax, q_min, guard[0], guard[1])
        if qmax - q_min > guard[0] and qmax > guard[1] * q_min:
            best = int((state.fill + eps_load).argmin())
            source = "guard"
    if not state._alive_mv[best]:
        raise NoLiveNodeError("no live node: every node is silent past node_timeout_s")
    return best, source, holder, cached, check, score, lc


def score_nodes(state: ClusterState, request: RouteRequest, eps_us: np.ndarray, eps_load: np.ndarray, *,
                use_kv: bool = True, use_emb: bool = True, guard: tuple[float, float] | None = None,
                policy: str = "racer", load_aware: LoadAwareConfig | None = None) -> RoutingDecision:
    """Score every node for ``request`` and pick one: a pure function of ``state`` and the inputs.

    ``eps_us``/``eps_load``: the tie-breaks added to the scores and, for the guard's fallback, to
    the loads (one value per node); ``eps_us`` also picks among near-equal nodes. ``guard``:
    ``(abs_threshold, rel_threshold)`` or ``None``. ``load_aware``: the rules under load
    (`LoadAwareConfig`), or ``None`` for the plain argmax of the expected time saved.
    """
    if type(request.user) is not int or type(request.history_len) is not int:
        request = _normalised(request)
    user = request.user
    history_len = request.history_len
    if not 0 <= user <= MAX_USER:
        raise ValueError(f"user must be an integer in [0, 2^63), got {user!r}")
    if history_len < 0:
        raise ValueError(f"history_len must be >= 0, got {history_len!r}")
    w = state.weights
    shards = request.item_shards
    num_items = len(shards)
    hot_rows = None
    emb_us = None
    if use_emb and num_items:
        hot_rows = np.dot(state.hot.hot, state.shard_counts(shards))
        emb_us = hot_rows * w.emb_us_per_row
    best, source, holder, cached, check, score, lc = _pick(state, user, history_len, emb_us, eps_us, eps_load,
                                                           use_kv, guard, load_aware, True)
    return RoutingDecision(best, state.node_ids[best], policy, source, holder, cached, check, score,
                           state.load.copy(), (w, state.node_ids, history_len, num_items, hot_rows, eps_us,
                                               use_kv, use_emb), load_check=lc)


# --------------------------------------------------------------------------------------- routers
class Router:
    """One routing policy over a `ClusterState`; every policy has this interface.

    ``route(request, now_s)`` decides and applies the optimistic update; ``route_batch(batch,
    now_s)`` routes requests arriving together (same result as routing them one by one);
    ``report``, ``complete`` and ``expire`` feed the state.
    """

    name = "router"

    def __init__(self, state: ClusterState, config: RouterConfig) -> None:
        self.state = state
        self.config = config
        n = state.num_nodes
        unit = np.random.default_rng(config.seed).random(_EPS_POOL + n)
        self._eps_us = unit * config.tie_break_us
        self._eps_load = unit * _LOAD_TIE_BREAK
        self._eps_pos = 0
        self._next_expiry_s = -_INF

    # -------------------------------------------------------------- shared plumbing
    def _next_eps(self) -> int:
        pos = self._eps_pos
        self._eps_pos = (pos + _EPS_STRIDE) & (_EPS_POOL - 1)
        return pos

    def _maybe_expire(self, now_s: float) -> None:
        if now_s >= self._next_expiry_s:
            self.state.expire(now_s)
            self._next_expiry_s = now_s + self.config.expiry_check_interval_s

    def _decide(self, request: RouteRequest) -> RoutingDecision:
        raise NotImplementedError

    def route(self, request: RouteRequest, now_s: float) -> RoutingDecision:
        """Choose a node for ``request`` at ``now_s`` and record the choice optimistically."""
        user, hl, k = request.user, request.history_len, request.num_new_items
        if type(user) is not int or type(hl) is not int or type(k) is not int:
            request = _normalised(request)
            user, hl, k = request.user, request.history_len, request.num_new_items
        if not (0 <= user <= MAX_USER and hl >= 0 and k >= 0):
            raise ValueError(f"bad request: user must be in [0, 2^63), history_len and num_new_items >= 0; "
                             f"got user={user}, history_len={hl}, num_new_items={k}")
        if not -_INF < now_s < _INF:
            raise ValueError(f"now_s must be a finite number, got {now_s!r}")
        if now_s >= self._next_expiry_s:
            self._maybe_expire(now_s)
        self.state.now_s = now_s
        d = self._decide(request)
        self.state.dispatch(d.node_index, user, hl + k, now_s)
        return d

    def route_batch(self, batch: RequestBatch, now_s: float) -> BatchRouting:
        """Route the requests of ``batch`` in order, all at ``now_s``."""
        out = np.empty(len(batch), dtype=np.int64)
        guard = np.zeros(len(batch), dtype=bool)
        holder = np.empty(len(batch), dtype=np.int64)
        for i in range(len(batch)):
            d = self.route(batch.request(i), now_s)
            out[i], guard[i], holder[i] = d.node_index, d.source == "guard", d.kv_holder
        return BatchRouting(out, guard, holder)

    def report(self, report: NodeReport) -> ReportOutcome:
        return self.state.apply_report(report)

    def complete(self, node: str | int, count: int = 1) -> None:
        self.state.complete(node, count)

    def expire(self, now_s: float) -> list[str]:
        expired = self.state.expire(now_s)
        self._next_expiry_s = now_s + self.config.expiry_check_interval_s
        return expired

    def _simple(self, request: RouteRequest, best: int, source: str, note: str = "") -> RoutingDecision:
        holder, cached = self.state.kv.lookup(request.user)
        return RoutingDecision(best, self.state.node_ids[best], self.name, source, holder, cached,
                               load=self.state.load.copy(), _note=note)


class RoundRobinRouter(Router):
    """Live nodes in index order, one request each."""

    name = "round_robin"

    def __init__(self, state: ClusterState, config: RouterConfig) -> None:
        super().__init__(state, config)
        self._cursor = 0

    def _decide(self, request: RouteRequest) -> RoutingDecision:
        n = self.state.num_nodes
        alive = self.state._alive_mv
        for step in range(n):
            i = (self._cursor + step) % n
            if alive[i]:
                self._cursor = (i + 1) % n
                return self._simple(request, i, "round_robin", f" (skipped {step} silent)" if step else "")
        raise NoLiveNodeError("no live node: every node is silent past node_timeout_s")


class LeastLoadRouter(Router):
    """The live node with the lowest ``queue_depth / queue_capacity`` (seeded ties): join the
    shortest queue. The ratio is not capped at 1 (as ``l(n)`` is), so past full queues the
    policy still balances instead of choosing at random."""

    name = "least_load"

    def _decide(self, request: RouteRequest) -> RoutingDecision:
        pos = self._next_eps()
        best = int((self.state.fill + self._eps_load[pos:pos + self.state.num_nodes]).argmin())
        if not self.state._alive_mv[best]:
            raise NoLiveNodeError("no live node: every node is silent past node_timeout_s")
        return self._simple(request, best, "least_load")


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


class UserAffinityRouter(Router):
    """Consistent hashing on the user id: ``affinity_vnodes`` points per node on a 64-bit ring;
    a user goes to the owner of the first point at or after its hash, skipping silent nodes, so
    a node falling silent moves only its own users."""

    name = "user_affinity"

    def __init__(self, state: ClusterState, config: RouterConfig) -> None:
        super().__init__(state, config)
        points = []
        for i, nid in enumerate(state.node_ids):
            for v in range(config.affinity_vnodes):
                h = int.from_bytes(hashlib.blake2b(f"{nid}#{v}".encode(), digest_size=8).digest(), "little")
                points.append((h, i))
        points.sort()
        self._points = [p for p, _ in points]
        self._owners = [o for _, o in points]

    def owner(self, user: int) -> int:
        """The node index that owns ``user`` when every node is live."""
        j = bisect.bisect_left(self._points, _splitmix64(user))
        return self._owners[j % len(self._points)]

    def _decide(self, request: RouteRequest) -> RoutingDecision:
        j = bisect.bisect_left(self._points, _splitmix64(request.user))
        alive = self.state._alive_mv
        owners = self._owners
        size = len(owners)
        first = owners[j % size]
        for step in range(size):
            o = owners[(j + step) % size]
            if alive[o]:
                note = "" if o == first else f" (owner {self.state.node_ids[first]} silent; next on the ring)"
                return self._simple(request, o, "user_affinity", note)
        raise NoLiveNodeError("no live node: every node is silent past node_timeout_s")


class ScoringRouter(Router):
    """The scoring family: ``racer`` (KV + EMB + load), ``kv_aware`` (KV + load) and ``emb_aware``
    (EMB + load), each with the imbalance guard when ``guard_enabled``."""

    use_kv = True
    use_emb = True
    name = "racer"

    def __init__(self, state: ClusterState, config: RouterConfig) -> None:
        super().__init__(state, config)
        self._guard = (config.guard_abs_threshold, config.guard_rel_threshold) if config.guard_enabled else None
        self._load_aware = config.load_aware if config.load_aware.enabled else None

    def _decide(self, request: RouteRequest) -> RoutingDecision:
        pos = self._eps_pos
        self._eps_pos = (pos + _EPS_STRIDE) & (_EPS_POOL - 1)
        end = pos + self.state.num_nodes
        return score_nodes(self.state, request, self._eps_us[pos:end], self._eps_load[pos:end],
                           use_kv=self.use_kv, use_emb=self.use_emb, guard=self._guard, policy=self.name,
                           load_aware=self._load_aware)

    def route_batch(self, batch: RequestBatch, now_s: float) -> BatchRouting:
        """Vectorised pre-pass (shard counts of every request and their EMB savings on every
        node in one matrix product), then per request the scoring rule `score_nodes` uses
        (`_pick`: K/V lookup, load, guard, argmax) and the optimistic update. Same decisions as
        calling `route` on each in order."""
        if not isinstance(batch, RequestBatch):
            raise TypeError(f"expected a RequestBatch, got {type(batch).__name__}")
        if not -_INF < now_s < _INF:
            raise ValueError(f"now_s must be a finite number, got {now_s!r}")
        self._maybe_expire(now_s)
        st = self.state
        st.now_s = now_s
        b = len(batch)
        out = np.empty(b, dtype=np.int64)
        fired = np.zeros(b, dtype=bool)
        holders = np.empty(b, dtype=np.int64)
        emb = None
        if self.use_emb and b:
            emb = (batch.shard_counts(st.num_shards) @ st.hot.hot.T) * st.weights.emb_us_per_row
        users = batch.user.tolist()
        lens = batch.history_len.tolist()
        news = batch.num_new_items.tolist()
        n = st.num_nodes
        guard = self._guard
        la = self._load_aware
        use_kv = self.use_kv
        eps_us, eps_load = self._eps_us, self._eps_load
        dispatch = st.dispatch
        for i in range(b):
            pos = self._eps_pos
            self._eps_pos = (pos + _EPS_STRIDE) & (_EPS_POOL - 1)
            user, hl = users[i], lens[i]
            best, source, holder, _, _, _, _ = _pick(st, user, hl, None if emb is None else emb[i],
                                                     eps_us[pos:pos + n], eps_load[pos:pos + n], use_kv, guard, la)
            fired[i] = source == "guard"
            dispatch(best, user, hl + news[i], now_s)
            out[i] = best
            holders[i] = holder
        return BatchRouting(out, fired, holders)


class KvAwareRouter(ScoringRouter):
    """KV locality + load (the EMB term's weight is zero)."""

    name = "kv_aware"
    use_emb = False


class EmbAwareRouter(ScoringRouter):
    """EMB locality + load (the KV term's weight is zero)."""

    name = "emb_aware"
    use_kv = False


class RacerRouter(ScoringRouter):
    """RACER's EMB-KV-aware scheduler: KV + EMB + load."""

    name = "racer"


ROUTERS: dict[str, type[Router]] = {
    "round_robin": RoundRobinRouter,
    "least_load": LeastLoadRouter,
    "user_affinity": UserAffinityRouter,
    "kv_aware": KvAwareRouter,
    "emb_aware": EmbAwareRouter,
    "racer": RacerRouter,
}


def make_router(name: str, node_ids: Sequence[str],
                profiles: CostProfile | Sequence[CostProfile] | Mapping[str, CostProfile],
                config: RouterConfig | None = None, *, now_s: float = 0.0, **overrides) -> Router:
    """Build the router ``name`` (one of `POLICIES`) over ``node_ids``.

    ``profiles``: one `CostProfile` for every node, a sequence in node order, or a mapping by
    node id. ``overrides`` replace fields of ``config``. Nodes count as heard from at ``now_s``.
    """
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(POLICIES)}")
    cfg = replace(config or RouterConfig(), **overrides).validate()
    node_ids = tuple(node_ids)
    if isinstance(profiles, CostProfile):
        plist = [profiles] * len(node_ids)
    elif isinstance(profiles, Mapping):
        missing = [n for n in node_ids if n not in profiles]
        if missing:
            raise ValueError(f"no cost profile for nodes {missing[:8]}")
        extra = [n for n in profiles if n not in set(node_ids)]
        if extra:
            raise ValueError(f"cost profiles for unknown nodes {extra[:8]}")
        plist = [profiles[n] for n in node_ids]
    else:
        plist = list(profiles)
    state = ClusterState(node_ids, plist, cfg, now_s)
    return ROUTERS[name](state, cfg)
