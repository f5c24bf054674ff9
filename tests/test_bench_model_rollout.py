"""`bench.model_rollout`'s pure parts: report windows bucketed per side, and its arguments checked
before racer up starts (the whole bench runs racer up for minutes: docs/model.md has its figures)."""

from __future__ import annotations

import pytest


def test_report_windows_are_bucketed_per_side_from_the_rollouts_start():
    from bench.model_rollout import BUCKET_S, buckets

    t0 = 1000.0
    rows = [{"node_id": "a", "ts_s": t0 + 1, "kv_hit_rate": 0.2, "emb_hit_rate": 0.5, "p99_ms": 8.0, "emb_share": 0.4},
            {"node_id": "a", "ts_s": t0 + 2, "kv_hit_rate": 0.4, "emb_hit_rate": None, "p99_ms": 10.0, "emb_share": 0.4},
            {"node_id": "b", "ts_s": t0 + 3, "kv_hit_rate": 0.6, "emb_hit_rate": 0.1, "p99_ms": 9.0, "emb_share": 0.5},
            {"node_id": "b", "ts_s": t0 - 1, "kv_hit_rate": 0.0, "emb_hit_rate": 0.0, "p99_ms": 7.0, "emb_share": 0.5},
            {"node_id": "a", "ts_s": t0 + BUCKET_S + 1, "kv_hit_rate": 0.9, "emb_hit_rate": 0.9, "p99_ms": 6.0,
             "emb_share": 0.3}]
    out = buckets(rows, {"a"}, t0)
    assert [b["from_s"] for b in out] == [-BUCKET_S, 0.0, BUCKET_S]
    before, first, second = out
    assert before["canary_kv_hit_rate"] is None and before["baseline_p99_ms"] == 7.0
    assert first["canary_kv_hit_rate"] == pytest.approx(0.3) and first["canary_p99_ms"] == pytest.approx(9.0)
    assert first["canary_emb_hit_rate"] == 0.5  # a window without the figure is left out, not a zero
    assert first["baseline_kv_hit_rate"] == 0.6 and second["baseline_p99_ms"] is None
    assert second["canary_emb_share"] == 0.3


@pytest.mark.parametrize("argv", [["--bake-s", "0"], ["--serve-s", "-1"], ["--runs", "0"]])
def test_bad_arguments_are_refused_before_anything_starts(argv, capsys):
    from bench.model_rollout import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "--bake-s must be > 0" in capsys.readouterr().err
