"""The control-plane API's JSON shapes (pydantic v2). Inputs forbid unknown fields and check
ranges, so a bad payload gets a 422 naming the field, and nothing is stored. What a node sends and
is told (registration, reports, directives, confirmations) is the wire contract, `common.contract`,
which these shapes build on."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from common.contract import INT64_MAX, Finite, In, ModelDigest, NodeId, Out, ReportTime, Version, distinct_seq

ROLES = ("node", "operator", "viewer", "router")


# ---- errors
class FieldError(BaseModel):
    """One refused input: where (``loc``, e.g. ``["body", "emb_share"]`` or ``["query", "step_s"]``),
    what is wrong (``msg``) and its kind (``type``); pydantic's validation errors have this shape."""
    loc: list[str | int]
    msg: str
    type: str


class ErrorOut(BaseModel):
    """Every 4xx body of the API: ``detail`` is a message naming the field or the object
    (401/403/404/409/413), or, for a 422, the list of refused inputs."""
    detail: str | list[FieldError]


# ---- nodes
class NodeOut(Out):
    node_id: str
    address: str
    device: str
    status: str  # "up", "down" or "retired"
    last_seen_s: float
    registered_at_s: float
    report_interval_s: float
    policy_version: str | None
    policy_error: str | None
    model_digest: str | None = None
    model_error: str | None = None
    emb_share: float | None
    cost_profile: dict[str, Any]
    last_report_seq: int | None
    # reports the node says it dropped (its latest report carrying the count, as seen by this
    # control-plane process since it started; null: none seen yet)
    num_reports_dropped: int | None = None
    # what its figures are (real, link-emulated, emulated) and an emulated device's cost profile:
    # from its latest report saying, else its registration (null: unknown)
    device_mode: str | None = None
    device_profile: str | None = None
    # when the agent process now registered started (wall s) and the restarts seen so far
    started_at_s: float | None = None
    num_restarts: int = 0
    # the request rate of its latest report (req/s; null: no report yet)
    throughput_rps: float | None = None


# ---- history
class ReportOut(Out):
    node_id: str
    seq: int | None = None
    ts_s: float
    num_reports: int = 1
    emb_share: float | None = None
    emb_share_target: float | None = None
    kv_hit_rate: float | None = None
    emb_hit_rate: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    slo_attainment: float | None = None
    throughput_rps: float | None = None
    num_requests: float | None = None
    queue_depth: float | None = None
    refill_bytes: float | None = None
    kv_recompute_us_per_token: float | None = None
    emb_transfer_us_per_row: float | None = None
    policy_version: str | None = None
    decision_source: str | None = None
    model_digest: str | None = None  # raw reports only (null in bucketed history)
    model_quality: float | None = None
    device_mode: str | None = None  # raw reports only: real, link-emulated or emulated (null: unknown)
    device_profile: str | None = None  # raw reports only: an emulated device's cost profile


class DecisionOut(Out):
    id: int
    node_id: str
    seq: int
    ts_s: float
    source: str
    emb_share: float
    prev_emb_share: float | None
    reason: str
    policy_version: str | None
    features: dict[str, Any]
    layers: list[dict[str, Any]] | None = None  # every allocator layer's trace (None: stored without them)


class Page(Out):
    total: int
    offset: int
    limit: int


class DecisionPage(Page):
    items: list[DecisionOut]


class BurstOut(Out):
    id: int
    node_id: str
    start_s: float
    end_s: float | None
    magnitude: float


# ---- routers
class RouterIn(In):
    url: Annotated[str, Field(min_length=1, max_length=512, pattern=r"^https?://")]


class RouterOut(Out):
    url: str
    registered_at_s: float
    pushed_version: int | None
    last_push_s: float | None
    last_error: str | None


class RouterRegisteredOut(RouterOut):
    """The registration's answer, to the registrant only: the bearer the control plane's pushes
    to ``url`` carry (derived from its secret key; never stored, never listed)."""
    push_token: str


class RouterWeightsOut(Out):
    version: int
    computed_at_s: float
    nodes: dict[str, dict[str, Any]]


class RouterWeightsHistoryOut(RouterWeightsOut):
    inputs: dict[str, Any]
    reason: str


# ---- overrides
class OverrideIn(In):
    node_id: NodeId | None = None
    emb_share: Finite
    expires_at_s: Finite | None = None
    ttl_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    reason: Annotated[str, Field(min_length=1, max_length=2000)]


class ReasonIn(In):
    reason: Annotated[str, Field(min_length=1, max_length=2000)]


class OverrideOut(Out):
    id: int
    node_id: str | None
    emb_share: float
    reason: str
    created_by: str
    created_at_s: float
    expires_at_s: float | None
    state: str
    ended_at_s: float | None


# ---- audit
class AlertOut(Out):
    alert: str  # one of control_plane.alerts.ALERTS
    severity: str  # "page" or "ticket"
    target: str  # "clients", "node:<id>" or "rollout:<id>"
    since_s: float | None  # when the condition began, where known
    summary: str


class AuditOut(Out):
    id: int
    ts_s: float
    actor: str
    action: str
    target: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    reason: str


class AuditPage(Page):
    items: list[AuditOut]


# ---- policies and rollouts
class PolicyOut(Out):
    version: str
    digest: str
    status: str
    uploaded_by: str
    uploaded_at_s: float
    manifest: dict[str, Any]
    evaluation: dict[str, Any]
    size_bytes: int


class ModelOut(Out):
    version: str  # the checkpoint's digest
    digest: str  # SHA-256 of the stored tar
    status: str
    uploaded_by: str
    uploaded_at_s: float
    manifest: dict[str, Any]
    size_bytes: int


class RolloutIn(In):
    """A rollout of ``policy_version`` (kind "policy") or ``model_version`` (kind "model", a
    checkpoint digest); the judge's fields are `control_plane.rollout.RolloutConfig`'s."""

    kind: Literal["policy", "model"] = "policy"
    policy_version: Version | None = None
    model_version: ModelDigest | None = None
    canary_fraction: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.25
    bake_time_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 300.0
    min_samples: Annotated[int, Field(ge=3)] = 10
    alpha: Annotated[float, Field(gt=0, le=0.5, allow_inf_nan=False)] = 0.01
    max_p99_regression_pct: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 10.0
    max_slo_attainment_drop: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.02
    load_timeout_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 120.0
    max_failed_canary_fraction: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.0
    max_model_quality_drop: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.02
    max_bake_factor: Annotated[float, Field(ge=1, le=100, allow_inf_nan=False)] = 4.0
    warmup_s: Annotated[float | None, Field(ge=0, allow_inf_nan=False)] = None
    auto: bool = True
    reason: Annotated[str, Field(min_length=1, max_length=2000)] = "rollout"

    @model_validator(mode="after")
    def _candidate(self) -> "RolloutIn":
        want, other = (("policy_version", "model_version") if self.kind == "policy"
                       else ("model_version", "policy_version"))
        if getattr(self, want) is None or getattr(self, other) is not None:
            raise ValueError(f"a {self.kind} rollout names its candidate in {want} (and not {other})")
        return self


class RolloutNodeOut(Out):
    node_id: str
    role: str
    status: str
    error: str | None


class RolloutStepOut(Out):
    id: int
    ts_s: float
    actor: str
    action: str
    from_state: str | None
    to_state: str
    reason: str
    details: dict[str, Any] | None


class RolloutOut(Out):
    id: int
    kind: str = "policy"
    policy_version: str | None
    model_version: str | None = None
    baseline_version: str | None
    state: str
    config: dict[str, Any]
    created_by: str
    created_at_s: float
    bake_started_s: float | None
    paused_from: str | None = None
    updated_at_s: float
    reason: str
    verdict: dict[str, Any] | None
    nodes: list[RolloutNodeOut] = Field(default_factory=list)
    steps: list[RolloutStepOut] = Field(default_factory=list)


# ---- auth, summary
class WhoAmIOut(Out):
    token_id: int | None
    name: str
    role: str
    node_id: str | None = None  # the node a node token is bound to


class TokenIn(In):
    """A new token. A node token is bound to one ``node_id`` (required for role node, refused
    for the others); ``replace`` revokes the other valid tokens bound to that id (a node whose
    token was lost: the node id is registered by a token that must stop working)."""
    role: Literal["node", "operator", "viewer", "router"]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    node_id: NodeId | None = None
    replace: bool = False

    @model_validator(mode="after")
    def _bound_to_a_node(self):
        if self.role == "node" and self.node_id is None:
            raise ValueError("node_id: a node token is bound to one node id; give the node_id it acts as")
        if self.role != "node" and (self.node_id is not None or self.replace):
            raise ValueError(f"node_id/replace: only node tokens are bound to a node id (role is {self.role!r})")
        return self


class TokenOut(Out):
    id: int
    name: str
    role: str
    node_id: str | None = None
    token: str | None = None  # the secret, shown once on creation
    replaced_token_ids: list[int] = Field(default_factory=list)  # revoked by ``replace``


class TokenInfoOut(Out):
    """A token as listed: never its secret or its hash."""
    id: int
    name: str
    role: str
    node_id: str | None = None
    created_at_s: float
    revoked: bool


class SummaryOut(Out):
    now_s: float
    num_nodes: int
    num_up: int
    num_down: int
    mean_emb_share: float | None
    mean_p99_ms: float | None
    mean_slo_attainment: float | None
    total_throughput_rps: float | None
    active_policy: str | None
    active_rollout: RolloutOut | None
    num_active_overrides: int
    router_weights_version: int | None
    leader: str | None
    decisions_by_source: dict[str, int]
    # up nodes by what their figures are (real, link-emulated, emulated; "unknown": the node does
    # not say); of those, the emulated ones (their figures are modelled time) and their profiles
    device_modes: dict[str, int] = Field(default_factory=dict)
    num_emulated: int = 0
    emulated_profiles: dict[str, int] = Field(default_factory=dict)


def finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


# ---- traffic samples (gateway.traffic_sample; POST /gateways/{gateway_id}/samples)
from common.contract import (MAX_SAMPLE_BATCH, MAX_SAMPLE_CANDIDATES, MAX_SAMPLE_HISTORY_LEN,  # noqa: E402
                             MAX_SAMPLE_ITEMS)

Int64 = Annotated[int, Field(ge=-(2**63), le=INT64_MAX)]  # a keyed hash (signed int64, as SQL BIGINT)
HashedIds = Annotated[list[Int64], Field(max_length=MAX_SAMPLE_ITEMS)]


class TrafficSampleIn(In):
    """One request a gateway sampled: every id a keyed hash. ``items``: the history's most recent
    ids (at most ``history_len``); ``candidates``: the explicit candidates (empty when the request
    named a count); ``num_candidates`` null: the node's default; ``node_id`` null: none was live."""
    seq: Annotated[int, Field(ge=0, le=INT64_MAX)]
    ts_s: ReportTime
    user_hash: Int64
    history_len: Annotated[int, Field(ge=0, le=MAX_SAMPLE_HISTORY_LEN)]
    items: HashedIds = Field(default_factory=list)
    new_items: HashedIds = Field(default_factory=list)
    candidates: HashedIds = Field(default_factory=list)
    num_candidates: Annotated[int, Field(ge=1, le=MAX_SAMPLE_CANDIDATES)] | None = None
    node_id: NodeId | None = None
    status: Annotated[int, Field(ge=100, le=599)] | None = None

    @field_validator("*", mode="after")
    @classmethod
    def _unicode_text(cls, v):
        """No free text here (``node_id`` has its pattern; the rest are numbers): the base class's
        walk over every id of every list would cost more than the validation itself."""
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if len(self.items) > self.history_len:
            raise ValueError(f"items: {len(self.items)} ids, more than history_len ({self.history_len})")
        if self.candidates and self.num_candidates is not None and len(self.candidates) > self.num_candidates:
            raise ValueError(f"candidates: {len(self.candidates)} ids, more than num_candidates "
                             f"({self.num_candidates})")
        return self


class TrafficSampleBatchIn(In):
    samples: Annotated[list[TrafficSampleIn], Field(min_length=1, max_length=MAX_SAMPLE_BATCH)]

    @field_validator("samples")
    @classmethod
    def _distinct_seq(cls, v: list[TrafficSampleIn]) -> list[TrafficSampleIn]:
        return distinct_seq("samples", v)


class TrafficSampleBatchOut(Out):
    stored: int
    duplicates: int


class TrafficSampleOut(Out):
    """A stored traffic sample (every id a keyed hash; lists decoded from their packed int64)."""
    id: int
    gateway_id: str
    seq: int
    ts_s: float
    received_s: float
    user_hash: int
    history_len: int
    items: list[int]
    new_items: list[int]
    candidates: list[int]
    num_candidates: int | None
    node_id: str | None
    status: int | None


class TrafficSampleCursor(Out):
    """Where the next page starts: after the sample at (``after_ts_s``, ``after_id``)."""
    after_ts_s: float
    after_id: int


class TrafficSamplePage(Out):
    samples: list[TrafficSampleOut]
    next: TrafficSampleCursor | None
