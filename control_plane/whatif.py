"""What-if runs: a stored window of the gateways' traffic samples replayed through the simulator,
to say what other splits or policies would have given on the fleet's own traffic.

A run is a row of ``whatif_runs`` (`db.models.WhatIfRun`): `start_run` checks the window and
inserts it "running" (one at a time: a second start is a `Conflict`, 409; the database's partial
unique index holds it across replicas), then `execute` runs it in a child process
(``python -m simulator.whatif_worker RUN_ID``) bounded in wall time (``whatif_wall_s``: the
process group is killed past it) and address space (``whatif_memory_bytes``, RLIMIT_AS), with no
``RACER_*`` secret in its environment but the database URL it needs. The child reads the window
(the most recent ``whatif_max_samples`` samples of it: the cut is stored), the fleet (node count,
cost profile) and the policies, replays the window (`simulator.sampled`), records its progress
on the row as it goes and stores the result. A child that dies without a word leaves the row
"running": `execute` marks it failed with the reason (time limit, memory limit, exit status),
and a start that finds a running row older than the time limit (its control plane stopped)
fails it first.

The control plane imports no simulator code (the simulator imports the control plane's router):
the child is started by module name. `WhatIfRunner` runs `execute` on a thread of the API
process; the scheduled what-if (``whatif_period_s``, off by default) runs it in the job's own
thread. `sentence` says a result in one plain sentence (the dashboard and the CLI print it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time

from db import queries
from db.models import Policy, WhatIfRun

from .rollout_service import Conflict, NotFound, flush_or_conflict

log = logging.getLogger("racer.control_plane.whatif")

WORKER_MODULE = "simulator.whatif_worker"
ENV_DATABASE_URL = "RACER_WHATIF_DATABASE_URL"
ENV_ARGS = "RACER_WHATIF_ARGS"
#: how long past its time limit a run's row may stay "running" before a new start fails it
STALE_GRACE_S = 60.0
#: a window may end at most this far past the control plane's clock
FUTURE_SLACK_S = 60.0


class EmptyWindow(ValueError):
    """The window holds no traffic sample."""


def check_window(start_s: float, end_s: float, *, now_s: float, max_window_s: float) -> tuple[str, str] | None:
    """None when ``[start_s, end_s)`` is a window a what-if may replay, else (field, why)."""
    for name, v in (("start_s", start_s), ("end_s", end_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            return name, f"{name} must be a finite time in Unix seconds, got {v!r}"
    if end_s <= start_s:
        return "end_s", f"end_s ({end_s:.3f}) must be after start_s ({start_s:.3f})"
    if end_s - start_s > max_window_s:
        return "end_s", (f"the window is {end_s - start_s:.0f} s long; a what-if replays at most "
                         f"{max_window_s:.0f} s (whatif_max_window_s)")
    if end_s > now_s + FUTURE_SLACK_S:
        return "end_s", f"end_s ({end_s:.3f}) is in the future (now {now_s:.3f})"
    return None


def fail_stale(s, settings, now_s: float) -> WhatIfRun | None:
    """Fail a running run whose row has not moved for longer than the time limit (the process that
    ran it stopped with it); returns it, or None."""
    run = queries.running_whatif(s)
    if run is None or now_s - run.updated_s <= settings.whatif_wall_s + STALE_GRACE_S:
        return None
    queries.finish_whatif(s, run.id, state="failed", now_s=now_s,
                          error=f"its worker stopped: no progress since {run.updated_s:.0f} (the control plane "
                                f"that ran it stopped?)")
    return run


def start_run(s, settings, *, start_s: float, end_s: float, candidate: str | None, actor: str,
              now_s: float) -> WhatIfRun:
    """Insert a running what-if over ``[start_s, end_s)`` (the caller has checked the window with
    `check_window`). `Conflict` when one is running; `EmptyWindow` when the window holds no sample;
    `NotFound` when ``candidate`` is not in the policy registry."""
    fail_stale(s, settings, now_s)
    running = queries.running_whatif(s)
    if running is not None:
        raise Conflict(f"what-if {running.id} is running ({100 * running.progress:.0f}% done): one at a time")
    if candidate is not None and s.get(Policy, candidate) is None:
        raise NotFound(f"policy version {candidate!r} is not in the registry")
    n = queries.count_traffic_samples(s, start_s=start_s, end_s=end_s)
    if n == 0:
        raise EmptyWindow(f"the window [{start_s:.0f}, {end_s:.0f}) holds no traffic sample: is sampling on "
                          f"(racer gateway --sample-rate, racer up --sample-rate) and did traffic flow then?")
    run = WhatIfRun(state="running", created_by=actor, created_at_s=now_s, updated_s=now_s, window_start_s=start_s,
                    window_end_s=end_s, candidate=candidate, progress=0.0, progress_note="starting",
                    num_samples=min(n, settings.whatif_max_samples))
    s.add(run)
    flush_or_conflict(s, "another what-if was started at the same moment: one at a time")
    queries.audit(s, ts_s=now_s, actor=actor, action="whatif.start", target=f"whatif:{run.id}", before=None,
                  after={"window_start_s": start_s, "window_end_s": end_s, "candidate": candidate, "num_samples": n})
    return run


def worker_args(settings, slo_ms: float | None = None) -> dict:
    """What the worker is told besides the run's row."""
    return {"max_samples": settings.whatif_max_samples, "wall_s": settings.whatif_wall_s,
            "slo_ms": slo_ms, "shares": list(settings.whatif_grid())}


def _limit(memory_bytes: int, cpu_s: int):
    def apply():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 5))
        os.setpgrp()  # its own group: the time limit kills whatever it started too

    return apply


def database_url_of(factory) -> str:
    """The URL (password included) of the database ``factory`` opens: the worker's."""
    return factory.kw["bind"].url.render_as_string(hide_password=False)


def execute(factory, settings, run_id: int, *, clock=time.time) -> str:
    """Run what-if ``run_id`` in a child process (see the module docstring) and wait for it;
    returns the run's final state. Never raises for the child's failures: they are stored."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RACER_")}  # no secrets in the child
    env.update({ENV_DATABASE_URL: database_url_of(factory), ENV_ARGS: json.dumps(worker_args(settings)),
                "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    wall = float(settings.whatif_wall_s)
    why = None
    try:
        proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(int(run_id))], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                preexec_fn=_limit(int(settings.whatif_memory_bytes), int(wall) + 30))
    except OSError as e:
        why = f"could not start the what-if's process: {e}"
    else:
        try:
            _, err = proc.communicate(timeout=wall + 30)  # the worker stops itself at `wall`; this is the backstop
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            err = b""
            why = f"ran past its time limit ({wall:g} s, whatif_wall_s)"
        rc = proc.returncode
        if why is None and rc != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
            if rc < 0 and -rc == signal.SIGXCPU:
                why = f"used more than {int(wall) + 30} s of CPU"
            elif any(m in (tail[0] if tail else "") for m in ("MemoryError", "Cannot allocate", "std::bad_alloc")) \
                    or (rc < 0 and -rc in (signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT)):
                why = f"ran out of its memory limit ({settings.whatif_memory_bytes // 2**20} MiB, whatif_memory_bytes)"
            else:
                why = f"its process failed (exit {rc}{': ' + tail[0][:300] if tail else ''})"
    with factory.begin() as s:
        run = s.get(WhatIfRun, run_id)
        if run is not None and run.state == "running":  # the worker did not finish it
            queries.finish_whatif(s, run_id, state="failed", now_s=clock(),
                                  error=why or "its process ended without storing a result")
        run = s.get(WhatIfRun, run_id)
        return run.state if run is not None else "failed"


class WhatIfRunner:
    """Runs what-ifs on a daemon thread of the API process, one at a time (the row says so too)."""

    def __init__(self, factory, settings, clock=time.time) -> None:
        self.factory, self.settings, self.clock = factory, settings, clock
        self._thread: threading.Thread | None = None

    def start(self, run_id: int) -> None:
        def go():
            try:
                execute(self.factory, self.settings, run_id, clock=self.clock)
            except Exception:  # noqa: BLE001 - logged; the row is failed by the next start (stale)
                log.exception("what-if %s", run_id)

        self._thread = threading.Thread(target=go, name=f"racer-whatif-{run_id}", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


def scheduled(factory, settings, now_s: float) -> dict:
    """The scheduled what-if over the last ``whatif_window_s``: started and run to its end in the
    caller's thread (the job's); skipped when one is running or the window holds no sample."""
    start = now_s - settings.whatif_window_s
    try:
        with factory.begin() as s:
            run = start_run(s, settings, start_s=start, end_s=now_s, candidate=None, actor="system", now_s=now_s)
            run_id = run.id
    except (Conflict, EmptyWindow) as e:
        return {"skipped": str(e)}
    return {"run_id": run_id, "state": execute(factory, settings, run_id)}


# ------------------------------------------------------------------------------------ reading ---
def _duration(seconds: float) -> str:
    if seconds >= 86400 * 2:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600 * 2:
        return f"{seconds / 3600:.0f} h" if seconds % 3600 < 60 else f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def _pct(a: float, b: float) -> float:
    return 100.0 * (a / b - 1.0)


def _than(pct: float, what: str) -> str:
    if abs(pct) < 0.5:
        return f"as fast as {what} (P99 within 0.5%)"
    return f"{abs(pct):.0f}% {'slower' if pct > 0 else 'faster'} than {what}"


def sentence(result: dict | None, *, window_s: float, cut: dict | None = None) -> str:
    """One plain sentence of a what-if's result: the best static split against the running policy,
    and a perfect dynamic split (the look-ahead oracle) against the best static; on P99."""
    if not result or not result.get("rows"):
        return "No what-if result yet."
    rows = {r["config"]: r for r in result["rows"]}
    f = result.get("findings", {})
    span = _duration(cut["kept_s"] if cut and cut.get("kept_s") else window_s)
    best = rows.get(f.get("best_static") or "")
    active = next((r for r in result["rows"] if r.get("role") == "active" and r.get("p99_ms")), None)
    oracle = next((r for r in result["rows"] if r["kind"] == "oracle" and r.get("p99_ms")), None)
    parts = []
    if best is not None and active is not None:
        parts.append(f"a static {best['share']:g} split (the best of the grid) would have been "
                     f"{_than(_pct(best['p99_ms'], active['p99_ms']), 'the running policy')}")
    elif best is not None:
        parts.append(f"the best static split was {best['share']:g} (P99 {best['p99_ms']:.1f} ms; no active policy "
                     f"to compare)")
    if best is not None and oracle is not None:
        gain = 100.0 * (1.0 - oracle["p99_ms"] / best["p99_ms"])
        parts.append("a perfect dynamic split would have been " + (
            f"{gain:.0f}% faster than the best static" if gain >= 0.5 else "no faster than the best static"))
    if not parts:
        return "The what-if has no figure to compare."
    return f"On the last {span} of sampled traffic, " + "; ".join(parts) + " (simulated P99)."


def run_dict(run: WhatIfRun, *, with_result: bool = True) -> dict:
    """The API's view of a run (`control_plane.schemas`-free: the route validates it)."""
    out = {"id": run.id, "state": run.state, "created_by": run.created_by, "created_at_s": run.created_at_s,
           "updated_s": run.updated_s, "finished_s": run.finished_s, "window_start_s": run.window_start_s,
           "window_end_s": run.window_end_s, "candidate": run.candidate, "progress": run.progress,
           "progress_note": run.progress_note, "num_samples": run.num_samples, "cut": run.cut,
           "profile": run.profile, "code_version": run.code_version, "error": run.error,
           "result": run.result if with_result else None}
    out["sentence"] = (sentence(run.result, window_s=run.window_end_s - run.window_start_s, cut=run.cut)
                       if run.state == "done" else None)
    return out
