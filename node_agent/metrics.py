"""Rolling serving metrics of one node: counts, latency percentiles, SLO attainment, hit rates.

Pure bookkeeping: callers pass ``now_s``; nothing here reads the clock. Per-request figures go
into a bounded ring (``max_samples``); a snapshot covers the requests of the last ``window_s``
seconds (latency percentiles, SLO attainment, hit rates) plus lifetime totals. `window` gives
the raw aggregates of any recent interval (what the SmartAllocator's `WindowStats` needs).
``link_emulated`` (set by the owner) is repeated in every snapshot, so a figure measured with an
emulated host-to-device link is never mistaken for a real one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.config import ranged
from common.config import validate as validate_fields

from .features import top_share


@dataclass(frozen=True)
class MetricsConfig:
    slo_ms: float = ranged(30.0, lo=0, lo_open=True)
    window_s: float = ranged(60.0, lo=0, lo_open=True)
    max_samples: int = ranged(65_536, lo=1, integer=True)

    def validate(self) -> "MetricsConfig":
        validate_fields(self)
        return self


# columns of the ring
_T, _LAT, _EMB_REQ, _EMB_HIT, _KV_TOK, _KV_HIT, _USER, _HIST, _QUEUE = range(9)
_NUM_COLS = 9


class RollingMetrics:
    """Ring of the last ``max_samples`` requests; see the module docstring."""

    def __init__(self, config: MetricsConfig | None = None, link_emulated: bool | None = None):
        self.config = (config or MetricsConfig()).validate()
        self.link_emulated = link_emulated
        self._ring = np.zeros((self.config.max_samples, _NUM_COLS), dtype=np.float64)
        self._n = 0  # total recorded
        self.num_requests = 0
        self.num_errors = 0
        self.num_rejected = 0
        self.refill_bytes = 0
        self.emb_requested_rows = 0
        self.emb_hit_rows = 0
        self.kv_tokens = 0
        self.kv_hit_tokens = 0
        self.kv_outcomes: dict[str, int] = {}

    def record(self, now_s: float, latency_us: float, *, emb_requested: int, emb_hits: int,
               kv_tokens: int, kv_hit_tokens: int, user: int = -1, history_len: int = 0,
               queue_us: float = 0.0, kv_outcome: str | None = None) -> None:
        row = self._ring[self._n % len(self._ring)]
        row[:] = (now_s, latency_us, emb_requested, emb_hits, kv_tokens, kv_hit_tokens, user, history_len,
                  queue_us)
        self._n += 1
        self.num_requests += 1
        self.emb_requested_rows += emb_requested
        self.emb_hit_rows += emb_hits
        self.kv_tokens += kv_tokens
        self.kv_hit_tokens += kv_hit_tokens
        if kv_outcome is not None:
            self.kv_outcomes[kv_outcome] = self.kv_outcomes.get(kv_outcome, 0) + 1

    def record_error(self) -> None:
        """A request that failed inside the node (a 5xx)."""
        self.num_errors += 1

    def record_rejected(self) -> None:
        """A request refused as invalid (a 4xx)."""
        self.num_rejected += 1

    def add_refill_bytes(self, n: int) -> None:
        self.refill_bytes += int(n)

    def _rows(self, since_s: float) -> np.ndarray:
        rows = self._ring[: min(self._n, len(self._ring))]
        return rows[rows[:, _T] >= since_s]

    def window(self, now_s: float, interval_s: float) -> dict:
        """Aggregates of the requests finished in ``[now_s - interval_s, now_s]``: count, P99
        latency (ms, 0 when none), hot-user ratio (share of the requests sent by the top 1% of
        the interval's users), history length percentiles, EMB rows per request, EMB and KV hit
        rates (0 when nothing was looked up)."""
        rows = self._rows(now_s - interval_s)
        n = len(rows)
        if n == 0:
            return {"num_requests": 0, "p99_ms": 0.0, "hot_user_ratio": 0.0, "history_len_p50": 0.0,
                    "history_len_p99": 0.0, "emb_lookups_per_request": 0.0, "emb_hit_rate": 0.0,
                    "kv_hit_rate": 0.0, "queue_us_mean": 0.0}
        emb_req, kv_tok = rows[:, _EMB_REQ].sum(), rows[:, _KV_TOK].sum()
        return {
            "num_requests": n,
            "p99_ms": float(np.percentile(rows[:, _LAT], 99)) / 1e3,
            "hot_user_ratio": top_share(rows[:, _USER], 0.01),
            "history_len_p50": float(np.percentile(rows[:, _HIST], 50)),
            "history_len_p99": float(np.percentile(rows[:, _HIST], 99)),
            "emb_lookups_per_request": float(emb_req / n),
            "emb_hit_rate": float(rows[:, _EMB_HIT].sum() / emb_req) if emb_req else 0.0,
            "kv_hit_rate": float(rows[:, _KV_HIT].sum() / kv_tok) if kv_tok else 0.0,
            "queue_us_mean": float(rows[:, _QUEUE].mean()),
        }

    def latency_summary(self, now_s: float, interval_s: float, slo_ms: float) -> dict:
        """P50 and P99 latency (ms) and SLO attainment of the requests finished in
        ``[now_s - interval_s, now_s]`` (None for each when there were none)."""
        rows = self._rows(now_s - interval_s)
        rows = rows[rows[:, _T] <= now_s]
        n = len(rows)
        if n == 0:
            return {"num_requests": 0, "p50_ms": None, "p99_ms": None, "slo_attainment": None}
        lat_ms = rows[:, _LAT] / 1e3
        return {"num_requests": n, "p50_ms": float(np.percentile(lat_ms, 50)),
                "p99_ms": float(np.percentile(lat_ms, 99)), "slo_attainment": float(np.mean(lat_ms <= slo_ms))}

    def latencies_since(self, count: int) -> tuple[np.ndarray, int]:
        """Latencies (seconds) of the requests recorded after the first ``count`` ones, and the new
        count: an exporter's cursor. Requests already overwritten in the ring are skipped."""
        total = self._n
        first = max(count, total - len(self._ring))
        if first >= total:
            return np.empty(0), total
        idx = np.arange(first, total) % len(self._ring)
        return self._ring[idx, _LAT] * 1e-6, total

    def snapshot(self, now_s: float) -> dict:
        """Window and lifetime figures as plain JSON-able values."""
        rows = self._rows(now_s - self.config.window_s)
        lat_ms = rows[:, _LAT] / 1e3
        n = len(rows)

        def ratio(a: float, b: float) -> float | None:
            return round(a / b, 6) if b > 0 else None

        return {
            "num_requests": self.num_requests,
            "num_errors": self.num_errors,
            "num_rejected": self.num_rejected,
            "window_s": self.config.window_s,
            "window_requests": n,
            "window_rps": round(n / self.config.window_s, 3),
            "latency_p50_ms": round(float(np.percentile(lat_ms, 50)), 4) if n else None,
            "latency_p90_ms": round(float(np.percentile(lat_ms, 90)), 4) if n else None,
            "latency_p99_ms": round(float(np.percentile(lat_ms, 99)), 4) if n else None,
            "queue_p50_ms": round(float(np.percentile(rows[:, _QUEUE], 50)) / 1e3, 4) if n else None,
            "slo_ms": self.config.slo_ms,
            "slo_attainment": round(float(np.mean(lat_ms <= self.config.slo_ms)), 6) if n else None,
            "emb_hit_rate": ratio(rows[:, _EMB_HIT].sum(), rows[:, _EMB_REQ].sum()),
            "kv_hit_rate": ratio(rows[:, _KV_HIT].sum(), rows[:, _KV_TOK].sum()),
            "lifetime_emb_hit_rate": ratio(self.emb_hit_rows, self.emb_requested_rows),
            "lifetime_kv_hit_rate": ratio(self.kv_hit_tokens, self.kv_tokens),
            "kv_outcomes": dict(sorted(self.kv_outcomes.items())),
            "refill_bytes": self.refill_bytes,
            "link_emulated": self.link_emulated,
        }
