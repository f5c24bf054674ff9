"""The node agent's side of the control plane (``racer node-agent --control-plane URL --token-file F``).

One `Reporter` per agent, on its own thread (the device worker never touches the network):

- **register**: ``POST /api/v1/nodes/register`` with the node's id, advertised address, device,
  cost profile (from the agent's miss costs, i.e. ``racer node profile``) and policy version;
  retried with backoff until the control plane answers;
- **report**: every control step hands its output to `Reporter.on_control` (the device worker's
  hook: builds one small dict and queues it, no I/O). The reporter thread gives each report the
  node's next **sequence number** and writes it to the on-disk spool before sending anything,
  then sends the spool in order, in batches (``POST /api/v1/nodes/{id}/reports``), deleting a
  report only once the control plane acknowledged it. The control plane stores a report once per
  (node id, seq), so a batch resent after a lost answer is harmless;
- **buffer**: while the control plane is unreachable the spool grows up to
  ``max_buffered_reports``; beyond that the oldest report is deleted and counted
  (``num_dropped``). The spool and the sequence counter survive a restart of the agent. A report
  the disk refuses (full, read-only) is kept in memory, up to ``max_memory_reports``, and sent
  like the others; ``num_dropped`` travels in every report (``num_reports_dropped``), so the
  control plane and its dashboard show what a node lost;
- **allocator state**: each control step's allocator snapshot (the split, the base policy's id,
  the residual weights, the tuner offset) is kept in ``allocator.json`` in the state folder; a
  restarted agent resumes from it (`restore_allocator`: the split always, the rest when the same
  policy runs) instead of starting again at ``--emb-share``;
- **directives**: ``GET /api/v1/nodes/{id}/directives`` every ``directives_period_s``:
  the override in force goes to `SmartAllocator.set_override` (its expiry converted from the
  control plane's clock, by the ``now_s`` of the answer, to the agent's; on an emulated device the
  time left is divided by its time scale, as a wall second is 1/K modelled second), and is cleared when the
  control plane no longer sends it; a policy version other than the one running is downloaded,
  its SHA-256 checked against the digest, unpacked, and loaded with `SmartAllocator.load_policy`
  (on any failure the old policy keeps running); the outcome is confirmed with
  ``POST /api/v1/nodes/{id}/policy`` ({policy_version, status: loaded|failed, error}), retried
  until the control plane acknowledges it. A version that failed is not retried until the control
  plane names another one (or another digest).
  A model (a checkpoint, named by its digest) other than the one served is handled the same way
  (`Reporter.apply_model`): downloaded, checked by the checkpoint loader against the served config
  and item count, swapped in on the device worker (`NodeAgent.swap_model`, i.e.
  `Engine.load_checkpoint`; a refused checkpoint leaves the current model serving), and confirmed
  with ``POST /api/v1/nodes/{id}/model`` ({model_version, status, error}). Every report carries the
  digest of the model served in its window (``model_digest``) and the window's online quality
  (``model_quality``, `node_agent.model.quality`).

Times: reports carry wall-clock seconds (``ts_s``, and a burst's ``start_s``/``end_s``), so the
control plane's history is in one time base across nodes: the agent's clock plus an offset fixed at
start, or, on an emulated device (a `node_agent.emulated.ScaledClock` in modelled seconds), the wall
time at the clock's origin plus the wall seconds since it (``wall_elapsed_s``). The window's figures
(``interval_s``, latencies, ``throughput_rps``) stay in the agent's time: modelled on an emulated
device.

Device: every report says what its figures are (``device_mode``: ``real``, ``link-emulated`` or
``emulated``, and ``device_profile``, the cost profile of an emulated device), and the registration
sends the device's label as ``device`` and `Engine.device_info` as ``cost_profile["device"]``
(`device_info`), so an emulated figure is never taken for a measured one. An engine without
``device_info`` (or one that answers something else) reports them as null: unknown.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import queue
import shutil
import socket
import tarfile
import threading
import time
import zipfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urljoin

from common.config import ranged, require, validate
from common.ids import path_segment
from node_agent.allocator.trace import (LAYERS, MAX_DETAIL_FIGURES, MAX_DETAIL_NAME_CHARS, MAX_DETAIL_TEXT_CHARS,
                                        MAX_PROPOSAL_ABS)

log = logging.getLogger("racer.node_agent.reporter")

API = "/api/v1"
#: when this process started (wall s): each registration says it, so the control plane counts restarts
PROCESS_STARTED_S = time.time()
MAX_SEQ = 2**31 - 1
MAX_REASON_CHARS = 2000
#: the allocator's state in the state folder, kept at each control step, resumed by a restart
ALLOCATOR_FILE = "allocator.json"
#: what a node's figures are (`Engine.device_info`'s ``mode``)
DEVICE_MODES = ("real", "link-emulated", "emulated")
DEVICE_TIMES = ("measured", "modelled")
MAX_DEVICE_TEXT_CHARS = 128  # a device's label and an emulated device's profile name
MAX_TIME_SCALE = 1e6  # wall seconds per modelled second the control plane takes
#: most reports kept in memory when the disk refuses them (``ReporterConfig.max_memory_reports``)
DEFAULT_MEMORY_REPORTS = 2_000


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
    - ``batch_size``: most reports per POST (the API takes up to 1000);
    - ``timeout_s``: per HTTP call; ``max_backoff_s``: longest wait between retries after an error;
    - ``directives_period_s``: how often directives are pulled (None: every control interval);
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
    batch_size: int = ranged(200, lo=1, hi=1000, integer=True)
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


# ------------------------------------------------------------------------------------ the spool ---


class ReportSpool:
    """The report buffer and sequence counter of one node (one directory), on disk where it can be.

    ``state.json`` holds ``next_seq`` and ``num_dropped``; ``spool/<seq>.json`` one report each.
    `append` assigns the next sequence number, persists the counter first (a crash then leaves a
    gap, never a reused number), then writes the report (write to a temporary file, rename).

    A report the disk refuses (full, read-only, gone) is kept in memory instead and sent like the
    others: the spool is the on-disk files plus that in-memory part, in one sequence order. The
    in-memory part holds at most ``max_memory_reports``; the whole spool at most ``max_reports``.
    Beyond either bound the oldest report (of the part over its bound) is deleted and counted in
    ``num_dropped``. ``num_unspooled`` counts the reports the disk refused (kept in memory);
    ``disk_error`` is the last refusal, None once a write succeeds again. Without a writable
    ``state.json`` the counter lives in memory; the control plane's ``last_report_seq`` at the
    next registration keeps numbers from being reused after a restart. Used by the reporter
    thread only.
    """

    def __init__(self, directory: str | Path, max_reports: int, max_memory_reports: int | None = None) -> None:
        self.dir = Path(directory)
        self.spool = self.dir / "spool"
        self.max_reports = max_reports
        self.max_memory_reports = min(max_reports, max_memory_reports or DEFAULT_MEMORY_REPORTS)
        self.disk_error: str | None = None
        self.num_unspooled = 0
        self._mem: dict[int, dict] = {}  # seq -> report the disk refused, in insertion (= seq) order
        try:
            self.spool.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._disk_failed("create the spool folder", e)
        state = {}
        sp = self.dir / "state.json"
        if sp.exists():
            try:
                state = json.loads(sp.read_text())
            except (OSError, ValueError) as e:
                log.error("unreadable %s (%s): sequence numbers continue after the spool's", sp, e)
        for tmp in self.spool.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        self._seqs: deque[int] = deque(sorted(int(p.stem) for p in self.spool.glob("*.json") if p.stem.isdigit()))
        self.next_seq = max(int(state.get("next_seq", 0)), (self._seqs[-1] + 1) if self._seqs else 0)
        self.num_dropped = int(state.get("num_dropped", 0))
        while len(self._seqs) > self.max_reports:
            self._drop_oldest()
        self._save_state()

    def __len__(self) -> int:
        return len(self._seqs) + len(self._mem)

    @property
    def num_in_memory(self) -> int:
        return len(self._mem)

    def _path(self, seq: int) -> Path:
        return self.spool / f"{seq:010d}.json"

    def _disk_failed(self, what: str, e: OSError) -> None:
        msg = f"could not {what} in {self.dir}: {e}"
        if self.disk_error is None:  # once per episode, not once per report
            log.error("%s; reports are kept in memory (at most %d) and sent from there", msg,
                      self.max_memory_reports)
        self.disk_error = msg

    def _save_state(self) -> None:
        tmp = self.dir / "state.json.tmp"
        try:
            tmp.write_text(json.dumps({"next_seq": self.next_seq, "num_dropped": self.num_dropped}))
            os.replace(tmp, self.dir / "state.json")
        except OSError as e:
            self._disk_failed("save state.json", e)

    def _drop_oldest(self, memory_only: bool = False) -> None:
        oldest_mem = next(iter(self._mem), None)
        if memory_only or not self._seqs or (oldest_mem is not None and oldest_mem < self._seqs[0]):
            del self._mem[oldest_mem]
        else:
            seq = self._seqs.popleft()
            self._path(seq).unlink(missing_ok=True)
        self.num_dropped += 1

    def raise_next_seq(self, at_least: int) -> None:
        """Never send a number the control plane has already seen (e.g. after the state was lost)."""
        if at_least > self.next_seq:
            self.next_seq = at_least
            self._save_state()

    def append(self, report: dict) -> int:
        seq = self.next_seq
        if seq > MAX_SEQ:
            raise OverflowError("report sequence numbers exhausted")
        self.next_seq = seq + 1
        while len(self) >= self.max_reports:
            self._drop_oldest()
        self._save_state()
        body = dict(report, seq=seq)
        tmp = self.spool / f"{seq:010d}.tmp"
        try:
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self._path(seq))
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self._disk_failed(f"spool report {seq}", e)
            self.num_unspooled += 1
            while len(self._mem) >= self.max_memory_reports:
                self._drop_oldest(memory_only=True)
            self._mem[seq] = body
            return seq
        if self.disk_error is not None:
            log.warning("the spool is writable again (%s)", self.dir)
            self.disk_error = None
        self._seqs.append(seq)
        return seq

    def peek(self, n: int) -> list[dict]:
        """The oldest ``n`` reports, in sequence order, from disk or memory (unreadable files are
        dropped and counted)."""
        out = []
        disk = list(self._seqs)[: n]
        seqs = sorted(disk + list(self._mem)[: n])[: n] if self._mem else disk
        for seq in seqs:
            if seq in self._mem:
                out.append(self._mem[seq])
                continue
            try:
                out.append(json.loads(self._path(seq).read_text()))
            except (OSError, ValueError) as e:
                log.error("dropping unreadable spooled report %d: %s", seq, e)
                self.remove([seq])
                self.num_dropped += 1
                self._save_state()
        return out

    def remove(self, seqs) -> None:
        gone = set(seqs)
        for s in gone:
            if self._mem.pop(s, None) is None:
                try:
                    self._path(s).unlink(missing_ok=True)
                except OSError as e:
                    log.error("could not delete spooled report %d: %s", s, e)
        self._seqs = deque(s for s in self._seqs if s not in gone)


# ------------------------------------------------------------------------------- the reporter ---


def device_memory(engine) -> dict:
    """What the node tells the operators about its device's memory at registration: the
    bookkeeping outside the arena (``metadata_bytes``), and, where the device reports it (CUDA),
    its total and free bytes then (``device_total_bytes``, ``device_free_bytes``). A CPU or an
    emulated device reports no device memory: the keys are absent."""
    out = {}
    mm = getattr(engine, "mm", None)
    if mm is not None and hasattr(mm, "metadata_bytes"):
        out["metadata_bytes"] = int(mm.metadata_bytes())
    dev = getattr(mm, "arena", None) and mm.arena.device
    if dev is not None and getattr(dev, "type", None) == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(dev)
        out.update(device_total_bytes=int(total), device_free_bytes=int(free))
    return out


def cost_profile(miss_costs: dict | None, *, queue_capacity: int, service_time_us: float | None = None,
                 history_len: float = 512.0, num_candidates: int = 256, arena_bytes: int | None = None) -> dict:
    """The cost profile sent at registration (control_plane.weights.CostProfile fields).

    ``kv_recompute_us_per_token`` is the profiled cost at the profiled history length nearest
    ``history_len``; ``service_time_us`` is the given figure, else an estimate of one request's
    full-miss service time: ``history_len * kv + num_candidates * emb`` (the router's load term
    only needs it to scale queue depth into time).
    """
    from .control import cost_at

    costs = miss_costs or {}
    kv = cost_at(costs.get("kv_recompute_us_per_token", 0.0), history_len)
    emb = float(costs.get("emb_transfer_us_per_row", 0.0))
    svc = service_time_us if service_time_us is not None else history_len * kv + num_candidates * emb
    out = {"kv_recompute_us_per_token": float(kv), "emb_transfer_us_per_row": emb,
           "service_time_us": float(max(svc, 0.0)), "queue_capacity": int(queue_capacity)}
    if arena_bytes:  # the arena's size, for the operators (the weights do not use it)
        out["arena_bytes"] = int(arena_bytes)
    return out


def _finite_or_none(x) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _unit(x) -> float | None:
    x = _finite_or_none(x)
    return None if x is None else min(1.0, max(0.0, x))


def _detail_value(v):
    """One figure of a layer's detail as the control plane accepts it (`control_plane.schemas.LayerIn`)."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, str):
        return v[:MAX_DETAIL_TEXT_CHARS]
    return _finite_or_none(v)


def _layers(layers) -> list[dict]:
    """The decision's layer traces (`AllocatorDecision.to_dict()["layers"]`), bounded as the
    control plane accepts them (`node_agent.allocator.trace`'s limits)."""
    out = []
    for t in (layers or [])[:len(LAYERS)]:
        p = _finite_or_none(t.get("proposal"))
        out.append({"layer": t["layer"],
                    "proposal": None if p is None else min(MAX_PROPOSAL_ABS, max(-MAX_PROPOSAL_ABS, p)),
                    "acted": bool(t.get("acted")),
                    "detail": {str(k)[:MAX_DETAIL_NAME_CHARS]: _detail_value(v)
                               for k, v in list((t.get("detail") or {}).items())[:MAX_DETAIL_FIGURES]}})
    return out


def device_info(engine) -> dict | None:
    """The engine's `Engine.device_info`, bounded as the control plane accepts it
    (`control_plane.schemas.DeviceInfoIn`): ``mode``, ``time``, ``label``, and for an emulated
    device ``profile``, ``time_scale`` and ``calibrated``. None when the engine has no such
    method, it fails, or its mode is not one of `DEVICE_MODES` (unknown)."""
    fn = getattr(engine, "device_info", None)
    if not callable(fn):
        return None
    try:
        info = fn()
    except Exception:  # noqa: BLE001 - unknown, never a failed report
        log.exception("engine.device_info() failed; the device is reported as unknown")
        return None
    if not isinstance(info, dict) or info.get("mode") not in DEVICE_MODES:
        return None
    out: dict = {"mode": info["mode"]}
    if info.get("time") in DEVICE_TIMES:
        out["time"] = info["time"]
    if isinstance(info.get("label"), str) and info["label"]:
        out["label"] = info["label"][:MAX_DEVICE_TEXT_CHARS]
    if info["mode"] == "emulated":
        if isinstance(info.get("profile"), str) and info["profile"]:
            out["profile"] = info["profile"][:MAX_DEVICE_TEXT_CHARS]
        k = _finite_or_none(info.get("time_scale"))
        if k is not None and 0 < k <= MAX_TIME_SCALE:
            out["time_scale"] = k
        if isinstance(info.get("calibrated"), bool):
            out["calibrated"] = info["calibrated"]
    return out


@dataclass
class _AppliedOverride:
    key: tuple
    override: object  # the allocator's Override object we set


@dataclass
class ReporterStatus:
    registered: bool = False
    connected: bool = False
    last_error: str | None = None
    last_success_s: float | None = None
    num_sent: int = 0
    num_duplicates: int = 0
    num_rejected: int = 0
    num_send_errors: int = 0
    num_directive_pulls: int = 0
    policy_version: str | None = None
    policy_error: str | None = None
    override: dict | None = None
    events: list = field(default_factory=list)


class Reporter:
    """See the module docstring. ``wall_clock`` is injectable (tests); the agent's own clock is
    ``agent.clock``."""

    def __init__(self, agent, config: ReporterConfig, *, wall_clock: Callable[[], float] = time.time,
                 transport=None) -> None:
        import httpx

        self.agent = agent
        self.config = config
        self.wall_clock = wall_clock
        self.wall_offset_s = wall_clock() - agent.clock()
        # an emulated device's clock runs K times slower than the wall: its times map to wall
        # seconds through the wall time at its origin, not through a fixed offset
        clock = agent.clock
        self._scaled_clock = clock if callable(getattr(clock, "wall_elapsed_s", None)) else None
        self.wall_origin_s = (None if self._scaled_clock is None
                              else wall_clock() - self._scaled_clock.wall_elapsed_s(clock()))
        self.device = device_info(agent.engine)  # what this node's figures are (None: unknown)
        self.spool = ReportSpool(Path(config.state_dir), config.max_buffered_reports, config.max_memory_reports)
        self._inbox: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards status
        self.status_ = ReporterStatus()
        self.report_interval_s: float | None = None
        self._client = httpx.Client(base_url=config.control_plane_url, timeout=config.timeout_s, transport=transport,
                                    headers={"Authorization": f"Bearer {config.token}"})
        self._backoff_s = 0.0
        self._retry_after_s = 0.0
        self._allocator_snapshot: dict | None = None
        self._kept_snapshot: dict | None = None
        self._next_directives_s = 0.0
        self._applied_override: _AppliedOverride | None = None
        self._pending_confirm: dict | None = None
        self._failed_policy: tuple[str, str] | None = None
        self._pending_model_confirm: dict | None = None
        self._failed_model: tuple[str, str] | None = None
        self._confirmed_model_key: tuple | None = None
        self._confirmed_key: tuple | None = None
        self._burst: dict | None = None  # the burst in progress: start_s (wall), magnitude
        self._closed_bursts: list[dict] = []
        # the policy version the node runs (a control-plane version once one was loaded)
        pol = getattr(agent.allocator, "policy", None) if agent.allocator is not None else None
        self.policy_version: str | None = config_policy_version(pol)
        self._window_policy_version = self.policy_version
        self.status_.policy_version = self.policy_version

    def wall_s(self, agent_s: float) -> float:
        """The wall-clock time (Unix s) of the agent's time ``agent_s``."""
        if self._scaled_clock is not None:
            return self.wall_origin_s + self._scaled_clock.wall_elapsed_s(agent_s)
        return agent_s + self.wall_offset_s

    @property
    def model_digest(self) -> str | None:
        """The digest of the checkpoint the engine serves (None: random weights)."""
        return (getattr(self.agent.engine, "model_info", None) or {}).get("digest")

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

    # ---- the device worker's hook (no I/O)
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
            self._event(f"allocator state in {path} not restored: {e}")
            return None
        self._event(f"allocator state restored after a restart: {said}")
        return said

    def _keep_allocator(self) -> None:
        """Write the latest allocator snapshot (taken on the worker at each control step) when it
        changed: whole (temporary file, rename)."""
        snap = self._allocator_snapshot
        if snap is None or snap == self._kept_snapshot:
            return
        path = Path(self.config.state_dir) / ALLOCATOR_FILE
        tmp = path.with_name(ALLOCATOR_FILE + ".tmp")
        try:
            tmp.write_text(json.dumps(snap))
            tmp.replace(path)
            self._kept_snapshot = snap
        except OSError as e:  # a full or read-only disk: the node runs on, a restart starts afresh
            log.warning("could not keep the allocator state: %s", e)

    def on_control(self, out: dict) -> None:
        """Called by the device worker with each control step's output: queue one report."""
        alloc = self.agent.allocator
        if alloc is not None and hasattr(alloc, "snapshot"):
            self._allocator_snapshot = alloc.snapshot()
        try:
            self._inbox.put(self._build_report(out))
        except Exception:  # noqa: BLE001 - never hurt the worker
            log.exception("could not build the report of a control step")
        self._wake.set()

    def _build_report(self, out: dict) -> dict:
        agent = self.agent
        now_s = float(out["now_s"])
        w = out.get("window") or {}
        interval = float(w.get("interval_s") or agent.config.control_interval_s)
        lat = agent.metrics.latency_summary(now_s, interval, agent.config.slo_ms)
        mm = agent.engine.mm
        target = out.get("target_emb_share")
        if target is None:
            target = mm.plan.target_emb_share if mm.boundary_moving else mm.emb_share
        n = int(lat["num_requests"])
        dev = self.device
        report = {
            "ts_s": self.wall_s(now_s),
            "interval_s": interval,  # the agent's time (modelled on an emulated device), as the figures
            "emb_share": _unit(mm.emb_share),
            "emb_share_target": _unit(target),
            "kv_hit_rate": _unit(w.get("kv_hit_rate")) if n else None,
            "emb_hit_rate": _unit(w.get("emb_hit_rate")) if n else None,
            "p50_ms": lat["p50_ms"],
            "p99_ms": lat["p99_ms"],
            "slo_attainment": lat["slo_attainment"],
            "throughput_rps": n / interval,
            "num_requests": n,
            "queue_depth": float(agent._queue.qsize()),
            "refill_bytes": int(min(max(_finite_or_none(w.get("refill_bytes")) or 0.0, 0.0), MAX_SEQ)),
            "kv_recompute_us_per_token": _finite_or_none(w.get("kv_recompute_us_per_token")),
            "emb_transfer_us_per_row": _finite_or_none(w.get("emb_transfer_us_per_row")),
            "policy_version": self._window_policy_version,
            "model_digest": self.model_digest,  # one model per window: a swap closes the window first
            "device_mode": dev["mode"] if dev else None,
            "device_profile": dev.get("profile") if dev else None,
        }
        quality = getattr(agent, "quality", None)
        if quality is not None:  # the worker thread calls this: the tracker is the worker's
            q, _ = quality.take_window()
            report["model_quality"] = _unit(q)
        self._window_policy_version = self.policy_version  # the next window runs this one
        d = out.get("decision")
        if d:
            feats = {k: float(v) for k, v in (d.get("features") or {}).items() if _finite_or_none(v) is not None}
            report["decision"] = {"source": d["source"], "emb_share": _unit(d["emb_share"]),
                                  "reason": str(d.get("reason", ""))[:MAX_REASON_CHARS],
                                  "prev_emb_share": _unit(d.get("prev_emb_share")), "features": feats,
                                  "layers": _layers(d.get("layers"))}
        report["bursts"] = self._bursts(now_s)
        return report

    def _bursts(self, now_s: float) -> list[dict]:
        """Bursts seen by the recovery controller: sent when one starts (end None) and when it ends."""
        alloc = self.agent.allocator
        out = []
        if alloc is None:
            return out
        rec = alloc.recovery
        if rec.phase == "burst" and rec.burst_started_s is not None:
            start = round(self.wall_s(rec.burst_started_s), 6)
            if self._burst is None or self._burst["start_s"] != start:
                if self._burst is not None:  # a new burst right after the old one: close the old one
                    out.append({**self._burst, "end_s": round(self.wall_s(now_s), 6)})
                self._burst = {"start_s": start, "end_s": None, "magnitude": float(rec.rate_ratio)}
                out.append(dict(self._burst))
            elif rec.rate_ratio > self._burst["magnitude"]:
                self._burst["magnitude"] = float(rec.rate_ratio)
        elif self._burst is not None:
            out.append({**self._burst, "end_s": round(self.wall_s(now_s), 6)})
            self._burst = None
        return out

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

    def _event(self, msg: str) -> None:
        log.info("%s", msg)
        with self._lock:
            self.status_.events = (self.status_.events + [{"t_s": self.wall_clock(), "event": msg}])[-20:]

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            self._keep_allocator()
            try:
                ok = self._cycle()
            except Exception as e:  # noqa: BLE001 - the thread must keep going
                log.exception("reporter cycle failed")
                ok = False
                self._error(f"{type(e).__name__}: {e}")
            if ok:
                self._backoff_s = 0.0
                wait = self._period()
            else:
                self._backoff_s = min(self.config.max_backoff_s, max(0.1, self._backoff_s * 2))
                wait = max(self._backoff_s, self._retry_after_s)  # a 429's Retry-After: the quota's wait
            self._retry_after_s = 0.0
            self._wake.wait(wait)
            self._wake.clear()

    def _period(self) -> float:
        return self.config.directives_period_s or self.agent.config.control_interval_s

    def _error(self, msg: str) -> None:
        with self._lock:
            self.status_.connected = False
            self.status_.last_error = msg
            self.status_.num_send_errors += 1

    def _ok(self) -> None:
        with self._lock:
            if not self.status_.connected:
                self.status_.connected = True
            self.status_.last_success_s = self.wall_clock()

    def _cycle(self) -> bool:
        """Register if needed, send the spool, pull directives, confirm; False on a transport error."""
        import httpx

        try:
            if not self.status_.registered and not self._register():
                return False
            if not self._send_spool():
                return False
            if self._pending_confirm is not None and not self._confirm():
                return False
            if self._pending_model_confirm is not None and not self._confirm_model():
                return False
            now = time.monotonic()
            if now >= self._next_directives_s:
                self._next_directives_s = now + self._period() * 0.9
                if not self._pull_directives():
                    return False
            return True
        except httpx.HTTPError as e:
            self._error(f"control plane unreachable: {type(e).__name__}: {e}")
            return False

    def _register(self) -> bool:
        body = {"node_id": self.config.node_id, "address": self.config.advertise_url,
                "device": self.device_label(), "cost_profile": self.registration_profile(),
                "policy_version": self.policy_version, "started_at_s": PROCESS_STARTED_S}
        r = self._client.post(f"{API}/nodes/register", json=body)
        if r.status_code >= 300:
            self._error(f"register: HTTP {r.status_code}: {r.text[:500]}")
            return False
        data = r.json()
        self.report_interval_s = _finite_or_none(data.get("report_interval_s"))
        last = data.get("last_report_seq")
        if isinstance(last, int):
            self.spool.raise_next_seq(last + 1)
        with self._lock:
            self.status_.registered = True
        self._ok()
        self._event(f"registered as {self.config.node_id} at {self.config.control_plane_url}")
        return True

    def device_label(self) -> str:
        """The device as the control plane lists it: `Engine.device_info`'s label
        ("emulated a100-hstu (uncalibrated, modelled time, x10)", "cpu (EMB link emulated)",
        "cuda:0"), else the engine's device."""
        label = (self.device or {}).get("label") or str(getattr(self.agent.engine, "device", "unknown"))
        return label[:MAX_DEVICE_TEXT_CHARS]

    def registration_profile(self) -> dict:
        c = self.config
        ecfg = self.agent.engine.config
        mm = getattr(self.agent.engine, "mm", None)
        arena = ecfg.num_pages * mm.config.page_bytes if mm is not None and hasattr(ecfg, "num_pages") else None
        prof = cost_profile(self.agent.miss_costs, queue_capacity=c.queue_capacity or self.agent.config.max_queue,
                            service_time_us=c.service_time_us,
                            num_candidates=getattr(ecfg, "default_num_candidates", 256), arena_bytes=arena)
        prof.update(device_memory(self.agent.engine))
        digest = (getattr(self.agent.engine, "model_info", None) or {}).get("digest")
        if digest:  # the checkpoint this node serves, for the operators (random weights: none)
            prof["model_digest"] = digest
        if self.device is not None:  # what its figures are: real, link-emulated or emulated (by which profile)
            prof["device"] = dict(self.device)
        return prof

    def _send_spool(self) -> bool:
        while len(self.spool) and not self._stop.is_set():
            batch = self.spool.peek(self.config.batch_size)
            if not batch:
                continue
            r = self._client.post(f"{API}/nodes/{self.config.node_id}/reports", json={"reports": batch})
            if r.status_code in (200, 201):
                data = r.json()
                self.spool.remove(x["seq"] for x in batch)
                with self._lock:
                    self.status_.num_sent += int(data.get("stored", len(batch)))
                    self.status_.num_duplicates += int(data.get("duplicates", 0))
                self._ok()
                self._drain_inbox()
                continue
            if r.status_code == 404:  # the control plane forgot this node (a new database): register again
                with self._lock:
                    self.status_.registered = False
                self._error(f"reports: HTTP 404 ({r.text[:200]}); registering again")
                return False
            if r.status_code == 422:
                if len(batch) > 1:  # find the report it refuses; send the others
                    for one in batch:
                        if not self._send_one(one):
                            return False
                    continue
                self._reject(batch[0], r)
                continue
            if r.status_code == 413 and len(batch) > 1:  # past the quota's burst: one at a time
                for one in batch:
                    if not self._send_one(one):
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
        self._error(f"reports: HTTP {r.status_code}: {r.text[:500]}")

    def _send_one(self, report: dict) -> bool:
        r = self._client.post(f"{API}/nodes/{self.config.node_id}/reports", json={"reports": [report]})
        if r.status_code in (200, 201):
            self.spool.remove([report["seq"]])
            with self._lock:
                self.status_.num_sent += int(r.json().get("stored", 1))
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
        with self._lock:
            self.status_.num_rejected += 1
            self.status_.last_error = f"report {report['seq']} refused: {r.text[:300]}"

    # ---- directives
    def _pull_directives(self) -> bool:
        sent_at = self.agent.clock()  # the control plane's now_s is at or after this instant
        r = self._client.get(f"{API}/nodes/{self.config.node_id}/directives")
        if r.status_code == 404:
            with self._lock:
                self.status_.registered = False
            self._error(f"directives: HTTP 404 ({r.text[:200]}); registering again")
            return False
        if r.status_code != 200:
            self._error(f"directives: HTTP {r.status_code}: {r.text[:500]}")
            return False
        d = r.json()
        with self._lock:
            self.status_.num_directive_pulls += 1
        self._ok()
        server_now = _finite_or_none(d.get("now_s"))
        self.apply_override(d.get("override"), server_now if server_now is not None else self.wall_clock(),
                            agent_now_s=sent_at)
        pol = d.get("policy")
        if pol:
            self.apply_policy(pol)
        md = d.get("model")
        if md:
            self.apply_model(md)
        return True

    def apply_override(self, od: dict | None, server_now_s: float, agent_now_s: float | None = None) -> None:
        """Apply the control plane's override (None: clear the one it set before).

        ``agent_now_s`` is the agent's time matching ``server_now_s``; the time the directive
        request was sent is used, which the control plane's clock can only have passed: the
        override then ends a round trip early at worst, never late."""
        alloc = self.agent.allocator
        if alloc is None:
            if od is not None:
                with self._lock:
                    self.status_.override = {**od, "applied": False, "error": "no allocator on this node"}
            return
        if od is None:
            if self._applied_override is not None:
                if alloc.override is self._applied_override.override:
                    alloc.clear_override()
                    self._event(f"override {self._applied_override.key[0]} cleared by the control plane")
                self._applied_override = None
                with self._lock:
                    self.status_.override = None
            return
        key = (od.get("override_id"), od.get("emb_share"), od.get("expires_at_s"))
        if self._applied_override is not None and self._applied_override.key == key:
            return  # applied already (the allocator drops it itself when it expires)
        now = self.agent.clock()
        ref = now if agent_now_s is None else agent_now_s
        exp = od.get("expires_at_s")
        # the control plane's seconds are wall seconds: on an emulated device (a ScaledClock) one
        # of them is 1/K of the agent's modelled second
        k = float(getattr(self._scaled_clock, "time_scale", 1.0))
        expires = None if exp is None else ref + (float(exp) - server_now_s) / k
        if expires is not None and expires <= now:
            return  # expired already by the control plane's clock; its expiry job will drop it
        reason = f"{od.get('reason', '')} (override {od.get('override_id')}, {od.get('scope', 'node')})"
        try:
            ov = alloc.set_override(float(od["emb_share"]), now_s=now, expires_at_s=expires, reason=reason)
        except (ValueError, KeyError, TypeError) as e:
            with self._lock:
                self.status_.override = {**od, "applied": False, "error": str(e)}
            self._event(f"override {od.get('override_id')} refused: {e}")
            self._applied_override = _AppliedOverride(key, None)
            return
        self._applied_override = _AppliedOverride(key, ov)
        with self._lock:
            self.status_.override = {**od, "applied": True, "expires_at_agent_s": expires}
        self._event(f"override {od.get('override_id')} applied: emb_share {ov.emb_share:.4f}"
                    + ("" if expires is None else f" for {expires - now:.1f} s"))

    def apply_policy(self, pol: dict) -> None:
        version, digest = str(pol.get("version")), str(pol.get("digest", ""))
        if version == self.policy_version:
            # running it already (e.g. the local artifact): confirm once per directive
            key = (version, digest, pol.get("rollout_id"))
            if self._confirmed_key != key:
                self._confirmed_key = key
                self._pending_confirm = {"policy_version": version, "status": "loaded", "error": None}
                self._confirm()
            return
        if self._failed_policy == (version, digest):
            return
        alloc = self.agent.allocator
        error = None
        try:
            if alloc is None:
                raise RuntimeError("no allocator on this node (start the agent with --policy or --control-plane)")
            path = self._download(version, digest, pol.get("download_url") or f"{API}/policies/{path_segment(version)}/artifact")
            alloc.load_policy(path, now_s=self.agent.clock())
        except Exception as e:  # noqa: BLE001 - any failure keeps the old policy
            error = f"{type(e).__name__}: {e}"
        if error is None:
            self.policy_version = version
            self._failed_policy = None
            self._confirmed_key = (version, digest, pol.get("rollout_id"))
            self._pending_confirm = {"policy_version": version, "status": "loaded", "error": None}
            self._event(f"policy {version} loaded")
        else:
            self._failed_policy = (version, digest)
            self._pending_confirm = {"policy_version": version, "status": "failed", "error": error[:4000]}
            self._event(f"policy {version} refused, keeping {self.policy_version}: {error}")
        with self._lock:
            self.status_.policy_version = self.policy_version
            self.status_.policy_error = error
        self._confirm()

    def apply_model(self, md: dict) -> None:
        """Serve the checkpoint the control plane names (``md``: version = checkpoint digest, digest
        = the tar's SHA-256, download_url). Downloaded, checked (tar digest, then every file's and
        the manifest's digest, the config and item count this node serves), then swapped in on the
        device worker (`NodeAgent.swap_model` -> `Engine.load_checkpoint`); on any failure the
        current model keeps serving. The outcome is confirmed with ``POST /nodes/{id}/model``."""
        version, digest = str(md.get("version")), str(md.get("digest", ""))
        if version == self.model_digest:
            key = (version, digest, md.get("rollout_id"))
            if self._confirmed_model_key != key:
                self._confirmed_model_key = key
                self._pending_model_confirm = {"model_version": version, "status": "loaded", "error": None}
                self._confirm_model()
            return
        if self._failed_model == (version, digest):
            return
        error = None
        try:
            from .model.checkpoint import load_checkpoint

            path = self._download(version, digest, md.get("download_url") or f"{API}/models/{path_segment(version)}/artifact",
                                  kind="model")
            ecfg = self.agent.engine.config
            ck = load_checkpoint(path, digest=version, num_items=ecfg.num_items, config=ecfg.model)
            self.agent.call_on_worker(lambda: self.agent.swap_model(ck)).result(timeout=120.0)
        except Exception as e:  # noqa: BLE001 - any failure keeps the current model
            error = f"{type(e).__name__}: {e}"
        if error is None:
            self._failed_model = None
            self._confirmed_model_key = (version, digest, md.get("rollout_id"))
            self._pending_model_confirm = {"model_version": version, "status": "loaded", "error": None}
            self._event(f"model {version[:16]} loaded")
        else:
            self._failed_model = (version, digest)
            self._pending_model_confirm = {"model_version": version, "status": "failed", "error": error[:4000]}
            self._event(f"model {version[:16]} refused, keeping {str(self.model_digest)[:16]}: {error}")
        self._confirm_model()

    def _confirm_model(self) -> bool:
        body = self._pending_model_confirm
        if body is None:
            return True
        r = self._client.post(f"{API}/nodes/{self.config.node_id}/model", json=body)
        if r.status_code >= 300:
            self._error(f"model confirmation: HTTP {r.status_code}: {r.text[:500]}")
            return False
        self._pending_model_confirm = None
        return True

    def _download(self, version: str, digest: str, url: str, kind: str = "policy") -> Path:
        r = self._client.get(urljoin(self.config.control_plane_url + "/", url.lstrip("/")) if not url.startswith(
            ("http://", "https://")) else url)
        if r.status_code != 200:
            raise RuntimeError(f"download of {kind} {version}: HTTP {r.status_code}: {r.text[:300]}")
        data = r.content
        want = digest.split(":", 1)[1] if digest.startswith("sha256:") else digest
        got = hashlib.sha256(data).hexdigest()
        if got != want.lower():
            raise RuntimeError(f"{kind} {version}: digest mismatch: got sha256 {got}, expected {want}")
        dest = Path(self.config.state_dir) / ("policies" if kind == "policy" else "models") / \
            f"{_safe(version)[:64]}-{got[:16]}"
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        unpack_artifact(data, dest)
        return dest

    def _confirm(self) -> bool:
        body = self._pending_confirm
        if body is None:
            return True
        r = self._client.post(f"{API}/nodes/{self.config.node_id}/policy", json=body)
        if r.status_code >= 300:
            self._error(f"policy confirmation: HTTP {r.status_code}: {r.text[:500]}")
            return False
        self._pending_confirm = None
        return True

    # ---- reporting
    def status(self) -> dict:
        with self._lock:
            s = self.status_
            return {"control_plane_url": self.config.control_plane_url, "node_id": self.config.node_id,
                    "registered": s.registered, "connected": s.connected, "last_error": s.last_error,
                    "last_success_s": s.last_success_s, "next_seq": self.spool.next_seq,
                    "num_buffered": len(self.spool), "num_dropped": self.spool.num_dropped,
                    "num_in_memory": self.spool.num_in_memory, "num_unspooled": self.spool.num_unspooled,
                    "spool_error": self.spool.disk_error,
                    "num_sent": s.num_sent, "num_duplicates": s.num_duplicates, "num_rejected": s.num_rejected,
                    "num_send_errors": s.num_send_errors, "num_directive_pulls": s.num_directive_pulls,
                    "policy_version": s.policy_version, "policy_error": s.policy_error,
                    "override": s.override, "events": list(s.events)}


def config_policy_version(policy) -> str | None:
    """The version a node reports before the control plane gave it one: its local artifact's id."""
    return None if policy is None else getattr(policy, "policy_id", None)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:100]


def unpack_artifact(data: bytes, dest: Path) -> None:
    """Unpack a policy artifact archive (tar, tar.gz or zip) into ``dest``: its files (policy.onnx,
    golden.npz, manifest.json) end up directly in ``dest`` (one top folder is stripped). Paths that
    leave ``dest`` and links are refused."""
    members: list[tuple[str, bytes]] = []
    # by the leading magic bytes: a tar holding golden.npz (itself a zip) would pass is_zipfile
    if data[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            for info in z.infolist():
                if not info.is_dir():
                    members.append((info.filename, z.read(info)))
    else:
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as t:
                for m in t.getmembers():
                    if m.issym() or m.islnk():
                        raise RuntimeError(f"policy archive holds a link: {m.name}")
                    if m.isfile():
                        members.append((m.name, t.extractfile(m).read()))
        except tarfile.TarError as e:
            raise RuntimeError(f"policy artifact is neither a zip nor a tar archive: {e}") from None
    if not members:
        raise RuntimeError("policy archive is empty")
    parts = [Path(n).parts for n, _ in members]
    strip = 1 if all(len(p) > 1 for p in parts) and len({p[0] for p in parts}) == 1 else 0
    for (name, blob), p in zip(members, parts):
        rel = Path(*p[strip:])
        if rel.is_absolute() or ".." in rel.parts:
            raise RuntimeError(f"policy archive path leaves the artifact: {name}")
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(blob)


def default_node_id(port: int) -> str:
    return f"{socket.gethostname()}-{port}"


def default_state_dir(node_id: str) -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "racer", "node-agent", _safe(node_id))
