"""Memory Manager: pure boundary plans, bounded steps, metadata-only moves, migration and
eviction on EMB growth, invalidation on shrink, the throttled refill in virtual time, and
randomised sequences (payload and metadata-only side by side) with invariants after each step."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from node_agent.memory import (
    ArenaSnapshot,
    BoundaryStep,
    KVLayout,
    MemoryConfig,
    MemoryManager,
    RefillConfig,
    TokenBucket,
    plan_boundary,
)

DIM = 4
# page: 1 layer x 2 x 2 tokens x 1 head x 8 dims x 4 B = 128 B = 8 rows of 16 B
LAYOUT = KVLayout(num_layers=1, num_heads=1, head_dim=8, page_tokens=2)


def make_cfg(num_pages: int = 8, emb_share: float = 0.5, num_items: int = 64,
             payload: bool = True, device: str = "cpu", **kw) -> MemoryConfig:
    refill = kw.pop("refill", RefillConfig(limit_bytes_per_s=1600.0, window_s=0.1,
                                           chunk_bytes=64))
    return MemoryConfig(num_pages=num_pages, num_items=num_items, emb_dim=DIM, kv=LAYOUT,
                        initial_emb_share=emb_share, payload=payload, device=device,
                        refill=refill, **kw)


def host_table(num_items: int) -> torch.Tensor:
    return torch.arange(num_items * DIM, dtype=torch.float32).view(num_items, DIM) / DIM


def make_mm(payload: bool = True, **kw) -> MemoryManager:
    cfg = make_cfg(payload=payload, **kw)
    return MemoryManager(cfg, host_table(cfg.num_items) if payload else None)


def ok(mm: MemoryManager) -> None:
    assert mm.check_invariants() == []


def snap(num_pages=16, emb_pages=4, occupied=(), kv_free=None) -> ArenaSnapshot:
    occ = np.zeros(num_pages, dtype=bool)
    occ[list(occupied)] = True
    free = (num_pages - emb_pages - len(occupied)) if kv_free is None else kv_free
    return ArenaSnapshot(num_pages=num_pages, emb_pages=emb_pages, rows_per_page=8,
                         page_bytes=128, kv_free_pages=free, kv_used_pages=len(occupied),
                         page_occupied=occ)


# ----------------------------------------------------------------------------- pure plans
def test_plan_grow_in_bounded_steps_reports_occupied_pages():
    s = snap(emb_pages=4, occupied=[6, 9, 15])
    p = plan_boundary(s, 0.75, max_step_pages=3)
    assert p.target_emb_pages == 12
    assert p.steps == (BoundaryStep(4, 7, 1), BoundaryStep(7, 10, 1), BoundaryStep(10, 12, 0))
    assert p.max_bytes_copied == 2 * 128
    assert "grow EMB 4 -> 12" in p.reason and "2 occupied KV pages to migrate" in p.reason
    assert s.page_occupied.tolist().count(True) == 3  # the snapshot is untouched


def test_plan_shrink_and_noop_and_clamps():
    p = plan_boundary(snap(emb_pages=10), 0.25, max_step_pages=4)
    assert p.steps == (BoundaryStep(10, 6, 0), BoundaryStep(6, 4, 0))
    assert "shrink EMB 10 -> 4" in p.reason and "invalidated" in p.reason
    assert plan_boundary(snap(emb_pages=4), 0.25, 4).steps == ()
    clamped = ArenaSnapshot(16, 4, 8, 128, 12, 0, np.zeros(16, bool), min_emb_pages=2,
                            min_kv_pages=4)
    p = plan_boundary(clamped, 1.0, 100)
    assert p.target_emb_pages == 12 and "clamped from 16" in p.reason
    assert plan_boundary(clamped, 0.0, 100).target_emb_pages == 2
    with pytest.raises(ValueError):
        plan_boundary(snap(), 1.5, 4)


def test_plan_says_when_users_will_be_evicted():
    s = snap(num_pages=8, emb_pages=2, occupied=[2, 3, 4, 5, 6, 7])
    p = plan_boundary(s, 0.5, 8)
    assert "LRU users will be evicted" in p.reason


# ---------------------------------------------------------------------- applying the plan
def test_growing_over_free_pages_moves_no_bytes():
    mm = make_mm(num_pages=8, emb_share=0.25)  # EMB pages 0,1 (16 rows)
    mm.kv.append(1, 4)  # pages 7, 6
    plan = mm.set_target(0.75, now_s=0.0)
    assert plan.steps == (BoundaryStep(2, 6, 0),)
    assert mm.arena.emb_pages == 2  # nothing moves before a step
    reps = mm.apply_plan(now_s=0.0)
    ok(mm)
    assert len(reps) == 1
    r = reps[0]
    assert (r.from_emb_pages, r.to_emb_pages, r.free_pages_moved) == (2, 6, 4)
    assert (r.migrated_pages, r.evicted_users, r.bytes_copied) == (0, (), 0)
    assert (mm.arena.emb_pages, mm.emb.rows, mm.emb_share) == (6, 48, 0.75)
    assert mm.kv.block_table(1) == (7, 6)


def test_growing_over_occupied_pages_migrates_and_keeps_kv():
    mm = make_mm(num_pages=8, emb_share=0.25)
    for u in range(6):
        mm.kv.append(u, 2)  # user u on page 7 - u; pool full
    mm.kv.evict(0)
    mm.kv.evict(1)  # pages 7, 6 free
    kv = torch.arange(1 * 2 * 2 * 1 * 8, dtype=torch.float32).view(1, 2, 2, 1, 8)
    mm.kv.write(5, 0, kv)  # page 2
    mm.set_target(0.5, 0.0)
    (r,) = mm.apply_plan(0.0)
    ok(mm)
    assert (r.migrated_pages, r.evicted_users, r.bytes_copied) == (2, (), 2 * 128)
    assert mm.kv.block_table(5) == (7,)
    assert mm.kv.block_table(4) == (6,)
    assert torch.equal(mm.kv.read(5), kv)
    assert mm.stats().boundary_bytes_copied == 256


def test_growing_into_a_full_pool_evicts_lru_users():
    mm = make_mm(num_pages=8, emb_share=0.25)
    for u in range(6):
        mm.kv.append(u, 2)
    mm.set_target(0.5, 0.0)
    (r,) = mm.apply_plan(0.0)
    ok(mm)
    assert r.evicted_users == (0, 1)  # LRU users: their pages 7, 6 take the migrants
    assert mm.kv.users_lru() == [2, 3, 4, 5]
    assert mm.kv.drain_residency().evicted == (0, 1)


def test_shrinking_invalidates_the_top_rows_and_frees_pages():
    mm = make_mm(num_pages=4, emb_share=0.5, num_items=64)  # 16 rows
    mm.emb.lookup(torch.arange(16))  # item i in row i
    mm.set_target(0.25, 0.0)
    (r,) = mm.apply_plan(0.0)
    ok(mm)
    assert (r.from_emb_pages, r.to_emb_pages, r.invalidated_rows) == (2, 1, 8)
    assert mm.emb.resident_items().tolist() == list(range(8))
    assert (mm.kv.num_free, mm.kv.kv_start) == (3, 1)
    assert mm.kv.append(9, 6).new_pages == (3, 2, 1)


def test_step_applies_one_bounded_step_at_a_time():
    mm = make_mm(num_pages=16, emb_share=0.25, max_step_pages=3)
    mm.set_target(0.75, 0.0)
    seen = []
    while mm.boundary_moving:
        st = mm.step(0.0)
        seen.append((st.boundary.from_emb_pages, st.boundary.to_emb_pages))
        ok(mm)
    assert seen == [(4, 7), (7, 10), (10, 12)]
    assert mm.step(0.0).boundary is None


def test_a_new_target_replaces_the_plan_in_progress():
    mm = make_mm(num_pages=16, emb_share=0.25, max_step_pages=2)
    mm.set_target(1.0, 0.0)
    mm.step(0.0)  # 4 -> 6
    plan = mm.set_target(0.25, 1.5)
    assert plan.steps == (BoundaryStep(6, 4, 0),)
    assert plan.planned_at_s == 1.5
    mm.apply_plan(0.0)
    ok(mm)
    assert mm.arena.emb_pages == 4


# --------------------------------------------------------------------------------- refill
def test_token_bucket_in_virtual_time():
    b = TokenBucket(rate_bytes_per_s=100.0, capacity_bytes=50.0, now_s=0.0)
    assert b.take(50, 0.0)
    assert not b.take(1, 0.0)
    assert b.available(0.2) == pytest.approx(20.0)
    assert b.available(0.1) == pytest.approx(20.0)  # time never runs backwards
    assert b.available(10.0) == 50.0  # capped
    assert b.check_invariants() == []


def test_refill_config_guarantees_the_window_limit():
    r = RefillConfig(limit_bytes_per_s=1000.0, window_s=0.1, chunk_bytes=40)
    assert r.bucket_rate_bytes_per_s == pytest.approx(600.0)  # 40 + 600 * 0.1 = 100 = limit*w
    with pytest.raises(ValueError):
        RefillConfig(limit_bytes_per_s=1000.0, window_s=0.1, chunk_bytes=60)


def test_refill_after_growth_is_throttled_in_every_window():
    # limit 1,600 B/s over 0.1 s windows = 160 B per window; chunk 64 B (4 rows of 16 B)
    mm = make_mm(num_pages=16, emb_share=0.125, num_items=256)  # 16 rows
    rng = random.Random(3)
    for _ in range(40):  # miss counts for 200 items
        mm.emb.lookup(torch.tensor([rng.randrange(200) for _ in range(20)]))
    mm.set_target(0.75, 0.0)
    mm.apply_plan(0.0)  # 96 rows, 80 of them empty
    events = []
    t = 0.0
    while t < 2.0:
        st = mm.step(t)
        if st.refill_bytes:
            events.append((t, st.refill_bytes))
            assert st.refill_bytes <= 64
        ok(mm)
        t = round(t + 0.01, 6)
    total = sum(b for _, b in events)
    assert total > 0
    for t0, _ in events:  # every window [t0, t0 + 0.1) holds at most limit * window bytes
        assert sum(b for t1, b in events if t0 <= t1 < t0 + 0.1 - 1e-9) <= 160
    assert total == 80 * 16  # every empty row refilled (200 items had misses)
    # at the bucket's rate: 64 B at once, then 960 B/s (1,600 B/s less one chunk per window)
    assert events[-1][0] >= (total - 64) / 960 - 0.02
    assert mm.emb.num_cached() == 96
    assert mm.emb.stats.refill_bytes == total
    slab = mm.arena.slab()
    items = mm.emb.slot_to_item[: mm.emb.rows]
    occ = (items >= 0).nonzero().squeeze(1)
    assert torch.equal(slab[occ], host_table(256)[items[occ]])


def test_refill_disabled_does_nothing():
    cfg = make_cfg(num_pages=8, emb_share=0.25,
                   refill=RefillConfig(enabled=False, limit_bytes_per_s=1600.0, chunk_bytes=64))
    mm = MemoryManager(cfg, host_table(cfg.num_items))
    mm.emb.lookup(torch.tensor([1, 2, 3] * 10))
    mm.set_target(0.75, 0.0)
    mm.apply_plan(0.0)
    assert mm.refill_step(5.0) == 0


def test_chunk_smaller_than_a_row_is_rejected():
    cfg = make_cfg(refill=RefillConfig(limit_bytes_per_s=1600.0, chunk_bytes=8))
    with pytest.raises(ValueError):
        MemoryManager(cfg, host_table(cfg.num_items))


# ------------------------------------------------------------------------------ randomised
def _random_ops(seed: int, n: int):
    rng = random.Random(seed)
    for i in range(n):
        r = rng.random()
        if r < 0.45:
            hot = [rng.randrange(12) for _ in range(rng.randint(0, 10))]
            cold = [rng.randrange(96) for _ in range(rng.randint(0, 4))]
            yield ("lookup", hot + cold)
        elif r < 0.7:
            yield ("append", rng.randrange(20), rng.randint(1, 9))
        elif r < 0.78:
            yield ("kv_lookup", rng.randrange(20))
        elif r < 0.86:
            yield ("target", rng.choice([0.0, 0.125, 0.25, 0.5, 0.625, 0.75, 1.0]))
        else:
            yield ("step", None)


@pytest.mark.parametrize("seed", range(5))
def test_random_sequences_payload_and_metadata_agree(seed):
    cfg = dict(num_pages=16, emb_share=0.5, num_items=96, max_step_pages=3)
    a = make_mm(payload=True, **cfg)
    b = make_mm(payload=False, **cfg)
    now = 0.0
    for i, op in enumerate(_random_ops(seed, 250)):
        now += 0.005
        for mm in (a, b):
            kind = op[0]
            if kind == "lookup":
                r = mm.emb.lookup(torch.tensor(op[1], dtype=torch.int64))
                if mm is a:
                    assert torch.equal(r.rows, host_table(96)[op[1]])
            elif kind == "append":
                mm.kv.append(op[1], op[2])
            elif kind == "kv_lookup":
                mm.kv.lookup(op[1])
            elif kind == "target":
                mm.set_target(op[1], now)
            else:
                mm.step(now)
            assert mm.check_invariants() == [], f"op {i} {op}"
        assert torch.equal(a.emb.slot_to_item, b.emb.slot_to_item), f"op {i}"
        assert a.kv.page_owner.tolist() == b.kv.page_owner.tolist()
        assert a.arena.emb_pages == b.arena.emb_pages
    assert a.stats() == b.stats()


@pytest.mark.cuda
def test_cuda_manager_moves_boundary_and_refills():
    cfg = make_cfg(num_pages=16, emb_share=0.25, num_items=256, device="cuda")
    mm = MemoryManager(cfg, host_table(256))
    assert mm.arena.device.type == "cuda"
    for i in range(30):
        mm.emb.lookup(torch.arange(i, i + 40, device="cuda"))
    mm.kv.append(1, 6)
    kv = torch.randn(1, 2, 6, 1, 8, device="cuda")
    mm.kv.write(1, 0, kv)
    mm.set_target(0.75, 0.0)
    mm.apply_plan(0.0)
    assert torch.equal(mm.kv.read(1), kv)
    t = 0.0
    for _ in range(50):
        t += 0.02
        mm.step(t)
    mm.emb.refill.wait()
    assert mm.emb.stats.num_refill_rows > 0
    assert mm.check_invariants() == []
    mm.set_target(0.25, t)
    mm.apply_plan(t)
    assert mm.check_invariants() == []
    out = mm.emb.lookup(torch.arange(100, device="cuda")).rows
    assert torch.equal(out.cpu(), host_table(256)[:100])
