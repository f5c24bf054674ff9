"""The pre-aggregated history (node_report_buckets, the history_rollup job) gives the same buckets
as grouping the raw reports, on SQLite and PostgreSQL: every dashboard step, per node and for the
cluster, with late and replayed reports, NULL figures, windows without requests, and the newest
buckets (after the job's watermark) still read from the raw reports."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import func, inspect, select

from control_plane.jobs import roll_up_history
from db import queries
from db.engine import current_revision
from db.models import HistoryRollupState, NodeReportBucket

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


def _seed(factory, rng, nodes=("a", "b", "c"), n=1500):
    with factory.begin() as s:
        for nid in nodes:
            queries.upsert_node(s, node_id=nid, address="http://h:1", device="cpu", cost_profile={},
                                policy_version=None, now_s=T0, report_interval_s=1.0)
    with factory.begin() as s:
        for k, nid in enumerate(nodes):  # about one report a second, with jitter; one node starts late
            queries.insert_reports(s, _reports(rng, nid, range(n), lambda i, k=k: T0 + 60 * k + i * 1.0
                                               + rng.uniform(0, 0.9), received_s=T0 + 10.0))


def _raw(s, step, start=None, end=None, node_id=None, cluster=False):
    """The reference: buckets grouped from the raw reports only (no stored buckets)."""
    if cluster:
        state = s.get(HistoryRollupState, queries.HISTORY_STATE)
        if state is not None:
            s.delete(state)
            s.flush()
        try:
            return queries.cluster_history(s, start_s=start, end_s=end, step_s=step, limit=100_000)
        finally:
            s.rollback()
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


def test_migration_0003_adds_the_buckets_table(db):
    engine, _ = db
    assert current_revision(engine) == "0013"  # the newest, which 0003 precedes
    assert {"node_report_buckets", "history_rollup_state"} <= set(inspect(engine).get_table_names())


def test_stored_buckets_equal_raw_bucketing_at_every_step(db):
    _, factory = db
    rng = random.Random(7)
    _seed(factory, rng)
    out = roll_up_history(factory, now_s=T0 + 20.0, margin_s=5.0)
    assert out["since_s"] is None
    with factory() as s:
        assert s.scalar(select(func.count()).select_from(NodeReportBucket)) > 0
        for step in STEPS:
            assert queries.history_level(step) is not None
            got = queries.report_history(s, node_id=None, start_s=None, end_s=None, step_s=step, limit=100_000)
            _same(got, _raw(s, step))
            start, end = T0 + 2 * step, T0 + 20 * step
            _same(queries.report_history(s, node_id=None, start_s=start, end_s=end, step_s=step, limit=100_000),
                  _raw(s, step, start, end))
            _same(queries.report_history(s, node_id="b", start_s=start, end_s=None, step_s=step, limit=100_000),
                  _raw(s, step, start, None, node_id="b"))
            _same(queries.cluster_history(s, start_s=start, end_s=None, step_s=step, limit=100_000),
                  _raw(s, step, start, None, cluster=True))
        # a step no stored step divides, and a range edge inside a bucket: read from the raw reports
        assert queries.history_boundary(s, 7.0, None, None) is None
        assert queries.history_boundary(s, 30.0, T0 + 3.0, None) is None
        _same(queries.report_history(s, node_id=None, start_s=T0 + 3.0, end_s=None, step_s=30.0, limit=100_000),
              _raw(s, 30.0, T0 + 3.0, None))


def test_new_and_late_reports_are_read_raw_until_the_next_run_rolls_them_up(db):
    _, factory = db
    rng = random.Random(11)
    _seed(factory, rng, n=600)
    roll_up_history(factory, now_s=T0 + 700.0, margin_s=10.0)
    with factory() as s:
        level, boundary = queries.history_boundary(s, 30.0, T0, None)
        assert (level, boundary) == (30.0, T0 + 690.0)
    # new reports after the watermark, one node's late replay into old buckets, a brand-new node
    with factory.begin() as s:
        queries.upsert_node(s, node_id="d", address="http://h:1", device="cpu", cost_profile={}, policy_version=None,
                            now_s=T0, report_interval_s=1.0)
        queries.insert_reports(s, _reports(rng, "a", range(600, 660), lambda i: T0 + i * 1.0 + 0.5, T0 + 701.0))
        queries.insert_reports(s, _reports(rng, "b", range(10_000, 10_040), lambda i: T0 + 100.0 + (i - 10_000) * 2.0,
                                           T0 + 702.0))
        queries.insert_reports(s, _reports(rng, "d", range(30), lambda i: T0 + 650.0 + i, T0 + 703.0))
    with factory() as s:  # before the next run: the boundary moves back to the oldest late report's bucket
        assert queries.history_boundary(s, 30.0, T0, None) == (30.0, T0 + 90.0)
        for step in STEPS:
            _same(queries.report_history(s, node_id=None, start_s=None, end_s=None, step_s=step, limit=100_000),
                  _raw(s, step))
            _same(queries.cluster_history(s, start_s=None, end_s=None, step_s=step, limit=100_000),
                  _raw(s, step, cluster=True))
    out = roll_up_history(factory, now_s=T0 + 720.0, margin_s=10.0)
    assert out["since_s"] == T0 + 690.0
    with factory() as s:
        assert queries.history_boundary(s, 30.0, T0, None) == (30.0, T0 + 690.0)  # caught up
        for step in STEPS:
            _same(queries.report_history(s, node_id=None, start_s=None, end_s=None, step_s=step, limit=100_000),
                  _raw(s, step))
            _same(queries.cluster_history(s, start_s=None, end_s=None, step_s=step, limit=100_000),
                  _raw(s, step, cluster=True))
    roll_up_history(factory, now_s=T0 + 725.0, margin_s=10.0)
    with factory() as s:
        _same(queries.report_history(s, node_id=None, start_s=None, end_s=None, step_s=60.0, limit=100_000),
              _raw(s, 60.0))


def test_retention_drops_the_buckets_with_their_raw_reports(db):
    _, factory = db
    rng = random.Random(3)
    _seed(factory, rng, nodes=("a",), n=400)
    roll_up_history(factory, now_s=T0 + 500.0, margin_s=1.0)
    with factory.begin() as s:
        queries.rollup_and_prune(s, now_s=T0 + 400.0, step_s=60.0, raw_retention_s=200.0, rollup_retention_s=1e9)
    with factory() as s:
        assert s.scalar(select(func.min(NodeReportBucket.bucket_s))) >= T0 + 180.0
        got = queries.report_history(s, node_id="a", start_s=None, end_s=None, step_s=60.0, limit=100_000)
        assert got[0]["ts_s"] == T0  # the older minutes from the retention rollups
        _same([r for r in got if r["ts_s"] >= T0 + 180.0], _raw(s, 60.0, T0 + 180.0))
