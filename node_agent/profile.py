"""Node cost profile: the miss and hit costs of this device, measured (``racer node profile``).

Measured with the engine's own model and memory layout on the engine's device (medians over
``repeats`` runs after a warm-up; CUDA runs are synchronised before each clock read):

- ``kv_recompute_us_per_token`` ``{length: µs}``: a full prefill (``HSTUModel.forward`` with no
  cached K/V) of a ``length``-token history, divided by ``length``: what a KV miss costs per
  history token. It grows with the length (attention is quadratic), hence one figure per length.
- ``emb_transfer_us_per_row``: an `EmbCache.lookup` of ``emb_batch_rows`` distinct ids that all
  miss (host gather, host-to-device copy, slab write, LRU bookkeeping), divided by the rows; with
  link emulation on, plus the emulated link time of the batch's bytes per row
  (``emb_link_us_per_row``, computed by `LinkEmulation.transfer_us`, the same charge the engine
  waits out).
- ``emb_hit_us_per_row``: the same lookup when every id hits, per row.
- ``kv_read_us_per_token``: reading a ``hit_history_len``-token history's K/V from its pages
  into a contiguous state (the KV hit path), per token.
- ``rank_us_per_candidate``: ranking ``num_candidates`` candidates against a
  ``hit_history_len``-token history, per candidate.
- ``incremental_prefill_us_per_token``: prefilling ``new_tokens`` tokens after a
  ``hit_history_len``-token cached history, per new token.

The keys ``kv_recompute_us_per_token``, ``emb_transfer_us_per_row`` and ``emb_hit_us_per_row`` are
what ``simulator.profiles.from_node_profile`` and the router's weights read.

``device_memory`` (`device_memory_budget`) is every device byte the profiled node holds, counted
at the end of the run: ``arena_bytes`` (the one arena allocation: EMB slab + KV pages),
``metadata_bytes`` (`MemoryManager.metadata_bytes`: the bookkeeping tensors on the device outside
the arena, catalogue-sized maps), ``model_weights_bytes`` (the model's parameters and buffers on
the device) and their sum ``node_bytes``; on CUDA also what the device itself says:
``device_total_bytes`` / ``device_free_bytes`` (``torch.cuda.mem_get_info``, the node's tensors
still held) and ``max_memory_allocated_bytes`` (``torch.cuda.max_memory_allocated``: the
caching allocator's peak since the process started, activations included; in a
``racer node profile`` process, the profile run's peak). A CPU reports none of the three: they
are ``null``, not 0, and ``device_reports`` says why. The sizes are the profile run's own (its
arena is sized for the measurement, not a serving config's ``--num-pages``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from common.config import ranged, validate

from .engine import EngineConfig, LinkEmulationConfig, make_item_table
from .memory import KVLayout, MemoryConfig, MemoryManager
from .model import HSTUModel, ModelConfig


@dataclass(frozen=True)
class ProfileConfig:
    """What ``measure_profile`` runs (ranges checked in ``__post_init__``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lengths: tuple[int, ...] = ranged((128, 512, 2048), lo=1, integer=True, length=(1, None))
    repeats: int = ranged(5, lo=1, integer=True, doc="timed runs per figure, median")
    emb_batch_rows: int = ranged(512, lo=1, integer=True, doc="ids per EMB lookup when timing hits and misses")
    hit_history_len: int = ranged(512, lo=1, integer=True)
    new_tokens: int = ranged(8, lo=1, integer=True)
    num_candidates: int = ranged(256, lo=1, integer=True, doc="candidates when timing ranking")
    page_tokens: int = ranged(16, lo=1, integer=True)
    kv_dtype: str = "float32"
    link: LinkEmulationConfig = field(default_factory=LinkEmulationConfig)
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        validate(self)
        # the engine's checks on the model and page layout
        EngineConfig(model=self.model, page_tokens=self.page_tokens, kv_dtype=self.kv_dtype, link=self.link,
                     device=self.device, num_items=1024, num_pages=64)


def _median_us(fn: Callable[[], object], repeats: int, sync: Callable[[], None],
               clock: Callable[[], float], tick: Callable[[], None]) -> float:
    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        t = clock()
        fn()
        sync()
        times.append((clock() - t) * 1e6)
        tick()
    return statistics.median(times)


def profile_steps(cfg: ProfileConfig) -> int:
    """How many timed runs ``measure_profile`` makes (for a progress bar)."""
    return cfg.repeats * (len(cfg.lengths) + 5)


def _profile_memory(cfg: ProfileConfig) -> MemoryConfig:
    """The profile run's memory: KV pages for the hit history (at least 64), and an EMB slab of ~4
    lookup batches over an item table of ~64 batches, so a sweep of fresh ids always misses."""
    m = cfg.model
    mem = MemoryConfig(
        num_pages=max(64, 4 * (cfg.hit_history_len // cfg.page_tokens + 1)), num_items=1024, emb_dim=m.embedding_dim,
        kv=KVLayout(m.num_layers, m.num_heads, m.qk_dim, cfg.page_tokens, cfg.kv_dtype),
        initial_emb_share=0.0, device=cfg.device)
    rows_per_page = mem.rows_per_page
    b = cfg.emb_batch_rows
    emb_pages = -(-4 * b // rows_per_page)
    num_items = 64 * b
    num_pages = emb_pages + mem.num_pages
    return MemoryConfig(num_pages=num_pages, num_items=num_items, emb_dim=m.embedding_dim, kv=mem.kv,
                        initial_emb_share=emb_pages / num_pages, device=cfg.device)


def _emb_lookup_us(mm: MemoryManager, b: int, num_items: int, timed: Callable[[Callable[[], object]], float]
                   ) -> tuple[float, float]:
    """(hit, miss) µs per row of an `EmbCache.lookup` of ``b`` ids: the same ``b`` ids again, and
    a sweep of fresh ids over the ``num_items`` of the item table that must all miss."""
    dev = mm.arena.device
    hot = torch.arange(b, dtype=torch.int64, device=dev)
    mm.emb.lookup(hot)
    hit_us = timed(lambda: mm.emb.lookup(hot)) / b
    sweep = {"next": b}

    def miss_lookup() -> None:
        start = sweep["next"]
        if start + b > num_items:
            start = b
        sweep["next"] = start + b
        lk = mm.emb.lookup(torch.arange(start, start + b, dtype=torch.int64, device=dev))
        if lk.num_hits:
            raise RuntimeError("profile: a miss sweep hit the EMB cache")

    return hit_us, timed(miss_lookup) / b


def _hit_path_us(model: HSTUModel, mm: MemoryManager, history, cfg: ProfileConfig,
                 timed: Callable[[Callable[[], object]], float]) -> tuple[float, float, float]:
    """The KV hit path after a ``hit_history_len``-token history (``history(n)`` draws one):
    (K/V read from pages, µs per token; incremental prefill, µs per new token; ranking, µs per
    candidate)."""
    L = cfg.hit_history_len
    rows, ts = history(L + cfg.new_tokens)
    _, kv = model(model.tokens(rows[:L]), ts[:L])
    mm.kv.append(0, L)
    mm.kv.write_layers(0, 0, kv.k, kv.v)
    read_us = timed(lambda: mm.kv.read_layers(0)) / L
    new_x = model.tokens(rows[L:])
    inc_us = timed(lambda: model(new_x, ts[L:], past=kv)) / cfg.new_tokens
    cands = history(cfg.num_candidates)[0]
    now = ts[-1]
    rank_us = timed(lambda: model.rank(cands, kv, now_ts=now)) / cfg.num_candidates
    return read_us, inc_us, rank_us


def measure_profile(cfg: ProfileConfig, *, clock: Callable[[], float] = time.perf_counter,
                    progress: Callable[[], None] | None = None, checkpoint=None) -> dict:
    """Measure the profile on ``cfg.device``; returns the JSON-able profile (see the module doc).

    With ``checkpoint`` (a `node_agent.model.checkpoint.Checkpoint` whose config is
    ``cfg.model``) the trained model is measured: its weights, and histories and candidates made
    of its own item rows; else random weights from ``cfg.seed``. ``model_source`` says which."""
    tick = progress or (lambda: None)
    m = cfg.model
    if checkpoint is not None and checkpoint.config != m:
        raise ValueError(f"profile: the checkpoint's model config {asdict(checkpoint.config)} differs from the "
                         f"profile's {asdict(m)}")
    mem = _profile_memory(cfg)
    b = cfg.emb_batch_rows
    num_items = mem.num_items
    host = make_item_table(num_items, m.embedding_dim, cfg.seed)
    if checkpoint is not None:  # the trained rows, repeated to the sweep's size
        t = checkpoint.item_table
        host = t[torch.arange(num_items) % t.shape[0]].contiguous()
    mm = MemoryManager(mem, host)
    dev = mm.arena.device
    link = cfg.link.resolve(dev)
    model = HSTUModel(m)
    if checkpoint is not None:
        model.load_state_dict(checkpoint.model.state_dict())
    model = model.to(dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn: Callable[[], object]) -> float:
        return _median_us(fn, cfg.repeats, sync, clock, tick)

    gen = torch.Generator().manual_seed(cfg.seed)

    def history(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if checkpoint is not None:
            t = checkpoint.item_table
            rows = t[torch.randint(0, t.shape[0], (n,), generator=gen)].to(dev)
        else:
            rows = (torch.randn(n, m.embedding_dim, generator=gen) / m.embedding_dim ** 0.5).to(dev)
        ts = (torch.cumsum(torch.rand(n, generator=gen, dtype=torch.float64) * 600, 0) + 1.5e9).to(dev)
        return rows, ts

    out: dict = {"name": f"node-{dev.type}", "device": _device_name(dev)}
    # KV recompute per token, by history length
    recompute = {}
    for n in cfg.lengths:
        rows, ts = history(n)
        x = model.tokens(rows)
        recompute[str(n)] = timed(lambda: model(x, ts)) / n
    hit_us, miss_us = _emb_lookup_us(mm, b, num_items, timed)
    link_us = link.transfer_us(b * mem.row_bytes) / b
    read_us, inc_us, rank_us = _hit_path_us(model, mm, history, cfg, timed)
    out.update({
        "kv_recompute_us_per_token": {k: _sig(v) for k, v in recompute.items()},
        "emb_transfer_us_per_row": _sig(miss_us + link_us),
        "emb_hit_us_per_row": _sig(hit_us),
        "emb_link_us_per_row": _sig(link_us),
        "kv_read_us_per_token": _sig(read_us),
        "incremental_prefill_us_per_token": _sig(inc_us),
        "rank_us_per_candidate": _sig(rank_us),
        "link_emulated": link.enabled,
        "link_emulation": link.to_dict(),
        "settings": {"lengths": list(cfg.lengths), "repeats": cfg.repeats, "emb_batch_rows": b,
                     "emb_row_bytes": mem.row_bytes, "hit_history_len": cfg.hit_history_len,
                     "new_tokens": cfg.new_tokens, "num_candidates": cfg.num_candidates,
                     "page_tokens": cfg.page_tokens, "kv_dtype": cfg.kv_dtype,
                     "torch_threads": torch.get_num_threads()},
        "model": asdict(m),
        "model_source": ({"kind": "random", "seed": m.seed, "digest": None} if checkpoint is None else
                         {"kind": "checkpoint", "digest": checkpoint.digest, "path": checkpoint.path}),
    })
    out["device_memory"] = device_memory_budget(mm, model)
    _check_positive(out)
    return out


def _tensor_bytes(tensors, device: torch.device) -> int:
    """Bytes of the distinct storages behind ``tensors`` that lie on ``device``."""
    seen, total = set(), 0
    for t in tensors:
        if t.device != device:
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def device_memory_budget(mm: MemoryManager, model: torch.nn.Module | None, cuda=None) -> dict:
    """Every device byte a node holds (see the module doc): arena, metadata outside it, model
    weights, their sum, and on CUDA the device's own total / free / peak-allocated figures (``None``
    on a device that reports none). ``cuda``: the ``torch.cuda`` module (a stand-in in tests)."""
    cuda = torch.cuda if cuda is None else cuda
    dev = mm.arena.device
    storage = mm.arena._storage
    arena = int(storage.untyped_storage().nbytes()) if storage is not None else 0
    meta = int(mm.metadata_bytes())
    weights = 0 if model is None else _tensor_bytes(list(model.parameters()) + list(model.buffers()), dev)
    out = {"device": str(dev), "arena_bytes": arena, "metadata_bytes": meta, "model_weights_bytes": weights,
           "node_bytes": arena + meta + weights, "device_total_bytes": None, "device_free_bytes": None,
           "max_memory_allocated_bytes": None}
    if dev.type == "cuda":
        free, total = cuda.mem_get_info(dev)
        out.update(device_total_bytes=int(total), device_free_bytes=int(free),
                   max_memory_allocated_bytes=int(cuda.max_memory_allocated(dev)),
                   device_reports="torch.cuda.mem_get_info (the node's tensors held) and max_memory_allocated "
                                  "(the caching allocator's peak since the process started)")
    else:
        out["device_reports"] = (f"none: the {dev.type} device reports no memory of its own (total, free and "
                                 f"peak are null, not 0)")
    return out


def _sig(v: float) -> float:
    """Four significant digits (never rounds a positive figure to zero)."""
    return float(f"{v:.4g}")


def _check_positive(profile: dict) -> None:
    vals = list(profile["kv_recompute_us_per_token"].values())
    vals += [profile[k] for k in ("emb_transfer_us_per_row", "emb_hit_us_per_row", "kv_read_us_per_token",
                                  "incremental_prefill_us_per_token", "rank_us_per_candidate")]
    if not all(isinstance(v, float) and np.isfinite(v) and v > 0 for v in vals):
        raise RuntimeError(f"profile: a measured cost is not a positive number: {profile}")


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    return "cpu"


def parse_lengths(text: str | Sequence[int]) -> tuple[int, ...]:
    """``"128,512,2048"`` -> ``(128, 512, 2048)``."""
    if not isinstance(text, str):
        return tuple(int(x) for x in text)
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--lengths must be comma-separated integers, got {text!r}") from None
    if not out:
        raise ValueError("--lengths needs at least one length")
    return out


from common.device_model import REQUIRED_PROFILE_KEYS, read_node_profile  # noqa: E402,F401 (re-exported)
