"""Ghost lists: the misses a cache one probe larger would have served (EMB slab and KV pool),
checked by hand on scripted sequences and against a larger cache fed the same sequence."""

from __future__ import annotations

import random

import torch

from node_agent.memory import Arena, EmbCache, KVLayout, KVPool, MemoryConfig

DIM = 4


def emb_cache(rows: int, probes: tuple[float, ...], num_items: int = 64) -> EmbCache:
    # a page holds one 16-B row (1 layer x 2 x 2 tokens x 1 head x 1 dim x 4 B)
    kv = KVLayout(num_layers=1, num_heads=1, head_dim=1, page_tokens=2)
    cfg = MemoryConfig(num_pages=rows, num_items=num_items, emb_dim=DIM, kv=kv, initial_emb_share=1.0,
                       ghost_probes=probes, payload=False, device="cpu")
    return EmbCache(Arena(cfg), num_items)


def one(i: int) -> torch.Tensor:
    return torch.tensor([i], dtype=torch.int64)


def test_emb_ghost_hits_are_the_misses_just_past_the_slab():
    c = emb_cache(4, (0.5,))  # 4 rows, ghost reach 2 rows
    assert c.ghosts.rows == (2,)
    for i in range(7):  # 0..3 fill the slab; 4, 5, 6 evict 0, 1, 2 (LRU)
        c.lookup(one(i))
    assert c.stats.ghost_hits[0] == 0
    c.lookup(one(0))  # left 3 departures ago: a 6-row slab would have evicted it too
    assert c.stats.ghost_hits[0] == 0
    c.lookup(one(2))  # evicted after 0 and 1 were: within the last 2 departures
    assert c.stats.ghost_hits == (1,)
    big = emb_cache(6, ())
    for i in list(range(7)) + [0, 2]:
        big.lookup(one(i))
    assert big.stats.num_hits == 1  # the 6-row slab hits 2 and misses 0, as the ghost list said


def test_emb_ghost_hits_on_a_cyclic_scan_equal_a_larger_slabs_extra_hits():
    rows, extra = 8, 3
    small, big = emb_cache(rows, (0.5,)), emb_cache(rows + 4, ())  # ghost reach 4 rows
    for _ in range(6):
        for i in range(rows + extra):  # LRU thrashes on a scan longer than the slab
            small.lookup(one(i))
            big.lookup(one(i))
    assert small.stats.num_hits == 0
    assert small.stats.ghost_hits[0] == big.stats.num_hits == 5 * (rows + extra)


def test_emb_ghost_hits_never_exceed_a_larger_slabs_extra_hits_and_leave_the_state_alone():
    rng = random.Random(3)
    seq = [min(int(rng.paretovariate(1.0)) - 1, 63) for _ in range(3000)]
    with_ghost, without = emb_cache(10, (0.4,)), emb_cache(10, ())
    bigger = emb_cache(14, ())
    for i in seq:
        with_ghost.lookup(one(i))
        without.lookup(one(i))
        bigger.lookup(one(i))
    extra = bigger.stats.num_hits - without.stats.num_hits
    # departures of items since re-admitted still count as distance: a lower bound, and close
    assert 0 < with_ghost.stats.ghost_hits[0] <= extra
    assert with_ghost.stats.ghost_hits[0] >= 0.8 * extra
    assert torch.equal(with_ghost.slot_to_item, without.slot_to_item)
    assert with_ghost.stats.num_hits == without.stats.num_hits


def test_emb_ghost_hits_count_distinct_ids_and_shrink_invalidations():
    a, b = emb_cache(4, (0.5,)), emb_cache(4, (0.5,))
    for i in range(6):  # 0, 1 evicted
        a.lookup(one(i))
        b.lookup(one(i))
    a.lookup(torch.tensor([1, 9, 1, 1]))
    b.lookup(torch.tensor([1, 9]), counts=torch.tensor([3, 1]))
    assert a.stats.ghost_hits == b.stats.ghost_hits == (1,)  # once per distinct id, as transfers
    c = emb_cache(4, (0.5,))
    for i in range(4):
        c.lookup(one(i))
    c.shrink(2)  # rows 2, 3 (items 2, 3) leave the slab
    c.lookup(one(3))
    assert c.stats.ghost_hits == (1,)


LAYOUT = KVLayout(num_layers=1, num_heads=1, head_dim=4, page_tokens=2)


def kv_pool(kv_pages: int, probes: tuple[float, ...]) -> KVPool:
    cfg = MemoryConfig(num_pages=kv_pages + 2, num_items=8, emb_dim=4, kv=LAYOUT,
                       initial_emb_share=2 / (kv_pages + 2), ghost_probes=probes, payload=False,
                       device="cpu")
    return KVPool(Arena(cfg))


def test_kv_ghost_hits_are_users_evicted_within_the_reach():
    p = kv_pool(6, (0.25,))  # 8 pages: ghost reach 2 pages; every user below takes 2 pages
    assert p.ghosts.pages == (2,)
    for u in (1, 2, 3, 4, 5):  # 4 evicts 1, 5 evicts 2
        p.lookup(u)
        p.append(u, 4)
    assert p.lookup(2) == 0
    assert (p.stats.ghost_hits, p.stats.ghost_hit_tokens) == ((1,), (4,))
    assert p.lookup(1) == 0  # evicted 4 pages of evictions ago: out of reach
    assert p.stats.ghost_hits == (1,)
    big = kv_pool(8, ())  # two pages more holds 2 and has already lost 1
    for u in (1, 2, 3, 4, 5):
        big.lookup(u)
        big.append(u, 4)
    assert big.lookup(2) == 4 and big.lookup(1) == 0


def test_kv_explicit_evictions_are_not_ghosts_and_ghosts_can_be_off():
    p = kv_pool(6, (0.5,))
    p.append(1, 4)
    p.evict(1)  # stale K/V dropped on purpose: more memory would not have kept it
    assert p.lookup(1) == 0 and p.stats.ghost_hits[0] == 0
    q = kv_pool(6, ())
    for u in (1, 2, 3, 4):
        q.lookup(u)
        q.append(u, 4)
    assert q.lookup(1) == 0 and q.stats.ghost_hits == ()


def test_kv_ghost_distance_counts_only_the_pages_the_eviction_was_short_of():
    p = kv_pool(6, (0.25,))  # ghost reach 2 pages, smaller than the 4-page user below
    p.append(1, 8)  # 4 pages
    p.append(2, 4)  # 2 pages: the pool is full
    p.lookup(2)
    p.append(3, 2)  # needs 1 page: evicts user 1 (LRU) although 1 page was missing
    assert p.lookup(1) == 0
    assert (p.stats.ghost_hits, p.stats.ghost_hit_tokens) == ((1,), (8,))
    big = kv_pool(8, ())  # 2 pages more: 4 + 2 + 1 pages fit, user 1 stays
    big.append(1, 8)
    big.append(2, 4)
    big.lookup(2)
    big.append(3, 2)
    assert big.lookup(1) == 8


def test_each_probe_counts_what_a_slab_that_much_larger_would_have_hit():
    rows = 8
    small = emb_cache(rows, (0.25, 0.5, 1.0))  # probes of 2, 4 and 8 rows
    assert small.ghosts.rows == (2, 4, 8)
    bigger = {g: emb_cache(rows + g, ()) for g in (2, 4, 8)}
    rng = random.Random(5)
    seq = [rng.randrange(rows + 6) if rng.random() < 0.7 else rng.randrange(40) for _ in range(4000)]
    for i in seq:
        small.lookup(one(i))
        for c in bigger.values():
            c.lookup(one(i))
    hits = small.stats.ghost_hits
    assert hits[0] <= hits[1] <= hits[2]
    for k, g in enumerate((2, 4, 8)):
        extra = bigger[g].stats.num_hits - small.stats.num_hits
        assert 0.8 * extra <= hits[k] <= extra, (g, hits[k], extra)


def test_kv_probes_split_ghosts_by_distance():
    p = kv_pool(6, (0.25, 0.5))  # probes of 2 and 4 pages
    for u in (1, 2, 3, 4, 5):  # 2 pages each: 4 evicts 1, 5 evicts 2
        p.lookup(u)
        p.append(u, 4)
    assert p.lookup(2) == 0 and p.lookup(1) == 0  # 2 pages beyond the pool, then 4
    assert (p.stats.ghost_hits, p.stats.ghost_hit_tokens) == ((1, 2), (4, 8))


def test_ghost_probes_are_validated():
    import pytest

    for bad in ((0.0,), (0.5, 0.2), (1.5,), (0.1, 0.1)):
        with pytest.raises(ValueError, match="ghost_probes"):
            MemoryConfig(ghost_probes=bad)


def test_a_shrink_makes_the_rows_just_past_the_new_end_the_nearest_ghosts():
    def run(rows_after):
        c = emb_cache(8, (0.25,))  # probe of 2 rows
        for i in range(8):
            c.lookup(one(i))  # item i in row i
        for i in (7, 6, 5, 4):
            c.lookup(one(i))
        c.shrink(rows_after)
        return c

    for item, ghost in ((4, 1), (5, 1), (6, 0), (7, 0)):
        c = run(4)  # rows 4..7 leave; a slab 2 rows larger (6) keeps rows 4 and 5
        c.lookup(one(item))
        assert c.stats.ghost_hits == (ghost,), item
        twin = run(6)
        before = twin.stats.num_hits
        twin.lookup(one(item))
        assert twin.stats.num_hits - before == ghost  # what the larger slab really does
