"""Benchmarks of node memory (EMB cache, KV pool, Memory Manager) on this machine.

    python -m bench.memory --json       # one JSON object on stdout

Figures (timings are medians over repetitions; these machines are shared and noisy):

- ``lookup_vs_index_select``: ids/s of ``EmbCache.lookup`` (LRU bookkeeping, misses copied
  from the host table, rows written to an output buffer) over ids/s of a raw
  ``torch.index_select`` of the same ids from the full item table on the same device, both into
  preallocated outputs, interleaved batch by batch (alternating which goes first). Batches are
  65,536 Zipf(1.1)-skewed ids over 1,048,576 items (Taobao has 4M); the slab (112,640 rows) is
  sized for a ~90% hit rate (the measured rate is reported). Measured at ``emb_dim`` 128 and,
  in ``lookup_by_dim``, at 64 as well.
- ``boundary_move_us``: ``set_target`` + ``apply_plan`` moving 25% of a 16,384-page arena from
  the KV pool to the slab when the moved pages are free; ``boundary_move_bytes_copied`` must be 0.
  ``boundary_shrink_us`` is the way back (the slab's rows are invalidated), and
  ``boundary_migrate_*`` the same grow when some moved pages hold KV (copied to free pages).
- ``refill_bytes_per_s_max_window``: the most refill bytes issued in any 100 ms window (sliding)
  while lookups run, per second, against ``refill_limit_bytes_per_s``.
- ``kv_append_per_s`` / ``kv_lookup_per_s``: KV pool metadata operations per second on a
  Zipf-skewed user stream with evictions.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from bench import print_figures
from node_agent.memory import KVLayout, MemoryConfig, MemoryManager, RefillConfig, resolve_device


def _zipf_sampler(num_items: int, alpha: float, seed: int):
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, num_items + 1) ** alpha)
    cdf /= cdf[-1]
    perm = rng.permutation(num_items)  # hot items spread over the id space

    def sample(n: int) -> torch.Tensor:
        ranks = np.minimum(np.searchsorted(cdf, rng.random(n)), num_items - 1)
        return torch.from_numpy(perm[ranks].astype(np.int64))

    return sample


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    return "cpu"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bench_lookup(emb_dim: int, num_batches: int, rounds: int, seed: int = 0) -> dict:
    num_items, batch, alpha, slab_rows = 1_048_576, 65_536, 1.1, 112_640
    kv = KVLayout(num_layers=2, num_heads=2, head_dim=64, page_tokens=16, dtype="float16")
    rows_per_page = kv.page_bytes // (emb_dim * 4)
    emb_pages = slab_rows // rows_per_page
    cfg = MemoryConfig(num_pages=2 * emb_pages, num_items=num_items, emb_dim=emb_dim, kv=kv,
                       initial_emb_share=0.5)
    gen = torch.Generator().manual_seed(seed)
    host = torch.randn(num_items, emb_dim, generator=gen)
    mm = MemoryManager(cfg, host)
    dev = mm.arena.device
    table = mm.emb.host_table if dev.type == "cpu" else host.to(dev)
    sample = _zipf_sampler(num_items, alpha, seed)
    batches = [sample(batch).to(dev) for _ in range(num_batches)]
    out_a = torch.empty(batch, emb_dim, device=dev)
    out_b = torch.empty(batch, emb_dim, device=dev)
    for b in batches:  # warm the cache to its steady state
        mm.emb.lookup(b, out=out_a)
    s0 = mm.emb.snapshot_stats()
    t_lookup, t_index = [], []

    def run_lookup(b: torch.Tensor) -> None:
        _sync(dev)
        a = time.perf_counter()
        mm.emb.lookup(b, out=out_a)
        _sync(dev)
        t_lookup.append(time.perf_counter() - a)

    def run_index(b: torch.Tensor) -> None:
        _sync(dev)
        a = time.perf_counter()
        torch.index_select(table, 0, b, out=out_b)
        _sync(dev)
        t_index.append(time.perf_counter() - a)

    for r in range(rounds):
        for i, b in enumerate(batches):  # alternate which goes first (warm ids, caches)
            first, second = (run_lookup, run_index) if (i + r) % 2 == 0 else (run_index, run_lookup)
            first(b)
            second(b)
    s1 = mm.emb.stats
    calls = s1.num_calls - s0.num_calls
    assert torch.equal(mm.emb.lookup(batches[0]).rows.cpu(), host[batches[0].cpu()])
    med_l, med_i = float(np.median(t_lookup)), float(np.median(t_index))
    return {
        "emb_dim": emb_dim,
        "num_items": num_items,
        "batch_ids": batch,
        "zipf_alpha": alpha,
        "slab_rows": mm.emb.rows,
        "hit_rate": (s1.num_hits - s0.num_hits) / (s1.num_requested_ids - s0.num_requested_ids),
        "unique_misses_per_call": (s1.num_unique_misses - s0.num_unique_misses) / calls,
        "lookup_us_p50": med_l * 1e6,
        "index_select_us_p50": med_i * 1e6,
        "lookup_ids_per_s": batch / med_l,
        "index_select_ids_per_s": batch / med_i,
        "lookup_vs_index_select": med_i / med_l,
        "samples": len(t_lookup),
    }


def bench_boundary(reps: int) -> dict:
    kv = KVLayout(num_layers=1, num_heads=1, head_dim=64, page_tokens=8, dtype="float32")
    cfg = MemoryConfig(num_pages=16_384, num_items=200_000, emb_dim=64, kv=kv,
                       initial_emb_share=0.25, max_step_pages=1024)
    host = torch.zeros(cfg.num_items, cfg.emb_dim)
    mm = MemoryManager(cfg, host)
    # KV users fill the top of the pool (highest pages are allocated first): pages far from
    # the boundary, so the 25% that moves is free.
    user = 0
    while mm.kv.num_used < 4096:
        mm.kv.append(user, 2 * kv.page_tokens)
        user += 1
    grow, shrink, copied, steps, invalidated = [], [], 0, 0, 0
    for _ in range(reps):
        a = time.perf_counter()
        mm.set_target(0.5, 0.0)
        reps_g = mm.apply_plan(0.0)
        grow.append(time.perf_counter() - a)
        copied += sum(r.bytes_copied for r in reps_g)
        steps = len(reps_g)
        mm.emb.lookup(torch.arange(mm.emb.rows))  # a full slab: shrinking has rows to drop
        a = time.perf_counter()
        mm.set_target(0.25, 0.0)
        reps_s = mm.apply_plan(0.0)
        shrink.append(time.perf_counter() - a)
        invalidated = sum(r.invalidated_rows for r in reps_s)
    problems = mm.check_invariants()
    # Grow over occupied pages: users placed right above the boundary get migrated.
    mig = MemoryManager(cfg, host)
    for u in range(12_288 // 2):  # fill the whole pool: pages 16383 down to 4096
        mig.kv.append(u, 2 * kv.page_tokens)
    for u in range(0, 12_288 // 2, 2):  # free every other user: free pages on both sides
        mig.kv.evict(u)
    a = time.perf_counter()
    mig.set_target(0.5, 0.0)
    reps_m = mig.apply_plan(0.0)
    migrate_s = time.perf_counter() - a
    problems += mig.check_invariants()
    return {
        "boundary_num_pages": cfg.num_pages,
        "boundary_pages_moved": 4096,
        "boundary_steps": steps,
        "boundary_move_us": float(np.median(grow)) * 1e6,
        "boundary_move_bytes_copied": copied,
        "boundary_shrink_us": float(np.median(shrink)) * 1e6,
        "boundary_shrink_invalidated_rows": invalidated,
        "boundary_migrate_us": migrate_s * 1e6,
        "boundary_migrate_pages": sum(r.migrated_pages for r in reps_m),
        "boundary_migrate_bytes_copied": sum(r.bytes_copied for r in reps_m),
        "boundary_migrate_evicted_users": sum(len(r.evicted_users) for r in reps_m),
        "boundary_invariant_violations": len(problems),
    }


def _max_window_rate(events: list[tuple[float, int]], window_s: float) -> float:
    """Most bytes in any window ``[t, t + window_s)`` starting at an event, per second."""
    if not events:
        return 0.0
    ts = np.array([t for t, _ in events])
    bs = np.cumsum([0] + [b for _, b in events])
    ends = np.searchsorted(ts, ts + window_s, side="left")
    return float((bs[ends] - bs[np.arange(len(ts))]).max() / window_s)


def bench_refill(duration_s: float, seed: int = 1) -> dict:
    """Requests (1,024 Zipf ids each) arrive every ``gap_s``; between requests the engine calls
    ``refill_step(now_s)`` once, as it would. The slab has just grown from 1/8 to 3/4 of the
    arena, so the refill has far more rows to fill than its limit lets it copy in the run."""
    limit = 4 * 2**20
    gap_s = 0.002
    refill = RefillConfig(limit_bytes_per_s=limit, window_s=0.1, chunk_bytes=32 * 2**10)
    kv = KVLayout(num_layers=1, num_heads=1, head_dim=64, page_tokens=8, dtype="float32")
    cfg = MemoryConfig(num_pages=8192, num_items=262_144, emb_dim=64, kv=kv,
                       initial_emb_share=0.125, refill=refill)
    host = torch.randn(cfg.num_items, cfg.emb_dim, generator=torch.Generator().manual_seed(seed))
    clock = time.perf_counter
    t0 = clock()
    mm = MemoryManager(cfg, host, now_s=0.0)
    sample = _zipf_sampler(cfg.num_items, 1.05, seed)
    for _ in range(64):  # popularity (miss counts) to rank the refill by
        mm.emb.lookup(sample(4096))
    before = mm.emb.snapshot_stats()
    mm.set_target(0.75, clock() - t0)
    mm.apply_plan(clock() - t0)
    empty_after_grow = mm.emb.rows - mm.emb.num_cached()
    events: list[tuple[float, int]] = []
    lookup_s: list[float] = []
    start = clock()
    next_arrival = start
    while clock() - start < duration_s:
        a = clock()
        mm.emb.lookup(sample(1024))
        lookup_s.append(clock() - a)
        now = clock() - t0
        nbytes = mm.refill_step(now)
        if nbytes:
            events.append((now, nbytes))
        next_arrival += gap_s
        while clock() < next_arrival:
            pass
    problems = mm.check_invariants()
    after = mm.emb.stats
    active = (events[-1][0] - events[0][0]) if len(events) > 1 else 0.0
    total = sum(b for _, b in events)
    return {
        "refill_limit_bytes_per_s": float(limit),
        "refill_bytes_per_s_max_window": _max_window_rate(events, 0.1),
        "refill_window_s": 0.1,
        "refill_bytes_total": total,
        "refill_rows_committed": after.num_refill_rows - before.num_refill_rows,
        "refill_chunks": len(events),
        "refill_active_s": active,
        "refill_bytes_per_s_mean_active": total / active if active > 0 else 0.0,
        "refill_empty_rows_after_grow": empty_after_grow,
        "refill_empty_rows_at_end": mm.emb.rows - mm.emb.num_cached(),
        "refill_lookups_during": len(lookup_s),
        "refill_lookup_us_p50_during": float(np.median(lookup_s)) * 1e6,
        "refill_invariant_violations": len(problems),
    }


def bench_kv(num_ops: int, seed: int = 2) -> dict:
    kv = KVLayout(num_layers=2, num_heads=2, head_dim=64, page_tokens=16, dtype="float16")
    cfg = MemoryConfig(num_pages=16_384, num_items=1024, emb_dim=64, kv=kv,
                       initial_emb_share=0.5, payload=False)
    mm = MemoryManager(cfg)
    pool = mm.kv
    rng = np.random.default_rng(seed)
    num_users = 50_000
    w = 1.0 / np.arange(1, num_users + 1) ** 0.9
    users = rng.choice(num_users, size=num_ops, p=w / w.sum()).tolist()
    tokens = rng.integers(1, 65, size=num_ops).tolist()
    a = time.perf_counter()
    for u, n in zip(users, tokens):
        pool.append(u, n)
    append_s = time.perf_counter() - a
    a = time.perf_counter()
    for u in users:
        pool.lookup(u)
    lookup_s = time.perf_counter() - a
    problems = pool.check_invariants()
    st = pool.stats
    return {
        "kv_pages": pool.num_kv_pages,
        "kv_append_per_s": num_ops / append_s,
        "kv_lookup_per_s": num_ops / lookup_s,
        "kv_lookup_hit_rate": st.num_hits / st.num_lookups,
        "kv_evicted_users": st.num_evicted_users,
        "kv_invariant_violations": len(problems),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: these 2-core VMs are shared, and "
                         "OpenMP regions stall for milliseconds when a core is taken)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    q = args.quick
    device = resolve_device("auto")
    result: dict = {
        "device": _device_name(device),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    main_lookup = bench_lookup(128, 16 if q else 32, 2 if q else 5)
    side_lookup = bench_lookup(64, 16 if q else 32, 2 if q else 5)
    result.update({
        "lookup_vs_index_select": main_lookup["lookup_vs_index_select"],
        "hit_rate": main_lookup["hit_rate"],
        "lookup_ids_per_s": main_lookup["lookup_ids_per_s"],
        "index_select_ids_per_s": main_lookup["index_select_ids_per_s"],
        "lookup_by_dim": {str(d["emb_dim"]): d for d in (main_lookup, side_lookup)},
    })
    result.update(bench_boundary(5 if q else 21))
    result.update(bench_refill(0.6 if q else 1.5))
    result.update(bench_kv(50_000 if q else 200_000))
    print_figures(result, as_json=args.json, width=40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
