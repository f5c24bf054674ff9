"""A supervisor of local processes: start them in order, restart those that exit, stop them all.

The supervisor is generic: a list of `ProcessSpec` (argv, environment, readiness URL). Each
process runs in its own process group (session) with its stdout and stderr appended to
``<log_dir>/<name>.log``; one that exits is reported and restarted, with a back-off (1 s doubling
to ``max_backoff_s``) while it keeps dying young; `Supervisor.stop` sends SIGTERM to each process
group in reverse start order and SIGKILL after a timeout, so nothing is left running.
``racer up`` (`racer.up`) builds the specs and drives its start-up through this.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .data_folder import write_atomic
from .errors import UpError

REPO = Path(__file__).resolve().parent.parent  # the processes' working folder


@dataclass
class ProcessSpec:
    """One supervised process: ``argv`` (run with ``env`` added to ours), ready when GET on one of
    ``ready_urls`` answers 200 (no URL: ready when started)."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_urls: list[str] = field(default_factory=list)
    ready_timeout_s: float = 120.0
    url: str | None = None
    ready_check: Callable[[], bool] | None = None  # beyond the URL answering 200


@dataclass
class _Proc:
    spec: ProcessSpec
    popen: subprocess.Popen | None = None
    started_s: float = 0.0
    restarts: int = 0
    next_start_s: float = 0.0
    backoff_s: float = 1.0
    exits: list = field(default_factory=list)
    ready_s: float | None = None  # when it last answered its ready URL (None: not since it started)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class Supervisor:
    """Start `ProcessSpec`s in order, restart those that exit, stop them all in reverse order.

    Each process gets its own session (process group), so stopping it stops whatever it started;
    its stdout and stderr are appended to ``log_dir/<name>.log``. ``report(line)`` receives every
    event (start, exit, restart, stop)."""

    def __init__(self, specs: Sequence[ProcessSpec], log_dir: Path, *, report: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic, max_backoff_s: float = 30.0,
                 state_file: Path | None = None, secrets: Sequence[str] = (),
                 cancel: threading.Event | None = None) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be distinct: {names}")
        self.procs = [_Proc(s) for s in specs]
        self.log_dir = log_dir
        self.report = report
        self.clock = clock
        self.max_backoff_s = max_backoff_s
        self.state_file = state_file
        self.secrets = [x for x in secrets if x]
        self.cancel = cancel or threading.Event()  # set: stop waiting for readiness
        self.stopping = False

    def __getitem__(self, name: str) -> _Proc:
        for p in self.procs:
            if p.spec.name == name:
                return p
        raise KeyError(name)

    def _spawn(self, p: _Proc) -> None:
        log = open(self.log_dir / f"{p.spec.name}.log", "ab")
        try:
            shown = " ".join(p.spec.argv)
            for secret in self.secrets:  # tokens never reach a log
                shown = shown.replace(secret, "***")
            log.write(f"\n==== racer up: starting {p.spec.name} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"{shown}\n".encode())
            log.flush()
            p.popen = subprocess.Popen(p.spec.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, cwd=REPO,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1", **p.spec.env})
        finally:
            log.close()
        p.started_s = self.clock()
        p.ready_s = None
        self.write_state()

    def write_state(self) -> None:
        """``state_file``: each process's pid, URL and restarts (for operators and tests)."""
        if self.state_file is None:
            return
        state = {p.spec.name: {"pid": p.popen.pid if p.popen else None, "url": p.spec.url, "restarts": p.restarts,
                               "log": str(self.log_dir / f"{p.spec.name}.log")} for p in self.procs}
        with contextlib.suppress(OSError):
            write_atomic(self.state_file, json.dumps({"supervisor_pid": os.getpid(), "processes": state}) + "\n")

    def start(self, names: Sequence[str] | None = None, *, wait: bool = True) -> None:
        """Start the named processes (all by default) together, then wait until each is ready."""
        group = [p for p in self.procs if names is None or p.spec.name in names]
        for p in group:
            self._spawn(p)
        if wait:
            for p in group:
                self.wait_ready(p)

    def wait_ready(self, p: _Proc) -> None:
        """Wait until ``p`` answers on a ready URL; meanwhile restart any *other* process that
        exits. ``p`` itself exiting is a start-up failure (`UpError` with the end of its log)."""
        import httpx

        if not p.spec.ready_urls:
            return
        deadline = self.clock() + p.spec.ready_timeout_s
        while self.clock() < deadline and not self.stopping and not self.cancel.is_set():
            self.poll(skip=p)
            code = p.popen.poll()
            if code is not None:
                tail = log_tail(self.log_dir / f"{p.spec.name}.log")
                raise UpError(f"{p.spec.name} {describe_exit(code)} while starting; the end of its log "
                              f"({self.log_dir / (p.spec.name + '.log')}):\n{tail}")
            for url in p.spec.ready_urls:
                try:
                    if httpx.get(url, timeout=2.0).status_code == 200 and (
                            p.spec.ready_check is None or p.spec.ready_check()):
                        return
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    pass
            time.sleep(0.25)
        if not self.stopping and not self.cancel.is_set():
            raise UpError(f"{p.spec.name} was not ready within {p.spec.ready_timeout_s:g} s "
                          f"(log: {self.log_dir / (p.spec.name + '.log')})")

    def check_ready(self, p: _Proc, timeout_s: float = 1.0) -> bool:
        """One look, without waiting: is ``p`` running and answering 200 on a ready URL (and its
        ``ready_check``)? Remembers when it first was (``p.ready_s``) since its last start."""
        import httpx

        if p.popen is None or p.popen.poll() is not None:
            return False
        if p.ready_s is not None:
            return True
        ok = not p.spec.ready_urls
        for url in p.spec.ready_urls:
            try:
                if httpx.get(url, timeout=timeout_s).status_code == 200 and (
                        p.spec.ready_check is None or p.spec.ready_check()):
                    ok = True
                    break
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                pass
        if ok:
            p.ready_s = self.clock()
        return ok

    def restart(self, p: _Proc, timeout_s: float = 20.0) -> None:
        """Stop ``p`` (SIGTERM to its group, SIGKILL after ``timeout_s``) and start it again."""
        if p.popen is not None and p.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, signal.SIGTERM)
            try:
                p.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait(10)
        self._spawn(p)

    def poll(self, skip: _Proc | None = None) -> list[str]:
        """Restart every process that has exited (after its back-off); returns the events."""
        events = []
        now = self.clock()
        for p in self.procs:
            if self.stopping or p.popen is None or p is skip:
                continue
            code = p.popen.poll()
            if code is None:
                if p.backoff_s > 1.0 and now - p.started_s > 60.0:
                    p.backoff_s = 1.0  # it stayed up: forget earlier crashes
                continue
            if p.next_start_s == 0.0:  # first time we see this exit
                ran_s = now - p.started_s
                p.exits.append({"at_s": now, "code": code, "ran_s": round(ran_s, 1)})
                p.next_start_s = now + (p.backoff_s if ran_s < 10.0 else 0.0)
                if ran_s < 10.0:
                    p.backoff_s = min(self.max_backoff_s, p.backoff_s * 2)
                ev = (f"{p.spec.name} (pid {p.popen.pid}) {describe_exit(code)} after {ran_s:.0f} s; "
                      f"restarting{f' in {p.next_start_s - now:.0f} s' if p.next_start_s > now else ''} "
                      f"(log: {self.log_dir / (p.spec.name + '.log')})")
                events.append(ev)
                self.report(ev)
            if now >= p.next_start_s:
                p.next_start_s = 0.0
                p.restarts += 1
                self._spawn(p)
                ev = f"{p.spec.name} restarted (pid {p.popen.pid}, restart {p.restarts})"
                events.append(ev)
                self.report(ev)
        return events

    def alive(self) -> dict[str, bool]:
        return {p.spec.name: p.popen is not None and p.popen.poll() is None for p in self.procs}

    def stop(self, timeout_s: float = 20.0) -> dict[str, int | None]:
        """SIGTERM every process group in reverse start order, each waited for up to ``timeout_s``,
        then SIGKILL what is left. Returns each process's exit code."""
        self.stopping = True
        codes: dict[str, int | None] = {}
        for p in reversed(self.procs):
            if p.popen is None:
                continue
            pg = p.popen.pid
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pg, signal.SIGTERM)
                try:
                    p.popen.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.report(f"{p.spec.name} did not stop within {timeout_s:g} s: SIGKILL")
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pg, signal.SIGKILL)
                    p.popen.wait(10)
            # whatever the process started and left in its group goes with it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pg, signal.SIGKILL)
            if not _wait_group_gone(pg, 5.0):
                self.report(f"{p.spec.name}: a process of its group was still alive 5 s after SIGKILL")
            codes[p.spec.name] = p.popen.returncode
        return codes


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until process group ``pgid`` has no live member left (SIGKILL is delivered
    asynchronously: on a loaded machine a killed child can still be running a moment after
    ``killpg`` returns). Zombies count as gone (their parent, possibly a container's init that
    never reaps, owns them). True when the group is gone; False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _group_alive(pgid: int) -> bool:
    """Whether a non-zombie process is in group ``pgid`` (Linux /proc; elsewhere ``killpg(pgid, 0)``)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def log_tail(path: Path, n: int = 15) -> str:
    """The last ``n`` lines of a log ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` (Linux /proc), None when it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
