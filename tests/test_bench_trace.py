"""bench.load_bench_trace: a missing trace is a clear error, never a synthetic substitute."""

from __future__ import annotations

import pytest

from bench import MissingTraceError, load_bench_trace

from .conftest import TAOBAO_SAMPLE


def test_a_missing_trace_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RACER_DATA_DIR", str(tmp_path))  # an empty data directory
    with pytest.raises(MissingTraceError, match="taobao trace is not available.*RACER_DATA_DIR"):
        load_bench_trace("taobao", None)
    with pytest.raises(MissingTraceError, match="amazon trace is not available"):
        load_bench_trace("amazon", str(tmp_path / "nope.inter"))


@pytest.mark.skipif(not TAOBAO_SAMPLE.exists(), reason="../shared/data not present")
def test_the_sample_is_loaded_and_named():
    trace, name = load_bench_trace("taobao", None)
    assert "UserBehavior" in name and trace.num_users > 500
