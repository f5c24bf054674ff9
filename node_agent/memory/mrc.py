"""Miss-ratio curves of the two caches from sampled LRU stack distances (SHARDS, Waldspurger et al.,
FAST 2015), so the allocator sees what each cache would hit at *every* share of the arena, not only
near the split in force.

One `ReuseSampler` per cache watches that cache's references, whatever the cache's own size:

- **spatial sampling**: a reference is followed only when its key's hash (a 64-bit
  multiply-shift of the key, the top 32 bits) lies under a threshold ``T``; the sampling rate is
  ``T / 2**32``. The same keys are followed every time, so a followed key's reuse is seen whole;
- **fixed size** (SHARDS' bounded-memory variant): at most ``max_keys`` keys are followed. When a
  new key would exceed that, ``T`` drops to the hash below which 7/8 of the followed keys lie and
  the keys at or above it are forgotten, so the rate adapts to the working set. Memory is
  ``O(max_keys + num_bins)`` whatever the trace: five arrays of ``max_keys`` entries, a dict of
  at most ``max_keys`` keys and two histograms of ``num_bins + 1`` bins;
- **stack distance**: a followed key's distance at a reference is the size of every followed key
  used more recently (plus its own size for a cache of variable-size entries), divided by the
  rate: the capacity an LRU cache needs to still hold it. The histogram of distances (weighted by
  what a hit saves) against the histogram's total (what every reference could save) is the hit
  curve: the hit fraction of an LRU cache of any capacity;
- **recency**: both histograms decay by half every ``half_life`` followed references, so the
  curve is the recent traffic's.

Time: a reference costs a hash (vectorised over a batch), and for a followed key a masked sum over
the followed keys' positions (``O(max_keys)`` numpy work, no per-key Python beyond a dict look-up
per followed key); a batch of ``n`` ids with ``k`` followed ones costs ``O(n)`` vectorised plus
``O(k)`` dict look-ups and one ``O(max_keys log max_keys)`` sort. `bench/mrc.py` measures it per
request beside the serving path's time.

**EMB slab** (`EmbReuse`): keys are item ids, every entry one row; a batch is one reference time
(the slab stamps a whole lookup with one tick), weights are the ids' repeat counts (the slab's hit
counters count repeats).

**KV pool** (`KVReuse`): keys are users, an entry's size its pages; a lookup's distance includes
the user's own pages (whole-user LRU: a user is held only with all of its pages). Its weight is
the tokens that would be reused (the user's tokens at its last append, at most the request's
history) against the request's history tokens. Sizes are updated at ``append`` whether or not the
pool could take the user: a user the pool refuses (it needs more pages than the pool has) is a
miss at this size and a hit at a size ``need`` pages or more, which the curve shows as a cliff.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import repeat

import numpy as np

_MULT = np.uint64(0x9E3779B97F4A7C15)
_SHIFT = np.uint64(32)
FULL = 1 << 32  # threshold of sampling rate 1


def key_hash(keys: np.ndarray) -> np.ndarray:
    """The spatial hash of int64 keys: top 32 bits of a multiply-shift (Fibonacci) hash, uint64."""
    with np.errstate(over="ignore"):
        return (keys.astype(np.uint64) * _MULT) >> _SHIFT


_M64 = (1 << 64) - 1
_MULT_INT = int(_MULT)


def _hash1(key: int) -> int:
    """`key_hash` of one key, in Python integers (cheaper than a one-element array)."""
    return ((int(key) * _MULT_INT) & _M64) >> 32


class ReuseSampler:
    """SHARDS fixed-size sampler of stack distances over one cache's references (see the module
    docstring). Distances are kept in *pages* of the arena in ``num_bins`` equal bins over
    ``[0, num_pages]`` plus one bin for beyond the arena (and for first references: cold misses).

    ``units_per_page``: how many of the cache's size units one page holds (rows per page for the
    EMB slab, 1 for the KV pool, whose sizes are pages)."""

    def __init__(self, num_pages: int, units_per_page: float, *, max_keys: int = 4096, num_bins: int = 256,
                 half_life: float = 20_000.0, own_size: bool = False) -> None:
        if num_pages < 1 or units_per_page <= 0 or max_keys < 8 or num_bins < 2 or half_life <= 0:
            raise ValueError("ReuseSampler: num_pages >= 1, units_per_page > 0, max_keys >= 8, num_bins >= 2, "
                             "half_life > 0")
        self.num_pages = int(num_pages)
        self.units_per_page = float(units_per_page)
        self.max_keys = int(max_keys)
        self.num_bins = int(num_bins)
        self.bin_pages = self.num_pages / self.num_bins
        self.half_life = float(half_life)
        self.own_size = own_size
        self.threshold = FULL
        self._slot: dict[int, int] = {}
        self._free = list(range(self.max_keys - 1, -1, -1))
        self.pos = np.full(self.max_keys, -1, dtype=np.int64)  # last reference time; -1: slot free
        self.size = np.zeros(self.max_keys, dtype=np.float64)  # size units
        self.hash = np.zeros(self.max_keys, dtype=np.uint64)
        self.tokens = np.zeros(self.max_keys, dtype=np.float64)  # KV: tokens held at the last append
        self.hits = np.zeros(self.num_bins + 1, dtype=np.float64)  # weight by distance bin (last: beyond)
        self.total = 0.0  # weight of every followed reference
        self.clock = 0
        self.num_followed = 0  # followed references so far (undecayed)
        self.recent = 0.0  # followed references, decayed like the histograms
        self._order: np.ndarray | None = None  # sorted positions of the followed keys (EMB; None: rebuild)

    # ---- bookkeeping
    @property
    def rate(self) -> float:
        return self.threshold / FULL

    @property
    def num_keys(self) -> int:
        return len(self._slot)

    def _bin(self, newer_units: np.ndarray, own_units) -> np.ndarray:
        """The bin of a stack distance: the followed units used more recently, scaled by the
        sampling rate, plus the key's own units (not scaled: they are its own)."""
        pages = (newer_units / self.rate + own_units) / self.units_per_page
        return np.minimum((pages / self.bin_pages).astype(np.int64), self.num_bins)

    def _decay(self, n: int) -> None:
        if n:
            f = 0.5 ** (n / self.half_life)
            self.hits *= f
            self.total *= f
            self.recent = self.recent * f + n
            self.num_followed += n

    def _shrink(self, incoming: np.ndarray | None = None) -> None:
        """Lower the threshold so that 7/8 of the followed keys stay, counting ``incoming`` (the
        hashes of keys about to be followed, which may alone outnumber the free slots); forget the
        others."""
        live = self.pos >= 0
        hs = self.hash[live] if incoming is None else np.concatenate((self.hash[live], incoming))
        hs = np.sort(hs)
        keep = max(1, (min(len(hs), self.max_keys) * 7) // 8)
        self.threshold = int(hs[keep]) if keep < len(hs) else self.threshold
        drop = np.flatnonzero(live & (self.hash >= np.uint64(self.threshold)))
        self._order = None
        inv = {s: k for k, s in self._slot.items()} if len(drop) > len(self._slot) // 4 else None
        for s in drop.tolist():
            if inv is not None:
                del self._slot[inv[s]]
            self.pos[s] = -1
            self._free.append(s)
        if inv is None:
            dropped = set(drop.tolist())
            for k in [k for k, s in self._slot.items() if s in dropped]:
                del self._slot[k]

    def _new_slot(self, key: int, h: int) -> int:
        if not self._free:
            self._shrink()
            if h >= self.threshold:
                return -1
        s = self._free.pop()
        self._slot[key] = s
        self.hash[s] = h
        self.size[s] = 0.0
        self.tokens[s] = 0.0
        return s

    # ---- the curve
    def hit_fraction(self, capacity_pages) -> np.ndarray:
        """Predicted hit fraction (of the references' weight) of an LRU cache of
        ``capacity_pages`` pages (array-like), linear inside a bin; 0 before any reference."""
        return self._fraction(self.hits, self.total, capacity_pages)

    def _fraction(self, hits: np.ndarray, total: float, capacity_pages) -> np.ndarray:
        cap = np.asarray(capacity_pages, dtype=np.float64)
        if total <= 0:
            return np.zeros_like(cap)
        edges = np.arange(self.num_bins + 1) * self.bin_pages
        cum = np.concatenate(([0.0], np.cumsum(hits[: self.num_bins])))
        return np.clip(np.interp(cap, edges, cum) / total, 0.0, 1.0)

    def check_invariants(self) -> list[str]:
        out = []
        live = int((self.pos >= 0).sum())
        if live != len(self._slot):
            out.append(f"{live} live slots but {len(self._slot)} keys")
        if len(self._slot) + len(self._free) != self.max_keys:
            out.append("slots leaked")
        if any(int(self.hash[s]) >= self.threshold for s in self._slot.values()):
            out.append("a followed key hashes at or above the threshold")
        if self.total < -1e-9 or (self.hits < -1e-9).any() or self.hits.sum() > self.total * (1 + 1e-9) + 1e-9:
            out.append("hit weight exceeds the total")
        return out


class EmbReuse(ReuseSampler):
    """The EMB slab's sampler: item ids, one row each, a batch per reference time."""

    def __init__(self, num_pages: int, rows_per_page: int, **kw) -> None:
        kw.setdefault("half_life", 20_000.0)
        super().__init__(num_pages, rows_per_page, **kw)

    def record(self, ids: np.ndarray, counts: np.ndarray | None = None) -> int:
        """One lookup of ``ids`` (int64; ``counts`` repeats per id, default 1). Returns the number
        of followed distinct ids. Vectorised: one hash of the ids, a dict look-up per followed
        distinct id (a C loop), and O(followed keys) array work on the sorted positions."""
        h = key_hash(ids)
        m = h < np.uint64(self.threshold)
        if not m.any():
            return 0
        sid = ids[m]
        w = counts[m].astype(np.float64) if counts is not None else np.ones(len(sid))
        uniq, inv = np.unique(sid, return_inverse=True)
        wsum = np.bincount(inv, weights=w, minlength=len(uniq))
        keys = uniq.tolist()
        slots = np.fromiter(map(self._slot.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))
        n_new = int((slots < 0).sum())
        while n_new > len(self._free):  # make room: lower the rate, drop the ids it no longer follows
            self._shrink(key_hash(uniq[slots < 0]))
            keep = key_hash(uniq) < np.uint64(self.threshold)
            uniq, wsum, slots = uniq[keep], wsum[keep], slots[keep]
            n_new = int((slots < 0).sum())
        if not len(uniq):
            return 0
        # each followed reference stands for 1 / rate references (Horvitz-Thompson): the rate
        # falls as the followed set fills, and early references must not outweigh later ones
        wsum = wsum / self.rate
        order = self._order if self._order is not None else np.sort(self.pos[self.pos >= 0])
        known = slots >= 0
        ks = slots[known]
        if len(ks):
            px = self.pos[ks]
            left = np.searchsorted(order, px, side="left")
            right = np.searchsorted(order, px, side="right")
            # rows used after it, and half of those stamped with it (one lookup's rows share a
            # tick: which of them goes first is the slab's choice)
            newer = (len(order) - right) + 0.5 * (right - left - 1)
            self.hits += np.bincount(self._bin(newer, 1.0), weights=wsum[known], minlength=self.num_bins + 1)
            ps = np.sort(px)  # take their old positions out of the sorted order (one each)
            idx = np.searchsorted(order, ps, side="left") + (np.arange(len(ps)) - np.searchsorted(ps, ps, side="left"))
            keep = np.ones(len(order), dtype=bool)
            keep[idx] = False
            order = order[keep]
        self.total += float(wsum.sum())
        self.clock += 1
        self.pos[ks] = self.clock
        if n_new:
            new = uniq[~known]
            fresh = np.array([self._free.pop() for _ in range(n_new)], dtype=np.int64)
            self._slot.update(zip(new.tolist(), fresh.tolist()))
            self.hash[fresh] = key_hash(new)
            self.size[fresh] = 1.0
            self.pos[fresh] = self.clock
        self._order = np.concatenate((order, np.full(len(uniq), self.clock, dtype=np.int64)))
        self._decay(len(uniq))
        return len(uniq)


class KVReuse(ReuseSampler):
    """The KV pool's sampler: users, sized in pages, a lookup per reference time."""

    def __init__(self, num_pages: int, page_tokens: int, **kw) -> None:
        kw.setdefault("half_life", 2_000.0)
        kw.setdefault("max_keys", 2048)
        super().__init__(num_pages, 1.0, own_size=True, **kw)
        self.page_tokens = int(page_tokens)
        self.num_refused = 0.0  # followed appends the pool refused (decayed like the histograms)
        self.tokens_per_lookup = 0.0  # decayed mean of the followed lookups' history tokens (weight: total)
        self._lookups = 0.0
        # the tail: lookups whose history is at least `tail_cut` tokens, the TAIL_QUANTILE of the
        # followed lookups' histories (read at each from a decayed histogram of their lengths in
        # quarter-octave bins: the tail is the quantile's bin and those above); the tail's own hit
        # histogram, total and count
        self.tail_cut = 0.0
        self._lengths = np.zeros(LENGTH_BINS, dtype=np.float64)
        self.hits_tail = np.zeros(self.num_bins + 1, dtype=np.float64)
        self.total_tail = 0.0
        self._tail_lookups = 0.0
        self._pending_history: int | None = 0  # None: the last lookup's denominator comes at its append
        self._inv_rate = 1.0

    def _decay(self, n: int) -> None:
        if n:
            f = 0.5 ** (n / self.half_life)
            self._lookups *= f
            self.num_refused *= f
            self.hits_tail *= f
            self._lengths *= f
            self.total_tail *= f
            self._tail_lookups *= f
        super()._decay(n)

    def followed(self, user_id: int) -> bool:
        return _hash1(user_id) < self.threshold

    def lookup(self, user_id: int, history_tokens: int | None = None) -> None:
        """A lookup of ``user_id`` (before its append). ``history_tokens``: the request's history
        length (the hit rate's denominator); None counts the user's tokens after its append."""
        h = _hash1(user_id)
        if h >= self.threshold:
            return
        tail = False
        if history_tokens is not None:
            x = float(history_tokens)
            xb = min(int(4.0 * math.log2(x + 1.0)), LENGTH_BINS - 1)
            self._lengths[xb] += 1.0
            cum = np.cumsum(self._lengths)
            b = int(np.searchsorted(cum, TAIL_QUANTILE * cum[-1]))
            self.tail_cut = 2.0 ** (b / 4.0) - 1.0  # the lower edge of the quantile's bin
            tail = xb >= b
        s = self._slot.get(user_id, -1)
        if s >= 0 and self.pos[s] >= 0:
            p = self.pos[s]
            newer = float(self.size[(self.pos > p)].sum())
            held = self.tokens[s]
            hit = held if history_tokens is None else min(held, float(history_tokens))
            if hit > 0:
                b = int(self._bin(np.array([newer]), self.size[s])[0])
                self.hits[b] += hit / self.rate
                if tail:
                    self.hits_tail[b] += hit / self.rate
        else:
            s = self._new_slot(user_id, h)
            if s < 0:
                return
        self.clock += 1
        self.pos[s] = self.clock
        self._pending_history = history_tokens
        self._inv_rate = 1.0 / self.rate
        if history_tokens is not None:
            self.total += float(history_tokens) * self._inv_rate
            self._lookups += self._inv_rate
            if tail:
                self.total_tail += float(history_tokens) * self._inv_rate
                self._tail_lookups += self._inv_rate
        self._decay(1)

    def append(self, user_id: int, total_tokens: int, refused: bool = False) -> None:
        """The user's tokens after its request's append (``refused``: the pool could not take
        them; the curve still learns the size the user needs)."""
        s = self._slot.get(user_id, -1)
        if s < 0:
            return
        self.tokens[s] = float(total_tokens)
        self.size[s] = float(math.ceil(total_tokens / self.page_tokens))
        if self._pending_history is None:
            self.total += float(total_tokens) * self._inv_rate
            self._lookups += self._inv_rate
            self._pending_history = 0
        if refused:
            self.num_refused += self._inv_rate

    def mean_tokens(self) -> float:
        """Mean history tokens of a followed lookup (recent-weighted)."""
        return self.total / self._lookups if self._lookups > 0 else 0.0

    def tail_hit_fraction(self, capacity_pages) -> np.ndarray:
        """`hit_fraction` of the tail's lookups only (histories of at least ``tail_cut`` tokens)."""
        return self._fraction(self.hits_tail, self.total_tail, capacity_pages)

    def tail_tokens(self) -> float:
        """Mean history tokens of a followed tail lookup (recent-weighted; 0 before any)."""
        return self.total_tail / self._tail_lookups if self._tail_lookups > 0 else 0.0


#: the quantile of the followed lookups' history tokens above which a lookup is the tail's, and the
#: bins of the histogram of their lengths it is read from
TAIL_QUANTILE = 0.9
LENGTH_BINS = 72  # quarter octaves: histories up to 2**18 tokens

#: the shares at which `MemoryManager.miss_curves` evaluates the curves (and the allocator's trace shows them)
CURVE_SHARES = tuple(round(0.05 * k, 2) for k in range(1, 20))


@dataclass(frozen=True)
class MissCurves:
    """Both caches' predicted hit rates at each of ``shares`` (EMB: of the rows looked up, repeats
    counted; KV: of the history tokens), from the samplers' recent references; what the allocator
    turns into an expected cost per share (`node_agent.allocator.curve`).

    ``emb_followed`` / ``kv_followed``: the recent (decayed) followed references behind each
    curve (its evidence); ``emb_rate`` / ``kv_rate``: the sampling rates; ``kv_tokens_per_lookup``:
    a followed lookup's mean history tokens; ``kv_refused``: recent followed appends the pool
    refused (users larger than the pool in force); ``kv_tail_hit_rate`` / ``kv_tail_tokens``: the
    KV curve and the mean history tokens of the tail's lookups alone (histories in the top
    ``1 - TAIL_QUANTILE`` of the followed lookups': the requests a light load's P99 is made of;
    None / 0 where unknown)."""

    shares: tuple[float, ...]
    emb_hit_rate: tuple[float, ...]
    kv_hit_rate: tuple[float, ...]
    emb_followed: float
    kv_followed: float
    emb_rate: float
    kv_rate: float
    kv_tokens_per_lookup: float
    kv_refused: float
    kv_tail_hit_rate: tuple[float, ...] | None = None
    kv_tail_tokens: float = 0.0

    def at(self, share: float) -> tuple[float, float]:
        """(EMB, KV) predicted hit rates at ``share``, linear between the grid's shares."""
        s = np.asarray(self.shares)
        return float(np.interp(share, s, self.emb_hit_rate)), float(np.interp(share, s, self.kv_hit_rate))


def miss_curves(emb: EmbReuse, kv: KVReuse, emb_pages, kv_pages, shares) -> MissCurves:
    """`MissCurves` at ``shares`` given each share's EMB and KV pages."""
    e = emb.hit_fraction(np.asarray(emb_pages, dtype=np.float64))
    kp = np.asarray(kv_pages, dtype=np.float64)
    k = kv.hit_fraction(kp)
    kt = kv.tail_hit_fraction(kp)
    return MissCurves(tuple(float(x) for x in shares), tuple(round(float(x), 6) for x in e),
                      tuple(round(float(x), 6) for x in k), round(emb.recent, 3), round(kv.recent, 3),
                      emb.rate, kv.rate, round(kv.mean_tokens(), 3), round(kv.num_refused, 3),
                      tuple(round(float(x), 6) for x in kt), round(kv.tail_tokens(), 3))
