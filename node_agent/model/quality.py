"""The online quality signal of the model a node serves: how high it ranked the item each user
requested next.

When user ``u``'s request ranks ``num_candidates`` items and returns the ranked ``items`` (best
first), the ranking is kept; when ``u``'s next request arrives carrying ``new_items`` (the items
the user touched since, in order: what the replayed trace sends), the first of them is the item the
user actually went to next. If the kept ranking holds it at 0-based rank ``r``, the observation is
``1 - r / num_candidates`` (1: ranked first; near 0: ranked last). When the request named its
candidates (``candidates``) and the next item was one of them but not among the returned items,
the model ranked it below the top-k: the observation is 0 (so the window's mean is a graded
hit rate at top-k, and a worse model scores lower). A next item that was not a candidate, or
whose candidacy the node cannot know (it drew the candidates itself and did not return it),
counts as unknown, not as a zero. A replay that plants each user's next item among the
candidates (`workloads.candidates.StreamCandidates`, ``plant_next``: a retrieval stage with full
recall) gives one observation per returning user. A window's quality is the mean of its
observations, None when it has none: a gap, never a zero.

Pure bookkeeping (no clock, no I/O); the node agent's device worker calls it after each batch and
the reporter takes one value per control window (``model_quality`` in the node's reports).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class NextItemQuality:
    """Keeps each user's newest ranking, its first ``max_ranks`` items (LRU over users, at most
    ``max_users``: the least recently served user's ranking is dropped first; the bounds keep the
    memory at ``16 * max_users * max_ranks`` bytes at most) and the window's observations."""

    def __init__(self, max_users: int = 4096, max_ranks: int = 1024) -> None:
        if max_users < 1 or max_ranks < 1:
            raise ValueError(f"max_users and max_ranks must be >= 1, got {max_users}, {max_ranks}")
        self.max_users, self.max_ranks = max_users, max_ranks
        self._ranked: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()
        self._sum = 0.0
        self._count = 0

    def observe(self, user_id: int, new_items: Sequence[int], items: Sequence[int], num_candidates: int,
                candidates: Sequence[int] | None = None) -> float | None:
        """One served request: score the user's previous ranking on ``new_items[0]`` (returns that
        observation, or None when unknown), then keep this request's ranking (and, when the
        request named them, its first ``max_ranks`` candidates) for the next one."""
        q = None
        prev = self._ranked.pop(int(user_id), None)
        if prev is not None and len(new_items):
            ranked, n, cands = prev
            nxt = int(new_items[0])
            hit = np.flatnonzero(ranked == nxt)
            if len(hit) and n > 0:
                q = 1.0 - int(hit[0]) / n
            elif cands is not None and bool((cands == nxt).any()):
                q = 0.0  # a candidate the model ranked below the returned top-k
            if q is not None:
                self._sum += q
                self._count += 1
        if len(items) and num_candidates > 0:
            kept = None if candidates is None or len(candidates) == 0 else np.asarray(
                candidates[:self.max_ranks], dtype=np.int64)
            self._ranked[int(user_id)] = (np.asarray(items[:self.max_ranks], dtype=np.int64), int(num_candidates), kept)
            while len(self._ranked) > self.max_users:
                self._ranked.popitem(last=False)
        return q

    def take_window(self) -> tuple[float | None, int]:
        """(the window's mean quality or None, its number of observations); starts a new window."""
        out = (self._sum / self._count if self._count else None, self._count)
        self._sum, self._count = 0.0, 0
        return out

    def reset(self) -> None:
        """Forget every kept ranking (the model changed: its rankings are not the new model's)."""
        self._ranked.clear()

    def __len__(self) -> int:
        return len(self._ranked)
