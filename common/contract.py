"""The wire contract between a node agent and the control plane (pydantic v2): what a node sends
(its registration with its cost profile and device, one report per control interval with the
allocator's decision, the decision's layer traces and the bursts seen, the outcome of a policy
or model load) and what it is told (its registration's answer, the directives).

Both sides use this one definition: the node bounds what it builds with these limits
(`node_agent.reports`, `node_agent.registration`, `node_agent.directives`, the allocator's layer
traces `node_agent.allocator.trace`), the control plane validates what it receives with these
models (`control_plane.routes`: registration, reports, directives, confirmations) and answers
with them. It imports neither side.

Inputs (`In`) forbid unknown fields, are strict (a boolean is not a number, nor a number a
string) and check ranges, so a bad payload gets a 422 naming the field and nothing is stored;
every number a node reports has a physical range.
"""

from __future__ import annotations

import enum
import math
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from .ids import ID_PATTERN
# a cost profile's physical ranges: those the router weights' `CostProfile` holds
from .weights import MAX_EMB_TRANSFER_US_PER_ROW, MAX_KV_RECOMPUTE_US_PER_TOKEN, MAX_QUEUE_CAPACITY, MAX_SERVICE_TIME_US

API = "/api/v1"  # the control plane's base path

INT64_MAX = 2**63 - 1  # the largest integer both databases store (SQLite and PostgreSQL BIGINT)
MAX_SEQ = 2**31 - 1  # a report's seq (and its other 32-bit counts: num_requests, refill_bytes) at most
MAX_REPORT_BATCH = 1000  # reports in one POST
MAX_SEND_PERIOD_S = 60.0  # the longest a node waits between sends of its reports
MAX_BURSTS_PER_REPORT = 100
MAX_REASON_CHARS = 2000  # a decision's reason in words
MAX_ERROR_CHARS = 4000  # why a policy or model failed to load

# ---- the allocator's decision and its layers
DECISION_SOURCES = ("base", "residual", "recovery", "override", "guard")
# a decision composes the layers in this order; each reports a trace (`node_agent.allocator.trace.LayerTrace`)
LAYERS = ("base", "residual", "curve", "recovery", "override", "guard")
# what a decision's traces may carry off the node: the node bounds them so (`node_agent.reports`),
# the control plane refuses more (`LayerIn`); at most one trace per layer
MAX_DETAIL_FIGURES = 16
MAX_DETAIL_NAME_CHARS = 64
MAX_DETAIL_TEXT_CHARS = 500
MAX_PROPOSAL_ABS = 10.0  # before the guards a proposal may lie outside [0, 1]

# each layer's detail, by name, in the order of `LayerTrace.values` (documented at each layer's function)
DETAIL_FIELDS = {
    "base": ("policy_id", "output", "hold_reason"),
    "residual": ("correction", "offset", "tuner_action", "tuner_step", "tuner_gradient", "tuner_mean_gradient",
                 "tuner_gradient_se", "tuner_sign_test", "load"),
    "curve": ("action", "min_share", "cost_min_us", "cost_proposal_us", "cost_prev_us", "gain", "emb_refs",
              "kv_lookups", "kv_refused", "proposal_in", "curve", "taken_back"),
    "recovery": ("phase", "event", "cap", "capped", "rate_ratio", "hot_ratio", "burst_started_s", "entry_emb_share",
                 "kv_shift", "proposal_in", "source_in", "cap_declined"),
    "override": ("active", "emb_share", "reason", "expires_at_s", "proposal_in", "source_in"),
    "guard": ("action", "limit", "prev", "proposal_in", "source_in", "step_limit", "taken_back"),
}

# the allocator's guard bounds by default (`node_agent.allocator.GuardConfig`): an override outside
# them is refused by the control plane unless its settings say other bounds
DEFAULT_MIN_EMB_SHARE = 0.05
DEFAULT_MAX_EMB_SHARE = 0.95


def curve_text(shares, cost_us) -> str:
    """The curve layer's ``curve`` detail: the expected time per request (µs) at each share, as
    ``"0.05:812.3 0.10:790.1 ..."``."""
    return " ".join(f"{s:.2f}:{c:.1f}" for s, c in zip(shares, cost_us))


def parse_curve_text(text: str) -> list[tuple[float, float]]:
    """The ``curve`` detail back into ``[(share, µs)]`` (malformed pairs are skipped)."""
    out = []
    for pair in str(text or "").split():
        a, sep, b = pair.partition(":")
        try:
            s, c = float(a), float(b)
        except ValueError:
            continue
        if sep and math.isfinite(s) and math.isfinite(c):
            out.append((s, c))
    return out


# ---- what a node's figures are (`node_agent.engine.Engine.device_info`): measured on a device,
# measured with the EMB link's time emulated, or the time of an emulated device's cost profile (modelled)
DEVICE_MODES = ("real", "link-emulated", "emulated")
DEVICE_TIMES = ("measured", "modelled")
MAX_DEVICE_TEXT_CHARS = 128  # a device's label and an emulated device's profile name
MAX_TIME_SCALE = 1e6  # wall seconds per modelled second


# ---- types
Finite = Annotated[float, Field(allow_inf_nan=False)]
NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Unit = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
NodeId = Annotated[str, Field(min_length=1, max_length=128, pattern=ID_PATTERN)]
PolicyId = Annotated[str, Field(min_length=1, max_length=128, pattern=ID_PATTERN)]
Version = PolicyId  # a policy's version: its policy_id (common.ids; a model's digest fits it too)
ModelDigest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]  # a checkpoint's digest (its manifest's)
DeviceMode = Literal[DEVICE_MODES]
DeviceText = Annotated[str, Field(min_length=1, max_length=MAX_DEVICE_TEXT_CHARS)]
# a report's time (Unix s): bounded so that bucketing it (floor(ts_s / step_s), step_s >= 1 ms) stays
# within 64-bit integers on every database
ReportTime = Annotated[float, Field(ge=0, le=1e11, allow_inf_nan=False)]


def _check_text(v, depth: int = 0) -> None:
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode text (a lone surrogate is not)") from None
        if "\x00" in v:
            raise ValueError("must not contain NUL (\\u0000)")
    elif depth < 4 and isinstance(v, dict):
        for k, x in v.items():
            _check_text(k, depth + 1)
            _check_text(x, depth + 1)
    elif depth < 4 and isinstance(v, list):
        for x in v:
            if isinstance(x, (str, dict, list)):
                _check_text(x, depth + 1)


def _checked_text(v):
    _check_text(v)
    return v


_TEXT_CHECK = AfterValidator(_checked_text)


def _may_hold_text(tp) -> bool:
    """Whether a value of annotation ``tp`` can carry a string (itself, or as a key or value of a
    mapping or list): str, Any, an untyped or str-keyed container, a union with one of them; not
    a number, a boolean, a Literal (its values are fixed), None or a model (which checks its own
    fields). Anything else counts as text (the check is harmless on other values)."""
    if tp in (str, Any, object, dict, list, tuple, set, frozenset):
        return True
    if tp in (float, int, bool, type(None)):
        return False
    origin = get_origin(tp)
    if origin is Literal:
        return False
    if origin is Annotated:
        return _may_hold_text(get_args(tp)[0])
    if origin is not None:
        return any(_may_hold_text(a) for a in get_args(tp) if a is not Ellipsis)
    if isinstance(tp, type) and (issubclass(tp, (BaseModel, enum.Enum))):
        return False
    return True


class In(BaseModel):
    """An input: extra fields refused; strict (a boolean is not a number, nor a number a string;
    an integer is still a float); and every string, also as a key or value of a mapping or list,
    must be text that can be stored and echoed: JSON's ``\\ud800`` (a lone surrogate) parses into
    one that cannot be encoded as UTF-8, and PostgreSQL's text refuses NUL (``\\u0000``). The
    text check is attached to the fields that can hold a string only (`_may_hold_text`; a check
    on every field cost a report batch 22 Python calls a report)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        changed = False
        for f in cls.model_fields.values():
            if _may_hold_text(f.annotation) and not any(m is _TEXT_CHECK for m in f.metadata):
                f.metadata.append(_TEXT_CHECK)
                changed = True
        if changed:
            cls.model_rebuild(force=True)


class Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


# ---- registration
def _cost(limit: float):
    """A cost in µs: a number (not a boolean or a string), finite, in [0, limit] (a physical range)."""
    return Annotated[float, Field(ge=0, le=limit, allow_inf_nan=False, strict=True)]


class DeviceInfoIn(In):
    """What a node's figures are (`node_agent.engine.Engine.device_info`, bounded by
    `node_agent.reports.device_info`): ``mode``; ``time`` measured or modelled; the ``label``
    shown; an emulated device's cost ``profile``, its ``time_scale`` (wall seconds per modelled
    second) and whether the profile was ``calibrated`` (measured on a device) or is a preset."""
    mode: DeviceMode
    time: Literal[DEVICE_TIMES] | None = None
    label: DeviceText | None = None
    profile: DeviceText | None = None
    time_scale: Annotated[float, Field(gt=0, le=MAX_TIME_SCALE, allow_inf_nan=False)] | None = None
    calibrated: bool | None = None


class CostProfileIn(In):
    """A node's cost profile, within physical ranges (`common.weights.PROFILE_LIMITS`)."""
    kv_recompute_us_per_token: _cost(MAX_KV_RECOMPUTE_US_PER_TOKEN)
    emb_transfer_us_per_row: _cost(MAX_EMB_TRANSFER_US_PER_ROW)
    service_time_us: _cost(MAX_SERVICE_TIME_US)
    queue_capacity: Annotated[int, Field(ge=1, le=MAX_QUEUE_CAPACITY, strict=True)] = 64
    # the HBM arena's size (shown by the dashboard; the weights do not use it), at most 1 PiB
    arena_bytes: Annotated[int, Field(ge=1, le=2**50, strict=True)] | None = None
    # the device's memory as the node saw it at registration: its bookkeeping outside the arena,
    # and where the device reports them (CUDA) its total and free bytes (absent: not reported)
    metadata_bytes: Annotated[int, Field(ge=0, le=2**50, strict=True)] | None = None
    device_total_bytes: Annotated[int, Field(ge=1, le=2**50, strict=True)] | None = None
    device_free_bytes: Annotated[int, Field(ge=0, le=2**50, strict=True)] | None = None
    # the digest of the model checkpoint the node serves (racer node-agent --model; absent: random weights)
    model_digest: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    # what the node's figures are (absent: an agent that does not say; unknown)
    device: DeviceInfoIn | None = None


class RegisterIn(In):
    node_id: NodeId
    address: Annotated[str, Field(min_length=1, max_length=512, pattern=r"^https?://")]
    device: Annotated[str, Field(min_length=1, max_length=MAX_DEVICE_TEXT_CHARS)]
    cost_profile: CostProfileIn
    policy_version: Version | None = None
    started_at_s: ReportTime | None = None  # when the agent process started (wall s): a new one is a restart


class RegisterOut(Out):
    node_id: str
    report_interval_s: float
    # how often the node sends its reports and pulls its directives (None: every control step)
    send_period_s: float | None = None
    last_report_seq: int | None = None  # highest seq stored for the node: a node that lost its state continues above it


# ---- reports
# one figure of an allocator layer's detail: a name, a flag, a finite number or nothing
DetailValue = Annotated[str, Field(max_length=MAX_DETAIL_TEXT_CHARS)] | bool | Finite | None


class LayerIn(In):
    """One allocator layer's part in a decision (`node_agent.allocator.LayerTrace`): the layer,
    the proposal it handed on (before the guards it may lie outside [0, 1]), whether it set the
    decision's source, and its inputs and figures by name (``DETAIL_FIELDS[layer]``)."""
    layer: Literal[LAYERS]
    proposal: Annotated[float, Field(ge=-MAX_PROPOSAL_ABS, le=MAX_PROPOSAL_ABS, allow_inf_nan=False)] | None = None
    acted: bool = False
    detail: Annotated[dict[Annotated[str, Field(max_length=MAX_DETAIL_NAME_CHARS)], DetailValue],
                      Field(max_length=MAX_DETAIL_FIGURES)] = Field(default_factory=dict)


class DecisionIn(In):
    source: Literal[DECISION_SOURCES]
    emb_share: Unit
    reason: Annotated[str, Field(max_length=MAX_REASON_CHARS)] = ""
    prev_emb_share: Unit | None = None
    features: Annotated[dict[Annotated[str, Field(max_length=64)], Finite], Field(max_length=64)] = \
        Field(default_factory=dict)
    layers: Annotated[list[LayerIn], Field(max_length=len(LAYERS))] = Field(default_factory=list)


class BurstIn(In):
    start_s: Finite
    end_s: Finite | None = None
    magnitude: Finite = 0.0


class ReportIn(In):
    """One control interval of one node. Figures that had no requests in the window are null."""

    seq: Annotated[int, Field(ge=0, lt=MAX_SEQ + 1)]
    ts_s: ReportTime
    interval_s: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    emb_share: Unit
    emb_share_target: Unit
    kv_hit_rate: Unit | None = None
    emb_hit_rate: Unit | None = None
    p50_ms: NonNeg | None = None
    p99_ms: NonNeg | None = None
    slo_attainment: Unit | None = None
    throughput_rps: NonNeg = 0.0
    num_requests: Annotated[int, Field(ge=0, lt=MAX_SEQ + 1)] = 0
    queue_depth: NonNeg = 0.0
    refill_bytes: Annotated[int, Field(ge=0, lt=MAX_SEQ + 1)] = 0
    kv_recompute_us_per_token: _cost(MAX_KV_RECOMPUTE_US_PER_TOKEN) | None = None
    emb_transfer_us_per_row: _cost(MAX_EMB_TRANSFER_US_PER_ROW) | None = None
    policy_version: Version | None = None
    decision: DecisionIn | None = None
    bursts: Annotated[list[BurstIn], Field(max_length=MAX_BURSTS_PER_REPORT)] = Field(default_factory=list)
    # reports the node has dropped so far (its spool's bound, an unreadable file, a disk that
    # refused them beyond the in-memory bound): a counter, kept by the node across restarts
    num_reports_dropped: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    # the checkpoint served in the window (null: random weights) and the window's online quality:
    # mean of 1 - rank / num_candidates of the users' next items (null: none known)
    model_digest: ModelDigest | None = None
    model_quality: Unit | None = None
    # what the figures are: measured (real, link-emulated) or modelled by an emulated device's
    # cost profile (its name); null: the node does not say
    device_mode: DeviceMode | None = None
    device_profile: DeviceText | None = None


def distinct_seq(field: str, items: list) -> list:
    """A batch's items (each with a ``seq``) if their seqs are distinct; a ValueError naming
    ``field`` otherwise (a batch is stored exactly once per seq)."""
    seqs = [r.seq for r in items]
    if len(set(seqs)) != len(seqs):
        raise ValueError(f"{field}: seq values must be distinct within a batch")
    return items


class ReportBatchIn(In):
    reports: Annotated[list[ReportIn], Field(min_length=1, max_length=MAX_REPORT_BATCH)]

    @field_validator("reports")
    @classmethod
    def _distinct_seq(cls, v: list[ReportIn]) -> list[ReportIn]:
        return distinct_seq("reports", v)


class ReportBatchOut(Out):
    stored: int
    duplicates: int


# ---- directives and their confirmations
class OverrideDirective(Out):
    override_id: int
    emb_share: float
    expires_at_s: float | None
    reason: str
    scope: Literal["node", "cluster"]


class PolicyDirective(Out):
    version: str
    digest: str
    download_url: str
    rollout_id: int | None = None


class ModelDirective(Out):
    version: str  # the checkpoint's digest
    digest: str  # SHA-256 of the tar served at download_url
    download_url: str
    rollout_id: int | None = None


class DirectivesOut(Out):
    node_id: str
    now_s: float
    report_interval_s: float
    send_period_s: float | None = None  # as in RegisterOut: the node follows a change here
    override: OverrideDirective | None
    policy: PolicyDirective | None
    model: ModelDirective | None = None


class ModelLoadedIn(In):
    model_version: ModelDigest
    status: Literal["loaded", "failed"]
    error: Annotated[str, Field(max_length=MAX_ERROR_CHARS)] | None = None


class PolicyLoadedIn(In):
    policy_version: Version
    status: Literal["loaded", "failed"]
    error: Annotated[str, Field(max_length=MAX_ERROR_CHARS)] | None = None


# ==== what a gateway sends the control plane
# A gateway reports what its clients see (``POST /api/v1/gateways/{gateway_id}/reports``, built by
# `gateway.client_view.ClientView`) and sends the traffic it samples for a what-if replay (``POST
# /api/v1/gateways/{gateway_id}/samples``, built by `gateway.traffic_sample.Sampler`); the control
# plane validates both bodies (`control_plane.routes.gateways`, `control_plane.schemas`) against
# these figures.

# ---- client reports
#: the outcomes a report counts requests under
OUTCOMES = ("ok", "client_error", "too_large", "no_live_node", "upstream_error", "upstream_timeout")
MAX_PHASES = 16  # distinct phase names per interval; more are counted under "other"
MAX_NODES = 256

# ---- traffic samples
#: most hashed ids in one list of a sample (the control plane refuses more; the node's default
#: max_history_len and max_candidates are 4096)
MAX_SAMPLE_ITEMS = 4096
#: most samples in one batch the control plane takes
MAX_SAMPLE_BATCH = 500
#: most history a sample may name (its ``history_len``; the node's requests are 4 MiB at most)
MAX_SAMPLE_HISTORY_LEN = 1 << 24
#: most candidates a sample may name (the node agent's own bound)
MAX_SAMPLE_CANDIDATES = 1 << 20
