"""Prometheus metrics of the control plane (``GET /metrics``), ``racer_*`` names with units.

Control-plane metrics are ``racer_cp_*``; the latest figures each node reported are
re-exported as ``racer_node_*{node_id=...}`` so one scrape of the control plane sees the cluster.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

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
        self.ingest_native = Counter("racer_cp_ingest_native_requests",
                                     "Report batches answered in the HTTP protocol (the native route), not through "
                                     "the ASGI app", registry=r)
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
        # the latest figures of each node: kept as its latest report, rendered at a scrape
        # (`_NodeFigures`), not set gauge by gauge on each of 1,000 reports a second
        self._latest: dict[str, object] = {}
        r.register(_NodeFigures(self._latest))
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
            c = self._children[node_id] = (self.node_refill.labels(node_id), self.node_bursts.labels(node_id))
        return c

    def observe_report(self, node_id: str, rep) -> None:  # rep: common.contract.ReportIn
        self._latest[node_id] = rep
        refill, bursts = self._node(node_id)
        if rep.refill_bytes:
            refill.inc(rep.refill_bytes)
        if rep.decision is not None:
            self.node_decisions.labels(node_id, rep.decision.source).inc()
        if rep.bursts:
            bursts.inc(len(rep.bursts))


# (metric name, help, the report's field, the factor to the metric's unit)
_NODE_GAUGES = (
    ("racer_node_emb_share_ratio", "emb_share in use (0-1)", "emb_share", 1.0),
    ("racer_node_emb_share_target_ratio", "emb_share target (0-1)", "emb_share_target", 1.0),
    ("racer_node_kv_hit_ratio", "KV hit ratio of the last window", "kv_hit_rate", 1.0),
    ("racer_node_emb_hit_ratio", "EMB hit ratio of the last window", "emb_hit_rate", 1.0),
    ("racer_node_latency_p50_seconds", "P50 latency of the last window", "p50_ms", 1e-3),
    ("racer_node_latency_p99_seconds", "P99 latency of the last window", "p99_ms", 1e-3),
    ("racer_node_slo_attainment_ratio", "SLO attainment of the last window", "slo_attainment", 1.0),
    ("racer_node_throughput_requests_per_second", "Throughput of the last window", "throughput_rps", 1.0),
    ("racer_node_queue_depth_requests", "Queue depth at the last report", "queue_depth", 1.0),
)


class _NodeFigures:
    """A Prometheus collector of each node's latest report (``latest``: node_id -> report) as the
    ``racer_node_*`` gauges of `_NODE_GAUGES`; a figure the latest report lacks has no sample."""

    def __init__(self, latest: dict) -> None:
        self.latest = latest

    def describe(self):
        return [GaugeMetricFamily(name, doc, labels=["node_id"]) for name, doc, _, _ in _NODE_GAUGES]

    def collect(self):
        nodes = list(self.latest.copy().items())  # reports arrive (event loop) while a scrape renders (a thread)
        for name, doc, field, k in _NODE_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["node_id"])
            for node_id, rep in nodes:
                v = getattr(rep, field)
                if v is not None:
                    g.add_metric([node_id], float(v) * k)
            yield g
