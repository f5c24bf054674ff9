"""What clients see, as the gateways report it.

    POST /api/v1/gateways/{gateway_id}/reports   a gateway's report batch (role router or operator)
    GET  /api/v1/gateways                        every reporting gateway, its newest report, staleness
    GET  /api/v1/gateway-reports                 the reports over a time range (the dashboard's history)
    POST /api/v1/gateways/{gateway_id}/samples   a gateway's traffic samples (role router or operator)
    GET  /api/v1/traffic-samples                 the samples over a time range, paged (a replay's input)

A gateway (`gateway.gateway`, with ``--control-plane``) sends one report per interval
(`gateway.client_view.ClientView`; the bounds both sides hold it to: `common.contract`):
end-to-end P50/P99, SLO attainment as clients see it, outcomes (served, 4xx, 413, 503 no live node,
502, 504), retries, per-node attempts and queueing before the node, and the load phase its clients
named. Storage is idempotent on (gateway_id, seq): a batch replayed after a lost answer stores
nothing twice. The first token that reports as a gateway id claims it: another token may not report
as that id while the first is valid (as a node id is bound to its token). The body is capped by
`control_plane.gate` before it is read (``max_body_bytes``) and every number has a physical range,
so hostile input gets a 4xx.

Traffic samples (`gateway.traffic_sample`: requests of the users a gateway samples, every id
a keyed hash) are bound to the gateway id the same way (the token whose first report or sample
batch claimed it), idempotent on (gateway_id, seq), capped at ``max_sample_body_bytes`` (413), and
refused (422) with a time more than `MAX_SAMPLE_AHEAD_S` ahead of the control plane's clock (so
retention by time keeps its bound). The retention job keeps them ``sample_retention_s`` and at most
``sample_max_rows`` (`control_plane.jobs.job_retention`).
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from pydantic import Field, field_validator, model_validator
from sqlalchemy.exc import IntegrityError

from common.contract import INT64_MAX, MAX_NODES, MAX_PHASES, OUTCOMES, In, NodeId, Out, ReportTime, Unit, distinct_seq
from db import queries
from db.models import GatewayReport, TrafficSample

from ..auth import Principal
from ..schemas import (TrafficSampleBatchIn, TrafficSampleBatchOut, TrafficSampleCursor, TrafficSampleOut,
                       TrafficSamplePage)
from .deps import OPERATOR, ROUTER, VIEWER, errors, invalid, principal, roles

Count = Annotated[int, Field(ge=0, lt=2**31)]
Ms = Annotated[float, Field(ge=0, le=1e7, allow_inf_nan=False)]  # up to ~3 hours
PhaseName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:+\[\]\- ]+$")]
StatusCode = Annotated[str, Field(pattern=r"^[1-5][0-9][0-9]$")]
GatewayId = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$",
                                description="the gateway's id (its --gateway-id)")]
MAX_BATCH = 120


class OutcomeIn(In):
    num_requests: Count
    p50_ms: Ms | None = None
    p99_ms: Ms | None = None


class GatewayNodeIn(In):
    """One node as the gateway saw it over the interval (``live``: in rotation at its end)."""
    node_id: NodeId
    num_attempts: Count = 0
    num_failed: Count = 0
    upstream_p99_ms: Ms | None = None
    pre_node_p50_ms: Ms | None = None
    pre_node_p99_ms: Ms | None = None
    max_inflight: Count = 0
    live: bool | None = None


class GatewayReportIn(In):
    """One report interval of a gateway (see `gateway.client_view`). Null: no data."""
    seq: Annotated[int, Field(ge=0, le=INT64_MAX)]
    ts_s: ReportTime
    interval_s: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)]
    slo_ms: Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]
    num_requests: Count
    num_ok: Count = 0
    num_failed: Count = 0
    num_retried: Count = 0
    num_503: Count = 0
    p50_ms: Ms | None = None
    p99_ms: Ms | None = None
    slo_attainment: Unit | None = None
    outcomes: Annotated[dict[Literal[OUTCOMES], OutcomeIn], Field(max_length=len(OUTCOMES))] = Field(
        default_factory=dict)
    statuses: Annotated[dict[StatusCode, Count], Field(max_length=64)] = Field(default_factory=dict)
    nodes: Annotated[list[GatewayNodeIn], Field(max_length=MAX_NODES)] = Field(default_factory=list)
    num_live_nodes: Count | None = None
    num_nodes: Count | None = None
    load_phase: PhaseName | None = None
    phases: Annotated[dict[PhaseName, Count], Field(max_length=MAX_PHASES + 1)] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self):
        for name in ("num_ok", "num_failed", "num_retried", "num_503"):
            if getattr(self, name) > self.num_requests:
                raise ValueError(f"{name} ({getattr(self, name)}) exceeds num_requests ({self.num_requests})")
        if self.num_ok + self.num_failed > self.num_requests:
            raise ValueError("num_ok + num_failed exceeds num_requests")
        if sum(o.num_requests for o in self.outcomes.values()) > self.num_requests:
            raise ValueError("outcomes: the counts add up to more than num_requests")
        return self


class GatewayReportBatchIn(In):
    reports: Annotated[list[GatewayReportIn], Field(min_length=1, max_length=MAX_BATCH)]

    @field_validator("reports")
    @classmethod
    def _distinct_seq(cls, v: list[GatewayReportIn]) -> list[GatewayReportIn]:
        return distinct_seq("reports", v)


class GatewayReportBatchOut(Out):
    stored: int
    duplicates: int


class GatewayReportOut(Out):
    gateway_id: str
    seq: int
    ts_s: float
    received_s: float
    interval_s: float
    num_requests: int
    num_ok: int
    num_failed: int
    num_retried: int
    num_503: int
    p50_ms: float | None
    p99_ms: float | None
    slo_ms: float
    slo_attainment: float | None
    num_live_nodes: int | None
    load_phase: str | None
    details: dict


class GatewayOut(Out):
    """A reporting gateway. ``stalled``: no report for more than twice its interval (one whole
    interval missed); ``last_report``: its newest report (None: none stored)."""
    gateway_id: str
    first_seen_s: float
    last_seen_s: float
    last_seq: int | None
    interval_s: float
    age_s: float
    stalled: bool
    last_report: GatewayReportOut | None


def _report_out(r: GatewayReport) -> GatewayReportOut:
    return GatewayReportOut.model_validate(r)


def _refuse_another_token(s, gateway_id: str, p: Principal) -> None:
    """403 when ``gateway_id`` is bound to another token that is still valid (its first report or
    sample batch claimed it)."""
    gw = queries.gateway(s, gateway_id)
    if (gw is not None and gw.token_id is not None and gw.token_id != p.token_id
            and queries.token_valid(s, gw.token_id)):
        raise HTTPException(403, f"gateway id {gateway_id!r} reports with another token (id {gw.token_id}, "
                                 f"still valid): this token (id {p.token_id}) may not report as it; give "
                                 f"this gateway another --gateway-id, or revoke the other token")


router = APIRouter()


@router.post("/gateways/{gateway_id}/reports", response_model=GatewayReportBatchOut, responses=errors(409, 413),
             **roles(ROUTER, OPERATOR))
def gateway_reports_in(gateway_id: GatewayId, body: GatewayReportBatchIn, request: Request,
                       p: principal(ROUTER, OPERATOR)):
    """Store a gateway's report batch (idempotent on (gateway_id, seq)); the first token that
    reports as ``gateway_id`` claims it."""
    now = request.app.state.clock()
    rows = []
    for rep in body.reports:
        d = rep.model_dump()
        details = {k: d.pop(k) for k in ("outcomes", "statuses", "nodes", "phases", "num_nodes")}
        rows.append({**d, "gateway_id": gateway_id, "received_s": now, "details": details})
    last = max(body.reports, key=lambda x: x.seq)
    try:
        with request.app.state.factory.begin() as s:
            _refuse_another_token(s, gateway_id, p)
            queries.touch_gateway(s, gateway_id=gateway_id, token_id=p.token_id, now_s=now, last_seq=last.seq,
                                  interval_s=last.interval_s)
            inserted = queries.insert_gateway_reports(s, rows)
    except IntegrityError:  # two first reports of one new id at once: the client retries
        raise HTTPException(409, f"gateway id {gateway_id!r} was claimed concurrently; retry") from None
    return GatewayReportBatchOut(stored=len(inserted), duplicates=len(rows) - len(inserted))


@router.get("/gateways", response_model=list[GatewayOut], **roles(OPERATOR, VIEWER))
def gateways(request: Request):
    """Every gateway that has reported, newest report included, with its age and whether it stalled."""
    now = request.app.state.clock()
    with request.app.state.factory() as s:
        out = []
        for gw, last in queries.list_gateways(s):
            age = max(0.0, now - gw.last_seen_s)
            out.append(GatewayOut(gateway_id=gw.gateway_id, first_seen_s=gw.first_seen_s, last_seen_s=gw.last_seen_s,
                                  last_seq=gw.last_seq, interval_s=gw.interval_s, age_s=age,
                                  stalled=age > 2 * gw.interval_s,
                                  last_report=None if last is None else _report_out(last)))
        return out


@router.get("/gateway-reports", response_model=list[GatewayReportOut], **roles(OPERATOR, VIEWER))
def gateway_report_history(request: Request,
                           gateway_id: Annotated[str | None, Query(max_length=128)] = None,
                           start_s: Annotated[float | None, Query(ge=0, le=1e11)] = None,
                           end_s: Annotated[float | None, Query(ge=0, le=1e11)] = None,
                           limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
                           details: Annotated[bool, Query(description="false: without the per-outcome, "
                                                                       "per-node and per-phase details")] = True):
    """Gateway reports with ``start_s <= ts_s < end_s``, oldest first (at most the newest ``limit``)."""
    with request.app.state.factory() as s:
        rows = [_report_out(r) for r in queries.gateway_reports(s, gateway_id=gateway_id, start_s=start_s,
                                                                end_s=end_s, limit=limit)]
    if not details:
        for r in rows:
            r.details = {}
    return rows


# ----------------------------------------------------------------------------- traffic samples ---
#: a sample's time may run ahead of the control plane's clock by this much (clock skew), no more
MAX_SAMPLE_AHEAD_S = 600.0
#: most samples, and most hashed ids, one page of GET /traffic-samples returns
MAX_SAMPLE_PAGE = 5000
MAX_SAMPLE_PAGE_IDS = 1_000_000


async def _sample_body_cap(request: Request) -> None:
    """413 for a sample batch over ``max_sample_body_bytes`` (the gate has read it, at most
    ``max_body_bytes``), before its JSON is validated."""
    cap = request.app.state.settings.max_sample_body_bytes
    n = len(await request.body())
    if n > cap:
        raise HTTPException(413, f"body: {n} bytes exceeds {cap} bytes (the control plane's max_sample_body_bytes, "
                                 f"RACER_MAX_SAMPLE_BODY_BYTES)")


def _pack(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype=np.int64).astype("<i8", copy=False).tobytes()


def _unpack(blob: bytes | None) -> list[int]:
    return np.frombuffer(blob or b"", dtype="<i8").tolist()


def _sample_out(r: TrafficSample) -> TrafficSampleOut:
    return TrafficSampleOut(id=r.id, gateway_id=r.gateway_id, seq=r.seq, ts_s=r.ts_s, received_s=r.received_s,
                            user_hash=r.user_hash, history_len=r.history_len, items=_unpack(r.items),
                            new_items=_unpack(r.new_items), candidates=_unpack(r.candidates),
                            num_candidates=r.num_candidates, node_id=r.node_id, status=r.status)


_SAMPLE_ROLES = roles(ROUTER, OPERATOR)


@router.post("/gateways/{gateway_id}/samples", response_model=TrafficSampleBatchOut, responses=errors(409, 413),
             dependencies=[*_SAMPLE_ROLES["dependencies"], Depends(_sample_body_cap)],
             openapi_extra=_SAMPLE_ROLES["openapi_extra"])
def traffic_samples_in(gateway_id: GatewayId, body: TrafficSampleBatchIn, request: Request,
                       p: principal(ROUTER, OPERATOR)):
    """Store a gateway's traffic samples (idempotent on (gateway_id, seq)); the first token that
    reports or samples as ``gateway_id`` claims it. No raw id is taken: every id is a keyed hash."""
    now = request.app.state.clock()
    for i, smp in enumerate(body.samples):
        if smp.ts_s > now + MAX_SAMPLE_AHEAD_S:
            raise invalid(["body", "samples", i, "ts_s"], f"{smp.ts_s} is more than {MAX_SAMPLE_AHEAD_S:g} s ahead "
                                                          f"of the control plane's clock ({now}): the gateway's "
                                                          f"clock is wrong")
    rows = [{"gateway_id": gateway_id, "seq": smp.seq, "ts_s": smp.ts_s, "received_s": now,
             "user_hash": smp.user_hash, "history_len": smp.history_len, "items": _pack(smp.items),
             "new_items": _pack(smp.new_items), "candidates": _pack(smp.candidates),
             "num_candidates": smp.num_candidates, "node_id": smp.node_id, "status": smp.status}
            for smp in body.samples]
    try:
        with request.app.state.factory.begin() as s:
            _refuse_another_token(s, gateway_id, p)
            queries.claim_gateway(s, gateway_id=gateway_id, token_id=p.token_id, now_s=now)
            stored = queries.insert_traffic_samples(s, rows)
    except IntegrityError:  # a new id claimed twice at once, or the same batch twice at once: the client retries
        raise HTTPException(409, f"gateway id {gateway_id!r}: a concurrent write won; retry") from None
    return TrafficSampleBatchOut(stored=stored, duplicates=len(rows) - stored)


@router.get("/traffic-samples", response_model=TrafficSamplePage, responses=errors(422),
            **roles(OPERATOR, VIEWER))
def traffic_samples(request: Request,
                    gateway_id: Annotated[str | None, Query(min_length=1, max_length=128,
                                                            pattern=r"^[A-Za-z0-9_.:\-]+$")] = None,
                    start_s: Annotated[float | None, Query(ge=0, le=1e11)] = None,
                    end_s: Annotated[float | None, Query(ge=0, le=1e11)] = None,
                    after_ts_s: Annotated[float | None, Query(ge=0, le=1e11, description="the cursor: the "
                                                              "previous page's next.after_ts_s")] = None,
                    after_id: Annotated[int | None, Query(ge=0, le=INT64_MAX, description="the cursor: the "
                                                          "previous page's next.after_id")] = None,
                    limit: Annotated[int, Query(ge=1, le=MAX_SAMPLE_PAGE)] = 1000):
    """Traffic samples with ``start_s <= ts_s < end_s`` in time order (then id), at most ``limit``
    and about `MAX_SAMPLE_PAGE_IDS` hashed ids a page; ``next`` is the cursor of the next page
    (null: none left)."""
    if (after_ts_s is None) != (after_id is None):
        raise invalid(["query", "after_id" if after_id is None else "after_ts_s"],
                      "after_ts_s and after_id go together (the previous page's next)")
    after = None if after_ts_s is None else (after_ts_s, after_id)
    with request.app.state.factory() as s:
        rows = queries.traffic_samples(s, gateway_id=gateway_id, start_s=start_s, end_s=end_s, after=after,
                                       limit=limit + 1)
    out, ids = [], 0
    for r in rows[:limit]:
        n = (len(r.items) + len(r.new_items) + len(r.candidates)) // 8
        if out and ids + n > MAX_SAMPLE_PAGE_IDS:
            break
        out.append(_sample_out(r))
        ids += n
    more = len(out) < len(rows)
    last = out[-1] if out else None
    return TrafficSamplePage(samples=out, next=TrafficSampleCursor(after_ts_s=last.ts_s, after_id=last.id)
                             if more and last is not None else None)
