"""Simulator speed: simulated requests per second of wall time, 32 nodes, RACER router.

    python -m bench.simulator [--json] [--trace taobao] [--rate R] [--duration S] [--breakdown] [--floor]

Runs the paper table's default setting (`simulator.table.TableConfig`) once per regime with a
static split and the RACER router, in one process on one thread, and reports
``sim_requests_per_s`` = simulated requests / wall seconds over all regimes (the stream's
generation is not timed), per regime too. ``--breakdown`` reruns the steady regime under cProfile
and reports where its time goes (``breakdown``: seconds and share of the profiled run in the EMB
cache's lookup, the KV pool, the router, the memory managers' steps and reports, the rest of the
simulator), plus the mean requests per (node, slice) call.
``--floor`` records, for each regime's run, every call the simulator makes on the nodes' memory
structures and on the router that does work (the methods in ``_FLOOR``: EMB lookups and resident
items, the KV pool's lookups, appends, evictions and residency drains, the managers' steps and
targets, the router's routing, reports and completions; cheap reads such as ``emb_share`` or the
ghost counters are left out), replays those calls alone on fresh structures, each timed, and
reports them per simulated request (``floor``, per regime and over all, comparable to
``sim_requests_per_s``): the wall time that any simulator driving the real structures the way
this one does (one EMB lookup per node micro-batch, the KV pool per request) must spend, whatever
its own bookkeeping costs, and so the most simulated requests per second it could reach. Every
replayed call must return what it returned in the run (``floor.replay_identical``).
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
    ap.add_argument("--breakdown", action="store_true", help="profile the steady run: where the time goes")
    ap.add_argument("--floor", action="store_true",
                    help="replay each run's calls on the real structures alone: the floor of any such simulator")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    trace, name = load_bench_trace(args.trace, args.path)
    cfg = SimConfig(num_nodes=args.nodes, cache_fraction=d.cache_fraction, slo_ms=d.slo_ms)
    out = {"trace": name, "nodes": args.nodes, "router": "racer", "rate_rps": args.rate,
           "duration_s": args.duration, "num_users": args.users, "torch_threads": torch.get_num_threads(),
           "regimes": {}}
    total_n, total_wall = 0, 0.0
    streams = {regime: generate(trace, regime=regime, rate_rps=args.rate, duration_s=args.duration,
                                num_users=args.users, history_scale=d.history_scale, seed=0) for regime in REGIMES}
    for regime, s in streams.items():
        t0 = time.perf_counter()
        r = simulate(s, cfg, StaticAllocator(0.5), "racer")
        wall = time.perf_counter() - t0
        total_n += len(s)
        total_wall += wall
        out["regimes"][regime] = {"num_requests": len(s), "wall_s": round(wall, 2),
                                  "sim_requests_per_s": round(len(s) / wall), "p99_ms": r.summary()["p99_ms"]}
    out["sim_requests_per_s"] = round(total_n / total_wall)
    if args.breakdown:
        out["breakdown"] = breakdown(streams["steady"], cfg)
    if args.floor:
        out["floor"] = floor(streams, cfg)
    if args.json:
        print(json.dumps(out))
    else:
        for regime, v in out["regimes"].items():
            print(f"{regime:<8} {v['num_requests']:>9,} requests in {v['wall_s']:>6} s: "
                  f"{v['sim_requests_per_s']:>8,} simulated req/s")
        print(f"sim_requests_per_s: {out['sim_requests_per_s']:,}")
        if "breakdown" in out:
            b = out["breakdown"]
            print(f"steady under cProfile: {b['requests_per_call']} requests per (node, slice) call")
            for k, v in b["parts"].items():
                print(f"  {k:<28} {v['s']:>7.2f} s  {100 * v['share']:>5.1f}%  {v['us_per_request']:>7.1f} us/request")
        if "floor" in out:
            f = out["floor"]
            print(f"the real structures' calls alone, replayed (identical returns: {f['replay_identical']}): "
                  f"{f['us_per_request']} us/request, at most {f['max_sim_requests_per_s']:,} simulated req/s")
            for regime, v in f["regimes"].items():
                print(f"  {regime:<8} {v['num_calls']:>9,} calls: {v['us_per_request']:>7.1f} us/request, at most "
                      f"{v['max_sim_requests_per_s']:>8,} req/s")
                for k, p in v["parts"].items():
                    print(f"    {k:<26} {p['calls']:>9,} calls  {p['us_per_call']:>7.1f} us/call  "
                          f"{p['us_per_request']:>7.1f} us/request")
    return out


# (label, file suffix, function name): cumulative time of these functions in the profiled run
_PARTS = (
    ("emb_cache.lookup", "node_agent/memory/emb_cache.py", "lookup"),
    ("kv_pool.lookup+append", "node_agent/memory/kv_pool.py", ("lookup", "append", "evict")),
    ("router.route_batch", "gateway/router.py", "route_batch"),
    ("memory_manager.step", "node_agent/memory/manager.py", "step"),
    ("node reports", "simulator/cluster.py", "_report"),
    ("control windows (stats)", "simulator/cluster.py", "_window_stats"),
)


def breakdown(s, cfg) -> dict:
    """Profile one run of stream ``s``; attribute its time to the parts above, the rest to the simulator."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    simulate(s, cfg, StaticAllocator(0.5), "racer")
    prof.disable()
    st = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    total = sum(v[2] for v in st.values())
    parts = {}
    for label, suffix, names in _PARTS:
        names = (names,) if isinstance(names, str) else names
        ct = sum(v[3] for (f, _, n), v in st.items() if f.endswith(suffix) and n in names)
        parts[label] = ct
    calls = sum(v[1] for (f, _, n), v in st.items() if f.endswith("node_agent/memory/emb_cache.py") and n == "lookup")
    parts["rest of the simulator"] = max(0.0, total - sum(parts.values()))
    n = len(s)
    return {"profiled_s": round(total, 2), "num_requests": n,
            "requests_per_call": round(n / calls, 2) if calls else None,
            "parts": {k: {"s": round(v, 3), "share": round(v / total, 4) if total else 0.0,
                          "us_per_request": round(v / n * 1e6, 1)} for k, v in parts.items()}}


# what the floor replays: (part, the object's path on a node or "router", method names)
_FLOOR = (
    ("emb_cache", "mm.emb", ("lookup", "resident_items")),
    ("kv_pool", "mm.kv", ("lookup", "append", "evict", "drain_residency")),
    ("memory_manager", "mm", ("step", "set_target", "apply_plan")),
    ("router", "router", ("route_batch", "report", "complete")),
)


def _floor_targets(sim):
    """(part, key, object, method names) for every object the floor records or replays, in a
    fixed order."""
    for part, path, names in _FLOOR:
        if path == "router":
            yield part, ("router",), sim.rt, names
            continue
        for node in sim.nodes:
            obj = node
            for a in path.split("."):
                obj = getattr(obj, a)
            yield part, (path, node.index), obj, names


def _fingerprint(x):
    """A comparable summary of what a call returned (arrays and tensors by content)."""
    import dataclasses

    import numpy as np

    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return ("array", x.dtype.str, x.shape, hash(np.ascontiguousarray(x).tobytes()))
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        return x.item()
    if isinstance(x, (tuple, list)):
        return tuple(_fingerprint(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _fingerprint(v)) for k, v in x.items())
    if dataclasses.is_dataclass(x):
        return (type(x).__name__,) + tuple(_fingerprint(getattr(x, f.name)) for f in dataclasses.fields(x))
    return (type(x).__name__, _fingerprint(vars(x)) if hasattr(x, "__dict__") else repr(x))


def _floor_regime(s, cfg, omit: str | None = None) -> dict:
    """Record one run's calls on the real structures and the router, replay them alone, timed.
    ``omit``: a method name whose calls the replay leaves out (a test of the check)."""
    from simulator.cluster import ClusterSim

    log: list = []
    sim = ClusterSim(s, cfg, "racer", initial_share=0.5)
    for part, key, obj, names in _floor_targets(sim):
        for name in names:
            f = getattr(obj, name)

            def rec(*a, _f=f, _k=(part, key, name), **kw):  # bound per method: the log keeps the call
                ret = _f(*a, **kw)
                log.append((_k, a, kw, _fingerprint(ret)))
                return ret

            setattr(obj, name, rec)
    out = sim.start()
    while out is not None:
        out = sim.advance([0.5] * len(sim.nodes))

    fresh = ClusterSim(s, cfg, "racer", initial_share=0.5)
    objs = {key: obj for _, key, obj, _ in _floor_targets(fresh)}
    spent = {part: 0.0 for part, _, _ in _FLOOR}
    calls: dict = {part: {} for part in spent}
    mismatches = 0
    clock = time.perf_counter
    for (part, key, name), a, kw, want in log:
        if name == omit:
            continue
        f = getattr(objs[key], name)
        t0 = clock()
        ret = f(*a, **kw)
        spent[part] += clock() - t0
        calls[part][name] = calls[part].get(name, 0) + 1
        mismatches += _fingerprint(ret) != want
    n = len(s)
    total = sum(spent.values())
    parts = {}
    for k, v in spent.items():
        nc = sum(calls[k].values())
        parts[k] = {"calls": nc, "methods": calls[k], "us_per_call": round(v / max(1, nc) * 1e6, 1),
                    "us_per_request": round(v / n * 1e6, 1) if n else None}
    return {"num_requests": n, "num_calls": len(log), "mismatched_returns": mismatches,
            "replay_identical": mismatches == 0, "replay_s": total,
            "us_per_request": round(total / n * 1e6, 1) if n else None,
            "max_sim_requests_per_s": round(n / total) if total else None, "parts": parts}


def floor(streams: dict, cfg) -> dict:
    """Per regime (``streams``: regime -> stream) and over all: the real structures' calls alone
    (see the module docstring)."""
    out = {"regimes": {}}
    n_all, s_all = 0, 0.0
    for regime, s in streams.items():
        f = _floor_regime(s, cfg)
        out["regimes"][regime] = f
        n_all += f["num_requests"]
        s_all += f.pop("replay_s")
    out["replay_identical"] = all(f["replay_identical"] for f in out["regimes"].values())
    out["us_per_request"] = round(s_all / n_all * 1e6, 1) if n_all else None
    out["max_sim_requests_per_s"] = round(n_all / s_all) if s_all else None  # comparable to sim_requests_per_s
    return out


if __name__ == "__main__":
    main()
