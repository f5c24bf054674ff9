"""Named workloads for the fleet bench, whose best EMB/KV split differs, with their figures stated
before any run.

Each workload is a function of (trace, rate_rps, duration_s, seed) returning a
`workloads.regimes.RequestStream` (`workload_stream`); `describe` gives its figures, derived from
the trace and the generated stream alone (no simulator, no fleet): history lengths, the share of
requests whose user was active in the previous 10 minutes of modelled time, the request-rate swing
over the run, the items it requests and their skew, the share of requests from users new to the
run. docs/workloads.md lists them for the Taobao sample (``python -m workloads.fleet_workloads
--json`` prints them).

- ``kv-heavy``: a session stream (`workloads.sessions`) over the most active quarter of the
  trace's users, each once (`kv_heavy_users`: trace history at least the 75th percentile of the
  lengths; 206 users with 137-539 items on Taobao), their sessions as fitted; modelled time is
  compressed to the rate, so these few users come back within seconds of the run, session after
  session, with the trace's longest histories.
- ``emb-heavy``: `workloads.regimes` steady arrivals over `EMB_USERS_PER_REQUEST` users per
  request (resampled trace users at random rotations): nearly every request comes from a user new
  to the run, and the users' histories sweep the whole catalogue with the trace's skew.
- ``day``: the trace's hour-of-day curve (its requests' histogram by local hour, `hour_curve`)
  compressed into the run: one modelled day, session starts laid on a curve calibrated so the
  requests follow the trace's (`day_start_curve`), sessions as fitted; the user count follows
  from the rate.
  A trace whose timestamps are whole days (Amazon) has no hour-of-day curve: a `ValueError`.
- ``trace-order``: the trace in its own time order (`workloads.sessions.trace_order_stream`)
  from the `TRACE_ORDER_START` quantile of its request times on (users have most of their
  history by then), compressed to the rate.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .regimes import RequestStream, generate, top_share
from .sessions import (MAX_USERS, RECENT_WINDOW_S, Modelled, SessionModel, StreamShape, check_run, fit_sessions,
                       modelled_session_stream, modelled_trace_order_stream, recent_share, trace_requests)
from .trace import Trace

KV_USER_QUANTILE = 0.75  # kv-heavy: its users' trace histories are at least this quantile of the lengths
EMB_USERS_PER_REQUEST = 20  # emb-heavy: users per request of the run
TRACE_ORDER_START = 0.6  # trace-order: the window opens at this quantile of the trace's request times
#: local time of each trace's timestamps (hours east of UTC): Taobao's are China Standard Time
UTC_OFFSET_H = {"taobao": 8}
DESCRIBE_RATE_RPS = 100.0  # the run `describe` generates unless told otherwise
DESCRIBE_DURATION_S = 120.0
DAY_CALIBRATION_DAYS = 4  # day_start_curve: modelled days generated per round
DAY_CALIBRATION_REQUESTS = 200_000  # day_start_curve: requests generated per round
DAY_CALIBRATION_ROUNDS = 5
SWING_WINDOWS = 24  # the run's request-rate swing: max / min (and `swing_3h`) over this many equal windows


@dataclass(frozen=True)
class WorkloadSpec:
    """One named workload: ``make(trace, rate_rps, duration_s, seed, shape) -> Modelled``."""

    name: str
    description: str
    make: Callable[..., Modelled]


def hour_curve(trace: Trace, utc_offset_h: float | None = None) -> np.ndarray:
    """Requests per local hour of day (24 counts) over the trace's core span
    (`workloads.sessions.TraceRequests.core_span_s`); ``utc_offset_h`` default `UTC_OFFSET_H`
    for the trace (0 when unknown)."""
    off = UTC_OFFSET_H.get(trace.name, 0.0) if utc_offset_h is None else float(utc_offset_h)
    req = trace_requests(trace)
    lo, hi = req.core_span_s()
    t = req.time_s[(req.time_s >= lo) & (req.time_s <= hi)]
    return np.bincount(((t + off * 3600.0) // 3600.0 % 24).astype(np.int64), minlength=24).astype(np.float64)


def swing_3h(counts) -> float | None:
    """The mean of the 3 highest counts over the mean of the 3 lowest: a swing that a few
    requests more or less in the trough window do not throw about (None if those are 0)."""
    c = np.sort(np.asarray(counts, dtype=np.float64))
    return round(float(c[-3:].mean() / c[:3].mean()), 2) if len(c) >= 6 and c[:3].mean() > 0 else None


def trace_day_figures(trace: Trace, utc_offset_h: float | None = None) -> dict:
    """The day's figures measured on the trace itself: the hourly request counts, their swing
    (max / min, and `swing_3h`), the hours of the trough and the peak, and the share of requests whose user was
    active in the previous 10 minutes, overall and its range over the 24 hours."""
    off = UTC_OFFSET_H.get(trace.name, 0.0) if utc_offset_h is None else float(utc_offset_h)
    curve = hour_curve(trace, off)
    req = trace_requests(trace)
    lo, hi = req.core_span_s()
    m = (req.time_s >= lo) & (req.time_s <= hi)
    recent = req.gaps_s()[m] <= RECENT_WINDOW_S
    hour = ((req.time_s[m] + off * 3600.0) // 3600.0 % 24).astype(np.int64)
    by_hour = [float(recent[hour == h].mean()) for h in range(24) if np.any(hour == h)]
    return {"utc_offset_h": off, "hour_counts": [int(c) for c in curve],
            "hour_swing": round(float(curve.max() / max(curve.min(), 1.0)), 2),
            "hour_swing_3h": swing_3h(curve),
            "trough_hour": int(curve.argmin()), "peak_hour": int(curve.argmax()),
            "recent_share_10min": round(float(recent.mean()), 4),
            "recent_share_10min_by_hour": [round(min(by_hour), 4), round(max(by_hour), 4)]}


# ----------------------------------------------------------------------------------- workloads


def kv_heavy_users(trace: Trace) -> np.ndarray:
    """The trace users kv-heavy replays: those whose trace history is at least the
    `KV_USER_QUANTILE` quantile of the history lengths (the most active, longest histories)."""
    lens = trace.seq_lens
    return np.flatnonzero(lens >= np.quantile(lens, KV_USER_QUANTILE))


def _kv_heavy(trace: Trace, rate_rps: float, duration_s: float, seed: int, shape: StreamShape) -> Modelled:
    pool = kv_heavy_users(trace)
    return modelled_session_stream(trace, fit_sessions(trace), rate_rps=rate_rps, duration_s=duration_s, seed=seed,
                                   num_users=len(pool), base_users=pool, shape=shape)


def _emb_heavy(trace: Trace, rate_rps: float, duration_s: float, seed: int, shape: StreamShape) -> Modelled:
    n = check_run(rate_rps, duration_s)
    stream = generate(trace, regime="steady", rate_rps=float(rate_rps), duration_s=float(duration_s), seed=int(seed),
                      num_users=min(MAX_USERS, max(trace.num_users, EMB_USERS_PER_REQUEST * n)),
                      num_candidates=shape.num_candidates, max_new_items=shape.max_new_items,
                      max_history_len=shape.max_history_len, history_scale=shape.history_scale)
    return Modelled(stream, 1.0)  # no modelled clock: run time is the users' time


def day_start_curve(trace: Trace, model: SessionModel | None = None) -> np.ndarray:
    """The hourly session-start rates under which the session model's requests follow the
    trace's request curve (`hour_curve`). Starting from the request curve itself, each of
    `DAY_CALIBRATION_ROUNDS` rounds generates `DAY_CALIBRATION_DAYS` modelled days (seed 0, about
    `DAY_CALIBRATION_REQUESTS` requests) and multiplies each hour's start rate by the trace's
    share of requests in that hour over the generated share (the factor kept within [0.2, 5]):
    sessions that start in the evening peak run on into the night, so start rates laid on the
    request curve as it is would flatten the night trough."""
    curve = hour_curve(trace)
    if np.count_nonzero(curve) < 12:
        raise ValueError(f"{trace.name}: the day workload needs timestamps finer than hours; the trace's requests fall "
                         f"in {np.count_nonzero(curve)} of the 24 hours of the day (whole-day timestamps?)")
    model = model or fit_sessions(trace)
    target = curve / curve.sum()
    span = DAY_CALIBRATION_DAYS * 86_400.0
    starts = curve.copy()
    for _ in range(DAY_CALIBRATION_ROUNDS):
        s = modelled_session_stream(trace, model, rate_rps=DAY_CALIBRATION_REQUESTS / span, duration_s=span, seed=0,
                                    modelled_span_s=span, hour_curve=starts).stream
        got = np.bincount((s.arrival_s // 3600.0 % 24).astype(np.int64), minlength=24).astype(np.float64)
        ok = got > 0
        factor = np.ones(24)
        factor[ok] = np.clip(target[ok] / (got[ok] / got.sum()), 0.2, 5.0)
        starts = starts * factor
    return starts


def _day(trace: Trace, rate_rps: float, duration_s: float, seed: int, shape: StreamShape) -> Modelled:
    model = fit_sessions(trace)
    return modelled_session_stream(trace, model, rate_rps=rate_rps, duration_s=duration_s, seed=seed,
                                   modelled_span_s=86_400.0, hour_curve=day_start_curve(trace, model), shape=shape)


def _trace_order(trace: Trace, rate_rps: float, duration_s: float, seed: int, shape: StreamShape) -> Modelled:
    req = trace_requests(trace)
    start = float(np.quantile(req.time_s, TRACE_ORDER_START))
    return modelled_trace_order_stream(trace, rate_rps=rate_rps, duration_s=duration_s, start_s=start, shape=shape,
                                       seed=seed)


WORKLOADS: dict[str, WorkloadSpec] = {s.name: s for s in (
    WorkloadSpec("kv-heavy", "sessions of the most active quarter of the users (the longest histories), each "
                 "once: a small population that comes back within seconds of the run", _kv_heavy),
    WorkloadSpec("emb-heavy", f"steady arrivals over {EMB_USERS_PER_REQUEST} users per request: nearly every request "
                 "from a new user, histories sweeping the whole catalogue", _emb_heavy),
    WorkloadSpec("day", "one modelled day on the trace's hour-of-day curve: session starts follow the night trough "
                 "and the evening peak, sessions as fitted", _day),
    WorkloadSpec("trace-order", "the trace in its own time order from the "
                 f"{TRACE_ORDER_START:g} quantile of its request times on, gaps compressed to the rate", _trace_order),
)}


def get_spec(name: str) -> WorkloadSpec:
    """The spec of ``name``; an unknown name is a `ValueError` listing the valid ones."""
    spec = WORKLOADS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return spec


def modelled_workload(name: str, trace: Trace, *, rate_rps: float, duration_s: float, seed: int = 0,
                      shape: StreamShape | None = None) -> Modelled:
    """The workload's stream and its modelled seconds per run second (see `workload_stream`)."""
    spec = get_spec(name)
    check_run(rate_rps, duration_s)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    return spec.make(trace, rate_rps, duration_s, int(seed), shape or StreamShape())


def workload_stream(name: str, trace: Trace, *, rate_rps: float, duration_s: float, seed: int = 0,
                    shape: StreamShape | None = None) -> RequestStream:
    """The request stream of workload ``name`` (one of `WORKLOADS`) on ``trace`` at ``rate_rps``
    for ``duration_s``; ``shape`` (`workloads.sessions.StreamShape`) sets the candidates per
    request, the caps on new items and history, and a history scale (multiplied by the
    workload's own). Deterministic for its arguments."""
    return modelled_workload(name, trace, rate_rps=rate_rps, duration_s=duration_s, seed=seed, shape=shape).stream


# ----------------------------------------------------------------------------------- figures


def _zipf_slope(counts: np.ndarray) -> float | None:
    """The least-squares slope of log(count) on log(rank), negated (as
    `workloads.scale.fit_zipf_exponent` fits a trace's items), over a count vector."""
    c = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    c = c[c > 0]
    if len(c) < 2:
        return None
    return float(-np.polyfit(np.log(np.arange(1, len(c) + 1)), np.log(c), 1)[0])


def requested_items(stream: RequestStream) -> np.ndarray:
    """The items the stream brings to the fleet: every request's new items plus the history of
    each user's first request in the run (what no node can have seen from that user yet)."""
    _, new = stream.all_new_items()
    firsts = np.flatnonzero(stream.prev_request < 0)
    hist = [stream.history(int(i)) for i in firsts]
    return np.concatenate([new.astype(np.int64), *[h.astype(np.int64) for h in hist]]) if len(firsts) else new


def stream_figures(m: Modelled, windows: int = SWING_WINDOWS) -> dict:
    """The figures of one generated stream (see the module docstring)."""
    s = m.stream
    n = len(s)
    dur = s.config.duration_s
    counts = np.bincount(np.minimum((s.arrival_s / dur * windows).astype(np.int64), windows - 1), minlength=windows)
    items = requested_items(s)
    item_counts = np.bincount(items, minlength=s.trace.num_items)
    zipf = _zipf_slope(item_counts)
    recent_run_s = RECENT_WINDOW_S / m.modelled_s_per_s
    return {
        "num_requests": n,
        "rate_rps": round(n / dur, 2),
        "num_users": int(len(np.unique(s.user))),
        "modelled_s_per_s": round(m.modelled_s_per_s, 1),
        "modelled_span_h": round(m.modelled_s_per_s * dur / 3600.0, 2),
        "history_len_mean": round(float(s.history_len.mean()), 1) if n else None,
        "history_len_p90": round(float(np.percentile(s.history_len, 90)), 1) if n else None,
        "recent_share_10min": round(recent_share(s, recent_run_s), 4),
        "new_user_share": round(float(np.mean(s.prev_request < 0)), 4) if n else None,
        "user_return_p50_s": (round(float(np.median(s.arrival_s[s.prev_request >= 0]
                                                    - s.arrival_s[s.prev_request[s.prev_request >= 0]])), 4)
                              if np.any(s.prev_request >= 0) else None),
        "rate_swing": round(float(counts.max() / counts.min()), 2) if counts.min() > 0 else None,
        "rate_swing_3h": swing_3h(counts),
        "catalogue_size": int(s.trace.num_items),
        "num_distinct_items": int(np.count_nonzero(item_counts)),
        "item_zipf_exponent": round(zipf, 3) if zipf is not None else None,
        "item_top1pct_share": round(top_share(items, 0.01), 4),
    }


def describe(name: str, trace: Trace, *, rate_rps: float = DESCRIBE_RATE_RPS, duration_s: float = DESCRIBE_DURATION_S,
             seed: int = 0, shape: StreamShape | None = None) -> dict:
    """Workload ``name``'s figures on ``trace``, derived before any run: the trace's, and those of
    the stream it generates at ``rate_rps`` for ``duration_s`` (`stream_figures`). ``day`` adds the
    trace's own hour-of-day swing and recent-activity share (`trace_day_figures`) and the
    stream's recent-activity share per modelled hour (its range)."""
    spec = get_spec(name)
    m = modelled_workload(name, trace, rate_rps=rate_rps, duration_s=duration_s, seed=seed, shape=shape)
    out = {"workload": name, "description": spec.description, "trace": trace.name,
           "trace_item_zipf_exponent": round(_zipf_slope(trace.item_popularity()) or 0.0, 3),
           **stream_figures(m)}
    if name == "day":
        out["trace_day"] = trace_day_figures(trace)
        s = m.stream
        hour = np.minimum((s.arrival_s / s.config.duration_s * 24).astype(np.int64), 23)
        ok = s.prev_request >= 0
        gap = np.where(ok, s.arrival_s - s.arrival_s[np.maximum(s.prev_request, 0)], np.inf)
        recent = gap <= RECENT_WINDOW_S / m.modelled_s_per_s
        by_hour = [float(recent[hour == h].mean()) for h in range(24) if np.any(hour == h)]
        out["recent_share_10min_by_hour"] = [round(min(by_hour), 4), round(max(by_hour), 4)]
    if name in ("kv-heavy", "day"):
        out["session_threshold_s"] = fit_sessions(trace).threshold_s
    return out


def main(argv=None) -> dict:
    """``python -m workloads.fleet_workloads [--json] [--trace taobao] [--rate R] [--duration D]``:
    every workload's `describe` figures."""
    from .loaders import load_trace

    ap = argparse.ArgumentParser(prog="python -m workloads.fleet_workloads", description=main.__doc__.split(":")[0])
    ap.add_argument("--trace", default="taobao")
    ap.add_argument("--path", default=None)
    ap.add_argument("--rate", type=float, default=DESCRIBE_RATE_RPS)
    ap.add_argument("--duration", type=float, default=DESCRIBE_DURATION_S)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated names")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in names or [""]:
        try:
            get_spec(w)
        except ValueError as e:
            ap.error(f"--workloads: {e}")
    trace = load_trace(args.trace, args.path)
    out = {"trace": trace.name, "session_model": fit_sessions(trace).to_json(),
           "workloads": {w: describe(w, trace, rate_rps=args.rate, duration_s=args.duration, seed=args.seed)
                         for w in names}}
    if args.json:
        print(json.dumps(out))
    else:
        keys = ("num_requests", "num_users", "modelled_span_h", "history_len_mean", "history_len_p90",
                "recent_share_10min", "new_user_share", "rate_swing", "num_distinct_items", "item_zipf_exponent")
        print(f"{'workload':<12} " + " ".join(f"{k[:14]:>14}" for k in keys))
        for w, d in out["workloads"].items():
            print(f"{w:<12} " + " ".join(f"{str(d[k]):>14}" for k in keys))
    return out


__all__ = ["WORKLOADS", "WorkloadSpec", "day_start_curve", "describe", "get_spec", "hour_curve", "kv_heavy_users",
           "modelled_workload", "requested_items", "stream_figures", "swing_3h", "trace_day_figures", "workload_stream"]


if __name__ == "__main__":
    main()
