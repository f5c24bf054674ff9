"""Ghost lists: the misses a larger cache would have served (the marginal utility of memory).

Each cache keeps what recently left it; a miss of something that left recently enough counts, per
probe, as a hit of a cache that much larger (LRU's stack property, as in ARC's ghost lists and
utility-based cache partitioning). Nothing here changes a cache decision.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

_OUT_OF_REACH = 1 << 62  # a distance no probe reaches


class EmbGhostList:
    """The EMB slab's ghost list (``probe_rows``: the extra rows of each probe, ascending).

    Every row that leaves the slab (an eviction, or an invalidation when the slab shrinks) stamps
    its item with a running count of such departures (``seq``). A missed item that left ``d``
    departures ago (``d = 1``: the last one) is among the ``d`` rows just past the slab's end in
    LRU order, so a slab at least ``d`` rows larger would have held it; for each probe of ``r``
    rows `hits` counts the call's distinct missed ids with ``d <= r``: row copies that much more
    memory would have saved. A shrink stamps its rows highest first, so the rows just past the new
    end are the nearest ghosts (a slab shrunk less would still hold them). The counts are
    estimates: items that left twice within reach count twice as distance (an undercount), and
    rows stamped in the same call tie in LRU order (batches of several ids can overcount a
    little); for one id per call they are lower bounds of a larger slab's extra hits. It costs
    five tensor ops on calls with misses and two per eviction; the stamps live on the device.
    """

    def __init__(self, probe_rows: tuple[int, ...], num_items: int, device: torch.device) -> None:
        i64 = torch.int64
        self.rows = probe_rows
        self.device = device
        self._limits = torch.tensor(probe_rows, dtype=i64, device=device)
        self._departures = 0
        # seq[item] = departures counted when the item left the slab (0: never)
        self._seq = (torch.zeros(num_items, dtype=i64, device=device) if probe_rows
                     else torch.empty(0, dtype=i64, device=device))

    def hits(self, uniq: torch.Tensor) -> list[int] | None:
        """Per probe, the distinct missed ids (``uniq``) that left the slab within that many
        departures; None when the list is off or nothing has left yet."""
        if not self.rows or not self._departures:
            return None
        seq = self._seq.index_select(0, uniq)
        dist = torch.where(seq > 0, self._departures + 1 - seq, _OUT_OF_REACH)  # never left: out of reach
        return (dist.unsqueeze(1) <= self._limits).sum(0).tolist()

    def record_departures(self, items: torch.Tensor) -> None:
        """Stamp items leaving the slab (in order)."""
        if not self.rows:
            return
        k = items.numel()
        self._seq.index_copy_(0, items, torch.arange(self._departures + 1, self._departures + k + 1,
                                                     dtype=torch.int64, device=self.device))
        self._departures += k


class KVGhostList:
    """The KV pool's ghost list (``probe_pages``: the extra pages of each probe, ascending).

    Users evicted for space (LRU evictions, also those forced by a boundary move) are remembered
    with their pages, their tokens and the pages evicted up to theirs. On a lookup miss of such a
    user, everything in the pool now and everything evicted after it was used more recently, so
    (LRU's stack property) a pool would still hold it if it had ``used + evicted since + its
    pages`` pages; when that is at most a probe's pages more than the pool has, the miss is a
    *ghost hit* of that probe, and its cached tokens then the recomputation that much more memory
    would have saved. Evicted users that came back are counted as still in the way (an
    undercount), but whole-user LRU over users whose K/V grows is not a stack algorithm (a larger
    pool can evict a different user), so ghost hits are estimates that can also exceed a larger
    pool's extra hits (by up to ~12% on simulator-like random sequences).
    """

    def __init__(self, probe_pages: tuple[int, ...], num_pages: int) -> None:
        self.pages = probe_pages
        self.num_pages = num_pages
        self._evicted_pages = 0  # pages freed by evictions so far
        # user -> (pages evicted up to it, its pages, its tokens), oldest first
        self._ghosts: OrderedDict[int, tuple[int, int, int]] = OrderedDict()

    def add(self, user_id: int, pages: int, tokens: int) -> None:
        """``user_id`` was evicted for space, holding ``pages`` pages and ``tokens`` tokens."""
        ghosts = self._ghosts
        ghosts.pop(user_id, None)
        self._evicted_pages += pages
        ghosts[user_id] = (self._evicted_pages, pages, tokens)
        floor = self._evicted_pages - self.pages[-1] - self.num_pages
        while ghosts:  # drop the ghosts no pool of this arena plus the probe could hold (oldest first)
            uid = next(iter(ghosts))
            if ghosts[uid][0] >= floor:
                break
            del ghosts[uid]

    def probe(self, user_id: int, num_used: int, num_kv_pages: int) -> tuple[list[bool], int] | None:
        """A lookup miss of ``user_id`` in a pool of ``num_kv_pages`` pages, ``num_used`` of them
        in use: per probe whether a pool that much larger would have hit, and the user's tokens
        then (None: not a ghost within reach). The ghost is forgotten either way."""
        if user_id not in self._ghosts:
            return None
        mark, pages, tokens = self._ghosts.pop(user_id)
        # pages beyond the pool's size that LRU would need to still hold the ghost
        d = num_used + (self._evicted_pages - mark) + pages - num_kv_pages
        if d > self.pages[-1]:
            return None
        return [d <= g for g in self.pages], tokens
