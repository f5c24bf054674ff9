"""How close to the replay oracle can an allocator that starts at 0.5 get, on a setting of the
regret grid? ``python -m bench.reachable --settings taobao-sample-schedule-s2,... [--json]``

The replay oracle (`simulator.cluster.oracle_replay`) may set any share in any window, from the
first on. A runtime allocator starts at the configured split (0.5) and the guards move it at most
``max_step_up`` (0.05) EMB-ward and ``max_step_down`` (0.1) KV-ward per control interval
(`node_agent.allocator.GuardConfig`). The *reachable oracle* follows the oracle's schedule as fast
as the guards allow from 0.5: window 0 at 0.5, then each window one guarded step toward the
oracle's share for it. Its regret (P99 over the oracle's minus 1) is a floor for any allocator
that does not know the schedule in advance and starts where the runtime starts; on a short
setting (the quick grid's 4-s regimes are 4 control intervals) it can be several percent.

Printed per setting: the oracle's schedule and P99, the reachable path and its P99 and regret,
and (``--allocators``, default ``racer,ppo``) each SmartAllocator row's regret on the same
setting, side by side. Settings are named as `bench.regret` names them (sample settings, quick).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

REACHABLE_START = 0.5


def reachable_path(schedule: list[float], start: float, max_up: float, max_down: float) -> list[float]:
    """Window 0 at ``start``, then one guarded step per window toward that window's share."""
    path = [float(start)]
    for target in schedule[1:]:
        cur = path[-1]
        path.append(min(target, cur + max_up) if target > cur else max(target, cur - max_down))
    return [round(x, 6) for x in path]


def _setting(name: str):
    from bench.regret import Setting

    parts = name.split("-")
    if len(parts) != 4 or parts[1] != "sample" or not parts[3].startswith("s") or not parts[3][1:].isdigit():
        raise ValueError(f"want a sample setting of the quick regret grid (TRACE-sample-REGIME-sN), got {name!r}")
    return Setting(parts[0], "sample", parts[2], int(parts[3][1:]))


def run_one(name: str, allocators: tuple[str, ...]) -> dict:
    from bench.regret import table_config
    from node_agent.allocator import GuardConfig
    from simulator.allocators import ScheduleAllocator
    from simulator.cluster import oracle_replay, simulate
    from simulator.smart import make_smart_allocator
    from simulator.table import GHOST_PROBES, _stream, sim_config

    st = _setting(name)
    cfg = table_config(st, True, allocators)
    stream = _stream(cfg, st.regime)
    scfg = sim_config(cfg)
    res, schedule = oracle_replay(stream, scfg, cfg.shares, "racer")
    oracle = res.summary()["p99_ms"]
    g = GuardConfig()
    path = reachable_path(schedule, REACHABLE_START, g.max_step_up, g.max_step_down)
    reach = simulate(stream, scfg, ScheduleAllocator(path, scfg.control_interval_s, name="reachable"), "racer")
    out = {"setting": name, "oracle_p99_ms": oracle, "oracle_schedule": schedule, "reachable_path": path,
           "reachable_p99_ms": reach.summary()["p99_ms"],
           "regret_pct": {"reachable": round(100.0 * (reach.summary()["p99_ms"] / oracle - 1.0), 2)}}
    for spec in allocators:
        r = simulate(stream, replace(scfg, ghost_probes=GHOST_PROBES), make_smart_allocator(spec), "racer")
        out["regret_pct"][spec] = round(100.0 * (r.summary()["p99_ms"] / oracle - 1.0), 2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reachable", description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", required=True, help="comma-separated setting names, e.g. amazon-sample-burst-s1")
    p.add_argument("--allocators", default="racer,ppo", help="SmartAllocator rows to run beside ('' for none)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    names = [x for x in a.settings.split(",") if x]
    try:
        for n in names:
            _setting(n)
    except ValueError as e:
        p.error(str(e))
    allocators = tuple(x for x in a.allocators.split(",") if x)
    rows = [run_one(n, allocators) for n in names]
    if a.json:
        print(json.dumps({"settings": rows}))
    else:
        for r in rows:
            print(f"{r['setting']}: oracle {r['oracle_p99_ms']} ms {r['oracle_schedule']}; reachable "
                  f"{r['reachable_path']} -> {r['reachable_p99_ms']} ms; regret % {r['regret_pct']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
