"""The node agent process: the engine behind HTTP (``racer node-agent``).

    POST /v1/recommend   one recommendation request (`RecommendBody`) -> top-k + breakdown
    GET  /healthz        liveness of the process and of the device worker
    GET  /v1/metrics     rolling metrics, memory, emb_share, link emulation, allocator state
    GET  /v1/residency   KV residency deltas and hot shards since a cursor, queue depth, service
                         time (`ResidencyFeed`; the gateway's feed, docs/gateway.md)
    GET  /metrics        Prometheus text (node_agent/exporter.py)
    POST /v1/admin/reset a cold start in place {emb_share, allocator} (only with --allow-reset)

With ``--control-plane`` a `node_agent.reporter.Reporter` (its own thread) gets each control
step's output through ``control_hooks`` and does the network I/O (docs/control_plane.md).

One **device worker** thread owns the engine (the device): HTTP handlers validate a request
(pydantic, then `Engine.validate`), put it on a bounded queue and await its result. The worker
admits queued requests into two lanes by estimated prefill tokens (`AdmissionLanes`; large KV
misses apart, see "Admission" in docs/engine.md) and serves a large miss alone or the small
lane's waiting requests (up to ``max_batch`` and ``max_prefill_tokens_per_batch``; optionally
waiting ``batch_window_us`` for more) as one micro-batch, the two lanes alternating. Between
batches, and at least every 50 ms when idle, it calls `Engine.maintenance` (one bounded boundary
step and one throttled refill chunk); every ``control_interval_s`` it runs the control step of
the shared control core (`node_agent.control`, the same code the simulator runs): the served
batches (with the worker's busy time) and the refill feed a `WindowAccumulator`, whose
`close_window` gives the interval's `WindowStats`; `control_step` then runs the `SmartAllocator`
(observe, decide) and applies its emb_share to the Memory Manager (the half-page rule), when a
policy was given. Without an allocator the split stays at the configured ``emb_share``.

Bad requests get 4xx with a message saying what is wrong (422: validation, NaN and Infinity
included; 413: body too large, counted on the bytes received); a full queue gets 503 and a
request that waits past ``request_timeout_s`` 504. None of them stops the agent. Time comes from an injected clock (``clock``, seconds).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from common.config import ranged, validate
from common.http_server import AllowedMethods, BodyLimit, JsonOnly, json_safe, refreeze_runtime  # shared with the gateway and control plane
from common.secrets_args import bearer_ok

from .admission import AdmissionLanes, Job
from .control import ControlEffect, MissCosts, WindowAccumulator, control_step, cost_at  # noqa: F401 (cost_at: re-exported for older callers)
from .engine import Engine
from .metrics import MetricsConfig, RollingMetrics
from .model.quality import NextItemQuality
from .rec_request import RecRequest, RecResponse, RequestError
from .residency_feed import ResidencyFeed

log = logging.getLogger("racer.node_agent")

MAX_USER_ID = 2**63 - 1
#: a timestamp (s) beyond this magnitude is refused: 1e11 s is the year 5138, and the model's time
#: features stay finite
MAX_ABS_TS_S = 1e11
#: most candidates, or items returned, one request may ask for (the engine's ``max_candidates``
#: bounds them further)
MAX_REQUEST_ITEMS = 1 << 20


@dataclass(frozen=True)
class AgentConfig:
    """The agent's one config (ranges checked in ``__post_init__``).

    - ``max_batch``: most requests in one micro-batch; ``batch_window_us``: how long the worker
      waits for more requests after the first (0: only those already queued);
    - ``max_queue``: requests waiting for the device before new ones get 503;
    - ``request_timeout_s``: a request not served by then gets 504;
    - ``control_interval_s``: period of the control step (WindowStats, allocator);
    - ``slo_ms`` / ``metrics_window_s``: the latency SLO and the metrics window;
    - ``max_body_bytes``: larger request bodies get 413 before they are parsed (bytes received
      are counted, so a chunked body is refused too);
    - ``large_prefill_tokens``: a request whose estimated prefill (its tokens not in its user's
      KV cache) is at least this many tokens is a *large miss* and waits in the large lane;
    - ``max_prefill_tokens_per_batch``: a micro-batch of the small lane stops taking requests
      once their estimated prefill tokens would pass this (its first request always goes).
      See "Admission" in docs/engine.md.
    """

    max_batch: int = ranged(16, lo=1, integer=True, doc="most requests per micro-batch")
    batch_window_us: float = ranged(0.0, lo=0, hi=1e6, doc="wait this long for more requests after the first")
    max_queue: int = ranged(1024, lo=1, integer=True, doc="queued requests before 503")
    request_timeout_s: float = ranged(30.0, lo=0, lo_open=True, doc="504 after this long")
    control_interval_s: float = ranged(1.0, lo=0, lo_open=True, doc="control step period: window stats, allocator")
    slo_ms: float = ranged(30.0, lo=0, lo_open=True, doc="latency SLO, ms")
    metrics_window_s: float = ranged(60.0, lo=0, lo_open=True, doc="metrics window")
    max_body_bytes: int = ranged(4 * 2**20, lo=1, integer=True,
                                 doc="larger request bodies get 413, chunked ones included")
    large_prefill_tokens: int = ranged(1024, lo=1, integer=True,
                                       doc="a request with at least this many tokens to prefill (not in its KV "
                                           "cache) is a large miss: served alone, alternating with the small requests")
    max_prefill_tokens_per_batch: int = ranged(2048, lo=1, integer=True,
                                               doc="estimated prefill tokens per micro-batch of small requests")

    def __post_init__(self) -> None:
        validate(self)


class RecommendBody(BaseModel):
    """``POST /v1/recommend``. Item ids are the trace's dense ids ``[0, num_items)``; the
    engine checks them, the lengths and the candidate count against its config."""

    model_config = ConfigDict(extra="forbid", strict=True)  # a boolean is not a number

    user_id: Annotated[StrictInt, Field(ge=0, le=MAX_USER_ID, description="user id, a non-negative integer")]
    history: list[StrictInt] = Field(default_factory=list, description="items before this request, oldest first")
    new_items: list[StrictInt] = Field(default_factory=list, description="items since the previous request")
    timestamps: list[Annotated[float, Field(ge=-MAX_ABS_TS_S, le=MAX_ABS_TS_S, allow_inf_nan=False)]] | None = Field(
        None, description="seconds, one per history and new item (optional)")
    now_ts: Annotated[float, Field(ge=-MAX_ABS_TS_S, le=MAX_ABS_TS_S, allow_inf_nan=False)] | None = Field(
        None, description="the ranking query's time (default: the last timestamp)")
    candidates: list[StrictInt] | None = Field(None, description="item ids to rank (else generated)")
    num_candidates: Annotated[StrictInt, Field(ge=1, le=MAX_REQUEST_ITEMS)] | None = Field(
        None, description="candidates to generate when `candidates` is absent (at most the node's max_candidates)")
    top_k: Annotated[StrictInt, Field(ge=1, le=MAX_REQUEST_ITEMS)] | None = Field(
        None, description="items to return (at most the node's max_candidates)")

    def to_request(self, arrival_s: float) -> RecRequest:
        return RecRequest(user_id=self.user_id, history=self.history, new_items=self.new_items,
                          timestamps=self.timestamps, now_ts=self.now_ts, candidates=self.candidates,
                          num_candidates=self.num_candidates, top_k=self.top_k, arrival_s=arrival_s)


class ResetBody(BaseModel):
    """``POST /v1/admin/reset`` (only with ``--allow-reset``): a cold start with this split, the
    allocator on or off."""

    model_config = ConfigDict(extra="forbid", strict=True)

    emb_share: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
    allocator: bool = False


class QueueFull(Exception):
    pass


def _run_call(fn: Callable[[], object], fut: concurrent.futures.Future) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn())
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        fut.set_exception(e)


class NodeAgent:
    """The device worker, the metrics and the control step around one `Engine`; its admission and
    batching are ``lanes`` (`AdmissionLanes`)."""

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
        # the arrival queue the handlers put on, and the device worker's lanes (only the worker takes),
        # on the agent's clock as it is at each call; the waits on the queue count wall time: wall
        # seconds per second of ``clock`` (an emulated device's `ScaledClock`: K)
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=self.config.max_queue)
        self.lanes = AdmissionLanes(self._queue, self.config, lambda: self.clock(),
                                    float(getattr(self.clock, "time_scale", 1.0)))
        self._lock = threading.Lock()  # guards metrics and the published snapshots
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_s = self.clock()
        self._last_control_s = self.started_s
        self._arrivals = 0
        self._arrivals_at_control = 0
        # the users of the arrivals not yet in a window (appended before _arrivals counts them;
        # bounded: a window's hot-user ratio needs no more than its last 65,536 arrivals)
        self._arrival_users: collections.deque[int] = collections.deque(maxlen=1 << 16)
        self.costs = MissCosts.from_dict(miss_costs)
        self.window = WindowAccumulator(self.started_s)  # the control core's window (worker thread only)
        self.last_effect: ControlEffect | None = None
        self.recent_effects: collections.deque[ControlEffect] = collections.deque(maxlen=256)
        self._memory: dict = self._memory_snapshot()
        self._allocator_state: dict | None = None
        self.last_window: dict | None = None
        self.num_control_steps = 0
        self.worker_error: str | None = None
        # called by the device worker with each control step's output (cheap, no I/O: see reporter.py)
        self.control_hooks: list[Callable[[dict], None]] = []
        self.reporter = None  # node_agent.reporter.Reporter when a control plane is configured
        #: the gateway's bearer for /v1/residency and /v1/admin/reset (common.secrets_args); None: open
        self.fleet_token: str | None = None
        # the online quality of the served model (worker thread only; the reporter takes a window's value)
        self.quality = NextItemQuality()
        # ``--allow-reset``: builds (engine, allocator) for a given split and allocator on/off (`reset`)
        self.reset_factory: Callable[[float, bool], tuple[Engine, object]] | None = None
        self.num_resets = 0
        # callables another thread asks the device worker to run between batches (e.g. a model swap)
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], concurrent.futures.Future]] = queue.SimpleQueue()

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
        self.lanes.fail_all(self.engine, RuntimeError("node agent stopping"))  # whatever is still queued

    @property
    def queue_depth(self) -> int:
        """Requests waiting for the device (the arrival queue and both lanes)."""
        return self.lanes.depth

    @property
    def worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call_on_worker(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn`` on the device worker between two batches (nothing else touches the engine
        meanwhile); the future holds its result or exception. Without a running worker it runs now."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.worker_alive:
            _run_call(fn, fut)
        else:
            self._calls.put((fn, fut))
        return fut

    def restore_allocator(self, snap: dict) -> str:
        """Resume the allocator from a snapshot a previous process of this node kept
        (`SmartAllocator.restore`) and move the boundary to its split; on the worker (call through
        `call_on_worker`). ValueError for a snapshot it cannot take."""
        from .control import apply_target

        if self.allocator is None or not hasattr(self.allocator, "restore"):
            raise ValueError("this node runs no allocator that keeps state")
        said = self.allocator.restore(snap)
        share = snap.get("emb_share")
        if share is not None:
            apply_target(self.engine.mm, float(share), self.clock())
        return said

    def swap_model(self, checkpoint) -> dict:
        """On the device worker: serve ``checkpoint`` from now on (`Engine.load_checkpoint`; a
        checkpoint it refuses leaves the current model serving) and forget the rankings of the old
        model (the quality signal scores each model's own rankings). The control window is closed
        first, so every window (and its report) was served by one model: the one named in it."""
        self.control_step(self.clock())
        info = self.engine.load_checkpoint(checkpoint)
        self.quality.reset()
        self.info["model"] = info
        return info

    def reset(self, emb_share: float, allocator: bool) -> dict:
        """On the device worker: back to the state of a fresh start (cold caches, no metrics, no
        control history, a new residency epoch) with ``emb_share`` and the allocator on or off,
        without reloading the trace or restarting the process (``--allow-reset``: benches that run
        many configurations on one fleet). Requests still queued are served by the new engine."""
        if self.reset_factory is None:
            raise RuntimeError("this agent was not started with --allow-reset")
        engine, alloc = self.reset_factory(emb_share, allocator)
        # what the previous run left queued is failed, not served by the new engine: it would warm the
        # cold caches and count in the next run's figures
        self.lanes.fail_all(self.engine, RuntimeError("node agent reset"))
        now = self.clock()
        with self._lock:
            self.engine = engine
            self.allocator = alloc
            self.metrics = RollingMetrics(MetricsConfig(slo_ms=self.config.slo_ms,
                                                        window_s=self.config.metrics_window_s),
                                          link_emulated=engine.link.enabled)
            self._allocator_state = None
        self.residency.reset()
        self.quality.reset()
        self.window = WindowAccumulator(now)
        self.started_s = self._last_control_s = now
        self._arrivals_at_control = self._arrivals
        self._arrival_users.clear()
        self.lanes.num_large_batches = self.lanes.num_expired = self.num_control_steps = 0
        self.last_effect, self.last_window = None, None
        self.recent_effects.clear()
        self._memory = self._memory_snapshot()
        self.num_resets += 1
        refreeze_runtime()  # the replaced engine is collected here, not inside the next run
        return {"emb_share": engine.mm.emb_share, "allocator": alloc is not None, "num_resets": self.num_resets,
                "device_mode": engine.device_info()}

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            _run_call(fn, fut)

    # --------------------------------------------------------------------------- serving ---
    async def submit(self, req: RecRequest) -> RecResponse:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if self.queue_depth >= self.config.max_queue:
            raise QueueFull(f"the node's queue is full ({self.config.max_queue} requests waiting)")
        try:
            self._queue.put_nowait(Job(req, loop, fut))
        except queue.Full:
            raise QueueFull(f"the node's queue is full ({self.config.max_queue} requests waiting)") from None
        self._arrival_users.append(req.user_id)
        self._arrivals += 1
        return await asyncio.wait_for(fut, self.config.request_timeout_s)

    def _serve(self, jobs: list[Job]) -> None:
        now = self.clock()
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
        span = getattr(self.engine, "last_batch_span", None)
        # an emulated device's batch on its own timeline (the host's lag is not the device's)
        self._record_batch(jobs, resps, *(span if span is not None else (now, self.clock())))
        with self._lock:
            for r in resps:
                self.metrics.record(r.finished_s, r.latency.total_us, emb_requested=r.emb_rows,
                                    emb_hits=r.emb_hits, kv_tokens=r.num_history, kv_hit_tokens=r.kv_hit_tokens,
                                    user=r.user_id, history_len=r.num_history, queue_us=r.latency.queue_us,
                                    kv_outcome=r.kv.outcome)
        for j, r in zip(jobs, resps):
            self.quality.observe(r.user_id, j.req.new_items if j.req.new_items is not None else (), r.items,
                                 r.num_candidates, j.req.candidates)
            j.answer(r)

    def _record_batch(self, jobs: list[Job], resps: list[RecResponse], start_s: float, end_s: float) -> None:
        """The agent's feed of the control core: one served batch, the device busy over
        ``[start_s, end_s]``; each request's latency is its batch's end (when the worker hands the
        results back) minus its arrival, as in the simulator."""
        self.window.add_batch(start_s, end_s,
                              [end_s - (j.req.arrival_s if j.req.arrival_s is not None else start_s) for j in jobs],
                              [r.user_id for r in resps], [r.num_history for r in resps],
                              [r.kv_hit_tokens for r in resps], sum(r.emb_rows for r in resps),
                              sum(r.emb_hits for r in resps))

    @staticmethod
    def _fail(jobs: list[Job], exc: BaseException) -> None:
        for j in jobs:
            j.fail(exc)

    def _run(self) -> None:
        interval = self.config.control_interval_s
        next_control = self.clock() + interval
        try:
            while not self._stop.is_set():
                wait = min(0.05, max(0.0, next_control - self.clock()))
                jobs = self.lanes.next_batch(wait, self.engine)
                if jobs:
                    t0 = self.clock()
                    self._serve(jobs)
                    span = getattr(self.engine, "last_batch_span", None)
                    self.residency.note_served(span[1] - span[0] if span is not None else self.clock() - t0,
                                               len(jobs))
                self._run_calls()
                now = self.clock()
                self.residency.collect(self.engine, now)
                step = self.engine.maintenance(now)
                if step.refill_bytes:
                    self.window.add_refill_bytes(step.refill_bytes)
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
        """Close the control window at ``now_s`` (`WindowAccumulator.close_window`): the
        interval's `WindowStats` and the number of requests that arrived in it."""
        arrivals = self._arrivals - self._arrivals_at_control
        self._arrivals_at_control += arrivals
        users = self._arrival_users
        self.window.add_arrivals(arrivals, [users.popleft() for _ in range(min(arrivals, len(users)))])
        return self.window.close_window(now_s, self.engine.mm, self.costs, self.config.slo_ms), arrivals

    def control_step(self, now_s: float) -> dict:
        """Close the control interval ending at ``now_s`` and run `node_agent.control.control_step`
        (allocator, half-page apply rule); returns `ControlEffect.to_dict` (the effect itself is
        ``last_effect``)."""
        stats, _ = self.window_stats(now_s)
        effect = control_step(self.allocator, stats, self.engine.mm, now_s)
        out = effect.to_dict()
        if self.allocator is not None:
            with self._lock:
                self._allocator_state = {"last_decision": out["decision"], "boundary_plan": out["boundary_plan"],
                                         "num_decisions": dict(self.allocator.num_decisions)}
        self._last_control_s = now_s
        self.num_control_steps += 1
        self.last_window = out["window"]
        self.last_effect = effect
        self.recent_effects.append(effect)
        d = effect.decision
        log.info("control step t=%.3f: load %.4f, p99 %.2f ms, %d requests, emb_share %.4f -> %s", now_s, stats.load,
                 stats.p99_ms, stats.num_requests, stats.emb_share,
                 "no allocator" if d is None else f"{d.emb_share:.4f} ({d.source})")
        for hook in self.control_hooks:
            try:
                hook(out)
            except Exception:  # noqa: BLE001 - a hook never stops the worker
                log.error("control hook failed: %s", traceback.format_exc())
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
                "uptime_s": round(self.clock() - self.started_s, 3), "queue_depth": self.queue_depth,
                "num_served": self.engine.num_served, "device": str(self.engine.device),
                "device_mode": self.engine.device_info(), "link_emulated": self.engine.link.enabled}

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
            "device_mode": self.engine.device_info(),
            "link_emulated": self.engine.link.enabled,
            "link_emulation": self.engine.link.to_dict(),
            "engine": {"num_served": self.engine.num_served, "kv_outcomes": dict(self.engine.kv_outcomes),
                       "num_uncacheable": self.engine.paged_kv.num_uncacheable,
                       "emulated_link_us_total": round(self.engine.link_us_total, 1)},
            "queue_depth": self.queue_depth,
            "admission": {"large_prefill_tokens": self.config.large_prefill_tokens,
                          "max_prefill_tokens_per_batch": self.config.max_prefill_tokens_per_batch,
                          "large_lane_depth": len(self.lanes.large), "num_large_batches": self.lanes.num_large_batches,
                          "num_expired": self.lanes.num_expired},
            "control": {"interval_s": self.config.control_interval_s, "num_steps": self.num_control_steps,
                        "last_window": self.last_window},
            "allocator": {"enabled": self.allocator is not None, **(alloc or {})},
            "miss_costs": self.miss_costs,
            **({"control_plane": self.reporter.status()} if self.reporter is not None else {}),
        }


# ---------------------------------------------------------------------------------- the app ---


ITEM_ID_FIELDS = ("history", "new_items", "candidates")


def _one_line(errors: list[dict], num_items: int | None = None) -> str:
    parts = []
    for e in errors[:5]:
        if e.get("type") == "json_invalid":
            pos = e.get("loc", ("body", "?"))[-1]
            why = (e.get("ctx") or {}).get("error", "")
            parts.append(f"malformed JSON body at character {pos}" + (f": {why}" if why else ""))
            continue
        path = [x for x in e.get("loc", ()) if x != "body"]
        if (num_items is not None and len(path) == 2 and path[0] in ITEM_ID_FIELDS and isinstance(path[1], int)
                and e.get("type", "").startswith("int")):  # e.g. 1e23: name the element and the range
            parts.append(f"{path[0]}[{path[1]}] = {e.get('input')!r} is not an item id: item ids are integers "
                         f"in [0, {num_items})")
            continue
        loc = ".".join(str(x) for x in path) or "body"
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

    app.add_middleware(BodyLimit, max_bytes=agent.config.max_body_bytes)
    app.add_middleware(JsonOnly, paths={"/v1/recommend", "/v1/admin/reset"})  # 415 for a body that is not JSON
    app.add_middleware(AllowedMethods, routes=app.router.routes)  # 405 / OPTIONS with the full Allow

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        errors = jsonable_encoder(json_safe(exc.errors()))  # the rejected input may be NaN, bytes, a surrogate
        with agent._lock:
            agent.metrics.record_rejected()
        return JSONResponse(status_code=422, content={"error": _one_line(errors, agent.engine.config.num_items),
                                                       "detail": errors})

    @app.post("/v1/recommend", responses={413: {"description": "body over max_body_bytes"},
                                           415: {"description": "the body is not announced as JSON"}})
    async def recommend(body: RecommendBody):
        arrival = agent.clock()
        req = body.to_request(arrival)
        try:
            most = agent.engine.config.max_candidates
            if body.top_k is not None and body.top_k > most:
                raise RequestError(f"top_k must be at most this node's max_candidates ({most}), got {body.top_k}")
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

    def refused(request: Request) -> JSONResponse | None:
        """401 unless the request carries the fleet token (when the agent has one)."""
        if bearer_ok(request.headers.get("authorization"), agent.fleet_token):
            return None
        return JSONResponse(status_code=401, headers={"www-authenticate": "Bearer"}, content={
            "error": "this view needs the fleet token (Authorization: Bearer <RACER_FLEET_TOKEN>)"})

    if agent.reset_factory is not None:  # --allow-reset only: benches on a local fleet
        @app.post("/v1/admin/reset", responses={401: {"description": "no fleet token"},
                                                409: {"description": "the allocator asked for has no policy"}})
        async def reset(body: ResetBody, request: Request):
            if (no := refused(request)) is not None:
                return no
            try:
                return await asyncio.wrap_future(agent.call_on_worker(
                    lambda: agent.reset(body.emb_share, body.allocator)))
            except ValueError as e:
                return JSONResponse(status_code=409, content={"error": str(e)})

    @app.get("/healthz")
    async def healthz():
        h = agent.health()
        return JSONResponse(status_code=200 if h["worker_alive"] else 503, content=h)

    @app.get("/v1/metrics")
    async def metrics():
        return agent.metrics_snapshot()

    @app.get("/v1/residency", responses={401: {"description": "no fleet token"}})
    async def residency(request: Request, cursor: Annotated[int, Field(ge=0)] = 0, epoch: str | None = None):
        if (no := refused(request)) is not None:
            return no
        return {**agent.residency.since(cursor, epoch), "queue_depth": agent._queue.qsize(), "at_s": agent.clock()}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def prometheus_metrics():
        from .exporter import render

        body, content_type = render(agent)
        return Response(content=body, media_type=content_type)

    return app
