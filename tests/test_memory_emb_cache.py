"""EMB hot cache: scripted LRU sequences (exact rows and eviction order), a reference model on
random sequences, payload/metadata parity, slab resizes and the CPU refill path."""

from __future__ import annotations

import random

import pytest
import torch

from node_agent.memory import (
    RESERVED_TICK,
    Arena,
    EmbCache,
    KVLayout,
    MemoryConfig,
)

DIM = 4


def make_cfg(num_pages: int = 4, rows_per_page: int = 1, num_items: int = 32,
             emb_share: float = 1.0, payload: bool = True) -> MemoryConfig:
    # page = 1 layer x 2 x 2 tokens x 1 head x rows_per_page dims x 4 B = 16 * rows_per_page B;
    # a row = 4 dims x 4 B = 16 B, so a page holds rows_per_page rows.
    kv = KVLayout(num_layers=1, num_heads=1, head_dim=rows_per_page, page_tokens=2)
    return MemoryConfig(num_pages=num_pages, num_items=num_items, emb_dim=DIM, kv=kv,
                        initial_emb_share=emb_share, payload=payload, device="cpu")


def host_table(num_items: int) -> torch.Tensor:
    """Row i is [i, i + .25, i + .5, i + .75]: every row names its item."""
    return torch.arange(num_items * DIM, dtype=torch.float32).view(num_items, DIM) / DIM


def make_cache(payload: bool = True, **kw) -> EmbCache:
    cfg = make_cfg(payload=payload, **kw)
    arena = Arena(cfg)
    return EmbCache(arena, cfg.num_items, host_table(cfg.num_items) if payload else None)


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def slots(cache: EmbCache) -> list[int]:
    return cache.slot_to_item[: cache.rows].tolist()


def ok(cache: EmbCache) -> None:
    assert cache.check_invariants() == []


# ----------------------------------------------------------------------------------- scripted
def test_first_misses_fill_rows_in_first_occurrence_order():
    c = make_cache()  # 4 rows, empty
    r = c.lookup(ids(5, 3, 5, 7))
    ok(c)
    assert slots(c) == [5, 3, 7, -1]
    assert r.rows[:, 0].tolist() == [5, 3, 5, 7]
    assert torch.equal(r.rows, host_table(32)[[5, 3, 5, 7]])
    assert (r.num_requested, r.num_hits, r.num_unique_ids, r.num_unique_misses) == (4, 0, 3, 3)
    assert (r.num_evictions, r.num_bypassed, r.bytes_transferred) == (0, 0, 3 * 16)
    assert r.evicted_items is None


def test_eviction_takes_empty_rows_then_least_recent_lowest_row_first():
    c = make_cache()
    c.lookup(ids(5, 3, 7))  # tick 1: rows 0,1,2
    r = c.lookup(ids(9, 3, 11))  # tick 2: 3 hits; 9 -> empty row 3, 11 -> LRU row 0 (item 5)
    ok(c)
    assert slots(c) == [11, 3, 7, 9]
    assert r.evicted_items.tolist() == [5]
    assert (r.num_hits, r.num_unique_misses, r.num_evictions) == (1, 2, 1)
    # ticks: row0 (11) 2, row1 (3) 2, row2 (7) 1, row3 (9) 2
    assert c.lru_items().tolist() == [7, 11, 3, 9]
    r = c.lookup(ids(13, 15))  # victims: row 2 (tick 1), then row 0 (tick 2, lowest row)
    ok(c)
    assert slots(c) == [15, 3, 13, 9]
    assert r.evicted_items.tolist() == [7, 11]
    assert c.lru_items().tolist() == [3, 9, 15, 13]  # same tick: lower row first


def test_rows_used_by_the_current_call_are_never_victims_and_overflow_bypasses():
    c = make_cache(num_pages=2)  # 2 rows
    c.lookup(ids(1, 2))
    r = c.lookup(ids(1, 3, 4, 3))  # 1 hits row 0; only row 1 (item 2) is eligible
    ok(c)
    assert slots(c) == [1, 3]
    assert r.evicted_items.tolist() == [2]
    assert (r.num_unique_misses, r.num_bypassed) == (2, 1)
    assert r.rows[:, 0].tolist() == [1, 3, 4, 3]  # 4 served from host without being cached
    assert int(c.item_to_slot[4]) == c.miss_slot


def test_batch_larger_than_the_slab():
    c = make_cache(num_pages=2)
    r = c.lookup(ids(6, 7, 8, 6, 9))
    ok(c)
    assert slots(c) == [6, 7]
    assert r.rows[:, 0].tolist() == [6, 7, 8, 6, 9]
    assert (r.num_unique_misses, r.num_bypassed, r.num_unique_ids) == (4, 2, 4)


def test_stats_accumulate_like_fbgemm_counters():
    c = make_cache()
    c.lookup(ids(1, 2, 1))
    c.lookup(ids(1, 2, 3, 3))
    c.lookup(ids())
    s = c.stats
    assert (s.num_calls, s.num_requested_ids, s.num_unique_ids) == (3, 7, 5)
    assert (s.num_hits, s.num_unique_misses, s.num_evictions) == (2, 3, 0)
    assert s.bytes_transferred == 3 * 16
    assert s.hit_rate == pytest.approx(2 / 7)


def test_distinct_hit_count_with_a_large_slab_and_a_small_batch():
    # rows > 2 * batch: the distinct-hit count takes the scatter path instead of the scan
    c = make_cache(num_pages=16)
    c.lookup(ids(1, 2, 3))
    r = c.lookup(ids(1, 1, 2, 9))
    assert (r.num_hits, r.num_unique_ids, r.num_unique_misses) == (3, 3, 1)
    r = c.lookup(ids(1, 1, 2))
    assert (r.num_hits, r.num_unique_ids, r.num_unique_misses) == (3, 2, 0)


def test_empty_slab_serves_everything_from_host():
    c = make_cache(emb_share=0.0)
    r = c.lookup(ids(4, 4, 2))
    ok(c)
    assert c.rows == 0
    assert r.rows[:, 0].tolist() == [4, 4, 2]
    assert (r.num_unique_misses, r.num_bypassed) == (2, 2)


def test_out_buffer_is_filled_in_place():
    c = make_cache()
    out = torch.empty(3, DIM)
    r = c.lookup(ids(2, 9, 2), out=out)
    assert r.rows.data_ptr() == out.data_ptr()
    assert out[:, 0].tolist() == [2, 9, 2]


def test_metadata_only_cache_returns_no_rows_but_same_decisions():
    c = make_cache(payload=False)
    r = c.lookup(ids(5, 3, 5, 7))
    assert r.rows is None
    assert slots(c) == [5, 3, 7, -1]
    assert c.arena.slab() is None
    ok(c)


# ------------------------------------------------------------------------------- boundary
def test_shrink_invalidates_the_top_rows_and_grow_adds_empty_rows_first():
    c = make_cache(num_pages=4, emb_share=1.0)
    c.lookup(ids(1, 2, 3, 4))  # rows 0..3
    c.lookup(ids(1))
    assert c.shrink(2) == 2  # rows 2, 3 (items 3, 4) dropped
    c.arena.set_emb_pages(2)
    ok(c)
    assert slots(c) == [1, 2]
    assert c.stats.num_invalidations == 2
    assert int(c.item_to_slot[3]) == c.miss_slot
    c.arena.set_emb_pages(4)
    c.grow(4)
    ok(c)
    r = c.lookup(ids(7, 8, 9))  # empty rows 2, 3 first, then LRU row 1 (item 2, tick 1)
    ok(c)
    assert slots(c) == [1, 9, 7, 8]
    assert r.evicted_items.tolist() == [2]


# ------------------------------------------------------------------ reference model, random
class RefLRU:
    """The documented eviction order, one id at a time in plain Python."""

    def __init__(self, rows: int) -> None:
        self.slot_item = [-1] * rows
        self.slot_tick = [0] * rows
        self.item_slot: dict[int, int] = {}
        self.tick = 0

    def lookup(self, batch: list[int]) -> tuple[list[int], int, int]:
        self.tick += 1
        t = self.tick
        hits = 0
        for i in batch:
            if i in self.item_slot:
                self.slot_tick[self.item_slot[i]] = t
                hits += 1
        uniq: list[int] = []
        for i in batch:
            if i not in self.item_slot and i not in uniq:
                uniq.append(i)
        order = sorted((tk, s) for s, tk in enumerate(self.slot_tick) if tk < t)
        evicted = []
        for i, (_, s) in zip(uniq, order):
            old = self.slot_item[s]
            if old >= 0:
                del self.item_slot[old]
                evicted.append(old)
            self.slot_item[s] = i
            self.item_slot[i] = s
            self.slot_tick[s] = t
        return evicted, hits, max(0, len(uniq) - len(order))

    def resize(self, rows: int) -> None:
        for s in range(rows, len(self.slot_item)):
            if self.slot_item[s] >= 0:
                del self.item_slot[self.slot_item[s]]
        n = len(self.slot_item)
        self.slot_item = self.slot_item[:rows] + [-1] * max(0, rows - n)
        self.slot_tick = self.slot_tick[:rows] + [0] * max(0, rows - n)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("payload", [True, False])
def test_random_sequences_match_the_reference_model(seed, payload):
    rng = random.Random(seed)
    c = make_cache(num_pages=8, rows_per_page=2, num_items=40, emb_share=0.5, payload=payload)
    ref = RefLRU(c.rows)
    for step in range(120):
        op = rng.random()
        if op < 0.12:
            pages = rng.randint(0, 8)
            if pages * 2 > c.rows:
                c.arena.set_emb_pages(pages)
                c.grow(pages * 2)
            else:
                c.shrink(pages * 2)
                c.arena.set_emb_pages(pages)
            ref.resize(pages * 2)
        else:
            hot = rng.random() < 0.7
            batch = [rng.randrange(10) if hot and rng.random() < 0.8 else rng.randrange(40)
                     for _ in range(rng.randint(0, 12))]
            r = c.lookup(torch.tensor(batch, dtype=torch.int64))
            evicted, hits, bypassed = ref.lookup(batch)
            assert (r.evicted_items.tolist() if r.evicted_items is not None else []) == evicted
            assert r.num_hits == hits
            assert r.num_bypassed == bypassed
            if payload:
                assert r.rows[:, 0].tolist() == [float(i) for i in batch]
        assert slots(c) == ref.slot_item, f"step {step}"
        ok(c)


def test_payload_and_metadata_caches_agree_step_by_step():
    rng = random.Random(7)
    a = make_cache(num_pages=8, rows_per_page=2, num_items=64, emb_share=0.5, payload=True)
    b = make_cache(num_pages=8, rows_per_page=2, num_items=64, emb_share=0.5, payload=False)
    for _ in range(80):
        batch = torch.tensor([min(63, int(rng.paretovariate(1.2))) for _ in range(9)])
        ra, rb = a.lookup(batch), b.lookup(batch)
        assert ra[1:-1] == rb[1:-1]
        assert torch.equal(a.slot_to_item, b.slot_to_item)
        assert torch.equal(a.slot_tick, b.slot_tick)
    assert a.stats == b.stats


@pytest.mark.parametrize("payload", [False, True])
def test_counts_are_the_same_as_repeating_the_ids(payload):
    """``lookup(ids, counts=)`` (a deduplicated batch) leaves the cache exactly as the call with
    every id repeated: slab, ticks, popularity, stats and the returned figures."""
    rng = random.Random(11)
    a = make_cache(num_pages=8, rows_per_page=2, num_items=64, emb_share=0.5, payload=payload)
    b = make_cache(num_pages=8, rows_per_page=2, num_items=64, emb_share=0.5, payload=payload)
    for _ in range(120):
        uniq = list(dict.fromkeys(min(63, int(rng.paretovariate(1.1))) for _ in range(rng.randint(1, 12))))
        cnt = [rng.randint(1, 4) for _ in uniq]
        # the repeated call: the whole deduplicated span once (first occurrences), then the repeats
        full = uniq + [x for x, k in zip(uniq, cnt) for _ in range(k - 1)]
        ra = a.lookup(torch.tensor(full))
        rb = b.lookup(torch.tensor(uniq), counts=torch.tensor(cnt))
        assert ra[1:-1] == rb[1:-1]
        assert torch.equal(a.slot_to_item, b.slot_to_item)
        assert torch.equal(a.slot_tick, b.slot_tick)
        assert torch.equal(a.popularity, b.popularity)
        if payload:
            assert torch.equal(rb.rows, host_table(64)[torch.tensor(uniq)])
    assert a.stats == b.stats
    with pytest.raises(ValueError, match="counts"):
        b.lookup(ids(1, 2), counts=ids(1))
    with pytest.raises(ValueError, match="counts"):
        b.lookup(ids(1, 2), counts=ids(1, 0))


# ----------------------------------------------------------------------------------- refill
def test_plan_refill_ranks_uncached_items_by_misses_ties_by_lower_id():
    c = make_cache(num_pages=4, num_items=32, emb_share=0.5)  # 2 rows of 4
    c.lookup(ids(9, 9, 9, 4))  # rows: 9, 4
    c.lookup(ids(6, 6, 8, 8, 2))  # 6 -> row 0 (9 evicted), 8 -> row 1; 2 bypassed
    c.lookup(ids(9, 12))  # 9 -> row 0, 12 -> row 1 (6, 8 evicted)
    ok(c)
    # misses so far: 9 x3 + 1, 4, 6 x2, 8 x2, 2, 12 ; cached: 9, 12
    c.arena.set_emb_pages(4)
    c.grow(4)
    cand = c.refill.plan()
    assert cand.tolist() == [6, 8]  # two empty rows: 6 and 8 (2 misses each), not 2 or 4
    assert c.popularity_of(ids(6, 2, 9)).tolist() == [2.0, 1.0, 4.0]


def test_refill_fills_empty_rows_lowest_first_and_skips_items_cached_since():
    c = make_cache(num_pages=4, num_items=32, emb_share=0.5)
    c.lookup(ids(1, 1, 1, 2, 2, 3, 4, 5))  # 1, 2 cached; 3, 4, 5 bypassed (1 miss each)
    c.lookup(ids(1, 2, 6, 6, 7))  # 6, 7 bypassed (1, 2 used this call)
    c.arena.set_emb_pages(4)
    c.grow(4)
    # two empty rows: 6 (2 misses), then the lowest id of those with 1 miss (3, 4, 5, 7)
    assert c.refill.plan().tolist() == [6, 3]
    c.lookup(ids(6))  # a demand miss takes 6 into the lowest empty row (2) first
    assert slots(c) == [1, 2, 6, -1]
    n = c.refill.issue(max_rows=8)  # CPU: copied and committed now
    ok(c)
    assert n == 1
    assert slots(c) == [1, 2, 6, 3]  # 6 skipped (cached), 3 into the last empty row
    assert c.stats.num_refill_rows == 1
    assert c.arena.slab()[3, 0].item() == 3.0
    assert c.refill.issue(max_rows=8) == 0  # no empty row left
    assert not c.refill.pending()


def test_refilled_rows_enter_as_most_recent():
    c = make_cache(num_pages=4, num_items=32, emb_share=0.5)
    c.lookup(ids(1, 2))
    c.lookup(ids(1, 2, 3, 3, 3))  # 3 bypassed, 3 misses
    c.arena.set_emb_pages(3)
    c.grow(3)
    assert c.refill.issue(4) == 1
    assert c.lru_items().tolist() == [1, 2, 3]
    r = c.lookup(ids(5))  # the LRU victim is row 0 (item 1), not the refilled row
    assert r.evicted_items.tolist() == [1]


def test_a_chunk_in_flight_reserves_its_rows_and_commit_discards_items_cached_meanwhile():
    # On CUDA a chunk stays in flight until its copy completes; on CPU the copy completes at
    # once. Drive the same reserve -> copy -> commit steps by hand to check the in-between.
    c = make_cache(num_pages=4, num_items=32, emb_share=0.5)  # 2 rows of 4
    c.lookup(ids(1, 2))
    c.lookup(ids(1, 2, 7, 8))  # 7, 8 bypassed
    c.arena.set_emb_pages(4)
    c.grow(4)
    items, rows = ids(7, 8), ids(2, 3)
    c.slot_tick.index_fill_(0, rows, RESERVED_TICK)
    c.refill._inflight = c.refill._copy_chunk(items, rows)
    ok(c)
    r = c.lookup(ids(8, 9))  # reserved rows 2, 3 are not victims: rows 0, 1 are
    assert r.evicted_items.tolist() == [1, 2]
    assert slots(c) == [8, 9, -1, -1]
    ok(c)
    assert c.refill.poll()
    ok(c)
    assert slots(c) == [8, 9, 7, -1]  # 8 already cached: its row goes back to empty
    assert (c.stats.num_refill_rows, c.stats.num_refill_discarded) == (1, 1)
    r = c.lookup(ids(10))  # the freed row is empty again: first victim
    assert slots(c) == [8, 9, 7, 10]
    ok(c)


def test_shrink_waits_for_the_chunk_in_flight():
    c = make_cache(num_pages=4, num_items=32, emb_share=0.5)
    c.lookup(ids(1, 2, 3, 3))
    c.arena.set_emb_pages(4)
    c.grow(4)
    c.slot_tick.index_fill_(0, ids(2), RESERVED_TICK)
    c.refill._inflight = c.refill._copy_chunk(ids(3), ids(2))
    assert c.shrink(2) == 1  # commits 3 into row 2 first, then drops rows 2, 3
    c.arena.set_emb_pages(2)
    ok(c)
    assert not c.refill.inflight
    assert slots(c) == [1, 2]


def test_popularity_halves_every_half_life():
    cfg = make_cfg(num_pages=1)
    c = EmbCache(Arena(cfg), cfg.num_items, host_table(cfg.num_items),
                 popularity_half_life_ids=4)
    c.lookup(ids(5, 6, 7))  # 1 row: 5 cached, 6 and 7 bypassed; 3 ids seen
    assert c.popularity_of(ids(5, 6)).tolist() == [1.0, 1.0]
    c.lookup(ids(9))  # 4 ids: one halving
    assert c.popularity_of(ids(5, 6, 9)).tolist() == [0.5, 0.5, 0.5]


def test_host_table_is_validated():
    cfg = make_cfg()
    with pytest.raises(ValueError):
        EmbCache(Arena(cfg), cfg.num_items, None)
    with pytest.raises(ValueError):
        EmbCache(Arena(cfg), cfg.num_items, torch.zeros(cfg.num_items, DIM + 1))
    meta = make_cfg(payload=False)
    with pytest.raises(ValueError):
        EmbCache(Arena(meta), meta.num_items, host_table(meta.num_items))


@pytest.mark.cuda
def test_cuda_lookup_and_refill_match_host_rows():
    kv = KVLayout(num_layers=1, num_heads=1, head_dim=4, page_tokens=2)
    cfg = MemoryConfig(num_pages=8, num_items=64, emb_dim=DIM, kv=kv, initial_emb_share=0.5,
                       device="cuda")
    arena = Arena(cfg)
    table = host_table(64)
    c = EmbCache(arena, 64, table)
    assert c.host_table.is_pinned()
    batch = torch.tensor([3, 9, 3, 40, 41, 42], device="cuda")
    r = c.lookup(batch)
    assert torch.equal(r.rows.cpu(), table[batch.cpu()])
    assert c.check_invariants() == []
    arena.set_emb_pages(8)
    c.grow(8 * cfg.rows_per_page)
    for i in range(40):
        c.lookup(torch.tensor([50 + i % 10], device="cuda"))
    issued = c.refill.issue(8)
    assert issued > 0
    c.refill.wait()
    assert not c.refill.inflight
    assert c.check_invariants() == []
