"""Batched compute of a pass: `HSTUModel.prefill_batch` / `rank_batch` equal the one-request
paths; the engine's batched path equals its sequential path (answers, K/V pages, records) for
mixed batches (different lengths, users with and without cached prefixes, refreshes, mismatches,
evictions inside the batch, repeated users, several chunks); KV reuse equals full recompute in
float32 and bfloat16; the number of kernels per batch does not grow with the requests.

Tolerances (scores are O(1)-O(10) here): float32, 1e-5 absolute (the existing engine tests'
bound; the measured differences are ~1e-6). bfloat16 (8 significant bits, so one rounding of a
score of 4 moves it by up to 2^-7 ~ 0.008): |a - b| <= 0.05 + 0.02 |b| between two bfloat16
computations (batched vs one at a time, KV reuse vs full recompute; measured up to ~0.03), and
the same against float32. Top-k lists are compared as lists in float32; in bfloat16 near-ties
may swap, so scores are compared per candidate (top_k = every candidate).
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import node_agent.passes as passes_module
from node_agent.engine import Engine, EngineConfig, LinkEmulationConfig, RecRequest, resolve_compute_dtype
from node_agent.passes import plan_chunks
from node_agent.memory import RefillConfig
from node_agent.model import MASKED, HSTUModel, KVBlock, KVState, ModelConfig

# the model (qk_dim != v_dim: its batched paths do not depend on the engine's page layout) and the
# sequences of the model's own tests
from .test_model import model, seq  # noqa: F401

NUM_ITEMS = 500
MODEL = ModelConfig(embedding_dim=16, num_layers=2, num_heads=2, qk_dim=8, v_dim=8, seed=3)
F32_ATOL = 1e-5
BF16_ATOL, BF16_RTOL = 0.05, 0.02

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------- the model ---


def block(model: HSTUModel, states: list[KVState | None], lengths: list[int], start: list[int], size: int) -> KVBlock:
    """Contiguous per-request K/V as one padded `KVBlock` (pads zero)."""
    c = model.cfg
    B = len(states)
    k = torch.zeros(c.num_layers, c.num_heads, B, size, c.qk_dim)
    v = torch.zeros(c.num_layers, c.num_heads, B, size, c.v_dim)
    ts = torch.zeros(B, size, dtype=torch.float64)
    for b, (st, n) in enumerate(zip(states, lengths)):
        if st is None or n == 0:
            continue
        for li in range(c.num_layers):
            k[li, :, b, :n] = st.k[li][:n].transpose(0, 1)
            v[li, :, b, :n] = st.v[li][:n].transpose(0, 1)
        ts[b, :n] = st.timestamps[:n]
    return KVBlock(k, v, ts, torch.tensor(lengths), torch.tensor(start))


def test_prefill_and_rank_batch_equal_the_one_request_paths(model):
    # (cached, new, candidates): different lengths, with and without a cached prefix, an empty
    # history, a refresh (nothing new), a request alone in its pad rows
    shapes = [(0, 9, 5), (5, 1, 7), (17, 4, 3), (0, 0, 6), (12, 0, 2), (3, 13, 7)]
    B = len(shapes)
    pmax, nmax, cmax = (max(s[i] for s in shapes) for i in range(3))
    pasts, full_kv, outs_ref, scores_ref = [], [], [], []
    x = torch.full((B, nmax, 32), 7.0)  # pads: any finite values
    ts_new = torch.zeros(B, nmax, dtype=torch.float64)
    cand = torch.full((B, cmax, 32), -3.0)
    now = torch.zeros(B, dtype=torch.float64)
    for b, (p, n, c) in enumerate(shapes):
        rows, ts = seq(p + n, seed=b)
        cands = torch.randn(c, 32, generator=torch.Generator().manual_seed(100 + b))
        past = model(model.tokens(rows[:p]), ts[:p])[1] if p else None
        if n:
            out, new = model(model.tokens(rows[p:]), ts[p:], past=past)
            outs_ref.append(out)
            full = new if past is None else past.append(new)
        else:
            outs_ref.append(None)
            full = past
        full_kv.append(full)
        pasts.append(past)
        now[b] = (float(ts[-1]) if p + n else 0.0) + 30.0
        hist = full if full is not None else KVState([torch.zeros(0, 2, 16)] * 3, [torch.zeros(0, 2, 8)] * 3,
                                                     torch.zeros(0, dtype=torch.float64))
        scores_ref.append(model.rank(cands, hist, now_ts=float(now[b])))
        x[b, :n] = model.tokens(rows[p:])
        ts_new[b, :n] = ts[p:]
        cand[b, :c] = cands
    past_blk = block(model, pasts, [s[0] for s in shapes], [0] * B, pmax + 3)  # 3 extra pad keys
    out, new_blk = model.prefill_batch(x, ts_new, torch.tensor([s[1] for s in shapes]), past_blk)
    assert new_blk.start.tolist() == [s[0] for s in shapes]
    for b, (p, n, c) in enumerate(shapes):
        if n:
            assert torch.allclose(out[b, :n], outs_ref[b], atol=F32_ATOL)
            for li in range(3):
                assert torch.allclose(new_blk.k[li, :, b, :n].transpose(0, 1), full_kv[b].k[li][p:], atol=F32_ATOL)
                assert torch.allclose(new_blk.v[li, :, b, :n].transpose(0, 1), full_kv[b].v[li][p:], atol=F32_ATOL)
        assert not new_blk.k[:, :, b, n:].any() and not new_blk.v[:, :, b, n:].any()  # pads zeroed
    scores = model.rank_batch(cand, [past_blk, new_blk], now)
    for b, (p, n, c) in enumerate(shapes):
        assert torch.allclose(scores[b, :c], scores_ref[b], atol=F32_ATOL)
    # one block holding the whole history ranks the same (the real candidates: a pad candidate's
    # score is any value, and its rounding differs with the key layout on some CPUs)
    whole = block(model, full_kv, [p + n for p, n, _ in shapes], [0] * B, pmax + nmax)
    again = model.rank_batch(cand, [whole], now)
    for b, (_p, _n, c) in enumerate(shapes):
        assert torch.allclose(again[b, :c], scores[b, :c], atol=F32_ATOL)


def test_a_pad_key_contributes_exactly_nothing(model):
    """A pad key (K zero, bias MASKED) scores exactly MASKED, and SiLU of it is exactly 0 in every
    float type; so one request's answer is bit-for-bit the same whatever the batch pads it to."""
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.nn.functional.silu(torch.tensor([MASKED], dtype=dt)).item() == 0.0
    rows, ts = seq(20, seed=9)
    _, kv = model(model.tokens(rows[:12]), ts[:12])
    cands = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(3))
    now = torch.tensor([float(ts[11]) + 5.0], dtype=torch.float64)
    tight = model.rank_batch(cands, [block(model, [kv], [12], [0], 12)], now)
    padded = model.rank_batch(cands, [block(model, [kv], [12], [0], 40)], now)
    assert torch.equal(tight, padded)


# ------------------------------------------------------------------------------ the engine ---


def make_engine(batched: bool, num_pages: int = 256, compute_dtype: str = "float32", **kw) -> Engine:
    cfg = EngineConfig(model=MODEL, num_items=NUM_ITEMS, num_pages=num_pages, page_tokens=4, emb_share=0.5,
                       max_history_len=256, max_candidates=64, default_num_candidates=16, default_top_k=5,
                       link=LinkEmulationConfig(mode="off"), compute_dtype=compute_dtype, batched_compute=batched,
                       refill=RefillConfig(limit_bytes_per_s=1e6, window_s=0.1, chunk_bytes=1024), **kw)
    return Engine(cfg, item_popularity=np.arange(NUM_ITEMS)[::-1].astype(np.float64))


def sequence(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, NUM_ITEMS, n), 1.6e9 + np.cumsum(rng.exponential(120.0, n))


def mixed_batches() -> list[list[RecRequest]]:
    """Warm-up batches, then a mixed one: hits of different cached and new lengths, misses of
    different lengths, a refresh, a mismatch, an empty history, no timestamps, candidate lists of
    different sizes, a repeated user (a second pass)."""
    s = {u: sequence(60, 50 + u) for u in range(10)}
    cands = np.arange(100, 140)
    warm = [RecRequest(0, s[0][0][:30], (), s[0][1][:30]),
            RecRequest(1, s[1][0][:7], (), s[1][1][:7]),
            RecRequest(2, s[2][0][:45], (), s[2][1][:45]),
            RecRequest(3, s[3][0][:20], (), s[3][1][:20]),
            RecRequest(4, s[4][0][:10], (), s[4][1][:10])]
    other = s[3][0][:26].copy()
    other[2] = (other[2] + 1) % NUM_ITEMS
    batch = [RecRequest(0, s[0][0][:30], s[0][0][30:38], s[0][1][:38], candidates=cands, top_k=7),  # hit, 8 new
             RecRequest(1, s[1][0][:7], s[1][0][7:60], s[1][1][:60], num_candidates=9),  # hit, 53 new
             RecRequest(2, s[2][0][:45], (), s[2][1][:45], candidates=cands[:5], top_k=5),  # refresh
             RecRequest(3, other[:20], other[20:], s[3][1][:26]),  # mismatch: recomputed
             RecRequest(5, s[5][0][:3], s[5][0][3:5], s[5][1][:5]),  # miss, short
             RecRequest(6, s[6][0][:50], s[6][0][50:], s[6][1][:60], num_candidates=33, top_k=40),  # miss, long
             RecRequest(7, (), (), candidates=[1, 2, 3]),  # empty history
             RecRequest(8, s[8][0][:12], s[8][0][12:15]),  # no timestamps
             RecRequest(4, s[4][0][:10], s[4][0][10:11], s[4][1][:11], top_k=3),  # hit, 1 new
             RecRequest(0, s[0][0][:38], s[0][0][38:40], s[0][1][:40], candidates=cands)]  # user 0 again
    follow = [RecRequest(u, s[u][0][:40], s[u][0][40:44], s[u][1][:44], num_candidates=20) for u in (0, 1, 5, 6)]
    return [warm, batch, follow]


def assert_same(a, b, mode: str = "float32") -> None:
    """Same plan, counts and answer. ``float32``: the same top-k, scores within F32_ATOL; ``cuda``
    (float32 on another device): the same top-k, scores within 1e-4 (test_engine's CUDA bound);
    ``bfloat16``: the i-th best scores within the bfloat16 bound (a perturbation of every score by
    at most e moves the i-th best by at most e, whichever items swap on near-ties)."""
    assert (a.user_id, a.kv, a.prefill_tokens, a.kv_cached_after, a.kv_hit_tokens, a.recomputed_tokens,
            a.num_candidates, a.emb_rows, a.emb_hits, a.batch_passes) == \
           (b.user_id, b.kv, b.prefill_tokens, b.kv_cached_after, b.kv_hit_tokens, b.recomputed_tokens,
            b.num_candidates, b.emb_rows, b.emb_hits, b.batch_passes)
    if mode in ("float32", "cuda"):
        assert a.items == b.items
        assert np.allclose(a.scores, b.scores, atol=F32_ATOL if mode == "float32" else 1e-4, rtol=0)
    else:
        assert len(a.items) == len(b.items)
        close(a.scores, b.scores)


def close(a, b) -> None:
    err = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
    assert np.all(err <= BF16_ATOL + BF16_RTOL * np.abs(b)), float(err.max())


def assert_same_state(eng: Engine, ref: Engine, users, atol: float = F32_ATOL) -> None:
    assert eng.check_invariants() == [] and ref.check_invariants() == []
    for u in users:
        assert eng.mm.kv.num_tokens(u) == ref.mm.kv.num_tokens(u)
        got, want = eng.mm.kv.recorded_tokens(u), ref.mm.kv.recorded_tokens(u)
        assert (got is None) == (want is None)
        if got is not None:
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        if eng.mm.kv.num_tokens(u):
            ka, va = eng.mm.kv.read_layers(u)
            kb, vb = ref.mm.kv.read_layers(u)
            for x, y in zip(ka + va, kb + vb):
                assert torch.allclose(x.float(), y.float(), atol=atol)
    assert eng.kv_outcomes == ref.kv_outcomes and eng.paged_kv.num_uncacheable == ref.paged_kv.num_uncacheable


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_batched_equals_one_at_a_time_on_a_mixed_batch(kv_dtype):
    eng, ref = make_engine(True, kv_dtype=kv_dtype), make_engine(False, kv_dtype=kv_dtype)
    for reqs in mixed_batches():
        got, want = eng.serve_batch(reqs), ref.serve_batch(reqs)
        assert len(got) == len(reqs)
        for a, b in zip(got, want):
            assert_same(a, b)
        assert_same_state(eng, ref, range(10))
    outcomes = [r.kv.outcome for r in eng.serve_batch(mixed_batches()[1])]
    assert {"hit", "mismatch"} <= set(outcomes)


def test_batched_equals_one_at_a_time_with_evictions_inside_the_batch():
    # 12 KV pages of 4 tokens: the batch's appends evict users appended before them in the batch
    eng, ref = make_engine(True, num_pages=24), make_engine(False, num_pages=24)
    s = {u: sequence(40, 70 + u) for u in (0, 1, 2, 3, 4, 9)}
    rounds = [[RecRequest(u, s[u][0][:14], (), s[u][1][:14]) for u in range(3)],
              [RecRequest(u, s[u][0][:14], s[u][0][14:22], s[u][1][:22], num_candidates=12) for u in range(5)]
              + [RecRequest(9, s[9][0][:40], (), s[9][1][:40])],  # 10 pages: evicts nearly everyone
              [RecRequest(u, s[u][0][:22], s[u][0][22:26], s[u][1][:26]) for u in (4, 3, 9, 0)]]
    for reqs in rounds:
        for a, b in zip(eng.serve_batch(reqs), ref.serve_batch(reqs)):
            assert_same(a, b)
        assert_same_state(eng, ref, list(range(5)) + [9])
        assert sorted(eng.mm.kv.users_lru()) == sorted(ref.mm.kv.users_lru())


def test_any_split_into_chunks_gives_the_same_answers(monkeypatch):
    """Chunks of two, in a scrambled order (and a chunk of one): the answers and the pages do not
    depend on how a pass is split."""
    def scrambled(shapes, num_heads, **kw):
        order = list(range(len(shapes)))[::-1]
        return [order[i: i + 2] for i in range(0, len(order), 2)]

    ref = make_engine(False)
    eng = make_engine(True)
    monkeypatch.setattr(passes_module, "plan_chunks", scrambled)
    for reqs in mixed_batches():
        for a, b in zip(eng.serve_batch(reqs), ref.serve_batch(reqs)):
            assert_same(a, b)
        assert_same_state(eng, ref, range(10))


def test_kv_reuse_equals_full_recompute_in_float32_and_bfloat16():
    cands = np.arange(200, 260)
    users = {u: sequence(48, 90 + u) for u in range(6)}
    for dtype in ("float32", "bfloat16"):
        inc, full, f32 = make_engine(True, compute_dtype=dtype), make_engine(True, compute_dtype=dtype), \
            make_engine(True)
        assert inc.model.norm_out.weight.dtype == getattr(torch, dtype)
        # cached prefixes of different lengths, then 4..15 new tokens each, all in one batch
        inc.serve_batch([RecRequest(u, it[: 20 + 4 * u], (), t[: 20 + 4 * u]) for u, (it, t) in users.items()])
        reqs = [RecRequest(u, it[: 20 + 4 * u], it[20 + 4 * u: 24 + 5 * u], t[: 24 + 5 * u], candidates=cands,
                           top_k=len(cands)) for u, (it, t) in users.items()]
        got = inc.serve_batch(reqs)
        assert all(r.kv.outcome == "hit" and r.kv_hit_tokens == 20 + 4 * r.user_id for r in got)
        want = full.serve_batch(reqs)  # nothing cached: everything recomputed
        exact = f32.serve_batch(reqs)
        assert all(r.kv.outcome == "miss" for r in want)
        for a, b, c in zip(got, want, exact):
            sa, sb, sc = (dict(zip(r.items, r.scores)) for r in (a, b, c))
            va, vb, vc = (np.array([d[i] for i in cands.tolist()]) for d in (sa, sb, sc))
            if dtype == "float32":
                assert a.items == b.items and np.allclose(va, vb, atol=F32_ATOL, rtol=0)
            else:
                close(va, vb)  # bfloat16 KV reuse vs bfloat16 recompute
                close(va, vc)  # and vs float32
                assert np.corrcoef(va, vc)[0, 1] > 0.999


def test_bfloat16_batched_equals_one_at_a_time():
    eng, ref = make_engine(True, compute_dtype="bfloat16"), make_engine(False, compute_dtype="bfloat16")
    for reqs in mixed_batches():
        for a, b in zip(eng.serve_batch(reqs), ref.serve_batch(reqs)):
            assert_same(a, b, "bfloat16")
        assert_same_state(eng, ref, range(10), atol=0.05)


def test_compute_dtype_defaults_by_device_and_is_validated():
    assert resolve_compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_compute_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_compute_dtype("float16", torch.device("cpu")) == torch.float16
    eng = make_engine(True)
    assert eng.compute_dtype == torch.float32 and eng.describe()["compute_dtype"] == "float32"
    assert eng.describe()["batched_compute"] is True
    with pytest.raises(ValueError, match="compute_dtype"):
        EngineConfig(model=MODEL, compute_dtype="float8")
    with pytest.raises(ValueError, match="batched_compute"):
        EngineConfig(model=MODEL, batched_compute="yes")


# ------------------------------------------------------------------------------ the chunks ---


def test_plan_chunks():
    def check(chunks, n):
        assert sorted(i for ch in chunks for i in ch) == list(range(n))

    same = [(128, 8, 256)] * 16
    assert plan_chunks(same, 2) == [list(range(16))]  # one shape: one chunk, whatever the count
    # a 2048-token miss among KV hits: computed apart (padding the hits to it would cost ~8x)
    mixed = [(2048, 8, 256)] * 7 + [(0, 2056, 256)] + [(2048, 8, 256)] * 8
    chunks = plan_chunks(mixed, 2)
    check(chunks, 16)
    assert [7] in chunks and len(chunks) == 2
    # small requests share a chunk whatever their shapes (the slack)
    small = [(0, 3, 5), (17, 1, 9), (4, 20, 2), (0, 0, 16)]
    assert len(plan_chunks(small, 2)) == 1
    # the memory cap: 16 misses of 2056 tokens do not make one 2 x 16 x 2056^2 score tensor
    big = [(0, 2056, 256)] * 16
    chunks = plan_chunks(big, 2)
    check(chunks, 16)
    assert all(2 * len(ch) * 2056 * 2056 <= passes_module.CHUNK_MAX_SCORES for ch in chunks)
    assert len(chunks) == -(-16 // (passes_module.CHUNK_MAX_SCORES // (2 * 2056 * 2056)))
    assert plan_chunks([], 2) == []


# --------------------------------------------------------------------------- the kernels ---


class CountKernels(TorchDispatchMode):
    """Operators that compute (views excluded): on a GPU, one kernel launch each (about)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def kernels_per_batch(batched: bool, n: int) -> int:
    eng = make_engine(batched)
    reqs = []
    for u in range(n):
        it, t = sequence(40, 300 + u)
        reqs.append((u, it, t))
    eng.serve_batch([RecRequest(u, it[:32], (), t[:32]) for u, it, t in reqs])
    with CountKernels() as c:
        out = eng.serve_batch([RecRequest(u, it[:32], it[32:], t, num_candidates=16) for u, it, t in reqs])
    assert all(r.kv.outcome == "hit" for r in out)
    return sum(c.count.values())


def test_kernels_per_batch_do_not_grow_with_the_requests():
    seq1, seq16 = kernels_per_batch(False, 1), kernels_per_batch(False, 16)
    bat1, bat16 = kernels_per_batch(True, 1), kernels_per_batch(True, 16)
    assert seq16 > 10 * seq1  # one request after another: linear in the requests
    assert bat16 <= bat1 + 16  # a few host-to-device index tensors at most; no per-request kernel
    assert bat1 <= 1.2 * seq1  # a batch of one costs about what the sequential path does


# ------------------------------------------------------------------------------ CUDA ---


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_on_cuda_matches_the_cpu(dtype):
    cpu = make_engine(False, device="cpu")
    gpu = make_engine(True, device="cuda", compute_dtype=dtype)
    assert gpu.compute_dtype == getattr(torch, dtype)
    for reqs in mixed_batches():
        for a, b in zip(gpu.serve_batch(reqs), cpu.serve_batch(reqs)):
            assert_same(a, b, "cuda" if dtype == "float32" else dtype)
    assert gpu.check_invariants() == []
