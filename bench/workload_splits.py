"""The best static split of each request stream in the simulator: does the session model move it
toward the trace's own time order, and do the fleet workloads differ?

    python -m bench.workload_splits --json                       # the sample setting, ~4 minutes on 2 cores
    python -m bench.workload_splits --setting sample,fleet --json  # both settings, ~6 minutes

Streams, all from one trace at one rate and duration, with the same request shape:

- ``independent``: `workloads.regimes` steady (every request's user drawn on its own, the
  trace's users);
- ``sessions``: `workloads.sessions.session_stream` (the trace's users in sessions fitted to it);
- ``trace-order``: `workloads.sessions.trace_order_stream` from the request at
  `workloads.fleet_workloads.TRACE_ORDER_START` of the trace (the fleet workload of that name);
- ``shuffled``: the trace-order stream's requests with their arrival times dealt out across users
  at random (each user keeps its own order, histories and new items): the trace-order stream
  with users shuffled in time, the control that isolates *when* users come;
- ``kv-heavy``, ``emb-heavy``, ``day``: the fleet workloads (`workloads.fleet_workloads`).

For each stream, a cluster of ``--nodes`` nodes (the RACER router) runs each static split of
``--shares``; the best static split is the one with the lowest P99 (the simulator's own rule,
`simulator.table`); its P99 curve over the splits is printed with it.

Settings (``--setting``):

- ``fleet``: the fleet bench's sizing (`bench.fleet.Sizing`) in the simulator: the arena 1.4% of
  the embedding table, a K/V per token that puts ~500 histories of 96 tokens in the arena (256
  bytes per token, 64-token pages of one 16 KiB row, as `simulator.profiles.PaperScale` shrinks
  the byte sizes and keeps every time cost), histories capped at 96 tokens, 32 new items at most,
  32 candidates;
- ``sample``: the simulator table's sample setting (`simulator.table.TableConfig`): the A100 HSTU
  profile as it is, the arena the size of the embedding table (``cache_fraction`` 1), 256
  candidates, histories as the trace has them.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import numpy as np

from bench import load_bench_trace

STREAMS = ("independent", "sessions", "trace-order", "shuffled", "kv-heavy", "emb-heavy", "day")
SETTINGS = ("sample", "fleet")
SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


#: per setting: nodes, the rate the capacity search starts from, the run's duration (s)
SETTING_RUN = {"fleet": (1, 4000.0, 5.0), "sample": (4, 400.0, 10.0)}
SLO_MS = 30.0  # the simulator's SLO: the capacity rule's limit


def setting(name: str, num_items: int, nodes: int, seed: int):
    """(SimConfig, StreamShape) of a setting (see the module docstring)."""
    from simulator.cluster import SimConfig
    from simulator.profiles import A100_HSTU
    from workloads.sessions import StreamShape

    if name == "fleet":
        prof = replace(A100_HSTU, name="a100-hstu@fleet-sizing", kv_bytes_per_token=256, page_tokens=64).validate()
        cache = int(0.014 * num_items * prof.emb_row_bytes)
        return (SimConfig(num_nodes=nodes, profile=prof, cache_bytes=cache, slo_ms=SLO_MS, seed=seed),
                StreamShape(num_candidates=32, max_new_items=32, max_history_len=96))
    if name == "sample":
        return (SimConfig(num_nodes=nodes, cache_fraction=1.0, slo_ms=SLO_MS, seed=seed),
                StreamShape(num_candidates=256, history_scale=10.0))
    raise ValueError(f"unknown setting {name!r}; choose one of {', '.join(SETTINGS)}")


def capacity(setting_name: str, trace, nodes: int, start_rps: float, seed: int = 0, duration_s: float = 5.0,
             iters: int = 4) -> dict:
    """The setting's steady capacity, found before any other run: the highest rate whose
    ``independent`` stream keeps P99 within `SLO_MS` at static 0.5 (doubling or halving from
    ``start_rps``, then ``iters`` bisections: `simulator.capacity.bracket_and_bisect`, the rule of
    `simulator.table.steady_capacity`)."""
    from simulator.allocators import StaticAllocator
    from simulator.capacity import bracket_and_bisect
    from simulator.cluster import simulate

    scfg, shape = setting(setting_name, trace.num_items, nodes, seed)
    probes = []

    def passes(rate: float) -> bool:
        s, _ = make_stream("independent", trace, rate, duration_s, seed, shape)
        p99 = float(simulate(s, scfg, StaticAllocator(0.5)).summary()["p99_ms"])
        probes.append([round(rate, 1), round(p99, 2)])
        return p99 <= SLO_MS

    found = bracket_and_bisect(passes, start_rps, iters, max_bracket_probes=8)
    if found.lo is None:
        raise ValueError(f"setting {setting_name}: no rate down to {found.stop_rate:g} req/s keeps P99 within "
                         f"{SLO_MS:g} ms: probes {probes}")
    return {"capacity_rps": round(found.lo, 1), "rule": f"independent stream, static 0.5, P99 <= {SLO_MS:g} ms",
            "probe_duration_s": duration_s, "probes": probes}


def shuffled(stream, seed: int):
    """``stream`` with its arrival times dealt out to its requests at random, then each user's
    requests put back in their own order over the times the user drew (histories, new items and
    each user's sequence unchanged)."""
    from workloads.sessions import assemble

    rng = np.random.default_rng([seed, 31])
    n = len(stream)
    perm = rng.permutation(n)  # request i takes time slot perm[i]
    by_user = np.lexsort((np.arange(n), stream.user))  # each user's requests in their order
    slots = perm[by_user]
    # a user's k-th request takes the user's k-th earliest slot
    grp_sorted = np.lexsort((slots, stream.user[by_user]))
    new_slot = np.empty(n, dtype=np.int64)
    new_slot[by_user] = slots[grp_sorted]
    order = np.argsort(new_slot, kind="stable")
    return assemble(stream.trace, stream.config, stream.arrival_s[np.sort(new_slot)], stream.user[order],
                    stream.history_len[order].astype(np.int64), stream.num_new_items[order].astype(np.int64),
                    stream.base_user.astype(np.int64), stream.rotation.astype(np.int64))


def make_stream(name: str, trace, rate_rps: float, duration_s: float, seed: int, shape):
    """Stream ``name`` (one of `STREAMS`) and its modelled seconds per run second (None where it has
    no modelled clock)."""
    from workloads.fleet_workloads import modelled_workload
    from workloads.regimes import generate
    from workloads.sessions import modelled_session_stream

    if name == "independent":
        s = generate(trace, regime="steady", rate_rps=rate_rps, duration_s=duration_s, seed=seed,
                     num_candidates=shape.num_candidates, max_new_items=shape.max_new_items,
                     max_history_len=shape.max_history_len, history_scale=shape.history_scale)
        return s, None
    if name == "sessions":
        m = modelled_session_stream(trace, rate_rps=rate_rps, duration_s=duration_s, seed=seed, shape=shape)
        return m.stream, m.modelled_s_per_s
    if name == "shuffled":
        m = modelled_workload("trace-order", trace, rate_rps=rate_rps, duration_s=duration_s, seed=seed, shape=shape)
        return shuffled(m.stream, seed), m.modelled_s_per_s
    if name in ("trace-order", "kv-heavy", "emb-heavy", "day"):
        m = modelled_workload(name, trace, rate_rps=rate_rps, duration_s=duration_s, seed=seed, shape=shape)
        return m.stream, (m.modelled_s_per_s if name != "emb-heavy" else None)
    raise ValueError(f"unknown stream {name!r}; choose one of {', '.join(STREAMS)}")


_CACHE: dict = {}


def _run(args) -> tuple[str, str, float, dict]:
    import torch

    from simulator.allocators import StaticAllocator
    from simulator.cluster import simulate

    torch.set_num_threads(1)
    setting_name, stream_name, share, trace_kind, path, nodes, rate, duration, seed = args
    key = (setting_name, stream_name)
    if key not in _CACHE:
        trace, _ = _CACHE.setdefault(("trace", trace_kind, path), load_bench_trace(trace_kind, path))
        scfg, shape = setting(setting_name, trace.num_items, nodes, seed)
        _CACHE[key] = (make_stream(stream_name, trace, rate, duration, seed, shape)[0], scfg)
    stream, scfg = _CACHE[key]
    res = simulate(stream, scfg, StaticAllocator(share)).summary()
    return setting_name, stream_name, share, {k: res[k] for k in ("p50_ms", "p99_ms", "slo_attainment",
                                                                  "emb_hit_rate", "kv_hit_rate")}


def stream_figures(name: str, trace, rate: float, duration: float, seed: int, shape) -> dict:
    """What the stream is, before any run (`workloads.fleet_workloads.stream_figures`)."""
    from workloads.fleet_workloads import stream_figures as figures
    from workloads.sessions import Modelled

    s, scale = make_stream(name, trace, rate, duration, seed, shape)
    f = figures(Modelled(s, scale or 1.0))
    keep = ("num_requests", "num_users", "history_len_mean", "new_user_share", "user_return_p50_s")
    out = {k: f[k] for k in keep}
    if scale is not None:
        out["modelled_span_h"] = f["modelled_span_h"]
        out["recent_share_10min"] = f["recent_share_10min"]
    return out


def run(trace_kind: str = "taobao", path: str | None = None, settings=SETTINGS, streams=STREAMS, shares=SHARES,
        load: float = 0.75, nodes: int | None = None, rate_rps: float | None = None, duration_s: float | None = None,
        seed: int = 0, jobs: int = 1) -> dict:
    """Every stream's static sweep in every setting; the rate is ``load`` x the setting's
    `capacity` unless ``rate_rps`` is given (``nodes`` / ``duration_s``: `SETTING_RUN`'s unless
    given)."""
    trace, trace_name = load_bench_trace(trace_kind, path)
    t0 = time.perf_counter()
    out = {"trace": trace_name, "seed": seed, "shares": list(shares), "settings": {}}
    plan = {}
    for st in settings:
        n0, start, d0 = SETTING_RUN[st]
        n, d = nodes or n0, duration_s or d0
        cap = None
        if rate_rps is None:
            cap = capacity(st, trace, n, start * n / n0, seed)
        rate = float(rate_rps) if rate_rps is not None else round(load * cap["capacity_rps"], 1)
        plan[st] = (n, rate, d, cap)
    jobs_list = [(st, sn, float(sh), trace_kind, path, plan[st][0], plan[st][1], plan[st][2], seed)
                 for st in settings for sn in streams for sh in shares]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(_run, jobs_list, chunksize=len(shares)))
    else:
        results = [_run(a) for a in jobs_list]
    for st in settings:
        n, rate, d, cap = plan[st]
        shape = setting(st, trace.num_items, n, seed)[1]
        rows = {}
        for sn in streams:
            curve = {sh: r for s2, n2, sh, r in results if s2 == st and n2 == sn}
            p99 = {sh: curve[sh]["p99_ms"] for sh in shares}
            best = min(shares, key=lambda sh: (p99[sh], sh))
            rows[sn] = {"best_static": best, "best_p99_ms": p99[best],
                        "p99_ms_by_share": {f"{sh:g}": p99[sh] for sh in shares},
                        "kv_hit_rate_at_best": curve[best]["kv_hit_rate"],
                        "emb_hit_rate_at_best": curve[best]["emb_hit_rate"],
                        "stream": stream_figures(sn, trace, rate, d, seed, shape)}
        out["settings"][st] = {"nodes": n, "rate_rps": rate, "duration_s": d, "load": load if cap else None,
                               "capacity": cap, "streams": rows}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def _names(text: str, valid, what: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in names if x not in valid]
    if not names or bad:
        raise SystemExit(f"--{what}: choose from {', '.join(valid)} (got {text!r})")
    return names


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.workload_splits", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="taobao")
    ap.add_argument("--path", default=None)
    ap.add_argument("--setting", default="sample", help=f"comma-separated: {', '.join(SETTINGS)}")
    ap.add_argument("--streams", default=",".join(STREAMS), help=f"comma-separated: {', '.join(STREAMS)}")
    ap.add_argument("--shares", default=",".join(f"{s:g}" for s in SHARES))
    ap.add_argument("--load", type=float, default=0.75, help="the rate as a fraction of the setting's capacity")
    ap.add_argument("--rate", type=float, default=None, help="requests per second over the cluster (skips the "
                    "capacity search)")
    ap.add_argument("--nodes", type=int, default=None, help="default: 1 (fleet), 4 (sample)")
    ap.add_argument("--duration", type=float, default=None, help="default: 5 s (fleet), 10 s (sample)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        shares = tuple(float(x) for x in args.shares.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"--shares: want numbers in [0, 1], got {args.shares!r}") from None
    if not shares or not all(0.0 <= s <= 1.0 for s in shares):
        raise SystemExit(f"--shares: want numbers in [0, 1], got {args.shares!r}")
    for name, v in (("--nodes", args.nodes), ("--rate", args.rate), ("--duration", args.duration)):
        if v is not None and not v > 0:
            raise SystemExit(f"{name} must be positive, got {v}")
    if not 0 < args.load <= 2:
        raise SystemExit(f"--load must be in (0, 2], got {args.load}")
    out = run(args.trace, args.path, _names(args.setting, SETTINGS, "setting"),
              _names(args.streams, STREAMS, "streams"), shares, args.load, args.nodes, args.rate, args.duration,
              args.seed, args.jobs)
    if args.json:
        print(json.dumps(out))
    else:
        for st, block in out["settings"].items():
            cap = block["capacity"]
            print(f"setting {st}: {block['nodes']} nodes, {block['rate_rps']:g} req/s"
                  + (f" ({block['load']:g} x capacity {cap['capacity_rps']:g})" if cap else "")
                  + f", {block['duration_s']:g} s; P99 ms per split {', '.join(f'{s:g}' for s in shares)}")
            for sn, r in block["streams"].items():
                curve = " ".join(f"{v:7.1f}" for v in r["p99_ms_by_share"].values())
                print(f"  {sn:<12} best {r['best_static']:.1f}  {curve}")
        print(f"wall {out['wall_s']} s")
    return out


if __name__ == "__main__":
    main()
