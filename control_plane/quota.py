"""Per-node ingestion quotas: one node token may not fill the database.

Each node has two token buckets, one on report rows and one on report-batch body bytes, each
refilled at a sustained rate up to a burst. A batch takes from both before it is stored (the
bytes before the body is parsed, the rows once it is); a batch that finds either bucket short is
answered 429 with ``Retry-After`` (the seconds until the bucket holds enough), nothing stored,
and the node's reporter keeps it and retries after that long. The bursts are sized for a node
flushing a full spool after an outage; the rates are tens of times what a node reporting every
second sends. With ``raw_retention_s`` they bound what one node can keep in the database:
``rows_per_s * raw_retention_s`` raw rows, at most.
"""

from __future__ import annotations

import math
import threading
import time


class TokenBucket:
    """``rate`` per second up to ``burst``; starts full."""

    __slots__ = ("rate", "burst", "level", "at")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.level, self.at = float(rate), float(burst), float(burst), now

    def refill(self, now: float) -> None:
        self.level = min(self.burst, self.level + max(0.0, now - self.at) * self.rate)
        self.at = now

    def wait_s(self, amount: float) -> float:
        """Seconds until ``amount`` is there (0: now); an amount past the burst is never there
        (inf)."""
        if amount > self.burst:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)


class NodeQuota:
    """The buckets of every node (bounded: node ids come from tokens bound to them)."""

    def __init__(self, rows_per_s: float, burst_rows: float, bytes_per_s: float, burst_bytes: float,
                 clock=time.monotonic) -> None:
        self.rows_per_s, self.burst_rows = float(rows_per_s), float(burst_rows)
        self.bytes_per_s, self.burst_bytes = float(bytes_per_s), float(burst_bytes)
        self.clock = clock
        self._buckets: dict[str, tuple[TokenBucket, TokenBucket]] = {}
        self._lock = threading.Lock()

    def take(self, node_id: str, rows: int = 0, nbytes: int = 0) -> float:
        """Take ``rows`` and ``nbytes`` from ``node_id``'s buckets: 0.0 when taken, else the seconds
        to wait before asking again (nothing taken; inf: the batch is past a burst, never)."""
        now = self.clock()
        with self._lock:
            pair = self._buckets.get(node_id)
            if pair is None:
                pair = self._buckets[node_id] = (TokenBucket(self.rows_per_s, self.burst_rows, now),
                                                 TokenBucket(self.bytes_per_s, self.burst_bytes, now))
            rb, bb = pair
            rb.refill(now)
            bb.refill(now)
            wait = max(rb.wait_s(rows), bb.wait_s(nbytes))
            if wait > 0:
                return wait
            rb.level -= rows
            bb.level -= nbytes
            return 0.0
