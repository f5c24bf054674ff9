"""The node agent process: the engine behind HTTP (``racer node-agent``).

    POST /v1/recommend   one recommendation request (`RecommendBody`) -> top-k + breakdown
    GET  /healthz        liveness of the process and of the device worker
    GET  /v1/metrics     rolling metrics, memory, emb_share, link emulation, allocator state
    GET  /v1/residency   KV residency deltas and hot shards since a cursor, queue depth, service
                         time (`ResidencyFeed`; the gateway's feed, docs/gateway.md)

One **device worker** thread owns the engine (the device): HTTP handlers validate a request
(pydantic, then `Engine.validate`), put it on a bounded queue and await its result. The worker
takes the first waiting request plus every other one already queued (up to ``max_batch``;
optionally waiting ``batch_window_us`` for more) and serves them as one micro-batch. Between
batches, and at least every 50 ms when idle, it calls `Engine.maintenance` (one bounded boundary
step and one throttled refill chunk); every ``control_interval_s`` it runs the control step:
`WindowStats` of the interval from the rolling metrics, then, when a policy artifact was given,
the `SmartAllocator` (observe, decide) whose emb_share becomes the Memory Manager's target.
Without a policy the split stays at the configured ``emb_share``.

Bad requests get 4xx with a message saying what is wrong (422: validation; 413: body too
large); a full queue gets 503 and a request that waits past ``request_timeout_s`` 504. None of
them stops the agent. Time comes from an injected clock (``clock``, seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from .engine import Engine, RecRequest, RecResponse, RequestError
from .metrics import MetricsConfig, RollingMetrics
from .residency_feed import ResidencyFeed

log = logging.getLogger("racer.node_agent")

MAX_USER_ID = 2**63 - 1


@dataclass(frozen=True)
class AgentConfig:
    """The agent's one config (ranges checked in ``__post_init__``).

    - ``max_batch``: most requests in one micro-batch; ``batch_window_us``: how long the worker
      waits for more requests after the first (0: only those already queued);
    - ``max_queue``: requests waiting for the device before new ones get 503;
    - ``request_timeout_s``: a request not served by then gets 504;
    - ``control_interval_s``: period of the control step (WindowStats, allocator);
    - ``slo_ms`` / ``metrics_window_s``: the latency SLO and the metrics window;
    - ``max_body_bytes``: larger request bodies get 413 before they are parsed.
    """

    max_batch: int = 16
    batch_window_us: float = 0.0
    max_queue: int = 1024
    request_timeout_s: float = 30.0
    control_interval_s: float = 1.0
    slo_ms: float = 30.0
    metrics_window_s: float = 60.0
    max_body_bytes: int = 4 * 2**20

    def __post_init__(self) -> None:
        problems = []
        for name in ("max_batch", "max_queue", "max_body_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                problems.append(f"{name} must be a positive integer, got {v!r}")
        for name in ("request_timeout_s", "control_interval_s", "slo_ms", "metrics_window_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                problems.append(f"{name} must be a positive number, got {v!r}")
        if not (isinstance(self.batch_window_us, (int, float)) and 0 <= self.batch_window_us <= 1e6):
            problems.append(f"batch_window_us must be in [0, 1e6], got {self.batch_window_us!r}")
        if problems:
            raise ValueError("invalid agent config: " + "; ".join(problems))


class RecommendBody(BaseModel):
    """``POST /v1/recommend``. Item ids are the trace's dense ids ``[0, num_items)``; the
    engine checks them, the lengths and the candidate count against its config."""

    model_config = ConfigDict(extra="forbid")

    user_id: Annotated[StrictInt, Field(ge=0, le=MAX_USER_ID, description="user id, a non-negative integer")]
    history: list[StrictInt] = Field(default_factory=list, description="items before this request, oldest first")
    new_items: list[StrictInt] = Field(default_factory=list, description="items since the previous request")
    timestamps: list[Annotated[float, Field(allow_inf_nan=False)]] | None = Field(
        None, description="seconds, one per history and new item (optional)")
    now_ts: Annotated[float, Field(allow_inf_nan=False)] | None = Field(
        None, description="the ranking query's time (default: the last timestamp)")
    candidates: list[StrictInt] | None = Field(None, description="item ids to rank (else generated)")
    num_candidates: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None, description="candidates to generate when `candidates` is absent")
    top_k: Annotated[StrictInt, Field(ge=1)] | None = Field(None, description="items to return")

    def to_request(self, arrival_s: float) -> RecRequest:
        return RecRequest(user_id=self.user_id, history=self.history, new_items=self.new_items,
                          timestamps=self.timestamps, now_ts=self.now_ts, candidates=self.candidates,
                          num_candidates=self.num_candidates, top_k=self.top_k, arrival_s=arrival_s)


class QueueFull(Exception):
    pass


@dataclass
class _Job:
    req: RecRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


def _resolve(fut: asyncio.Future, value, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def cost_at(costs: dict | float, length: float) -> float:
    """A per-token cost from a profile mapping ``{length: µs}`` at the nearest profiled length."""
    if not isinstance(costs, dict):
        return float(costs)
    pts = sorted((float(k), float(v)) for k, v in costs.items())
    return min(pts, key=lambda p: abs(p[0] - length))[1]


class NodeAgent:
    """The device worker, the metrics and the control step around one `Engine`."""

    def __init__(self, engine: Engine, config: AgentConfig | None = None, *, allocator=None,
                 miss_costs: dict | None = None, clock: Callable[[], float] | None = None,
                 info: dict | None = None, residency: ResidencyFeed | None = None) -> None:
        self.engine = engine
        self.residency = residency or ResidencyFeed()
        self.config = config or AgentConfig()
        self.clock = clock or engine.clock
        self.allocator = allocator
        self.miss_costs = miss_costs  # {"kv_recompute_us_per_token": ..., "emb_transfer_us_per_row": ...}
        self.info = dict(info or {})
        self.metrics = RollingMetrics(MetricsConfig(slo_ms=self.config.slo_ms, window_s=self.config.metrics_window_s),
                                      link_emulated=engine.link.enabled)
        self._queue: queue.Queue[_Job] = queue.Queue(maxsize=self.config.max_queue)
        self._lock = threading.Lock()  # guards metrics and the published snapshots
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_s = self.clock()
        self._last_control_s = self.started_s
        self._arrivals = 0
        self._arrivals_at_control = 0
        self._depth_sum = 0.0
        self._depth_n = 0
        self._refill_at_control = 0
        self._memory: dict = self._memory_snapshot()
        self._allocator_state: dict | None = None
        self.last_window: dict | None = None
        self.num_control_steps = 0
        self.worker_error: str | None = None

    # ------------------------------------------------------------------------- lifecycle ---
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="racer-device-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        while True:  # fail whatever is still queued
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            job.loop.call_soon_threadsafe(_resolve, job.future, None, RuntimeError("node agent stopping"))

    @property
    def worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --------------------------------------------------------------------------- serving ---
    async def submit(self, req: RecRequest) -> RecResponse:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        try:
            self._queue.put_nowait(_Job(req, loop, fut))
        except queue.Full:
            raise QueueFull(f"the node's queue is full ({self.config.max_queue} requests waiting)") from None
        self._arrivals += 1
        return await asyncio.wait_for(fut, self.config.request_timeout_s)

    def _take_batch(self, first: _Job) -> list[_Job]:
        jobs = [first]
        deadline = self.clock() + self.config.batch_window_us * 1e-6
        while len(jobs) < self.config.max_batch:
            try:
                jobs.append(self._queue.get_nowait())
                continue
            except queue.Empty:
                pass
            left = deadline - self.clock()
            if left <= 0:
                break
            try:
                jobs.append(self._queue.get(timeout=left))
            except queue.Empty:
                break
        return jobs

    def _serve(self, jobs: list[_Job]) -> None:
        now = self.clock()
        self._depth_sum += len(jobs) + self._queue.qsize()
        self._depth_n += 1
        try:
            resps = self.engine.serve_batch([j.req for j in jobs], now)
        except RequestError as e:  # cannot happen (validated on arrival) but never kill the worker
            if len(jobs) > 1:
                for j in jobs:
                    self._serve([j])
                return
            self._fail(jobs, e)
            return
        except Exception as e:  # noqa: BLE001 - the worker must keep serving
            log.error("device worker: batch failed: %s", traceback.format_exc())
            with self._lock:
                for _ in jobs:
                    self.metrics.record_error()
            self._fail(jobs, RuntimeError(f"internal error while serving: {type(e).__name__}: {e}"))
            return
        with self._lock:
            for r in resps:
                self.metrics.record(r.finished_s, r.latency.total_us, emb_requested=r.emb_rows,
                                    emb_hits=r.emb_hits, kv_tokens=r.num_history, kv_hit_tokens=r.kv_hit_tokens,
                                    user=r.user_id, history_len=r.num_history, queue_us=r.latency.queue_us,
                                    kv_outcome=r.kv.outcome)
        for j, r in zip(jobs, resps):
            j.loop.call_soon_threadsafe(_resolve, j.future, r, None)

    @staticmethod
    def _fail(jobs: list[_Job], exc: BaseException) -> None:
        for j in jobs:
            j.loop.call_soon_threadsafe(_resolve, j.future, None, exc)

    def _run(self) -> None:
        interval = self.config.control_interval_s
        next_control = self.clock() + interval
        try:
            while not self._stop.is_set():
                wait = min(0.05, max(0.0, next_control - self.clock()))
                try:
                    first = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    first = None
                if first is not None:
                    jobs = self._take_batch(first)
                    t0 = self.clock()
                    self._serve(jobs)
                    self.residency.note_served(self.clock() - t0, len(jobs))
                now = self.clock()
                self.residency.collect(self.engine, now)
                step = self.engine.maintenance(now)
                if step.refill_bytes:
                    with self._lock:
                        self.metrics.add_refill_bytes(step.refill_bytes)
                if now >= next_control:
                    self.control_step(now)
                    next_control = max(next_control + interval, now + 1e-3)
                self._memory = self._memory_snapshot()
        except Exception:  # noqa: BLE001
            self.worker_error = traceback.format_exc()
            log.error("device worker died: %s", self.worker_error)

    # ---------------------------------------------------------------------- control step ---
    def window_stats(self, now_s: float):
        """`WindowStats` of the interval since the last control step (the allocator's input)."""
        from policies.features import WindowStats, marginal_utilities_us

        interval = max(now_s - self._last_control_s, 1e-6)
        with self._lock:
            w = self.metrics.window(now_s, interval)
            refill = self.metrics.refill_bytes
        arrivals = self._arrivals - self._arrivals_at_control
        load = (self._depth_sum / self._depth_n / self.config.max_queue) if self._depth_n else 0.0
        costs = self.miss_costs or {}
        kv_cost = cost_at(costs.get("kv_recompute_us_per_token", 0.0), w["history_len_p50"])
        emb_cost = float(costs.get("emb_transfer_us_per_row", 0.0))
        c = self.engine.config
        mm = self.engine.mm
        emb_ghost, kv_ghost = mm.take_ghost_counts()
        emb_marginal, kv_marginal = marginal_utilities_us(mm.config.ghost_probe_shares, emb_ghost, kv_ghost,
                                                          w["num_requests"], emb_cost, kv_cost)
        stats = WindowStats(
            interval_s=interval, num_requests=w["num_requests"], arrival_rate_rps=arrivals / interval,
            hot_user_ratio=w["hot_user_ratio"], history_len_p50=w["history_len_p50"],
            history_len_p99=w["history_len_p99"], emb_lookups_per_request=w["emb_lookups_per_request"],
            emb_hit_rate=w["emb_hit_rate"], kv_hit_rate=w["kv_hit_rate"], kv_recompute_us_per_token=kv_cost,
            emb_transfer_us_per_row=emb_cost,
            emb_share=self.engine.mm.emb_share, load=min(1.0, load), p99_ms=w["p99_ms"], slo_ms=self.config.slo_ms,
            refill_bytes=float(refill - self._refill_at_control),
            arena_bytes=float(c.num_pages * self.engine.mm.config.page_bytes),
            emb_marginal_us=emb_marginal, kv_marginal_us=kv_marginal)
        return stats, arrivals

    def control_step(self, now_s: float) -> dict:
        """Close the control interval ending at ``now_s``: window stats, then the allocator."""
        stats, arrivals = self.window_stats(now_s)
        out: dict = {"now_s": now_s, "window": asdict(stats)}
        if self.allocator is not None:
            self.allocator.observe(stats)
            d = self.allocator.decide(stats, now_s)
            out["decision"] = d.to_dict()
            target = self.engine.mm.plan.target_emb_share if self.engine.mm.boundary_moving else self.engine.mm.emb_share
            if abs(d.emb_share - target) * self.engine.config.num_pages >= 0.5:
                plan = self.engine.set_emb_share(d.emb_share, now_s)
                out["boundary_plan"] = plan.reason
            with self._lock:
                self._allocator_state = {"last_decision": out["decision"], "boundary_plan": out.get("boundary_plan"),
                                         "num_decisions": dict(self.allocator.num_decisions)}
        self._last_control_s = now_s
        self._arrivals_at_control += arrivals
        self._refill_at_control = self.metrics.refill_bytes
        self._depth_sum = 0.0
        self._depth_n = 0
        self.num_control_steps += 1
        self.last_window = out["window"]
        return out

    # ------------------------------------------------------------------------- reporting ---
    def _memory_snapshot(self) -> dict:
        st = self.engine.mm.stats()
        d = asdict(st)
        d["target_emb_share"] = st.target_emb_pages / self.engine.config.num_pages
        d["boundary_moving"] = self.engine.mm.boundary_moving
        return d

    def health(self) -> dict:
        return {"status": "ok" if self.worker_alive else "unavailable", "worker_alive": self.worker_alive,
                "worker_error": None if self.worker_error is None else self.worker_error.strip().splitlines()[-1],
                "uptime_s": round(self.clock() - self.started_s, 3), "queue_depth": self._queue.qsize(),
                "num_served": self.engine.num_served, "device": str(self.engine.device),
                "link_emulated": self.engine.link.enabled}

    def metrics_snapshot(self) -> dict:
        now = self.clock()
        with self._lock:
            snap = self.metrics.snapshot(now)
            alloc = None if self._allocator_state is None else dict(self._allocator_state)
        mem = self._memory
        return {
            "node": {**self.engine.describe(), **self.info},
            "metrics": snap,
            "memory": mem,
            "emb_share": mem["emb_share"],
            "target_emb_share": mem["target_emb_share"],
            "link_emulated": self.engine.link.enabled,
            "link_emulation": self.engine.link.to_dict(),
            "engine": {"num_served": self.engine.num_served, "kv_outcomes": dict(self.engine.kv_outcomes),
                       "num_uncacheable": self.engine.num_uncacheable,
                       "emulated_link_us_total": round(self.engine.link_us_total, 1)},
            "queue_depth": self._queue.qsize(),
            "control": {"interval_s": self.config.control_interval_s, "num_steps": self.num_control_steps,
                        "last_window": self.last_window},
            "allocator": {"enabled": self.allocator is not None, **(alloc or {})},
            "miss_costs": self.miss_costs,
        }


# ---------------------------------------------------------------------------------- the app ---


def _one_line(errors: list[dict]) -> str:
    parts = []
    for e in errors[:5]:
        if e.get("type") == "json_invalid":
            pos = e.get("loc", ("body", "?"))[-1]
            why = (e.get("ctx") or {}).get("error", "")
            parts.append(f"malformed JSON body at character {pos}" + (f": {why}" if why else ""))
            continue
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more


def create_app(agent: NodeAgent) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the device worker."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        agent.start()
        try:
            yield
        finally:
            agent.stop()

    app = FastAPI(title="RACER node agent", version="1", lifespan=lifespan)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > agent.config.max_body_bytes:
            return JSONResponse(status_code=413, content={
                "error": f"request body of {size} bytes exceeds {agent.config.max_body_bytes} bytes"})
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        errors = jsonable_encoder(exc.errors())
        with agent._lock:
            agent.metrics.record_rejected()
        return JSONResponse(status_code=422, content={"error": _one_line(errors), "detail": errors})

    @app.post("/v1/recommend")
    async def recommend(body: RecommendBody):
        arrival = agent.clock()
        req = body.to_request(arrival)
        try:
            agent.engine.validate(req)
        except RequestError as e:
            with agent._lock:
                agent.metrics.record_rejected()
            return JSONResponse(status_code=422, content={"error": str(e)})
        try:
            resp = await agent.submit(req)
        except QueueFull as e:
            return JSONResponse(status_code=503, content={"error": str(e)})
        except asyncio.TimeoutError:
            return JSONResponse(status_code=504, content={
                "error": f"not served within request_timeout_s={agent.config.request_timeout_s}"})
        except RequestError as e:
            return JSONResponse(status_code=422, content={"error": str(e)})
        except RuntimeError as e:
            return JSONResponse(status_code=500, content={"error": str(e)})
        return resp.to_dict()

    @app.get("/healthz")
    async def healthz():
        h = agent.health()
        return JSONResponse(status_code=200 if h["worker_alive"] else 503, content=h)

    @app.get("/v1/metrics")
    async def metrics():
        return agent.metrics_snapshot()

    @app.get("/v1/residency")
    async def residency(cursor: Annotated[int, Field(ge=0)] = 0, epoch: str | None = None):
        return {**agent.residency.since(cursor, epoch), "queue_depth": agent._queue.qsize(), "at_s": agent.clock()}

    return app


def serve_forever(app: FastAPI, host: str, port: int, *, log_level: str = "warning",
                  ready: Callable[[str, int], None] | None = None) -> None:
    """Bind ``host:port`` (0: a free port), report it through ``ready``, serve until SIGINT/SIGTERM.

    SIGINT and SIGTERM shut down gracefully (the lifespan stops the worker) and return normally.
    """
    import signal
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    bound = sock.getsockname()[1]
    if ready is not None:
        ready(host, bound)
    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in
    # place that re-raise is a no-op and the process exits with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: None)
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
