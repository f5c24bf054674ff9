"""Router decision latency: ``python -m bench.router [--json]``.

For each cluster size (32, 256 and 1,024 nodes by default) a ``racer`` router is built with
1,000,000 users resident in its K/V map and a hot-shard set reported by every node; then requests
of a steady stream (1M users replaying a synthetic trace; looked-up items = the request's new
items plus ``--candidates`` candidates drawn by item popularity) are routed one at a time. Only
`Router.route` is timed (``perf_counter_ns`` around each call, garbage collector left on, as in
a serving process); between timed calls, outside the timing, the bench completes requests so
that the cluster keeps ``--inflight-per-node`` requests in flight per node, and every 500
decisions one node sends a report (queue depth, a new hot-shard set, a few evicted users).

The figures are percentiles of the per-decision times: ``--rounds`` rounds of ``--decisions``
timed decisions each, after a warm-up; each percentile printed is the median over rounds of that
round's percentile, so one round disturbed by another process on a shared machine does not move
it (each round's P99 is from ``--decisions`` samples: ``p99_us_few_samples`` under 100).
``batch_us_per_decision`` is the mean cost per decision of `Router.route_batch` over batches of
256 requests. Benchmarks print figures; no test asserts them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from bench.stats import MIN_P99_SAMPLES, few_samples_note
from gateway import CostProfile, NodeReport, RequestBatch, RouteRequest, make_router
from workloads import generate, synthetic_trace


def _requests(num_users: int, num_requests: int, num_candidates: int, num_shards: int, seed: int) -> list[RouteRequest]:
    trace = synthetic_trace(num_users=20_000, num_items=200_000, seed=seed, num_shards=num_shards)
    duration = max(1.0, num_requests / 1_000.0)
    stream = generate(trace, regime="steady", rate_rps=num_requests / duration * 1.05, duration_s=duration,
                      num_users=num_users, seed=seed)
    rng = np.random.default_rng(seed + 1)
    pop = trace.item_popularity().astype(np.float64) + 1.0
    cdf = np.cumsum(pop) / pop.sum()
    req_idx, new_items = stream.all_new_items()
    bounds = np.searchsorted(req_idx, np.arange(len(stream) + 1))
    out = []
    for i in range(min(num_requests, len(stream))):
        cands = np.searchsorted(cdf, rng.random(num_candidates))
        items = np.concatenate([new_items[bounds[i]:bounds[i + 1]], cands])
        out.append(RouteRequest(int(stream.user[i]), int(stream.history_len[i]), trace.item_shard[items],
                                int(stream.num_new_items[i])))
    return out


def bench_nodes(num_nodes: int, requests: list[RouteRequest], *, num_users: int, num_shards: int, rounds: int,
                plain: bool = False,
                decisions: int, warmup: int, inflight_per_node: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    node_ids = [f"node-{i:04d}" for i in range(num_nodes)]
    profile = CostProfile(kv_recompute_us_per_token=1.5, emb_transfer_us_per_row=4.0, service_time_us=2_000.0,
                          queue_capacity=64)
    from gateway.router import LOAD_AWARE_OFF, LoadAwareConfig

    router = make_router("racer", node_ids, profile, now_s=0.0, num_shards=num_shards,
                         load_aware=LOAD_AWARE_OFF if plain else LoadAwareConfig(),
                         node_timeout_s=float("inf"))
    users = np.arange(num_users, dtype=np.int64)
    router.state.kv.record_many(users, rng.integers(0, num_nodes, num_users), rng.integers(1, 2_000, num_users), 0.0)
    resident = len(router.state.kv)
    for i, nid in enumerate(node_ids):
        router.report(NodeReport(nid, 0.0, seq=0, hot_shards=rng.choice(num_shards, num_shards // 4, replace=False)))

    inflight: list[int] = []
    seqs = np.zeros(num_nodes, dtype=np.int64)
    target = inflight_per_node * num_nodes
    state = {"k": 0, "t": 0.0}

    def step(timed: bool) -> int:
        req = requests[state["k"] % len(requests)]
        state["k"] += 1
        state["t"] += 1e-4
        now = state["t"]
        if timed:
            t0 = time.perf_counter_ns()
            d = router.route(req, now)
            dt = time.perf_counter_ns() - t0
        else:
            d = router.route(req, now)
            dt = 0
        inflight.append(d.node_index)
        while len(inflight) > target:
            router.complete(inflight.pop(0))
        if state["k"] % 500 == 0:
            n = int(rng.integers(0, num_nodes))
            seqs[n] += 1
            depth = float(router.state.queue[n])
            router.report(NodeReport(node_ids[n], now, seq=int(seqs[n]), queue_depth=depth,
                                     hot_shards=rng.choice(num_shards, num_shards // 4, replace=False),
                                     evicted_users=rng.integers(0, num_users, 32)))
        return dt

    for _ in range(warmup):
        step(False)
    p50s, p90s, p99s, means = [], [], [], []
    for _ in range(rounds):
        times = np.fromiter((step(True) for _ in range(decisions)), dtype=np.int64, count=decisions) / 1e3
        p50s.append(np.percentile(times, 50))
        p90s.append(np.percentile(times, 90))
        p99s.append(np.percentile(times, 99))
        means.append(times.mean())

    # batch path: same stream, 256 requests at a time
    batch_costs = []
    for _ in range(rounds):
        chunk = [requests[(state["k"] + j) % len(requests)] for j in range(256)]
        state["k"] += 256
        batch = RequestBatch.from_requests(chunk)
        t0 = time.perf_counter_ns()
        res = router.route_batch(batch, state["t"])
        batch_costs.append((time.perf_counter_ns() - t0) / 1e3 / len(batch))
        for n in res.node_index.tolist():
            router.complete(n)
    problems = router.state.check_invariants()
    if problems:
        raise AssertionError(f"router state inconsistent after the bench: {problems}")
    return {
        "p50_us": round(float(np.median(p50s)), 2),
        "p99_us": round(float(np.median(p99s)), 2),
        "p99_us_samples": decisions, "p99_us_few_samples": decisions < MIN_P99_SAMPLES,  # each round's
        "p90_us": round(float(np.median(p90s)), 2),
        "mean_us": round(float(np.median(means)), 2),
        "num_decisions": rounds * decisions,
        "resident_users": resident,
        "residency_mib": round(router.state.kv.nbytes / 2**20, 1),
        "batch_us_per_decision": round(float(np.median(batch_costs)), 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--nodes", default="32,256,1024", help="comma-separated cluster sizes (default 32,256,1024)")
    p.add_argument("--users", type=int, default=1_000_000, help="resident users (default 1,000,000)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per size (default 5)")
    p.add_argument("--decisions", type=int, default=10_000, help="timed decisions per round (default 10,000)")
    p.add_argument("--warmup", type=int, default=2_000, help="untimed decisions first (default 2,000)")
    p.add_argument("--candidates", type=int, default=256, help="candidate items per request (default 256)")
    p.add_argument("--inflight-per-node", type=int, default=4, help="requests kept in flight per node (default 4)")
    p.add_argument("--num-shards", type=int, default=64, help="embedding shards (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plain", action="store_true", help="the plain score, without the load-aware rules")
    args = p.parse_args(argv)
    try:
        sizes = [int(x) for x in args.nodes.split(",") if x.strip()]
    except ValueError:
        print(f"--nodes must be comma-separated integers, got {args.nodes!r}", file=sys.stderr)
        return 2
    if not sizes or min(sizes) < 1 or args.users < 1 or args.rounds < 1 or args.decisions < 1:
        print("--nodes, --users, --rounds and --decisions must be positive", file=sys.stderr)
        return 2
    requests = _requests(args.users, 20_000, args.candidates, args.num_shards, args.seed)
    result = {}
    for n in sizes:
        result[f"nodes_{n}"] = bench_nodes(n, requests, num_users=args.users, num_shards=args.num_shards,
                                           rounds=args.rounds, decisions=args.decisions, warmup=args.warmup,
                                           inflight_per_node=args.inflight_per_node, seed=args.seed,
                                           plain=args.plain)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"racer router decision latency, {args.users:,} resident users, {args.candidates} candidates/request")
        print(f"{'nodes':>6} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8} {'mean us':>8} {'batch us':>9}")
        for n in sizes:
            r = result[f"nodes_{n}"]
            print(f"{n:>6} {r['p50_us']:>8} {r['p90_us']:>8} {r['p99_us']:>8} {r['mean_us']:>8} "
                  f"{r['batch_us_per_decision']:>9}{few_samples_note(r['p99_us_samples'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
