"""The candidates a request ranks: one definition for the simulator and the replay.

A retrieval stage hands the ranker its candidates; the traces do not hold them. Request ``i`` of
a stream ranks ``num_candidates[i]`` items read in order from a seeded pool of ``CAND_POOL``
items drawn with replacement by the trace's item popularity (`candidate_pool`), starting where
the previous request's stopped, after the stream's item shifts (a trend's drift, an EMB burst's
hot set; `RequestStream.shift_items`). The simulator's nodes (`simulator.cluster`) rank exactly
these; a replay sends them in the request (``ReplayConfig.explicit_candidates``) so a node agent
ranks the same items instead of drawing its own (`node_agent.engine.CandidateGenerator`).
"""

from __future__ import annotations

import numpy as np

from .regimes import RequestStream
from .trace import Trace

CAND_POOL = 1 << 20


def candidate_pool(trace: Trace, seed: int) -> np.ndarray:
    """``CAND_POOL`` item ids drawn with replacement in proportion to the trace's popularity."""
    pop = trace.item_popularity().astype(np.float64)
    rng = np.random.default_rng([seed, 7])
    cdf = np.cumsum(pop)
    return np.searchsorted(cdf, rng.random(CAND_POOL) * cdf[-1], side="right").clip(0, trace.num_items - 1)


class StreamCandidates:
    """``candidates(i)``: request ``i``'s candidate ids (see the module doc)."""

    def __init__(self, stream: RequestStream, trace: Trace, seed: int) -> None:
        self.stream = stream
        self.pool = candidate_pool(trace, seed)
        self.offsets = np.zeros(len(stream) + 1, dtype=np.int64)
        np.cumsum(stream.num_candidates.astype(np.int64), out=self.offsets[1:])

    def __call__(self, i: int) -> np.ndarray:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        cands = self.pool[np.arange(a, b) % CAND_POOL]
        if not self.stream.shifts_items:
            return cands
        return self.stream.shift_items(np.full(b - a, i, dtype=np.int64), cands, salt=1)
