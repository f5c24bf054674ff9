"""The `Trace`: one interaction log, reduced to what the caches care about.

A trace holds dense integer ids (users ``0..num_users-1``, items ``0..num_items-1``), each user's
history in time order as one flat array with CSR-style offsets, the item categories where the
source knows them, and the item -> embedding-shard map that the router's EMB locality uses.
Loaders (``workloads.loaders``) build it from files of any size; nothing here reads a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

UNKNOWN_CATEGORY = -1

# Knuth's multiplicative hash constant (2^32 / golden ratio): spreads keys over shards so a shard
# is not a popularity band (dense ids follow first appearance, which correlates with time).
_SHARD_HASH = np.uint64(2654435761)


def shard_map(num_items: int, num_shards: int, categories: np.ndarray | None = None) -> np.ndarray:
    """Item -> embedding shard (int32), deterministic given its inputs.

    Items of a known category go to the category's shard, ``(category * 2654435761 mod 2^32) mod
    num_shards``, so a shard groups related items (as production tables shard by feature or
    category, cf. AutoShard) and a node serving users with a taste for some categories keeps
    their shards hot. Items with no category (``UNKNOWN_CATEGORY``, or no ``categories`` at all)
    hash by their own id the same way.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    keys = np.arange(num_items, dtype=np.uint64)
    if categories is not None:
        cats = np.asarray(categories)
        if len(cats) != num_items:
            raise ValueError(f"categories has {len(cats)} entries for {num_items} items")
        known = cats != UNKNOWN_CATEGORY
        # categories and item ids must not collide: offset category keys past every item id
        keys = np.where(known, cats.astype(np.int64).clip(min=0).astype(np.uint64) + np.uint64(num_items), keys)
    hashed = (keys * _SHARD_HASH) & np.uint64(0xFFFFFFFF)
    return (hashed % np.uint64(num_shards)).astype(np.int32)


@dataclass(frozen=True)
class Trace:
    """Per-user, time-ordered interaction histories with dense ids.

    ``items[offsets[u]:offsets[u + 1]]`` is user ``u``'s history, oldest first, and
    ``timestamps_s`` runs beside it. ``user_keys[u]`` and ``item_keys[i]`` are the source's own ids
    (strings), kept so results can be mapped back.
    """

    name: str
    source_path: str
    offsets: np.ndarray  # int64 [num_users + 1]
    items: np.ndarray  # int32 [num_interactions]
    timestamps_s: np.ndarray  # float64 [num_interactions]
    item_category: np.ndarray  # int32 [num_items], UNKNOWN_CATEGORY where unknown
    user_keys: list[str]
    item_keys: list[str]
    num_shards: int = 64
    num_skipped_lines: int = 0
    behavior_counts: dict[str, int] = field(default_factory=dict)
    item_shard: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.offsets.ndim != 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.items):
            raise ValueError("offsets must start at 0 and end at len(items)")
        if np.any(np.diff(self.offsets) <= 0):
            raise ValueError("every user must have at least one interaction")
        if len(self.timestamps_s) != len(self.items):
            raise ValueError("timestamps_s and items differ in length")
        if len(self.item_category) != len(self.item_keys):
            raise ValueError("item_category must have one entry per item")
        object.__setattr__(self, "item_shard", shard_map(len(self.item_keys), self.num_shards, self.item_category))

    @property
    def num_users(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_items(self) -> int:
        return len(self.item_keys)

    @property
    def num_interactions(self) -> int:
        return len(self.items)

    @property
    def num_categories(self) -> int:
        known = self.item_category[self.item_category != UNKNOWN_CATEGORY]
        return int(len(np.unique(known)))

    @property
    def seq_lens(self) -> np.ndarray:
        return np.diff(self.offsets)

    def history(self, user: int) -> np.ndarray:
        """User ``user``'s item ids, oldest first (a view)."""
        return self.items[self.offsets[user] : self.offsets[user + 1]]

    def item_popularity(self) -> np.ndarray:
        """Interactions per item (int64 [num_items])."""
        return np.bincount(self.items, minlength=self.num_items)

    def with_num_shards(self, num_shards: int) -> "Trace":
        """The same trace with another shard count."""
        return Trace(
            name=self.name,
            source_path=self.source_path,
            offsets=self.offsets,
            items=self.items,
            timestamps_s=self.timestamps_s,
            item_category=self.item_category,
            user_keys=self.user_keys,
            item_keys=self.item_keys,
            num_shards=num_shards,
            num_skipped_lines=self.num_skipped_lines,
            behavior_counts=dict(self.behavior_counts),
        )

    def describe(self) -> dict:
        """Summary statistics as plain JSON-able values."""
        lens = self.seq_lens
        pop = np.sort(self.item_popularity())[::-1]
        total = max(int(pop.sum()), 1)

        def top_share(fraction: float) -> float:
            k = max(1, int(np.ceil(fraction * len(pop))))
            return round(float(pop[:k].sum()) / total, 4)

        ts = self.timestamps_s
        out = {
            "trace": self.name,
            "path": self.source_path,
            "num_users": self.num_users,
            "num_items": self.num_items,
            "num_interactions": self.num_interactions,
            "num_categories": self.num_categories,
            "num_shards": self.num_shards,
            "num_skipped_lines": self.num_skipped_lines,
            "seq_len_mean": round(float(lens.mean()), 1),
            "seq_len_p50": round(float(np.percentile(lens, 50)), 1),
            "seq_len_p90": round(float(np.percentile(lens, 90)), 1),
            "seq_len_p99": round(float(np.percentile(lens, 99)), 1),
            "seq_len_max": int(lens.max()),
            "top1pct_item_share": top_share(0.01),
            "top10pct_item_share": top_share(0.10),
            "items_seen_once_share": round(float(np.mean(pop == 1)), 4),
            "time_start_s": float(ts.min()),
            "time_end_s": float(ts.max()),
        }
        if self.behavior_counts:
            n = sum(self.behavior_counts.values())
            out["behavior_share"] = {k: round(v / n, 4) for k, v in sorted(self.behavior_counts.items())}
        return out


def build_trace(
    name: str,
    source_path: str,
    user_rows: list[str],
    item_rows: list[str],
    timestamps: list[float] | np.ndarray,
    *,
    item_category_of: dict[str, str] | None = None,
    num_shards: int = 64,
    num_skipped_lines: int = 0,
    behavior_counts: dict[str, int] | None = None,
) -> Trace:
    """Turn parallel per-row columns (source ids as strings) into a `Trace`.

    Users and items get dense ids in order of first appearance in the rows. Rows are stably sorted
    by (user, timestamp), so rows with equal timestamps keep their file order.
    """
    if not user_rows:
        raise ValueError(f"{source_path}: no interactions")
    user_index: dict[str, int] = {}
    item_index: dict[str, int] = {}
    u = np.fromiter((user_index.setdefault(k, len(user_index)) for k in user_rows), np.int64, len(user_rows))
    it = np.fromiter((item_index.setdefault(k, len(item_index)) for k in item_rows), np.int64, len(item_rows))
    ts = np.asarray(timestamps, dtype=np.float64)
    order = np.lexsort((ts, u))
    u, it, ts = u[order], it[order], ts[order]
    counts = np.bincount(u, minlength=len(user_index))
    offsets = np.zeros(len(user_index) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])

    item_keys = list(item_index)
    categories = np.full(len(item_keys), UNKNOWN_CATEGORY, dtype=np.int32)
    if item_category_of:
        cat_index: dict[str, int] = {}
        for i, key in enumerate(item_keys):
            c = item_category_of.get(key)
            if c is not None:
                categories[i] = cat_index.setdefault(c, len(cat_index))
    return Trace(
        name=name,
        source_path=source_path,
        offsets=offsets,
        items=it.astype(np.int32),
        timestamps_s=ts,
        item_category=categories,
        user_keys=list(user_index),
        item_keys=item_keys,
        num_shards=num_shards,
        num_skipped_lines=num_skipped_lines,
        behavior_counts=dict(behavior_counts or {}),
    )


def synthetic_trace(
    num_users: int = 200,
    num_items: int = 5_000,
    mean_seq_len: float = 60.0,
    zipf_a: float = 1.1,
    num_categories: int = 20,
    seed: int = 0,
    num_shards: int = 64,
) -> Trace:
    """A small trace made in code (Zipf item popularity, geometric-ish history lengths).

    For tests and for runs where ../shared/data is absent; not a stand-in for the real traces.
    """
    if num_users < 1 or num_items < 1 or mean_seq_len < 1:
        raise ValueError("num_users, num_items and mean_seq_len must be positive")
    rng = np.random.default_rng(seed)
    lens = np.maximum(1, rng.geometric(1.0 / mean_seq_len, size=num_users))
    offsets = np.zeros(num_users + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    ranks = np.arange(1, num_items + 1, dtype=np.float64)
    p = ranks ** (-zipf_a)
    p /= p.sum()
    items = rng.choice(num_items, size=int(offsets[-1]), p=p).astype(np.int32)
    ts = np.concatenate([np.sort(rng.uniform(0, 86_400, size=n)) for n in lens])
    cats = rng.integers(0, num_categories, size=num_items).astype(np.int32)
    return Trace(
        name="synthetic",
        source_path=f"synthetic(users={num_users},items={num_items},len={mean_seq_len:g},zipf={zipf_a:g},"
                    f"categories={num_categories},seed={seed})",
        offsets=offsets,
        items=items,
        timestamps_s=ts,
        item_category=cats,
        user_keys=[str(i) for i in range(num_users)],
        item_keys=[str(i) for i in range(num_items)],
        num_shards=num_shards,
    )
