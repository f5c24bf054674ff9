"""Replay a window of the gateways' traffic samples through the simulator (the what-if's engine).

`sampled_stream` turns the stored samples of a window (`SampledRequests`: per request the time,
the keyed hash of the user, the history length, the history's most recent item hashes, the new
items and candidates, hashed alike) into a `RequestStream` the simulator runs as it runs a
generated one, in the recorded order:

- **users**: one simulated user per distinct user hash (dense index, in hash order); a user's
  requests keep their times, so its reuse (KV prefix, returning users) is the fleet's own;
- **items**: one dense item id per distinct item hash; reuse across requests and users is kept,
  the ids are not (the hash is keyed; the dense ids are a relabelling);
- **histories**: each user's sequence is rebuilt position by position (item at position ``p`` of
  the user's history, as the simulator reads it): a sample names the items at positions
  ``[history_len - len(items), history_len)`` and its new items at ``[history_len, history_len +
  num_new)``; a later sample overwrites an earlier one at the same position. Positions no sample
  named (histories longer than the gateway keeps, ``--sample-max-items``) get an item of their own
  that occurs nowhere else: looked up, it misses (an upper bound on the EMB misses of those
  positions); ``unknown_history_fraction`` says how many history positions that is. Histories
  longer than ``max_history_len`` keep their most recent ``max_history_len`` positions;
- **candidates**: the recorded candidate hashes where the client sent them (the node ranks those);
  where it sent a count (or more than the gateway kept), the simulator draws the rest from its
  seeded pool over the window's item popularity, as for a generated stream; a request that named
  neither ranks ``default_num_candidates`` (the node agent's default);
- **phases**: the window cut into ``num_phases`` equal parts (``part1[0-900s]`` ...): the figures
  per phase and the look-ahead oracle's segments.

`run_whatif` runs the configurations (static splits on a grid, the look-ahead oracle, SmartAllocator
policies given by their artifact directories) on that stream with the fleet's node count and cost
profile, and returns per configuration its P99, SLO attainment, mean share and figures per phase,
then the findings: the best static split over the look-ahead oracle (what a dynamic split was
worth on this traffic) and each policy's regret (its P99 over the oracle's). Pure: no I/O but
the policy artifacts it is given; the control plane's what-if job (`simulator.whatif_worker`)
reads the window and stores the result.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from workloads.regimes import RegimeConfig, RequestStream
from workloads.trace import UNKNOWN_CATEGORY, Trace

#: the node agent's default candidate count (`node_agent.engine.EngineConfig.default_num_candidates`)
DEFAULT_NUM_CANDIDATES = 256
#: most history positions a simulated request keeps (the node agent's `max_history_len` bound)
MAX_HISTORY_LEN = 16_384
#: the static split grid of a what-if (the paper table's default sweep)
DEFAULT_SHARES = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass
class SampledRequests:
    """A window of traffic samples, column-wise, in recorded order (time, then id). Item lists are
    int64 keyed hashes; ``num_candidates`` is -1 where the sample did not say (the node's default)."""

    ts_s: np.ndarray
    user_hash: np.ndarray
    history_len: np.ndarray
    items: list[np.ndarray]
    new_items: list[np.ndarray]
    candidates: list[np.ndarray]
    num_candidates: np.ndarray

    def __len__(self) -> int:
        return len(self.ts_s)

    @classmethod
    def from_rows(cls, rows: Sequence[dict]) -> "SampledRequests":
        """From dicts with the stored columns (``items``/``new_items``/``candidates``: int64 arrays
        or packed little-endian bytes; ``num_candidates`` None: not said)."""
        def ids(v):
            if isinstance(v, (bytes, bytearray, memoryview)):
                return np.frombuffer(bytes(v), dtype="<i8").astype(np.int64)
            return np.asarray(v, dtype=np.int64).reshape(-1)

        return cls(ts_s=np.array([float(r["ts_s"]) for r in rows], dtype=np.float64),
                   user_hash=np.array([int(r["user_hash"]) for r in rows], dtype=np.int64),
                   history_len=np.array([int(r["history_len"]) for r in rows], dtype=np.int64),
                   items=[ids(r["items"]) for r in rows], new_items=[ids(r["new_items"]) for r in rows],
                   candidates=[ids(r["candidates"]) for r in rows],
                   num_candidates=np.array([-1 if r.get("num_candidates") is None else int(r["num_candidates"])
                                            for r in rows], dtype=np.int64))


class SampledStream(RequestStream):
    """A `RequestStream` rebuilt from traffic samples (`sampled_stream`). Its recorded candidates
    replace the simulator's pool draws (`shift_items` with ``salt=1``, which the simulator calls on
    every candidate it draws, request by request, in order); ``info`` describes the rebuild."""

    recorded_candidates: np.ndarray | None = None  # per candidate slot (stream order): item id, -1: drawn
    candidate_offsets: np.ndarray | None = None
    info: dict | None = None

    @property
    def shifts_items(self) -> bool:
        return self.recorded_candidates is not None

    def shift_items(self, req: np.ndarray, items: np.ndarray, salt: int = 0) -> np.ndarray:
        if salt != 1 or self.recorded_candidates is None or len(items) == 0:
            return items
        req = np.asarray(req, dtype=np.int64)
        # the simulator passes each request's candidates together and in order: the slot of
        # entry k is its request's first slot plus k's rank within its run of equal requests
        run_start = np.flatnonzero(np.r_[True, req[1:] != req[:-1]])
        rank = np.arange(len(req)) - np.repeat(run_start, np.diff(np.r_[run_start, len(req)]))
        rec = self.recorded_candidates[self.candidate_offsets[req] + rank]
        out = np.asarray(items, dtype=np.int64).copy()
        known = rec >= 0
        out[known] = rec[known]
        return out


def _phases(duration_s: float, num_phases: int) -> list[tuple[str, float, float]]:
    n = max(1, int(num_phases))
    edges = [round(duration_s * k / n, 6) for k in range(n + 1)]
    return [(f"part{k + 1}", edges[k], edges[k + 1]) for k in range(n)]


def _user_sequences(user: np.ndarray, num_users: int, hl: np.ndarray, n_tail: np.ndarray, n_new: np.ndarray,
                    tail_ids: np.ndarray, new_ids: np.ndarray, max_history_len: int):
    """Each user's sequence rebuilt from the positions the samples name: ``(offsets, seq, drop)``,
    user ``u``'s kept positions at ``seq[offsets[u]:offsets[u + 1]]`` (-1: named by no sample),
    ``drop[u]`` the positions cut from its start (beyond ``max_history_len``). Request ``i`` names
    its ``n_tail[i]`` last history items (``tail_ids``, concatenated) and its ``n_new[i]`` new items
    (``new_ids``); a later sample overwrites an earlier one at the same position."""
    n = len(user)
    tot_tail, tot_new = int(n_tail.sum()), int(n_new.sum())
    # per user: its sequence's length and the positions dropped from its start (beyond max_history_len)
    seq_end = hl + n_new
    user_len = np.zeros(num_users, dtype=np.int64)
    np.maximum.at(user_len, user, seq_end)
    drop = np.maximum(user_len - int(max_history_len), 0)
    kept_len = np.maximum(user_len - drop, 1)  # a trace user has at least one interaction
    offsets = np.zeros(num_users + 1, dtype=np.int64)
    np.cumsum(kept_len, out=offsets[1:])
    seq = np.full(int(offsets[-1]), -1, dtype=np.int64)

    # the positions the samples name, in recorded order (later samples overwrite earlier ones)
    def place(req_of: np.ndarray, pos: np.ndarray, ids: np.ndarray) -> None:
        p = pos - drop[user[req_of]]
        ok = p >= 0
        seq[offsets[user[req_of[ok]]] + p[ok]] = ids[ok]

    r_tail = np.repeat(np.arange(n), n_tail)
    r_new = np.repeat(np.arange(n), n_new)
    within_tail = np.arange(tot_tail) - np.repeat(np.cumsum(n_tail) - n_tail, n_tail)
    within_new = np.arange(tot_new) - np.repeat(np.cumsum(n_new) - n_new, n_new)
    # one array of every placement in recorded order, so the last sample's item wins a position
    order_req = np.concatenate([r_tail, r_new])
    order_pos = np.concatenate([hl[r_tail] - n_tail[r_tail] + within_tail, hl[r_new] + within_new])
    order_ids = np.concatenate([tail_ids, new_ids])
    o = np.lexsort((np.r_[np.zeros(tot_tail), np.ones(tot_new)], order_req))
    place(order_req[o], order_pos[o], order_ids[o])
    return offsets, seq, drop


def _candidate_slots(num_candidates: np.ndarray, n_rec: np.ndarray, rec_ids: np.ndarray,
                     default_num_candidates: int):
    """``(ncand, cand_off, recorded)``: each request's candidate count (at least the recorded ones;
    the sample's count, else ``default_num_candidates``), the offsets of its slots, and the item of
    each slot where the sample recorded it (-1: the simulator draws it; None: none recorded)."""
    n = len(n_rec)
    ncand = np.where(n_rec > 0, np.maximum(num_candidates, n_rec),
                     np.where(num_candidates >= 0, num_candidates, default_num_candidates)).astype(np.int64)
    cand_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(ncand, out=cand_off[1:])
    recorded = None
    if len(rec_ids):
        recorded = np.full(int(cand_off[-1]), -1, dtype=np.int64)
        r_rec = np.repeat(np.arange(n), n_rec)
        within = np.arange(len(rec_ids)) - np.repeat(np.cumsum(n_rec) - n_rec, n_rec)
        recorded[cand_off[r_rec] + within] = rec_ids
    return ncand, cand_off, recorded


def sampled_stream(reqs: SampledRequests, *, start_s: float | None = None, end_s: float | None = None,
                   num_phases: int = 4, max_history_len: int = MAX_HISTORY_LEN,
                   default_num_candidates: int = DEFAULT_NUM_CANDIDATES, num_shards: int = 64) -> SampledStream:
    """The `SampledStream` of ``reqs`` (see the module docstring); times are seconds since
    ``start_s`` (default: the first sample's), the run lasts until ``end_s`` (default: just past the
    last sample). ValueError on an empty window."""
    n = len(reqs)
    if n == 0:
        raise ValueError("the window holds no traffic sample")
    t0 = float(reqs.ts_s[0]) if start_s is None else float(start_s)
    arrival = np.asarray(reqs.ts_s, dtype=np.float64) - t0
    if np.any(np.diff(arrival) < 0) or arrival[0] < 0:
        raise ValueError("samples must be in time order, at or after the window's start")
    duration = (float(end_s) - t0) if end_s is not None else float(arrival[-1]) + 1.0
    duration = max(duration, float(arrival[-1]) + 1e-3, 1.0)

    # users: dense, in hash order
    uniq_users, user = np.unique(reqs.user_hash, return_inverse=True)
    user = user.astype(np.int64).reshape(-1)
    num_users = len(uniq_users)

    # items: one dense id per distinct hash over every list
    hl = np.asarray(reqs.history_len, dtype=np.int64)
    n_tail = np.array([len(x) for x in reqs.items], dtype=np.int64)
    n_new = np.array([len(x) for x in reqs.new_items], dtype=np.int64)
    n_rec = np.array([len(x) for x in reqs.candidates], dtype=np.int64)
    n_tail = np.minimum(n_tail, hl)  # a sample never names more history than it has
    tails = [x[len(x) - k:] if k else x[:0] for x, k in zip(reqs.items, n_tail.tolist())]
    flat = np.concatenate([np.concatenate(tails), np.concatenate(reqs.new_items),
                           np.concatenate(reqs.candidates)]).astype(np.int64)
    uniq_items, inv = np.unique(flat, return_inverse=True)
    inv = inv.astype(np.int64).reshape(-1)
    k_items = len(uniq_items)
    tot_tail, tot_new = int(n_tail.sum()), int(n_new.sum())
    tail_ids, new_ids, rec_ids = inv[:tot_tail], inv[tot_tail:tot_tail + tot_new], inv[tot_tail + tot_new:]

    offsets, seq, drop = _user_sequences(user, num_users, hl, n_tail, n_new, tail_ids, new_ids, max_history_len)
    unknown = seq < 0
    num_unknown = int(unknown.sum())
    seq[unknown] = k_items + np.arange(num_unknown)  # named by no sample: an item of its own
    num_items = k_items + num_unknown

    # requests: history length as kept, new items, candidate counts
    h_kept = np.maximum(hl - drop[user], 0)
    ncand, cand_off, recorded = _candidate_slots(reqs.num_candidates, n_rec, rec_ids, default_num_candidates)
    prev = np.full(n, -1, dtype=np.int64)
    last: dict[int, int] = {}
    for i, u in enumerate(user.tolist()):
        prev[i] = last.get(u, -1)
        last[u] = i

    trace = Trace(name="traffic-samples", source_path="traffic_samples", offsets=offsets,
                  items=seq.astype(np.int32), timestamps_s=np.zeros(len(seq)),
                  item_category=np.full(num_items, UNKNOWN_CATEGORY, dtype=np.int32),
                  user_keys=[""] * num_users, item_keys=[""] * num_items, num_shards=num_shards)
    config = RegimeConfig(regime="steady", rate_rps=max(n / duration, 1e-6), duration_s=duration,
                          num_users=num_users, num_candidates=int(ncand.max(initial=0)),
                          max_history_len=int(max_history_len))
    hist_positions = int(h_kept.sum())
    unknown_hist = 0
    if num_unknown:  # history positions of the requests that fall on an unknown item
        r = np.repeat(np.arange(n), h_kept)
        p = np.arange(hist_positions) - np.repeat(np.cumsum(h_kept) - h_kept, h_kept)
        unknown_hist = int(np.sum(seq[offsets[user[r]] + p] >= k_items))
    stream = SampledStream(
        trace=trace, config=config, arrival_s=arrival, user=user, history_len=h_kept.astype(np.int32),
        num_new_items=n_new.astype(np.int32), num_candidates=ncand.astype(np.int32), prev_request=prev,
        base_user=np.arange(num_users, dtype=np.int32), rotation=np.zeros(num_users, dtype=np.int32),
        hot_users=np.empty(0, dtype=np.int64), phases=_phases(duration, num_phases))
    stream.recorded_candidates = recorded
    stream.candidate_offsets = cand_off
    stream.info = {"num_requests": n, "num_users": num_users, "num_items": k_items, "duration_s": round(duration, 3),
                   "history_positions": hist_positions,
                   "unknown_history_fraction": round(unknown_hist / hist_positions, 6) if hist_positions else 0.0,
                   "histories_cut": int(np.sum(drop > 0)),
                   "recorded_candidate_fraction": round(float(len(rec_ids)) / max(int(cand_off[-1]), 1), 6)}
    return stream


# ------------------------------------------------------------------------------- the what-if run ---
@dataclass(frozen=True)
class WhatIfConfig:
    """What one what-if runs: the fleet (``num_nodes``, the cost ``profile``, the arena's
    ``cache_bytes``; None: the simulator's default, `SimConfig.cache_fraction` of the window's item
    table), the static split grid
    ``shares``, the look-ahead oracle on that grid (one share per phase, beam search,
    `simulator.cluster.oracle_lookahead`), the policies (name -> artifact directory; each runs as
    the node agent's SmartAllocator, every layer on), the SLO, the router and its seed."""

    num_nodes: int
    profile: object  # a `simulator.profiles.CostProfile`
    cache_bytes: int | None = None
    shares: tuple[float, ...] = DEFAULT_SHARES
    oracle: bool = True
    policies: dict = field(default_factory=dict)
    slo_ms: float = 30.0
    router: str = "racer"
    seed: int = 0
    num_phases: int = 4


def _figures(lat_ms: np.ndarray, slo_ms: float) -> dict:
    n = len(lat_ms)
    return {"num_requests": int(n),
            "p50_ms": round(float(np.percentile(lat_ms, 50)), 3) if n else None,
            "p99_ms": round(float(np.percentile(lat_ms, 99)), 3) if n else None,
            "slo_attainment": round(float(np.mean(lat_ms <= slo_ms)), 5) if n else None}


def _row(name: str, kind: str, res, stream: SampledStream, scfg) -> dict:
    lat_ms = res.latency_s * 1e3
    row = {"config": name, "kind": kind, **_figures(lat_ms, scfg.slo_ms),
           "mean_share": round(float(res.shares.mean()), 4) if res.shares.size else None, "phases": []}
    w_start = np.arange(len(res.shares)) * scfg.control_interval_s
    for ph, a, b in stream.phases:
        m = (stream.arrival_s >= a) & (stream.arrival_s < b)
        wm = (w_start >= a) & (w_start < b)
        row["phases"].append({"phase": f"{ph}[{a:g}-{b:g}s]", **_figures(lat_ms[m], scfg.slo_ms),
                              "mean_share": round(float(res.shares[wm].mean()), 4) if wm.any() else None})
    return row


class _Bar:
    """Stands for the simulator's progress bar: each request served moves the run's progress."""

    def __init__(self, total: int, tick: Callable[[float], None]) -> None:
        self.total, self.done, self.tick = max(1, total), 0, tick

    def update(self, k: int) -> None:
        self.done += int(k)
        self.tick(min(1.0, self.done / self.total))

    def close(self) -> None:
        pass


def run_whatif(stream: SampledStream, cfg: WhatIfConfig, *, progress: Callable[[float, str], None] | None = None,
               deadline_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> dict:
    """Run every configuration of ``cfg`` on ``stream`` (see the module docstring). ``progress(f,
    what)`` is told the fraction done (0..1) as runs advance; past ``deadline_s`` (on ``clock``) a
    TimeoutError stops the run between two control windows."""
    from .allocators import StaticAllocator
    from .cluster import ClusterSim, SimConfig, oracle_lookahead
    from .smart import make_smart_allocator

    kw = {"cache_bytes": int(cfg.cache_bytes)} if cfg.cache_bytes else {}
    scfg = SimConfig(num_nodes=int(cfg.num_nodes), profile=cfg.profile, slo_ms=float(cfg.slo_ms), seed=int(cfg.seed),
                     **kw).validate()
    shares = tuple(sorted({float(s) for s in cfg.shares}))
    if not shares or any(not 0 <= s <= 1 for s in shares):
        raise ValueError("shares must be a non-empty list of values in [0, 1]")
    runs: list[tuple[str, str, object, float]] = [(f"static:{s:.2f}", "static", s, 1.0) for s in shares]
    for name, path in cfg.policies.items():
        runs.append((name, "policy", path, 1.0))
    if cfg.oracle:
        runs.append(("oracle_lookahead", "oracle", None, float(len(shares)) * 1.5))
    total = sum(w for *_, w in runs)
    done = 0.0

    def say(f: float, what: str) -> None:
        if deadline_s is not None and clock() > deadline_s:
            raise TimeoutError("the what-if ran past its time limit")
        if progress is not None:
            progress(min(1.0, (done + f) / total), what)

    rows = []
    t0 = time.perf_counter()
    for name, kind, arg, weight in runs:
        say(0.0, name)
        if kind == "oracle":
            res, sched = oracle_lookahead(stream, scfg, shares, cfg.router, num_segments=cfg.num_phases)
            row = _row(name, kind, res, stream, scfg)
            row["schedule"] = [float(x) for x in sched]
        else:
            try:
                alloc = StaticAllocator(float(arg)) if kind == "static" else make_smart_allocator("racer", arg)
                alloc.reset(scfg.num_nodes, scfg.initial_emb_share)
            except Exception as e:  # noqa: BLE001 - a policy that does not load here: its row says why
                if kind == "static":
                    raise
                rows.append({"config": name, "kind": kind, "num_requests": len(stream), "p50_ms": None,
                             "p99_ms": None, "slo_attainment": None, "mean_share": None, "phases": [],
                             "error": f"its policy does not load here: {e}"[:500]})
                done += weight
                continue
            sim = ClusterSim(stream, scfg, cfg.router, initial_share=alloc.initial_share(), name=name)
            sim.bar = _Bar(len(stream), lambda f, name=name, w=weight: say(f * w, name))
            out = sim.start()
            while out is not None:
                out = sim.control(alloc)
            res = sim.result()
            row = _row(name, kind, res, stream, scfg)
            if kind == "static":
                row["share"] = float(arg)
        rows.append(row)
        done += weight
        say(0.0, name)
    return {"rows": rows, "findings": findings(rows), "shares": list(shares), "router": cfg.router,
            "sim_config": _jsonable(scfg), "stream": stream.info, "wall_s": round(time.perf_counter() - t0, 2)}


def _jsonable(scfg) -> dict:
    from dataclasses import asdict

    d = asdict(replace(scfg, profile=None))
    d["profile"] = scfg.profile.name
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in d.items()}


def findings(rows: list[dict]) -> dict:
    """Best static split (lowest P99, then P50), the best static over the look-ahead oracle
    (``best_static_over_oracle_pct``: what a perfect dynamic split was worth, >= 0 up to the
    oracle's grid and segments), and per policy its regret: P99 over the oracle's and over the
    best static's, in %."""
    statics = [r for r in rows if r["kind"] == "static" and r["p99_ms"] is not None]
    out: dict = {}
    if statics:
        best = min(statics, key=lambda r: (r["p99_ms"], r["p50_ms"]))
        out["best_static"] = best["config"]
        out["best_static_share"] = best["share"]
        out["best_static_p99_ms"] = best["p99_ms"]
    oracle = next((r for r in rows if r["kind"] == "oracle" and r["p99_ms"]), None)
    if oracle is not None:
        out["oracle_p99_ms"] = oracle["p99_ms"]
        if statics:
            out["best_static_over_oracle_pct"] = round(100 * (out["best_static_p99_ms"] / oracle["p99_ms"] - 1), 2)
    regret = {}
    for r in rows:
        if r["kind"] != "policy" or not r["p99_ms"]:
            continue
        g = {}
        if oracle is not None:
            g["over_oracle_pct"] = round(100 * (r["p99_ms"] / oracle["p99_ms"] - 1), 2)
        if statics:
            g["over_best_static_pct"] = round(100 * (r["p99_ms"] / out["best_static_p99_ms"] - 1), 2)
        regret[r["config"]] = g
    out["policy_regret"] = regret
    return out
