"""The device worker's admission: the arrival queue, two lanes by estimated prefill, micro-batches.

HTTP handlers put a `Job` on the bounded arrival queue; only the device worker takes from it. It
admits each job into a lane by its estimated prefill tokens (its tokens not in its user's KV
cache): a *large miss* (at least ``large_prefill_tokens``) waits in the large lane, the rest in
the small lane. See "Admission" in docs/engine.md.
"""

from __future__ import annotations

import asyncio
import collections
import math
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .rec_request import RecRequest

if TYPE_CHECKING:
    from .agent import AgentConfig
    from .engine import Engine


def _resolve(fut: asyncio.Future, value, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


@dataclass
class Job:
    """A request waiting for the device, and the future its handler awaits on its event loop."""

    req: RecRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    prefill_est: int = 0  # tokens to prefill, estimated when the worker admits the job

    def answer(self, value) -> None:
        """Hand ``value`` to the waiting handler (from any thread; nothing if it gave up)."""
        self.loop.call_soon_threadsafe(_resolve, self.future, value, None)

    def fail(self, exc: BaseException) -> None:
        """Hand ``exc`` to the waiting handler (from any thread; nothing if it gave up)."""
        self.loop.call_soon_threadsafe(_resolve, self.future, None, exc)


def _arrived(job: Job, cut: float) -> bool:
    """Whether ``job`` arrived by ``cut`` (a job without an arrival time always has)."""
    a = job.req.arrival_s
    return a is None or a <= cut


class AdmissionLanes:
    """The worker's side of the arrival queue (``queue``: the agent's, bounded by ``max_queue``,
    where the handlers put jobs) and its two lanes.

    `next_batch` serves a large miss alone or the small lane's waiting requests (up to
    ``max_batch`` and ``max_prefill_tokens_per_batch``; optionally waiting ``batch_window_us``
    for more) as one micro-batch, the two lanes alternating. The lanes are the device worker's
    only; the engine whose KV cache the estimates read is passed in (it changes on a reset).
    ``clock``: the agent's clock; ``wall_per_s``: wall seconds per second of it (the waits on the
    queue count wall time).
    """

    def __init__(self, arrivals: queue.Queue[Job], config: AgentConfig, clock: Callable[[], float],
                 wall_per_s: float = 1.0) -> None:
        self.queue = arrivals
        self.config = config
        self.clock = clock
        self.wall_per_s = wall_per_s
        self.small: collections.deque[Job] = collections.deque()
        self.large: collections.deque[Job] = collections.deque()
        self._last_was_large = True  # so the small lane goes first
        self.num_large_batches = 0
        self.num_expired = 0  # jobs whose caller had given up (504) before the device reached them

    @property
    def depth(self) -> int:
        """Requests waiting for the device (the arrival queue and both lanes)."""
        return self.queue.qsize() + len(self.small) + len(self.large)

    def admit(self, job: Job, engine: Engine) -> None:
        """Estimate the job's prefill tokens from its user's cached K/V and put it in a lane."""
        req = job.req
        nh = len(req.history) if req.history is not None else 0
        nn = len(req.new_items) if req.new_items is not None else 0
        cached = engine.mm.kv.num_tokens(int(req.user_id))
        job.prefill_est = nh + nn - min(cached, nh)
        (self.large if job.prefill_est >= self.config.large_prefill_tokens else self.small).append(job)

    def drain(self, engine: Engine) -> None:
        """Admit every job of the arrival queue."""
        while True:
            try:
                self.admit(self.queue.get_nowait(), engine)
            except queue.Empty:
                return

    def fail_all(self, engine: Engine, exc: BaseException) -> None:
        """Fail every job still waiting (the arrival queue's too)."""
        self.drain(engine)
        while self.small or self.large:
            (self.small or self.large).popleft().fail(exc)

    def _pop_live(self, lane: collections.deque) -> Job | None:
        """The lane's next job whose caller still waits (a 504'd job is dropped, not served)."""
        while lane:
            job = lane.popleft()
            if not job.future.done():
                return job
            self.num_expired += 1
        return None

    def next_batch(self, wait_s: float, engine: Engine) -> list[Job] | None:
        """The next micro-batch, waiting up to ``wait_s`` for a first request (None: none came).

        Two lanes: large misses (estimated prefill >= ``large_prefill_tokens``) are served one
        per batch, alternating with the small lane: a large one goes when the small lane is
        empty or the previous batch was small, so a small request waits for at most one large
        miss, never for a queue of them."""
        self.drain(engine)
        if not self.small and not self.large:
            try:
                self.admit(self.queue.get(timeout=wait_s * self.wall_per_s) if wait_s > 0
                           else self.queue.get_nowait(), engine)
            except queue.Empty:
                return None
            self.drain(engine)
        cut = self._cutoff(engine)
        small_ready = bool(self.small) and _arrived(self.small[0], cut)
        if self.large and _arrived(self.large[0], cut) and (not small_ready or not self._last_was_large):
            job = self._pop_live(self.large)
            if job is not None:
                self._last_was_large = True
                self.num_large_batches += 1
                return [job]
        self._last_was_large = False
        return self._take_batch(engine, cut) or None

    def _cutoff(self, engine: Engine) -> float:
        """The latest arrival the next batch may take. A real device forms its next batch when it
        is free (or when the first request after that arrives), from what has arrived by then;
        on an emulated device this host's thread may get there late, with requests in its lanes
        that arrived after that moment on the device's timeline: they wait for the following
        batch, as on the device, so host lag does not change the batches. Otherwise no cut."""
        emu = getattr(engine, "emu", None)
        if emu is None:
            return math.inf
        heads = [lane[0].req.arrival_s for lane in (self.small, self.large)
                 if lane and lane[0].req.arrival_s is not None]
        if not heads:
            return math.inf
        return max(emu.free_at_s, min(heads)) + self.config.batch_window_us * 1e-6

    def _take_batch(self, engine: Engine, cut: float = math.inf) -> list[Job]:
        """Up to ``max_batch`` small-lane jobs within ``max_prefill_tokens_per_batch`` (the
        first always goes) that arrived by ``cut`` (`_cutoff`), waiting up to
        ``batch_window_us`` after the first for more."""
        jobs: list[Job] = []
        tokens = 0
        budget = self.config.max_prefill_tokens_per_batch
        deadline = self.clock() + self.config.batch_window_us * 1e-6
        while len(jobs) < self.config.max_batch:
            if not self.small:
                self.drain(engine)
            if self.small:
                nxt = self.small[0]
                if nxt.future.done():
                    self.small.popleft()
                    self.num_expired += 1
                    continue
                if not _arrived(nxt, cut):
                    break
                if jobs and tokens + nxt.prefill_est > budget:
                    break
                jobs.append(self.small.popleft())
                tokens += nxt.prefill_est
                continue
            left = deadline - self.clock()
            if not jobs or left <= 0:
                break
            try:
                self.admit(self.queue.get(timeout=left * self.wall_per_s), engine)
            except queue.Empty:
                break
        return jobs
