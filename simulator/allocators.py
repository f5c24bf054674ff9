"""Allocators for the simulator: who picks each node's ``emb_share`` every control interval.

One interface: ``decide(node, stats, now_s) -> float`` (the target ``emb_share`` for ``node``
from that node's `node_agent.features.WindowStats` of the interval just ended), plus ``reset()``
before a run. The simulator calls it once per node per control interval and hands the target to
the node's Memory Manager, exactly as the node agent does with the SmartAllocator.

- ``static:<share>``: a fixed split;
- ``schedule``: a per-window share list (the oracle's replay, see `simulator.table`);
- ``heuristic``: a hit-rate heuristic: compare the time lost to EMB misses with the time lost to KV
  recompute in the last interval and move ``step`` toward the costlier side (within bounds);
- ``smart`` (`SmartAllocatorAdapter`): RACER's SmartAllocator runtime (node_agent/allocator.py),
  one instance per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from node_agent.features import WindowStats


class Allocator:
    name = "allocator"

    def reset(self, num_nodes: int, initial_share: float) -> None:
        """Called once before a run."""

    def initial_share(self) -> float | None:
        """The split to start from (applied at once, as configured at start-up); None: the
        simulator's ``initial_emb_share``."""
        return None

    def decide(self, node: int, stats: WindowStats, now_s: float) -> float:
        raise NotImplementedError


@dataclass
class StaticAllocator(Allocator):
    share: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"static share must be in [0, 1], got {self.share}")
        self.name = f"static:{self.share:.2f}"

    def initial_share(self) -> float | None:
        return self.share

    def decide(self, node: int, stats: WindowStats, now_s: float) -> float:
        return self.share


class ScheduleAllocator(Allocator):
    """Replays a share per control window (window ``w`` covers ``[w * interval, (w+1) * interval)``)."""

    def __init__(self, shares: list[float], interval_s: float, name: str = "oracle"):
        if not shares:
            raise ValueError("a schedule needs at least one share")
        self.shares = [float(s) for s in shares]
        self.interval_s = interval_s
        self.name = name

    def initial_share(self) -> float | None:
        return self.shares[0]

    def share_at(self, now_s: float) -> float:
        w = int(now_s / self.interval_s + 1e-9)
        return self.shares[min(max(w, 0), len(self.shares) - 1)]

    def decide(self, node: int, stats: WindowStats, now_s: float) -> float:
        return self.share_at(now_s)


class HeuristicAllocator(Allocator):
    """Move toward the cache whose misses cost more time in the last interval.

    EMB miss time per request: ``(1 - emb_hit_rate) * emb_lookups_per_request *
    emb_transfer_us_per_row``; KV miss time per request: ``(1 - kv_hit_rate) * history_len_p50 *
    kv_recompute_us_per_token``. If one exceeds the other by more than ``deadband`` (relative),
    the share moves ``step`` toward it, within ``[lo, hi]``.
    """

    name = "heuristic"

    def __init__(self, step: float = 0.05, deadband: float = 0.1, lo: float = 0.05, hi: float = 0.95):
        self.step, self.deadband, self.lo, self.hi = step, deadband, lo, hi
        self._share: list[float] = []

    def reset(self, num_nodes: int, initial_share: float) -> None:
        self._share = [initial_share] * num_nodes

    def decide(self, node: int, stats: WindowStats, now_s: float) -> float:
        if stats.num_requests == 0:
            return self._share[node]
        emb = (1 - stats.emb_hit_rate) * stats.emb_lookups_per_request * stats.emb_transfer_us_per_row
        kv = (1 - stats.kv_hit_rate) * stats.history_len_p50 * stats.kv_recompute_us_per_token
        s = self._share[node]
        if emb > kv * (1 + self.deadband):
            s += self.step
        elif kv > emb * (1 + self.deadband):
            s -= self.step
        s = min(self.hi, max(self.lo, s))
        self._share[node] = s
        return s


def make_allocator(spec: str, **kwargs) -> Allocator:
    """``static:0.30``, ``heuristic`` (schedules and SmartAllocators are built by their callers)."""
    if spec.startswith("static:"):
        try:
            share = float(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"bad static allocator {spec!r}: want static:<share in [0, 1]>") from None
        return StaticAllocator(share)
    if spec == "heuristic":
        return HeuristicAllocator(**kwargs)
    raise ValueError(f"unknown allocator {spec!r}: use static:<share>, heuristic, best_static or oracle")


GHOST_SUFFIX = "@ghost"  # a SmartAllocator spec whose residual adapter reads the caches' ghost lists


POLICY_SPECS = ("racer", "ppo", "ppo+residual", "ppo+recovery")  # the SmartAllocator rows (simulator.smart)


def needs_ghost_lists(spec: str) -> bool:
    """True for the allocator specs that need the simulator's ghost lists on: every SmartAllocator
    row (`POLICY_SPECS`, with or without ``@ghost``): its base policy reads the caches' marginal
    utilities among its features (feature schema 3), the operating-point tuner of the residual
    layer reads them too, and the node agent runs with the lists on by default."""
    return spec.endswith(GHOST_SUFFIX) or spec in POLICY_SPECS
