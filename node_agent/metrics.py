"""Rolling serving metrics of one node: counts, latency percentiles, SLO attainment, hit rates.

Pure bookkeeping: callers pass ``now_s``; nothing here reads the clock. Per-request figures go
into a bounded ring (``max_samples``); a snapshot covers the requests of the last ``window_s``
seconds (latency percentiles, SLO attainment, hit rates) plus lifetime totals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MetricsConfig:
    slo_ms: float = 30.0
    window_s: float = 60.0
    max_samples: int = 65_536

    def validate(self) -> "MetricsConfig":
        if not self.slo_ms > 0:
            raise ValueError(f"slo_ms must be positive, got {self.slo_ms}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")
        if self.max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {self.max_samples}")
        return self


# columns of the ring
_T, _LAT, _EMB_REQ, _EMB_HIT, _KV_TOK, _KV_HIT = range(6)


class RollingMetrics:
    """Ring of the last ``max_samples`` requests; see the module docstring."""

    def __init__(self, config: MetricsConfig | None = None):
        self.config = (config or MetricsConfig()).validate()
        self._ring = np.zeros((self.config.max_samples, 6), dtype=np.float64)
        self._n = 0  # total recorded
        self.num_requests = 0
        self.num_errors = 0
        self.refill_bytes = 0
        self.emb_requested_rows = 0
        self.emb_hit_rows = 0
        self.kv_tokens = 0
        self.kv_hit_tokens = 0

    def record(self, now_s: float, latency_us: float, *, emb_requested: int, emb_hits: int,
               kv_tokens: int, kv_hit_tokens: int) -> None:
        row = self._ring[self._n % len(self._ring)]
        row[:] = (now_s, latency_us, emb_requested, emb_hits, kv_tokens, kv_hit_tokens)
        self._n += 1
        self.num_requests += 1
        self.emb_requested_rows += emb_requested
        self.emb_hit_rows += emb_hits
        self.kv_tokens += kv_tokens
        self.kv_hit_tokens += kv_hit_tokens

    def record_error(self) -> None:
        self.num_errors += 1

    def add_refill_bytes(self, n: int) -> None:
        self.refill_bytes += int(n)

    def snapshot(self, now_s: float) -> dict:
        """Window and lifetime figures as plain JSON-able values."""
        rows = self._ring[: min(self._n, len(self._ring))]
        rows = rows[rows[:, _T] >= now_s - self.config.window_s]
        lat_ms = rows[:, _LAT] / 1e3
        n = len(rows)

        def ratio(a: float, b: float) -> float | None:
            return round(a / b, 6) if b > 0 else None

        return {
            "num_requests": self.num_requests,
            "num_errors": self.num_errors,
            "window_s": self.config.window_s,
            "window_requests": n,
            "window_rps": round(n / self.config.window_s, 3),
            "latency_p50_ms": round(float(np.percentile(lat_ms, 50)), 4) if n else None,
            "latency_p90_ms": round(float(np.percentile(lat_ms, 90)), 4) if n else None,
            "latency_p99_ms": round(float(np.percentile(lat_ms, 99)), 4) if n else None,
            "slo_ms": self.config.slo_ms,
            "slo_attainment": round(float(np.mean(lat_ms <= self.config.slo_ms)), 6) if n else None,
            "emb_hit_rate": ratio(rows[:, _EMB_HIT].sum(), rows[:, _EMB_REQ].sum()),
            "kv_hit_rate": ratio(rows[:, _KV_HIT].sum(), rows[:, _KV_TOK].sum()),
            "lifetime_emb_hit_rate": ratio(self.emb_hit_rows, self.emb_requested_rows),
            "lifetime_kv_hit_rate": ratio(self.kv_hit_tokens, self.kv_tokens),
            "refill_bytes": self.refill_bytes,
        }
