"""The gateway's Prometheus metrics (``GET /metrics``): one registry per gateway."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    """Requests by outcome, retries, upstream failures, the gateway's overhead, live nodes, the
    weights in force and the traffic samples sent and dropped."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("racer_gateway_requests", "Requests answered, by serving node, outcome and "
                                "decision source", ("node", "outcome", "source"), registry=r)
        self.retries = Counter("racer_gateway_retries", "Requests retried on another node, by failure kind",
                               ("kind",), registry=r)
        self.failures = Counter("racer_gateway_upstream_failures", "Failed forward attempts by node and kind",
                                ("node", "kind"), registry=r)
        self.overhead = Histogram("racer_gateway_overhead_seconds", "Time a request spends in the gateway "
                                  "outside the node's round trip", registry=r,
                                  buckets=(5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.25))
        self.upstream = Histogram("racer_gateway_upstream_seconds", "Round trip to the serving node", registry=r,
                                  buckets=(1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0))
        self.slo_requests = Counter("racer_gateway_slo_requests", "Requests answered within the clients' SLO or "
                                    "not (failures are misses, 4xx answers left out): the SLO burn-rate alerts' input",
                                    ("outcome",), registry=r)
        for outcome in ("within", "missed"):  # both series from the start, so a rate over them is defined
            self.slo_requests.labels(outcome)
        self.live_nodes = Gauge("racer_gateway_live_nodes", "Nodes in rotation", registry=r)
        self.weights_version = Gauge("racer_gateway_weights_version", "Version of the router weights in force",
                                     registry=r)
        self.samples_sent = Counter("racer_gateway_samples_sent", "Traffic samples the control plane stored",
                                    registry=r)
        self.samples_dropped = Counter("racer_gateway_samples_dropped", "Traffic samples dropped: buffer_full "
                                       "(the oldest, past the gateway's bounds) or refused (for good, by the "
                                       "control plane)", ("reason",), registry=r)
