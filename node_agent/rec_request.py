"""One recommendation request through the engine: what comes in (`RecRequest`), its checked
form (`prepare_request` -> `PreparedRequest`, or `RequestError`), and what goes out
(`RecResponse`, with its `LatencyBreakdown`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .paged_kv import KVReuse


class RequestError(ValueError):
    """A request the engine refuses (out-of-range ids, oversize history, bad counts)."""


@dataclass
class RecRequest:
    """One recommendation request.

    ``history`` then ``new_items`` is the user's item sequence, oldest first; ``timestamps``
    (seconds, optional) has one entry per item of that sequence. Without timestamps every token
    and the ranking query get time 0: the relative time bias is then the same for every pair and
    only the position bias orders the history (deterministic, so cached and recomputed K/V agree).
    ``now_ts`` is the ranking query's time (default: the last token's timestamp, 0 without
    timestamps). ``candidates`` lists item ids to rank; else ``num_candidates`` are drawn by the
    `CandidateGenerator`. ``top_k`` is clamped to the number of candidates. ``arrival_s`` is
    when the request reached the node, on the engine's clock (for the queue time).
    """

    user_id: int
    history: Sequence[int] | np.ndarray = ()
    new_items: Sequence[int] | np.ndarray = ()
    timestamps: Sequence[float] | np.ndarray | None = None
    now_ts: float | None = None
    candidates: Sequence[int] | np.ndarray | None = None
    num_candidates: int | None = None
    top_k: int | None = None
    arrival_s: float | None = None

    @classmethod
    def from_workload(cls, req, *, top_k: int | None = None, arrival_s: float | None = None) -> "RecRequest":
        """From a `workloads.Request` (no timestamps; its ``num_candidates`` are generated)."""
        return cls(user_id=int(req.user), history=np.asarray(req.history, dtype=np.int64),
                   new_items=np.asarray(req.new_items, dtype=np.int64), num_candidates=int(req.num_candidates),
                   top_k=top_k, arrival_s=arrival_s)


@dataclass(frozen=True)
class PreparedRequest:
    """A request checked against the engine's config, its sequence as arrays."""

    req: RecRequest
    user: int
    items: np.ndarray  # int64 [n]: history + new items
    ts: np.ndarray  # float64 [n]
    num_history: int
    now_ts: float
    candidates: np.ndarray | None  # int64, or None: generate
    num_candidates: int
    top_k: int


def _length(values) -> int:
    try:
        return len(values) if values is not None else 0
    except TypeError:
        raise RequestError("history and new_items must be lists of item ids") from None


def _int_array(name: str, values, limit: int) -> np.ndarray:
    try:
        a = np.asarray(values if values is not None else ())
    except (TypeError, ValueError, OverflowError) as e:
        raise RequestError(f"{name} must be a list of item ids ({e})") from None
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.ndim == 1 and a.dtype.kind == "O":  # ints beyond int64 (e.g. 10**23) make an object array
        for i, v in enumerate(a):
            if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and not 0 <= v < limit:
                raise RequestError(f"{name}[{i}] = {int(v)} is out of range: item ids must be in [0, {limit})")
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise RequestError(f"{name} must be a flat list of integer item ids")
    bad = np.flatnonzero((a < 0) | (a >= limit))
    if bad.size:
        i = int(bad[0])
        raise RequestError(f"{name}[{i}] = {int(a[i])} is out of range: item ids must be in [0, {limit}) "
                           f"({bad.size} out of range)")
    return a.astype(np.int64, copy=False)


def prepare_request(config, req: RecRequest) -> PreparedRequest:
    """Check ``req`` against ``config`` (an `EngineConfig`: its item count and limits); returns
    its normalised form or raises `RequestError`."""
    c = config
    if isinstance(req.user_id, bool) or not isinstance(req.user_id, (int, np.integer)) or req.user_id < 0:
        raise RequestError(f"user_id must be a non-negative integer, got {req.user_id!r}")
    nh, nn = _length(req.history), _length(req.new_items)
    if nh + nn > c.max_history_len:  # before looking at the ids: an oversize request costs nothing
        raise RequestError(f"history ({nh}) + new_items ({nn}) = {nh + nn} tokens exceeds "
                           f"max_history_len {c.max_history_len}")
    hist = _int_array("history", req.history, c.num_items)
    new = _int_array("new_items", req.new_items, c.num_items)
    n = len(hist) + len(new)
    items = np.concatenate([hist, new])
    if req.timestamps is None:
        ts = np.zeros(n, dtype=np.float64)
        default_now = 0.0
    else:
        try:
            ts = np.asarray(req.timestamps, dtype=np.float64)
        except (TypeError, ValueError):
            raise RequestError("timestamps must be a list of numbers (seconds)") from None
        if ts.ndim != 1 or len(ts) != n:
            raise RequestError(f"timestamps must have one entry per history and new item ({n}), got "
                               f"{ts.size}")
        if not np.all(np.isfinite(ts)):
            raise RequestError("timestamps must be finite numbers")
        default_now = float(ts[-1]) if n else 0.0
    now_ts = default_now if req.now_ts is None else req.now_ts
    if isinstance(now_ts, bool) or not isinstance(now_ts, (int, float, np.integer, np.floating)) \
            or not math.isfinite(now_ts):
        raise RequestError(f"now_ts must be a finite number, got {req.now_ts!r}")
    if req.candidates is not None:
        cands = _int_array("candidates", req.candidates, c.num_items)
        if len(cands) == 0:
            raise RequestError("candidates must list at least one item id")
        if len(cands) > c.max_candidates:
            raise RequestError(f"{len(cands)} candidates exceed max_candidates {c.max_candidates}")
        num_c = len(cands)
    else:
        cands = None
        num_c = c.default_num_candidates if req.num_candidates is None else req.num_candidates
        if isinstance(num_c, bool) or not isinstance(num_c, (int, np.integer)) or num_c < 1:
            raise RequestError(f"num_candidates must be a positive integer, got {num_c!r}")
        limit = min(c.max_candidates, c.num_items)
        if num_c > limit:
            raise RequestError(f"num_candidates {num_c} exceeds the limit {limit} "
                               f"(min of max_candidates {c.max_candidates} and num_items {c.num_items})")
    top_k = c.default_top_k if req.top_k is None else req.top_k
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise RequestError(f"top_k must be a positive integer, got {top_k!r}")
    return PreparedRequest(req, int(req.user_id), items, ts, len(hist), float(now_ts), cands, int(num_c),
                           int(min(top_k, num_c)))


@dataclass(frozen=True)
class LatencyBreakdown:
    """Where one request's time went, in µs.

    - ``queue_us``: from arrival to the start of its micro-batch;
    - ``emb_lookup_us``: the batch's EMB lookup (shared by the batch), including ``link_us``, the
      emulated host-to-device wait for its misses (0 when the link is not emulated);
    - ``batch_wait_us``: time spent on the batch's other requests before this one's compute;
    - ``kv_read_us``: reading the reused K/V from the pages; ``kv_write_us``: appending the
      new tokens' pages and writing their K/V;
    - ``prefill_us``: the model's prefill of the tokens not cached; ``rank_us``: ranking and top-k;
      ``compute_us = prefill_us + rank_us``;
    - ``total_us``: arrival (or batch start) to the response.
    """

    queue_us: float
    emb_lookup_us: float
    link_us: float
    batch_wait_us: float
    kv_read_us: float
    prefill_us: float
    kv_write_us: float
    rank_us: float
    compute_us: float
    total_us: float

    def to_dict(self) -> dict:
        return {k: round(v, 1) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class RecResponse:
    """The top-k (items, scores; best first) with everything needed to explain the request."""

    user_id: int
    items: list[int]
    scores: list[float]
    num_candidates: int
    num_history: int
    kv: KVReuse
    kv_hit_tokens: int  # history tokens whose K/V came from the pages
    recomputed_tokens: int  # history tokens whose K/V had to be computed
    prefill_tokens: int  # every token prefilled (recomputed history + new items)
    kv_cached_after: int  # the user's tokens in the pool after the request (0: not cached)
    emb_rows: int
    emb_hits: int
    emb_batch_miss_bytes: int  # host-to-device bytes of the batch's lookup (shared by the batch)
    latency: LatencyBreakdown
    link_emulated: bool
    batch_size: int
    finished_s: float
    batch_passes: int = 1  # passes its batch took: one more for each repeat of a user in it
    device: dict | None = None  # `Engine.device_info`: real, link-emulated or emulated (and by which profile)

    def to_dict(self) -> dict:
        return {
            "user_id": self.user_id, "items": self.items, "scores": self.scores,
            "num_candidates": self.num_candidates, "num_history": self.num_history,
            "kv": {"outcome": self.kv.outcome, "reason": self.kv.reason, "hit_tokens": self.kv_hit_tokens,
                   "recomputed_tokens": self.recomputed_tokens, "prefill_tokens": self.prefill_tokens,
                   "cached_after": self.kv_cached_after},
            "emb": {"rows": self.emb_rows, "hits": self.emb_hits,
                    "batch_miss_bytes": self.emb_batch_miss_bytes},
            "latency_us": self.latency.to_dict(),
            "link_emulated": self.link_emulated,
            "batch_size": self.batch_size,
            "batch_passes": self.batch_passes,
            "device": self.device,
        }
