"""Request streams in three regimes (`steady`, `trend`, `burst`) generated from a `Trace`.

A request is (arrival time, user, the user's history up to now, the new items since the user's
previous request, the number of candidates to rank). The stream is generated column-wise with
numpy, deterministically for a seed, and keeps histories as *references* into the trace (base
user, length, rotation), so millions of requests cost a few arrays; `RequestStream.request(i)`
materialises one request's item ids when a consumer needs them.

Users. ``num_users`` may exceed the trace's own user count: user ``s`` replays trace user
``base_user[s]`` (itself for ``s < trace.num_users``, a uniform resample otherwise), starting at a
random rotation of that history so synthesised users do not share item order. A history longer
than the trace's is the base history tiled (position ``j`` is item ``base[(rot + j) % L]``), which
lets ``history_scale`` reach production lengths (the paper's histories run to 15k tokens).

Activity. A user's request weight is its base user's interaction count (the trace's activity
skew). The *hot set* is the top ``hot_user_fraction`` of users by weight.

History. A user's first request has ``round(L * history_scale * U(0.5, 1))`` items of history
(``L``: the base user's trace length) and ``Poisson(mean_new_items)`` new items. Later requests
bring the items the user touched since the previous one, ``Poisson(new_items_per_s * gap_s)``
(zero is a pure refresh), so histories grow with time, not with request count, and a user who
fires many requests in a burst brings few new items each time. New items per request are capped
at ``max_new_items``. The next request's history is the previous history plus those items (what
a KV cache can reuse); histories are capped at ``max_history_len``.

Regimes (``t`` runs over [0, duration_s], ``u = t / duration_s``):

- ``steady``: Poisson arrivals at ``rate_rps``; users drawn by weight.
- ``trend``: a gradual drift. Arrival rate ``rate_rps * (trend_rate_start + (trend_rate_end -
  trend_rate_start) * u)`` (the defaults 0.6 -> 1.4 keep the mean at ``rate_rps``); the share of
  requests sent by the hot set moves linearly from its natural share (its weight) to
  ``trend_hot_share_end``; history lengths scale by ``1 + (trend_history_scale_end - 1) * u``
  (first-request histories and the rate at which new items accrue).
- ``burst``: the steady stream plus ``num_bursts`` bursts (default one per ``burst_every_s``),
  each placed uniformly at random in its own equal slot of the run so bursts never overlap. A
  burst lasts ``burst_duration_s``; in it a fresh hot set of ``burst_hot_user_fraction`` of
  the users (at least one) sends extra requests at ``(burst_rate_mult - 1) * rate_rps``, so the
  total rate is ``burst_rate_mult`` times the baseline. ``burst_kind`` says what the burst moves:
  ``kv`` (default): the hot set is returning users drawn by activity (weight; long histories),
  which a KV pool can hold; ``emb``: the hot set is new users (not seen yet in the run, drawn
  uniformly) whose new items and candidates come from a hot set of ``burst_item_set_size`` items
  drawn uniformly from the catalogue (cold rows turned hot), which an EMB slab can hold.
- the trend also drifts item popularity: a request's new items and candidates are, with
  probability ``trend_item_drift_end * u``, their drifted twins (`RequestStream.shift_items`).

Schedules (`generate_schedule`, ``"steady:60,trend:60,burst:30,steady:60"``): the regimes follow
each other in one stream; users keep their identity and running histories across phases, the
drift reached in a trend stays for the phases after it.

Statistics (`window_stats`), per window of ``window_s``:

- ``rate_rps``: requests per second;
- ``hot_user_ratio``: share of the window's requests sent by the top 1% of the users active in
  the window (at least one user), ranked by their request count in the window;
- ``reuse_distance_p50``: median number of requests between a request and the same user's
  previous one (requests whose user has no previous request are left out): the KV cache's reuse
  interval, an upper bound on its LRU stack distance;
- ``item_top1pct_share``: share of the window's new-item lookups that go to its top 1% items;
- ``history_len_p50`` / ``history_len_p99``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np

from common.config import ranged, require
from common.config import validate as validate_fields
from common.shares import top_share

from .trace import Trace

REGIMES = ("steady", "trend", "burst")
BURST_KINDS = ("kv", "emb")


def _positive(default: float):
    return ranged(default, lo=0, lo_open=True)


@dataclass(frozen=True)
class RegimeConfig:
    """Parameters of a request stream; `validate` checks ranges. See the module docstring."""

    regime: str = ranged("steady", choices=REGIMES)
    rate_rps: float = _positive(1_000.0)
    duration_s: float = _positive(60.0)
    num_users: int | None = ranged(None, lo=1, integer=True, optional=True)  # None: the trace's own user count
    seed: int = 0
    num_candidates: int = ranged(256, lo=0, integer=True)
    mean_new_items: float = _positive(8.0)  # new items on a user's first request of the run
    new_items_per_s: float = ranged(8.0 / 60, lo=0)  # items a user touches per second between requests
    max_new_items: int = ranged(256, lo=1, integer=True)
    history_scale: float = _positive(1.0)
    max_history_len: int = ranged(15_000, lo=1, integer=True)
    hot_user_fraction: float = ranged(0.01, lo=0, hi=1, lo_open=True)
    # trend
    trend_rate_start: float = _positive(0.6)
    trend_rate_end: float = _positive(1.4)
    trend_hot_share_end: float = ranged(0.5, lo=0, hi=1, lo_open=True)
    trend_history_scale_end: float = _positive(3.0)
    # burst
    num_bursts: int | None = ranged(None, lo=0, integer=True, optional=True)  # None: max(1, round(duration_s / burst_every_s))
    burst_every_s: float = _positive(30.0)
    burst_duration_s: float = _positive(3.0)
    burst_rate_mult: float = ranged(4.0, lo=1)
    burst_hot_user_fraction: float = ranged(0.005, lo=0, hi=1, lo_open=True)
    # what a burst moves: "kv" (hot returning users, drawn by activity: long histories) or "emb"
    # (new users, drawn uniformly among those not seen yet, whose new items and candidates come
    # from a hot set of `burst_item_set_size` items drawn uniformly from the catalogue: cold rows)
    burst_kind: str = ranged("kv", choices=BURST_KINDS)
    burst_item_set_size: int = ranged(256, lo=1, integer=True)
    # trend: by the run's end this share of new items and candidates comes from a shifted
    # popularity (the item ranks moved by a fixed bijection): what is hot drifts
    trend_item_drift_end: float = ranged(0.5, lo=0, hi=1)

    def validate(self) -> "RegimeConfig":
        validate_fields(self)
        require(self, self.regime != "burst" or self.bursts_count() * self.burst_duration_s <= self.duration_s,
                f"{self.bursts_count()} bursts of {self.burst_duration_s} s do not fit in {self.duration_s} s")
        return self

    def bursts_count(self) -> int:
        if self.num_bursts is not None:
            return self.num_bursts
        return max(1, int(round(self.duration_s / self.burst_every_s)))


@dataclass
class Request:
    """One materialised request."""

    index: int
    arrival_s: float
    user: int
    history: np.ndarray  # item ids the user interacted with before this request, oldest first
    new_items: np.ndarray  # items since the user's previous request (appended after `history`)
    num_candidates: int


@dataclass
class RequestStream:
    """A generated stream, column-wise; row ``i`` is request ``i`` in arrival order."""

    trace: Trace
    config: RegimeConfig
    arrival_s: np.ndarray  # float64, non-decreasing
    user: np.ndarray  # int64 global user id in [0, num_users)
    history_len: np.ndarray  # int32 items before this request's new items
    num_new_items: np.ndarray  # int32 >= 0
    num_candidates: np.ndarray  # int32
    prev_request: np.ndarray  # int64 index of the same user's previous request, -1 if none
    base_user: np.ndarray  # int32 [num_users] trace user replayed by each user
    rotation: np.ndarray  # int32 [num_users] start offset into the base history
    hot_users: np.ndarray  # int64 users of the static hot set
    bursts: list[tuple[float, float]] = field(default_factory=list)  # [start_s, end_s)
    burst_hot_users: list[np.ndarray] = field(default_factory=list)
    # item shifts (see `shift_items`): per request the share of its new items and candidates drawn
    # from the drifted popularity, and the index of the hot item set it draws them from (-1: none)
    item_drift: np.ndarray | None = None
    item_set: np.ndarray | None = None
    item_sets: list[np.ndarray] = field(default_factory=list)
    phases: list[tuple[str, float, float]] = field(default_factory=list)  # (regime, start_s, end_s)

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def num_users(self) -> int:
        return len(self.base_user)

    def _items_at(self, user: int, positions: np.ndarray) -> np.ndarray:
        b = int(self.base_user[user])
        start, end = self.trace.offsets[b], self.trace.offsets[b + 1]
        return self.trace.items[start + (positions + self.rotation[user]) % (end - start)]

    def history(self, i: int) -> np.ndarray:
        return self._items_at(int(self.user[i]), np.arange(int(self.history_len[i])))

    def new_items(self, i: int) -> np.ndarray:
        h = int(self.history_len[i])
        items = self._items_at(int(self.user[i]), np.arange(h, h + int(self.num_new_items[i])))
        return self.shift_items(np.full(len(items), i), items) if self.item_drift is not None else items

    def request(self, i: int) -> Request:
        return Request(index=i, arrival_s=float(self.arrival_s[i]), user=int(self.user[i]),
                       history=self.history(i), new_items=self.new_items(i),
                       num_candidates=int(self.num_candidates[i]))

    def __iter__(self):
        for i in range(len(self)):
            yield self.request(i)

    @property
    def shifts_items(self) -> bool:
        return self.item_drift is not None

    def shift_items(self, req: np.ndarray, items: np.ndarray, salt: int = 0) -> np.ndarray:
        """The looked-up items of requests ``req`` (one entry per item) after the stream's item
        shifts: an item of a request in a hot item set's burst is that set's
        ``hash(req, item, salt) mod size``-th item; otherwise, with probability
        ``item_drift[req]`` (a hash, so deterministic), the item's drifted twin
        ``(item * 2654435761 + 12345) mod num_items`` (a bijection when the count is odd; a fixed
        map either way), so what was cold becomes hot as the drift grows. Histories read from the
        trace stay as they are."""
        if self.item_drift is None or len(items) == 0:
            return items
        n = self.trace.num_items
        req = np.asarray(req, dtype=np.int64)
        h = ((req.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ (np.asarray(items, dtype=np.uint64)
             * np.uint64(0xBF58476D1CE4E5B9)) ^ np.uint64(salt * 0x94D049BB133111EB + 1))
        h ^= h >> np.uint64(31)
        h *= np.uint64(0xD6E8FEB86659FD93)
        h ^= h >> np.uint64(32)
        u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        out = np.asarray(items, dtype=np.int64).copy()
        drift = u < self.item_drift[req]
        out[drift] = (out[drift] * 2654435761 + 12345) % n
        if self.item_sets:
            k = self.item_set[req]
            for j, items_j in enumerate(self.item_sets):
                m = k == j
                if m.any():
                    out[m] = items_j[(h[m] % np.uint64(len(items_j))).astype(np.int64)]
        return out

    def all_new_items(self) -> tuple[np.ndarray, np.ndarray]:
        """(request index, item id) of every new-item lookup in the stream, vectorised (after the
        stream's item shifts, `shift_items`)."""
        n_new = self.num_new_items.astype(np.int64)
        req = np.repeat(np.arange(len(self)), n_new)
        starts = np.cumsum(n_new) - n_new
        pos = self.history_len.astype(np.int64)[req] + (np.arange(len(req)) - starts[req])
        users = self.user[req]
        base = self.base_user[users]
        offs = self.trace.offsets
        lens = offs[base + 1] - offs[base]
        items = self.trace.items[offs[base] + (pos + self.rotation[users]) % lens]
        return req, self.shift_items(req, items)

    def in_burst(self) -> np.ndarray:
        """Boolean per request: arrived inside a burst window."""
        mask = np.zeros(len(self), dtype=bool)
        for s, e in self.bursts:
            mask |= (self.arrival_s >= s) & (self.arrival_s < e)
        return mask

    def window_stats(self, window_s: float = 1.0) -> dict[str, np.ndarray]:
        """Per-window statistics over the run (see the module docstring)."""
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        n_win = max(1, int(np.ceil(self.config.duration_s / window_s)))
        win = np.minimum((self.arrival_s // window_s).astype(np.int64), n_win - 1)
        bounds = np.searchsorted(win, np.arange(n_win + 1))
        req_idx, items = self.all_new_items()
        item_bounds = np.searchsorted(req_idx, bounds)
        reuse = np.where(self.prev_request >= 0, np.arange(len(self)) - self.prev_request, -1)
        out = {k: np.zeros(n_win) for k in ("rate_rps", "hot_user_ratio", "reuse_distance_p50",
                                             "item_top1pct_share", "history_len_p50", "history_len_p99")}
        out["t_s"] = (np.arange(n_win) + 0.5) * window_s
        for w in range(n_win):
            a, b = bounds[w], bounds[w + 1]
            out["rate_rps"][w] = (b - a) / window_s
            if b == a:
                continue
            out["hot_user_ratio"][w] = top_share(self.user[a:b], 0.01)
            r = reuse[a:b]
            r = r[r >= 0]
            out["reuse_distance_p50"][w] = np.median(r) if len(r) else np.nan
            out["item_top1pct_share"][w] = top_share(items[item_bounds[w] : item_bounds[w + 1]], 0.01)
            h = self.history_len[a:b]
            out["history_len_p50"][w] = np.percentile(h, 50)
            out["history_len_p99"][w] = np.percentile(h, 99)
        return out

    def summary(self) -> dict:
        """Whole-run figures as plain JSON-able values."""
        reuse = (np.arange(len(self)) - self.prev_request)[self.prev_request >= 0]
        _, items = self.all_new_items()
        burst = self.in_burst()
        return {
            "regime": self.config.regime,
            "num_requests": len(self),
            "num_users": self.num_users,
            "num_active_users": int(len(np.unique(self.user))),
            "duration_s": self.config.duration_s,
            "mean_rate_rps": round(len(self) / self.config.duration_s, 2),
            "hot_user_ratio": round(top_share(self.user, 0.01), 4),
            "reuse_distance_p50": round(float(np.median(reuse)), 1) if len(reuse) else None,
            "item_top1pct_share": round(top_share(items, 0.01), 4),
            "history_len_p50": round(float(np.percentile(self.history_len, 50)), 1) if len(self) else 0.0,
            "history_len_p99": round(float(np.percentile(self.history_len, 99)), 1) if len(self) else 0.0,
            "num_bursts": len(self.bursts),
            "burst_request_share": round(float(burst.mean()), 4) if len(self) else 0.0,
            "config": asdict(self.config),
        }


def _poisson_times(rng: np.random.Generator, rate: float, start: float, end: float) -> np.ndarray:
    n = rng.poisson(rate * (end - start))
    return rng.uniform(start, end, size=n)


def generate(trace: Trace, config: RegimeConfig | None = None, **overrides) -> RequestStream:
    """Generate the request stream of ``config`` (fields may be overridden by keyword)."""
    cfg = replace(config or RegimeConfig(), **overrides).validate()
    return generate_schedule(trace, [(cfg.regime, cfg.duration_s)], cfg)


def parse_schedule(text: str) -> list[tuple[str, float]]:
    """``"steady:60,trend:60,burst:30,steady:60"`` -> [(regime, seconds), ...] (checked)."""
    phases = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        name, sep, dur = part.partition(":")
        if not sep:
            raise ValueError(f"schedule phase {part!r}: want REGIME:SECONDS")
        if name not in REGIMES:
            raise ValueError(f"schedule phase {part!r}: regime must be one of {', '.join(REGIMES)}")
        try:
            d = float(dur)
        except ValueError:
            raise ValueError(f"schedule phase {part!r}: seconds must be a number") from None
        if not (np.isfinite(d) and d > 0):
            raise ValueError(f"schedule phase {part!r}: seconds must be positive")
        phases.append((name, d))
    if not phases:
        raise ValueError("schedule: want at least one REGIME:SECONDS phase")
    return phases


def generate_schedule(trace: Trace, phases, config: RegimeConfig | None = None, **overrides) -> RequestStream:
    """One stream whose regimes follow each other: ``phases`` is [(regime, seconds), ...] (or a
    `parse_schedule` string). Users keep their identity, activity and running histories across
    phases (one user population, histories computed over the whole run), so a cache's state
    carries over; each phase's arrivals, hot-user share, history scaling and bursts are those
    of its regime over its own span (``u`` runs over the phase), and the trend's item drift,
    once reached, stays for the phases after it (popularity does not drift back)."""
    if isinstance(phases, str):
        phases = parse_schedule(phases)
    phases = [(str(r), float(d)) for r, d in phases]
    base = replace(config or RegimeConfig(), **overrides)
    total = float(sum(d for _, d in phases))
    cfg = replace(base, regime=phases[0][0], duration_s=total).validate()
    for r, d in phases:
        replace(base, regime=r, duration_s=d).validate()
    rng = np.random.default_rng(cfg.seed)
    num_users = cfg.num_users or trace.num_users

    # users: base trace user, rotation, activity weight, hot set
    base_user = np.arange(num_users, dtype=np.int64)
    extra = base_user >= trace.num_users
    base_user[extra] = rng.integers(0, trace.num_users, size=int(extra.sum()))
    base_len = trace.seq_lens[base_user]
    rotation = np.where(extra, rng.integers(0, 1 << 30, size=num_users) % base_len, 0)
    weight = base_len.astype(np.float64)
    num_hot = max(1, int(np.ceil(cfg.hot_user_fraction * num_users)))
    hot_users = np.sort(np.argsort(-weight, kind="stable")[:num_hot])
    is_hot = np.zeros(num_users, dtype=bool)
    is_hot[hot_users] = True

    parts, bursts, burst_sets, item_sets, spans = [], [], [], [], []
    t0, drift0, seen = 0.0, 0.0, np.zeros(num_users, dtype=bool)
    for regime, dur in phases:
        pc = replace(base, regime=regime, duration_s=dur)
        p = _phase(rng, pc, num_users, weight, is_hot, hot_users, drift0, seen, len(item_sets), trace.num_items)
        parts.append((p["times"] + t0, p["users"], p["scale"], p["drift"], p["set"]))
        bursts += [(s + t0, e + t0) for s, e in p["bursts"]]
        burst_sets += p["burst_sets"]
        item_sets += p["item_sets"]
        spans.append((regime, t0, t0 + dur))
        seen[p["users"]] = True
        drift0 = p["drift_end"]
        t0 += dur
    times = np.concatenate([q[0] for q in parts])
    users = np.concatenate([q[1] for q in parts])
    scale = np.concatenate([q[2] for q in parts])
    drift = np.concatenate([q[3] for q in parts])
    iset = np.concatenate([q[4] for q in parts])
    n = len(times)

    # per-user running history: group requests by user (stable keeps arrival order within a user)
    by_user = np.argsort(users, kind="stable")
    su = users[by_user]
    first = np.ones(n, dtype=bool)
    first[1:] = su[1:] != su[:-1]
    st = times[by_user]
    gap = np.empty(n)
    gap[1:] = st[1:] - st[:-1]
    lam = np.where(first, cfg.mean_new_items, cfg.new_items_per_s * gap) * scale[by_user]
    sn = np.minimum(rng.poisson(lam), cfg.max_new_items)
    cs = np.cumsum(sn)
    group_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    before = cs - sn - (cs[group_start] - sn[group_start])  # new items of the user's earlier requests
    h0_frac = rng.uniform(0.5, 1.0, size=num_users)
    first_scale = scale[by_user][group_start]
    h0 = np.maximum(1, np.round(base_len[su] * cfg.history_scale * h0_frac[su] * first_scale)).astype(np.int64)
    hist = np.empty(n, dtype=np.int64)
    hist[by_user] = np.minimum(h0 + before, cfg.max_history_len)
    n_new = np.empty(n, dtype=np.int64)
    n_new[by_user] = sn
    prev = np.full(n, -1, dtype=np.int64)
    prev_sorted = np.where(first, -1, np.concatenate(([-1], by_user[:-1])))
    prev[by_user] = prev_sorted
    shifts = bool(np.any(drift > 0) or np.any(iset >= 0))

    return RequestStream(
        trace=trace,
        config=cfg,
        arrival_s=times,
        user=users,
        history_len=hist.astype(np.int32),
        num_new_items=n_new.astype(np.int32),
        num_candidates=np.full(n, cfg.num_candidates, dtype=np.int32),
        prev_request=prev,
        base_user=base_user.astype(np.int32),
        rotation=rotation.astype(np.int32),
        hot_users=hot_users,
        bursts=bursts,
        burst_hot_users=burst_sets,
        item_drift=drift if shifts else None,
        item_set=iset if shifts else None,
        item_sets=item_sets,
        phases=spans,
    )


def _phase(rng, cfg: RegimeConfig, num_users: int, weight: np.ndarray, is_hot: np.ndarray, hot_users: np.ndarray,
           drift0: float, seen: np.ndarray, set_base: int, num_items: int) -> dict:
    """One phase's arrivals (times from 0), users, history scaling, item drift and bursts."""
    dur, rate = cfg.duration_s, cfg.rate_rps
    if cfg.regime == "trend":
        a, b = cfg.trend_rate_start, cfg.trend_rate_end
        total = rate * dur * (a + b) / 2
        lam = rng.uniform(0, total, size=rng.poisson(total)) / (rate * dur)  # cumulative intensity / (r D)
        # invert  lam = a u + (b - a) u^2 / 2  for u in [0, 1]
        if abs(b - a) < 1e-12:
            u = lam / a
        else:
            u = (-a + np.sqrt(a * a + 2 * (b - a) * lam)) / (b - a)
        times = np.clip(u, 0, 1) * dur
    else:
        times = _poisson_times(rng, rate, 0.0, dur)
    times.sort()
    u = times / dur

    # users of the base process: hot with probability p_hot(u), else by weight among the others
    p_hot0 = float(weight[is_hot].sum() / weight.sum())
    if cfg.regime == "trend":
        p_hot = p_hot0 + (max(cfg.trend_hot_share_end, p_hot0) - p_hot0) * u
    else:
        p_hot = np.full(len(times), p_hot0)
    pick_hot = rng.random(len(times)) < p_hot
    users = np.empty(len(times), dtype=np.int64)
    cold_users = np.flatnonzero(~is_hot)
    users[pick_hot] = _weighted_choice(rng, hot_users, weight[hot_users], int(pick_hot.sum()))
    users[~pick_hot] = _weighted_choice(rng, cold_users, weight[cold_users], int((~pick_hot).sum()))
    iset = np.full(len(times), -1, dtype=np.int64)

    # bursts: extra requests from a fresh hot set, one burst per equal slot of the run
    bursts: list[tuple[float, float]] = []
    burst_sets: list[np.ndarray] = []
    item_sets: list[np.ndarray] = []
    if cfg.regime == "burst" and cfg.bursts_count() > 0:
        k = cfg.bursts_count()
        slot = dur / k
        extra_t, extra_u, extra_s = [times], [users], [iset]
        num_burst_users = max(1, int(round(cfg.burst_hot_user_fraction * num_users)))
        for j in range(k):
            s = j * slot + rng.uniform(0, slot - cfg.burst_duration_s)
            e = s + cfg.burst_duration_s
            size = min(num_burst_users, num_users)
            if cfg.burst_kind == "kv":  # hot returning users, by activity (long histories)
                hot = np.sort(rng.choice(num_users, size=size, replace=False, p=weight / weight.sum()))
            else:  # new users (not seen yet, when there are enough), uniformly
                before = seen.copy()
                before[users[times < s]] = True
                fresh = np.flatnonzero(~before)
                pool = fresh if len(fresh) >= size else np.arange(num_users)
                hot = np.sort(rng.choice(pool, size=size, replace=False))
                item_sets.append(np.sort(rng.choice(num_items, size=min(cfg.burst_item_set_size, num_items),
                                                    replace=False)))
            t = _poisson_times(rng, (cfg.burst_rate_mult - 1) * rate, s, e)
            extra_t.append(t)
            extra_u.append(hot[rng.integers(0, len(hot), size=len(t))])
            extra_s.append(np.full(len(t), set_base + len(item_sets) - 1 if cfg.burst_kind == "emb" else -1))
            bursts.append((float(s), float(e)))
            burst_sets.append(hot)
        times = np.concatenate(extra_t)
        users = np.concatenate(extra_u)
        iset = np.concatenate(extra_s)
        order = np.argsort(times, kind="stable")
        times, users, iset = times[order], users[order], iset[order]
        u = times / dur

    n = len(times)
    scale = 1.0 + (cfg.trend_history_scale_end - 1.0) * u if cfg.regime == "trend" else np.ones(n)
    if cfg.regime == "trend":
        drift_end = max(drift0, cfg.trend_item_drift_end)
        drift = drift0 + (drift_end - drift0) * u
    else:
        drift_end = drift0
        drift = np.full(n, drift0)
    return {"times": times, "users": users, "scale": scale, "drift": drift, "set": iset, "bursts": bursts,
            "burst_sets": burst_sets, "item_sets": item_sets, "drift_end": drift_end}


def _weighted_choice(rng: np.random.Generator, population: np.ndarray, weight: np.ndarray, size: int) -> np.ndarray:
    if size == 0:
        return np.empty(0, dtype=np.int64)
    if len(population) == 0:
        raise ValueError("cannot draw users from an empty population")
    cdf = np.cumsum(weight)
    idx = np.searchsorted(cdf, rng.random(size) * cdf[-1], side="right")
    return population[np.minimum(idx, len(population) - 1)]
