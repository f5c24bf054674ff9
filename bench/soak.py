"""Soak: the whole system (`racer up`: control plane, node agents, gateway, dashboard) under the
steady -> trend -> burst replay for N minutes, then one JSON object:

    python -m bench.soak --minutes 10 --json

- ``requests_served``, ``requests_failed`` (explicit, counted errors), ``requests_lost`` (sent with
  no outcome at all: must be 0), ``p99_ms``, ``slo_attainment`` (share of sent requests served within
  the SLO), ``failures`` by reason;
- per process (each node agent, the control plane, the gateway, the dashboard and the load
  generator itself): RSS after the warm-up and at the end, and its growth in percent
  (``rss_growth_pct``; each end is the median of three samples, so one sample's noise does not
  count); ``rss_growth_max_pct`` is the largest; a process that was restarted reports its restarts;
- ``restarts``: processes racer up had to restart (0 on a healthy run).

The soak runs `racer up` as a child process (bench may not import racer) on a fresh data folder
(``--data-dir``, default a temporary folder) with free ports. Figures on a shared machine move
with the other jobs on it: read them with the load average this prints.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import print_figures

ROOT = Path(__file__).resolve().parent.parent


def rss_growth(samples: list, warmup_s: float) -> dict | None:
    """RSS at the end against RSS just after ``warmup_s`` (medians of three samples each)."""
    after = [r for t, r in samples if t >= warmup_s]
    if len(after) < 4:
        return None
    start = statistics.median(after[:3])
    end = statistics.median(after[-3:])
    return {"rss_after_warmup_bytes": int(start), "rss_end_bytes": int(end),
            "rss_growth_pct": round(100.0 * (end - start) / start, 2)}


def run(minutes: float, nodes: int = 4, rate: float = 8.0, warmup_s: float | None = None,
        data_dir: str | None = None, rss_every_s: float = 10.0, extra: list[str] | None = None) -> dict:
    duration = minutes * 60.0
    warmup = warmup_s if warmup_s is not None else min(120.0, max(30.0, 0.2 * duration))
    tmp = Path(data_dir or tempfile.mkdtemp(prefix="racer-soak-"))
    cmd = [sys.executable, "-m", "racer", "up", "--nodes", str(nodes), "--data-dir", str(tmp), "--duration",
           str(duration), "--rate", str(rate), "--dashboard-port", "0", "--rss-every-s", str(rss_every_s),
           "--json", *(extra or [])]
    t0 = time.monotonic()
    load_before = os.getloadavg()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    if p.returncode != 0:
        raise SystemExit(f"racer up failed ({p.returncode}):\n{p.stderr[-3000:]}")
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    procs = {}
    for name, series in rep["rss"].items():
        g = rss_growth(series["samples"], warmup)
        restarts = rep["processes"].get(name, {}).get("restarts", 0)
        procs[name] = {**(g or {"rss_growth_pct": None}), "restarts": restarts}
    growth = [v["rss_growth_pct"] for v in procs.values() if v["rss_growth_pct"] is not None]
    return {
        "minutes": minutes, "nodes": nodes, "rate_rps": rate, "warmup_s": warmup,
        "requests_sent": rep["requests_sent"], "requests_served": rep["requests_served"],
        "requests_failed": rep["requests_failed"], "requests_lost": rep["requests_lost"],
        "requests_retried": rep["requests_retried"], "failures": rep["failures"],
        "p99_ms": rep["p99_ms"], "p50_ms": rep["latency_ms"]["p50"], "slo_ms": rep["slo_ms"],
        "slo_attainment": rep["slo_attainment"], "regimes": rep["regimes"],
        "rss_growth_max_pct": max(growth) if growth else None, "processes": procs,
        "restarts": sum(v["restarts"] for v in rep["processes"].values()),
        "missing": rep["missing"], "wall_s": round(time.monotonic() - t0, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "data_dir": str(tmp),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="minutes of load (default 10)")
    ap.add_argument("--nodes", type=int, default=4, help="node agents (default 4)")
    ap.add_argument("--rate", type=float, default=8.0, help="base replay rate, req/s (default 8)")
    ap.add_argument("--warmup-s", type=float, default=None,
                    help="RSS growth is measured from here (default: 20%% of the run, 30-120 s)")
    ap.add_argument("--data-dir", default=None, help="data folder (default: a fresh temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary data folder (logs, database)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if not args.minutes > 0:
        ap.error("--minutes must be positive")
    out = run(args.minutes, nodes=args.nodes, rate=args.rate, warmup_s=args.warmup_s, data_dir=args.data_dir)
    if args.data_dir is None and not args.keep:
        import shutil

        shutil.rmtree(out["data_dir"], ignore_errors=True)
        out["data_dir"] = None
    print_figures(out, as_json=args.json, width=22)
    return 0


if __name__ == "__main__":
    sys.exit(main())
