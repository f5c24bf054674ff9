"""The policy and model registries' and rollouts' database side: it turns rows into the pure
judge's inputs (`control_plane.rollout`), applies its actions and the operators' events, and
answers which policy and which model each node should run. Functions take a session and do not
commit.

A rollout has a kind, "policy" or "model"; one of each kind may be open at a time, and both go
through the same judge and state machine. A model rollout is judged on ``MODEL_METRICS`` (the
latency metrics and the agents' online ``model_quality``), over the windows each side reported
while serving its own checkpoint (``node_reports.model_digest``).

Which policy a node is told to run (``policy_for_node``): a canary node of the rollout in
progress (pending, baking or paused) gets the candidate; every other node gets the active policy.
A promotion makes the candidate the active policy (the old one becomes "retired"), so every node
gets it; a rollback marks the candidate "rolled_back" and the canary nodes get the active policy
back. A rollout needs an active policy (the baseline): activate one first. The same holds for
models (``model_for_node``, the active model, a model rollout's candidate checkpoint).
"""

from __future__ import annotations

import math
import random

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from db import queries
from db.models import ModelVersion, Node, Policy, Rollout, RolloutNode, RolloutStep

from .rollout import (METRICS, MODEL_METRICS, Action, InvalidTransition, NodeLoad, RolloutConfig, RolloutState,
                      RolloutStats, RolloutStatus, WindowSamples, apply_event, evaluate_rollout)

KINDS = ("policy", "model")
_REGISTRY = {"policy": Policy, "model": ModelVersion}

OPEN_STATES = ("pending", "baking", "paused")
#: how far back a model rollout looks, when it starts, for reports that carry model_quality
QUALITY_LOOKBACK_S = 120.0


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


def model_for_node(s: Session, node_id: str) -> tuple[ModelVersion | None, int | None]:
    """(model the node should serve, rollout id when it is a canary of the open model rollout)."""
    ro = queries.open_rollout(s, "model")
    if ro is not None:
        rn = queries.rollout_role(s, ro.id, node_id)
        if rn is not None and rn.role == "canary":
            return s.get(ModelVersion, ro.model_version), ro.id
    return queries.active_model(s), None


def _active(s: Session, kind: str):
    return queries.active_policy(s) if kind == "policy" else queries.active_model(s)


def flush_or_conflict(s: Session, message: str) -> None:
    """Write the session's changes now; a database "only one" index refusing them (a parallel
    request got there first: migration 0009) is a `Conflict` with ``message``, not a 500."""
    try:
        s.flush()
    except (IntegrityError, StaleDataError):
        raise Conflict(message) from None


def _registered_idle(s: Session, kind: str, version: str, *, missing: str, busy: str):
    """The registry's ``version`` of ``kind``, when no rollout of that kind is open: `NotFound`
    ("... is not in the registry" + ``missing``) or `Conflict` (``busy``) otherwise."""
    p = s.get(_REGISTRY[kind], version)
    if p is None:
        raise NotFound(f"{kind}_version {version!r} is not in the registry{missing}")
    if queries.open_rollout(s, kind) is not None:
        raise Conflict(busy)
    return p


def _make_active(s: Session, kind: str, new, busy: str):
    """Retire the active ``kind`` (unless it is ``new``), then make ``new`` active; a parallel
    change is `Conflict` (``busy``). Returns the one that was active (or None)."""
    old = _active(s, kind)
    if old is not None and old.version != new.version:
        old.status = "retired"
        flush_or_conflict(s, busy)  # the old one out before the new one in: one active at every step
    new.status = "active"
    flush_or_conflict(s, busy)
    return old


def activate(s: Session, version: str, *, actor: str, reason: str, now_s: float, kind: str = "policy"):
    """Make ``version`` the active policy (or model, ``kind="model"``): every node not in a canary gets it."""
    p = _registered_idle(s, kind, version, missing="", busy=f"a {kind} rollout is in progress: promote, roll back "
                                                              f"or finish it before activating a {kind}")
    old = _make_active(s, kind, p, f"another {kind} activation or rollout changed the active {kind} at the same "
                                   f"moment: read it again and retry")
    queries.audit(s, ts_s=now_s, actor=actor, action=f"{kind}.activate", target=f"{kind}:{version}",
                  before={"active": old.version if old else None}, after={"active": version}, reason=reason)
    return p


def create_rollout(s: Session, body, *, actor: str, now_s: float) -> Rollout:
    kind = getattr(body, "kind", "policy")
    version = body.policy_version if kind == "policy" else body.model_version
    if version is None:
        raise Conflict(f"a {kind} rollout needs {kind}_version")
    p = _registered_idle(s, kind, version, missing=" (upload it first)",
                         busy=f"another {kind} rollout is in progress (promote, roll back or finish it first)")
    active = _active(s, kind)
    if active is None:
        raise Conflict(f"no active {kind} to serve as the baseline: activate one first "
                       f"(POST /api/v1/{kind}s/{{version}}/activate)")
    cfg = {k: getattr(body, k) for k in RolloutConfig.__dataclass_fields__ if hasattr(body, k)}
    try:
        RolloutConfig(**cfg)
    except ValueError as e:
        raise Conflict(str(e)) from None
    cfg.update(canary_fraction=body.canary_fraction, auto=body.auto)
    r = Rollout(kind=kind, policy_version=p.version if kind == "policy" else None,
                model_version=p.version if kind == "model" else None, baseline_version=active.version,
                state="pending", config=cfg,
                created_by=actor, created_at_s=now_s, bake_started_s=None, updated_at_s=now_s, reason=body.reason)
    s.add(r)
    flush_or_conflict(s, f"another {kind} rollout was started at the same moment (promote, roll back or finish it first)")
    up = [n for n in queries.list_nodes(s) if n.status == "up"]
    # a node whose split an operator pins measures the override, not the candidate: neither canary
    # nor baseline (it keeps the active one); a cluster-wide override pins them all
    pinned = {o.node_id: o for o in queries.active_overrides(s)}
    if None in pinned and up:
        o = pinned[None]
        raise Conflict(f"override {o.id} pins every node's emb_share at {o.emb_share:g}: a canary would measure "
                       f"the override; clear it (POST /overrides/{o.id}/clear) before a rollout")
    excluded = {n.node_id: f"override {pinned[n.node_id].id} pins emb_share at {pinned[n.node_id].emb_share:g}"
                for n in up if n.node_id in pinned}
    nodes = [n for n in up if n.node_id not in excluded]
    if up and not nodes:
        raise Conflict(f"every live node is under a manual override ({', '.join(sorted(excluded))}): a canary "
                       f"would measure the overrides; clear one before a rollout")
    if kind == "model" and nodes:  # the judge reads model_quality: say now if the nodes do not report it
        seen = queries.quality_windows(s, [n.node_id for n in nodes], since_s=now_s - QUALITY_LOOKBACK_S)
        blind = sorted(n for n, (windows, with_q) in seen.items() if windows and not with_q)
        if blind and 2 * len(blind) > len(seen):
            raise Conflict(f"{len(blind)} of the {len(seen)} nodes with traffic in the last {QUALITY_LOOKBACK_S:g} s "
                           f"reported no model_quality ({', '.join(blind[:8])}): the judge could not compare the "
                           f"models' quality, only their latency. The signal needs requests whose candidates hold "
                           f"the users' next items (the replay's plant_next_item) and new_items on the users' next "
                           f"requests")
    num_canary = 0 if not nodes else max(1, math.floor(body.canary_fraction * len(nodes) + 1e-9))
    if len(nodes) > 1 and body.canary_fraction < 1:
        num_canary = min(num_canary, len(nodes) - 1)  # keep a baseline
    canary = set(random.Random(r.id).sample([n.node_id for n in nodes], num_canary)) if nodes else set()
    for n in nodes:
        s.add(RolloutNode(rollout_id=r.id, node_id=n.node_id, role="canary" if n.node_id in canary else "baseline",
                          status="assigned" if n.node_id in canary else "loaded",
                          prev_version=n.policy_version if kind == "policy" else n.model_digest,
                          updated_at_s=now_s))
    if p.status in ("registered", "retired", "rolled_back"):
        p.status = "canary"
    _step(s, r, actor=actor, action="create", from_state=None, to_state="pending", reason=body.reason, now_s=now_s,
          details={"canary": sorted(canary), "baseline": sorted(n.node_id for n in nodes if n.node_id not in canary),
                   **({"excluded": excluded} if excluded else {})})
    queries.audit(s, ts_s=now_s, actor=actor, action="rollout.create", target=f"rollout:{r.id}",
                  after={"kind": kind, f"{kind}_version": p.version, "baseline_version": active.version, "config": cfg,
                         "canary": sorted(canary), **({"excluded": excluded} if excluded else {})}, reason=body.reason)
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
    _canary_answered(s, "policy", node, version, status, error, now_s)


def _canary_answered(s: Session, kind: str, node: Node, version: str, status: str, error: str | None,
                     now_s: float) -> None:
    ro = queries.open_rollout(s, kind)
    if ro is None or (ro.policy_version if kind == "policy" else ro.model_version) != version:
        return
    rn = queries.rollout_role(s, ro.id, node.node_id)
    if rn is not None and rn.role == "canary" and rn.status != status:
        rn.status, rn.error, rn.updated_at_s = status, error, now_s


def node_model_confirmed(s: Session, node: Node, *, version: str, status: str, error: str | None,
                         now_s: float) -> None:
    """A node says it serves checkpoint ``version`` (or failed to load it: it keeps its model)."""
    if status == "loaded":
        node.model_digest, node.model_error = version, None
        prof = dict(node.cost_profile or {})
        if prof.get("model_digest") != version:
            prof["model_digest"] = version  # what the dashboard's model column reads
            node.cost_profile = prof
    else:
        node.model_error = f"{version}: {error or 'load failed'}"
    _canary_answered(s, "model", node, version, status, error, now_s)


def _effects(s: Session, r: Rollout, to_state: str, now_s: float) -> None:
    kind = r.kind or "policy"
    cand = s.get(_REGISTRY[kind], r.policy_version if kind == "policy" else r.model_version)
    if to_state == "promoted":
        _make_active(s, kind, cand, f"the active {kind} changed at the same moment: read it again and retry")
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
    # written only where the row is still in ``before`` (`Rollout`'s version column): of two
    # parallel events one wins, the other is a Conflict
    flush_or_conflict(s, f"rollout {r.id} left {before} at the same moment: read it again and retry")
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
    # the bake's windows after its warm-up (caches refilling after the change are not judged)
    since = (r.bake_started_s + rollout_config(r).warmup) if r.bake_started_s is not None else r.created_at_s
    loaded = [n.node_id for n in canary if n.status == "loaded"]
    if r.kind == "model":
        cv = queries.window_values(s, loaded, since_s=since, until_s=now_s, model_digest=r.model_version)
        bv = queries.window_values(s, base, since_s=since, until_s=now_s, model_digest=r.baseline_version)
    else:
        cv = queries.window_values(s, loaded, since_s=since, until_s=now_s, policy_version=r.policy_version)
        bv = queries.window_values(s, base, since_s=since, until_s=now_s, policy_version=r.baseline_version)
    return RolloutStats(state=RolloutState(r.state), started_at_s=r.created_at_s,
                        metrics=MODEL_METRICS if r.kind == "model" else METRICS,
                        canary=WindowSamples(**cv), baseline=WindowSamples(**bv),
                        canary_nodes={n.node_id: NodeLoad(n.status) for n in canary},
                        bake_started_at_s=r.bake_started_s, pause_reason=r.reason if r.state == "paused" else "")


def evaluate(s: Session, now_s: float) -> dict | None:
    """The rollout job: judge the open rollout of each kind and apply the judge's action (automatic
    rollouts only promote or roll back by themselves; with ``auto`` False a promote/rollback verdict
    pauses it for an operator). Returns what was done (the policy rollout's, with the model
    rollout's under ``"model"`` when both are open), or None when no rollout is open."""
    done = {k: _evaluate_one(s, k, now_s) for k in KINDS}
    if done["policy"] is None:
        return done["model"]
    if done["model"] is not None:
        done["policy"]["model"] = done["model"]
    return done["policy"]


def _evaluate_one(s: Session, kind: str, now_s: float) -> dict | None:
    r = queries.open_rollout(s, kind)
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
