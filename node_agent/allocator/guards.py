"""The guard layer: the step limit from the split in force, then the [min, max] bounds."""

from __future__ import annotations

from node_agent.allocator.config import GuardConfig
from node_agent.allocator.trace import LayerTrace

GUARD_ACTIONS = ("step_up", "step_down", "max", "min")


def guard_stage(proposed: float, prev: float, guard: GuardConfig, *, step_limit: bool = True,
                step_down_limit: bool = True) -> tuple[float, str | None]:
    """The guard stage, the one used by the runtime (`SmartAllocator.decide`) and by training
    (`policies.env.apply_guards`): the step limit from ``prev`` (``max_step_up`` /
    ``max_step_down``; skipped with ``step_limit=False``, as for an operator override; the step-down
    limit alone skipped with ``step_down_limit=False``, as for the curve layer's ``jump`` and, unless
    paced, in a burst), then the ``[min_emb_share, max_emb_share]`` bounds. Returns
    ``(emb_share, action)`` with ``action`` the last guard that changed the value (one of
    `GUARD_ACTIONS`) or None."""
    share = proposed
    action = None
    if step_limit:
        if share > prev + guard.max_step_up:
            share, action = prev + guard.max_step_up, "step_up"
        elif step_down_limit and share < prev - guard.max_step_down:
            share, action = prev - guard.max_step_down, "step_down"
    if share > guard.max_emb_share:
        share, action = guard.max_emb_share, "max"
    elif share < guard.min_emb_share:
        share, action = guard.min_emb_share, "min"
    return share, action


def guard_layer(proposal: float, prev: float, guard: GuardConfig, source_in: str,
                step_limit: bool = True, step_down_limit: bool = True) -> tuple[float, LayerTrace]:
    """`guard_stage` as a layer. Detail: ``action`` (`GUARD_ACTIONS` or None), ``limit`` (the step
    or bound that applied), ``prev`` (the split in force), ``proposal_in``, ``source_in`` (the
    layer whose proposal reached the guards), ``step_limit`` (False under an override) and
    ``taken_back`` (the part of the operating point's step the step limit refused, filled in by
    the allocator's anti-windup; 0 otherwise)."""
    share, action = guard_stage(proposal, prev, guard, step_limit=step_limit, step_down_limit=step_down_limit)
    limit = None if action is None else (
        guard.max_step_up if action == "step_up" else guard.max_step_down if action == "step_down"
        else guard.max_emb_share if action == "max" else guard.min_emb_share)
    return share, LayerTrace("guard", share, action is not None,
                             (action, limit, prev, proposal, source_in, step_limit, 0.0))
