"""Start-up: how soon ``racer up`` shows its dashboard and moves data, and how fast ``racer --help``
answers, then one JSON object:

    python -m bench.up --json

- ``help_s``: wall time of ``racer --help`` (a fresh interpreter; the median of ``--repeats``);
  ``subcommand_help_s``: the same for ``racer up --help`` and ``racer workload --help``;
- ``fresh`` (a new data folder: the cost profile is measured, the schema and the tokens made) and
  ``reused`` (the same folder again): ``url_s`` (from starting ``racer up`` to the line with the
  dashboard's URL), ``first_data_s`` (to the line saying the first requests were served), both
  read on racer up's own output as an operator would see them, and ``startup`` (racer up's own
  account of each step, from its JSON report: control plane healthy, URL, load started, first
  request served) and ``policies`` (the shipped policy and the candidate it registered).

Each run is ``racer up --duration 5`` on free ports, started as a child process (bench may not
import racer). Figures on a shared machine move with the other jobs on it: read them with the
load averages this prints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import print_figures

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "PYTHONUNBUFFERED": "1"}


def _racer() -> list[str]:
    """The installed ``racer`` script beside this interpreter, else ``python -m racer``."""
    exe = Path(sys.executable).with_name("racer")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "racer"]


def help_seconds(args: list[str], repeats: int) -> float:
    """Median wall time of ``racer ARGS`` (it must exit 0)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        p = subprocess.run(_racer() + args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        times.append(time.perf_counter() - t0)
        if p.returncode != 0:
            raise SystemExit(f"racer {' '.join(args)} failed ({p.returncode}): {p.stderr[-1000:]}")
    return round(statistics.median(times), 3)


def kill_left_behind(p: subprocess.Popen, data_dir: Path) -> list[int]:
    """``racer up`` did not stop after SIGTERM: SIGKILL it, then SIGKILL the process group of each
    process it recorded in ``DATA/processes.json`` (each runs in its own session, so killing racer
    up alone would leave them running). Returns the groups signalled."""
    with contextlib.suppress(ProcessLookupError):
        p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(10)
    try:
        procs = json.loads((data_dir / "processes.json").read_text()).get("processes") or {}
    except (OSError, ValueError, AttributeError):
        procs = {}
    killed = []
    for info in procs.values():
        pid = info.get("pid") if isinstance(info, dict) else None
        if not isinstance(pid, int) or pid <= 1:
            continue
        try:
            os.killpg(pid, signal.SIGKILL)  # racer up starts each with start_new_session: pgid == pid
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def up_once(data_dir: Path, nodes: int, duration_s: float, timeout_s: float) -> dict:
    """One ``racer up --duration``: when its URL line and its first-data line appeared."""
    cmd = _racer() + ["up", "--nodes", str(nodes), "--data-dir", str(data_dir), "--duration", str(duration_s),
                      "--dashboard-port", "0", "--status-every-s", "60", "--json"]
    seen: dict[str, float] = {}
    lines: list[str] = []
    load_before = os.getloadavg()
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def read_stderr() -> None:
        for line in p.stderr:
            at = time.monotonic() - t0
            lines.append(line.rstrip())
            if line.startswith("racer up: dashboard ") and "url_s" not in seen:
                seen["url_s"] = round(at, 1)
            elif line.startswith("racer up: first requests served") and "first_data_s" not in seen:
                seen["first_data_s"] = round(at, 1)

    chunks: list[str] = []
    readers = [threading.Thread(target=read_stderr, daemon=True),
               threading.Thread(target=lambda: chunks.append(p.stdout.read()), daemon=True)]
    for r in readers:
        r.start()
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        p.terminate()  # racer up stops everything on SIGTERM and still prints its report
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            kill_left_behind(p, data_dir)
    for r in readers:
        r.join(10)
    out = "".join(chunks)
    wall_s = round(time.monotonic() - t0, 1)
    try:
        rep = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SystemExit(f"racer up gave no report ({p.returncode}):\n" + "\n".join(lines[-30:])) from None
    return {"url_s": seen.get("url_s"), "first_data_s": seen.get("first_data_s"), "startup": rep.get("startup"),
            "policies": rep.get("policies"), "requests_served": rep["requests_served"],
            "requests_failed": rep["requests_failed"], "restarts": sum(
                v["restarts"] for v in rep["processes"].values()), "returncode": p.returncode, "wall_s": wall_s,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()]}


def run(nodes: int = 4, duration_s: float = 5.0, repeats: int = 3, data_dir: str | None = None,
        timeout_s: float = 300.0) -> dict:
    out: dict = {"load_average_before": [round(x, 2) for x in os.getloadavg()], "nproc": os.cpu_count()}
    out["help_s"] = help_seconds(["--help"], repeats)
    out["subcommand_help_s"] = {name: help_seconds([name, "--help"], repeats) for name in ("up", "workload")}
    folder = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="racer-up-bench-")) / "racer-data"
    if folder.exists() and any(folder.iterdir()):
        raise SystemExit(f"--data-dir {folder} is not empty: the fresh run needs a new folder")
    out["fresh"] = up_once(folder, nodes, duration_s, timeout_s)
    out["reused"] = up_once(folder, nodes, duration_s, timeout_s)
    out.update(nodes=nodes, duration_s=duration_s, data_dir=str(folder),
               load_average_after=[round(x, 2) for x in os.getloadavg()])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.up", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4, help="node agents (default 4, racer up's default)")
    ap.add_argument("--duration-s", type=float, default=5.0, help="seconds of load per run (default 5)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each --help, median kept (default 3)")
    ap.add_argument("--data-dir", default=None, help="data folder, new or empty (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary data folder (logs, database)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.nodes < 1 or not args.duration_s > 0 or args.repeats < 1:
        ap.error("--nodes, --duration-s and --repeats must be positive")
    out = run(args.nodes, args.duration_s, args.repeats, args.data_dir)
    if args.data_dir is None and not args.keep:
        shutil.rmtree(Path(out["data_dir"]).parent, ignore_errors=True)
        out["data_dir"] = None
    print_figures(out, as_json=args.json, width=18)
    return 0


if __name__ == "__main__":
    sys.exit(main())
