"""The node agent's side of the control plane (``racer node-agent --control-plane URL --token-file F``).

One `Reporter` per agent, on its own thread (the device worker never touches the network). Its
parts, one module each:

- **register** (`node_agent.registration`): ``POST /api/v1/nodes/register`` with the node's id,
  advertised address, device, cost profile and policy version; retried with backoff until the
  control plane answers;
- **report** (`node_agent.reports`): every control step hands its output to `Reporter.on_control`
  (the device worker's hook: builds one small dict and queues it, no I/O). The reporter thread
  gives each report the node's next **sequence number** and writes it to the on-disk spool
  (`node_agent.spool`, durable: fsync'd files and folder) before sending anything, then sends the
  spool in order, in batches (``POST /api/v1/nodes/{id}/reports``), deleting a report only once
  the control plane acknowledged it. The control plane stores a report once per (node id, seq),
  so a batch resent after a lost answer is harmless. The spool is sent every **send period**
  (the control plane's ``send_period_s``, in its answers to the registration and to each
  directives pull; without one, every control step): at fleet scale a node sends several steps' reports in one request and pulls its
  directives in the same cycle, so the control plane serves fewer, larger requests;
- **buffer**: while the control plane is unreachable the spool grows up to
  ``max_buffered_reports``; beyond that the oldest report is deleted and counted
  (``num_dropped``). The spool and the sequence counter survive a restart of the agent, a kill -9
  included. A report the disk refuses (full, read-only) is kept in memory, up to
  ``max_memory_reports``, and sent like the others; ``num_dropped`` travels in every report
  (``num_reports_dropped``), so the control plane and its dashboard show what a node lost. A
  report still queued between the device worker and the reporter thread (not yet in the spool)
  is lost with the process when it is killed;
- **allocator state**: each control step's allocator snapshot (the split, the base policy's id,
  the residual weights, the tuner offset) is kept in ``allocator.json`` in the state folder; a
  restarted agent resumes from it (`Reporter.restore_allocator`: the split always, the rest when
  the same policy runs) instead of starting again at ``--emb-share``;
- **directives** (`node_agent.directives`, downloads in `node_agent.downloads`): pulled every
  ``directives_period_s`` (default: the send period): an override, a policy version, a model to
  serve; each outcome confirmed to the control plane.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.config import ranged, require, validate
from common.contract import API, MAX_REPORT_BATCH

from .directives import Directives
from .downloads import safe_name
from .registration import device_label, registration_body, registration_profile
from .reporter_status import ReporterStatus
from .reports import WallTime, WindowReports, device_info, finite_or_none
from .spool import DEFAULT_MEMORY_REPORTS, ReportSpool, write_durably

log = logging.getLogger("racer.node_agent.reporter")

#: the allocator's state in the state folder, kept at each control step, resumed by a restart
ALLOCATOR_FILE = "allocator.json"


@dataclass(frozen=True)
class ReporterConfig:
    """- ``control_plane_url``: base URL of the control plane (``http://host:port``);
    - ``token``: bearer token of role ``node``;
    - ``node_id``: this node's id (letters, digits, ``_ . : -``);
    - ``advertise_url``: the agent's own ``http://host:port`` that gateways send requests to;
    - ``state_dir``: where the sequence counter, the report spool and downloaded policies live;
    - ``max_buffered_reports``: spool bound; the oldest reports are dropped (and counted) beyond it;
    - ``max_memory_reports``: most reports kept in memory while the disk refuses them (full,
      read-only); the oldest of those are dropped (and counted) beyond it;
    - ``batch_size``: most reports per POST (the API takes up to ``common.contract.MAX_REPORT_BATCH``);
    - ``timeout_s``: per HTTP call; ``max_backoff_s``: longest wait between retries after an error;
    - ``directives_period_s``: how often directives are pulled (None: every send period);
    - ``queue_capacity`` / ``service_time_us``: cost-profile figures sent at registration besides
      the miss costs (see `cost_profile`).
    """

    control_plane_url: str
    token: str
    node_id: str
    advertise_url: str
    state_dir: str
    max_buffered_reports: int = ranged(10_000, lo=1, integer=True,
                                       doc="reports kept on disk while the control plane is unreachable; the oldest "
                                           "are dropped beyond")
    max_memory_reports: int = ranged(DEFAULT_MEMORY_REPORTS, lo=1, integer=True,
                                     doc="reports kept in memory when the disk refuses them (full, read-only) until "
                                         "they are sent; the oldest are dropped beyond, and counted")
    batch_size: int = ranged(200, lo=1, hi=MAX_REPORT_BATCH, integer=True)
    timeout_s: float = ranged(5.0, lo=0, lo_open=True)
    max_backoff_s: float = ranged(2.0, lo=0, lo_open=True)
    directives_period_s: float | None = ranged(None, lo=0, lo_open=True, optional=True)
    queue_capacity: int | None = None
    service_time_us: float | None = ranged(None, lo=0, lo_open=True, optional=True,
                                           doc="service time per request sent in the cost profile (default: "
                                               "estimated from the miss costs)")

    def __post_init__(self) -> None:
        validate(self)
        for name in ("control_plane_url", "advertise_url"):
            url = getattr(self, name)
            require(self, url.startswith(("http://", "https://")),
                    f"{name} must start with http:// or https://, got {url!r}")
        require(self, bool(self.token), "token must not be empty")
        require(self, 0 < len(self.node_id) <= 128 and all(c.isalnum() or c in "_.:-" for c in self.node_id),
                f"node_id must be 1-128 letters, digits or _ . : -, got {self.node_id!r}")


class Reporter:
    """See the module docstring. ``wall_clock`` is injectable (tests); the agent's own clock is
    ``agent.clock``. ``transport``: an httpx transport (tests)."""

    def __init__(self, agent, config: ReporterConfig, *, wall_clock: Callable[[], float] = time.time,
                 transport=None) -> None:
        import httpx

        self.agent = agent
        self.config = config
        self.wall_clock = wall_clock
        self.wall = WallTime(agent.clock, wall_clock)
        self.device = device_info(agent.engine)  # what this node's figures are (None: unknown)
        self.spool = ReportSpool(Path(config.state_dir), config.max_buffered_reports, config.max_memory_reports)
        self._inbox: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.status_ = ReporterStatus(wall_clock=wall_clock)
        self.report_interval_s: float | None = None
        self._next_send_s = 0.0  # time.monotonic() when the spool is next due
        self._client = httpx.Client(base_url=config.control_plane_url, timeout=config.timeout_s, transport=transport,
                                    headers={"Authorization": f"Bearer {config.token}"})
        self._backoff_s = 0.0
        self._retry_after_s = 0.0
        self._allocator_snapshot: dict | None = None
        self._kept_snapshot: dict | None = None
        self._next_directives_s = 0.0
        self.directives = Directives(agent, self._client, config, self.status_, self.wall)
        self.reports = WindowReports(agent, self.wall, self.device, lambda: self.directives.policy_version,
                                     lambda: self.directives.model_digest)

    @property
    def policy_version(self) -> str | None:
        """The policy version the node runs (a control-plane version once one was loaded)."""
        return self.directives.policy_version

    @property
    def model_digest(self) -> str | None:
        """The digest of the checkpoint the engine serves (None: random weights)."""
        return self.directives.model_digest

    def apply_override(self, od: dict | None, server_now_s: float, agent_now_s: float | None = None) -> None:
        self.directives.apply_override(od, server_now_s, agent_now_s)

    def apply_policy(self, pol: dict) -> None:
        self.directives.apply_policy(pol)

    def apply_model(self, md: dict) -> None:
        self.directives.apply_model(md)

    def device_label(self) -> str:
        return device_label(self.agent.engine, self.device)

    def registration_profile(self) -> dict:
        return registration_profile(self.agent, self.device, queue_capacity=self.config.queue_capacity,
                                    service_time_us=self.config.service_time_us)

    # ---- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="racer-reporter", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; queued reports go to the spool (sent on the next start if not now)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s + self.config.timeout_s)  # an HTTP call in flight ends by its timeout
            self._thread = None
        self._drain_inbox()
        self._client.close()

    # ---- the allocator's state, kept across restarts (state_dir/allocator.json)
    def restore_allocator(self) -> str | None:
        """Resume the agent's allocator from the snapshot the previous process of this node kept
        in the state folder (what it resumed, in words; None when there is none or no allocator).
        A snapshot it cannot take is set aside as ``allocator.json.bad`` and said in the events."""
        path = Path(self.config.state_dir) / ALLOCATOR_FILE
        if self.agent.allocator is None or not path.exists():
            return None
        try:
            snap = json.loads(path.read_text())
            said = self.agent.call_on_worker(lambda: self.agent.restore_allocator(snap)).result(30)
        except (OSError, ValueError, TypeError) as e:
            with contextlib.suppress(OSError):
                path.replace(path.with_name(ALLOCATOR_FILE + ".bad"))
            self.status_.event(f"allocator state in {path} not restored: {e}")
            return None
        self.status_.event(f"allocator state restored after a restart: {said}")
        return said

    def _keep_allocator(self) -> None:
        """Write the latest allocator snapshot (taken on the worker at each control step) when it
        changed: whole (`node_agent.spool.write_durably`)."""
        snap = self._allocator_snapshot
        if snap is None or snap == self._kept_snapshot:
            return
        try:
            write_durably(Path(self.config.state_dir) / ALLOCATOR_FILE, json.dumps(snap))
            self._kept_snapshot = snap
        except OSError as e:  # a full or read-only disk: the node runs on, a restart starts afresh
            log.warning("could not keep the allocator state: %s", e)

    # ---- the device worker's hook (no I/O)
    def on_control(self, out: dict) -> None:
        """Called by the device worker with each control step's output: queue one report."""
        alloc = self.agent.allocator
        if alloc is not None and hasattr(alloc, "snapshot"):
            self._allocator_snapshot = alloc.snapshot()
        try:
            self._inbox.put(self.reports.build(out))
        except Exception:  # noqa: BLE001 - never hurt the worker
            log.exception("could not build the report of a control step")
        if time.monotonic() >= self._next_send_s:  # else the report waits for its send period
            self._wake.set()

    # ---- the reporter thread
    def _drain_inbox(self) -> None:
        while True:
            try:
                r = self._inbox.get_nowait()
            except queue.Empty:
                return
            # the node's drop count so far travels with each report (the control plane shows it)
            r["num_reports_dropped"] = self.spool.num_dropped
            try:
                self.spool.append(r)  # a disk that refuses it: kept in memory (see ReportSpool)
            except Exception as e:  # noqa: BLE001 - sequence numbers exhausted: the report is lost, counted
                log.error("could not buffer a report: %s", e)
                self.spool.num_dropped += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            self._keep_allocator()
            try:
                ok = self._cycle()
            except Exception as e:  # noqa: BLE001 - the thread must keep going
                log.exception("reporter cycle failed")
                ok = False
                self.status_.error(f"{type(e).__name__}: {e}")
            if ok:
                self._backoff_s = 0.0
                wait = self._period()
            else:
                self._backoff_s = min(self.config.max_backoff_s, max(0.1, self._backoff_s * 2))
                wait = max(self._backoff_s, self._retry_after_s)  # a 429's Retry-After: the quota's wait
            self._retry_after_s = 0.0
            self._wake.wait(wait)
            self._wake.clear()

    def _send_period(self) -> float:
        return self.directives.send_period_s or self.agent.config.control_interval_s

    def _directives_period(self) -> float:
        return self.config.directives_period_s or self._send_period()

    def _period(self) -> float:
        """The longest the thread sleeps between cycles."""
        return min(self._directives_period(), self._send_period())

    def _cycle(self) -> bool:
        """Register if needed, send the spool, pull directives, confirm; False on a transport error."""
        import httpx

        try:
            if not self.status_.registered and not self._register():
                return False
            if not self._send_spool():
                return False
            self._next_send_s = time.monotonic() + 0.9 * self._send_period()
            if not self.directives.confirm_pending():
                return False
            now = time.monotonic()
            if now >= self._next_directives_s:
                self._next_directives_s = now + self._directives_period() * 0.9
                if not self.directives.pull(self.wall_clock()):
                    return False
            return True
        except httpx.HTTPError as e:
            self.status_.error(f"control plane unreachable: {type(e).__name__}: {e}")
            return False

    def _register(self) -> bool:
        body = registration_body(self.agent, self.config, self.device, self.policy_version)
        r = self._client.post(f"{API}/nodes/register", json=body)
        if r.status_code >= 300:
            self.status_.error(f"register: HTTP {r.status_code}: {r.text[:500]}")
            return False
        data = r.json()
        self.report_interval_s = finite_or_none(data.get("report_interval_s"))
        self.directives.set_send_period(data.get("send_period_s"))
        last = data.get("last_report_seq")
        if isinstance(last, int):
            self.spool.raise_next_seq(last + 1)
        self.status_.update(registered=True)
        self.status_.ok()
        self.status_.event(f"registered as {self.config.node_id} at {self.config.control_plane_url}")
        return True

    # ---- sending the spool
    def _send_spool(self) -> bool:
        while len(self.spool) and not self._stop.is_set():
            batch = self.spool.peek(self.config.batch_size)
            if not batch:
                continue
            r = self._client.post(f"{API}/nodes/{self.config.node_id}/reports", json={"reports": batch})
            if r.status_code in (200, 201):
                data = r.json()
                self.spool.remove(x["seq"] for x in batch)
                self.status_.add(num_sent=int(data.get("stored", len(batch))), num_report_posts=1,
                                 num_duplicates=int(data.get("duplicates", 0)))
                self.status_.ok()
                self._drain_inbox()
                continue
            if r.status_code == 404:  # the control plane forgot this node (a new database): register again
                self.status_.update(registered=False)
                self.status_.error(f"reports: HTTP 404 ({r.text[:200]}); registering again")
                return False
            if r.status_code == 422 and len(batch) == 1:
                self._reject(batch[0], r)
                continue
            # 422: find the report it refuses and send the others; 413: past the quota's burst
            if r.status_code in (413, 422) and len(batch) > 1:
                if not all(self._send_one(one) for one in batch):
                    return False
                continue
            self._refused(r)
            return False
        return True

    def _refused(self, r) -> None:
        """A batch not stored (kept in the spool); a 429 (this node is over its ingestion quota)
        says how long to wait before sending again (``Retry-After``, at most 5 minutes)."""
        if r.status_code == 429:
            try:
                self._retry_after_s = min(300.0, max(0.0, float(r.headers.get("retry-after", "1"))))
            except ValueError:
                self._retry_after_s = 1.0
        self.status_.error(f"reports: HTTP {r.status_code}: {r.text[:500]}")

    def _send_one(self, report: dict) -> bool:
        r = self._client.post(f"{API}/nodes/{self.config.node_id}/reports", json={"reports": [report]})
        if r.status_code in (200, 201):
            self.spool.remove([report["seq"]])
            self.status_.add(num_sent=int(r.json().get("stored", 1)))
            return True
        if r.status_code == 422:
            self._reject(report, r)
            return True
        self._refused(r)
        return False

    def _reject(self, report: dict, r) -> None:
        """A report the control plane refuses as invalid will never be accepted: drop it, count it."""
        log.error("control plane refused report %d: %s", report["seq"], r.text[:1000])
        self.spool.remove([report["seq"]])
        self.status_.add(num_rejected=1)
        self.status_.update(last_error=f"report {report['seq']} refused: {r.text[:300]}")

    # ---- what the agent shows
    def status(self) -> dict:
        s = self.status_
        with s.lock:
            return {"control_plane_url": self.config.control_plane_url, "node_id": self.config.node_id,
                    "registered": s.registered, "connected": s.connected, "last_error": s.last_error,
                    "last_success_s": s.last_success_s, "next_seq": self.spool.next_seq,
                    "num_buffered": len(self.spool), "num_dropped": self.spool.num_dropped,
                    "num_in_memory": self.spool.num_in_memory, "num_unspooled": self.spool.num_unspooled,
                    "spool_error": self.spool.disk_error,
                    "num_sent": s.num_sent, "num_duplicates": s.num_duplicates, "num_rejected": s.num_rejected,
                    "num_send_errors": s.num_send_errors, "num_directive_pulls": s.num_directive_pulls,
                    "num_report_posts": s.num_report_posts, "send_period_s": self.directives.send_period_s,
                    "policy_version": s.policy_version, "policy_error": s.policy_error,
                    "override": s.override, "events": list(s.events)}


def default_node_id(port: int) -> str:
    return f"{socket.gethostname()}-{port}"


def default_state_dir(node_id: str) -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "racer", "node-agent", safe_name(node_id))
