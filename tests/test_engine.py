"""The serving engine: paged K/V == contiguous K/V, KV hit == recompute, mismatch and eviction
handling, micro-batches, the latency breakdown, link emulation, request validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from node_agent.engine import CandidateGenerator, Engine, EngineConfig, LinkEmulationConfig, RecRequest
from node_agent.memory import CachedSequence
from node_agent.paged_kv import KVReuse, plan_kv_reuse
from node_agent.rec_request import RequestError
from node_agent.memory import RefillConfig
from node_agent.model import KVState, ModelConfig

NUM_ITEMS = 500

pytestmark = pytest.mark.usefixtures("one_thread")


MODEL = ModelConfig(embedding_dim=16, num_layers=2, num_heads=2, qk_dim=8, v_dim=8, seed=3)


def make_engine(num_pages: int = 256, page_tokens: int = 4, emb_share: float = 0.5, **kw) -> Engine:
    # page = 2 layers x 2 x 4 tokens x 2 heads x 8 floats = 512 B = 8 rows of 16 floats
    cfg = EngineConfig(model=MODEL, num_items=NUM_ITEMS, num_pages=num_pages, page_tokens=page_tokens,
                       emb_share=emb_share, max_history_len=kw.pop("max_history_len", 256),
                       max_candidates=64, default_num_candidates=16, default_top_k=5,
                       link=kw.pop("link", LinkEmulationConfig(mode="off")),
                       refill=RefillConfig(limit_bytes_per_s=1e6, window_s=0.1, chunk_bytes=1024), **kw)
    pop = np.arange(NUM_ITEMS)[::-1].astype(np.float64)  # item 0 most popular
    return Engine(cfg, item_popularity=pop)


def sequence(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, NUM_ITEMS, n), 1.6e9 + np.cumsum(rng.exponential(120.0, n))


def reference_scores(engine: Engine, items: np.ndarray, ts: np.ndarray, cands: np.ndarray,
                     now_ts: float | None = None) -> tuple[torch.Tensor, KVState]:
    """The model on contiguous K/V: a full prefill of the whole sequence, then rank."""
    table = engine.mm.emb.host_table
    model = engine.model
    if len(items):
        _, kv = model(model.tokens(table[torch.from_numpy(items)]), torch.from_numpy(ts))
    else:
        kv = engine.passes.empty_kv
    now = float(ts[-1]) if now_ts is None and len(ts) else (now_ts or 0.0)
    scores = model.rank(table[torch.from_numpy(cands)], kv, now_ts=torch.tensor(now, dtype=torch.float64))
    return scores, kv


def check_against_reference(engine: Engine, resp, items, ts, cands, top_k) -> None:
    ref, _ = reference_scores(engine, items, ts, cands)
    top = torch.topk(ref, top_k)
    assert resp.items == cands[top.indices.numpy()].tolist()
    assert np.allclose(resp.scores, top.values.numpy(), atol=1e-5)


def test_paged_kv_equals_contiguous_across_page_boundaries():
    eng = make_engine(page_tokens=4)
    cands = np.arange(100, 140)
    for seed, splits in enumerate([[3, 4, 5], [4, 8, 9], [1, 7, 15, 16, 17], [13, 21, 37], [0, 2, 3, 11, 64]]):
        items, ts = sequence(splits[-1], seed)
        user = 10 + seed
        prev = 0
        for n in splits:
            hist_end = prev if prev else max(0, n - 1)
            req = RecRequest(user, items[:hist_end], items[hist_end:n], ts[:n], candidates=cands, top_k=7)
            resp = eng.serve(req)
            assert resp.kv.outcome == ("hit" if prev else "miss"), resp.kv.reason
            assert resp.kv.reuse_tokens == prev and resp.prefill_tokens == n - prev
            check_against_reference(eng, resp, items[:n], ts[:n], cands, 7)
            # the pages hold exactly the contiguous K/V of the whole sequence
            k, v = eng.mm.kv.read_layers(user)
            _, ref_kv = reference_scores(eng, items[:n], ts[:n], cands)
            for li in range(MODEL.num_layers):
                assert torch.allclose(k[li], ref_kv.k[li], atol=1e-5)
                assert torch.allclose(v[li], ref_kv.v[li], atol=1e-5)
            prev = n
        assert eng.mm.kv.num_tokens(user) == splits[-1]
        assert eng.mm.kv.block_table(user).__len__() == -(-splits[-1] // 4)
    assert eng.check_invariants() == []


def test_kv_hit_path_equals_recompute_path():
    eng = make_engine()
    items, ts = sequence(40, 7)
    eng.serve(RecRequest(1, items[:30], (), ts[:30]))
    hit = eng.serve(RecRequest(1, items[:30], items[30:], ts))
    assert hit.kv.outcome == "hit" and hit.kv_hit_tokens == 30 and hit.prefill_tokens == 10
    assert hit.recomputed_tokens == 0
    assert eng.mm.kv.evict(1)
    miss = eng.serve(RecRequest(1, items[:30], items[30:], ts))
    assert miss.kv.outcome == "miss" and miss.kv.reason == "the user's K/V were evicted"
    assert miss.kv_hit_tokens == 0 and miss.recomputed_tokens == 30 and miss.prefill_tokens == 40
    assert miss.items == hit.items  # the same generated candidates: seeded by (seed, user, length)
    assert np.allclose(miss.scores, hit.scores, atol=1e-5)
    # a pure refresh (no new items) ranks on the cached K/V without prefilling anything
    again = eng.serve(RecRequest(1, items, (), ts))
    assert again.kv.outcome == "hit" and again.prefill_tokens == 0
    assert again.kv.reason == "all 40 tokens cached: nothing to prefill"
    assert again.items == hit.items and np.allclose(again.scores, hit.scores, atol=1e-5)


def test_mismatch_evicts_and_recomputes():
    eng = make_engine()
    items, ts = sequence(20, 8)
    cands = np.arange(50)
    eng.serve(RecRequest(2, items[:12], (), ts[:12]))
    other = items.copy()
    other[3] = (other[3] + 1) % NUM_ITEMS
    r = eng.serve(RecRequest(2, other[:16], other[16:], ts, candidates=cands))
    assert r.kv.outcome == "mismatch"
    assert r.kv.reason == f"cached token 3 is item {items[3]}, the request has item {other[3]} there"
    assert r.prefill_tokens == 20 and r.kv_cached_after == 20
    check_against_reference(eng, r, other, ts, cands, 5)
    assert eng.mm.kv.recorded_tokens(2)[0].tolist() == other.tolist()
    # timestamps are part of the check
    ts2 = ts.copy()
    ts2[5] += 1.0
    r = eng.serve(RecRequest(2, other, (), ts2, candidates=cands))
    assert r.kv.outcome == "mismatch" and "timestamp" in r.kv.reason
    check_against_reference(eng, r, other, ts2, cands, 5)
    # a request shorter than what is cached
    r = eng.serve(RecRequest(2, other[:10], (), ts2[:10], candidates=cands))
    assert r.kv.outcome == "mismatch" and r.kv.reason == "20 tokens cached but the request's sequence has only 10"
    check_against_reference(eng, r, other[:10], ts2[:10], cands, 5)
    assert eng.mm.kv.num_tokens(2) == 10
    assert eng.check_invariants() == []


def test_plan_kv_reuse_is_pure_and_explains_itself():
    items = np.array([5, 6, 7, 8])
    ts = np.zeros(4)
    assert plan_kv_reuse(CachedSequence(0), items, ts) == KVReuse("miss", 0, 4, "no K/V cached for the user")
    assert plan_kv_reuse(CachedSequence(0, evicted=True), items, ts) == KVReuse(
        "miss", 0, 4, "the user's K/V were evicted")
    assert plan_kv_reuse(CachedSequence(2, items[:2], ts[:2]), items, ts) == KVReuse(
        "hit", 2, 2, "2 cached tokens reused, 2 prefilled")
    assert plan_kv_reuse(CachedSequence(3), items, ts) == KVReuse(
        "mismatch", 0, 4, "the pool holds 3 tokens but no record of their items")
    other = np.array([5, 9, 7])
    assert plan_kv_reuse(CachedSequence(3, other, ts[:3]), items, ts) == KVReuse(
        "mismatch", 0, 4, "cached token 1 is item 9, the request has item 6 there")


def test_eviction_by_other_users_is_handled():
    # 12 KV pages of 4 tokens: one user of 30 tokens takes 8 pages, so the next one evicts it
    eng = make_engine(num_pages=24, emb_share=0.5)
    assert eng.mm.kv.num_kv_pages == 12
    a, ta = sequence(30, 1)
    b, tb = sequence(30, 2)
    cands = np.arange(20)
    eng.serve(RecRequest(1, a[:26], (), ta[:26]))
    rb = eng.serve(RecRequest(2, b[:26], b[26:], tb, candidates=cands))
    assert 1 not in eng.mm.kv and rb.kv_cached_after == 30
    ra = eng.serve(RecRequest(1, a[:26], a[26:], ta, candidates=cands))
    assert ra.kv.outcome == "miss" and ra.kv.reason == "the user's K/V were evicted"
    check_against_reference(eng, ra, a, ta, cands, 5)
    # a user whose sequence cannot fit in the pool at all is served without caching
    big, tbig = sequence(60, 3)
    r = eng.serve(RecRequest(3, big[:50], big[50:], tbig, candidates=cands))
    assert r.kv_cached_after == 0 and 3 not in eng.mm.kv and eng.paged_kv.num_uncacheable == 1
    check_against_reference(eng, r, big, tbig, cands, 5)
    assert eng.check_invariants() == []
    # the pool forgets which users it evicted (amortised, after a batch): a later miss is a plain one
    assert 2 not in eng.mm.kv and eng.mm.kv.records.evicted == {2}
    eng.mm.kv.records._forget_at = 0
    eng.serve(RecRequest(4, a[:3], (), ta[:3]))
    assert eng.mm.kv.records.evicted == set()
    r = eng.serve(RecRequest(2, b[:26], b[26:], tb, candidates=cands))
    assert r.kv.outcome == "miss" and r.kv.reason == "no K/V cached for the user"


def test_micro_batch_with_evictions_inside_and_a_repeated_user():
    eng = make_engine(num_pages=24, emb_share=0.5)  # 12 KV pages: one 30-token user at a time
    ref = make_engine(num_pages=256)
    seqs = {u: sequence(30, 20 + u) for u in range(3)}
    for u, (it, t) in seqs.items():  # cache 26 tokens of user 0 only (the others get evicted)
        eng.serve(RecRequest(u, it[:26], (), t[:26]))
    cands = np.arange(30, 60)
    reqs = [RecRequest(u, it[:26], it[26:], t, candidates=cands) for u, (it, t) in seqs.items()]
    reqs.append(RecRequest(0, seqs[0][0], (), seqs[0][1], candidates=cands))  # user 0 again: sees the first
    out = eng.serve_batch(reqs)
    assert [r.batch_size for r in out] == [4] * 4
    assert [r.batch_passes for r in out] == [2] * 4  # user 0's second request: a pass of its own
    assert out[0].to_dict()["batch_passes"] == 2
    assert [r.batch_passes for r in eng.serve_batch(reqs[:3])] == [1] * 3
    assert [r.user_id for r in out] == [0, 1, 2, 0]
    assert out[2].kv.outcome == "hit" and out[0].kv.outcome == "miss" and out[1].kv.outcome == "miss"
    for r, req in zip(out[:3], reqs):
        it, t = seqs[r.user_id]
        check_against_reference(ref, r, it, t, cands, 5)
    assert out[3].kv.outcome in ("hit", "miss") and out[3].items == out[0].items
    assert np.allclose(out[3].scores, out[0].scores, atol=1e-5)
    assert eng.check_invariants() == []


def test_boundary_moves_while_serving_keep_kv_correct():
    eng = make_engine(num_pages=64, emb_share=0.25)
    cands = np.arange(40)
    seqs = {u: sequence(25, 40 + u) for u in range(4)}
    for u, (it, t) in seqs.items():
        eng.serve(RecRequest(u, it[:20], (), t[:20]))
    plan = eng.set_emb_share(0.5, now_s=1.0)
    assert plan.target_emb_pages == 32
    now = 1.0
    while eng.mm.boundary_moving:
        now += 0.01
        eng.maintenance(now)
        assert eng.check_invariants() == []
    for u, (it, t) in seqs.items():
        r = eng.serve(RecRequest(u, it[:20], it[20:], t, candidates=cands))
        assert r.kv.outcome in ("hit", "miss")
        check_against_reference(eng, r, it, t, cands, 5)
    assert eng.mm.emb_share == 0.5


def test_latency_breakdown_and_link_emulation():
    slow_link = LinkEmulationConfig(mode="on", bandwidth_gb_per_s=1.0, latency_us=3000.0)
    eng = make_engine(link=slow_link)
    assert eng.link.enabled and eng.link.transfer_us(1000) == pytest.approx(3001.0)
    items, ts = sequence(12, 5)
    arrival = eng.clock()
    r = eng.serve(RecRequest(1, items[:8], items[8:], ts, arrival_s=arrival))
    lat = r.latency.to_dict()
    assert set(lat) == {"queue_us", "emb_lookup_us", "link_us", "batch_wait_us", "kv_read_us", "prefill_us",
                        "kv_write_us", "rank_us", "compute_us", "total_us"}
    assert all(v >= 0 for v in lat.values())
    assert r.link_emulated is True and r.to_dict()["link_emulated"] is True
    miss_bytes = r.emb_batch_miss_bytes
    assert miss_bytes == (r.emb_rows - r.emb_hits) * 16 * 4  # all distinct here: one row each
    assert r.latency.link_us == pytest.approx(3000.0 + miss_bytes / 1e3)
    assert r.latency.emb_lookup_us >= r.latency.link_us  # the engine really waited
    assert r.latency.compute_us == pytest.approx(r.latency.prefill_us + r.latency.rank_us)
    assert r.latency.total_us >= r.latency.emb_lookup_us + r.latency.compute_us
    assert r.kv_hit_tokens == 0 and r.recomputed_tokens == 8 and r.prefill_tokens == 12
    d = r.to_dict()
    assert d["kv"]["outcome"] == "miss" and d["kv"]["recomputed_tokens"] == 8
    # all hits: no transfer, no charge
    r2 = eng.serve(RecRequest(1, items, (), ts, candidates=r.items))
    assert r2.emb_rows == len(r.items) and r2.emb_hits == r2.emb_rows and r2.latency.link_us == 0.0
    # off: nothing charged, and responses say so
    off = make_engine(link=LinkEmulationConfig(mode="off"))
    r3 = off.serve(RecRequest(1, items[:8], items[8:], ts))
    assert r3.link_emulated is False and r3.latency.link_us == 0.0
    # auto: emulated on the CPU, not on CUDA
    assert LinkEmulationConfig().resolve(torch.device("cpu")).enabled
    assert not LinkEmulationConfig().resolve(torch.device("cuda")).enabled


def test_clock_is_injected():
    t = [100.0]

    def clock() -> float:
        t[0] += 1e-6
        return t[0]

    eng = Engine(EngineConfig(model=MODEL, num_items=NUM_ITEMS, num_pages=64, page_tokens=4,
                              link=LinkEmulationConfig(mode="off")), clock=clock)
    items, ts = sequence(6, 1)
    r = eng.serve(RecRequest(1, items, (), ts, arrival_s=99.0), now_s=100.5)
    assert r.latency.queue_us == pytest.approx(1.5e6)
    assert r.finished_s > 100.0 and r.latency.total_us == pytest.approx((r.finished_s - 99.0) * 1e6)


def test_candidates_generated_deterministically_by_popularity():
    gen = CandidateGenerator(np.array([1000.0] + [0.0] * 99), 100, seed=1)
    a = gen.sample(7, 12, 20)
    assert len(set(a.tolist())) == 20 and a.dtype == np.int64
    assert np.array_equal(a, gen.sample(7, 12, 20))
    assert not np.array_equal(a, gen.sample(8, 12, 20))
    hits = sum(int(0 in gen.sample(u, 1, 5)) for u in range(50))
    assert hits >= 45  # item 0 carries ~91% of the weight
    assert sorted(gen.sample(3, 3, 100).tolist()) == list(range(100))
    with pytest.raises(ValueError):
        gen.sample(1, 1, 101)
    eng = make_engine()
    items, ts = sequence(10, 1)
    r = eng.serve(RecRequest(4, items, (), ts, num_candidates=33, top_k=100))
    assert r.num_candidates == 33 and len(r.items) == 33  # top_k clamped to the candidates
    assert r.scores == sorted(r.scores, reverse=True)


def test_empty_history_and_no_timestamps():
    eng = make_engine()
    r = eng.serve(RecRequest(9, (), (), candidates=[1, 2, 3]))
    assert len(r.items) == 3 and r.kv_cached_after == 0
    items, _ = sequence(9, 2)
    r1 = eng.serve(RecRequest(9, items[:5], items[5:]))  # no timestamps: all time 0
    r2 = eng.serve(RecRequest(9, items, ()))
    assert r2.kv.outcome == "hit" and r2.prefill_tokens == 0
    check_against_reference(eng, r1, items, np.zeros(9), np.asarray(eng.candidates.sample(9, 9, 16)), 5)


@pytest.mark.parametrize("req, words", [
    (RecRequest(-1), "user_id must be a non-negative integer"),
    (RecRequest("u7"), "user_id must be a non-negative integer"),
    (RecRequest(1, [1, 2, NUM_ITEMS]), f"history[2] = {NUM_ITEMS} is out of range"),
    (RecRequest(1, [1], [-3]), "new_items[0] = -3 is out of range"),
    (RecRequest(1, [1.5]), "history must be a flat list of integer item ids"),
    (RecRequest(1, list(range(200)), list(range(57))), "exceeds max_history_len 256"),
    (RecRequest(1, [1, 2], timestamps=[1.0]), "timestamps must have one entry per history and new item (2)"),
    (RecRequest(1, [1], timestamps=[float("nan")]), "timestamps must be finite"),
    (RecRequest(1, [1], num_candidates=-2), "num_candidates must be a positive integer"),
    (RecRequest(1, [1], num_candidates=65), "num_candidates 65 exceeds the limit 64"),
    (RecRequest(1, [1], candidates=[]), "candidates must list at least one item id"),
    (RecRequest(1, [1], top_k=0), "top_k must be a positive integer"),
])
def test_bad_requests_are_refused_with_a_clear_message(req, words):
    eng = make_engine()
    with pytest.raises(RequestError) as e:
        eng.serve(req)
    assert words in str(e.value)
    assert eng.num_served == 0 and eng.mm.kv.stats.num_lookups == 0  # refused before any work
    # a bad request in a batch refuses the batch before anything runs
    with pytest.raises(RequestError):
        eng.serve_batch([RecRequest(1, [1, 2]), req])
    assert eng.num_served == 0


def test_config_is_validated():
    with pytest.raises(ValueError, match="qk_dim .* must equal v_dim"):
        EngineConfig(model=ModelConfig(qk_dim=16, v_dim=8))
    with pytest.raises(ValueError, match="emb_share"):
        EngineConfig(emb_share=1.5)
    with pytest.raises(ValueError, match="max_history_len"):
        EngineConfig(max_history_len=0)
    with pytest.raises(ValueError, match="mode"):
        LinkEmulationConfig(mode="maybe")
    with pytest.raises(ValueError, match="bandwidth"):
        LinkEmulationConfig(bandwidth_gb_per_s=0)


def test_from_workload_requests():
    from workloads import generate, synthetic_trace

    trace = synthetic_trace(num_users=20, num_items=NUM_ITEMS, mean_seq_len=15, seed=1)
    stream = generate(trace, regime="steady", rate_rps=50, duration_s=2, num_candidates=16, seed=1)
    eng = make_engine()
    outs = [eng.serve(RecRequest.from_workload(stream.request(i), top_k=3)) for i in range(min(40, len(stream)))]
    assert all(len(r.items) == 3 for r in outs)
    assert any(r.kv.outcome == "hit" for r in outs)  # returning users reuse their K/V
    assert all(r.kv.outcome != "mismatch" for r in outs)
    assert eng.check_invariants() == []


@pytest.mark.cuda
def test_engine_on_cuda_matches_the_cpu():
    cpu = make_engine(device="cpu")
    gpu = make_engine(device="cuda", link=LinkEmulationConfig())  # auto: real copies, not emulated
    assert gpu.device.type == "cuda" and not gpu.link.enabled
    items, ts = sequence(40, 11)
    for hist_end, n in ((20, 30), (30, 40)):
        a = cpu.serve(RecRequest(1, items[:hist_end], items[hist_end:n], ts[:n]))
        b = gpu.serve(RecRequest(1, items[:hist_end], items[hist_end:n], ts[:n]))
        assert a.kv.outcome == b.kv.outcome and a.items == b.items
        assert np.allclose(a.scores, b.scores, atol=1e-4)
        assert b.link_emulated is False and b.latency.link_us == 0.0
    assert gpu.check_invariants() == []
