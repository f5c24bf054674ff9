"""The KV pool's free pages, handed out highest first (`FreePages`)."""

from __future__ import annotations

import heapq

import numpy as np

FREE = -1  # page_owner of a free KV page
EMB = -2  # page_owner of a page in the EMB slab


class FreePages:
    """The free pages of ``[kv_start, num_pages)``, popped highest first.

    Pages next to the EMB boundary are then the last to fill, so growing the slab usually takes
    free pages (metadata only). The pages are a *bottom run* ``[kv_start, run_end)`` (all free,
    next to the boundary) plus a lazy max-heap of the free pages above it (stale entries are
    skipped when popped; freed pages are appended and the heap rebuilt only when popped one by
    one). Pages given back by the slab extend the run and pages taken by the slab shorten it, both
    in O(1), so moving the boundary over free pages costs a few slice operations whatever their
    number.

    ``owner`` is the pool's ``page_owner`` array (``FREE``, ``EMB`` or a user id), shared, not
    copied: a heap entry is valid while its page is still ``FREE``. The pool keeps the counts and
    the boundary ``kv_start`` and passes it in.
    """

    def __init__(self, owner: np.ndarray) -> None:
        self.owner = owner
        self.num_pages = len(owner)
        # the run [kv_start, run_end) is free and not in the heap; every other free page is in the
        # max-heap ``_heap`` (negated ids; stale entries are skipped)
        self.run_end = self.num_pages
        self._heap: list[int] = []
        self._heap_dirty = False  # entries appended since the last heapify

    def pop(self, kv_start: int) -> int:
        """The highest free page: from the heap (pages >= run_end), else the run's top."""
        owner = self.owner
        heap = self._heap
        if self._heap_dirty:
            heapq.heapify(heap)
            self._heap_dirty = False
        while heap:
            p = -heapq.heappop(heap)
            if p >= self.run_end and owner[p] == FREE:  # entries below run_end are stale
                return p
        if self.run_end > kv_start:
            self.run_end -= 1
            return self.run_end
        raise RuntimeError("kv pool: no free page while num_free > 0")

    def pop_many(self, k: int, kv_start: int) -> list[int]:
        """The ``k`` highest free pages, highest first: the same pages, in the same order, as
        ``k`` calls of `pop` (for more than a few pages, one scan of the pages above the run
        instead of ``k`` heap pops, after which the heap is rebuilt without stale entries)."""
        if k <= 4:
            return [self.pop(kv_start) for _ in range(k)]
        hi = np.flatnonzero(self.owner[self.run_end:] == FREE) + self.run_end
        take = min(k, len(hi))
        out = hi[len(hi) - take:][::-1].tolist()
        # the heap becomes exactly the free pages above the run that were not taken: negated
        # and in descending page order it is sorted, hence already a heap
        self._heap = (-hi[: len(hi) - take][::-1]).tolist()
        self._heap_dirty = False
        rest = k - len(out)
        if rest:
            if self.run_end - rest < kv_start:
                raise RuntimeError("kv pool: no free page while num_free > 0")
            out.extend(range(self.run_end - 1, self.run_end - rest - 1, -1))
            self.run_end -= rest
        return out

    def push(self, pages: list[int]) -> None:
        """Pages just marked ``FREE`` in ``owner``."""
        if len(pages) > 8 or self._heap_dirty:  # heapified when next popped one by one; a scan of
            # the pages above the run (`pop_many`) rebuilds it without a heapify at all
            self._heap.extend([-p for p in pages])
            self._heap_dirty = True
        else:
            for p in pages:
                heapq.heappush(self._heap, -p)
        if len(self._heap) > 2 * self.num_pages + 64:  # drop stale entries
            hi = np.flatnonzero(self.owner[self.run_end:] == FREE) + self.run_end
            self._heap = [-int(p) for p in hi]
            self._heap_dirty = True

    def cut_run(self, to_page: int) -> None:
        """The slab took the pages below ``to_page``: the run's pages there are gone."""
        self.run_end = max(self.run_end, to_page)

    def check_invariants(self, kv_start: int) -> list[str]:
        out: list[str] = []
        owner = self.owner
        if not kv_start <= self.run_end <= self.num_pages:
            out.append(f"kv: run_end {self.run_end} outside [{kv_start}, {self.num_pages}]")
        elif not np.all(owner[kv_start: self.run_end] == FREE):
            out.append("kv: a page of the bottom free run is not free")
        heap_pages = {-h for h in self._heap}
        above = np.flatnonzero(owner[self.run_end:] == FREE) + self.run_end
        missing = set(above.tolist()) - heap_pages
        if missing:
            out.append(f"kv: free pages missing from the free heap: {sorted(missing)[:5]}")
        return out
