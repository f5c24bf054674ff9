"""The policy registry's and rollouts' database side: it turns rows into the pure judge's inputs
(`control_plane.rollout`), applies its actions and the operators' events, and answers which policy
each node should run. Functions take a session and do not commit.

Which policy a node is told to run (``policy_for_node``): a canary node of the rollout in
progress (pending, baking or paused) gets the candidate; every other node gets the active policy.
A promotion makes the candidate the active policy (the old one becomes "retired"), so every node
gets it; a rollback marks the candidate "rolled_back" and the canary nodes get the active policy
back. A rollout needs an active policy (the baseline): activate one first.
"""

from __future__ import annotations

import math
import random

from sqlalchemy.orm import Session

from db import queries
from db.models import Node, Policy, Rollout, RolloutNode, RolloutStep

from .rollout import (Action, InvalidTransition, NodeLoad, RolloutConfig, RolloutState, RolloutStats,
                      RolloutStatus, WindowSamples, apply_event, evaluate_rollout)

OPEN_STATES = ("pending", "baking", "paused")


class Conflict(ValueError):
    """The request cannot be applied in the current state (HTTP 409)."""


class NotFound(LookupError):
    """HTTP 404."""


def rollout_config(r: Rollout) -> RolloutConfig:
    keys = RolloutConfig.__dataclass_fields__
    return RolloutConfig(**{k: v for k, v in r.config.items() if k in keys})


def _status(r: Rollout) -> RolloutStatus:
    return RolloutStatus(state=RolloutState(r.state), started_at_s=r.created_at_s, updated_at_s=r.updated_at_s,
                         bake_started_at_s=r.bake_started_s,
                         paused_from=RolloutState(r.paused_from) if r.paused_from else None, reason=r.reason)


def policy_for_node(s: Session, node_id: str) -> tuple[Policy | None, int | None]:
    """(policy the node should run, rollout id when it is a canary of the open rollout)."""
    ro = queries.open_rollout(s)
    if ro is not None:
        rn = queries.rollout_role(s, ro.id, node_id)
        if rn is not None and rn.role == "canary":
            return s.get(Policy, ro.policy_version), ro.id
    return queries.active_policy(s), None


def activate(s: Session, version: str, *, actor: str, reason: str, now_s: float) -> Policy:
    p = s.get(Policy, version)
    if p is None:
        raise NotFound(f"policy_version {version!r} is not in the registry")
    if queries.open_rollout(s) is not None:
        raise Conflict("a rollout is in progress: promote, roll back or finish it before activating a policy")
    old = queries.active_policy(s)
    if old is not None and old.version != version:
        old.status = "retired"
    p.status = "active"
    queries.audit(s, ts_s=now_s, actor=actor, action="policy.activate", target=f"policy:{version}",
                  before={"active": old.version if old else None}, after={"active": version}, reason=reason)
    return p


def create_rollout(s: Session, body, *, actor: str, now_s: float) -> Rollout:
    p = s.get(Policy, body.policy_version)
    if p is None:
        raise NotFound(f"policy_version {body.policy_version!r} is not in the registry (upload it first)")
    if queries.open_rollout(s) is not None:
        raise Conflict("another rollout is in progress (promote, roll back or finish it first)")
    active = queries.active_policy(s)
    if active is None:
        raise Conflict("no active policy to serve as the baseline: activate one first "
                       "(POST /api/v1/policies/{version}/activate)")
    cfg = {k: getattr(body, k) for k in RolloutConfig.__dataclass_fields__ if hasattr(body, k)}
    try:
        RolloutConfig(**cfg)
    except ValueError as e:
        raise Conflict(str(e)) from None
    cfg.update(canary_fraction=body.canary_fraction, auto=body.auto)
    r = Rollout(policy_version=p.version, baseline_version=active.version, state="pending", config=cfg,
                created_by=actor, created_at_s=now_s, bake_started_s=None, updated_at_s=now_s, reason=body.reason)
    s.add(r)
    s.flush()
    nodes = [n for n in queries.list_nodes(s) if n.status == "up"]
    num_canary = 0 if not nodes else max(1, math.floor(body.canary_fraction * len(nodes) + 1e-9))
    if len(nodes) > 1 and body.canary_fraction < 1:
        num_canary = min(num_canary, len(nodes) - 1)  # keep a baseline
    canary = set(random.Random(r.id).sample([n.node_id for n in nodes], num_canary)) if nodes else set()
    for n in nodes:
        s.add(RolloutNode(rollout_id=r.id, node_id=n.node_id, role="canary" if n.node_id in canary else "baseline",
                          status="assigned" if n.node_id in canary else "loaded", prev_version=n.policy_version,
                          updated_at_s=now_s))
    if p.status in ("registered", "retired", "rolled_back"):
        p.status = "canary"
    _step(s, r, actor=actor, action="create", from_state=None, to_state="pending", reason=body.reason, now_s=now_s,
          details={"canary": sorted(canary), "baseline": sorted(n.node_id for n in nodes if n.node_id not in canary)})
    queries.audit(s, ts_s=now_s, actor=actor, action="rollout.create", target=f"rollout:{r.id}",
                  after={"policy_version": p.version, "baseline_version": active.version, "config": cfg,
                         "canary": sorted(canary)}, reason=body.reason)
    s.flush()
    return r


def _step(s: Session, r: Rollout, *, actor: str, action: str, from_state: str | None, to_state: str, reason: str,
          now_s: float, details: dict | None = None) -> None:
    s.add(RolloutStep(rollout_id=r.id, ts_s=now_s, actor=actor, action=action, from_state=from_state,
                      to_state=to_state, reason=reason, details=details))


def node_confirmed(s: Session, node: Node, *, version: str, status: str, error: str | None, now_s: float) -> None:
    """A node says it loaded ``version`` (or failed to: it keeps its previous policy)."""
    if status == "loaded":
        node.policy_version, node.policy_error = version, None
    else:
        node.policy_error = f"{version}: {error or 'load failed'}"
    ro = queries.open_rollout(s)
    if ro is None or ro.policy_version != version:
        return
    rn = queries.rollout_role(s, ro.id, node.node_id)
    if rn is not None and rn.role == "canary" and rn.status != status:
        rn.status, rn.error, rn.updated_at_s = status, error, now_s


def _effects(s: Session, r: Rollout, to_state: str, now_s: float) -> None:
    cand = s.get(Policy, r.policy_version)
    if to_state == "promoted":
        old = queries.active_policy(s)
        if old is not None and old.version != cand.version:
            old.status = "retired"
        cand.status = "active"
    elif to_state == "rolled_back" and cand.status != "active":
        cand.status = "rolled_back"


def transition(s: Session, r: Rollout, event: str, *, actor: str, reason: str, now_s: float,
               details: dict | None = None) -> Rollout:
    """An operator's (or the judge's) event on rollout ``r``; `Conflict` if the state forbids it."""
    before = r.state
    try:
        new, step = apply_event(_status(r), event, now_s, actor=actor, reason=reason)
    except InvalidTransition as e:
        raise Conflict(str(e)) from None
    r.state, r.updated_at_s, r.reason = new.state.value, now_s, new.reason
    r.bake_started_s = new.bake_started_at_s
    r.paused_from = new.paused_from.value if new.paused_from else None
    _effects(s, r, r.state, now_s)
    _step(s, r, actor=actor, action=event, from_state=before, to_state=r.state, reason=new.reason, now_s=now_s,
          details=details)
    queries.audit(s, ts_s=now_s, actor=actor, action=f"rollout.{event}", target=f"rollout:{r.id}",
                  before={"state": before}, after={"state": r.state}, reason=new.reason)
    return r


def stats_of(s: Session, r: Rollout, now_s: float) -> RolloutStats:
    nodes = queries.rollout_nodes(s, r.id)
    canary = [n for n in nodes if n.role == "canary"]
    base = [n.node_id for n in nodes if n.role == "baseline"]
    since = r.bake_started_s if r.bake_started_s is not None else r.created_at_s
    loaded = [n.node_id for n in canary if n.status == "loaded"]
    cv = queries.window_values(s, loaded, since_s=since, until_s=now_s, policy_version=r.policy_version)
    bv = queries.window_values(s, base, since_s=since, until_s=now_s, policy_version=r.baseline_version)
    return RolloutStats(state=RolloutState(r.state), started_at_s=r.created_at_s,
                        canary=WindowSamples(**cv), baseline=WindowSamples(**bv),
                        canary_nodes={n.node_id: NodeLoad(n.status) for n in canary},
                        bake_started_at_s=r.bake_started_s, pause_reason=r.reason if r.state == "paused" else "")


def evaluate(s: Session, now_s: float) -> dict | None:
    """The rollout job: judge the open rollout and apply the judge's action (automatic rollouts
    only promote or roll back by themselves; with ``auto`` False a promote/rollback verdict pauses
    it for an operator). Returns what was done, or None when no rollout is open."""
    r = queries.open_rollout(s)
    if r is None:
        return None
    action = evaluate_rollout(stats_of(s, r, now_s), now_s, rollout_config(r))
    d = action.to_dict()
    if action.action is not Action.WAIT or r.verdict is None or r.verdict.get("reason") != d["reason"]:
        r.verdict = d
    if action.action is Action.WAIT:
        return {"rollout_id": r.id, "action": "wait", "reason": action.reason}
    event = action.action.value
    if not r.config.get("auto", True) and event in ("promote", "rollback"):
        event, reason = "pause", f"manual rollout: judge says {event}: {action.reason}"
    else:
        reason = action.reason
    transition(s, r, event, actor="judge", reason=reason, now_s=now_s, details=d)
    return {"rollout_id": r.id, "action": event, "reason": reason}
