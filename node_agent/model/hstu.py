"""An HSTU-style generative recommender ("Actions Speak Louder than Words", Zhai et al., 2024).

Each token is an item the user interacted with: its embedding row (served by the EMB cache, not
held here) plus an action embedding. A stack of HSTU layers processes the sequence causally:

    X' = LayerNorm(X)
    U, V, Q, K = split(SiLU(X' W1 + b1))                 (per head: U, V of dv; Q, K of dqk)
    A[t, s] = SiLU(Q_t . K_s / sqrt(dqk) + rab_pos(t - s) + rab_time(ts_t - ts_s)) / n_t
    X  <- X + (LayerNorm(sum_s A[t, s] V_s) * U_t) W2

with ``s <= t`` (causal) and ``n_t`` the number of keys token ``t`` attends to (its own position
+ 1). Relative biases are learned per head over log-spaced buckets of position distance and of
time difference (seconds). Because attention is causal and ``n_t`` depends only on ``t``'s
position, the K and V of a past token never change: a returning user's request only computes its
new tokens against the cached K/V (`forward` with ``past``), and the result equals full
recompute. The cached state per layer is ``K [T, heads, dqk]`` and ``V [T, heads, dv]`` plus the
tokens' timestamps.

Ranking (`rank`): each of N candidates is one query token at position ``T`` (right after the
history) that attends to the history's K/V and to itself, never to other candidates (as in
M-FALCON), through every layer; its score is ``<LayerNorm(h_final), e_candidate>``.

Weights are initialised deterministically from ``seed``, or loaded from a checkpoint trained by
``racer model train`` (`node_agent.model.checkpoint`, docs/model.md); nothing is downloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from common.config import ranged
from common.config import validate as validate_fields


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the model; `validate` checks ranges."""

    # every field capped: a checkpoint's config.json comes from an upload, and a config of
    # num_position_buckets 2^27 once cost the control plane 2.1 GiB to check (2^40: a 500)
    embedding_dim: int = ranged(64, lo=1, hi=4096, integer=True, doc="item embedding / model width")
    num_layers: int = ranged(2, lo=1, hi=64, integer=True, doc="HSTU layers")
    num_heads: int = ranged(2, lo=1, hi=64, integer=True, doc="attention heads")
    qk_dim: int = ranged(32, lo=1, hi=1024, integer=True)  # per head
    v_dim: int = ranged(32, lo=1, hi=1024, integer=True)  # per head
    num_actions: int = ranged(4, lo=1, hi=1024, integer=True)
    num_position_buckets: int = ranged(32, lo=1, hi=4096, integer=True)
    num_time_buckets: int = ranged(32, lo=1, hi=4096, integer=True)
    seed: int = 0

    def validate(self) -> "ModelConfig":
        validate_fields(self)
        return self

    @property
    def kv_floats_per_token(self) -> int:
        """Floats of cached K and V per token over all layers."""
        return self.num_layers * self.num_heads * (self.qk_dim + self.v_dim)


def log_bucket(d: Tensor, num_buckets: int) -> Tensor:
    """0 for d <= 0, else 1 + floor(log2(d)), capped at num_buckets - 1 (int64)."""
    d = d.clamp(min=0).to(torch.float32)
    b = torch.where(d > 0, 1 + torch.floor(torch.log2(d.clamp(min=1))), torch.zeros_like(d))
    return b.clamp(max=num_buckets - 1).to(torch.int64)


class HSTULayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, dqk, dv = cfg.num_heads, cfg.qk_dim, cfg.v_dim
        self.h, self.dqk, self.dv = h, dqk, dv
        self.norm_in = nn.LayerNorm(cfg.embedding_dim)
        self.w1 = nn.Linear(cfg.embedding_dim, h * (2 * dv + 2 * dqk))
        self.norm_attn = nn.LayerNorm(dv)
        self.w2 = nn.Linear(h * dv, cfg.embedding_dim)
        self.pos_bias = nn.Parameter(torch.randn(h, cfg.num_position_buckets) * 0.1)
        self.time_bias = nn.Parameter(torch.randn(h, cfg.num_time_buckets) * 0.1)
        self.scale = 1.0 / math.sqrt(dqk)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [T, d] -> u [T, h, dv], v [T, h, dv], q [T, h, dqk], k [T, h, dqk]."""
        t = x.shape[0]
        y = F.silu(self.w1(self.norm_in(x)))
        u, v, q, k = torch.split(y, [self.h * self.dv, self.h * self.dv, self.h * self.dqk, self.h * self.dqk], dim=-1)
        return (u.view(t, self.h, self.dv), v.view(t, self.h, self.dv),
                q.view(t, self.h, self.dqk), k.view(t, self.h, self.dqk))

    def bias(self, q_pos: Tensor, k_pos: Tensor, q_ts: Tensor, k_ts: Tensor) -> Tensor:
        """Relative position + time bias [h, Tq, Tk]."""
        pb = log_bucket(q_pos[:, None] - k_pos[None, :], self.pos_bias.shape[1])
        tb = log_bucket(q_ts[:, None] - k_ts[None, :], self.time_bias.shape[1])
        return self.pos_bias[:, pb] + self.time_bias[:, tb]

    def output(self, x: Tensor, attn_v: Tensor, u: Tensor) -> Tensor:
        t = x.shape[0]
        return x + self.w2((self.norm_attn(attn_v) * u).reshape(t, self.h * self.dv))


class HSTUModel(nn.Module):
    """Stack of `HSTULayer`; see the module docstring for the three paths."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        gen_state = torch.random.get_rng_state()
        try:
            torch.manual_seed(cfg.seed)
            self.action_emb = nn.Embedding(cfg.num_actions, cfg.embedding_dim)
            nn.init.normal_(self.action_emb.weight, std=0.02)
            self.layers = nn.ModuleList(HSTULayer(cfg) for _ in range(cfg.num_layers))
            self.norm_out = nn.LayerNorm(cfg.embedding_dim)
        finally:
            torch.random.set_rng_state(gen_state)
        self.eval()
        for p in self.parameters():
            p.requires_grad_(False)

    def tokens(self, item_rows: Tensor, actions: Tensor | None = None) -> Tensor:
        """Input tokens: item embedding rows [T, d] plus action embeddings (action 0 if None)."""
        if actions is None:
            return item_rows + self.action_emb.weight[0]
        return item_rows + self.action_emb(actions)

    @torch.no_grad()
    def forward(self, x: Tensor, timestamps: Tensor, past: "KVState | None" = None) -> tuple[Tensor, "KVState"]:
        """Prefill tokens ``x [T, d]`` (timestamps ``[T]``) after ``past`` cached tokens.

        Returns the new tokens' outputs ``[T, d]`` and the K/V of the new tokens only (per layer),
        with their timestamps; the caller appends them to the cache. ``past=None`` is a full
        prefill from position 0. One request; `prefill_batch` computes many at once.
        """
        p = 0 if past is None else past.length
        t = x.shape[0]
        dev = x.device
        q_pos = torch.arange(p, p + t, device=dev)
        k_pos = torch.arange(0, p + t, device=dev)
        k_ts = timestamps if past is None else torch.cat([past.timestamps, timestamps])
        causal = (k_pos[None, :] <= q_pos[:, None]).to(x.dtype)  # [T, P+T]
        inv_n = (1.0 / (q_pos + 1).to(torch.float32)).to(x.dtype)  # 1 / keys attended (exact counts in bf16 too)
        # the relative-bias buckets depend on positions and times only: once for every layer
        pb, tb = self._buckets(q_pos, k_pos, timestamps, k_ts)
        new_k, new_v = [], []
        for li, layer in enumerate(self.layers):
            u, v, q, k = layer.project(x)
            keys = k if past is None else torch.cat([past.k[li], k])
            vals = v if past is None else torch.cat([past.v[li], v])
            s = torch.einsum("thd,shd->hts", q, keys) * layer.scale + (layer.pos_bias[:, pb] + layer.time_bias[:, tb])
            a = F.silu(s) * causal * inv_n[None, :, None]
            attn_v = torch.einsum("hts,shd->thd", a, vals)
            x = layer.output(x, attn_v, u)
            new_k.append(k)
            new_v.append(v)
        return x, KVState(new_k, new_v, timestamps)

    def _buckets(self, q_pos: Tensor, k_pos: Tensor, q_ts: Tensor, k_ts: Tensor) -> tuple[Tensor, Tensor]:
        """Position and time buckets ``[Tq, Tk]`` (those of `HSTULayer.bias`, shared by the layers)."""
        c = self.cfg
        return (log_bucket(q_pos[:, None] - k_pos[None, :], c.num_position_buckets),
                log_bucket(q_ts[:, None] - k_ts[None, :], c.num_time_buckets))

    @torch.no_grad()
    def rank(self, cand_rows: Tensor, history: "KVState", now_ts: float | Tensor | None = None,
             cand_actions: Tensor | None = None) -> Tensor:
        """Scores ``[N]`` of candidates (embedding rows ``[N, d]``) against a user's history K/V.
        One request; `rank_batch` ranks many at once."""
        n = cand_rows.shape[0]
        L = history.length
        dev = cand_rows.device
        if now_ts is None:
            now_ts = history.timestamps[-1] if L else torch.zeros((), device=dev)
        q_ts = torch.as_tensor(now_ts, dtype=history.timestamps.dtype if L else torch.float64, device=dev).reshape(1)
        q_pos = torch.full((1,), L, device=dev)
        k_pos = torch.arange(L, device=dev)
        inv_n = 1.0 / (L + 1)
        pb, tb = self._buckets(q_pos, k_pos, q_ts, history.timestamps)  # [1, L], once for every layer
        x = self.tokens(cand_rows, cand_actions)
        for li, layer in enumerate(self.layers):
            u, v, q, k = layer.project(x)
            s_hist = torch.einsum("nhd,shd->hns", q, history.k[li]) * layer.scale
            s_hist = s_hist + (layer.pos_bias[:, pb] + layer.time_bias[:, tb])  # [h, 1, L] broadcasts
            # self: distance 0 and time difference 0, buckets 0 and 0
            s_self = (q * k).sum(-1).T * layer.scale + (layer.pos_bias[:, :1] + layer.time_bias[:, :1])  # [h, n]
            attn_v = torch.einsum("hns,shd->nhd", F.silu(s_hist), history.v[li])
            attn_v = (attn_v + F.silu(s_self).T[:, :, None] * v) * inv_n
            x = layer.output(x, attn_v, u)
        return (self.norm_out(x) * cand_rows).sum(-1)

    # ------------------------------------------------------------------------ batched paths ---
    def bias_tables(self) -> Tensor:
        """Every layer's relative bias as one table ``[layers, h, P * T + 1]``: entry ``p * T + t``
        is ``pos_bias[:, p] + time_bias[:, t]`` (``T`` time buckets), and the last entry is
        `MASKED`, the bias of a pad key (see `KVBlock`). One gather per layer then gives the
        whole bias of a forward. Cached until a bias parameter is replaced or changed in place."""
        params = [t for layer in self.layers for t in (layer.pos_bias, layer.time_bias)]
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in params)
        cached = getattr(self, "_bias_tables", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        with torch.no_grad():
            pos = torch.stack([layer.pos_bias for layer in self.layers])  # [L, h, P]
            tim = torch.stack([layer.time_bias for layer in self.layers])  # [L, h, T]
            nl, h = pos.shape[:2]
            table = (pos[:, :, :, None] + tim[:, :, None, :]).reshape(nl, h, -1)
            table = torch.cat([table, table.new_full((nl, h, 1), MASKED)], dim=2)
        self._bias_tables = (key, table)
        return table

    def bias_index(self, q_pos: Tensor, q_ts: Tensor, blocks: "list[KVBlock]") -> Tensor:
        """Index ``[B, Tq, S1 + S2 + ...]`` into `bias_tables` for queries at positions
        ``q_pos [B, Tq]`` with times ``q_ts [B, Tq]`` (float64) against the keys of ``blocks`` in
        turn; a pad key gets the `MASKED` entry. Computed once per forward and shared by the
        layers: the buckets depend on positions and times only (those of `log_bucket`)."""
        c = self.cfg
        k_pos = torch.cat([blk.positions for blk in blocks], dim=1) if len(blocks) > 1 else blocks[0].positions
        k_ts = torch.cat([blk.ts for blk in blocks], dim=1) if len(blocks) > 1 else blocks[0].ts
        k_pad = torch.cat([blk.pads for blk in blocks], dim=1) if len(blocks) > 1 else blocks[0].pads
        pb = _bucket_f32(q_pos.to(torch.float32)[:, :, None] - k_pos.to(torch.float32)[:, None, :],
                         c.num_position_buckets)
        tb = _bucket_f32((q_ts[:, :, None] - k_ts[:, None, :]).to(torch.float32), c.num_time_buckets)
        idx = pb.mul_(c.num_time_buckets).add_(tb)  # exact in float32: below 2^24 + 1
        idx.masked_fill_(k_pad[:, None, :], c.num_position_buckets * c.num_time_buckets)
        # int32 halves the index's bytes on the CPU; CUDA gets int64, the index type every version takes
        return idx.to(torch.int32 if idx.device.type == "cpu" else torch.int64)

    @staticmethod
    def _heads_first(t: Tensor, out: Tensor | None = None) -> Tensor:
        """``[B, T, h, e]`` -> a contiguous ``[h, B, T, e]`` (into ``out`` when given)."""
        t = t.permute(2, 0, 1, 3)
        return t.contiguous() if out is None else out.copy_(t)

    @torch.no_grad()
    def prefill_batch(self, x: Tensor, timestamps: Tensor, lengths: Tensor,
                      past: "KVBlock | None" = None) -> tuple[Tensor, "KVBlock"]:
        """`forward` for ``B`` requests at once, padded.

        ``x [B, N, d]``: request ``b``'s new tokens in rows ``0 .. lengths[b] - 1``, the rest pads
        (any finite values); ``timestamps [B, N]`` (float64); ``past``: each request's cached prefix
        (`KVBlock`, ``start`` 0), or None (nothing cached). Request ``b``'s new token ``t`` sits at
        position ``past.lengths[b] + t`` and attends to its own prefix and its own new tokens up to
        itself: to ``past`` through the bias (pads get `MASKED`), to the new tokens through a
        causal mask. Returns the outputs ``[B, N, d]`` (pad rows meaningless) and the new tokens'
        K/V as a `KVBlock` starting after ``past``, pads zeroed. The number of kernels does not
        depend on ``B``.
        """
        B, N, _ = x.shape
        dev, dt = x.device, x.dtype
        h = self.cfg.num_heads
        if past is not None and past.size == 0:
            past = None
        start = past.lengths if past is not None else torch.zeros(B, dtype=torch.int64, device=dev)
        nl = len(self.layers)
        new = KVBlock(x.new_empty(nl, h, B, N, self.cfg.qk_dim), x.new_empty(nl, h, B, N, self.cfg.v_dim),
                      timestamps, lengths, start)
        q_pos = new.positions  # [B, N]
        ar = torch.arange(N, device=dev)
        causal = ((ar[:, None] >= ar[None, :])[None] & ~new.pads[:, None, :]).to(dt)  # [B, N, N]: keys up to the query
        inv_n = (1.0 / (q_pos + 1).to(torch.float32)).to(dt)[None, :, :, None]  # [1, B, N, 1]
        tables = self.bias_tables()
        P = past.size if past is not None else 0
        idx = self.bias_index(q_pos, timestamps, [past, new] if past is not None else [new])  # [B, N, P + N]
        for li, layer in enumerate(self.layers):
            u, v, q, k = layer.project(x.reshape(B * N, -1))
            u, v, q, k = (t.view(B, N, h, -1) for t in (u, v, q, k))
            qh = self._heads_first(q).view(h * B, N, -1)
            kh = self._heads_first(k, new.k[li]).view(h * B, N, -1)
            vh = self._heads_first(v, new.v[li]).view(h * B, N, -1)
            bias = tables[li][:, idx].flatten(0, 1)  # [h * B, N, P + N]
            acc = None
            if past is not None:
                s = torch.baddbmm(bias[:, :, :P], qh, past.k[li].view(h * B, P, -1).transpose(1, 2), alpha=layer.scale)
                acc = torch.bmm(F.silu(s, inplace=True), past.v[li].view(h * B, P, -1))
            s = torch.baddbmm(bias[:, :, P:], qh, kh.transpose(1, 2), alpha=layer.scale)
            a = F.silu(s, inplace=True).view(h, B, N, N).mul_(causal).view(h * B, N, N)
            acc = torch.bmm(a, vh) if acc is None else torch.baddbmm(acc, a, vh)
            attn_v = (acc.view(h, B, N, -1) * inv_n).permute(1, 2, 0, 3)  # [B, N, h, dv]
            x = x + layer.w2((layer.norm_attn(attn_v) * u).reshape(B, N, -1))
        pad = new.pads[None, None, :, :, None]
        new.k.masked_fill_(pad, 0)
        new.v.masked_fill_(pad, 0)
        return x, new

    @torch.no_grad()
    def rank_batch(self, cand_rows: Tensor, history: "list[KVBlock]", now_ts: Tensor,
                   cand_actions: Tensor | None = None) -> Tensor:
        """`rank` for ``B`` requests at once: scores ``[B, C]`` of candidates ``cand_rows [B, C, d]``
        (pads: any finite rows, their scores meaningless).

        Request ``b``'s history is the concatenation of its part of each block of ``history``
        (e.g. the cached prefix and the new tokens; empty blocks allowed), ``L_b`` tokens; its
        candidates are query tokens at position ``L_b`` at time ``now_ts[b]`` (float64 ``[B]``)
        that attend to its history and to themselves, never to each other.
        """
        B, C, _ = cand_rows.shape
        dev, dt = cand_rows.device, cand_rows.dtype
        h = self.cfg.num_heads
        blocks = [blk for blk in history if blk.size]
        hist_len = torch.zeros(B, dtype=torch.int64, device=dev)
        for blk in history:
            hist_len = hist_len + blk.lengths
        inv_n = (1.0 / (hist_len + 1).to(torch.float32)).to(dt)[:, None, None, None]  # [B, 1, 1, 1]
        tables = self.bias_tables()
        sizes = [blk.size for blk in blocks]
        # the candidates share a position (L_b) and a time per request: one bias row [B, 1, S]
        idx = self.bias_index(hist_len[:, None], now_ts.to(torch.float64).reshape(B, 1), blocks) if blocks else None
        x = self.tokens(cand_rows.reshape(B * C, -1), None if cand_actions is None else cand_actions.reshape(-1))
        for li, layer in enumerate(self.layers):
            u, v, q, k = layer.project(x)
            u, v, q, k = (t.view(B, C, h, -1) for t in (u, v, q, k))
            table = tables[li]
            acc = None
            if blocks:
                qh = self._heads_first(q).view(h * B, C, -1).mul_(layer.scale)
                bias = table[:, idx].flatten(0, 1)  # [h * B, 1, S1 + S2 + ...]
                off = 0
                for blk, S in zip(blocks, sizes):
                    # the bias row is shared by the candidates: added in place (a baddbmm would first
                    # copy it out to every candidate's row)
                    s = torch.bmm(qh, blk.k[li].view(h * B, S, -1).transpose(1, 2)).add_(bias[:, :, off: off + S])
                    a = F.silu(s, inplace=True)
                    vv = blk.v[li].view(h * B, S, -1)
                    acc = torch.bmm(a, vv) if acc is None else torch.baddbmm(acc, a, vv)
                    off += S
            # self: distance 0 and time difference 0, table entry 0
            s_self = (q * k).sum(-1) * layer.scale + table[:, 0]  # [B, C, h]
            attn_v = F.silu(s_self)[..., None] * v  # [B, C, h, dv]
            if acc is not None:
                attn_v = attn_v + acc.view(h, B, C, -1).permute(1, 2, 0, 3)
            attn_v = attn_v * inv_n
            x = layer.output(x, attn_v.reshape(B * C, h, -1), u.reshape(B * C, h, -1))
        return (self.norm_out(x).view(B, C, -1) * cand_rows).sum(-1)


def _bucket_f32(d: Tensor, num_buckets: int) -> Tensor:
    """`log_bucket` of a float32 ``d`` as float32 buckets, in place (``d`` is consumed)."""
    pos = d > 0
    return d.clamp_(min=1).log2_().floor_().add_(pos).clamp_(max=num_buckets - 1)


MASKED = -30000.0
"""The bias of a pad key. A pad key's K is zero (`KVBlock`), so its score is exactly this value, and
SiLU of it is exactly 0 (``exp(30000)`` overflows in every float type, fp16's range included):
pads contribute nothing, with no mask multiplication."""


@dataclass
class KVBlock:
    """K/V of ``B`` token sequences, padded to ``S`` tokens (the batched paths' layout).

    ``k [layers, h, B, S, dqk]`` and ``v [layers, h, B, S, dv]`` (each layer's ``[h, B, S, e]``
    contiguous, so a layer is one batched matmul operand ``[h * B, S, e]``); ``ts [B, S]`` float64
    token times; ``lengths [B]`` (int64): sequence ``b``'s tokens are ``0 .. lengths[b] - 1``,
    the rest are pads, whose K and V must be zero (finite would do for V; K zero makes a pad's
    score exactly `MASKED`); ``start [B]`` (int64): the position of token 0 (0 for a cached
    prefix; the prefix length for new tokens).
    """

    k: Tensor
    v: Tensor
    ts: Tensor
    lengths: Tensor
    start: Tensor

    @property
    def size(self) -> int:
        """Padded length ``S``."""
        return int(self.k.shape[3])

    @cached_property
    def positions(self) -> Tensor:
        """``[B, S]`` int64: each token's position in its sequence."""
        return self.start[:, None] + torch.arange(self.size, device=self.start.device)

    @cached_property
    def pads(self) -> Tensor:
        """``[B, S]`` bool: True for a pad."""
        return torch.arange(self.size, device=self.lengths.device)[None, :] >= self.lengths[:, None]


@dataclass
class KVState:
    """Contiguous per-layer K ``[T, h, dqk]`` and V ``[T, h, dv]`` with token timestamps ``[T]``."""

    k: list[Tensor]
    v: list[Tensor]
    timestamps: Tensor

    @property
    def length(self) -> int:
        return int(self.timestamps.shape[0])

    def append(self, other: "KVState") -> "KVState":
        return KVState([torch.cat([a, b]) for a, b in zip(self.k, other.k)],
                       [torch.cat([a, b]) for a, b in zip(self.v, other.v)],
                       torch.cat([self.timestamps, other.timestamps]))

    def prefix(self, n: int) -> "KVState":
        return KVState([a[:n] for a in self.k], [b[:n] for b in self.v], self.timestamps[:n])
