"""The capacity search shared by the simulator (`simulator.table.steady_capacity`) and the fleet
bench (`bench.fleet.find_capacity`): bracket the highest passing rate by doubling or halving,
then bisect. Pure: the caller's ``passes(rate)`` runs (or looks up) the probe; no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CapacitySearch:
    """What `bracket_and_bisect` found.

    ``lo``: the highest rate that passed (``None`` when none did); ``hi``: the lowest rate above
    it that failed (``None`` when none did); ``stop_rate``: where the bracketing stopped (the rate
    that could not be judged, the one past a rate bound, or the next it would have tried when the
    probe budget ran out); ``rates``: every rate asked, in order."""

    lo: float | None
    hi: float | None
    stop_rate: float
    rates: list[float] = field(default_factory=list)


def bracket_and_bisect(passes: Callable[[float], bool | None], start: float, iters: int, *,
                       max_bracket_probes: int | None = None, max_rate: float = math.inf,
                       min_rate: float = 0.0) -> CapacitySearch:
    """Bracket, then bisect, the highest rate for which ``passes(rate)`` is true.

    From ``start`` the rate doubles while it passes (halves while it fails) until the other
    outcome is seen, the rate reaches ``max_rate`` (doubling) or ``min_rate`` (halving), or
    ``max_bracket_probes`` rates have been asked; ``passes`` returning ``None`` (the probe cannot
    judge, e.g. too few requests) stops the bracketing there. When both a pass and a fail are
    known, ``iters`` bisections follow (``None`` counts as a fail). The search is monotone in the
    rate: it assumes a rate above a failing one fails."""
    if not (start > 0 and math.isfinite(start)):
        raise ValueError(f"start must be a positive finite rate, got {start!r}")
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters!r}")
    rates: list[float] = []

    def ask(r: float) -> bool | None:
        rates.append(r)
        return passes(r)

    lo = hi = None
    r = start
    n = 0
    while max_bracket_probes is None or n < max_bracket_probes:
        ok = ask(r)
        n += 1
        if ok is None:
            return CapacitySearch(lo, hi, r, rates)
        if ok:
            lo = r
            if hi is not None or r >= max_rate:
                break
            r *= 2.0
        else:
            hi = r
            if lo is not None or r <= min_rate:
                break
            r /= 2.0
    stop = r
    if lo is not None and hi is not None:
        for _ in range(iters):
            mid = 0.5 * (lo + hi)
            if ask(mid):
                lo = mid
            else:
                hi = mid
    return CapacitySearch(lo, hi, stop, rates)
