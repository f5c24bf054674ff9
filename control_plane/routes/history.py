"""Reads of the cluster's history: reports (raw or bucketed, per node or the whole cluster), the
allocator's decisions, bursts, the summary the dashboard opens with, and the scheduled jobs' runs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from db import queries
from db.models import SchedulerLease

from ..schemas import AlertOut, BurstOut, DecisionPage, ReportOut, SummaryOut
from .deps import OPERATOR, VIEWER, Offset, PageLimit, invalid, now_s, roles, session, settings
from .rollouts import rollout_out

router = APIRouter()

Range = dict(start_s=Query(None, description="from (Unix s, inclusive)"),
             end_s=Query(None, description="to (Unix s, exclusive)"))


@router.get("/reports", response_model=list[ReportOut], **roles(OPERATOR, VIEWER))
def report_history(request: Request, node_id: str | None = None, start_s: float | None = Range["start_s"],
                   end_s: float | None = Range["end_s"],
                   step_s: Annotated[float | None, Query(ge=1e-3, le=1e9, description=(
                       "downsample: one row per node and bucket, throughput time-weighted, hit rates "
                       "request-weighted (s, 1 ms to 1e9)"))] = None,
                   limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
                   cluster: Annotated[bool, Query(description="one row per bucket for the whole cluster "
                                                               "(node_id '*'; needs step_s)")] = False):
    if cluster and (step_s is None or node_id is not None):
        raise invalid(["query", "step_s" if step_s is None else "node_id"],
                      "cluster=true needs step_s and no node_id")
    with session(request) as s:
        if cluster:
            return [ReportOut(**d) for d in queries.cluster_history(s, start_s=start_s, end_s=end_s, step_s=step_s,
                                                                    limit=limit)]
        return [ReportOut(**d) for d in queries.report_history(s, node_id=node_id, start_s=start_s, end_s=end_s,
                                                               step_s=step_s, limit=limit)]


@router.get("/decisions", response_model=DecisionPage, **roles(OPERATOR, VIEWER))
def decisions(request: Request, node_id: str | None = None,
              source: Annotated[str | None, Query(pattern="^(base|residual|recovery|override|guard)$")] = None,
              q: Annotated[str | None, Query(max_length=200, description="text in the reason or node id")] = None,
              start_s: float | None = None, end_s: float | None = None,
              offset: Offset = 0, limit: PageLimit = 100):
    with session(request) as s:
        total, rows = queries.decisions_page(s, node_id=node_id, source=source, q=q, start_s=start_s,
                                             end_s=end_s, offset=offset, limit=limit)
        return DecisionPage(total=total, offset=offset, limit=limit, items=rows)


@router.get("/bursts", response_model=list[BurstOut], **roles(OPERATOR, VIEWER))
def bursts(request: Request, node_id: str | None = None, start_s: float | None = None,
           end_s: float | None = None, limit: Annotated[int, Query(ge=1, le=10_000)] = 1000):
    with session(request) as s:
        return [BurstOut.model_validate(b) for b in queries.bursts(s, node_id=node_id, start_s=start_s,
                                                                    end_s=end_s, limit=limit)]


def _mean(vals):
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


@router.get("/summary", response_model=SummaryOut, **roles(OPERATOR, VIEWER))
def summary(request: Request):
    now = now_s(request)
    with session(request) as s:
        ns = queries.list_nodes(s)
        latest = queries.latest_reports(s, now - 10 * settings(request).report_interval_s)
        ro = queries.open_rollout(s)
        act = queries.active_policy(s)
        w = queries.latest_weights(s)
        lease = s.get(SchedulerLease, "scheduler")
        up = [n for n in ns if n.status == "up"]
        modes, profiles = {}, {}
        for mode, prof in queries.node_devices(s, up).values():
            modes[mode or "unknown"] = modes.get(mode or "unknown", 0) + 1
            if mode == "emulated":
                profiles[prof or "unknown"] = profiles.get(prof or "unknown", 0) + 1
        return SummaryOut(
            now_s=now, num_nodes=len(ns), num_up=sum(n.status == "up" for n in ns),
            num_down=sum(n.status == "down" for n in ns),
            mean_emb_share=_mean([x.emb_share for x in latest]), mean_p99_ms=_mean([x.p99_ms for x in latest]),
            mean_slo_attainment=_mean([x.slo_attainment for x in latest]),
            total_throughput_rps=sum(x.throughput_rps for x in latest) if latest else None,
            active_policy=act.version if act else None,
            active_rollout=None if ro is None else rollout_out(s, ro),
            num_active_overrides=len(queries.active_overrides(s)),
            router_weights_version=w.version if w else None, leader=lease.holder if lease else None,
            decisions_by_source=queries.decisions_by_source(s, now - 300),
            device_modes=modes, num_emulated=modes.get("emulated", 0), emulated_profiles=profiles)


@router.get("/jobs", **roles(OPERATOR, VIEWER))
def jobs(request: Request, job: str | None = None, since_s: float | None = None,
         limit: Annotated[int, Query(ge=1, le=10_000)] = 500):
    with session(request) as s:
        return [dict(job=j.job, instance=j.instance, started_s=j.started_s, duration_s=j.duration_s, ok=j.ok,
                     error=j.error, summary=j.summary) for j in queries.job_runs(s, job, since_s, limit)]


@router.get("/alerts", response_model=list[AlertOut], **roles(OPERATOR, VIEWER))
def alerts(request: Request):
    """The alerts firing now (`control_plane.alerts`: the clients' SLO burn rate over two windows,
    nodes down, nodes pinned at a guard bound, dropped reports, rollouts rolled back), pages
    first; the same conditions ship as Prometheus rules in deploy/prometheus/racer-alerts.yml."""
    from ..alerts import AlertConfig, evaluate

    st = settings(request)
    cfg = AlertConfig(st.slo_objective, st.alert_window_s, st.pinned_fraction)
    with session(request) as s:
        return [AlertOut(**a) for a in evaluate(s, now_s(request), cfg, dict(request.app.state.reports_dropped))]
