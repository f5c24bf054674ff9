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
``client_report_interval_s`` (`gateway.client_view`: end-to-end P50/P99, SLO attainment,
outcomes, retries, 503s, per-node queueing before the node, the load phase clients name in
``x-racer-load-phase``) to ``POST /api/v1/gateways/{gateway_id}/reports``; reports the control
plane did not take are kept (at most ``MAX_PENDING_CLIENT_REPORTS``) and sent again. See
docs/gateway.md.

With ``--sample-rate R`` (> 0; a key from ``--sample-key-file`` / ``$RACER_SAMPLE_KEY``) it also
samples its traffic by user for a what-if replay (`gateway.traffic_sample`: every request of
a fraction R of the users, ids hashed with the key) and sends the samples every
``sample_interval_s`` to ``POST /api/v1/gateways/{gateway_id}/samples``, as it sends its reports.

The decisions (which node a failed request is retried on, a node's health transitions, what a new
node list changes, whether a weights document applies, what to do with a client-report batch)
are pure functions in `gateway.decisions`; `Gateway` does the I/O around them, one idea per
module: the request path (`gateway.request_path`), health checks and residency feeds
(`gateway.nodes`), the weights in force (`gateway.weights_sync`), the control plane's node list and
the registration for pushes (`gateway.registry`), client reports and traffic samples
(`gateway.uplink`), the state they share declared in `gateway.state`; the HTTP app is
`gateway.app`, the command line `gateway.cli`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

import httpx
import numpy as np

from .client_view import ClientView
from .config import GatewayConfig
from .decisions import HealthPolicy
from .metrics import GatewayMetrics
from .nodes import NodeLink, NodeWatch
from .registry import RegistrySync
from .request_path import RequestPath
from .router import Router, RouterConfig, make_router
from .traffic_sample import Sampler
from .uplink import MAX_PENDING_CLIENT_REPORTS, Uplink, gateway_id_from
from .weights_sync import DEFAULT_PROFILE, PROFILE_FIELDS, WeightsSync

log = logging.getLogger("racer.gateway")


class Gateway(RequestPath, NodeWatch, WeightsSync, RegistrySync, Uplink):
    """The router, the node links and the loops that keep them current.

    ``nodes``: ``[(node_id, address)]``; ``item_shard``: item -> shard map of the trace the nodes
    serve (``None``: the EMB term sees no items); ``control_plane``/``token``: where node lists and
    weights come from (``None``: the ``nodes`` given, weights from the nodes' ``/v1/metrics``);
    ``sample_key``: the traffic samples' key (needed when ``config.sample_rate`` > 0).

    The state every part shares is set here (declared by `gateway.state.GatewayState`); the
    parts' methods come from `RequestPath`, `NodeWatch`, `WeightsSync`, `RegistrySync` and
    `Uplink`, one module each.
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
        self.metrics = GatewayMetrics()
        # what clients see (reported to the control plane); the id defaults to the advertised
        # address, else host:port once serving (`gateway.cli.cmd_gateway`), else host-pid
        self.gateway_id = gateway_id_from(gateway_id or self.advertise_url or "") if (
            gateway_id or self.advertise_url) else None
        self.client_view = ClientView(self.config.slo_ms)
        self.client_reports: collections.deque = collections.deque(maxlen=MAX_PENDING_CLIENT_REPORTS)
        self.client_report_error: str | None = None
        self.client_reports_sent = 0
        self.client_reports_dropped = 0  # refused for good by the control plane (403, 413 or 422 alone)
        # traffic samples for a what-if replay (gateway.traffic_sample): None when off
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
                        "nodes": {l.node_id: {**{f: getattr(st.profiles[i], f) for f in PROFILE_FIELDS},
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
