"""``racer bench paper-table``: the paper's table from the cluster simulator."""

from __future__ import annotations

import argparse
import json
import sys


def _floats(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated numbers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("want at least one number")
    return vals


def _names(text: str) -> tuple[str, ...]:
    vals = tuple(x.strip() for x in text.split(",") if x.strip())
    if not vals:
        raise argparse.ArgumentTypeError("want at least one name")
    return vals


def _table_config(args):
    """The `TableConfig` of ``racer bench paper-table``'s options (checked first: ValueError says
    which is wrong), before ``--load`` sets the rate."""
    from dataclasses import replace

    from workloads.regimes import REGIMES

    from .table import ROUTERS, TableConfig

    bad = [r for r in args.regimes if r not in REGIMES]
    if args.schedule is not None and args.seeds is not None:
        raise ValueError("--schedule runs one seed (--seed)")
    if bad:
        raise ValueError(f"unknown regime(s) {', '.join(bad)}; choose from {', '.join(REGIMES)}")
    bad = [r for r in (args.routers or ()) if r not in ROUTERS]
    if bad:
        raise ValueError(f"unknown router(s) {', '.join(bad)}; choose from {', '.join(ROUTERS)}")
    if args.seeds is not None and args.out is None:
        raise ValueError("--seeds needs --out")
    if args.seed is not None and args.seeds is not None:
        raise ValueError("give --seed or --seeds, not both")
    if args.seed is not None and args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    kw = {"trace": args.trace, "path": args.path, "regimes": args.regimes,
          "seed": args.seed if args.seed is not None else 0, "jobs": args.jobs}
    if args.nodes is not None:
        kw["num_nodes"] = args.nodes
    if args.setting == "paper-scale":
        pk = {"paper_scale": args.paper_scale} if args.paper_scale is not None else {}
        if args.nodes is not None:
            pk["num_nodes"] = args.nodes
        base = TableConfig.paper(quick=args.quick, **pk)
    else:
        if args.paper_scale is not None:
            raise ValueError("--paper-scale needs --setting paper-scale")
        base = TableConfig.quick() if args.quick else TableConfig()
    if args.schedule is not None:
        from workloads.regimes import parse_schedule

        parse_schedule(args.schedule)  # a clear error before anything runs
        kw["schedule"] = args.schedule
        kw["regimes"] = ("schedule",)
        if not args.allocators:
            kw["extra_allocators"] = usable_smart_allocators(("racer", "ppo"), args.policy)
    for name in ("rate", "duration", "users", "history_scale", "cache_fraction", "slo_ms", "profile", "policy"):
        v = getattr(args, name)
        if v is not None:
            kw[{"rate": "rate_rps", "duration": "duration_s", "users": "num_users"}.get(name, name)] = v
    if args.shares:
        kw["shares"] = args.shares
    if args.routers:
        kw["routers"] = args.routers
    # the SmartAllocator row (racer) is part of the paper's table unless --allocators says otherwise
    # (--allocators none: no SmartAllocator row); a schedule's default rows are set above
    if args.allocators and "none" in args.allocators:
        if len(args.allocators) > 1:
            raise ValueError("--allocators none cannot be combined with other allocators")
        kw["extra_allocators"] = ()
    elif args.allocators:
        kw["extra_allocators"] = tuple(args.allocators)
    elif "extra_allocators" not in kw:
        kw["extra_allocators"] = ("racer",)
    if args.nodes is not None and args.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
    if args.schedule is not None and not args.allocators:
        kw["extra_allocators"] = kw["extra_allocators"] + ("oracle_lookahead",)
    return replace(base, **kw)


def cmd_paper_table(args) -> int:
    from dataclasses import replace

    from .table import format_rows, run_table

    cfg = _table_config(args)
    load = None
    if args.load is not None:
        from .table import steady_capacity

        if not 0 < args.load <= 2:
            raise ValueError(f"--load must be in (0, 2], got {args.load:g}")
        if args.rate is not None:
            raise ValueError("give --rate or --load, not both")
        load = steady_capacity(cfg, progress=not args.no_progress)
        load["factor"] = args.load
        cfg = replace(cfg, rate_rps=round(args.load * load["capacity_rps"], 3))
        load["rate_rps"] = cfg.rate_rps
        why = (f"P99 <= the {cfg.slo_ms:g} ms SLO" if load["rule"] == "slo" else
               f"the SLO is met at no rate (light-load P99 {load['light_load_p99_ms']:g} ms): P99 <= "
               f"{load['limit_ms']:g} ms, twice that")
        print(f"capacity at static 0.5 ({why}): {load['capacity_rps_per_node']:g} req/s per node; "
              f"--load {args.load:g}: {cfg.rate_rps:g} req/s on {cfg.num_nodes} node(s)", file=sys.stderr)
    if args.seeds is not None:
        return _paper_table_seeds(cfg, args)
    result = run_table(cfg, args.out, progress=not args.no_progress, resume=not args.fresh)
    if load is not None:
        result["load"] = load
    runs = result["runs"]
    if runs["reused"]:
        print(f"reused {runs['reused']} of {runs['total']} runs saved in {args.out}/runs by the same code and "
              f"settings (--fresh recomputes them)", file=sys.stderr)
    if runs["unreadable"]:
        print(f"{runs['unreadable']} saved runs in {args.out}/runs could not be read back and were recomputed",
              file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_rows(result["rows"]))
        print(json.dumps(result["findings"], indent=1))
        print(f"wrote {args.out}/paper_table_{cfg.trace}.json and plots in {result['wall_s']} s" if args.out
              else f"done in {result['wall_s']} s (nothing saved: give --out DIR to keep the runs and plots)")
    return 0


def usable_smart_allocators(specs, policy=None) -> tuple[str, ...]:
    """``specs`` whose policy artifact loads here; for the others, say on stderr why they are left
    out (e.g. an artifact of another feature schema, while the shipped policy is retrained)."""
    from .smart import make_smart_allocator

    ok = []
    for spec in specs:
        try:
            make_smart_allocator(spec, policy).reset(1, 0.5)  # loads and checks the artifact
        except Exception as e:  # noqa: BLE001 - reported, the row is left out
            print(f"row {spec!r} left out: its policy does not load here: {e}", file=sys.stderr)
            continue
        ok.append(spec)
    return tuple(ok)


def _paper_table_seeds(cfg, args) -> int:
    from .table import format_seed_rows, run_seeds

    result = run_seeds(cfg, args.seeds, args.out, progress=not args.no_progress, resume=not args.fresh)
    reused = sum(v["runs"]["reused"] for v in result["per_seed"].values())
    if reused:
        print(f"reused {reused} runs saved under {args.out}/seed*/runs by the same code and settings "
              f"(--fresh recomputes them)", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_seed_rows(result["rows"]))
        print(json.dumps(result["findings"], indent=1))
        print(f"wrote {args.out}/paper_table_{cfg.trace}_seeds.json and one table per seed in "
              f"{args.out}/seed<S>/ in {result['wall_s']} s")
    return 0


def _seeds(text: str) -> tuple[int, ...]:
    """Comma-separated integers; `run_seeds` checks that they are distinct and >= 0."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None


def add_bench_parser(subparsers, more=()) -> argparse.ArgumentParser:
    """Add ``bench`` (with ``paper-table``) to racer's top-level subparsers; each of ``more`` is
    called with the bench's own subparsers to add a subcommand of its own (``racer bench fleet``)."""
    from workloads.loaders import LOADERS

    b = subparsers.add_parser("bench", help="experiments: the paper's table (simulator), the fleet A/B (real processes)",
                              description="Cluster-simulator experiments.")
    sub = b.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)
    p = sub.add_parser("paper-table", help="every (allocator, router) pair on each regime of a trace",
                       description="Run the paper's table in the cluster simulator: static splits (a sweep), "
                                   "best static, hit-rate heuristic and the per-window oracle, with every router, "
                                   "on the steady / trend / burst streams of one trace.")
    p.add_argument("--trace", required=True, choices=sorted(LOADERS), help="trace format")
    p.add_argument("--path", default=None, help="trace file (default: the sample under ../shared/data)")
    p.add_argument("--nodes", type=int, default=None,
                   help="cluster size (default 32; paper-scale: 4, 1 with --quick, a slice of the 32-node cluster)")
    p.add_argument("--setting", choices=("sample", "paper-scale"), default="sample",
                   help="sample: the sample trace as it is; paper-scale: the paper-scale setting and its scale "
                        "model (docs/simulator.md)")
    p.add_argument("--paper-scale", type=float, default=None,
                   help="the scale model's factor (default 1/192 = 0.005208...; 1/96, 1/384, ... keep whole rows "
                        "per page)")
    p.add_argument("--schedule", default=None,
                   help="regimes within one run, e.g. steady:60,trend:60,burst:30,steady:60 (rows per phase and "
                        "'all'; the best single static split for the whole run)")
    p.add_argument("--regimes", type=_names, default=("steady", "trend", "burst"),
                   help="comma-separated regimes (default steady,trend,burst)")
    p.add_argument("--out", default=None,
                   help="directory for the JSON, the plots and the saved runs (a rerun resumes from them); "
                        "without it nothing is saved")
    p.add_argument("--quick", action="store_true", help="a small, coarse table (smoke run, about a minute)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--rate", type=float, default=None, help="base request rate of the cluster, req/s")
    p.add_argument("--duration", type=float, default=None, help="simulated seconds per run")
    p.add_argument("--users", type=int, default=None, help="number of users")
    p.add_argument("--history-scale", type=float, default=None, help="stretch trace histories")
    p.add_argument("--cache-fraction", type=float, default=None,
                   help="cache bytes per node as a fraction of the embedding table")
    p.add_argument("--slo-ms", type=float, default=None, help="latency SLO (default 30)")
    p.add_argument("--profile", default=None,
                   help="cost profile: a100-hstu (default) or a JSON file written by `racer node profile`")
    p.add_argument("--shares", type=_floats, default=None, help="static split grid, e.g. 0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--routers", type=_names, default=None, help="routers to run (default: all six)")
    p.add_argument("--policy", default=None,
                   help="policy artifact directory of the SmartAllocator rows (default: policies/default)")
    p.add_argument("--allocators", type=_names, default=None,
                   help="extra allocators run with the racer router (default: racer, the SmartAllocator; none: no "
                        "extra row; "
                        "e.g. racer,ppo,ppo+residual,ppo+recovery; "
                        "add @ghost to run the residual adapter on the caches' marginal utilities, e.g. racer@ghost)")
    p.add_argument("--load", type=float, default=None,
                   help="run at this fraction of the cluster's steady capacity (the highest rate whose P99 meets "
                        "the SLO at static 0.5, found by the simulator before any allocator runs), e.g. 0.75")
    p.add_argument("--seed", type=int, default=None, help="the streams' seed (default 0)")
    p.add_argument("--seeds", type=_seeds, default=None,
                   help="run the table once per seed (e.g. 0,1,2), each in OUT/seed<S>/, and report each row's "
                        "mean, min and max across seeds in OUT/paper_table_<trace>_seeds.json")
    p.add_argument("--jobs", type=int, default=0, help="parallel runs (default: one per core)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--fresh", action="store_true",
                   help="recompute every run (default: reuse the runs saved in OUT/runs by the same code and "
                        "settings, so an interrupted table resumes)")
    p.set_defaults(func=cmd_paper_table)
    for add in more:
        add(sub)
    return b
