"""The gateway: the EMB-KV-aware router on the request path, in front of real node agents.

    racer gateway --nodes http://h:p,http://h:p,... | --control-plane URL [--token-file F]
                  [--router racer] [--trace taobao [--path P]] [--port 8000]

    POST /v1/recommend       the node agent's body -> route -> forward -> the node's answer plus
                             ``served_by``, ``retried`` and ``routing`` (source, K/V holder;
                             reason and per-node scores with ``x-racer-explain``)
    GET  /v1/router          weights in force (version, source), per-node state, config;
                             ``?user=U``: the node the gateway scores as U's K/V holder
    POST /v1/router/weights  the control plane's weight push (Bearer token)
    GET  /healthz            the gateway's own liveness and its live nodes
    GET  /v1/clients         this gateway's client-side figures: the interval so far, reports pending
    GET  /metrics            Prometheus metrics

Residency and load never go through the database: every routing decision updates the router's
`ClusterState` optimistically (queue depth + 1, the user's K/V on the chosen node), every answer
completes it (queue depth - 1), and every ``report_interval_s`` the gateway pulls each node's
`GET /v1/residency?cursor=N&epoch=E` (users evicted and added since the cursor, hot shards,
queue depth, service time) and applies it as a `NodeReport`. Health checks (``GET /healthz``
every ``health_interval_s``) take a node out after ``health_failures`` failures in a row and put
it back after ``health_successes`` successes. A request that meets a connection error, a timeout
or a 5xx is retried once on the next-best node; 4xx answers pass through unchanged. A request
body over ``max_body_bytes`` (default 4 MiB, the node agent's own default) gets the gateway's
own 413 before it is parsed or forwarded (bytes counted as they arrive, so chunked bodies too;
`common.http_server.read_body`).

With ``--control-plane`` the gateway also reports what its clients see every
``client_report_interval_s`` (`control_plane.client_view`: end-to-end P50/P99, SLO attainment,
outcomes, retries, 503s, per-node queueing before the node, the load phase clients name in
``x-racer-load-phase``) to ``POST /api/v1/gateways/{gateway_id}/reports``; reports the control
plane did not take are kept (at most ``MAX_PENDING_CLIENT_REPORTS``) and sent again. See
docs/gateway.md.

With ``--sample-rate R`` (> 0; a key from ``--sample-key-file`` / ``$RACER_SAMPLE_KEY``) it also
samples its traffic by user for a what-if replay (`control_plane.traffic_sample`: every request of
a fraction R of the users, ids hashed with the key) and sends the samples every
``sample_interval_s`` to ``POST /api/v1/gateways/{gateway_id}/samples``, as it sends its reports.

The decisions (which node a failed request is retried on, a node's health transitions, what a new
node list changes, whether a weights document applies, what to do with a client-report batch)
are pure functions in `control_plane.gateway_decisions`; this module does the I/O around them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import httpx
import numpy as np
from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from common.config import add_config_arguments, config_kwargs, ranged, validate
from common.secrets_args import FLEET_TOKEN_ENV, add_secret_arguments, bearer_ok, read_secret, require_fleet_token
from common.http_server import (AllowedMethods, BodyLimit, BodyTooLarge, JsonOnly, finite_validation_errors,
                               json_content_type, may_have_body, read_body, send_json, unsupported_media_type)

from .client_view import PHASE_HEADER, ClientView, clean_phase, node_total_us
from .traffic_sample import DEFAULT_SAMPLE_MAX_ITEMS, MAX_SAMPLE_ITEMS, SAMPLE_KEY_ENV, Sampler
from .traffic_sample import sample_key as traffic_sample_key
from .gateway_decisions import (Attempt, HealthEvent, HealthPolicy, HealthState, RetrySnapshot, WeightsInForce,
                                choose_retry, client_report_step, diff_registry, health_transition,
                                profile_from_metrics, service_time_changed, weights_verdict)
from .router import POLICIES, NodeReport, NoLiveNodeError, RouteRequest, Router, RouterConfig, make_router
from common.http_client import UpstreamError, UpstreamPool, UpstreamTimeout
from .weights import CostProfile

log = logging.getLogger("racer.gateway")

DEFAULT_PROFILE = CostProfile(kv_recompute_us_per_token=1.0, emb_transfer_us_per_row=1.0, service_time_us=2_000.0,
                              queue_capacity=64)
_PROFILE_FIELDS = ("kv_recompute_us_per_token", "emb_transfer_us_per_row", "service_time_us", "queue_capacity")


MAX_CLIENT_REPORT_INTERVAL_S = 600.0  # the control plane refuses a report's interval_s over 3600
MAX_SLO_MS = 1e6  # and its slo_ms over 1e6


def _positive(default: float, doc: str):
    return ranged(default, lo=0, lo_open=True, doc=doc)


def _count(default: int, doc: str):
    return ranged(default, lo=1, integer=True, doc=doc)


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway's settings, each field's range declared on it (`common.config`) and checked in
    ``__post_init__``; `add_gateway_parser` reads the command line's defaults and help from them.

    Health checks follow SGLang's gateway (3 failures out, 2 successes back). ``request_timeout_s``
    is one forward attempt's limit (a request takes at most
    `control_plane.gateway_decisions.MAX_ATTEMPTS`). ``client_report_interval_s``
    and ``slo_ms`` stay within what the control plane takes (a report's interval_s <= 3600, slo_ms
    <= 1e6): the measured interval runs a little over the configured one, so its cap is well below.
    """

    router: str = ranged("racer", choices=POLICIES, doc="routing policy")
    report_interval_s: float = _positive(0.5, "residency feed pull period, s")
    health_interval_s: float = _positive(1.0, "health check period, s")
    health_timeout_s: float = _positive(0.5, "health check timeout, s")
    health_failures: int = _count(3, "failures in a row that take a node out")
    health_successes: int = _count(2, "successes in a row that bring it back")
    request_timeout_s: float = _positive(10.0, "one forward attempt's limit, s")
    connect_timeout_s: float = _positive(1.0, "the connect part of a forward attempt's limit, s")
    weights_interval_s: float = _positive(5.0, "how often weights are pulled (control plane) or re-derived from "
                                               "the nodes' /v1/metrics, s")
    registry_interval_s: float = _positive(5.0, "how often the control plane's node list is re-read, s")
    queue_capacity: int = _count(64, "queue depth at which a node counts as full when the weights come from the "
                                     "nodes")
    num_shards: int = _count(64, "embedding shards; must match the nodes'")
    max_connections: int = _count(512, "pooled connections to all nodes together")
    max_body_bytes: int = _count(4 * 2**20, "most bytes of a request body (a recommendation or a weights "
                                            "push); a larger one gets 413 and is not forwarded; the node "
                                            "agent's default")
    slo_ms: float = ranged(30.0, lo=0, lo_open=True, hi=MAX_SLO_MS,
                           doc="latency SLO for the clients' SLO attainment, ms; as racer replay's")
    client_report_interval_s: float = ranged(1.0, lo=0.1, hi=MAX_CLIENT_REPORT_INTERVAL_S,
                                             doc="how often what clients see goes to the control plane, s; "
                                                 "with --control-plane")
    sample_rate: float = ranged(0.0, lo=0, hi=1, doc="fraction of users whose every request is sampled for a "
                                                     "what-if replay (0: off; > 0 needs --control-plane and a "
                                                     "key: --sample-key-file or $RACER_SAMPLE_KEY)")
    sample_max_items: int = ranged(DEFAULT_SAMPLE_MAX_ITEMS, lo=1, hi=MAX_SAMPLE_ITEMS, integer=True,
                                   doc="most item ids a sample keeps of each list (the history's most recent, "
                                       "the first new items and candidates); the history length is kept whole")
    sample_interval_s: float = ranged(2.0, lo=0.05, hi=600, doc="how often samples go to the control plane, s")

    def __post_init__(self) -> None:
        validate(self)


@dataclass
class NodeLink:
    """What the gateway knows of one node besides the router's state."""

    node_id: str
    address: str
    health: HealthState = field(default_factory=HealthState)  # in rotation, consecutive failures/successes
    inflight: int = 0  # requests this gateway has sent and not yet seen answered
    epoch: str | None = None  # the node's residency feed epoch and cursor
    cursor: int = 0
    last_report_s: float | None = None
    report_error: str | None = None
    service_time_us: float | None = None
    node_queue_depth: int = 0
    hot_shards: list[int] = field(default_factory=list)
    pool: UpstreamPool | None = field(default=None, repr=False)  # the request path's connections

    @property
    def live(self) -> bool:
        return self.health.live


class BadRequest(ValueError):
    pass


def _parse_body(body: bytes) -> dict:
    try:
        d = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"body: malformed JSON: {e}") from None
    except RecursionError:  # 100,000 nested brackets: not a request, and not a 500
        raise BadRequest("body: JSON nested too deeply") from None
    if not isinstance(d, dict):
        raise BadRequest("body: must be a JSON object")
    return d


def _route_request(body: bytes, item_shard: np.ndarray | None) -> RouteRequest:
    """The router's view of a node-agent body; only the fields routing needs are checked here
    (the node validates the rest and answers 4xx, which the gateway passes through)."""
    return _route_of(_parse_body(body), item_shard)


def _route_of(d: dict, item_shard: np.ndarray | None) -> RouteRequest:
    """`_route_request` of the parsed body ``d``."""
    user = d.get("user_id")
    if isinstance(user, bool) or not isinstance(user, int) or not 0 <= user < 2**63:
        raise BadRequest(f"user_id: must be an integer in [0, 2^63), got {user!r}")
    history = d.get("history", [])
    new_items = d.get("new_items", [])
    cands = d.get("candidates")
    for name, v in (("history", history), ("new_items", new_items)):
        if not isinstance(v, list):
            raise BadRequest(f"{name}: must be a list of item ids")
    if cands is not None and not isinstance(cands, list):
        raise BadRequest("candidates: must be a list of item ids")
    shards = _EMPTY
    if item_shard is not None:
        looked_up = new_items + cands if cands else new_items
        if looked_up:
            try:
                ids = np.asarray(looked_up, dtype=np.int64)
            except (ValueError, TypeError, OverflowError):
                raise BadRequest("new_items / candidates: item ids must be integers") from None
            ids = ids[(ids >= 0) & (ids < len(item_shard))]
            shards = item_shard[ids]
    return RouteRequest(user, len(history), shards, len(new_items))


_EMPTY = np.empty(0, dtype=np.int64)
MAX_PENDING_CLIENT_REPORTS = 600  # reports kept while the control plane does not take them (oldest dropped)
SAMPLE_BATCH = 250  # traffic samples per batch (the control plane takes 500: traffic_sample.MAX_SAMPLE_BATCH)
SAMPLE_BATCH_BYTES = 512 * 2**10  # and about this much JSON (its max_sample_body_bytes: 1 MiB by default)
REREGISTER_S = 60.0  # a registered gateway registers again this often (its push token comes with the answer)
CLIENT_REPORT_BATCH = 60
_GATEWAY_ID_BAD = re.compile(r"[^A-Za-z0-9_.:\-]")


def gateway_id_from(text: str) -> str:
    """An id the control plane accepts (``[A-Za-z0-9_.:-]``, at most 128 characters) made from ``text``."""
    return (_GATEWAY_ID_BAD.sub("-", text.split("://", 1)[-1].rstrip("/")) or "gateway")[:128]


class _Metrics:
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


class Gateway:
    """The router, the node links and the loops that keep them current.

    ``nodes``: ``[(node_id, address)]``; ``item_shard``: item -> shard map of the trace the nodes
    serve (``None``: the EMB term sees no items); ``control_plane``/``token``: where node lists and
    weights come from (``None``: the ``nodes`` given, weights from the nodes' ``/v1/metrics``);
    ``sample_key``: the traffic samples' key (needed when ``config.sample_rate`` > 0).
    """

    def __init__(self, nodes: Sequence[tuple[str, str]], config: GatewayConfig | None = None, *,
                 item_shard: np.ndarray | None = None, control_plane: str | None = None,
                 token: str | None = None, advertise_url: str | None = None, push_token: str | None = None,
                 clock: Callable[[], float] = time.monotonic, gateway_id: str | None = None,
                 fleet_token: str | None = None, sample_key: bytes | None = None) -> None:
        self.config = config or GatewayConfig()
        self.health_policy = HealthPolicy(self.config.health_failures, self.config.health_successes)
        self.item_shard = None if item_shard is None else np.asarray(item_shard, dtype=np.int64)
        if self.item_shard is not None and len(self.item_shard) and int(self.item_shard.max()) >= self.config.num_shards:
            raise ValueError(f"the item -> shard map names shard {int(self.item_shard.max())} but num_shards is "
                             f"{self.config.num_shards}")
        self.control_plane = control_plane.rstrip("/") if control_plane else None
        self.token = token
        self.advertise_url = advertise_url.rstrip("/") if advertise_url else None
        if push_token and control_plane:
            raise ValueError("a push token is given to a gateway without a control plane: one with a control plane "
                             "is given its push token when it registers (POST /api/v1/routers)")
        # the secret weight pushes must carry: given (no control plane), or the control plane's answer
        # to the registration (derived from its secret key: the database holds none)
        self.push_token = push_token
        self.registered = False
        self.registered_at_s = -math.inf
        #: shown to the agents' /v1/residency, and wanted on GET /v1/router (common.secrets_args)
        self.fleet_token = fleet_token
        self._fleet_headers = {"Authorization": f"Bearer {fleet_token}"} if fleet_token else {}
        self.clock = clock
        self.metrics = _Metrics()
        # what clients see (reported to the control plane); the id defaults to the advertised
        # address, else host:port once serving (`cmd_gateway`), else host-pid
        self.gateway_id = gateway_id_from(gateway_id or self.advertise_url or "") if (
            gateway_id or self.advertise_url) else None
        self.client_view = ClientView(self.config.slo_ms)
        self.client_reports: collections.deque = collections.deque(maxlen=MAX_PENDING_CLIENT_REPORTS)
        self.client_report_error: str | None = None
        self.client_reports_sent = 0
        self.client_reports_dropped = 0  # refused for good by the control plane (403, 413 or 422 alone)
        # traffic samples for a what-if replay (control_plane.traffic_sample): None when off
        self.sampler: Sampler | None = None
        self.sample_error: str | None = None
        self.samples_sent = 0
        if self.config.sample_rate > 0:
            if not sample_key:
                raise ValueError(f"--sample-rate {self.config.sample_rate:g} needs the samples' key: "
                                 f"--sample-key-file PATH or $RACER_SAMPLE_KEY (a random secret of at least 16 "
                                 f"characters, the same on every gateway)")
            if not self.control_plane:
                raise ValueError("--sample-rate applies with --control-plane only: the samples are sent there")
            self.sampler = Sampler(sample_key, self.config.sample_rate, max_items=self.config.sample_max_items,
                                   on_drop=lambda n, reason: self.metrics.samples_dropped.labels(reason).inc(n))
            for reason in ("buffer_full", "refused"):  # both series from the start
                self.metrics.samples_dropped.labels(reason)
        self.weights_version = 0
        self.weights_source = "control_plane" if self.control_plane else "node_metrics"
        self.weights_computed_at_s: float | None = None
        self.weights_reasons: dict[str, str] = {}
        self.client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task] = []
        self.links: list[NodeLink] = []
        self.router: Router | None = None
        if nodes:
            self._build(nodes)

    # ------------------------------------------------------------------------ structure ---
    def _build(self, nodes: Sequence[tuple[str, str]]) -> None:
        ids = [n for n, _ in nodes]
        old = {l.node_id: l for l in self.links}
        profiles = [self.router.state.profiles[self.router.state.index[n]] if self.router and n in self.router.state.index
                    else DEFAULT_PROFILE for n in ids]
        rcfg = RouterConfig(num_shards=self.config.num_shards, node_timeout_s=math.inf,
                            seed=secrets.randbits(31))  # its own tie-breaks: gateways must not herd
        self.router = make_router(self.config.router, ids, profiles, rcfg, now_s=self.clock())
        self.links = [old.get(n) or NodeLink(n, a.rstrip("/")) for n, a in nodes]
        for link, (_, a) in zip(self.links, nodes):
            link.address = a.rstrip("/")
            link.epoch, link.cursor, link.inflight = None, 0, 0
            if not link.live:
                self._mark_down(self.links.index(link))
        self.metrics.live_nodes.set(sum(l.live for l in self.links))

    def _mark_down(self, i: int) -> None:
        self.router.state.set_down(i)

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def start(self) -> None:
        c = self.config
        transport = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=c.max_connections, max_keepalive_connections=c.max_connections),
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self.client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(
            c.request_timeout_s, connect=c.connect_timeout_s))
        if self.control_plane:
            await self._refresh_registry(first=True)
            await self._register()
        await self._refresh_weights()
        await self._pull_residency_all()
        self._tasks = [asyncio.create_task(self._loop(c.health_interval_s, self._health_round), name="health"),
                       asyncio.create_task(self._loop(c.report_interval_s, self._pull_residency_all), name="residency"),
                       asyncio.create_task(self._loop(c.weights_interval_s, self._refresh_weights), name="weights")]
        if self.control_plane:
            self._tasks.append(asyncio.create_task(self._loop(c.registry_interval_s, self._refresh_registry),
                                                   name="registry"))
            self._tasks.append(asyncio.create_task(self._loop(c.client_report_interval_s, self.report_clients),
                                                   name="client-reports"))
        if self.sampler is not None:
            self._tasks.append(asyncio.create_task(self._loop(c.sample_interval_s, self.send_samples),
                                                   name="traffic-samples"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if self.control_plane and self.client is not None:  # the last interval, cut short
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.report_clients(), 2.0)
            if self.sampler is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.send_samples(), 2.0)
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        for link in self.links:
            if link.pool is not None:
                await link.pool.close()
                link.pool = None

    @staticmethod
    async def _loop(interval_s: float, fn) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a loop must survive one bad round
                log.exception("gateway background round %s failed", getattr(fn, "__name__", fn))

    # ------------------------------------------------------------------------- request path ---
    async def serve(self, body: bytes, phase: str | None = None, t0: float | None = None,
                    explain: str = "") -> tuple[int, bytes, dict]:
        """`recommend`, counted in the client-side view from ``t0`` (the request's first byte;
        default now); ``phase``: the load phase the client named; ``explain``: ``reason`` or
        ``scores`` (`recommend`)."""
        t0 = time.perf_counter() if t0 is None else t0
        status, content, headers = await self.recommend(body, t0, explain)
        latency_s = time.perf_counter() - t0
        self.client_view.record(status, latency_s, retried=headers.get("x-racer-retried") == "1", phase=phase)
        if not 400 <= status < 500:  # as the client view counts: the client's own faults left out, failures missed
            self.metrics.slo_requests.labels(
                "within" if status < 300 and latency_s * 1e3 <= self.client_view.slo_ms else "missed").inc()
        return status, content, headers

    async def recommend(self, body: bytes, first_byte_s: float | None = None,
                        explain: str = "") -> tuple[int, bytes, dict]:
        """Route, forward, retry on another node as `choose_retry` says (once at most); returns
        ``(status, body, extra headers)``. A served answer's ``routing`` says the policy, source
        and K/V holder; with ``explain`` ``reason`` also the one-line reason, with ``scores`` the
        reason and the per-node score terms (composing and encoding them costs the gateway more
        CPU than the routing itself, so only on request: `EXPLAIN_HEADER`);
        ``gateway`` says ``upstream_ms``, the round trips to nodes, and ``gateway_ms``, from the
        request's first byte (``first_byte_s``, `time.perf_counter`; default now) to the answer."""
        t0 = time.perf_counter()
        first_byte_s = t0 if first_byte_s is None else first_byte_s
        m = self.metrics
        try:
            parsed = _parse_body(body)
            rreq = _route_of(parsed, self.item_shard)
        except BadRequest as e:
            m.requests.labels("none", "bad_request", "none").inc()
            return 422, _dumps({"error": str(e)}), {}
        # a sampled user's request is kept as answered (a 4xx, the client's own fault, is not)
        sampled = self.sampler.pick(rreq.user) if self.sampler is not None else None
        router = self.router
        if router is None:
            return 503, _dumps({"error": "no nodes known to the gateway"}), {}
        try:
            d = router.route(rreq, self.clock())
        except NoLiveNodeError:
            m.requests.labels("none", "no_live_node", "none").inc()
            if sampled is not None:
                self._sample(sampled, parsed, None, 503, first_byte_s)
            return 503, _dumps({"error": self._no_live_reason()}), {}
        source = d.source
        served = d.node_index
        tried: list[int] = []
        failed: list[dict] = []
        up_s = 0.0
        while True:
            tried.append(served)
            status, content, up, kind = await self._forward(served, body)
            up_s += up
            if kind is None:
                break
            failed.append(self._failure_note(served, kind, status, content))
            choice = choose_retry(Attempt(tuple(tried), kind), self._retry_snapshot(d))
            if choice.give_up:
                m.requests.labels(self.links[served].node_id, "upstream_error", source).inc()
                m.overhead.observe(max(time.perf_counter() - t0 - up_s, 0.0))
                if sampled is not None:
                    self._sample(sampled, parsed, self.links[served].node_id, choice.status, first_byte_s)
                return choice.status, self._failed_body(tried, failed), (
                    {"x-racer-retried": "1"} if len(tried) > 1 else {})
            m.retries.labels(kind).inc()
            served = choice.node
            router.state.dispatch(served, rreq.user, rreq.history_len + rreq.num_new_items, self.clock())
        retried = len(tried) > 1
        nid = self.links[served].node_id
        headers = {"x-racer-served-by": nid, "x-racer-retried": "1" if retried else "0"}
        if status >= 300:  # a 4xx: the node's answer, unchanged
            m.requests.labels(nid, "client_error", source).inc()
            m.overhead.observe(max(time.perf_counter() - t0 - up_s, 0.0))
            return status, content, headers
        extra = {"served_by": nid, "retried": retried,
                 "routing": {"policy": d.policy, "source": source,
                             "kv_holder": None if d.kv_holder < 0 else self.links[d.kv_holder].node_id}}
        if failed:
            extra["routing"]["failed"] = failed[0]
        if explain:
            extra["routing"]["reason"] = d.reason
            b = d.breakdown() if explain == "scores" else None
            if b is not None:
                extra["routing"]["scores"] = {r.pop("node"): r for r in b.rows()}
        extra["gateway"] = {"upstream_ms": round(up_s * 1e3, 3),
                            "gateway_ms": round((time.perf_counter() - first_byte_s) * 1e3, 3)}
        tail = _dumps(extra)
        out = content[:-1] + b"," + tail[1:] if len(content) > 2 and content.endswith(b"}") else content
        m.requests.labels(nid, "ok", source).inc()
        if sampled is not None:
            self._sample(sampled, parsed, nid, status, first_byte_s)
        overhead = max(time.perf_counter() - t0 - up_s, 0.0)
        m.overhead.observe(overhead)
        m.upstream.observe(up_s)
        return status, out, headers

    def _sample(self, user_hash: int, parsed: dict, node_id: str | None, status: int, first_byte_s: float) -> None:
        """Keep a sampled user's request, timed at its arrival (wall clock)."""
        self.sampler.record(user_hash, parsed, node_id=node_id, status=status,
                            ts_s=time.time() - (time.perf_counter() - first_byte_s))

    async def _forward(self, i: int, body: bytes) -> tuple[int, bytes, float, str | None]:
        """One attempt on node ``i``: ``(status, content, round trip s, failure kind or None)``."""
        link = self.links[i]
        link.inflight += 1
        inflight = link.inflight
        t = time.perf_counter()
        try:
            pool = link.pool
            if pool is None or pool.address != link.address:
                if pool is not None:
                    await pool.close()
                c = self.config
                pool = link.pool = UpstreamPool(link.address, max_connections=c.max_connections,
                                                connect_timeout_s=c.connect_timeout_s)
            status, content = await pool.post("/v1/recommend", body, timeout_s=self.config.request_timeout_s)
            kind = "5xx" if status >= 500 else None
        except UpstreamTimeout as e:
            status, content, kind = 0, str(e).encode() or b"timeout", "timeout"
        except UpstreamError as e:
            status, content, kind = 0, (str(e) or type(e).__name__).encode(), "connect"
        finally:
            link.inflight -= 1
            self.router.complete(i)
        up_s = time.perf_counter() - t
        self.client_view.attempt(link.node_id, up_s, failed=kind is not None, inflight=inflight,
                                 node_total_us=node_total_us(content) if status == 200 else None)
        return status, content, up_s, kind

    def _failure_note(self, i: int, kind: str, status: int, content: bytes) -> dict:
        link = self.links[i]
        err = content[:300].decode("utf-8", "replace")
        note = {"node": link.node_id, "kind": kind, "status": status or None, "error": f"{kind}: {err}"}
        self.metrics.failures.labels(link.node_id, kind).inc()
        # no user id: logs leave the fleet's hands more easily than its database (the traffic sample
        # stores users only as keyed hashes)
        log.warning(json.dumps({"event": "upstream_failure", "node": link.node_id, "address": link.address,
                                "kind": kind, "status": status or None, "error": err}))
        if kind == "connect":  # a refused connection counts as a failed health check
            self._health_result(i, False, f"connect: {err}")
        return note

    def _retry_snapshot(self, d) -> RetrySnapshot:
        """What `choose_retry` reads: decision ``d``'s scores, who is live and the loads now."""
        st = self.router.state
        return RetrySnapshot(tuple(l.node_id for l in self.links), d.score, st.alive, st.load)

    def _failed_body(self, tried: list[int], failed: list[dict]) -> bytes:
        """The 502/504 answer once `choose_retry` gave up: every failed attempt, in order."""
        ids = [self.links[i].node_id for i in tried]
        if len(tried) == 1:
            return _dumps({"error": f"node {ids[0]} failed ({failed[0]['error']}) and no other node is live to "
                                    f"retry on", "failed": failed[0]})
        return _dumps({"error": f"nodes {' and '.join(ids)} both failed ({'; '.join(f['error'] for f in failed)})",
                       "failed": failed, "retried": True})

    def _no_live_reason(self) -> str:
        parts = [f"{l.node_id}: {l.health.last_error or 'out of rotation'}" for l in self.links if not l.live]
        return "no live node: every node is out of rotation (" + "; ".join(parts) + ")"

    # --------------------------------------------------------------------------- health ---
    def _health_result(self, i: int, ok: bool, error: str | None = None) -> None:
        """Apply a health check's result (or a refused connection) to node ``i``: `health_transition`
        decides; taking a node out or putting it back in the router happens here."""
        link = self.links[i]
        now = self.clock()
        t = health_transition(link.health, HealthEvent(ok, error), now, self.health_policy)
        link.health = t.state
        if t.change == "in":
            link.epoch, link.cursor = None, 0  # the node may have restarted: take a full snapshot
            self.router.report(NodeReport(link.node_id, at_s=now, queue_depth=0.0))
            log.warning(json.dumps({"event": "node_in", "node": link.node_id, "successes": t.state.successes}))
        elif t.change == "out":
            self._mark_down(i)
            log.warning(json.dumps({"event": "node_out", "node": link.node_id, "failures": t.state.failures,
                                    "error": error}))
        self.metrics.live_nodes.set(sum(l.live for l in self.links))

    async def _check(self, i: int) -> None:
        link = self.links[i]
        try:
            r = await self.client.get(link.address + "/healthz", timeout=self.config.health_timeout_s)
            ok = r.status_code == 200
            err = None if ok else f"healthz {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            ok, err = False, f"{type(e).__name__}: {e}"
        if i < len(self.links) and self.links[i] is link:
            self._health_result(i, ok, err)

    async def _health_round(self) -> None:
        await asyncio.gather(*(self._check(i) for i in range(len(self.links))))

    # ------------------------------------------------------------------------ residency ---
    async def _pull_residency(self, i: int) -> None:
        link = self.links[i]
        if not link.live:
            return
        params = {"cursor": link.cursor}
        if link.epoch:
            params["epoch"] = link.epoch
        sent_s = self.clock()
        try:
            r = await self.client.get(link.address + "/v1/residency", params=params, headers=self._fleet_headers,
                                      timeout=self.config.health_timeout_s * 4)
            r.raise_for_status()
            feed = r.json()
        except (httpx.HTTPError, ValueError) as e:
            link.report_error = f"{type(e).__name__}: {e}"
            return
        if self.links[i] is not link or not link.live:
            return
        self.apply_feed(i, feed, sent_s)

    def apply_feed(self, i: int, feed: dict, at_s: float) -> None:
        """Apply one ``/v1/residency`` answer of node ``i`` fetched at gateway time ``at_s``."""
        link = self.links[i]
        st = self.router.state
        added = np.asarray(feed.get("kv_added", []), dtype=np.int64)
        lens = np.asarray(feed.get("kv_cached_lens", []), dtype=np.int64)
        evicted = np.asarray(feed.get("kv_evicted", []), dtype=np.int64)
        if feed.get("full"):  # everything the node holds: forget what the map puts there and it lacks
            used = np.flatnonzero((st.kv.node == i) & (st.kv.keys >= 0))
            evicted = np.setdiff1d(st.kv.keys[used], added)
        hot = feed.get("hot_shards")
        if hot is not None and feed.get("num_shards") not in (None, 0, st.num_shards):
            link.report_error = (f"node has {feed.get('num_shards')} shards, gateway {st.num_shards}: "
                                 f"hot shards ignored")
            hot = None
        node_q = int(feed.get("queue_depth") or 0)
        report = NodeReport(link.node_id, at_s=at_s, queue_depth=float(max(link.inflight, node_q)),
                            hot_shards=None if hot is None else np.asarray(hot, dtype=np.int64),
                            evicted_users=evicted, kv_users=added, kv_cached_lens=lens)
        self.router.report(report)
        link.epoch, link.cursor = feed.get("epoch"), int(feed.get("cursor", 0))
        link.last_report_s, link.report_error = at_s, None
        link.node_queue_depth = node_q
        link.hot_shards = [] if hot is None else list(hot)
        svc = feed.get("service_time_us")
        if svc:
            link.service_time_us = float(svc)
            if self.weights_source == "node_metrics":
                p = st.profiles[i]
                if service_time_changed(p.service_time_us, svc):
                    st.set_profile(i, replace(p, service_time_us=float(svc)))
                    self.weights_version += 1
                    self.weights_computed_at_s = time.time()
                    self.weights_reasons[link.node_id] = "miss costs from the node's /v1/metrics; " \
                                                         "service time from its residency feed"
                    self.metrics.weights_version.set(self.weights_version)

    async def _pull_residency_all(self) -> None:
        await asyncio.gather(*(self._pull_residency(i) for i in range(len(self.links))))

    # -------------------------------------------------------------------------- weights ---
    def apply_weights(self, payload: dict) -> dict:
        """Apply a weights document (push or pull); raises ValueError naming the bad field."""
        if not isinstance(payload, dict):
            raise ValueError("body: must be a JSON object")
        version = payload.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version: must be an integer >= 0, got {version!r}")
        nodes = payload.get("nodes")
        if not isinstance(nodes, dict):
            raise ValueError("nodes: must be an object {node_id: cost profile}")
        profiles = {}
        for nid, p in nodes.items():
            if not isinstance(p, dict):
                raise ValueError(f"nodes.{nid}: must be an object")
            missing = [f for f in _PROFILE_FIELDS if f not in p]
            if missing:
                raise ValueError(f"nodes.{nid}.{missing[0]}: field required")
            try:
                profiles[nid] = CostProfile(**{f: p[f] for f in _PROFILE_FIELDS})
            except ValueError as e:
                raise ValueError(f"nodes.{nid}: {e}") from None
        computed = payload.get("computed_at_s")
        verdict = weights_verdict(version, WeightsInForce(self.weights_version, self.weights_source,
                                                          self.weights_computed_at_s))
        if not verdict.apply:
            if verdict.current:  # a push of what a pull already brought: nothing to do
                return {"applied": False, "current": True, "version": version, "reason": verdict.reason}
            return {"applied": False, "current": False, "reason": verdict.reason}
        st = self.router.state
        known = [n for n in profiles if n in st.index]
        # the state is rebuilt from this version alone: a node it does not name goes back to the
        # defaults instead of keeping what an older version said (a bad old profile never outlives it)
        for n, i in st.index.items():
            if n in profiles:
                st.profiles[i] = profiles[n]
                self.weights_reasons[n] = str(nodes[n].get("reason", "control plane"))[:512]
            else:
                st.profiles[i] = DEFAULT_PROFILE
                self.weights_reasons[n] = f"not in weights version {version}: defaults"
        if st.index:
            first = next(iter(st.index))
            st.set_profile(first, st.profiles[st.index[first]])  # re-derives the weights once
        self.weights_version = version
        self.weights_source = "control_plane"
        self.weights_computed_at_s = float(computed) if isinstance(computed, (int, float)) else time.time()
        self.metrics.weights_version.set(version)
        return {"applied": True, "version": version, "nodes": known,
                "ignored_unknown_nodes": sorted(set(profiles) - set(known))}

    async def _refresh_weights(self) -> None:
        if self.control_plane:
            try:
                r = await self.client.get(self.control_plane + "/api/v1/router/weights", headers=self._headers(),
                                          timeout=5.0)
                if r.status_code == 200:
                    self.apply_weights(r.json())
                else:
                    log.warning(json.dumps({"event": "weights_pull_failed", "status": r.status_code,
                                            "error": r.text[:200]}))
            except (httpx.HTTPError, ValueError) as e:
                log.warning(json.dumps({"event": "weights_pull_failed", "error": f"{type(e).__name__}: {e}"}))
            return
        if self.weights_source == "control_plane":  # a pushed document is in force: keep it
            return
        st = self.router.state
        changed = False

        async def one(i: int) -> None:
            nonlocal changed
            link = self.links[i]
            try:
                r = await self.client.get(link.address + "/v1/metrics", timeout=2.0)
                r.raise_for_status()
                costs = r.json().get("miss_costs") or {}
            except (httpx.HTTPError, ValueError):
                return
            old = st.profiles[i]
            p, self.weights_reasons[link.node_id] = profile_from_metrics(old, costs, link.service_time_us,
                                                                         self.config.queue_capacity)
            if p != old:
                st.profiles[i] = p
                changed = True

        await asyncio.gather(*(one(i) for i in range(len(self.links))))
        if changed or self.weights_computed_at_s is None:
            st.set_profile(0, st.profiles[0])
            self.weights_version += 1
            self.weights_computed_at_s = time.time()
            self.metrics.weights_version.set(self.weights_version)

    # ------------------------------------------------------------------- client reports ---
    async def report_clients(self) -> None:
        """End the client-side interval and send every pending report to the control plane
        (batches of `CLIENT_REPORT_BATCH`). A report the control plane refuses for good (403,
        413, 422) is dropped, counted and logged; on a connection error, 401, 409 or 5xx it is kept
        and sent again next interval (idempotent there on gateway id and seq); a batch over the
        control plane's body cap (413) or refused as invalid (422) is sent again in halves, so only
        the one report refused alone is dropped."""
        live = {l.node_id: l.live for l in self.links}
        self.client_reports.append(self.client_view.close(num_live_nodes=sum(live.values()), num_nodes=len(live),
                                                          live=live))
        if not self.control_plane or self.client is None:
            return
        self._ensure_gateway_id()
        url = f"{self.control_plane}/api/v1/gateways/{self.gateway_id}/reports"
        size = CLIENT_REPORT_BATCH
        while self.client_reports:
            batch = [self.client_reports[k] for k in range(min(size, len(self.client_reports)))]
            try:
                r = await self.client.post(url, json={"reports": batch}, headers=self._headers(), timeout=5.0)
            except httpx.HTTPError as e:
                self._client_report_failed(f"{type(e).__name__}: {e}")
                return
            step = client_report_step(r.status_code, len(batch), CLIENT_REPORT_BATCH)
            if step.action == "keep":
                self._client_report_failed(f"{r.status_code}: {r.text[:200]}")
                return
            size = step.next_size or size
            if step.action == "split":
                continue
            for _ in batch:
                self.client_reports.popleft()
            if step.action == "drop":
                self.client_reports_dropped += len(batch)
                self._client_report_failed(f"{r.status_code}: {r.text[:300]} ({len(batch)} reports dropped)")
                continue
            self.client_reports_sent += len(batch)
            self.client_report_error = None

    def _ensure_gateway_id(self) -> None:
        """The id this gateway reports and samples under: given, else one from host and process."""
        if self.gateway_id is None:
            self.gateway_id = gateway_id_from(f"{socket.gethostname()}-{os.getpid()}")

    def _client_report_failed(self, error: str) -> None:
        if error != self.client_report_error:
            log.warning(json.dumps({"event": "client_report_failed", "gateway_id": self.gateway_id, "error": error,
                                    "pending": len(self.client_reports)}))
        self.client_report_error = error

    # ------------------------------------------------------------------ traffic samples ---
    async def send_samples(self) -> None:
        """Hash what was sampled since the last round (`Sampler.prepare`) and send every ready sample
        to the control plane (batches of `SAMPLE_BATCH`, about `SAMPLE_BATCH_BYTES`), with the reports'
        refusal handling (`client_report_step`): kept on no answer, 401, 409, 429 or 5xx (idempotent
        there on gateway id and seq); a 413 or 422 batch sent again in halves; dropped and counted
        (``refused``) when refused alone or with another 4xx."""
        smp = self.sampler
        if smp is None:
            return
        await smp.prepare()
        if not self.control_plane or self.client is None:
            return
        self._ensure_gateway_id()
        url = f"{self.control_plane}/api/v1/gateways/{self.gateway_id}/samples"
        size = SAMPLE_BATCH
        while smp.ready:
            batch = smp.peek(size, SAMPLE_BATCH_BYTES)
            content = await smp.body(batch)
            try:
                r = await self.client.post(url, content=content, timeout=10.0,
                                           headers={**self._headers(), "content-type": "application/json"})
            except httpx.HTTPError as e:
                self._sample_failed(f"{type(e).__name__}: {e}")
                return
            step = client_report_step(r.status_code, len(batch), SAMPLE_BATCH)
            if step.action == "keep":
                self._sample_failed(f"{r.status_code}: {r.text[:200]}")
                return
            size = step.next_size or size
            if step.action == "split":
                continue
            if step.action == "drop":
                smp.drop(batch, "refused")
                self._sample_failed(f"{r.status_code}: {r.text[:300]} ({len(batch)} samples dropped)")
                continue
            smp.pop(batch)
            self.samples_sent += len(batch)
            self.metrics.samples_sent.inc(len(batch))
            self.sample_error = None

    def _sample_failed(self, error: str) -> None:
        if error != self.sample_error:  # an answer may echo what was sent: hashes, never a raw id
            log.warning(json.dumps({"event": "traffic_samples_failed", "gateway_id": self.gateway_id, "error": error,
                                    "pending": self.sampler.pending if self.sampler else 0}))
        self.sample_error = error

    def describe_clients(self) -> dict:
        """The client-side view: the interval so far (not yet reported) and the reporting state."""
        v = self.client_view
        return {"gateway_id": self.gateway_id, "slo_ms": v.slo_ms, "next_seq": v.seq,
                "interval_so_far": {"num_requests": sum(v.outcomes.values()), "outcomes": dict(v.outcomes),
                                    "num_retried": v.retried, "load_phase": v.last_phase},
                "pending_reports": len(self.client_reports), "reports_sent": self.client_reports_sent,
                "reports_dropped": self.client_reports_dropped,
                "report_error": self.client_report_error,
                "reporting_to": self.control_plane,
                "samples": None if self.sampler is None else {**self.sampler.describe(), "sent": self.samples_sent,
                                                              "error": self.sample_error}}

    # ------------------------------------------------------------------------- registry ---
    async def _refresh_registry(self, first: bool = False) -> None:
        last_err = None
        for attempt in range(10 if first else 1):
            try:
                r = await self.client.get(self.control_plane + "/api/v1/nodes", headers=self._headers(), timeout=5.0)
                if r.status_code != 200:
                    raise ValueError(f"GET /api/v1/nodes answered {r.status_code}: {r.text[:200]}")
                rows = r.json()
                if isinstance(rows, dict):
                    rows = rows.get("nodes", rows.get("items", []))
                nodes = [(str(n["node_id"]), str(n["address"])) for n in rows]
                break
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                last_err = f"{type(e).__name__}: {e}"
                if first:
                    await asyncio.sleep(0.5)
        else:
            if first:
                raise RuntimeError(f"cannot read the node list from {self.control_plane}: {last_err}")
            log.warning(json.dumps({"event": "registry_failed", "error": last_err}))
            return
        diff = diff_registry([(l.node_id, l.address) for l in self.links] if self.router is not None else [], nodes)
        if diff.empty:
            if first:
                log.warning(json.dumps({"event": "registry_empty", "control_plane": self.control_plane}))
            return
        await self._register()  # until it succeeds
        if diff.changed:
            log.warning(json.dumps({"event": "nodes_changed", "nodes": [n for n, _ in diff.nodes],
                                    "reason": diff.reason}))
            self._build(diff.nodes)
            if not first:
                await self._pull_residency_all()

    async def _register(self) -> None:
        """Register this gateway for weight pushes (``POST /api/v1/routers {url}``), and again every
        `REREGISTER_S`: the answer carries the push token (it changes if the control plane's key
        does)."""
        if not self.advertise_url or (self.registered and self.clock() - self.registered_at_s < REREGISTER_S):
            return
        try:
            r = await self.client.post(self.control_plane + "/api/v1/routers", json={"url": self.advertise_url},
                                       headers=self._headers(), timeout=5.0)
            try:
                token = r.json().get("push_token") if r.status_code < 300 else None
            except (ValueError, AttributeError):
                token = None
            if isinstance(token, str) and token:
                self.push_token, self.registered, self.registered_at_s = token, True, self.clock()
            else:
                log.warning(json.dumps({"event": "register_failed", "status": r.status_code, "error": r.text[:200]}))
        except httpx.HTTPError as e:
            log.warning(json.dumps({"event": "register_failed", "error": f"{type(e).__name__}: {e}"}))

    # ---------------------------------------------------------------------- inspection ---
    def describe(self, user: int | None = None) -> dict:
        st = self.router.state
        w = st.weights
        counts = st.kv.count_by_node(st.num_nodes).tolist()
        now = self.clock()
        nodes = []
        for i, l in enumerate(self.links):
            nodes.append({
                "node_id": l.node_id, "address": l.address, "live": l.live,
                "health": {"consecutive_failures": l.health.failures, "consecutive_successes": l.health.successes,
                           "last_error": l.health.last_error},
                "queue_depth": float(st.queue[i]), "load": None if not math.isfinite(st.load[i]) else float(st.load[i]),
                "inflight": l.inflight, "node_queue_depth": l.node_queue_depth,
                "kv_resident_users": counts[i], "hot_shards": l.hot_shards,
                "residency_feed": {"epoch": l.epoch, "cursor": l.cursor, "report_error": l.report_error,
                                   "last_report_age_s": None if l.last_report_s is None
                                   else round(now - l.last_report_s, 3)},
                "weights": {"kv_us_per_token": float(w.kv_us_per_token[i]), "emb_us_per_row": float(w.emb_us_per_row[i]),
                            "ld_us": float(w.ld_us[i]), "load_offset_us": float(w.load_offset_us[i])},
            })
        out = {
            "router": self.config.router,
            "weights": {"version": self.weights_version, "source": self.weights_source,
                        "computed_at_s": self.weights_computed_at_s,
                        "nodes": {l.node_id: {**{f: getattr(st.profiles[i], f) for f in _PROFILE_FIELDS},
                                              "reason": self.weights_reasons.get(l.node_id, "defaults")}
                                  for i, l in enumerate(self.links)}},
            "nodes": nodes, "num_live_nodes": sum(l.live for l in self.links),
            "control_plane": self.control_plane, "registered_for_pushes": self.registered,
            "config": asdict(self.config),
        }
        if user is not None:
            holder, cached = st.kv.lookup(user)
            out["user"] = {"user_id": user, "kv_holder": None if holder < 0 else self.links[holder].node_id,
                           "cached_len": int(cached)}
        return out


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# ------------------------------------------------------------------------------------ the app ---
class GatewayApp:
    """The ASGI app: ``POST /v1/recommend`` handled directly (no framework layers on the request
    path: it reads the body, at most ``max_body_bytes``, calls `Gateway.recommend`, sends the
    answer), everything else (including the lifespan) by the FastAPI app ``fastapi``, behind
    the same body cap (`BodyLimit`)."""

    def __init__(self, gateway: Gateway, fastapi_app: FastAPI) -> None:
        self.gateway = gateway
        self.max_body_bytes = gateway.config.max_body_bytes
        # behind the cap: a JSON-only weights push, and 405 / OPTIONS naming every allowed method
        self.fastapi = AllowedMethods(JsonOnly(BodyLimit(fastapi_app, self.max_body_bytes, error_field="error"),
                                               {"/v1/router/weights"}), fastapi_app.router.routes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/recommend" and scope["method"] == "POST":
            t0 = time.perf_counter()
            phase = None
            explain = ""
            for name, value in scope.get("headers", ()):
                if name == _PHASE_HEADER_B:
                    phase = clean_phase(value)
                elif name == _EXPLAIN_HEADER_B:
                    explain = _explain_level(value.decode("latin-1"))
            if not json_content_type(scope):  # refused here, never forwarded for the node to refuse
                self.gateway.metrics.requests.labels("none", "bad_request", "none").inc()
                self.gateway.client_view.record(415, time.perf_counter() - t0, phase=phase)
                await send_json(send, 415, {"error": f"gateway: {unsupported_media_type(scope)}"},
                                close=may_have_body(scope))
                return
            try:
                body = await read_body(receive, self.max_body_bytes, scope)
            except BodyTooLarge as e:
                self.gateway.metrics.requests.labels("none", "too_large", "none").inc()
                self.gateway.client_view.record(413, time.perf_counter() - t0, phase=phase)
                await send_json(send, 413, {"error": f"gateway: {e} (its --max-body-bytes)"}, close=True)
                return
            if body is None:  # the client went away
                return
            status, content, headers = await self.gateway.serve(body, phase, t0, explain)
            raw = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
            raw += [(k.encode(), v.encode()) for k, v in headers.items()]
            await send({"type": "http.response.start", "status": status, "headers": raw})
            await send({"type": "http.response.body", "body": content})
            return
        await self.fastapi(scope, receive, send)


_PHASE_HEADER_B = PHASE_HEADER.encode()
#: ``x-racer-explain: reason`` on ``POST /v1/recommend``: the answer's ``routing`` carries the
#: decision's one-line reason; ``scores``: the reason and the per-node score terms
#: (`RoutingDecision.breakdown`); anything else: neither
EXPLAIN_HEADER = "x-racer-explain"
_EXPLAIN_HEADER_B = EXPLAIN_HEADER.encode()


def _explain_level(value: str | None) -> str:
    v = (value or "").strip().lower()
    return v if v in ("reason", "scores") else ""


class GatewayError(BaseModel):
    """The body of the gateway's own error answers (a node's error answer is passed on as the node
    sent it, which has the same ``error`` field)."""
    error: str


def _errors(descriptions: dict[int, str]) -> dict:
    return {c: {"model": GatewayError, "description": d} for c, d in descriptions.items()}


def create_app(gateway: Gateway) -> GatewayApp:
    """The gateway's ASGI app; its lifespan starts and stops the gateway's loops and client."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="RACER gateway", version="1", lifespan=lifespan)
    finite_validation_errors(app)  # a rejected NaN/Infinity gets its 422, not a 500

    @app.post("/v1/recommend", responses=_errors({
        413: "request body over --max-body-bytes (not forwarded)",
        415: "the body is not announced as JSON (not forwarded)",
        422: "invalid request body (the field is named in `error`)", 502: "the node failed twice",
        503: "no live node", 504: "the node did not answer in time"}))
    async def recommend(request: Request):
        status, content, headers = await gateway.serve(
            await request.body(), clean_phase(request.headers.get(PHASE_HEADER)),
            explain=_explain_level(request.headers.get(EXPLAIN_HEADER)))
        return Response(content, status_code=status, headers=headers, media_type="application/json")

    @app.get("/v1/router", responses=_errors({401: "the gateway has a fleet token and the request does not carry "
                                                   "it (the view names node addresses and where a user's cache is)"}))
    async def router_state(request: Request, user: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None):
        if not bearer_ok(request.headers.get("authorization"), gateway.fleet_token):
            return JSONResponse(status_code=401, headers={"www-authenticate": "Bearer"}, content={
                "error": "this view needs the fleet token (Authorization: Bearer <RACER_FLEET_TOKEN>)"})
        return gateway.describe(user)

    @app.post("/v1/router/weights", responses={
        **_errors({401: "missing or wrong bearer token", 403: "weight pushes are disabled on this gateway",
                   413: "body over --max-body-bytes",
                   422: "invalid weights document (the field is named in `error`)"}),
        409: {"description": "not applied: the version is older than the gateway's", "content": {
            "application/json": {"schema": {"type": "object", "properties": {"applied": {"type": "boolean"}}}}}}})
    async def push_weights(request: Request):
        if not gateway.push_token:
            return JSONResponse(status_code=403, content={
                "error": "weight pushes are disabled: the gateway has no push token (--push-token-file without a "
                         "control plane; with one, --advertise-url and a registration the control plane answered)"})
        if not bearer_ok(request.headers.get("authorization"), gateway.push_token):
            return JSONResponse(status_code=401, content={"error": "missing or wrong bearer token"})
        try:
            payload = json.loads(await request.body())
            result = gateway.apply_weights(payload)
        except ValueError as e:
            return JSONResponse(status_code=422, content={"error": str(e)[:1000]})
        except RecursionError:
            return JSONResponse(status_code=422, content={"error": "body: JSON nested too deeply"})
        return JSONResponse(status_code=200 if result["applied"] or result.get("current") else 409, content=result)

    @app.get("/v1/clients")
    async def clients():
        return gateway.describe_clients()

    @app.get("/healthz")
    async def healthz():
        live = sum(l.live for l in gateway.links)
        return JSONResponse(status_code=200 if live else 503, content={
            "status": "ok" if live else "no_live_node", "num_nodes": len(gateway.links), "num_live_nodes": live})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def metrics():
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return GatewayApp(gateway, app)


# -------------------------------------------------------------------------------- command line ---
def _node_list(text: str) -> list[tuple[str, str]]:
    out = []
    for part in text.split(","):
        url = part.strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--nodes: {url!r} is not an http(s) URL")
        out.append((url.split("://", 1)[1], url))
    if not out:
        raise ValueError("--nodes: no node URL given")
    if len({n for n, _ in out}) != len(out):
        raise ValueError("--nodes: a node is listed twice")
    return out


def cmd_gateway(args) -> int:
    from common.http_server import serve_forever  # TCP_NODELAY on accepted connections

    if bool(args.nodes) == bool(args.control_plane):
        raise ValueError("give exactly one of --nodes and --control-plane")
    cfg = GatewayConfig(**config_kwargs(args, CLI_CONFIG_FIELDS))
    nodes = _node_list(args.nodes) if args.nodes else []
    item_shard = None
    if args.trace:
        from workloads.loaders import load_trace

        item_shard = load_trace(args.trace, args.path, num_shards=args.num_shards).item_shard
    if args.advertise_url and not args.control_plane:
        raise ValueError("--advertise-url applies with --control-plane only")
    fleet_token = read_secret(args, "fleet-token", FLEET_TOKEN_ENV, prog="racer gateway")
    require_fleet_token(fleet_token, args.host, "the gateway")
    token = read_secret(args, "token", "RACER_GATEWAY_TOKEN", prog="racer gateway")
    push_token = read_secret(args, "push-token", "RACER_GATEWAY_PUSH_TOKEN", prog="racer gateway")
    if push_token and args.control_plane:
        raise ValueError("--push-token-file / $RACER_GATEWAY_PUSH_TOKEN apply without --control-plane only: the "
                         "control plane gives a registered gateway its push token")
    sample_key = traffic_sample_key(read_secret(args, "sample-key", SAMPLE_KEY_ENV, prog="racer gateway"))
    gw = Gateway(nodes, cfg, item_shard=item_shard, control_plane=args.control_plane,
                 token=token,
                 advertise_url=args.advertise_url, push_token=push_token, gateway_id=args.gateway_id,
                 fleet_token=fleet_token, sample_key=sample_key)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    def ready(host: str, port: int) -> None:
        if not fleet_token:
            print(f"racer gateway: no fleet token (${FLEET_TOKEN_ENV}): GET /v1/router is open to local callers",
                  flush=True)
        if gw.gateway_id is None:
            gw.gateway_id = gateway_id_from(f"{socket.gethostname() if host in ('0.0.0.0', '::') else host}:{port}")
        print(f"racer gateway: serving on http://{host}:{port} (router {cfg.router}, "
              f"{len(nodes) if nodes else 'registry'} nodes)", flush=True)

    serve_forever(create_app(gw), args.host, args.port, log_level=args.log_level, ready=ready)
    print("racer gateway: stopped", flush=True)
    return 0


#: the `GatewayConfig` fields the command line sets (``--router``, ``--report-interval-s``, ...)
CLI_CONFIG_FIELDS = ("router", "num_shards", "report_interval_s", "health_interval_s", "health_timeout_s",
                     "health_failures", "health_successes", "request_timeout_s", "max_body_bytes", "slo_ms",
                     "client_report_interval_s", "sample_rate", "sample_max_items", "sample_interval_s")


def add_gateway_parser(subparsers) -> None:
    """Add ``gateway`` to racer's top-level subparsers."""
    from workloads.loaders import LOADERS

    g = subparsers.add_parser("gateway", help="route recommendation requests to node agents (EMB-KV-aware)",
                              description="The gateway: POST /v1/recommend routed by the chosen router to the "
                                          "node agents, with residency feeds, health checks and retries.")
    g.add_argument("--nodes", default=None, help="node agent URLs, comma-separated (http://host:port,...)")
    g.add_argument("--control-plane", default=None, help="control plane URL: node list and weights from it")
    add_secret_arguments(g, "token", "RACER_GATEWAY_TOKEN",
                         "bearer token sent to the control plane (a router token: it lists nodes, reads weights and "
                         "registers the gateway)")
    add_secret_arguments(g, "push-token", "RACER_GATEWAY_PUSH_TOKEN",
                         "secret weight pushes to this gateway must carry, without --control-plane (with one, the "
                         "control plane gives it when the gateway registers; without either, pushes are refused)",
                         file_only=True)
    add_secret_arguments(g, "sample-key", SAMPLE_KEY_ENV,
                         "key of the traffic samples' keyed hash of user and item ids (--sample-rate > 0; a random "
                         "secret of at least 16 characters, the same on every gateway)", file_only=True)
    add_secret_arguments(g, "fleet-token", FLEET_TOKEN_ENV,
                         "token shown to the agents' /v1/residency and wanted on GET /v1/router (the same on every "
                         "agent; needed to listen beyond loopback)", file_only=True)
    g.add_argument("--advertise-url", default=None,
                   help="this gateway's URL as the control plane reaches it: registered with POST /api/v1/routers "
                        "for weight pushes (default: none, weights are pulled only)")
    g.add_argument("--trace", default=None, choices=sorted(LOADERS),
                   help="trace the nodes serve: its item -> shard map feeds the EMB term (default: none, no EMB term)")
    g.add_argument("--path", default=None, help="trace file (default: the sample)")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (0: a free one; default 8000)")
    add_config_arguments(g, GatewayConfig, CLI_CONFIG_FIELDS)
    g.add_argument("--gateway-id", default=None,
                   help="this gateway's id in its client-side reports to the control plane (default: the "
                        "--advertise-url's host:port, else host:port)")
    g.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn log level (default warning)")
    g.set_defaults(func=cmd_gateway)
