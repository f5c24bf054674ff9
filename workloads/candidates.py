"""The candidates a request ranks: one definition for the simulator and the replay.

A retrieval stage hands the ranker its candidates; the traces do not hold them. Request ``i`` of
a stream ranks ``num_candidates[i]`` items read in order from a seeded pool of ``CAND_POOL``
items drawn with replacement by the trace's item popularity (`candidate_pool`), starting where
the previous request's stopped, after the stream's item shifts (a trend's drift, an EMB burst's
hot set; `RequestStream.shift_items`). The simulator's nodes (`simulator.cluster`) rank exactly
these; a replay sends them in the request (``ReplayConfig.explicit_candidates``) so a node agent
ranks the same items instead of drawing its own (`node_agent.engine.CandidateGenerator`).

``plant_next`` (``ReplayConfig.plant_next_item``): each request's last candidate is replaced by the
first new item of its user's next request in the stream, or in the stream sent after it (a looping
replay's next pass; when there is one and it is not a candidate already), as a retrieval stage
with full recall would offer it. Then every returning
user gives the node's online quality signal an observation (`node_agent.model.quality`): whether
the model ranked the item the user went to next within the top-k. The simulator never plants.
"""

from __future__ import annotations

import numpy as np

from .regimes import RequestStream
from .trace import Trace

CAND_POOL = 1 << 20


_POOLS: dict[tuple, np.ndarray] = {}  # the last few pools drawn (a replay asks for one per phase and cycle)


def candidate_pool(trace: Trace, seed: int) -> np.ndarray:
    """``CAND_POOL`` item ids drawn with replacement in proportion to the trace's popularity
    (the same trace and seed: the same pool, drawn once)."""
    key = (id(trace), trace.name, trace.num_items, seed)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _draw_pool(trace, seed)
        if len(_POOLS) >= 4:
            _POOLS.pop(next(iter(_POOLS)))
        _POOLS[key] = pool
    return pool


def _draw_pool(trace: Trace, seed: int) -> np.ndarray:
    pop = trace.item_popularity().astype(np.float64)
    rng = np.random.default_rng([seed, 7])
    cdf = np.cumsum(pop)
    return np.searchsorted(cdf, rng.random(CAND_POOL) * cdf[-1], side="right").clip(0, trace.num_items - 1)


class StreamCandidates:
    """``candidates(i)``: request ``i``'s candidate ids (see the module doc)."""

    def __init__(self, stream: RequestStream, trace: Trace, seed: int, plant_next: bool = False,
                 then: RequestStream | None = None) -> None:
        self.stream = stream
        self.pool = candidate_pool(trace, seed)
        self.offsets = np.zeros(len(stream) + 1, dtype=np.int64)
        np.cumsum(stream.num_candidates.astype(np.int64), out=self.offsets[1:])
        self.next_of = next_request_of_user(stream) if plant_next else None
        # the stream sent after this one (a looping replay's next pass): a user's last request here
        # gets the first new item of that user's first request there
        self.then = then if plant_next else None
        self.first_then = first_request_by_user(then) if self.then is not None else {}

    def __call__(self, i: int) -> np.ndarray:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        cands = self.pool[np.arange(a, b) % CAND_POOL]
        if self.stream.shifts_items:
            cands = self.stream.shift_items(np.full(b - a, i, dtype=np.int64), cands, salt=1)
        nxt = None
        if self.next_of is not None and len(cands):
            if self.next_of[i] >= 0:
                nxt = self.stream.new_items(int(self.next_of[i]))
            elif self.then is not None and (j := self.first_then.get(int(self.stream.user[i]))) is not None:
                nxt = self.then.new_items(j)
        if nxt is not None and len(nxt) and not (cands == nxt[0]).any():
            cands = cands.copy()
            cands[-1] = nxt[0]
        return cands


def first_request_by_user(stream: RequestStream) -> dict[int, int]:
    """Each user of ``stream``: the index of its first request there."""
    users, first = np.unique(np.asarray(stream.user), return_index=True)
    return dict(zip(users.tolist(), first.tolist()))


def next_request_of_user(stream: RequestStream) -> np.ndarray:
    """For each request, the index of its user's next request in ``stream`` (-1: none)."""
    users = np.asarray(stream.user)
    out = np.full(len(users), -1, dtype=np.int64)
    order = np.lexsort((np.arange(len(users)), users))  # by user, then by position
    same = users[order[1:]] == users[order[:-1]]
    out[order[:-1][same]] = order[1:][same]
    return out
