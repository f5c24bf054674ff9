"""Training the HSTU model for next-item prediction (``racer model train``).

Protocol (SASRec's, Kang & McAuley 2018, also HSTU's): each user's time-ordered sequence is split
leave-one-out: the last item is the test target, the one before it the validation target, the
rest is training. Users with fewer than 3 items train only. Training sequences are cut to their
last ``max_seq_len`` items.

What is trained is exactly what the node serves: the item table (the EMB cache's rows) and the
`HSTUModel`'s weights. The loss scores a candidate item the way `HSTUModel.rank` does: the
candidate is one query token placed right after the history, attending to the history's K/V and
to itself through every layer, scored by ``<LayerNorm(h), e_candidate>``. `candidate_scores`
does this for every position of a batch of sequences at once (the history of slot ``t`` is items
``0..t``; the target is item ``t + 1``); a test proves it equals `HSTUModel.rank`. Loss: sampled
softmax over the positive and ``num_negatives`` negatives drawn uniformly from the items (the
same negatives for the whole batch), or, with ``negatives="in-batch"``, the batch's other
positives. Early stopping: NDCG@10 against 100 sampled negatives on the validation targets
(`node_agent.model.eval`), evaluated through the serving path; the best epoch's weights are kept.

Timestamps: requests to a node carry none by default (the replayer sends none), so by default the
model trains without them (every time difference 0: the time bias is one constant per head), as
it will be served. ``use_timestamps=True`` trains with the trace's times.

Resumable: after every epoch ``train_state.pt`` (weights, optimiser, RNG, history) is written to
the output directory; a run that finds one for the same trace and config resumes from it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from common.config import ranged, validate

from .checkpoint import item_keys_digest, save_checkpoint
from .hstu import HSTUModel, ModelConfig, log_bucket

NEGATIVES = ("uniform", "in-batch")
STATE_FILE = "train_state.pt"


@dataclass(frozen=True)
class TrainConfig:
    """One training run (ranges checked in ``__post_init__``)."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(embedding_dim=32, num_layers=2, num_heads=2,
                                                                   qk_dim=16, v_dim=16))
    max_seq_len: int = ranged(50, lo=1, integer=True, doc="training histories cut to their last N items")
    batch_size: int = ranged(32, lo=1, integer=True, doc="sequences per step")
    max_epochs: int = ranged(60, lo=1, integer=True, doc="most epochs")
    patience: int = ranged(5, lo=1, integer=True, doc="stop after this many epochs without a better validation NDCG@10")
    lr: float = ranged(3e-3, lo=0, lo_open=True, doc="AdamW learning rate")
    weight_decay: float = ranged(0.0, lo=0, hi=1, hi_open=True, doc="AdamW weight decay")
    dropout: float = ranged(0.2, lo=0, hi=1, hi_open=True, doc="dropout on input tokens while training")
    num_negatives: int = ranged(32, lo=1, integer=True, doc="negatives per step")
    positions_per_seq: int = ranged(8, lo=1, integer=True, doc="target positions per sequence per epoch, drawn afresh")
    negatives: str = ranged("uniform", choices=NEGATIVES, doc="sampled-softmax negatives: uniform over items, or "
                                                             "the batch's other targets")
    use_timestamps: bool = False
    item_features: bool = True  # train item rows as id + category + popularity-bucket rows (see Trainable)
    max_minutes: float | None = ranged(None, lo=0, lo_open=True, optional=True,
                                       doc="stop after this long; the best epoch so far is kept")
    item_dtype: str = ranged("float32", choices=("float32", "float16"),
                             doc="how the checkpoint stores the item table (float16 halves the file)")
    seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        self.model.validate()
        validate(self)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# ------------------------------------------------------------------------------------ split ---


@dataclass(frozen=True)
class Split:
    """Leave-one-out split of a trace: per user the training items, the validation and test
    targets (-1 for users with fewer than 3 items), and the timestamps beside them."""

    train: list[np.ndarray]  # int64 item ids, oldest first (all but the last two items)
    train_ts: list[np.ndarray]
    valid: np.ndarray  # int64 [num_users], -1: none
    test: np.ndarray  # int64 [num_users], -1: none
    valid_ts: np.ndarray
    test_ts: np.ndarray
    num_items: int

    def eval_users(self) -> np.ndarray:
        return np.flatnonzero(self.test >= 0)

    def popularity(self, split: str) -> np.ndarray:
        """Interaction counts of what a model may see when predicting ``split``'s targets:
        the training items, plus the validation targets when predicting the test targets."""
        counts = np.bincount(np.concatenate(self.train) if self.train else np.zeros(0, np.int64),
                             minlength=self.num_items).astype(np.float64)
        if split == "test":
            v = self.valid[self.valid >= 0]
            counts += np.bincount(v, minlength=self.num_items)
        return counts

    def history(self, user: int, split: str) -> tuple[np.ndarray, np.ndarray]:
        """The items (and timestamps) before ``split``'s target of ``user``."""
        if split == "valid":
            return self.train[user], self.train_ts[user]
        return (np.append(self.train[user], self.valid[user]),
                np.append(self.train_ts[user], self.valid_ts[user]))


def leave_one_out(trace) -> Split:
    train, train_ts = [], []
    n = trace.num_users
    valid = np.full(n, -1, dtype=np.int64)
    test = np.full(n, -1, dtype=np.int64)
    valid_ts = np.zeros(n)
    test_ts = np.zeros(n)
    for u in range(n):
        lo, hi = int(trace.offsets[u]), int(trace.offsets[u + 1])
        items = trace.items[lo:hi].astype(np.int64)
        ts = trace.timestamps_s[lo:hi].astype(np.float64)
        if len(items) < 3:
            train.append(items)
            train_ts.append(ts)
            continue
        train.append(items[:-2])
        train_ts.append(ts[:-2])
        valid[u], test[u] = items[-2], items[-1]
        valid_ts[u], test_ts[u] = ts[-2], ts[-1]
    return Split(train, train_ts, valid, test, valid_ts, test_ts, trace.num_items)


# ----------------------------------------------------------------------- batched model paths ---


def _project(layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`HSTULayer.project` over any leading shape: x [..., d] -> u, v [..., h, dv], q, k [..., h, dqk]."""
    lead = x.shape[:-1]
    u, v, q, k = layer.project(x.reshape(-1, x.shape[-1]))
    return (u.view(*lead, layer.h, layer.dv), v.view(*lead, layer.h, layer.dv),
            q.view(*lead, layer.h, layer.dqk), k.view(*lead, layer.h, layer.dqk))


def _output(layer, x: Tensor, attn_v: Tensor, u: Tensor) -> Tensor:
    lead = x.shape[:-1]
    d = x.shape[-1]
    return layer.output(x.reshape(-1, d), attn_v.reshape(-1, layer.h, layer.dv),
                        u.reshape(-1, layer.h, layer.dv)).view(*lead, d)


def _time_bucket(layer, dt: Tensor) -> Tensor:
    """Time bias for differences ``dt [...]`` -> ``[h, ...]``."""
    return layer.time_bias[:, log_bucket(dt, layer.time_bias.shape[1])]


def causal_forward(model: HSTUModel, x: Tensor, ts: Tensor | None = None) -> list[tuple[Tensor, Tensor]]:
    """`HSTUModel.forward` (full prefill) for a batch ``x [B, T, d]`` of right-padded sequences
    (padding only ever follows a sequence's items, and attention is causal, so it changes
    nothing before it); ``ts [B, T]`` or None (every time 0). Returns per layer (K [B, T, h, dqk],
    V [B, T, h, dv]). With grad (training)."""
    B, T, _ = x.shape
    dev = x.device
    pos = torch.arange(T, device=dev)
    causal = (pos[None, :] <= pos[:, None]).to(x.dtype)  # [T, S]
    inv_n = 1.0 / (pos + 1).to(x.dtype)
    kvs = []
    for layer in model.layers:
        u, v, q, k = _project(layer, x)
        pb = layer.pos_bias[:, log_bucket(pos[:, None] - pos[None, :], layer.pos_bias.shape[1])]  # [h, T, S]
        if ts is None:
            bias = (pb + layer.time_bias[:, :1, None])[None]  # [1, h, T, S]
        else:
            bias = pb[None] + _time_bucket(layer, ts[:, :, None] - ts[:, None, :]).permute(1, 0, 2, 3)
        s = torch.einsum("bthd,bshd->bhts", q, k) * layer.scale + bias
        a = F.silu(s) * causal * inv_n[None, None, :, None]
        attn_v = torch.einsum("bhts,bshd->bthd", a, v)
        x = _output(layer, x, attn_v, u)
        kvs.append((k, v))
    return kvs


def candidate_scores(model: HSTUModel, kvs: list[tuple[Tensor, Tensor]], cand_rows: Tensor, slots: Tensor,
                     ts: Tensor | None = None, cand_ts: Tensor | None = None) -> Tensor:
    """`HSTUModel.rank` for many histories at once.

    Slot ``t`` of sequence ``b`` is the history ``items[b, 0..t]`` (its K/V from `causal_forward`).
    ``slots [B, P]`` picks P slots per sequence; their candidates ``cand_rows [B, P, K, d]``
    (embedding rows) are query tokens at position ``t + 1`` that attend to keys ``0..t`` and to
    themselves, never to each other. ``cand_ts [B, P]``: the query time of each slot (with ``ts``;
    None: every time 0). Returns scores ``[B, P, K]``."""
    S = kvs[0][0].shape[1]
    dev = cand_rows.device
    pos = torch.arange(S, device=dev)
    q_pos = slots + 1  # [B, P]
    mask = (pos[None, None, :] <= slots[:, :, None]).to(cand_rows.dtype)[:, :, None, None, :]  # [B, P, 1, 1, S]
    inv_n = (1.0 / (q_pos + 1).to(cand_rows.dtype))[:, :, None, None, None]
    x = model.tokens(cand_rows)
    for layer, (hk, hv) in zip(model.layers, kvs):
        u, v, q, k = _project(layer, x)  # [B, P, K, h, *]
        pb = layer.pos_bias[:, log_bucket(q_pos[:, :, None] - pos[None, None, :], layer.pos_bias.shape[1])]
        if ts is None:
            bias = pb + layer.time_bias[:, :1, None, None]  # [h, B, P, S]
        else:
            bias = pb + _time_bucket(layer, cand_ts[:, :, None] - ts[:, None, :])
        bias = bias.permute(1, 2, 0, 3)[:, :, None]  # [B, P, 1, h, S]
        self_bias = layer.pos_bias[:, 0] + layer.time_bias[:, 0]  # [h]: distance 0, time difference 0
        s_hist = torch.einsum("bpkhd,bshd->bpkhs", q, hk) * layer.scale + bias
        a = F.silu(s_hist) * mask
        attn_v = torch.einsum("bpkhs,bshd->bpkhd", a, hv)
        s_self = (q * k).sum(-1) * layer.scale + self_bias  # [B, P, K, h]
        attn_v = (attn_v + F.silu(s_self)[..., None] * v) * inv_n
        x = _output(layer, x, attn_v, u)
    return (model.norm_out(x) * cand_rows).sum(-1)


# --------------------------------------------------------------------------------- training ---


class Trainable(nn.Module):
    """The item table and the model, trained together.

    The item table is trained as a sum of three rows per item: its own row, its category's row
    (when the trace knows categories) and its popularity bucket's row (``floor(log2(1 + count))``
    of its training interactions). Rare items, most of a real trace, then start from what their
    category and popularity say instead of noise. The checkpoint stores the sum (`table`): what
    a node serves is one row per item, as ever."""

    NUM_POP_BUCKETS = 20

    def __init__(self, cfg: ModelConfig, num_items: int, *, item_category: np.ndarray | None = None,
                 item_counts: np.ndarray | None = None, init_std: float | None = None, out_scale: float = 0.1):
        super().__init__()
        self.model = HSTUModel(cfg)
        self.model.train()
        for p in self.model.parameters():
            p.requires_grad_(True)
        d = cfg.embedding_dim
        std = init_std or 1.0 / math.sqrt(d)
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.item_emb = nn.Parameter(torch.randn(num_items, d, generator=gen) * std)
        cats = np.full(num_items, -1, dtype=np.int64) if item_category is None else np.asarray(item_category, np.int64)
        num_cats = int(cats.max()) + 1 if len(cats) and cats.max() >= 0 else 0
        self.register_buffer("item_cat", torch.from_numpy(np.where(cats >= 0, cats, num_cats)), persistent=False)
        self.cat_emb = nn.Parameter(torch.randn(num_cats + 1, d, generator=gen) * std)
        counts = np.zeros(num_items) if item_counts is None else np.asarray(item_counts, np.float64)
        buckets = np.minimum(np.floor(np.log2(1.0 + counts)), self.NUM_POP_BUCKETS - 1).astype(np.int64)
        self.register_buffer("item_pop", torch.from_numpy(buckets), persistent=False)
        self.pop_emb = nn.Parameter(torch.randn(self.NUM_POP_BUCKETS, d, generator=gen) * std)
        # the layers' output projections start small, so at first a candidate's token is mostly its
        # own item row and the layers grow in (as GPT-2's scaled residual initialisation)
        with torch.no_grad():
            for layer in self.model.layers:
                layer.w2.weight.mul_(out_scale)
                layer.w2.bias.zero_()

    def table(self) -> Tensor:
        """The item table ``[num_items, d]`` the node serves."""
        return self.item_emb + self.cat_emb[self.item_cat] + self.pop_emb[self.item_pop]

    def frozen_model(self) -> HSTUModel:
        """A frozen copy of the model for the serving path (eval, no grad)."""
        m = HSTUModel(self.model.cfg)
        m.load_state_dict(self.model.state_dict())
        return m


def _batches(split: Split, users: np.ndarray, max_len: int, batch_size: int, rng: np.random.Generator):
    """Shuffled batches of (items [B, T], ts [B, T], lengths [B]) with T <= max_len + 1: the last
    ``max_len + 1`` training items of each user (``max_len`` history slots, each predicting the next)."""
    order = rng.permutation(users)
    for i in range(0, len(order), batch_size):
        us = order[i: i + batch_size]
        seqs = [split.train[u][-(max_len + 1):] for u in us]
        tss = [split.train_ts[u][-(max_len + 1):] for u in us]
        T = max(len(s) for s in seqs)
        items = np.zeros((len(us), T), dtype=np.int64)
        ts = np.zeros((len(us), T), dtype=np.float64)
        lens = np.array([len(s) for s in seqs], dtype=np.int64)
        for j, (s, t) in enumerate(zip(seqs, tss)):
            items[j, : len(s)] = s
            ts[j, : len(s)] = t
        yield items, ts, lens


def sample_slots(lens: np.ndarray, per_seq: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``per_seq`` distinct slots per sequence among those with a target (slot t < len - 1),
    padded with slot 0 and a False mask: (slots [B, P], mask [B, P])."""
    P = int(min(per_seq, max(int(lens.max()) - 1, 1)))
    slots = np.zeros((len(lens), P), dtype=np.int64)
    ok = np.zeros((len(lens), P), dtype=bool)
    for j, n in enumerate(lens.tolist()):
        m = n - 1
        pick = np.sort(rng.choice(m, size=min(P, m), replace=False)) if m > P else np.arange(m)
        slots[j, : len(pick)] = pick
        ok[j, : len(pick)] = True
    return slots, ok


def batch_loss(net: Trainable, items: Tensor, ts: Tensor | None, slots: Tensor, ok: Tensor, cfg: TrainConfig,
               gen: torch.Generator) -> tuple[Tensor, int]:
    """Sampled-softmax loss of a batch at the chosen slots; returns (mean loss, number of targets)."""
    B = items.shape[0]
    dev = items.device
    table = net.table()
    rows = table[items]
    x = net.model.tokens(rows)
    if cfg.dropout > 0:
        x = F.dropout(x, cfg.dropout, training=True)
    kvs = causal_forward(net.model, x, ts)
    target = items.gather(1, slots + 1)  # [B, P]
    P = slots.shape[1]
    num_items = table.shape[0]
    if cfg.negatives == "uniform":
        neg = torch.randint(0, num_items, (cfg.num_negatives,), generator=gen).to(dev)
    else:  # in-batch: the batch's other targets (up to num_negatives of them)
        neg = target[ok]
        if len(neg) > cfg.num_negatives:
            neg = neg[torch.randperm(len(neg), generator=gen)[: cfg.num_negatives].to(dev)]
    cand = torch.cat([target[..., None], neg.expand(B, P, -1)], dim=-1)  # [B, P, 1 + N]
    scores = candidate_scores(net.model, kvs, table[cand], slots, ts,
                              None if ts is None else ts.gather(1, slots + 1))
    same = cand[..., 1:] == cand[..., :1]  # a negative equal to the positive is not a negative
    scores = torch.cat([scores[..., :1], scores[..., 1:].masked_fill(same, float("-inf"))], dim=-1)
    n = int(ok.sum())
    loss = F.cross_entropy(scores[ok], torch.zeros(n, dtype=torch.long, device=dev))
    return loss, n


def trace_digest(trace) -> str:
    """Identity of a trace's content as training sees it (dense ids, order, times)."""
    h = hashlib.sha256()
    h.update(item_keys_digest(trace.item_keys).encode())
    h.update(np.ascontiguousarray(trace.offsets, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(trace.items, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(trace.timestamps_s, dtype=np.float64).tobytes())
    return h.hexdigest()


def _config_dict(cfg: TrainConfig) -> dict:
    d = asdict(cfg)
    return d


def _run_key(cfg: TrainConfig, tdigest: str) -> str:
    d = _config_dict(cfg)
    for k in ("max_epochs", "max_minutes", "device", "item_dtype", "patience"):
        d.pop(k)  # may change between a run and its resumption
    return hashlib.sha256(json.dumps([d, tdigest], sort_keys=True).encode()).hexdigest()


@dataclass
class TrainResult:
    out_dir: str
    manifest: dict
    history: list[dict]
    best_epoch: int
    stopped: str  # why training stopped
    resumed_from_epoch: int
    seconds: float


def _load_state(state_path: Path, key: str, net: Trainable, opt: torch.optim.Optimizer, rng: np.random.Generator,
                gen: torch.Generator, say: Callable[[str], None]) -> tuple[list[dict], dict, int] | None:
    """Resume from ``state_path`` when it was written by this run (``key``): the network, the
    optimiser and both random generators are loaded in place; returns (history, best epoch so
    far, the epoch to start from). None without a state to resume: none, a torn file or another
    run's (said through ``say``)."""
    if not state_path.exists():
        return None
    try:
        st = torch.load(state_path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a torn or foreign file: start afresh, say so
        say(f"{state_path} does not load ({type(e).__name__}): starting afresh")
        st = {}
    if st.get("key") == key:
        net.load_state_dict(st["net"])
        opt.load_state_dict(st["opt"])
        rng.bit_generator.state = st["rng"]
        gen.set_state(st["gen"])
        best = st["best"]
        say(f"resuming after epoch {st['epoch'] + 1} (best so far: epoch {best['epoch'] + 1}, "
            f"validation NDCG@10 {best['ndcg']:.4f})")
        return st["history"], best, st["epoch"] + 1
    if st:
        say(f"{state_path} belongs to another trace or config: starting afresh")
    return None


def _train_epoch(net: Trainable, opt: torch.optim.Optimizer, split: Split, users: np.ndarray, cfg: TrainConfig,
                 rng: np.random.Generator, gen: torch.Generator, dev: torch.device, bar, *, epoch: int,
                 best_ndcg: float) -> float:
    """One pass of minibatch steps over ``users``' training sequences; returns the mean loss per
    target."""
    net.train()
    tot, cnt = 0.0, 0
    for items, ts, lens in _batches(split, users, cfg.max_seq_len, cfg.batch_size, rng):
        it = torch.from_numpy(items).to(dev)
        tt = torch.from_numpy(ts).to(dev, torch.float32) if cfg.use_timestamps else None
        slots, ok = sample_slots(lens, cfg.positions_per_seq, rng)
        loss, n = batch_loss(net, it, tt, torch.from_numpy(slots).to(dev), torch.from_numpy(ok).to(dev), cfg, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        tot += float(loss.detach()) * n
        cnt += n
        bar.update(1)
        bar.set_postfix(epoch=epoch + 1, loss=f"{tot / max(cnt, 1):.3f}", best_ndcg=f"{max(best_ndcg, 0):.4f}")
    return tot / max(cnt, 1)


def _save_best(out: Path, net: Trainable, best: dict, trace, tdigest: str, split: Split, cfg: TrainConfig,
               dev: torch.device, history: list[dict], stopped: str) -> dict:
    """Load the best epoch's weights into ``net``, evaluate them on the test targets and write the
    checkpoint (with the run's figures) to ``out``; returns its manifest."""
    from .eval import evaluate

    net.load_state_dict(best["state"])
    model = net.frozen_model()
    table = net.table().detach().cpu()
    test = evaluate(model, table, split, "test", max_seq_len=cfg.max_seq_len, full=False, seed=cfg.seed,
                    use_timestamps=cfg.use_timestamps)
    figures = {"history": history, "best_epoch": best["epoch"] + 1, "stopped": stopped,
               "test_sampled": {k: test[k] for k in ("hr@10_sampled", "ndcg@10_sampled", "num_users")}}
    train_info = {**_config_dict(cfg), "model": asdict(cfg.model), "device_used": str(dev),
                  "best_epoch": best["epoch"] + 1, "epochs_run": len(history), "stopped": stopped,
                  "seconds": history[-1]["elapsed_s"] if history else 0.0, "torch": torch.__version__}
    trace_info = {"name": trace.name, "path": trace.source_path, "digest": tdigest, "num_users": trace.num_users,
                  "num_items": trace.num_items, "num_interactions": trace.num_interactions}
    return save_checkpoint(out, model, table, list(trace.item_keys), trace=trace_info, train=train_info,
                           figures=figures, test=figures["test_sampled"], item_dtype=cfg.item_dtype)


def train(trace, cfg: TrainConfig, out_dir: str | os.PathLike, *, progress: bool = True, resume: bool = True,
          log: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic) -> TrainResult:
    """Train on ``trace`` with ``cfg``; write the best epoch's checkpoint to ``out_dir``."""
    from tqdm import tqdm

    from .eval import evaluate

    say = log or (lambda s: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = resolve_device(cfg.device)
    split = leave_one_out(trace)
    users = np.array([u for u in range(trace.num_users) if len(split.train[u]) >= 2], dtype=np.int64)
    if len(users) == 0:
        raise ValueError("train: no user has 2 or more training items")
    tdigest = trace_digest(trace)
    key = _run_key(cfg, tdigest)
    torch.manual_seed(cfg.seed)
    net = Trainable(cfg.model, trace.num_items, item_category=trace.item_category if cfg.item_features else None,
                    item_counts=split.popularity("valid") if cfg.item_features else None).to(dev)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[dict] = []
    best = {"epoch": -1, "ndcg": -1.0, "state": None}
    start_epoch = 0
    state_path = out / STATE_FILE
    resumed = _load_state(state_path, key, net, opt, rng, gen, say) if resume else None
    if resumed is not None:
        history, best, start_epoch = resumed
    t0 = clock()
    elapsed_before = history[-1]["elapsed_s"] if history else 0.0
    stopped = "max_epochs"
    steps_per_epoch = math.ceil(len(users) / cfg.batch_size)
    epoch = start_epoch - 1
    with tqdm(total=cfg.max_epochs * steps_per_epoch, initial=start_epoch * steps_per_epoch,
              desc="racer model train", unit="batch", disable=not progress, dynamic_ncols=True) as bar:
        for epoch in range(start_epoch, cfg.max_epochs):
            if best["epoch"] >= 0 and epoch - best["epoch"] > cfg.patience:
                stopped = f"early stop: no better validation NDCG@10 for {cfg.patience} epochs"
                break
            loss = _train_epoch(net, opt, split, users, cfg, rng, gen, dev, bar, epoch=epoch, best_ndcg=best["ndcg"])
            val = evaluate(net.frozen_model().to(dev), net.table().detach(), split, "valid",
                           max_seq_len=cfg.max_seq_len, full=False, seed=cfg.seed,
                           use_timestamps=cfg.use_timestamps)
            elapsed = elapsed_before + clock() - t0
            row = {"epoch": epoch + 1, "loss": loss, "valid_hr@10_sampled": val["hr@10_sampled"],
                   "valid_ndcg@10_sampled": val["ndcg@10_sampled"], "elapsed_s": round(elapsed, 2)}
            history.append(row)
            improved = val["ndcg@10_sampled"] > best["ndcg"]
            if improved:
                best = {"epoch": epoch, "ndcg": val["ndcg@10_sampled"],
                        "state": {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}}
            say(f"epoch {epoch + 1}: loss {row['loss']:.4f}, validation HR@10 {row['valid_hr@10_sampled']:.4f} "
                f"NDCG@10 {row['valid_ndcg@10_sampled']:.4f} (sampled){' *' if improved else ''}, "
                f"{elapsed:.0f} s")
            tmp = out / (STATE_FILE + ".tmp")
            torch.save({"key": key, "net": net.state_dict(), "opt": opt.state_dict(), "rng": rng.bit_generator.state,
                        "gen": gen.get_state(), "history": history, "best": best, "epoch": epoch}, tmp)
            os.replace(tmp, state_path)
            if cfg.max_minutes is not None and elapsed > cfg.max_minutes * 60:
                stopped = f"time limit: {cfg.max_minutes:g} min"
                break
        else:
            if best["epoch"] >= 0 and epoch - best["epoch"] > cfg.patience:
                stopped = f"early stop: no better validation NDCG@10 for {cfg.patience} epochs"
    if best["state"] is None:
        raise ValueError("train: no epoch ran (max_epochs reached before this run started?)")
    manifest = _save_best(out, net, best, trace, tdigest, split, cfg, dev, history, stopped)
    return TrainResult(str(out), manifest, history, best["epoch"] + 1, stopped, start_epoch,
                       history[-1]["elapsed_s"] if history else 0.0)
