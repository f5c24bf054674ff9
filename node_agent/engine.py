"""The node's serving engine: EMB lookup -> KV reuse or recompute -> paged K/V write -> ranking.

One request (`RecRequest`, `node_agent.rec_request`) is a user's item sequence ``history +
new_items`` (oldest first) and the candidates to rank. `Engine.serve_batch` runs a micro-batch
of them, in passes: requests of one user inside a batch are served in arrival order in
successive passes, so the second sees the first's K/V. A pass (`node_agent.passes`):

1. **KV plan** (per request, pure: `node_agent.paged_kv.plan_kv_reuse`). The KV pool records,
   per user, the item ids and timestamps of the tokens whose K/V its pages hold. A cached prefix
   is reused only when it *is* a prefix of the request's sequence, ids and timestamps alike;
   otherwise the user's K/V are evicted and the whole sequence is recomputed. The reused K/V are
   read from the user's pages (a copy, so the pages may change afterwards).
2. **EMB lookup**: one `EmbCache.lookup` for the whole pass (the tokens to prefill and the
   candidates of every request; one cache tick and one host-to-device transfer). Misses are
   copied from the host table; with link emulation on, the pass then waits what the PCIe link
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

Times are read from an injected clock (``clock``, seconds); `serve_batch` takes ``now_s`` from
the same clock. Every response carries its latency breakdown (µs), its KV decision with the
reason, EMB counts, and whether the link is emulated.

Synchronisation: the serving path never waits for the whole device. On CUDA the stages are
timed with events recorded on the serving stream (`node_agent.device_io.StageTimer`; none with
``stage_timing=False``), and the host waits only where it needs a value (the answer's top-k, the
lookup's miss ids), and then only for the serving stream. The EMB refill copies on its own
stream, which waits for the serving stream's writes before it starts; the serving stream never
waits for it (`node_agent.memory.emb_refill`).

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

from .device_io import wait_until
from .emulated import EmulatedDevice, EmulationConfig
from .memory import DEFAULT_GHOST_PROBES, KVLayout, MemoryConfig, MemoryManager, RefillConfig
from .memory.manager import BoundaryPlan, ManagerStep
from .model import HSTUModel, ModelConfig
from .model.checkpoint import Checkpoint, CheckpointError
from .paged_kv import PagedKV
from .passes import EmulatedPasses, ModelPasses
from .rec_request import PreparedRequest, RecRequest, RecResponse, prepare_request


# PCIe 4.0 x16: 16 GT/s x 16 lanes x 128b/130b = 31.5 GB/s per direction (PCI-SIG); pinned
# host-to-device cudaMemcpy reaches about 25 GB/s of it. A copy's fixed cost (launch, DMA set-up,
# completion) is of the order of 10 µs.
PCIE4_X16_BANDWIDTH_GB_PER_S = 25.0
PCIE4_X16_LATENCY_US = 10.0

LINK_MODES = ("auto", "on", "off")
KV_OUTCOMES = ("hit", "miss", "mismatch")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")


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

    Its parts: ``mm`` (the arena, EMB cache and KV pool), ``paged_kv`` (`PagedKV`: the users'
    K/V through the pool), ``passes`` (`ModelPasses`, or `EmulatedPasses` on an emulated device:
    how a pass is computed). Not thread-safe: one caller (the node agent's device worker) drives
    it. ``validate`` only reads the config and may be called from any thread.
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
        self.paged_kv = PagedKV(self.mm, self.compute_dtype)
        self.passes: ModelPasses | EmulatedPasses = EmulatedPasses(self) if emu is not None else ModelPasses(self)
        self.num_served = 0
        self.kv_outcomes = {k: 0 for k in KV_OUTCOMES}
        self.link_us_total = 0.0
        self._device_info: dict | None = None
        # an emulated device's last batch on its own timeline (first pass's start, last pass's end);
        # None on a real device, whose batches the caller times itself
        self.last_batch_span: tuple[float, float] | None = None

    # ------------------------------------------------------------------------- validation ---
    def validate(self, req: RecRequest) -> PreparedRequest:
        """Check a request against the config (`prepare_request`); returns its normalised form or
        raises `RequestError`."""
        return prepare_request(self.config, req)

    # ---------------------------------------------------------------------------- serving ---
    def serve(self, req: RecRequest, now_s: float | None = None) -> RecResponse:
        return self.serve_batch([req], now_s)[0]

    def serve_batch(self, reqs: Sequence[RecRequest], now_s: float | None = None) -> list[RecResponse]:
        """Serve a micro-batch (see the module docstring). ``now_s``: the batch's start on the
        engine's clock (default: ``clock()``). Raises `RequestError` before doing anything if
        a request is invalid."""
        preps = [self.validate(r) for r in reqs]
        t0 = self.clock() if now_s is None else now_s
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
            for i, resp in zip(group, self.passes.run([preps[i] for i in group], t0, len(preps), passes == 1)):
                out[i] = resp
            pending = rest
        self.mm.kv.records.forget()
        if passes > 1:  # every answer of the batch waited for all its passes
            out = [replace(r, batch_passes=passes) for r in out]
        return out  # type: ignore[return-value]

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
            self.mm.kv.evict_all()
            self.model_info = _model_info(checkpoint, self.config)
            return self.model_info
        _check_serves(checkpoint, self.config)
        model = HSTUModel(self.config.model)
        model.load_state_dict(checkpoint.model.state_dict())
        model = model.to(self.device, self.compute_dtype)
        emb = self.mm.emb
        emb.refill.wait()  # a chunk in flight holds the old table's rows: committed before the rewrite
        if emb.host_table is not None:
            emb.host_table.copy_(checkpoint.item_table)
            resident = torch.nonzero(emb.item_to_slot != emb.miss_slot).flatten()
            if resident.numel():
                slots = emb.item_to_slot.index_select(0, resident)
                rows = emb.host_table.index_select(0, resident.cpu()).to(self.device)
                self.mm.arena.all_rows().index_copy_(0, slots, rows)
        self.mm.kv.evict_all()
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

    def check_invariants(self) -> list[str]:
        return self.mm.check_invariants()

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
