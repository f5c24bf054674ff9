"""`bench.ingest` at a small scale: real control-plane processes and real HTTP.

Nodes that send several reports per request (a control plane's ``send_period_s``) lose none and
store none twice, and the HTTP floor beside them answers every report without a database.
"""

from __future__ import annotations

import pytest

from bench import ingest

pytestmark = pytest.mark.slow


def test_batched_reports_are_all_stored_once_and_the_http_floor_answers_them():
    cur = ingest.run("sqlite", nodes=12, duration_s=4.0, warmup_s=0.5, pg_url="", per_request=2)
    assert cur["errors"] == 0, cur["error_examples"]
    assert cur["reports_per_request"] == 2 and cur["reports_per_s"] >= 12 * 0.75
    assert cur["rows_lost"] == 0 and cur["rows_doubled"] == 0 and cur["rows_stored"] == cur["rows_acknowledged"]
    assert cur["server_cpu_ms_per_report"] == pytest.approx(cur["server_cpu_ms_per_request"] / 2, abs=0.002)
    # each node's first batch goes through the app (its token not cached yet), the rest natively
    assert 0.5 <= cur["native_share"] <= 1.0, cur["native_share"]
    assert ingest.cpu_ratios([cur], [cur]) == [1.0]
    floor = ingest.run("sqlite", nodes=12, duration_s=2.0, warmup_s=0.5, pg_url="", floor=True)
    assert floor["http_floor"] is True and floor["errors"] == 0 and floor["reports_per_s"] >= 12 * 0.75
    assert "rows_lost" not in floor
    s = ingest.summary([floor])
    assert s["rows_lost"] == 0 and s["server_cpu_ms_per_report_median"] == floor["server_cpu_ms_per_report"]
