"""Static splits against the allocator on ``racer up``'s default loop: is the floor it settles on
right for that traffic?

    python -m bench.static_sweep --json [--shares 0.05,0.25,0.5,0.75] [--duration 240] [--allocator-dir DIR]

For each share, ``racer up --duration`` (4 agents, the default steady -> trend -> burst loop) in a
fresh data folder, with a cluster override holding every node at that share from the moment the
control plane answers (`POST /api/v1/overrides`, the operator's own control: the allocator's
proposals are overridden, the guards still apply). Figures come from the run's database, after
``--skip-s`` (default 60: the override applied, the caches warm): the clients' SLO attainment
(request-weighted over the gateway's intervals, what the dashboard's headline shows), the
intervals' median P99, and the nodes' mean emb_share. ``--allocator-dir`` adds a finished run of
``racer up`` without an override (for example ``bench.bursts --keep DIR``) as the allocator's row.
Prints one JSON object: ``{"rows": [{"config", "slo_attainment", "p99_ms", "emb_share", ...}],
"best_static": .., ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "PYTHONUNBUFFERED": "1"}


def _hold(data_dir: Path, share: float, ttl_s: float, stop: threading.Event, said: dict) -> None:
    """Once racer up's control plane answers, set a cluster override at ``share``."""
    import httpx

    while not stop.is_set():
        try:
            url = json.loads((data_dir / "processes.json").read_text())["processes"]["control-plane"]["url"]
            token = (data_dir / "operator_token").read_text().strip()
            r = httpx.post(f"{url}/api/v1/overrides", headers={"Authorization": f"Bearer {token}"}, timeout=5,
                           json={"node_id": None, "emb_share": share, "ttl_s": ttl_s,
                                 "reason": f"static sweep at {share}"})
            if r.status_code < 300:
                said["override_at_s"] = time.time()
                return
            said["error"] = r.text[:300]
        except (OSError, ValueError, KeyError, TypeError, httpx.HTTPError):
            pass
        stop.wait(1.0)


def run_up(data_dir: Path, duration_s: float, share: float | None, seed: int) -> dict:
    cmd = [sys.executable, "-m", "racer", "up", "--nodes", "4", "--data-dir", str(data_dir), "--duration",
           str(duration_s), "--dashboard-port", "0", "--status-every-s", "60", "--json", "--seed", str(seed)]
    stop, said = threading.Event(), {}
    th = None
    if share is not None:
        th = threading.Thread(target=_hold, args=(data_dir, share, duration_s + 600, stop, said), daemon=True)
        th.start()
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=duration_s + 900)
    stop.set()
    if th is not None:
        th.join(5)
    if share is not None and "override_at_s" not in said:
        raise SystemExit(f"the override at {share} was never set: {said.get('error')}\n{p.stderr[-2000:]}")
    return said


def figures(db_path: Path, skip_s: float) -> dict:
    """The clients' SLO attainment (request-weighted), median P99 and the nodes' mean emb_share,
    after the first ``skip_s`` seconds of gateway reports."""
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{db_path}")
    try:
        with engine.connect() as c:
            gw = c.execute(text("SELECT ts_s, num_requests, slo_attainment, p99_ms FROM gateway_reports "
                                "WHERE num_requests > 0 ORDER BY ts_s")).all()
            t0 = gw[0][0] + skip_s if gw else 0.0
            shares = [r[0] for r in c.execute(text("SELECT emb_share FROM node_reports WHERE ts_s >= :t"),
                                               {"t": t0}).all()]
    finally:
        engine.dispose()
    rows = [r for r in gw if r[0] >= t0 and r[2] is not None]
    n = sum(r[1] for r in rows)
    return {"slo_attainment": round(sum(r[1] * r[2] for r in rows) / n, 4) if n else None,
            "p99_ms": round(statistics.median(r[3] for r in rows if r[3] is not None), 1) if rows else None,
            "emb_share": round(statistics.fmean(shares), 3) if shares else None,
            "emb_share_p10_p90": [round(statistics.quantiles(shares, n=10)[0], 3),
                                  round(statistics.quantiles(shares, n=10)[-1], 3)] if len(shares) > 10 else None,
            "requests": n, "intervals": len(rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.static_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shares", default="0.05,0.25,0.5,0.75", help="static splits (comma-separated)")
    ap.add_argument("--duration", type=float, default=240.0, help="racer up --duration of each run, s (default 240)")
    ap.add_argument("--skip-s", type=float, default=60.0, help="gateway reports left out at each run's start (60)")
    ap.add_argument("--seed", type=int, default=0, help="the replay's seed (default 0)")
    ap.add_argument("--allocator-dir", type=Path, default=None,
                    help="a finished racer up's data folder without an override: the allocator's row")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    rows = []
    for share in [float(x) for x in args.shares.split(",") if x.strip()]:
        with tempfile.TemporaryDirectory(prefix="racer-sweep-") as d:
            run_up(Path(d) / "data", args.duration, share, args.seed)
            rows.append({"config": f"static {share:g}", **figures(Path(d) / "data" / "racer.db", args.skip_s)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    static = [r for r in rows if r["slo_attainment"] is not None]
    best = max(static, key=lambda r: (r["slo_attainment"], -(r["p99_ms"] or 0))) if static else None
    if args.allocator_dir is not None:
        rows.append({"config": "allocator (racer)", **figures(args.allocator_dir / "racer.db", args.skip_s)})
    out = {"rows": rows, "best_static": best["config"] if best else None, "seed": args.seed,
           "duration_s": args.duration, "skip_s": args.skip_s, "wall_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
