"""The curve layer: the two caches' miss-ratio curves (`node_agent.memory.MissCurves`) turned into an
expected time per request at every share, and a guard on the layers' proposal that sees the whole
trade-off (utility-based cache partitioning's lookahead, Qureshi and Patt 2006; cliffs, Talus and
Cliffhanger).

Expected time at share ``s`` (`expected_costs`), from the node's window and its profiled miss
costs:

- KV recompute: ``tokens * (1 - kv_hit(s)) * kv_recompute_us_per_token`` per request (``tokens``:
  the curve's mean history tokens per lookup);
- EMB transfer: ``rows(s) * (1 - emb_hit(s)) * emb_transfer_us_per_row``, where ``rows(s)`` is
  the window's embedding rows per request plus the history items that KV misses add at ``s``
  over the split in force (a recomputed token looks its item up);
- queueing from the node's load: the device's time per request ``S(s) = S_now + miss(s) -
  miss(now)`` (``S_now``: the window's busy time per request) at utilisation
  ``rho(s) = offered * S(s) / S_now``, ``T(s) = S(s) / (1 - rho)`` (M/M/1) below ``rho_max``.
  ``offered`` is the busy fraction ``load``, except on a saturated node (``load >= rho_max``),
  where the busy fraction is clipped at 1 and hides how far the node is overloaded: there it is
  ``arrival_rate * S_now`` (the work that arrived over the time the node had) when that is more.
  At and above ``rho_max`` the queue no longer settles, it grows by ``rho - 1`` seconds of work a
  second, so every share that serves faster shrinks a backlog that every later request waits
  behind: ``T`` continues past ``rho_max`` along its tangent there, ``T(s) = S(s) / (1 - rho_max)
  * (1 + (rho - rho_max) / (1 - rho_max))``, instead of stopping at the cap, which made every
  share of an overloaded node look the same up to its service time (``CurveConfig.saturation``,
  on by default; off: the cap);
- the tail (``CurveConfig.tail``): a light load's P99 is the service time of the longest
  histories, whose K/V need a larger pool than the mean's. The KV curve of the tail's lookups
  alone (``kv_tail_hit_rate``: histories in the top tenth, mean ``kv_tail_tokens``) gives what a
  tail request recomputes beyond the mean one, ``X(s) = max(tail_tokens * (1 - kv_tail_hit(s)) -
  tokens * (1 - kv_hit(s)), 0) * kv_recompute_us_per_token`` (a tail request waits as the mean
  one does), and the layer's cost is ``C(s) = T(s) + X(s) - min X``: what the tail adds where the
  split decides it (where the tail's curve is flat, ``C`` is ``T`` and the layer decides as it
  does without it). Under a busy load ``T`` dominates, under a light one the tail's term. ``T``
  below means ``C`` where the tail is on.

The layer (`curve_layer`) compares ``T`` at the proposal with ``T`` at the curve's minimum over the
guard range and at the split in force:

- ``to_minimum``: the minimum saves at least ``move_gain`` of the proposal's ``T`` (on a busy
  node, busy fraction at least ``busy_load``: ``busy_move_gain``, lower): the proposal becomes the
  minimum's share (the guards' step limit still paces the move); it stays there while the saving
  is at least ``hold_gain`` (hysteresis). Under a busy load the queueing term is most of ``T`` and
  a queue's P99 moves with its mean wait, so a smaller saving of ``T`` is already a P99 saving;
  under a light one the P99 is the longest histories' service time, which ``T`` resolves less
  well, and the base policy keeps the valley unless the curve sees a large saving;
- ``jump``: ``to_minimum`` where the minimum lies KV-ward of the split in force and saves at least
  ``jump_gain`` of the split in force's ``T`` (a cliff the node stands above): the guards'
  step-down limit is waived for this decision, so the split reaches the minimum at once. A
  shrink of the EMB slab is metadata-only (its pages go to the KV pool); a growth stays paced,
  its new rows need a refill. Every interval above a cliff builds a backlog that the tail keeps.
  On a saturated node with ``saturation``, the jump is also taken where the capped cost (``rho``
  stopped at ``rho_max``) sees that saving: the tangent's growth dwarfs the tail's term there,
  and the thresholds were set on the capped cost (the minimum is then taken even under
  ``move_gain``). With ``first_jump`` (on by default) the layer's first decision on evidence
  jumps to a KV-ward minimum that ``to_minimum`` would move to, whatever its saving over the
  split in force: that split is the configured one, with no curve behind it (a restored split
  counts as chosen on evidence), and a node started above a cliff otherwise pays one paced
  interval more there (a busy trend whose first decision saved 49% of the split in force, under
  ``jump_gain``: 78.5 against 54.0 ms);
- ``refuse_step``: the proposal's ``T`` exceeds the split in force's by ``cliff_gain`` or more (a
  step over a cliff): the proposal becomes the split in force;
- ``flat``: the split the layer last chose (``anchor``; at first the split in force; with
  ``flat_holds_split`` the split the guards let through after it, unless a burst or an override
  was in force) is within ``flat_gain`` of the curve's minimum (the valley is flat: no share
  saves that much): the
  proposal becomes that split, a dead band that keeps a noisy gradient from walking the split
  across a valley where it does not matter. It holds the layer's own choice, not the split in
  force, so a burst's KV-ward cap (the recovery layer, after this one) is undone when the burst
  ends instead of ratcheting the split down;
- otherwise the proposal passes (``pass``), as it does with too little evidence (``no_curve``:
  curves off, or fewer followed references than ``min_emb_refs`` / ``min_kv_lookups``).

Its trace carries the curve it used: ``curve``, the expected time per request at each grid share
as text (``"0.05:812.3 0.10:790.1 ..."``, µs), which the dashboard draws.
"""

from __future__ import annotations

import numpy as np

from common.contract import curve_text
from node_agent.allocator.config import CurveConfig, GuardConfig
from node_agent.allocator.trace import LayerTrace

CURVE_ACTIONS = ("pass", "no_curve", "to_minimum", "jump", "refuse_step", "flat")


def saturated(stats, rho_max: float) -> bool:
    """Whether the node was saturated in the window: its busy fraction at ``rho_max`` or more."""
    return stats.load >= rho_max


def _service(curves, stats):
    """``(shares, S, S_now, kv_miss)``: the device's time per request at each share (µs), the
    window's, and the KV tokens a request misses at each share; None without requests or busy
    time in the window."""
    n = stats.num_requests
    if n <= 0 or stats.load <= 0.0:
        return None
    s_now = stats.load * stats.interval_s * 1e6 / n
    shares = np.asarray(curves.shares, dtype=np.float64)
    e_hit = np.asarray(curves.emb_hit_rate, dtype=np.float64)
    k_hit = np.asarray(curves.kv_hit_rate, dtype=np.float64)
    tokens = float(curves.kv_tokens_per_lookup)
    kv_us, emb_us = stats.kv_recompute_us_per_token, stats.emb_transfer_us_per_row
    e_now, k_now = np.interp(stats.emb_share, shares, e_hit), np.interp(stats.emb_share, shares, k_hit)
    kv_miss = tokens * (1.0 - k_hit)
    kv_miss_now = tokens * (1.0 - k_now)
    rows = np.maximum(stats.emb_lookups_per_request + kv_miss - kv_miss_now, 0.0)
    miss = kv_miss * kv_us + rows * (1.0 - e_hit) * emb_us
    miss_now = kv_miss_now * kv_us + stats.emb_lookups_per_request * (1.0 - e_now) * emb_us
    return shares, np.maximum(s_now + miss - miss_now, 0.05 * s_now), s_now, kv_miss


def _offered(stats, s_now: float, rho_max: float) -> float:
    """The offered load: the busy fraction, or on a saturated node the arrivals' work when more."""
    if saturated(stats, rho_max):
        return max(stats.load, stats.arrival_rate_rps * s_now * 1e-6)
    return stats.load


def expected_costs(curves, stats, rho_max: float = 0.95, tail: bool = True,
                   saturation: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
    """``(shares, C)``: the expected cost (µs) at each of ``curves.shares``, the time per request
    ``T`` plus, with ``tail``, the tail's extra recompute (see the module docstring), or None
    without requests or busy time in the window. ``saturation``: the offered load and the tangent
    past ``rho_max`` (off: ``rho`` capped at ``rho_max``)."""
    m = _service(curves, stats)
    return None if m is None else _priced(m, curves, stats, rho_max, tail, saturation)


def _priced(m, curves, stats, rho_max: float, tail: bool, saturation: bool) -> tuple[np.ndarray, np.ndarray]:
    """`expected_costs` from `_service`'s ``m``: the queueing term (and the tail's) on its service times."""
    shares, service, s_now, kv_miss = m
    kv_us = stats.kv_recompute_us_per_token
    tokens = float(curves.kv_tokens_per_lookup)
    if saturation:
        rho = _offered(stats, s_now, rho_max) * service / s_now
        under = rho < rho_max
        cost = np.where(under, service / (1.0 - np.where(under, rho, 0.0)),
                        service / (1.0 - rho_max) * (1.0 + (rho - rho_max) / (1.0 - rho_max)))
    else:
        rho = np.minimum(stats.load * service / s_now, rho_max)
        cost = service / (1.0 - rho)
    if tail and curves.kv_tail_hit_rate is not None and curves.kv_tail_tokens > tokens:
        # a request of the tail waits as the mean one does but recomputes its own history's misses
        t_hit = np.asarray(curves.kv_tail_hit_rate, dtype=np.float64)
        extra = np.maximum(curves.kv_tail_tokens * (1.0 - t_hit) - kv_miss, 0.0) * kv_us
        cost = cost + (extra - extra.min())
    return shares, cost


class CurveGuard:
    """The curve layer's state: whether it holds the curve's minimum (hysteresis), and the split
    its dead band holds (``anchor``: the layer's own last output, so a cap a later layer put on
    the split, a burst's or an override's, is not held after it ends; with
    ``CurveConfig.flat_holds_split`` the decision's split when neither a burst nor an override
    was in force, set by `SmartAllocator.decide`), whether it has decided on evidence yet
    (``evidenced``; a restored split counts) and whether its last decision was the first one's jump
    (``jumped_first``, which the decision's note reads)."""

    def __init__(self, config: CurveConfig | None = None) -> None:
        self.config = config or CurveConfig()
        self.holding = False
        self.anchor: float | None = None
        self.evidenced = False
        self.jumped_first = False
        self.num_actions = {a: 0 for a in CURVE_ACTIONS}

    def reset(self) -> None:
        self.holding = False
        self.anchor = None
        self.evidenced = False
        self.jumped_first = False

    def state(self) -> dict:
        return {"enabled": self.config.enabled, "holding_minimum": self.holding, "num_actions": dict(self.num_actions)}


class CostCurve:
    """The expected time per request at each grid share, as the curve layer's trace keeps it: the
    arrays, rendered as text (`common.contract.curve_text`: ``"0.05:812.3 0.10:790.1 ..."``, µs) only
    when the record is read (`LayerTrace.to_dict`), so a decision does not pay for formatting it."""

    __slots__ = ("shares", "cost")

    def __init__(self, shares, cost) -> None:
        self.shares, self.cost = shares, cost

    def __str__(self) -> str:
        return curve_text(self.shares.tolist(), self.cost.tolist())

    def __len__(self) -> int:
        return len(self.shares)


def curve_layer(guard_state: CurveGuard, curves, stats, proposal: float, prev: float,
                guard: GuardConfig) -> tuple[float, LayerTrace]:
    """The curve layer (see the module docstring). Detail (`trace.DETAIL_FIELDS["curve"]`):
    ``action``, ``min_share`` and ``cost_min_us`` (the curve's minimum over the guard range),
    ``cost_proposal_us`` and ``cost_prev_us`` (``T`` at the proposal in and at the split in
    force), ``gain`` (the minimum's saving over the proposal's ``T``), ``emb_refs`` /
    ``kv_lookups`` (the evidence), ``kv_refused``, ``proposal_in``, ``curve`` and ``taken_back`` (the
    part of the operating point's step a hold took back, filled in by `SmartAllocator.decide`)."""
    c = guard_state.config
    nan = float("nan")
    m = None
    if curves is not None and curves.emb_followed >= c.min_emb_refs and curves.kv_followed >= c.min_kv_lookups:
        m = _service(curves, stats)
    if m is None:
        guard_state.holding = False
        guard_state.anchor = proposal
        guard_state.num_actions["no_curve"] += 1
        ev = (nan, nan, nan) if curves is None else (curves.emb_followed, curves.kv_followed, curves.kv_refused)
        return proposal, LayerTrace("curve", proposal, False,
                                    ("no_curve", nan, nan, nan, nan, nan, *ev, proposal, "", 0.0))
    shares, cost = _priced(m, curves, stats, c.rho_max, c.tail, c.saturation)
    inside = (shares >= guard.min_emb_share - 1e-9) & (shares <= guard.max_emb_share + 1e-9)
    idx = np.flatnonzero(inside)
    j = int(idx[np.argmin(cost[idx])])
    s_min, t_min = float(shares[j]), float(cost[j])
    p_in = min(max(proposal, guard.min_emb_share), guard.max_emb_share)
    t_p = float(np.interp(p_in, shares, cost))
    t_prev = float(np.interp(prev, shares, cost))
    gain = (t_p - t_min) / t_p if t_p > 0 else 0.0
    out, action = proposal, "pass"
    drains = False  # on a saturated node: the jump the capped cost would make (its thresholds were set on it)
    if s_min < prev and c.saturation and saturated(stats, c.rho_max):
        _, capped = _priced(m, curves, stats, c.rho_max, c.tail, False)
        c_prev = float(np.interp(prev, shares, capped))
        drains = c_prev > 0 and c_prev - float(capped[j]) >= c.jump_gain * c_prev
    first, guard_state.evidenced = not guard_state.evidenced, True
    guard_state.jumped_first = False
    move = c.busy_move_gain if stats.load >= c.busy_load else c.move_gain
    if gain >= move or (guard_state.holding and gain >= min(c.hold_gain, move)) or drains:
        out, action = s_min, "to_minimum"
        if drains or (s_min < prev and t_prev > 0 and (t_prev - t_min) >= c.jump_gain * t_prev):
            action = "jump"
        elif first and c.first_jump and s_min < prev and t_prev > 0:
            action, guard_state.jumped_first = "jump", True
    elif t_prev > 0 and t_p >= t_prev * (1.0 + c.cliff_gain):
        out, action = prev, "refuse_step"
    else:
        held = prev if guard_state.anchor is None else min(max(guard_state.anchor, guard.min_emb_share),
                                                            guard.max_emb_share)
        t_held = float(np.interp(held, shares, cost))
        if proposal != held and t_held > 0 and (t_held - t_min) < c.flat_gain * t_held:
            out, action = held, "flat"
    guard_state.holding = action in ("to_minimum", "jump")
    guard_state.anchor = out
    guard_state.num_actions[action] += 1
    acted = action != "pass" and out != proposal
    return out, LayerTrace("curve", out, acted,
                           (action, s_min, t_min, t_p, t_prev, round(gain, 6), curves.emb_followed, curves.kv_followed,
                            curves.kv_refused, proposal, CostCurve(shares, cost), 0.0))
