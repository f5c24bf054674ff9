"""The burst detector against the load's own phase labels, on ``racer up``'s default loop:

    python -m bench.bursts --json [--duration 600] [--seed 0] [--data-dir DIR]

Runs ``racer up --duration`` (4 agents, the default steady -> trend -> burst loop, 15 s a phase,
8 req/s) in a fresh data folder, then reads from its database what an operator's dashboard
shows: the bursts the nodes reported (the ``bursts`` table: node, start, end) and the load phases
the clients named (the gateway's client reports: requests per phase name per interval, the
``x-racer-load-phase`` header `racer up`'s replay sends). With ``--data-dir`` of a finished run it
reads that folder instead of running.

Labels: each gateway interval takes the regime most of its requests named; consecutive intervals
labelled ``burst`` are one burst phase. A detection is *true* when it starts inside a burst
phase, or at most ``--lag-s`` (default 3: one control interval to close, one report) after its
end; ``precision`` = true detections / detections (every node's detection counts); ``recall`` =
burst phases with at least one true detection / burst phases; ``time_precision`` = the share of
the time the charts shade as a burst (each detection from its start to its end) that lies in a
burst phase (+ the lag). Prints one JSON object
(``{"precision": .., "recall": .., "detections": .., "burst_phases": .., "rule": ..}``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "PYTHONUNBUFFERED": "1"}


def run_up(data_dir: Path, duration_s: float, seed: int, nodes: int) -> dict:
    """``racer up --duration`` to its end; its JSON report."""
    cmd = [sys.executable, "-m", "racer", "up", "--nodes", str(nodes), "--data-dir", str(data_dir), "--duration",
           str(duration_s), "--dashboard-port", "0", "--status-every-s", "60", "--json", "--seed", str(seed)]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=duration_s + 900)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SystemExit(f"racer up gave no report (exit {p.returncode}):\n{p.stderr[-3000:]}") from None


def read_run(db_path: Path) -> tuple[list[tuple[float, float, str]], list[dict]]:
    """(gateway intervals as (start_s, end_s, regime), bursts as dicts) from a run's database."""
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{db_path}")
    try:
        with engine.connect() as c:
            reports = c.execute(text("SELECT ts_s, interval_s, load_phase, details FROM gateway_reports "
                                     "ORDER BY ts_s")).all()
            bursts = [dict(r._mapping) for r in c.execute(text(
                "SELECT node_id, start_s, end_s, magnitude FROM bursts ORDER BY start_s")).all()]
    finally:
        engine.dispose()
    intervals = []
    for ts, interval, last, details in reports:
        d = json.loads(details) if isinstance(details, str) else (details or {})
        phases = d.get("phases") or ({last: 1} if last else {})
        if not phases:
            continue
        by_regime: dict[str, int] = {}
        for name, n in phases.items():
            regime = str(name).split("[", 1)[0]
            by_regime[regime] = by_regime.get(regime, 0) + int(n)
        intervals.append((float(ts) - float(interval), float(ts), max(by_regime, key=by_regime.get)))
    return intervals, bursts


def burst_phases(intervals: list[tuple[float, float, str]]) -> list[tuple[float, float]]:
    """Consecutive intervals labelled ``burst``, merged: [(start_s, end_s)]."""
    out: list[list[float]] = []
    prev = None
    for a, b, regime in intervals:
        if regime == "burst":
            if prev == "burst" and out:
                out[-1][1] = b
            else:
                out.append([a, b])
        prev = regime
    return [(a, b) for a, b in out]


def score(intervals, bursts: list[dict], lag_s: float) -> dict:
    phases = burst_phases(intervals)
    first, last = (intervals[0][0], intervals[-1][1]) if intervals else (0.0, 0.0)
    seen = [b for b in bursts if first <= b["start_s"] <= last + lag_s]  # during the labelled load
    true = [b for b in seen if any(a <= b["start_s"] <= e + lag_s for a, e in phases)]
    found = [p for p in phases if any(p[0] <= b["start_s"] <= p[1] + lag_s for b in seen)]
    by_label: dict[str, int] = {}
    for b in seen:
        label = next((r for a, e, r in intervals if a <= b["start_s"] <= e), "after the load")
        if b not in true:
            by_label[label] = by_label.get(label, 0) + 1
    # the time the charts shade: each detection from its start to its end (the load's end while open)
    shaded = inside = 0.0
    for b in seen:
        a, e = b["start_s"], min(b["end_s"] if b["end_s"] is not None else last, last)
        shaded += max(0.0, e - a)
        inside += sum(max(0.0, min(e, pe + lag_s) - max(a, pa)) for pa, pe in phases)
    return {"precision": round(len(true) / len(seen), 3) if seen else None,
            "time_precision": round(inside / shaded, 3) if shaded else None,
            "median_burst_s": round(sorted(max(0.0, (b["end_s"] or last) - b["start_s"]) for b in seen)[len(seen) // 2],
                                    1) if seen else None,
            "recall": round(len(found) / len(phases), 3) if phases else None,
            "detections": len(seen), "true_detections": len(true), "burst_phases": len(phases),
            "burst_phases_detected": len(found), "false_detections_by_phase": by_label,
            "labelled_s": round(last - first, 1), "lag_s": lag_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bursts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="racer up --duration, s (default 600)")
    ap.add_argument("--seed", type=int, default=0, help="the replay's seed (default 0)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--lag-s", type=float, default=3.0, help="how late a true detection may start (default 3)")
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="a finished racer up's data folder: read it instead of running")
    ap.add_argument("--keep", type=Path, default=None, help="run racer up in this (new) folder and keep it")
    ap.add_argument("--json", action="store_true", help="one JSON object (the default prints it indented)")
    args = ap.parse_args(argv)
    from node_agent.allocator.config import RecoveryConfig

    t0 = time.monotonic()
    report = None
    if args.data_dir is None and args.keep is not None:
        report = run_up(args.keep, args.duration, args.seed, args.nodes)
        intervals, bursts = read_run(args.keep / "racer.db")
    elif args.data_dir is None:
        with tempfile.TemporaryDirectory(prefix="racer-bursts-") as d:
            report = run_up(Path(d) / "data", args.duration, args.seed, args.nodes)
            intervals, bursts = read_run(Path(d) / "data" / "racer.db")
    else:
        intervals, bursts = read_run(args.data_dir / "racer.db")
    c = RecoveryConfig()
    out = {**score(intervals, bursts, args.lag_s),
           "rule": (f"enter when the interval's arrival rate >= {c.enter_rate_ratio:g}x and its hot-user share >= "
                    f"{c.enter_hot_ratio:g}x their baselines (EWMAs, tau {c.baseline_tau_s:g} s, updated outside "
                    f"bursts); exit when either is at or below {c.exit_rate_ratio:g}x / {c.exit_hot_ratio:g}x for "
                    f"{c.exit_confirm_s:g} s, at least {c.min_hold_s:g} s after entry, or after {c.max_burst_s:g} s"),
           "duration_s": args.duration if report is not None else None, "seed": args.seed,
           "requests_served": (report or {}).get("requests_served"), "wall_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
