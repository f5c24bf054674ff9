"""A session model of a trace's users, and request streams drawn from it or replayed in trace order.

**Requests.** A request is the interactions of one user that share one timestamp
(`trace_requests`): on Taobao (timestamps in seconds) nearly every interaction is a request of
its own (0.3% of same-user gaps are 0); on Amazon (timestamps at day resolution) a request is a
user's day of reviews. The request's new items are those interactions; its history is everything
the user did before.

**The session model** (`fit_sessions` -> `SessionModel`). A user's consecutive requests are
*within* one session when the gap between them is at most ``threshold_s``, else the second one
opens a new session. The threshold is found in the data (``threshold_rule="valley"``): the
minimum of the density of log10(gap) (a Gaussian kernel of 0.15 decades) between 5 minutes and 6
hours, when that minimum is an interior valley at least 10% below both sides' highest density.
On the Taobao sample the same-user gaps are bimodal (a mode near 55 s, browsing; a mode near 13
h, the next visit) and the valley lies at 2,750 s, 46 minutes (docs/workloads.md). Where
there is no valley (Amazon's gaps are whole days; a synthetic trace's are exponential) the
threshold is the 30-minute rule of web-session studies (``threshold_rule="default"``); a caller
may also give it (``"given"``). The model keeps, each as quantiles at `QUANTILE_PROBS` (figures
rounded to 4 significant digits):

- ``within_gap_q_s``: gaps inside a session (with a lognormal summary: median and log-sd);
- ``session_len_q``: requests per session;
- ``between_ratio_q``: a gap between sessions divided by the mean of that user's own gaps
  between sessions (users with at least two such gaps): the *shape* of return times, apart
  from how active the user is (a heavy user returns in hours, a light one in days, with the
  same shape);
- ``items_per_request``: mean interactions per request.

**Session streams** (`session_stream`). Every user of the stream (``num_users``; users past the
trace's own replay a resampled trace user at a random rotation, as in `workloads.regimes`) runs
a renewal process in *modelled* time: a session of ``n ~ session_len_q`` requests separated by
``within_gap_q_s`` gaps, then a gap ``max(threshold_s, r * b_u)`` with ``r ~ between_ratio_q``
and ``b_u`` the base user's mean gap between sessions (the trace's span over its session count,
less its mean session span), then the next session. Time 0 falls at a stationary phase of each
user's process (it runs from `BURN_IN_S` before: `_draw_sessions`), so the run opens
mid-stream, not with every user arriving together. Modelled time maps linearly onto the run:
with ``num_users`` given, the run is the first ``round(rate_rps * duration_s)`` requests and
``modelled_s_per_s`` follows (the declared rate exactly); a ``modelled_span_s`` instead fixes the
modelled time and the user count follows (the rate in expectation). ``hour_curve`` (24 relative
rates, modelled span one day) lays the session *starts* on a day's curve (time-warped: a
session's own gaps are not stretched).

**Histories** follow `workloads.regimes`: a user's first request of the run has
``round(L * history_scale * U(0.5, 1))`` items of history (``L``: the base user's trace length);
each request brings ``1 + Poisson(items_per_request - 1)`` new items (at most ``max_new_items``)
and the next request's history is the previous one plus those (capped at ``max_history_len``).

**Trace order** (`trace_order_stream`): the trace's own requests from ``start_s`` on, the first
``round(rate_rps * duration_s)`` of them in their time order, every gap compressed by one factor
(``modelled_s_per_s``) so the run has the declared mean rate; each user's requests keep their
real order and their real history positions (the request at trace position ``j`` has ``j`` items
of history, plus ``round((history_scale - 1) * L * U(0.5, 1))`` older items tiled in front when
``history_scale > 1``: the law of `workloads.regimes`'s first histories for the part the trace
does not hold).

All streams are `workloads.regimes.RequestStream`s (``config.regime`` is ``steady``: one phase,
no bursts, no item drift), so the simulator takes them as they are, and so do the replay's
`workloads.replay.Phase` and ``request_body``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from common.config import ranged
from common.config import validate as validate_fields

from .regimes import RegimeConfig, RequestStream
from .trace import Trace

#: the probabilities at which a `SessionModel` keeps its quantiles
QUANTILE_PROBS = (0.0, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65,
                  0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.975, 0.99, 0.999, 1.0)
DEFAULT_THRESHOLD_S = 1800.0  # the 30-minute rule, where the data shows no valley
VALLEY_RANGE_S = (300.0, 21_600.0)  # where a valley between the two gap modes is looked for
VALLEY_BANDWIDTH_DECADES = 0.15
VALLEY_DEPTH = 0.9  # the valley's density at most this share of the lower of the two sides' peaks
RECENT_WINDOW_S = 600.0  # "active in the last 10 minutes" (modelled time)
MAX_REQUESTS = 20_000_000  # the most requests one stream may hold (memory bound)
MAX_USERS = 10_000_000


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (0 stays 0)."""
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def _quantiles(x: np.ndarray) -> tuple[float, ...]:
    if len(x) == 0:
        return ()
    return tuple(_sig(v) for v in np.quantile(np.asarray(x, dtype=np.float64), QUANTILE_PROBS))


def check_run(rate_rps: float, duration_s: float) -> int:
    """The request count ``round(rate_rps * duration_s)`` of a run, after checking both are finite
    and positive and the count is between 1 and `MAX_REQUESTS`; a `ValueError` says which is not."""
    for name, v in (("rate_rps", rate_rps), ("duration_s", duration_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v) \
                or v <= 0:
            raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    n = int(round(float(rate_rps) * float(duration_s)))
    if not 1 <= n <= MAX_REQUESTS:
        raise ValueError(f"rate_rps x duration_s = {rate_rps:g} x {duration_s:g} gives {n} requests; "
                         f"want 1 to {MAX_REQUESTS:,}")
    return n


# ------------------------------------------------------------------------------- trace requests


@dataclass(frozen=True)
class TraceRequests:
    """A trace's requests (a user's interactions sharing one timestamp), ordered by (user, time):
    ``user``, ``time_s``, ``position`` (index of the request's first interaction in the user's
    history) and ``num_items`` per request; ``first[u]`` is the index of user ``u``'s first
    request (CSR offsets, ``num_users + 1`` entries)."""

    user: np.ndarray
    time_s: np.ndarray
    position: np.ndarray
    num_items: np.ndarray
    first: np.ndarray

    def __len__(self) -> int:
        return len(self.user)

    def gaps_s(self) -> np.ndarray:
        """Per request, the gap since the same user's previous request (inf for a user's first)."""
        g = np.full(len(self), np.inf)
        g[1:] = np.diff(self.time_s)
        g[self.first[:-1]] = np.inf
        return g

    def core_span_s(self) -> tuple[float, float]:
        """The 0.1st and 99.9th percentiles of the request times: the trace's span without its
        stray rows (the Taobao sample has one row two months before the rest)."""
        lo, hi = np.percentile(self.time_s, [0.1, 99.9])
        return float(lo), float(max(hi, lo + 1.0))


def trace_requests(trace: Trace) -> TraceRequests:
    """Group ``trace``'s interactions into requests (see the module docstring)."""
    n = trace.num_interactions
    users = np.repeat(np.arange(trace.num_users, dtype=np.int64), trace.seq_lens)
    ts = np.asarray(trace.timestamps_s, dtype=np.float64)
    if len(ts) != n or not np.all(np.isfinite(ts)):
        raise ValueError(f"{trace.name}: a session model needs a finite timestamp per interaction")
    starts = np.ones(n, dtype=bool)
    starts[1:] = (users[1:] != users[:-1]) | (ts[1:] != ts[:-1])
    idx = np.flatnonzero(starts)
    num_items = np.diff(np.r_[idx, n])
    req_user = users[idx]
    position = idx - trace.offsets[req_user]
    first = np.searchsorted(req_user, np.arange(trace.num_users + 1))
    return TraceRequests(user=req_user, time_s=ts[idx], position=position.astype(np.int64),
                         num_items=num_items.astype(np.int64), first=first.astype(np.int64))


# ------------------------------------------------------------------------------- the model


def find_threshold(gaps_s: np.ndarray) -> tuple[float, str]:
    """The session gap threshold in ``gaps_s`` (positive, finite same-user gaps) and its rule
    (``valley`` or ``default``); see the module docstring."""
    g = np.asarray(gaps_s, dtype=np.float64)
    g = g[np.isfinite(g) & (g > 0)]
    lo, hi = np.log10(VALLEY_RANGE_S[0]), np.log10(VALLEY_RANGE_S[1])
    if len(g) < 50 or np.mean((g >= VALLEY_RANGE_S[0]) & (g <= VALLEY_RANGE_S[1])) < 0.01:
        return DEFAULT_THRESHOLD_S, "default"
    x = np.log10(g)
    if len(x) > 200_000:  # the density needs no more points than this
        x = np.random.default_rng(0).choice(x, 200_000, replace=False)
    grid = np.arange(-1.0, 8.0, 0.02)
    dens = np.zeros(len(grid))
    for chunk in np.array_split(x, max(1, len(x) // 20_000)):
        dens += np.exp(-0.5 * ((grid[:, None] - chunk[None, :]) / VALLEY_BANDWIDTH_DECADES) ** 2).sum(axis=1)
    inside = np.flatnonzero((grid >= lo) & (grid <= hi))
    k = inside[np.argmin(dens[inside])]
    left, right = dens[: k + 1].max(), dens[k:].max()
    if k in (inside[0], inside[-1]) or dens[k] > VALLEY_DEPTH * min(left, right):
        return DEFAULT_THRESHOLD_S, "default"
    return _sig(10 ** grid[k], 3), "valley"


@dataclass(frozen=True)
class SessionModel:
    """Sessions of a trace's users (see the module docstring); `fit_sessions` builds it."""

    trace: str
    threshold_s: float
    threshold_rule: str  # "valley", "default" or "given"
    num_users: int
    num_requests: int
    num_sessions: int
    span_s: float  # the trace's core span (`TraceRequests.core_span_s`)
    items_per_request: float
    session_len_mean: float
    session_len_q: tuple[float, ...]
    within_gap_median_s: float | None
    within_gap_log_sd: float | None  # sd of ln(gap): the lognormal summary
    within_gap_q_s: tuple[float, ...]
    between_gap_median_s: float | None
    between_ratio_q: tuple[float, ...]  # gap between sessions / the user's own mean such gap
    recent_share: float  # share of requests whose user had a request in the previous 10 minutes
    requests_per_user_day: float
    quantile_probs: tuple[float, ...] = QUANTILE_PROBS

    def to_json(self) -> dict:
        """Plain JSON-able figures (lists for the quantiles)."""
        out = asdict(self)
        for f in fields(self):
            if isinstance(out[f.name], tuple):
                out[f.name] = list(out[f.name])
        return out

    # sampling: inverse CDFs interpolated between the quantiles
    def sample_session_lengths(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` session lengths (requests, int64 >= 1)."""
        q = np.asarray(self.session_len_q, dtype=np.float64)
        return np.maximum(1, np.rint(np.interp(rng.random(n), self.quantile_probs, q))).astype(np.int64)

    def sample_within_gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` gaps inside a session (s), log-interpolated between the quantiles."""
        if n and not self.within_gap_q_s:
            raise ValueError(f"{self.trace}: the model has no gap inside a session to draw from")
        return _log_interp(rng.random(n), self.quantile_probs, self.within_gap_q_s)

    def sample_between_ratios(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` gaps between sessions in units of the user's mean gap between sessions."""
        return _log_interp(rng.random(n), self.quantile_probs, self.between_ratio_q)

    def mean_session_len(self) -> float:
        """The mean of the session length `sample_session_lengths` draws (integrated over its
        inverse CDF), which sets the session count a request count needs."""
        u = (np.arange(4000) + 0.5) / 4000
        return float(np.maximum(1, np.rint(np.interp(u, self.quantile_probs, self.session_len_q))).mean())

    def mean_session_span_s(self) -> float:
        """The mean time from a session's first request to its last (modelled s)."""
        if not self.within_gap_q_s:
            return 0.0
        u = (np.arange(4000) + 0.5) / 4000
        return (self.mean_session_len() - 1) * float(_log_interp(u, self.quantile_probs, self.within_gap_q_s).mean())


    def mean_gaps_s(self, b: np.ndarray) -> np.ndarray:
        """``E[max(threshold_s, r b)]`` per user whose mean gap between sessions is ``b``: the mean
        gap `_draw_sessions` leaves between that user's sessions."""
        r = _ratio_grid(self)
        tail = np.r_[np.cumsum(r[::-1])[::-1], 0.0] / len(r)  # tail[k] = E[r; r >= r_k]
        b = np.asarray(b, dtype=np.float64)
        k = np.searchsorted(r, self.threshold_s / np.maximum(b, 1e-12))
        return self.threshold_s * k / len(r) + b * tail[k]

    def request_rates(self, b: np.ndarray) -> np.ndarray:
        """Requests per modelled second of users whose mean gap between sessions is ``b``: a
        session's mean length over the mean cycle (its span plus `mean_gaps_s`)."""
        return self.mean_session_len() / (self.mean_session_span_s() + self.mean_gaps_s(b))

    def sample_between_ratios_at(self, u: np.ndarray) -> np.ndarray:
        """The between-session ratio at probabilities ``u`` (its inverse CDF)."""
        return _log_interp(np.asarray(u, dtype=np.float64), self.quantile_probs, self.between_ratio_q)


def _log_interp(u: np.ndarray, probs, q) -> np.ndarray:
    q = np.asarray(q, dtype=np.float64)
    return np.exp(np.interp(u, probs, np.log(np.maximum(q, 1e-9))))


def _exp_quantiles() -> tuple[float, ...]:
    """Quantiles of Exp(1) (the last at 1 - 1e-4): return times of a Poisson session process."""
    p = np.minimum(np.asarray(QUANTILE_PROBS), 1 - 1e-4)
    return tuple(_sig(max(v, 1e-6)) for v in -np.log1p(-p))


def user_sessions(req: TraceRequests, threshold_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per request, whether it opens a session; per trace user, its session count and the mean
    span of its sessions (s)."""
    gap = req.gaps_s()
    opens = gap > threshold_s
    sess_id = np.cumsum(opens) - 1
    num_users = len(req.first) - 1
    sess_user = req.user[opens]
    counts = np.bincount(sess_user, minlength=num_users)
    t_first = req.time_s[opens]
    t_last = np.full(len(t_first), -np.inf)
    np.maximum.at(t_last, sess_id, req.time_s)
    spans = np.bincount(sess_user, weights=t_last - t_first, minlength=num_users)
    return opens, counts, spans / np.maximum(counts, 1)


def fit_sessions(trace: Trace, *, threshold_s: float | None = None) -> SessionModel:
    """Fit a `SessionModel` to ``trace``'s per-user request gaps (see the module docstring).
    ``threshold_s``: the session gap threshold (None: found in the data)."""
    if threshold_s is not None and not (isinstance(threshold_s, (int, float)) and math.isfinite(threshold_s)
                                        and threshold_s > 0):
        raise ValueError(f"threshold_s must be a positive number of seconds, got {threshold_s!r}")
    req = trace_requests(trace)
    gap = req.gaps_s()
    finite = np.isfinite(gap)
    if threshold_s is None:
        thr, rule = find_threshold(gap[finite])
    else:
        thr, rule = float(threshold_s), "given"
    opens, counts, _ = user_sessions(req, thr)
    within = gap[finite & ~opens]
    sess_len = np.diff(np.r_[np.flatnonzero(opens), len(req)])
    # gaps between sessions, each over its user's own mean such gap (users with two or more)
    bg_mask = finite & opens
    bg, bu = gap[bg_mask], req.user[bg_mask]
    n_bg = np.bincount(bu, minlength=trace.num_users)
    mean_bg = np.bincount(bu, weights=bg, minlength=trace.num_users) / np.maximum(n_bg, 1)
    keep = n_bg[bu] >= 2
    ratios = bg[keep] / mean_bg[bu[keep]]
    t0, t1 = req.core_span_s()
    span = t1 - t0
    ln_w = np.log(within) if len(within) else np.empty(0)
    return SessionModel(
        trace=trace.name,
        threshold_s=_sig(thr),
        threshold_rule=rule,
        num_users=trace.num_users,
        num_requests=len(req),
        num_sessions=int(opens.sum()),
        span_s=_sig(span, 6),
        items_per_request=_sig(trace.num_interactions / len(req)),
        session_len_mean=_sig(sess_len.mean()),
        session_len_q=_quantiles(sess_len),
        within_gap_median_s=_sig(np.median(within)) if len(within) else None,
        within_gap_log_sd=_sig(ln_w.std()) if len(within) > 1 else None,
        within_gap_q_s=_quantiles(within),
        between_gap_median_s=_sig(np.median(bg)) if len(bg) else None,
        between_ratio_q=_quantiles(ratios) if len(ratios) >= 10 else _exp_quantiles(),
        recent_share=_sig(float(np.mean(gap <= RECENT_WINDOW_S))),
        requests_per_user_day=_sig(len(req) / trace.num_users / (span / 86_400.0)),
    )


# ------------------------------------------------------------------------------- stream shape


@dataclass(frozen=True)
class StreamShape:
    """What a request carries, as `workloads.regimes.RegimeConfig` names it (ranges checked)."""

    num_candidates: int = ranged(256, lo=0, integer=True)
    max_new_items: int = ranged(256, lo=1, integer=True)
    max_history_len: int = ranged(15_000, lo=1, integer=True)
    history_scale: float = ranged(1.0, lo=0, lo_open=True, hi=1000)

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass(frozen=True)
class Modelled:
    """A stream and how much modelled (trace) time one second of the run stands for."""

    stream: RequestStream
    modelled_s_per_s: float

    def recent_share(self, window_s: float = RECENT_WINDOW_S) -> float:
        """Share of the run's requests whose user sent one in the previous ``window_s`` of
        modelled time (a user's first request in the run counts as not recent)."""
        return recent_share(self.stream, window_s / self.modelled_s_per_s)


def recent_share(stream: RequestStream, window_run_s: float) -> float:
    """Share of ``stream``'s requests whose user's previous request came at most ``window_run_s``
    (run time) before."""
    if len(stream) == 0:
        return 0.0
    prev = stream.prev_request
    ok = prev >= 0
    gap = np.where(ok, stream.arrival_s - stream.arrival_s[np.maximum(prev, 0)], np.inf)
    return float(np.mean(gap <= window_run_s))


def _users(trace: Trace, num_users: int, rng: np.random.Generator,
           pool: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(base trace user, rotation) per stream user: the users of ``pool`` (default every trace
    user) each once, a random subset of them when fewer are asked; past the pool's size, users
    resampled from it at a random rotation of their history (as `workloads.regimes` draws them)."""
    pool = np.arange(trace.num_users, dtype=np.int64) if pool is None else pool
    if num_users < len(pool):
        return np.sort(rng.choice(pool, size=num_users, replace=False)), np.zeros(num_users, dtype=np.int64)
    extra = num_users - len(pool)
    base_user = np.r_[pool, pool[rng.integers(0, len(pool), size=extra)]].astype(np.int64)
    rotation = np.r_[np.zeros(len(pool), dtype=np.int64),
                     rng.integers(0, 1 << 30, size=extra) % trace.seq_lens[base_user[len(pool):]]]
    return base_user, rotation


def assemble(trace: Trace, cfg: RegimeConfig, arrival_s: np.ndarray, users: np.ndarray, history_len: np.ndarray,
             num_new_items: np.ndarray, base_user: np.ndarray, rotation: np.ndarray) -> RequestStream:
    """A `RequestStream` from per-request columns sorted by arrival (previous requests and the
    hot set computed here, as `workloads.regimes.generate_schedule` does)."""
    n = len(arrival_s)
    by_user = np.argsort(users, kind="stable")
    su = users[by_user]
    first = np.ones(n, dtype=bool)
    first[1:] = su[1:] != su[:-1]
    prev = np.full(n, -1, dtype=np.int64)
    prev[by_user] = np.where(first, -1, np.concatenate(([-1], by_user[:-1])))
    weight = trace.seq_lens[base_user].astype(np.float64)
    num_hot = max(1, int(np.ceil(cfg.hot_user_fraction * len(base_user))))
    hot_users = np.sort(np.argsort(-weight, kind="stable")[:num_hot])
    return RequestStream(
        trace=trace, config=cfg, arrival_s=np.asarray(arrival_s, dtype=np.float64), user=users.astype(np.int64),
        history_len=np.minimum(history_len, cfg.max_history_len).astype(np.int32),
        num_new_items=np.minimum(num_new_items, cfg.max_new_items).astype(np.int32),
        num_candidates=np.full(n, cfg.num_candidates, dtype=np.int32), prev_request=prev,
        base_user=base_user.astype(np.int32), rotation=rotation.astype(np.int32), hot_users=hot_users,
        phases=[("steady", 0.0, cfg.duration_s)])


def _regime_config(n_users: int, rate_rps: float, duration_s: float, seed: int, shape: StreamShape) -> RegimeConfig:
    return RegimeConfig(regime="steady", rate_rps=float(rate_rps), duration_s=float(duration_s), num_users=n_users,
                        seed=int(seed), num_candidates=shape.num_candidates, max_new_items=shape.max_new_items,
                        history_scale=shape.history_scale, max_history_len=shape.max_history_len).validate()


# ------------------------------------------------------------------------------- session streams


def _hour_warp(hour_curve) -> tuple[np.ndarray, np.ndarray]:
    """(modelled time of day, operational time) knots of the day's cumulative intensity: each
    hour at its own rate (piecewise constant, so every hour keeps its share of the day),
    normalised to a mean of 1, so operational time runs as fast as sessions start."""
    c = np.asarray(hour_curve, dtype=np.float64)
    if c.shape != (24,) or not np.all(np.isfinite(c)) or np.any(c < 0) or c.sum() <= 0:
        raise ValueError("hour_curve must be 24 finite non-negative rates, not all zero")
    rate = np.maximum(c, 1e-6 * c.max())
    t = np.arange(25) * 3600.0
    cum = np.r_[0.0, np.cumsum(rate)]
    return t, cum * 86_400.0 / cum[-1]


def _sessions(model: SessionModel, rng: np.random.Generator, count: int) -> tuple[np.ndarray, ...]:
    """``count`` sessions: their lengths, every request's offset from its session's start
    (concatenated), each session's first request's index in that array, and their spans."""
    n = model.sample_session_lengths(rng, count)
    total = int(n.sum())
    gaps = model.sample_within_gaps(rng, total) if model.within_gap_q_s else np.zeros(total)
    firsts = np.cumsum(n) - n
    gaps[firsts] = 0.0  # a session's first request comes at its start
    within = np.cumsum(gaps)
    within -= np.repeat(within[firsts], n)
    return n, within, firsts, within[firsts + n - 1]


_GRID = 4000  # equal-probability points of the between-session ratio for means and length-biased draws


def _ratio_grid(model: SessionModel) -> np.ndarray:
    return np.sort(model.sample_between_ratios_at((np.arange(_GRID) + 0.5) / _GRID))


def _length_biased_gaps(model: SessionModel, b: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Per user, a gap between sessions drawn length-biased: with probability proportional to
    the gap ``max(threshold_s, r b)`` over the grid of ``r`` (the gap time 0 falls in)."""
    thr = model.threshold_s
    r = _ratio_grid(model)
    R = np.r_[0.0, np.cumsum(r)]  # R[i]: sum of the i smallest ratios
    b = np.asarray(b, dtype=np.float64)
    k = np.searchsorted(r, thr / np.maximum(b, 1e-12))  # ratios whose gap is the threshold
    total = thr * k + b * (R[-1] - R[k])
    target = rng.random(len(b)) * total
    low = target <= thr * k
    i_low = np.ceil(target / thr).astype(np.int64) - 1
    i_high = np.searchsorted(R, R[k] + (target - thr * k) / np.maximum(b, 1e-12), side="left") - 1
    i = np.clip(np.where(low, i_low, i_high), 0, len(r) - 1)
    return np.maximum(thr, r[i] * b)
BURN_IN_S = 6 * 3600.0  # modelled time a user's process runs before the run opens (sessions rarely last longer)


def _draw_sessions(model: SessionModel, b: np.ndarray, horizon_s: float, rng: np.random.Generator,
                   warp: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, ...]:
    """Every user's requests in modelled time [0, horizon_s): (time, user, new items) unsorted.
    ``b``: per user, the mean gap between sessions (s). ``warp``: operational -> modelled time
    knots for the session starts (None: the identity).

    Each user's process starts `BURN_IN_S` before time 0 at a uniform point of a gap drawn
    length-biased (the stationary phase of a renewal process whose sessions are short against
    its gaps); by time 0 the sessions in progress are those the process itself began, so the run
    opens mid-stream (requests before 0 are dropped)."""
    num_users = len(b)
    thr = model.threshold_s
    out_t, out_u = [], []
    start = -BURN_IN_S + rng.random(num_users) * _length_biased_gaps(model, b, rng)  # next session starts
    users = np.arange(num_users)
    while True:  # one session per live user a pass; every pass moves a start on by >= threshold_s
        live = start < horizon_s
        if not live.any():
            break
        users, start = users[live], start[live]
        n, within, _, span = _sessions(model, rng, len(users))
        t_start = start if warp is None else _warp(start, warp)
        out_t.append(np.repeat(t_start, n) + within)
        out_u.append(np.repeat(users, n))
        start = start + span + np.maximum(thr, model.sample_between_ratios(rng, len(users)) * b[users])
    t = np.concatenate(out_t) if out_t else np.empty(0)
    u = np.concatenate(out_u) if out_u else np.empty(0, dtype=np.int64)
    keep = (t >= 0) & (t < horizon_s)
    t, u = t[keep], u[keep]
    extra = max(0.0, model.items_per_request - 1.0)
    k = 1 + (rng.poisson(extra, size=len(t)) if extra > 0 else np.zeros(len(t), dtype=np.int64))
    return t, u.astype(np.int64), k.astype(np.int64)


def _warp(tau: np.ndarray, warp: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Operational time -> modelled time (periodic over days)."""
    t_knots, cum = warp
    day = np.floor(tau / 86_400.0)
    return day * 86_400.0 + np.interp(tau - day * 86_400.0, cum, t_knots)


def user_gap_means(trace: Trace, model: SessionModel, req: TraceRequests | None = None) -> np.ndarray:
    """Per trace user, the mean gap between its sessions in modelled time: the model's span over
    the user's session count, less its mean session span, at least ``threshold_s``."""
    req = req or trace_requests(trace)
    _, counts, span_mean = user_sessions(req, model.threshold_s)
    return np.maximum(model.threshold_s, model.span_s / np.maximum(counts, 1) - span_mean)


def modelled_session_stream(trace: Trace, model: SessionModel | None = None, *, rate_rps: float, duration_s: float,
                            seed: int = 0, num_users: int | None = None, modelled_span_s: float | None = None,
                            hour_curve=None, base_users: np.ndarray | None = None,
                            shape: StreamShape | None = None) -> Modelled:
    """A session stream and its time scale; see `session_stream` (the same arguments)."""
    n_req = check_run(rate_rps, duration_s)
    model = model or fit_sessions(trace)
    shape = shape or StreamShape()
    if num_users is not None and modelled_span_s is not None:
        raise ValueError("give num_users or modelled_span_s, not both (the other follows from the rate)")
    if hour_curve is not None and modelled_span_s is None:
        raise ValueError("hour_curve lays sessions on a day: give modelled_span_s too (86400 for one day)")
    if modelled_span_s is not None and not (isinstance(modelled_span_s, (int, float)) and
                                            math.isfinite(modelled_span_s) and modelled_span_s > 0):
        raise ValueError(f"modelled_span_s must be a positive number of seconds, got {modelled_span_s!r}")
    if num_users is not None and not (isinstance(num_users, (int, np.integer)) and 1 <= num_users <= MAX_USERS):
        raise ValueError(f"num_users must be an integer in [1, {MAX_USERS:,}], got {num_users!r}")
    pool = None
    if base_users is not None:
        pool = np.unique(np.asarray(base_users, dtype=np.int64))
        if len(pool) == 0 or pool[0] < 0 or pool[-1] >= trace.num_users:
            raise ValueError(f"base_users must be trace users in [0, {trace.num_users})")
    rng = np.random.default_rng([int(seed), 23])
    b_trace = user_gap_means(trace, model)
    rate_trace = model.request_rates(b_trace)
    if modelled_span_s is not None:
        mean_rate = float(rate_trace[pool].mean()) if pool is not None else float(rate_trace.mean())
        num_users = int(min(MAX_USERS, max(1, round(n_req / (mean_rate * modelled_span_s)))))
    elif num_users is None:
        num_users = trace.num_users if pool is None else len(pool)
    base_user, rotation = _users(trace, num_users, rng, pool)
    b = b_trace[base_user]
    warp = _hour_warp(hour_curve) if hour_curve is not None else None
    if modelled_span_s is not None:
        span = float(modelled_span_s)
        t, u, k = _draw_sessions(model, b, span, rng, warp)
        order = np.argsort(t, kind="stable")
    else:  # the first n_req requests; the horizon grows until it holds them
        horizon = 1.3 * n_req / float(rate_trace[base_user].sum())
        for attempt in range(40):
            t, u, k = _draw_sessions(model, b, horizon, np.random.default_rng([int(seed), 29, attempt]), None)
            if len(t) > n_req:
                break
            horizon *= 2
        else:
            raise ValueError(f"{num_users} users of this model do not make {n_req} requests")
        order = np.argsort(t, kind="stable")[: n_req + 1]
        span = float(t[order[-1]])
        order = order[:n_req]
    t, u, k = t[order], u[order], k[order]
    scale = span / float(duration_s)
    # histories: the run's first request of a user carries round(L * history_scale * U(0.5, 1))
    by_user = np.argsort(u, kind="stable")
    su = u[by_user]
    first = np.ones(len(su), dtype=bool)
    first[1:] = su[1:] != su[:-1]
    cs = np.cumsum(k[by_user])
    grp = np.maximum.accumulate(np.where(first, np.arange(len(su)), 0))
    before = cs - k[by_user] - (cs[grp] - k[by_user][grp])
    h0 = np.maximum(1, np.round(trace.seq_lens[base_user] * shape.history_scale
                                * rng.uniform(0.5, 1.0, size=num_users))).astype(np.int64)
    hist = np.empty(len(u), dtype=np.int64)
    hist[by_user] = h0[su] + before
    cfg = _regime_config(num_users, rate_rps, duration_s, seed, shape)
    stream = assemble(trace, cfg, t / scale, u, hist, k, base_user, rotation)
    return Modelled(stream, scale)


def session_stream(trace: Trace, model: SessionModel | None = None, *, rate_rps: float, duration_s: float,
                   seed: int = 0, num_users: int | None = None, modelled_span_s: float | None = None,
                   hour_curve=None, base_users=None, shape: StreamShape | None = None) -> RequestStream:
    """A `RequestStream` whose users come in sessions drawn from ``model`` (default: fitted to
    ``trace``); see the module docstring. Deterministic for its arguments.

    - ``num_users`` (default: the trace's user count, or ``len(base_users)``): the run is then the
      model's first ``round(rate_rps * duration_s)`` requests, mapped onto ``duration_s``;
    - ``modelled_span_s``: instead, the modelled time the run covers; the user count follows from
      the rate (the request count is then ``rate_rps * duration_s`` in expectation);
    - ``hour_curve``: 24 relative hourly rates on which session starts are laid (with
      ``modelled_span_s``, e.g. 86400 for one day);
    - ``base_users``: the trace users the stream's users replay (default: all, resampled past the
      trace's count);
    - ``shape``: candidates, history scale and caps (`StreamShape`)."""
    return modelled_session_stream(trace, model, rate_rps=rate_rps, duration_s=duration_s, seed=seed,
                                   num_users=num_users, modelled_span_s=modelled_span_s, hour_curve=hour_curve,
                                   base_users=base_users, shape=shape).stream


# ------------------------------------------------------------------------------- trace order


def modelled_trace_order_stream(trace: Trace, *, rate_rps: float, duration_s: float, start_s: float | None = None,
                                shape: StreamShape | None = None, seed: int = 0) -> Modelled:
    """The trace in its own time order and its time scale; see `trace_order_stream`."""
    n_req = check_run(rate_rps, duration_s)
    shape = shape or StreamShape()
    req = trace_requests(trace)
    order = np.argsort(req.time_s, kind="stable")
    times = req.time_s[order]
    if start_s is None:
        start_s = req.core_span_s()[0]
    elif not (isinstance(start_s, (int, float)) and math.isfinite(start_s)):
        raise ValueError(f"start_s must be a trace time (Unix seconds), got {start_s!r}")
    i0 = int(np.searchsorted(times, float(start_s), side="left"))
    avail = len(times) - i0
    if avail < n_req:
        raise ValueError(f"{trace.name}: from start_s={start_s:.0f} the trace holds {avail} requests; "
                         f"rate_rps x duration_s = {n_req} needs more (lower the rate or the duration, "
                         f"or start earlier)")
    sel = order[i0 : i0 + n_req]
    t = times[i0 : i0 + n_req]
    # the window's span runs to the next request (or one mean gap past the last)
    t_end = times[i0 + n_req] if avail > n_req else t[-1] + (t[-1] - t[0]) / max(1, n_req - 1)
    span = max(float(t_end - t[0]), 1e-9)
    scale = span / float(duration_s)
    users = req.user[sel]
    if shape.history_scale < 1.0:
        raise ValueError(f"trace order keeps the trace's own histories: history_scale must be >= 1, "
                         f"got {shape.history_scale}")
    lens = trace.seq_lens.astype(np.int64)
    rng = np.random.default_rng([int(seed), 37])
    prefix = np.round((shape.history_scale - 1.0) * lens * rng.uniform(0.5, 1.0, size=len(lens))).astype(np.int64)
    rotation = (-prefix) % lens  # position prefix + j reads the trace's item j
    cfg = _regime_config(trace.num_users, rate_rps, duration_s, seed, shape)
    stream = assemble(trace, cfg, (t - t[0]) / scale, users, prefix[users] + req.position[sel], req.num_items[sel],
                      np.arange(trace.num_users, dtype=np.int64), rotation)
    return Modelled(stream, scale)


def trace_order_stream(trace: Trace, *, rate_rps: float, duration_s: float, start_s: float | None = None,
                       shape: StreamShape | None = None, seed: int = 0) -> RequestStream:
    """The trace replayed in its own time order: its requests from ``start_s`` (a trace time,
    Unix s; default the 0.1st percentile of the request times) on, the first
    ``round(rate_rps * duration_s)`` of them, every gap compressed by one factor so the run has
    ``rate_rps`` on average over ``duration_s``; each user keeps its requests' real order and
    history positions (see the module docstring). ``seed`` draws the older history tiled in front
    when ``shape.history_scale > 1`` (nothing else is drawn). A window past the trace's end is a
    `ValueError` saying how many requests it holds."""
    return modelled_trace_order_stream(trace, rate_rps=rate_rps, duration_s=duration_s, start_s=start_s,
                                       shape=shape, seed=seed).stream


__all__ = ["DEFAULT_THRESHOLD_S", "MAX_REQUESTS", "MAX_USERS", "Modelled", "QUANTILE_PROBS", "RECENT_WINDOW_S",
           "SessionModel", "StreamShape", "TraceRequests", "assemble", "check_run", "find_threshold", "fit_sessions",
           "modelled_session_stream", "modelled_trace_order_stream", "recent_share", "session_stream",
           "trace_order_stream", "trace_requests", "user_gap_means", "user_sessions"]
