"""RollingMetrics: windows, percentiles, SLO attainment, hit rates, KV outcomes, link flag."""

from __future__ import annotations

import pytest

from node_agent.metrics import MetricsConfig, RollingMetrics


def test_snapshot_and_window():
    m = RollingMetrics(MetricsConfig(slo_ms=10.0, window_s=5.0), link_emulated=True)
    for i in range(10):  # 1..10 ms, users 0,0,0,0,0,1..5
        m.record(float(i), (i + 1) * 1e3, emb_requested=10, emb_hits=i, kv_tokens=20, kv_hit_tokens=10,
                 user=0 if i < 5 else i - 4, history_len=20 + i, queue_us=100.0, kv_outcome="hit" if i % 2 else "miss")
    m.record_rejected()
    m.add_refill_bytes(512)
    s = m.snapshot(9.0)
    assert s["window_requests"] == 6 and s["num_requests"] == 10 and s["num_rejected"] == 1  # t in [4, 9]
    assert s["latency_p50_ms"] == pytest.approx(7.5) and s["slo_attainment"] == 1.0
    assert s["emb_hit_rate"] == pytest.approx(sum(range(4, 10)) / 60)
    assert s["lifetime_kv_hit_rate"] == 0.5 and s["kv_outcomes"] == {"hit": 5, "miss": 5}
    assert s["link_emulated"] is True and s["refill_bytes"] == 512 and s["queue_p50_ms"] == 0.1
    w = m.window(9.0, 2.0)  # t in [7, 9]: users 3, 4, 5
    assert w["num_requests"] == 3 and w["history_len_p50"] == 28.0
    assert w["hot_user_ratio"] == pytest.approx(1 / 3) and w["emb_lookups_per_request"] == 10.0
    assert w["p99_ms"] == pytest.approx(9.98) and w["kv_hit_rate"] == 0.5
    assert m.window(100.0, 1.0)["num_requests"] == 0
    assert RollingMetrics().snapshot(0.0)["link_emulated"] is None
