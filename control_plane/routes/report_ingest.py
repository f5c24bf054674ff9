"""Report ingestion, the hot path (one request per node per interval): `ingest_batch` validates
and stores one batch; the ``POST /nodes/{node_id}/reports`` route (`routes.nodes`) and the ASGI
fast path `IngestFastPath` (the same function without FastAPI's routing and dependency
machinery) both call it, and `IngestNative` runs its steps (`_checked`, `_stage`, `_settled`) in
the HTTP protocol for the batches it claims. Storage goes through the group-commit writer
(`control_plane.ingest`)."""

from __future__ import annotations

import json
import logging
import math
import re
import time

from fastapi.encoders import jsonable_encoder
from pydantic import ValidationError
from sqlalchemy.exc import DataError, IntegrityError

from common.contract import API, ReportBatchIn
from common.http_server import NativeRoute, json_safe, send_json_bytes
from db.models import Node
from db.queries import registered_device

from ..auth import PRINCIPAL_STATE, Principal, bearer_secret, node_route_refusal, role_refusal
from ..schemas import NodeOut
from .deps import NODE

log = logging.getLogger("racer.control_plane.ingest")
INGEST_PATH = re.compile(r"^/api/v1/nodes/([A-Za-z0-9_.:\-]{1,128})/reports$")


def node_out(state, node: Node, device: tuple[str | None, str | None] | None = None,
             throughput_rps: float | None = None) -> NodeOut:
    """A node as the API shows it: its row, the drop count its latest report gave, what its
    figures are (``device``: (device_mode, device_profile) from `db.queries.node_devices`; None:
    from its registration) and its latest report's request rate."""
    out = NodeOut.model_validate(node)
    out.throughput_rps = throughput_rps
    out.device_mode, out.device_profile = device if device is not None else registered_device(node.cost_profile)
    dropped = state.reports_dropped.get(node.node_id)
    if dropped is not None:
        out.num_reports_dropped = dropped[1]
    return out


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


async def _known_node(state, node_id: str) -> tuple[int, bytes] | None:
    """None when ``node_id`` is registered (then remembered in ``state.known_nodes``), else the
    (status, JSON body) to answer: 404 (not registered) or 503 (database unreachable)."""
    import anyio.to_thread

    def known() -> bool:
        with state.factory() as s:
            return s.get(Node, node_id) is not None

    try:
        is_known = await anyio.to_thread.run_sync(known)
    except Exception as e:  # noqa: BLE001 - database unreachable: the node keeps the batch and retries
        return 503, _json({"detail": f"database unavailable, retry later: {type(e).__name__}: {str(e)[:300]}"})
    if not is_known:
        return 404, _json({"detail": f"node_id {node_id!r} is not registered (POST {API}/nodes/register first)"})
    state.known_nodes.add(node_id)
    return None


def _rows(node_id: str, body: ReportBatchIn, now: float) -> tuple[list, list, list]:
    """The batch as rows of the reports, the decisions and the bursts tables."""
    rows, decisions, bursts = [], [], []
    for rep in body.reports:
        d = rep.__dict__.copy()  # its validated fields (all plain values but these two): a model_dump's tenth
        del d["decision"], d["bursts"]
        d["node_id"], d["received_s"] = node_id, now
        d["decision_source"] = rep.decision.source if rep.decision is not None else None
        rows.append(d)
        if rep.decision is not None:
            decisions.append(dict(node_id=node_id, seq=rep.seq, ts_s=rep.ts_s, source=rep.decision.source,
                                  emb_share=rep.decision.emb_share, prev_emb_share=rep.decision.prev_emb_share,
                                  reason=rep.decision.reason, policy_version=rep.policy_version,
                                  features=rep.decision.features,
                                  layers=[t.model_dump() for t in rep.decision.layers] or None))
        for b in rep.bursts:
            bursts.append(dict(node_id=node_id, start_s=b.start_s, end_s=b.end_s, magnitude=b.magnitude))
    return rows, decisions, bursts


def _count(state, node_id: str, body: ReportBatchIn, last, num_rows: int, stored: int, dup: int, t0: float,
           now: float) -> None:
    """The metrics of a stored batch, and the node's drop count (from its newest report saying)
    with when it last rose (`control_plane.alerts`: the first count seen is the baseline)."""
    said = [x for x in body.reports if x.num_reports_dropped is not None]
    if said:
        newest = max(said, key=lambda x: x.seq)
        old = state.reports_dropped.get(node_id)
        if old is None or newest.seq >= old[0]:  # a replayed older report does not lower it
            rose = now if old is not None and newest.num_reports_dropped > old[1] else (old[2] if old else None)
            state.reports_dropped[node_id] = (newest.seq, newest.num_reports_dropped, rose)
            state.metrics.node_reports_dropped.labels(node_id).set(newest.num_reports_dropped)
    m = state.metrics
    m.reports_received.inc(num_rows)
    m.reports_stored.inc(stored)
    if dup:
        m.reports_duplicate.inc(dup)
    m.observe_report(node_id, last)
    m.ingest_request.observe(time.perf_counter() - t0)


def _throttled(state, node_id: str, wait_s: float, what: str) -> tuple[int, bytes, dict]:
    """429 for a batch past ``node_id``'s quota (`control_plane.quota`), with ``Retry-After``."""
    state.metrics.reports_throttled.labels(what).inc()
    q = state.quota
    if math.isinf(wait_s):
        return 413, _json({"detail": f"the batch is larger than node {node_id}'s ingestion burst "
                                     f"({q.burst_rows:.0f} reports, {q.burst_bytes:.0f} bytes): send it in parts"}), {}
    retry = max(1, math.ceil(wait_s))
    return 429, _json({"detail": f"node {node_id} is over its ingestion quota ({q.rows_per_s:g} reports/s, "
                                 f"{q.bytes_per_s:.0f} bytes/s sustained; {what}): retry in {retry} s"}), \
        {"retry-after": str(retry)}


def _checked(state, node_id: str, raw: bytes, principal: Principal | None) -> ReportBatchIn | tuple:
    """The batch ``raw`` of ``node_id`` sent by ``principal``, validated within the node's quota
    (its bytes before the body is parsed, its rows after), else the (status, JSON body, extra
    headers) refusing it."""
    if principal is None:
        return 401, _json({"detail": "missing bearer token (Authorization: Bearer <token>)"}), \
            {"www-authenticate": "Bearer"}
    why = role_refusal(principal, (NODE,)) or node_route_refusal(principal, node_id)
    if why:
        return 403, _json({"detail": why}), {}
    wait = state.quota.take(node_id, nbytes=len(raw))
    if wait:
        return _throttled(state, node_id, wait, "bytes")
    try:
        body = ReportBatchIn.model_validate_json(raw)
    except ValidationError as e:
        errs = [{**x, "loc": ["body", *x["loc"]]} for x in e.errors(include_url=False, include_context=False)]
        return 422, _json({"detail": jsonable_encoder(json_safe(errs))}), {}
    wait = state.quota.take(node_id, rows=len(body.reports))
    if wait:
        return _throttled(state, node_id, wait, "reports")
    return body


def _stage(state, node_id: str, body: ReportBatchIn, clock) -> tuple:
    """Hand a validated batch to the group-commit writer: (its future, what `_settled` needs)."""
    now = clock()
    rows, decisions, bursts = _rows(node_id, body, now)
    last = max(body.reports, key=lambda x: x.seq)
    fut = state.writer.enqueue(node_id, rows, decisions, bursts, (now, last.seq, last.emb_share, last.policy_version))
    return fut, (body, last, len(rows), now)


def _settled(state, node_id: str, fut, staged: tuple, t0: float) -> tuple[int, bytes, dict]:
    """The answer to a batch whose commit ``fut`` is done (the metrics counted when stored)."""
    body, last, num_rows, now = staged
    try:
        stored, dup = fut.result()
    except (IntegrityError, DataError) as e:  # the batch itself is wrong: the node drops it and counts it
        return 422, _json({"detail": f"reports refused by the database: {type(e).__name__}: {e}"}), {}
    except Exception as e:  # noqa: BLE001 - database unreachable or failing: the node keeps the batch and retries
        return 503, _json({"detail": f"database unavailable, retry later: {type(e).__name__}: {str(e)[:300]}"}), {}
    _count(state, node_id, body, last, num_rows, stored, dup, t0, now)
    return 200, b'{"stored":%d,"duplicates":%d}' % (stored, dup), {}


async def ingest_batch(state, node_id: str, raw: bytes, clock,
                       principal: Principal | None) -> tuple[int, bytes, dict[str, str]]:
    """Validate and store one report batch of ``node_id`` sent by ``principal`` (the token
    `control_plane.gate` checked before the body was read; checked again here: role node, bound
    to ``node_id``), within the node's quota (`control_plane.quota`: its bytes before the body is
    parsed, its rows after); (HTTP status, JSON body, extra headers)."""
    t0 = time.perf_counter()
    body = _checked(state, node_id, raw, principal)
    if isinstance(body, tuple):
        return body
    if node_id not in state.known_nodes:
        refused = await _known_node(state, node_id)
        if refused is not None:
            return (*refused, {})
    fut, staged = _stage(state, node_id, body, clock)
    try:
        await fut
    except Exception:  # noqa: BLE001 - `_settled` answers it
        pass
    return _settled(state, node_id, fut, staged, t0)


class IngestFastPath:
    """ASGI middleware inside `RequestGate`: ``POST /api/v1/nodes/{node_id}/reports`` goes
    straight to `ingest_batch` (the gate has checked the token and read the body, capped),
    without FastAPI's routing and dependency machinery; everything else goes on to the routes."""

    def __init__(self, app, state) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            m = INGEST_PATH.match(scope["path"])
            if m is not None:
                chunks = []
                while True:  # one message: the gate hands the body on whole
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    chunks.append(msg.get("body", b""))
                    if not msg.get("more_body"):
                        break
                status, body, extra = await ingest_batch(self.state, m.group(1), b"".join(chunks), self.state.clock,
                                                         scope.get("state", {}).get(PRINCIPAL_STATE))
                await send_json_bytes(send, status, body, extra)
                return
        await self.app(scope, receive, send)


class IngestNative(NativeRoute):
    """The report batch route answered in the HTTP protocol (`common.http_server.NativeRoute`),
    without the ASGI request cycle, `RequestGate` and `IngestFastPath`: it claims ``POST
    /api/v1/nodes/{node_id}/reports`` of a registered node (known to this process) carrying a
    bearer token whose principal is cached (`TokenCache.cached`, the gate's own cache hit) and
    may send this node's reports, with a Content-Length within ``max_report_body_bytes``; then
    `ingest_batch`'s steps run on the body. Any other request, a refusal of the token or the
    size included, takes the ASGI path (the gate, then `IngestFastPath`), which answers it."""

    def __init__(self, state, max_body_bytes: int) -> None:
        self.state = state
        self.max_body_bytes = max_body_bytes

    def claim(self, method: str, path: str, headers: list):
        if method != "POST":
            return None
        m = INGEST_PATH.match(path)
        st = self.state
        if m is None or getattr(st, "writer", None) is None:  # not a batch, or the lifespan not begun
            return None
        node_id = m.group(1)
        if node_id not in st.known_nodes:
            return None
        secret = length = None
        for name, value in headers:
            if name == b"authorization":
                if secret is not None:  # the gate reads the first one: two are the gate's to judge
                    return None
                secret = bearer_secret(value.decode("latin-1")) or ""
            elif name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                return None
        if not secret or length is None or not length.isdigit() or int(length) > self.max_body_bytes:
            return None
        p = st.tokens.cached(secret)
        if p is None or role_refusal(p, (NODE,)) or node_route_refusal(p, node_id):
            return None
        return node_id, p

    def handle(self, claim, body: bytes, respond):
        node_id, principal = claim
        t0 = time.perf_counter()
        st = self.state
        st.metrics.ingest_native.inc()
        batch = _checked(st, node_id, body, principal)
        if isinstance(batch, tuple):
            respond(*batch)
            return None
        fut, staged = _stage(st, node_id, batch, st.clock)
        def done(f) -> None:
            if f.cancelled():  # only by a forced shutdown: the node resends, the replay is stored once
                return
            try:
                answer = _settled(st, node_id, f, staged, t0)
            except Exception:  # noqa: BLE001 - answered, not left hanging
                log.exception("report batch of %s: answering failed", node_id)
                answer = 500, b'{"detail": "internal error"}', {}
            respond(*answer)

        fut.add_done_callback(done)
        return fut
