"""What a gateway's clients see, one report interval at a time (`ClientView`).

The gateway records every request it answers (`ClientView.record`: status, time from the first
byte received to the answer, retried or not, the load phase the client named) and every forward
attempt to a node (`ClientView.attempt`: round trip, failure, the node's own time from its
answer, requests in flight to it). `ClientView.close` ends the interval and returns its report,
the body the control plane stores (``POST /api/v1/gateways/{gateway_id}/reports``):

- ``num_requests`` answered, by outcome (``ok``, ``client_error``, ``too_large``, ``no_live_node``,
  ``upstream_error``, ``upstream_timeout``) with each outcome's P50/P99, and by HTTP status;
- ``p50_ms`` / ``p99_ms``: end-to-end latency of the requests served (``ok``); a failed request's
  latency is under its outcome only (a fast 503 must not make the P99 look better);
- ``slo_attainment``: requests served within ``slo_ms`` over the requests that were not the
  client's own fault (4xx answers are left out: the request was wrong); failures count as misses;
- ``num_failed`` (5xx answers), ``num_503``, ``num_retried`` (requests that took a second node);
- per node: attempts, failed attempts, the round trip's P99, and the *queueing before the node*:
  round trip minus the node's own ``latency_us.total_us`` (connection wait, network, the node's
  HTTP server before the request reaches its queue), P50 and P99;
- the load phases named by clients (``x-racer-load-phase``, sent by `racer replay` / `racer up`):
  requests per phase and the last one seen (``load_phase``).

An interval with no request still gives a report (``num_requests`` 0, latencies null): the
control plane then knows the gateway is up and idle, which is not the same as a stall (no
report). Figures with no data are null, never 0. Latency samples are capped per interval
(reservoir sampling beyond ``max_samples``), so memory stays bounded at any rate. Pure of I/O:
the clock is injected.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable

from common.contract import MAX_NODES, MAX_PHASES, OUTCOMES

PHASE_HEADER = "x-racer-load-phase"
PHASE_RE = re.compile(r"^[A-Za-z0-9_.:+\[\]\- ]{1,64}$")


def outcome_of(status: int) -> str:
    """The outcome of an answer with HTTP ``status``."""
    if status < 300:
        return "ok"
    if status == 413:
        return "too_large"
    if status == 503:
        return "no_live_node"
    if status == 504:
        return "upstream_timeout"
    if status >= 500:
        return "upstream_error"
    return "client_error"


def clean_phase(value: str | bytes | None) -> str | None:
    """A client-named load phase, or None when absent or not a short plain name."""
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    value = value.strip()
    return value if PHASE_RE.match(value) else None


def pct(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation, as numpy's default), rounded to µs; None
    when there are no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return round(v[lo] + (v[hi] - v[lo]) * (k - lo), 3)


class _Samples:
    """At most ``cap`` values, a uniform sample of all that were added (reservoir)."""

    __slots__ = ("cap", "n", "values", "rng")

    def __init__(self, cap: int, rng: random.Random) -> None:
        self.cap, self.n, self.values, self.rng = cap, 0, [], rng

    def add(self, v: float) -> None:
        self.n += 1
        if len(self.values) < self.cap:
            self.values.append(v)
        else:
            j = self.rng.randrange(self.n)
            if j < self.cap:
                self.values[j] = v


class _NodeWindow:
    __slots__ = ("attempts", "failed", "upstream", "pre_node", "max_inflight")

    def __init__(self, cap: int, rng: random.Random) -> None:
        self.attempts = 0
        self.failed = 0
        self.upstream = _Samples(cap, rng)
        self.pre_node = _Samples(cap, rng)
        self.max_inflight = 0


class ClientView:
    """Per-interval client-side figures of one gateway (see the module docstring).

    ``seq0``: the first report's sequence number (default: Unix time in ms at construction, so a
    restarted gateway's numbers never repeat an earlier run's while reporting at most once per ms)."""

    def __init__(self, slo_ms: float = 30.0, *, clock: Callable[[], float] = time.time, max_samples: int = 20_000,
                 seq0: int | None = None, seed: int = 0) -> None:
        if not (isinstance(slo_ms, (int, float)) and math.isfinite(slo_ms) and slo_ms > 0):
            raise ValueError(f"slo_ms must be a positive number, got {slo_ms!r}")
        self.slo_ms = float(slo_ms)
        self.clock = clock
        self.max_samples = max_samples
        self._rng = random.Random(seed)
        self.seq = int(clock() * 1000) if seq0 is None else int(seq0)
        self.started_s = clock()
        self._reset()

    def _reset(self) -> None:
        self.outcomes: Counter = Counter()
        self.statuses: Counter = Counter()
        self.latency = {o: _Samples(self.max_samples, self._rng) for o in OUTCOMES}
        self.within_slo = 0
        self.retried = 0
        self.phases: Counter = Counter()
        self.last_phase: str | None = None
        self.nodes: dict[str, _NodeWindow] = {}

    # ------------------------------------------------------------------------- recording ---
    def record(self, status: int, latency_s: float, *, retried: bool = False, phase: str | None = None) -> None:
        """One request answered with ``status`` after ``latency_s`` (from its first byte)."""
        o = outcome_of(status)
        ms = max(0.0, latency_s * 1e3)
        self.outcomes[o] += 1
        self.statuses[status] += 1
        self.latency[o].add(ms)
        if o == "ok" and ms <= self.slo_ms:
            self.within_slo += 1
        if retried:
            self.retried += 1
        if phase is not None:
            if phase not in self.phases and len(self.phases) >= MAX_PHASES:
                phase = "other"
            self.phases[phase] += 1
            self.last_phase = phase

    def attempt(self, node_id: str, upstream_s: float, *, failed: bool, node_total_us: float | None = None,
                inflight: int = 0) -> None:
        """One forward attempt to ``node_id``: its round trip, whether it failed, the node's own
        time from its answer (None when the answer has none), requests in flight to it then."""
        w = self.nodes.get(node_id)
        if w is None:
            if len(self.nodes) >= MAX_NODES:
                return
            w = self.nodes[node_id] = _NodeWindow(self.max_samples, self._rng)
        w.attempts += 1
        ms = max(0.0, upstream_s * 1e3)
        if failed:
            w.failed += 1
        else:
            w.upstream.add(ms)
            if node_total_us is not None and math.isfinite(node_total_us) and node_total_us >= 0:
                w.pre_node.add(max(0.0, ms - node_total_us / 1e3))
        w.max_inflight = max(w.max_inflight, int(inflight))

    # ---------------------------------------------------------------------------- report ---
    def close(self, *, num_live_nodes: int | None = None, num_nodes: int | None = None,
              live: dict[str, bool] | None = None) -> dict:
        """End the interval: its report (the API's ``GatewayReportIn``), and start the next."""
        now = self.clock()
        interval = max(now - self.started_s, 1e-3)
        n = sum(self.outcomes.values())
        ok = self.outcomes["ok"]
        judged = n - self.outcomes["client_error"] - self.outcomes["too_large"]
        by_outcome = {o: {"num_requests": self.outcomes[o], "p50_ms": pct(self.latency[o].values, 50),
                          "p99_ms": pct(self.latency[o].values, 99)} for o in OUTCOMES if self.outcomes[o]}
        nodes = []
        for nid, w in sorted(self.nodes.items()):
            nodes.append({"node_id": nid, "num_attempts": w.attempts, "num_failed": w.failed,
                          "upstream_p99_ms": pct(w.upstream.values, 99),
                          "pre_node_p50_ms": pct(w.pre_node.values, 50), "pre_node_p99_ms": pct(w.pre_node.values, 99),
                          "max_inflight": w.max_inflight, "live": None if live is None else live.get(nid)})
        if live:  # nodes with no attempt this interval still show whether they are in rotation
            seen = {x["node_id"] for x in nodes}
            nodes += [{"node_id": nid, "num_attempts": 0, "num_failed": 0, "upstream_p99_ms": None,
                       "pre_node_p50_ms": None, "pre_node_p99_ms": None, "max_inflight": 0, "live": up}
                      for nid, up in sorted(live.items()) if nid not in seen][:max(0, MAX_NODES - len(nodes))]
        report = {
            "seq": self.seq, "ts_s": now, "interval_s": round(interval, 6), "slo_ms": self.slo_ms,
            "num_requests": n, "num_ok": ok,
            "num_failed": sum(c for s, c in self.statuses.items() if s >= 500),
            "num_retried": self.retried, "num_503": self.statuses[503],
            "p50_ms": pct(self.latency["ok"].values, 50), "p99_ms": pct(self.latency["ok"].values, 99),
            "slo_attainment": round(self.within_slo / judged, 6) if judged > 0 else None,
            "outcomes": by_outcome, "statuses": {str(s): c for s, c in sorted(self.statuses.items())},
            "nodes": nodes, "num_live_nodes": num_live_nodes, "num_nodes": num_nodes,
            "load_phase": self.last_phase, "phases": dict(self.phases),
        }
        self.seq += 1
        self.started_s = now
        self._reset()
        return report


_TOTAL_US = b'"total_us":'
_NUMBER = re.compile(rb" *([0-9.eE+\-]{1,32})")


def node_total_us(content: bytes) -> float | None:
    """The node's own ``latency_us.total_us`` from its answer's bytes (found, not parsed: the
    gateway does not decode answers on the request path), or None."""
    i = content.rfind(_TOTAL_US)
    if i < 0:
        return None
    m = _NUMBER.match(content, i + len(_TOTAL_US))
    if m is None:
        return None
    try:
        v = float(m.group(1))
    except ValueError:
        return None
    return v if math.isfinite(v) and v >= 0 else None
