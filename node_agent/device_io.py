"""The host's side of the serving stream: stage marks, waits on a clock, uploads in one copy.

A request's stages are timed by a `StageTimer` chosen by device type (`make_stage_timer`): on
the CPU a mark is a reading of the engine's clock, on CUDA a timing event recorded on the
serving stream, and with stage timing off nothing at all. The host waits only where it needs a
value, and only for the serving stream (`sync_serving`); other streams, the EMB refill's among
them, are never waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch


def wait_until(clock: Callable[[], float], deadline_s: float) -> None:
    """Block until ``clock() >= deadline_s``: sleep through all but the last 0.5 ms, then spin."""
    while True:
        left = deadline_s - clock()
        if left <= 0:
            return
        if left > 1e-3:
            time.sleep(left - 5e-4)


class StageTimer:
    """Marks between a request's stages, and the µs between two marks.

    This class is the CPU's: an op's work is done when its call returns, so a mark is a reading of
    the engine's clock. `CudaStageTimer` records a timing event on the serving stream instead;
    `NoStageTimer` (stage timing off) records nothing. None of them waits for another stream: a
    refill chunk in flight on its own stream never delays an answer. `make_stage_timer` picks one.
    """

    enabled = True

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock

    def mark(self):
        return self.clock()

    def elapsed_us(self, start, end) -> float:
        return (end - start) * 1e6


class CudaStageTimer(StageTimer):
    """Timing events recorded on the serving stream (``stream``). ``elapsed_us`` waits for the
    ``end`` event only, i.e. for the serving stream's work up to it, and reads the GPU's time
    between the two events."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def mark(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.stream)
        return ev

    def elapsed_us(self, start, end) -> float:
        end.synchronize()
        return float(start.elapsed_time(end)) * 1e3  # ms


class NoStageTimer(StageTimer):
    """Stage timing off: no clock reading, no event, no wait; every stage reads 0 µs."""

    enabled = False

    def __init__(self) -> None:
        pass

    def mark(self):
        return None

    def elapsed_us(self, start, end) -> float:
        return 0.0


def make_stage_timer(device: torch.device, clock: Callable[[], float], enabled: bool = True,
                     stream=None) -> StageTimer:
    """The timer for a batch on ``device``: `NoStageTimer` when timing is off, else events on the
    serving stream (``stream``; default: the calling thread's current stream of the device) on
    CUDA and clock readings on the CPU."""
    if not enabled:
        return NoStageTimer()
    if device.type == "cuda":
        return CudaStageTimer(stream if stream is not None else torch.cuda.current_stream(device))
    return StageTimer(clock)


def sync_serving(device: torch.device) -> None:
    """Wait for the work queued so far on this thread's serving stream (CUDA; nothing on the
    CPU). Other streams, the EMB refill's among them, are not waited for."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host arrays of one dtype onto ``device`` in one copy (views of it, in order); on the CPU
    the arrays themselves."""
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    flat = torch.from_numpy(np.concatenate([a.ravel() for a in arrays])).to(device)
    out, off = [], 0
    for a in arrays:
        out.append(flat[off: off + a.size].view(a.shape))
        off += a.size
    return out
