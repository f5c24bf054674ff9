"""The node's residency feed for gateways: KV residency deltas and hot embedding shards.

    GET /v1/residency?cursor=N&epoch=E   (the node agent's route; see docs/gateway.md)

The device worker calls `ResidencyFeed.collect` after each micro-batch and when idle: it drains
the KV pool's residency changes (`KVPool.drain_residency`: users added, users evicted) into a
bounded ring of events numbered 1, 2, 3, ... and, at most every ``hot_interval_s``, recomputes
the hot shards from the EMB slab: a shard is hot when the slab holds at least ``hot_min_mass``
of its items' popularity mass (the simulator's rule) or, on a slab too small for any shard to be
half resident, at least ``hot_rel`` times the slab's overall coverage (resident mass over all
mass): the shards this node covers well above its average. HTTP handlers call `since` from the event
loop; a lock guards the shared state (never the engine: the feed only reads the engine from the
worker thread).

`since(cursor, epoch)` returns the events after ``cursor``; when the cursor is older than the
ring (events were dropped), newer than the last event, or from another epoch (the agent
restarted: a new random epoch), it returns a full snapshot instead (every resident user with
its cached tokens), marked ``full``. A gateway applies a delta as "forget these, confirm those"
and a snapshot as "this is everything the node holds".
"""

from __future__ import annotations

import secrets
import threading
from collections import deque

import numpy as np


class ResidencyFeed:
    """Bounded log of one node's KV residency changes plus its hot shards and service time.

    - ``item_shard``: item -> embedding shard (the trace's ``item_shard``); ``None`` disables the
      hot-shard report (``hot_shards`` is then empty);
    - ``item_mass``: item popularity (a shard's mass is the sum over its items);
    - ``capacity``: events kept; older ones are dropped (a reader that far behind gets a snapshot).
    """

    def __init__(self, item_shard: np.ndarray | None = None, item_mass: np.ndarray | None = None, *,
                 num_shards: int | None = None, capacity: int = 65_536, hot_min_mass: float = 0.5,
                 hot_rel: float = 1.5, hot_interval_s: float = 0.1) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not 0.0 < hot_min_mass <= 1.0:
            raise ValueError(f"hot_min_mass must be in (0, 1], got {hot_min_mass}")
        self.capacity = int(capacity)
        self.hot_min_mass = float(hot_min_mass)
        self.hot_rel = float(hot_rel)
        self.hot_interval_s = float(hot_interval_s)
        self.epoch = secrets.token_hex(8)
        self._item_shard = None if item_shard is None else np.asarray(item_shard, dtype=np.int64)
        if self._item_shard is not None:
            n = len(self._item_shard)
            mass = np.ones(n) if item_mass is None else np.asarray(item_mass, dtype=np.float64)
            if len(mass) != n:
                raise ValueError(f"item_mass has {len(mass)} entries for {n} items")
            self.num_shards = int(num_shards or (int(self._item_shard.max()) + 1 if n else 1))
            self._mass = mass
            self._shard_mass = np.bincount(self._item_shard, weights=mass, minlength=self.num_shards)
        else:
            self.num_shards = int(num_shards or 0)
            self._mass = self._shard_mass = None
        self._lock = threading.Lock()
        self._events: deque[tuple[int, int, int]] = deque(maxlen=self.capacity)  # (seq, user, +1/-1)
        self._seq = 0
        self._resident: dict[int, int] = {}  # user -> cached tokens (as of the last collect)
        self._hot: list[int] = []
        self._next_hot_s = -float("inf")
        self._busy_s = 0.0
        self._served = 0
        self.service_time_us: float | None = None

    def reset(self) -> None:
        """Forget everything, as a restart would: a new epoch (a reader gets a full, empty snapshot
        next), no events, no resident users or hot shards, no service time."""
        with self._lock:
            self.epoch = secrets.token_hex(8)
            self._events.clear()
            self._resident = {}
            self._hot = []
            self._next_hot_s = -float("inf")
            self._busy_s = 0.0
            self._served = 0
            self.service_time_us = None

    # ------------------------------------------------------------------ worker thread side ---
    def note_served(self, busy_s: float, num_requests: int) -> None:
        """The device worker served ``num_requests`` in ``busy_s`` seconds (one micro-batch)."""
        self._busy_s += busy_s
        self._served += num_requests
        if self._served >= 8:  # an exponentially weighted mean of the recent batches
            st = self._busy_s / self._served * 1e6
            prev = self.service_time_us
            self.service_time_us = st if prev is None else 0.8 * prev + 0.2 * st
            self._busy_s, self._served = 0.0, 0

    def collect(self, engine, now_s: float) -> None:
        """Drain the engine's KV residency changes into the log; refresh hot shards when due.
        Called from the device worker (the only thread that touches the engine)."""
        kv = engine.mm.kv
        delta = kv.drain_residency()
        hot = None
        if self._item_shard is not None and now_s >= self._next_hot_s:
            self._next_hot_s = now_s + self.hot_interval_s
            resident = engine.mm.emb.resident_items(sort=False).cpu().numpy()
            resident = resident[resident < len(self._item_shard)]
            mass = np.bincount(self._item_shard[resident], weights=self._mass[resident], minlength=self.num_shards)
            coverage = mass / np.maximum(self._shard_mass, 1e-12)
            overall = float(mass.sum() / max(self._shard_mass.sum(), 1e-12))
            hot = np.flatnonzero(coverage >= min(self.hot_min_mass, self.hot_rel * overall)).tolist()
        if not delta.added and not delta.evicted and hot is None:
            return
        lens = {u: kv.num_tokens(u) for u in delta.added}
        with self._lock:
            for u in delta.evicted:
                self._seq += 1
                self._events.append((self._seq, u, -1))
                self._resident.pop(u, None)
            for u in delta.added:
                if lens[u] > 0:
                    self._seq += 1
                    self._events.append((self._seq, u, lens[u]))
                    self._resident[u] = lens[u]
            if hot is not None:
                self._hot = hot

    # --------------------------------------------------------------------- reader side ---
    @property
    def cursor(self) -> int:
        return self._seq

    def since(self, cursor: int = 0, epoch: str | None = None) -> dict:
        """The changes after ``cursor`` (see the module docstring)."""
        with self._lock:
            seq = self._seq
            first = self._events[0][0] if self._events else seq + 1
            full = epoch != self.epoch or cursor > seq or cursor < first - 1
            if full:
                users = list(self._resident)
                added, added_lens, evicted = users, [self._resident[u] for u in users], []
            else:
                # events are numbered consecutively: the first wanted one sits at cursor - first + 1
                last: dict[int, int] = {}  # a user's last change wins
                for i in range(cursor - first + 1, len(self._events)):
                    _, u, v = self._events[i]
                    last.pop(u, None)
                    last[u] = v
            hot = list(self._hot)
        if not full:
            added = [u for u, v in last.items() if v >= 0]
            added_lens = [v for v in last.values() if v >= 0]
            evicted = [u for u, v in last.items() if v < 0]
        return {"epoch": self.epoch, "cursor": seq, "full": full, "kv_added": added, "kv_cached_lens": added_lens,
                "kv_evicted": evicted, "hot_shards": hot, "num_shards": self.num_shards,
                "service_time_us": self.service_time_us}
