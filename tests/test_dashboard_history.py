"""dashboard.history.HistoryCache: complete buckets only, one read per new span, late reports
refetched, clear after an outage. The fetch function here serves rows from a list held in the
test (the cache's own logic is under test; the browser tests use it against the real API)."""

from __future__ import annotations

import math

from dashboard.history import HistoryCache

STEP = 10.0


class Source:
    """Per-node reports; answers ``fetch(token, start_s, end_s, step_s)`` with bucket means."""

    def __init__(self):
        self.reports: list[tuple[str, float, float]] = []  # node, ts, p99
        self.calls: list[tuple[float, float]] = []

    def add(self, node: str, t0: float, t1: float, value: float) -> None:
        t = t0
        while t < t1:
            self.reports.append((node, t, value))
            t += 1.0

    def fetch(self, token, *, start_s, end_s, step_s):
        assert token == "tok"
        self.calls.append((start_s, end_s))
        buckets: dict = {}
        for node, t, v in self.reports:
            if start_s <= t < end_s:
                buckets.setdefault((node, math.floor(t / step_s) * step_s), []).append(v)
        return [{"node_id": n, "ts_s": b, "p99_ms": sum(vs) / len(vs), "num_reports": len(vs)}
                for (n, b), vs in sorted(buckets.items(), key=lambda kv: (kv[0][1], kv[0][0]))]


def test_only_complete_buckets_and_one_read_per_new_span():
    src = Source()
    src.add("a", 1000, 1100, 5.0)
    src.add("b", 1000, 1100, 7.0)
    cache = HistoryCache(src.fetch, grace_s=2.0, refetch_buckets=0)
    rows = cache.rows("tok", STEP, 1000, now_s=1055)  # buckets up to 1040 are complete (1050 + 10 > 1053)
    assert sorted({r["ts_s"] for r in rows}) == [1000, 1010, 1020, 1030, 1040]
    assert src.calls == [(1000, 1050)] and all(r["num_reports"] == 10 for r in rows)
    # the same range again: nothing new is complete, no read
    assert cache.rows("tok", STEP, 1000, now_s=1056) == rows and src.calls == [(1000, 1050)]
    # later: only the new span is read
    new = cache.since("tok", STEP, 1040, 1000, now_s=1075)
    assert [(r["node_id"], r["ts_s"]) for r in new] == [("a", 1050), ("b", 1050), ("a", 1060), ("b", 1060)]
    assert src.calls[-1] == (1050, 1070)
    # a longer range than held: read from its start
    src.add("a", 900, 1000, 3.0)
    rows = cache.rows("tok", STEP, 905, now_s=1075)
    assert rows[0]["ts_s"] == 900 and src.calls[-1] == (900, 1070)


def test_late_reports_are_refetched_and_clear_forgets_everything():
    src = Source()
    src.add("a", 1000, 1050, 5.0)
    cache = HistoryCache(src.fetch, grace_s=2.0, refetch_buckets=2)
    first = cache.rows("tok", STEP, 1000, now_s=1063)
    assert [r["ts_s"] for r in first] == [1000, 1010, 1020, 1030, 1040, 1050][: len(first)]
    src.add("b", 1030, 1050, 9.0)  # node b replays buffered reports into buckets already read
    keys = {(r["node_id"], r["ts_s"]) for r in cache.rows("tok", STEP, 1000, now_s=1064)}
    assert ("b", 1040) in keys  # within the refetched tail (the last 2 buckets before 1060)
    assert ("b", 1030) not in keys  # older than the tail: seen only after clear()
    cache.clear()
    assert ("b", 1030) in {(r["node_id"], r["ts_s"]) for r in cache.rows("tok", STEP, 1000, now_s=1064)}
    assert cache.rows("tok", STEP, 1070, now_s=1064) == []
