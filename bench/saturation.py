"""`racer` with its saturation terms and the unpaced burst off and on, side by side, on the regret grids' settings:
``python -m bench.saturation --settings in-sample|held-out|random:FROM:COUNT|NAME,... [--router-seeds S,...] [--jobs N] [--json]``

Three parts of the allocator, all on by default, were built for a saturated node (busy fraction
at least ``CurveConfig.rho_max``, 0.95): the curve layer's queueing term reads the offered load
there and grows past ``rho_max`` (`CurveConfig.saturation`; the tangent also prices a share that
would overload a node not yet saturated, and a saturated node still jumps where the capped cost
would); in a burst a KV-ward step is not paced by the guards' step-down limit, on any node, and
on a saturated node the cap is not declined by the curve (`RecoveryConfig.paced` off); and on a
saturated node the burst detector reads the hot-user ratio of the arrivals, which it serves a
backlog late (`RecoveryConfig.hot_over_arrivals`). Per setting and router seed this replays the ``racer`` row
twice, as `bench.reachable` runs it (ghost lists on): ``off``, all three off (``saturation=False``,
``paced=True``, ``hot_over_arrivals=False``), and ``on``, the shipped config, and prints both
P99s, the change and whether they are equal to the microsecond. The summary counts the settings
where any seed differs.

``--settings``: comma-separated names as `bench.reachable` takes them; ``in-sample`` (the quick
regret grid's 36), ``held-out`` (`bench.regret.holdout_grid`'s 36) or ``random:FROM:COUNT`` (the
held-out random family's draws FROM .. FROM+COUNT-1, four settings each). ``--router-seeds``:
default the setting's own seed, the one `bench.regret` runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from tqdm import tqdm

VARIANTS = ("off", "on")


def setting_names(spec: str) -> list[str]:
    """``--settings`` as names (see the module docstring); ValueError on a bad ``random:`` spec."""
    from bench import reachable
    from bench.regret import holdout_grid

    if spec == "held-out":
        return [st.name for st in holdout_grid(True)]
    if spec.startswith("random:"):
        parts = spec.split(":")
        if len(parts) != 3 or not all(x.isdigit() for x in parts[1:]) or int(parts[2]) < 1:
            raise ValueError(f"want random:FROM:COUNT (whole numbers, COUNT >= 1), got {spec!r}")
        first, count = int(parts[1]), int(parts[2])
        return [st.name for st in holdout_grid(True, num_random=count, first_random=first)
                if st.name.startswith("holdout-random-")]
    return reachable.setting_names(spec)


def allocator_config(variant: str):
    """The `AllocatorConfig` of ``variant``: ``on`` the shipped one, ``off`` without its three
    saturated-node terms."""
    from node_agent.allocator import AllocatorConfig, CurveConfig, RecoveryConfig

    if variant == "on":
        return AllocatorConfig()
    if variant == "off":
        return AllocatorConfig(curve=CurveConfig(saturation=False),
                               recovery=RecoveryConfig(paced=True, hot_over_arrivals=False))
    raise ValueError(f"unknown variant {variant!r}: use one of {', '.join(VARIANTS)}")


def racer_p99(stream, scfg, variant: str) -> float:
    """P99 of one ``racer`` run under ``variant``'s config (ghost lists on, the racer router)."""
    from simulator.cluster import simulate
    from simulator.smart import make_smart_allocator
    from simulator.table import GHOST_PROBES

    alloc = make_smart_allocator("racer", None, allocator_config(variant))
    return simulate(stream, replace(scfg, ghost_probes=GHOST_PROBES), alloc, "racer").summary()["p99_ms"]


def compare(stream, scfg, router_seeds: tuple[int, ...] = ()) -> dict:
    """Both variants on ``stream`` once per router seed (none: ``scfg``'s own, as `simulate` takes
    it: ``router_seed``, else ``seed``): P99s by variant,
    the change of ``on`` over ``off`` (%) and whether every pair is equal."""
    seeds = router_seeds or (scfg.seed if scfg.router_seed is None else scfg.router_seed,)
    p99 = {v: [racer_p99(stream, replace(scfg, router_seed=s), v) for s in seeds] for v in VARIANTS}
    change = [round(100.0 * (b / a - 1.0), 2) if a and b is not None else None for a, b in zip(p99["off"], p99["on"])]
    return {"router_seeds": list(seeds), "p99_ms": p99, "change_pct": change, "same": p99["off"] == p99["on"]}


def run_one(name: str, router_seeds: tuple[int, ...] = ()) -> dict:
    from bench.reachable import setting_run

    _, stream, scfg = setting_run(name, ("racer",))
    return {"setting": name, **compare(stream, scfg, router_seeds)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.saturation", description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", required=True, help="in-sample, held-out, random:FROM:COUNT or comma-separated names")
    p.add_argument("--router-seeds", default="", help="router seeds (comma-separated; default: the setting's)")
    p.add_argument("--jobs", type=int, default=1, help="settings run in parallel (processes)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        seeds = tuple(int(x) for x in a.router_seeds.split(",") if x)
    except ValueError:
        p.error("--router-seeds takes integers (comma-separated)")
    if a.jobs < 1:
        p.error("--jobs must be at least 1")
    try:
        from bench.reachable import _setting

        names = setting_names(a.settings)
        for n in names:
            _setting(n)
    except ValueError as e:
        p.error(str(e))
    if not names:
        p.error("--settings names no setting")
    from bench.reachable import _run_all

    by_name = {}
    bar = tqdm(total=len(names), desc="saturation", unit="setting", file=sys.stderr)
    for row in _run_all([(n, seeds) for n in names], a.jobs, run_one):
        by_name[row["setting"]] = row
        bar.update()
    bar.close()
    rows = [by_name[n] for n in names]
    changed = [r["setting"] for r in rows if not r["same"]]
    if a.json:
        print(json.dumps({"settings": rows, "settings_changed": changed, "settings_counted": len(rows)}))
    else:
        for r in rows:
            for i, seed in enumerate(r["router_seeds"]):
                off, on, ch = r["p99_ms"]["off"][i], r["p99_ms"]["on"][i], r["change_pct"][i]
                print(f"{r['setting']} router seed {seed}: P99 off {off} ms, on {on} ms"
                      + (", the same" if off == on else f" ({ch:+.2f}%)" if ch is not None else ""))
        print(f"settings where the saturation terms change racer's P99: {len(changed)} of {len(rows)}"
              + (f" ({', '.join(changed)})" if changed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
