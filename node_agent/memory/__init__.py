"""Node memory: one arena of pages split between the EMB hot cache (a contiguous LRU slab) and
the paged KV pool, and the Memory Manager that moves the boundary and refills the slab.

See docs/memory.md for the design. Public API::

    cfg = MemoryConfig(num_pages=..., num_items=..., emb_dim=..., kv=KVLayout(...))
    mm = MemoryManager(cfg, host_table)          # payload=False: metadata only, no host_table
    out = mm.emb.lookup(item_ids)                # out.rows: [n, emb_dim]
    mm.kv.lookup(user); mm.kv.append(user, n)    # block tables; mm.kv.read/write K/V
    plan = mm.set_target(0.6, now_s); mm.step(now_s)  # bounded boundary step + refill chunk
"""

from .arena import Arena
from .config import DEFAULT_GHOST_PROBES, KVLayout, MemoryConfig, RefillConfig, resolve_device, torch_dtype
from .emb_cache import RESERVED_TICK, EmbCache, EmbCacheStats, EmbLookup
from .kv_pool import EMB, FREE, KVAppend, KVPool, KVPoolStats, KVRelease, ResidencyDelta
from .manager import (
    ArenaSnapshot,
    BoundaryPlan,
    BoundaryStep,
    BoundaryStepReport,
    ManagerStep,
    MemoryManager,
    MemoryStats,
    plan_boundary,
)
from .mrc import CURVE_SHARES, EmbReuse, KVReuse, MissCurves, ReuseSampler
from .throttle import TokenBucket

__all__ = [
    "DEFAULT_GHOST_PROBES", "EMB", "FREE", "RESERVED_TICK",
    "Arena", "ArenaSnapshot", "BoundaryPlan", "BoundaryStep", "BoundaryStepReport", "EmbCache",
    "EmbCacheStats", "EmbLookup", "KVAppend", "KVLayout", "KVPool", "KVPoolStats", "KVRelease",
    "ManagerStep", "MemoryConfig", "MemoryManager", "MemoryStats", "RefillConfig",
    "ResidencyDelta", "TokenBucket", "CURVE_SHARES", "EmbReuse", "KVReuse", "MissCurves", "ReuseSampler", "plan_boundary", "resolve_device", "torch_dtype",
]
