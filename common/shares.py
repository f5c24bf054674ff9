"""How concentrated a window's ids are: the one `top_share` that the node agent's window
statistics (the hot-user ratio a policy sees) and the trace generator's regime statistics both use."""

from __future__ import annotations

import numpy as np


def top_share(ids: np.ndarray, fraction: float = 0.01) -> float:
    """Share of ``ids`` taken by the top ``fraction`` of its distinct values (at least one): the
    hot-user ratio of a window's users, the top-1% items' share of its item lookups."""
    if len(ids) == 0:
        return 0.0
    counts = np.unique(ids, return_counts=True)[1]
    k = max(1, int(np.ceil(fraction * len(counts))))
    top = np.partition(counts, len(counts) - k)[len(counts) - k:]
    return float(top.sum()) / len(ids)
