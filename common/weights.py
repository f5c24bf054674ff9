"""Router weights derived from profiled miss costs (see docs/router.md, "Weights"): a node's
`CostProfile` as it registers it, the control plane validates and stores it, and the router
(`gateway.router`) scores with it.

The scheduler's score is ``w_kv * h_kv + w_emb * h_emb + w_ld * (1 - l) + eps``. The weights are
not tuning knobs: they convert each hit fraction into the microseconds it saves *for this
request on this node*, so the score of a node is the expected time saved by sending the request
there (up to one constant shared by every node, which cannot change the choice):

- ``w_kv(n) = history_len * kv_recompute_us_per_token(n)``: a KV hit of fraction ``h_kv`` spares
  recomputing ``h_kv * history_len`` tokens of the user's history;
- ``w_emb(n) = num_items * emb_transfer_us_per_row(n)``: an EMB hit of fraction ``h_emb`` spares
  ``h_emb * num_items`` host-to-device row transfers;
- ``w_ld(n) = queue_capacity(n) * service_time_us(n)``: the queueing delay of a full queue, so
  ``w_ld * (1 - l)`` is the wait avoided relative to a full queue on that node (``l`` is the queue
  depth over ``queue_capacity``, and each queued request ahead delays a newcomer by one
  ``service_time_us``).

The two hit weights scale with the request (history length, number of looked-up items), so
`RouterWeights` keeps the per-node *rates* and `RouterWeights.for_request` multiplies them out.
With nodes of different ``w_ld`` the per-node constant ``w_ld(n)`` would bias the choice toward
nodes with long queues allowed; ``load_offset_us(n) = max_m w_ld(m) - w_ld(n)`` removes it, so
``w_ld(n) * (1 - l(n)) + load_offset_us(n) = max_m w_ld(m) - wait(n)`` for every node (zero offset
on a homogeneous cluster, as in the paper's 32 x A100 setup).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.config import ranged, validate


# Physical ranges of a cost profile: a figure outside them is a broken profiler or a hostile
# client, never a device. Generous on purpose (a CPU recomputes a token in ~100 µs, a GPU in ~2 µs;
# a 16 KiB row crosses PCIe in ~1.4 µs), so that no real node is refused.
MAX_KV_RECOMPUTE_US_PER_TOKEN = 1e5  # 0.1 s per history token
MAX_EMB_TRANSFER_US_PER_ROW = 1e5  # 0.1 s per embedding row
MAX_SERVICE_TIME_US = 6e7  # one minute per request
MAX_QUEUE_CAPACITY = 1_000_000
PROFILE_LIMITS = {"kv_recompute_us_per_token": MAX_KV_RECOMPUTE_US_PER_TOKEN,
                  "emb_transfer_us_per_row": MAX_EMB_TRANSFER_US_PER_ROW, "service_time_us": MAX_SERVICE_TIME_US}


@dataclass(frozen=True)
class CostProfile:
    """One node's profiled costs.

    - ``kv_recompute_us_per_token``: time to recompute one history token's K/V on a KV miss;
    - ``emb_transfer_us_per_row``: time to bring one embedding row host -> device on an EMB miss;
    - ``service_time_us``: mean time between request completions at saturation (1 / throughput),
      so ``q`` queued requests delay a newcomer by ``q * service_time_us``;
    - ``queue_capacity``: the queue depth at which the node counts as fully loaded (``l = 1``).

    Costs may be zero (that term then carries no weight); they may not be negative, infinite or
    beyond their physical range (`PROFILE_LIMITS`, ``queue_capacity <= MAX_QUEUE_CAPACITY``), so
    every weight derived from a profile is a finite number of microseconds.
    """

    kv_recompute_us_per_token: float = ranged(lo=0, hi=MAX_KV_RECOMPUTE_US_PER_TOKEN)
    emb_transfer_us_per_row: float = ranged(lo=0, hi=MAX_EMB_TRANSFER_US_PER_ROW)
    service_time_us: float = ranged(lo=0, hi=MAX_SERVICE_TIME_US)
    queue_capacity: int = ranged(64, lo=1, hi=MAX_QUEUE_CAPACITY, integer=True)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True, eq=False)
class RouterWeights:
    """Per-node weight rates (float64 arrays of length ``num_nodes``; treat them as read-only).

    A new profile produces a new `RouterWeights` (never an in-place change), so a decision that
    keeps a reference to the weights it used can explain itself later.
    """

    kv_us_per_token: np.ndarray  # w_kv(n) = history_len * kv_us_per_token[n]
    emb_us_per_row: np.ndarray  # w_emb(n) = num_items * emb_us_per_row[n]
    ld_us: np.ndarray  # w_ld(n) = queue_capacity[n] * service_time_us[n]
    load_offset_us: np.ndarray  # max(ld_us) - ld_us[n]
    service_time_us: np.ndarray
    queue_capacity: np.ndarray  # float64, >= 1

    @property
    def num_nodes(self) -> int:
        return len(self.ld_us)

    @property
    def ld_ref_us(self) -> float:
        """``max_n w_ld(n)``: the constant every node's load term plus offset is measured from."""
        return float(self.ld_us.max())

    def for_request(self, history_len: int, num_items: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(w_kv, w_emb, w_ld)`` per node, in µs, for a request of this shape."""
        if history_len < 0 or num_items < 0:
            raise ValueError(f"history_len and num_items must be >= 0, got {history_len}, {num_items}")
        return history_len * self.kv_us_per_token, num_items * self.emb_us_per_row, self.ld_us.copy()


def derive_weights(profiles: Sequence[CostProfile]) -> RouterWeights:
    """The weight rates of a cluster whose node ``i`` has cost profile ``profiles[i]``."""
    profiles = list(profiles)
    if not profiles:
        raise ValueError("derive_weights needs at least one node's cost profile")
    for i, p in enumerate(profiles):
        if not isinstance(p, CostProfile):
            raise TypeError(f"profile {i} must be a CostProfile, got {type(p).__name__}")
    kv = np.array([p.kv_recompute_us_per_token for p in profiles], dtype=np.float64)
    emb = np.array([p.emb_transfer_us_per_row for p in profiles], dtype=np.float64)
    svc = np.array([p.service_time_us for p in profiles], dtype=np.float64)
    cap = np.array([p.queue_capacity for p in profiles], dtype=np.float64)
    ld = cap * svc
    return RouterWeights(
        kv_us_per_token=kv,
        emb_us_per_row=emb,
        ld_us=ld,
        load_offset_us=ld.max() - ld,
        service_time_us=svc,
        queue_capacity=cap,
    )


def expected_saving_us(profile: CostProfile, *, cached_len: int, hot_items: int, queue_depth: float,
                       history_len: int) -> float:
    """Time saved (µs) on a node of ``profile``, relative to a full miss behind a full queue there.

    The reference implementation of the derivation, one node at a time, for tests and docs:
    ``min(cached_len, history_len) * kv + hot_items * emb + (capacity - min(q, capacity)) * svc``.
    """
    q = min(max(queue_depth, 0.0), float(profile.queue_capacity))
    return (min(cached_len, history_len) * profile.kv_recompute_us_per_token
            + hot_items * profile.emb_transfer_us_per_row
            + (profile.queue_capacity - q) * profile.service_time_us)
