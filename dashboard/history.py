"""A shared cache of downsampled history: one control-plane read of an hour serves every page
and every signed-in user after it.

`HistoryCache` keeps, per bucket size ``step_s``, the per-node bucket rows the API returned
(``GET /reports?step_s=``) for **complete buckets only**: a bucket ``[b, b + step_s)`` is complete
once ``b + step_s <= now_s - grace_s`` (a report may arrive up to a report interval late). A read
fetches only what it does not hold: the older part of a longer range, and the newest complete
buckets; the last ``refetch_buckets`` cached buckets are fetched again each time, so late
reports land. `clear` drops everything (after a control-plane outage, when nodes replay their
buffered reports into buckets already read).

The cache holds history only: every read is made with the caller's token, and the dashboard
calls it only after the same token was accepted (``/summary``) in the same callback, so a token
the control plane no longer accepts reads nothing from it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable


class HistoryCache:
    def __init__(self, fetch: Callable[..., list[dict]], *, grace_s: float = 2.0, keep_s: float = 2 * 86400.0,
                 refetch_buckets: int = 2):
        """``fetch(token, start_s=, end_s=, step_s=)``: the API read (`ControlPlaneClient.history`)."""
        self._fetch = fetch
        self.grace_s = grace_s
        self.keep_s = keep_s
        self.refetch_buckets = refetch_buckets
        self._lock = threading.Lock()
        self._entries: dict[float, dict] = {}
        self.num_fetches = 0

    def complete_end(self, step_s: float, now_s: float) -> float:
        """The start of the first incomplete bucket: buckets starting before it are complete."""
        return math.floor((now_s - self.grace_s) / step_s) * step_s

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def rows(self, token: str, step_s: float, start_s: float, now_s: float) -> list[dict]:
        """Complete buckets from ``start_s`` (rounded down to a bucket) to now, sorted by (time, node)."""
        end = self.complete_end(step_s, now_s)
        start_b = math.floor(start_s / step_s) * step_s
        if start_b >= end:
            return []
        with self._lock:
            entry = self._entries.get(step_s)
            entry = None if entry is None else {"from": entry["from"], "to": entry["to"], "rows": dict(entry["rows"])}
        if entry is None or entry["from"] > start_b:
            fetched = self._get(token, start_b, end, step_s)
            entry = {"from": start_b, "to": end, "rows": {}}
        else:
            since = max(entry["from"], entry["to"] - self.refetch_buckets * step_s)
            fetched = self._get(token, since, end, step_s) if since < end else []
            entry["to"] = max(entry["to"], end)
        for r in fetched:
            entry["rows"][(r["node_id"], float(r["ts_s"]))] = r
        keep_from = max(entry["from"], math.floor((now_s - self.keep_s) / step_s) * step_s)
        if keep_from > entry["from"]:
            entry["rows"] = {k: v for k, v in entry["rows"].items() if k[1] >= keep_from}
            entry["from"] = keep_from
        with self._lock:
            old = self._entries.get(step_s)
            if old is None or old["to"] <= entry["to"]:
                self._entries[step_s] = entry
        return sorted((r for (_n, t), r in entry["rows"].items() if start_b <= t < end),
                      key=lambda r: (r["ts_s"], r["node_id"]))

    def since(self, token: str, step_s: float, after_s: float | None, start_s: float, now_s: float) -> list[dict]:
        """Complete buckets newer than ``after_s`` (the last one drawn), or from ``start_s``."""
        rows = self.rows(token, step_s, start_s, now_s)
        return rows if after_s is None else [r for r in rows if r["ts_s"] > after_s]

    def _get(self, token: str, start_s: float, end_s: float, step_s: float) -> list[dict]:
        self.num_fetches += 1
        return self._fetch(token, start_s=start_s, end_s=end_s, step_s=step_s)
