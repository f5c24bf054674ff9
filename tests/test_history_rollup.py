"""The pre-aggregated history (node_report_buckets, kept in each report batch's own transaction)
gives the same buckets as grouping the raw reports, on SQLite and PostgreSQL: every dashboard step,
per node and for the cluster, with late and replayed reports, duplicates, NULL figures, windows
without requests, and a database migrated from the roll-up job's schema."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import func, inspect, select, text

from db import queries
from db.engine import current_revision, make_engine, session_factory, upgrade
from db.models import NodeReportBucket

from .cp_util import Database, backends
from .cp_util import migrated_db as db  # noqa: F401 - the fixture

T0 = 1_800_000_000.0  # a multiple of every stored step
STEPS = (5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def _reports(rng: random.Random, node: str, seqs, t_of, received_s: float) -> list[dict]:
    out = []
    for seq in seqs:
        nreq = rng.choice([0, 0, 3, 17, 120])
        none = rng.random() < 0.15
        out.append(dict(
            node_id=node, seq=seq, ts_s=t_of(seq), received_s=received_s, interval_s=rng.choice([0.05, 0.9, 1.0, 1.7]),
            emb_share=rng.random(), emb_share_target=rng.random(), kv_hit_rate=None if none else rng.random(),
            emb_hit_rate=None if rng.random() < 0.3 else rng.random(), p50_ms=rng.uniform(1, 10),
            p99_ms=None if none else rng.uniform(5, 80), slo_attainment=None if nreq == 0 else rng.random(),
            throughput_rps=rng.uniform(0, 500), num_requests=nreq, queue_depth=rng.uniform(0, 9),
            refill_bytes=rng.randrange(0, 1 << 20), kv_recompute_us_per_token=rng.choice([None, rng.uniform(1, 9)]),
            emb_transfer_us_per_row=rng.uniform(1, 9), policy_version="p1", decision_source=None))
    return out


def _seed(factory, rng, nodes=("a", "b", "c"), n=1500, batch=7):
    """``n`` reports of each node, about one a second with jitter (one node starts late), stored
    ``batch`` at a time as the ingest writer stores them (each call its own transaction)."""
    with factory.begin() as s:
        for nid in nodes:
            queries.upsert_node(s, node_id=nid, address="http://h:1", device="cpu", cost_profile={},
                                policy_version=None, now_s=T0, report_interval_s=1.0)
    reps = []
    for k, nid in enumerate(nodes):
        reps += _reports(rng, nid, range(n), lambda i, k=k: T0 + 60 * k + i * 1.0 + rng.uniform(0, 0.9),
                         received_s=T0 + 10.0)
    rng.shuffle(reps)
    for i in range(0, len(reps), batch):
        with factory.begin() as s:
            queries.insert_reports(s, reps[i:i + batch])
    return reps


def _raw(s, step, start=None, end=None, node_id=None, cluster=False, monkeypatch=None):
    """The reference: buckets grouped from the raw reports only (no stored buckets)."""
    if cluster:
        with monkeypatch.context() as m:
            m.setattr(queries, "stored_level", lambda *a: None)
            return queries.cluster_history(s, start_s=start, end_s=end, step_s=step, limit=100_000)
    return queries._raw_buckets(s, node_id=node_id, start_s=start, end_s=end, step_s=step, limit=100_000)


def _same(got: list[dict], want: list[dict]) -> None:
    assert [(r["node_id"], r["ts_s"], r["num_reports"]) for r in got] == \
        [(r["node_id"], r["ts_s"], r["num_reports"]) for r in want]
    for g, w in zip(got, want):
        for k in queries.REPORT_FIGURES:
            if w[k] is None:
                assert g[k] is None, (k, g, w)
            else:
                assert g[k] == pytest.approx(w[k], rel=1e-9, abs=1e-9), (k, g, w)


def _all_steps_same(s, monkeypatch, start=None):
    for step in STEPS:
        assert queries.stored_level(step, start, None) is not None
        _same(queries.report_history(s, node_id=None, start_s=start, end_s=None, step_s=step, limit=100_000),
              _raw(s, step, start))
        _same(queries.cluster_history(s, start_s=start, end_s=None, step_s=step, limit=100_000),
              _raw(s, step, start, cluster=True, monkeypatch=monkeypatch))


def test_migration_0014_keeps_the_buckets_and_drops_the_watermark(db):
    engine, _ = db
    assert current_revision(engine) == "0014"
    tables = set(inspect(engine).get_table_names())
    assert "node_report_buckets" in tables and "history_rollup_state" not in tables
    assert "ix_node_reports__received_s" not in {i["name"] for i in inspect(engine).get_indexes("node_reports")}


def test_stored_buckets_equal_raw_bucketing_at_every_step(db, monkeypatch):
    _, factory = db
    rng = random.Random(7)
    _seed(factory, rng)
    with factory() as s:
        assert s.scalar(select(func.count()).select_from(NodeReportBucket)) > 0
        _all_steps_same(s, monkeypatch)
        for step in STEPS:
            start, end = T0 + 2 * step, T0 + 20 * step
            _same(queries.report_history(s, node_id=None, start_s=start, end_s=end, step_s=step, limit=100_000),
                  _raw(s, step, start, end))
            _same(queries.report_history(s, node_id="b", start_s=start, end_s=None, step_s=step, limit=100_000),
                  _raw(s, step, start, None, node_id="b"))
            _same(queries.cluster_history(s, start_s=start, end_s=end, step_s=step, limit=100_000),
                  _raw(s, step, start, end, cluster=True, monkeypatch=monkeypatch))
        # a step no stored step divides, and a range edge inside a bucket: read from the raw reports
        assert queries.stored_level(7.0, None, None) is None
        assert queries.stored_level(30.0, T0 + 3.0, None) is None
        _same(queries.report_history(s, node_id=None, start_s=T0 + 3.0, end_s=None, step_s=30.0, limit=100_000),
              _raw(s, 30.0, T0 + 3.0, None))


def test_late_replayed_and_duplicate_reports_are_in_the_buckets_at_once(db, monkeypatch):
    _, factory = db
    rng = random.Random(11)
    reps = _seed(factory, rng, n=600)
    # one node's late replay into old buckets, a brand-new node, and a batch sent twice (its
    # second copy stores nothing and adds nothing), in one transaction as a group commit does
    with factory.begin() as s:
        queries.upsert_node(s, node_id="d", address="http://h:1", device="cpu", cost_profile={}, policy_version=None,
                            now_s=T0, report_interval_s=1.0)
    with factory.begin() as s:
        late = _reports(rng, "b", range(10_000, 10_040), lambda i: T0 + 100.0 + (i - 10_000) * 2.0, T0 + 702.0)
        assert len(queries.insert_reports(s, late)) == 40
        assert len(queries.insert_reports(s, _reports(rng, "d", range(30), lambda i: T0 + 650.0 + i, T0 + 703.0))) == 30
        assert queries.insert_reports(s, late) == set()
    with factory.begin() as s:  # a replay mixing stored and new reports: only the new ones count
        got = queries.insert_reports(s, reps[:50] + _reports(rng, "a", range(600, 660), lambda i: T0 + i + 0.5,
                                                             T0 + 704.0))
        assert got == {("a", i) for i in range(600, 660)}
    with factory() as s:
        _all_steps_same(s, monkeypatch)


def test_a_failed_transaction_adds_nothing(db, monkeypatch):
    _, factory = db
    rng = random.Random(5)
    _seed(factory, rng, nodes=("a",), n=100)
    s = factory()
    try:
        with s.begin():
            queries.insert_reports(s, _reports(rng, "a", range(100, 150), lambda i: T0 + i + 0.25, T0 + 200.0))
            raise RuntimeError("the commit fails")
    except RuntimeError:
        pass
    finally:
        s.close()
    with factory() as s:
        assert s.scalar(select(func.sum(NodeReportBucket.num_reports)).where(NodeReportBucket.step_s == 5.0)) == 100
        _all_steps_same(s, monkeypatch)


@pytest.mark.parametrize("backend", backends())
def test_a_database_the_roll_up_job_kept_is_brought_up_to_date_by_the_migration(backend, tmp_path, monkeypatch):
    """At 0013 the buckets were kept by a job up to its watermark: reports received after it are
    not in them (here: wrong sums). Migrating to 0014 recomputes those buckets from the raw
    reports; the buckets before the watermark stay as they were (right)."""
    d = Database(backend, tmp_path)
    engine = make_engine(d.url)
    try:
        upgrade(engine, "0013")
        factory = session_factory(engine)
        rng = random.Random(13)
        _seed(factory, rng, nodes=("a", "b"), n=900)  # (this code keeps the buckets as it inserts)
        cut = T0 + 600.0
        with engine.begin() as c:  # as the job left them: everything received after the watermark is missing
            c.execute(text("UPDATE node_reports SET received_s = :late WHERE ts_s >= :cut"),
                      {"late": T0 + 900.0, "cut": cut})
            c.execute(text("UPDATE node_report_buckets SET num_reports = 1, sum_p99_ms = 0 WHERE bucket_s >= :cut"),
                      {"cut": cut})
            c.execute(text("INSERT INTO history_rollup_state (name, received_to_s, updated_s) "
                           "VALUES ('history', :m, :m)"), {"m": T0 + 800.0})
        upgrade(engine)
        assert current_revision(engine) == "0014"
        with factory() as s:
            _all_steps_same(s, monkeypatch)
    finally:
        engine.dispose()
        d.drop()


def test_retention_drops_the_buckets_with_their_raw_reports(db, monkeypatch):
    _, factory = db
    rng = random.Random(3)
    _seed(factory, rng, nodes=("a",), n=400)
    with factory.begin() as s:
        queries.rollup_and_prune(s, now_s=T0 + 400.0, step_s=60.0, raw_retention_s=200.0, rollup_retention_s=1e9)
    with factory() as s:
        assert s.scalar(select(func.min(NodeReportBucket.bucket_s))) >= T0 + 180.0
        got = queries.report_history(s, node_id="a", start_s=None, end_s=None, step_s=60.0, limit=100_000)
        assert got[0]["ts_s"] == T0  # the older minutes from the retention rollups
        _same([r for r in got if r["ts_s"] >= T0 + 180.0], _raw(s, 60.0, T0 + 180.0))
