"""The EMB slab's background refill: the most popular uncached items copied into its empty rows.

`EmbRefill` chooses the items and the rows and tracks the chunk in flight; a `RefillStream`
copies a chunk (`CudaRefillStream`: on a stream of its own); the cache commits the rows
(`EmbCache.admit_refilled`) once the copy has completed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .emb_cache import EmbCache

RESERVED_TICK = 1 << 62  # larger than any real tick; never a victim, never counted as a hit


@dataclass
class _RefillChunk:
    items: torch.Tensor
    slots: torch.Tensor
    num_bytes: int
    event: object | None  # the copy's handle (``query``, ``synchronize``); None when it already completed


class RefillStream:
    """Copies a refill chunk's rows into the slab and hands back how to see the copy complete.

    This class is the CPU's: the copy is done when ``copy`` returns, which returns ``None``.
    `CudaRefillStream` copies on a stream of its own and returns a CUDA event. ``EmbRefill``
    keeps one in ``stream``; anything with the same ``copy`` (returning ``None`` or an object
    with ``query()`` and ``synchronize()``) may replace it."""

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


class EmbRefill:
    """The background refill of one `EmbCache`'s empty rows.

    When the slab grows, the uncached items with the most misses (ties: lower id first) are
    ranked once (`plan`), as many as there are empty rows; each chunk (`issue`) then copies the
    next of them still uncached into the lowest empty rows. Rows are reserved
    (``RESERVED_TICK``), copied by ``stream`` (CUDA: `CudaRefillStream`, on a separate
    high-priority stream that waits for the serving stream, never the reverse; CPU: a plain
    copy; ``None`` in metadata-only mode), and committed to the cache's maps only once the copy
    has completed (``event.query()``, `poll`), so a lookup never waits for a refill and never
    sees a half-written row. The ranked candidates are kept on the host as well, so issuing a
    chunk reads no item ids back from the device. Refilled rows enter as most recent; items that
    a demand miss cached meanwhile are skipped at commit and their rows go back to empty. Demand
    misses take empty rows first too (tick 0), so the refill only fills what demand has not.
    """

    def __init__(self, cache: EmbCache, stream: RefillStream | None) -> None:
        self.cache = cache
        self.stream = stream
        self._candidates = torch.empty(0, dtype=torch.int64, device=cache.device)
        self._candidates_host = self._candidates.cpu()
        self._cursor = 0
        self._stale = True
        self._inflight: _RefillChunk | None = None

    def mark_stale(self) -> None:
        """The slab grew: rank the candidates again before the next chunk."""
        self._stale = True

    def _empty_rows(self) -> torch.Tensor:
        """Empty, unreserved rows of the slab, lowest first."""
        c = self.cache
        t = c.slot_tick[: c.rows]
        return ((c.slot_to_item[: c.rows] < 0) & (t != RESERVED_TICK)).nonzero().squeeze(1)

    def plan(self) -> torch.Tensor:
        """The most popular uncached items, as many as there are empty rows, hottest first
        (ties: lower item id first); items never requested are left out."""
        c = self.cache
        num_empty = self._empty_rows().numel()
        self._cursor = 0
        self._stale = False
        if num_empty == 0:
            self._candidates = self._candidates[:0]
            self._candidates_host = self._candidates_host[:0]
            return self._candidates
        score = c.popularity.masked_fill(c.item_to_slot != c.miss_slot, -1.0)
        k = min(num_empty, c.num_items)
        kth = float(torch.topk(score, k, sorted=False).values.min())
        if kth <= 0.0:
            cand = (score > 0).nonzero().squeeze(1)
        else:
            above = (score > kth).nonzero().squeeze(1)
            ties = (score == kth).nonzero().squeeze(1)[: k - above.numel()]
            cand = torch.cat([above, ties])
        order = torch.argsort(-score.index_select(0, cand), stable=True)
        self._candidates = cand.index_select(0, order)
        self._candidates_host = self._candidates.cpu()  # the same tensor on the CPU
        return self._candidates

    @property
    def inflight(self) -> bool:
        return self._inflight is not None

    @property
    def num_inflight_rows(self) -> int:
        return 0 if self._inflight is None else self._inflight.slots.numel()

    def pending(self) -> bool:
        """True while a refill has work: a chunk in flight, a stale plan or candidates left."""
        return (self._inflight is not None or self._stale
                or self._cursor < self._candidates.numel())

    def issue(self, max_rows: int) -> int:
        """Start copying up to ``max_rows`` candidate rows into empty rows; returns the rows
        issued (0 while a chunk is in flight, or when there is nothing to fill)."""
        c = self.cache
        self.poll()
        if self._inflight is not None or max_rows <= 0:
            return 0
        if self._stale:
            self.plan()
        cand = self._candidates
        cur = self._cursor
        if cur >= cand.numel():
            return 0
        hi = cur + max(4 * max_rows, 64)
        window, window_host = cand[cur:hi], self._candidates_host[cur:hi]
        # which candidates are still uncached: one flag each read back; the ids come from the host list
        missing = (c.item_to_slot.index_select(0, window) == c.miss_slot).cpu().nonzero().squeeze(1)
        if missing.numel() > max_rows:
            missing = missing[:max_rows]
            self._cursor = cur + int(missing[-1]) + 1
        else:
            self._cursor = cur + window.numel()
        items_host = window_host.index_select(0, missing)
        empty = self._empty_rows()
        k = min(items_host.numel(), empty.numel())
        if empty.numel() == 0:
            self._cursor = cand.numel()  # nothing left to fill until the slab grows
        if k == 0:
            return 0
        items_host, slots = items_host[:k], empty[:k]
        c.slot_tick.index_fill_(0, slots, RESERVED_TICK)
        self._inflight = self._copy_chunk(items_host.to(c.device), slots, items_host)
        self.poll()
        return k

    def _copy_chunk(self, items: torch.Tensor, slots: torch.Tensor,
                    items_host: torch.Tensor | None = None) -> _RefillChunk:
        """Copy ``items``' rows into the reserved rows ``slots`` through ``stream``
        (``items_host``: the same ids in host memory, read back from ``items`` when not given)."""
        c = self.cache
        nbytes = items.numel() * c.row_bytes
        if not c.payload:
            return _RefillChunk(items, slots, nbytes, None)
        if items_host is None:
            items_host = items.cpu()
        done = self.stream.copy(c.arena.all_rows(), slots, c.host_table, items_host)
        return _RefillChunk(items, slots, nbytes, done)

    def poll(self) -> bool:
        """Commit the chunk in flight if its copy has completed (never waits)."""
        ch = self._inflight
        if ch is None:
            return False
        if ch.event is not None and not ch.event.query():
            return False
        self._inflight = None
        self._commit(ch)
        return True

    def wait(self) -> None:
        """Wait for the chunk in flight and commit it (boundary shrinks and checkpoint swaps)."""
        ch = self._inflight
        if ch is None:
            return
        if ch.event is not None:
            ch.event.synchronize()
        self._inflight = None
        self._commit(ch)

    def _commit(self, ch: _RefillChunk) -> None:
        n_ok = self.cache.admit_refilled(ch.items, ch.slots)
        stats = self.cache.stats
        stats.num_refill_rows += n_ok
        stats.num_refill_discarded += ch.items.numel() - n_ok
        stats.refill_bytes += ch.num_bytes
