"""Node memory: one arena of pages split between the EMB hot cache (a contiguous LRU slab) and
the paged KV pool, and the Memory Manager that moves the boundary and refills the slab.

See docs/memory.md for the design. Public API::

    cfg = MemoryConfig(num_pages=..., num_items=..., emb_dim=..., kv=KVLayout(...))
    mm = MemoryManager(cfg, host_table)          # payload=False: metadata only, no host_table
    out = mm.emb.lookup(item_ids)                # out.rows: [n, emb_dim]
    mm.kv.lookup(user); mm.kv.append(user, n)    # block tables; mm.kv.read/write K/V
    mm.kv.append(user, n, items, ts); mm.kv.lookup_sequence(user)  # with the tokens' ids recorded
    plan = mm.set_target(0.6, now_s); mm.step(now_s)  # bounded boundary step + refill chunk
"""

from .arena import Arena
from .config import DEFAULT_GHOST_PROBES, KVLayout, MemoryConfig, RefillConfig, resolve_device, torch_dtype
from .emb_cache import DemandCopies, EmbCache, EmbCacheStats, EmbLookup, VictimQueue
from .emb_refill import RESERVED_TICK, CudaRefillStream, EmbRefill, RefillStream
from .free_pages import EMB, FREE, FreePages
from .ghosts import EmbGhostList, KVGhostList
from .kv_pool import CachedSequence, KVAppend, KVPool, KVPoolStats, KVRelease, ResidencyDelta, TokenRecords
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
    "Arena", "ArenaSnapshot", "BoundaryPlan", "BoundaryStep", "BoundaryStepReport", "CachedSequence",
    "CudaRefillStream", "DemandCopies", "EmbCache", "EmbCacheStats", "EmbGhostList", "EmbLookup", "EmbRefill",
    "FreePages", "KVAppend", "KVGhostList", "KVLayout", "KVPool", "KVPoolStats", "KVRelease", "ManagerStep",
    "MemoryConfig", "MemoryManager", "MemoryStats", "RefillConfig", "RefillStream", "ResidencyDelta",
    "TokenBucket", "TokenRecords", "VictimQueue", "CURVE_SHARES", "EmbReuse", "KVReuse", "MissCurves",
    "ReuseSampler", "plan_boundary", "resolve_device", "torch_dtype",
]
