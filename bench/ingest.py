"""Ingestion benchmark: real control-plane processes, N simulated nodes, real HTTP.

    python -m bench.ingest --json --db sqlite          [--nodes 1000] [--duration-s 20] [--runs 5]
    python -m bench.ingest --json --db postgresql      [--pg-url postgresql://postgres@127.0.0.1/]
    python -m bench.ingest --json --db postgresql --replicas 2 --nodes 3000
    python -m bench.ingest --json --db sqlite --runs 5 --baseline-rev REV   # REV's server beside this one
    python -m bench.ingest --json --db sqlite --http-floor --reports-per-request 5

Starts ``--replicas`` control-plane processes (``python -m control_plane.main``; more than one
only on PostgreSQL, each with the scheduler on, so the replicas elect its one leader) on a fresh
database (a temporary SQLite file, or a fresh PostgreSQL database ``racer_bench_ingest`` on the
server of ``--pg-url``), creates one node token per simulated node (bound to its id), registers
``--nodes`` nodes, node i with replica i mod ``--replicas`` (as a load balancer spreading
connections would), then each simulated node sends one report per second (a batch of one; phases
spread over the second) as an HTTP/1.1 request on its own keep-alive connection (an asyncio client
writing raw requests, so the client costs little CPU next to the server). After ``--warmup-s`` it
measures for ``--duration-s``: ``reports_per_s`` is the reports *stored* (acknowledged by the
server) per second of the measured span, ``ingest_p99_ms`` the P99 of the client-side request
latency (send to full response), over the measured requests. Errors (non-200 replies, broken
connections) are counted. Then the stored rows are read back from the database: ``rows_lost``
counts reports acknowledged as stored that are not there, ``rows_doubled`` rows stored more than
once, ``rows_unacknowledged`` rows stored whose request got no acknowledgement (a broken
connection). CPU is read from /proc over the measured drive: the servers' per request (and their
main threads' share: the event loop, where HTTP, the gate and validation run; the rest is the
ingest writer's and the jobs'), the client's, and a local PostgreSQL server's (all its processes)
as shares of one core. Where the tail lies: ``slow_requests_by_second`` (second of the measured
span -> requests slower than the P99) beside ``jobs_in_window`` (each scheduled job run then).

``--jobs-process`` runs the replicas with no scheduler (``RACER_SCHEDULER=false``) beside one
``python -m control_plane.main --jobs-only`` process at niceness ``--jobs-nice``, elected as any
replica and taking no node traffic: the jobs' Python no longer shares an interpreter (its GIL)
with ingestion. Its CPU counts in the server's.

``--reports-per-request N`` has each node send its reports N at a time, every N seconds (a
node told the control plane's ``send_period_s`` of N s does that; the servers get it too, for
their liveness check): ``server_cpu_ms_per_report`` then differs from ``..._per_request``.

``--runs K`` repeats the whole measurement K times in a row (a fresh database each) and adds a
summary (each run's P99, the worst, CPU per report). ``--baseline-rev REV`` runs the server of
git revision REV (its tree from ``git archive``, the same client) before each run of this tree's
server, so the two stand side by side in one output. ``--http-floor`` does the same with
`bench.ingest_floor`, the control plane's HTTP server with nothing behind it: the CPU per request
no report handling can go below on this server. Prints one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.gateway import free_port
from common.http_server import tune_runtime

ROOT = Path(__file__).resolve().parent.parent
FLOOR_SERVER = Path(__file__).resolve().parent / "ingest_floor.py"


def start_control_plane(db_url: str, port: int, admin: str, extra_env: dict | None = None,
                        log_path: str | None = None, root: Path = ROOT,
                        server_cmd: str | None = None, args: tuple = (), nice: int = 0) -> subprocess.Popen:
    """A control-plane process of the tree at ``root`` (this one, or a baseline revision's), or the
    script ``server_cmd`` taking (db_url, port) in its place; ``args`` added to its command line,
    run at niceness ``nice``."""
    env = dict(os.environ, RACER_ADMIN_TOKEN=admin,
               PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra_env or {})
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    cmd = server_cmd or os.environ.get("RACER_BENCH_SERVER_CMD")  # profiling hook: a script taking (db_url, port)
    argv = ([sys.executable, cmd, db_url, str(port)] if cmd else
            [sys.executable, "-m", "control_plane.main", "--db", db_url, "--port", str(port), *args])
    if nice:
        argv = ["nice", "-n", str(nice), *argv]
    proc = subprocess.Popen(argv,
                            cwd=str(root), env=env, stdout=out, stderr=subprocess.STDOUT)
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
                    results: list, errors: list, per_request: int = 1) -> None:
    """One node: a report a second, sent ``per_request`` at a time (every ``per_request`` seconds,
    as a node told a send period of that many seconds sends them)."""
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
            t_now = time.time()
            body = json.dumps({"reports": [report(seq + k, t_now - (per_request - 1 - k))
                                           for k in range(per_request)]}).encode()
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
            results.append((sent_at, dt, stored, node_id, seq, per_request))
            seq += per_request
            next_t += per_request
    finally:
        writer.close()


async def drive(ports: dict[str, int], tokens: dict[str, str], node_ids: list[str], warmup_s: float,
                duration_s: float, seed: int, per_request: int = 1):
    """Every node reports with its own token (a node token is bound to one node id) to its
    replica's port (``ports``: node id -> port)."""
    rng = random.Random(seed)
    t_start = time.time() + 1.0
    t_end = t_start + warmup_s + duration_s
    results: list = []
    errors: list = []
    await asyncio.gather(*(node_loop(n, ports[n], tokens[n], t_start, t_end, per_request * rng.random(), results,
                                     errors, per_request)
                           for n in node_ids))
    return t_start, results, errors


def _query(url: str, sql: str, args: tuple = ()) -> list[tuple]:
    """The rows of ``sql`` in the database at ``url`` (SQLite ``?`` or PostgreSQL ``%s`` style)."""
    if url.startswith("sqlite:///"):
        import sqlite3

        with sqlite3.connect(url[len("sqlite:///"):]) as c:
            return [tuple(r) for r in c.execute(sql, args)]
    import psycopg

    with psycopg.connect(url) as c:
        return [tuple(r) for r in c.execute(sql.replace("?", "%s"), args)]


def jobs_in_window(url: str, m0: float, m1: float) -> list[dict]:
    """The scheduled jobs that ran within the measured span ``[m0, m1)``: name, start (s into the
    span) and duration, so a tail can be laid beside them."""
    rows = _query(url, "SELECT job, started_s, duration_s FROM job_runs WHERE started_s + duration_s >= ? "
                       "AND started_s < ? ORDER BY started_s", (m0, m1))
    return [{"job": j, "at_s": round(t - m0, 2), "duration_ms": round(d * 1e3, 1)} for j, t, d in rows]


def slow_seconds(meas: list, m0: float, p99_ms: float) -> dict[int, int]:
    """Second into the measured span -> how many requests sent in it took longer than the P99."""
    out: dict[int, int] = {}
    for t, dt, _st in meas:
        if dt * 1e3 > p99_ms:
            out[int(t - m0)] = out.get(int(t - m0), 0) + 1
    return dict(sorted(out.items()))


def stored_rows(url: str) -> list[tuple[str, int, int]]:
    """(node_id, seq, copies) of every report stored in the database at ``url``."""
    return _query(url, "SELECT node_id, seq, count(*) FROM node_reports GROUP BY node_id, seq")


def check_rows(url: str, results: list) -> dict:
    """What the database holds against what the server acknowledged (see the module docstring)."""
    acked = {(nid, seq + k) for _t, _dt, stored, nid, seq, per in results if stored for k in range(per)}
    rows = stored_rows(url)
    have = {(nid, seq) for nid, seq, _n in rows}
    return {"rows_stored": len(rows), "rows_acknowledged": len(acked), "rows_lost": len(acked - have),
            "rows_doubled": sum(n - 1 for _a, _b, n in rows if n > 1), "rows_unacknowledged": len(have - acked)}


def baseline_tree(rev: str) -> Path:
    """The tree of git revision ``rev`` of this repository, unpacked in a temporary folder."""
    out = Path(tempfile.mkdtemp(prefix="racer-baseline-"))
    tar = subprocess.run(["git", "archive", "--format=tar", rev], cwd=str(ROOT), capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=tar, check=True)
    return out


def run(db: str, nodes: int, duration_s: float, warmup_s: float, pg_url: str, seed: int = 0,
        keep_log: str | None = None, replicas: int = 1, root: Path = ROOT, floor: bool = False,
        per_request: int = 1, jobs_nice: int | None = None) -> dict:
    """One measurement (see the module docstring) of the server of the tree at ``root``; with
    ``floor``, of `bench.ingest_floor` (the HTTP stack alone: no database, no rows to check); with
    ``jobs_nice``, the replicas run with no scheduler beside one ``--jobs-only`` process at that
    niceness."""
    admin = "bench-admin-token"
    if replicas > 1 and db != "postgresql":
        raise ValueError("--replicas > 1 needs --db postgresql (SQLite: one process per database file)")
    tmp = tempfile.mkdtemp(prefix="racer-ingest-")
    if floor:
        url = "none:"
    elif db == "sqlite":
        url = f"sqlite:///{tmp}/cp.db"
    else:
        url = fresh_pg_database(pg_url, "racer_bench_ingest")
    procs, ports = [], []
    jobs = jobs_nice is not None and not floor
    env = {"RACER_LIVENESS_MISSED_INTERVALS": "30",
           **({"RACER_SEND_PERIOD_S": str(per_request)} if per_request > 1 else {})}
    try:
        for k in range(replicas):
            ports.append(free_port())
            log = (keep_log + (f".{k}" if k else "")) if keep_log else os.path.join(tmp, f"control_plane.{k}.log")
            procs.append(start_control_plane(url, ports[k], admin, log_path=log, root=root,
                                             extra_env={**env, **({"RACER_SCHEDULER": "false"} if jobs else {})},
                                             server_cmd=str(FLOOR_SERVER) if floor else None))
        serving = list(procs)  # the jobs process takes no node traffic: it is not behind `ports`
        if jobs:
            procs.append(start_control_plane(url, free_port(), admin, log_path=os.path.join(tmp, "jobs.log"),
                                             root=root, extra_env=env, args=("--jobs-only",), nice=jobs_nice))
        ids = [f"bench-{i:05d}" for i in range(nodes)]
        node_port = {nid: ports[i % replicas] for i, nid in enumerate(ids)}
        tokens = {}
        with httpx.Client(timeout=30) as c:
            for nid in ids:
                r = c.post(f"http://127.0.0.1:{ports[0]}/api/v1/tokens",
                           json={"role": "node", "name": f"bench {nid}", "node_id": nid},
                           headers={"Authorization": f"Bearer {admin}"})
                r.raise_for_status()
                tokens[nid] = r.json()["token"]
                r = c.post(f"http://127.0.0.1:{node_port[nid]}/api/v1/nodes/register",
                           headers={"Authorization": f"Bearer {tokens[nid]}"}, json={
                               "node_id": nid, "address": "http://127.0.0.1:1", "device": "cpu",
                               "cost_profile": {"kv_recompute_us_per_token": 2.5, "emb_transfer_us_per_row": 0.8,
                                                "service_time_us": 1000.0, "queue_capacity": 64}})
                r.raise_for_status()
        cpu0, me0, pg0 = sum(_cpu_s(p.pid) for p in procs), _cpu_s(os.getpid()), _postgres_cpu_s()
        main0 = sum(_cpu_s(p.pid, task=p.pid) for p in serving)
        w0 = time.time()
        tune_runtime()  # the client's own collections would otherwise show up as server latency
        t_start, results, errors = asyncio.run(drive(node_port, tokens, ids, warmup_s, duration_s, seed,
                                                       per_request))
        cpu1, me1, w1, pg1 = sum(_cpu_s(p.pid) for p in procs), _cpu_s(os.getpid()), time.time(), _postgres_cpu_s()
        main1 = sum(_cpu_s(p.pid, task=p.pid) for p in serving)
        load = round(os.getloadavg()[0], 2)
        m0, m1 = t_start + warmup_s, t_start + warmup_s + duration_s
        meas = [(t, dt, st) for t, dt, st, _n, _q, _p in results if m0 <= t < m1]
        lat_ms = np.array([dt * 1e3 for _, dt, _ in meas]) if meas else np.array([np.nan])
        stored = sum(st for _, _, st in meas)
        metrics = []
        with httpx.Client(timeout=30) as c:
            for port in ports:
                metrics.append(c.get(f"http://127.0.0.1:{port}/metrics").text)
        rows = _hists_mean(metrics, "racer_cp_ingest_commit_rows")
        commit_s = _hists_mean(metrics, "racer_cp_ingest_commit_duration_seconds")
        handler_s = _hists_mean(metrics, "racer_cp_ingest_request_duration_seconds")
        p99 = float(np.percentile(lat_ms, 99))
        return {
            "db": db, "replicas": replicas, "jobs_process": {"nice": jobs_nice} if jobs else None, "nodes": nodes,
            "duration_s": duration_s, "warmup_s": warmup_s,
            "reports_per_s": round(stored / duration_s, 1),
            "requests": len(meas),
            "ingest_p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
            "ingest_p99_ms": round(float(np.percentile(lat_ms, 99)), 2),
            "ingest_max_ms": round(float(np.max(lat_ms)), 2),
            "errors": len(errors), "error_examples": errors[:3],
            **({"http_floor": True} if floor else check_rows(url, results)),
            "reports_per_request": per_request,
            "server_cpu_ms_per_request": round((cpu1 - cpu0) * 1e3 / max(len(results), 1), 3),
            "server_cpu_ms_per_report": round((cpu1 - cpu0) * 1e3 / max(len(results) * per_request, 1), 3),
            "server_cpu_share_of_one_core": round((cpu1 - cpu0) / (w1 - w0), 3),
            # of it, the serving replicas' main threads' (the event loop: HTTP, gate, validation,
            # replies); the rest is the other threads' (the ingest writer, the jobs, the WAL
            # checkpoints, token refresh) and the jobs process's
            "server_main_thread_cpu_share_of_one_core": round((main1 - main0) / (w1 - w0), 3),
            "client_cpu_ms_per_request": round((me1 - me0) * 1e3 / max(len(results), 1), 3),
            "client_cpu_share_of_one_core": round((me1 - me0) / (w1 - w0), 3),
            # a local PostgreSQL server's processes (all of its databases), when there is one
            "postgres_cpu_share_of_one_core": (round((pg1 - pg0) / (w1 - w0), 3)
                                               if db == "postgresql" and pg0 is not None and pg1 is not None else None),
            "load_average_1m": load, "num_cpus": os.cpu_count(),
            "mean_rows_per_commit": None if rows is None else round(rows, 2),
            "mean_commit_ms": None if commit_s is None else round(commit_s * 1e3, 3),
            "commit_p99_bound_ms": _ms(_hist_quantile_bound(metrics[0], "racer_cp_ingest_commit_duration_seconds",
                                                            0.99)),
            "handler_p99_bound_ms": _ms(_hist_quantile_bound(metrics[0], "racer_cp_ingest_request_duration_seconds",
                                                             0.99)),
            "mean_server_handler_ms": None if handler_s is None else round(handler_s * 1e3, 3),
            # the batches the servers answered in the HTTP protocol (the native route), of all sent
            "native_share": _native_share(metrics, len(results)),
            # where the tail lies: the seconds of the slowest requests, and the jobs run meanwhile
            "slow_requests_by_second": slow_seconds(meas, m0, p99),
            **({} if floor else {"jobs_in_window": jobs_in_window(url, m0, m1)}),
            "target": {"reports_per_s": f">= {nodes}", "ingest_p99_ms": "<= 50"},
        }
    finally:
        for proc in procs:
            proc.send_signal(2)  # SIGINT: uvicorn shuts down gracefully
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


def summary(runs: list[dict]) -> dict:
    """Each run's P99 and CPU per report, the worst P99, the median CPU, and whether every run
    held the targets (rate, P99, nothing lost or doubled)."""
    p99 = [r["ingest_p99_ms"] for r in runs]
    cpu = [r["server_cpu_ms_per_request"] for r in runs]
    per_report = [r["server_cpu_ms_per_report"] for r in runs]
    return {"ingest_p99_ms_each_run": p99, "ingest_p99_ms_worst": max(p99),
            "server_cpu_ms_per_request_each_run": cpu,
            "server_cpu_ms_per_request_median": round(float(np.median(cpu)), 3),
            "server_cpu_ms_per_report_median": round(float(np.median(per_report)), 3),
            "reports_per_s_each_run": [r["reports_per_s"] for r in runs],
            "load_average_1m_each_run": [r["load_average_1m"] for r in runs],
            "rows_lost": sum(r.get("rows_lost", 0) for r in runs),
            "rows_doubled": sum(r.get("rows_doubled", 0) for r in runs),
            "every_run_held": all(r["ingest_p99_ms"] <= 50 and r["reports_per_s"] >= 0.99 * r["nodes"]
                                  and not r.get("rows_lost") and not r.get("rows_doubled") and not r["errors"]
                                  for r in runs)}


def _native_share(texts: list[str], requests: int) -> float | None:
    """``racer_cp_ingest_native_requests_total`` summed over the servers' scrapes, over
    ``requests`` (None: a server without the counter, such as an older revision's)."""
    total, seen = 0.0, False
    for text in texts:
        for line in text.splitlines():
            if line.startswith("racer_cp_ingest_native_requests_total "):
                total += float(line.split()[1])
                seen = True
    return round(total / requests, 3) if seen and requests else None


def cpu_ratios(current: list[dict], baseline: list[dict]) -> list[float]:
    """Each run's server CPU per report over the baseline server's in the same run (measured one
    after the other on one machine)."""
    return [round(c["server_cpu_ms_per_report"] / b["server_cpu_ms_per_report"], 3)
            for c, b in zip(current, baseline)]


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _postgres_cpu_s() -> float | None:
    """CPU seconds of every process named ``postgres`` on this machine (a local server), with those
    of its exited backends (their parent's reaped-children times), or None."""
    total, found = 0.0, False
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "comm").read_text().strip() != "postgres":
                continue
            total += _cpu_s(int(d.name), children=True)
            found = True
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return total if found else None


def _cpu_s(pid: int, children: bool = False, task: int | None = None) -> float:
    """utime + stime of a process (with ``children``: plus those of its exited, reaped children;
    with ``task``: of that one thread), seconds (Linux /proc)."""
    path = f"/proc/{pid}/task/{task}/stat" if task is not None else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


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


def _hists_mean(texts: list[str], name: str) -> float | None:
    """The mean of histogram ``name`` over several processes' /metrics."""
    s = c = 0.0
    for text in texts:
        for ln in text.splitlines():
            if ln.startswith(name + "_sum "):
                s += float(ln.split()[1])
            elif ln.startswith(name + "_count "):
                c += float(ln.split()[1])
    return s / c if c else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ingest", description=__doc__.split("\n\n")[0])
    p.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--replicas", type=int, default=1, help="control-plane processes on one database (PostgreSQL)")
    p.add_argument("--runs", type=int, default=1, help="measurements in a row (each on a fresh database)")
    p.add_argument("--baseline-rev", default=None, metavar="REV",
                   help="also measure the server of git revision REV, before each run of this tree's")
    p.add_argument("--reports-per-request", type=int, default=1, metavar="N",
                   help="each node sends its reports N at a time, every N s (the control plane's send_period_s)")
    p.add_argument("--jobs-process", action="store_true",
                   help="the replicas serve with no scheduler beside one `control_plane.main --jobs-only` "
                        "process (elected, taking no node traffic); this tree's server only")
    p.add_argument("--jobs-nice", type=int, default=10, metavar="N",
                   help="the jobs process's niceness (default 10: below the serving replicas, as on cores of "
                        "their own)")
    p.add_argument("--http-floor", action="store_true",
                   help="also measure bench/ingest_floor.py (the HTTP stack alone), before each run")
    p.add_argument("--pg-url", default=os.environ.get("RACER_BENCH_PG_URL", "postgresql://postgres@127.0.0.1/"),
                   help="PostgreSQL server (a database racer_bench_ingest is created there)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if (a.nodes < 1 or a.duration_s <= 0 or a.warmup_s < 0 or a.runs < 1 or a.replicas < 1
            or not 1 <= a.reports_per_request <= 60):
        print("error: --nodes >= 1, --duration-s > 0, --warmup-s >= 0, --runs >= 1, --replicas >= 1, "
              "--reports-per-request 1..60", file=sys.stderr)
        return 2
    if a.replicas > 1 and a.db != "postgresql":
        print("error: --replicas > 1 needs --db postgresql", file=sys.stderr)
        return 2
    trees = {"current": ROOT}
    if a.baseline_rev:
        trees = {f"baseline {a.baseline_rev}": baseline_tree(a.baseline_rev), "current": ROOT}
    if a.http_floor:
        trees = {"http floor": None, **trees}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for i in range(a.runs):
        for name, root in trees.items():
            runs[name].append(run(a.db, a.nodes, a.duration_s, a.warmup_s, a.pg_url, seed=i, replicas=a.replicas,
                                  root=root or ROOT, floor=root is None, per_request=a.reports_per_request,
                                  jobs_nice=a.jobs_nice if a.jobs_process and name == "current" else None))
    if len(trees) == 1 and a.runs == 1:
        out = runs["current"][0]
    else:
        out = {"runs": runs, "summary": {k: summary(v) for k, v in runs.items()}}
        base = f"baseline {a.baseline_rev}"
        if base in runs:  # the machine's speed drifts between runs: the ratio within each run is the figure
            out["summary"]["current"]["cpu_ratio_to_baseline_each_run"] = cpu_ratios(runs["current"], runs[base])
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
