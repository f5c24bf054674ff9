"""The paper-scale trace: ~1 M-user histories and a table of many rows, built from a sample trace.

`paper_scale_trace(sample, num_users, num_rows, history_tail, seed)` (the setting and its sources:
`simulator.profiles.PaperScale`, docs/simulator.md):

- **history lengths**: user ``u`` has an activity level, one sample user ``b``'s sequence length
  ``l_b`` (drawn uniformly: the sample's per-user length distribution), and ``P_u ~
  U{1..periods_max}`` periods of that activity (a sample sequence is one period: 9 days on
  Taobao): its history has ``min(P_u l_b, max_history_len)`` tokens, ``periods_max =
  ceil(history_tail / longest sample sequence)``, so the longest histories reach
  ``history_tail`` (15,000: the paper's "15k+").
- **history content**: the periods are real sample sequences concatenated: ``b``'s own, then
  sample users of similar activity (each drawn among the 17 nearest to ``b`` in sequence
  length), the last one cut to length. A history is never a tiled copy of one sequence.
- **items**: the rows' popularity is a Zipf law whose exponent is fitted to the sample
  (`fit_zipf_exponent`: least squares of log(count) on log(rank) over every item). Each period
  maps the sample's items to rows through its own random offset into one table of Zipf draws,
  so an item repeated inside a sample sequence stays one row (the sequence's own repeats are
  kept) while different periods, and different users, touch independent rows.
- **activity**: the request generator weights a user by its history length (`workloads.regimes`).

Timestamps are not modelled (a zero-stride array of zeros: no memory), nor categories (rows hash
to shards by id).
"""

from __future__ import annotations

import math

import numpy as np

from .trace import UNKNOWN_CATEGORY, Trace

_ZIPF_TABLE = 1 << 22  # Zipf draws that periods index into (with a per-period offset)
_NEIGHBOURS = 8  # a period's sample user is among the 17 nearest in sequence length to the user's own


def fit_zipf_exponent(trace: Trace) -> float:
    """The least-squares slope of log(count) on log(rank) over every item of ``trace`` (negated)."""
    pop = np.sort(trace.item_popularity())[::-1].astype(np.float64)
    pop = pop[pop > 0]
    if len(pop) < 2:
        raise ValueError(f"{trace.name}: need at least two items to fit a Zipf exponent")
    ranks = np.arange(1, len(pop) + 1, dtype=np.float64)
    return float(-np.polyfit(np.log(ranks), np.log(pop), 1)[0])


def zipf_rows(rng: np.random.Generator, num_rows: int, exponent: float, size: int) -> np.ndarray:
    """``size`` row ids drawn with P(rank r) ~ r^-exponent, ranks placed on rows by a random permutation."""
    ranks = np.arange(1, num_rows + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** (-exponent))
    r = np.searchsorted(cdf, rng.random(size) * cdf[-1], side="right").clip(0, num_rows - 1)
    return rng.permutation(num_rows)[r]


def periods_max(sample: Trace, history_tail: int) -> int:
    return max(1, math.ceil(history_tail / int(sample.seq_lens.max())))


def paper_scale_trace(sample: Trace, num_users: int, num_rows: int, history_tail: int = 15_000,
                      max_history_len: int = 15_000, seed: int = 0, num_shards: int = 64) -> Trace:
    """See the module docstring. Deterministic for its arguments."""
    if num_users < 1 or num_rows < 2 or history_tail < 1 or max_history_len < 1:
        raise ValueError("num_users, num_rows, history_tail and max_history_len must be positive (num_rows >= 2)")
    rng = np.random.default_rng([seed, 19])
    alpha = fit_zipf_exponent(sample)
    pmax = periods_max(sample, history_tail)
    slen = sample.seq_lens
    by_len = np.argsort(slen, kind="stable")  # sample users by sequence length
    rank_of = np.empty_like(by_len)
    rank_of[by_len] = np.arange(len(by_len))
    base = rng.integers(0, sample.num_users, size=num_users)  # the user's activity: one sample user's
    periods = rng.integers(1, pmax + 1, size=num_users)
    target = np.minimum(periods * slen[base], max_history_len)  # P periods at that activity, capped
    # the periods' sequences: the base user's own, then sample users of similar length (the
    # _NEIGHBOURS nearest in length rank), enough of them to reach the target, the last one cut
    nseg = 2 * periods + 2
    owner = np.repeat(np.arange(num_users), nseg)
    first = np.r_[0, np.cumsum(nseg)[:-1]]
    near = rank_of[base][owner] + rng.integers(-_NEIGHBOURS, _NEIGHBOURS + 1, size=len(owner))
    seg_user = by_len[np.clip(near, 0, len(by_len) - 1)]
    seg_user[first] = base
    seg_len = slen[seg_user]
    cum = np.cumsum(seg_len)
    before = cum - seg_len - np.repeat((cum - seg_len)[first], nseg)  # tokens of the user's earlier periods
    keep = np.clip(target[owner] - before, 0, seg_len)
    seg_offset = rng.integers(0, _ZIPF_TABLE, size=len(seg_user))
    lens = np.bincount(owner, weights=keep, minlength=num_users).astype(np.int64)
    offsets = np.zeros(num_users + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    # tokens: period j contributes the first keep[j] items of sample user seg_user[j]'s sequence
    total = int(offsets[-1])
    src = np.repeat(sample.offsets[seg_user] - (np.cumsum(keep) - keep), keep) + np.arange(total)
    table = zipf_rows(rng, num_rows, alpha, _ZIPF_TABLE)
    items = table[(sample.items[src].astype(np.int64) * 2654435761 + np.repeat(seg_offset, keep)) % _ZIPF_TABLE]
    name = f"{sample.name}@paper-scale"
    return Trace(
        name=name,
        source_path=f"paper_scale_trace({sample.source_path}, users={num_users}, rows={num_rows}, "
                    f"tail={history_tail}, seed={seed})",
        offsets=offsets,
        items=items.astype(np.int32),
        timestamps_s=np.broadcast_to(np.float64(0.0), (total,)),
        item_category=np.broadcast_to(np.int32(UNKNOWN_CATEGORY), (num_rows,)),
        user_keys=_Keys(num_users),
        item_keys=_Keys(num_rows),
        num_shards=num_shards,
    )


class _Keys:
    """``str(i)`` for ``i`` in ``range(n)``, without a list of a million strings."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [str(k) for k in range(self.n)[i]]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return str(i % self.n)

    def __iter__(self):
        return (str(i) for i in range(self.n))
