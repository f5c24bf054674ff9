"""Marginal utility of memory per regime: what 10% more of the arena would buy each cache.

    python -m bench.marginal [--json] [--trace taobao] [--path P] [--share 0.5] [--duration 30]

Runs the paper table's default setting (`simulator.table.TableConfig`: 32 nodes, 4,000 req/s)
once per regime at a static split with the caches' ghost lists on
(`SimConfig.ghost_probes`), and reports, over every node's control windows, the mean marginal
utilities that the nodes' `WindowStats` carry (`emb_marginal_us`, `kv_marginal_us`: busy time
per request that 10% more of the arena would have saved the EMB slab or the KV pool, from their
ghost lists, `node_agent.features.marginal_utility_us`), next to the mean busy time per request
and the run's P50 and P99. The first and second half of each run are reported apart (the trend
regime drifts). It says how much the split can move service time at all: when 10% of the arena
is worth tens of microseconds per request on either side against a P99 of tens of milliseconds,
no split moves P99 much.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np
import torch

from bench import load_bench_trace
from simulator import StaticAllocator, simulate
from simulator.table import GHOST_PROBES, TableConfig, sim_config
from workloads import REGIMES, generate


class _Recorder(StaticAllocator):
    """A static split that keeps each node's window figures."""

    def __init__(self, share: float) -> None:
        super().__init__(share)
        self.rows: list[tuple[float, float, float, float]] = []

    def control(self, node, stats, manager, now_s):
        busy_us = stats.load * stats.interval_s * 1e6 / stats.num_requests if stats.num_requests else 0.0
        self.rows.append((now_s, stats.emb_marginal_us, stats.kv_marginal_us, busy_us))
        return super().control(node, stats, manager, now_s)


def _summary(rows: np.ndarray) -> dict:
    if not len(rows):  # a run shorter than two control intervals has no decision to record
        return {"emb_marginal_us": None, "kv_marginal_us": None, "busy_us_per_request": None}
    return {"emb_marginal_us": round(float(rows[:, 1].mean()), 1), "kv_marginal_us": round(float(rows[:, 2].mean()), 1),
            "busy_us_per_request": round(float(rows[:, 3].mean()), 1)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.marginal", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace", default="taobao")
    ap.add_argument("--path", default=None)
    ap.add_argument("--share", type=float, default=0.5, help="the static emb_share of the runs")
    ap.add_argument("--duration", type=float, default=None, help="seconds per run (default: the table's)")
    args = ap.parse_args(argv)
    if not 0.0 <= args.share <= 1.0:
        ap.error(f"--share must be in [0, 1], got {args.share}")
    torch.set_num_threads(1)
    d = TableConfig(trace=args.trace, path=args.path)
    duration = args.duration or d.duration_s
    trace, name = load_bench_trace(args.trace, args.path)
    cfg = sim_config(d)
    cfg = replace(cfg, ghost_probes=GHOST_PROBES)
    out = {"trace": name, "nodes": cfg.num_nodes, "share": args.share, "ghost_probes": list(GHOST_PROBES),
           "duration_s": duration, "regimes": {}}
    for regime in REGIMES:
        try:
            s = generate(trace, regime=regime, rate_rps=d.rate_rps, duration_s=duration, num_users=d.num_users,
                         history_scale=d.history_scale, seed=d.seed)
        except ValueError as e:  # e.g. a duration too short for the regime's burst
            ap.error(str(e))
        rec = _Recorder(args.share)
        r = simulate(s, cfg, rec, "racer").summary()
        rows = np.array(rec.rows).reshape(-1, 4)
        half = rows[:, 0] <= duration / 2
        out["regimes"][regime] = {"p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"], **_summary(rows),
                                  "first_half": _summary(rows[half]), "second_half": _summary(rows[~half])}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{name}: {cfg.num_nodes} nodes at emb_share {args.share}; per request, what 10% more of the arena "
              "would save each cache")
        for regime, v in out["regimes"].items():
            for part in ("first_half", "second_half"):
                h = v[part]
                if h["emb_marginal_us"] is None:
                    print(f"{regime:<7} {part:<11} (no control interval ended)")
                    continue
                print(f"{regime:<7} {part:<11} EMB {h['emb_marginal_us']:>7.1f} us  KV {h['kv_marginal_us']:>7.1f} us  "
                      f"busy {h['busy_us_per_request']:>8.1f} us/request")
            print(f"{regime:<7} P50 {v['p50_ms']} ms, P99 {v['p99_ms']} ms")
    return out


if __name__ == "__main__":
    main()
