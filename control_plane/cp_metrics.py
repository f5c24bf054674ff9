"""Prometheus metrics of the control plane (``GET /metrics``), ``racer_*`` names with units.

Control-plane metrics are ``racer_cp_*``; the latest figures each node reported are
re-exported as ``racer_node_*{node_id=...}`` so one scrape of the control plane sees the cluster.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LAT = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ControlPlaneMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.reports_received = Counter("racer_cp_reports_received", "Reports received (before dedup)", registry=r)
        self.reports_stored = Counter("racer_cp_reports_stored", "Reports stored", registry=r)
        self.reports_duplicate = Counter("racer_cp_reports_duplicate",
                                         "Reports already stored (replays), skipped", registry=r)
        self.ingest_request = Histogram("racer_cp_ingest_request_duration_seconds",
                                        "Report batch request time in the handler (validation to commit)",
                                        buckets=_LAT, registry=r)
        self.ingest_commit = Histogram("racer_cp_ingest_commit_duration_seconds",
                                       "Time of one group commit of report rows", buckets=_LAT, registry=r)
        self.ingest_commit_rows = Histogram("racer_cp_ingest_commit_rows", "Report rows per group commit",
                                            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000), registry=r)
        self.reports_throttled = Counter("racer_cp_reports_throttled",
                                         "Report batches refused 429: a node past its ingestion quota", ["what"],
                                         registry=r)
        for what in ("reports", "bytes"):  # both series from the start (an alert's increase() needs them)
            self.reports_throttled.labels(what)
        self.job_runs = Counter("racer_cp_job_runs", "Scheduled job runs", ["job", "outcome"], registry=r)
        self.job_duration = Histogram("racer_cp_job_duration_seconds", "Scheduled job run time", ["job"],
                                      buckets=_LAT, registry=r)
        self.is_leader = Gauge("racer_cp_scheduler_leader", "1 while this replica runs the scheduler", registry=r)
        self.nodes = Gauge("racer_cp_nodes", "Registered nodes by status", ["status"], registry=r)
        self.weights_version = Gauge("racer_cp_router_weights_version", "Current router weights version",
                                     registry=r)
        self.weight_pushes = Counter("racer_cp_router_weight_pushes", "Weight pushes to routers", ["outcome"],
                                     registry=r)
        self.overrides_active = Gauge("racer_cp_overrides_active", "Overrides in force", registry=r)
        self.rollouts = Gauge("racer_cp_rollouts", "Rollouts by state (the rollout job's last count)", ["state"],
                              registry=r)
        lbl = ["node_id"]
        self.node_emb_share = Gauge("racer_node_emb_share_ratio", "emb_share in use (0-1)", lbl, registry=r)
        self.node_emb_share_target = Gauge("racer_node_emb_share_target_ratio", "emb_share target (0-1)", lbl,
                                           registry=r)
        self.node_kv_hit = Gauge("racer_node_kv_hit_ratio", "KV hit ratio of the last window", lbl, registry=r)
        self.node_emb_hit = Gauge("racer_node_emb_hit_ratio", "EMB hit ratio of the last window", lbl, registry=r)
        self.node_p50 = Gauge("racer_node_latency_p50_seconds", "P50 latency of the last window", lbl, registry=r)
        self.node_p99 = Gauge("racer_node_latency_p99_seconds", "P99 latency of the last window", lbl, registry=r)
        self.node_slo = Gauge("racer_node_slo_attainment_ratio", "SLO attainment of the last window", lbl,
                              registry=r)
        self.node_throughput = Gauge("racer_node_throughput_requests_per_second", "Throughput of the last window",
                                     lbl, registry=r)
        self.node_queue = Gauge("racer_node_queue_depth_requests", "Queue depth at the last report", lbl,
                                registry=r)
        self.node_refill = Counter("racer_node_refill_bytes", "EMB refill bytes reported", lbl, registry=r)
        self.node_decisions = Counter("racer_node_decisions", "Allocator decisions reported, by source",
                                      ["node_id", "source"], registry=r)
        self.node_bursts = Counter("racer_node_bursts", "Bursts reported (starts)", lbl, registry=r)
        self.node_reports_dropped = Gauge("racer_node_reports_dropped",
                                          "Reports the node dropped so far, as its newest report (by seq) said",
                                          lbl,
                                          registry=r)

        self._children: dict[str, tuple] = {}

    def _node(self, node_id: str) -> tuple:
        c = self._children.get(node_id)
        if c is None:
            c = self._children[node_id] = tuple(m.labels(node_id) for m in (
                self.node_emb_share, self.node_emb_share_target, self.node_kv_hit, self.node_emb_hit, self.node_p50,
                self.node_p99, self.node_slo, self.node_throughput, self.node_queue, self.node_refill,
                self.node_bursts))
        return c

    def observe_report(self, node_id: str, rep) -> None:  # rep: common.contract.ReportIn
        share, target, kv, emb, p50, p99, slo, thr, queue, refill, bursts = self._node(node_id)
        share.set(rep.emb_share)
        target.set(rep.emb_share_target)
        if rep.kv_hit_rate is not None:
            kv.set(rep.kv_hit_rate)
        if rep.emb_hit_rate is not None:
            emb.set(rep.emb_hit_rate)
        if rep.p50_ms is not None:
            p50.set(rep.p50_ms / 1e3)
        if rep.p99_ms is not None:
            p99.set(rep.p99_ms / 1e3)
        if rep.slo_attainment is not None:
            slo.set(rep.slo_attainment)
        thr.set(rep.throughput_rps)
        queue.set(rep.queue_depth)
        if rep.refill_bytes:
            refill.inc(rep.refill_bytes)
        if rep.decision is not None:
            self.node_decisions.labels(node_id, rep.decision.source).inc()
        if rep.bursts:
            bursts.inc(len(rep.bursts))
