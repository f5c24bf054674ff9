"""Percentiles the benchmarks print, with the number of samples behind them.

A 99th percentile needs at least 100 samples to be more than the largest one: from 30 samples
numpy's P99 lies between the largest and the second largest. `p99` returns the figure with its
sample count and a flag; a benchmark puts all three in its JSON (`P99.fields`) and its printed
line (`P99.text`), so a P99 from few samples says so wherever it is read.

    tail = p99(latencies_ms)
    row.update(tail.fields("p99_ms"))       # {"p99_ms": 12.3, "p99_ms_samples": 30, "p99_ms_few_samples": True}
    print(f"P99 {tail.text('ms')}")         # "P99 12.30 ms (P99 from 30 samples, fewer than 100: near their maximum)"
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_P99_SAMPLES = 100


def pct(xs, q: float, ndigits: int = 3) -> float | None:
    """The ``q``-th percentile of ``xs`` (numpy's linear interpolation), rounded; None for no samples."""
    if len(xs) == 0:
        return None
    return round(float(np.percentile(np.asarray(xs, dtype=np.float64), q)), ndigits)


@dataclass(frozen=True)
class P99:
    """A P99 (None for no samples), how many samples it is from, and whether that is too few."""

    value: float | None
    num_samples: int

    @property
    def few_samples(self) -> bool:
        """Fewer than `MIN_P99_SAMPLES`: the figure is about the largest sample, not a 99th percentile."""
        return self.num_samples < MIN_P99_SAMPLES

    def fields(self, key: str = "p99_ms") -> dict:
        """The figure under ``key``, its sample count under ``key_samples`` and the flag under
        ``key_few_samples``."""
        return {key: self.value, f"{key}_samples": self.num_samples, f"{key}_few_samples": self.few_samples}

    def text(self, unit: str = "ms", ndigits: int = 2) -> str:
        """``12.30 ms``, or with `few_samples_note` when the samples are too few."""
        if self.value is None:
            return "none (no samples)"
        return f"{self.value:.{ndigits}f} {unit}".rstrip() + few_samples_note(self.num_samples)


def few_samples_note(num_samples: int) -> str:
    """What a printed P99 from ``num_samples`` samples adds: nothing from `MIN_P99_SAMPLES` on."""
    if num_samples >= MIN_P99_SAMPLES:
        return ""
    return f" (P99 from {num_samples} samples, fewer than {MIN_P99_SAMPLES}: near their maximum)"


def p99(xs, ndigits: int = 3) -> P99:
    """The P99 of ``xs`` with its sample count (see the module docstring)."""
    return P99(pct(xs, 99, ndigits), len(xs))
