"""Simulator speed: simulated requests per second of wall time, 32 nodes, RACER router.

    python -m bench.simulator [--json] [--trace taobao] [--rate R] [--duration S]

Runs the paper table's default setting (`simulator.table.TableConfig`) once per regime with a
static split and the RACER router, in one process on one thread, and reports
``sim_requests_per_s`` = simulated requests / wall seconds over all regimes (the stream's
generation is not timed), per regime too.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench import load_bench_trace
from simulator import SimConfig, StaticAllocator, simulate
from simulator.table import TableConfig
from workloads import REGIMES, generate


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.simulator", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace", default="taobao")
    ap.add_argument("--path", default=None)
    d = TableConfig()
    ap.add_argument("--nodes", type=int, default=d.num_nodes)
    ap.add_argument("--rate", type=float, default=d.rate_rps)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--users", type=int, default=d.num_users)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    trace, name = load_bench_trace(args.trace, args.path)
    cfg = SimConfig(num_nodes=args.nodes, cache_fraction=d.cache_fraction, slo_ms=d.slo_ms)
    out = {"trace": name, "nodes": args.nodes, "router": "racer", "rate_rps": args.rate,
           "duration_s": args.duration, "num_users": args.users, "torch_threads": torch.get_num_threads(),
           "regimes": {}}
    total_n, total_wall = 0, 0.0
    for regime in REGIMES:
        s = generate(trace, regime=regime, rate_rps=args.rate, duration_s=args.duration, num_users=args.users,
                     history_scale=d.history_scale, seed=0)
        t0 = time.perf_counter()
        r = simulate(s, cfg, StaticAllocator(0.5), "racer")
        wall = time.perf_counter() - t0
        total_n += len(s)
        total_wall += wall
        out["regimes"][regime] = {"num_requests": len(s), "wall_s": round(wall, 2),
                                  "sim_requests_per_s": round(len(s) / wall), "p99_ms": r.summary()["p99_ms"]}
    out["sim_requests_per_s"] = round(total_n / total_wall)
    if args.json:
        print(json.dumps(out))
    else:
        for regime, v in out["regimes"].items():
            print(f"{regime:<8} {v['num_requests']:>9,} requests in {v['wall_s']:>6} s: "
                  f"{v['sim_requests_per_s']:>8,} simulated req/s")
        print(f"sim_requests_per_s: {out['sim_requests_per_s']:,}")
    return out


if __name__ == "__main__":
    main()
