"""What clients see: the gateway's per-interval figures (`gateway.client_view`, pure, on a
virtual clock), their API (``/api/v1/gateways``: stored idempotently, bound to the token that
claimed the id, hostile input refused with a 4xx), migration 0005, and the dashboard's reading
of them (`dashboard.client_cards`: gaps, not zeros; live, idle, failing, stalled)."""

from __future__ import annotations

import json
import math

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import inspect

from gateway.client_view import ClientView, clean_phase, node_total_us, outcome_of
from dashboard.client_cards import client_state

from .cp_util import Database, backends, migrated_db as db, token_maker  # noqa: F401 - the fixture

ADMIN = "racer_test_admin_client_view"


# ------------------------------------------------------------------------------ the gateway ---
def test_client_view_interval_figures_by_outcome_with_gaps_not_zeros():
    t = [1000.0]
    v = ClientView(slo_ms=30.0, clock=lambda: t[0], seq0=7)
    for ms in (10, 20, 25, 40):
        v.record(200, ms / 1e3, phase="steady[0-60s]")
    v.record(200, 0.012, retried=True, phase="burst[60-90s]")
    v.record(503, 0.001)
    v.record(502, 0.050, retried=True)
    v.record(422, 0.002)
    v.attempt("n1", 0.020, failed=False, node_total_us=15_000.0, inflight=3)
    v.attempt("n1", 0.030, failed=False, node_total_us=10_000.0, inflight=1)
    v.attempt("n2", 0.001, failed=True, inflight=1)
    t[0] = 1001.0
    r = v.close(num_live_nodes=1, num_nodes=2, live={"n1": True, "n2": False, "n3": True})
    assert (r["seq"], r["ts_s"], r["interval_s"]) == (7, 1001.0, 1.0)
    assert (r["num_requests"], r["num_ok"], r["num_failed"], r["num_503"], r["num_retried"]) == (8, 5, 2, 1, 2)
    # served within 30 ms: 10, 20, 25, 12 of the 7 not refused as the client's own fault (the 422)
    assert r["slo_attainment"] == round(4 / 7, 6)
    assert r["p50_ms"] == 20.0 and r["p99_ms"] == pytest.approx(39.4, abs=1e-6)  # served requests only
    assert r["outcomes"]["no_live_node"] == {"num_requests": 1, "p50_ms": 1.0, "p99_ms": 1.0}
    assert set(r["outcomes"]) == {"ok", "no_live_node", "upstream_error", "client_error"}
    assert r["statuses"] == {"200": 5, "422": 1, "502": 1, "503": 1}
    n1, n2, n3 = r["nodes"]
    assert n1 == {"node_id": "n1", "num_attempts": 2, "num_failed": 0, "upstream_p99_ms": pytest.approx(29.9),
                  "pre_node_p50_ms": pytest.approx(12.5), "pre_node_p99_ms": pytest.approx(19.85),
                  "max_inflight": 3, "live": True}
    assert (n2["num_failed"], n2["upstream_p99_ms"], n2["pre_node_p50_ms"], n2["live"]) == (1, None, None, False)
    assert n3 == {"node_id": "n3", "num_attempts": 0, "num_failed": 0, "upstream_p99_ms": None,
                  "pre_node_p50_ms": None, "pre_node_p99_ms": None, "max_inflight": 0, "live": True}
    assert r["phases"] == {"steady[0-60s]": 4, "burst[60-90s]": 1} and r["load_phase"] == "burst[60-90s]"
    # the next interval: nothing happened; a report still, its figures null (a gap), not 0
    t[0] = 1002.5
    r2 = v.close()
    assert (r2["seq"], r2["num_requests"], r2["interval_s"]) == (8, 0, 1.5)
    assert r2["p50_ms"] is None and r2["p99_ms"] is None and r2["slo_attainment"] is None
    assert r2["load_phase"] is None and r2["outcomes"] == {} and r2["nodes"] == []


def test_client_view_helpers():
    assert [outcome_of(s) for s in (200, 204, 413, 422, 404, 503, 504, 502, 500)] == [
        "ok", "ok", "too_large", "client_error", "client_error", "no_live_node", "upstream_timeout",
        "upstream_error", "upstream_error"]
    assert clean_phase(b"burst[60-90s]") == "burst[60-90s]" and clean_phase(" steady ") == "steady"
    assert clean_phase(None) is None and clean_phase("x" * 65) is None and clean_phase("<script>") is None
    assert clean_phase(b"\xff\xfe") is None and clean_phase("") is None
    ans = b'{"items":[1],"latency_us":{"queue_us":3.0,"total_us":1234.5},"served_by":"n"}'
    assert node_total_us(ans) == 1234.5
    assert node_total_us(b'{"latency_us":{"total_us":1e400}}') is None
    assert node_total_us(b'{"error":"x"}') is None and node_total_us(b'"total_us":-5}') is None
    v = ClientView(clock=lambda: 0.0, max_samples=10)
    for k in range(1000):  # samples stay bounded; counts stay exact
        v.record(200, k / 1e3)
    assert len(v.latency["ok"].values) == 10 and v.outcomes["ok"] == 1000
    with pytest.raises(ValueError):
        ClientView(slo_ms=math.nan)


# ------------------------------------------------------------------------------------- API ---
def _report(seq: int, ts: float, **kw) -> dict:
    d = {"seq": seq, "ts_s": ts, "interval_s": 1.0, "slo_ms": 30.0, "num_requests": 10, "num_ok": 8,
         "num_failed": 2, "num_retried": 1, "num_503": 1, "p50_ms": 5.0, "p99_ms": 40.0, "slo_attainment": 0.7,
         "outcomes": {"ok": {"num_requests": 8, "p50_ms": 5.0, "p99_ms": 40.0},
                      "no_live_node": {"num_requests": 1}, "upstream_error": {"num_requests": 1}},
         "statuses": {"200": 8, "502": 1, "503": 1},
         "nodes": [{"node_id": "n1", "num_attempts": 9, "num_failed": 1, "pre_node_p99_ms": 2.0, "live": True}],
         "num_live_nodes": 1, "num_nodes": 2, "load_phase": "burst[60-90s]", "phases": {"burst[60-90s]": 10}}
    d.update(kw)
    return d


@pytest.fixture()
def api(tmp_path):
    from control_plane.api import create_app
    from control_plane.settings import Settings

    now = [2000.0]
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'cp.db'}", scheduler=False, admin_token=ADMIN),
                     clock=lambda: now[0])
    with TestClient(app) as c:
        yield c, token_maker(c, ADMIN), now, app


def test_gateway_reports_are_stored_once_bound_to_their_token_and_read_back(api):
    c, token, now, _ = api
    gw, other, viewer = token("router"), token("router"), token("viewer")
    node = token("node", node_id="n1")
    url = "/api/v1/gateways/gw-1/reports"
    r = c.post(url, json={"reports": [_report(5, 1999.0), _report(6, 2000.0)]}, headers=gw)
    assert r.status_code == 200 and r.json() == {"stored": 2, "duplicates": 0}, r.text
    r = c.post(url, json={"reports": [_report(6, 2000.0, p99_ms=99.0), _report(7, 2001.0)]}, headers=gw)
    assert r.json() == {"stored": 1, "duplicates": 1}
    # another token may not report as gw-1 while the first is valid; a node or viewer token never
    r = c.post(url, json={"reports": [_report(8, 2002.0)]}, headers=other)
    assert r.status_code == 403 and "another token" in r.json()["detail"]
    for h in (node, viewer):
        assert c.post(url, json={"reports": [_report(8, 2002.0)]}, headers=h).status_code == 403
    assert c.post(url, json={"reports": [_report(8, 2002.0)]}).status_code == 401
    assert c.post("/api/v1/gateways/gw-2/reports", json={"reports": [_report(1, 2000.0)]},
                  headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200  # an operator may too
    now[0] = 2001.5
    gws = {g["gateway_id"]: g for g in c.get("/api/v1/gateways", headers=viewer).json()}
    g = gws["gw-1"]
    assert g["last_seq"] == 7 and g["stalled"] is False and g["age_s"] == pytest.approx(1.5)
    assert g["last_report"]["seq"] == 7 and g["last_report"]["load_phase"] == "burst[60-90s]"
    assert g["last_report"]["details"]["nodes"][0]["pre_node_p99_ms"] == 2.0
    now[0] = 2003.0  # more than two intervals since gw-1's last report: stalled
    assert {g["gateway_id"]: g["stalled"] for g in c.get("/api/v1/gateways", headers=viewer).json()} == {
        "gw-1": True, "gw-2": True}
    rows = c.get("/api/v1/gateway-reports", params={"gateway_id": "gw-1", "start_s": 1999.5}, headers=viewer).json()
    assert [(x["seq"], x["p99_ms"]) for x in rows] == [(6, 40.0), (7, 40.0)]  # the replay changed nothing
    assert c.get("/api/v1/gateways", headers=gw).status_code == 403  # a gateway reports, it does not read


HOSTILE = [
    {"reports": []},
    {"reports": [_report(1, 1.0), _report(1, 2.0)]},
    {"reports": [_report(1, 1.0, p99_ms=float("inf"))]},
    {"reports": [_report(1, 1.0, num_ok=11)]},
    {"reports": [_report(1, 1.0, slo_attainment=1.5)]},
    {"reports": [_report(-1, 1.0)]},
    {"reports": [_report(2**63, 1.0)]},
    {"reports": [_report(1, 1e12)]},
    {"reports": [_report(1, 1.0, outcomes={"weird": {"num_requests": 1}})]},
    {"reports": [_report(1, 1.0, statuses={"abc": 1})]},
    {"reports": [_report(1, 1.0, load_phase="<img src=x>")]},
    {"reports": [_report(1, 1.0, phases={f"p{k}": 1 for k in range(40)})]},
    {"reports": [_report(1, 1.0, nodes=[{"node_id": "bad id"}])]},
    {"reports": [_report(1, 1.0, extra_field=1)]},
    {"reports": [_report(k, 1.0) for k in range(200)]},
    {"reports": "x"}, [], "null",
]


def test_hostile_gateway_reports_get_a_4xx_and_store_nothing(api):
    c, token, _, _ = api
    h = token("router")
    for bad in HOSTILE:
        r = c.post("/api/v1/gateways/gw-h/reports", content=json.dumps(bad),  # Infinity too
                   headers={**h, "content-type": "application/json"})
        assert r.status_code == 422, (bad, r.text)
    assert c.post("/api/v1/gateways/bad%20id/reports", json={"reports": [_report(1, 1.0)]},
                  headers=h).status_code == 422
    assert c.get("/api/v1/gateways", headers={"Authorization": f"Bearer {ADMIN}"}).json() == []


@pytest.mark.parametrize("backend", backends())
def test_migration_0005_upgrades_and_downgrades(backend, tmp_path):
    from alembic import command

    from db.engine import alembic_config, current_revision, make_engine, upgrade

    d = Database(backend, tmp_path)
    engine = make_engine(d.url)
    try:
        upgrade(engine, "0004")
        assert "gateway_reports" not in inspect(engine).get_table_names()
        upgrade(engine, "0005")
        assert {"gateways", "gateway_reports"} <= set(inspect(engine).get_table_names())
        uqs = {tuple(u["column_names"]) for u in inspect(engine).get_unique_constraints("gateway_reports")}
        assert ("gateway_id", "seq") in uqs
        cfg = alembic_config(engine)
        with engine.connect() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0004")
            conn.commit()
        assert current_revision(engine) == "0004"
        assert not {"gateways", "gateway_reports"} & set(inspect(engine).get_table_names())
        upgrade(engine, "0005")
        assert current_revision(engine) == "0005"
    finally:
        engine.dispose()
        d.drop()


def test_gateway_reports_insert_once_on_each_backend(db):
    from db import queries

    _, factory = db
    row = dict(gateway_id="g", seq=2**40, ts_s=1.0, received_s=1.0, interval_s=1.0, num_requests=3, num_ok=2,
               num_failed=1, num_retried=0, num_503=1, p50_ms=1.0, p99_ms=2.0, slo_ms=30.0, slo_attainment=0.5,
               num_live_nodes=1, load_phase="burst", details={"statuses": {"200": 2, "503": 1}})
    with factory.begin() as s:
        queries.touch_gateway(s, gateway_id="g", token_id=1, now_s=1.0, last_seq=2**40 + 1, interval_s=1.0)
        assert queries.insert_gateway_reports(s, [row, dict(row, seq=2**40 + 1)]) == {("g", 2**40), ("g", 2**40 + 1)}
    with factory.begin() as s:
        assert queries.insert_gateway_reports(s, [dict(row, p99_ms=9.0), dict(row, seq=3)]) == {("g", 3)}
    with factory() as s:
        got = queries.gateway_reports(s, gateway_id="g", start_s=None, end_s=None, limit=10)
        assert sorted((r.seq, r.p99_ms) for r in got) == [(3, 2.0), (2**40, 2.0), (2**40 + 1, 2.0)]
        (gw, last), = queries.list_gateways(s)
        assert gw.last_seq == 2**40 + 1 and last.seq == 2**40 + 1 and last.details["statuses"]["503"] == 1
    from control_plane.jobs import job_retention
    from control_plane.settings import Settings

    with factory.begin() as s:
        # one in the window, and one whose clock claims the far future but was received long ago
        queries.insert_gateway_reports(s, [dict(row, seq=9, ts_s=1000.0, received_s=1000.0),
                                           dict(row, seq=10, ts_s=9.9e10, received_s=1.0)])
    out = job_retention(factory, Settings(raw_retention_s=500.0), None, now_s=1200.0)  # keeps what is >= 700
    assert out["gateway_reports_deleted"] == 4 and out["gateways_deleted"] == 0  # "g" still has a report
    with factory() as s:
        assert [r.seq for r in queries.gateway_reports(s, gateway_id=None, start_s=None, end_s=None, limit=10)] == [9]
    out = job_retention(factory, Settings(raw_retention_s=500.0), None, now_s=5000.0)
    assert out["gateway_reports_deleted"] == 1 and out["gateways_deleted"] == 1  # gone and silent: forgotten
    with factory() as s:
        assert queries.list_gateways(s) == []


# ------------------------------------------------------------------------------- dashboard ---
def _gw(age_s: float, interval_s: float = 1.0, **rep) -> dict:
    last = None if rep.get("none") else {**_report(1, 0.0), **rep}
    return {"gateway_id": "g", "age_s": age_s, "interval_s": interval_s, "stalled": age_s > 2 * interval_s,
            "last_report": last}


def test_dashboard_reads_live_idle_failing_stalled_and_gaps():
    s = client_state([])
    assert s["state"] == "none" and s["p99_ms"] is None and s["slo_attainment"] is None and s["banner"] is None
    s = client_state([_gw(0.5)])
    assert s["state"] == "live" and s["p99_ms"] == 40.0 and s["num_failed"] == 2 and s["num_503"] == 1
    assert s["load_phase"] == "burst[60-90s]" and s["banner"] is None
    s = client_state([_gw(0.5, num_requests=0, num_ok=0, num_failed=0, num_retried=0, num_503=0, p50_ms=None,
                          p99_ms=None, slo_attainment=None, outcomes={}, statuses={})])
    assert s["state"] == "idle" and s["p99_ms"] is None and s["slo_attainment"] is None and s["banner"] is None
    s = client_state([_gw(0.5, num_ok=0, num_failed=10, num_503=10, p50_ms=None, p99_ms=None,
                          slo_attainment=0.0, outcomes={"no_live_node": {"num_requests": 10}})])
    assert s["state"] == "failing" and "no request served" in s["banner"][0]
    s = client_state([_gw(3.5)])  # one whole interval without a report
    assert s["state"] == "stalled" and "no report" in s["banner"][0] and s["p99_ms"] is None
    old = dict(_gw(4000.0), gateway_id="old")  # replaced long ago: no banner while another reports
    s = client_state([old, _gw(0.5)])
    assert s["state"] == "live" and s["banner"] is None and s["num_gone"] == 1
    s = client_state([old])  # the only one: stalled, however long ago
    assert s["state"] == "stalled" and "old" in s["banner"][0] and s["num_gone"] == 0


def test_clients_chart_buckets_with_gaps_and_reads_only_what_is_new():
    from dashboard.client_cards import _History, clients_figure

    now = 10_000.0
    rows = [{"ts_s": now - 100.0, "p99_ms": 12.0, "num_failed": 0}, {"ts_s": now - 99.0, "p99_ms": 30.0, "num_failed": 1},
            {"ts_s": now - 20.0, "p99_ms": None, "num_failed": 7}]
    fig = clients_figure(rows, now, 900.0, slo_ms=50.0)  # 5 s buckets
    p99, failed = list(fig.data[0].y), list(fig.data[1].y)
    assert len(p99) == len(failed) == 20  # from the first report's bucket to now
    k = [i for i, v in enumerate(failed) if v is not None]
    assert [(p99[i], failed[i]) for i in k] == [(30.0, 1), (None, 7)]  # the worst P99; nothing served: no P99
    assert sum(v is None for v in p99) == 19  # no report: a gap, never 0
    assert fig.layout.shapes[0].y0 == 50.0 and fig.data[0].x[1] - fig.data[0].x[0] == 5000
    assert fig.data[2].showlegend is False  # no burst named by the load: no band, no legend entry
    # the load generator's burst phases (as clients named them) shaded, touching intervals merged
    phased = [{"ts_s": now - 50.0 + k, "interval_s": 1.0, "load_phase": p} for k, p in enumerate(
        ["steady[0-60s]", "burst[60-90s]", "burst[60-90s]", "burst[60-90s]", "trend[90-120s]", "burst", "burst"])]
    bands = [sh for sh in clients_figure(phased, now, 900.0).layout.shapes if sh.name == "load_burst"]
    assert [(sh.x0, sh.x1) for sh in bands] == [(int((now - 50.0) * 1000), int((now - 47.0) * 1000)),
                                                (int((now - 46.0) * 1000), int((now - 44.0) * 1000))]
    calls = []

    def fetch(rows_):
        def f(since, end, limit):
            calls.append(since)
            return rows_
        return f

    h = _History()
    r1 = {"gateway_id": "g", "seq": 1, "ts_s": now - 10, "p99_ms": 1.0, "num_failed": 0, "details": {}}
    got, changed = h.update("sid", 900.0, now, fetch([r1]))
    assert changed == "new" and len(got) == 1 and calls == [now - 900.0]
    r2 = dict(r1, seq=2, ts_s=now - 5)
    got, changed = h.update("sid", 900.0, now, fetch([r1, r2]))  # r1 again (the look-back): kept once
    assert changed is True and [r["seq"] for r in got] == [1, 2] and calls[-1] == now - 10 - 30.0
    got, changed = h.update("sid", 900.0, now, fetch([r2]))
    assert changed is False
    got, changed = h.update("sid", 900.0, now + 6, fetch([]))  # a bucket boundary passed: redraw
    assert changed is True
    got, changed = h.update("sid", 300.0, now + 6, fetch([r2]))  # another range: read again, draw whole
    assert changed == "new" and [r["seq"] for r in got] == [2]


def test_gateway_sends_its_reports_keeps_them_while_refused_and_halves_a_batch_over_the_cap():
    import asyncio

    import httpx

    from gateway.gateway import Gateway

    seen: list[int] = []
    mode = {"status": 503}

    def handler(request: httpx.Request) -> httpx.Response:
        n = len(json.loads(request.content)["reports"])
        assert request.headers["authorization"] == "Bearer tok" and request.url.path == "/api/v1/gateways/gw-9/reports"
        if mode["status"] == 200 and n > 2:
            return httpx.Response(413, json={"detail": "body too large"})
        seen.append(n)
        return httpx.Response(mode["status"], json={"stored": n, "duplicates": 0})

    async def run():
        gw = Gateway([], control_plane="http://cp", token="tok", gateway_id="gw-9")
        gw.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        for _ in range(4):  # the control plane unavailable: every report kept
            await gw.report_clients()
        assert len(gw.client_reports) == 4 and gw.client_report_error.startswith("503")
        mode["status"] = 200
        await gw.report_clients()  # five pending, batches over 2 refused with 413: sent in halves
        assert len(gw.client_reports) == 0 and gw.client_reports_sent == 5 and gw.client_report_error is None
        mode["status"] = 422  # refused for good: dropped, not resent forever
        await gw.report_clients()
        assert len(gw.client_reports) == 0 and gw.client_report_error.startswith("422")
        await gw.client.aclose()

    asyncio.run(run())
    assert seen[-4:-1] == [2, 2, 1] and sum(seen[4:-1]) == 5


def test_per_node_rows_merge_the_fresh_gateways():
    from dashboard.client_cards import node_rows

    a = _gw(0.5, details={"nodes": [{"node_id": "n1", "num_attempts": 5, "num_failed": 1, "pre_node_p50_ms": 2.0,
                                     "pre_node_p99_ms": 6.0, "live": True},
                                    {"node_id": "n2", "num_attempts": 0, "num_failed": 0, "pre_node_p50_ms": None,
                                     "pre_node_p99_ms": None, "live": False}]})
    b = _gw(0.5, details={"nodes": [{"node_id": "n1", "num_attempts": 3, "num_failed": 0, "pre_node_p50_ms": 4.0,
                                     "pre_node_p99_ms": 9.0, "live": True}]})
    stale = _gw(9.0, details={"nodes": [{"node_id": "n9", "num_attempts": 1}]})
    assert node_rows([a, b, stale]) == [
        {"node_id": "n1", "num_attempts": 8, "num_failed": 1, "pre_node_p99_ms": 9.0, "live": True, "pre_node_p50_ms": 3.0},
        {"node_id": "n2", "num_attempts": 0, "num_failed": 0, "pre_node_p99_ms": None, "live": False,
         "pre_node_p50_ms": None}]
