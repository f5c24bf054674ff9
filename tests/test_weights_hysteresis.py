"""Router weights change on a real move only: a node whose reported KV recompute cost alternates
between two profiled points (157.8 and 80.74 µs/token as its window's history length crosses
them) keeps one version, where each period used to publish the other value; a move of the whole
range is published at once. The quartiles come from SQL on SQLite and PostgreSQL alike."""

from __future__ import annotations

from db import queries
from control_plane.jobs import compute_weights
from control_plane.settings import Settings

from .cp_util import migrated_db as db  # noqa: F401 - the fixture
from .test_control_plane_db import _row

PROFILE = {"kv_recompute_us_per_token": 100.0, "emb_transfer_us_per_row": 2.0, "service_time_us": 500.0,
           "queue_capacity": 64}


def _period(factory, settings, now_s):
    """One run of the weights job: compute, and store a version when something changed."""
    with factory.begin() as s:
        out = compute_weights(s, settings, now_s)
        if out is not None:
            payload, inputs, reason = out
            queries.add_weights(s, computed_at_s=now_s, nodes=payload, inputs=inputs, reason=reason)
        return out


def test_quartiles_are_picked_in_sql(db):
    _, factory = db
    with factory.begin() as s:
        queries.upsert_node(s, node_id="q", address="http://h:1", device="cpu", cost_profile=PROFILE,
                            policy_version=None, now_s=0.0, report_interval_s=1.0)
        vals = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]  # sorted: 1 2 3 5 7 8 9
        queries.insert_reports(s, [_row("q", i, 10.0 + i, kv_recompute_us_per_token=v) for i, v in enumerate(vals)])
    with factory() as s:
        band = queries.recent_miss_cost_bands(s, 0.0)["q"]["kv_recompute_us_per_token"]
        assert band == (2.0, 5.0, 8.0)  # sorted(v)[n // 4], [n // 2], [3n // 4]
        assert queries.recent_miss_costs(s, 0.0)["q"]["kv_recompute_us_per_token"] == 5.0


def test_quartiles_match_sorting_every_report_with_repeats_gaps_and_the_window_edge(db):
    """The database counts each node's distinct values; the quartiles read off the counts are
    ``sorted(v)[k]`` of the reports in the window (repeated values, costs a report leaves out,
    reports before the window, a node with one report)."""
    import random

    _, factory = db
    rng = random.Random(2)
    want: dict = {}
    with factory.begin() as s:
        for n in range(6):
            nid = f"r{n}"
            queries.upsert_node(s, node_id=nid, address="http://h:1", device="cpu", cost_profile=PROFILE,
                                policy_version=None, now_s=0.0, report_interval_s=1.0)
            rows = []
            for i in range(1 if n == 5 else rng.randrange(2, 80)):
                kv = rng.choice([None, 80.74, 157.8, 157.8, round(rng.uniform(50, 200), 3)])
                emb = rng.choice([2.0, 2.0, 3.5, None])
                ts = rng.uniform(0.0, 100.0)
                rows.append(_row(nid, i, ts, kv_recompute_us_per_token=kv, emb_transfer_us_per_row=emb))
                for name, v in (("kv_recompute_us_per_token", kv), ("emb_transfer_us_per_row", emb)):
                    if v is not None and ts >= 40.0:
                        want.setdefault(nid, {}).setdefault(name, []).append(v)
            queries.insert_reports(s, rows)
    expect = {nid: {k: (sorted(v)[len(v) // 4], sorted(v)[len(v) // 2], sorted(v)[(3 * len(v)) // 4])
                    for k, v in costs.items()} for nid, costs in want.items()}
    with factory() as s:
        assert queries.recent_miss_cost_bands(s, 40.0) == expect


def test_an_alternating_cost_keeps_one_version_and_a_real_move_makes_one(db):
    _, factory = db
    settings = Settings(weights_window_s=10.0, weights_rel_change=0.05)
    with factory.begin() as s:
        queries.upsert_node(s, node_id="n1", address="http://h:1", device="cpu", cost_profile=PROFILE,
                            policy_version=None, now_s=0.0, report_interval_s=1.0)
    seq = 0
    versions = []
    for period in range(12):  # a report a second; the window's majority alternates between the two points
        t0 = 100.0 + 10.0 * period
        rows = []
        for i in range(10):
            high = (i < 7) if period % 2 == 0 else (i < 3)
            rows.append(_row("n1", seq, t0 + i, kv_recompute_us_per_token=157.8 if high else 80.74))
            seq += 1
        with factory.begin() as s:
            queries.insert_reports(s, rows)
        out = _period(factory, settings, t0 + 10.0)
        if out is not None:
            versions.append(out[0]["n1"]["kv_recompute_us_per_token"])
    # the first period replaces the registered 100 with a reported median; then nothing flips
    assert len(versions) == 1 and versions[0] in (157.8, 80.74), versions
    # the whole range moves (a new model, a new device clock): published within a window
    moved = None
    for period in range(12, 16):
        t0 = 100.0 + 10.0 * period
        with factory.begin() as s:
            queries.insert_reports(s, [_row("n1", seq + i, t0 + i, kv_recompute_us_per_token=40.0) for i in range(10)])
        seq += 10
        out = _period(factory, settings, t0 + 10.0)
        if out is not None:
            moved = out
            break
    assert moved is not None and moved[0]["n1"]["kv_recompute_us_per_token"] == 40.0
    assert "n1 kv_recompute_us_per_token" in moved[2] and "reported median" in moved[0]["n1"]["reason"]
