"""The gateway's view of each node beyond the router's state (`NodeLink`), and what keeps it
current: health checks (``GET /healthz``; `gateway.decisions.health_transition` decides, a node
taken out or put back here) and the residency feed (``GET /v1/residency?cursor=N&epoch=E``,
applied to the router as a `NodeReport`). `NodeWatch` holds these methods of
`gateway.gateway.Gateway`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field, replace

import httpx
import numpy as np

from common.http_client import UpstreamPool

from .decisions import HealthEvent, HealthState, health_transition, service_time_changed
from .router import NodeReport
from .state import GatewayState

log = logging.getLogger("racer.gateway")


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


class NodeWatch(GatewayState):
    """Health checks and residency feeds, one round over every node per interval. Reads the
    gateway's links, router, client, config, clock and metrics; a feed's service time updates the
    weights in force when they come from the nodes (``weights_source`` ``node_metrics``)."""

    def _mark_down(self, i: int) -> None:
        self.router.state.set_down(i)

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
