"""The control plane's tables (SQLAlchemy 2 typed models).

Times are Unix seconds as float (``*_s``), the project's one time unit. JSON columns hold
structured values (cost profiles, features, manifests, verdicts). Every constraint and index is
named by the naming convention below (``ix_<table>__<cols>`` ...), so Alembic migrations can
refer to them by name on SQLite (batch mode) and PostgreSQL alike.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (JSON, BigInteger, Boolean, Column, Float, ForeignKey, Index, Integer, LargeBinary, MetaData,
                        String, Table, Text, UniqueConstraint, text)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s__%(column_0_N_name)s",
    "uq": "uq_%(table_name)s__%(column_0_N_name)s",
    "ck": "ck_%(table_name)s__%(constraint_name)s",
    "fk": "fk_%(table_name)s__%(column_0_N_name)s__%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

Seconds = Float(precision=53)  # double precision on PostgreSQL (plain REAL would lose sub-ms on epoch times)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, float: Seconds}


class Node(Base):
    """A registered node agent; ``status`` is "up", "down" (the liveness job sets it) or
    "retired" (an operator retired it: out of the node list, its tokens revoked).
    ``token_id`` is the token that registered it: another token may not register the same node
    id while that one is valid (None: registered before tokens were bound to node ids)."""

    __tablename__ = "nodes"
    node_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    address: Mapped[str] = mapped_column(String(512))
    device: Mapped[str] = mapped_column(String(128))
    cost_profile: Mapped[dict[str, Any]]
    policy_version: Mapped[str | None] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16), default="up")
    registered_at_s: Mapped[float]
    last_seen_s: Mapped[float]
    report_interval_s: Mapped[float]
    last_report_seq: Mapped[int | None] = mapped_column(Integer)
    emb_share: Mapped[float | None]
    policy_error: Mapped[str | None] = mapped_column(Text)
    token_id: Mapped[int | None] = mapped_column(Integer)
    # the model checkpoint the node confirmed it serves (its digest), and its last load failure
    model_digest: Mapped[str | None] = mapped_column(String(64))
    model_error: Mapped[str | None] = mapped_column(Text)
    # when the agent process that registered last started (wall s; null: it did not say), and how
    # many registrations came from a process started at another time than the one before (0010)
    started_at_s: Mapped[float | None]
    num_restarts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class NodeReport(Base):
    """One control interval of one node (the raw time series; idempotent on (node_id, seq))."""

    __tablename__ = "node_reports"
    __table_args__ = (UniqueConstraint("node_id", "seq"), Index(None, "ts_s"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    ts_s: Mapped[float]
    received_s: Mapped[float]
    interval_s: Mapped[float]
    emb_share: Mapped[float]
    emb_share_target: Mapped[float]
    kv_hit_rate: Mapped[float | None]
    emb_hit_rate: Mapped[float | None]
    p50_ms: Mapped[float | None]
    p99_ms: Mapped[float | None]
    slo_attainment: Mapped[float | None]
    throughput_rps: Mapped[float]
    num_requests: Mapped[int] = mapped_column(Integer)
    queue_depth: Mapped[float]
    refill_bytes: Mapped[int] = mapped_column(Integer)
    kv_recompute_us_per_token: Mapped[float | None]
    emb_transfer_us_per_row: Mapped[float | None]
    policy_version: Mapped[str | None] = mapped_column(String(256))
    decision_source: Mapped[str | None] = mapped_column(String(16))
    model_digest: Mapped[str | None] = mapped_column(String(64))  # the checkpoint served in the window
    model_quality: Mapped[float | None]  # mean of 1 - rank/num_candidates of the users' next items; null: unknown
    # what the figures are: "real", "link-emulated" or "emulated" (modelled time), and an
    # emulated device's cost profile; null: the node did not say
    device_mode: Mapped[str | None] = mapped_column(String(16))
    device_profile: Mapped[str | None] = mapped_column(String(128))


class Gateway(Base):
    """A gateway that reports what its clients see. ``token_id`` is the token whose first report
    claimed the id: another token may not report as this gateway while that one is valid."""

    __tablename__ = "gateways"
    gateway_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    token_id: Mapped[int | None] = mapped_column(Integer)
    first_seen_s: Mapped[float]
    last_seen_s: Mapped[float]
    last_seq: Mapped[int | None] = mapped_column(BigInteger)
    interval_s: Mapped[float]


class GatewayReport(Base):
    """One report interval of one gateway: the requests its clients sent, end to end (idempotent
    on (gateway_id, seq)). Latency figures are null when no request was answered in the interval;
    ``details`` holds the counts by outcome and status, per-node attempts and queueing before the
    node, and the load phases the clients named."""

    __tablename__ = "gateway_reports"
    __table_args__ = (UniqueConstraint("gateway_id", "seq"), Index(None, "ts_s"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    gateway_id: Mapped[str] = mapped_column(ForeignKey("gateways.gateway_id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    ts_s: Mapped[float]
    received_s: Mapped[float]
    interval_s: Mapped[float]
    num_requests: Mapped[int] = mapped_column(Integer)
    num_ok: Mapped[int] = mapped_column(Integer)
    num_failed: Mapped[int] = mapped_column(Integer)
    num_retried: Mapped[int] = mapped_column(Integer)
    num_503: Mapped[int] = mapped_column(Integer)
    p50_ms: Mapped[float | None]
    p99_ms: Mapped[float | None]
    slo_ms: Mapped[float]
    slo_attainment: Mapped[float | None]
    num_live_nodes: Mapped[int | None] = mapped_column(Integer)
    load_phase: Mapped[str | None] = mapped_column(String(64))
    details: Mapped[dict[str, Any]]


class TrafficSample(Base):
    """One request a gateway sampled for a what-if replay (`gateway.traffic_sample`): no raw
    id, only keyed hashes (signed int64). ``items`` (the history's most recent ids), ``new_items`` and
    ``candidates`` are packed int64 little-endian (8 bytes an id); ``history_len`` is the whole
    history's length; ``num_candidates`` null: the node's default count; ``node_id`` null: no node
    was live. Idempotent on (gateway_id, seq); kept ``sample_retention_s`` by ``ts_s`` and at most
    ``sample_max_rows`` rows."""

    __tablename__ = "traffic_samples"
    __table_args__ = (UniqueConstraint("gateway_id", "seq"), Index(None, "ts_s"))
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    gateway_id: Mapped[str] = mapped_column(ForeignKey("gateways.gateway_id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    ts_s: Mapped[float]
    received_s: Mapped[float]
    user_hash: Mapped[int] = mapped_column(BigInteger)
    history_len: Mapped[int] = mapped_column(Integer)
    items: Mapped[bytes] = mapped_column(LargeBinary)
    new_items: Mapped[bytes] = mapped_column(LargeBinary)
    candidates: Mapped[bytes] = mapped_column(LargeBinary)
    num_candidates: Mapped[int | None] = mapped_column(Integer)
    node_id: Mapped[str | None] = mapped_column(String(128))
    status: Mapped[int | None] = mapped_column(Integer)


class NodeReportRollup(Base):
    """Downsampled history: per node, per ``step_s`` bucket, the mean of each figure (the
    downsampling job writes these before the retention job drops the raw rows)."""

    __tablename__ = "node_report_rollups"
    __table_args__ = (UniqueConstraint("node_id", "step_s", "bucket_s"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id", ondelete="CASCADE"))
    step_s: Mapped[float]
    bucket_s: Mapped[float]
    num_reports: Mapped[int] = mapped_column(Integer)
    figures: Mapped[dict[str, Any]]


# The figures a report carries that history aggregates (per node and bucket), and those of them
# weighted by each report's requests (the rest are plain means; throughput is time-weighted).
REPORT_FIGURES = ("emb_share", "emb_share_target", "kv_hit_rate", "emb_hit_rate", "p50_ms", "p99_ms",
                  "slo_attainment", "throughput_rps", "num_requests", "queue_depth", "refill_bytes",
                  "kv_recompute_us_per_token", "emb_transfer_us_per_row")
REQUEST_WEIGHTED = ("slo_attainment", "emb_hit_rate", "kv_hit_rate")


def bucket_sum_columns() -> list[Column]:
    """The mergeable sums one `NodeReportBucket` row keeps (adding two rows' columns gives the
    row of the union of their reports): ``num_reports``; ``sum_interval_s`` and
    ``sum_rate_x_interval`` (throughput weighted by the time each report covers); per figure
    ``sum_<f>`` and ``cnt_<f>`` (sum and count of its non-null values); per request-weighted
    figure ``wsum_<f>`` (sum of value x requests) and ``w_<f>`` (requests of the reports where it
    is not null). Sums are NULL where no report had a value, as SQL's SUM."""
    cols = [Column("num_reports", Integer, nullable=False), Column("sum_interval_s", Seconds, nullable=False),
            Column("sum_rate_x_interval", Seconds, nullable=False)]
    for f in REPORT_FIGURES:
        cols += [Column(f"sum_{f}", Seconds, nullable=True), Column(f"cnt_{f}", Integer, nullable=False)]
    for f in REQUEST_WEIGHTED:
        cols += [Column(f"wsum_{f}", Seconds, nullable=True), Column(f"w_{f}", Seconds, nullable=True)]
    return cols


class NodeReportBucket(Base):
    """Recent history pre-aggregated per node at fixed steps (`db.queries.HISTORY_STEPS`), as
    mergeable sums (`bucket_sum_columns`), kept current in each report's own transaction
    (`db.queries.insert_reports` adds the rows it inserts): a read at a step that is a multiple
    of a stored step groups these rows instead of the raw reports."""

    __table__ = Table(
        "node_report_buckets", Base.metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("node_id", String(128), ForeignKey("nodes.node_id", ondelete="CASCADE"), nullable=False),
        Column("step_s", Seconds, nullable=False),
        Column("bucket_s", Seconds, nullable=False),
        *bucket_sum_columns(),
        UniqueConstraint("node_id", "step_s", "bucket_s"),
        Index(None, "step_s", "bucket_s"),
    )


class Decision(Base):
    """One allocator decision (source base/residual/recovery/override/guard) with its reason."""

    __tablename__ = "decisions"
    __table_args__ = (UniqueConstraint("node_id", "seq"), Index(None, "ts_s"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    ts_s: Mapped[float]
    source: Mapped[str] = mapped_column(String(16))
    emb_share: Mapped[float]
    prev_emb_share: Mapped[float | None]
    reason: Mapped[str] = mapped_column(Text)
    policy_version: Mapped[str | None] = mapped_column(String(256))
    features: Mapped[dict[str, Any]]
    # each allocator layer's trace: layer, proposal, acted, detail (SQL NULL when none were sent)
    layers: Mapped[list[Any] | None] = mapped_column(JSON(none_as_null=True))


class Burst(Base):
    """A burst the node's recovery controller saw (end_s None while it lasts)."""

    __tablename__ = "bursts"
    __table_args__ = (UniqueConstraint("node_id", "start_s"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id", ondelete="CASCADE"))
    start_s: Mapped[float]
    end_s: Mapped[float | None]
    magnitude: Mapped[float]


class RouterWeightsVersion(Base):
    """One version of the cluster's router weights, with its inputs and why it changed."""

    __tablename__ = "router_weights"
    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    computed_at_s: Mapped[float]
    nodes: Mapped[dict[str, Any]]  # node_id -> CostProfile fields + reason (the push payload)
    inputs: Mapped[dict[str, Any]]  # node_id -> where each cost came from
    reason: Mapped[str] = mapped_column(Text)


class Router(Base):
    """A registered gateway; the weights job pushes each new version to ``url`` with
    ``Authorization: Bearer <push token>``, the token derived from the control plane's secret key,
    the URL and ``token_id`` (`control_plane.auth.push_token_for`): no secret is stored here."""

    __tablename__ = "routers"
    url: Mapped[str] = mapped_column(String(512), primary_key=True)
    registered_at_s: Mapped[float]
    pushed_version: Mapped[int | None] = mapped_column(Integer)
    last_push_s: Mapped[float | None]
    last_error: Mapped[str | None] = mapped_column(Text)
    token_id: Mapped[int | None] = mapped_column(Integer)  # the router token that registered it (0009)


class Override(Base):
    """An operator's emb_share override for one node (node_id) or the cluster (node_id None).
    ``state``: "active", "cleared" (by an operator) or "expired" (by the expiry job)."""

    __tablename__ = "overrides"
    # one active override per node and one for the cluster (migration 0009)
    __table_args__ = (Index(None, "state"),
                      Index("uq_overrides_one_active", text("coalesce(node_id, '*')"), unique=True,
                            sqlite_where=text("state = 'active'"), postgresql_where=text("state = 'active'")))
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[str | None] = mapped_column(String(128))
    emb_share: Mapped[float]
    reason: Mapped[str] = mapped_column(Text)
    created_by: Mapped[str] = mapped_column(String(128))
    created_at_s: Mapped[float]
    expires_at_s: Mapped[float | None]
    state: Mapped[str] = mapped_column(String(16), default="active")
    ended_at_s: Mapped[float | None]


class Policy(Base):
    """A policy artifact (the files `racer policy export` writes, stored as one tar) and its
    manifest. ``version`` is the manifest's policy_id. ``status``: "registered", "active",
    "canary", "retired", "rolled_back"."""

    __tablename__ = "policies"
    __table_args__ = (Index("uq_policies_one_active", "status", unique=True, sqlite_where=text("status = 'active'"),
                            postgresql_where=text("status = 'active'")),)  # one active policy (0009)
    version: Mapped[str] = mapped_column(String(256), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64))
    artifact: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)  # loaded when read: /summary's
    manifest: Mapped[dict[str, Any]]                                      # active_policy needs the version only
    evaluation: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), default="registered")
    uploaded_by: Mapped[str] = mapped_column(String(128))
    uploaded_at_s: Mapped[float]


class ModelVersion(Base):
    """A model checkpoint (the directory `racer model train` writes, stored as one canonical tar)
    and its manifest. ``version`` is the checkpoint's own digest (the manifest's ``digest``, what
    a node reports as the model it serves). ``status`` as for policies: "registered", "active",
    "canary", "retired", "rolled_back"."""

    __tablename__ = "models"
    __table_args__ = (Index("uq_models_one_active", "status", unique=True, sqlite_where=text("status = 'active'"),
                            postgresql_where=text("status = 'active'")),)  # one active model (0009)
    version: Mapped[str] = mapped_column(String(64), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64))  # SHA-256 of the stored tar (what a node checks on download)
    artifact: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)
    manifest: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), default="registered")
    uploaded_by: Mapped[str] = mapped_column(String(128))
    uploaded_at_s: Mapped[float]


class Rollout(Base):
    """A canary rollout of a candidate over ``baseline_version``: ``kind`` "policy" (the candidate
    is ``policy_version``) or "model" (``model_version``, a checkpoint digest). ``state``: "pending"
    (waiting for the canary nodes to load the candidate), "baking", "paused", "promoted",
    "rolled_back" (the last two are final); see `control_plane.rollout`."""

    __tablename__ = "rollouts"
    # one open rollout of each kind (0009)
    __table_args__ = (Index(None, "state"),
                      Index("uq_rollouts_one_open", "kind", unique=True,
                            sqlite_where=text("state IN ('pending', 'baking', 'paused')"),
                            postgresql_where=text("state IN ('pending', 'baking', 'paused')")))
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16), default="policy", server_default="policy")
    policy_version: Mapped[str | None] = mapped_column(ForeignKey("policies.version"))
    model_version: Mapped[str | None] = mapped_column(ForeignKey("models.version"))
    baseline_version: Mapped[str | None] = mapped_column(String(256))
    state: Mapped[str] = mapped_column(String(16))
    config: Mapped[dict[str, Any]]
    created_by: Mapped[str] = mapped_column(String(128))
    created_at_s: Mapped[float]
    bake_started_s: Mapped[float | None]
    paused_from: Mapped[str | None] = mapped_column(String(16))
    updated_at_s: Mapped[float]
    reason: Mapped[str] = mapped_column(Text, default="")
    verdict: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    # an UPDATE applies only where the row is still in the state it was read in (a parallel
    # transition that got there first makes it a StaleDataError: one of the two wins)
    __mapper_args__ = {"version_id_col": state, "version_id_generator": False}


class RolloutNode(Base):
    """A node's part in a rollout: role "canary" or "baseline"; status "assigned", "loaded"
    or "failed" (with the node's error); ``prev_version`` is what it ran when the rollout began."""

    __tablename__ = "rollout_nodes"
    __table_args__ = (UniqueConstraint("rollout_id", "node_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id", ondelete="CASCADE"))
    node_id: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default="assigned")
    prev_version: Mapped[str | None] = mapped_column(String(256))
    error: Mapped[str | None] = mapped_column(Text)
    updated_at_s: Mapped[float]


class RolloutStep(Base):
    """Every transition and judgement of a rollout (who/what, state before and after, why)."""

    __tablename__ = "rollout_steps"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id", ondelete="CASCADE"), index=True)
    ts_s: Mapped[float]
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(32))
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    details: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class AuditEntry(Base):
    """Every operator (and system) action: who, what, on what, before, after, why."""

    __tablename__ = "audit_log"
    __table_args__ = (Index(None, "ts_s"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    ts_s: Mapped[float]
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(256))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    reason: Mapped[str] = mapped_column(Text, default="")


class Token(Base):
    """A bearer token, stored as the sha256 of its text (tokens are 256-bit random strings).
    A token of role node is bound to one ``node_id`` (the only node it may act as); None on
    every other role, and on node tokens made before the binding existed (refused on node routes)."""

    __tablename__ = "tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    node_id: Mapped[str | None] = mapped_column(String(128), index=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at_s: Mapped[float]
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)


class JobRun(Base):
    """One run of a scheduled job by the leader replica ``instance`` (timing and outcome)."""

    __tablename__ = "job_runs"
    __table_args__ = (Index(None, "job", "started_s"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job: Mapped[str] = mapped_column(String(64))
    instance: Mapped[str] = mapped_column(String(128))
    started_s: Mapped[float]
    duration_s: Mapped[float]
    ok: Mapped[bool] = mapped_column(Boolean)
    error: Mapped[str | None] = mapped_column(Text)
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class SchedulerLease(Base):
    """The scheduler lease (one row per cluster) where advisory locks are not available; on
    PostgreSQL the leader holds a session advisory lock and this row only records who leads."""

    __tablename__ = "scheduler_lease"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    acquired_s: Mapped[float]
    renewed_s: Mapped[float]


class WhatIfRun(Base):
    """One what-if replay of a stored window of traffic samples through the simulator
    (`control_plane.whatif`). ``state``: "running", "done" or "failed" (``error`` says why); at
    most one running at a time (a partial unique index, 0013). ``progress`` (0..1) and
    ``progress_note`` move while it runs, ``updated_s`` with them (a running row whose worker
    stopped without a word is failed once it is older than the run's time limit). Versioned by
    what made it: the window (``window_start_s`` / ``window_end_s``, and ``cut`` when the window
    was cut to fit), the fleet and cost profile it ran on (``profile``), the code (``code_version``).
    ``result``: the table per configuration, per phase, and the findings (`simulator.sampled`)."""

    __tablename__ = "whatif_runs"
    __table_args__ = (Index(None, "created_at_s"),
                      Index("uq_whatif_runs_one_running", "state", unique=True,
                            sqlite_where=text("state = 'running'"), postgresql_where=text("state = 'running'")))
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    state: Mapped[str] = mapped_column(String(16))
    created_by: Mapped[str] = mapped_column(String(128))
    created_at_s: Mapped[float]
    updated_s: Mapped[float]
    finished_s: Mapped[float | None]
    window_start_s: Mapped[float]
    window_end_s: Mapped[float]
    candidate: Mapped[str | None] = mapped_column(String(256))  # a policy version asked for by name
    progress: Mapped[float] = mapped_column(default=0.0)
    progress_note: Mapped[str] = mapped_column(Text, default="")
    num_samples: Mapped[int | None] = mapped_column(Integer)
    cut: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    profile: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    code_version: Mapped[str | None] = mapped_column(String(64))
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
