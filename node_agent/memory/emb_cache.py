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
(amortised, see ``EmbCache``) and the host-to-device copy. About 15 torch ops per call (50 with
misses), so small batches cost tens of microseconds of Python and large ones are memory bound.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from .arena import Arena
from .config import torch_dtype
from .mrc import EmbReuse

RESERVED_TICK = 1 << 62  # larger than any real tick; never a victim, never counted as a hit


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


@dataclass
class _RefillChunk:
    items: torch.Tensor
    slots: torch.Tensor
    num_bytes: int
    event: object | None  # the copy's handle (``query``, ``synchronize``); None when it already completed


class RefillStream:
    """Copies a refill chunk's rows into the slab and hands back how to see the copy complete.

    This class is the CPU's: the copy is done when ``copy`` returns, which returns ``None``.
    `CudaRefillStream` copies on a stream of its own and returns a CUDA event. ``EmbCache``
    keeps one in ``refill_stream``; anything with the same ``copy`` (returning ``None`` or an
    object with ``query()`` and ``synchronize()``) may replace it."""

    def copy(self, slab_rows: torch.Tensor, slots: torch.Tensor, host_table: torch.Tensor,
             items_host: torch.Tensor):
        slab_rows.index_copy_(0, slots, host_table.index_select(0, items_host))
        return None


class CudaRefillStream(RefillStream):
    """The refill's high-priority CUDA stream and its pinned staging buffer.

    ``copy`` gathers the rows on the host into the staging buffer (pinned on CUDA, grown as
    needed; a chunk is issued only once the previous one completed, so one buffer serves), records
    an event on the serving stream (the calling thread's current stream) after the rows'
    reservation and any earlier use of their pages as KV, makes the refill stream wait for it, and
    copies ``non_blocking`` on the refill stream. The serving stream never waits for this stream:
    the chunk's rows are reserved, so no lookup reads or writes them until the commit."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device, priority=-100)
        self.staging: torch.Tensor | None = None

    def copy(self, slab_rows, slots, host_table, items_host):
        k = items_host.numel()
        if self.staging is None or self.staging.shape[0] < k:
            self.staging = torch.empty((k, host_table.shape[1]), dtype=host_table.dtype,
                                       pin_memory=self.device.type == "cuda")
        staging = self.staging[:k]
        torch.index_select(host_table, 0, items_host, out=staging)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            dev_rows = staging.to(self.device, non_blocking=True)
            slab_rows.index_copy_(0, slots, dev_rows)
            done = torch.cuda.Event()
            done.record(self.stream)
        if slots.is_cuda:
            slots.record_stream(self.stream)  # allocated on the serving stream, read on this one
        return done


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

    **Victim selection** is amortised: the eligible rows are sorted by ``(tick, slot)`` once into
    a queue; later calls take victims from its head, skipping entries whose row was touched since
    (its tick changed). Ticks only grow, so the valid entries stay the least recent rows in order;
    anything that can lower a tick (growing the slab, a refill discarding a row) drops the queue.

    **Refill** (``issue_refill`` / ``poll_refill``): when the slab grows, the uncached items with
    the most misses (ties: lower id first) are ranked once, as many as there are empty rows;
    each chunk then copies the next of them still uncached into the lowest empty rows. Rows are
    reserved (``RESERVED_TICK``), copied by ``refill_stream`` (CUDA: `CudaRefillStream`, on a
    separate high-priority stream that waits for the serving stream, never the reverse; CPU: a
    plain copy), and committed to the maps only once the copy has completed (``event.query()``),
    so a lookup never waits for a refill and never sees a half-written row. The ranked candidates
    are kept on the host as well, so issuing a chunk reads no item ids back from the device.
    Refilled rows enter as most recent. Items that a demand miss cached meanwhile are skipped at
    commit and their rows go back to empty. Demand misses take empty rows first too (tick 0), so
    the refill only fills what demand has not.

    **Ghost list** (``config.ghost_probes``): the marginal utility of more rows. Every row that
    leaves the slab (an eviction, or an invalidation when the slab shrinks) stamps its item with
    a running count of such departures (``ghost_seq``). A missed item that left ``d`` departures
    ago (``d = 1``: the last one) is among the ``d`` rows just past the slab's end in LRU order,
    so a slab at least ``d`` rows larger would have held it (LRU's stack property, as in ARC's
    ghost lists and utility-based cache partitioning); for each probe of ``r`` rows
    (``ghost_rows``) the call counts its distinct missed ids with ``d <= r``: row copies that
    much more memory would have saved. A shrink stamps its rows highest first, so the rows just
    past the new end are the nearest ghosts (a slab shrunk less would still hold them). The
    counts are estimates: items that left twice within reach count twice as distance (an
    undercount), and rows stamped in the same call tie in LRU order (batches of several ids can
    overcount a little); for one id per call they are lower bounds of a larger slab's extra hits.
    It costs five tensor ops on calls with misses and two per eviction; the metadata lives on
    the device with the rest.

    **Demand misses** on CUDA are gathered on the host into a pinned staging buffer (reused,
    grown as needed) and copied ``non_blocking`` on the serving stream; the host waits for the
    serving stream only, to read the missed ids and before it reuses the buffer.

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
        self._q_slots = torch.empty(0, dtype=i64, device=dev)
        self._q_ticks = torch.empty(0, dtype=i64, device=dev)
        self._q_head = 0
        self.stats = EmbCacheStats()
        # ghost list: ghost_seq[item] = departures counted when the item left the slab (0: never)
        self.ghost_rows = tuple(p * cfg.rows_per_page for p in cfg.ghost_probe_pages)
        self._ghost_limits = torch.tensor(self.ghost_rows, dtype=i64, device=dev)
        self._departures = 0
        self._ghost_seq = (torch.zeros(num_items, dtype=i64, device=dev) if self.ghost_rows
                           else torch.empty(0, dtype=i64, device=dev))
        self.stats.ghost_hits = (0,) * len(self.ghost_rows)
        # the miss-ratio curve (config.miss_curves): the slab's hits at every size (node_agent.memory.mrc)
        self.reuse = EmbReuse(cfg.num_pages, cfg.rows_per_page) if cfg.miss_curves_on else None
        # refill state
        self._refill_candidates = torch.empty(0, dtype=i64, device=dev)
        self._refill_candidates_host = self._refill_candidates.cpu()
        self._refill_cursor = 0
        self._refill_stale = True
        self._inflight: _RefillChunk | None = None
        self.refill_stream: RefillStream | None = None
        # demand misses on CUDA: pinned staging buffer, and the event after its last copy
        self._demand_staging: torch.Tensor | None = None
        self._demand_copied = None
        # host table
        self.host_table: torch.Tensor | None = None
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
                self.refill_stream = CudaRefillStream(self.device)
            else:
                self.refill_stream = RefillStream()
            self.host_table = host_table.contiguous()
        elif host_table is not None:
            raise ValueError("a metadata-only EMB cache takes no host_table")

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
        evicted = None
        bypass_pos = None
        ghost = None
        if num_miss:
            miss_ids = ids.index_select(0, miss_pos)
            self._count_misses(miss_ids, miss_counts)
            uniq = self._mark_first_occurrences(miss_ids)
            u = uniq.numel()
            if self.ghost_rows and self._departures:
                ghost = self._count_ghost_hits(uniq)
            victims = self._take_victims(min(u, self.rows), tick)
            a = victims.numel()
            if a:
                admitted = uniq[:a] if a < u else uniq
                old = self.slot_to_item.index_select(0, victims)
                evicted = old[old >= 0]
                num_evicted = evicted.numel()
                if num_evicted:
                    self.item_to_slot.index_fill_(0, evicted, self.miss_slot)
                    self._record_departures(evicted)
                else:
                    evicted = None
                self.item_to_slot.index_copy_(0, admitted, victims)
                self.slot_to_item.index_copy_(0, victims, admitted)
                if self.payload:
                    self.arena.all_rows().index_copy_(0, victims, self._host_rows(admitted))
            if a < u:
                self.item_to_slot.index_fill_(0, uniq[a:], self.miss_slot)
            if self.payload:  # the rows' slots (metadata-only mode returns no rows)
                new_slots = self.item_to_slot.index_select(0, miss_ids)
                slots.index_copy_(0, miss_pos, new_slots)
                if a < u:
                    bypass_pos = miss_pos[new_slots == self.miss_slot]
                    slots.index_fill_(0, bypass_pos, 0)  # any in-bounds row; overwritten below

        rows = None
        if self.payload:
            rows = torch.index_select(self.arena.all_rows(), 0, slots, out=out)
            if bypass_pos is not None:
                rows.index_copy_(0, bypass_pos, self._host_rows(ids.index_select(0, bypass_pos)))

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

    def _count_misses(self, miss_ids: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Popularity of uncached items: each miss (with repeats) adds one; counts halve every
        ``popularity_half_life_ids`` requested ids."""
        if weights is None:
            k = miss_ids.numel()
            if self._ones.numel() < k:
                self._ones = torch.ones(max(k, 2 * self._ones.numel()), device=self.device)
            weights = self._ones[:k]
        self.popularity.scatter_add_(0, miss_ids, weights.to(self.popularity.dtype))

    def _count_ghost_hits(self, uniq: torch.Tensor) -> list[int]:
        """Per probe, the distinct missed ids that left the slab within that many departures."""
        seq = self._ghost_seq.index_select(0, uniq)
        dist = torch.where(seq > 0, self._departures + 1 - seq, RESERVED_TICK)  # never left: out of reach
        return (dist.unsqueeze(1) <= self._ghost_limits).sum(0).tolist()

    def _record_departures(self, items: torch.Tensor) -> None:
        """Stamp items leaving the slab (in order) for the ghost list."""
        if not self.ghost_rows:
            return
        k = items.numel()
        self._ghost_seq.index_copy_(0, items, torch.arange(self._departures + 1, self._departures + k + 1,
                                                           dtype=torch.int64, device=self.device))
        self._departures += k

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

    def _host_rows(self, items: torch.Tensor) -> torch.Tensor:
        """The host table's rows of ``items``, on the device."""
        if self.device.type == "cpu":
            return self.host_table.index_select(0, items)
        return self._staged_host_rows(items.cpu())  # the host reads the ids: waits for the serving stream

    def _staged_host_rows(self, items_host: torch.Tensor) -> torch.Tensor:
        """Rows of ``items_host`` (host ids) gathered into the demand staging buffer (pinned on
        CUDA) and copied ``non_blocking`` on the serving stream (the current stream). Before the
        buffer is rewritten the host waits for the event after its previous copy: the serving
        stream's work up to there, nothing else."""
        k = items_host.numel()
        if self._demand_copied is not None:
            self._demand_copied.synchronize()
        buf = self._demand_staging
        if buf is None or buf.shape[0] < k:
            cap = max(k, 2 * buf.shape[0] if buf is not None else 0)
            buf = torch.empty((cap, self.emb_dim), dtype=self.host_table.dtype,
                              pin_memory=self.device.type == "cuda")
            self._demand_staging = buf
        staging = buf[:k]
        torch.index_select(self.host_table, 0, items_host, out=staging)
        rows = staging.to(self.device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._demand_copied = ev
        return rows

    # ------------------------------------------------------------------------------ victims --
    def _invalidate_queue(self) -> None:
        self._q_head = self._q_slots.numel()

    def _rebuild_queue(self, tick: int) -> None:
        """All rows with a tick below ``tick``, in increasing (tick, slot)."""
        t = self.slot_tick[: self.rows]
        order = torch.argsort(t, stable=True)
        sorted_ticks = t.index_select(0, order)
        eligible = int(torch.searchsorted(sorted_ticks, tick))
        self._q_slots = order[:eligible]
        self._q_ticks = sorted_ticks[:eligible]
        self._q_head = 0

    def _take_victims(self, k: int, tick: int) -> torch.Tensor:
        """Up to ``k`` victim rows in eviction order, stamped with ``tick``."""
        if k <= 0:
            return self._q_slots[:0]
        taken: list[torch.Tensor] = []
        need = k
        rebuilt = False
        while need > 0:
            size = self._q_slots.numel()
            head = self._q_head
            if head >= size:
                if rebuilt:
                    break  # every eligible row is taken
                self._rebuild_queue(tick)
                rebuilt = True
                continue
            w = min(size - head, need + need // 4 + 64)  # the queue head is mostly valid
            qs = self._q_slots[head: head + w]
            valid = self.slot_tick.index_select(0, qs) == self._q_ticks[head: head + w]
            vpos = valid.nonzero().squeeze(1)
            if vpos.numel() >= need:
                vpos = vpos[:need]
                self._q_head = head + int(vpos[-1]) + 1
            else:
                self._q_head = head + w
            got = qs.index_select(0, vpos)
            if got.numel():
                self.slot_tick.index_fill_(0, got, tick)
                taken.append(got)
                need -= got.numel()
        if not taken:
            return self._q_slots[:0]
        return taken[0] if len(taken) == 1 else torch.cat(taken)

    # ------------------------------------------------------------------------ boundary moves -
    def grow(self, new_rows: int) -> None:
        """Extend the slab to ``new_rows`` (metadata only: rows past the slab are kept empty)."""
        if not self.rows <= new_rows <= self.max_rows:
            raise ValueError(f"grow to {new_rows} rows from {self.rows} (max {self.max_rows})")
        if new_rows == self.rows:
            return
        self.rows = new_rows
        self._invalidate_queue()  # new empty rows rank before every queued row
        self._refill_stale = True

    def shrink(self, new_rows: int) -> int:
        """Cut the slab to ``new_rows``: the top rows' items are invalidated (metadata only).
        Waits for a refill chunk in flight first (at most one chunk). Returns rows invalidated."""
        if not 0 <= new_rows <= self.rows:
            raise ValueError(f"shrink to {new_rows} rows from {self.rows}")
        if new_rows == self.rows:
            return 0
        self.wait_refill()
        top = self.slot_to_item[new_rows: self.rows]
        items = top[top >= 0]
        if items.numel():
            self.item_to_slot.index_fill_(0, items, self.miss_slot)
            # highest row first: the rows just past the new end are the most recent departures,
            # as a slab shrunk less would still hold them
            self._record_departures(items.flip(0))
        top.fill_(-1)
        self.slot_tick[new_rows: self.rows].fill_(0)
        self.rows = new_rows
        self._invalidate_queue()
        self.stats.num_invalidations += items.numel()
        return items.numel()

    # ------------------------------------------------------------------------------ refill ---
    def _empty_rows(self) -> torch.Tensor:
        """Empty, unreserved rows of the slab, lowest first."""
        t = self.slot_tick[: self.rows]
        return ((self.slot_to_item[: self.rows] < 0) & (t != RESERVED_TICK)).nonzero().squeeze(1)

    def plan_refill(self) -> torch.Tensor:
        """The most popular uncached items, as many as there are empty rows, hottest first
        (ties: lower item id first); items never requested are left out."""
        num_empty = self._empty_rows().numel()
        self._refill_cursor = 0
        self._refill_stale = False
        if num_empty == 0:
            self._refill_candidates = self._refill_candidates[:0]
            self._refill_candidates_host = self._refill_candidates_host[:0]
            return self._refill_candidates
        score = self.popularity.masked_fill(self.item_to_slot != self.miss_slot, -1.0)
        k = min(num_empty, self.num_items)
        kth = float(torch.topk(score, k, sorted=False).values.min())
        if kth <= 0.0:
            cand = (score > 0).nonzero().squeeze(1)
        else:
            above = (score > kth).nonzero().squeeze(1)
            ties = (score == kth).nonzero().squeeze(1)[: k - above.numel()]
            cand = torch.cat([above, ties])
        order = torch.argsort(-score.index_select(0, cand), stable=True)
        self._refill_candidates = cand.index_select(0, order)
        self._refill_candidates_host = self._refill_candidates.cpu()  # the same tensor on the CPU
        return self._refill_candidates

    @property
    def refill_inflight(self) -> bool:
        return self._inflight is not None

    def refill_pending(self) -> bool:
        """True while a refill has work: a chunk in flight, a stale plan or candidates left."""
        return (self._inflight is not None or self._refill_stale
                or self._refill_cursor < self._refill_candidates.numel())

    def issue_refill(self, max_rows: int) -> int:
        """Start copying up to ``max_rows`` candidate rows into empty rows; returns the rows
        issued (0 while a chunk is in flight, or when there is nothing to fill)."""
        self.poll_refill()
        if self._inflight is not None or max_rows <= 0:
            return 0
        if self._refill_stale:
            self.plan_refill()
        cand = self._refill_candidates
        cur = self._refill_cursor
        if cur >= cand.numel():
            return 0
        hi = cur + max(4 * max_rows, 64)
        window, window_host = cand[cur:hi], self._refill_candidates_host[cur:hi]
        # which candidates are still uncached: one flag each read back; the ids come from the host list
        missing = (self.item_to_slot.index_select(0, window) == self.miss_slot).cpu().nonzero().squeeze(1)
        if missing.numel() > max_rows:
            missing = missing[:max_rows]
            self._refill_cursor = cur + int(missing[-1]) + 1
        else:
            self._refill_cursor = cur + window.numel()
        items_host = window_host.index_select(0, missing)
        empty = self._empty_rows()
        k = min(items_host.numel(), empty.numel())
        if empty.numel() == 0:
            self._refill_cursor = cand.numel()  # nothing left to fill until the slab grows
        if k == 0:
            return 0
        items_host, slots = items_host[:k], empty[:k]
        self.slot_tick.index_fill_(0, slots, RESERVED_TICK)
        self._inflight = self._copy_chunk(items_host.to(self.device), slots, items_host)
        self.poll_refill()
        return k

    def _copy_chunk(self, items: torch.Tensor, slots: torch.Tensor,
                    items_host: torch.Tensor | None = None) -> _RefillChunk:
        """Copy ``items``' rows into the reserved rows ``slots`` through ``refill_stream``
        (``items_host``: the same ids in host memory, read back from ``items`` when not given)."""
        nbytes = items.numel() * self.row_bytes
        if not self.payload:
            return _RefillChunk(items, slots, nbytes, None)
        if items_host is None:
            items_host = items.cpu()
        done = self.refill_stream.copy(self.arena.all_rows(), slots, self.host_table, items_host)
        return _RefillChunk(items, slots, nbytes, done)

    def poll_refill(self) -> bool:
        """Commit the chunk in flight if its copy has completed (never waits)."""
        ch = self._inflight
        if ch is None:
            return False
        if ch.event is not None and not ch.event.query():
            return False
        self._inflight = None
        self._commit(ch)
        return True

    def wait_refill(self) -> None:
        """Wait for the chunk in flight and commit it (only boundary shrinks call this)."""
        ch = self._inflight
        if ch is None:
            return
        if ch.event is not None:
            ch.event.synchronize()
        self._inflight = None
        self._commit(ch)

    def _commit(self, ch: _RefillChunk) -> None:
        ok = self.item_to_slot.index_select(0, ch.items) == self.miss_slot
        ok_items, ok_slots = ch.items[ok], ch.slots[ok]
        self._tick += 1
        self.item_to_slot.index_copy_(0, ok_items, ok_slots)
        self.slot_to_item.index_copy_(0, ok_slots, ok_items)
        self.slot_tick.index_fill_(0, ok_slots, self._tick)
        n_ok = ok_items.numel()
        if n_ok < ch.items.numel():
            self.slot_tick.index_fill_(0, ch.slots[~ok], 0)
            self._invalidate_queue()  # rows went back to empty (tick 0)
        self.stats.num_refill_rows += n_ok
        self.stats.num_refill_discarded += ch.items.numel() - n_ok
        self.stats.refill_bytes += ch.num_bytes

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
        n_inflight = 0 if self._inflight is None else self._inflight.slots.numel()
        if n_res != n_inflight:
            out.append(f"emb: {n_res} rows reserved but {n_inflight} in flight")
        ot = ticks[occ]
        if ot.numel() and (int(ot.min()) < 1 or int(ot.max()) > self._tick):
            out.append("emb: an occupied row's tick is outside [1, tick]")
        head = self._q_head
        if head < self._q_slots.numel() and int(self._q_slots[head:].max()) >= rows:
            out.append("emb: the victim queue points past the slab")
        if self.payload and self._inflight is None and items.numel():
            if not torch.equal(self.arena.all_rows()[occ.to(self.device)].cpu(),
                               self.host_table[items]):
                out.append("emb: a cached row differs from the host table")
        return out
