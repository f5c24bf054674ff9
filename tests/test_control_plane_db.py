"""db/: migrations and query functions on SQLite and PostgreSQL (real SQL, both dialects)."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, select, text

from db import queries
from db.engine import current_revision, make_engine, normalize_url, upgrade
from db.models import Decision, Node, NodeReport, NodeReportRollup

from .cp_util import Database, backends, migrated_db as db  # noqa: F401 - the fixture


def _node(s, nid, now=100.0):
    queries.upsert_node(s, node_id=nid, address="http://h:1", device="cpu", cost_profile={"service_time_us": 1.0},
                        policy_version=None, now_s=now, report_interval_s=1.0)


def _row(nid, seq, ts, **kw):
    d = dict(node_id=nid, seq=seq, ts_s=ts, received_s=ts, interval_s=1.0, emb_share=0.5, emb_share_target=0.5,
             kv_hit_rate=None, emb_hit_rate=None, p50_ms=1.0, p99_ms=2.0, slo_attainment=1.0, throughput_rps=10.0,
             num_requests=10, queue_depth=0.0, refill_bytes=0, kv_recompute_us_per_token=None,
             emb_transfer_us_per_row=None, policy_version="a", decision_source=None)
    d.update(kw)
    return d


def test_migrations_make_every_table_and_are_idempotent(db):
    engine, _ = db
    upgrade(engine)  # second run: nothing to do
    assert current_revision(engine) == "0014"
    names = set(inspect(engine).get_table_names())
    for t in ("nodes", "node_reports", "node_report_rollups", "decisions", "bursts", "router_weights", "routers",
              "overrides", "policies", "rollouts", "rollout_nodes", "rollout_steps", "audit_log", "tokens",
              "job_runs", "scheduler_lease", "node_report_buckets", "alembic_version"):
        assert t in names, t
    uqs = {tuple(u["column_names"]) for u in inspect(engine).get_unique_constraints("node_reports")}
    assert ("node_id", "seq") in uqs


@pytest.mark.parametrize("backend", backends())
def test_migration_chain_upgrades_an_older_schema(backend, tmp_path):
    d = Database(backend, tmp_path)
    engine = make_engine(d.url)
    try:
        upgrade(engine, "0001")
        assert current_revision(engine) == "0001"
        assert "push_token" not in {c["name"] for c in inspect(engine).get_columns("routers")}
        upgrade(engine, "0002")
        assert current_revision(engine) == "0002"
        assert "push_token" in {c["name"] for c in inspect(engine).get_columns("routers")}
        upgrade(engine, "0003")
        assert current_revision(engine) == "0003"
        assert "node_report_buckets" in set(inspect(engine).get_table_names())
        assert "ix_node_reports__received_s" in {i["name"] for i in inspect(engine).get_indexes("node_reports")}
        with engine.begin() as c:  # a node token and a node of the older schema
            c.execute(text("INSERT INTO tokens (name, role, token_sha256, created_at_s, revoked) "
                           "VALUES ('old', 'node', :h, 1.0, false)"), {"h": "ab" * 32})
            c.execute(text("INSERT INTO nodes (node_id, address, device, cost_profile, status, registered_at_s, "
                           "last_seen_s, report_interval_s) VALUES ('n', 'http://x:1', 'cpu', '{}', 'up', 1, 1, 1)"))
            c.execute(text("INSERT INTO routers (url, push_token, registered_at_s, pushed_version) "
                           "VALUES ('http://gw:1', 'a-secret-in-clear', 1.0, 3)"))
        upgrade(engine)
        assert current_revision(engine) == "0014"
        assert "push_token" not in {c["name"] for c in inspect(engine).get_columns("routers")}  # no secret kept
        with engine.connect() as c:  # pushed again, with the token derived from the key
            assert c.execute(text("SELECT url, pushed_version FROM routers")).all() == [("http://gw:1", None)]
        assert "node_id" in {c["name"] for c in inspect(engine).get_columns("tokens")}
        assert "ix_tokens__node_id" in {i["name"] for i in inspect(engine).get_indexes("tokens")}
        assert "token_id" in {c["name"] for c in inspect(engine).get_columns("nodes")}
        with engine.connect() as c:  # kept, unbound (refused on the node routes until a bound one is made)
            assert c.execute(text("SELECT role, node_id FROM tokens")).all() == [("node", None)]
            assert c.execute(text("SELECT node_id, token_id FROM nodes")).all() == [("n", None)]
    finally:
        engine.dispose()
        d.drop()


def test_insert_reports_is_idempotent_on_node_and_seq(db):
    _, factory = db
    with factory.begin() as s:
        _node(s, "a")
        _node(s, "b")
    with factory.begin() as s:
        got = queries.insert_reports(s, [_row("a", 0, 100.0), _row("a", 1, 101.0), _row("b", 0, 100.0)])
    assert got == {("a", 0), ("a", 1), ("b", 0)}
    with factory.begin() as s:  # replay plus one new report
        got = queries.insert_reports(s, [_row("a", 1, 101.0, p99_ms=99.0), _row("a", 2, 102.0)])
        queries.insert_decisions(s, [dict(node_id="a", seq=2, ts_s=102.0, source="base", emb_share=0.4,
                                          prev_emb_share=0.5, reason="r", policy_version="a", features={"x": 1.0})] * 2)
    assert got == {("a", 2)}
    with factory() as s:
        rows = s.execute(select(NodeReport.node_id, NodeReport.seq, NodeReport.p99_ms).order_by(
            NodeReport.node_id, NodeReport.seq)).all()
        assert [tuple(r) for r in rows] == [("a", 0, 2.0), ("a", 1, 2.0), ("a", 2, 2.0), ("b", 0, 2.0)]
        assert s.scalar(select(Decision.features)) == {"x": 1.0}
        assert len(s.scalars(select(Decision)).all()) == 1


def test_unknown_node_is_refused_by_the_foreign_key(db):
    _, factory = db
    with pytest.raises(Exception):
        with factory.begin() as s:
            queries.insert_reports(s, [_row("ghost", 0, 1.0)])
    with factory() as s:
        assert s.scalars(select(NodeReport)).all() == []


def test_history_downsampling_rollups_and_retention(db):
    _, factory = db
    with factory.begin() as s:
        _node(s, "a")
        queries.insert_reports(s, [_row("a", i, 1000.0 + i, p99_ms=float(i)) for i in range(20)])
    with factory() as s:
        raw = queries.report_history(s, node_id="a", start_s=1005.0, end_s=1010.0, step_s=None, limit=100)
        assert [r["seq"] for r in raw] == [5, 6, 7, 8, 9]
        buckets = queries.report_history(s, node_id="a", start_s=None, end_s=None, step_s=10.0, limit=100)
        assert [(b["ts_s"], b["num_reports"], b["p99_ms"]) for b in buckets] == [(1000.0, 10, 4.5), (1010.0, 10, 14.5)]
    with factory.begin() as s:  # raw rows older than 1010 are rolled up (10 s buckets) and deleted
        out = queries.rollup_and_prune(s, now_s=1015.0, step_s=10.0, raw_retention_s=5.0, rollup_retention_s=1e9)
    assert out["raw_deleted"] == 10 and out["rollups"] == 1
    with factory.begin() as s:  # idempotent
        out = queries.rollup_and_prune(s, now_s=1015.0, step_s=10.0, raw_retention_s=5.0, rollup_retention_s=1e9)
    assert out["raw_deleted"] == 0
    with factory() as s:
        assert len(s.scalars(select(NodeReportRollup)).all()) == 1
        buckets = queries.report_history(s, node_id="a", start_s=None, end_s=None, step_s=10.0, limit=100)
        assert [(b["ts_s"], b["num_reports"], b["p99_ms"]) for b in buckets] == [(1000.0, 10, 4.5), (1010.0, 10, 14.5)]


def test_cluster_history_sums_rates_and_averages_the_rest(db):
    _, factory = db
    with factory.begin() as s:
        _node(s, "a")
        _node(s, "b")
        queries.insert_reports(s, [_row("a", i, 1000.0 + i, p99_ms=2.0, throughput_rps=10.0) for i in range(4)]
                               + [_row("b", i, 1000.0 + i, p99_ms=6.0, throughput_rps=30.0) for i in range(4)]
                               + [_row("b", 9, 1001.5, p99_ms=None, throughput_rps=30.0)])
    with factory() as s:
        rows = queries.cluster_history(s, start_s=None, end_s=None, step_s=10.0, limit=10)
    assert len(rows) == 1
    r = rows[0]
    assert (r["node_id"], r["ts_s"], r["num_reports"], r["throughput_rps"], r["p99_ms"]) == ("*", 1000.0, 9, 40.0, 4.0)


def test_liveness_marks_silent_nodes_down_and_a_report_brings_them_up(db):
    _, factory = db
    with factory.begin() as s:
        _node(s, "a", now=100.0)
        _node(s, "b", now=104.0)
    with factory.begin() as s:
        assert queries.mark_down(s, now_s=105.5, missed_intervals=5) == ["a"]
    with factory.begin() as s:
        queries.touch_nodes(s, {"a": (106.0, 3, 0.4, None)})
    with factory() as s:
        a = s.get(Node, "a")
        assert (a.status, a.last_seen_s, a.last_report_seq, a.emb_share) == ("up", 106.0, 3, 0.4)



def test_liveness_counts_in_send_periods_when_nodes_send_less_often_than_they_report(db):
    _, factory = db
    with factory.begin() as s:
        _node(s, "a", now=100.0)  # reports every 1 s, sends every 3 s: silent 6 s is two sends
    with factory.begin() as s:
        assert queries.mark_down(s, now_s=106.0, missed_intervals=5, send_period_s=3.0) == []
        assert queries.mark_down(s, now_s=106.0, missed_intervals=5, send_period_s=0.5) == ["a"]


def test_window_values_select_nodes_versions_and_windows_with_requests(db):
    _, factory = db
    with factory.begin() as s:
        _node(s, "a")
        _node(s, "b")
        queries.insert_reports(s, [_row("a", 0, 10.0, p99_ms=5.0, policy_version="new"),
                                   _row("a", 1, 11.0, p99_ms=None, slo_attainment=None, num_requests=0,
                                        policy_version="new"),
                                   _row("a", 2, 12.0, p99_ms=7.0, policy_version="old"),
                                   _row("b", 0, 10.0, p99_ms=3.0, policy_version="new")])
    with factory() as s:
        v = queries.window_values(s, ["a"], since_s=0.0, until_s=100.0, policy_version="new")
        assert v == {"slo_attainment": [1.0], "p99_ms": [5.0], "model_quality": []}

    # a model rollout's side: the windows served by one checkpoint, with their online quality
    da, db_ = "a" * 64, "b" * 64
    with factory.begin() as s:
        assert len(queries.insert_reports(s, [
            _row("a", 10, 20.0, model_digest=da, model_quality=0.75),
            _row("a", 11, 21.0, model_digest=db_, model_quality=0.25),
            _row("a", 12, 22.0, model_digest=da, model_quality=None)])) == 3
    with factory() as s:
        v = queries.window_values(s, ["a"], since_s=15.0, until_s=100.0, model_digest=da)
        assert v == {"slo_attainment": [1.0, 1.0], "p99_ms": [2.0, 2.0], "model_quality": [0.75]}
        assert queries.window_values(s, ["a"], since_s=15.0, until_s=100.0, model_digest=db_)["model_quality"] == [0.25]


def test_device_mode_is_stored_per_report_and_a_node_shows_its_latest_else_its_registration(db):
    """``device_mode``/``device_profile`` are stored with each report (null: the node did not say)
    and read back raw; `node_devices` gives a node's from the report of its ``last_report_seq``
    when that says, else from its registered cost profile's ``device`` (else (None, None))."""
    _, factory = db
    emu = {"mode": "emulated", "profile": "a100-hstu", "time_scale": 10.0, "calibrated": False,
           "time": "modelled", "label": "emulated a100-hstu (uncalibrated, modelled time, x10)"}
    with factory.begin() as s:
        _node(s, "a")
        _node(s, "b")
        queries.upsert_node(s, node_id="c", address="http://h:1", device=emu["label"],
                            cost_profile={"service_time_us": 1.0, "device": emu}, policy_version=None, now_s=100.0,
                            report_interval_s=1.0)
        queries.insert_reports(s, [_row("a", 0, 10.0, device_mode="emulated", device_profile="h100-x"),
                                   _row("a", 1, 11.0, device_mode="link-emulated"),
                                   _row("b", 0, 10.0)])
        queries.touch_nodes(s, {"a": (11.0, 0, 0.5, None), "b": (10.0, 0, 0.5, None)})
    with factory() as s:
        raw = queries.report_history(s, node_id="a", start_s=None, end_s=None, step_s=None, limit=10)
        assert [(r["device_mode"], r["device_profile"]) for r in raw] == [("emulated", "h100-x"),
                                                                          ("link-emulated", None)]
        nodes = queries.list_nodes(s)
        # a: its report 0 (last_report_seq); b: its report says nothing, nor its registration; c: registration
        assert queries.node_devices(s, nodes) == {"a": ("emulated", "h100-x"), "b": (None, None),
                                                  "c": ("emulated", "a100-hstu")}
    with factory.begin() as s:
        queries.touch_nodes(s, {"a": (12.0, 1, 0.5, None)})
    with factory() as s:
        assert queries.node_devices(s, [s.get(Node, "a")]) == {"a": ("link-emulated", None)}
    assert queries.registered_device({"device": {"mode": "real", "profile": "ignored"}}) == ("real", None)
    assert queries.registered_device({"device": "cpu"}) == (None, None)


@pytest.mark.parametrize("backend", backends())
def test_migration_0008_adds_the_report_device_columns_and_downgrades(backend, tmp_path):
    from alembic import command

    from db.engine import alembic_config

    d = Database(backend, tmp_path)
    engine = make_engine(d.url)
    try:
        upgrade(engine, "0007")
        with engine.begin() as c:  # a node and a report of the older schema: kept, their device unknown
            c.execute(text("INSERT INTO nodes (node_id, address, device, cost_profile, status, registered_at_s, "
                           "last_seen_s, report_interval_s) VALUES ('n', 'http://x:1', 'cpu', '{}', 'up', 1, 1, 1)"))
            c.execute(text("INSERT INTO node_reports (node_id, seq, ts_s, received_s, interval_s, emb_share, "
                           "emb_share_target, throughput_rps, num_requests, queue_depth, refill_bytes) "
                           "VALUES ('n', 0, 1, 1, 1, 0.5, 0.5, 0, 0, 0, 0)"))
        assert "device_mode" not in {c["name"] for c in inspect(engine).get_columns("node_reports")}
        upgrade(engine)
        assert current_revision(engine) == "0014"
        cols = {c["name"]: c for c in inspect(engine).get_columns("node_reports")}
        assert cols["device_mode"]["nullable"] and cols["device_profile"]["nullable"]
        with engine.connect() as c:
            assert c.execute(text("SELECT node_id, device_mode, device_profile FROM node_reports")).all() == [
                ("n", None, None)]
        cfg = alembic_config(engine)
        with engine.connect() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0007")
            conn.commit()
        assert current_revision(engine) == "0007"
        assert "device_mode" not in {c["name"] for c in inspect(engine).get_columns("node_reports")}
        upgrade(engine)
        assert current_revision(engine) == "0014"
    finally:
        engine.dispose()
        d.drop()


def test_postgres_urls_use_psycopg3():
    assert normalize_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_url("sqlite:///x.db") == "sqlite:///x.db"


def test_a_short_window_does_not_lift_the_bucket_throughput(db):
    """A control step delayed by a long batch is followed by a very short window with a high
    rate (here 60 req/s over 0.1 s). The bucket's throughput is the requests over the time the
    reports cover, not the plain mean of their rates (24 req/s here, 3x the node's 8 req/s:
    the spike seen on the overview), and hit rates / attainment are weighted by requests."""
    _, factory = db
    with factory.begin() as s:
        _node(s, "a")
        _node(s, "b")
        reps = []
        for nid in ("a", "b"):
            reps += [_row(nid, 1, 1000.5, interval_s=2.0, throughput_rps=8.0, num_requests=16, emb_hit_rate=0.5,
                          slo_attainment=1.0),
                     _row(nid, 2, 1004.4, interval_s=3.9, throughput_rps=4.0, num_requests=16, emb_hit_rate=0.5,
                          slo_attainment=0.5),
                     _row(nid, 3, 1004.5, interval_s=0.1, throughput_rps=60.0, num_requests=6, emb_hit_rate=0.95,
                          slo_attainment=1.0)]
        queries.insert_reports(s, reps)
    want_thr = (8.0 * 2.0 + 4.0 * 3.9 + 60.0 * 0.1) / 6.0  # 6.27 req/s: 37.6 requests over 6 s
    want_hit = (0.5 * 16 + 0.5 * 16 + 0.95 * 6) / 38
    with factory() as s:
        rows = queries.report_history(s, node_id=None, start_s=None, end_s=None, step_s=5.0, limit=10)
        cl = queries.cluster_history(s, start_s=None, end_s=None, step_s=5.0, limit=10)
    assert [(r["node_id"], r["ts_s"], r["num_reports"]) for r in rows] == [("a", 1000.0, 3), ("b", 1000.0, 3)]
    for r in rows:
        assert r["throughput_rps"] == pytest.approx(want_thr)
        assert r["emb_hit_rate"] == pytest.approx(want_hit)
        assert r["slo_attainment"] == pytest.approx((16 + 8 + 6) / 38)
        assert r["p99_ms"] == pytest.approx(2.0)
    assert len(cl) == 1 and cl[0]["throughput_rps"] == pytest.approx(2 * want_thr)
    with factory.begin() as s:  # the rollups keep the same figures
        queries.rollup_and_prune(s, now_s=1100.0, step_s=5.0, raw_retention_s=10.0, rollup_retention_s=1e9)
    with factory() as s:
        rolled = queries.report_history(s, node_id="a", start_s=None, end_s=None, step_s=5.0, limit=10)
    assert len(rolled) == 1 and rolled[0]["throughput_rps"] == pytest.approx(want_thr)


def test_recent_miss_costs_is_the_upper_median_per_node_in_the_window(db):
    """The median is picked in SQL (window functions on both dialects): it must equal
    ``sorted(values)[n // 2]`` for odd and even counts, skip missing values and old reports, and
    leave out a node with no value in the window. Node status counts are counted in SQL too."""
    import random

    _, factory = db
    rng = random.Random(3)
    want: dict[str, dict[str, float]] = {}
    with factory.begin() as s:
        rows = []
        for nid, n in (("a", 7), ("b", 8), ("c", 1)):
            _node(s, nid)
            kv = [round(rng.uniform(0.5, 9.0), 3) for _ in range(n)]
            emb = [None if i % 3 == 0 else round(rng.uniform(0.1, 2.0), 3) for i in range(n)]
            rows += [_row(nid, i, 100.0 + i, kv_recompute_us_per_token=kv[i], emb_transfer_us_per_row=emb[i])
                     for i in range(n)]
            rows.append(_row(nid, n, 10.0, kv_recompute_us_per_token=1e6))  # older than the window
            got_emb = sorted(v for v in emb if v is not None)
            want[nid] = {"kv_recompute_us_per_token": sorted(kv)[len(kv) // 2]}
            if got_emb:
                want[nid]["emb_transfer_us_per_row"] = got_emb[len(got_emb) // 2]
        _node(s, "d")
        rows.append(_row("d", 0, 100.0))  # reported, but no miss costs
        queries.insert_reports(s, rows)
    with factory() as s:
        got = queries.recent_miss_costs(s, since_s=50.0)
        counts = queries.node_status_counts(s)
    assert got == want  # the stored values themselves, picked, not computed
    assert "c" in got and "emb_transfer_us_per_row" not in got["c"]
    assert "d" not in got
    assert counts == {"up": 4}


def test_the_checkpointer_starts_the_wal_over_and_does_not_wait_long_behind_a_reader(tmp_path):
    """A steady writer keeps a PASSIVE checkpoint from finishing, and SQLite starts the WAL over
    only after a finished one: `checkpoint_wal` follows it with a RESTART past its byte bound, so
    the next write lands at the WAL's start. A reader on old frames makes that RESTART give up
    after its short wait ("restart-busy") instead of holding the writer for the 30-s busy timeout;
    once the reader is gone it succeeds."""
    import sqlite3
    import time

    from db.engine import checkpoint_wal

    path = tmp_path / "wal.db"
    engine = make_engine(f"sqlite:///{path}")
    w = sqlite3.connect(path, isolation_level=None)
    w.execute("PRAGMA journal_mode=WAL")
    w.execute("PRAGMA wal_autocheckpoint=0")  # as on the control plane's connections
    w.execute("CREATE TABLE t (b BLOB)")

    def write(n: int) -> None:
        for _ in range(n):
            w.execute("INSERT INTO t VALUES (randomblob(3000))")

    def wal_frames() -> int:
        return w.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1]

    write(200)
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM t").fetchone()  # a snapshot on the frames so far
    write(200)
    assert checkpoint_wal(engine, restart_bytes=10**9) == "passive"
    t0 = time.monotonic()
    assert checkpoint_wal(engine, restart_bytes=2**20, restart_wait_ms=50) == "restart-busy"
    assert time.monotonic() - t0 < 5.0  # the 50-ms wait, not the connection's 30-s busy timeout
    write(1)
    assert wal_frames() > 400  # the WAL did not start over: frames pile up behind the reader
    reader.execute("COMMIT")
    write(200)
    assert checkpoint_wal(engine, restart_bytes=2**20) == "restart"
    write(1)
    assert wal_frames() <= 3  # the write after the RESTART started the WAL over
    assert checkpoint_wal(engine, restart_bytes=2**20) == "passive"
    assert w.execute("SELECT count(*) FROM t").fetchone()[0] == 602  # nothing lost
    assert engine.connect().exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000  # restored
    reader.close()
    w.close()
    engine.dispose()
