"""KV pool: page allocation order, whole-user LRU eviction, residency deltas, K/V views and
round trips, boundary releases (migrate / evict) and randomised sequences with invariants."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from node_agent.memory import EMB, FREE, Arena, CachedSequence, KVLayout, KVPool, MemoryConfig, ResidencyDelta

LAYOUT = KVLayout(num_layers=2, num_heads=1, head_dim=4, page_tokens=2)  # page: [2, 2, 2, 1, 4]


def make_pool(num_pages: int = 8, emb_pages: int = 2, payload: bool = True) -> KVPool:
    cfg = MemoryConfig(num_pages=num_pages, num_items=8, emb_dim=4, kv=LAYOUT,
                       initial_emb_share=emb_pages / num_pages, payload=payload, device="cpu")
    return KVPool(Arena(cfg))


def ok(pool: KVPool) -> None:
    assert pool.check_invariants() == []


def kv_tokens(n: int, base: float) -> torch.Tensor:
    """[layers, 2, n, heads, dim] with distinct values."""
    return base + torch.arange(2 * 2 * n * 1 * 4, dtype=torch.float32).view(2, 2, n, 1, 4)


def test_pages_are_allocated_highest_first_and_extended_as_tokens_grow():
    p = make_pool()  # KV pages 2..7
    a = p.append(1, 3)  # 3 tokens, 2 per page -> 2 pages
    assert (a.start_token, a.num_tokens, a.new_pages, a.evicted_users) == (0, 3, (7, 6), ())
    assert p.append(2, 1).new_pages == (5,)
    assert p.append(1, 1).new_pages == ()  # 4 tokens still fit in 2 pages
    a = p.append(1, 1)
    assert (a.start_token, a.new_pages) == (4, (4,))
    assert p.block_table(1) == (7, 6, 4)
    assert (p.num_tokens(1), p.num_used, p.num_free) == (5, 4, 2)
    ok(p)


def ids(*xs: int):
    return np.asarray(xs, dtype=np.int64)


def times(*xs: float):
    return np.asarray(xs, dtype=np.float64)


def test_the_pool_records_which_tokens_its_pages_hold():
    p = make_pool()  # 6 KV pages of 2 tokens
    assert p.lookup_sequence(1) == CachedSequence(0)
    p.append(1, 3, ids(5, 6, 7), times(1, 2, 3))
    p.append(1, 2, ids(8, 9), times(4, 5))
    got = p.lookup_sequence(1)
    assert got.num_tokens == 5 and not got.evicted
    assert got.items.tolist() == [5, 6, 7, 8, 9] and got.ts.tolist() == [1, 2, 3, 4, 5]
    items, ts = p.recorded_tokens(1)
    assert items.tolist() == [5, 6, 7, 8, 9] and ts.tolist() == [1, 2, 3, 4, 5]
    p.append(2, 1)  # no ids: not recorded
    assert p.lookup_sequence(2) == CachedSequence(1) and p.recorded_tokens(2) is None
    p.append(1, 1)  # more tokens without their ids: user 1 is no longer recorded
    assert p.lookup_sequence(1) == CachedSequence(6) and p.records.num_recorded == 0
    with pytest.raises(ValueError, match="the 2 new tokens"):
        p.append(3, 2, ids(1), times(1))
    ok(p)


def test_a_recorded_user_evicted_is_told_once_and_forgotten_amortised():
    p = make_pool()  # 6 KV pages of 2 tokens
    p.append(1, 4, ids(1, 2, 3, 4), times(0, 0, 0, 0))  # pages 7, 6
    p.append(2, 4, ids(5, 6, 7, 8), times(0, 0, 0, 0))  # 5, 4
    p.append(3, 4)  # 3, 2: not recorded
    assert p.append(4, 2, ids(9, 9), times(0, 0)).evicted_users == (1,)  # LRU
    assert p.append(5, 8).evicted_users == (2, 3)
    assert p.records.evicted == {1, 2}  # 3 was not recorded
    ok(p)
    assert p.lookup_sequence(1) == CachedSequence(0, evicted=True)
    assert p.lookup_sequence(1) == CachedSequence(0)  # told once
    p.append(2, 2, ids(1, 2), times(0, 0))  # back in the pool: no longer an evicted user
    assert p.records.evicted == set()
    p.evict(2)  # an eviction by the caller is remembered too ...
    assert p.records.evicted == {2}
    p.append(2, 2, ids(1, 2), times(0, 0))
    p.evict(2, forget=True)  # ... unless the caller found the K/V stale
    assert p.lookup_sequence(2) == CachedSequence(0)
    p.append(2, 2, ids(1, 2), times(0, 0))
    p.evict(2)
    assert p.records.num_recorded == 1 and p.records.evicted == {2}  # user 4 recorded, 2 remembered
    p.records.forget()  # 2 < 1024: nothing forgotten yet
    assert p.records.evicted == {2}
    p.records._forget_at = 1
    p.records.forget()
    assert p.records.evicted == set() and p.records._forget_at == 2 * 1 + 1024
    p.append(6, 2, ids(1, 2), times(0, 0))
    p.evict_all()  # every user dropped, none remembered
    assert (p.users_lru(), p.records.num_recorded, p.records.evicted) == ([], 0, set())
    ok(p)


def test_whole_users_are_evicted_least_recently_used_first():
    p = make_pool()  # 6 KV pages
    p.append(1, 4)  # 7, 6
    p.append(2, 2)  # 5
    p.append(3, 2)  # 4
    p.append(4, 4)  # 3, 2
    assert p.lookup(1) == 4  # 1 becomes most recent: LRU order 2, 3, 4, 1
    assert p.users_lru() == [2, 3, 4, 1]
    a = p.append(5, 3)  # needs 2 pages: evict 2 (frees 5), then 3 (frees 4)
    ok(p)
    assert a.evicted_users == (2, 3)
    assert a.new_pages == (5, 4)
    assert p.users_lru() == [4, 1, 5]
    assert p.lookup(2) == 0
    a = p.append(1, 4)  # user 1 grows 4 -> 8 tokens: 2 more pages; evict 4 (never 1 itself)
    assert a.evicted_users == (4,)
    assert a.new_pages == (3, 2)
    assert p.block_table(1) == (7, 6, 3, 2)
    ok(p)


def test_a_user_that_can_never_fit_is_dropped_and_others_kept():
    p = make_pool()  # 6 KV pages = 12 tokens
    p.append(1, 2)
    p.append(2, 10)
    assert p.append(3, 13) is None
    assert p.users_lru() == [1, 2]
    assert p.append(2, 3) is None  # 2 would need 13 tokens: its KV is dropped
    assert p.users_lru() == [1]
    assert p.stats.num_rejected == 2
    ok(p)


def test_residency_deltas_are_net_and_ordered_by_last_change():
    p = make_pool()
    p.append(1, 2)
    p.append(2, 2)
    assert p.drain_residency() == ResidencyDelta(added=(1, 2), evicted=())
    assert p.drain_residency() == ResidencyDelta((), ())
    p.evict(1)
    p.append(3, 2)
    p.append(1, 2)  # evicted, then back: net "added"
    p.append(4, 2)
    p.evict(4)  # added, then evicted: net "evicted"
    assert p.drain_residency() == ResidencyDelta(added=(3, 1), evicted=(4,))


def test_write_read_round_trip_and_page_views():
    p = make_pool()
    p.append(7, 3)  # pages 7, 6
    kv = kv_tokens(3, 100.0)
    p.write(7, 0, kv)
    assert torch.equal(p.read(7), kv)
    views = p.page_views(7)
    assert [tuple(v.shape) for v in views] == [(2, 2, 2, 1, 4)] * 2
    # token 2 is page 6 (the second page), offset 0; K of layer 1
    assert torch.equal(views[1][1, 0, 0], kv[1, 0, 2])
    views[1][0, 1, 0].fill_(-1.0)  # writes through a view land in the arena
    assert torch.equal(p.read(7)[0, 1, 2], torch.full((1, 4), -1.0))
    p.append(7, 2)  # 5 tokens: page 5 added
    p.write(7, 3, kv_tokens(2, 500.0))
    assert torch.equal(p.read(7)[:, :, 3:], kv_tokens(2, 500.0))
    assert torch.equal(p.read(7, 2), kv[:, :, :2])
    assert p.arena.kv_pages().shape == (8, 2, 2, 2, 1, 4)
    with pytest.raises(ValueError):
        p.write(7, 4, kv_tokens(2, 0.0))  # past the cached tokens
    with pytest.raises(ValueError):
        p.write(7, 0, torch.zeros(2, 2, 1, 2, 4))  # wrong shape


def test_per_layer_k_and_v_lists_round_trip():
    p = make_pool()
    p.append(3, 3)
    k = [torch.randn(3, 1, 4) for _ in range(2)]
    v = [torch.randn(3, 1, 4) for _ in range(2)]
    p.write_layers(3, 0, k, v)
    k2, v2 = p.read_layers(3)
    assert all(torch.equal(a, b) for a, b in zip(k + v, k2 + v2))
    assert torch.equal(p.read(3)[1, 1], v[1])  # layer 1, V
    with pytest.raises(ValueError):
        p.write_layers(3, 0, k[:1], v[:1])


def test_metadata_only_pool_has_no_tensors():
    p = make_pool(payload=False)
    p.append(1, 3)
    assert p.block_table(1) == (7, 6)
    with pytest.raises(RuntimeError):
        p.read(1)
    with pytest.raises(RuntimeError):
        p.page_views(1)


# ------------------------------------------------------------------------- boundary moves
def test_release_of_free_pages_is_metadata_only():
    p = make_pool(num_pages=10, emb_pages=2)
    p.append(1, 4)  # 9, 8
    rel = p.release_low_pages(6)  # pages 2..5 are free
    assert (rel.free_pages_taken, rel.migrated, rel.evicted_users) == (4, (), ())
    assert rel.bytes_copied == 0
    p.arena.set_emb_pages(6)
    ok(p)
    assert p.page_owner[:6].tolist() == [EMB] * 6
    assert p.append(2, 2).new_pages == (7,)


def test_release_migrates_occupied_pages_into_the_highest_free_pages_keeping_data():
    p = make_pool(num_pages=8, emb_pages=2)
    for u in range(6):
        p.append(u, 2)  # user u -> page 7 - u
    p.evict(0)  # frees 7
    p.evict(2)  # frees 5
    kv3, kv4 = kv_tokens(2, 30.0), kv_tokens(2, 40.0)
    p.write(3, 0, kv3)  # page 4
    p.write(4, 0, kv4)  # page 3
    p.lookup(1)  # LRU: 3, 4, 5, 1
    rel = p.release_low_pages(4)  # pages 2 (user 5), 3 (user 4) occupied; 7 and 5 free above
    p.arena.set_emb_pages(4)
    ok(p)
    assert rel.evicted_users == ()
    assert rel.migrated == ((2, 7), (3, 5))
    assert rel.bytes_copied == 2 * p.page_bytes
    assert p.block_table(5) == (7,)
    assert p.block_table(4) == (5,)
    assert torch.equal(p.read(4), kv4)
    assert torch.equal(p.read(3), kv3)
    assert p.stats.num_migrated_pages == 2


def test_release_evicts_lru_users_when_there_is_no_room_to_migrate():
    p = make_pool(num_pages=8, emb_pages=2)
    for u in range(6):
        p.append(u, 2)  # full: user u on page 7 - u
    p.lookup(0)
    p.lookup(5)  # LRU order: 1, 2, 3, 4, 0, 5
    rel = p.release_low_pages(4)  # pages 2 (user 5), 3 (user 4) must go
    p.arena.set_emb_pages(4)
    ok(p)
    # evict 1 (page 6 freed): 2 occupied, 1 free outside -> evict 2 (page 5): enough room
    assert rel.evicted_users == (1, 2)
    assert rel.migrated == ((2, 6), (3, 5))
    assert p.users_lru() == [3, 4, 0, 5]
    assert p.block_table(5) == (6,)


def test_accept_pages_extends_the_free_run_next_to_the_boundary():
    p = make_pool(num_pages=8, emb_pages=6)  # KV pages 6, 7
    p.append(1, 2)  # page 7
    p.arena.set_emb_pages(2)
    assert p.accept_pages(2) == 4
    ok(p)
    assert p.page_owner.tolist() == [EMB, EMB, FREE, FREE, FREE, FREE, FREE, 1]
    assert [p.append(u, 2).new_pages for u in (2, 3, 4)] == [(6,), (5,), (4,)]
    ok(p)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("payload", [True, False])
def test_random_sequences_keep_invariants(seed, payload):
    from collections import OrderedDict

    rng = random.Random(seed)
    p = make_pool(num_pages=24, emb_pages=6, payload=payload)
    shadow: dict[int, torch.Tensor] = {}  # user -> the K/V we wrote (payload pools)
    order: OrderedDict[int, None] = OrderedDict()  # resident users, least recently used first (both pools)
    num_evictions = 0
    for step in range(300):
        op = rng.random()
        if op < 0.55:
            u, n = rng.randrange(12), rng.randint(1, 7)
            a = p.append(u, n)
            if a is None:
                shadow.pop(u, None)
                order.pop(u, None)
            else:
                # the victims are the least recently used users, oldest first (never u itself)
                lru_first = [v for v in order if v != u]
                assert list(a.evicted_users) == lru_first[:len(a.evicted_users)], f"step {step}"
                num_evictions += len(a.evicted_users)
                for v in a.evicted_users:
                    shadow.pop(v, None)
                    order.pop(v, None)
                order[u] = None
                order.move_to_end(u)
                if payload:
                    kv = kv_tokens(n, float(step * 100))
                    p.write(u, a.start_token, kv)
                    prev = shadow.get(u, torch.zeros(2, 2, 0, 1, 4))
                    shadow[u] = torch.cat([prev, kv], dim=2)
        elif op < 0.75:
            u = rng.randrange(12)
            if p.lookup(u):  # a hit makes the user most recent
                order.move_to_end(u)
        elif op < 0.82:
            u = rng.randrange(12)
            p.evict(u)
            shadow.pop(u, None)
            order.pop(u, None)
        else:
            target = rng.randint(0, 20)
            if target > p.kv_start:
                rel = p.release_low_pages(target)
                for v in rel.evicted_users:
                    shadow.pop(v, None)
                    order.pop(v, None)
            else:
                p.arena.set_emb_pages(target)
                p.accept_pages(target)
            p.arena.set_emb_pages(target)
        assert p.check_invariants() == [], f"step {step}"
        assert p.users_lru() == list(order), f"step {step}"  # the LRU order, with or without payload
        if payload:
            assert set(shadow) == set(order)
    assert num_evictions > 0  # the sequence did exercise eviction
    if payload:
        for u, kv in shadow.items():
            assert torch.equal(p.read(u), kv)


@pytest.mark.parametrize("seed", range(4))
def test_bulk_page_allocation_matches_one_page_at_a_time(seed):
    """`append` of many pages (one scan) takes the same pages, in the same order, as popping
    the highest free page again and again; churn leaves free pages both in and above the run."""
    rng = random.Random(seed)
    bulk = make_pool(num_pages=64, emb_pages=4, payload=False)
    single = make_pool(num_pages=64, emb_pages=4, payload=False)
    for _ in range(300):
        user, tokens = rng.randrange(12), rng.randint(1, 160)  # up to 80 pages of 2 tokens: some never fit
        a = bulk.append(user, tokens)
        entry = single._users.get(user)
        have = 0 if entry is None else len(entry.block_table)
        need = -(-((0 if entry is None else entry.num_tokens) + tokens) // single.page_tokens)
        if need > single.num_kv_pages:
            assert a is None and single.append(user, tokens) is None
            continue
        # the reference: free LRU users as append would, then pop page by page
        extra = need - have
        while extra > single.num_free:
            single._evict_lru(protect=user)
        expected = [single.free.pop(single.kv_start) for _ in range(extra)]
        assert list(a.new_pages) == expected
        # bring the reference to the same state through the public path
        for p in expected:
            single.page_owner[p] = FREE
            single.free.push([p])
        single.append(user, tokens)
        assert bulk.page_owner.tolist() == single.page_owner.tolist()
        assert bulk.check_invariants() == [] and single.check_invariants() == []
