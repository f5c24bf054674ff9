"""Benchmark of the gateway in front of real node-agent processes.

    python -m bench.gateway --json
    python -m bench.gateway --routers racer,least_load,round_robin --trace taobao --json

Default mode profiles the small model once (``racer node profile``: the agents' ``--profile``,
whose miss costs the gateway's weights come from), starts 4 ``racer node-agent`` processes
(small model: 1 layer, 32-dim embeddings, 256 pages, histories up to 256 tokens) and one
``racer gateway`` process (router ``racer``), then measures:

Three paths to the same 4 agents, each named in the output (``paths``):

- ``gateway_racer``: the client -> a ``racer gateway`` with router ``racer`` -> an agent;
- ``gateway_round_robin``: the client -> a second ``racer gateway`` with router ``round_robin``;
- ``direct_round_robin``: the client -> an agent, spread round-robin by the client (no gateway).

Like is compared with like: ``gateway_racer`` against ``gateway_round_robin`` is the router's
worth (the same hop, another choice of node); ``gateway_round_robin`` against
``direct_round_robin`` is the hop's cost (the same choice of node, with and without a gateway).
``gateway_racer`` against ``direct_round_robin`` mixes both and is not reported as a comparison.
The paths share the agents and their caches, so each path's traffic also warms the others'.

- **overhead** (closed loop, one request at a time, the same requests on every path, in chunks
  that alternate the paths): for every request sent through the ``racer`` gateway, the client's
  latency minus the gateway's round trip to the node for that request (``gateway.upstream_ms`` in
  the answer), i.e. what the extra hop and the routing add on top of the node's own service time
  as the gateway saw it (the client's own cost is in it too: the client is `LoadClient`, the
  gateway's lean pooled HTTP/1.1 client, not httpx, whose ~1.5 ms per request on this machine
  used to be most of the figure). ``overhead_p50_ms`` / ``overhead_p99_ms``;
  ``gateway_internal_p50_ms`` is the gateway's own histogram (parse, route, splice) for
  comparison. ``client_ms``: the client's latency P50 / P99 on each path.
- **max_rps**: open-loop Poisson load at rising rates on each path; the highest rate whose P99
  stays within 2x the P99 at the lowest rate (and with no errors): ``max_rps_by_path``
  (``max_rps``: ``gateway_racer``'s). The paths' sweeps run in the same run, level by level
  interleaved (`sweep_paths`); every level runs long enough for 100 requests (the lowest for
  200, so its P99 is a yardstick and not one outlier), and a failing level is tried once more.

Every P99 comes with its sample count and a flag when that count is under 100 (`bench.stats`).

``--routers`` mode replays the same request stream (a ``steady`` regime of the trace; candidates
sampled by item popularity, sent explicitly so the gateway sees every looked-up item) through a
gateway per router, restarting the 4 agents before each router so every router starts cold, and
prints each router's P99 and the KV hit rate (history tokens whose K/V was reused) and EMB hit
rate (rows found in the slab) summed over the answers.
Figures come from a shared, noisy machine: compare, do not assert.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.stats import MIN_P99_SAMPLES, p99, pct
from common.http_client import UpstreamError, UpstreamPool
from common.http_server import tune_runtime

REPO = Path(__file__).resolve().parents[1]

SMALL_AGENT = ["--num-pages", "256", "--max-history-len", "256", "--num-candidates", "32", "--max-candidates", "256",
               "--emb-share", "0.5", "--embedding-dim", "32", "--head-dim", "16", "--num-layers", "1"]


_ISSUED: set[int] = set()


def free_port() -> int:
    """A free local port, never one this process was given before: a probed port stays free until
    the process it was handed to binds it, so two probes in a row can return the same one."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ISSUED:
            _ISSUED.add(port)
            return port


class Proc:
    """A child process (``racer ...``) with its output in a log file, at CPU priority ``nice`` (0:
    the caller's); `kill` and `stop` by pid."""

    def __init__(self, args: list[str], log_path: Path, port: int, nice: int = 0, env: dict | None = None) -> None:
        self.args, self.log_path, self.port, self.nice, self.env = args, log_path, port, nice, env or {}
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Proc":
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **self.env}
        log = open(self.log_path, "a")
        nice = ["nice", "-n", str(self.nice)] if self.nice else []  # a lower CPU priority (Linux / POSIX nice)
        self.proc = subprocess.Popen([*nice, sys.executable, "-m", "racer", *self.args, "--port", str(self.port)],
                                     cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        return self

    def wait_ready(self, path: str = "/healthz", timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[0]} exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.args[0]} on port {self.port} not ready after {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL (kill -9)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        stop_all([self])


def stop_all(procs: list[Proc], timeout_s: float = 10.0) -> None:
    """SIGTERM to every running one at once, then wait for each (SIGKILL after ``timeout_s``): the
    processes shut down side by side, not one after another."""
    live = [p.proc for p in procs if p.proc is not None and p.proc.poll() is None]
    for proc in live:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in live:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def start_agents(n: int, workdir: Path, trace: str = "taobao", path: str | None = None,
                 extra: list[str] | None = None, ports: list[int] | None = None,
                 env: dict | None = None) -> list[Proc]:
    """``n`` node agents (small model), started in parallel and healthy on return (``env``: added
    to their environment)."""
    agents = []
    for i in range(n):
        port = ports[i] if ports else free_port()
        args = ["node-agent", "--trace", trace, *(["--path", path] if path else []), *SMALL_AGENT,
                "--seed", "1", *(extra or [])]
        agents.append(Proc(args, workdir / f"agent{i}.log", port, env=env).start())
    try:
        for a in agents:
            a.wait_ready()
    except Exception:
        for a in agents:
            a.kill()
        raise
    return agents


def measure_profile(workdir: Path) -> Path:
    """``racer node profile`` of the small model (the agents' ``--profile``: their miss costs,
    which the gateway's weights come from)."""
    out = workdir / "node_profile.json"
    model = [a for a in SMALL_AGENT[SMALL_AGENT.index("--embedding-dim"):]]
    subprocess.run([sys.executable, "-m", "racer", "node", "profile", *model, "--lengths", "64,128,256",
                    "--repeats", "3", "--num-candidates", "32", "--out", str(out), "--no-progress"],
                   cwd=REPO, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return out


def start_gateway(node_urls: list[str], workdir: Path, router: str = "racer", trace: str | None = "taobao",
                  path: str | None = None, extra: list[str] | None = None, port: int | None = None,
                  env: dict | None = None) -> Proc:
    args = ["gateway", "--nodes", ",".join(node_urls), "--router", router,
            *(["--trace", trace] if trace else []), *(["--path", path] if path else []), *(extra or [])]
    g = Proc(args, workdir / f"gateway-{router}.log", port or free_port(), env=env).start()
    try:
        g.wait_ready()
    except Exception:
        g.kill()
        raise
    return g


# ----------------------------------------------------------------------------------- requests ---
def make_bodies(trace_kind: str, path: str | None, num: int, seed: int = 0, rate_rps: float = 200.0,
                num_candidates: int = 32, max_history_len: int = 200, num_users: int | None = None) -> list[bytes]:
    """Request bodies of a ``steady`` stream of the trace, candidates sampled by popularity."""
    from workloads import generate, load_trace

    trace = load_trace(trace_kind, path)
    stream = generate(trace, regime="steady", rate_rps=rate_rps, duration_s=num / rate_rps * 1.3 + 1, seed=seed,
                      num_candidates=num_candidates, max_history_len=max_history_len, num_users=num_users)
    rng = np.random.default_rng(seed)
    pop = trace.item_popularity().astype(np.float64)
    cdf = np.cumsum(pop / pop.sum())
    out = []
    for i in range(min(num, len(stream))):
        r = stream.request(i)
        cands = np.unique(np.minimum(np.searchsorted(cdf, rng.random(num_candidates)), trace.num_items - 1))
        out.append(json.dumps({"user_id": int(r.user), "history": r.history.tolist(),
                               "new_items": r.new_items.tolist(), "candidates": cands.tolist(),
                               "top_k": 10}).encode())
    return out


class LoadClient:
    """The benchmark's HTTP client: one `common.http_client.UpstreamPool` (pooled keep-alive
    HTTP/1.1, the gateway's own forwarding client) per URL. A lean client matters on a 2-core
    machine: with httpx the client's own ~1.5 ms per request counted as gateway overhead and its CPU
    was taken from the agents under load."""

    def __init__(self, urls: list[str], max_connections: int = 256) -> None:
        self.pools = [UpstreamPool(u, max_connections=max_connections, connect_timeout_s=5.0) for u in urls]

    async def post(self, i: int, body: bytes, timeout_s: float) -> tuple[int, bytes]:
        return await self.pools[i % len(self.pools)].post("/v1/recommend", body, timeout_s=timeout_s)

    async def close(self) -> None:
        for p in self.pools:
            await p.close()


async def closed_loop(urls: list[str], bodies: list[bytes]) -> list[tuple[float, dict]]:
    """One request at a time; ``urls`` used round-robin. Returns (latency s, answer)."""
    out = []
    c = LoadClient(urls)
    try:
        for i, b in enumerate(bodies):
            t = time.perf_counter()
            status, content = await c.post(i, b, timeout_s=30.0)
            dt = time.perf_counter() - t
            if status != 200:
                raise RuntimeError(f"request {i}: {status} {content[:300]!r}")
            out.append((dt, json.loads(content)))
    finally:
        await c.close()
    return out


async def open_loop(urls: list[str], bodies: list[bytes], rate_rps: float, duration_s: float,
                    seed: int = 0, timeout_s: float = 10.0) -> dict:
    """Poisson arrivals at ``rate_rps`` for ``duration_s``; latency percentiles (the P99 with
    its sample count, `bench.stats.p99`) and errors."""
    rng = np.random.default_rng(seed)
    n = max(1, int(rate_rps * duration_s))
    gaps = rng.exponential(1.0 / rate_rps, n)
    lat: list[float] = []
    errors = 0
    c = LoadClient(urls)
    try:
        async def one(i: int) -> None:
            nonlocal errors
            t = time.perf_counter()
            try:
                status, _ = await c.post(i, bodies[i % len(bodies)], timeout_s=timeout_s)
                ok = status == 200
            except UpstreamError:
                ok = False
            if ok:
                lat.append(time.perf_counter() - t)
            else:
                errors += 1

        tasks = []
        start = time.perf_counter()
        at = 0.0
        for i in range(n):
            at += gaps[i]
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    finally:
        await c.close()
    ms = [x * 1e3 for x in lat]
    return {"offered_rps": rate_rps, "achieved_rps": round(len(lat) / elapsed, 1), "n": n, "errors": errors,
            "p50_ms": pct(ms, 50, 2), **p99(ms, 2).fields("p99_ms")}


BASELINE_SAMPLES = 200  # requests at the lowest rate: its P99 is the yardstick of every other level


def _within(row: dict, base_p99_ms: float | None) -> bool:
    """No errors, and a P99 within 2x the lowest level's."""
    return (row["errors"] == 0 and row["p99_ms"] is not None and base_p99_ms is not None
            and row["p99_ms"] <= 2 * base_p99_ms)


async def sweep_paths(paths: dict[str, list[str]], bodies: list[bytes], rates: list[float],
                      duration_s: float) -> dict[str, tuple[float, list]]:
    """Open-loop sweeps of several paths (``{name: urls}``, the client spreading requests over a
    path's urls round-robin), interleaved level by level (the order rotates per level) so every
    path sees the same machine noise.

    Every level runs for ``duration_s`` or long enough for ``MIN_P99_SAMPLES`` requests,
    whichever is longer (the lowest for ``BASELINE_SAMPLES``); a level passes when it has no
    errors and its P99 is within 2x the lowest level's; a failing level is run once more (a noisy
    neighbour can spoil one 5-s window) and the path stops at its first level that fails twice.
    Returns ``{name: (highest passing rate, rows)}``."""
    state = {name: {"best": 0.0, "rows": [], "base": None, "done": False} for name in paths}
    names = list(paths)
    for k, rate in enumerate(rates):
        order = names[k % len(names):] + names[:k % len(names)]
        for name in order:
            st = state[name]
            if st["done"]:
                continue
            dur = max(duration_s, (BASELINE_SAMPLES if k == 0 else MIN_P99_SAMPLES) / rate)
            row = await open_loop(paths[name], bodies[k * 1000:] + bodies, rate, dur, seed=k)
            if st["base"] is None:
                st["base"] = row["p99_ms"]
            ok = _within(row, st["base"])
            if not ok and k > 0:
                again = await open_loop(paths[name], bodies[k * 1000 + 500:] + bodies, rate, dur, seed=k + 100)
                row["retry"] = again
                ok = _within(again, st["base"])
            row["within_2x_low_load_p99"] = ok
            st["rows"].append(row)
            if ok:
                st["best"] = rate
            else:
                st["done"] = True
        if all(st["done"] for st in state.values()):
            break
    return {name: (st["best"], st["rows"]) for name, st in state.items()}


def _gateway_internal_p50_ms(url: str) -> float | None:
    """The gateway's overhead histogram's median (linear within the bucket)."""
    text = httpx.get(url + "/metrics", timeout=5.0).text
    buckets = []
    for line in text.splitlines():
        if line.startswith("racer_gateway_overhead_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= total / 2:
            frac = (total / 2 - prev_c) / max(c - prev_c, 1e-9)
            return round((prev_le + frac * (le - prev_le)) * 1e3, 3)
        prev_le, prev_c = le, c
    return None


# ------------------------------------------------------------------------------------- modes ---
PATHS = {
    "gateway_racer": "client -> racer gateway (router racer) -> agent",
    "gateway_round_robin": "client -> racer gateway (router round_robin) -> agent",
    "direct_round_robin": "client -> agent, the client spreading requests round-robin (no gateway)",
}
COMPARISONS = {  # like with like: (what differs, path, the path it is compared with)
    "router": ("the gateway's choice of node, the same hop", "gateway_racer", "gateway_round_robin"),
    "hop": ("the gateway in the path, the same round-robin choice", "gateway_round_robin", "direct_round_robin"),
}


def _client_ms(lat_ms: list[float]) -> dict:
    return {"p50_ms": pct(lat_ms, 50), **p99(lat_ms).fields("p99_ms")}


def run_overhead(args, workdir: Path) -> dict:
    load_at_start = os.getloadavg()[0]
    profile = ["--profile", str(measure_profile(workdir))]
    agents = start_agents(args.nodes, workdir, args.trace, args.path, extra=profile)
    gws: list[Proc] = []
    try:
        urls = [a.url for a in agents]
        gws.append(start_gateway(urls, workdir, "racer", args.trace, args.path))
        gws.append(start_gateway(urls, workdir, "round_robin", args.trace, args.path))
        paths = {"gateway_racer": [gws[0].url], "gateway_round_robin": [gws[1].url], "direct_round_robin": urls}
        bodies = make_bodies(args.trace, args.path, args.requests + 6000, seed=1)
        for targets in paths.values():
            asyncio.run(closed_loop(targets, bodies[:50]))
        reqs = bodies[50:50 + args.requests]
        # the paths alternate in chunks of the same requests, so all see the same machine noise
        over: list[float] = []
        lat: dict[str, list[float]] = {name: [] for name in paths}
        for k in range(0, len(reqs), 50):
            chunk = reqs[k:k + 50]
            for name, targets in paths.items():
                for dt, ans in asyncio.run(closed_loop(targets, chunk)):
                    lat[name].append(dt * 1e3)
                    if name == "gateway_racer":
                        over.append(dt * 1e3 - ans["gateway"]["upstream_ms"])
        internal = _gateway_internal_p50_ms(gws[0].url)
        rates = [float(r) for r in args.rates.split(",")]
        swept = asyncio.run(sweep_paths(paths, bodies[50 + args.requests:], rates, args.duration))
        best = {name: swept[name][0] for name in paths}
        state = httpx.get(gws[0].url + "/v1/router", timeout=5.0).json()
        return {
            "num_nodes": args.nodes, "requests": len(reqs), "cpu_count": os.cpu_count(),
            "load_average_at_start": load_at_start, "paths": PATHS,
            "overhead_p50_ms": pct(over, 50), **p99(over).fields("overhead_p99_ms"),
            "overhead_target_ms": {"p50": 1.0, "p99": 5.0},
            "gateway_internal_p50_ms": internal,
            "client_ms": {name: _client_ms(xs) for name, xs in lat.items()},
            "max_rps": best["gateway_racer"], "max_rps_by_path": best,
            "compare": {name: {"differs": what, "max_rps": [best[a], best[b]], "paths": [a, b],
                               "client_p50_ms": [pct(lat[a], 50), pct(lat[b], 50)]}
                        for name, (what, a, b) in COMPARISONS.items()},
            "sweep": {name: swept[name][1] for name in paths},
            "served_by": {n["node_id"]: n["kv_resident_users"] for n in state["nodes"]},
        }
    finally:
        stop_all(gws + agents)


def run_routers(args, workdir: Path) -> dict:
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bodies = make_bodies(args.trace, args.path, args.requests, seed=2, rate_rps=args.replay_rps,
                         num_users=args.replay_users)
    profile = ["--profile", str(measure_profile(workdir))]
    out = {"trace": args.trace, "requests": len(bodies), "rate_rps": args.replay_rps, "users": args.replay_users,
           "cpu_count": os.cpu_count(), "load_average_at_start": os.getloadavg()[0], "routers": {}}
    for router in routers:
        agents = start_agents(args.nodes, workdir, args.trace, args.path, extra=profile)
        gw = None
        try:
            gw = start_gateway([a.url for a in agents], workdir, router, args.trace, args.path,
                               extra=["--report-interval-s", "0.2"])
            answers = asyncio.run(replay(gw.url, bodies, args.replay_rps))
            st = httpx.get(gw.url + "/v1/router", timeout=5.0).json()
            lat = [a[0] * 1e3 for a in answers if a[1] is not None]
            ok = [a[1] for a in answers if a[1] is not None]
            hist = sum(a["kv"]["hit_tokens"] + a["kv"]["recomputed_tokens"] for a in ok)
            rows = sum(a["emb"]["rows"] for a in ok)
            per_node: dict[str, int] = {}
            for a in ok:
                per_node[a["served_by"]] = per_node.get(a["served_by"], 0) + 1
            out["routers"][router] = {
                "p50_ms": pct(lat, 50), **p99(lat).fields("p99_ms"), "errors": len(answers) - len(ok),
                "kv_hit_rate": round(sum(a["kv"]["hit_tokens"] for a in ok) / max(hist, 1), 4),
                "emb_hit_rate": round(sum(a["emb"]["hits"] for a in ok) / max(rows, 1), 4),
                "retried": sum(a["retried"] for a in ok), "requests_per_node": per_node,
                "guard": sum(a["routing"]["source"] == "guard" for a in ok),
                "kv_holder_known": round(sum(a["routing"]["kv_holder"] is not None for a in ok) / max(len(ok), 1), 4),
                "hot_shards_per_node": [len(n["hot_shards"]) for n in st["nodes"]],
            }
        finally:
            stop_all(([gw] if gw is not None else []) + agents)
    return out


async def replay(url: str, bodies: list[bytes], rate_rps: float) -> list:
    """The bodies at a fixed rate (open loop); (latency s, answer or None)."""
    out: list = [None] * len(bodies)
    c = LoadClient([url])
    try:
        async def one(i: int) -> None:
            t = time.perf_counter()
            try:
                status, content = await c.post(0, bodies[i], timeout_s=30.0)
                out[i] = (time.perf_counter() - t, json.loads(content) if status == 200 else None)
            except UpstreamError:
                out[i] = (time.perf_counter() - t, None)

        start = time.perf_counter()
        tasks = []
        for i in range(len(bodies)):
            delay = start + i / rate_rps - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    finally:
        await c.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--nodes", type=int, default=4, help="node agents (default 4)")
    ap.add_argument("--trace", default="taobao", help="trace the agents serve (default taobao)")
    ap.add_argument("--path", default=None, help="trace file (default: the sample)")
    ap.add_argument("--requests", type=int, default=300,
                    help="closed-loop requests for the overhead; replayed requests with --routers (default 300)")
    ap.add_argument("--rates", default="4,8,12,16,24,32,48,64,96,128,192,256",
                    help="offered rates of the max_rps sweep, req/s, lowest first: the lowest is the low-load "
                         "reference (default 4,8,12,16,24,32,48,64,96,128,192,256; the sweep stops at the first "
                         "rate that fails)")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per sweep rate (default 5)")
    ap.add_argument("--routers", default=None, help="compare these routers on one replayed stream")
    ap.add_argument("--replay-rps", type=float, default=6.0, help="replay rate with --routers (default 6)")
    ap.add_argument("--replay-users", type=int, default=100,
                    help="users in the replayed stream (default 100, so users come back within the replay)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="racer-bench-gateway-") as d:
        workdir = Path(d)
        tune_runtime()  # the client's own collections and GIL hand-offs would otherwise count as latency
        result = run_routers(args, workdir) if args.routers else run_overhead(args, workdir)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
