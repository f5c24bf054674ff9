"""``racer workload`` (describe and plot traces and their regimes) and ``racer replay`` (the
open-loop load generator); racer/cli.py registers them with `add_workload_parser` and
`add_replay_parser`."""

from __future__ import annotations

import argparse
import json

from common.config import add_config_arguments, config_kwargs

from .errors import UsageError

# options whose default, help and range are read from the config's fields
REGIME_FIELDS = ("rate_rps", "history_scale")  # workloads.regimes.RegimeConfig
REPLAY_FIELDS = ("rate_rps", "max_history_len", "num_candidates", "top_k", "slo_ms", "timeout_s",
                 "retries")  # workloads.replay.ReplayConfig


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    from workloads.loaders import LOADERS

    p.add_argument("--trace", required=True, choices=sorted(LOADERS), help="trace format")
    p.add_argument("--path", default=None,
                   help="trace file (default: the sample under $RACER_DATA_DIR or ../shared/data)")
    p.add_argument("--item-path", default=None, help="amazon only: RecBole item file for categories")
    p.add_argument("--num-shards", type=int, default=64, help="embedding shards for the item -> shard map (default 64)")
    p.add_argument("--max-rows", type=int, default=None, help="read at most this many interactions")


def _add_regime_args(p: argparse.ArgumentParser, regime_required: bool) -> None:
    from workloads.regimes import REGIMES, RegimeConfig

    p.add_argument("--regime", choices=REGIMES, required=regime_required, help="workload regime")
    p.add_argument("--duration", type=float, default=120.0, help="run length, s (default 120)")
    p.add_argument("--users", type=int, default=None, help="number of users (default: the trace's; more are resampled)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    add_config_arguments(p, RegimeConfig, REGIME_FIELDS, flags={"rate_rps": "--rate"},
                         helps={"rate_rps": "base request rate, req/s",
                                "history_scale": "stretch trace histories by this factor"})


def _load(args):
    from workloads.loaders import load_trace

    kwargs = {"num_shards": args.num_shards, "max_rows": args.max_rows}
    if args.item_path:
        if args.trace != "amazon":
            raise UsageError("--item-path applies to --trace amazon only")
        kwargs["item_path"] = args.item_path
    if args.num_shards < 1:
        raise UsageError(f"--num-shards must be >= 1, got {args.num_shards}")
    return load_trace(args.trace, args.path, **kwargs)


def _stream(trace, args):
    from workloads.regimes import generate

    return generate(trace, regime=args.regime, duration_s=args.duration, num_users=args.users, seed=args.seed,
                    **config_kwargs(args, REGIME_FIELDS))


def _round_figures(value, digits: int = 4):
    """Floats rounded to ``digits`` decimals (lengths are rounded to one decimal at the source),
    so no figure prints as 0.13333333333333333 or 197.83999999999924."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: _round_figures(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [_round_figures(v, digits) for v in value]
    return value


def cmd_workload_describe(args) -> int:
    trace = _load(args)
    out = trace.describe()
    if args.regime:
        stream = _stream(trace, args)
        out["stream"] = stream.summary()
    out = _round_figures(out)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            if isinstance(v, dict):
                print(f"{k}:")
                for k2, v2 in v.items():
                    print(f"  {k2:<24} {v2}")
            else:
                print(f"{k:<24} {v}")
    return 0


def cmd_workload_plot(args) -> int:
    from workloads.plot import write_stream_plots

    trace = _load(args)
    stream = _stream(trace, args)
    paths = write_stream_plots(stream, args.out, window_s=args.window)
    summary = {"files": paths, "num_requests": len(stream), "bursts_s": stream.bursts}
    print(json.dumps(summary) if args.json else "\n".join(f"wrote {p}" for p in paths.values()))
    return 0


def cmd_replay(args) -> int:
    from workloads.replay import ReplayConfig, parse_phases, replay

    if (args.regime is None) == (args.schedule is None):
        raise UsageError("give one of --regime R or --schedule steady,trend,burst (or steady:60,trend:60,...)")
    schedule, phase_s = ((args.regime,), None) if args.regime else parse_phases(args.schedule)
    duration_s = 60.0 if args.duration is None else args.duration
    if phase_s is not None:
        total_s = sum(phase_s)
        if args.duration is not None and abs(args.duration - total_s) > 1e-9 * max(1.0, total_s):
            raise UsageError(f"--duration {args.duration:g} differs from the schedule's {total_s:g} s "
                             f"({args.schedule}): with REGIME:SECONDS phases the run lasts their sum; "
                             f"leave --duration out")
        duration_s = total_s
    targets = [t.strip() for t in args.gateway.split(",") if t.strip()]
    for t in targets:
        if not t.startswith(("http://", "https://")):
            raise UsageError(f"--gateway: {t!r} is not an http:// or https:// URL")
    if not targets:
        raise UsageError("--gateway: give the gateway's URL (or node agents' URLs, comma-separated)")
    config = ReplayConfig(schedule=schedule, phase_s=phase_s, duration_s=duration_s, seed=args.seed,
                          num_users=args.users, **config_kwargs(args, REPLAY_FIELDS))
    trace = _load(args)
    out = replay(targets, trace, config, progress=not args.no_progress)
    if args.json:
        print(json.dumps(out))
    else:
        lat = out["latency_ms"]
        print(f"sent {out['requests_sent']}  served {out['requests_served']}  failed {out['requests_failed']} "
              f"{out['failures'] or ''}  retried {out['requests_retried']}  lost {out['requests_lost']}")
        print(f"latency ms  p50 {lat['p50']}  p90 {lat['p90']}  p99 {lat['p99']}  max {lat['max']}")
        print(f"SLO {args.slo_ms:g} ms attainment {out['slo_attainment']}  offered {out['offered_rps']} req/s  "
              f"served {out['served_rps']} req/s")
        for phase, r in out["phases"].items():
            print(f"  {phase:<22} sent {r['requests_sent']:>6}  p99 {r['p99_ms']} ms  SLO {r['slo_attainment']}")
        if len(out["regimes"]) < len(out["phases"]):  # a regime played in several phases: its whole too
            for regime, r in out["regimes"].items():
                print(f"  {regime:<22} sent {r['requests_sent']:>6}  p99 {r['p99_ms']} ms  SLO {r['slo_attainment']}")
    return 0 if out["requests_lost"] == 0 else 1


def add_workload_parser(sub) -> None:
    """Add ``workload`` (``describe``, ``plot``) to racer's top-level subparsers."""
    wl = sub.add_parser("workload", help="load traces, describe them, generate and plot request streams",
                        description="Real-trace workloads and the steady / trend / burst regimes.")
    wl_sub = wl.add_subparsers(dest="workload_command", metavar="SUBCOMMAND", required=True)

    d = wl_sub.add_parser("describe", help="statistics of a trace (and of a generated stream with --regime)",
                          description="Print a trace's statistics; with --regime, also the generated stream's.")
    _add_trace_args(d)
    _add_regime_args(d, regime_required=False)
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=cmd_workload_describe)

    pl = wl_sub.add_parser("plot", help="plot request rate and hot-user ratio of a regime over time",
                           description="Write an HTML and a PNG plot of a generated stream (bursts shaded).")
    _add_trace_args(pl)
    _add_regime_args(pl, regime_required=True)
    pl.add_argument("--out", required=True, help="output directory")
    pl.add_argument("--window", type=float, default=1.0, help="statistics window, s (default 1)")
    pl.add_argument("--json", action="store_true", help="print the written paths as JSON")
    pl.set_defaults(func=cmd_workload_plot)


def add_replay_parser(sub) -> None:
    """Add ``replay`` to racer's top-level subparsers."""
    from workloads.regimes import REGIMES
    from workloads.replay import ReplayConfig

    rp = sub.add_parser("replay", help="open-loop load generator: replay a trace through regimes against a gateway",
                        description="Send a trace's requests (steady / trend / burst streams) to a gateway, or to "
                                    "node agents directly, at their scheduled times whether or not earlier ones "
                                    "returned; report served, failed and retried requests, latency percentiles and "
                                    "SLO attainment.")
    _add_trace_args(rp)
    rp.add_argument("--regime", choices=REGIMES, default=None, help="one regime for the whole run")
    rp.add_argument("--schedule", default=None,
                    help="regimes in order: steady,trend,burst (equal parts of --duration, each its own stream) or "
                         "REGIME:SECONDS,... e.g. steady:60,trend:60,burst:30,steady:60 (one stream, users keep "
                         "their identity and histories across phases; the run lasts the sum)")
    rp.add_argument("--duration", type=float, default=None,
                    help="run length, s (default 60; with a REGIME:SECONDS schedule, the phases' sum)")
    rp.add_argument("--gateway", required=True, help="gateway URL (or node agents' URLs, comma-separated: round "
                                                     "robin)")
    rp.add_argument("--users", type=int, default=None, help="number of users (default: the trace's)")
    rp.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    add_config_arguments(rp, ReplayConfig, REPLAY_FIELDS, flags={"rate_rps": "--rate"},
                         helps={"max_history_len": "most history + new items per request; at most the agents' "
                                                   "--max-history-len",
                                "retries": "client retries on the next target after a connection error, timeout "
                                           "or 5xx"})
    rp.add_argument("--json", action="store_true", help="print the report as one JSON object")
    rp.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    rp.set_defaults(func=cmd_replay)
