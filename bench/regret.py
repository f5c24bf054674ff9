"""Each allocator judged by its regret over a grid of settings.

    python -m bench.regret [--json] [--quick] [--out DIR] [--seeds 0,1,2] [--jobs N]
                           [--executor process|ray] [--address A] [--fresh]

A *setting* is one request stream on one cluster: a trace setting (the Taobao and Amazon samples
as the paper table runs them, and the paper-scale setting of `simulator.profiles.PaperScale` on
the Taobao sample), a regime (``steady``, ``trend``, ``burst``) or the schedule
(``steady,trend,burst,steady`` in one run), and a seed. On each setting every allocator runs with
the RACER router: each static split of the grid (each its own allocator), the replay oracle, the
hit-rate ``heuristic``, and the SmartAllocator rows ``racer`` and ``ppo`` (left out, with the
reason, when the shipped policy does not load). An allocator's regret on a setting is its P99
over the oracle's P99 minus 1 (in %; negative where it beats the greedy oracle); the output gives
per allocator ``max_regret_pct`` and ``mean_regret_pct`` over the settings, and ``settings`` (how
many).

Each setting is one `simulator.table.run_table` (with ``--out DIR`` its runs are saved under
``DIR/<setting>/runs`` and reused by a rerun with the same code and settings: an interrupted grid
resumes; without ``--out`` nothing is written), and the settings
run in parallel: a local process pool (``--jobs``, default one per core) or a Ray cluster
(``--executor ray --address A``; ``--address local`` starts a local Ray instance). A progress bar
counts settings.

``--quick``: short streams (sample settings: 8 nodes, 800 req/s, 4 s per regime, a 4+4+4+4 s
schedule, histories x4; paper-scale: one node at scale 1/384, 20 s per regime, a 20+20+16+20 s
schedule), shares 0.1 .. 0.9 in steps of 0.1. Default: 16 nodes, 2,000 req/s, 10 s per regime, a
10+10+5+10 s schedule, paper-scale on two nodes at scale 1/192, 20 s per regime, a 20+20+10+20 s
schedule, shares 0.05 .. 0.95 in steps of 0.05. Why 0.1 with ``--quick``: the oracle forks every
window once per grid share and every share is a static run of its own, so a setting costs about
twice the grid's size in runs; 0.05 steps double the quick grid's time on the 2-core VM
(``--share-step 0.05`` asks for them). ``--paper-regime-s S`` sets the paper-scale regime length (the
schedule's phases in proportion; default 20): an adaptive allocator starts at 0.5 and the guards
move the split at most 0.1 per 1-s interval, so a regime much shorter than that transient
measures the start-up, not the allocator (docs/results.md, "5-s paper-scale regimes").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

REGIMES = ("steady", "trend", "burst", "schedule")


def share_grid(step: float) -> tuple[float, ...]:
    """The static splits and the oracle's choices: ``step``, ``2 step``, ... below 1 (0.1 -> 0.1 ..
    0.9; 0.05 -> 0.05 .. 0.95)."""
    if not (0.0 < step <= 0.5):
        raise ValueError(f"share step must be in (0, 0.5], got {step!r}")
    n = int(round(1.0 / step))
    return tuple(round(k * step, 4) for k in range(1, n) if k * step < 1.0 - 1e-9)


def default_share_step(quick: bool) -> float:
    return 0.1 if quick else 0.05


@dataclass(frozen=True)
class Setting:
    """One cell of the grid."""

    trace: str
    setting: str  # "sample" or "paper-scale"
    regime: str  # a regime or "schedule"
    seed: int

    @property
    def name(self) -> str:
        return f"{self.trace}-{self.setting}-{self.regime}-s{self.seed}"


def grid(seeds=(0, 1, 2), traces=("taobao", "amazon"), paper_traces=("taobao",), regimes=REGIMES) -> list[Setting]:
    out = [Setting(t, "sample", r, s) for s in seeds for t in traces for r in regimes]
    out += [Setting(t, "paper-scale", r, s) for s in seeds for t in paper_traces for r in regimes]
    return out


# A paper-scale regime lasts PAPER_REGIME_S seconds (1-s control intervals). An adaptive allocator
# starts at emb_share 0.5 and the guards move the split at most 0.1 per interval KV-ward (0.05
# EMB-ward): crossing the guard range takes 9-18 intervals. A regime of 5 s is mostly that
# start-up transient (the 5-s KV-ward burst: +15% over the oracle on the fastest path the step
# limit allows, measured; docs/results.md), so a regime lasts about twice the KV-ward
# transient. The schedule keeps its proportions (burst phase 0.8x a regime with --quick, 0.5x without).
PAPER_REGIME_S = 20.0
_SCHEDULE_BURST = {True: 0.8, False: 0.5}


def table_config(st: Setting, quick: bool, smart: tuple[str, ...], policy: str | None = None,
                 paper_regime_s: float | None = None, share_step: float | None = None):
    """The `TableConfig` of one setting (racer router only, no other routers). ``paper_regime_s``
    sets the paper-scale settings' regime length (default `PAPER_REGIME_S`); their schedule's
    phases scale with it. ``share_step``: the grid of static splits and oracle choices
    (`share_grid`; default `default_share_step`)."""
    from simulator.table import TableConfig

    common = dict(trace=st.trace, seed=st.seed, routers=("racer",), other_router_allocators=(),
                  extra_allocators=smart, policy=policy, jobs=1)
    if st.setting == "paper-scale":
        d = PAPER_REGIME_S if paper_regime_s is None else float(paper_regime_s)
        sched = f"steady:{d:g},trend:{d:g},burst:{_SCHEDULE_BURST[quick] * d:g},steady:{d:g}"
        if quick:
            cfg = TableConfig.paper(quick=True, num_nodes=1, paper_scale=1 / 384, duration_s=d, **common)
        else:
            cfg = TableConfig.paper(quick=False, num_nodes=2, duration_s=d, **common)
    else:
        if quick:
            cfg = TableConfig.quick(num_nodes=8, rate_rps=800.0, duration_s=4.0, num_users=4_000, **common)
            sched = "steady:4,trend:4,burst:4,steady:4"
        else:
            cfg = TableConfig(num_nodes=16, rate_rps=2_000.0, duration_s=10.0, num_users=10_000, **common)
            sched = "steady:10,trend:10,burst:5,steady:10"
    shares = share_grid(default_share_step(quick) if share_step is None else share_step)
    if st.regime == "schedule":
        return replace(cfg, regimes=("schedule",), schedule=sched, shares=shares)
    return replace(cfg, regimes=(st.regime,), shares=shares)


# ------------------------------------------------------------------------------ the held-out grid


@dataclass(frozen=True)
class HoldoutSetting:
    """One held-out cell: a trace no policy was trained or tuned on (made in code from a spec, or a
    file the user names), a cluster, a load and a regime. ``known`` is the side the best split
    lies on by construction (``"kv"``: at most 0.3, ``"emb"``: at least 0.7) or None."""

    family: str
    trace: str  # a `workloads.loaders.LOADERS` kind ("synthetic": path is a spec)
    path: str
    num_nodes: int
    users_per_node: int
    rate_rps_per_node: float
    history_scale: float
    cache_fraction: float
    load: str  # "light" or "busy": the per-node rate's name
    regime: str
    seed: int = 0
    known: str | None = None

    @property
    def name(self) -> str:
        return f"holdout-{self.family}-{self.load}-{self.regime}-s{self.seed}"


# Per-node request rates of the held-out grid, stated before any run: "light" is the sample
# settings' per-node rate (SLO attainment 100%, load under 0.2: the tail is service time),
# "busy" about 5x that (load ~0.4-0.9 on the settings below: queueing starts to count).
HOLDOUT_RATES = {"light": 60.0, "busy": 300.0}
HOLDOUT_FAMILIES = ("kv-heavy", "emb-heavy", "cliff", "random", "file")
HOLDOUT_SEED_BASE = 7_000  # synthetic traces' seeds: disjoint from every seed a training or tuning run used
TUNE_SEED_BASE = 9_000  # `tune_grid`'s: the settings a tuning run may look at, disjoint from the held-out ones


def holdout_grid(quick: bool = True, extra_traces: tuple[tuple[str, str], ...] = (), num_random: int | None = None,
                 loads: tuple[str, ...] = ("light", "busy"), first_random: int = 0) -> list[HoldoutSetting]:
    """The held-out grid (`python -m bench.regret --holdout`): traces made in code that no policy
    saw, settings drawn over what decides the trade-off, at a light and a busy load.

    - ``kv-heavy`` (by construction): few users per node (30), each returning within seconds,
      with long histories (mean 150 items, x4) over a small, skewed catalogue (30k items, Zipf
      1.3): the KV pool decides, the best split is KV-heavy;
    - ``emb-heavy`` (by construction): every request a new user (20k users, more than the
      requests) with histories of 40 items (x4) over a flatter catalogue (60k items, Zipf 1.0) and
      an arena of 0.6 of the table: K/V is never reused, the EMB slab decides;
    - ``random-i``: a trace and cluster drawn from seed ``HOLDOUT_SEED_BASE + i``: users per node
      log-uniform in [20, 2000], items log-uniform in [5k, 150k], mean history 10-150 items,
      Zipf 0.8-1.3, history scale 1-5, arena 0.3-2x the table (log-uniform);
    - ``cliff-a`` / ``cliff-b`` (by construction): a performance cliff. Two users per node, each
      returning within a fraction of a second, with histories of 250 items x4 (1,000 tokens: 63
      pages of the A100 profile's 16-token pages each; ~126 pages per node) over 20k items (Zipf
      0.9): while the KV pool holds a node's users, their K/V are reused; below that, whole-user
      LRU evicts the one about to return and every request recomputes its history. The arena is
      0.85x the table (~177 pages) for ``cliff-a`` and 1.5x (~312 pages) for ``cliff-b``, sized
      for cliffs near shares 0.29 and 0.6; the router's placement and the users' growing
      histories put both between 0.1 and 0.2 on the busy trend (measured, docs/results.md).
      Regimes ``steady`` and ``trend``;
    - ``extra_traces``: ``(kind, path)`` files the user holds out (e.g. a public sequence dataset
      never used in training), at 150 users per node, histories x4, the arena the table's size.

    Regimes: the KV-heavy and EMB-heavy families run ``steady``, ``trend`` and ``burst``; the others
    ``steady`` and ``trend``. ``--quick``: 4 nodes, 20 s per run, 4 random settings; otherwise
    8 nodes, 30 s, 8 random settings. ``first_random`` (``--holdout-random-from``) starts the
    random settings at another index: a fresh draw, for a check on settings nobody has looked at."""
    nodes = 4 if quick else 8
    n_rand = (4 if quick else 8) if num_random is None else num_random
    out: list[HoldoutSetting] = []

    def add(family, trace, path, upn, hs, cf, regimes, known=None):
        for load in loads:
            for rg in regimes:
                out.append(HoldoutSetting(family, trace, path, nodes, upn, HOLDOUT_RATES[load], hs, cf, load, rg,
                                          known=known))

    add("kv-heavy", "synthetic", f"users={30 * nodes},items=30000,len=150,zipf=1.3,seed={HOLDOUT_SEED_BASE}", 30,
        4.0, 1.0, ("steady", "trend", "burst"), "kv")
    add("emb-heavy", "synthetic", f"users=20000,items=60000,len=40,zipf=1.0,seed={HOLDOUT_SEED_BASE + 1}",
        20_000 // nodes, 4.0, 0.6, ("steady", "trend", "burst"), "emb")
    for tag, cf, seed in (("a", 0.85, HOLDOUT_SEED_BASE + 2), ("b", 1.5, HOLDOUT_SEED_BASE + 3)):
        add(f"cliff-{tag}", "synthetic", f"users={2 * nodes},items=20000,len=250,zipf=0.9,seed={seed}", 2, 4.0, cf,
            ("steady", "trend"))
    for i in range(first_random, first_random + n_rand):
        add(f"random-{i}", *_random_draw(HOLDOUT_SEED_BASE, i, nodes), ("steady", "trend"))
    for j, (kind, path) in enumerate(extra_traces):
        add(f"file-{j}", kind, path, 150, 4.0, 1.0, ("steady", "trend"))
    return out


def _random_draw(seed_base: int, i: int, nodes: int) -> tuple:
    """The ``i``-th random setting drawn from ``seed_base``: ``("synthetic", spec, users per node,
    history scale, cache fraction)`` (the ranges: `holdout_grid`'s ``random-i``)."""
    import numpy as np

    rng = np.random.default_rng(seed_base + 100 + i)
    upn = int(round(math.exp(rng.uniform(math.log(20), math.log(2000)))))
    items = int(round(math.exp(rng.uniform(math.log(5_000), math.log(150_000)))))
    length = round(float(rng.uniform(10, 150)), 1)
    zipf = round(float(rng.uniform(0.8, 1.3)), 3)
    hs = round(float(rng.uniform(1.0, 5.0)), 2)
    cf = round(math.exp(float(rng.uniform(math.log(0.3), math.log(2.0)))), 3)
    spec = f"users={upn * nodes},items={items},len={length:g},zipf={zipf:g},seed={seed_base + 200 + i}"
    return "synthetic", spec, upn, hs, cf


def tune_grid(first: int = 0, num: int = 4, loads: tuple[str, ...] = ("light", "busy")) -> list[HoldoutSetting]:
    """Settings for tuning the allocator, never for judging it: random settings drawn as the
    held-out grid's ``random-i`` are (same ranges, 4 nodes, quick), from `TUNE_SEED_BASE`, disjoint
    from the held-out seeds. Named ``holdout-tune-i-LOAD-REGIME-s0`` (`bench.reachable` runs them)."""
    out = []
    for i in range(first, first + num):
        trace, spec, upn, hs, cf = _random_draw(TUNE_SEED_BASE, i, 4)
        for load in loads:
            for rg in ("steady", "trend"):
                out.append(HoldoutSetting(f"tune-{i}", trace, spec, 4, upn, HOLDOUT_RATES[load], hs, cf, load, rg))
    return out


def holdout_config(st: HoldoutSetting, quick: bool, smart: tuple[str, ...], policy: str | None = None,
                   share_step: float | None = None):
    """The `TableConfig` of one held-out setting (racer router only, the shares of `share_grid`:
    0.1 .. 0.9 with ``quick``, 0.05 .. 0.95 without, unless ``share_step`` says), with the
    ``oracle_start`` row: the replay oracle held at the configured split (0.5) for its first window,
    as every online allocator is (`simulator.cluster.oracle_replay`'s ``first_share``). Its regret
    is the start-up's floor: what knowing the future from the first decision on still loses to the
    best known split of the setting."""
    from simulator.table import TableConfig

    shares = share_grid(default_share_step(quick) if share_step is None else share_step)
    return TableConfig(trace=st.trace, path=st.path, regimes=(st.regime,), num_nodes=st.num_nodes,
                       rate_rps=st.rate_rps_per_node * st.num_nodes, duration_s=20.0 if quick else 30.0,
                       num_users=st.users_per_node * st.num_nodes, history_scale=st.history_scale,
                       cache_fraction=st.cache_fraction, shares=shares, routers=("racer",),
                       other_router_allocators=(), extra_allocators=tuple(smart) + ("oracle_start",), policy=policy,
                       seed=st.seed, jobs=1)


def holdout_findings(res: dict, settings: list[HoldoutSetting]) -> dict:
    """What the held-out grid must show: per setting each allocator's regret against the best known
    P99 (`best_known`), racer's worst and mean, the static splits' worst, the minimax static split,
    and for the constructed families the known side."""
    by_name = {st.name: st for st in settings}
    statics = sorted(a for a in res["allocators"] if a.startswith("static:"))
    rows, over = [], []
    for r in res["per_setting"]:
        best, best_by = best_known(r["p99_ms"])
        st = by_name.get(r["setting"])
        start = r["p99_ms"].get("oracle_start")
        row = {"setting": r["setting"], "oracle_p99_ms": r["p99_ms"].get("oracle"), "best_known_p99_ms": best,
               "best_known_by": best_by,
               "startup_floor_pct": round(100.0 * (start / best - 1.0), 2) if start and best else None,
               "regret_pct": {a: round(100.0 * (v / best - 1.0), 2) for a, v in r["p99_ms"].items()
                              if v is not None and best},
               "mean_share": r.get("mean_share", {}), "slo_attainment": r.get("slo_attainment", {}).get("oracle")}
        if st is not None and st.known is not None:
            row["known"] = st.known
        if start and best and r["p99_ms"].get("racer"):
            # racer against the better of the best known P99 and the oracle that starts at the
            # configured split: what is left once the start-up, which no online allocator avoids, is paid
            row["racer_over_startup_floor_pct"] = round(100.0 * (r["p99_ms"]["racer"] / max(best, start) - 1.0), 2)
            over.append(row["racer_over_startup_floor_pct"])
        rows.append(row)
    racer = res["allocators"].get("racer")
    mm = res["allocators"].get("minimax_static")
    worst_static = min((res["allocators"][a]["max_regret_pct"] for a in statics), default=None)
    return {"per_setting": rows,
            "racer_max_regret_pct": racer["max_regret_pct"] if racer else None,
            "racer_mean_regret_pct": racer["mean_regret_pct"] if racer else None,
            "static_max_regret_pct": {a: res["allocators"][a]["max_regret_pct"] for a in statics},
            "minimax_static": mm,
            "racer_max_within_5pct": racer is not None and racer["max_regret_pct"] <= 5.0,
            "startup_floor_max_pct": max((r["startup_floor_pct"] for r in rows if r["startup_floor_pct"] is not None),
                                         default=None),
            "racer_max_over_startup_floor_pct": max(over) if over else None,
            "racer_mean_over_startup_floor_pct": round(sum(over) / len(over), 2) if over else None,
            "racer_below_minimax_static": (racer is not None and mm is not None
                                           and racer["max_regret_pct"] < mm["max_regret_pct"]
                                           and racer["mean_regret_pct"] < mm["mean_regret_pct"]),
            "racer_below_every_static_max": (racer is not None and worst_static is not None
                                             and racer["max_regret_pct"] < worst_static)}


def run_setting(args) -> dict:
    """Run one setting's table (``(name, TableConfig, out_dir)``); return its P99 per allocator
    (the ``all`` rows)."""
    name, cfg, out = args
    from simulator.table import run_table

    res = run_table(cfg, Path(out) / name if out else None, progress=False, resume=True)
    p99, share, slo = {}, {}, {}
    for r in res["rows"]:
        if r.get("phase", "all") != "all" or r["router"] != "racer" or r["allocator"] == "best_static":
            continue
        p99[r["allocator"]] = r["p99_ms"]
        share[r["allocator"]] = r["mean_share"]
        slo[r["allocator"]] = r["slo_attainment"]
    return {"setting": name, "p99_ms": p99, "mean_share": share, "slo_attainment": slo, "runs": res["runs"],
            "wall_s": res["wall_s"]}


def best_known(p99_ms: dict) -> tuple[float | None, str | None]:
    """The best known P99 of one setting and who gave it: the lowest of the replay oracle's and
    every static split's (the yardstick every allocator is judged against)."""
    cands = [(v, a) for a, v in p99_ms.items() if v is not None and v > 0 and (a == "oracle" or a.startswith("static:"))]
    if not cands:
        return None, None
    v, a = min(cands)
    return v, a


def regret(results: list[dict]) -> dict:
    """Per allocator: regret = P99 / best known P99 - 1 on each setting (%, `best_known`), its max
    and mean; plus ``minimax_static``: the static split whose max regret is lowest (ties: the
    lower mean), with ``share`` naming it. Only settings where every static split ran count for
    the minimax choice."""
    per: dict[str, list[float]] = {}
    for r in results:
        best, _ = best_known(r["p99_ms"])
        if not best:
            continue
        for name, v in r["p99_ms"].items():
            if v is None:
                continue
            per.setdefault(name, []).append(100.0 * (v / best - 1.0))
    out = {name: {"max_regret_pct": round(max(v), 2), "mean_regret_pct": round(sum(v) / len(v), 2),
                  "settings": len(v)} for name, v in sorted(per.items())}
    statics = [a for a in out if a.startswith("static:")]
    if statics:
        n = max(out[a]["settings"] for a in statics)
        full = [a for a in statics if out[a]["settings"] == n]
        a = min(full, key=lambda a: (max(per[a]), sum(per[a]) / len(per[a]), a))
        out["minimax_static"] = {**out[a], "share": float(a.split(":", 1)[1])}
    return out


def run_grid(settings: list[Setting], quick: bool, out: str | None, executor: str = "process", jobs: int = 0,
             address: str | None = None, smart=("racer", "ppo"), policy: str | None = None,
             progress: bool = True, make_config=None, paper_regime_s: float | None = None,
             share_step: float | None = None) -> dict:
    """Run ``settings`` (each a `run_table` with ``make_config(setting, quick, smart, policy)``,
    `table_config` with ``paper_regime_s`` and ``share_step`` by default) on the executor; the
    figures of `regret` and each setting's P99s."""
    from tqdm import tqdm

    from simulator.cli import usable_smart_allocators

    t0 = time.perf_counter()
    smart = usable_smart_allocators(tuple(smart), policy) if smart else ()
    if make_config is None:
        def make_config(st, q, sm, pol):
            return table_config(st, q, sm, pol, paper_regime_s, share_step)
    work = [(st.name, make_config(st, quick, smart, policy), out) for st in settings]
    bar = tqdm(total=len(work), desc="regret", unit="setting", disable=not progress)
    results = []
    if executor == "ray":
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        started = not ray.is_initialized()
        if started:
            if address in (None, "", "local"):
                ray.init(num_cpus=jobs or (os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
        try:
            remote = ray.remote(num_cpus=1)(run_setting)
            pending = [remote.remote(w) for w in work]
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                results.append(ray.get(done[0]))
                bar.update(1)
        finally:
            if started:
                ray.shutdown()
    elif executor == "process":
        n = jobs or (os.cpu_count() or 1)
        if n <= 1:
            for w in work:
                results.append(run_setting(w))
                bar.update(1)
        else:
            from concurrent.futures import ProcessPoolExecutor, as_completed

            with ProcessPoolExecutor(max_workers=n) as pool:
                for f in as_completed([pool.submit(run_setting, w) for w in work]):
                    results.append(f.result())
                    bar.update(1)
    else:
        raise ValueError(f"unknown executor {executor!r}; choose process or ray")
    bar.close()
    results.sort(key=lambda r: r["setting"])
    return {"allocators": regret(results), "settings": len(results), "smart_allocators": list(smart),
            "per_setting": results, "quick": quick, "executor": executor,
            "paper_regime_s": PAPER_REGIME_S if paper_regime_s is None else paper_regime_s,
            "share_step": default_share_step(quick) if share_step is None else share_step,
            "runs": {k: sum(r["runs"][k] for r in results) for k in ("total", "computed", "reused")},
            "wall_s": round(time.perf_counter() - t0, 1)}


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 0:
        raise argparse.ArgumentTypeError("want at least one integer >= 0")
    return vals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.regret", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--quick", action="store_true", help="short streams (see the module docstring)")
    p.add_argument("--out", default=None, help="directory for each setting's runs (resumable); without it "
                                               "nothing is written and nothing is reused")
    p.add_argument("--seeds", type=_ints, default=(0, 1, 2))
    p.add_argument("--traces", default="taobao,amazon", help="sample traces of the grid")
    p.add_argument("--paper-traces", default="taobao", help="traces run in the paper-scale setting ('' for none)")
    p.add_argument("--regimes", default=",".join(REGIMES), help="regimes and/or 'schedule'")
    p.add_argument("--executor", choices=("process", "ray"), default="process")
    p.add_argument("--address", default=None, help="Ray cluster address (default / 'local': a local instance)")
    p.add_argument("--jobs", type=int, default=0, help="parallel settings (default: one per core)")
    p.add_argument("--no-smart", action="store_true", help="leave out the SmartAllocator rows")
    p.add_argument("--policy", default=None, help="policy artifact of the SmartAllocator rows")
    p.add_argument("--paper-regime-s", type=float, default=None,
                   help="length of a paper-scale regime, s (default 20); the paper-scale schedule's phases "
                        "scale with it")
    p.add_argument("--holdout", action="store_true",
                   help="the held-out grid instead: traces made in code that no policy was trained or tuned on, "
                        "at a light and a busy load (see holdout_grid)")
    p.add_argument("--holdout-trace", action="append", default=[], metavar="KIND:PATH",
                   help="with --holdout, a trace file you hold out too (repeatable), e.g. sequences:/data/beauty.txt")
    p.add_argument("--holdout-families", default=None, metavar="F,...",
                   help="with --holdout, only these families (kv-heavy, emb-heavy, cliff, random, file)")
    p.add_argument("--holdout-random-from", type=int, default=0, metavar="I",
                   help="with --holdout, draw the random settings from index I on (a fresh draw; default 0)")
    p.add_argument("--share-step", type=float, default=None,
                   help="grid of static splits and oracle choices (default 0.1 with --quick, else 0.05)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.share_step is not None and not (0.0 < args.share_step <= 0.5):
        p.error(f"--share-step: want a step in (0, 0.5], got {args.share_step:g}")
    if args.paper_regime_s is not None and not (args.paper_regime_s > 0 and args.paper_regime_s < 1e5):
        p.error(f"--paper-regime-s: want a positive number of seconds, got {args.paper_regime_s:g}")
    regimes = tuple(x.strip() for x in args.regimes.split(",") if x.strip())
    bad = [r for r in regimes if r not in REGIMES]
    if bad or not regimes:
        p.error(f"--regimes: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(REGIMES)}")
    if args.holdout:
        extra = []
        for spec in args.holdout_trace:
            kind, sep, path = spec.partition(":")
            if not sep or not path:
                p.error(f"--holdout-trace: want KIND:PATH, got {spec!r}")
            extra.append((kind, path))
        if args.holdout_random_from < 0:
            p.error("--holdout-random-from must be >= 0")
        hsettings = holdout_grid(args.quick, tuple(extra), first_random=args.holdout_random_from)
        if args.holdout_families:
            fams = tuple(f.strip() for f in args.holdout_families.split(",") if f.strip())
            bad = [f for f in fams if f not in HOLDOUT_FAMILIES]
            if bad or not fams:
                p.error(f"--holdout-families: unknown {', '.join(bad) or '(none)'}; choose from "
                        f"{', '.join(HOLDOUT_FAMILIES)}")
            hsettings = [st for st in hsettings if st.family.split("-")[0] in fams or st.family in fams]
            if not hsettings:
                p.error("--holdout-families: no setting left")
        step = args.share_step

        def make_holdout(st, q, sm, pol):
            return holdout_config(st, q, sm, pol, step)

        res = run_grid(hsettings, args.quick, args.out, args.executor, args.jobs, args.address,
                       () if args.no_smart else ("racer", "ppo"), args.policy, progress=not args.no_progress,
                       make_config=make_holdout, share_step=step)
        res["holdout"] = holdout_findings(res, hsettings)
        _print(res, args.json)
        return 0
    traces = tuple(x for x in args.traces.split(",") if x)
    paper = tuple(x for x in args.paper_traces.split(",") if x)
    settings = grid(args.seeds, traces, paper, regimes)
    if not settings:
        p.error("the grid is empty")
    res = run_grid(settings, args.quick, args.out, args.executor, args.jobs, args.address,
                   () if args.no_smart else ("racer", "ppo"), args.policy, progress=not args.no_progress,
                   paper_regime_s=args.paper_regime_s, share_step=args.share_step)
    _print(res, args.json)
    return 0


def _print(res: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(res))
        return
    h = res.get("holdout")
    if h:
        names = [a for a in res["allocators"] if a != "minimax_static"]
        print(f"{'setting':>40} {'oracle share':>12} " + " ".join(f"{a:>12}" for a in names))
        for r in h["per_setting"]:
            print(f"{r['setting']:>40} {r['mean_share'].get('oracle', float('nan')):>12.2f} "
                  + " ".join(f"{r['regret_pct'].get(a, float('nan')):>+11.2f}%" for a in names))
        print(f"start-up floor (oracle_start's regret): max {h['startup_floor_max_pct']}%; racer over the floor: "
              f"max {h['racer_max_over_startup_floor_pct']}%, mean {h['racer_mean_over_startup_floor_pct']}%")
        print()
    print(f"{'allocator':>14} {'max_regret_pct':>15} {'mean_regret_pct':>16} {'settings':>9}")
    for name, v in res["allocators"].items():
        label = f"minimax {v['share']:.2f}" if name == "minimax_static" else name
        print(f"{label:>14} {v['max_regret_pct']:>15.2f} {v['mean_regret_pct']:>16.2f} {v['settings']:>9}")
    print(f"{res['settings']} settings in {res['wall_s']} s; runs {res['runs']}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
