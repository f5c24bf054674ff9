"""The emulated device: the node agent's control path real, the device's time modelled.

``racer node-agent --emulate PROFILE [--time-scale K]`` runs the agent as it is (HTTP server,
admission and batching, the EMB slab and KV pool bookkeeping: ids, LRU order, pages, boundary
moves, the throttled refill, the allocator, the reporter and its directives) with the arena in
metadata-only mode, and charges the device's time as waits from one cost profile
(`common.device_model.CostProfile`, the object the simulator charges): no model runs.

Per pass of a micro-batch (`Engine.serve_batch` serves a batch in passes, one request per user
each), in modelled time:

1. ``batch_overhead_us`` (plus ``request_overhead_us`` per request of the batch in its first
   pass) and ``emb_hit_us_per_row`` per EMB hit;
2. the pass's distinct EMB misses, ``emb_transfer_us_per_row`` each, over the **host link**
   (`EmulatedLink`): a transfer starts when the link is free, so it waits behind a refill chunk
   in flight;
3. compute, ``max(max_i c_i, sum_i c_i / batch_speedup)`` over the pass's requests, ``c_i`` from
   `common.device_model.request_compute_us` (the prefill of the tokens not cached, ranking).

A pass starts on the device's own timeline: when the device is free and the pass's last request
has arrived (``free_at_s``), not when the host's worker thread got round to it, so a thread
descheduled on a busy host catches up instead of adding its delay to the modelled time; the
worker then waits until the pass's modelled end, so answers leave when the device would give
them (a host too slow to keep up shows as lateness the clients see, not inside the figures the
node reports).

The background refill (`MemoryManager.step`, throttled by its token bucket as on a device) puts
each chunk on the same link, ``emb_transfer_us_per_row`` per row, without blocking the worker: a
demand miss issued meanwhile waits for the chunk, as a copy engine serves one copy after another.
So refill and demand compete for one link budget, and the throttle decides how much.

**Time**: the agent's clock is a `ScaledClock` in modelled seconds: ``K`` (``time_scale``)
stretches every modelled duration, so one modelled second takes ``K`` wall seconds and a small
machine keeps up with a fleet of emulated devices. Every figure the agent gives (latencies,
queue times, control intervals, rates) is in modelled time, and every output says so
(`EmulationInfo`).

**Answers**: the candidates are ranked by the trace's item popularity, not by the model (an
emulated device computes nothing); each answer says ``"device": {"mode": "emulated", ...}``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from common.config import ranged, validate
from common.device_model import CostProfile, get_profile, request_compute_us

#: wall seconds the waits spin for at their end (sleeping is coarse; spinning is exact)
_SPIN_S = 5e-4


class ScaledClock:
    """Modelled seconds: ``origin + (perf_counter() - origin) / time_scale``.

    ``wait_until(t)`` blocks until the modelled clock reads ``t`` (sleeping through all but the
    last half millisecond of wall time, then spinning). ``to_wall_offset_s`` maps a modelled time
    to wall seconds since its origin (for timestamps a person reads)."""

    def __init__(self, time_scale: float = 1.0, wall: Callable[[], float] = time.perf_counter) -> None:
        if not time_scale >= 1e-3 or time_scale != time_scale or time_scale == float("inf"):
            raise ValueError(f"time_scale must be a finite number >= 0.001, got {time_scale!r}")
        self.time_scale = float(time_scale)
        self._wall = wall
        self.origin = wall()

    def __call__(self) -> float:
        return self.origin + (self._wall() - self.origin) / self.time_scale

    def wait_until(self, deadline_s: float) -> None:
        k = self.time_scale
        while True:
            left_wall = (deadline_s - self()) * k
            if left_wall <= 0:
                return
            if left_wall > 2 * _SPIN_S:
                time.sleep(left_wall - _SPIN_S)

    def wall_elapsed_s(self, modelled_s: float) -> float:
        """Wall seconds between the origin and modelled time ``modelled_s``."""
        return (modelled_s - self.origin) * self.time_scale


class EmulatedLink:
    """The host-to-device link of an emulated device: one copy at a time, first come first served.

    ``transfer(now_s, us, kind)`` books a copy of ``us`` modelled µs that starts when the link is
    free (``free_at_s``) and returns ``(start_s, end_s)``. Demand copies and refill chunks book the
    same link; ``waited_us`` counts, per kind, how long copies waited for the link, ``busy_us``
    how long they held it. Pure bookkeeping: the caller waits (demand) or not (refill)."""

    KINDS = ("demand", "refill")

    def __init__(self) -> None:
        self.free_at_s = -float("inf")
        self.busy_us = {k: 0.0 for k in self.KINDS}
        self.waited_us = {k: 0.0 for k in self.KINDS}
        self.num_transfers = {k: 0 for k in self.KINDS}

    def transfer(self, now_s: float, us: float, kind: str) -> tuple[float, float]:
        if kind not in self.KINDS:
            raise ValueError(f"link transfer kind must be one of {self.KINDS}, got {kind!r}")
        if us <= 0:
            return now_s, now_s
        start = max(now_s, self.free_at_s)
        end = start + us * 1e-6
        self.free_at_s = end
        self.busy_us[kind] += us
        self.waited_us[kind] += (start - now_s) * 1e6
        self.num_transfers[kind] += 1
        return start, end

    def to_dict(self) -> dict:
        return {"busy_us": {k: round(v, 1) for k, v in self.busy_us.items()},
                "waited_us": {k: round(v, 1) for k, v in self.waited_us.items()},
                "num_transfers": dict(self.num_transfers)}


@dataclass(frozen=True)
class EmulationConfig:
    """``--emulate PROFILE --time-scale K``: which profile charges the device's time, and how much
    every modelled duration is stretched in wall time."""

    profile: str = "a100-hstu"
    time_scale: float = ranged(1.0, lo=1e-3, doc="wall seconds per modelled second")

    def __post_init__(self) -> None:
        validate(self)

    def resolve(self) -> CostProfile:
        return get_profile(self.profile)


@dataclass(frozen=True)
class EmulationInfo:
    """What an emulated agent says about itself in every output (answers, reports, metrics)."""

    mode: str  # "emulated"
    profile: str
    time_scale: float
    calibrated: bool
    time: str = "modelled"

    @property
    def label(self) -> str:
        cal = "calibrated" if self.calibrated else "uncalibrated"
        return f"emulated {self.profile} ({cal}, modelled time, x{self.time_scale:g})"

    def to_dict(self) -> dict:
        return asdict(self) | {"label": self.label}


class EmulatedDevice:
    """The device's time for one engine: the profile, the link, and the wait on the agent's clock.

    ``wait_until`` blocks until the clock reads a modelled time (a `ScaledClock`'s own, or a
    virtual clock's in tests)."""

    def __init__(self, profile: CostProfile, time_scale: float = 1.0, *,
                 wait_until: Callable[[float], None]) -> None:
        self.profile = profile.validate()
        self.time_scale = float(time_scale)
        self.wait_until = wait_until
        self.link = EmulatedLink()
        self.busy_us = 0.0  # modelled device time charged (overheads, hits, compute, demand copies)
        self.free_at_s = -float("inf")  # the device's timeline: when its last pass ends (modelled s)
        self.info = EmulationInfo("emulated", profile.name, self.time_scale, bool(profile.calibrated))

    def compute_us(self, cached: list[int], history_len: list[int], num_new: list[int],
                   num_candidates: list[int]) -> np.ndarray:
        """Each request's modelled compute (µs): prefill of its tokens not cached, then ranking."""
        return request_compute_us(self.profile, np.asarray(cached, dtype=np.int64),
                                  np.asarray(history_len, dtype=np.int64), np.asarray(num_new, dtype=np.int64),
                                  np.asarray(num_candidates, dtype=np.int64))

    def pass_us(self, compute_us: np.ndarray, num_requests_charged: int) -> tuple[float, float]:
        """(fixed overhead µs, compute µs) of one pass: the batch overhead plus the per-request
        overhead of ``num_requests_charged`` requests, and the overlapped compute."""
        p = self.profile
        fixed = p.batch_overhead_us + num_requests_charged * p.request_overhead_us
        comp = 0.0 if len(compute_us) == 0 else max(float(compute_us.max()), float(compute_us.sum()) / p.batch_speedup)
        return fixed, comp

    def demand_copy(self, now_s: float, num_unique_misses: int) -> tuple[float, float]:
        """Book the pass's demand misses on the link; returns (start_s, end_s)."""
        return self.link.transfer(now_s, num_unique_misses * self.profile.emb_transfer_us_per_row, "demand")

    def refill_copy(self, now_s: float, num_rows: int) -> tuple[float, float]:
        """Book a refill chunk of ``num_rows`` rows on the link (the worker does not wait)."""
        return self.link.transfer(now_s, num_rows * self.profile.emb_transfer_us_per_row, "refill")

    def to_dict(self) -> dict:
        return self.info.to_dict() | {"link": self.link.to_dict(), "busy_us": round(self.busy_us, 1),
                                      "profile_costs": {k: v for k, v in self.profile.to_json().items()
                                                        if k != "sources"}}


def emulated_refill(profile: CostProfile, link_fraction: float = 0.1, batch_window_ms: float = 10.0):
    """The background refill's throttle on a device of ``profile``: ``link_fraction`` of its link
    (bytes per modelled second), in chunks of at most one batch window's budget and half of one
    0.1-s throttle window's, whole rows. The simulator's nodes use the same (`simulator.cluster.
    memory_config`), so an emulated agent and a simulated node refill alike."""
    from .memory import RefillConfig

    if not 0 < link_fraction <= 1:
        raise ValueError(f"the refill's link fraction must be in (0, 1], got {link_fraction!r}")
    limit = link_fraction * profile.link_bytes_per_s
    window = 0.1
    chunk = int(min(0.5 * limit * window, limit * batch_window_ms / 1e3))
    chunk = max(profile.emb_row_bytes, chunk - chunk % profile.emb_row_bytes)
    if chunk > 0.5 * limit * window:
        limit = 2 * chunk / window
    return RefillConfig(limit_bytes_per_s=limit, window_s=window, chunk_bytes=chunk)
