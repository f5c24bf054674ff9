"""The node agent's Prometheus exposition (``GET /metrics``, prometheus_client text format).

Names follow the Prometheus conventions (one ``racer_`` prefix, base units in the name, 0-1 values
end in ``_ratio``, counters in ``_total``); every series carries no label but the few listed.

    racer_emb_share_ratio                      gauge    EMB slab's share of the arena now
    racer_emb_share_target_ratio               gauge    the Memory Manager's target emb_share
    racer_emb_hit_ratio                        gauge    EMB row hit ratio over the metrics window
    racer_kv_hit_ratio                         gauge    KV token hit ratio over the metrics window
    racer_slo_attainment_ratio                 gauge    requests within the SLO over the metrics window
    racer_slo_seconds                          gauge    the latency SLO
    racer_request_latency_seconds              histogram  end-to-end latency of every served request
                                                        (modelled seconds on an emulated device)
    racer_requests_total                       counter  requests served
    racer_request_errors_total                 counter  requests that failed inside the node (5xx)
    racer_requests_rejected_total              counter  requests refused as invalid (4xx)
    racer_queue_depth_requests                 gauge    requests waiting for the device
    racer_refill_bytes_total                   counter  bytes the EMB refill brought host -> device
    racer_decisions_total{source}              counter  allocator decisions by source
                                                        (base, residual, recovery, override, guard)
    racer_decisions_at_bound_total{bound}      counter  of those, decisions clamped to the min or max emb_share
    racer_bursts_total                         counter  bursts the recovery controller entered
    racer_burst_active                         gauge    1 while a burst is in progress
    racer_override_active                      gauge    1 while an operator override is in force
    racer_control_steps_total                  counter  control steps run
    racer_reports_buffered                     gauge    reports waiting to be sent (on disk or in memory)
    racer_reports_in_memory                    gauge    of those, reports the disk refused (full, read-only)
    racer_reports_sent_total                   counter  reports the control plane stored
    racer_reports_dropped_total                counter  reports dropped (a buffer's bound, unreadable)
    racer_control_plane_up                     gauge    1 while the control plane answers
    racer_node_info{node_id,device,policy_version}  gauge 1
    racer_node_device_info{mode,profile,time,time_scale}  gauge 1: what the figures are (`Engine.device_info`):
                                                        mode real | link-emulated | emulated (unknown: an
                                                        engine that does not say), profile the emulated
                                                        device's cost profile (else ""), time measured |
                                                        modelled, time_scale wall s per agent s

The latency histogram is fed from the rolling metrics' ring at each scrape (every request once;
a request already overwritten in the ring, after more than ``max_samples`` requests between two
scrapes, is not counted in it); everything else is read at scrape time.

On an emulated device (``racer node-agent --emulate PROFILE``) every time the agent measures is
modelled (its cost profile's, in modelled seconds): the latency histogram and the SLO attainment
are, and their HELP text says so (`device_note`), as ``racer_node_device_info`` does. Counters
count what happened (requests, bytes); a rate of them over scrape time is per wall second.
"""

from __future__ import annotations

import threading

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from common.contract import DECISION_SOURCES

from .reporter import device_info

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0)


def device_note(dev: dict | None) -> str:
    """What a latency metric's HELP adds about the device's time: modelled on an emulated device
    (by which profile), else measured."""
    if dev is not None and dev.get("mode") == "emulated":
        cal = "calibrated" if dev.get("calibrated") else "uncalibrated"
        return f" (modelled seconds of an emulated device, profile {dev.get('profile', '?')} ({cal}): not measured)"
    return " (measured; an emulated device's are modelled seconds, see racer_node_device_info)"


def device_labels(dev: dict | None) -> list[str]:
    """``racer_node_device_info``'s label values (mode, profile, time, time_scale)."""
    if dev is None:
        return ["unknown", "", "", ""]
    k = dev.get("time_scale", 1.0 if dev["mode"] != "emulated" else None)
    return [dev["mode"], dev.get("profile", ""), dev.get("time", ""), "" if k is None else f"{k:g}"]


class _AgentCollector:
    def __init__(self, exporter: AgentExporter) -> None:
        self.exporter = exporter

    def collect(self):
        a = self.exporter.agent
        yield self.exporter.latency_family()
        snap = a.metrics_snapshot()
        m = snap["metrics"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc)
            if value is not None:
                g.add_metric([], float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            return c

        yield gauge("racer_emb_share_ratio", "EMB slab's share of the arena's pages", snap["emb_share"])
        yield gauge("racer_emb_share_target_ratio", "the Memory Manager's target emb_share", snap["target_emb_share"])
        yield gauge("racer_emb_hit_ratio", "EMB row hit ratio over the metrics window", m["emb_hit_rate"])
        yield gauge("racer_kv_hit_ratio", "KV token hit ratio over the metrics window", m["kv_hit_rate"])
        note = device_note(self.exporter.device)
        yield gauge("racer_slo_attainment_ratio", "share of the window's requests within the SLO" + note,
                    m["slo_attainment"])
        yield gauge("racer_slo_seconds", "the latency SLO", m["slo_ms"] / 1e3)
        yield counter("racer_requests", "requests served", m["num_requests"])
        yield counter("racer_request_errors", "requests that failed inside the node", m["num_errors"])
        yield counter("racer_requests_rejected", "requests refused as invalid", m["num_rejected"])
        yield gauge("racer_queue_depth_requests", "requests waiting for the device", snap["queue_depth"])
        yield counter("racer_refill_bytes", "bytes the EMB refill copied host to device", m["refill_bytes"])
        yield counter("racer_control_steps", "control steps run", snap["control"]["num_steps"])
        alloc = a.allocator
        dec = CounterMetricFamily("racer_decisions", "allocator decisions by source", labels=["source"])
        counts = dict(alloc.num_decisions) if alloc is not None else {}
        for src in DECISION_SOURCES:
            dec.add_metric([src], float(counts.get(src, 0)))
        yield dec
        at = CounterMetricFamily("racer_decisions_at_bound", "allocator decisions the guard clamped to its min or max "
                                 "emb_share", labels=["bound"])
        for bound in ("min", "max"):
            at.add_metric([bound], float(alloc.num_at_bound[bound] if alloc is not None else 0))
        yield at
        rec = alloc.recovery if alloc is not None else None
        yield counter("racer_bursts", "bursts the recovery controller entered", rec.num_bursts if rec else 0)
        yield gauge("racer_burst_active", "1 while a burst is in progress", 1 if rec and rec.phase == "burst" else 0)
        yield gauge("racer_override_active", "1 while an operator override is in force",
                    1 if alloc is not None and alloc.override is not None else 0)
        rep = a.reporter.status() if a.reporter is not None else None
        if rep is not None:
            yield gauge("racer_reports_buffered", "reports waiting to be sent (on disk or in memory)",
                        rep["num_buffered"])
            yield gauge("racer_reports_in_memory", "reports waiting in memory (the disk refused them)",
                        rep["num_in_memory"])
            yield counter("racer_reports_sent", "reports the control plane stored", rep["num_sent"])
            yield counter("racer_reports_dropped", "reports dropped (a buffer's bound, or unreadable)",
                          rep["num_dropped"])
            yield gauge("racer_control_plane_up", "1 while the control plane answers", 1 if rep["connected"] else 0)
        info = GaugeMetricFamily("racer_node_info", "this node", labels=["node_id", "device", "policy_version"])
        policy = (rep or {}).get("policy_version")
        if policy is None and alloc is not None and alloc.policy is not None:
            policy = alloc.policy.policy_id
        info.add_metric([rep["node_id"] if rep else "", str(a.engine.device), policy or ""], 1.0)
        yield info
        dev = GaugeMetricFamily("racer_node_device_info", "what this node's figures are: real, link-emulated or "
                                "emulated (profile, modelled time, time_scale wall s per modelled s)",
                                labels=["mode", "profile", "time", "time_scale"])
        dev.add_metric(device_labels(self.exporter.device), 1.0)
        yield dev


class AgentExporter:
    """One registry per agent (several agents may share a process in tests). The latency
    histogram's bucket counts are kept here (numpy, ``le`` semantics: a value equal to a bound
    counts in that bucket)."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self.device = device_info(agent.engine)  # what the figures are (None: the engine does not say)
        self.registry = CollectorRegistry(auto_describe=False)
        self._bounds = np.asarray(LATENCY_BUCKETS_S, dtype=np.float64)
        self._counts = np.zeros(len(self._bounds) + 1, dtype=np.int64)  # last: above the largest bound
        self._sum_s = 0.0
        self._cursor = 0
        self._lock = threading.Lock()
        self.registry.register(_AgentCollector(self))

    def sync_latency(self) -> int:
        """Count every request recorded since the last call into the histogram; returns how many."""
        with self._lock:
            with self.agent._lock:
                lat_s, self._cursor = self.agent.metrics.latencies_since(self._cursor)
            if len(lat_s):
                idx = np.searchsorted(self._bounds, lat_s, side="left")
                self._counts += np.bincount(idx, minlength=len(self._counts))
                self._sum_s += float(lat_s.sum())
            return len(lat_s)

    def latency_family(self) -> HistogramMetricFamily:
        with self._lock:
            cum = np.cumsum(self._counts)
            buckets = [(repr(float(b)), float(c)) for b, c in zip(self._bounds, cum[:-1])]
            buckets.append(("+Inf", float(cum[-1])))
            total = self._sum_s
        h = HistogramMetricFamily("racer_request_latency_seconds",
                                  "end-to-end latency of served requests" + device_note(self.device))
        h.add_metric([], buckets, total)
        return h

    def render(self) -> tuple[bytes, str]:
        self.sync_latency()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


_create_lock = threading.Lock()


def exporter_of(agent) -> AgentExporter:
    with _create_lock:
        ex = getattr(agent, "_exporter", None)
        if ex is None:
            ex = agent._exporter = AgentExporter(agent)
        return ex


def render(agent) -> tuple[bytes, str]:
    return exporter_of(agent).render()
