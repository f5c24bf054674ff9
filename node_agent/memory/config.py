"""The memory subsystem's one typed config: arena geometry, EMB cache, KV layout, boundary steps
and refill throttling. Every range is validated in ``__post_init__``.

Page size is set by the KV layout: one page holds ``page_tokens`` tokens of K and V for every
layer, ``num_layers * 2 * page_tokens * num_heads * head_dim`` elements of ``kv.dtype``. The EMB
slab cuts the same pages into ``rows_per_page = page_bytes // row_bytes`` embedding rows, and the
page size must be a whole number of rows so that the slab is one contiguous ``[rows, emb_dim]``
view over pages ``[0, emb_pages)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from common.config import ranged, require, validate

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a config dtype name (``float32``, ``float16``, ``bfloat16``)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def dtype_bytes(name: str) -> int:
    return torch.empty((), dtype=torch_dtype(name)).element_size()


def resolve_device(name: str) -> torch.device:
    """``auto`` is ``cuda`` when torch sees a GPU, else ``cpu``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for but torch.cuda.is_available() is False")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    return dev


@dataclass(frozen=True)
class KVLayout:
    """Shape of one KV page: ``[num_layers, 2 (K, V), page_tokens, num_heads, head_dim]``."""

    num_layers: int = ranged(2, lo=1, integer=True)
    num_heads: int = ranged(2, lo=1, integer=True)
    head_dim: int = ranged(32, lo=1, integer=True)
    page_tokens: int = ranged(16, lo=1, integer=True)
    dtype: str = "float32"

    def __post_init__(self) -> None:
        validate(self)
        torch_dtype(self.dtype)

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.page_tokens, self.num_heads, self.head_dim)

    @property
    def page_elems(self) -> int:
        return math.prod(self.page_shape)

    @property
    def page_bytes(self) -> int:
        return self.page_elems * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class RefillConfig:
    """Background refill of newly granted EMB rows, throttled by a token bucket.

    ``limit_bytes_per_s`` is a hard limit over every window of ``window_s`` seconds: a bucket of
    capacity ``chunk_bytes`` filling at ``limit - chunk_bytes / window_s`` can never send more
    than ``chunk_bytes + rate * window_s = limit * window_s`` bytes in any such window.
    """

    enabled: bool = True
    limit_bytes_per_s: float = ranged(64 * 2**20, lo=0, lo_open=True)
    window_s: float = ranged(0.1, lo=0, lo_open=True)
    chunk_bytes: int = ranged(256 * 2**10, lo=1, integer=True)

    def __post_init__(self) -> None:
        validate(self)
        half = 0.5 * self.limit_bytes_per_s * self.window_s
        require(self, self.chunk_bytes <= half,
                f"chunk_bytes must be at most half of limit_bytes_per_s * window_s ({half:.0f}), got {self.chunk_bytes}")

    @property
    def bucket_rate_bytes_per_s(self) -> float:
        """The bucket's fill rate, below the limit by the one chunk a window may start with."""
        return self.limit_bytes_per_s - self.chunk_bytes / self.window_s


DEFAULT_GHOST_PROBES = (0.05, 0.1, 0.2, 0.4)  # the probes the node agent and the simulator use when on


@dataclass(frozen=True)
class MemoryConfig:
    """One node's arena, EMB hot cache, KV pool and Memory Manager.

    - ``num_pages``: pages in the arena; ``initial_emb_share`` of them start in the EMB slab.
    - ``num_items`` / ``emb_dim`` / ``emb_dtype``: the item embedding table (kept whole in host
      memory; the slab caches its hot rows).
    - ``kv``: the KV page layout (sets the page size).
    - ``max_step_pages``: most pages one boundary step moves (bounds a step's work).
    - ``min_emb_pages`` / ``min_kv_pages``: floors that every plan respects.
    - ``popularity_half_life_ids``: requested ids after which the refill's popularity counts
      (misses per uncached item) halve.
    - ``ghost_probes``: ascending shares of the arena, each in (0, 1] (empty, the default: off;
      the node agent's engine turns on `DEFAULT_GHOST_PROBES`; on, they cost a large lookup ~5%
      on this CPU). Each cache
      keeps a ghost list of what it evicted, and counts, for every probe, the misses that a
      cache that much larger would have served: a short miss-ratio curve of the memory it does
      not have (see `EmbCache` and `KVPool`), from which an allocator reads the marginal utility
      of moving the boundary.
    - ``miss_curves``: each cache keeps a miss-ratio curve from sampled stack distances
      (`node_agent.memory.mrc`, SHARDS): its hit rate at every share of the arena, in bounded
      memory (at most 4,096 followed rows and 2,048 followed users) and bounded time per lookup.
      ``None`` (the default): on exactly when the ghost lists are on.
    - ``payload``: False runs the same metadata logic with no arena tensor and no host table
      (the simulator's mode); hits, evictions and boundary moves are identical.
    - ``device``: ``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda[:N]``.
    """

    num_pages: int = ranged(1024, lo=1, integer=True)
    num_items: int = ranged(100_000, lo=1, integer=True)
    emb_dim: int = ranged(64, lo=1, integer=True)
    emb_dtype: str = "float32"
    kv: KVLayout = field(default_factory=KVLayout)
    initial_emb_share: float = ranged(0.5, lo=0, hi=1)
    max_step_pages: int = ranged(1024, lo=1, integer=True)
    min_emb_pages: int = ranged(0, lo=0, integer=True)
    min_kv_pages: int = ranged(0, lo=0, integer=True)
    popularity_half_life_ids: float = ranged(1e6, lo=0, lo_open=True)
    ghost_probes: tuple[float, ...] = ranged((), lo=0, hi=1, lo_open=True, length=(0, None))
    refill: RefillConfig = field(default_factory=RefillConfig)
    miss_curves: bool | None = None
    payload: bool = True
    device: str = "auto"

    def __post_init__(self) -> None:
        validate(self)
        torch_dtype(self.emb_dtype)
        require(self, self.min_emb_pages + self.min_kv_pages <= self.num_pages,
                f"min_emb_pages + min_kv_pages ({self.min_emb_pages + self.min_kv_pages}) exceeds num_pages "
                f"({self.num_pages})")
        probes = list(self.ghost_probes)
        require(self, probes == sorted(set(probes)), f"ghost_probes must be ascending, got {self.ghost_probes!r}")
        if self.row_bytes > self.page_bytes:
            raise ValueError(
                f"an embedding row ({self.row_bytes} B) does not fit in a page "
                f"({self.page_bytes} B)"
            )
        if self.page_bytes % self.row_bytes:
            raise ValueError(
                f"page_bytes ({self.page_bytes}) must be a multiple of the embedding row size "
                f"({self.row_bytes} B = emb_dim {self.emb_dim} x {self.emb_dtype})"
            )
        if self.device != "auto":
            try:
                dev = torch.device(self.device)  # availability is checked when the arena is built
            except RuntimeError as e:
                raise ValueError(f"device: {e}") from None
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")

    @property
    def page_bytes(self) -> int:
        return self.kv.page_bytes

    @property
    def row_bytes(self) -> int:
        return self.emb_dim * dtype_bytes(self.emb_dtype)

    @property
    def rows_per_page(self) -> int:
        return self.page_bytes // self.row_bytes

    @property
    def max_rows(self) -> int:
        """Rows the slab would have with every page in it."""
        return self.num_pages * self.rows_per_page

    @property
    def miss_curves_on(self) -> bool:
        """Whether the caches keep miss-ratio curves (``miss_curves``; None: with the ghost lists)."""
        return bool(self.ghost_probes) if self.miss_curves is None else bool(self.miss_curves)

    @property
    def ghost_probe_pages(self) -> tuple[int, ...]:
        """Each ghost probe in pages (at least one page each; empty when off)."""
        return tuple(max(1, round(f * self.num_pages)) for f in self.ghost_probes)

    @property
    def ghost_probe_shares(self) -> tuple[float, ...]:
        """Each ghost probe as the share of the arena it really covers (whole pages)."""
        return tuple(p / self.num_pages for p in self.ghost_probe_pages)

    def pages_for_share(self, emb_share: float) -> int:
        """EMB pages for a share, rounded to the nearest page and clamped to the floors."""
        pages = int(round(emb_share * self.num_pages))
        return max(self.min_emb_pages, min(self.num_pages - self.min_kv_pages, pages))
