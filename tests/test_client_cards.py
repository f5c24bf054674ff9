"""The overview's client chart history (`dashboard.client_cards._History`) against a fake
``GET /gateway-reports`` with the API's semantics: the newest ``limit`` reports of
``[start_s, end_s)``, oldest first. No browser, no server."""

from __future__ import annotations

import bisect

from dashboard.client_cards import PAGE_ROWS, _History, clients_figure, read_span


class FakeApi:
    """Gateway reports in memory, answered as the control plane does (and counted)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.calls: list[tuple] = []

    def add(self, gateway_id: str, seq: int, ts_s: float, p99_ms: float = 10.0) -> dict:
        r = {"gateway_id": gateway_id, "seq": seq, "ts_s": ts_s, "interval_s": 1.0, "p99_ms": p99_ms,
             "num_failed": 0, "load_phase": None, "details": {}}
        self.rows.insert(bisect.bisect_right([x["ts_s"] for x in self.rows], ts_s), r)
        return r

    def fetch(self, start_s: float, end_s: float | None, limit: int) -> list[dict]:
        self.calls.append((start_s, end_s, limit))
        span = [r for r in self.rows if r["ts_s"] >= start_s and (end_s is None or r["ts_s"] < end_s)]
        return span[-limit:]

    def gateways(self) -> list[dict]:
        last: dict[str, int] = {}
        first: dict[str, float] = {}
        for r in self.rows:
            last[r["gateway_id"]] = max(last.get(r["gateway_id"], -1), r["seq"])
            first[r["gateway_id"]] = min(first.get(r["gateway_id"], r["ts_s"]), r["ts_s"])
        return [{"gateway_id": g, "last_seq": s, "first_seen_s": first[g], "interval_s": 1.0}
                for g, s in sorted(last.items())]


def test_the_24_h_range_is_read_whole_in_pages_and_drawn_without_gaps():
    """86,400 reports (24 h at 1 s) are more than one page: the first read pages back through the
    whole range, a bounded number of requests, and every bucket of the chart has data."""
    api = FakeApi()
    now = 1_000_000.0
    day = 86_400
    api.rows = [{"gateway_id": "g", "seq": k, "ts_s": now - day + 0.5 + k, "interval_s": 1.0, "p99_ms": 5.0,
                 "num_failed": 0, "load_phase": None} for k in range(day)]
    h = _History()
    rows, changed = h.update("sid", float(day), now, api.fetch, api.gateways())
    assert changed == "new" and len(rows) == day
    assert [r["seq"] for r in rows] == list(range(day))  # time order, each once
    assert len(api.calls) <= day // PAGE_ROWS + 2
    fig = clients_figure(rows, now, float(day))
    p99 = list(fig.data[0].y)
    assert len(p99) >= 144 and all(v is not None for v in p99[1:])  # the first bucket may start before the range


def test_read_span_pages_through_reports_sharing_an_instant_and_stops_at_its_bound():
    api = FakeApi()
    for k in range(25):
        api.add("a", k, 100.0 + k // 5)  # five reports each second
    got, complete = read_span(api.fetch, 0.0, page_rows=7)
    assert complete and sorted({(r["gateway_id"], r["seq"]) for r in got}) == [("a", k) for k in range(25)]
    got, complete = read_span(api.fetch, 0.0, max_pages=2, page_rows=7)
    assert not complete and len(got) == 14


def test_a_report_stored_late_is_drawn():
    """A second gateway posting a little late, and a gateway replaying its backlog after an outage
    (reports older than the newest held), both reach the chart on the next tick."""
    api = FakeApi()
    now = 10_000.0
    for k in range(60):
        api.add("a", k, now - 60 + k)
        if k < 50:
            api.add("b", 1000 + k, now - 60 + k)
    h = _History()
    rows, _ = h.update("sid", 900.0, now, api.fetch, api.gateways())
    assert len(rows) == 110
    api.add("b", 1050, now - 9.5)  # b posts its report of 9.5 s ago now: a's newer ones are held
    rows, changed = h.update("sid", 900.0, now + 1, api.fetch, api.gateways())
    assert changed is True and ("b", 1050) in {(r["gateway_id"], r["seq"]) for r in rows}
    # a third gateway held up to 400 s ago replays 300 s of backlog at once (older than any look-back)
    for k in range(5):
        api.add("c", 5000 + k, now - 405 + k)
    rows, _ = h.update("sid", 900.0, now + 2, api.fetch, api.gateways())
    assert {r["seq"] for r in rows if r["gateway_id"] == "c"} == set(range(5000, 5005))
    for k in range(5, 305):
        api.add("c", 5000 + k, now - 405 + k)
    rows, changed = h.update("sid", 900.0, now + 3, api.fetch, api.gateways())
    assert changed is True and {r["seq"] for r in rows if r["gateway_id"] == "c"} == set(range(5000, 5305))
    assert [r["ts_s"] for r in rows] == sorted(r["ts_s"] for r in rows)
    assert len(rows) == len({(r["gateway_id"], r["seq"]) for r in rows}) == 111 + 305
    fig = clients_figure(rows, now + 3, 900.0)
    assert sum(v is not None for v in fig.data[0].y) >= 72  # 5 s buckets: c's 61 and a's 12 (one shared)
    # once read, a quiet tick asks only for the look-back, not the whole range again
    api.calls.clear()
    h.update("sid", 900.0, now + 4, api.fetch, api.gateways())
    assert len(api.calls) == 1 and api.calls[0][0] >= now - 60
    # a gateway new here: read from what it may have kept unsent (600 intervals) before it was first seen
    api.add("d", 1, now + 4.5)
    rows, _ = h.update("sid", 900.0, now + 5, api.fetch, api.gateways())
    assert ("d", 1) in {(r["gateway_id"], r["seq"]) for r in rows} and api.calls[-1][0] == now + 4.5 - 600.0


def test_the_clients_chart_starts_at_its_first_report_as_the_nodes_charts_do():
    """Two minutes of gateway reports in a 15-minute range: the chart's buckets start at the first
    report's bucket (the nodes' charts start at their first report too), not 13 empty minutes
    before it; with no report in the range it spans the range, every bucket a gap."""
    now = 10_000.0
    rows = [{"gateway_id": "g", "seq": k, "ts_s": now - 120 + k, "p99_ms": 5.0, "num_failed": 0} for k in range(120)]
    rows.insert(0, {"gateway_id": "g", "seq": -1, "ts_s": now - 2000, "p99_ms": 9.0, "num_failed": 0})  # out of range
    fig = clients_figure(rows, now, 900.0)
    xs = list(fig.data[0].x)
    assert xs[0] == int(round((now - 120) // 5 * 5 * 1000)) and len(xs) == 24
    assert all(v is not None for v in fig.data[0].y)
    empty = clients_figure([], now, 900.0)
    assert len(empty.data[0].x) == 180 and set(empty.data[0].y) == {None}
