"""The per-node control core, shared by the node agent and the cluster simulator.

One node's control loop is: requests are served in batches; every control interval the
interval's figures are closed into a `WindowStats` (the policy's input, `node_agent.features`);
the allocator decides a split; the split becomes the memory manager's target. The node agent
(`node_agent.agent.NodeAgent`, a real device and a wall clock) and the simulator
(`simulator.cluster.ClusterSim`, a cost model and a virtual clock) both run exactly this code;
they only feed it (their clocks and I/O):

    acc = WindowAccumulator(start_s=0.0)
    acc.add_arrivals(n, users)                       # requests accepted by the node, their users
    acc.add_batch(start_s, end_s, latency_s, users,  # one served micro-batch (end_s may lie in the
                  history_len, kv_hit_tokens,        # future in the simulator: it counts once the
                  emb_rows, emb_hits)                # window closes after it)
    acc.add_refill_bytes(n)                          # the memory manager's background refill
    stats = acc.close_window(now_s, manager, costs, slo_ms)   # -> WindowStats, starts the next window
    effect = control_step(allocator, stats, manager, now_s)   # -> ControlEffect

Every feature of `WindowStats` is defined once, here (`WindowAccumulator.close_window`); the
definitions, with their units, are in `node_agent.features.WindowStats`'s docstring. The split is
applied by `apply_target` (the half-page rule: a target within half a page of the manager's
current target is not re-planned), which both the agent and the simulator call.

`tests/test_control_parity.py` runs one sequence of served requests and manager states through
the agent's path and the simulator's path and checks identical `WindowStats` and decisions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from .features import WindowStats, marginal_utilities_us, top_share


def cost_at(costs: Mapping | float, length: float) -> float:
    """A per-token cost from a profile mapping ``{length: µs}`` at the nearest profiled length
    (ties: the shorter); a plain number is returned as is."""
    if not isinstance(costs, Mapping):
        return float(costs)
    if not costs:
        return 0.0
    pts = sorted((float(k), float(v)) for k, v in costs.items())
    return min(pts, key=lambda p: abs(p[0] - length))[1]


@dataclass(frozen=True)
class MissCosts:
    """The node's profiled miss costs: ``kv_recompute_us_per_token`` (a number, or a profile
    mapping ``{history length: µs per token}`` read at the window's ``history_len_p50``) and
    ``emb_transfer_us_per_row``."""

    kv_recompute_us_per_token: float | Mapping = 0.0
    emb_transfer_us_per_row: float = 0.0

    @classmethod
    def from_dict(cls, d: Mapping | None) -> "MissCosts":
        d = d or {}
        return cls(d.get("kv_recompute_us_per_token", 0.0), float(d.get("emb_transfer_us_per_row", 0.0)))


class _Batch:
    __slots__ = ("start_s", "end_s", "latency_s", "users", "history_len", "kv_hit_tokens", "emb_rows", "emb_hits")

    def __init__(self, start_s, end_s, latency_s, users, history_len, kv_hit_tokens, emb_rows, emb_hits):
        self.start_s = start_s
        self.end_s = end_s
        self.latency_s = latency_s
        self.users = users
        self.history_len = history_len
        self.kv_hit_tokens = kv_hit_tokens
        self.emb_rows = emb_rows
        self.emb_hits = emb_hits


class WindowAccumulator:
    """What one node served since the last `close_window`; see the module docstring.

    A batch counts in the window its service ends in (``end_s <= now_s`` at the close); its busy
    time counts in every window it overlaps, for the part of ``[start_s, end_s]`` inside the
    window. In the node agent a batch is added after it ran; in the simulator when it is
    scheduled (possibly to run after the window closes): the rule is the same."""

    __slots__ = ("start_s", "arrivals", "refill_bytes", "_pending", "_arrival_users")

    def __init__(self, start_s: float = 0.0) -> None:
        self.start_s = float(start_s)
        self.arrivals = 0
        self.refill_bytes = 0
        self._pending: list[_Batch] = []
        self._arrival_users: list[np.ndarray] = []

    def add_arrivals(self, n: int, users=None) -> None:
        """``n`` requests arrived (accepted by the node) in the current window; ``users``, their
        ``n`` user ids, if known (the window's ``arrival_hot_user_ratio``; without them it is 0)."""
        self.arrivals += int(n)
        if users is not None and len(users):
            self._arrival_users.append(np.asarray(users))

    def add_refill_bytes(self, n: int) -> None:
        """Bytes the memory manager's background refill copied host -> device."""
        self.refill_bytes += int(n)

    def add_batch(self, start_s: float, end_s: float, latency_s, users, history_len, kv_hit_tokens,
                  emb_rows: int, emb_hits: int) -> None:
        """One served micro-batch: the device was busy over ``[start_s, end_s]``; per request its
        latency (finish - arrival, seconds), user, history length and history tokens whose K/V came
        from the KV cache; for the batch the embedding rows looked up and the EMB cache's hits."""
        self._pending.append(_Batch(float(start_s), float(end_s), np.asarray(latency_s, dtype=np.float64),
                                    np.asarray(users), np.asarray(history_len, dtype=np.int64),
                                    np.asarray(kv_hit_tokens, dtype=np.int64), int(emb_rows), int(emb_hits)))

    def close_window(self, now_s: float, manager, costs: MissCosts, slo_ms: float) -> WindowStats:
        """The `WindowStats` of ``[start_s, now_s]`` (definitions: `node_agent.features.WindowStats`)
        and the start of the next window at ``now_s``. ``manager`` is the node's
        `node_agent.memory.MemoryManager` (its split, arena size and ghost counters, which this
        drains)."""
        ws = self.start_s
        interval = max(now_s - ws, 1e-6)
        busy = 0.0
        done: list[_Batch] = []
        keep: list[_Batch] = []
        for b in self._pending:
            lo = b.start_s if b.start_s > ws else ws
            hi = b.end_s if b.end_s < now_s else now_s
            if hi > lo:
                busy += hi - lo
            (done if b.end_s <= now_s else keep).append(b)
        self._pending = keep
        n = sum(len(b.users) for b in done)
        if n:
            users = np.concatenate([b.users for b in done])
            hist = np.concatenate([b.history_len for b in done])
            lat = np.concatenate([b.latency_s for b in done])
            hot = top_share(users, 0.01)
            h50, h99 = float(np.percentile(hist, 50)), float(np.percentile(hist, 99))
            p99_ms = float(np.percentile(lat, 99)) * 1e3
            kv_tokens = int(hist.sum())
            kv_hits = int(sum(int(b.kv_hit_tokens.sum()) for b in done))
        else:
            hot = h50 = h99 = p99_ms = 0.0
            kv_tokens = kv_hits = 0
        emb_rows = sum(b.emb_rows for b in done)
        emb_hits = sum(b.emb_hits for b in done)
        kv_cost = cost_at(costs.kv_recompute_us_per_token, h50)
        emb_cost = float(costs.emb_transfer_us_per_row)
        emb_ghost, kv_ghost = manager.take_ghost_counts()
        emb_marginal, kv_marginal = marginal_utilities_us(manager.config.ghost_probe_shares, emb_ghost, kv_ghost,
                                                          n, emb_cost, kv_cost)
        mcfg = manager.config
        stats = WindowStats(
            interval_s=interval, num_requests=n, arrival_rate_rps=self.arrivals / interval, hot_user_ratio=hot,
            history_len_p50=h50, history_len_p99=max(h50, h99),
            emb_lookups_per_request=emb_rows / n if n else 0.0,
            emb_hit_rate=emb_hits / emb_rows if emb_rows else 0.0,
            kv_hit_rate=kv_hits / kv_tokens if kv_tokens else 0.0,
            kv_recompute_us_per_token=kv_cost, emb_transfer_us_per_row=emb_cost,
            emb_share=manager.emb_share, load=min(1.0, busy / interval), p99_ms=p99_ms, slo_ms=float(slo_ms),
            refill_bytes=float(self.refill_bytes), arena_bytes=float(mcfg.num_pages * mcfg.page_bytes),
            emb_marginal_us=emb_marginal, kv_marginal_us=kv_marginal,
            table_bytes=float(mcfg.num_items * mcfg.row_bytes), kv_bytes_per_token=mcfg.page_bytes / mcfg.kv.page_tokens,
            arrival_hot_user_ratio=top_share(np.concatenate(self._arrival_users), 0.01) if self._arrival_users else 0.0)
        self.start_s = float(now_s)
        self.arrivals = 0
        self._arrival_users = []
        self.refill_bytes = 0
        return stats


# ------------------------------------------------------------------------------------- the step


def current_target(manager) -> float:
    """The split the manager is heading to: the plan's target while the boundary moves, else the
    split in effect."""
    return manager.plan.target_emb_share if manager.boundary_moving else manager.emb_share


def apply_target(manager, emb_share: float, now_s: float):
    """The half-page rule: plan a move to ``emb_share`` unless it is within half a page of the
    manager's current target (then nothing changes: re-planning would only restart the same move).
    Returns the `BoundaryPlan`, or None when nothing was planned."""
    if abs(emb_share - current_target(manager)) * manager.config.num_pages < 0.5:
        return None
    return manager.set_target(emb_share, now_s)


class NodeDecision(Protocol):
    """One node's decision for the coming interval: the target ``emb_share``, the ``source`` that
    set it and the ``reason`` in words; ``to_dict()`` is its JSON-able record."""

    emb_share: float
    source: str

    @property
    def reason(self) -> str: ...

    def to_dict(self) -> dict: ...


@runtime_checkable
class NodeAllocator(Protocol):
    """What the control core drives on one node, every control interval: ``observe(stats)`` (the
    outcome of its previous decision), then ``decide(stats, now_s)`` -> a `NodeDecision`.
    `node_agent.allocator.SmartAllocator` is one; the simulator's baselines (a static split, a
    replayed schedule, the miss-time heuristic: `simulator.allocators`) are others, so every
    allocator, RACER's and its comparisons alike, runs through `decide_step` / `control_step`."""

    def observe(self, outcome: WindowStats) -> object: ...

    def decide(self, stats: WindowStats, now_s: float) -> NodeDecision: ...


def decide_step(allocator: NodeAllocator, stats: WindowStats, now_s: float) -> NodeDecision:
    """The allocator's half of a control step: ``observe(stats)`` (the outcome of its previous
    decision), then ``decide(stats, now_s)``; returns the decision."""
    allocator.observe(stats)
    return allocator.decide(stats, now_s)


@dataclass(frozen=True)
class ControlEffect:
    """What one control step did.

    - ``now_s``, ``stats``: the closed window's `WindowStats`;
    - ``decision``: the allocator's `node_agent.allocator.AllocatorDecision` (None without an
      allocator: the split stays as configured); its explicit fields say which layer set the
      value (``source`` in base, residual, recovery, override, guard) and why;
    - ``applied``: whether a new boundary plan was made (`apply_target`'s half-page rule);
      ``plan_reason``: the plan's own reason when one was made;
    - ``target_emb_share``: the manager's target after the step.
    """

    now_s: float
    stats: WindowStats
    decision: object | None
    applied: bool
    target_emb_share: float
    plan_reason: str | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {"now_s": self.now_s, "window": asdict(self.stats),
                "decision": None if self.decision is None else self.decision.to_dict(),
                "applied": self.applied, "target_emb_share": self.target_emb_share,
                "boundary_plan": self.plan_reason}


def control_step(allocator: NodeAllocator | None, stats: WindowStats, manager, now_s: float) -> ControlEffect:
    """One control step on a closed window: `decide_step`, then `apply_target` (nothing but the
    window when ``allocator`` is None)."""
    if allocator is None:
        return ControlEffect(now_s, stats, None, False, current_target(manager))
    read = getattr(allocator, "read_curves", None)  # the caches' miss-ratio curves, for allocators that use them
    if read is not None:
        read(manager.miss_curves() if hasattr(manager, "miss_curves") else None)
    d = decide_step(allocator, stats, now_s)
    plan = apply_target(manager, d.emb_share, now_s)
    return ControlEffect(now_s, stats, d, plan is not None, current_target(manager),
                         None if plan is None else plan.reason)


def stats_differences(a: WindowStats, b: WindowStats, rel_tol: float = 0.0) -> list[str]:
    """The fields where ``a`` and ``b`` differ (exactly, or beyond ``rel_tol``), as lines: the
    parity check between two producers of `WindowStats`."""
    from dataclasses import fields

    out = []
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x == y or (rel_tol and math.isclose(x, y, rel_tol=rel_tol, abs_tol=1e-12)):
            continue
        out.append(f"{f.name}: {x!r} != {y!r}")
    return out
