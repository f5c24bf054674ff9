"""The request path: a recommendation body read into the router's view (`route_of`), routed,
forwarded to the chosen node and retried once on another as `gateway.decisions.choose_retry` says;
what clients see (`gateway.client_view`) and the traffic sample (`gateway.traffic_sample`) are
recorded on the way. `RequestPath` holds these methods of `gateway.gateway.Gateway`."""

from __future__ import annotations

import json
import logging
import time

import numpy as np

from common.http_client import UpstreamError, UpstreamPool, UpstreamTimeout

from .client_view import node_total_us
from .decisions import Attempt, RetrySnapshot, choose_retry
from .router import NoLiveNodeError, RouteRequest
from .state import GatewayState

log = logging.getLogger("racer.gateway")

_EMPTY = np.empty(0, dtype=np.int64)


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


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class RequestPath(GatewayState):
    """`Gateway.serve` and `Gateway.recommend`: route, forward, retry, answer. Reads the router,
    the node links, the config, the metrics, the client view and the sampler of the gateway; a
    refused connection counts as a failed health check (`NodeWatch._health_result`)."""

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
        CPU than the routing itself, so only on request: `gateway.app.EXPLAIN_HEADER`);
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
