"""How much can any per-window allocator gain over the best static split, across calibrations?

    python -m bench.oracle_gap [--json] [--traces taobao,amazon] [--regimes steady]
                               [--kv-kib 6,24,96] [--cache-fractions 0.25,1,4] [--nodes 8] ...

For every (trace, KV bytes per token, cache fraction, regime) it runs the static sweep and the
greedy replay oracle (`simulator.cluster.oracle_replay`, which tries every grid share on every
control window from its own state, in hindsight) on one request stream, and reports the best static
split's P99 over the oracle's (``gap``: 0.10 = the best static split's P99 is 10% above the
oracle's). The KV bytes per token stand for the model's size (96 KiB: the default HSTU-scale
profile, 24 layers x 1024 x bf16 K and V; 6 KiB: a 4-layer, 384-wide model), the cache fraction
for the memory a node gives the two caches (x the trace's embedding table). The default setting
is the paper table's per-node load on 8 nodes (1,000 req/s) for 20 s, so a full sweep takes a few
minutes per regime on two cores.

``gap`` bounds what the split can be worth: an allocator that beats the best static split's P99 by
X% on a regime needs an X% gap there, unless it finds what a replay of every grid share per
window does not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

# The calibration grid (the defaults below), defined once in policies.env, whose
# `calibration_settings` trains on the same points
from policies.env import CALIBRATION_CACHE_FRACTIONS as CACHE_FRACTIONS
from policies.env import CALIBRATION_HISTORY_SCALE as HISTORY_SCALE
from policies.env import CALIBRATION_KV_KIB as KV_KIB
from policies.env import CALIBRATION_NODES as NODES
from policies.env import CALIBRATION_RATE_RPS as RATE_RPS
from policies.env import CALIBRATION_USERS as USERS


def _job(args) -> dict:
    import torch

    from simulator import SimConfig, StaticAllocator, simulate
    from simulator.cluster import memory_config, oracle_replay
    from simulator.profiles import A100_HSTU
    from workloads import generate

    from . import load_bench_trace

    torch.set_num_threads(1)
    trace_kind, kv_kib, cf, regime, o = args
    trace, _ = load_bench_trace(trace_kind, None)
    stream = generate(trace, regime=regime, rate_rps=o["rate"], duration_s=o["duration"], num_users=o["users"],
                      history_scale=o["history_scale"], seed=o["seed"])
    cfg = SimConfig(num_nodes=o["nodes"], profile=replace(A100_HSTU, kv_bytes_per_token=int(kv_kib * 1024)),
                    cache_fraction=cf, seed=o["seed"])
    mcfg = memory_config(trace.num_items, cfg)
    t0 = time.perf_counter()
    static = {}
    for share in o["shares"]:
        r = simulate(stream, cfg, StaticAllocator(share), "racer").summary()
        static[f"{share:.2f}"] = {k: r[k] for k in ("p99_ms", "slo_attainment", "emb_hit_rate", "kv_hit_rate")}
    res, schedule = oracle_replay(stream, cfg, o["shares"], "racer")
    orc = res.summary()
    best = min(static, key=lambda k: static[k]["p99_ms"])
    best_p99 = static[best]["p99_ms"]
    user_tokens = float(np.mean(stream.history_len))
    return {"trace": trace_kind, "kv_kib": kv_kib, "cache_fraction": cf, "regime": regime,
            # how many mean histories the whole arena would hold as K/V
            "arena_holds_histories": round(mcfg.num_pages * mcfg.page_bytes / (user_tokens * cfg.profile.kv_bytes_per_token), 1),
            "static": static, "best_static": best, "best_static_p99_ms": best_p99,
            "static_p99_spread": round(max(v["p99_ms"] for v in static.values()) / best_p99 - 1, 4),
            "oracle_p99_ms": orc["p99_ms"], "oracle_slo_attainment": orc["slo_attainment"],
            "oracle_mean_share": round(float(np.mean(schedule)), 3),
            "gap": round(best_p99 / orc["p99_ms"] - 1, 4), "wall_s": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> dict:
    from simulator.cli import _floats
    from simulator.table import TableConfig

    ap = argparse.ArgumentParser(prog="python -m bench.oracle_gap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--traces", default="taobao,amazon")
    ap.add_argument("--regimes", default="steady")
    ap.add_argument("--kv-kib", type=_floats, default=KV_KIB, help="KV bytes per token, KiB")
    ap.add_argument("--cache-fractions", type=_floats, default=CACHE_FRACTIONS)
    ap.add_argument("--shares", type=_floats, default=TableConfig().shares)
    ap.add_argument("--nodes", type=int, default=NODES)
    ap.add_argument("--rate", type=float, default=RATE_RPS)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--users", type=int, default=USERS)
    ap.add_argument("--history-scale", type=float, default=HISTORY_SCALE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=0, help="worker processes (0: one per core)")
    ap.add_argument("--out", default=None,
                    help="directory for oracle_gap.json and oracle_gap.png (gap against how much the split matters)")
    args = ap.parse_args(argv)

    from simulator import SimConfig
    from simulator.cluster import memory_config
    from simulator.profiles import A100_HSTU
    from workloads import LOADERS, REGIMES

    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    problems = [f"unknown trace {t!r} (one of {', '.join(LOADERS)})" for t in traces if t not in LOADERS]
    problems += [f"unknown regime {r!r} (one of {', '.join(REGIMES)})" for r in regimes if r not in REGIMES]
    if not (traces and regimes):  # the number lists are checked by `_floats`
        problems.append("--traces and --regimes must each name at least one")
    if any(not 0 <= s <= 1 for s in args.shares):
        problems.append("--shares must be in [0, 1]")
    if len({f"{x:.2f}" for x in args.shares}) != len(args.shares):
        problems.append("--shares must differ by at least 0.01 (rows are labelled to two decimals)")
    for kv in args.kv_kib:  # the simulator's own check of the sizes (`memory_config`)
        b = kv * 1024
        try:
            if not (math.isfinite(b) and b > 0 and b == int(b)):
                raise ValueError("not a whole number of bytes > 0")
            memory_config(1, SimConfig(num_nodes=1, profile=replace(A100_HSTU, kv_bytes_per_token=int(b))))
        except ValueError as e:
            problems.append(f"--kv-kib {kv:g}: {e} (e.g. 1, 6, 24, 96)")
    for name in ("nodes", "rate", "duration", "users", "history_scale"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v > 0):
            problems.append(f"--{name.replace('_', '-')} must be a finite number > 0, got {v}")
    if args.seed < 0 or args.jobs < 0:
        problems.append("--seed and --jobs must be >= 0")
    if not problems:  # the streams' own checks (e.g. a burst that does not fit the duration)
        from workloads import RegimeConfig

        for r in regimes:
            try:
                RegimeConfig(regime=r, rate_rps=args.rate, duration_s=args.duration, num_users=args.users,
                             history_scale=args.history_scale, seed=args.seed).validate()
            except ValueError as e:
                problems.append(str(e))
    for cf in args.cache_fractions:
        try:
            SimConfig(num_nodes=1, cache_fraction=cf).validate()
        except ValueError as e:
            problems.append(str(e))
    if args.out:
        try:
            Path(args.out).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            problems.append(f"--out {args.out}: {e.strerror or e}")
    if problems:
        ap.error("; ".join(problems))

    opts = {"nodes": args.nodes, "rate": args.rate, "duration": args.duration, "users": args.users,
            "history_scale": args.history_scale, "seed": args.seed, "shares": tuple(args.shares)}
    jobs = [(t, kv, cf, r, opts) for t in traces for kv in args.kv_kib for cf in args.cache_fractions for r in regimes]
    workers = args.jobs or min(len(jobs), os.cpu_count() or 1)
    t0 = time.perf_counter()
    rows = []
    from tqdm import tqdm

    with ProcessPoolExecutor(workers) as ex:
        for res in tqdm(ex.map(_job, jobs), total=len(jobs), desc="oracle gap", unit="setting", leave=False):
            rows.append(res)
    out = {"settings": opts, "rows": rows, "wall_s": round(time.perf_counter() - t0, 1),
           "max_gap": {r: max(x["gap"] for x in rows if x["regime"] == r) for r in regimes}}
    out["one_split"] = one_split(rows)
    if args.out:
        d = Path(args.out)
        (d / "oracle_gap.json").write_text(json.dumps(out, indent=1))
        out["plot"] = str(plot(rows, d / "oracle_gap.png"))
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{'trace':<8} {'KV KiB/tok':>10} {'cache x':>7} {'holds':>6} {'regime':<7} {'best static':>16} "
              f"{'oracle':>9} {'gap':>7} {'static spread':>13}")
        for x in rows:
            print(f"{x['trace']:<8} {x['kv_kib']:>10g} {x['cache_fraction']:>7g} {x['arena_holds_histories']:>6g} "
                  f"{x['regime']:<7} {x['best_static_p99_ms']:>9.2f} ({x['best_static']}) {x['oracle_p99_ms']:>9.2f} "
                  f"{100 * x['gap']:>6.1f}% {100 * x['static_p99_spread']:>12.1f}%")
        for r, g in out["max_gap"].items():
            print(f"largest gap on {r}: {100 * g:.1f}%")
        if out["one_split"]["settings"]:
            print(f"one split for all regimes: at most {100 * out['one_split']['max_gap']:.1f}% above the oracle")
        if "plot" in out:
            print(f"wrote {args.out}/oracle_gap.json and {out['plot']}")
    return out


def one_split(rows: list[dict]) -> dict:
    """Where a setting ran more than one regime: the single grid share best for all of them (the
    lowest sum over regimes of its P99 over the oracle's) and, per regime, its P99 over the
    oracle's (what one split chosen in hindsight for the whole fleet leaves)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["trace"], r["kv_kib"], r["cache_fraction"]), {})[r["regime"]] = r
    settings = []
    for (trace, kv, cf), by in groups.items():
        if len(by) < 2:
            continue
        shares = list(next(iter(by.values()))["static"])
        best = min(shares, key=lambda s: sum(x["static"][s]["p99_ms"] / x["oracle_p99_ms"] for x in by.values()))
        settings.append({"trace": trace, "kv_kib": kv, "cache_fraction": cf, "share": best,
                         "gap": {rg: round(x["static"][best]["p99_ms"] / x["oracle_p99_ms"] - 1, 4)
                                 for rg, x in by.items()}})
    return {"settings": settings,
            "max_gap": max((g for x in settings for g in x["gap"].values()), default=None)}


def plot(rows: list[dict], path) -> str:
    """One point per setting: how much the split matters (the static splits' P99 spread, x) against
    what a per-window split adds over the best static one (the oracle's gap, y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    colors = {"steady": "tab:blue", "trend": "tab:orange", "burst": "tab:red"}
    markers = ["o", "s", "^", "D"]
    traces = sorted({r["trace"] for r in rows})
    for r in rows:
        ax.scatter(max(r["static_p99_spread"], 1e-3) * 100, r["gap"] * 100, color=colors.get(r["regime"], "grey"),
                   marker=markers[traces.index(r["trace"]) % len(markers)], alpha=0.8)
    for rg, c in colors.items():
        if any(r["regime"] == rg for r in rows):
            ax.scatter([], [], color=c, label=rg)
    for i, t in enumerate(traces):
        ax.scatter([], [], color="black", marker=markers[i % len(markers)], label=t)
    ax.axhline(24, color="crimson", ls="--", lw=1, label="24% (the paper's P99 reduction)")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("static splits' P99 spread: worst over best (%)")
    ax.set_ylabel("best static P99 over the oracle's (%)")
    ax.set_title("How much the split matters vs what a per-window split adds")
    ax.legend(fontsize=8, loc="center left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


if __name__ == "__main__":
    main()
