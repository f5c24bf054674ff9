"""Discrete-event simulation of an N-node GR serving cluster on a virtual clock.

Every simulated node runs the node agent's own `node_agent.memory.MemoryManager` (EMB LRU slab,
paged KV pool, bounded boundary moves, throttled refill) in metadata-only mode, so hit rates,
evictions and boundary moves are exactly what the real structures do; the router is the real
`gateway.router`; each node's window statistics come from the node agent's own control
core (`node_agent.control.WindowAccumulator`: the same `WindowStats` definitions, fed by the
simulated batches), and at every window boundary each node runs the agent's own control step
(`node_agent.control.control_step`: its allocator decides, `apply_target` applies the target by
the half-page rule; `ClusterSim.control`). Only time is modelled (`simulator.cost`).

The clock advances in slices of ``batch_window_ms``. A node serves the requests the router sent it
during a slice as one micro-batch (a GPU batching window): the batch starts when the slice ends
or when the node's previous batch finishes, whichever is later, and all its requests finish
together. A batch larger than the profile's ``max_batch`` is split into consecutive batches.
Inside a batch, requests touch the KV pool in arrival order (lookup, then append of the tokens
prefilled), and the batch's embedding ids (recomputed history items, new items, candidates) go
to the EMB cache as one lookup. Completions are reported to the router when the virtual clock
passes them (its load term); every ``report_interval_s`` each node reports its evicted users and
hot shards; every ``control_interval_s`` the allocator sets each node's target ``emb_share``
and the Memory Manager moves the boundary one bounded step per slice, refilling in the
background within its byte budget.

Candidates: each request ranks ``num_candidates`` items drawn from the trace's item popularity
(a retrieval stage's output), from a seeded pool shared by all runs with the same seed.
"""

from __future__ import annotations

import heapq
import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch

from common.config import ranged, require
from common.config import validate as validate_fields
from common.weights import CostProfile as RouterProfile
from gateway.router import LoadAwareConfig, NodeReport, RequestBatch, make_router
from node_agent.emulated import emulated_refill
from node_agent.memory import KVLayout, MemoryConfig, MemoryManager
from node_agent.control import MissCosts, WindowAccumulator, apply_target
from node_agent.features import WindowStats
from workloads.candidates import CAND_POOL as _CAND_POOL
from workloads.candidates import candidate_pool  # noqa: F401 (re-exported)
from workloads.regimes import RequestStream

from .allocators import Allocator
from .cost import batch_duration_us, extra_passes_us, request_compute_us, user_passes
from .profiles import A100_HSTU, CostProfile



@dataclass(frozen=True)
class SimConfig:
    """Cluster settings; `validate` checks ranges.

    - ``cache_bytes``: HBM per node for the two caches; ``None`` sizes it as ``cache_fraction``
      of the trace's embedding table (num_items x the profile's row bytes), see profiles.py;
    - ``batch_window_ms``: the slice, and so the micro-batching window;
    - ``refill_limit_fraction``: the background refill's byte budget as a fraction of the link;
    - ``max_step_fraction``: the most of the arena one boundary step (one slice) moves;
    - ``hot_shard_min_mass``: a shard is hot on a node when the node's slab holds at least this
      share of the shard's popularity mass (what the node reports to the router);
    - ``ghost_probes``: the caches' ghost probes (`MemoryConfig.ghost_probes`); off by default
      here (they cost the simulator ~15% of its speed and change no decision of the caches);
      on, every `WindowStats` carries the nodes' marginal utilities of memory;
    - ``miss_curves``: the caches' miss-ratio curves (`MemoryConfig.miss_curves`; None: on with
      the ghost lists, as in the node agent); on, each node's control step hands them to its
      allocator;
    - ``load_aware``: the scoring routers' rules under load (`gateway.router.LoadAwareConfig`);
      ``None`` keeps the router's defaults; ``pass_while_queued`` is always off here, since a
      simulated node batches by slice, not from its queue;
    - ``router_seed``: the seed of the router's tie-breaks (``None``: ``seed``); the same stream
      with another router seed shows how much of a P99 is the router's own randomness.
    """

    num_nodes: int = ranged(32, lo=1, integer=True)
    profile: CostProfile = A100_HSTU
    cache_bytes: int | None = ranged(None, lo=0, lo_open=True, optional=True)
    cache_fraction: float = ranged(0.25, lo=0, lo_open=True)
    batch_window_ms: float = ranged(10.0, lo=0, lo_open=True)
    control_interval_s: float = ranged(1.0, lo=0, lo_open=True)
    report_interval_s: float = ranged(0.25, lo=0, lo_open=True)
    slo_ms: float = ranged(30.0, lo=0, lo_open=True)
    initial_emb_share: float = ranged(0.5, lo=0, hi=1)
    refill_limit_fraction: float = ranged(0.1, lo=0, lo_open=True)
    max_step_fraction: float = ranged(0.05, lo=0, lo_open=True)
    hot_shard_min_mass: float = ranged(0.5, lo=0, hi=1)
    queue_capacity: int = 64
    ghost_probes: tuple[float, ...] = ()
    miss_curves: bool | None = None
    seed: int = 0
    load_aware: LoadAwareConfig | None = None
    router_seed: int | None = ranged(None, integer=True, optional=True)

    def validate(self) -> "SimConfig":
        validate_fields(self)
        require(self, self.control_interval_s * 1000 >= self.batch_window_ms,
                "control_interval_s must be at least one batch window")
        self.profile.validate()
        return self


@dataclass
class SimResult:
    """What one run produced. Arrays are per request (arrival order) or per window x node."""

    allocator: str
    router: str
    latency_s: np.ndarray  # per request: finish - arrival
    node: np.ndarray  # per request: the node that served it
    window_p99_ms: np.ndarray  # per control window, over the requests that arrived in it
    window_slo: np.ndarray  # per window: share within the SLO
    shares: np.ndarray  # [windows, nodes]: emb_share in effect at the end of each window
    targets: np.ndarray  # [windows, nodes]: the allocator's target for the window
    emb_lookups: int
    emb_hits: int
    kv_history_tokens: int
    kv_hit_tokens: int
    refill_bytes: int
    boundary_bytes_copied: int
    duration_s: float
    slo_ms: float
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        lat_ms = self.latency_s * 1e3
        n = len(lat_ms)
        done = int(np.sum(self.latency_s_finish() <= self.duration_s)) if n else 0
        return {
            "allocator": self.allocator,
            "router": self.router,
            "num_requests": n,
            "p50_ms": round(float(np.percentile(lat_ms, 50)), 3) if n else None,
            "p99_ms": round(float(np.percentile(lat_ms, 99)), 3) if n else None,
            "slo_attainment": round(float(np.mean(lat_ms <= self.slo_ms)), 5) if n else None,
            "throughput_rps": round(done / self.duration_s, 2),
            "emb_hit_rate": round(self.emb_hits / self.emb_lookups, 5) if self.emb_lookups else None,
            "kv_hit_rate": round(self.kv_hit_tokens / self.kv_history_tokens, 5) if self.kv_history_tokens else None,
            "mean_share": round(float(self.shares.mean()), 4),
            "refill_bytes": int(self.refill_bytes),
            "boundary_bytes_copied": int(self.boundary_bytes_copied),
            "wall_s": round(self.wall_s, 2),
        }

    def latency_s_finish(self) -> np.ndarray:
        return self.extra["arrival_s"] + self.latency_s


class _Window:
    """Per-node service figures of one control interval for the router's reports (requests
    dispatched and their batches' modelled busy time: the node's measured service time)."""

    __slots__ = ("n", "busy_us")

    def __init__(self) -> None:
        self.n = 0
        self.busy_us = 0.0


class _Node:
    __slots__ = ("index", "id", "mm", "busy_until", "win", "seq", "acc")

    def __init__(self, index: int, mm: MemoryManager) -> None:
        self.index = index
        self.id = f"node-{index:03d}"
        self.mm = mm
        self.busy_until = 0.0
        self.win = _Window()
        self.seq = 0
        self.acc = WindowAccumulator(0.0)  # the control core's window (node_agent.control)


def memory_config(trace_num_items: int, cfg: SimConfig) -> MemoryConfig:
    """The metadata-only `MemoryConfig` of one simulated node (page = profile's KV page)."""
    prof = cfg.profile
    if prof.kv_bytes_per_token % 8 or prof.emb_row_bytes % 4 or prof.page_bytes % prof.emb_row_bytes:
        raise ValueError("profile sizes must give whole float32 K/V and rows, and pages of whole rows")
    kv = KVLayout(num_layers=1, num_heads=1, head_dim=prof.kv_bytes_per_token // 8, page_tokens=prof.page_tokens,
                  dtype="float32")
    cache_bytes = cfg.cache_bytes or int(cfg.cache_fraction * trace_num_items * prof.emb_row_bytes)
    num_pages = max(2, cache_bytes // prof.page_bytes)
    return MemoryConfig(
        num_pages=int(num_pages), num_items=trace_num_items, emb_dim=prof.emb_row_bytes // 4, emb_dtype="float32",
        kv=kv, initial_emb_share=cfg.initial_emb_share,
        max_step_pages=max(1, int(cfg.max_step_fraction * num_pages)),
        refill=emulated_refill(prof, cfg.refill_limit_fraction, cfg.batch_window_ms),
        ghost_probes=tuple(cfg.ghost_probes), miss_curves=cfg.miss_curves, payload=False, device="cpu",
    )


def router_profile(stream: RequestStream, cfg: SimConfig, service_time_us: float | None = None) -> RouterProfile:
    """The router's view of a simulated node's costs (its weights come from these).

    ``service_time_us``: the node's measured busy time per request (batch time over batch size),
    which nodes report as they run; the first estimate is a mean request that misses its K/V and
    half of its embedding rows, with its compute overlapped ``batch_speedup`` ways."""
    prof = cfg.profile
    if service_time_us is None:
        L = float(np.mean(stream.history_len)) if len(stream) else 0.0
        n = float(np.mean(stream.num_new_items)) if len(stream) else 0.0
        nc = float(np.mean(stream.num_candidates)) if len(stream) else 0.0
        comp = float(request_compute_us(prof, np.zeros(1), np.array([L]), np.array([n]), np.array([nc]))[0])
        service_time_us = (prof.request_overhead_us + comp / prof.batch_speedup
                           + 0.5 * (L + n + nc) * prof.emb_transfer_us_per_row)
    return RouterProfile(kv_recompute_us_per_token=prof.kv_recompute_us_per_token,
                         emb_transfer_us_per_row=prof.emb_transfer_us_per_row,
                         service_time_us=float(service_time_us), queue_capacity=cfg.queue_capacity)


def _gather(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenate ranges ``[starts[i], starts[i] + lens[i])`` (int64)."""
    total = int(lens.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    ends = np.cumsum(lens)
    return np.repeat(starts - (ends - lens), lens) + np.arange(total)


def feed_batches(accs, batch_node, starts, ends, bstart, bsize, arrival, users, L, cached, emb_req, emb_hit):
    """The simulator's feed of the control core (`node_agent.control.WindowAccumulator`): batch
    ``j`` ran on node ``batch_node[j]`` over ``[starts[j], ends[j]]`` and holds requests
    ``[bstart[j], bstart[j] + bsize[j])`` of the per-request arrays (arrival time, user, history
    length, history tokens cached); ``emb_req[j]`` / ``emb_hit[j]`` are its EMB rows and hits.
    Returns each request's latency: its batch's end minus its arrival (all of a batch's
    requests finish together)."""
    b_of = np.repeat(np.arange(len(bstart)), bsize)
    lat = ends[b_of] - arrival
    for j, (r0, size) in enumerate(zip(np.asarray(bstart).tolist(), np.asarray(bsize).tolist())):
        r1 = r0 + size
        accs[int(batch_node[j])].add_batch(starts[j], ends[j], lat[r0:r1], users[r0:r1], L[r0:r1], cached[r0:r1],
                                           emb_req[j], emb_hit[j])
    return lat


def simulate(stream: RequestStream, cfg: SimConfig, allocator: Allocator, router: str = "racer", *,
             progress: bool = False, desc: str | None = None, record: list | None = None) -> SimResult:
    """Run ``stream`` through a cluster of ``cfg.num_nodes`` nodes; see the module docstring.

    ``allocator`` picks every node's target ``emb_share`` each control interval from the node's
    `WindowStats`. ``record``: when a list is given, every operation on a node's memory is
    appended in order: ``("batch", node, start_s, request indices, cached tokens per request,
    embedding ids after the recomputed history items (new items, candidates), EMB hits)`` (the
    batch's lookup is the requests' history items ``[cached, history_len)`` in order, then those),
    ``("target", node, share, now_s, applied_at_once)`` and ``("step", node, now_s)``, so tests
    can replay them on payload-carrying structures."""
    allocator.reset(cfg.num_nodes, cfg.initial_emb_share)
    sim = ClusterSim(stream, cfg, router, initial_share=allocator.initial_share(), name=allocator.name,
                     record=record)
    with _progress(sim, progress, desc or f"{allocator.name}/{router}"):
        out = sim.start()
        while out is not None:
            out = sim.control(allocator)
    return sim.result()


def run_cluster(stream: RequestStream, cfg: SimConfig, router: str = "racer", *, initial_share: float | None = None,
                name: str = "external", progress: bool = False, desc: str | None = None, record: list | None = None):
    """The simulation as a generator: at every control-interval boundary after the first it yields
    ``(now_s, [WindowStats per node])`` and takes back the list of target ``emb_share`` per node
    (``send``); it returns the `SimResult` (``StopIteration.value``). The PPO environment
    (policies/env.py) drives it one interval per step; `simulate` runs an `Allocator`'s control
    steps instead (`ClusterSim.control`).

    ``initial_share``: a split applied at once at start-up (a static configuration); ``None``
    starts every node at ``cfg.initial_emb_share``."""
    sim = ClusterSim(stream, cfg, router, initial_share=initial_share, name=name, record=record)
    with _progress(sim, progress, desc or f"{name}/{router}"):
        out = sim.start()
        while out is not None:
            decided = yield out
            out = sim.advance(decided)
    return sim.result()


@contextmanager
def _progress(sim: "ClusterSim", progress: bool, desc: str):
    """A progress bar over the run's requests (``progress``), closed however the run ends."""
    if progress:
        from tqdm import tqdm

        sim.bar = tqdm(total=len(sim.stream), desc=desc, unit="req", leave=False, mininterval=0.5)
    try:
        yield
    finally:
        if sim.bar is not None:
            sim.bar.close()


class _Inputs:
    """Read-only per-run arrays (shared between forks): the stream's per-request columns, the
    offsets of each request's new items and candidates, the candidate pool, the trace's item
    shards and popularity; `ClusterSim` adds the slice and window bounds."""

    def __init__(self, stream: RequestStream, seed: int) -> None:
        trace = stream.trace
        n_req = len(stream)
        self.arrival = stream.arrival_s
        self.users_all = stream.user
        self.hist_all = stream.history_len.astype(np.int64)
        self.nnew_all = stream.num_new_items.astype(np.int64)
        self.ncand_all = stream.num_candidates.astype(np.int64)
        _, self.new_items = stream.all_new_items()
        self.new_off = np.zeros(n_req + 1, dtype=np.int64)
        np.cumsum(self.nnew_all, out=self.new_off[1:])
        self.cand_off = np.zeros(n_req + 1, dtype=np.int64)
        np.cumsum(self.ncand_all, out=self.cand_off[1:])
        self.pool = candidate_pool(trace, seed)
        self.item_shard = trace.item_shard.astype(np.int64)
        self.pop = trace.item_popularity().astype(np.float64)
        self.shard_mass = np.bincount(self.item_shard, weights=self.pop, minlength=trace.num_shards)
        self.offs, self.titems = trace.offsets, trace.items
        self.base_user, self.rotation = stream.base_user, stream.rotation


class _Batches(NamedTuple):
    """A slice's requests grouped by node (arrival order within a node) and cut into micro-batches:
    ``sidx`` the request indices in that order, ``snode`` their nodes, ``node_start`` where each
    node's run begins, ``bstart`` / ``bsize`` each batch's first position and size, ``b_of`` each
    position's batch."""

    sidx: np.ndarray
    snode: np.ndarray
    node_start: np.ndarray
    bstart: np.ndarray
    bsize: np.ndarray
    b_of: np.ndarray


def _group_batches(idx: np.ndarray, routed: np.ndarray, max_batch: int) -> _Batches:
    """Requests ``idx`` routed to ``routed``, grouped by node, in batches of at most ``max_batch``."""
    order = np.argsort(routed, kind="stable")
    sidx = idx[order]
    snode = routed[order]
    n = len(sidx)
    node_start = np.flatnonzero(np.r_[True, snode[1:] != snode[:-1]])
    pos_in_node = np.arange(n) - np.repeat(node_start, np.diff(np.r_[node_start, n]))
    bstart = np.flatnonzero(pos_in_node % max_batch == 0)
    bsize = np.diff(np.r_[bstart, n])
    b_of = np.repeat(np.arange(len(bstart)), bsize)
    return _Batches(sidx, snode, node_start, bstart, bsize, b_of)


def _kv_pass(nodes, users: np.ndarray, L: np.ndarray, nn: np.ndarray, snode: np.ndarray) -> np.ndarray:
    """The KV pool of each request's node, request by request (lookup, then append of the tokens
    prefilled); returns the tokens each request reused.

    A user's cached tokens are the first positions of its sequence (history, then new items), as
    the node agent's engine keeps them (`node_agent.paged_kv.plan_kv_reuse`: reused while they are a
    prefix of the request's history + new items): the previous request's new items stay reusable
    when the next history does not yet hold all of them; more cached tokens than the request's
    whole sequence are no prefix (the history was capped since) and are evicted."""
    cached_l = []
    for u, lj, nj, ni in zip(users.tolist(), L.tolist(), nn.tolist(), snode.tolist()):
        kv = nodes[ni].mm.kv
        cj = kv.lookup(u, lj)
        if cj > lj + nj:
            kv.evict(u)
            cj = 0
        cached_l.append(cj)
        t = lj + nj - cj
        if t > 0:
            kv.append(u, t)
    return np.array(cached_l, dtype=np.int64)


class _EmbIds(NamedTuple):
    """A slice's embedding ids, batch after batch: batch ``j``'s are ``ids[seg[j]:seg[j + 1]]`` with
    their repeat ``counts`` (passed to the lookup where ``repeated[j]``), its first ``hist_b[j]``
    the recomputed history items."""

    ids: np.ndarray
    counts: np.ndarray
    seg: np.ndarray
    hist_b: np.ndarray
    repeated: np.ndarray


def _emb_ids(c: _Inputs, g: _Batches, users, cached, L, skip, nlook, nc, candidates: np.ndarray) -> _EmbIds:
    """Each batch's embedding ids, laid out batch after batch: the recomputed history items of its
    requests (positions ``[cached, L)``, item ``base[(p + rotation) % blen]``; a history longer
    than its base cycles through it, so each distinct base position is looked up once with a
    repeat count, `EmbCache.lookup(counts=)`), then their new items (the ``nlook`` after the
    ``skip`` reused), then their ``candidates`` (the slice's, request by request)."""
    bstart, b_of = g.bstart, g.b_of
    n = len(g.sidx)
    span = L - cached  # > 0: a KV miss, the span is recomputed
    bu = c.base_user[users]
    blen = c.offs[bu + 1] - c.offs[bu]
    hcnt = np.where(span > 0, np.minimum(span, blen), 0)
    per_req = hcnt + nlook + nc
    tot_b = np.add.reduceat(per_req, bstart)
    seg = np.zeros(len(bstart) + 1, dtype=np.int64)
    np.cumsum(tot_b, out=seg[1:])
    hist_b = np.add.reduceat(hcnt, bstart)
    new_b = np.add.reduceat(nlook, bstart)

    def within(x):  # exclusive prefix sums of x inside each batch
        ex = np.cumsum(x) - x
        return ex - ex[bstart][b_of]

    base = seg[:-1][b_of]
    ids = np.empty(int(seg[-1]), dtype=np.int64)
    counts = np.ones(len(ids), dtype=np.int64)
    hpos = _gather(base + within(hcnt), hcnt)
    if len(hpos):
        rq = np.repeat(np.arange(n), hcnt)
        mc, bl = cached[rq], blen[rq]
        p = _gather(cached, hcnt)
        ids[hpos] = c.titems[c.offs[bu][rq] + (p + c.rotation[users][rq]) % bl]
        sp = span[rq]
        counts[hpos] = sp // bl + ((p - mc) < sp % bl)
    ids[_gather(base + hist_b[b_of] + within(nlook), nlook)] = c.new_items[_gather(c.new_off[g.sidx] + skip, nlook)]
    ids[_gather(base + (hist_b + new_b)[b_of] + within(nc), nc)] = candidates
    repeated = np.zeros(len(bstart), dtype=bool)  # batches that pass repeat counts
    nonempty = tot_b > 0
    if nonempty.any():
        repeated[nonempty] = np.maximum.reduceat(counts, seg[:-1][nonempty]) > 1
    return _EmbIds(ids, counts, seg, hist_b, repeated)


class ClusterSim:
    """The cluster's whole state on the virtual clock, advanced one control window at a time.

    `start` runs the first window; `advance(targets)` applies one target ``emb_share`` per node at
    the current window boundary and runs up to the next; both return ``(now_s, [WindowStats])`` at
    that boundary, or ``None`` once the stream is over; `result` builds the `SimResult`. `fork`
    copies the state (nodes' memory managers, router, queues, latencies so far) while sharing the
    read-only stream, so a run can be continued several ways from one point: the replay oracle
    (`oracle_replay`) tries every share on each window from its own state this way."""

    def __init__(self, stream: RequestStream, cfg: SimConfig, router: str = "racer", *,
                 initial_share: float | None = None, name: str = "external", record: list | None = None) -> None:
        import time as _time

        self._wall0 = _time.perf_counter()
        self.cfg = cfg = cfg.validate()
        self.stream = stream
        self.name, self.router_name = name, router
        self.initial_share = initial_share
        self.record = record
        self.bar = None
        trace = stream.trace
        self.prof = prof = cfg.profile
        self.mcfg = mcfg = memory_config(trace.num_items, cfg)
        self.nodes = [_Node(i, MemoryManager(mcfg)) for i in range(cfg.num_nodes)]
        self.rp = rp = router_profile(stream, cfg)
        self.costs = MissCosts(rp.kv_recompute_us_per_token, prof.emb_transfer_us_per_row)
        # a simulated node batches by slice: a request never joins a batch an earlier slice formed
        la = replace(cfg.load_aware or LoadAwareConfig(), pass_while_queued=False)
        self.rt = make_router(router, [n.id for n in self.nodes], rp, num_shards=trace.num_shards,
                              seed=cfg.seed if cfg.router_seed is None else cfg.router_seed,
                              node_timeout_s=float("inf"), load_aware=la)
        n_req = len(stream)
        c = self._c = _Inputs(stream, cfg.seed)  # read-only, shared by forks

        self.slice_s = slice_s = cfg.batch_window_ms / 1e3
        self.duration = stream.config.duration_s
        self.num_slices = num_slices = _num_slices(self.duration, cfg)
        c.bounds = np.searchsorted(c.arrival, np.arange(num_slices + 1) * slice_s)
        c.bounds[-1] = n_req
        self.slices_per_window = _slices_per_window(cfg)
        self.slices_per_report = max(1, int(round(cfg.report_interval_s / slice_s)))
        self.num_windows = num_windows = num_windows_of(num_slices, self.slices_per_window)
        # requests [win_bounds[w], win_bounds[w + 1]) arrived in control window w (the last takes the rest)
        c.win_bounds = np.searchsorted(c.arrival, np.arange(num_windows + 1) * cfg.control_interval_s)
        c.win_bounds[-1] = n_req

        self.latency = np.zeros(n_req)
        self.node_of = np.full(n_req, -1, dtype=np.int32)
        self.shares = np.zeros((self.num_windows, cfg.num_nodes))
        self.targets = np.zeros((self.num_windows, cfg.num_nodes))
        self.completions: list[tuple[float, int, int]] = []  # (finish_s, node, count)
        self.totals = {"emb_lookups": 0, "emb_hits": 0, "kv_tokens": 0, "kv_hit_tokens": 0, "refill": 0}
        self.target_now = [cfg.initial_emb_share] * cfg.num_nodes
        self.k = 0  # the next slice to run
        self.finished = False

    # ---------------------------------------------------------------------------- driving ---
    def fork(self) -> "ClusterSim":
        """An independent copy of the state; the stream and the other read-only inputs are shared."""
        import copy

        memo = {id(self.stream): self.stream, id(self._c): self._c, id(self.cfg): self.cfg, id(self.mcfg): self.mcfg,
                id(self.record): self.record, id(self.bar): self.bar}
        return copy.deepcopy(self, memo)

    def start(self):
        """Run the first control window; see the class docstring."""
        if self.k != 0:
            raise RuntimeError("start() runs once, at the first slice")
        if self.initial_share is not None:  # a fixed split is configured at start-up
            for node in self.nodes:
                node.mm.set_target(float(self.initial_share), 0.0)
                node.mm.apply_plan(0.0)
                self.target_now[node.index] = float(self.initial_share)
                if self.record is not None:
                    self.record.append(("target", node.index, float(self.initial_share), 0.0, True))
        self.targets[0, :] = self.target_now
        self._pop_completions(0.0)
        self._run_slice_rest(0)
        self.k = 1
        return self._run_to_boundary()

    def advance(self, decided):
        """Apply one target ``emb_share`` per node at the current boundary (`apply_target`, the
        half-page rule), run to the next. For a driver that chooses targets itself (the PPO
        environment); `control` runs the allocators' control step instead."""
        if self.finished:
            raise RuntimeError("the run is over")
        nodes = self.nodes
        if decided is None or len(decided) != len(nodes):
            raise ValueError(f"need one target emb_share per node ({len(nodes)}), got {decided!r}")
        t0 = self.k * self.slice_s
        for node, target in zip(nodes, decided):
            target = float(target)
            if not (math.isfinite(target) and 0.0 <= target <= 1.0):
                raise ValueError(f"allocator {self.name} returned emb_share {target!r} for {node.id}")
            self._applied(node, target, t0, apply_target(node.mm, target, t0) is not None)
        return self._next_window()

    def control(self, allocator: Allocator):
        """The node agent's control step on every node at the current boundary
        (`Allocator.control`: `node_agent.control.control_step` on the window just closed, the
        allocator decides and the target is applied by the half-page rule), then run to the next
        boundary."""
        if self.finished:
            raise RuntimeError("the run is over")
        t0 = self.k * self.slice_s
        for node, stats in zip(self.nodes, self._stats):
            effect = allocator.control(node.index, stats, node.mm, t0)
            self._applied(node, float(effect.decision.emb_share), t0, effect.applied)
        return self._next_window()

    def _applied(self, node: _Node, target: float, t0: float, moved: bool) -> None:
        self.target_now[node.index] = target
        if moved and self.record is not None:
            self.record.append(("target", node.index, target, t0, False))
        node.win = _Window()

    def _next_window(self):
        k = self.k
        self.targets[k // self.slices_per_window, :] = self.target_now
        self._run_slice_rest(k)
        self.k = k + 1
        return self._run_to_boundary()

    def _run_to_boundary(self):
        """Run slices until the next window boundary (its completions popped, the window's figures
        taken) and return ``(now_s, stats)``, or finish the run and return ``None``."""
        spw = self.slices_per_window
        while self.k < self.num_slices:
            k = self.k
            t0 = k * self.slice_s
            self._pop_completions(t0)
            if k % spw == 0:
                wi = k // spw
                for node in self.nodes:
                    self.shares[wi - 1, node.index] = node.mm.emb_share
                self._stats = [self._window_stats(node) for node in self.nodes]
                return t0, self._stats
            self._run_slice_rest(k)
            self.k = k + 1
        self._finish()
        return None

    def _pop_completions(self, t0: float) -> None:
        comp = self.completions
        while comp and comp[0][0] <= t0:
            _, ni, cnt = heapq.heappop(comp)
            self.rt.complete(ni, cnt)

    def _finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        wi_last = (self.num_slices - 1) // self.slices_per_window
        for node in self.nodes:
            self.shares[wi_last, node.index] = node.mm.emb_share
            self.totals["emb_lookups"] += node.mm.emb.stats.num_requested_ids
            self.totals["emb_hits"] += node.mm.emb.stats.num_hits

    # ---------------------------------------------------------------------------- a slice ---
    def _run_slice_rest(self, k: int) -> None:
        """Slice ``k`` after its completions and window boundary: reports, boundary steps, routing
        and service of the requests that arrived in it."""
        c = self._c
        slice_s = self.slice_s
        t0 = k * slice_s
        t1 = t0 + slice_s
        nodes, record, totals = self.nodes, self.record, self.totals
        if k % self.slices_per_report == 0 and k > 0:
            for node in nodes:
                self._report(node, t0)
        for node in nodes:
            ms = node.mm.step(t0)
            if record is not None:
                record.append(("step", node.index, t0))
            if ms.refill_bytes:
                node.acc.add_refill_bytes(ms.refill_bytes)
                totals["refill"] += ms.refill_bytes
        a, b = int(c.bounds[k]), int(c.bounds[k + 1])
        if a == b:
            return
        idx = np.arange(a, b)
        L = c.hist_all[a:b]
        nn = c.nnew_all[a:b]
        # the router sees each request's looked-up items: new items and candidates
        sh_off = np.zeros(b - a + 1, dtype=np.int64)
        np.cumsum(nn + c.ncand_all[a:b], out=sh_off[1:])
        items = np.empty(int(sh_off[-1]), dtype=np.int64)
        pos_new = _gather(sh_off[:-1], nn)
        items[pos_new] = c.new_items[c.new_off[a]:c.new_off[b]]
        mask = np.ones(len(items), dtype=bool)
        mask[pos_new] = False
        items[mask] = self._candidates(np.arange(a, b), c.ncand_all[a:b], np.arange(c.cand_off[a], c.cand_off[b]))
        batch = RequestBatch(c.users_all[a:b], L, nn, sh_off, c.item_shard[items])
        routed = self.rt.route_batch(batch, t0).node_index
        self.node_of[a:b] = routed
        self._serve_slice(idx, routed, t1)
        if self.bar is not None:
            self.bar.update(b - a)

    def _candidates(self, req: np.ndarray, nc: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """The candidates of requests ``req`` (``nc`` each, at pool positions ``pos``), after the
        stream's item shifts (a trend's drift, an EMB burst's hot item set)."""
        cands = self._c.pool[pos % _CAND_POOL]
        if not self.stream.shifts_items:
            return cands
        return self.stream.shift_items(np.repeat(req, nc), cands, salt=1)

    def _serve_slice(self, idx: np.ndarray, routed: np.ndarray, t1: float) -> None:
        """Serve the slice's requests ``idx`` (arrival order), routed to ``routed``: each node's
        requests as micro-batches of at most ``max_batch``, the first starting at
        ``max(t1, busy_until)``, the next when the previous ends.

        The per-request bookkeeping is vectorised over the whole slice; only the memory
        structures are called per request (the KV pool, in arrival order per node) and per batch
        (the EMB cache). A node's KV pool and EMB slab do not interact within a slice (the
        boundary moves only in the manager's step, at the slice's start), so all KV operations
        of the slice run before the EMB lookups, each structure seeing its own operations in the
        order one batch after another would give it."""
        c = self._c
        nodes = self.nodes
        g = _group_batches(idx, routed, self.prof.max_batch)
        sidx = g.sidx
        users = c.users_all[sidx]
        L = c.hist_all[sidx]
        nn = c.nnew_all[sidx]
        nc = c.ncand_all[sidx]
        # 1. the KV pool, request by request (lookup, then append what was prefilled)
        cached = _kv_pass(nodes, users, L, nn, g.snode)  # reused tokens: history, then new items
        skip = np.maximum(cached - L, 0)  # new items whose K/V are reused: neither prefilled nor looked up
        nlook = nn - skip
        cached_hist = np.minimum(cached, L)  # history tokens whose K/V were reused (the KV hit tokens)
        # 2. each batch's embedding ids
        cands = self._candidates(sidx, nc, _gather(c.cand_off[sidx], nc))
        emb = _emb_ids(c, g, users, cached, L, skip, nlook, nc, cands)
        # 3. per batch: the EMB lookup, then its time on the node, one batch after another
        starts, ends, emb_req, emb_hit = self._run_batches(g, emb, users, cached, L, nn, nc, t1)
        # 4. latencies; the batches go to their nodes' control windows (node_agent.control)
        lat = feed_batches([nd.acc for nd in nodes], g.snode[g.bstart], starts, ends, g.bstart, g.bsize,
                           c.arrival[sidx], users, L, cached_hist, emb_req, emb_hit)
        self.latency[sidx] = lat
        totals = self.totals
        totals["kv_tokens"] += int(L.sum())
        totals["kv_hit_tokens"] += int(cached_hist.sum())
        n = len(sidx)
        for r0, r1 in zip(g.node_start.tolist(), np.r_[g.node_start[1:], n].tolist()):
            node = nodes[int(g.snode[r0])]
            node.win.n += r1 - r0
            node.acc.add_arrivals(r1 - r0, users[r0:r1])

    def _run_batches(self, g: _Batches, emb: _EmbIds, users, cached, L, nn, nc, t1: float):
        """Each batch of the slice in turn: its EMB lookup, its modelled time on its node (from
        ``max(t1, busy_until)``), its completion queued for the router. Returns per batch
        ``(starts, ends, EMB rows requested, EMB hits)``."""
        prof = self.prof
        nodes = self.nodes
        sidx, snode, bstart, bsize = g.sidx, g.snode, g.bstart, g.bsize
        comp = request_compute_us(prof, cached, L, nn, nc)
        passes = user_passes(g.b_of, users)  # a user's later requests in a batch: passes of their own
        later = np.maximum.reduceat(passes, bstart) > 0
        comp_first = np.where(passes == 0, comp, 0.0)
        comp_max = np.maximum.reduceat(comp_first, bstart)
        ids, seg, hist_b = emb.ids, emb.seg, emb.hist_b
        ids_t, counts_t = torch.from_numpy(ids), torch.from_numpy(emb.counts)
        ends = np.empty(len(bstart))
        starts = np.empty(len(bstart))
        emb_req = np.empty(len(bstart), dtype=np.int64)
        emb_hit = np.empty(len(bstart), dtype=np.int64)
        record = self.record
        completions = self.completions
        for j, (s0, s1) in enumerate(zip(seg[:-1].tolist(), seg[1:].tolist())):
            node = nodes[int(snode[bstart[j]])]
            mm = node.mm
            lk = mm.emb.lookup(ids_t[s0:s1], counts=counts_t[s0:s1] if emb.repeated[j] else None)
            size = int(bsize[j])
            r0 = int(bstart[j])
            start = max(t1, node.busy_until)
            if record is not None:
                record.append(("batch", node.index, start, sidx[r0:r0 + size].copy(), cached[r0:r0 + size].copy(),
                               ids[s0 + int(hist_b[j]):s1].copy(), lk.num_hits))
            csum = float(comp_first[r0:r0 + size].sum())  # ndarray.sum, as batch_time_us: the same float
            dur_us = batch_duration_us(prof, size, float(comp_max[j]), csum, lk.num_unique_misses, lk.num_hits)
            if later[j]:
                dur_us += extra_passes_us(prof, comp[r0:r0 + size], passes[r0:r0 + size])
            end = start + dur_us / 1e6
            ends[j] = end
            starts[j] = start
            emb_req[j] = lk.num_requested
            emb_hit[j] = lk.num_hits
            node.busy_until = end
            node.win.busy_us += dur_us
            heapq.heappush(completions, (end, node.index, size))
        return starts, ends, emb_req, emb_hit

    def _window_stats(self, node: _Node) -> WindowStats:
        """Close the node's control window at the current boundary (`WindowAccumulator.close_window`)."""
        return node.acc.close_window(self.k * self.slice_s, node.mm, self.costs, self.cfg.slo_ms)

    def _report(self, node: _Node, now_s: float) -> None:
        c = self._c
        delta = node.mm.kv.drain_residency()
        resident = node.mm.emb.resident_items(sort=False).cpu().numpy()
        mass = np.bincount(c.item_shard[resident], weights=c.pop[resident], minlength=len(c.shard_mass))
        hot = np.flatnonzero(mass >= self.cfg.hot_shard_min_mass * np.maximum(c.shard_mass, 1e-12))
        node.seq += 1
        w = node.win
        # the node's measured service time re-derives the router's load weight (as a node agent's
        # reports let the control plane recompute and push weights)
        profile = router_profile(self.stream, self.cfg, w.busy_us / w.n) if w.n >= 20 else None
        self.rt.report(NodeReport(node.id, at_s=now_s, seq=node.seq, hot_shards=hot, profile=profile,
                                  evicted_users=np.asarray(delta.evicted, dtype=np.int64)))

    # ----------------------------------------------------------------------------- result ---
    def window_p99_ms(self, w: int) -> float:
        """P99 (ms) of the requests that arrived in window ``w`` (all served once it has run)."""
        return self.window_p99_estimate(w)[0]

    def window_p99_estimate(self, w: int) -> tuple[float, float]:
        """``(p99_ms, standard_error_ms)`` of window ``w``'s P99. The error comes from the
        order statistics: the sample P99's rank has a standard deviation of
        ``sqrt(n 0.99 0.01)`` ranks, so the error is half the spread of the quantiles that far
        either side of 0.99."""
        wb = self._c.win_bounds
        seg = self.latency[wb[w]:wb[w + 1]]
        n = len(seg)
        if not n:
            return 0.0, 0.0
        dq = math.sqrt(0.99 * 0.01 / n)
        lo, p99, hi = np.percentile(seg, [100 * max(0.0, 0.99 - dq), 99, 100 * min(1.0, 0.99 + dq)])
        return float(p99) * 1e3, float(hi - lo) / 2 * 1e3

    def result(self) -> SimResult:
        import time as _time

        self._finish()
        cfg = self.cfg
        arrival = self._c.arrival
        num_windows = self.num_windows
        wp99 = np.zeros(num_windows)
        wslo = np.zeros(num_windows)
        lat_ms = self.latency * 1e3
        wb = self._c.win_bounds
        for w in range(num_windows):
            seg = lat_ms[wb[w]:wb[w + 1]]
            if len(seg):
                wp99[w] = np.percentile(seg, 99)
                wslo[w] = np.mean(seg <= cfg.slo_ms)
        t = self.totals
        mcfg = self.mcfg
        return SimResult(
            allocator=self.name, router=self.router_name, latency_s=self.latency, node=self.node_of,
            window_p99_ms=wp99, window_slo=wslo, shares=self.shares, targets=self.targets,
            emb_lookups=t["emb_lookups"], emb_hits=t["emb_hits"], kv_history_tokens=t["kv_tokens"],
            kv_hit_tokens=t["kv_hit_tokens"], refill_bytes=t["refill"],
            boundary_bytes_copied=sum(n.mm.boundary_bytes_copied for n in self.nodes),
            duration_s=self.duration, slo_ms=cfg.slo_ms, wall_s=_time.perf_counter() - self._wall0,
            extra={"arrival_s": arrival, "num_pages": mcfg.num_pages, "rows_per_page": mcfg.rows_per_page,
                   "page_tokens": mcfg.kv.page_tokens},
        )


def oracle_replay(stream: RequestStream, cfg: SimConfig, shares, router: str = "racer", *, rel_tol: float = 0.01,
                  ties: str = "rel_tol", name: str = "oracle",
                  first_share: float | None = None) -> tuple[SimResult, list[float]]:
    """The offline-optimal split per control window, found on the window's replay.

    At each window boundary the run is forked once per share in ``shares``; every fork runs the
    window with all nodes at its share, from the oracle's own state (its caches, queues and the
    router as the earlier choices left them); the share whose window P99 is lowest is kept (among
    shares within ``rel_tol`` of that P99, the one nearest the previous choice: the oracle does not
    move the boundary for noise) and the run continues from that fork. The first window tries each
    share as the split configured at start-up; with ``first_share`` it runs at that split alone
    (``oracle_start``: the oracle that starts where every online allocator starts, at
    ``cfg.initial_emb_share``, and knows nothing before its first window ends, so its regret
    is the start-up's floor). Greedy over one window: a share that would only pay
    off after more than one window is not seen. Returns the oracle's own `SimResult` (measured
    like any run) and its schedule (one share per window); ``result.extra["oracle_observed"][i]``
    holds the nodes' `WindowStats` the choice ``schedule[i + 1]`` followed (what a policy would
    have seen: imitation data); ``result.extra["oracle_bands"][w]`` the grid shares whose window
    P99 was within two standard errors of the best one's (`ClusterSim.window_p99_estimate`), and
    the chosen one: the shares the window's replay cannot tell apart from the best.

    ``ties="band"`` makes a *sticky* oracle: the shares that tie are the band instead of those
    within ``rel_tol``, so it moves only when another share is better beyond sampling error (a
    check of how much of the greedy oracle's edge is chosen noise; docs/simulator.md).
    """
    shares = sorted({float(s) for s in shares})
    if not shares or any(not 0.0 <= s <= 1.0 for s in shares):
        raise ValueError("oracle shares must be a non-empty list of values in [0, 1]")
    if ties not in ("rel_tol", "band"):
        raise ValueError(f"ties must be 'rel_tol' or 'band', got {ties!r}")

    bands = []  # per window: the grid shares statistically indistinguishable from the best

    def pick(cands, w, prev):
        est = [f.window_p99_estimate(w) for _, f, _ in cands]
        p99 = [e[0] for e in est]
        best = min(p99)
        se_best = est[int(np.argmin(p99))][1]
        in_band = [k for k, (v, se) in enumerate(est) if v - best <= 2.0 * math.hypot(se, se_best)]
        ok = in_band if ties == "band" else [i for i, v in enumerate(p99) if v <= best * (1 + rel_tol) + 1e-9]
        if prev is not None:
            i = min(ok, key=lambda i: (abs(cands[i][0] - prev), p99[i]))
        else:
            i = int(np.argmin(p99))
        bands.append([cands[k][0] for k in sorted(set(in_band) | {i})])  # the choice is always in it
        return cands[i]

    if first_share is not None and not 0.0 <= first_share <= 1.0:
        raise ValueError(f"first_share must be in [0, 1], got {first_share!r}")
    cands = []
    for s in (shares if first_share is None else [float(first_share)]):
        sim = ClusterSim(stream, cfg, router, initial_share=s, name=name)
        cands.append((s, sim, sim.start()))
    s, sim, out = pick(cands, 0, None)
    schedule = [s]
    observed = []  # the per-node WindowStats each later choice was made after
    w = 1
    while out is not None:
        observed.append(out[1])
        n = len(sim.nodes)
        cands = []
        for s_try in shares[:-1]:
            f = sim.fork()
            cands.append((s_try, f, f.advance([s_try] * n)))
        cands.append((shares[-1], sim, sim.advance([shares[-1]] * n)))
        s, sim, out = pick(cands, w, schedule[-1])
        schedule.append(s)
        w += 1
    res = sim.result()
    res.extra["oracle_schedule"] = schedule
    res.extra["oracle_bands"] = bands
    res.extra["oracle_observed"] = observed  # observed[i]: [WindowStats per node] before schedule[i + 1]
    return res, schedule


def _num_slices(duration_s: float, cfg: SimConfig) -> int:
    return int(math.ceil(duration_s / (cfg.batch_window_ms / 1e3)))


def _slices_per_window(cfg: SimConfig) -> int:
    return max(1, int(round(cfg.control_interval_s / (cfg.batch_window_ms / 1e3))))


def num_windows_of(num_slices: int, slices_per_window: int) -> int:
    return int(math.ceil(num_slices / slices_per_window))


def num_windows(duration_s: float, cfg: SimConfig) -> int:
    """The control windows of a run of ``duration_s`` (as `ClusterSim` counts them)."""
    return num_windows_of(_num_slices(duration_s, cfg), _slices_per_window(cfg))


def lookahead_segments(stream: RequestStream, cfg: SimConfig, num_segments: int = 4) -> list[tuple[int, int]]:
    """The windows ``[w0, w1)`` of each phase of ``stream`` (a window belongs to the phase its start
    lies in); a one-regime stream is cut into ``num_segments`` equal parts instead."""
    dt = cfg.control_interval_s
    n_w = num_windows(stream.config.duration_s, cfg)
    if len(stream.phases) >= 2:
        starts = [int(math.ceil(a / dt - 1e-9)) for _, a, _ in stream.phases]
    else:
        starts = [int(round(i * n_w / num_segments)) for i in range(num_segments)]
    starts = sorted({min(max(0, w), n_w) for w in starts} | {0})
    bounds = [w for w in starts if w < n_w] + [n_w]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def oracle_lookahead(stream: RequestStream, cfg: SimConfig, shares, router: str = "racer", *,
                     beam: int | None = None, num_segments: int = 4,
                     name: str = "oracle_lookahead") -> tuple[SimResult, list[float]]:
    """The best per-phase schedule over the grid, chosen jointly (beam search), not window by window.

    The run is cut into segments: the phases of a schedule stream (`lookahead_segments`), or
    ``num_segments`` equal parts of a one-regime stream. One share holds over each segment on every
    node. Candidates are schedules of the segments so far; each is extended by every grid share for
    the next segment (a fork of its run) and scored by the P99 of every request that arrived so far;
    the ``beam`` best (default: as many as there are shares; ``beam >= len(shares) ** segments``
    makes it exhaustive) go on. The greedy `oracle_replay` judges each 1-s window alone and cannot
    see a split that pays only later (a KV pool warmed before a burst); this one judges whole
    schedules on the whole run so far, so "what a dynamic split could be worth" is bounded by more
    than one window's choice. Returns the best schedule's `SimResult` and its share per window."""
    shares = sorted({float(s) for s in shares})
    if not shares or any(not 0.0 <= s <= 1.0 for s in shares):
        raise ValueError("oracle shares must be a non-empty list of values in [0, 1]")
    width = len(shares) if beam is None else int(beam)
    if width < 1:
        raise ValueError(f"beam must be >= 1, got {beam!r}")
    segs = lookahead_segments(stream, cfg, num_segments)

    def score(sim: ClusterSim, w_end: int) -> float:
        n = sim._c.win_bounds[min(w_end, len(sim._c.win_bounds) - 1)]
        lat = sim.latency[:n]
        return float(np.percentile(lat, 99)) if len(lat) else 0.0

    def run_segment(sim: ClusterSim, share: float, a: int, b: int, first: bool):
        n = len(sim.nodes)
        out = sim.start() if first else sim.advance([share] * n)
        for _ in range(a + 1, b):
            if out is None:
                break
            out = sim.advance([share] * n)
        return out

    a0, b0 = segs[0]
    states = []  # (score, schedule of segment shares, sim, last output)
    for s in shares:
        sim = ClusterSim(stream, cfg, router, initial_share=s, name=name)
        out = run_segment(sim, s, a0, b0, True)
        states.append((score(sim, b0), [s], sim, out))
    states = sorted(states, key=lambda x: x[0])[:width]
    for a, b in segs[1:]:
        nxt = []
        for _, sched, sim, out in states:
            if out is None:
                nxt.append((score(sim, b), sched + [sched[-1]], sim, out))
                continue
            for i, s in enumerate(shares):
                f = sim if i == len(shares) - 1 else sim.fork()
                o = run_segment(f, s, a, b, False)
                nxt.append((score(f, b), sched + [s], f, o))
        states = sorted(nxt, key=lambda x: x[0])[:width]
    _, best, sim, out = states[0]
    while out is not None:  # windows past the last segment's end (none when the segments cover the run)
        out = sim.advance([best[-1]] * len(sim.nodes))
    per_window = []
    for (a, b), s in zip(segs, best):
        per_window += [s] * (b - a)
    res = sim.result()
    res.extra["oracle_schedule"] = per_window
    res.extra["lookahead_segments"] = [list(x) for x in segs]
    res.extra["lookahead_segment_shares"] = best
    return res, per_window
