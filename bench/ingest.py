"""Ingestion benchmark: a real control-plane process, N simulated nodes, real HTTP.

    python -m bench.ingest --json --db sqlite          [--nodes 1000] [--duration-s 20]
    python -m bench.ingest --json --db postgresql      [--pg-url postgresql://postgres@127.0.0.1/]

Starts ``python -m control_plane.main`` on a fresh database (a temporary SQLite file, or a fresh
PostgreSQL database ``racer_bench_ingest`` on the server of ``--pg-url``), creates one node token per simulated node (bound to its id),
registers ``--nodes`` nodes, then each simulated node sends one report per second (a batch of
one; phases spread over the second) as an HTTP/1.1 request on its own keep-alive connection (an
asyncio client writing raw requests, so the client costs little CPU next to the server). After
``--warmup-s`` it measures for ``--duration-s``: ``reports_per_s`` is the reports *stored*
(acknowledged by the server) per second of the measured span, ``ingest_p99_ms`` the P99 of the
client-side request latency (send to full response), over the measured requests. Errors (non-200
replies, broken connections) are counted. Prints one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from common.http_server import tune_runtime

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_control_plane(db_url: str, port: int, admin: str, extra_env: dict | None = None,
                        log_path: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, RACER_ADMIN_TOKEN=admin, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra_env or {})
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    cmd = os.environ.get("RACER_BENCH_SERVER_CMD")  # profiling hook: a script taking (db_url, port)
    argv = ([sys.executable, cmd, db_url, str(port)] if cmd else
            [sys.executable, "-m", "control_plane.main", "--db", db_url, "--port", str(port)])
    proc = subprocess.Popen(argv,
                            cwd=str(ROOT), env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"control plane exited with {proc.returncode} (log: {log_path})")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("control plane did not start within 60 s")


def fresh_pg_database(pg_url: str, name: str) -> str:
    import psycopg

    base = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(base.rstrip("/") + "/postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        c.execute(f'CREATE DATABASE "{name}"')
    return base.rstrip("/") + "/" + name


def report(seq: int, now: float) -> dict:
    return {"seq": seq, "ts_s": now, "interval_s": 1.0, "emb_share": 0.5, "emb_share_target": 0.52,
            "kv_hit_rate": 0.71, "emb_hit_rate": 0.93, "p50_ms": 4.1, "p99_ms": 11.7, "slo_attainment": 0.998,
            "throughput_rps": 950.0, "num_requests": 950, "queue_depth": 3.0, "refill_bytes": 65536,
            "kv_recompute_us_per_token": 2.5, "emb_transfer_us_per_row": 0.8, "policy_version": "bench",
            "decision": {"source": "base", "emb_share": 0.52, "reason": "bench", "prev_emb_share": 0.5}}


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for ln in lines[1:]:
        if ln[:15].lower() == b"content-length:":
            length = int(ln[15:].strip())
    body = await reader.readexactly(length) if length else b""
    return status, body


async def node_loop(node_id: str, port: int, token: str, t_start: float, t_end: float, phase: float,
                    results: list, errors: list) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    seq = 0
    next_t = t_start + phase
    path = f"/api/v1/nodes/{node_id}/reports"
    try:
        while True:
            now = time.time()
            if next_t >= t_end:
                break
            if next_t > now:
                await asyncio.sleep(next_t - now)
            body = json.dumps({"reports": [report(seq, time.time())]}).encode()
            req = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
            t0 = time.perf_counter()
            sent_at = time.time()
            try:
                writer.write(req)
                status, data = await _read_response(reader)
            except (OSError, asyncio.IncompleteReadError) as e:
                errors.append(f"{node_id}: {type(e).__name__}")
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                status, data = 0, b""
            dt = time.perf_counter() - t0
            stored = 0
            if status == 200:
                stored = json.loads(data)["stored"]
            elif status:
                errors.append(f"{node_id}: HTTP {status} {data[:200]!r}")
            results.append((sent_at, dt, stored))
            seq += 1
            next_t += 1.0
    finally:
        writer.close()


async def drive(port: int, tokens: dict[str, str], node_ids: list[str], warmup_s: float, duration_s: float,
                seed: int):
    """Every node reports with its own token (a node token is bound to one node id)."""
    rng = random.Random(seed)
    t_start = time.time() + 1.0
    t_end = t_start + warmup_s + duration_s
    results: list = []
    errors: list = []
    await asyncio.gather(*(node_loop(n, port, tokens[n], t_start, t_end, rng.random(), results, errors)
                           for n in node_ids))
    return t_start, results, errors


def run(db: str, nodes: int, duration_s: float, warmup_s: float, pg_url: str, seed: int = 0,
        keep_log: str | None = None) -> dict:
    admin = "bench-admin-token"
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="racer-ingest-")
    if db == "sqlite":
        url = f"sqlite:///{tmp}/cp.db"
    else:
        url = fresh_pg_database(pg_url, "racer_bench_ingest")
    log = keep_log or os.path.join(tmp, "control_plane.log")
    proc = start_control_plane(url, port, admin, log_path=log,
                               extra_env={"RACER_LIVENESS_MISSED_INTERVALS": "30"})
    try:
        base = f"http://127.0.0.1:{port}/api/v1"
        with httpx.Client(timeout=30) as c:
            ids = [f"bench-{i:05d}" for i in range(nodes)]
            tokens = {}
            for nid in ids:
                r = c.post(f"{base}/tokens", json={"role": "node", "name": f"bench {nid}", "node_id": nid},
                           headers={"Authorization": f"Bearer {admin}"})
                r.raise_for_status()
                tokens[nid] = r.json()["token"]
                r = c.post(f"{base}/nodes/register", headers={"Authorization": f"Bearer {tokens[nid]}"}, json={
                    "node_id": nid, "address": "http://127.0.0.1:1", "device": "cpu",
                    "cost_profile": {"kv_recompute_us_per_token": 2.5, "emb_transfer_us_per_row": 0.8,
                                     "service_time_us": 1000.0, "queue_capacity": 64}})
                r.raise_for_status()
        cpu0, me0 = _cpu_s(proc.pid), _cpu_s(os.getpid())
        w0 = time.time()
        tune_runtime()  # the client's own collections would otherwise show up as server latency
        t_start, results, errors = asyncio.run(drive(port, tokens, ids, warmup_s, duration_s, seed))
        cpu1, me1, w1 = _cpu_s(proc.pid), _cpu_s(os.getpid()), time.time()
        m0, m1 = t_start + warmup_s, t_start + warmup_s + duration_s
        meas = [(t, dt, st) for t, dt, st in results if m0 <= t < m1]
        lat_ms = np.array([dt * 1e3 for _, dt, _ in meas]) if meas else np.array([np.nan])
        stored = sum(st for _, _, st in meas)
        with httpx.Client(timeout=30) as c:
            metrics = c.get(f"http://127.0.0.1:{port}/metrics").text
        rows = _hist_mean(metrics, "racer_cp_ingest_commit_rows")
        commit_s = _hist_mean(metrics, "racer_cp_ingest_commit_duration_seconds")
        handler_s = _hist_mean(metrics, "racer_cp_ingest_request_duration_seconds")
        return {
            "db": db, "nodes": nodes, "duration_s": duration_s, "warmup_s": warmup_s,
            "reports_per_s": round(stored / duration_s, 1),
            "requests": len(meas),
            "ingest_p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
            "ingest_p99_ms": round(float(np.percentile(lat_ms, 99)), 2),
            "ingest_max_ms": round(float(np.max(lat_ms)), 2),
            "errors": len(errors), "error_examples": errors[:3],
            "server_cpu_ms_per_request": round((cpu1 - cpu0) * 1e3 / max(len(results), 1), 3),
            "server_cpu_share_of_one_core": round((cpu1 - cpu0) / (w1 - w0), 3),
            "client_cpu_ms_per_request": round((me1 - me0) * 1e3 / max(len(results), 1), 3),
            "load_average_1m": round(os.getloadavg()[0], 2), "num_cpus": os.cpu_count(),
            "mean_rows_per_commit": None if rows is None else round(rows, 2),
            "mean_commit_ms": None if commit_s is None else round(commit_s * 1e3, 3),
            "commit_p99_bound_ms": _ms(_hist_quantile_bound(metrics, "racer_cp_ingest_commit_duration_seconds", 0.99)),
            "handler_p99_bound_ms": _ms(_hist_quantile_bound(metrics, "racer_cp_ingest_request_duration_seconds",
                                                             0.99)),
            "mean_server_handler_ms": None if handler_s is None else round(handler_s * 1e3, 3),
            "target": {"reports_per_s": ">= 1000", "ingest_p99_ms": "<= 50"},
        }
    finally:
        proc.send_signal(2)  # SIGINT: uvicorn shuts down gracefully
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _hist_quantile_bound(text: str, name: str, q: float) -> float | None:
    """The smallest histogram bucket bound holding a fraction ``q`` of the observations."""
    buckets = []
    for ln in text.splitlines():
        if ln.startswith(name + "_bucket{"):
            le = ln.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(ln.split()[-1])))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    return next(le for le, c in buckets if c >= q * total)


def _hist_mean(text: str, name: str) -> float | None:
    s = c = None
    for ln in text.splitlines():
        if ln.startswith(name + "_sum "):
            s = float(ln.split()[1])
        elif ln.startswith(name + "_count "):
            c = float(ln.split()[1])
    return s / c if s is not None and c else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ingest", description=__doc__.split("\n\n")[0])
    p.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--pg-url", default=os.environ.get("RACER_BENCH_PG_URL", "postgresql://postgres@127.0.0.1/"),
                   help="PostgreSQL server (a database racer_bench_ingest is created there)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.nodes < 1 or a.duration_s <= 0 or a.warmup_s < 0:
        print("error: --nodes >= 1, --duration-s > 0, --warmup-s >= 0", file=sys.stderr)
        return 2
    out = run(a.db, a.nodes, a.duration_s, a.warmup_s, a.pg_url)
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
