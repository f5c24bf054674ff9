"""Memory Manager: applies a new EMB:KV split in bounded steps and drives the throttled refill.

``plan_boundary(snapshot, target)`` is pure: it turns an ``ArenaSnapshot`` and a target
``emb_share`` into a ``BoundaryPlan`` (steps of at most ``max_step_pages`` pages, each with what
it is expected to cost, and the reason). ``MemoryManager`` owns the arena, the EMB cache and the
KV pool, applies one step per ``step(now_s)`` (or all with ``apply_plan``), and runs one refill
chunk per ``step``/``refill_step`` within the token bucket. Time is always passed in (``now_s``).

EMB grows (pages ``[E, E')`` leave the KV pool): free pages move with metadata only; occupied
pages are migrated into free KV pages above ``E'`` (a device copy, counted in
``bytes_copied``), and only when there are too few free pages are least recently used users
evicted whole to make room. Migration is preferred because a page copy on the device costs
microseconds while an evicted user costs a recompute of its whole history; the KV pool's
highest-page-first allocation keeps pages near the boundary free, so most moves copy nothing.

EMB shrinks (pages ``[E', E)`` join the KV pool): the slab's top rows are invalidated (their
items become misses; metadata only) and the pages join the KV free list.

Newly granted rows are refilled in the background with the most popular uncached items (see
``EmbCache``), at most ``refill.limit_bytes_per_s`` over any ``refill.window_s`` window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .arena import Arena
from .config import MemoryConfig
from .emb_cache import EmbCache, EmbCacheStats
from .kv_pool import KVPool, KVPoolStats
from .mrc import CURVE_SHARES, MissCurves, miss_curves
from .throttle import TokenBucket


@dataclass(frozen=True)
class ArenaSnapshot:
    """What a boundary plan needs to know about the arena, frozen at one instant."""

    num_pages: int
    emb_pages: int
    rows_per_page: int
    page_bytes: int
    kv_free_pages: int
    kv_used_pages: int
    page_occupied: np.ndarray = field(repr=False)  # bool per page: holds a KV user's tokens
    min_emb_pages: int = 0
    min_kv_pages: int = 0

    @property
    def emb_share(self) -> float:
        return self.emb_pages / self.num_pages


@dataclass(frozen=True)
class BoundaryStep:
    """Move the boundary from ``from_emb_pages`` to ``to_emb_pages``; ``occupied_kv_pages``
    of the pages changing sides held KV when planned (zero: the step is metadata only)."""

    from_emb_pages: int
    to_emb_pages: int
    occupied_kv_pages: int

    @property
    def num_pages(self) -> int:
        return abs(self.to_emb_pages - self.from_emb_pages)

    @property
    def grows_emb(self) -> bool:
        return self.to_emb_pages > self.from_emb_pages


@dataclass(frozen=True)
class BoundaryPlan:
    """A target split and the bounded steps that reach it, with the reason in words."""

    target_emb_share: float
    from_emb_pages: int
    target_emb_pages: int
    steps: tuple[BoundaryStep, ...]
    max_bytes_copied: int  # if every occupied page were migrated
    reason: str
    planned_at_s: float = 0.0


def plan_boundary(snapshot: ArenaSnapshot, target_emb_share: float,
                  max_step_pages: int, now_s: float = 0.0) -> BoundaryPlan:
    """Pure: the steps from the snapshot's boundary to ``target_emb_share`` (rounded to the
    nearest page, clamped to the floors), each at most ``max_step_pages`` pages."""
    if not 0.0 <= target_emb_share <= 1.0:
        raise ValueError(f"target_emb_share must be in [0, 1], got {target_emb_share}")
    if max_step_pages < 1:
        raise ValueError(f"max_step_pages must be >= 1, got {max_step_pages}")
    s = snapshot
    raw = int(round(target_emb_share * s.num_pages))
    target = max(s.min_emb_pages, min(s.num_pages - s.min_kv_pages, raw))
    steps: list[BoundaryStep] = []
    cur = s.emb_pages
    occ_total = 0
    while cur != target:
        if target > cur:
            nxt = min(target, cur + max_step_pages)
        else:
            nxt = max(target, cur - max_step_pages)
        occ = int(s.page_occupied[cur:nxt].sum()) if nxt > cur else 0
        occ_total += occ
        steps.append(BoundaryStep(cur, nxt, occ))
        cur = nxt
    clamp = ""
    if target != raw:
        clamp = (f" (clamped from {raw} by min_emb_pages={s.min_emb_pages}, "
                 f"min_kv_pages={s.min_kv_pages})")
    if not steps:
        reason = f"EMB already at {target} pages{clamp}; nothing to move"
    elif target > s.emb_pages:
        delta = target - s.emb_pages
        if occ_total == 0:
            how = "all free KV pages: metadata only"
        else:
            room = s.kv_free_pages - (delta - occ_total)
            how = (f"{occ_total} occupied KV pages to migrate"
                   + ("" if room >= occ_total else
                      f", only {max(room, 0)} free pages outside: LRU users will be evicted"))
        reason = (f"grow EMB {s.emb_pages} -> {target} pages (+{delta}) in {len(steps)} "
                  f"step(s) of <= {max_step_pages}; {how}{clamp}")
    else:
        delta = s.emb_pages - target
        reason = (f"shrink EMB {s.emb_pages} -> {target} pages (-{delta}) in {len(steps)} "
                  f"step(s) of <= {max_step_pages}; slab rows {target * s.rows_per_page}.."
                  f"{s.emb_pages * s.rows_per_page - 1} invalidated, pages join the KV free "
                  f"list{clamp}")
    return BoundaryPlan(target_emb_share, s.emb_pages, target, tuple(steps),
                        occ_total * s.page_bytes, reason, now_s)


@dataclass(frozen=True)
class BoundaryStepReport:
    """What applying one step did."""

    now_s: float
    from_emb_pages: int
    to_emb_pages: int
    free_pages_moved: int
    migrated_pages: int
    evicted_users: tuple[int, ...]
    bytes_copied: int
    invalidated_rows: int


@dataclass(frozen=True)
class ManagerStep:
    """One ``MemoryManager.step``: the boundary step applied (if any) and the refill issued."""

    boundary: BoundaryStepReport | None
    refill_rows: int
    refill_bytes: int


@dataclass(frozen=True)
class MemoryStats:
    """A node's memory at one instant, for metrics reports."""

    emb_pages: int
    emb_share: float
    target_emb_pages: int
    num_boundary_steps: int
    boundary_bytes_copied: int
    emb: EmbCacheStats
    kv: KVPoolStats


class MemoryManager:
    """Owns one node's arena, EMB cache and KV pool, and moves the boundary between them.

    ``set_target`` plans; ``step(now_s)`` (called by the engine between requests) applies at
    most one bounded boundary step and issues at most one refill chunk; ``apply_plan`` applies
    every remaining step at once. Only boundary shrinks ever wait, for at most one refill chunk.
    """

    def __init__(self, config: MemoryConfig, host_table: torch.Tensor | None = None,
                 now_s: float = 0.0) -> None:
        if config.refill.chunk_bytes < config.row_bytes:
            raise ValueError(
                f"refill.chunk_bytes ({config.refill.chunk_bytes}) is below one embedding row "
                f"({config.row_bytes} B)"
            )
        self.config = config
        self.arena = Arena(config)
        self.emb = EmbCache(
            self.arena, config.num_items, host_table,
            popularity_half_life_ids=config.popularity_half_life_ids,
        )
        self.kv = KVPool(self.arena)
        self.bucket = TokenBucket(config.refill.bucket_rate_bytes_per_s, config.refill.chunk_bytes,
                                  now_s)
        self.plan: BoundaryPlan | None = None
        self._pending: deque[BoundaryStep] = deque()
        self.num_boundary_steps = 0
        self.boundary_bytes_copied = 0
        self._ghost_taken = ((), ())  # ghost_counters() at the last take_ghost_counts()

    # ---------------------------------------------------------------------------- queries ---
    @property
    def emb_share(self) -> float:
        return self.arena.emb_share

    @property
    def boundary_moving(self) -> bool:
        return bool(self._pending)

    def snapshot(self) -> ArenaSnapshot:
        occ = self.kv.page_owner >= 0
        occ.flags.writeable = False
        c = self.config
        return ArenaSnapshot(
            num_pages=self.arena.num_pages, emb_pages=self.arena.emb_pages,
            rows_per_page=self.arena.rows_per_page, page_bytes=self.arena.page_bytes,
            kv_free_pages=self.kv.num_free, kv_used_pages=self.kv.num_used,
            page_occupied=occ, min_emb_pages=c.min_emb_pages, min_kv_pages=c.min_kv_pages,
        )

    def metadata_bytes(self) -> int:
        """Bytes of the bookkeeping tensors on the arena's device outside the arena: the EMB slab's
        per-item maps (slot, popularity, ghost order: catalogue-sized) and per-row ones, scratch
        included; the host-side table and staging buffers are not on the device."""
        import torch

        arena = self.arena._storage
        arena_ptr = arena.untyped_storage().data_ptr() if arena is not None else None
        seen, total = set(), 0
        for obj in (self.emb, self.kv):
            for name, v in vars(obj).items():
                if (not isinstance(v, torch.Tensor) or name in ("host_table", "_staging")
                        or v.device != self.arena.device):
                    continue
                st = v.untyped_storage()
                if st.data_ptr() in seen or st.data_ptr() == arena_ptr:
                    continue
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    def stats(self) -> MemoryStats:
        target = self.plan.target_emb_pages if self._pending else self.arena.emb_pages
        return MemoryStats(
            emb_pages=self.arena.emb_pages, emb_share=self.arena.emb_share,
            target_emb_pages=target,
            num_boundary_steps=self.num_boundary_steps,
            boundary_bytes_copied=self.boundary_bytes_copied,
            emb=self.emb.snapshot_stats(), kv=replace(self.kv.stats),
        )

    # ------------------------------------------------------------------------ the boundary --
    def ghost_counters(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Cumulative ghost counts per probe: EMB row copies and KV tokens that a cache each
        probe larger would have saved (``config.ghost_probes``; empty tuples when off)."""
        return self.emb.stats.ghost_hits, self.kv.stats.ghost_hit_tokens

    def miss_curves(self, shares=CURVE_SHARES) -> MissCurves | None:
        """Both caches' predicted hit rates at each of ``shares`` (their EMB slab and KV pool in
        whole pages, as `pages_for_share` plans them), from the miss-ratio curves; None when
        ``config.miss_curves`` is off."""
        if self.emb.reuse is None or self.kv.reuse is None:
            return None
        cfg = self.config
        emb_pages = [cfg.pages_for_share(s) for s in shares]
        return miss_curves(self.emb.reuse, self.kv.reuse, emb_pages, [cfg.num_pages - p for p in emb_pages], shares)

    def take_ghost_counts(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """`ghost_counters` since the previous call (since start-up the first time): one
        control interval's counts, for whoever closes intervals (the node agent, the simulator)."""
        now = self.ghost_counters()
        taken = tuple(tuple(a - b for a, b in zip(n, t or (0,) * len(n))) for n, t in zip(now, self._ghost_taken))
        self._ghost_taken = now
        return taken

    def set_target(self, emb_share: float, now_s: float) -> BoundaryPlan:
        """Plan a move to ``emb_share`` from the current boundary (replacing any plan in
        progress); nothing moves until ``step``/``apply_plan``."""
        plan = plan_boundary(self.snapshot(), emb_share, self.config.max_step_pages, now_s)
        self.plan = plan
        self._pending = deque(plan.steps)
        return plan

    def _apply(self, step: BoundaryStep, now_s: float) -> BoundaryStepReport:
        cur = self.arena.emb_pages
        to = step.to_emb_pages
        rpp = self.arena.rows_per_page
        if to > cur:
            rel = self.kv.release_low_pages(to)
            self.arena.set_emb_pages(to)
            self.emb.grow(to * rpp)
            rep = BoundaryStepReport(now_s, cur, to, rel.free_pages_taken, len(rel.migrated),
                                     rel.evicted_users, rel.bytes_copied, 0)
        else:
            inv = self.emb.shrink(to * rpp)
            self.arena.set_emb_pages(to)
            self.kv.accept_pages(to)
            rep = BoundaryStepReport(now_s, cur, to, cur - to, 0, (), 0, inv)
        self.num_boundary_steps += 1
        self.boundary_bytes_copied += rep.bytes_copied
        return rep

    def advance(self, now_s: float) -> BoundaryStepReport | None:
        """Apply the next planned step (steps run from the boundary as it is now)."""
        while self._pending:
            step = self._pending.popleft()
            cur = self.arena.emb_pages
            if step.to_emb_pages == cur:
                continue
            if step.from_emb_pages != cur:  # the boundary moved since planning: re-anchor
                step = BoundaryStep(cur, step.to_emb_pages, step.occupied_kv_pages)
            return self._apply(step, now_s)
        return None

    def apply_plan(self, now_s: float) -> list[BoundaryStepReport]:
        """Apply every remaining step now."""
        reports = []
        while self._pending:
            rep = self.advance(now_s)
            if rep is not None:
                reports.append(rep)
        return reports

    # ----------------------------------------------------------------------------- refill ---
    def refill_step(self, now_s: float) -> int:
        """Commit a finished refill chunk and issue the next one if the token bucket allows;
        returns the bytes issued. Never waits."""
        emb = self.emb
        emb.refill.poll()
        r = self.config.refill
        if not r.enabled or emb.refill.inflight or not emb.refill.pending():
            return 0
        budget = min(self.bucket.available(now_s), r.chunk_bytes)
        max_rows = int(budget // emb.row_bytes)
        if max_rows == 0:
            return 0
        rows = emb.refill.issue(max_rows)
        nbytes = rows * emb.row_bytes
        if rows and not self.bucket.take(nbytes, now_s):
            raise RuntimeError("refill issued more bytes than the bucket held")
        return nbytes

    def step(self, now_s: float) -> ManagerStep:
        """Between requests: one boundary step (if a plan is in progress) and one refill chunk."""
        rep = self.advance(now_s) if self._pending else None
        nbytes = self.refill_step(now_s)
        return ManagerStep(rep, nbytes // self.emb.row_bytes, nbytes)

    # ------------------------------------------------------------------------- invariants ---
    def check_invariants(self) -> list[str]:
        out = self.arena.check_invariants() + self.emb.check_invariants()
        out += self.kv.check_invariants() + self.bucket.check_invariants()
        for name, r in (("emb curve", self.emb.reuse), ("kv curve", self.kv.reuse)):
            if r is not None:
                out += [f"{name}: {v}" for v in r.check_invariants()]
        a = self.arena
        if self.emb.rows != a.emb_pages * a.rows_per_page:
            out.append(f"manager: slab rows {self.emb.rows} != emb pages x rows per page")
        if self.kv.kv_start != a.emb_pages:
            out.append(f"manager: KV pool starts at {self.kv.kv_start}, boundary at {a.emb_pages}")
        if a.emb_pages + self.kv.num_used + self.kv.num_free != a.num_pages:
            out.append(
                f"manager: emb {a.emb_pages} + kv_used {self.kv.num_used} + kv_free "
                f"{self.kv.num_free} != num_pages {a.num_pages}"
            )
        return out
