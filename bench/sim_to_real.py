"""Simulator against the emulated fleet (sim-to-real): the same trace, sizing, profile, schedule
and configurations through the discrete-event simulator and through emulated node agents.

    python -m bench.sim_to_real --fleet OUT --json      # OUT: a `racer bench fleet --emulate ... --out OUT`

For every static configuration (``SPLIT/ROUTER``) of the fleet bench and every load, the
simulator (`simulator.cluster.simulate` with a static allocator) runs the stream the fleet bench
sent (`bench.fleet.replay_config` + `workloads.replay.build_plan`: the same seed and rate) on
``num_nodes`` nodes sized as the emulated agents (the profile the agents charged, their arena's
pages, the refill's link fraction, the SLO, a 1-s control interval), with the same router. Figures
side by side per configuration, overall and per phase: P99, P50, KV and EMB hit rates, mean
``emb_share``. The error is the mean absolute percentage error over the configurations
(``p99_mape_pct``, ``p50_mape_pct``; the simulator's figure against the fleet's median over its
rounds) and the largest absolute difference of each hit rate (``kv_hit_max_abs_diff``,
``emb_hit_max_abs_diff``), as simulator-validation studies report them.

What differs by construction, stated: the simulator batches by slices of ``batch_window_ms``
(here 1 ms, which adds about half a slice to a sub-millisecond P50) up to the profile's
``max_batch`` (64), where an agent batches what its queue holds up to its own ``max_batch`` (16)
and serves a large miss (``large_prefill_tokens``, 1,024) alone in its own lane; the simulator
routes on reports every ``report_interval_s`` where the gateway reads each agent's feed. On a
stream that shifts items (trend drift, EMB bursts) the simulator reuses a cached prefix by length
where the engine compares item ids, so it can count a hit the engine recomputes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from bench.fleet import Emulation, FleetConfig, Sizing, parse_configs, replay_config, workload_plan
from bench.stats import p99, pct


def _phase_figs(lat_ms: np.ndarray, arrival: np.ndarray, phases) -> dict:
    out = {}
    for ph in phases:
        m = (arrival >= ph.start_s) & (arrival < ph.end_s)
        x = lat_ms[m]
        out[ph.name] = {**p99(x).fields("p99_ms"), "p50_ms": pct(x, 50)}
    return out


def simulate_config(cfg: FleetConfig, stream, phases, *, num_nodes: int, emulation: Emulation, num_pages: int,
                    slo_ms: float, seed: int = 0, batch_window_ms: float = 1.0) -> dict:
    """The simulator's figures of one static configuration on ``stream``."""
    from simulator.allocators import StaticAllocator
    from simulator.cluster import SimConfig, simulate

    prof = emulation.device_profile()
    sc = SimConfig(num_nodes=num_nodes, profile=prof, cache_bytes=num_pages * prof.page_bytes,
                   batch_window_ms=batch_window_ms, control_interval_s=1.0, slo_ms=slo_ms,
                   initial_emb_share=cfg.split, refill_limit_fraction=0.1, seed=seed).validate()
    res = simulate(stream, sc, StaticAllocator(cfg.split), cfg.router)
    s = res.summary()
    lat_ms = res.latency_s * 1e3
    return {"p99_ms": s["p99_ms"], "p50_ms": s["p50_ms"], "kv_hit_rate": s["kv_hit_rate"],
            "emb_hit_rate": s["emb_hit_rate"], "mean_share": s["mean_share"],
            "phases": _phase_figs(lat_ms, np.asarray(stream.arrival_s), phases), "wall_s": s["wall_s"]}


def _mape(pairs) -> float | None:
    xs = [abs(s - f) / f * 100 for s, f in pairs if s is not None and f not in (None, 0)]
    return round(float(np.mean(xs)), 2) if xs else None


def _max_abs(pairs) -> float | None:
    xs = [abs(s - f) for s, f in pairs if s is not None and f is not None]
    return round(float(max(xs)), 4) if xs else None


def compare(fleet_dir: str | Path, *, loads: list[float] | None = None, progress: bool = False) -> dict:
    """Sim-to-real of a saved emulated fleet bench (its ``settings.json`` and ``fleet.json``)."""
    from workloads import load_trace

    d = Path(fleet_dir)
    try:
        settings = json.loads((d / "settings.json").read_text())
        fleet = json.loads((d / "fleet.json").read_text())
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{d}: not a finished fleet bench ({e.filename} missing)") from None
    emu = settings.get("emulation")
    if not emu:
        raise ValueError(f"{d}: a fleet bench on CPU-compute agents; sim-to-real needs one run with --emulate")
    emulation = Emulation(**emu)
    sizing = Sizing(**settings["sizing"])
    trace = load_trace(settings["trace_kind"], settings.get("trace_path"))
    num_nodes = int(fleet["num_nodes"])
    num_pages = emulation.num_pages(trace.num_items, sizing.arena_table)
    configs = [c for c in parse_configs(",".join(settings["configs"])) if c.split is not None and c.copy == 1]
    want = loads or [float(x) for x in settings["loads"]]
    rows = []
    for load in want:
        rate = fleet["loads"].get(format(load, "g"))
        if rate is None:
            raise ValueError(f"load {load:g} is not one of the bench's ({', '.join(fleet['loads'])})")
        rc = replay_config(settings["schedule"], rate, settings["seed"], settings["slo_ms"], sizing, emulated=True)
        plan = workload_plan(trace, rc, settings.get("workload"))
        stream = plan[0].stream
        for cfg in configs:
            real = next((r for r in fleet["configs"] if r["config"] == cfg.key and r["load"] == load), None)
            if real is None:
                continue
            if progress:
                print(f"sim-to-real: simulating {cfg.key} at load {load:g} ({rate:g} req/s)", file=sys.stderr)
            sim = simulate_config(cfg, stream, plan, num_nodes=num_nodes, emulation=emulation, num_pages=num_pages,
                                  slo_ms=settings["slo_ms"], seed=settings["seed"])
            med = {f: (real.get(f) or {}).get("median") for f in ("p99_ms", "p50_ms", "kv_hit_rate", "emb_hit_rate",
                                                                  "mean_share")}
            phases = {ph: {"sim": sim["phases"].get(ph), "fleet": {f: (v.get(f) or {}).get("median")
                                                                   for f in ("p99_ms", "p50_ms")}}
                      for ph, v in real.get("phases", {}).items()}
            rows.append({"config": cfg.key, "load": load, "rate_rps": rate, "sim": {k: sim[k] for k in med},
                         "fleet": med, "phases": phases, "sim_wall_s": sim["wall_s"]})
    by_load = {}
    for load in want:
        rs = [r for r in rows if r["load"] == load]
        by_load[format(load, "g")] = {
            "num_configs": len(rs),
            "p99_mape_pct": _mape((r["sim"]["p99_ms"], r["fleet"]["p99_ms"]) for r in rs),
            "p50_mape_pct": _mape((r["sim"]["p50_ms"], r["fleet"]["p50_ms"]) for r in rs),
            "kv_hit_max_abs_diff": _max_abs((r["sim"]["kv_hit_rate"], r["fleet"]["kv_hit_rate"]) for r in rs),
            "emb_hit_max_abs_diff": _max_abs((r["sim"]["emb_hit_rate"], r["fleet"]["emb_hit_rate"]) for r in rs),
            "share_max_abs_diff": _max_abs((r["sim"]["mean_share"], r["fleet"]["mean_share"]) for r in rs)}
    return {"fleet": str(d), "device": fleet.get("device"), "num_nodes": num_nodes, "schedule": settings["schedule"],
            "trace": settings["trace"], "by_load": by_load, "rows": rows,
            "note": "the simulator's figures against the emulated fleet's medians over its rounds; both in modelled "
                    "time from one profile"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim_to_real", description=__doc__.split("\n\n")[0])
    p.add_argument("--fleet", required=True, help="the --out folder of a finished racer bench fleet --emulate run")
    p.add_argument("--loads", default=None, help="loads to compare (default: every load of the bench)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    try:
        loads = None if args.loads is None else [float(x) for x in args.loads.split(",") if x.strip()]
        if loads is not None and not all(math.isfinite(x) and x > 0 for x in loads):
            raise ValueError("--loads must be positive numbers")
        res = compare(args.fleet, loads=loads, progress=args.progress)
    except (ValueError, FileNotFoundError) as e:
        print(f"sim-to-real: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res))
    else:
        for load, v in res["by_load"].items():
            print(f"load {load}: P99 MAPE {v['p99_mape_pct']}%, P50 MAPE {v['p50_mape_pct']}%, KV hit max diff "
                  f"{v['kv_hit_max_abs_diff']}, EMB hit max diff {v['emb_hit_max_abs_diff']} over {v['num_configs']} "
                  f"configurations")
            for r in [r for r in res["rows"] if format(r["load"], "g") == load]:
                print(f"  {r['config']:>18}: P99 sim {r['sim']['p99_ms']} / fleet {r['fleet']['p99_ms']} ms, KV hit "
                      f"{r['sim']['kv_hit_rate']} / {r['fleet']['kv_hit_rate']}, EMB hit {r['sim']['emb_hit_rate']} / "
                      f"{r['fleet']['emb_hit_rate']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
