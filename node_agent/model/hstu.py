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
        prefill from position 0.
        """
        p = 0 if past is None else past.length
        t = x.shape[0]
        dev = x.device
        q_pos = torch.arange(p, p + t, device=dev)
        k_pos = torch.arange(0, p + t, device=dev)
        k_ts = timestamps if past is None else torch.cat([past.timestamps, timestamps])
        causal = (k_pos[None, :] <= q_pos[:, None]).to(x.dtype)  # [T, P+T]
        inv_n = 1.0 / (q_pos + 1).to(x.dtype)  # 1 / number of keys attended
        new_k, new_v = [], []
        for li, layer in enumerate(self.layers):
            u, v, q, k = layer.project(x)
            keys = k if past is None else torch.cat([past.k[li], k])
            vals = v if past is None else torch.cat([past.v[li], v])
            s = torch.einsum("thd,shd->hts", q, keys) * layer.scale + layer.bias(q_pos, k_pos, timestamps, k_ts)
            a = F.silu(s) * causal * inv_n[None, :, None]
            attn_v = torch.einsum("hts,shd->thd", a, vals)
            x = layer.output(x, attn_v, u)
            new_k.append(k)
            new_v.append(v)
        return x, KVState(new_k, new_v, timestamps)

    @torch.no_grad()
    def rank(self, cand_rows: Tensor, history: "KVState", now_ts: float | Tensor | None = None,
             cand_actions: Tensor | None = None) -> Tensor:
        """Scores ``[N]`` of candidates (embedding rows ``[N, d]``) against a user's history K/V."""
        n = cand_rows.shape[0]
        L = history.length
        dev = cand_rows.device
        if now_ts is None:
            now_ts = history.timestamps[-1] if L else torch.zeros((), device=dev)
        q_ts = torch.as_tensor(now_ts, dtype=history.timestamps.dtype if L else torch.float64, device=dev).reshape(1)
        q_pos = torch.full((1,), L, device=dev)
        k_pos = torch.arange(L, device=dev)
        inv_n = 1.0 / (L + 1)
        x = self.tokens(cand_rows, cand_actions)
        for li, layer in enumerate(self.layers):
            u, v, q, k = layer.project(x)
            s_hist = torch.einsum("nhd,shd->hns", q, history.k[li]) * layer.scale
            s_hist = s_hist + layer.bias(q_pos, k_pos, q_ts, history.timestamps)  # [h, 1, L] broadcasts
            s_self = (q * k).sum(-1).T * layer.scale + layer.bias(q_pos, q_pos, q_ts, q_ts)[:, 0]  # [h, n]
            attn_v = torch.einsum("hns,shd->nhd", F.silu(s_hist), history.v[li])
            attn_v = (attn_v + F.silu(s_self).T[:, :, None] * v) * inv_n
            x = layer.output(x, attn_v, u)
        return (self.norm_out(x) * cand_rows).sum(-1)


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
