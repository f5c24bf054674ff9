"""Quality of a trained model on the leave-one-out split (``racer model eval``).

For every user with 3 or more items, the held-out target (the last item for ``test``, the one
before for ``valid``) is ranked among candidates by the model *through its serving path*: the
history (the items before the target, cut to the last ``max_seq_len``) is prefilled with
`HSTUModel.forward`, and the candidates are scored with `HSTUModel.rank`, exactly what a node
does for a request. Two candidate sets:

- **sampled** (SASRec's protocol): the target plus 100 items drawn uniformly from the items the
  user never interacted with (seeded per user);
- **full**: every item, except the items in the user's history that are not the target
  (the usual "filtered" full ranking).

HR@10 is the share of users whose target ranks in the top 10; NDCG@10 is the mean of
``1 / log2(rank + 2)`` for those (rank 0-based). Ties with the target are broken at random
(seeded), so a baseline that gives many items one score gets its expected rank, not the best.

The popularity baseline scores an item by its interactions in what a model may see before the
target (the training items, plus the validation targets for ``test``), on the same candidates.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from .hstu import HSTUModel

TOP_K = 10
NUM_SAMPLED_NEGATIVES = 100


def _rank(scores: np.ndarray, target_index: int, rng: np.random.Generator) -> int:
    s = scores[target_index]
    greater = int(np.sum(scores > s))
    ties = int(np.sum(scores == s)) - 1
    return greater + (int(rng.integers(0, ties + 1)) if ties > 0 else 0)


def _sample_negatives(num_items: int, seen: set, n: int, rng: np.random.Generator) -> np.ndarray:
    if num_items - len(seen) < n:
        n = num_items - len(seen)
    out: list[int] = []
    chosen: set[int] = set()
    while len(out) < n:
        for x in rng.integers(0, num_items, size=2 * (n - len(out)) + 8).tolist():
            if x not in seen and x not in chosen:
                chosen.add(x)
                out.append(x)
                if len(out) == n:
                    break
    return np.asarray(out, dtype=np.int64)


class _Figures:
    def __init__(self):
        self.hr = 0.0
        self.ndcg = 0.0
        self.n = 0

    def add(self, rank: int) -> None:
        self.n += 1
        if rank < TOP_K:
            self.hr += 1.0
            self.ndcg += 1.0 / math.log2(rank + 2)

    def hr_at(self) -> float:
        return self.hr / max(self.n, 1)

    def ndcg_at(self) -> float:
        return self.ndcg / max(self.n, 1)


@torch.no_grad()
def model_scorer(model: HSTUModel, item_table: torch.Tensor, *, use_timestamps: bool = False,
                 chunk: int = 8192) -> Callable:
    """``score(history, history_ts, now_ts, candidates) -> scores`` through the serving path."""
    dev = next(model.parameters()).device
    table = item_table.to(dev, torch.float32)

    def score(hist: np.ndarray, hist_ts: np.ndarray, now_ts: float, cands: np.ndarray) -> np.ndarray:
        ts = torch.from_numpy(hist_ts if use_timestamps else np.zeros(len(hist))).to(dev, torch.float64)
        now = torch.tensor(now_ts if use_timestamps else 0.0, dtype=torch.float64, device=dev)
        _, kv = model(model.tokens(table[torch.from_numpy(hist).to(dev)]), ts)
        c = torch.from_numpy(cands).to(dev)
        out = [model.rank(table[c[i: i + chunk]], kv, now_ts=now) for i in range(0, len(c), chunk)]
        return torch.cat(out).cpu().numpy()

    return score


def evaluate(model: HSTUModel | None, item_table: torch.Tensor | None, split, which: str = "test", *,
             max_seq_len: int = 50, full: bool = True, sampled: bool = True, seed: int = 0,
             use_timestamps: bool = False, popularity: bool = False, max_users: int | None = None,
             progress: Callable[[], None] | None = None) -> dict:
    """HR@10 / NDCG@10 of ``model`` (and, with ``popularity``, of the popularity baseline beside
    it) on ``split``'s ``which`` targets (`node_agent.model.train.Split`). ``model=None``: the
    baseline only. Returns flat keys ``hr@10_sampled``, ``ndcg@10_sampled``, ``hr@10_full``,
    ``ndcg@10_full``, ``num_users``, and ``popularity`` with the same keys."""
    if which not in ("valid", "test"):
        raise ValueError(f"evaluate: which must be valid or test, got {which!r}")
    targets = split.valid if which == "valid" else split.test
    target_ts = split.valid_ts if which == "valid" else split.test_ts
    users = np.flatnonzero(targets >= 0)
    if max_users is not None:
        users = users[:max_users]
    if len(users) == 0:
        raise ValueError("evaluate: no user has 3 or more items (nothing held out)")
    n_items = split.num_items
    pop = split.popularity(which)
    score = model_scorer(model, item_table, use_timestamps=use_timestamps) if model is not None else None
    figs = {name: _Figures() for name in ("m_s", "m_f", "p_s", "p_f")}
    all_items = np.arange(n_items, dtype=np.int64)
    salt = 0 if which == "test" else 1
    for u in users.tolist():
        hist, hist_ts = split.history(u, which)
        target = int(targets[u])
        seen = set(hist.tolist())
        seen.add(target)
        if which == "valid":
            seen.add(int(split.test[u]))
        rng = np.random.default_rng((seed, u, salt))
        tie_rng = np.random.default_rng((seed, u, salt, 1))
        h = hist[-max_seq_len:]
        ht = hist_ts[-max_seq_len:]
        if sampled:
            cands = np.concatenate([[target], _sample_negatives(n_items, seen, NUM_SAMPLED_NEGATIVES, rng)])
            if score is not None:
                figs["m_s"].add(_rank(score(h, ht, float(target_ts[u]), cands), 0, tie_rng))
            if popularity:
                figs["p_s"].add(_rank(pop[cands], 0, tie_rng))
        if full:
            excluded = np.fromiter((i for i in set(hist.tolist()) if i != target), dtype=np.int64)
            if score is not None:
                s = score(h, ht, float(target_ts[u]), all_items)
                s[excluded] = -np.inf
                figs["m_f"].add(_rank(s, target, tie_rng))
            if popularity:
                p = pop.copy()
                p[excluded] = -np.inf
                figs["p_f"].add(_rank(p, target, tie_rng))
        if progress is not None:
            progress()

    def block(s: _Figures, f: _Figures) -> dict:
        out: dict = {}
        if sampled:
            out["hr@10_sampled"] = round(s.hr_at(), 4)
            out["ndcg@10_sampled"] = round(s.ndcg_at(), 4)
        if full:
            out["hr@10_full"] = round(f.hr_at(), 4)
            out["ndcg@10_full"] = round(f.ndcg_at(), 4)
        return out

    out = block(figs["m_s"], figs["m_f"]) if model is not None else {}
    out["num_users"] = int(len(users))
    if popularity:
        out["popularity"] = block(figs["p_s"], figs["p_f"])
    return out
