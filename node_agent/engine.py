"""The node's serving engine: EMB lookup -> KV reuse or recompute -> paged K/V write -> ranking.

One request (`RecRequest`) is a user's item sequence ``history + new_items`` (oldest first) and
the candidates to rank. `Engine.serve_batch` runs a micro-batch of them:

1. **KV plan** (per request, pure: `plan_kv_reuse`). The engine keeps, per user, the item ids and
   timestamps of the tokens whose K/V the pool holds (the pages hold only K and V). A cached
   prefix is reused only when it *is* a prefix of the request's sequence, ids and timestamps
   alike, and the pool's own token count agrees; otherwise the user's K/V are evicted and the
   whole sequence is recomputed. The reused K/V are read from the user's pages (a copy, so the
   pages may change afterwards).
2. **EMB lookup**: one `EmbCache.lookup` for the whole batch (the tokens to prefill and the
   candidates of every request; one cache tick and one host-to-device transfer). Misses are
   copied from the host table; with link emulation on, the batch then waits what the PCIe link
   would take for the missed bytes (`LinkEmulation`).
3. **Compute**: incremental prefill of the tokens not cached (full prefill on a miss), the new
   K/V appended to the users' pages, then the candidates ranked against the whole history K/V
   (candidates attend to the history and themselves, not to each other) and the top-k returned.
   With ``batched_compute`` (the default) the requests of a pass are computed together, padded:
   `plan_chunks` groups them into chunks whose padding stays within a bound (requests of one
   shape: one chunk), and per chunk the cached prefixes are gathered from the pages in one
   `torch.index_select` straight into the model's layout (`KVBlock`), then one
   `HSTUModel.prefill_batch`, one `HSTUModel.rank_batch` and one top-k run, whatever the number
   of requests; the pads are masked, so each request attends to its own prefix and its own new
   tokens only. The pages and records are updated in the pass's order, then each chunk's new
   K/V is written in one scatter per block. ``batched_compute=False`` computes one request
   after another (`HSTUModel.forward` / `rank` on contiguous `KVState` copies), the older path.
   The model runs in ``compute_dtype`` (bfloat16 on CUDA, float32 on the CPU by default).

Requests of one user inside a batch are served in arrival order in successive sub-batches, so
the second sees the first's K/V. Times are read from an injected clock (``clock``, seconds);
`serve_batch` takes ``now_s`` from the same clock. Every response carries its latency
breakdown (µs), its KV decision with the reason, EMB counts, and whether the link is emulated.

Synchronisation: the serving path never waits for the whole device. On CUDA the stages are
timed with events recorded on the serving stream (`StageTimer`; none with
``stage_timing=False``), and the host waits only where it needs a value (the answer's top-k, the
lookup's miss ids), and then only for the serving stream. The EMB refill copies on its own
stream, which waits for the serving stream's writes before it starts; the serving stream never
waits for it (`node_agent.memory.emb_cache`).

Candidates: a request may list its candidate item ids; otherwise `CandidateGenerator` draws
``num_candidates`` distinct items with probability proportional to ``popularity + 1``
(the trace's interaction counts), from a generator seeded by ``(seed, user, sequence length)``,
so the same request always gets the same candidates.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from common.config import ranged, require, validate

from .emulated import EmulatedDevice, EmulationConfig
from .memory import DEFAULT_GHOST_PROBES, KVLayout, MemoryConfig, MemoryManager, RefillConfig
from .memory.manager import BoundaryPlan, ManagerStep
from .model import HSTUModel, KVBlock, KVState, ModelConfig
from .model.checkpoint import Checkpoint, CheckpointError

# PCIe 4.0 x16: 16 GT/s x 16 lanes x 128b/130b = 31.5 GB/s per direction (PCI-SIG); pinned
# host-to-device cudaMemcpy reaches about 25 GB/s of it. A copy's fixed cost (launch, DMA set-up,
# completion) is of the order of 10 µs.
PCIE4_X16_BANDWIDTH_GB_PER_S = 25.0
PCIE4_X16_LATENCY_US = 10.0

LINK_MODES = ("auto", "on", "off")
KV_OUTCOMES = ("hit", "miss", "mismatch")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")


class RequestError(ValueError):
    """A request the engine refuses (out-of-range ids, oversize history, bad counts)."""


# ------------------------------------------------------------------------------ link emulation --


@dataclass(frozen=True)
class LinkEmulationConfig:
    """Charging EMB misses what a host-to-device link would cost.

    On CUDA the host-to-device copies of EMB misses are real; on the CPU they are memcpys that
    cost next to nothing, which would make EMB misses look free. ``mode``: ``auto`` emulates on
    the CPU and not on CUDA; ``on`` / ``off`` force it. An emulated transfer of ``b`` bytes takes
    ``latency_us + b / bandwidth`` (one transfer per lookup call with misses) and the engine
    waits that long (sleeping for the bulk of long waits, spinning for the rest).
    Defaults: PCIe 4.0 x16 (see ``PCIE4_X16_*``).
    """

    mode: str = ranged("auto", choices=LINK_MODES,
                       doc="auto: on for the CPU, off on CUDA where the copies are real")
    bandwidth_gb_per_s: float = ranged(PCIE4_X16_BANDWIDTH_GB_PER_S, lo=0, lo_open=True,
                                       doc="emulated bandwidth, GB/s (the default: PCIe 4.0 x16's)")
    latency_us: float = ranged(PCIE4_X16_LATENCY_US, lo=0,
                               doc="emulated fixed cost per transfer, µs (the default: PCIe 4.0 x16's)")

    def __post_init__(self) -> None:
        validate(self)

    def resolve(self, device: torch.device) -> "LinkEmulation":
        if self.mode == "auto":
            on = device.type != "cuda"
            why = ("auto: the device is the CPU, host-to-device copies are memcpys" if on
                   else "auto: the device is CUDA, host-to-device copies are real")
        else:
            on = self.mode == "on"
            why = f"forced {self.mode}"
        return LinkEmulation(on, float(self.bandwidth_gb_per_s), float(self.latency_us), why)


@dataclass(frozen=True)
class LinkEmulation:
    """The resolved setting; ``transfer_us`` is the pure cost model."""

    enabled: bool
    bandwidth_gb_per_s: float
    latency_us: float
    reason: str

    def transfer_us(self, num_bytes: int) -> float:
        """What moving ``num_bytes`` in one transfer costs on the emulated link (0 when off)."""
        if not self.enabled or num_bytes <= 0:
            return 0.0
        return self.latency_us + num_bytes / (self.bandwidth_gb_per_s * 1e3)  # GB/s = 1e3 bytes/µs

    def to_dict(self) -> dict:
        return asdict(self)


def wait_until(clock: Callable[[], float], deadline_s: float) -> None:
    """Block until ``clock() >= deadline_s``: sleep through all but the last 0.5 ms, then spin."""
    while True:
        left = deadline_s - clock()
        if left <= 0:
            return
        if left > 1e-3:
            time.sleep(left - 5e-4)


# ------------------------------------------------------------------------------ stage timing ---


class StageTimer:
    """Marks between a request's stages, and the µs between two marks.

    This class is the CPU's: an op's work is done when its call returns, so a mark is a reading of
    the engine's clock. `CudaStageTimer` records a timing event on the serving stream instead;
    `NoStageTimer` (stage timing off) records nothing. None of them waits for another stream: a
    refill chunk in flight on its own stream never delays an answer. `make_stage_timer` picks one.
    """

    enabled = True

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock

    def mark(self):
        return self.clock()

    def elapsed_us(self, start, end) -> float:
        return (end - start) * 1e6


class CudaStageTimer(StageTimer):
    """Timing events recorded on the serving stream (``stream``). ``elapsed_us`` waits for the
    ``end`` event only, i.e. for the serving stream's work up to it, and reads the GPU's time
    between the two events."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def mark(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.stream)
        return ev

    def elapsed_us(self, start, end) -> float:
        end.synchronize()
        return float(start.elapsed_time(end)) * 1e3  # ms


class NoStageTimer(StageTimer):
    """Stage timing off: no clock reading, no event, no wait; every stage reads 0 µs."""

    enabled = False

    def __init__(self) -> None:
        pass

    def mark(self):
        return None

    def elapsed_us(self, start, end) -> float:
        return 0.0


def make_stage_timer(device: torch.device, clock: Callable[[], float], enabled: bool = True,
                     stream=None) -> StageTimer:
    """The timer for a batch on ``device``: `NoStageTimer` when timing is off, else events on the
    serving stream (``stream``; default: the calling thread's current stream of the device) on
    CUDA and clock readings on the CPU."""
    if not enabled:
        return NoStageTimer()
    if device.type == "cuda":
        return CudaStageTimer(stream if stream is not None else torch.cuda.current_stream(device))
    return StageTimer(clock)


# ------------------------------------------------------------------------------------- config ---


@dataclass(frozen=True)
class EngineConfig:
    """The engine's one config (ranges checked in ``__post_init__``).

    - ``model``: the HSTU model; its ``qk_dim`` must equal ``v_dim`` (a KV page stores K and V
      with one head size);
    - ``num_items``: the item table's rows (from the trace); ``item_seed``: seed of the item
      table (``make_item_table``) and of the candidate generator;
    - ``num_pages`` / ``page_tokens`` / ``kv_dtype`` / ``emb_share`` / ``max_step_pages`` /
      ``refill``: the arena and its Memory Manager (see docs/memory.md);
    - ``max_history_len``: most tokens (history + new items) a request may carry;
      ``max_candidates``: most candidates; ``default_num_candidates`` / ``default_top_k``: used
      when a request leaves them out;
    - ``link``: link emulation (`LinkEmulationConfig`); ``device``: ``auto``, ``cpu``, ``cuda[:N]``;
    - ``stage_timing``: time each request's stages (`LatencyBreakdown`; on CUDA with timing events
      on the serving stream); off, the stage fields read 0 and only ``queue_us``, ``link_us`` and
      ``total_us`` are given, with no event recorded and no wait added;
    - ``ghost_probes``: the caches' ghost lists (`MemoryConfig.ghost_probes`; on by default here:
      the node agent reports the marginal utilities of memory in every control interval);
    - ``emulation``: an emulated device (`node_agent.emulated`): no model runs, the arena is
      metadata only with the profile's row and K/V token sizes, and the device's time is charged
      from the profile (``None``: the real device);
    - ``compute_dtype``: the model's weights and activations (``auto``: ``bfloat16`` on CUDA,
      ``float32`` on the CPU; `resolve_compute_dtype`); the K/V pages keep ``kv_dtype``, the EMB
      rows float32, timestamps float64;
    - ``batched_compute``: compute the requests of a pass together (`plan_chunks`,
      `HSTUModel.prefill_batch` / `rank_batch`); ``False``: one request after another (the
      older path, kept for comparison: ``python -m bench.engine`` runs both).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    num_items: int = ranged(100_000, lo=1, integer=True)
    item_seed: int = 0
    num_pages: int = ranged(4096, lo=1, integer=True, doc="arena pages")
    page_tokens: int = ranged(16, lo=1, integer=True, doc="tokens per KV page")
    kv_dtype: str = "float32"
    emb_share: float = ranged(0.5, lo=0, hi=1, doc="initial EMB share of the arena")
    max_step_pages: int = ranged(1024, lo=1, integer=True)
    refill: RefillConfig = field(default_factory=RefillConfig)
    max_history_len: int = ranged(4096, lo=1, integer=True, doc="most history + new items per request")
    max_candidates: int = ranged(4096, lo=1, integer=True, doc="most candidates per request")
    default_num_candidates: int = ranged(256, lo=1, integer=True,
                                         doc="candidates generated when a request names none and gives no count")
    default_top_k: int = ranged(10, lo=1, integer=True, doc="top-k when a request gives none")
    link: LinkEmulationConfig = field(default_factory=LinkEmulationConfig)
    device: str = "auto"
    stage_timing: bool = True
    ghost_probes: tuple[float, ...] = DEFAULT_GHOST_PROBES
    emulation: EmulationConfig | None = None
    compute_dtype: str = ranged("auto", choices=COMPUTE_DTYPES,
                                doc="the model's float type: auto is bfloat16 on CUDA, float32 on the CPU")
    batched_compute: bool = True

    def __post_init__(self) -> None:
        m = self.model.validate()
        require(self, m.qk_dim == m.v_dim, f"the KV page layout stores K and V with one head size, so the model's "
                                           f"qk_dim ({m.qk_dim}) must equal v_dim ({m.v_dim})")
        validate(self)
        require(self, isinstance(self.stage_timing, bool), f"stage_timing must be a bool, got {self.stage_timing!r}")
        require(self, isinstance(self.batched_compute, bool),
                f"batched_compute must be a bool, got {self.batched_compute!r}")
        require(self, self.default_num_candidates <= self.max_candidates,
                f"default_num_candidates ({self.default_num_candidates}) exceeds max_candidates ({self.max_candidates})")
        self.memory_config()  # the arena's own checks (page size a whole number of rows, ...)

    def memory_config(self) -> MemoryConfig:
        m = self.model
        if self.emulation is not None:  # metadata only, sized as the profile's device (as the simulator's nodes)
            prof = self.emulation.resolve()
            if prof.emb_row_bytes % 4 or prof.kv_bytes_per_token % 8:
                raise ValueError(f"profile {prof.name}: emb_row_bytes ({prof.emb_row_bytes}) must be a multiple of 4 and "
                                 f"kv_bytes_per_token ({prof.kv_bytes_per_token}) of 8 (whole float32 rows and K/V)")
            return MemoryConfig(
                num_pages=self.num_pages, num_items=self.num_items, emb_dim=prof.emb_row_bytes // 4,
                emb_dtype="float32",
                kv=KVLayout(num_layers=1, num_heads=1, head_dim=prof.kv_bytes_per_token // 8,
                            page_tokens=self.page_tokens, dtype="float32"),
                initial_emb_share=self.emb_share, max_step_pages=self.max_step_pages, refill=self.refill,
                ghost_probes=tuple(self.ghost_probes), payload=False, device="cpu")
        return MemoryConfig(
            num_pages=self.num_pages, num_items=self.num_items, emb_dim=m.embedding_dim, emb_dtype="float32",
            kv=KVLayout(num_layers=m.num_layers, num_heads=m.num_heads, head_dim=m.qk_dim,
                        page_tokens=self.page_tokens, dtype=self.kv_dtype),
            initial_emb_share=self.emb_share, max_step_pages=self.max_step_pages, refill=self.refill,
            ghost_probes=tuple(self.ghost_probes), device=self.device,
        )


def resolve_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """``EngineConfig.compute_dtype`` on ``device``: ``auto`` is bfloat16 on CUDA (tensor cores, half
    the bytes of K/V and activations) and float32 on the CPU (where bfloat16 matmuls are emulated
    on most cores and slower)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


# A pass's requests are computed in chunks padded to the chunk's longest (`plan_chunks`): a chunk
# takes a request while its padded work stays within CHUNK_PAD_RATIO x its real work plus
# CHUNK_SLACK (so small requests always share a chunk), and its largest score tensor within
# CHUNK_MAX_SCORES elements (heads x queries x keys: memory). CHUNK_LINEAR_KEYS: a token's
# projections cost about as much as attending to this many keys (the default model's sizes).
CHUNK_PAD_RATIO = 1.5
CHUNK_SLACK = 1 << 16
CHUNK_MAX_SCORES = 1 << 25
CHUNK_LINEAR_KEYS = 64


def plan_chunks(shapes: Sequence[tuple[int, int, int]], num_heads: int, *, pad_ratio: float = CHUNK_PAD_RATIO,
                slack: int = CHUNK_SLACK, max_scores: int = CHUNK_MAX_SCORES,
                linear_keys: int = CHUNK_LINEAR_KEYS) -> list[list[int]]:
    """Pure: split a pass's requests, ``shapes[i] = (cached, new, candidates)`` tokens, into chunks
    computed together (indices into ``shapes``; every index once).

    A request's work is ``(new + candidates) * (cached + new + linear_keys)`` (queries times keys,
    plus the projections); a chunk of ``k`` requests padded to its largest ``cached``, ``new`` and
    ``candidates`` does ``k`` times the work of that padded shape. Requests are taken by new
    tokens, then history length, longest first, and a request joins the current chunk while the
    chunk's padded work stays within ``pad_ratio`` x its real work + ``slack`` and its largest
    score tensor (``num_heads * k * max(new, candidates) * max(cached, new)``) within
    ``max_scores``; else it starts the next chunk. Requests of one shape make one chunk (up to
    the memory cap), whatever their number.
    """
    order = sorted(range(len(shapes)), key=lambda i: (-shapes[i][1], -(shapes[i][0] + shapes[i][1]), i))
    chunks: list[list[int]] = []
    cur: list[int] = []
    real = 0
    top = (0, 0, 0)
    for i in order:
        p, n, c = shapes[i]
        work = (n + c) * (p + n + linear_keys)
        tp, tn, tc = max(top[0], p), max(top[1], n), max(top[2], c)
        k = len(cur) + 1
        padded = k * (tn + tc) * (tp + tn + linear_keys)
        scores = num_heads * k * max(tn, tc) * max(tp, tn)
        if cur and (padded > pad_ratio * (real + work) + slack or scores > max_scores):
            chunks.append(cur)
            cur, real, (tp, tn, tc) = [], 0, (p, n, c)
        cur.append(i)
        real += work
        top = (tp, tn, tc)
    if cur:
        chunks.append(cur)
    return chunks


def make_item_table(num_items: int, dim: int, seed: int) -> torch.Tensor:
    """The host item table ``[num_items, dim]`` float32, N(0, 1/dim), deterministic per seed."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randn(num_items, dim, generator=gen) / math.sqrt(dim)


class CandidateGenerator:
    """Popularity-weighted candidates without replacement, deterministic per request.

    Item ``i`` is drawn with probability proportional to ``popularity[i] + 1`` (every item can be
    drawn). ``sample(user, seq_len, n)`` seeds a numpy generator with ``(seed, user, seq_len)``,
    draws with replacement through the cumulative weights, keeps first occurrences, and repeats
    until it has ``n`` distinct items (after 8 rounds the rest come from a seeded permutation of
    the items not yet drawn). Items the user already saw are not excluded.
    """

    def __init__(self, popularity: np.ndarray | None, num_items: int, seed: int = 0):
        w = np.ones(num_items, dtype=np.float64)
        if popularity is not None:
            pop = np.asarray(popularity, dtype=np.float64)
            if pop.shape != (num_items,) or not np.all(np.isfinite(pop)) or np.any(pop < 0):
                raise ValueError(f"popularity must be {num_items} finite counts >= 0")
            w += pop
        self.weights = w  # popularity + 1 per item
        self.cdf = np.cumsum(w)
        self.num_items = num_items
        self.seed = int(seed)

    def sample(self, user: int, seq_len: int, n: int) -> np.ndarray:
        if not 0 <= n <= self.num_items:
            raise ValueError(f"cannot draw {n} distinct candidates from {self.num_items} items")
        rng = np.random.default_rng((self.seed, int(user), int(seq_len)))
        got = np.empty(0, dtype=np.int64)
        for _ in range(8):
            if len(got) >= n:
                break
            draws = np.searchsorted(self.cdf, rng.random(2 * (n - len(got)) + 8) * self.cdf[-1], side="right")
            allv = np.concatenate([got, np.minimum(draws, self.num_items - 1)])
            _, first = np.unique(allv, return_index=True)
            got = allv[np.sort(first)]
        if len(got) < n:
            rest = np.setdiff1d(np.arange(self.num_items), got)
            got = np.concatenate([got, rng.permutation(rest)[: n - len(got)]])
        return got[:n].astype(np.int64)


# ----------------------------------------------------------------------------------- requests ---


@dataclass
class RecRequest:
    """One recommendation request.

    ``history`` then ``new_items`` is the user's item sequence, oldest first; ``timestamps``
    (seconds, optional) has one entry per item of that sequence. Without timestamps every token
    and the ranking query get time 0: the relative time bias is then the same for every pair and
    only the position bias orders the history (deterministic, so cached and recomputed K/V agree).
    ``now_ts`` is the ranking query's time (default: the last token's timestamp, 0 without
    timestamps). ``candidates`` lists item ids to rank; else ``num_candidates`` are drawn by the
    `CandidateGenerator`. ``top_k`` is clamped to the number of candidates. ``arrival_s`` is
    when the request reached the node, on the engine's clock (for the queue time).
    """

    user_id: int
    history: Sequence[int] | np.ndarray = ()
    new_items: Sequence[int] | np.ndarray = ()
    timestamps: Sequence[float] | np.ndarray | None = None
    now_ts: float | None = None
    candidates: Sequence[int] | np.ndarray | None = None
    num_candidates: int | None = None
    top_k: int | None = None
    arrival_s: float | None = None

    @classmethod
    def from_workload(cls, req, *, top_k: int | None = None, arrival_s: float | None = None) -> "RecRequest":
        """From a `workloads.Request` (no timestamps; its ``num_candidates`` are generated)."""
        return cls(user_id=int(req.user), history=np.asarray(req.history, dtype=np.int64),
                   new_items=np.asarray(req.new_items, dtype=np.int64), num_candidates=int(req.num_candidates),
                   top_k=top_k, arrival_s=arrival_s)


@dataclass(frozen=True)
class _Prepared:
    req: RecRequest
    user: int
    items: np.ndarray  # int64 [n]: history + new items
    ts: np.ndarray  # float64 [n]
    num_history: int
    now_ts: float
    candidates: np.ndarray | None  # int64, or None: generate
    num_candidates: int
    top_k: int


def _length(values) -> int:
    try:
        return len(values) if values is not None else 0
    except TypeError:
        raise RequestError("history and new_items must be lists of item ids") from None


def _int_array(name: str, values, limit: int) -> np.ndarray:
    try:
        a = np.asarray(values if values is not None else ())
    except (TypeError, ValueError, OverflowError) as e:
        raise RequestError(f"{name} must be a list of item ids ({e})") from None
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.ndim == 1 and a.dtype.kind == "O":  # ints beyond int64 (e.g. 10**23) make an object array
        for i, v in enumerate(a):
            if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and not 0 <= v < limit:
                raise RequestError(f"{name}[{i}] = {int(v)} is out of range: item ids must be in [0, {limit})")
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise RequestError(f"{name} must be a flat list of integer item ids")
    bad = np.flatnonzero((a < 0) | (a >= limit))
    if bad.size:
        i = int(bad[0])
        raise RequestError(f"{name}[{i}] = {int(a[i])} is out of range: item ids must be in [0, {limit}) "
                           f"({bad.size} out of range)")
    return a.astype(np.int64, copy=False)


# ------------------------------------------------------------------------------- KV decision ---


@dataclass(frozen=True)
class KVReuse:
    """What to do with a user's cached K/V for one request, and why.

    ``outcome``: ``hit`` (the first ``reuse_tokens`` tokens come from the pages), ``miss``
    (nothing cached), ``mismatch`` (something cached that is not a prefix of the request: it is
    evicted and the sequence recomputed). ``prefill_tokens`` are computed by the model.
    """

    outcome: str
    reuse_tokens: int
    prefill_tokens: int
    reason: str


def plan_kv_reuse(pool_tokens: int, cached_items: np.ndarray | None, cached_ts: np.ndarray | None,
                  items: np.ndarray, ts: np.ndarray) -> KVReuse:
    """Pure: compare the pool's token count and the engine's record of the cached tokens with the
    request's sequence (``items``, ``ts``)."""
    n = len(items)
    if pool_tokens == 0:
        why = "no K/V cached for the user" if cached_items is None else "the user's K/V were evicted"
        return KVReuse("miss", 0, n, why)
    if cached_items is None or len(cached_items) != pool_tokens:
        have = "no record" if cached_items is None else f"a record of {len(cached_items)}"
        return KVReuse("mismatch", 0, n, f"the pool holds {pool_tokens} tokens but the engine has {have}")
    c = pool_tokens
    if c > n:
        return KVReuse("mismatch", 0, n, f"{c} tokens cached but the request's sequence has only {n}")
    diff = np.flatnonzero(cached_items != items[:c])
    if diff.size:
        i = int(diff[0])
        return KVReuse("mismatch", 0, n, f"cached token {i} is item {int(cached_items[i])}, the request has "
                                         f"item {int(items[i])} there")
    tdiff = np.flatnonzero(cached_ts != ts[:c])
    if tdiff.size:
        i = int(tdiff[0])
        return KVReuse("mismatch", 0, n, f"cached token {i} has timestamp {float(cached_ts[i])!r}, the request "
                                         f"{float(ts[i])!r}")
    if c == n:
        return KVReuse("hit", c, 0, f"all {c} tokens cached: nothing to prefill")
    return KVReuse("hit", c, n - c, f"{c} cached tokens reused, {n - c} prefilled")


class _UserSeq:
    """The items and timestamps of one user's cached tokens (the pages hold only K/V)."""

    __slots__ = ("items", "ts", "n")

    def __init__(self) -> None:
        self.items = np.empty(0, dtype=np.int64)
        self.ts = np.empty(0, dtype=np.float64)
        self.n = 0

    def view(self) -> tuple[np.ndarray, np.ndarray]:
        return self.items[: self.n], self.ts[: self.n]

    def set(self, items: np.ndarray, ts: np.ndarray, start: int) -> None:
        """Tokens ``[start, len(items))`` of ``items``/``ts`` become cached (earlier ones already are)."""
        n = len(items)
        if n > len(self.items):
            cap = max(n, 2 * len(self.items), 64)
            ni, nt = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.float64)
            ni[: self.n], nt[: self.n] = self.items[: self.n], self.ts[: self.n]
            self.items, self.ts = ni, nt
        self.items[start:n] = items[start:]
        self.ts[start:n] = ts[start:]
        self.n = n


# ---------------------------------------------------------------------------------- responses ---


@dataclass(frozen=True)
class LatencyBreakdown:
    """Where one request's time went, in µs.

    - ``queue_us``: from arrival to the start of its micro-batch;
    - ``emb_lookup_us``: the batch's EMB lookup (shared by the batch), including ``link_us``, the
      emulated host-to-device wait for its misses (0 when the link is not emulated);
    - ``batch_wait_us``: time spent on the batch's other requests before this one's compute;
    - ``kv_read_us``: reading the reused K/V from the pages; ``kv_write_us``: appending the
      new tokens' pages and writing their K/V;
    - ``prefill_us``: the model's prefill of the tokens not cached; ``rank_us``: ranking and top-k;
      ``compute_us = prefill_us + rank_us``;
    - ``total_us``: arrival (or batch start) to the response.
    """

    queue_us: float
    emb_lookup_us: float
    link_us: float
    batch_wait_us: float
    kv_read_us: float
    prefill_us: float
    kv_write_us: float
    rank_us: float
    compute_us: float
    total_us: float

    def to_dict(self) -> dict:
        return {k: round(v, 1) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class RecResponse:
    """The top-k (items, scores; best first) with everything needed to explain the request."""

    user_id: int
    items: list[int]
    scores: list[float]
    num_candidates: int
    num_history: int
    kv: KVReuse
    kv_hit_tokens: int  # history tokens whose K/V came from the pages
    recomputed_tokens: int  # history tokens whose K/V had to be computed
    prefill_tokens: int  # every token prefilled (recomputed history + new items)
    kv_cached_after: int  # the user's tokens in the pool after the request (0: not cached)
    emb_rows: int
    emb_hits: int
    emb_batch_miss_bytes: int  # host-to-device bytes of the batch's lookup (shared by the batch)
    latency: LatencyBreakdown
    link_emulated: bool
    batch_size: int
    finished_s: float
    batch_passes: int = 1  # passes its batch took: one more for each repeat of a user in it
    device: dict | None = None  # `Engine.device_info`: real, link-emulated or emulated (and by which profile)

    def to_dict(self) -> dict:
        return {
            "user_id": self.user_id, "items": self.items, "scores": self.scores,
            "num_candidates": self.num_candidates, "num_history": self.num_history,
            "kv": {"outcome": self.kv.outcome, "reason": self.kv.reason, "hit_tokens": self.kv_hit_tokens,
                   "recomputed_tokens": self.recomputed_tokens, "prefill_tokens": self.prefill_tokens,
                   "cached_after": self.kv_cached_after},
            "emb": {"rows": self.emb_rows, "hits": self.emb_hits,
                    "batch_miss_bytes": self.emb_batch_miss_bytes},
            "latency_us": self.latency.to_dict(),
            "link_emulated": self.link_emulated,
            "batch_size": self.batch_size,
            "batch_passes": self.batch_passes,
            "device": self.device,
        }


# ------------------------------------------------------------------------------------- engine ---


def _check_serves(checkpoint: Checkpoint, config: EngineConfig) -> None:
    """Refuse a checkpoint this engine cannot serve (`CheckpointError` naming what differs)."""
    if checkpoint.config != config.model:
        a, b = asdict(checkpoint.config), asdict(config.model)
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        raise CheckpointError(f"checkpoint {checkpoint.path}: its model config differs from the one this node "
                              f"serves (checkpoint vs node: {diff})")
    if checkpoint.num_items != config.num_items:
        raise CheckpointError(f"checkpoint {checkpoint.path}: trained on {checkpoint.num_items} items, this node "
                              f"serves {config.num_items}")


def _model_info(checkpoint: Checkpoint | None, config: EngineConfig) -> dict:
    """What the node says about its weights: a checkpoint's digest, or random weights from a seed."""
    if checkpoint is None:
        return {"kind": "random", "seed": config.model.seed, "digest": None}
    return {"kind": "checkpoint", "digest": checkpoint.digest, "path": checkpoint.path,
            "trace": checkpoint.manifest.get("trace", {}).get("name")}



class Engine:
    """One device's model, arena and Memory Manager, serving `RecRequest` micro-batches.

    Not thread-safe: one caller (the node agent's device worker) drives it. ``validate`` only
    reads the config and may be called from any thread.
    """

    def __init__(self, config: EngineConfig, *, host_table: torch.Tensor | None = None,
                 item_popularity: np.ndarray | None = None, clock: Callable[[], float] = time.perf_counter,
                 now_s: float | None = None, checkpoint: Checkpoint | None = None) -> None:
        self.config = config
        self.clock = clock
        mc = config.model
        emu = config.emulation
        if checkpoint is not None:  # a trained model: its weights, and its item table in the EMB cache
            _check_serves(checkpoint, config)
            if host_table is not None:
                raise ValueError("engine: give a checkpoint or a host table, not both (the checkpoint holds the "
                                 "item table)")
            host_table = checkpoint.item_table.clone()
        if emu is not None:
            host_table = None  # metadata only: no rows to hold
        elif host_table is None:
            host_table = make_item_table(config.num_items, mc.embedding_dim, config.item_seed)
        self.mm = MemoryManager(config.memory_config(), host_table, now_s=clock() if now_s is None else now_s)
        self.device = self.mm.arena.device
        self.compute_dtype = resolve_compute_dtype(config.compute_dtype, self.device)
        self.emu: EmulatedDevice | None = None
        if emu is not None:  # no model: the device's time is charged from the profile
            waiter = getattr(clock, "wait_until", None) or (lambda t: wait_until(clock, t))
            self.emu = EmulatedDevice(emu.resolve(), emu.time_scale, wait_until=waiter)
            self.model = None
        elif checkpoint is not None:
            self.model = HSTUModel(mc)
            self.model.load_state_dict(checkpoint.model.state_dict())
            self.model = self.model.to(self.device, self.compute_dtype)
        else:
            self.model = HSTUModel(mc).to(self.device, self.compute_dtype)
        self.model_info = _model_info(checkpoint, config)
        # an emulated device charges its own link (EmulatedDevice); the CPU's link emulation is off
        self.link = (LinkEmulationConfig(mode="off") if emu is not None else config.link).resolve(self.device)
        if emu is not None:
            self.link = replace(self.link, reason="emulated device: the profile's link is charged instead")
        self.candidates = CandidateGenerator(item_popularity, config.num_items, config.item_seed)
        self._seqs: dict[int, _UserSeq] = {}
        self._prune_at = 1024
        cdt = self.compute_dtype
        self._empty_kv = KVState(
            [torch.zeros(0, mc.num_heads, mc.qk_dim, device=self.device, dtype=cdt) for _ in range(mc.num_layers)],
            [torch.zeros(0, mc.num_heads, mc.v_dim, device=self.device, dtype=cdt) for _ in range(mc.num_layers)],
            torch.zeros(0, dtype=torch.float64, device=self.device))
        self.num_served = 0
        self.kv_outcomes = {k: 0 for k in KV_OUTCOMES}
        self.num_uncacheable = 0
        self.link_us_total = 0.0
        self._device_info: dict | None = None
        # an emulated device's last batch on its own timeline (first pass's start, last pass's end);
        # None on a real device, whose batches the caller times itself
        self.last_batch_span: tuple[float, float] | None = None

    # ------------------------------------------------------------------------- validation ---
    def validate(self, req: RecRequest) -> _Prepared:
        """Check a request against the config; returns its normalised form or raises `RequestError`."""
        c = self.config
        if isinstance(req.user_id, bool) or not isinstance(req.user_id, (int, np.integer)) or req.user_id < 0:
            raise RequestError(f"user_id must be a non-negative integer, got {req.user_id!r}")
        nh, nn = _length(req.history), _length(req.new_items)
        if nh + nn > c.max_history_len:  # before looking at the ids: an oversize request costs nothing
            raise RequestError(f"history ({nh}) + new_items ({nn}) = {nh + nn} tokens exceeds "
                               f"max_history_len {c.max_history_len}")
        hist = _int_array("history", req.history, c.num_items)
        new = _int_array("new_items", req.new_items, c.num_items)
        n = len(hist) + len(new)
        items = np.concatenate([hist, new])
        if req.timestamps is None:
            ts = np.zeros(n, dtype=np.float64)
            default_now = 0.0
        else:
            try:
                ts = np.asarray(req.timestamps, dtype=np.float64)
            except (TypeError, ValueError):
                raise RequestError("timestamps must be a list of numbers (seconds)") from None
            if ts.ndim != 1 or len(ts) != n:
                raise RequestError(f"timestamps must have one entry per history and new item ({n}), got "
                                   f"{ts.size}")
            if not np.all(np.isfinite(ts)):
                raise RequestError("timestamps must be finite numbers")
            default_now = float(ts[-1]) if n else 0.0
        now_ts = default_now if req.now_ts is None else req.now_ts
        if isinstance(now_ts, bool) or not isinstance(now_ts, (int, float, np.integer, np.floating)) \
                or not math.isfinite(now_ts):
            raise RequestError(f"now_ts must be a finite number, got {req.now_ts!r}")
        if req.candidates is not None:
            cands = _int_array("candidates", req.candidates, c.num_items)
            if len(cands) == 0:
                raise RequestError("candidates must list at least one item id")
            if len(cands) > c.max_candidates:
                raise RequestError(f"{len(cands)} candidates exceed max_candidates {c.max_candidates}")
            num_c = len(cands)
        else:
            cands = None
            num_c = c.default_num_candidates if req.num_candidates is None else req.num_candidates
            if isinstance(num_c, bool) or not isinstance(num_c, (int, np.integer)) or num_c < 1:
                raise RequestError(f"num_candidates must be a positive integer, got {num_c!r}")
            limit = min(c.max_candidates, c.num_items)
            if num_c > limit:
                raise RequestError(f"num_candidates {num_c} exceeds the limit {limit} "
                                   f"(min of max_candidates {c.max_candidates} and num_items {c.num_items})")
        top_k = c.default_top_k if req.top_k is None else req.top_k
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
            raise RequestError(f"top_k must be a positive integer, got {top_k!r}")
        return _Prepared(req, int(req.user_id), items, ts, len(hist), float(now_ts), cands, int(num_c),
                         int(min(top_k, num_c)))

    # ---------------------------------------------------------------------------- serving ---
    def serve(self, req: RecRequest, now_s: float | None = None) -> RecResponse:
        return self.serve_batch([req], now_s)[0]

    def serve_batch(self, reqs: Sequence[RecRequest], now_s: float | None = None) -> list[RecResponse]:
        """Serve a micro-batch (see the module docstring). ``now_s``: the batch's start on the
        engine's clock (default: ``clock()``). Raises `RequestError` before doing anything if
        a request is invalid."""
        preps = [self.validate(r) for r in reqs]
        t0 = self.clock() if now_s is None else now_s
        self._span_start: float | None = None
        out: list[RecResponse | None] = [None] * len(preps)
        # sub-batches in which each user appears once, in arrival order
        pending = list(range(len(preps)))
        passes = 0
        while pending:
            passes += 1
            seen: set[int] = set()
            group, rest = [], []
            for i in pending:
                (rest if preps[i].user in seen else group).append(i)
                seen.add(preps[i].user)
            serve = (self._serve_group_emulated if self.emu is not None
                     else self._serve_group_batched if self.config.batched_compute else self._serve_group)
            for i, resp in zip(group, serve([preps[i] for i in group], t0, len(preps), passes == 1)):
                out[i] = resp
            pending = rest
        self._prune_seqs()
        if passes > 1:  # every answer of the batch waited for all its passes
            out = [replace(r, batch_passes=passes) for r in out]
        return out  # type: ignore[return-value]

    def _sync_serving(self) -> None:
        """Wait for the work queued so far on this thread's serving stream (CUDA; nothing on the
        CPU). Other streams, the EMB refill's among them, are not waited for."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _serve_group(self, preps: list[_Prepared], t_batch: float, batch_size: int,
                     first_pass: bool = True) -> list[RecResponse]:
        clock, mm, dev = self.clock, self.mm, self.device
        # stage marks: clock readings on the CPU, events on the serving stream on CUDA; the host
        # waits only where it needs a value (the answer's top-k), and only for the serving stream
        timer = make_stage_timer(dev, clock, self.config.stage_timing)
        us = timer.elapsed_us
        cdt = self.compute_dtype
        # 1. KV plan and reads (a copy of the reused K/V, so later appends may evict freely)
        plans: list[KVReuse] = []
        pasts: list[KVState | None] = []
        read_marks: list[tuple] = []
        cands: list[np.ndarray] = []
        for p in preps:
            m_read = timer.mark()
            plan = self._plan_kv(p)
            past = None
            if plan.reuse_tokens:
                ks, vs = mm.kv.read_layers(p.user, plan.reuse_tokens)
                if ks[0].dtype != cdt:
                    ks, vs = [k.to(cdt) for k in ks], [v.to(cdt) for v in vs]
                past = KVState(ks, vs, torch.from_numpy(p.ts[: plan.reuse_tokens]).to(dev))
            read_marks.append((m_read, timer.mark()))
            plans.append(plan)
            pasts.append(past)
            cands.append(p.candidates if p.candidates is not None
                         else self.candidates.sample(p.user, len(p.items), p.num_candidates))
        # 2. one EMB lookup for the group: tokens to prefill, then candidates, request by request
        lk, sizes, hits_per_req, link_us, m_emb, m_emb_end = self._emb_lookup(preps, plans, cands, timer)
        emb_us: float | None = None  # read once the first answer has waited for the serving stream
        read_us: list[float] = []
        rows_all = lk.rows
        # 3. per request: prefill, write K/V, rank
        out: list[RecResponse] = []
        off = 0
        for j, (p, plan, past, c) in enumerate(zip(preps, plans, pasts, cands)):
            m_start = timer.mark()
            n_new = len(p.items) - plan.reuse_tokens
            rows = rows_all[off: off + sizes[j]]
            off += sizes[j]
            new_rows, cand_rows = rows[:n_new].to(cdt), rows[n_new:].to(cdt)
            new_kv = None
            if n_new:
                ts_new = torch.from_numpy(p.ts[plan.reuse_tokens:]).to(dev)
                _, new_kv = self.model(self.model.tokens(new_rows), ts_new, past=past)
            if past is None:
                full = new_kv if new_kv is not None else self._empty_kv
            else:
                full = past if new_kv is None else past.append(new_kv)
            m_prefill = timer.mark()
            cached_after = self._write_kv(p, plan, new_kv, full)
            m_write = timer.mark()
            scores = self.model.rank(cand_rows, full, now_ts=torch.tensor(p.now_ts, dtype=torch.float64, device=dev))
            top = torch.topk(scores, p.top_k)
            m_end = timer.mark()
            # the answer's host values: these copies wait for the serving stream (only)
            top_items = c[top.indices.cpu().numpy()].tolist()
            top_scores = top.values.cpu().tolist()
            t_end = clock()
            if emb_us is None:
                emb_us = us(m_emb, m_emb_end)
                read_us = [us(a, b) for a, b in read_marks]
            prefill_us, rank_us = us(m_start, m_prefill), us(m_write, m_end)
            arrival = p.req.arrival_s if p.req.arrival_s is not None else t_batch
            kv_hit = min(plan.reuse_tokens, p.num_history)
            lat = LatencyBreakdown(
                queue_us=max(0.0, (t_batch - arrival) * 1e6), emb_lookup_us=emb_us, link_us=link_us,
                batch_wait_us=max(0.0, us(m_emb_end, m_start)),
                kv_read_us=read_us[j], prefill_us=prefill_us, kv_write_us=us(m_prefill, m_write),
                rank_us=rank_us, compute_us=prefill_us + rank_us, total_us=(t_end - arrival) * 1e6)
            self.num_served += 1
            self.kv_outcomes[plan.outcome] += 1
            out.append(RecResponse(
                user_id=p.user, items=[int(i) for i in top_items], scores=[float(s) for s in top_scores],
                num_candidates=len(c), num_history=p.num_history, kv=plan, kv_hit_tokens=kv_hit,
                recomputed_tokens=p.num_history - kv_hit, prefill_tokens=n_new, kv_cached_after=cached_after,
                emb_rows=sizes[j], emb_hits=int(hits_per_req[j]), emb_batch_miss_bytes=lk.bytes_transferred,
                latency=lat, link_emulated=self.link.enabled, batch_size=batch_size, finished_s=t_end,
                device=self.device_info()))
        return out

    def _emb_lookup(self, preps: list[_Prepared], plans: list[KVReuse], cands: list[np.ndarray], timer: StageTimer):
        """One EMB lookup for a pass: the tokens to prefill, then the candidates, request by request.
        Returns (lookup, rows per request, hits per request, link µs, start mark, end mark)."""
        mm, clock = self.mm, self.clock
        parts, sizes = [], []
        for p, plan, c in zip(preps, plans, cands):
            parts += [p.items[plan.reuse_tokens:], c]
            sizes.append(len(p.items) - plan.reuse_tokens + len(c))
        host_ids = np.concatenate(parts)
        ids = torch.from_numpy(host_ids).to(self.device)
        m_emb = timer.mark()
        hits_per_req = None
        if len(preps) > 1:
            hit = (mm.emb.item_to_slot.index_select(0, ids) != mm.emb.miss_slot).to(torch.int64)
            bounds = np.cumsum([0] + sizes)
            cs = torch.cat([hit.new_zeros(1), hit.cumsum(0)]).cpu().numpy()
            hits_per_req = (cs[bounds[1:]] - cs[bounds[:-1]]).tolist()
        lk = mm.emb.lookup(ids, host_ids=host_ids)
        link_us = self.link.transfer_us(lk.bytes_transferred)
        if link_us > 0:
            self._sync_serving()  # the emulated transfer starts once the lookup's own work is done
            wait_until(clock, clock() + link_us * 1e-6)
            self.link_us_total += link_us
        m_emb_end = timer.mark()
        if hits_per_req is None:
            hits_per_req = [lk.num_hits]
        return lk, sizes, hits_per_req, link_us, m_emb, m_emb_end

    def _upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Host arrays of one dtype onto the device in one copy (views of it, in order); on the CPU
        the arrays themselves."""
        if self.device.type == "cpu":
            return [torch.from_numpy(a) for a in arrays]
        flat = torch.from_numpy(np.concatenate([a.ravel() for a in arrays])).to(self.device)
        out, off = [], 0
        for a in arrays:
            out.append(flat[off: off + a.size].view(a.shape))
            off += a.size
        return out

    def _read_past(self, preps: list[_Prepared], reuse: list[int]) -> KVBlock | None:
        """The cached prefixes of a chunk's requests (``reuse[b]`` tokens of ``preps[b]``'s user) as
        one padded `KVBlock`, read from the pages in one gather (`torch.index_select` of whole pages
        into a new buffer in the model's layout: a copy, so later appends may evict freely), then
        the pad tokens zeroed (one index_put, over the pads only). None when nothing is reused."""
        pmax = max(reuse)
        if pmax == 0:
            return None
        kv = self.mm.kv
        T = kv.page_tokens
        M = -(-pmax // T)
        B, S = len(preps), M * T
        page_idx = np.zeros((B, M), dtype=np.int64)  # pad pages: page 0, read then zeroed
        ts = np.zeros((B, S), dtype=np.float64)
        for b, (p, n) in enumerate(zip(preps, reuse)):
            if n:
                m = -(-n // T)
                page_idx[b, :m] = kv.block_table(p.user)[:m]
                ts[b, :n] = p.ts[:n]
        lengths = np.asarray(reuse, dtype=np.int64)
        pad_b, pad_s = np.nonzero(np.arange(S)[None, :] >= lengths[:, None])
        page_idx_t, lengths_t, pad_b_t, pad_s_t = self._upload([page_idx.ravel(), lengths, pad_b, pad_s])
        (ts_t,) = self._upload([ts])
        pages = self.mm.arena.kv_pages()  # [pages, layers, 2, T, h, e]
        L, _, _, H, E = pages.shape[1:]
        buf = pages.new_empty(L, 2, H, B * M, T, E)
        torch.index_select(pages.permute(1, 2, 4, 0, 3, 5), 3, page_idx_t, out=buf)
        g = buf.view(L, 2, H, B, S, E)
        if g.dtype != self.compute_dtype:
            g = g.to(self.compute_dtype)
        if len(pad_b):
            g[:, :, :, pad_b_t, pad_s_t] = 0
        return KVBlock(g[:, 0], g[:, 1], ts_t, lengths_t, torch.zeros_like(lengths_t))

    def _write_pages(self, writes: list[tuple[int, int, int, int, KVBlock | None, int, KVBlock | None]]) -> None:
        """The K/V of appended tokens into the users' pages, a block's tokens at a time (one gather
        and one index_put per block, for K and for V; no per-request kernel). ``writes``: (user,
        first token to write, tokens, tokens in the cached block, the chunk's cached block, the
        request's row in the chunk, the chunk's new block). Token ``i`` comes from the cached block
        when ``i`` is below its cached tokens (a rewrite after an eviction), else from the new one."""
        if not writes:
            return
        kv = self.mm.kv
        T = kv.page_tokens
        pages = self.mm.arena.kv_pages()
        dst = pages.permute(1, 2, 4, 0, 3, 5)  # [layers, 2, h, pages, T, e]
        # per source block: rows b, token index in the block, destination page and offset
        by_block: dict[int, tuple[KVBlock, list[np.ndarray]]] = {}
        for user, start, n, plen, past, b, new in writes:
            bt = np.asarray(kv.block_table(user), dtype=np.int64)
            pos = np.arange(start, n)
            for blk, sel, off in ((past, pos < plen, 0), (new, pos >= plen, plen)):
                if blk is None or not sel.any():
                    continue
                ps = pos[sel]
                entry = by_block.setdefault(id(blk), (blk, [[], [], [], []]))[1]
                entry[0].append(np.full(len(ps), b, dtype=np.int64))
                entry[1].append(ps - off)
                entry[2].append(bt[ps // T])
                entry[3].append(ps % T)
        for blk, cols in by_block.values():
            rb, tok, pg, off = self._upload([np.concatenate(c) for c in cols])
            for j, src in enumerate((blk.k, blk.v)):
                dst[:, j][:, :, pg, off] = src[:, :, rb, tok].to(pages.dtype)

    def _serve_group_batched(self, preps: list[_Prepared], t_batch: float, batch_size: int,
                             first_pass: bool = True) -> list[RecResponse]:
        """One pass (each user once) computed in chunks of requests (`plan_chunks`): per chunk one
        gather of the cached prefixes from the pages, one `HSTUModel.prefill_batch`, one
        `HSTUModel.rank_batch` and one top-k, whatever the number of requests; the pages and
        records updated in the pass's order, then the new K/V written per chunk. Each request
        attends to its own cached prefix and its own new tokens only (the pads are masked), so
        the answers are those of `_serve_group` within float rounding. The stage times are the
        pass's (every request of the pass gets the same ones; ``batch_wait_us`` is ~0)."""
        clock, dev, model = self.clock, self.device, self.model
        cdt = self.compute_dtype
        timer = make_stage_timer(dev, clock, self.config.stage_timing)
        us = timer.elapsed_us
        # 1. KV plans (in the pass's order: lookups touch the LRU), chunks, reads
        m_read = timer.mark()
        plans = [self._plan_kv(p) for p in preps]
        cands = [p.candidates if p.candidates is not None
                 else self.candidates.sample(p.user, len(p.items), p.num_candidates) for p in preps]
        reuse = [pl.reuse_tokens for pl in plans]
        n_new = [len(p.items) - r for p, r in zip(preps, reuse)]
        chunks = plan_chunks([(r, n, len(c)) for r, n, c in zip(reuse, n_new, cands)], self.config.model.num_heads)
        pasts = [self._read_past([preps[i] for i in ch], [reuse[i] for i in ch]) for ch in chunks]
        m_read_end = timer.mark()
        # 2. one EMB lookup for the pass
        lk, sizes, hits_per_req, link_us, m_emb, m_emb_end = self._emb_lookup(preps, plans, cands, timer)
        rows_all = lk.rows
        row0 = np.cumsum([0] + sizes[:-1])  # request j's rows: new tokens, then candidates
        # 3. prefill, chunk by chunk
        m_start = timer.mark()
        news: list[KVBlock | None] = []
        for ch, past in zip(chunks, pasts):
            nmax = max(n_new[i] for i in ch)
            if nmax == 0:
                news.append(None)
                continue
            B = len(ch)
            t = np.arange(nmax)
            lens = np.asarray([n_new[i] for i in ch], dtype=np.int64)
            live = t[None, :] < lens[:, None]
            rows = np.where(live, row0[ch][:, None] + t[None, :], 0)  # pads: row 0 (finite; masked)
            ts = np.zeros((B, nmax), dtype=np.float64)
            for b, i in enumerate(ch):
                ts[b, : n_new[i]] = preps[i].ts[reuse[i]:]
            rows_t, lens_t = self._upload([rows.astype(np.int64).ravel(), lens])
            (ts_t,) = self._upload([ts])
            x = model.tokens(rows_all.index_select(0, rows_t).to(cdt)).view(B, nmax, -1)
            _, new = model.prefill_batch(x, ts_t, lens_t, past)
            news.append(new)
        m_prefill = timer.mark()
        # 4. pages and records in the pass's order (an append may evict a user appended before it:
        #    its K/V are then not written), then the K/V of every user still holding its pages
        where = {i: (c, b) for c, ch in enumerate(chunks) for b, i in enumerate(ch)}
        cached_after, pending = [], []
        for j, (p, plan) in enumerate(zip(preps, plans)):
            n_after, start = self._append_kv(p, plan)
            cached_after.append(n_after)
            if start is not None:
                pending.append((j, start))
        writes = []
        for j, start in pending:
            n = len(preps[j].items)
            if self.mm.kv.num_tokens(preps[j].user) == n:
                c, b = where[j]
                writes.append((preps[j].user, start, n, reuse[j], pasts[c], b, news[c]))
        self._write_pages(writes)
        m_write = timer.mark()
        # 5. rank and top-k, chunk by chunk
        tops = []
        for ch, past, new in zip(chunks, pasts, news):
            B = len(ch)
            cmax = max(len(cands[i]) for i in ch)
            t = np.arange(cmax)
            clens = np.asarray([len(cands[i]) for i in ch], dtype=np.int64)
            live = t[None, :] < clens[:, None]
            rows = np.where(live, (row0[ch] + np.asarray(n_new)[ch])[:, None] + t[None, :], 0)
            now = np.asarray([preps[i].now_ts for i in ch], dtype=np.float64)
            rows_t, pad_b, pad_c = self._upload([rows.astype(np.int64).ravel(), *np.nonzero(~live)])
            (now_t,) = self._upload([now])
            cand_rows = rows_all.index_select(0, rows_t).to(cdt).view(B, cmax, -1)
            scores = model.rank_batch(cand_rows, [blk for blk in (past, new) if blk is not None], now_t)
            if len(pad_b):
                scores[pad_b, pad_c] = float("-inf")
            tops.append(torch.topk(scores, max(preps[i].top_k for i in ch), dim=1))
        m_end = timer.mark()
        # the answers' host values: these copies wait for the serving stream (only)
        host = [(top.indices.cpu().numpy(), top.values.float().cpu().numpy()) for top in tops]
        t_end = clock()
        emb_us = us(m_emb, m_emb_end)
        read_us = us(m_read, m_read_end)
        prefill_us, write_us, rank_us = us(m_start, m_prefill), us(m_prefill, m_write), us(m_write, m_end)
        wait_us = max(0.0, us(m_emb_end, m_start))
        out: list[RecResponse] = []
        for j, (p, plan, c) in enumerate(zip(preps, plans, cands)):
            ci, b = where[j]
            idx, vals = host[ci]
            top_items = c[idx[b, : p.top_k]].tolist()
            top_scores = vals[b, : p.top_k].tolist()
            arrival = p.req.arrival_s if p.req.arrival_s is not None else t_batch
            kv_hit = min(plan.reuse_tokens, p.num_history)
            lat = LatencyBreakdown(
                queue_us=max(0.0, (t_batch - arrival) * 1e6), emb_lookup_us=emb_us, link_us=link_us,
                batch_wait_us=wait_us, kv_read_us=read_us, prefill_us=prefill_us, kv_write_us=write_us,
                rank_us=rank_us, compute_us=prefill_us + rank_us, total_us=(t_end - arrival) * 1e6)
            self.num_served += 1
            self.kv_outcomes[plan.outcome] += 1
            out.append(RecResponse(
                user_id=p.user, items=[int(i) for i in top_items], scores=[float(s) for s in top_scores],
                num_candidates=len(c), num_history=p.num_history, kv=plan, kv_hit_tokens=kv_hit,
                recomputed_tokens=p.num_history - kv_hit, prefill_tokens=n_new[j], kv_cached_after=cached_after[j],
                emb_rows=sizes[j], emb_hits=int(hits_per_req[j]), emb_batch_miss_bytes=lk.bytes_transferred,
                latency=lat, link_emulated=self.link.enabled, batch_size=batch_size, finished_s=t_end,
                device=self.device_info()))
        return out

    def _plan_kv(self, p: _Prepared) -> KVReuse:
        """The request's KV plan from the pool and the engine's record (evicts on a mismatch)."""
        mm = self.mm
        pool_tokens = mm.kv.lookup(p.user, history_tokens=p.num_history)
        seq = self._seqs.get(p.user)
        ci, ct = seq.view() if seq is not None else (None, None)
        plan = plan_kv_reuse(pool_tokens, ci, ct, p.items, p.ts)
        if plan.outcome == "mismatch":
            mm.kv.evict(p.user)
        if plan.outcome != "hit":
            self._seqs.pop(p.user, None)
        return plan

    def _serve_group_emulated(self, preps: list[_Prepared], t_batch: float, batch_size: int,
                              first_pass: bool = True) -> list[RecResponse]:
        """One pass on an emulated device: the same KV plan, EMB lookup and page bookkeeping as
        `_serve_group`, no model; the pass's time is charged from the profile (module doc of
        `node_agent.emulated`) and waited out on the engine's clock. The pass starts when it is
        called, so the bookkeeping's own CPU time counts inside the modelled duration."""
        clock, mm, emu = self.clock, self.mm, self.emu
        assert emu is not None
        # the device's own timeline: the pass starts when the device is free and its last request has
        # arrived, not when this host's thread got round to it (a late thread catches up, no wait)
        last_arrival = max((p.req.arrival_s if p.req.arrival_s is not None else t_batch) for p in preps)
        t_start = min(clock(), max(emu.free_at_s, last_arrival))
        if self._span_start is None:  # the batch's first pass
            self._span_start = t_start
        plans = [self._plan_kv(p) for p in preps]
        cands = [p.candidates if p.candidates is not None
                 else self.candidates.sample(p.user, len(p.items), p.num_candidates) for p in preps]
        parts, sizes = [], []
        for p, plan, c in zip(preps, plans, cands):
            parts += [p.items[plan.reuse_tokens:], c]
            sizes.append(len(p.items) - plan.reuse_tokens + len(c))
        ids = torch.from_numpy(np.concatenate(parts))
        hit = (mm.emb.item_to_slot.index_select(0, ids) != mm.emb.miss_slot).to(torch.int64)
        bounds = np.cumsum([0] + sizes)
        cs = torch.cat([hit.new_zeros(1), hit.cumsum(0)]).numpy()
        hits_per_req = (cs[bounds[1:]] - cs[bounds[:-1]]).tolist()
        lk = mm.emb.lookup(ids)
        prof = emu.profile
        nh = [p.num_history for p in preps]
        nn = [len(p.items) - p.num_history for p in preps]
        comp = emu.compute_us([pl.reuse_tokens for pl in plans], nh, nn, [len(c) for c in cands])
        rank = np.array([len(c) * (prof.cand_us + prof.attn_us_per_ctx * len(p.items)) for p, c in zip(preps, cands)])
        fixed_us, comp_us = emu.pass_us(comp, batch_size if first_pass else 0)
        t_copy = t_start + (fixed_us + lk.num_hits * prof.emb_hit_us_per_row) * 1e-6
        c0, c1 = emu.demand_copy(t_copy, lk.num_unique_misses)
        t_end = c1 + comp_us * 1e-6
        emu.free_at_s = t_end
        self.last_batch_span = (self._span_start, t_end)
        emu.wait_until(t_end)
        emu.busy_us += (t_end - t_start) * 1e6
        emb_us = (c1 - t_start) * 1e6
        link_us = (c1 - t_copy) * 1e6
        pop = self.candidates.weights
        out: list[RecResponse] = []
        for j, (p, plan, c) in enumerate(zip(preps, plans, cands)):
            cached_after = self._write_kv(p, plan, None, None)
            w = pop[c]
            top = np.argsort(-w, kind="stable")[: p.top_k]
            arrival = p.req.arrival_s if p.req.arrival_s is not None else t_batch
            kv_hit = min(plan.reuse_tokens, p.num_history)
            own = float(comp[j])
            lat = LatencyBreakdown(
                queue_us=max(0.0, (self._span_start - arrival) * 1e6), emb_lookup_us=emb_us, link_us=link_us,
                batch_wait_us=max(0.0, (t_end - t_start) * 1e6 - emb_us - own), kv_read_us=0.0,
                prefill_us=own - float(rank[j]), kv_write_us=0.0, rank_us=float(rank[j]), compute_us=own,
                total_us=(t_end - arrival) * 1e6)
            self.num_served += 1
            self.kv_outcomes[plan.outcome] += 1
            out.append(RecResponse(
                user_id=p.user, items=[int(i) for i in c[top]], scores=[float(x) for x in w[top]],
                num_candidates=len(c), num_history=p.num_history, kv=plan, kv_hit_tokens=kv_hit,
                recomputed_tokens=p.num_history - kv_hit, prefill_tokens=len(p.items) - plan.reuse_tokens,
                kv_cached_after=cached_after, emb_rows=sizes[j], emb_hits=int(hits_per_req[j]),
                emb_batch_miss_bytes=lk.bytes_transferred, latency=lat, link_emulated=False,
                batch_size=batch_size, finished_s=t_end, device=self.device_info()))
        return out

    def _write_kv(self, p: _Prepared, plan: KVReuse, new_kv: KVState | None, full: KVState | None) -> int:
        """Append the request's new tokens to the user's pages; returns the tokens cached after.
        ``full`` None: an emulated device's pages hold no K/V, only the pages and the record are kept."""
        cached_after, start = self._append_kv(p, plan)
        if start is not None:
            kv = new_kv if start == plan.reuse_tokens else full
            if kv is not None:
                self.mm.kv.write_layers(p.user, start, list(kv.k), list(kv.v))
        return cached_after

    def _append_kv(self, p: _Prepared, plan: KVReuse) -> tuple[int, int | None]:
        """The pages and the record of the request's tokens: returns (tokens cached after, first
        token whose K/V the caller must write, or None: nothing to write). The tokens to write are
        ``[start, n)``: the new tokens (``start == plan.reuse_tokens``), or the whole sequence again
        (``start`` 0) when the user was evicted meanwhile (by another request of the batch) or
        holds something else."""
        mm = self.mm
        n = len(p.items)
        if n == 0:
            return 0, None
        have = mm.kv.num_tokens(p.user)
        if plan.reuse_tokens == n and have == n:
            return n, None  # refresh: everything already cached
        if have == plan.reuse_tokens:
            start = have
        else:
            if have:
                mm.kv.evict(p.user)
            self._seqs.pop(p.user, None)
            start = 0
        app = mm.kv.append(p.user, n - start)
        if app is None:  # the user's sequence does not fit in the KV pool at all
            self._seqs.pop(p.user, None)
            self.num_uncacheable += 1
            return 0, None
        seq = self._seqs.get(p.user)
        if seq is None or start == 0:
            seq = _UserSeq()
            self._seqs[p.user] = seq
            seq.set(p.items, p.ts, 0)
        else:
            seq.set(p.items, p.ts, start)
        return n, start

    def _prune_seqs(self) -> None:
        """Drop the records of users the pool evicted. Amortised: a pass runs only when the
        records have doubled (plus 1024) since the last pass left them."""
        if len(self._seqs) > self._prune_at:
            kv = self.mm.kv
            for u in [u for u in self._seqs if u not in kv]:
                del self._seqs[u]
            self._prune_at = 2 * len(self._seqs) + 1024

    # ---------------------------------------------------------------------------- the model ---
    def load_checkpoint(self, checkpoint: Checkpoint) -> dict:
        """Serve another trained model from now on (between batches, on the engine's thread).

        The checkpoint must fit what this engine holds: the same model config (the KV pages'
        layout and the EMB rows' width) and the same item count. Otherwise `CheckpointError` is
        raised and nothing changes: the engine keeps serving its current model. On success the
        host item table is replaced, the cached EMB rows are rewritten from it, and every user's
        K/V is dropped (they were computed by the old weights). Returns the new `model_info`."""
        if self.emu is not None:  # an emulated device holds no weights: the model's name, its users' K/V dropped
            if checkpoint.num_items != self.config.num_items:
                raise CheckpointError(f"checkpoint {checkpoint.path}: trained on {checkpoint.num_items} items, this "
                                      f"node serves {self.config.num_items}")
            for u in list(self.mm.kv.users_lru()):
                self.mm.kv.evict(u)
            self._seqs.clear()
            self.model_info = _model_info(checkpoint, self.config)
            return self.model_info
        _check_serves(checkpoint, self.config)
        model = HSTUModel(self.config.model)
        model.load_state_dict(checkpoint.model.state_dict())
        model = model.to(self.device, self.compute_dtype)
        emb = self.mm.emb
        emb.wait_refill()  # a chunk in flight holds the old table's rows: committed before the rewrite
        if emb.host_table is not None:
            emb.host_table.copy_(checkpoint.item_table)
            resident = torch.nonzero(emb.item_to_slot != emb.miss_slot).flatten()
            if resident.numel():
                slots = emb.item_to_slot.index_select(0, resident)
                rows = emb.host_table.index_select(0, resident.cpu()).to(self.device)
                self.mm.arena.all_rows().index_copy_(0, slots, rows)
        for u in list(self.mm.kv.users_lru()):
            self.mm.kv.evict(u)
        self._seqs.clear()
        self.model = model
        self.model_info = _model_info(checkpoint, self.config)
        return self.model_info

    # ------------------------------------------------------------------------ maintenance ---
    def maintenance(self, now_s: float) -> ManagerStep:
        """Between batches: one bounded boundary step and one throttled refill chunk (on an
        emulated device the chunk books the host link, where demand copies wait behind it)."""
        step = self.mm.step(now_s)
        if self.emu is not None and step.refill_rows:
            self.emu.refill_copy(now_s, step.refill_rows)
        return step

    def device_info(self) -> dict:
        """What this engine's figures are: ``mode`` ``real`` (the device computes and copies),
        ``link-emulated`` (the device computes, EMB misses wait out a link model) or ``emulated``
        (nothing computed: the profile's time, in modelled seconds), with a ``label`` to show."""
        if self._device_info is None:
            if self.emu is not None:
                self._device_info = self.emu.info.to_dict()
            elif self.link.enabled:
                self._device_info = {"mode": "link-emulated", "time": "measured",
                                     "label": f"{self.device} (EMB link emulated)"}
            else:
                self._device_info = {"mode": "real", "time": "measured", "label": str(self.device)}
        return self._device_info

    def set_emb_share(self, emb_share: float, now_s: float) -> BoundaryPlan:
        """Plan a new split; ``maintenance`` applies it step by step."""
        return self.mm.set_target(emb_share, now_s)

    def cached_sequence(self, user: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The engine's record of ``user``'s cached tokens (items, timestamps), or None."""
        seq = self._seqs.get(user)
        if seq is None or self.mm.kv.num_tokens(user) != seq.n:
            return None
        i, t = seq.view()
        return i.copy(), t.copy()

    def check_invariants(self) -> list[str]:
        out = self.mm.check_invariants()
        for u, seq in self._seqs.items():
            have = self.mm.kv.num_tokens(u)
            if have and have != seq.n:
                out.append(f"engine: user {u} has {have} tokens in the pool but a record of {seq.n}")
        return out

    def describe(self) -> dict:
        c = self.config
        return {
            "device": str(self.device),
            "model": asdict(c.model),
            "model_source": dict(self.model_info),
            "num_items": c.num_items,
            "num_pages": c.num_pages,
            "page_bytes": self.mm.config.page_bytes,
            "arena_bytes": c.num_pages * self.mm.config.page_bytes,
            "page_tokens": c.page_tokens,
            "kv_dtype": c.kv_dtype,
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "batched_compute": c.batched_compute,
            "max_history_len": c.max_history_len,
            "max_candidates": c.max_candidates,
            "link_emulation": self.link.to_dict(),
            "torch_threads": torch.get_num_threads(),
            "device_mode": self.device_info(),
            **({"emulation": self.emu.to_dict()} if self.emu is not None else {}),
        }
