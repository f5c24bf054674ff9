"""The simulator's cost model: how long a node takes to serve a micro-batch.

For a request with history length ``L``, ``c`` history tokens whose K/V the node holds, ``n``
new items and ``N`` candidates (``a = token_us``, ``b = attn_us_per_ctx``):

- prefill of the ``T = L + n - c`` tokens at positions ``c .. L+n-1``:
  ``sum_p (a + b p) = a T + b T (c + L + n - 1) / 2`` (a KV miss has ``c = 0``: the whole
  history is recomputed);
- ranking: ``N (cand_us + b (L + n))`` (each candidate attends to the whole sequence);
- compute of the request ``= prefill + ranking``.

A micro-batch of requests ``i`` whose embedding lookup (one call for the batch) had ``M`` distinct
misses and ``H`` hits takes

    batch_overhead_us + R request_overhead_us + M emb_transfer_us_per_row + H emb_hit_us_per_row
      + max(max_i compute_i, sum_i compute_i / batch_speedup)

Transfers are serial on the host link; compute overlaps up to ``batch_speedup`` requests'
worth (a GPU batching small prefills) but a batch never runs faster than its largest request.

A batch that holds several requests of one user is served as the node agent serves it
(`node_agent.engine`): in successive passes, the k-th request of each user in pass k (the second
reads the K/V the first appended). The first pass is the formula above over the batch's first
requests of each user (with every request's overhead and the batch's one embedding lookup); each
later pass adds ``batch_overhead_us + max(max_i compute_i, sum_i compute_i / batch_speedup)``
over its own requests (`extra_passes_us`).
"""

from __future__ import annotations

import numpy as np

from .profiles import CostProfile


def request_compute_us(prof: CostProfile, cached: np.ndarray, history_len: np.ndarray, num_new: np.ndarray,
                       num_candidates: np.ndarray) -> np.ndarray:
    """Compute time (µs) of each request; arguments are equal-length integer arrays."""
    c = cached.astype(np.float64)
    L = history_len.astype(np.float64)
    n = num_new.astype(np.float64)
    t = L + n - c
    prefill = prof.token_us * t + prof.attn_us_per_ctx * t * (c + L + n - 1) / 2
    rank = num_candidates * (prof.cand_us + prof.attn_us_per_ctx * (L + n))
    return prefill + rank


def batch_time_us(prof: CostProfile, compute_us: np.ndarray, num_unique_misses: int, num_hits: int) -> float:
    """Duration (µs) of a micro-batch; see the module docstring."""
    if len(compute_us) == 0:
        return 0.0
    return batch_duration_us(prof, len(compute_us), float(compute_us.max()), float(compute_us.sum()),
                             num_unique_misses, num_hits)


def batch_duration_us(prof: CostProfile, num_requests: int, max_compute_us: float, sum_compute_us: float,
                      num_unique_misses: int, num_hits: int) -> float:
    """`batch_time_us` from the batch's largest and total request compute."""
    comp = max(max_compute_us, sum_compute_us / prof.batch_speedup)
    return (prof.batch_overhead_us + num_requests * prof.request_overhead_us
            + num_unique_misses * prof.emb_transfer_us_per_row + num_hits * prof.emb_hit_us_per_row + comp)


def user_passes(batch_of: np.ndarray, users: np.ndarray) -> np.ndarray:
    """The pass each request is served in: how many earlier requests (in the given order) of its
    user its batch holds. ``batch_of``/``users``: per request, its batch and its user."""
    n = len(users)
    out = np.zeros(n, dtype=np.int64)
    if n < 2:
        return out
    order = np.lexsort((np.arange(n), users, batch_of))  # by batch, then user, then arrival
    b, u = batch_of[order], users[order]
    first = np.flatnonzero(np.r_[True, (b[1:] != b[:-1]) | (u[1:] != u[:-1])])
    out[order] = np.arange(n) - np.repeat(first, np.diff(np.r_[first, n]))
    return out


def extra_passes_us(prof: CostProfile, compute_us: np.ndarray, passes: np.ndarray) -> float:
    """What a batch's passes after its first add (its requests with ``passes >= 1``): each pass
    ``batch_overhead_us + max(max compute, sum compute / batch_speedup)`` over its own requests."""
    total = 0.0
    for k in range(1, int(passes.max()) + 1 if len(passes) else 1):  # every pass up to the last has a request
        c = compute_us[passes == k]
        total += prof.batch_overhead_us + max(float(c.max()), float(c.sum()) / prof.batch_speedup)
    return total
