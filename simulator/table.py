"""The paper's table: every (allocator, router) pair on each regime of a trace, with the same streams.

For each regime of one trace:

1. generate the request stream once (same seed for every run);
2. **sweep** static splits (``static:<share>`` on the grid) with the RACER router;
3. **best static** = the sweep's lowest P99 (the best split in hindsight for this run);
4. **oracle** = `simulator.cluster.oracle_replay`: at every window boundary the run is forked once
   per grid share, each fork replays the window from the oracle's own state, and the share with
   the lowest window P99 is kept (the offline-optimal ``emb_share`` per window); its row is the
   run it kept, measured like any other;
5. **heuristic** (hit-rate heuristic), and any extra allocators (the SmartAllocator layers);
6. every other router with ``best_static`` and ``oracle`` (``--quick``: ``best_static`` only).

With an output directory, every finished run is saved at once under ``DIR/runs/`` keyed by
everything it depends on (the code, the trace file, the stream and simulator settings, the
allocator, router, schedule and policy files), so an interrupted table resumes where it stopped
and a rerun with more allocators or routers runs only the new ones (``resume=False``, the CLI's
``--fresh``, recomputes everything).

Each row carries P50/P99 (ms), SLO attainment, throughput, EMB and KV hit rates, the mean
``emb_share`` and the mean |emb_share - oracle| over nodes and windows. Runs are independent, so
they go to a process pool (``jobs``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from node_agent.memory import DEFAULT_GHOST_PROBES

from .allocators import HeuristicAllocator, ScheduleAllocator, StaticAllocator, needs_ghost_lists
from .capacity import bracket_and_bisect
from .cluster import SimConfig, SimResult, oracle_lookahead, oracle_replay, simulate

ROUTERS = ("racer", "kv_aware", "emb_aware", "least_load", "round_robin", "user_affinity")


@dataclass(frozen=True)
class TableConfig:
    """What one table run covers; `quick` gives a smaller, coarser version for smoke runs."""

    trace: str = "taobao"
    path: str | None = None
    regimes: tuple[str, ...] = ("steady", "trend", "burst")
    num_nodes: int = 32
    rate_rps: float = 4_000.0
    duration_s: float = 30.0
    num_users: int = 20_000
    history_scale: float = 10.0
    shares: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    routers: tuple[str, ...] = ROUTERS
    other_router_allocators: tuple[str, ...] = ("best_static", "oracle")  # run with every non-racer router
    extra_allocators: tuple[str, ...] = ()
    cache_fraction: float = 1.0
    profile: str = "a100-hstu"  # a name in simulator.profiles.PROFILES or a `racer node profile` JSON file
    policy: str | None = None  # the SmartAllocator rows' policy artifact directory (None: policies/default)
    slo_ms: float = 30.0
    seed: int = 0
    jobs: int = 0  # 0: one per core
    # "sample": the sample trace as it is (histories stretched by history_scale, the arena
    # cache_fraction x the trace's table); "paper-scale": `simulator.profiles.PaperScale` at
    # `paper_scale` (the trace built by `workloads.scale.paper_scale_trace`, the arena and byte
    # sizes of the scale model; num_users and rate_rps follow num_nodes: `TableConfig.paper`)
    setting: str = "sample"
    paper_scale: float = 1 / 192
    # "steady:60,trend:60,burst:30,steady:60": the regimes in one run (regimes becomes ("schedule",))
    schedule: str | None = None

    @classmethod
    def paper(cls, quick: bool = False, **kw) -> "TableConfig":
        """The paper-scale setting on ``num_nodes`` nodes (``--quick``: 1 node at scale 1/384, else
        4 nodes at 1/192) of the 32-node cluster: users and rate in proportion (31,250 users and
        125 req/s per node), histories as built (``history_scale`` 1), the racer router only unless
        ``routers`` says otherwise."""
        from .profiles import PaperScale

        nodes = int(kw.pop("num_nodes", 1 if quick else 4))
        kw.setdefault("paper_scale", 1 / 384 if quick else 1 / 192)
        ps = PaperScale(scale=float(kw["paper_scale"])).validate()
        base = dict(setting="paper-scale", num_nodes=nodes, num_users=ps.users_per_node * nodes,
                    rate_rps=ps.rate_rps_per_node * nodes, history_scale=1.0, routers=("racer",),
                    other_router_allocators=("best_static",), duration_s=30.0,
                    shares=(0.2, 0.5, 0.8) if quick else (0.1, 0.3, 0.5, 0.7, 0.9))
        base.update(kw)
        return cls(**base)

    @classmethod
    def quick(cls, **kw) -> "TableConfig":
        base = dict(rate_rps=2_000.0, duration_s=6.0, num_users=8_000, history_scale=4.0, shares=(0.2, 0.5, 0.8),
                    other_router_allocators=("best_static",))
        base.update(kw)
        return cls(**base)


@dataclass
class _Job:
    key: tuple
    regime: str
    allocator: str  # "static:0.30", "heuristic", "oracle", or an extra allocator spec
    router: str
    schedule: list[float] | None = None


_STREAMS: dict = {}


def setting_trace(cfg: TableConfig):
    """The trace a table of ``cfg`` replays: the sample as loaded (``setting="sample"``), or the
    paper-scale trace built from it (`workloads.scale.paper_scale_trace` with `PaperScale`'s rows
    and history tail, ``cfg.num_users`` users, seeded by ``cfg.seed``). Cached per process. The
    training environment builds its paper-scale episodes with it (`policies.env.EnvSetting`)."""
    from workloads import load_trace

    key = ("trace", cfg.trace, cfg.path)
    if key not in _STREAMS:
        _STREAMS[key] = load_trace(cfg.trace, cfg.path)
    if cfg.setting == "sample":
        return _STREAMS[key]
    if cfg.setting != "paper-scale":
        raise ValueError(f"unknown setting {cfg.setting!r}; choose sample or paper-scale")
    from workloads.regimes import RegimeConfig
    from workloads.scale import paper_scale_trace

    from .profiles import PaperScale

    ps = PaperScale(scale=cfg.paper_scale).validate()
    pkey = ("paper-scale", cfg.trace, cfg.path, cfg.num_users, cfg.paper_scale, cfg.seed)
    if pkey not in _STREAMS:
        _STREAMS[pkey] = paper_scale_trace(_STREAMS[key], num_users=cfg.num_users, num_rows=ps.scaled_rows(),
                                           history_tail=ps.history_tail,
                                           max_history_len=RegimeConfig().max_history_len, seed=cfg.seed)
    return _STREAMS[pkey]



def _stream(cfg: TableConfig, regime: str):
    from workloads import generate
    from workloads.regimes import generate_schedule

    key = (cfg.trace, cfg.path, regime, cfg.rate_rps, cfg.duration_s, cfg.num_users, cfg.history_scale, cfg.seed,
           cfg.setting, cfg.paper_scale, cfg.schedule)
    if key not in _STREAMS:
        trace = setting_trace(cfg)
        kw = dict(rate_rps=cfg.rate_rps, num_users=cfg.num_users, history_scale=cfg.history_scale, seed=cfg.seed)
        if regime == "schedule":
            if not cfg.schedule:
                raise ValueError("regime 'schedule' needs a schedule")
            _STREAMS[key] = generate_schedule(trace, cfg.schedule, **kw)
        else:
            _STREAMS[key] = generate(trace, regime=regime, duration_s=cfg.duration_s, **kw)
    return _STREAMS[key]


def sim_config(cfg: TableConfig) -> SimConfig:
    from .profiles import PaperScale, get_profile

    if cfg.setting == "paper-scale":
        ps = PaperScale(scale=cfg.paper_scale)
        return SimConfig(num_nodes=cfg.num_nodes, profile=ps.profile(get_profile(cfg.profile)),
                         cache_bytes=ps.scaled_arena_bytes(), slo_ms=cfg.slo_ms, seed=cfg.seed)
    return SimConfig(num_nodes=cfg.num_nodes, profile=get_profile(cfg.profile), cache_fraction=cfg.cache_fraction,
                     slo_ms=cfg.slo_ms, seed=cfg.seed)


GHOST_PROBES = DEFAULT_GHOST_PROBES  # the runs whose allocator reads the caches' ghost lists


# the oracles `_run` runs itself from the stream (their runs depend on the share grid)
_ORACLES = ("oracle", "oracle_lookahead", "oracle_start")


def _is_smart(spec: str) -> bool:
    """A SmartAllocator spec (read from a policy artifact), not one of the simulator's own."""
    return not (spec.startswith("static:") or spec in ("heuristic", "best_static") + _ORACLES)


def _make_allocator(spec: str, schedule, scfg: SimConfig, policy: str | None = None):
    if spec.startswith("static:"):
        return StaticAllocator(float(spec.split(":", 1)[1]))
    if spec == "heuristic":
        return HeuristicAllocator()
    if spec in ("oracle_lookahead", "oracle_start") and schedule is None:  # run by `_run` itself; nothing to build
        return None
    if not _is_smart(spec):  # "oracle" or "best_static": a schedule replayed
        return ScheduleAllocator(schedule, scfg.control_interval_s, name=spec)
    from .smart import make_smart_allocator  # the SmartAllocator layers (policies/)

    return make_smart_allocator(spec, policy)


def _run(args) -> tuple[tuple, dict, dict]:
    import torch

    torch.set_num_threads(1)
    cfg, job = args
    stream = _stream(cfg, job.regime)
    scfg = sim_config(cfg)
    if needs_ghost_lists(job.allocator):  # its residual layer reads the caches' marginal utilities
        scfg = replace(scfg, ghost_probes=GHOST_PROBES)
    if job.allocator == "oracle" and job.schedule is None:  # the replay oracle
        res, sched = oracle_replay(stream, scfg, cfg.shares, job.router)
        bands = res.extra["oracle_bands"]
    elif job.allocator == "oracle_start" and job.schedule is None:  # the replay oracle from the configured split
        res, sched = oracle_replay(stream, scfg, cfg.shares, job.router, first_share=scfg.initial_emb_share,
                                   name="oracle_start")
        bands = res.extra["oracle_bands"]
    elif job.allocator == "oracle_lookahead" and job.schedule is None:  # the per-phase schedule, beam search
        res, sched = oracle_lookahead(stream, scfg, cfg.shares, job.router)
        bands = None
    else:
        alloc = _make_allocator(job.allocator, job.schedule, scfg, cfg.policy)
        res = simulate(stream, scfg, alloc, job.router)
        sched = bands = None
    series = {"phases": phase_figures(stream, res, scfg),
              "window_p99_ms": res.window_p99_ms.tolist(), "shares": res.shares.mean(axis=1).tolist(),
              "share_matrix": res.shares.tolist(), "bursts": [list(b) for b in stream.bursts], "schedule": sched,
              "bands": bands}
    return job.key, res.summary(), series


def phase_name(regime: str, start_s: float, end_s: float) -> str:
    return f"{regime}[{start_s:g}-{end_s:g}s]"


def phase_figures(stream, res: SimResult, scfg: SimConfig) -> dict:
    """P50/P99, SLO attainment and mean share over each phase of a schedule (requests by arrival,
    control windows by start), keyed by `phase_name`; {} for a one-regime stream."""
    if len(stream.phases) < 2:
        return {}
    out = {}
    lat_ms = res.latency_s * 1e3
    w_start = np.arange(len(res.shares)) * scfg.control_interval_s
    for rg, a, b in stream.phases:
        m = (stream.arrival_s >= a) & (stream.arrival_s < b)
        wm = (w_start >= a) & (w_start < b)
        x = lat_ms[m]
        out[phase_name(rg, a, b)] = {
            "num_requests": int(m.sum()),
            "p50_ms": round(float(np.percentile(x, 50)), 3) if len(x) else None,
            "p99_ms": round(float(np.percentile(x, 99)), 3) if len(x) else None,
            "slo_attainment": round(float(np.mean(x <= scfg.slo_ms)), 5) if len(x) else None,
            "mean_share": round(float(res.shares[wm].mean()), 4) if wm.any() else None}
    return out


def _pool(cfg: TableConfig):
    jobs = cfg.jobs or (os.cpu_count() or 1)
    return ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else None


_CODE_PACKAGES = ("simulator", "node_agent", "control_plane", "policies", "workloads")


def _files_digest(paths, root: Path | None = None) -> str:
    """A digest of the files' names and contents; relative names are read under ``root`` (not the
    current directory: a table may be run from anywhere)."""
    h = hashlib.sha256()
    for f in paths:
        h.update(str(f).encode())
        h.update(b"\0")
        h.update((Path(root) / f if root is not None else Path(f)).read_bytes())
    return h.hexdigest()[:16]


def _trace_digest(trace) -> str:
    """What a run reads of a trace, whichever files it was loaded from (a loader may read sibling
    files, e.g. Amazon's item categories): histories, timestamps, categories, shards."""
    h = hashlib.sha256()
    h.update(trace.source_path.encode())
    for a in (trace.offsets, trace.items, trace.timestamps_s, trace.item_category, trace.item_shard):
        if a.ndim and a.strides[0] == 0:  # a constant (paper-scale timestamps, categories): no copy
            a = a[:1]
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    h.update(str(trace.num_shards).encode())
    return h.hexdigest()[:16]


def _library_versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "numpy", "onnxruntime", "onnxruntime-gpu"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


class RunCache:
    """Finished runs of a table saved under ``DIR/runs/<key>.json``, one file per run, written as
    each run ends (atomically), so nothing finished is lost when a table is interrupted.

    A run's key is a digest of everything that decides its result: the source of the packages a
    run executes (a code change invalidates every saved run), the versions of torch, numpy and
    onnxruntime, the loaded trace's content (whatever files the loader read), the stream's and
    the simulator's settings, the allocator, the router, the schedule it replays, the oracle's
    share grid, and the policy artifact's files for the SmartAllocator rows. A file that cannot be
    read back, or whose stored key differs, is recomputed (``unreadable`` counts them). When a run
    fails, the runs that finished are saved before the error is raised."""

    def __init__(self, cfg: TableConfig, out_dir: str | Path, resume: bool = True) -> None:
        root = Path(__file__).resolve().parents[1]
        self.dir = Path(out_dir) / "runs"
        self.resume = resume
        self.reused = self.saved = self.unreadable = 0
        code = _files_digest(sorted(f.relative_to(root) for pkg in _CODE_PACKAGES for f in (root / pkg).rglob("*.py")),
                             root)
        self._base = {"code": code, "libraries": _library_versions(), "trace": cfg.trace,
                      "trace_content": _trace_digest(setting_trace(cfg)),
                      "stream": [cfg.rate_rps, cfg.duration_s, cfg.num_users, cfg.history_scale, cfg.seed,
                                 cfg.setting, cfg.paper_scale, cfg.schedule],
                      "sim": asdict(sim_config(cfg))}  # `_canon` makes it JSON
        self._policy = None
        self._cfg = cfg

    def _policy_digest(self) -> str:
        if self._policy is None:
            from .smart import DEFAULT_ARTIFACT

            d = Path(self._cfg.policy) if self._cfg.policy else DEFAULT_ARTIFACT
            files = sorted(f for f in d.rglob("*") if f.is_file()) if d.is_dir() else []
            self._policy = _files_digest(files)
        return self._policy

    def key(self, job: _Job) -> dict:
        return _canon(self._base | {"regime": job.regime, "allocator": job.allocator, "router": job.router,
                                    "schedule": job.schedule,
                                    "shares": list(self._cfg.shares)
                                    if job.allocator in _ORACLES else None,
                                    "policy": self._policy_digest() if _is_smart(job.allocator) else None})

    def _file(self, key: dict) -> Path:
        return self.dir / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json")

    def get(self, key: dict):
        """The saved ``(summary, series)`` of the run with this `key`, or None."""
        if not self.resume:
            return None
        f = self._file(key)
        if not f.exists():
            return None
        try:
            saved = json.loads(f.read_text())
            if saved["key"] != key:
                raise ValueError("key differs")
            hit = saved["summary"], saved["series"]
        except (OSError, ValueError, KeyError, TypeError):
            self.unreadable += 1
            return None
        self.reused += 1
        return hit

    def put(self, key: dict, summary: dict, series: dict) -> None:
        f = self._file(key)
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"key": key, "summary": summary, "series": series}))
            os.replace(tmp, f)
        finally:
            tmp.unlink(missing_ok=True)
        self.saved += 1


def _canon(x):
    """A run key in one form whatever the caller's number types (200 and 200.0 are one setting)."""
    if isinstance(x, dict):
        return {str(k): _canon(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_canon(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, (int, float)):
        return float(x) if math.isfinite(x) else str(float(x))
    return str(x)


def _map(pool, cfg: TableConfig, jobs: list[_Job], bar, cache: RunCache | None = None):
    """Run ``jobs`` (those not in ``cache``), saving each to ``cache`` as it finishes."""
    out, todo = {}, []
    keys = {j.key: cache.key(j) for j in jobs} if cache is not None else {}
    for j in jobs:
        hit = cache.get(keys[j.key]) if cache is not None else None
        if hit is not None:
            out[j.key] = hit
            bar.update(1)
        else:
            todo.append(j)

    def done(j, s, ser):
        out[j.key] = (s, ser)
        if cache is not None:
            cache.put(keys[j.key], s, ser)
        bar.update(1)

    if pool is None:
        for j in todo:
            _, s, ser = _run((cfg, j))
            done(j, s, ser)
        return out
    futures = {pool.submit(_run, (cfg, j)): j for j in todo}
    failed = None
    for f in as_completed(futures):  # a failed run stops the table only after the others are saved
        try:
            _, s, ser = f.result()
        except Exception as e:  # noqa: BLE001 - re-raised below
            failed = failed or e
            continue
        done(futures[f], s, ser)
    if failed is not None:
        raise failed
    return out


KNEE = 2.0  # the knee rule's bound: P99 within this many times the light-load P99


def steady_capacity(cfg: TableConfig, *, duration_s: float = 20.0, share: float = 0.5, iters: int = 6,
                    progress: bool = False, router: str = "racer") -> dict:
    """The cluster's steady capacity, found before any allocator runs: the highest base rate of a
    ``steady`` stream whose P99, at the static split ``share`` with ``router`` (RACER's), stays within
    a limit. The limit is the SLO (``cfg.slo_ms``, ``rule`` "slo"); where no rate meets it (the
    service time alone puts the tail above the SLO: the light-load P99 is a floor), it is `KNEE`
    times the P99 at the lowest rate probed (``rule`` "knee": where queueing has doubled the tail).
    From ``cfg.rate_rps`` the rate doubles (or halves) until the limit is crossed, then ``iters``
    bisections (relative precision 2^-iters of the bracket; `simulator.capacity.bracket_and_bisect`,
    the fleet bench's search too). Returns the capacity per node, the rule, the limit and the probes ``[rate_rps, p99_ms]``, in the order run. This is the
    provisioning rule the load sweep (``--load F``: per-node rate = F x this) starts from; it is
    not tuned toward any allocator."""
    from tqdm import tqdm

    scfg = sim_config(cfg)
    probes: list[list[float]] = []
    bar = tqdm(total=None, desc="capacity", unit="probe", disable=not progress)

    def p99_at(rate: float) -> float | None:
        if rate * duration_s < 20:  # too few requests to say anything about a P99
            return None
        c = replace(cfg, rate_rps=float(rate), duration_s=float(duration_s), regimes=("steady",), schedule=None)
        res = simulate(_stream(c, "steady"), scfg, StaticAllocator(share), router)
        v = float(res.summary()["p99_ms"])
        probes.append([round(float(rate), 3), round(v, 3)])
        bar.update(1)
        return v

    def bracket(limit: float, start: float):
        def passes(r: float) -> bool | None:
            v = next((p for q, p in probes if q == round(r, 3)), None)  # a rate probed before
            if v is None:
                v = p99_at(r)
            return None if v is None else v <= limit

        return bracket_and_bisect(passes, start, iters, max_bracket_probes=12)

    try:
        rule, limit = "slo", float(cfg.slo_ms)
        found = bracket(limit, float(cfg.rate_rps))
        if found.lo is None:
            if not probes:
                raise ValueError(f"no rate down to {found.stop_rate:g} req/s gives {cfg.slo_ms:g} ms or any P99: "
                                 "too few requests")
            light = min(probes, key=lambda p: p[0])
            rule, limit = "knee", KNEE * light[1]
            found = bracket(limit, light[0])
            if found.lo is None:
                raise ValueError(f"no rate down to {found.stop_rate:g} req/s keeps P99 within {KNEE:g}x the light-load "
                                 f"P99 at static {share}: probes {probes}")
        if found.hi is None:
            raise ValueError(f"every rate up to {found.stop_rate:g} req/s keeps P99 within {limit:g} ms: probes {probes}")
        lo = found.lo
    finally:
        bar.close()
    out = {"capacity_rps": round(lo, 3), "capacity_rps_per_node": round(lo / cfg.num_nodes, 3),
           "share": share, "router": router, "slo_ms": float(cfg.slo_ms), "rule": rule, "limit_ms": round(limit, 3),
           "probe_duration_s": duration_s, "probes": probes}
    if rule == "knee":
        out["light_load_p99_ms"] = min(probes, key=lambda p: p[0])[1]
    return out


def _table_rows(cfg: TableConfig, plans: dict, sweep: dict, done: dict) -> tuple[list[dict], dict]:
    """The table's rows and each run's series (by ``(regime, allocator, router)``) from the finished
    runs: per regime the static sweep, the best static split, the oracle, the heuristic, the extra
    allocators, then the other routers; a schedule's rows give each phase, then the whole run."""
    rows: list[dict] = []
    series: dict = {}
    for rg in cfg.regimes:
        best, sched, by_share = plans[rg]
        oracle = np.array(sched)
        bands = sweep[("oracle", rg, "racer")][1]["bands"]

        def row(alloc: str, router: str, summary: dict, ser: dict) -> dict:
            sm = np.array(ser["share_matrix"])  # [windows, nodes]
            err = float(np.mean(np.abs(sm - oracle[: len(sm), None]))) if len(sm) else None
            band_err = band_error(sm, bands, cfg.shares)
            return {"trace": cfg.trace, "regime": rg, "allocator": alloc, "router": router, "phase": "all",
                    "p50_ms": summary["p50_ms"], "p99_ms": summary["p99_ms"],
                    "slo_attainment": summary["slo_attainment"], "throughput_rps": summary["throughput_rps"],
                    "emb_hit_rate": summary["emb_hit_rate"], "kv_hit_rate": summary["kv_hit_rate"],
                    "mean_share": summary["mean_share"],
                    "mean_abs_share_error": round(err, 4) if err is not None else None,
                    "mean_share_error_to_band": round(band_err, 4) if band_err is not None else None,
                    "num_requests": summary["num_requests"]}

        for s in cfg.shares:
            summary, ser = by_share[s]
            rows.append(row(f"static:{s:.2f}", "racer", summary, ser))
            series[(rg, f"static:{s:.2f}", "racer")] = ser
        summary, ser = by_share[best]
        rows.append(row("best_static", "racer", summary, ser) | {"best_static_share": best})
        series[(rg, "best_static", "racer")] = ser
        for key in [("oracle", rg, "racer"), ("heuristic", rg, "racer")] + \
                   [(spec, rg, "racer") for spec in cfg.extra_allocators] + \
                   [(a, rg, rt) for rt in cfg.routers if rt != "racer" for a in cfg.other_router_allocators]:
            summary, ser = sweep[key] if key[0] == "oracle" and key[2] == "racer" else done[key]
            rows.append(row(key[0], key[2], summary, ser))
            series[(rg, key[0], key[2])] = ser

    expanded = []
    for r in rows:  # a schedule's rows: each phase, then the whole run ("all")
        for ph, f in (series.get((r["regime"], r["allocator"], r["router"])) or {}).get("phases", {}).items():
            expanded.append({**{k: None for k in r}, "trace": r["trace"], "regime": r["regime"],
                             "allocator": r["allocator"], "router": r["router"], "phase": ph, **f})
        expanded.append(r)
    return expanded, series


def run_table(cfg: TableConfig, out_dir: str | Path | None = None, progress: bool = True,
              resume: bool = True) -> dict:
    """Run the table for one trace; return ``{"rows": [...], ...}`` and write it (and plots) to
    ``out_dir`` when given, with every finished run saved under ``out_dir/runs`` (`RunCache`);
    ``resume``: reuse the runs saved there by the same code and settings (False: recompute all).
    ``result["runs"]`` says how many were computed, reused and unreadable."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    for r in cfg.routers:
        if r not in ROUTERS:
            raise ValueError(f"unknown router {r!r}; choose from {', '.join(ROUTERS)}")
    if not cfg.shares or any(not 0 <= s <= 1 for s in cfg.shares):
        raise ValueError("shares must be a non-empty list of values in [0, 1]")
    _stream(cfg, cfg.regimes[0])  # fail fast on a bad trace, regime, profile or policy, before the pool starts
    sim_config(cfg).validate()
    for spec in cfg.extra_allocators:
        _make_allocator(spec, None, sim_config(cfg), cfg.policy)
    n_other = len(cfg.routers) - (1 if "racer" in cfg.routers else 0)
    n_runs = len(cfg.regimes) * (len(cfg.shares) + 2 + len(cfg.extra_allocators)
                                 + len(cfg.other_router_allocators) * n_other)  # the oracle counts as one
    cache = RunCache(cfg, out_dir, resume) if out_dir is not None else None
    bar = tqdm(total=n_runs, desc=f"paper-table {cfg.trace}", unit="run", disable=not progress)
    pool = _pool(cfg)
    try:
        # 1. the static sweeps and the replay oracle (the longest job, first), every regime at once
        first = [_Job(("oracle", rg, "racer"), rg, "oracle", "racer") for rg in cfg.regimes]
        first += [_Job(("sweep", rg, s), rg, f"static:{s:.2f}", "racer") for rg in cfg.regimes for s in cfg.shares]
        sweep = _map(pool, cfg, first, bar, cache)
        plans = {}
        jobs: list[_Job] = []
        for rg in cfg.regimes:
            by_share = {s: sweep[("sweep", rg, s)] for s in cfg.shares}
            best = min(cfg.shares, key=lambda s: (by_share[s][0]["p99_ms"], by_share[s][0]["p50_ms"]))
            sched = sweep[("oracle", rg, "racer")][1]["schedule"]
            plans[rg] = (best, sched, by_share)
            nw = len(sched)
            jobs.append(_Job(("heuristic", rg, "racer"), rg, "heuristic", "racer"))
            for spec in cfg.extra_allocators:
                jobs.append(_Job((spec, rg, "racer"), rg, spec, "racer"))
            for rt in cfg.routers:
                if rt == "racer":
                    continue
                for a in cfg.other_router_allocators:
                    jobs.append(_Job((a, rg, rt), rg, a, rt, [best] * nw if a == "best_static" else sched))
        done = _map(pool, cfg, jobs, bar, cache)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        bar.close()

    rows, series = _table_rows(cfg, plans, sweep, done)
    result = {
        "trace": cfg.trace,
        "setting": cfg.setting,
        "schedule": cfg.schedule,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        "sim_config": _json_safe(asdict(sim_config(cfg))),
        "profile": _json_safe(sim_config(cfg).profile.to_json()),
        "rows": rows,
        "oracle": {rg: {"schedule": plans[rg][1], "mean_share": round(float(np.mean(plans[rg][1])), 4),
                        "best_static_share": plans[rg][0], "bands": sweep[("oracle", rg, "racer")][1]["bands"]}
                   for rg in cfg.regimes},
        "wall_s": round(time.perf_counter() - t0, 1),
        "runs": {"total": n_runs, "computed": cache.saved if cache else n_runs,
                 "reused": cache.reused if cache else 0, "unreadable": cache.unreadable if cache else 0},
    }
    result["findings"] = findings(result)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"paper_table_{cfg.trace}.json").write_text(json.dumps(result, indent=1))
        result["plots"] = write_plots(result, series, out, cfg)
    return result


_SEED_FIGURES = ("p50_ms", "p99_ms", "slo_attainment", "throughput_rps", "emb_hit_rate", "kv_hit_rate",
                 "mean_share", "mean_abs_share_error")


def _spread(values: list) -> dict | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"mean": round(float(np.mean(vals)), 4), "min": min(vals), "max": max(vals), "per_seed": values}


def run_seeds(cfg: TableConfig, seeds, out_dir: str | Path | None = None, progress: bool = True,
              resume: bool = True) -> dict:
    """The table once per seed (each seed draws other request streams and candidate pools), each in
    ``out_dir/seed<S>`` (its JSON, plots and saved runs), and the figures across seeds: per
    (regime, allocator, router) the mean, min, max and per-seed values of each row's figures, and
    per regime the same of the findings (best static P99 over the oracle's, the oracle's mean
    share). Written to ``out_dir/paper_table_<trace>_seeds.json``."""
    seeds = [int(x) for x in seeds]
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"seeds must be distinct integers >= 0, got {seeds}")
    t0 = time.perf_counter()
    per = {}
    for sd in seeds:
        sub = Path(out_dir) / f"seed{sd}" if out_dir is not None else None
        per[sd] = run_table(replace(cfg, seed=sd), sub, progress=progress, resume=resume)
    index = {sd: {(r["regime"], r["allocator"], r["router"]): r for r in res["rows"]} for sd, res in per.items()}
    rows = []
    for k in index[seeds[0]]:  # the first seed's rows, in their order
        got = [index[sd].get(k) for sd in seeds]
        row = {"trace": cfg.trace, "regime": k[0], "allocator": k[1], "router": k[2]}
        for fig in _SEED_FIGURES:
            row[fig] = _spread([g[fig] if g else None for g in got])
        if k[1] == "best_static":
            row["best_static_share"] = [g.get("best_static_share") if g else None for g in got]
        rows.append(row)
    find = {}
    for rg in cfg.regimes:
        f = {}
        for name in ("best_static_p99_over_oracle", "oracle_mean_share"):
            f[name] = _spread([per[sd]["findings"].get(rg, {}).get(name) for sd in seeds])
        find[rg] = f
    find["oracle_mean_share_spread"] = _spread([per[sd]["findings"].get("oracle_mean_share_spread") for sd in seeds])
    result = {"trace": cfg.trace, "seeds": seeds, "rows": rows, "findings": find,
              "per_seed": {str(sd): {"findings": per[sd]["findings"], "runs": per[sd]["runs"],
                                     "wall_s": per[sd]["wall_s"]} for sd in seeds},
              "wall_s": round(time.perf_counter() - t0, 1)}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"paper_table_{cfg.trace}_seeds.json").write_text(json.dumps(result, indent=1))
        result["plot"] = write_seed_plot(result, out / f"paper_table_{cfg.trace}_seeds.png")
    return result


def write_seed_plot(result: dict, path: Path) -> str:
    """Per regime, each racer-router allocator's P99 over the best static split's of the same seed
    (%): one dot per seed and the mean as a bar, so what moves with the streams is plain to see."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["router"] == "racer" and not r["allocator"].startswith("static:")]
    regimes = list(dict.fromkeys(r["regime"] for r in rows))
    fig, axes = plt.subplots(1, len(regimes), figsize=(4.8 * len(regimes), 4.2), squeeze=False)
    for ax, rg in zip(axes[0], regimes):
        mine = [r for r in rows if r["regime"] == rg]
        base = next(r for r in mine if r["allocator"] == "best_static")["p99_ms"]["per_seed"]
        names = [r["allocator"] for r in mine if r["allocator"] != "best_static"]
        for i, r in enumerate(r for r in mine if r["allocator"] != "best_static"):
            rel = [100 * (v / b - 1) for v, b in zip(r["p99_ms"]["per_seed"], base) if v is not None and b]
            if rel:
                ax.bar(i, float(np.mean(rel)), color="tab:blue", alpha=0.35)
                ax.scatter([i] * len(rel), rel, color="tab:blue", s=18, zorder=3)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{result['trace']} / {rg}")
        ax.set_ylabel("P99 over best static (%), per seed")
    fig.suptitle(f"seeds {', '.join(map(str, result['seeds']))}: bars the mean, dots the seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def format_seed_rows(rows: list[dict]) -> str:
    """The across-seed rows: mean [min, max] of P99, SLO attainment and mean share."""
    lines = [f"{'regime':>8} {'allocator':>22} {'router':>13} {'p99_ms mean [min, max]':>28} "
             f"{'slo mean [min, max]':>26} {'mean_share':>10}"]

    def fmt(v, nd):
        return "-" if v is None else f"{v['mean']:.{nd}f} [{v['min']:.{nd}f}, {v['max']:.{nd}f}]"

    for r in rows:
        share = "-" if r["mean_share"] is None else f"{r['mean_share']['mean']:.3f}"
        lines.append(f"{r['regime']:>8} {r['allocator']:>22} {r['router']:>13} {fmt(r['p99_ms'], 2):>28} "
                     f"{fmt(r['slo_attainment'], 4):>26} {share:>10}")
    return "\n".join(lines)


def band_error(share_matrix: np.ndarray, bands: list[list[float]], grid) -> float | None:
    """Mean over windows and nodes of the distance from a node's share to the window's oracle band
    (the grid shares whose window P99 the replay could not tell apart from the best,
    `oracle_replay`). Adjacent grid shares that are both in the band count as the whole interval
    between them (a share between two equally good splits is as good as they are, as far as the
    grid can tell); an isolated one as a point. 0 wherever a split is as good as the oracle's
    within the window P99's sampling error."""
    if not len(share_matrix) or not bands:
        return None
    grid = sorted(float(g) for g in grid)
    d = []
    for row, band in zip(share_matrix, bands):
        if not band:
            continue
        inb = [g in band for g in grid]
        runs, k = [], 0
        while k < len(grid):  # maximal runs of adjacent grid shares in the band -> [lo, hi]
            if inb[k]:
                j = k
                while j + 1 < len(grid) and inb[j + 1]:
                    j += 1
                runs.append((grid[k], grid[j]))
                k = j + 1
            else:
                k += 1
        lo = np.array([r[0] for r in runs])[None, :]
        hi = np.array([r[1] for r in runs])[None, :]
        x = np.asarray(row, dtype=np.float64)[:, None]
        d.append(np.min(np.maximum(0.0, np.maximum(lo - x, x - hi)), axis=1))
    return float(np.mean(np.concatenate(d))) if d else None


def _json_safe(d):
    if isinstance(d, dict):
        return {k: _json_safe(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [_json_safe(v) for v in d]
    if isinstance(d, float) and not math.isfinite(d):
        return str(d)
    return d


def findings(result: dict) -> dict:
    """The figures the paper's claims are checked against, per regime."""
    out = {}
    rows = result["rows"]
    means = [v["mean_share"] for v in result["oracle"].values()]
    for rg in result["oracle"]:
        def get(alloc, router="racer"):
            return next((r for r in rows if r["regime"] == rg and r["allocator"] == alloc and r["router"] == router
                         and r.get("phase", "all") == "all"), None)

        best, oracle = get("best_static"), get("oracle")
        f = {"oracle_mean_share": result["oracle"][rg]["mean_share"],
             "best_static_share": result["oracle"][rg]["best_static_share"]}
        if best and oracle and oracle["p99_ms"]:
            f["best_static_p99_over_oracle"] = round(best["p99_ms"] / oracle["p99_ms"] - 1, 4)
        bands = result["oracle"][rg].get("bands") or []
        if bands:  # how often the window's replay cannot tell the oracle's share from others
            f["oracle_band_mean_size"] = round(float(np.mean([len(b) for b in bands])), 3)
            f["oracle_band_ambiguous_windows"] = round(float(np.mean([len(b) > 1 for b in bands])), 3)
        if rg == "schedule" and best and oracle and oracle["p99_ms"]:  # one split for the whole schedule
            f["best_single_static_share"] = f["best_static_share"]
            f["best_single_static_over_oracle_pct"] = round(100 * (best["p99_ms"] / oracle["p99_ms"] - 1), 2)
            look = get("oracle_lookahead")
            if look and look["p99_ms"]:
                f["best_single_static_over_lookahead_oracle_pct"] = round(100 * (best["p99_ms"] / look["p99_ms"] - 1),
                                                                          2)
                for name in ("racer", "ppo", "heuristic", "oracle"):
                    r = get(name)
                    if r and r["p99_ms"]:
                        f[f"{name}_over_lookahead_oracle_pct"] = round(100 * (r["p99_ms"] / look["p99_ms"] - 1), 2)
            for name in ("racer", "ppo", "heuristic"):
                r = get(name)
                if r and r["p99_ms"]:
                    f[f"{name}_over_oracle_pct"] = round(100 * (r["p99_ms"] / oracle["p99_ms"] - 1), 2)
                    f[f"{name}_over_best_single_static_pct"] = round(100 * (r["p99_ms"] / best["p99_ms"] - 1), 2)
            out.update({k: v for k, v in f.items()
                        if k.startswith(("best_single", "racer_", "ppo_", "heuristic_", "oracle_over"))})
        out[rg] = f
    out["oracle_mean_share_spread"] = round(max(means) - min(means), 4) if means else None
    return out


def write_plots(result: dict, series: dict, out: Path, cfg: TableConfig) -> dict:
    """P99 over time (bursts shaded) and emb_share over time per allocator with the oracle band
    shaded (the shares the window's replay could not tell from the best), HTML + PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    interval = sim_config(cfg).control_interval_s
    allocs = ["best_static", "oracle", "heuristic"] + list(cfg.extra_allocators)

    def band(rg):  # the oracle band's span per window (lowest and highest share the replay could not rule out)
        bands = (series.get((rg, "oracle", "racer")) or {}).get("bands") or []
        if not bands:
            return None
        t = (np.arange(len(bands)) + 0.5) * interval
        return t, np.array([min(b) for b in bands]), np.array([max(b) for b in bands])

    spans = {rg: band(rg) for rg in cfg.regimes}
    fig, axes = plt.subplots(2, len(cfg.regimes), figsize=(5.5 * len(cfg.regimes), 7), squeeze=False)
    for j, rg in enumerate(cfg.regimes):
        b = spans[rg]
        if b is not None:
            axes[1, j].fill_between(b[0], b[1], b[2], step="mid", color="grey", alpha=0.2, label="oracle band")
        for a in allocs:
            ser = series.get((rg, a, "racer"))
            if ser is None:
                continue
            t = (np.arange(len(ser["window_p99_ms"])) + 0.5) * interval
            axes[0, j].plot(t, ser["window_p99_ms"], label=a)
            axes[1, j].plot(t, ser["shares"], label=a)
        for s, e in (series.get((rg, "oracle", "racer")) or {}).get("bursts", []):
            for i in range(2):
                axes[i, j].axvspan(s, e, color="crimson", alpha=0.15)
        axes[0, j].axhline(cfg.slo_ms, color="grey", ls="--", lw=1)
        axes[0, j].set_title(f"{cfg.trace} / {rg}")
        axes[0, j].set_ylabel("P99 per window (ms)")
        axes[1, j].set_ylabel("mean emb_share over nodes")
        axes[1, j].set_xlabel("time (s)")
        axes[1, j].set_ylim(0, 1)
        for i in range(2):
            axes[i, j].grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    if spans[cfg.regimes[0]] is not None:
        axes[1, 0].legend(fontsize=8, loc="lower left")  # the band's swatch
    fig.tight_layout()
    png = out / f"paper_table_{cfg.trace}.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    paths["png"] = str(png)

    from plotly.subplots import make_subplots
    import plotly.graph_objects as go

    pfig = make_subplots(rows=2, cols=len(cfg.regimes), subplot_titles=[f"{rg}: P99 per window" for rg in cfg.regimes]
                         + [f"{rg}: emb_share" for rg in cfg.regimes])
    for j, rg in enumerate(cfg.regimes, start=1):
        b = spans[rg]
        if b is not None:
            pfig.add_trace(go.Scatter(x=b[0].tolist(), y=b[2].tolist(), mode="lines", line={"width": 0, "shape": "hvh"},
                                      showlegend=False, hoverinfo="skip"), row=2, col=j)
            pfig.add_trace(go.Scatter(x=b[0].tolist(), y=b[1].tolist(), mode="lines", fill="tonexty",
                                      line={"width": 0, "shape": "hvh"}, fillcolor="rgba(128,128,128,0.2)",
                                      name=f"{rg} oracle band"), row=2, col=j)
        for a in allocs:
            ser = series.get((rg, a, "racer"))
            if ser is None:
                continue
            t = ((np.arange(len(ser["window_p99_ms"])) + 0.5) * interval).tolist()
            pfig.add_trace(go.Scatter(x=t, y=ser["window_p99_ms"], name=f"{rg} {a}", mode="lines"), row=1, col=j)
            pfig.add_trace(go.Scatter(x=t, y=ser["shares"], name=f"{rg} {a} share", mode="lines"), row=2, col=j)
        for s, e in (series.get((rg, "oracle", "racer")) or {}).get("bursts", []):
            for i in (1, 2):
                pfig.add_vrect(x0=s, x1=e, fillcolor="crimson", opacity=0.15, line_width=0, row=i, col=j)
    pfig.update_layout(title=f"RACER simulator: {cfg.trace}", height=750, template="plotly_white")
    html = out / f"paper_table_{cfg.trace}.html"
    pfig.write_html(html, include_plotlyjs=True)
    paths["html"] = str(html)
    return paths


def format_rows(rows: list[dict]) -> str:
    cols = ("regime", "allocator", "router", "p50_ms", "p99_ms", "slo_attainment", "throughput_rps", "emb_hit_rate",
            "kv_hit_rate", "mean_share", "mean_abs_share_error", "mean_share_error_to_band")
    lines = [" ".join(f"{c:>14}" for c in cols)]
    for r in rows:
        lines.append(" ".join(f"{(r[c] if r[c] is not None else '-')!s:>14}" for c in cols))
    return "\n".join(lines)
