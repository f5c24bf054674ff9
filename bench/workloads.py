"""How fast request streams are generated at 32-node scale.

    python -m bench.workloads [--json] [--trace taobao] [--path PATH]

A 32-node cluster at 1,000 req/s per node for 60 s with 1,000,000 users (resampled from the
trace): about 1.9 M requests per steady/trend stream, more with bursts. Reports generated
requests per second of wall time for each regime (median of ``--repeats`` runs) and the minimum
over regimes as ``requests_per_s``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench import load_bench_trace
from workloads import REGIMES, generate


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.workloads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace", default="taobao")
    ap.add_argument("--path", default=None)
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--rate-per-node", type=float, default=1_000.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--users", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    trace, trace_name = load_bench_trace(args.trace, args.path)
    rate = args.nodes * args.rate_per_node
    out = {"trace": trace_name, "nodes": args.nodes, "rate_rps": rate, "duration_s": args.duration,
           "num_users": args.users, "regimes": {}}
    generate(trace, rate_rps=rate, duration_s=1.0, num_users=args.users)  # warm-up
    for regime in REGIMES:
        rates, n = [], 0
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            s = generate(trace, regime=regime, rate_rps=rate, duration_s=args.duration,
                         num_users=args.users, seed=rep)
            dt = time.perf_counter() - t0
            n = len(s)
            rates.append(n / dt)
        out["regimes"][regime] = {"num_requests": n, "requests_per_s": round(statistics.median(rates))}
    out["requests_per_s"] = min(r["requests_per_s"] for r in out["regimes"].values())
    if args.json:
        print(json.dumps(out))
    else:
        for regime, r in out["regimes"].items():
            print(f"{regime:<8} {r['num_requests']:>10,} requests  {r['requests_per_s']:>12,} req/s generated")
        print(f"requests_per_s (min over regimes): {out['requests_per_s']:,}")
    return out


if __name__ == "__main__":
    main()
