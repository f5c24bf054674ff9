"""How close to the replay oracle can an allocator that starts at 0.5 get, on a setting of the
regret grid? ``python -m bench.reachable --settings taobao-sample-schedule-s2,...|in-sample [--jobs N] [--json]``

The replay oracle (`simulator.cluster.oracle_replay`) may set any share in any window, from the
first on. A runtime allocator starts at the configured split (0.5) and the guards move it at most
``max_step_up`` (0.05) EMB-ward and ``max_step_down`` (0.1) KV-ward per control interval
(`node_agent.allocator.GuardConfig`). The *reachable oracle* follows the oracle's schedule as fast
as the guards allow from 0.5: window 0 at 0.5, then each window one guarded step toward the
oracle's share for it. Its regret (P99 over the oracle's minus 1) is a floor for any allocator
that does not know the schedule in advance, starts where the runtime starts and keeps the step
limits (the curve layer's ``jump`` waives the step-down limit above a KV cliff; `bench.regret`'s
``oracle_start`` row is the floor without step limits); on a short setting (the quick grid's 4-s
regimes are 4 control intervals) it can be several percent.

Printed per setting: the oracle's schedule and P99, the reachable path and its P99 and regret,
and (``--allocators``, default ``racer,ppo``) each SmartAllocator row's regret on the same
setting, side by side. Settings are named as `bench.regret` names them: the quick grid's sample
settings (``taobao-sample-schedule-s2``) and the held-out grid's
(``holdout-random-9-busy-trend-s0``).

``--router-seeds S,...`` also replays the static splits (``--shares``, default the setting's)
and the SmartAllocator rows once per router tie-break seed (`SimConfig.router_seed`) and prints
each one's P99 over the seeds (median and range) and the SmartAllocator rows' median over the
best static split's: one run per cell carries the router's own randomness, which a single
regret figure cannot tell from the allocator's. Beside them, ``start_to_best``: the best static
split reached from 0.5 at the guards' step limits, once per seed, the price of starting at 0.5
for an allocator that knew the best static split in advance, and ``start_floor``: one interval
at 0.5, then the best static split at once (the curve layer's ``jump`` may waive the step
limit), the start-up's floor for an allocator whose first decision closes the first interval;
each SmartAllocator row is also judged over the larger of the best static split's median and
``start_floor``'s (``over_start_floor_pct``). With router seeds the output ends with each
SmartAllocator row's worst median over the best static split's and how many settings lie within
5% of it, and the same over the start-up floor. ``--settings in-sample`` names the quick regret grid's 36 settings
(`bench.regret.grid`: both samples and the paper-scale setting, four regimes, seeds 0-2; the
paper-scale ones are one node, where router seeds change nothing); ``--jobs`` runs settings in
parallel processes. ``--out FILE`` appends each setting's row to FILE (JSON lines) as it
finishes, and a later run with the same FILE takes the rows already there for the same
allocators, router seeds and shares instead of running them again: a long grid survives an
interruption, and may be run in parts. ``--path SHARE[xN],...`` (repeatable) also replays a fixed
path, one share per control interval and the last one held after it (``0.5x15,0.1x5``: 0.5 for
fifteen intervals, then 0.1): the price of a schedule one can name, such as a move one interval
earlier or later.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from tqdm import tqdm

REACHABLE_START = 0.5


def reachable_path(schedule: list[float], start: float, max_up: float, max_down: float) -> list[float]:
    """Window 0 at ``start``, then one guarded step per window toward that window's share."""
    path = [float(start)]
    for target in schedule[1:]:
        cur = path[-1]
        path.append(min(target, cur + max_up) if target > cur else max(target, cur - max_down))
    return [round(x, 6) for x in path]


def _setting(name: str):
    """The `bench.regret` setting called ``name``: a sample setting of the quick grid
    (TRACE-sample-REGIME-sN), a held-out one (holdout-FAMILY-LOAD-REGIME-s0, quick) or one of the
    tuning draw (holdout-tune-I-LOAD-REGIME-s0, `bench.regret.tune_grid`)."""
    from bench.regret import Setting, holdout_grid, tune_grid

    if name.startswith("holdout-"):
        parts = name.split("-")
        first = int(parts[2]) if len(parts) > 2 and parts[1] in ("random", "tune") and parts[2].isdigit() else 0
        grid = tune_grid(first, 1) if parts[1] == "tune" else holdout_grid(True, num_random=1, first_random=first)
        for st in grid:
            if st.name == name:
                return st
        raise ValueError(f"no held-out setting {name!r} (e.g. holdout-kv-heavy-busy-trend-s0, "
                         "holdout-random-9-busy-trend-s0, holdout-tune-0-light-trend-s0)")
    kind = "paper-scale" if "-paper-scale-" in name else "sample"
    parts = name.replace("-paper-scale-", "-paper_scale-").split("-")
    if len(parts) != 4 or parts[1] not in ("sample", "paper_scale") or not parts[3].startswith("s") \
            or not parts[3][1:].isdigit():
        raise ValueError(f"want a setting of the quick regret grid (TRACE-sample-REGIME-sN, "
                         f"TRACE-paper-scale-REGIME-sN) or a held-out one (holdout-...), got {name!r}")
    return Setting(parts[0], kind, parts[2], int(parts[3][1:]))


def setting_names(spec: str) -> list[str]:
    """``--settings``: comma-separated names, or ``in-sample`` for the quick regret grid's 36
    settings (`bench.regret.grid`)."""
    from bench.regret import grid

    if spec == "in-sample":
        return [st.name for st in grid()]
    return [x for x in spec.split(",") if x]


def parse_path(spec: str) -> list[float]:
    """``--path``: comma-separated ``SHARE`` or ``SHAREx N`` (``N`` intervals at ``SHARE``), e.g.
    ``0.5x15,0.1x5``; ValueError on a share outside [0, 1] or a bad count."""
    out: list[float] = []
    for part in (x.strip() for x in spec.split(",")):
        share, _, n = part.partition("x")
        try:
            v, k = float(share), int(n) if n else 1
        except ValueError:
            raise ValueError(f"--path: want SHARE or SHARExN, got {part!r}") from None
        if not 0.0 <= v <= 1.0 or k < 1 or k > 100_000:
            raise ValueError(f"--path: share in [0, 1] and 1 <= N <= 100000, got {part!r}")
        out += [v] * k
    return out


def setting_run(name: str, allocators: tuple[str, ...]):
    """``(cfg, stream, scfg)`` of the setting called ``name`` (`_setting`) as `bench.regret` runs it
    with ``allocators``: its table config, its request stream and its simulator config."""
    from bench.regret import HoldoutSetting, holdout_config, table_config
    from simulator.table import _stream, sim_config

    st = _setting(name)
    cfg = holdout_config(st, True, allocators) if isinstance(st, HoldoutSetting) else table_config(st, True, allocators)
    return cfg, _stream(cfg, st.regime), sim_config(cfg)


def run_one(name: str, allocators: tuple[str, ...], router_seeds: tuple[int, ...] = (),
            shares: tuple[float, ...] | None = None, paths: tuple[tuple[float, ...], ...] = ()) -> dict:
    from simulator.cluster import oracle_replay

    cfg, stream, scfg = setting_run(name, allocators)
    res, schedule = oracle_replay(stream, scfg, cfg.shares, "racer")
    oracle = res.summary()["p99_ms"]
    path = guarded_path(schedule)
    reach = _path_p99(stream, scfg, path, "reachable")
    out = {"setting": name, "oracle_p99_ms": oracle, "oracle_schedule": schedule, "reachable_path": path,
           "reachable_p99_ms": reach, "regret_pct": {"reachable": round(100.0 * (reach / oracle - 1.0), 2)}}
    for spec in allocators:
        out["regret_pct"][spec] = round(100.0 * (_p99(stream, scfg, spec) / oracle - 1.0), 2)
    if paths:
        out["paths"] = [{"path": list(x), "p99_ms": _path_p99(stream, scfg, list(x), "path")} for x in paths]
    if router_seeds:
        out["over_router_seeds"] = over_router_seeds(stream, scfg, shares or cfg.shares, allocators, router_seeds,
                                                     windows=len(schedule))
    return out


def guarded_path(schedule: list[float]) -> list[float]:
    """`reachable_path` of ``schedule`` from `REACHABLE_START` at the runtime guards' step limits."""
    from node_agent.allocator import GuardConfig

    g = GuardConfig()
    return reachable_path(schedule, REACHABLE_START, g.max_step_up, g.max_step_down)


def _path_p99(stream, scfg, path: list[float], name: str) -> float:
    """P99 of a replay that sets the shares of ``path``, one per control interval, under the racer router."""
    from simulator.allocators import ScheduleAllocator
    from simulator.cluster import simulate

    alloc = ScheduleAllocator(path, scfg.control_interval_s, name=name)
    return simulate(stream, scfg, alloc, "racer").summary()["p99_ms"]


def _p99(stream, scfg, spec: str) -> float:
    """P99 of one run of the allocator ``spec`` (``static:S`` or a SmartAllocator row, built as the
    regret table builds it, with the ghost lists on where it reads them) under the racer router."""
    from simulator.allocators import needs_ghost_lists
    from simulator.cluster import simulate
    from simulator.table import GHOST_PROBES, _make_allocator

    if needs_ghost_lists(spec):
        scfg = replace(scfg, ghost_probes=GHOST_PROBES)
    return simulate(stream, scfg, _make_allocator(spec, None, scfg), "racer").summary()["p99_ms"]


def over_router_seeds(stream, scfg, shares, allocators, router_seeds, windows: int = 0) -> dict:
    """Each static split of ``shares`` and each SmartAllocator row replayed once per router seed:
    P99s, their median and range, and each row's median over the best static split's median.
    ``windows`` > 0 (the setting's control intervals) adds two rows: ``start_to_best``, the best
    static split reached from `REACHABLE_START` at the guards' step limits (`guarded_path`), what
    knowing the best static split in advance costs an allocator that starts where the runtime
    starts and keeps the step limits; and ``start_floor``, one interval at `REACHABLE_START`, then
    the best static split (the curve layer's ``jump`` waives the step limit), the start-up's price
    on medians for an allocator that starts at the configured split and knows the best split from
    its first decision (a price, not a strict bound: near saturation a slower path can be the
    luckier one, as ``start_to_best`` is on some cells). ``over_start_floor_pct``
    is each SmartAllocator row's median over the larger of the best static split's median and
    ``start_floor``'s."""
    import numpy as np

    def row(p99: list[float]) -> dict:
        med = float(np.median(p99))
        return {"p99_ms": p99, "median": med, "spread_pct": round(100.0 * (max(p99) - min(p99)) / med, 1)}

    rows = {}
    for spec in [f"static:{x:g}" for x in shares] + list(allocators):
        rows[spec] = row([round(_p99(stream, replace(scfg, router_seed=rs), spec), 3) for rs in router_seeds])
    statics = [k for k in rows if k.startswith("static:")]
    best = min(statics, key=lambda k: rows[k]["median"])
    compared = list(allocators)
    if windows > 0:
        best_share = float(best.split(":", 1)[1])
        path = guarded_path([best_share] * windows)
        p99 = [round(_path_p99(stream, replace(scfg, router_seed=rs), path, "start_to_best"), 3) for rs in router_seeds]
        rows["start_to_best"] = {**row(p99), "path": path}
        floor = start_floor_path(best_share, windows)
        p99 = [round(_path_p99(stream, replace(scfg, router_seed=rs), floor, "start_floor"), 3) for rs in router_seeds]
        rows["start_floor"] = {**row(p99), "path": floor}
        compared += ["start_to_best", "start_floor"]
    out = {"router_seeds": list(router_seeds), "rows": rows, "best_static": best,
           "over_best_static_pct": {a: round(100.0 * (rows[a]["median"] / rows[best]["median"] - 1.0), 2)
                                    for a in compared}}
    if "start_floor" in rows:
        bar = max(rows[best]["median"], rows["start_floor"]["median"])
        out["over_start_floor_pct"] = {a: round(100.0 * (rows[a]["median"] / bar - 1.0), 2) for a in allocators}
    return out


def _worst_and_within(over: list[dict], allocators: tuple[str, ...], worst_key: str, within_key: str) -> dict:
    """Per allocator, the worst of the settings' ``over`` percentages (``worst_key``) and how many
    are at most 5% (``within_key``)."""
    return {worst_key: {al: max(v[al] for v in over) for al in allocators},
            within_key: {al: sum(v[al] <= 5.0 for v in over) for al in allocators}}


def start_floor_path(best: float, windows: int) -> list[float]:
    """One control interval at `REACHABLE_START`, then ``best`` for the other ``windows - 1``."""
    return [REACHABLE_START] + [float(best)] * max(windows - 1, 0)


def _run_all(work: list[tuple], jobs: int, fn=None):
    """``fn`` (default `run_one`; a module-level function) on each item of ``work``, in ``jobs``
    processes when more than one; yields each row as it ends (in the order they end)."""
    fn = fn or run_one
    if jobs > 1 and len(work) > 1:
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(min(jobs, len(work))) as pool:
            for fut in as_completed([pool.submit(fn, *w) for w in work]):
                yield fut.result()
    else:
        for w in work:
            yield fn(*w)


def _saved_rows(path: str, key: dict) -> dict[str, dict]:
    """The rows of ``path`` (JSON lines, `_saved`) run with ``key``'s allocators, seeds and shares,
    by setting name (the last one of a setting wins); none when the file does not exist."""
    rows = {}
    try:
        f = open(path)
    except FileNotFoundError:
        return rows
    with f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                raise ValueError(f"line {i} is not JSON (a run cut while writing it? remove that line)") from None
            if isinstance(rec, dict) and rec.get("key") == key and isinstance(rec.get("row"), dict):
                rows[rec["row"]["setting"]] = rec["row"]
    return rows


def _saved(path: str | None, key: dict, row: dict) -> dict:
    """Append ``row`` (run with ``key``) to ``path`` as one JSON line, flushed; returns ``row``."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"key": key, "row": row}) + "\n")
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reachable", description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", required=True, help="comma-separated setting names, e.g. amazon-sample-burst-s1, "
                   "or 'in-sample' for the quick regret grid's 36")
    p.add_argument("--jobs", type=int, default=1, help="settings run in parallel (processes)")
    p.add_argument("--allocators", default="racer,ppo", help="SmartAllocator rows to run beside ('' for none)")
    p.add_argument("--router-seeds", default="", help="also replay the static splits and the SmartAllocator rows "
                   "once per router seed (comma-separated) and compare medians")
    p.add_argument("--shares", default="", help="static splits of --router-seeds (default: the setting's)")
    p.add_argument("--path", action="append", default=[], metavar="SHARE[xN],...",
                   help="also replay this fixed path, one share per control interval (the last held), "
                   "e.g. 0.5x15,0.1x5; repeatable")
    p.add_argument("--out", default=None, help="JSON-lines file: each setting's row appended when done; rows "
                   "already there (same allocators, seeds and shares) are reused, not run again")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        seeds = tuple(int(x) for x in a.router_seeds.split(",") if x)
        shares = tuple(float(x) for x in a.shares.split(",") if x) or None
    except ValueError:
        p.error("--router-seeds takes integers, --shares numbers (comma-separated)")
    if shares and not all(0.0 <= x <= 1.0 for x in shares):
        p.error("--shares must be in [0, 1]")
    try:
        paths = tuple(tuple(parse_path(x)) for x in a.path)
    except ValueError as e:
        p.error(str(e))
    names = setting_names(a.settings)
    if a.jobs < 1:
        p.error("--jobs must be at least 1")
    try:
        for n in names:
            _setting(n)
    except ValueError as e:
        p.error(str(e))
    allocators = tuple(x for x in a.allocators.split(",") if x)
    key = {"allocators": list(allocators), "router_seeds": list(seeds), "shares": None if shares is None else list(shares)}
    if paths:
        key["paths"] = [list(x) for x in paths]
    try:
        done = _saved_rows(a.out, key) if a.out else {}
    except (OSError, ValueError) as e:
        p.error(f"--out {a.out}: {e}")
    work = [(n, allocators, seeds, shares, paths) for n in names if n not in done]
    by_name = dict(done)
    bar = tqdm(total=len(names), initial=len(names) - len(work), desc="reachable", unit="setting", file=sys.stderr)
    for row in _run_all(work, a.jobs):
        by_name[row["setting"]] = _saved(a.out, key, row)
        bar.update()
    bar.close()
    rows = [by_name[n] for n in names]
    summary = {}
    if seeds:
        over = [r["over_router_seeds"]["over_best_static_pct"] for r in rows]
        summary = {**_worst_and_within(over, allocators, "worst_over_best_static_pct", "settings_within_5pct"),
                   "settings_counted": len(rows)}
        # rows saved by a run before the start_floor row lack it: counted only where present
        floor = [r["over_router_seeds"]["over_start_floor_pct"] for r in rows
                 if "over_start_floor_pct" in r["over_router_seeds"]]
        if floor and allocators:
            summary.update({**_worst_and_within(floor, allocators, "worst_over_start_floor_pct",
                                                "settings_within_5pct_over_start_floor"),
                            "settings_counted_over_start_floor": len(floor)})
    if a.json:
        print(json.dumps({"settings": rows, **summary}))
    else:
        for r in rows:
            print(f"{r['setting']}: oracle {r['oracle_p99_ms']} ms {r['oracle_schedule']}; reachable "
                  f"{r['reachable_path']} -> {r['reachable_p99_ms']} ms; regret % {r['regret_pct']}")
            for x in r.get("paths", []):
                print(f"  path {x['path']} -> {x['p99_ms']} ms")
            o = r.get("over_router_seeds")
            if o:
                for k, v in o["rows"].items():
                    print(f"  {k:<12} P99 over router seeds {o['router_seeds']}: median {v['median']:.3f} ms "
                          f"{v['p99_ms']} (spread {v['spread_pct']}%)")
                print(f"  over the best static ({o['best_static']}), medians: {o['over_best_static_pct']}")
                if "over_start_floor_pct" in o:
                    print(f"  over the start-up floor (the larger of the best static's and start_floor's "
                          f"medians): {o['over_start_floor_pct']}")
        if summary:
            print(f"medians over the best static split's, worst cell: {summary['worst_over_best_static_pct']}; "
                  f"cells within 5%: {summary['settings_within_5pct']} of {len(rows)}")
            if "worst_over_start_floor_pct" in summary:
                print(f"over the start-up floor, worst cell: {summary['worst_over_start_floor_pct']}; cells within "
                      f"5%: {summary['settings_within_5pct_over_start_floor']} of "
                      f"{summary['settings_counted_over_start_floor']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
