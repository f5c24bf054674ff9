"""The users' K/V in the KV pool, as the engine uses them for one request.

The pages hold only K and V; the pool records which tokens they are (item ids and timestamps,
`CachedSequence`). A cached prefix is reused only when it *is* a prefix of the request's
sequence, ids and timestamps alike (`plan_kv_reuse`, pure); otherwise the user's K/V are evicted
and the whole sequence is recomputed. `PagedKV` carries out the plans: it reads the reused
prefixes from the pages (a copy, so the pages may change afterwards), gives the new tokens pages
and records them, and writes their K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .device_io import upload
from .memory import CachedSequence, MemoryManager
from .model import KVBlock, KVState

if TYPE_CHECKING:
    from .rec_request import PreparedRequest


@dataclass(frozen=True)
class KVReuse:
    """What to do with a user's cached K/V for one request, and why.

    ``outcome``: ``hit`` (the first ``reuse_tokens`` tokens come from the pages), ``miss``
    (nothing cached), ``mismatch`` (something cached that is not a prefix of the request: it is
    evicted and the sequence recomputed). ``prefill_tokens`` are computed by the model.
    """

    outcome: str
    reuse_tokens: int
    prefill_tokens: int
    reason: str


def plan_kv_reuse(cached: CachedSequence, items: np.ndarray, ts: np.ndarray) -> KVReuse:
    """Pure: compare what the pool holds of the user's sequence (its cached tokens and their
    recorded ids and timestamps) with the request's sequence (``items``, ``ts``)."""
    n = len(items)
    c = cached.num_tokens
    if c == 0:
        why = "the user's K/V were evicted" if cached.evicted else "no K/V cached for the user"
        return KVReuse("miss", 0, n, why)
    cached_items, cached_ts = cached.items, cached.ts
    if cached_items is None:
        return KVReuse("mismatch", 0, n, f"the pool holds {c} tokens but no record of their items")
    if c > n:
        return KVReuse("mismatch", 0, n, f"{c} tokens cached but the request's sequence has only {n}")
    diff = np.flatnonzero(cached_items != items[:c])
    if diff.size:
        i = int(diff[0])
        return KVReuse("mismatch", 0, n, f"cached token {i} is item {int(cached_items[i])}, the request has "
                                         f"item {int(items[i])} there")
    tdiff = np.flatnonzero(cached_ts != ts[:c])
    if tdiff.size:
        i = int(tdiff[0])
        return KVReuse("mismatch", 0, n, f"cached token {i} has timestamp {float(cached_ts[i])!r}, the request "
                                         f"{float(ts[i])!r}")
    if c == n:
        return KVReuse("hit", c, 0, f"all {c} tokens cached: nothing to prefill")
    return KVReuse("hit", c, n - c, f"{c} cached tokens reused, {n - c} prefilled")


class PagedKV:
    """The engine's side of the KV pool, request by request: the plan (`plan`: reuse, miss, or
    mismatch and eviction), the reused prefix read from the pages (one request: `read`; a chunk
    of requests: `read_past`, one gather), and the tokens a request adds: pages and record
    (`append`), then their K/V (`write` for one request, `write_pages` for a pass). Counts the
    requests whose sequence does not fit in the pool at all (``num_uncacheable``)."""

    def __init__(self, mm: MemoryManager, compute_dtype: torch.dtype) -> None:
        self.mm = mm
        self.device = mm.arena.device
        self.compute_dtype = compute_dtype
        self.num_uncacheable = 0

    def plan(self, p: PreparedRequest) -> KVReuse:
        """The request's KV plan from what the pool holds of its user's sequence (the lookup makes
        the user most recent; a mismatch evicts it)."""
        kv = self.mm.kv
        plan = plan_kv_reuse(kv.lookup_sequence(p.user, history_tokens=p.num_history), p.items, p.ts)
        if plan.outcome == "mismatch":
            kv.evict(p.user, forget=True)
        return plan

    def read(self, p: PreparedRequest, plan: KVReuse) -> KVState | None:
        """The request's reused prefix as contiguous K/V in the compute dtype (a copy, so later
        appends may evict freely); None when nothing is reused."""
        if not plan.reuse_tokens:
            return None
        cdt = self.compute_dtype
        ks, vs = self.mm.kv.read_layers(p.user, plan.reuse_tokens)
        if ks[0].dtype != cdt:
            ks, vs = [k.to(cdt) for k in ks], [v.to(cdt) for v in vs]
        return KVState(ks, vs, torch.from_numpy(p.ts[: plan.reuse_tokens]).to(self.device))

    def read_past(self, preps: list[PreparedRequest], reuse: list[int]) -> KVBlock | None:
        """The cached prefixes of a chunk's requests (``reuse[b]`` tokens of ``preps[b]``'s user) as
        one padded `KVBlock`, read from the pages in one gather (`torch.index_select` of whole pages
        into a new buffer in the model's layout: a copy, so later appends may evict freely), then
        the pad tokens zeroed (one index_put, over the pads only). None when nothing is reused."""
        pmax = max(reuse)
        if pmax == 0:
            return None
        kv = self.mm.kv
        T = kv.page_tokens
        M = -(-pmax // T)
        B, S = len(preps), M * T
        page_idx = np.zeros((B, M), dtype=np.int64)  # pad pages: page 0, read then zeroed
        ts = np.zeros((B, S), dtype=np.float64)
        for b, (p, n) in enumerate(zip(preps, reuse)):
            if n:
                m = -(-n // T)
                page_idx[b, :m] = kv.block_table(p.user)[:m]
                ts[b, :n] = p.ts[:n]
        lengths = np.asarray(reuse, dtype=np.int64)
        pad_b, pad_s = np.nonzero(np.arange(S)[None, :] >= lengths[:, None])
        page_idx_t, lengths_t, pad_b_t, pad_s_t = upload([page_idx.ravel(), lengths, pad_b, pad_s], self.device)
        (ts_t,) = upload([ts], self.device)
        pages = self.mm.arena.kv_pages()  # [pages, layers, 2, T, h, e]
        L, _, _, H, E = pages.shape[1:]
        buf = pages.new_empty(L, 2, H, B * M, T, E)
        torch.index_select(pages.permute(1, 2, 4, 0, 3, 5), 3, page_idx_t, out=buf)
        g = buf.view(L, 2, H, B, S, E)
        if g.dtype != self.compute_dtype:
            g = g.to(self.compute_dtype)
        if len(pad_b):
            g[:, :, :, pad_b_t, pad_s_t] = 0
        return KVBlock(g[:, 0], g[:, 1], ts_t, lengths_t, torch.zeros_like(lengths_t))

    def append(self, p: PreparedRequest, plan: KVReuse) -> tuple[int, int | None]:
        """The pages and the record of the request's tokens: returns (tokens cached after, first
        token whose K/V the caller must write, or None: nothing to write). The tokens to write are
        ``[start, n)``: the new tokens (``start == plan.reuse_tokens``), or the whole sequence again
        (``start`` 0) when the user was evicted meanwhile (by another request of the batch) or
        holds something else."""
        kv = self.mm.kv
        n = len(p.items)
        if n == 0:
            return 0, None
        have = kv.num_tokens(p.user)
        if plan.reuse_tokens == n and have == n:
            return n, None  # refresh: everything already cached
        if have == plan.reuse_tokens:
            start = have
        else:
            if have:
                kv.evict(p.user, forget=True)
            start = 0
        if kv.append(p.user, n - start, p.items[start:], p.ts[start:]) is None:
            self.num_uncacheable += 1  # the user's sequence does not fit in the KV pool at all
            return 0, None
        return n, start

    def write(self, p: PreparedRequest, plan: KVReuse, new_kv: KVState | None, full: KVState | None) -> int:
        """Append the request's new tokens to the user's pages; returns the tokens cached after.
        ``full`` None: an emulated device's pages hold no K/V, only the pages and the record are kept."""
        cached_after, start = self.append(p, plan)
        if start is not None:
            kv = new_kv if start == plan.reuse_tokens else full
            if kv is not None:
                self.mm.kv.write_layers(p.user, start, list(kv.k), list(kv.v))
        return cached_after

    def append_pass(self, preps: list[PreparedRequest], plans: list[KVReuse], where: dict[int, tuple[int, int]],
                    pasts: list[KVBlock | None], news: list[KVBlock | None]) -> list[int]:
        """A batched pass's tokens: pages and records in the pass's order (an append may evict a
        user appended before it: its K/V are then not written), then the K/V of every user still
        holding its pages (`write_pages`). ``where[j]``: request ``j``'s chunk and row in it;
        ``pasts`` / ``news``: each chunk's cached and new blocks. Returns each request's tokens
        cached after."""
        cached_after, pending = [], []
        for j, (p, plan) in enumerate(zip(preps, plans)):
            n_after, start = self.append(p, plan)
            cached_after.append(n_after)
            if start is not None:
                pending.append((j, start))
        writes = []
        for j, start in pending:
            n = len(preps[j].items)
            if self.mm.kv.num_tokens(preps[j].user) == n:
                c, b = where[j]
                writes.append((preps[j].user, start, n, plans[j].reuse_tokens, pasts[c], b, news[c]))
        self.write_pages(writes)
        return cached_after

    def write_pages(self, writes: list[tuple[int, int, int, int, KVBlock | None, int, KVBlock | None]]) -> None:
        """The K/V of appended tokens into the users' pages, a block's tokens at a time (one gather
        and one index_put per block, for K and for V; no per-request kernel). ``writes``: (user,
        first token to write, tokens, tokens in the cached block, the chunk's cached block, the
        request's row in the chunk, the chunk's new block). Token ``i`` comes from the cached block
        when ``i`` is below its cached tokens (a rewrite after an eviction), else from the new one."""
        if not writes:
            return
        kv = self.mm.kv
        T = kv.page_tokens
        pages = self.mm.arena.kv_pages()
        dst = pages.permute(1, 2, 4, 0, 3, 5)  # [layers, 2, h, pages, T, e]
        # per source block: rows b, token index in the block, destination page and offset
        by_block: dict[int, tuple[KVBlock, list[np.ndarray]]] = {}
        for user, start, n, plen, past, b, new in writes:
            bt = np.asarray(kv.block_table(user), dtype=np.int64)
            pos = np.arange(start, n)
            for blk, sel, off in ((past, pos < plen, 0), (new, pos >= plen, plen)):
                if blk is None or not sel.any():
                    continue
                ps = pos[sel]
                entry = by_block.setdefault(id(blk), (blk, [[], [], [], []]))[1]
                entry[0].append(np.full(len(ps), b, dtype=np.int64))
                entry[1].append(ps - off)
                entry[2].append(bt[ps // T])
                entry[3].append(ps % T)
        for blk, cols in by_block.values():
            rb, tok, pg, off = upload([np.concatenate(c) for c in cols], self.device)
            for j, src in enumerate((blk.k, blk.v)):
                dst[:, j][:, :, pg, off] = src[:, :, rb, tok].to(pages.dtype)
