"""What a node says in its reports: one report per control step, built on the device worker
(`WindowReports.build`: one small dict, no I/O), bounded as the control plane accepts it.

Times: reports carry wall-clock seconds (``ts_s``, and a burst's ``start_s``/``end_s``), so the
control plane's history is in one time base across nodes (`WallTime`): the agent's clock plus an
offset fixed at start, or, on an emulated device (a `node_agent.emulated.ScaledClock` in modelled
seconds), the wall time at the clock's origin plus the wall seconds since it (``wall_elapsed_s``).
The window's figures (``interval_s``, latencies, ``throughput_rps``) stay in the agent's time:
modelled on an emulated device.

Device: every report says what its figures are (``device_mode``: ``real``, ``link-emulated`` or
``emulated``, and ``device_profile``, the cost profile of an emulated device; `device_info`), so
an emulated figure is never taken for a measured one. An engine without ``device_info`` (or one
that answers something else) reports them as null: unknown.

Every report carries the digest of the model served in its window (``model_digest``), the
window's online quality (``model_quality``, `node_agent.model.quality`), the policy version that
ran the window, the allocator's decision with its layer traces, and the bursts the recovery
controller saw (sent when one starts, end None, and when it ends).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

# what the control plane accepts (`common.contract.ReportIn`): each report is bounded so
from common.contract import (DEVICE_MODES, DEVICE_TIMES, LAYERS, MAX_DETAIL_FIGURES, MAX_DETAIL_NAME_CHARS,
                             MAX_DETAIL_TEXT_CHARS, MAX_DEVICE_TEXT_CHARS, MAX_PROPOSAL_ABS, MAX_REASON_CHARS, MAX_SEQ,
                             MAX_TIME_SCALE)

log = logging.getLogger("racer.node_agent.reports")


def finite_or_none(x) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def unit(x) -> float | None:
    x = finite_or_none(x)
    return None if x is None else min(1.0, max(0.0, x))


def _detail_value(v):
    """One figure of a layer's detail as the control plane accepts it (`common.contract.LayerIn`)."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, str):
        return v[:MAX_DETAIL_TEXT_CHARS]
    return finite_or_none(v)


def report_layers(layers) -> list[dict]:
    """The decision's layer traces (`AllocatorDecision.to_dict()["layers"]`), bounded as the
    control plane accepts them (`common.contract.LayerIn`)."""
    out = []
    for t in (layers or [])[:len(LAYERS)]:
        p = finite_or_none(t.get("proposal"))
        out.append({"layer": t["layer"],
                    "proposal": None if p is None else min(MAX_PROPOSAL_ABS, max(-MAX_PROPOSAL_ABS, p)),
                    "acted": bool(t.get("acted")),
                    "detail": {str(k)[:MAX_DETAIL_NAME_CHARS]: _detail_value(v)
                               for k, v in list((t.get("detail") or {}).items())[:MAX_DETAIL_FIGURES]}})
    return out


def device_info(engine) -> dict | None:
    """The engine's `Engine.device_info`, bounded as the control plane accepts it
    (`common.contract.DeviceInfoIn`): ``mode``, ``time``, ``label``, and for an emulated
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
        k = finite_or_none(info.get("time_scale"))
        if k is not None and 0 < k <= MAX_TIME_SCALE:
            out["time_scale"] = k
        if isinstance(info.get("calibrated"), bool):
            out["calibrated"] = info["calibrated"]
    return out


class WallTime:
    """The wall-clock time (Unix s) of an agent time. An emulated device's clock (with
    ``wall_elapsed_s``) runs K times slower than the wall: its times map to wall seconds through
    the wall time at its origin, not through a fixed offset."""

    def __init__(self, agent_clock: Callable[[], float], wall_clock: Callable[[], float]) -> None:
        self.offset_s = wall_clock() - agent_clock()
        self.scaled = agent_clock if callable(getattr(agent_clock, "wall_elapsed_s", None)) else None
        self.origin_s = None if self.scaled is None else wall_clock() - self.scaled.wall_elapsed_s(agent_clock())

    @property
    def time_scale(self) -> float:
        """Agent seconds per wall second (1 unless the clock is an emulated device's)."""
        return float(getattr(self.scaled, "time_scale", 1.0))

    def wall_s(self, agent_s: float) -> float:
        if self.scaled is not None:
            return self.origin_s + self.scaled.wall_elapsed_s(agent_s)
        return agent_s + self.offset_s


class WindowReports:
    """Builds each control step's report on the device worker (no I/O). ``policy_version`` says
    the version running now; a report names the one that ran its window."""

    def __init__(self, agent, wall: WallTime, device: dict | None, policy_version: Callable[[], str | None],
                 model_digest: Callable[[], str | None]) -> None:
        self.agent = agent
        self.wall = wall
        self.device = device
        self._policy_version = policy_version
        self._model_digest = model_digest
        self._window_policy_version = policy_version()
        self._burst: dict | None = None  # the burst in progress: start_s (wall), magnitude

    def build(self, out: dict) -> dict:
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
            "ts_s": self.wall.wall_s(now_s),
            "interval_s": interval,  # the agent's time (modelled on an emulated device), as the figures
            "emb_share": unit(mm.emb_share),
            "emb_share_target": unit(target),
            "kv_hit_rate": unit(w.get("kv_hit_rate")) if n else None,
            "emb_hit_rate": unit(w.get("emb_hit_rate")) if n else None,
            "p50_ms": lat["p50_ms"],
            "p99_ms": lat["p99_ms"],
            "slo_attainment": lat["slo_attainment"],
            "throughput_rps": n / interval,
            "num_requests": n,
            "queue_depth": float(agent._queue.qsize()),
            "refill_bytes": int(min(max(finite_or_none(w.get("refill_bytes")) or 0.0, 0.0), MAX_SEQ)),
            "kv_recompute_us_per_token": finite_or_none(w.get("kv_recompute_us_per_token")),
            "emb_transfer_us_per_row": finite_or_none(w.get("emb_transfer_us_per_row")),
            "policy_version": self._window_policy_version,
            "model_digest": self._model_digest(),  # one model per window: a swap closes the window first
            "device_mode": dev["mode"] if dev else None,
            "device_profile": dev.get("profile") if dev else None,
        }
        quality = getattr(agent, "quality", None)
        if quality is not None:  # the worker thread calls this: the tracker is the worker's
            q, _ = quality.take_window()
            report["model_quality"] = unit(q)
        self._window_policy_version = self._policy_version()  # the next window runs this one
        d = out.get("decision")
        if d:
            feats = {k: float(v) for k, v in (d.get("features") or {}).items() if finite_or_none(v) is not None}
            report["decision"] = {"source": d["source"], "emb_share": unit(d["emb_share"]),
                                  "reason": str(d.get("reason", ""))[:MAX_REASON_CHARS],
                                  "prev_emb_share": unit(d.get("prev_emb_share")), "features": feats,
                                  "layers": report_layers(d.get("layers"))}
        report["bursts"] = self.bursts(now_s)
        return report

    def bursts(self, now_s: float) -> list[dict]:
        """Bursts seen by the recovery controller: sent when one starts (end None) and when it ends."""
        alloc = self.agent.allocator
        out = []
        if alloc is None:
            return out
        rec = alloc.recovery
        wall_s = self.wall.wall_s
        if rec.phase == "burst" and rec.burst_started_s is not None:
            start = round(wall_s(rec.burst_started_s), 6)
            if self._burst is None or self._burst["start_s"] != start:
                if self._burst is not None:  # a new burst right after the old one: close the old one
                    out.append({**self._burst, "end_s": round(wall_s(now_s), 6)})
                self._burst = {"start_s": start, "end_s": None, "magnitude": float(rec.rate_ratio)}
                out.append(dict(self._burst))
            elif rec.rate_ratio > self._burst["magnitude"]:
                self._burst["magnitude"] = float(rec.rate_ratio)
        elif self._burst is not None:
            out.append({**self._burst, "end_s": round(wall_s(now_s), 6)})
            self._burst = None
        return out
