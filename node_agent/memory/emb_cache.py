"""EMB hot cache: an LRU cache of item embedding rows in the arena's slab, vectorised per batch.

Metadata (all device tensors, apart from the slab itself; see ``EmbCache``):

- ``item_to_slot[num_items]``: slab row of each item, or ``miss_slot`` (= ``max_rows``, one
  past the largest slab the arena can hold) when the item is not cached;
- ``slot_to_item[max_rows]``: the item in each row, ``-1`` for an empty row;
- ``slot_tick[max_rows + 1]``: the logical time each row was last used (``0``: empty,
  ``RESERVED_TICK``: held by a refill chunk in flight). Entry ``miss_slot`` is a sink that
  absorbs the stamps of misses so that a batch is stamped with one scatter and no mask;
- ``popularity[num_items]``: how often each item was requested while not cached (its misses,
  repeats included), halved every ``popularity_half_life_ids`` requested ids: the refill ranks
  uncached items by it. Counting misses only keeps the count off the hit path, and among
  uncached items (the only ones a refill considers) a miss count is a request count.

A lookup of ``n`` ids is a fixed sequence of tensor ops (no per-id Python): gather slots, stamp
them, find misses, gather rows. Only a batch with misses pays for deduplication (a
first-occurrence ``scatter_reduce`` into ``item_to_slot`` itself, not a sort), victim selection
(amortised, see ``VictimQueue``) and the host-to-device copy. About 15 torch ops per call (50 with
misses), so small batches cost tens of microseconds of Python and large ones are memory bound.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from .arena import Arena
from .config import torch_dtype
from .emb_refill import RESERVED_TICK, CudaRefillStream, EmbRefill, RefillStream
from .ghosts import EmbGhostList
from .mrc import EmbReuse


class EmbLookup(NamedTuple):
    """What one ``lookup`` did. ``rows`` is ``[n, emb_dim]`` (``None`` in metadata-only mode);
    ``evicted_items`` lists the evicted items in eviction order (``None`` when none)."""

    rows: torch.Tensor | None
    num_requested: int
    num_hits: int
    num_unique_ids: int
    num_unique_misses: int
    num_bypassed: int
    num_evictions: int
    bytes_transferred: int
    evicted_items: torch.Tensor | None


@dataclass
class EmbCacheStats:
    """Cumulative counters in the style of FBGEMM's cache stats.

    ``num_hits`` counts requested ids (with repeats) found in the slab at the start of their
    call; ``num_unique_misses`` distinct ids per call that were not; ``num_bypassed`` those of
    them served straight from host memory because the call's distinct ids outnumbered the rows
    (FBGEMM's conflict misses); ``bytes_transferred`` the demand host-to-device bytes (one row
    per unique miss); refill traffic is counted apart in ``refill_bytes``; ``ghost_hits``, per
    ghost probe, the unique misses that a slab that much larger would have held (row copies
    saved).
    """

    num_calls: int = 0
    num_requested_ids: int = 0
    num_unique_ids: int = 0
    num_hits: int = 0
    num_unique_misses: int = 0
    num_bypassed: int = 0
    num_evictions: int = 0
    num_invalidations: int = 0
    bytes_transferred: int = 0
    num_refill_rows: int = 0
    num_refill_discarded: int = 0
    refill_bytes: int = 0
    ghost_hits: tuple[int, ...] = ()  # per ghost probe (see EmbCache)

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_requested_ids if self.num_requested_ids else 0.0


class VictimQueue:
    """Victims of the slab in eviction order, amortised.

    The eligible rows (tick below the current call's) are sorted by ``(tick, slot)`` once into a
    queue; later calls take victims from its head, skipping entries whose row was touched since
    (its tick changed). Ticks only grow, so the valid entries stay the least recent rows in
    order; anything that can lower a tick (growing the slab, a refill discarding a row) must
    `invalidate` the queue. ``slot_tick`` is the cache's tensor, shared."""

    def __init__(self, slot_tick: torch.Tensor) -> None:
        self.slot_tick = slot_tick
        self._slots = torch.empty(0, dtype=torch.int64, device=slot_tick.device)
        self._ticks = torch.empty(0, dtype=torch.int64, device=slot_tick.device)
        self._head = 0

    def invalidate(self) -> None:
        self._head = self._slots.numel()

    def _rebuild(self, tick: int, rows: int) -> None:
        """All rows of ``[0, rows)`` with a tick below ``tick``, in increasing (tick, slot)."""
        t = self.slot_tick[:rows]
        order = torch.argsort(t, stable=True)
        sorted_ticks = t.index_select(0, order)
        eligible = int(torch.searchsorted(sorted_ticks, tick))
        self._slots = order[:eligible]
        self._ticks = sorted_ticks[:eligible]
        self._head = 0

    def take(self, k: int, tick: int, rows: int) -> torch.Tensor:
        """Up to ``k`` victim rows of ``[0, rows)`` in eviction order, stamped with ``tick``."""
        if k <= 0:
            return self._slots[:0]
        taken: list[torch.Tensor] = []
        need = k
        rebuilt = False
        while need > 0:
            size = self._slots.numel()
            head = self._head
            if head >= size:
                if rebuilt:
                    break  # every eligible row is taken
                self._rebuild(tick, rows)
                rebuilt = True
                continue
            w = min(size - head, need + need // 4 + 64)  # the queue head is mostly valid
            qs = self._slots[head: head + w]
            valid = self.slot_tick.index_select(0, qs) == self._ticks[head: head + w]
            vpos = valid.nonzero().squeeze(1)
            if vpos.numel() >= need:
                vpos = vpos[:need]
                self._head = head + int(vpos[-1]) + 1
            else:
                self._head = head + w
            got = qs.index_select(0, vpos)
            if got.numel():
                self.slot_tick.index_fill_(0, got, tick)
                taken.append(got)
                need -= got.numel()
        if not taken:
            return self._slots[:0]
        return taken[0] if len(taken) == 1 else torch.cat(taken)

    def points_past(self, rows: int) -> bool:
        """Whether a queued entry still to be read names a row at or past ``rows``."""
        head = self._head
        return head < self._slots.numel() and int(self._slots[head:].max()) >= rows


class DemandCopies:
    """The host table's rows of demand misses, on the device.

    On CUDA the rows are gathered on the host into a pinned staging buffer (reused, grown as
    needed) and copied ``non_blocking`` on the serving stream; the host waits for the serving
    stream only, to read the missed ids and before it reuses the buffer. On the CPU a gather."""

    def __init__(self, host_table: torch.Tensor, device: torch.device) -> None:
        self.host_table = host_table
        self.device = device
        self.staging: torch.Tensor | None = None
        self._copied = None  # the event after the staging buffer's last copy

    def rows(self, items: torch.Tensor) -> torch.Tensor:
        """The host table's rows of ``items``, on the device."""
        if self.device.type == "cpu":
            return self.host_table.index_select(0, items)
        return self.staged_rows(items.cpu())  # the host reads the ids: waits for the serving stream

    def staged_rows(self, items_host: torch.Tensor) -> torch.Tensor:
        """Rows of ``items_host`` (host ids) gathered into the staging buffer (pinned on CUDA) and
        copied ``non_blocking`` on the serving stream (the current stream). Before the buffer is
        rewritten the host waits for the event after its previous copy: the serving stream's work
        up to there, nothing else."""
        k = items_host.numel()
        if self._copied is not None:
            self._copied.synchronize()
        buf = self.staging
        if buf is None or buf.shape[0] < k:
            cap = max(k, 2 * buf.shape[0] if buf is not None else 0)
            buf = torch.empty((cap, self.host_table.shape[1]), dtype=self.host_table.dtype,
                              pin_memory=self.device.type == "cuda")
            self.staging = buf
        staging = buf[:k]
        torch.index_select(self.host_table, 0, items_host, out=staging)
        rows = staging.to(self.device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._copied = ev
        return rows


class EmbCache:
    """LRU cache of embedding rows in the arena's slab ``[0, emb_rows)``.

    **Eviction order (exact).** Every call to ``lookup`` is one logical tick; every row touched
    by the call (hit or inserted) is stamped with it. Victims are taken in increasing
    ``(tick, slot)``: empty rows first (tick 0, lowest slot first), then the least recently used
    rows, rows last used in the same call going lowest slot first. Rows touched by the current
    call and rows held by a refill in flight are never victims. A call's distinct misses are
    inserted in order of first occurrence in the batch, the i-th into the i-th victim. If a call
    has more distinct misses than there are eligible rows, the first ones (in that order) are
    admitted and the rest are served from host memory without being cached (``num_bypassed``).

    Why this order: a tick per batch, as FBGEMM's LRU cache does, keeps the bookkeeping a single
    scatter per batch; the slot tie-break makes the order deterministic, so tests can script it.
    Victim selection is amortised (`VictimQueue`, ``victims``).

    Parts: ``refill`` (`EmbRefill`: the background refill of empty rows with the most missed
    items; the cache commits its rows in `admit_refilled`), ``ghosts`` (`EmbGhostList`, with
    ``config.ghost_probes``: the misses a larger slab would have served), ``demand``
    (`DemandCopies`: the rows of demand misses from host memory; ``None`` in metadata-only mode).

    **Metadata-only mode** (``arena.payload is False``): the same code with no slab and no host
    table; ``rows`` is ``None`` and nothing is copied, every counter and decision is identical.
    """

    def __init__(
        self,
        arena: Arena,
        num_items: int,
        host_table: torch.Tensor | None = None,
        popularity_half_life_ids: float = 1e6,
    ) -> None:
        cfg = arena.config
        self.arena = arena
        self.device = arena.device
        self.payload = arena.payload
        self.num_items = num_items
        self.emb_dim = cfg.emb_dim
        self.row_bytes = cfg.row_bytes
        self.max_rows = cfg.max_rows
        self.miss_slot = cfg.max_rows
        self.rows = arena.emb_rows
        self.popularity_half_life_ids = float(popularity_half_life_ids)
        dev = self.device
        i64 = torch.int64
        self.item_to_slot = torch.full((num_items,), self.miss_slot, dtype=i64, device=dev)
        self.slot_to_item = torch.full((self.max_rows,), -1, dtype=i64, device=dev)
        self.slot_tick = torch.zeros(self.max_rows + 1, dtype=i64, device=dev)
        self.popularity = torch.zeros(num_items, dtype=torch.float32, device=dev)
        self._ids_since_decay = 0.0
        self._marks = torch.empty(0, dtype=i64, device=dev)  # miss_slot + 1 + position
        self._slot_mark = torch.zeros(self.max_rows + 1, dtype=torch.int32, device=dev)  # scratch
        self._arange32 = torch.arange(0, dtype=torch.int32, device=dev)
        self._ones = torch.ones(0, dtype=torch.float32, device=dev)
        self._tick = 0
        self.victims = VictimQueue(self.slot_tick)
        self.stats = EmbCacheStats()
        self.ghosts = EmbGhostList(tuple(p * cfg.rows_per_page for p in cfg.ghost_probe_pages), num_items, dev)
        self.stats.ghost_hits = (0,) * len(self.ghosts.rows)
        # the miss-ratio curve (config.miss_curves): the slab's hits at every size (node_agent.memory.mrc)
        self.reuse = EmbReuse(cfg.num_pages, cfg.rows_per_page) if cfg.miss_curves_on else None
        self.host_table: torch.Tensor | None = None
        self.demand: DemandCopies | None = None
        stream = None
        if self.payload:
            if host_table is None:
                raise ValueError("a payload EMB cache needs host_table [num_items, emb_dim]")
            want = torch_dtype(cfg.emb_dtype)
            if tuple(host_table.shape) != (num_items, self.emb_dim) or host_table.dtype != want:
                raise ValueError(
                    f"host_table must be [{num_items}, {self.emb_dim}] {want}, got "
                    f"{list(host_table.shape)} {host_table.dtype}"
                )
            if host_table.device.type != "cpu":
                raise ValueError("host_table must live in host memory")
            if self.device.type == "cuda":
                if not host_table.is_pinned():
                    host_table = host_table.pin_memory()
                stream = CudaRefillStream(self.device)
            else:
                stream = RefillStream()
            self.host_table = host_table.contiguous()
            self.demand = DemandCopies(self.host_table, self.device)
        elif host_table is not None:
            raise ValueError("a metadata-only EMB cache takes no host_table")
        self.refill = EmbRefill(self, stream)

    # ------------------------------------------------------------------------------ lookup ---
    def _record_reuse(self, ids: torch.Tensor, counts: torch.Tensor | None, host_ids: np.ndarray | None) -> None:
        """Feed the miss-ratio curve's sampler from host memory: ``host_ids`` (the same ids as the
        caller had them before the copy to the device), or ``ids`` themselves on the CPU. Device
        ids without a host copy are not sampled: reading them back would stall the serving path."""
        if host_ids is None and ids.is_cuda:
            return
        if counts is not None and counts.is_cuda:
            return
        src = host_ids if host_ids is not None else ids.numpy()
        self.reuse.record(np.asarray(src, dtype=np.int64), None if counts is None else counts.numpy())

    def lookup(self, ids: torch.Tensor, out: torch.Tensor | None = None,
               counts: torch.Tensor | None = None, host_ids: np.ndarray | None = None) -> EmbLookup:
        """Rows for ``ids`` (1-D item ids); misses are copied in from host memory (LRU).

        ``out`` (optional, ``[n, emb_dim]`` on the device) receives the rows instead of a new
        tensor. Ids out of ``[0, num_items)`` raise (CPU) or fault the device (CUDA).

        ``counts`` (optional, 1-D, one positive integer per id): each id stands for that many
        repeats of itself, as a GPU lookup deduplicates a batch before it queries the cache. The
        cache's state, the counters and the returned figures are exactly those of a call with
        every id repeated ``counts`` times (the repeats need not be adjacent: only the order of
        first occurrences matters); rows are returned once per given id. ``host_ids`` (optional):
        the same ids in host memory, for the miss-ratio curve's sampler (device ids without them
        are not sampled: reading them back would stall the serving path)."""
        if ids.device != self.device or ids.dtype != torch.int64:
            ids = ids.to(device=self.device, dtype=torch.int64)
        if ids.dim() != 1:
            ids = ids.reshape(-1)
        n = ids.numel()
        n_total = n
        if counts is not None:
            if counts.dim() != 1 or counts.numel() != n:
                raise ValueError(f"counts must be 1-D with one entry per id ({n}), got {list(counts.shape)}")
            if counts.device != self.device or counts.dtype != torch.int64:
                counts = counts.to(device=self.device, dtype=torch.int64)
            n_total = int(counts.sum())
            if n and int(counts.min()) < 1:
                raise ValueError("counts must be >= 1")
        stats = self.stats
        stats.num_calls += 1
        if self.reuse is not None and n:
            self._record_reuse(ids, counts, host_ids)
        if n == 0:
            rows = None
            if self.payload:
                rows = torch.empty(0, self.emb_dim, dtype=self.host_table.dtype, device=self.device)
            return EmbLookup(rows, 0, 0, 0, 0, 0, 0, 0, None)
        self._tick += 1
        tick = self._tick
        slots = self.item_to_slot.index_select(0, ids)
        self.slot_tick.index_fill_(0, slots, tick)
        miss_pos = (slots == self.miss_slot).nonzero().squeeze(1)
        num_miss_pos = miss_pos.numel()
        num_distinct_hits = self._count_distinct_hit_slots(slots, tick, n, num_miss_pos)
        miss_counts = None
        if counts is None:
            num_miss = num_miss_pos
        else:
            miss_counts = counts.index_select(0, miss_pos)
            num_miss = int(miss_counts.sum()) if num_miss_pos else 0

        u = a = num_evicted = 0
        evicted = bypass_pos = ghost = None
        if num_miss:
            u, a, evicted, bypass_pos, ghost = self._insert_misses(ids, slots, miss_pos, miss_counts, tick)
            num_evicted = 0 if evicted is None else evicted.numel()

        rows = None
        if self.payload:
            rows = torch.index_select(self.arena.all_rows(), 0, slots, out=out)
            if bypass_pos is not None:
                rows.index_copy_(0, bypass_pos, self.demand.rows(ids.index_select(0, bypass_pos)))

        self._decay_popularity(n_total)
        num_hits = n_total - num_miss
        bytes_moved = u * self.row_bytes
        stats.num_requested_ids += n_total
        stats.num_unique_ids += num_distinct_hits + u
        stats.num_hits += num_hits
        stats.num_unique_misses += u
        stats.num_bypassed += u - a
        stats.num_evictions += num_evicted
        stats.bytes_transferred += bytes_moved
        if ghost is not None:
            stats.ghost_hits = tuple(a + b for a, b in zip(stats.ghost_hits, ghost))
        return EmbLookup(rows, n_total, num_hits, num_distinct_hits + u, u, u - a, num_evicted,
                         bytes_moved, evicted)

    def _insert_misses(self, ids: torch.Tensor, slots: torch.Tensor, miss_pos: torch.Tensor,
                       miss_counts: torch.Tensor | None, tick: int):
        """A call's misses (at ``miss_pos`` of ``ids``): counted (popularity, ghost list), the
        distinct ones admitted into victim rows in order of first occurrence (their items
        evicted), the rest bypassed; in payload mode ``slots`` gets the misses' new rows (bypassed
        ones: row 0, to be overwritten). Returns (distinct misses, admitted, evicted items or
        None, positions bypassed or None, ghost hits per probe or None)."""
        miss_ids = ids.index_select(0, miss_pos)
        self._count_misses(miss_ids, miss_counts)
        uniq = self._mark_first_occurrences(miss_ids)
        u = uniq.numel()
        ghost = self.ghosts.hits(uniq)
        victims = self.victims.take(min(u, self.rows), tick, self.rows)
        a = victims.numel()
        evicted = bypass_pos = None
        if a:
            admitted = uniq[:a] if a < u else uniq
            old = self.slot_to_item.index_select(0, victims)
            evicted = old[old >= 0]
            if evicted.numel():
                self.item_to_slot.index_fill_(0, evicted, self.miss_slot)
                self.ghosts.record_departures(evicted)
            else:
                evicted = None
            self.item_to_slot.index_copy_(0, admitted, victims)
            self.slot_to_item.index_copy_(0, victims, admitted)
            if self.payload:
                self.arena.all_rows().index_copy_(0, victims, self.demand.rows(admitted))
        if a < u:
            self.item_to_slot.index_fill_(0, uniq[a:], self.miss_slot)
        if self.payload:  # the rows' slots (metadata-only mode returns no rows)
            new_slots = self.item_to_slot.index_select(0, miss_ids)
            slots.index_copy_(0, miss_pos, new_slots)
            if a < u:
                bypass_pos = miss_pos[new_slots == self.miss_slot]
                slots.index_fill_(0, bypass_pos, 0)  # any in-bounds row; overwritten below
        return u, a, evicted, bypass_pos, ghost

    def _count_misses(self, miss_ids: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Popularity of uncached items: each miss (with repeats) adds one; counts halve every
        ``popularity_half_life_ids`` requested ids."""
        if weights is None:
            k = miss_ids.numel()
            if self._ones.numel() < k:
                self._ones = torch.ones(max(k, 2 * self._ones.numel()), device=self.device)
            weights = self._ones[:k]
        self.popularity.scatter_add_(0, miss_ids, weights.to(self.popularity.dtype))

    def _decay_popularity(self, n: int) -> None:
        self._ids_since_decay += n
        if self._ids_since_decay >= self.popularity_half_life_ids:
            halvings = int(self._ids_since_decay // self.popularity_half_life_ids)
            self.popularity.mul_(0.5 ** halvings)
            self._ids_since_decay -= halvings * self.popularity_half_life_ids

    def _arange(self, n: int) -> torch.Tensor:
        if self._arange32.numel() < n:
            self._arange32 = torch.arange(
                max(n, 2 * self._arange32.numel()), dtype=torch.int32, device=self.device
            )
        return self._arange32[:n]

    def _count_distinct_hit_slots(self, slots: torch.Tensor, tick: int, n: int,
                                  num_miss: int) -> int:
        """Distinct slab rows hit by this call (before its misses are inserted)."""
        if num_miss == n:
            return 0
        if self.rows <= 2 * n:  # a scan of the stamps is cheaper than a scatter of the batch
            return int((self.slot_tick[: self.rows] == tick).sum())
        # Scatter positions and read them back: exactly one position per distinct slot wins,
        # whichever write lands last, so the count is exact on every device.
        ar = self._arange(n)
        self._slot_mark.index_copy_(0, slots, ar)
        distinct = int((self._slot_mark.index_select(0, slots) == ar).sum())
        return distinct - (1 if num_miss else 0)  # the miss sink counted once

    def _mark_first_occurrences(self, miss_ids: torch.Tensor) -> torch.Tensor:
        """Distinct ``miss_ids`` in order of first occurrence (deterministic on every device).

        Uses ``item_to_slot`` itself as the scratch: each missed item's entry is set to
        ``miss_slot + 1 + (position of its first occurrence)``; the caller must then overwrite
        every returned item's entry (with its new row, or ``miss_slot`` if bypassed)."""
        m = miss_ids.numel()
        if self._marks.numel() < m:
            self._marks = torch.arange(max(m, 2 * self._marks.numel()), dtype=torch.int64,
                                       device=self.device) + (self.miss_slot + 1)
        marks = self._marks[:m]
        self.item_to_slot.scatter_reduce_(0, miss_ids, marks, "amin", include_self=False)
        return miss_ids[self.item_to_slot.index_select(0, miss_ids) == marks]

    # ------------------------------------------------------------------------ boundary moves -
    def grow(self, new_rows: int) -> None:
        """Extend the slab to ``new_rows`` (metadata only: rows past the slab are kept empty)."""
        if not self.rows <= new_rows <= self.max_rows:
            raise ValueError(f"grow to {new_rows} rows from {self.rows} (max {self.max_rows})")
        if new_rows == self.rows:
            return
        self.rows = new_rows
        self.victims.invalidate()  # new empty rows rank before every queued row
        self.refill.mark_stale()

    def shrink(self, new_rows: int) -> int:
        """Cut the slab to ``new_rows``: the top rows' items are invalidated (metadata only).
        Waits for a refill chunk in flight first (at most one chunk). Returns rows invalidated."""
        if not 0 <= new_rows <= self.rows:
            raise ValueError(f"shrink to {new_rows} rows from {self.rows}")
        if new_rows == self.rows:
            return 0
        self.refill.wait()
        top = self.slot_to_item[new_rows: self.rows]
        items = top[top >= 0]
        if items.numel():
            self.item_to_slot.index_fill_(0, items, self.miss_slot)
            # highest row first: the rows just past the new end are the most recent departures,
            # as a slab shrunk less would still hold them
            self.ghosts.record_departures(items.flip(0))
        top.fill_(-1)
        self.slot_tick[new_rows: self.rows].fill_(0)
        self.rows = new_rows
        self.victims.invalidate()
        self.stats.num_invalidations += items.numel()
        return items.numel()

    def admit_refilled(self, items: torch.Tensor, slots: torch.Tensor) -> int:
        """Commit a refill chunk whose rows ``slots`` (reserved) now hold ``items``' rows: the
        items still uncached take their rows as most recent (one tick); the others' rows go back
        to empty. Returns the rows admitted."""
        ok = self.item_to_slot.index_select(0, items) == self.miss_slot
        ok_items, ok_slots = items[ok], slots[ok]
        self._tick += 1
        self.item_to_slot.index_copy_(0, ok_items, ok_slots)
        self.slot_to_item.index_copy_(0, ok_slots, ok_items)
        self.slot_tick.index_fill_(0, ok_slots, self._tick)
        n_ok = ok_items.numel()
        if n_ok < items.numel():
            self.slot_tick.index_fill_(0, slots[~ok], 0)
            self.victims.invalidate()  # rows went back to empty (tick 0)
        return n_ok

    # ----------------------------------------------------------------------------- queries ---
    @property
    def tick(self) -> int:
        return self._tick

    def snapshot_stats(self) -> EmbCacheStats:
        return replace(self.stats)

    def resident_items(self, sort: bool = True) -> torch.Tensor:
        """Cached item ids, ascending (``sort=False``: in slot order, cheaper)."""
        s = self.slot_to_item[: self.rows]
        s = s[s >= 0]
        return torch.sort(s).values if sort else s

    def lru_items(self) -> torch.Tensor:
        """Cached items in eviction order (least recent first), ignoring rows in flight."""
        s = self.slot_to_item[: self.rows]
        occ = (s >= 0).nonzero().squeeze(1)
        order = torch.argsort(self.slot_tick.index_select(0, occ), stable=True)
        return s.index_select(0, occ.index_select(0, order))

    def num_cached(self) -> int:
        return int((self.slot_to_item[: self.rows] >= 0).sum())

    def popularity_of(self, items: torch.Tensor) -> torch.Tensor:
        """Decayed miss counts for ``items``."""
        return self.popularity.index_select(0, items.to(self.device))

    # -------------------------------------------------------------------------- invariants ---
    def check_invariants(self) -> list[str]:
        out: list[str] = []
        rows, ms = self.rows, self.miss_slot
        if rows != self.arena.emb_rows:
            out.append(f"emb: rows {rows} != arena emb rows {self.arena.emb_rows}")
        s2i = self.slot_to_item.cpu()
        i2s = self.item_to_slot.cpu()
        ticks = self.slot_tick.cpu()
        inside, outside = s2i[:rows], s2i[rows:]
        if bool((outside != -1).any()) or bool((ticks[rows: self.max_rows] != 0).any()):
            out.append("emb: a row past the slab is not empty")
        occ = (inside >= 0).nonzero().squeeze(1)
        items = inside[occ]
        if items.numel() and int(items.max()) >= self.num_items:
            out.append("emb: slot_to_item holds an item id out of range")
            return out
        if items.numel() != torch.unique(items).numel():
            out.append("emb: an item occupies two rows")
        if items.numel() and not torch.equal(i2s[items], occ):
            out.append("emb: item_to_slot and slot_to_item disagree")
        mapped = (i2s != ms).nonzero().squeeze(1)
        if mapped.numel() != items.numel():
            out.append(f"emb: {mapped.numel()} items mapped but {items.numel()} rows occupied")
        if mapped.numel() and int(i2s[mapped].max()) >= rows:
            out.append("emb: an item maps past the slab")
        empty = (inside < 0).nonzero().squeeze(1)
        et = ticks[empty]
        reserved = et == RESERVED_TICK
        if bool(((et != 0) & ~reserved).any()):
            out.append("emb: an empty row carries a tick")
        n_res = int(reserved.sum())
        n_inflight = self.refill.num_inflight_rows
        if n_res != n_inflight:
            out.append(f"emb: {n_res} rows reserved but {n_inflight} in flight")
        ot = ticks[occ]
        if ot.numel() and (int(ot.min()) < 1 or int(ot.max()) > self._tick):
            out.append("emb: an occupied row's tick is outside [1, tick]")
        if self.victims.points_past(rows):
            out.append("emb: the victim queue points past the slab")
        if self.payload and not self.refill.inflight and items.numel():
            if not torch.equal(self.arena.all_rows()[occ.to(self.device)].cpu(),
                               self.host_table[items]):
                out.append("emb: a cached row differs from the host table")
        return out
