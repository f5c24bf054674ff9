"""How the engine computes one pass of a micro-batch (each user once): `ModelPasses` on a real
device, `EmulatedPasses` on an emulated one.

A pass: the requests' KV plans (`PagedKV.plan`), one EMB lookup for the tokens to prefill and
every candidate, then the compute: incremental prefill of the tokens not cached (full prefill on
a miss), the new K/V appended to the users' pages, and the candidates ranked against the whole
history K/V (candidates attend to the history and themselves, not to each other); the top-k is
returned. `ModelPasses.batched` computes the pass's requests together, padded, in chunks
(`plan_chunks`); `ModelPasses.sequential` one request after another on contiguous `KVState`
copies (the older path). `EmulatedPasses.run` does the same bookkeeping with no model and
charges the pass's time from the cost profile (`node_agent.emulated`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from .device_io import StageTimer, make_stage_timer, sync_serving, upload, wait_until
from .model import KVBlock, KVState
from .paged_kv import KVReuse
from .rec_request import LatencyBreakdown, PreparedRequest, RecResponse

if TYPE_CHECKING:
    from .engine import Engine


# A pass's requests are computed in chunks padded to the chunk's longest (`plan_chunks`): a chunk
# takes a request while its padded work stays within CHUNK_PAD_RATIO x its real work plus
# CHUNK_SLACK (so small requests always share a chunk), and its largest score tensor within
# CHUNK_MAX_SCORES elements (heads x queries x keys: memory). CHUNK_LINEAR_KEYS: a token's
# projections cost about as much as attending to this many keys (the default model's sizes).
CHUNK_PAD_RATIO = 1.5
CHUNK_SLACK = 1 << 16
CHUNK_MAX_SCORES = 1 << 25
CHUNK_LINEAR_KEYS = 64


def plan_chunks(shapes: Sequence[tuple[int, int, int]], num_heads: int, *, pad_ratio: float = CHUNK_PAD_RATIO,
                slack: int = CHUNK_SLACK, max_scores: int = CHUNK_MAX_SCORES,
                linear_keys: int = CHUNK_LINEAR_KEYS) -> list[list[int]]:
    """Pure: split a pass's requests, ``shapes[i] = (cached, new, candidates)`` tokens, into chunks
    computed together (indices into ``shapes``; every index once).

    A request's work is ``(new + candidates) * (cached + new + linear_keys)`` (queries times keys,
    plus the projections); a chunk of ``k`` requests padded to its largest ``cached``, ``new`` and
    ``candidates`` does ``k`` times the work of that padded shape. Requests are taken by new
    tokens, then history length, longest first, and a request joins the current chunk while the
    chunk's padded work stays within ``pad_ratio`` x its real work + ``slack`` and its largest
    score tensor (``num_heads * k * max(new, candidates) * max(cached, new)``) within
    ``max_scores``; else it starts the next chunk. Requests of one shape make one chunk (up to
    the memory cap), whatever their number.
    """
    order = sorted(range(len(shapes)), key=lambda i: (-shapes[i][1], -(shapes[i][0] + shapes[i][1]), i))
    chunks: list[list[int]] = []
    cur: list[int] = []
    real = 0
    top = (0, 0, 0)
    for i in order:
        p, n, c = shapes[i]
        work = (n + c) * (p + n + linear_keys)
        tp, tn, tc = max(top[0], p), max(top[1], n), max(top[2], c)
        k = len(cur) + 1
        padded = k * (tn + tc) * (tp + tn + linear_keys)
        scores = num_heads * k * max(tn, tc) * max(tp, tn)
        if cur and (padded > pad_ratio * (real + work) + slack or scores > max_scores):
            chunks.append(cur)
            cur, real, (tp, tn, tc) = [], 0, (p, n, c)
        cur.append(i)
        real += work
        top = (tp, tn, tc)
    if cur:
        chunks.append(cur)
    return chunks


def _answer(e: Engine, p: PreparedRequest, plan: KVReuse, cands: np.ndarray, items, scores,
            lat: LatencyBreakdown, *, prefill_tokens: int, cached_after: int, emb_rows: int, emb_hits: int,
            miss_bytes: int, link_emulated: bool, batch_size: int, finished_s: float) -> RecResponse:
    """One request's answer (``items`` / ``scores``: its top-k, best first), counted in the
    engine's figures."""
    kv_hit = min(plan.reuse_tokens, p.num_history)
    e.num_served += 1
    e.kv_outcomes[plan.outcome] += 1
    return RecResponse(
        user_id=p.user, items=[int(i) for i in items], scores=[float(s) for s in scores],
        num_candidates=len(cands), num_history=p.num_history, kv=plan, kv_hit_tokens=kv_hit,
        recomputed_tokens=p.num_history - kv_hit, prefill_tokens=prefill_tokens, kv_cached_after=cached_after,
        emb_rows=emb_rows, emb_hits=int(emb_hits), emb_batch_miss_bytes=miss_bytes, latency=lat,
        link_emulated=link_emulated, batch_size=batch_size, finished_s=finished_s, device=e.device_info())


class ModelPasses:
    """The passes of an engine on a real device (its model, arena and link emulation)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        mc, dev, cdt = engine.config.model, engine.device, engine.compute_dtype
        self.empty_kv = KVState(
            [torch.zeros(0, mc.num_heads, mc.qk_dim, device=dev, dtype=cdt) for _ in range(mc.num_layers)],
            [torch.zeros(0, mc.num_heads, mc.v_dim, device=dev, dtype=cdt) for _ in range(mc.num_layers)],
            torch.zeros(0, dtype=torch.float64, device=dev))

    def run(self, preps: list[PreparedRequest], t_batch: float, batch_size: int,
            first_pass: bool = True) -> list[RecResponse]:
        """One pass: `batched` with ``EngineConfig.batched_compute``, else `sequential`."""
        serve = self.batched if self.engine.config.batched_compute else self.sequential
        return serve(preps, t_batch, batch_size, first_pass)

    def sequential(self, preps: list[PreparedRequest], t_batch: float, batch_size: int,
                   first_pass: bool = True) -> list[RecResponse]:
        """One pass computed one request after another (`HSTUModel.forward` / `rank` on
        contiguous `KVState` copies); every request gets its own stage times."""
        e = self.engine
        clock, dev, model, kvs = e.clock, e.device, e.model, e.paged_kv
        # stage marks: clock readings on the CPU, events on the serving stream on CUDA; the host
        # waits only where it needs a value (the answer's top-k), and only for the serving stream
        timer = make_stage_timer(dev, clock, e.config.stage_timing)
        us = timer.elapsed_us
        cdt = e.compute_dtype
        # 1. KV plan and reads (a copy of the reused K/V, so later appends may evict freely)
        plans: list[KVReuse] = []
        pasts: list[KVState | None] = []
        read_marks: list[tuple] = []
        cands: list[np.ndarray] = []
        for p in preps:
            m_read = timer.mark()
            plan = kvs.plan(p)
            past = kvs.read(p, plan)
            read_marks.append((m_read, timer.mark()))
            plans.append(plan)
            pasts.append(past)
            cands.append(p.candidates if p.candidates is not None
                         else e.candidates.sample(p.user, len(p.items), p.num_candidates))
        # 2. one EMB lookup for the group: tokens to prefill, then candidates, request by request
        lk, sizes, hits_per_req, link_us, m_emb, m_emb_end = self.emb_lookup(preps, plans, cands, timer)
        emb_us: float | None = None  # read once the first answer has waited for the serving stream
        read_us: list[float] = []
        rows_all = lk.rows
        # 3. per request: prefill, write K/V, rank
        out: list[RecResponse] = []
        off = 0
        for j, (p, plan, past, c) in enumerate(zip(preps, plans, pasts, cands)):
            m_start = timer.mark()
            n_new = len(p.items) - plan.reuse_tokens
            rows = rows_all[off: off + sizes[j]]
            off += sizes[j]
            new_rows, cand_rows = rows[:n_new].to(cdt), rows[n_new:].to(cdt)
            new_kv = None
            if n_new:
                ts_new = torch.from_numpy(p.ts[plan.reuse_tokens:]).to(dev)
                _, new_kv = model(model.tokens(new_rows), ts_new, past=past)
            if past is None:
                full = new_kv if new_kv is not None else self.empty_kv
            else:
                full = past if new_kv is None else past.append(new_kv)
            m_prefill = timer.mark()
            cached_after = kvs.write(p, plan, new_kv, full)
            m_write = timer.mark()
            scores = model.rank(cand_rows, full, now_ts=torch.tensor(p.now_ts, dtype=torch.float64, device=dev))
            top = torch.topk(scores, p.top_k)
            m_end = timer.mark()
            # the answer's host values: these copies wait for the serving stream (only)
            top_items = c[top.indices.cpu().numpy()].tolist()
            top_scores = top.values.cpu().tolist()
            t_end = clock()
            if emb_us is None:
                emb_us = us(m_emb, m_emb_end)
                read_us = [us(a, b) for a, b in read_marks]
            prefill_us, rank_us = us(m_start, m_prefill), us(m_write, m_end)
            arrival = p.req.arrival_s if p.req.arrival_s is not None else t_batch
            lat = LatencyBreakdown(
                queue_us=max(0.0, (t_batch - arrival) * 1e6), emb_lookup_us=emb_us, link_us=link_us,
                batch_wait_us=max(0.0, us(m_emb_end, m_start)),
                kv_read_us=read_us[j], prefill_us=prefill_us, kv_write_us=us(m_prefill, m_write),
                rank_us=rank_us, compute_us=prefill_us + rank_us, total_us=(t_end - arrival) * 1e6)
            out.append(_answer(e, p, plan, c, top_items, top_scores, lat, prefill_tokens=n_new,
                               cached_after=cached_after, emb_rows=sizes[j], emb_hits=hits_per_req[j],
                               miss_bytes=lk.bytes_transferred, link_emulated=e.link.enabled,
                               batch_size=batch_size, finished_s=t_end))
        return out

    def emb_lookup(self, preps: list[PreparedRequest], plans: list[KVReuse], cands: list[np.ndarray],
                   timer: StageTimer):
        """One EMB lookup for a pass: the tokens to prefill, then the candidates, request by request
        (with link emulation on, then the wait the link would take for the missed bytes).
        Returns (lookup, rows per request, hits per request, link µs, start mark, end mark)."""
        e = self.engine
        mm, clock = e.mm, e.clock
        parts, sizes = [], []
        for p, plan, c in zip(preps, plans, cands):
            parts += [p.items[plan.reuse_tokens:], c]
            sizes.append(len(p.items) - plan.reuse_tokens + len(c))
        host_ids = np.concatenate(parts)
        ids = torch.from_numpy(host_ids).to(e.device)
        m_emb = timer.mark()
        hits_per_req = None
        if len(preps) > 1:
            hit = (mm.emb.item_to_slot.index_select(0, ids) != mm.emb.miss_slot).to(torch.int64)
            bounds = np.cumsum([0] + sizes)
            cs = torch.cat([hit.new_zeros(1), hit.cumsum(0)]).cpu().numpy()
            hits_per_req = (cs[bounds[1:]] - cs[bounds[:-1]]).tolist()
        lk = mm.emb.lookup(ids, host_ids=host_ids)
        link_us = e.link.transfer_us(lk.bytes_transferred)
        if link_us > 0:
            sync_serving(e.device)  # the emulated transfer starts once the lookup's own work is done
            wait_until(clock, clock() + link_us * 1e-6)
            e.link_us_total += link_us
        m_emb_end = timer.mark()
        if hits_per_req is None:
            hits_per_req = [lk.num_hits]
        return lk, sizes, hits_per_req, link_us, m_emb, m_emb_end

    def batched(self, preps: list[PreparedRequest], t_batch: float, batch_size: int,
                first_pass: bool = True) -> list[RecResponse]:
        """One pass (each user once) computed in chunks of requests (`plan_chunks`): per chunk one
        gather of the cached prefixes from the pages, one `HSTUModel.prefill_batch`, one
        `HSTUModel.rank_batch` and one top-k, whatever the number of requests; the pages and
        records updated in the pass's order, then the new K/V written per chunk. Each request
        attends to its own cached prefix and its own new tokens only (the pads are masked), so
        the answers are those of `sequential` within float rounding. The stage times are the
        pass's (every request of the pass gets the same ones; ``batch_wait_us`` is ~0)."""
        e = self.engine
        clock, kvs = e.clock, e.paged_kv
        timer = make_stage_timer(e.device, clock, e.config.stage_timing)
        us = timer.elapsed_us
        # 1. KV plans (in the pass's order: lookups touch the LRU), chunks, reads
        m_read = timer.mark()
        plans = [kvs.plan(p) for p in preps]
        cands = [p.candidates if p.candidates is not None
                 else e.candidates.sample(p.user, len(p.items), p.num_candidates) for p in preps]
        reuse = [pl.reuse_tokens for pl in plans]
        n_new = [len(p.items) - r for p, r in zip(preps, reuse)]
        chunks = plan_chunks([(r, n, len(c)) for r, n, c in zip(reuse, n_new, cands)], e.config.model.num_heads)
        pasts = [kvs.read_past([preps[i] for i in ch], [reuse[i] for i in ch]) for ch in chunks]
        m_read_end = timer.mark()
        # 2. one EMB lookup for the pass
        lk, sizes, hits_per_req, link_us, m_emb, m_emb_end = self.emb_lookup(preps, plans, cands, timer)
        rows_all = lk.rows
        row0 = np.cumsum([0] + sizes[:-1])  # request j's rows: new tokens, then candidates
        # 3. prefill, chunk by chunk
        m_start = timer.mark()
        news = self._prefill_chunks(preps, chunks, pasts, reuse, n_new, rows_all, row0)
        m_prefill = timer.mark()
        # 4. pages and records in the pass's order, then the K/V of every user still holding its pages
        where = {i: (c, b) for c, ch in enumerate(chunks) for b, i in enumerate(ch)}
        cached_after = kvs.append_pass(preps, plans, where, pasts, news)
        m_write = timer.mark()
        # 5. rank and top-k, chunk by chunk
        tops = self._rank_chunks(preps, chunks, pasts, news, cands, n_new, rows_all, row0)
        m_end = timer.mark()
        # the answers' host values: these copies wait for the serving stream (only)
        host = [(top.indices.cpu().numpy(), top.values.float().cpu().numpy()) for top in tops]
        t_end = clock()
        emb_us = us(m_emb, m_emb_end)
        read_us = us(m_read, m_read_end)
        prefill_us, write_us, rank_us = us(m_start, m_prefill), us(m_prefill, m_write), us(m_write, m_end)
        wait_us = max(0.0, us(m_emb_end, m_start))
        out: list[RecResponse] = []
        for j, (p, plan, c) in enumerate(zip(preps, plans, cands)):
            ci, b = where[j]
            idx, vals = host[ci]
            top_items = c[idx[b, : p.top_k]].tolist()
            top_scores = vals[b, : p.top_k].tolist()
            arrival = p.req.arrival_s if p.req.arrival_s is not None else t_batch
            lat = LatencyBreakdown(
                queue_us=max(0.0, (t_batch - arrival) * 1e6), emb_lookup_us=emb_us, link_us=link_us,
                batch_wait_us=wait_us, kv_read_us=read_us, prefill_us=prefill_us, kv_write_us=write_us,
                rank_us=rank_us, compute_us=prefill_us + rank_us, total_us=(t_end - arrival) * 1e6)
            out.append(_answer(e, p, plan, c, top_items, top_scores, lat, prefill_tokens=n_new[j],
                               cached_after=cached_after[j], emb_rows=sizes[j], emb_hits=hits_per_req[j],
                               miss_bytes=lk.bytes_transferred, link_emulated=e.link.enabled,
                               batch_size=batch_size, finished_s=t_end))
        return out

    def _prefill_chunks(self, preps: list[PreparedRequest], chunks: list[list[int]], pasts: list[KVBlock | None],
                        reuse: list[int], n_new: list[int], rows_all: torch.Tensor,
                        row0: np.ndarray) -> list[KVBlock | None]:
        """Each chunk's new tokens prefilled in one `HSTUModel.prefill_batch` (padded to the
        chunk's most; request ``i``'s rows start at ``row0[i]`` of ``rows_all``); returns each
        chunk's new `KVBlock` (None: nothing to prefill)."""
        e = self.engine
        model, cdt, dev = e.model, e.compute_dtype, e.device
        news: list[KVBlock | None] = []
        for ch, past in zip(chunks, pasts):
            nmax = max(n_new[i] for i in ch)
            if nmax == 0:
                news.append(None)
                continue
            B = len(ch)
            t = np.arange(nmax)
            lens = np.asarray([n_new[i] for i in ch], dtype=np.int64)
            live = t[None, :] < lens[:, None]
            rows = np.where(live, row0[ch][:, None] + t[None, :], 0)  # pads: row 0 (finite; masked)
            ts = np.zeros((B, nmax), dtype=np.float64)
            for b, i in enumerate(ch):
                ts[b, : n_new[i]] = preps[i].ts[reuse[i]:]
            rows_t, lens_t = upload([rows.astype(np.int64).ravel(), lens], dev)
            (ts_t,) = upload([ts], dev)
            x = model.tokens(rows_all.index_select(0, rows_t).to(cdt)).view(B, nmax, -1)
            _, new = model.prefill_batch(x, ts_t, lens_t, past)
            news.append(new)
        return news

    def _rank_chunks(self, preps: list[PreparedRequest], chunks: list[list[int]], pasts: list[KVBlock | None],
                     news: list[KVBlock | None], cands: list[np.ndarray], n_new: list[int], rows_all: torch.Tensor,
                     row0: np.ndarray) -> list:
        """Each chunk's candidates ranked in one `HSTUModel.rank_batch` against its cached and new
        blocks (pad candidates scored -inf), then one top-k per chunk; returns the top-k results."""
        e = self.engine
        model, cdt, dev = e.model, e.compute_dtype, e.device
        tops = []
        for ch, past, new in zip(chunks, pasts, news):
            B = len(ch)
            cmax = max(len(cands[i]) for i in ch)
            t = np.arange(cmax)
            clens = np.asarray([len(cands[i]) for i in ch], dtype=np.int64)
            live = t[None, :] < clens[:, None]
            rows = np.where(live, (row0[ch] + np.asarray(n_new)[ch])[:, None] + t[None, :], 0)
            now = np.asarray([preps[i].now_ts for i in ch], dtype=np.float64)
            rows_t, pad_b, pad_c = upload([rows.astype(np.int64).ravel(), *np.nonzero(~live)], dev)
            (now_t,) = upload([now], dev)
            cand_rows = rows_all.index_select(0, rows_t).to(cdt).view(B, cmax, -1)
            scores = model.rank_batch(cand_rows, [blk for blk in (past, new) if blk is not None], now_t)
            if len(pad_b):
                scores[pad_b, pad_c] = float("-inf")
            tops.append(torch.topk(scores, max(preps[i].top_k for i in ch), dim=1))
        return tops


class EmulatedPasses:
    """The passes of an engine on an emulated device: no model, the time from the profile."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.span_start: float | None = None  # the batch's first pass's start, on the device's timeline

    def run(self, preps: list[PreparedRequest], t_batch: float, batch_size: int,
            first_pass: bool = True) -> list[RecResponse]:
        """One pass on an emulated device: the same KV plan, EMB lookup and page bookkeeping as
        `ModelPasses`, no model; the pass's time is charged from the profile (module doc of
        `node_agent.emulated`) and waited out on the engine's clock. The pass starts when it is
        called, so the bookkeeping's own CPU time counts inside the modelled duration."""
        e = self.engine
        clock, mm, emu, kvs = e.clock, e.mm, e.emu, e.paged_kv
        assert emu is not None
        # the device's own timeline: the pass starts when the device is free and its last request has
        # arrived, not when this host's thread got round to it (a late thread catches up, no wait)
        last_arrival = max((p.req.arrival_s if p.req.arrival_s is not None else t_batch) for p in preps)
        t_start = min(clock(), max(emu.free_at_s, last_arrival))
        if first_pass:
            self.span_start = t_start
        plans = [kvs.plan(p) for p in preps]
        cands = [p.candidates if p.candidates is not None
                 else e.candidates.sample(p.user, len(p.items), p.num_candidates) for p in preps]
        parts, sizes = [], []
        for p, plan, c in zip(preps, plans, cands):
            parts += [p.items[plan.reuse_tokens:], c]
            sizes.append(len(p.items) - plan.reuse_tokens + len(c))
        ids = torch.from_numpy(np.concatenate(parts))
        hit = (mm.emb.item_to_slot.index_select(0, ids) != mm.emb.miss_slot).to(torch.int64)
        bounds = np.cumsum([0] + sizes)
        cs = torch.cat([hit.new_zeros(1), hit.cumsum(0)]).numpy()
        hits_per_req = (cs[bounds[1:]] - cs[bounds[:-1]]).tolist()
        lk = mm.emb.lookup(ids)
        prof = emu.profile
        nh = [p.num_history for p in preps]
        nn = [len(p.items) - p.num_history for p in preps]
        comp = emu.compute_us([pl.reuse_tokens for pl in plans], nh, nn, [len(c) for c in cands])
        rank = np.array([len(c) * (prof.cand_us + prof.attn_us_per_ctx * len(p.items)) for p, c in zip(preps, cands)])
        fixed_us, comp_us = emu.pass_us(comp, batch_size if first_pass else 0)
        t_copy = t_start + (fixed_us + lk.num_hits * prof.emb_hit_us_per_row) * 1e-6
        c0, c1 = emu.demand_copy(t_copy, lk.num_unique_misses)
        t_end = c1 + comp_us * 1e-6
        emu.free_at_s = t_end
        e.last_batch_span = (self.span_start, t_end)
        emu.wait_until(t_end)
        emu.busy_us += (t_end - t_start) * 1e6
        emb_us = (c1 - t_start) * 1e6
        link_us = (c1 - t_copy) * 1e6
        pop = e.candidates.weights
        out: list[RecResponse] = []
        for j, (p, plan, c) in enumerate(zip(preps, plans, cands)):
            cached_after = kvs.write(p, plan, None, None)
            w = pop[c]
            top = np.argsort(-w, kind="stable")[: p.top_k]
            arrival = p.req.arrival_s if p.req.arrival_s is not None else t_batch
            own = float(comp[j])
            lat = LatencyBreakdown(
                queue_us=max(0.0, (self.span_start - arrival) * 1e6), emb_lookup_us=emb_us, link_us=link_us,
                batch_wait_us=max(0.0, (t_end - t_start) * 1e6 - emb_us - own), kv_read_us=0.0,
                prefill_us=own - float(rank[j]), kv_write_us=0.0, rank_us=float(rank[j]), compute_us=own,
                total_us=(t_end - arrival) * 1e6)
            out.append(_answer(e, p, plan, c, c[top], w[top], lat, prefill_tokens=len(p.items) - plan.reuse_tokens,
                               cached_after=cached_after, emb_rows=sizes[j], emb_hits=hits_per_req[j],
                               miss_bytes=lk.bytes_transferred, link_emulated=False, batch_size=batch_size,
                               finished_s=t_end))
        return out
