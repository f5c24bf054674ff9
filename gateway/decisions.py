"""The gateway's decisions as pure functions over small snapshots; `gateway.gateway.Gateway` does
the I/O (HTTP to the nodes and the control plane, the router's state, metrics, logs) and calls
these to decide. None reads the clock (``now_s`` is passed in), none mutates its inputs, and
each answer carries its reason.

    choose_retry(attempt, snapshot) -> RetryChoice             after a failed forward attempt
    health_transition(state, event, now_s, policy) -> HealthTransition   one node's health
    diff_registry(current_nodes, registered_nodes) -> RegistryDiff      the control plane's node list
    weights_verdict(version, in_force) -> WeightsVerdict       a weights document, pushed or pulled
    profile_from_metrics(old, costs, ...) -> (CostProfile, reason)      weights from a node's metrics
    client_report_step(status, batch_len) -> ReportStep        the control plane's answer to a batch

Health state diagram (thresholds from `HealthPolicy`; a refused connection on the request path
counts as a failed check)::

    live ──(failures_out failures in a row)──> out ──(successes_in successes in a row)──> live

A success resets the failure count and a failure the success count, in either state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from common.config import ranged, validate
from common.weights import CostProfile

__all__ = ["MAX_ATTEMPTS", "FAILURE_KINDS", "Attempt", "RetrySnapshot", "RetryChoice", "choose_retry",
           "HealthPolicy", "HealthState", "HealthEvent", "HealthTransition", "health_transition",
           "RegistryDiff", "diff_registry", "WeightsInForce", "WeightsVerdict", "weights_verdict",
           "profile_from_metrics", "service_time_changed", "ReportStep", "client_report_step"]


# ----------------------------------------------------------------------------------- retry ---
#: forward attempts per request: the first choice and one retry
MAX_ATTEMPTS = 2
#: what makes an attempt fail (and be retried): no connection, no answer in time, a 5xx. A 4xx is
#: the node's answer to pass on, not a failure.
FAILURE_KINDS = ("connect", "timeout", "5xx")


@dataclass(frozen=True)
class Attempt:
    """The attempts made so far on one request: the node indexes tried, in order, and how the last
    one failed (one of `FAILURE_KINDS`)."""

    tried: tuple[int, ...]
    kind: str


@dataclass(frozen=True)
class RetrySnapshot:
    """What the retry choice reads, taken right after the failed attempt (after its health
    update): ``node_ids`` in index order; ``score``: the routing decision's per-node scores (None
    when the router does not score: load-based then); ``alive``: nodes in rotation now;
    ``load``: each node's load now (infinite when out of rotation)."""

    node_ids: tuple[str, ...]
    score: np.ndarray | None
    alive: np.ndarray
    load: np.ndarray


@dataclass(frozen=True)
class RetryChoice:
    """``node``: where to send the next attempt, or None to give up with ``status`` (504 after a
    timeout, else 502); ``reason``: why, in words."""

    node: int | None
    status: int | None
    reason: str

    @property
    def give_up(self) -> bool:
        return self.node is None


def choose_retry(attempt: Attempt, snapshot: RetrySnapshot, max_attempts: int = MAX_ATTEMPTS) -> RetryChoice:
    """After a failed attempt: the next node to try, or give up.

    Gives up once ``max_attempts`` were made. Otherwise, with scores: the live node with the highest
    decision-time score among those not tried; without (a baseline that does not score): the node
    with the lowest load now among those not tried (a node out of rotation has infinite load). Gives
    up when no such node is left. A tie goes to the lowest index."""
    if attempt.kind not in FAILURE_KINDS:
        raise ValueError(f"attempt.kind must be one of {', '.join(FAILURE_KINDS)}, got {attempt.kind!r}")
    status = 504 if attempt.kind == "timeout" else 502
    ids = snapshot.node_ids
    last = ids[attempt.tried[-1]]
    if len(attempt.tried) >= max_attempts:
        return RetryChoice(None, status, f"{attempt.kind} on {last}: {len(attempt.tried)} attempts made, "
                                         f"no more (at most {max_attempts})")
    tried = list(attempt.tried)
    if snapshot.score is not None:
        s = np.array(snapshot.score, dtype=np.float64)
        s[~np.asarray(snapshot.alive, dtype=bool)] = -math.inf
        s[tried] = -math.inf
        best = int(s.argmax())
        if s[best] > -math.inf:
            return RetryChoice(best, None, f"{attempt.kind} on {last}: retry on {ids[best]}, the highest score "
                                           f"({s[best]:.1f}) among live nodes not tried")
    else:
        load = np.array(snapshot.load, dtype=np.float64)
        load[tried] = math.inf
        best = int(load.argmin())
        if math.isfinite(load[best]):
            return RetryChoice(best, None, f"{attempt.kind} on {last}: retry on {ids[best]}, the lowest load "
                                           f"({load[best]:.3f}) among live nodes not tried")
    return RetryChoice(None, status, f"{attempt.kind} on {last}: no other node is live to retry on")


# ---------------------------------------------------------------------------------- health ---
@dataclass(frozen=True)
class HealthPolicy:
    """``failures_out`` failures in a row take a live node out of rotation; ``successes_in``
    successes in a row put a node that is out back in."""

    failures_out: int = ranged(3, lo=1, integer=True)
    successes_in: int = ranged(2, lo=1, integer=True)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class HealthState:
    """One node's health: in rotation or not, the consecutive failures and successes, the last
    failure's error (cleared when the node comes back), and ``since_s``: when it last went in or
    out (None: never changed, in rotation from the start)."""

    live: bool = True
    failures: int = 0
    successes: int = 0
    last_error: str | None = None
    since_s: float | None = None


@dataclass(frozen=True)
class HealthEvent:
    """A health check's result (``ok``, or its ``error``), or a connection the node refused on the
    request path (``ok=False``: counts as a failed check)."""

    ok: bool
    error: str | None = None


@dataclass(frozen=True)
class HealthTransition:
    """The state after an event; ``change``: ``"in"`` (back in rotation), ``"out"`` (taken out) or
    None; ``reason``: why, in words."""

    state: HealthState
    change: str | None
    reason: str


def health_transition(state: HealthState, event: HealthEvent, now_s: float,
                      policy: HealthPolicy = HealthPolicy()) -> HealthTransition:
    """Apply one health event to a node's state at gateway time ``now_s`` (see the module's state
    diagram)."""
    if event.ok:
        n = state.successes + 1
        if not state.live and n >= policy.successes_in:
            return HealthTransition(HealthState(True, 0, n, None, now_s), "in",
                                    f"{n} successes in a row (>= {policy.successes_in}): back in rotation")
        return HealthTransition(replace(state, failures=0, successes=n), None,
                                "success" if state.live else f"success {n} of {policy.successes_in} to come back")
    n = state.failures + 1
    if state.live and n >= policy.failures_out:
        return HealthTransition(HealthState(False, n, 0, event.error, now_s), "out",
                                f"{n} failures in a row (>= {policy.failures_out}): out of rotation ({event.error})")
    return HealthTransition(replace(state, failures=n, successes=0, last_error=event.error), None,
                            f"failure {n} of {policy.failures_out} to take it out" if state.live else
                            "failure while out of rotation")


# -------------------------------------------------------------------------------- registry ---
@dataclass(frozen=True)
class RegistryDiff:
    """How the control plane's node list differs from the gateway's.

    ``changed``: the node list (ids, addresses, order) differs, and the router is rebuilt from
    ``nodes`` (nodes kept keep their health); ``added`` / ``removed``: node ids; ``readdressed``:
    ids whose address moved; ``reordered``: only the order differs. ``empty``: the control plane
    lists no node, and the gateway keeps the ones it has."""

    nodes: tuple[tuple[str, str], ...]
    changed: bool
    empty: bool
    added: tuple[str, ...]
    removed: tuple[str, ...]
    readdressed: tuple[str, ...]
    reordered: bool
    reason: str


def diff_registry(current_nodes: Sequence[tuple[str, str]],
                  registered_nodes: Sequence[tuple[str, str]]) -> RegistryDiff:
    """Compare the gateway's ``[(node_id, address)]`` with the control plane's. Addresses compare
    without a trailing ``/`` (the gateway keeps them so), so ``http://h:p/`` is not a new address."""
    cur = tuple((str(n), str(a).rstrip("/")) for n, a in current_nodes)
    new = tuple((str(n), str(a).rstrip("/")) for n, a in registered_nodes)
    if not new:
        return RegistryDiff(cur, False, True, (), (), (), False,
                            f"the control plane lists no node: keeping the {len(cur)} known")
    was, now = dict(cur), dict(new)
    added = tuple(n for n, _ in new if n not in was)
    removed = tuple(n for n, _ in cur if n not in now)
    moved = tuple(n for n, a in new if n in was and was[n] != a)
    changed = cur != new
    reordered = changed and not (added or removed or moved)
    if not changed:
        reason = f"unchanged: {len(new)} nodes"
    else:
        parts = [f"{what} {', '.join(ids)}" for what, ids in
                 (("added", added), ("removed", removed), ("readdressed", moved)) if ids]
        reason = "; ".join(parts) if parts else "the same nodes in another order"
    return RegistryDiff(new, changed, False, added, removed, moved, reordered, reason)


# --------------------------------------------------------------------------------- weights ---
@dataclass(frozen=True)
class WeightsInForce:
    """The weights the gateway routes with: their version, where they came from
    (``control_plane`` or ``node_metrics``) and when they were computed (None: not yet)."""

    version: int
    source: str
    computed_at_s: float | None


@dataclass(frozen=True)
class WeightsVerdict:
    """``apply``: put the document in force; ``current``: not applied because that version is
    already in force (not a refusal); ``reason``: why not, when not applied."""

    apply: bool
    current: bool
    reason: str


def weights_verdict(version: int, in_force: WeightsInForce) -> WeightsVerdict:
    """Whether a (valid) weights document of ``version`` replaces the weights in force: always over
    weights derived from the nodes, and over the control plane's own only when newer."""
    if in_force.source == "control_plane" and version <= in_force.version and in_force.computed_at_s:
        if version == in_force.version:  # a push of what a pull already brought: nothing to do
            return WeightsVerdict(False, True, "already in force")
        return WeightsVerdict(False, False, f"version {version} < version in force {in_force.version}")
    return WeightsVerdict(True, False, f"version {version} replaces version {in_force.version} ({in_force.source})")


def profile_from_metrics(old: CostProfile, costs: Mapping, service_time_us: float | None,
                         queue_capacity: int) -> tuple[CostProfile, str]:
    """A node's cost profile from its ``/v1/metrics`` ``miss_costs`` (a per-layer K/V cost is
    summarised by its median), the service time its residency feed reported, and the gateway's
    queue capacity; a cost the node does not report keeps ``old``'s. Returns it and its reason."""
    kv = costs.get("kv_recompute_us_per_token")
    if isinstance(kv, dict) and kv:
        kv = float(np.median([float(v) for v in kv.values()]))
    emb = costs.get("emb_transfer_us_per_row")
    p = CostProfile(kv_recompute_us_per_token=float(kv) if kv is not None else old.kv_recompute_us_per_token,
                    emb_transfer_us_per_row=float(emb) if emb is not None else old.emb_transfer_us_per_row,
                    service_time_us=service_time_us or old.service_time_us, queue_capacity=queue_capacity)
    return p, ("miss costs from the node's /v1/metrics" if costs else
               "defaults: the node reports no miss costs (no --profile)")


def service_time_changed(old_us: float, new_us: float) -> bool:
    """Whether a node's reported service time moved enough (over 10%) to re-derive its weights."""
    return abs(old_us - new_us) > 0.1 * old_us


# ---------------------------------------------------------------------------- client reports ---
@dataclass(frozen=True)
class ReportStep:
    """What to do with a batch of client reports after the control plane's answer.

    ``action``: ``sent`` (taken: remove it), ``keep`` (keep every pending report and stop until the
    next interval), ``split`` (send again in halves: ``next_size``), ``drop`` (refused for good:
    remove and count it); ``next_size``: the batch size from now on (None: unchanged)."""

    action: str
    next_size: int | None
    reason: str


def client_report_step(status: int | None, batch_len: int, full_batch: int) -> ReportStep:
    """The control plane answered ``status`` (None: no answer, a connection error) to a batch of
    ``batch_len`` reports; ``full_batch``: the usual batch size.

    No answer, 401, 409, 429 or 5xx: keep (idempotent there, sent again next interval). 413 (over
    the body cap) or 422 (one report refused) on a batch of several: split in halves, so only
    the one refused alone is dropped. Any other 4xx: drop; after a 422 the rest go in whole
    batches again."""
    if status is None or status >= 500 or status in (401, 409, 429):
        return ReportStep("keep", None, "no answer" if status is None else f"{status}: try again next interval")
    if status in (413, 422) and batch_len > 1:
        return ReportStep("split", max(1, batch_len // 2), f"{status} on {batch_len} reports: send in halves")
    if status >= 400:
        return ReportStep("drop", full_batch if status == 422 else None, f"{status}: refused for good")
    return ReportStep("sent", None, f"{status}: taken")
