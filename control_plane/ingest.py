"""Report ingestion with group commit.

A report batch request is validated in the event loop, turned into rows and handed to one writer
thread; the request then awaits its commit. The writer takes every batch waiting, and those that
arrive within ``linger_s`` of the first one's arrival (up to ``max_rows`` report rows), and writes
them in one transaction on a connection of its own (no pool checkout or liveness ping per commit;
after a failure it takes a fresh one): ``INSERT ... ON CONFLICT (node_id,
seq) DO NOTHING RETURNING`` (so a replayed report is stored once and the reply counts it as a
duplicate), the decisions and bursts they carry, and each node's last-seen time. A commit costs
a fixed part (on PostgreSQL several round trips) and a part per row, so the linger trades a few
milliseconds of latency for fewer commits (at 1,000 reports/s and a 15-ms linger, 16-17 batches
shared each in bench.ingest's runs). At low load a batch commits alone once its linger has
passed. If a group's transaction fails, each batch is retried in its own transaction, so one bad
batch fails alone.

A full disk (SQLite) is a failure of its own: after one, no batch is written until the WAL has
been checkpointed into the database and truncated (`db.engine.reclaim_wal`), which is tried
before each later batch; until it works the batches get 503 and their nodes keep them. Space
freed on the disk then goes to the checkpoint first, not to a WAL that grows into it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from db import queries
from db.engine import reclaim_wal

log = logging.getLogger("racer.control_plane.ingest")


@dataclass
class Batch:
    node_id: str
    reports: list[dict]
    decisions: list[dict]
    bursts: list[dict]
    seen: tuple[float, int, float, str | None]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    queued_s: float = 0.0  # time.monotonic() when it was handed to the writer
    keys: set = field(default_factory=set)


class IngestWriter:
    def __init__(self, factory, metrics, max_rows: int = 5000, linger_s: float = 0.0):
        self.factory, self.metrics, self.max_rows, self.linger_s = factory, metrics, max_rows, linger_s
        self.disk_full = False  # set by a full disk; cleared once the WAL is reclaimed
        self._conn = None  # the writer's own connection (made on first use, dropped after a failure)
        self._q: queue.Queue[Batch | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="racer-ingest-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)
        self._drop_conn()

    async def submit(self, node_id: str, reports: list[dict], decisions: list[dict], bursts: list[dict],
                     seen: tuple) -> tuple[int, int]:
        """Write one node's batch; returns (stored, duplicates) once committed."""
        return await self.enqueue(node_id, reports, decisions, bursts, seen)

    def enqueue(self, node_id: str, reports: list[dict], decisions: list[dict], bursts: list[dict],
                seen: tuple) -> asyncio.Future:
        """Hand one node's batch to the writer (from the event loop); the future gets (stored,
        duplicates) once committed, or the write's exception."""
        loop = asyncio.get_running_loop()
        b = Batch(node_id, reports, decisions, bursts, seen, loop, loop.create_future(), time.monotonic())
        self._q.put(b)
        return b.future

    def _run(self) -> None:
        while True:
            first = self._q.get()
            if first is None:
                return
            group, rows = [first], len(first.reports)
            wait_s = first.queued_s + self.linger_s - time.monotonic()
            if wait_s > 0:  # one sleep, not a wake-up per batch arriving meanwhile
                time.sleep(wait_s)
            while rows < self.max_rows:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)
                    break
                group.append(nxt)
                rows += len(nxt.reports)
            try:
                self._attempt(group)
            except DiskFull as e:
                _settle([(b, None, e) for b in group])
            except Exception:  # noqa: BLE001 - retry one by one so one bad batch fails alone
                for b in group:
                    try:
                        self._attempt([b])
                    except Exception as e:  # noqa: BLE001
                        log.warning("report batch of %s refused: %s", b.node_id, e)
                        _settle([(b, None, e)])

    def _attempt(self, group: list[Batch]) -> None:
        """`_write` ``group``, after reclaiming the WAL if the disk was full; a write that finds
        the disk full marks it so."""
        self._reclaim()
        try:
            self._write(group)
        except Exception as e:
            self._drop_conn()
            if _is_disk_full(e):
                self.disk_full = True
            raise

    def _connection(self):
        """The writer's own connection (made when missing): a Core connection, no Session, whose
        bookkeeping cost about a fifth of a commit's CPU."""
        if self._conn is None:
            self._conn = self.factory.kw["bind"].connect()
        return self._conn

    def _drop_conn(self) -> None:
        """Give the writer's connection back (after a failure: the next write takes a fresh one,
        checked by the pool)."""
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001 - already broken
                pass
            self._conn = None

    def _reclaim(self) -> None:
        """After a full disk: checkpoint and truncate the WAL before writing again (DiskFull until
        that works)."""
        if not self.disk_full:
            return
        engine = self.factory.kw["bind"]
        try:
            done = reclaim_wal(engine)
        except Exception as e:  # noqa: BLE001 - still full, or busy
            raise DiskFull(f"database or disk is full; the write-ahead log could not be reclaimed yet "
                           f"({type(e).__name__}: {str(e)[:200]})") from None
        if not done:
            raise DiskFull("database or disk is full; the write-ahead log could not be reclaimed yet (busy)")
        log.warning("write-ahead log reclaimed after a full disk: writing again")
        self.disk_full = False

    def _write(self, group: list[Batch]) -> None:
        t0 = time.perf_counter()
        reports = [r for b in group for r in b.reports]
        seen: dict[str, tuple] = {}
        for b in group:
            old = seen.get(b.node_id)
            if old is None or b.seen[1] > old[1]:
                seen[b.node_id] = b.seen
        conn = self._connection()
        with conn.begin():
            inserted = queries.insert_reports(conn, reports)
            queries.insert_decisions(conn, [d for b in group for d in b.decisions])
            queries.upsert_bursts(conn, [x for b in group for x in b.bursts])
            queries.touch_nodes(conn, seen)
        self.metrics.ingest_commit.observe(time.perf_counter() - t0)
        self.metrics.ingest_commit_rows.observe(len(reports))
        outcomes = []
        for b in group:
            stored = sum(1 for r in b.reports if (r["node_id"], r["seq"]) in inserted)
            outcomes.append((b, (stored, len(b.reports) - stored), None))
        _settle(outcomes)


class DiskFull(RuntimeError):
    """The disk was full and the WAL is not reclaimed yet: retry later (503)."""


def _is_disk_full(e: BaseException) -> bool:
    text = str(e).lower()
    return "disk is full" in text or "disk i/o error" in text or "no space left" in text


def _settle(outcomes: list[tuple[Batch, object, BaseException | None]]) -> None:
    """Set each batch's future (its result, or its exception when not None) in its event loop:
    one call into each loop for the whole group (each call wakes the loop)."""
    by_loop: dict = {}
    for o in outcomes:
        by_loop.setdefault(o[0].loop, []).append(o)
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_set_all, items)


def _set_all(items) -> None:
    for b, value, e in items:
        if b.future.done():
            continue
        if e is None:
            b.future.set_result(value)
        else:
            b.future.set_exception(e)
