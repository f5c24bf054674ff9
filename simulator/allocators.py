"""Allocators for the simulator: who picks each node's ``emb_share`` every control interval.

Every node runs one `node_agent.control.NodeAllocator` (``observe(stats)``, then
``decide(stats, now_s)`` -> a decision with ``emb_share``, ``source`` and ``reason``), driven by
the node agent's own control step, `node_agent.control.control_step` (`decide_step`, then
`apply_target`'s half-page rule), which `simulator.cluster.ClusterSim.control` runs on every
node. An `Allocator` is the cluster's set of them: ``reset(num_nodes, initial_share)`` makes one
per node (`make_node`); ``control(node, stats, manager, now_s)`` is one node's control step,
``decide(node, stats, now_s)`` its decision alone (the target)
for drivers that apply targets themselves; ``last_decisions`` and ``decisions_by_source`` keep
what they decided (`note`).

- ``static:<share>``: a fixed split (source ``static``);
- ``schedule``: a per-window share list (the oracle's replay, see `simulator.table`; source
  ``schedule``);
- ``heuristic``: a hit-rate heuristic: compare the time lost to EMB misses with the time lost to KV
  recompute in the last interval and move ``step`` toward the costlier side (within bounds;
  source ``heuristic``);
- ``smart`` (`simulator.smart.SmartAllocatorSim`): RACER's SmartAllocator runtime
  (`node_agent.allocator`), one per node, with its own sources (base ... guard).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from node_agent.control import ControlEffect, NodeAllocator, control_step, decide_step
from node_agent.features import WindowStats

BASELINE_SOURCES = ("static", "schedule", "heuristic")


@dataclass(frozen=True, slots=True)
class BaselineDecision:
    """A baseline's decision: the target, its source (`BASELINE_SOURCES`) and why."""

    now_s: float
    emb_share: float
    source: str
    reason: str

    def to_dict(self) -> dict:
        return {"now_s": self.now_s, "emb_share": self.emb_share, "source": self.source, "reason": self.reason}


class _Baseline:
    """A baseline node allocator learns nothing from outcomes: ``observe`` does nothing."""

    def observe(self, outcome: WindowStats) -> None:
        return None


class StaticNode(_Baseline):
    def __init__(self, share: float):
        self.share = share
        self._reason = f"static split {share:.4f}"

    def decide(self, stats: WindowStats, now_s: float) -> BaselineDecision:
        return BaselineDecision(now_s, self.share, "static", self._reason)


class ScheduleNode(_Baseline):
    def __init__(self, schedule: "ScheduleAllocator"):
        self.schedule = schedule

    def decide(self, stats: WindowStats, now_s: float) -> BaselineDecision:
        sch = self.schedule
        w = sch.window_at(now_s)
        share = sch.shares[w]
        return BaselineDecision(now_s, share, "schedule", f"{sch.name}: window {w}'s share {share:.4f}")


class HeuristicNode(_Baseline):
    """Move ``step`` toward the cache whose misses cost more time in the last interval."""

    def __init__(self, share: float, step: float, deadband: float, lo: float, hi: float):
        self.share, self.step, self.deadband, self.lo, self.hi = share, step, deadband, lo, hi

    def decide(self, stats: WindowStats, now_s: float) -> BaselineDecision:
        if stats.num_requests == 0:
            return BaselineDecision(now_s, self.share, "heuristic", "no requests in the interval: split held")
        emb = (1 - stats.emb_hit_rate) * stats.emb_lookups_per_request * stats.emb_transfer_us_per_row
        kv = (1 - stats.kv_hit_rate) * stats.history_len_p50 * stats.kv_recompute_us_per_token
        s = self.share
        if emb > kv * (1 + self.deadband):
            s += self.step
            move = f"EMB-ward {self.step:+g}"
        elif kv > emb * (1 + self.deadband):
            s -= self.step
            move = f"KV-ward {-self.step:+g}"
        else:
            move = f"held (within the {self.deadband:g} deadband)"
        s = min(self.hi, max(self.lo, s))
        self.share = s
        return BaselineDecision(now_s, s, "heuristic", f"miss time per request: EMB {emb:.1f} us, KV {kv:.1f} us: "
                                                       f"{move} to {s:.4f}")


class Allocator:
    """The cluster's allocators: one `NodeAllocator` per node (`make_node`), each driven by
    `decide_step` as the node agent drives its own."""

    name = "allocator"

    def __init__(self) -> None:
        self.nodes: list[NodeAllocator] = []
        self.last_decisions: list = []
        self.decisions_by_source: Counter = Counter()

    def make_node(self, node: int, initial_share: float) -> NodeAllocator:
        raise NotImplementedError

    def reset(self, num_nodes: int, initial_share: float) -> None:
        """Called once before a run: a fresh allocator per node."""
        self.nodes = [self.make_node(i, initial_share) for i in range(num_nodes)]
        self.last_decisions = [None] * num_nodes
        self.decisions_by_source = Counter()

    def initial_share(self) -> float | None:
        """The split to start from (applied at once, as configured at start-up); None: the
        simulator's ``initial_emb_share``."""
        return None

    def decide(self, node: int, stats: WindowStats, now_s: float) -> float:
        """Node ``node``'s decision on its closed window (`decide_step`): its target."""
        d = decide_step(self.nodes[node], stats, now_s)
        self.note(node, d)
        return d.emb_share

    def control(self, node: int, stats: WindowStats, manager, now_s: float) -> ControlEffect:
        """Node ``node``'s control step on its closed window, as the node agent runs it
        (`control_step`: decide, then apply the target to ``manager`` by the half-page rule)."""
        effect = control_step(self.nodes[node], stats, manager, now_s)
        self.note(node, effect.decision)
        return effect

    def note(self, node: int, decision) -> None:
        """Keep node ``node``'s last decision and count its source."""
        self.last_decisions[node] = decision
        self.decisions_by_source[decision.source] += 1


class StaticAllocator(Allocator):
    def __init__(self, share: float):
        super().__init__()
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"static share must be in [0, 1], got {share}")
        self.share = share
        self.name = f"static:{share:.2f}"

    def make_node(self, node: int, initial_share: float) -> StaticNode:
        return StaticNode(self.share)

    def initial_share(self) -> float | None:
        return self.share


class ScheduleAllocator(Allocator):
    """Replays a share per control window (window ``w`` covers ``[w * interval, (w+1) * interval)``)."""

    def __init__(self, shares: list[float], interval_s: float, name: str = "oracle"):
        super().__init__()
        if not shares:
            raise ValueError("a schedule needs at least one share")
        self.shares = [float(s) for s in shares]
        self.interval_s = interval_s
        self.name = name

    def make_node(self, node: int, initial_share: float) -> ScheduleNode:
        return ScheduleNode(self)

    def initial_share(self) -> float | None:
        return self.shares[0]

    def window_at(self, now_s: float) -> int:
        w = int(now_s / self.interval_s + 1e-9)
        return min(max(w, 0), len(self.shares) - 1)


class HeuristicAllocator(Allocator):
    """Move toward the cache whose misses cost more time in the last interval.

    EMB miss time per request: ``(1 - emb_hit_rate) * emb_lookups_per_request *
    emb_transfer_us_per_row``; KV miss time per request: ``(1 - kv_hit_rate) * history_len_p50 *
    kv_recompute_us_per_token``. If one exceeds the other by more than ``deadband`` (relative),
    the share moves ``step`` toward it, within ``[lo, hi]``.
    """

    name = "heuristic"

    def __init__(self, step: float = 0.05, deadband: float = 0.1, lo: float = 0.05, hi: float = 0.95):
        super().__init__()
        self.step, self.deadband, self.lo, self.hi = step, deadband, lo, hi

    def make_node(self, node: int, initial_share: float) -> HeuristicNode:
        return HeuristicNode(initial_share, self.step, self.deadband, self.lo, self.hi)


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
