"""The router under load, in the simulator: ``python -m bench.router_load [--json]``.

Do no harm: the ``racer`` router's P99 must not be worse than ``least_load``'s at the same split.
For a grid of loads (``--loads``, fractions of the cluster's steady capacity) x regimes
(``--regimes``) x stream seeds (``--seeds``) x router seeds (``--router-seeds``, the seed of the
routers' tie-breaks), every router of ``--routers`` replays the same stream on the same simulated
cluster at static split 0.5, side by side in one run. The router seeds are there because a P99
moves with the router's own randomness alone (the printed ``least_load_router_seed_spread_pct``:
one stream replayed by ``least_load`` with each router seed), so one run per stream cannot tell
two routers 2% apart. ``racer`` is the
shipped router (`gateway.router.LoadAwareConfig` defaults); ``racer_plain`` the same
score without the load-aware rules (the paper's argmax of the expected time saved), to show
what they change.

Capacity, stated before any run: `simulator.table.steady_capacity` with ``least_load`` (the
highest steady rate whose P99 is within the SLO, or the knee rule where none is). The cluster is
``--nodes`` simulated nodes of the quick sample setting (``TableConfig.quick``: Taobao sample,
histories x4) over ``--duration-s`` seconds.

Printed: per cell, each router's P99 (median over every stream and router seed, and the
range), the ratio of racer's median P99 to least_load's, the paired ratio (the geometric mean
over runs with the same stream and router seed of racer's P99 over least_load's: the judged
figure, ``cells_above_tolerance``), the share of those pairs where racer's P99 is at most
least_load's, least_load's own spread over the router seeds of one stream (the noise a single
run carries), KV hit rates, and the largest node's share of requests over the mean (how much a
router piles up); ``findings`` gives the worst ratio and the cells above
``--tolerance-pct``. Benchmarks print figures; the test of the same rule on a small setting is
tests/test_router_load.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import numpy as np

ROUTERS = ("least_load", "racer", "racer_plain")


def _run_one(cfg, regime: str, router: str, router_seed: int) -> dict:
    from gateway.router import LoadAwareConfig
    from simulator import StaticAllocator, simulate
    from simulator.table import _stream, sim_config

    scfg = replace(sim_config(cfg), router_seed=router_seed)
    name = router
    if router == "racer_plain":
        scfg, router = replace(scfg, load_aware=LoadAwareConfig(enabled=False)), "racer"
    res = simulate(_stream(cfg, regime), scfg, StaticAllocator(0.5), router)
    s = res.summary()
    counts = np.bincount(res.node[res.node >= 0], minlength=cfg.num_nodes)
    return {"router": name, "seed": cfg.seed, "router_seed": router_seed, "p99_ms": s["p99_ms"],
            "p50_ms": s["p50_ms"], "kv_hit_rate": s["kv_hit_rate"], "emb_hit_rate": s["emb_hit_rate"], "max_over_mean": round(float(counts.max() / counts.mean()), 3)}


def run(nodes: int = 8, duration_s: float = 6.0, num_users: int = 4000, loads=(0.5, 0.75, 0.95),
        regimes=("steady", "trend", "burst"), seeds=(0, 1, 2), routers=ROUTERS, tolerance_pct: float = 2.0,
        capacity_rps: float | None = None, progress: bool = True, router_seeds=(0, 1, 2)) -> dict:
    from simulator.table import TableConfig, steady_capacity

    t0 = time.perf_counter()
    base = TableConfig.quick(num_nodes=nodes, rate_rps=100.0 * nodes, duration_s=duration_s, num_users=num_users)
    cap = None
    if capacity_rps is None:
        cap = steady_capacity(base, duration_s=duration_s, iters=3, router="least_load")
        capacity_rps = cap["capacity_rps"]
    rows = []
    for load in loads:
        for regime in regimes:
            per = {r: [] for r in routers}
            for seed in seeds:
                cfg = replace(base, rate_rps=capacity_rps * load, regimes=(regime,), seed=seed)
                for rs in router_seeds:
                    for r in routers:
                        per[r].append(_run_one(cfg, regime, r, rs))
            row = {"load": load, "regime": regime}
            for r in routers:
                p = [x["p99_ms"] for x in per[r]]
                row[r] = {"p99_ms": float(np.median(p)), "p99_min": min(p), "p99_max": max(p),
                          "kv_hit_rate": float(np.median([x["kv_hit_rate"] or 0.0 for x in per[r]])),
                          "max_over_mean": float(np.median([x["max_over_mean"] for x in per[r]])),
                          "seeds": per[r]}
            if "racer" in per and "least_load" in per:
                row["racer_over_least_load_pct"] = round(100.0 * (row["racer"]["p99_ms"] / row["least_load"]["p99_ms"]
                                                                  - 1.0), 2)
                pairs = [(a["p99_ms"], b["p99_ms"]) for a, b in zip(per["racer"], per["least_load"])]
                row["racer_at_most_least_load"] = round(sum(a <= b for a, b in pairs) / len(pairs), 3)
                ratio = np.exp(np.mean([np.log(a / b) for a, b in pairs]))  # same stream, same router seed
                row["racer_over_least_load_paired_pct"] = round(100.0 * (float(ratio) - 1.0), 2)
            if "least_load" in per and len(router_seeds) > 1:
                spreads = []
                for seed in seeds:
                    p = [x["p99_ms"] for x in per["least_load"] if x["seed"] == seed]
                    spreads.append(100.0 * (max(p) - min(p)) / float(np.median(p)))
                row["least_load_router_seed_spread_pct"] = round(float(np.median(spreads)), 1)
            rows.append(row)
            if progress:
                print(format_row(row, routers), file=sys.stderr, flush=True)
    ratios = [r["racer_over_least_load_pct"] for r in rows if "racer_over_least_load_pct" in r]
    paired = [r["racer_over_least_load_paired_pct"] for r in rows if "racer_over_least_load_paired_pct" in r]
    findings = {"worst_racer_over_least_load_pct": max(ratios) if ratios else None,
                "worst_racer_over_least_load_paired_pct": max(paired) if paired else None,
                "cells_above_tolerance": [f"{r['load']}/{r['regime']}" for r in rows
                                          if r.get("racer_over_least_load_paired_pct", -1e9) > tolerance_pct],
                "tolerance_pct": tolerance_pct}
    return {"nodes": nodes, "duration_s": duration_s, "num_users": num_users, "capacity_rps": capacity_rps,
            "capacity": cap, "seeds": list(seeds), "router_seeds": list(router_seeds), "rows": rows,
            "findings": findings, "wall_s": round(time.perf_counter() - t0, 1)}


def format_row(row: dict, routers) -> str:
    cells = []
    for r in routers:
        x = row[r]
        cells.append(f"{r} {x['p99_ms']:8.1f} [{x['p99_min']:.1f}-{x['p99_max']:.1f}] kv {x['kv_hit_rate']:.2f} "
                     f"max/mean {x['max_over_mean']:.2f}")
    pct = row.get("racer_over_least_load_pct")
    tail = "" if pct is None else (f" | racer/ll {pct:+.1f}%, paired {row['racer_over_least_load_paired_pct']:+.1f}% "
                                   f"(racer <= ll in {row['racer_at_most_least_load']:.0%} of pairs)")
    return f"{row['load']:<5g} {row['regime']:<7} " + " | ".join(cells) + tail


def format_table(res: dict) -> str:
    routers = [r for r in ROUTERS if r in res["rows"][0]] if res["rows"] else []
    head = "| load | regime | " + " | ".join(f"{r} P99 ms (median [range])" for r in routers) + \
        (" | racer over least_load (medians) | paired | racer <= least_load (pairs) | least_load's router-seed "
         "spread | KV hit (" + " / ".join(routers) + ") | max/mean node (" + " / ".join(routers) + ") |")
    lines = [f"capacity {res['capacity_rps']:g} req/s on {res['nodes']} nodes; seeds {res['seeds']}; "
             f"router seeds {res['router_seeds']}; {res['duration_s']:g} s runs", head,
             "|" + "---|" * (head.count("|") - 1)]
    for row in res["rows"]:
        p = " | ".join(f"{row[r]['p99_ms']:.1f} [{row[r]['p99_min']:.1f}-{row[r]['p99_max']:.1f}]" for r in routers)
        kv = " / ".join(f"{row[r]['kv_hit_rate']:.2f}" for r in routers)
        mm = " / ".join(f"{row[r]['max_over_mean']:.2f}" for r in routers)
        pct = row.get("racer_over_least_load_pct")
        pairs = row.get("racer_at_most_least_load")
        spread = row.get("least_load_router_seed_spread_pct")
        pp = row.get("racer_over_least_load_paired_pct")
        cells = ("" if pct is None else f"{pct:+.1f}%", "" if pp is None else f"{pp:+.1f}%",
                 "" if pairs is None else f"{pairs:.0%}", "" if spread is None else f"{spread:.1f}%")
        lines.append(f"| {row['load']:g} | {row['regime']} | {p} | " + " | ".join(cells) + f" | {kv} | {mm} |")
    lines.append("findings: " + json.dumps(res["findings"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.router_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--duration-s", type=float, default=6.0)
    p.add_argument("--num-users", type=int, default=4000)
    p.add_argument("--loads", default="0.5,0.75,0.95")
    p.add_argument("--regimes", default="steady,trend,burst")
    p.add_argument("--seeds", default="0,1,2", help="stream seeds")
    p.add_argument("--router-seeds", default="0,1,2", help="seeds of the routers' tie-breaks, each stream replayed "
                   "with every one")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--capacity-rps", type=float, default=None, help="skip the capacity search (req/s, whole cluster)")
    p.add_argument("--tolerance-pct", type=float, default=2.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    routers = tuple(x for x in a.routers.split(",") if x)
    bad = [r for r in routers if r not in ROUTERS]
    if bad or a.nodes < 1 or a.duration_s <= 0:
        p.error(f"--routers from {', '.join(ROUTERS)}; --nodes >= 1; --duration-s > 0 (got {bad or ''})")
    res = run(a.nodes, a.duration_s, a.num_users, tuple(float(x) for x in a.loads.split(",")),
              tuple(a.regimes.split(",")), tuple(int(x) for x in a.seeds.split(",")), routers, a.tolerance_pct,
              a.capacity_rps, router_seeds=tuple(int(x) for x in a.router_seeds.split(",")))
    print(json.dumps(res) if a.json else format_table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
