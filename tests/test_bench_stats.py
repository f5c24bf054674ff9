"""bench/stats.py: a P99 travels with its sample count and says when the samples are too few."""

from __future__ import annotations

from bench.stats import MIN_P99_SAMPLES, P99, few_samples_note, p99, pct


def test_a_p99_from_30_samples_is_flagged_and_says_so():
    tail = p99([float(x) for x in range(1, 31)])
    assert tail == P99(29.71, 30)  # (30 - 1) x 0.99 = 28.71: 71% of the way from the 29th to the 30th
    assert tail.few_samples is True
    assert tail.fields("p99_ms") == {"p99_ms": 29.71, "p99_ms_samples": 30, "p99_ms_few_samples": True}
    assert tail.text("ms") == "29.71 ms (P99 from 30 samples, fewer than 100: near their maximum)"


def test_a_p99_from_enough_samples_is_not_flagged_and_no_samples_is_none():
    tail = p99(list(range(MIN_P99_SAMPLES)))
    assert tail.value == 98.01 and tail.num_samples == 100 and tail.few_samples is False
    assert tail.text("us") == "98.01 us" and few_samples_note(100) == ""
    empty = p99([])
    assert empty == P99(None, 0) and empty.few_samples is True and empty.text() == "none (no samples)"
    assert empty.fields("x") == {"x": None, "x_samples": 0, "x_few_samples": True}
    assert pct([], 50) is None and pct([1.0, 2.0, 4.0], 50) == 2.0 and pct([1, 2], 50, 0) == 2.0
