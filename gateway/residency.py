"""Residency metadata the router scores with: where each user's K/V lives, which shards are hot.

`KvResidency` maps user -> (node, cached_len) in a fixed amount of memory (a set-associative
table of numpy arrays, 24 bytes an entry); `HotShardTable` holds each node's hot embedding shards
as one row of a ``[num_nodes, num_shards]`` 0/1 matrix, so the EMB locality of every node for a
request is one matrix-vector product. Neither reads a clock: times come in as ``now_s``/``at_s``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

EMPTY = -1  # key of a free entry
MAX_USER = (1 << 63) - 1
_HASH = 0x9E3779B97F4A7C15  # 2^64 / golden ratio (Fibonacci hashing)
_MASK64 = (1 << 64) - 1
ENTRY_BYTES = 8 + 4 + 4 + 8  # key int64, node int32, cached_len int32, touched_s float64


def _as_users(users) -> np.ndarray:
    u = np.asarray(users)
    if u.ndim != 1:
        u = u.reshape(-1)
    if u.size and u.dtype.kind not in "iu":
        raise TypeError(f"user ids must be integers, got dtype {u.dtype}")
    u = u.astype(np.int64, copy=False)
    if u.size and int(u.min()) < 0:
        raise ValueError(f"user ids must be >= 0, got {int(u.min())}")
    return u


class ArrayViews:
    """Memoryviews over numpy arrays for fast scalar access from Python, kept through copies.

    A subclass names them in ``_VIEWS`` (view attribute -> array attribute) and calls
    `_bind_views` once its arrays exist; memoryviews cannot be pickled, so a copy (``copy.deepcopy``,
    as the simulator's forks do) carries the arrays and rebinds the views to the copied ones."""

    _VIEWS: dict[str, str] = {}

    def _bind_views(self) -> None:
        for view, arr in self._VIEWS.items():
            setattr(self, view, memoryview(getattr(self, arr)))

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in self._VIEWS}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._bind_views()


class KvResidency(ArrayViews):
    """Which node holds each user's K/V and for how many tokens, in bounded memory.

    Layout: ``num_sets`` sets of ``ways`` entries (``capacity = num_sets * ways``); a user lives
    only in set ``fibonacci_hash(user) >> shift``. Each entry is (key, node, cached_len,
    touched_s) in four parallel numpy arrays; lookups of one user scan its set from Python through
    memoryviews (a few hundred ns), bulk operations are vectorised over the arrays.

    Eviction order: when a user is recorded into a full set, the entry of that set with the oldest
    ``touched_s`` goes (ties: the lowest way). That is LRU within a set, an approximation of global
    LRU whose error is bounded by the set size: it keeps memory fixed at ``capacity`` entries
    whatever the number of users, and the router only loses the hint for a user that has not been
    routed for longer than the others sharing its set, which is the user whose K/V the node most
    likely evicted anyway. Entries also go when a node reports the user evicted (`forget_many`)
    and all of a node's entries go when the node falls silent (`forget_node`).
    """

    def __init__(self, capacity: int = 1 << 21, ways: int = 8) -> None:
        if isinstance(ways, bool) or not isinstance(ways, int) or ways < 1:
            raise ValueError(f"ways must be an integer >= 1, got {ways!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        num_sets = 2
        while num_sets * ways < capacity:
            num_sets *= 2
        self.ways = ways
        self.num_sets = num_sets
        self.capacity = num_sets * ways
        self._shift = 64 - (num_sets.bit_length() - 1)
        self.keys = np.full(self.capacity, EMPTY, dtype=np.int64)
        self.node = np.full(self.capacity, -1, dtype=np.int32)
        self.cached_len = np.zeros(self.capacity, dtype=np.int32)
        self.touched_s = np.zeros(self.capacity, dtype=np.float64)
        self._count = 0
        self._way_range = np.arange(ways, dtype=np.int64)
        self._bind_views()

    _VIEWS = {"_keys_mv": "keys", "_node_mv": "node", "_len_mv": "cached_len", "_touched_mv": "touched_s"}

    # ---------------------------------------------------------------- one user
    def _set_base(self, user: int) -> int:
        return (((user * _HASH) & _MASK64) >> self._shift) * self.ways

    def lookup(self, user: int) -> tuple[int, int]:
        """``(node, cached_len)`` of ``user``, or ``(-1, 0)`` when no node is known to hold it."""
        base = (((user * _HASH) & _MASK64) >> self._shift) * self.ways
        keys = self._keys_mv
        for j in range(base, base + self.ways):
            if keys[j] == user:
                return self._node_mv[j], self._len_mv[j]
        return -1, 0

    def record(self, user: int, node: int, cached_len: int, now_s: float) -> int:
        """Note that ``node`` holds ``cached_len`` tokens of ``user``'s K/V as of ``now_s``.

        Replaces the user's previous entry (one holder per user). Returns the user evicted to make
        room (`EMPTY` if none). ``user`` must be in ``[0, 2^63)``; callers on the hot path check.
        """
        ways = self.ways
        base = (((user * _HASH) & _MASK64) >> self._shift) * ways
        keys = self._keys_mv
        touched = self._touched_mv
        slot = -1
        free = -1
        oldest = base
        for j in range(base, base + ways):
            k = keys[j]
            if k == user:
                slot = j
                break
            if k == EMPTY:
                if free < 0:
                    free = j
            elif touched[j] < touched[oldest] or keys[oldest] == EMPTY:
                oldest = j
        evicted = EMPTY
        if slot < 0:
            if free >= 0:
                slot = free
                self._count += 1
            else:
                slot = oldest
                evicted = keys[slot]
            keys[slot] = user
        self._node_mv[slot] = node
        self._len_mv[slot] = cached_len
        touched[slot] = now_s
        return evicted

    # ---------------------------------------------------------------- many users
    def _candidate_slots(self, users: np.ndarray) -> np.ndarray:
        sets = (users.astype(np.uint64) * np.uint64(_HASH)) >> np.uint64(self._shift)
        return (sets.astype(np.int64) * self.ways)[:, None] + self._way_range

    def find_many(self, users) -> np.ndarray:
        """Entry index of each user (int64), ``-1`` where the user has no entry."""
        u = _as_users(users)
        if not u.size:
            return np.empty(0, dtype=np.int64)
        cand = self._candidate_slots(u)
        match = self.keys[cand] == u[:, None]
        hit = match.any(axis=1)
        j = match.argmax(axis=1)
        return np.where(hit, cand[np.arange(len(u)), j], -1)

    def lookup_many(self, users) -> tuple[np.ndarray, np.ndarray]:
        """``(node, cached_len)`` arrays for ``users`` (``-1``/``0`` where unknown)."""
        slots = self.find_many(users)
        hit = slots >= 0
        node = np.where(hit, self.node[np.maximum(slots, 0)], -1).astype(np.int64)
        length = np.where(hit, self.cached_len[np.maximum(slots, 0)], 0).astype(np.int64)
        return node, length

    def record_many(self, users, nodes, cached_lens, now_s: float) -> int:
        """Vectorised `record` (the last occurrence of a repeated user wins). Returns evictions."""
        u = _as_users(users)
        n = np.broadcast_to(np.asarray(nodes, dtype=np.int64), u.shape)
        c = np.broadcast_to(np.asarray(cached_lens, dtype=np.int64), u.shape)
        if not u.size:
            return 0
        if int(n.min()) < 0 or int(c.min()) < 0:
            raise ValueError("nodes and cached_lens must be >= 0")
        if int(c.max()) > np.iinfo(np.int32).max:
            raise ValueError("cached_len does not fit in int32")
        # keep each user's last occurrence
        rev_unique, rev_first = np.unique(u[::-1], return_index=True)
        keep = np.sort(len(u) - 1 - rev_first)
        u, n, c = u[keep], n[keep], c[keep]
        slots = self.find_many(u)
        have = slots >= 0
        s = slots[have]
        self.node[s] = n[have]
        self.cached_len[s] = c[have]
        self.touched_s[s] = now_s
        # new users: fill the free ways of their set in order, the rest go through `record`
        new_u, new_n, new_c = u[~have], n[~have], c[~have]
        if not new_u.size:
            return 0
        cand = self._candidate_slots(new_u)
        order = np.argsort(cand[:, 0], kind="stable")
        new_u, new_n, new_c, cand = new_u[order], new_n[order], new_c[order], cand[order]
        set_base = cand[:, 0]
        first = np.ones(len(set_base), dtype=bool)
        first[1:] = set_base[1:] != set_base[:-1]
        start = np.maximum.accumulate(np.where(first, np.arange(len(set_base)), 0))
        rank = np.arange(len(set_base)) - start  # rank among this batch's new users of the same set
        free = self.keys[cand] == EMPTY  # [k, ways]
        num_free = free.sum(axis=1)
        free_ways = np.argsort(~free, axis=1, kind="stable")  # free ways first, in way order
        fits = rank < num_free
        rows = np.flatnonzero(fits)
        slot = set_base[rows] + free_ways[rows, rank[rows]]
        self.keys[slot] = new_u[rows]
        self.node[slot] = new_n[rows]
        self.cached_len[slot] = new_c[rows]
        self.touched_s[slot] = now_s
        self._count += len(rows)
        evicted = 0
        for i in np.flatnonzero(~fits).tolist():
            if self.record(int(new_u[i]), int(new_n[i]), int(new_c[i]), now_s) != EMPTY:
                evicted += 1
        return evicted

    def forget_many(self, users, node: int, at_s: float = float("inf")) -> int:
        """Drop the entries of ``users`` that say ``node`` holds them and were last recorded at or
        before ``at_s`` (a node's eviction report must not undo a newer routing decision that put
        the user back on that node, or on another). Returns the number of entries dropped."""
        slots = self.find_many(users)
        slots = slots[slots >= 0]
        slots = slots[(self.node[slots] == node) & (self.touched_s[slots] <= at_s)]
        slots = np.unique(slots)
        self._clear(slots)
        return int(len(slots))

    def forget_node(self, node: int) -> int:
        """Drop every entry held by ``node``. Returns the number of entries dropped."""
        slots = np.flatnonzero((self.node == node) & (self.keys != EMPTY))
        self._clear(slots)
        return int(len(slots))

    def _clear(self, slots: np.ndarray) -> None:
        self.keys[slots] = EMPTY
        self.node[slots] = -1
        self.cached_len[slots] = 0
        self.touched_s[slots] = 0.0
        self._count -= len(slots)

    # ---------------------------------------------------------------- inspection
    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.node.nbytes + self.cached_len.nbytes + self.touched_s.nbytes

    def count_by_node(self, num_nodes: int) -> np.ndarray:
        """Resident users per node (int64 ``[num_nodes]``)."""
        used = self.keys != EMPTY
        return np.bincount(self.node[used], minlength=num_nodes)[:num_nodes]

    def check_invariants(self, num_nodes: int | None = None) -> list[str]:
        """Violations of the table's invariants (empty when consistent)."""
        out = []
        used = self.keys != EMPTY
        if int(used.sum()) != self._count:
            out.append(f"count {self._count} != {int(used.sum())} used entries")
        idx = np.flatnonzero(used)
        if idx.size:
            users = self.keys[idx]
            want = self._candidate_slots(users)[:, 0]
            wrong = (idx // self.ways) * self.ways != want
            if wrong.any():
                out.append(f"{int(wrong.sum())} users stored outside their set, e.g. {int(users[wrong][0])}")
            if len(np.unique(users)) != len(users):
                out.append("a user has more than one entry")
            if int(self.node[idx].min()) < 0:
                out.append("a used entry has no node")
            if num_nodes is not None and int(self.node[idx].max()) >= num_nodes:
                out.append(f"a used entry names node {int(self.node[idx].max())} >= {num_nodes}")
            if int(self.cached_len[idx].min()) < 0:
                out.append("a negative cached_len")
        free = ~used
        if (self.node[free] != -1).any() or (self.cached_len[free] != 0).any():
            out.append("a free entry keeps stale data")
        return out


class HotShardTable:
    """Each node's hot embedding shards as a ``[num_nodes, num_shards]`` float64 0/1 matrix.

    A row is replaced whole by the node's report (the node knows its slab; the router does not
    guess), and cleared when the node falls silent. ``hot @ shard_counts`` gives, for every node,
    how many of a request's looked-up items fall in shards hot there.
    """

    def __init__(self, num_nodes: int, num_shards: int) -> None:
        if num_nodes < 1 or num_shards < 1:
            raise ValueError(f"num_nodes and num_shards must be >= 1, got {num_nodes}, {num_shards}")
        self.num_nodes = num_nodes
        self.num_shards = num_shards
        self.hot = np.zeros((num_nodes, num_shards), dtype=np.float64)

    def set_hot(self, node: int, shards: Iterable[int] | np.ndarray) -> None:
        s = np.asarray(list(shards) if not isinstance(shards, np.ndarray) else shards).reshape(-1)
        if s.size and s.dtype.kind not in "iu":
            raise TypeError(f"shard ids must be integers, got dtype {s.dtype}")
        if s.size and (int(s.min()) < 0 or int(s.max()) >= self.num_shards):
            raise ValueError(f"shard ids must be in [0, {self.num_shards}), got {int(s.min())}..{int(s.max())}")
        row = self.hot[node]
        row[:] = 0.0
        row[s.astype(np.int64)] = 1.0

    def clear(self, node: int) -> None:
        self.hot[node] = 0.0

    def shards_of(self, node: int) -> np.ndarray:
        return np.flatnonzero(self.hot[node])
