"""Open-loop replay of a trace's request streams against a gateway or node agents (``racer replay``).

A *plan* is a list of phases, one per regime of the schedule, in one of two forms:

- ``steady,trend,burst`` (regime names): each phase a `RequestStream` of its own, generated for
  ``duration_s / len(schedule)`` seconds at ``rate_rps`` with its own seed, laid end to end (users
  do not keep their histories from one phase to the next);
- ``steady:60,trend:60,burst:30,steady:60`` (``REGIME:SECONDS``, `ReplayConfig.phase_s`): ONE
  stream from `workloads.regimes.generate_schedule`, the simulator's schedule stream: users keep
  their identity, activity and running histories across the phases, so what the nodes' caches
  hold carries over; each phase is that stream's requests arriving in its span.

Figures are kept per regime (``regimes``) and per phase (``phases``, keyed ``regime[start-end s]``
as the simulator's `simulator.table.phase_name`; a loop's passes add up under the same keys).
`run_replay` sends every request at its own arrival time whether or not earlier ones have
returned (open loop: a slow server does not slow the offered load down, so queueing shows up in the
latencies instead of being hidden by a waiting client). Latency is measured from the request's
*scheduled* time, so time a request spent waiting for a free connection or behind a late dispatch
counts (no coordinated omission); ``dispatch_lag_ms_p99`` says how late the generator itself was.

A pool of keep-alive connections per target (`common.http_client.UpstreamPool`, the gateway's
own client; httpx for an ``https://`` target) carries every request: at a few hundred requests per
second an httpx client costs a core by itself, and a load generator that saturates first measures
itself, not the fleet (docs/fleet.md). The body is the
node agent's (`POST /v1/recommend`: user_id, history, new_items, num_candidates, top_k), so the
same replay drives a gateway or node agents directly; with several targets the requests go round
robin. Every request ends in exactly one outcome: *served* (HTTP 200) or *failed* with a counted
reason (``http_<status>``, ``timeout``, ``connect``, ``transport``); ``requests_lost`` (sent with no
outcome) is reported and is 0 unless the run is cut off. A request the gateway says it retried
(``"retried": true`` or ``"attempts" > 1`` in its answer) counts in ``requests_retried``; with
``retries > 0`` the client itself retries connection errors, timeouts and 5xx answers on the next
target (useful against bare node agents, where nobody else retries).

SLO attainment is the share of *sent* requests served within ``slo_ms`` (failures count as misses).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from common.config import ranged, require, validate
from common.http_client import UpstreamError, UpstreamPool, UpstreamTimeout

from .regimes import REGIMES, RequestStream, generate, generate_schedule
from .regimes import parse_schedule as parse_timed_schedule
from .trace import Trace


@dataclass(frozen=True)
class ReplayConfig:
    """What to send and how (ranges checked in ``__post_init__``).

    - ``schedule``: regimes played in order, each for ``duration_s / len(schedule)`` seconds as
      streams of their own, unless ``phase_s`` is given;
    - ``phase_s``: seconds of each regime of ``schedule`` (the ``REGIME:SECONDS`` form): one pass is
      then ONE `generate_schedule` stream in which users keep their identity across phases, and
      ``duration_s`` must be the sum;
    - ``first_cycle_s``: the length of the first pass over the schedule when looping (None: the
      same ``duration_s``); `racer up` makes it short so the first burst phase comes early;
    - ``rate_rps``: the base rate of every regime (trend drifts around it, bursts multiply it);
    - ``max_history_len``: most history + new items in one request (the agent's own limit);
      histories are generated up to ``max_history_len - max_new_items``;
    - ``num_candidates`` / ``top_k``: the ranking asked of the node;
    - ``slo_ms``: the latency a request must meet to count towards SLO attainment;
    - ``timeout_s``: a request with no answer by then fails as ``timeout``;
    - ``retries``: client-side retries on the next target (0: leave retries to the gateway);
    - ``max_connections``: size of the client's connection pool;
    - ``explicit_candidates``: send each request's candidate ids (`workloads.candidates`, the ones
      the simulator ranks) instead of a count the node draws its own for; ``plant_next_item``:
      with them, each user's next item among them (`workloads.candidates`: the node's online
      model-quality signal then has an observation per returning user);
    - ``time_scale``: wall seconds per modelled second, for emulated nodes (`node_agent.emulated`)
      whose clocks run ``time_scale`` times slower: each request is sent at its arrival time x
      ``time_scale`` and every latency is read on the same modelled clock (1: wall time).
    """

    schedule: tuple[str, ...] = ranged(("steady",), choices=REGIMES, length=(1, None))
    phase_s: tuple[float, ...] | None = ranged(None, lo=0, lo_open=True, length=(0, None), optional=True)
    rate_rps: float = ranged(20.0, lo=0, lo_open=True, doc="base request rate, req/s")
    duration_s: float = ranged(60.0, lo=0, lo_open=True)
    first_cycle_s: float | None = ranged(None, lo=0, lo_open=True, optional=True)
    seed: int = 0
    num_users: int | None = None
    max_history_len: int = ranged(256, lo=1, integer=True,
                                  doc="most history + new items per request (the node agent's own limit)")
    max_new_items: int = ranged(32, lo=1, integer=True)
    num_candidates: int = ranged(64, lo=1, integer=True, doc="candidates to rank per request")
    top_k: int = ranged(10, lo=1, integer=True, doc="items returned per request")
    slo_ms: float = ranged(30.0, lo=0, lo_open=True, doc="latency SLO, ms")
    timeout_s: float = ranged(10.0, lo=0, lo_open=True, doc="a request fails after this long")
    retries: int = ranged(0, lo=0, hi=5, integer=True,
                          doc="client-side retries on the next target (0: leave retries to the gateway)")
    max_connections: int = ranged(256, lo=1, integer=True)
    time_scale: float = ranged(1.0, lo=1e-3, doc="wall seconds per modelled second (emulated nodes)")
    explicit_candidates: bool = False
    plant_next_item: bool = False
    history_scale: float = ranged(1.0, lo=0, lo_open=True, hi=1000,
                                  doc="first histories scaled from the trace's lengths (workloads.regimes)")

    def __post_init__(self) -> None:
        validate(self)
        require(self, self.max_new_items < self.max_history_len,
                f"max_new_items ({self.max_new_items}) must be below max_history_len ({self.max_history_len})")
        if self.phase_s is not None:
            require(self, len(self.phase_s) == len(self.schedule),
                    f"phase_s has {len(self.phase_s)} entries for {len(self.schedule)} regimes")
            require(self, abs(sum(self.phase_s) - self.duration_s) <= 1e-9 * max(1.0, self.duration_s),
                    f"duration_s ({self.duration_s:g}) must be the sum of phase_s ({sum(self.phase_s):g})")


def phase_name(regime: str, start_s: float, end_s: float) -> str:
    """A phase's key in the report: the same format as `simulator.table.phase_name` (written again
    here: workloads is the lowest folder and imports nothing from simulator)."""
    return f"{regime}[{start_s:g}-{end_s:g}s]"


@dataclass
class Phase:
    """Requests ``first`` to ``stop`` (None: the end) of ``stream``, the part of a pass that one
    regime plays from ``start_s`` to ``end_s`` of its cycle; a request is sent ``offset_s`` +
    its ``arrival_s`` after the start of the cycle (``offset_s`` is where ``stream`` begins: the
    phase's own start for a stream of its own, 0 for a phase of a pass's one schedule stream)."""

    regime: str
    offset_s: float
    stream: RequestStream
    start_s: float = 0.0
    end_s: float = 0.0
    first: int = 0
    stop: int | None = None

    @property
    def name(self) -> str:
        return phase_name(self.regime, self.start_s, self.end_s)

    @property
    def indices(self) -> range:
        return range(self.first, len(self.stream) if self.stop is None else self.stop)

    @property
    def num_requests(self) -> int:
        return len(self.indices)


def parse_schedule(text: str) -> tuple[str, ...]:
    """``"steady,trend,burst"`` -> the regimes (equal parts of the run); see `parse_phases` for the
    ``REGIME:SECONDS`` form too."""
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    if not parts:
        raise ValueError("--schedule: give one or more of steady, trend, burst separated by commas")
    timed = [p for p in parts if ":" in p]
    if timed:
        raise ValueError(f"--schedule: {timed[0]!r} has seconds; here the schedule is regime names only "
                         f"(e.g. steady,trend,burst)")
    bad = [p for p in parts if p not in REGIMES]
    if bad:
        raise ValueError(f"--schedule: unknown regime {bad[0]!r} (choose from {', '.join(REGIMES)})")
    return parts


def parse_phases(text: str) -> tuple[tuple[str, ...], tuple[float, ...] | None]:
    """`racer replay --schedule`: ``"steady,trend,burst"`` -> (regimes, None), equal parts of the
    run; ``"steady:60,trend:60,burst:30,steady:60"`` -> (regimes, seconds of each), one stream in
    which users keep their identity (`workloads.regimes.parse_schedule` checks it). Mixing the
    two forms, an unknown regime, seconds that are not a positive number, or no phase at all is a
    `ValueError` naming the part."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    timed = [p for p in parts if ":" in p]
    if not timed:
        return parse_schedule(text), None
    bare = [p for p in parts if ":" not in p]
    if bare:
        raise ValueError(f"--schedule: {bare[0]!r} has no seconds but {timed[0]!r} has: give every phase as "
                         f"REGIME:SECONDS (e.g. steady:60,trend:60,burst:30) or none (steady,trend,burst)")
    try:
        phases = parse_timed_schedule(text)
    except ValueError as e:
        raise ValueError(f"--schedule: {e}") from None
    return tuple(r for r, _ in phases), tuple(d for _, d in phases)


def cycle_length_s(config: ReplayConfig, cycle: int) -> float:
    """Seconds of pass ``cycle``: ``first_cycle_s`` for the first when set, else ``duration_s``."""
    return config.first_cycle_s if cycle == 0 and config.first_cycle_s is not None else config.duration_s


def build_plan(trace: Trace, config: ReplayConfig, cycle: int = 0) -> list[Phase]:
    """The phases of one pass over the schedule; ``cycle`` varies the seed from pass to pass.

    Regime names: one stream per phase (seed ``seed + 1000 cycle + k``). With ``phase_s``: one
    `generate_schedule` stream for the pass (seed ``seed + 1000 cycle``; a shorter first pass
    scales every phase alike), cut into its phases by arrival time, so a user keeps its identity
    and history from one phase to the next."""
    length_s = cycle_length_s(config, cycle)
    common = dict(rate_rps=config.rate_rps, num_users=config.num_users, num_candidates=config.num_candidates,
                  history_scale=config.history_scale,
                  max_new_items=config.max_new_items, max_history_len=config.max_history_len - config.max_new_items)
    if config.phase_s is None:
        phase_s = length_s / len(config.schedule)
        out = []
        for k, regime in enumerate(config.schedule):
            stream = generate(trace, regime=regime, duration_s=phase_s, seed=config.seed + 1000 * cycle + k,
                              burst_every_s=min(30.0, phase_s), burst_duration_s=min(3.0, phase_s / 2), **common)
            out.append(Phase(regime, k * phase_s, stream, k * phase_s, (k + 1) * phase_s))
        return out
    scale = length_s / config.duration_s
    phases = [(r, d * scale) for r, d in zip(config.schedule, config.phase_s)]
    # the bursts' spacing and length as for a stream of its own, set by the shortest burst phase
    # (one setting for the whole stream; every burst phase then fits its bursts)
    shortest = min((d for r, d in phases if r == "burst"), default=min(d for _, d in phases))
    stream = generate_schedule(trace, phases, seed=config.seed + 1000 * cycle, burst_every_s=min(30.0, shortest),
                               burst_duration_s=min(3.0, shortest / 2), **common)
    cuts = [int(np.searchsorted(stream.arrival_s, a, side="left")) for _, a, _ in stream.phases[1:]]
    firsts, stops = [0, *cuts], [*cuts, len(stream)]
    return [Phase(regime, 0.0, stream, a, b, first, stop)
            for (regime, a, b), first, stop in zip(stream.phases, firsts, stops)]


def _following_streams(plan: Sequence[Phase], ahead: Sequence[Phase] | None) -> dict[int, RequestStream]:
    """Each stream of ``plan`` (by id): the stream sent after it, in this pass or in ``ahead``
    (the next pass; None: nothing follows the last one)."""
    order: list[RequestStream] = []
    for p in [*plan, *(ahead or ())]:
        if not order or order[-1] is not p.stream:
            order.append(p.stream)
    return {id(a): b for a, b in zip(order, order[1:]) if any(p.stream is a for p in plan)}


def modelled_clock(time_scale: float) -> Callable[[], float]:
    """``time.monotonic() / time_scale``: modelled seconds for a replay against emulated nodes."""
    k = float(time_scale)
    return lambda: time.monotonic() / k


def request_body(stream: RequestStream, i: int, top_k: int, candidates=None) -> dict:
    """The node agent's `POST /v1/recommend` body of request ``i``; with ``candidates`` (a
    `workloads.candidates.StreamCandidates`) its candidate ids instead of a count."""
    r = stream.request(i)
    body = {"user_id": r.user, "history": r.history.tolist(), "new_items": r.new_items.tolist(), "top_k": top_k}
    if candidates is None:
        body["num_candidates"] = r.num_candidates
    elif r.num_candidates:
        body["candidates"] = candidates(i).tolist()
    else:  # nothing to list: the node refuses it as it refuses a count of 0
        body["num_candidates"] = 0
    return body


def _pct(values: Sequence[float], q: float) -> float | None:
    if len(values) == 0:
        return None
    return round(float(np.percentile(np.asarray(values, dtype=np.float64), q)), 3)


@dataclass
class _Tally:
    sent: int = 0
    served: int = 0
    failed: int = 0
    within_slo: int = 0
    latencies_ms: list = field(default_factory=list)
    kv_hit_tokens: int = 0  # history tokens whose K/V the serving node had cached (from the answers)
    kv_tokens: int = 0  # history tokens, cached or recomputed
    emb_hits: int = 0  # embedding rows found in the serving node's slab
    emb_rows: int = 0  # embedding rows looked up
    answered: int = 0  # served requests whose answer said how many passes their batch took
    multi_pass: int = 0  # of those, the ones whose batch took more than one (a user repeated in it)
    parts_ms: list = field(default_factory=list)  # (latency, node queue, node total, upstream, gateway) per answer
    service_us: float = 0.0  # the node agents' time outside their queues, summed over the answers that say
    cache_us: float = 0.0  # of it, the stages a cache decides (`CACHE_STAGES`)
    slo_ms: float | None = None  # the SLO of ``node_slo_attainment`` (set by `ReplayStats`)

    def tail(self) -> dict | None:
        """Where the slowest 1% of the answered requests (latency at or above their P99) spent
        their time, in mean ms: ``queue`` waiting in the node agent's queue, ``node`` the agent's
        whole time (queue, lookup, compute), ``upstream`` the gateway's round trip to the agent
        (``node`` plus HTTP), ``gateway`` the gateway's whole time from the request's first byte
        (``upstream`` plus routing and its event loop), ``outside`` the rest of the client's
        latency (the client's own time and the wait before the gateway read the request); None
        when no answer carried the breakdown."""
        if not self.parts_ms:
            return None
        a = np.asarray(self.parts_ms, dtype=np.float64)
        t = a[a[:, 0] >= np.percentile(a[:, 0], 99)]
        m = t.mean(axis=0)
        return {"n": int(len(t)), "latency": round(float(m[0]), 2), "queue": round(float(m[1]), 2),
                "node": round(float(m[2]), 2), "upstream": round(float(m[3]), 2),
                "gateway": round(float(m[4]), 2), "outside": round(float(m[0] - m[4]), 2)}

    def to_dict(self) -> dict:
        """The counts and rates; ``node_p99_ms`` is the P99 of the node agents' own time (queue,
        lookup, compute: the part a router decides), ``tail_ms`` is `tail`; ``cache_stage_share``
        is the share of the node agents' time outside their queues spent in `CACHE_STAGES`: the
        most of a node's work that any split or router can change."""
        return {"requests_sent": self.sent, "requests_served": self.served, "requests_failed": self.failed,
                "p50_ms": _pct(self.latencies_ms, 50), "p99_ms": _pct(self.latencies_ms, 99),
                "slo_attainment": round(self.within_slo / self.sent, 4) if self.sent else None,
                "kv_hit_rate": round(self.kv_hit_tokens / self.kv_tokens, 4) if self.kv_tokens else None,
                "emb_hit_rate": round(self.emb_hits / self.emb_rows, 4) if self.emb_rows else None,
                "multi_pass_share": round(self.multi_pass / self.answered, 4) if self.answered else None,
                "node_p99_ms": _pct([p[2] for p in self.parts_ms], 99),
                "node_p50_ms": _pct([p[2] for p in self.parts_ms], 50),
                "node_slo_attainment": (round(sum(p[2] <= self.slo_ms for p in self.parts_ms) / self.sent, 4)
                                        if self.sent and self.slo_ms is not None else None),
                "tail_ms": self.tail(),
                "cache_stage_share": round(self.cache_us / self.service_us, 4) if self.service_us else None}


def _batch_passes(answer: dict | None) -> int | None:
    """The passes the answer's batch took (``batch_passes``), or None when it does not say."""
    v = answer.get("batch_passes") if isinstance(answer, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


def _answer_fields(answer: dict | None, paths: Sequence[tuple[str, str]], ok: Callable[[object], bool]) -> list | None:
    """The values at ``paths`` (``(section, key)`` pairs) of an answer, or None unless the answer
    has each section as an object and each value passes ``ok``."""
    if not isinstance(answer, dict):
        return None
    vals = []
    for section, key in paths:
        part = answer.get(section)
        if not isinstance(part, dict) or not ok(v := part.get(key)):
            return None
        vals.append(v)
    return vals


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _finite_ms(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


_PARTS = (("latency_us", "queue_us"), ("latency_us", "total_us"), ("gateway", "upstream_ms"), ("gateway", "gateway_ms"))
_COUNTS = (("kv", "hit_tokens"), ("kv", "recomputed_tokens"), ("emb", "hits"), ("emb", "rows"))


#: the node agent's stages whose time a cache decides: the history's prefill (all of it on a K/V
#: miss, the new items on a hit), reading and writing pages of K/V, and the emulated host-to-device
#: copy of the embedding rows the slab missed. The rest of a node's time (ranking, the lookup's
#: fixed cost, batching, HTTP) is the same whatever the split and the router decide.
CACHE_STAGES = ("prefill_us", "kv_read_us", "kv_write_us", "link_us")
_SERVICE = tuple(("latency_us", k) for k in ("total_us", "queue_us", *CACHE_STAGES))


def _service_us(answer: dict | None) -> tuple[float, float] | None:
    """(the node's time outside its queue, of which in `CACHE_STAGES`) in µs, or None when the
    answer does not carry them as finite numbers."""
    vals = _answer_fields(answer, _SERVICE, _finite_ms)
    return None if vals is None else (vals[0] - vals[1], float(sum(vals[2:])))


def _parts_ms(answer: dict | None) -> tuple[float, float, float, float] | None:
    """(node queue, node total, gateway upstream, gateway total) in ms from an answer that came
    through a gateway, or None when it does not carry them as finite numbers."""
    vals = _answer_fields(answer, _PARTS, _finite_ms)
    return None if vals is None else (vals[0] / 1e3, vals[1] / 1e3, float(vals[2]), float(vals[3]))


def _cache_counts(answer: dict | None) -> tuple[int, int, int, int] | None:
    """(KV hit tokens, history tokens, EMB hits, EMB rows) of a node agent's answer, or None when
    the answer does not carry them as counts."""
    vals = _answer_fields(answer, _COUNTS, _count)
    return None if vals is None else (vals[0], vals[0] + vals[1], vals[2], vals[3])


class ReplayStats:
    """Outcome counts and latencies of a replay; safe to read (`snapshot`, `report`) from another
    thread while the replay's event loop writes it."""

    def __init__(self, slo_ms: float, recent_window_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 wall_per_s: float = 1.0):
        self.slo_ms = slo_ms
        # wall seconds per second of ``clock`` (emulated nodes: K): the gateway's own times in an
        # answer are wall times, divided by it so every part of `_Tally.tail` is on one clock
        self.wall_per_s = float(wall_per_s)
        self.recent_window_s = recent_window_s
        self.clock = clock
        self._lock = threading.Lock()
        self.total = _Tally(slo_ms=slo_ms)
        self.by_regime: dict[str, _Tally] = {}
        self.by_phase: dict[str, _Tally] = {}
        self.failures: Counter = Counter()
        self.served_by: Counter = Counter()
        self.retried = 0
        self.client_retries = 0
        self.dispatch_lag_ms: list[float] = []
        self.in_flight = 0
        self.regime: str | None = None
        self.phase: str | None = None
        self.cycle = 0
        self.started_s: float | None = None  # the clock when the first pass began sending
        self._recent: deque = deque()  # (done_s, latency_ms or None when failed)

    def on_sent(self, regime: str, lag_ms: float, phase: str | None = None) -> None:
        """A request of ``regime`` left ``lag_ms`` after its time; ``phase``: its phase's name
        (default: the regime's)."""
        phase = phase or regime
        with self._lock:
            self.total.sent += 1
            self.by_regime.setdefault(regime, _Tally(slo_ms=self.slo_ms)).sent += 1
            self.by_phase.setdefault(phase, _Tally(slo_ms=self.slo_ms)).sent += 1
            self.dispatch_lag_ms.append(lag_ms)
            self.in_flight += 1
            self.regime = regime
            self.phase = phase

    def on_done(self, regime: str, latency_ms: float | None, failure: str | None, served_by: str | None,
                retried: bool, phase: str | None = None, answer: dict | None = None) -> None:
        """A request's outcome; ``answer`` (a served request's JSON answer) adds its KV and EMB
        counts to the hit rates."""
        now = self.clock()
        counts = _cache_counts(answer) if failure is None else None
        passes = _batch_passes(answer) if failure is None else None
        parts = _parts_ms(answer) if failure is None else None
        if parts is not None and self.wall_per_s != 1.0:
            parts = (parts[0], parts[1], parts[2] / self.wall_per_s, parts[3] / self.wall_per_s)
        service = _service_us(answer) if failure is None else None
        with self._lock:
            self.in_flight -= 1
            for t in (self.total, self.by_regime[regime], self.by_phase[phase or regime]):
                if failure is None:
                    t.served += 1
                    t.latencies_ms.append(latency_ms)
                    t.within_slo += latency_ms <= self.slo_ms
                    if counts is not None:
                        t.kv_hit_tokens += counts[0]
                        t.kv_tokens += counts[1]
                        t.emb_hits += counts[2]
                        t.emb_rows += counts[3]
                    if passes is not None:
                        t.answered += 1
                        t.multi_pass += passes > 1
                    if parts is not None:
                        t.parts_ms.append((latency_ms, *parts))
                    if service is not None:
                        t.service_us += service[0]
                        t.cache_us += service[1]
                else:
                    t.failed += 1
            if failure is not None:
                self.failures[failure] += 1
            if served_by is not None:
                self.served_by[served_by] += 1
            self.retried += bool(retried)
            self._recent.append((now, latency_ms if failure is None else None))
            while self._recent and self._recent[0][0] < now - self.recent_window_s:
                self._recent.popleft()

    def snapshot(self) -> dict:
        """Figures for a status line: totals, and P99 / SLO attainment over the recent window."""
        with self._lock:
            recent = [lat for _, lat in self._recent]
            served = [lat for lat in recent if lat is not None]
            return {"requests_sent": self.total.sent, "requests_served": self.total.served,
                    "requests_failed": self.total.failed, "requests_retried": self.retried,
                    "in_flight": self.in_flight, "regime": self.regime, "phase": self.phase,
                    "cycle": self.cycle,
                    "recent_p99_ms": _pct(served, 99),
                    "recent_slo_attainment": (round(sum(lat <= self.slo_ms for lat in served) / len(recent), 4)
                                              if recent else None)}

    def report(self) -> dict:
        with self._lock:
            t = self.total
            lat = t.latencies_ms
            tot = t.to_dict()  # the same rates as each regime's and phase's
            return {
                "requests_sent": t.sent, "requests_served": t.served, "requests_failed": t.failed,
                "requests_retried": self.retried, "client_retries": self.client_retries,
                "requests_lost": t.sent - t.served - t.failed,
                "failures": dict(self.failures),
                "latency_ms": {"p50": _pct(lat, 50), "p90": _pct(lat, 90), "p99": _pct(lat, 99),
                               "max": round(max(lat), 3) if lat else None,
                               "mean": round(float(np.mean(lat)), 3) if lat else None},
                "p99_ms": _pct(lat, 99),
                "slo_ms": self.slo_ms,
                **{k: tot[k] for k in ("slo_attainment", "kv_hit_rate", "emb_hit_rate", "multi_pass_share",
                                       "node_p99_ms", "node_p50_ms", "node_slo_attainment", "tail_ms",
                                       "cache_stage_share")},
                "dispatch_lag_ms_p99": _pct(self.dispatch_lag_ms, 99),
                "regimes": {k: v.to_dict() for k, v in self.by_regime.items()},
                "phases": {k: v.to_dict() for k, v in self.by_phase.items()},
                "served_by": dict(self.served_by),
            }


def _served_by(answer: dict, target: str) -> str:
    for key in ("node_id", "node", "served_by"):
        v = answer.get(key)
        if isinstance(v, str):
            return v
        if isinstance(v, dict) and isinstance(v.get("node_id"), str):
            return v["node_id"]
    return target


def _was_retried(answer: dict) -> bool:
    if answer.get("retried") is True:
        return True
    attempts = answer.get("attempts")
    return isinstance(attempts, int) and not isinstance(attempts, bool) and attempts > 1


#: the header that names the load's phase (``regime[start-end s]``) on every request; a gateway
#: counts requests by it and reports the phase to the control plane, whose dashboard shows it
PHASE_HEADER = "x-racer-load-phase"


class _SendFailed(Exception):
    """A request that got no HTTP answer; ``kind`` is its failure reason (``timeout``,
    ``connect``, ``transport_<error>``)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class _Sender:
    """POSTs to the targets: one `UpstreamPool` per ``http://`` target, an httpx client for the
    others (TLS); every request ends within ``timeout_s``, the wait for a free connection
    included."""

    def __init__(self, targets: Sequence[str], config: ReplayConfig) -> None:
        self.timeout_s = config.timeout_s
        connect_s = min(config.timeout_s, 5.0)
        self.pools = {t: UpstreamPool(t, max_connections=config.max_connections, connect_timeout_s=connect_s)
                      for t in targets if t.startswith("http://")}
        self.httpx = None
        if len(self.pools) < len(set(targets)):
            limits = httpx.Limits(max_connections=config.max_connections,
                                  max_keepalive_connections=config.max_connections)
            self.httpx = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(config.timeout_s, connect=connect_s))

    async def post(self, target: str, body: bytes, headers: dict | None) -> tuple[int, bytes]:
        pool = self.pools.get(target)
        if pool is None:
            try:
                r = await self.httpx.post(f"{target}/v1/recommend", content=body,
                                          headers={"content-type": "application/json", **(headers or {})})
            except httpx.TimeoutException:
                raise _SendFailed("timeout") from None
            except httpx.ConnectError:
                raise _SendFailed("connect") from None
            except httpx.TransportError as e:
                raise _SendFailed(f"transport_{type(e).__name__}") from None
            return r.status_code, r.content
        try:
            async with asyncio.timeout(self.timeout_s):  # a free connection's wait counts too
                return await pool.post("/v1/recommend", body, timeout_s=self.timeout_s, headers=headers)
        except (UpstreamTimeout, TimeoutError):
            raise _SendFailed("timeout") from None
        except UpstreamError:
            raise _SendFailed("connect") from None

    async def close(self) -> None:
        for pool in self.pools.values():
            await pool.close()
        if self.httpx is not None:
            await self.httpx.aclose()


async def _send(sender: _Sender, targets: Sequence[str], first: int, body: dict, config: ReplayConfig,
                stats: ReplayStats, phase: str | None = None) -> tuple[str | None, dict | None, bool]:
    """POST ``body`` (``phase`` in the `PHASE_HEADER`); returns (failure reason or None, answer,
    client retried)."""
    failure = None
    headers = {PHASE_HEADER: phase} if phase else None
    raw = json.dumps(body, separators=(",", ":")).encode()
    for attempt in range(config.retries + 1):
        target = targets[(first + attempt) % len(targets)]
        try:
            status, content = await sender.post(target, raw, headers)
        except _SendFailed as e:
            failure = e.kind
        else:
            if status == 200:
                try:
                    answer = json.loads(content)
                except ValueError:
                    return "bad_json", None, attempt > 0
                return None, {"_target": target, **answer} if isinstance(answer, dict) else {"_target": target}, \
                    attempt > 0
            failure = f"http_{status}"
            if status < 500:  # the request itself is wrong: retrying cannot help
                return failure, None, attempt > 0
        if attempt < config.retries:
            with stats._lock:
                stats.client_retries += 1
    return failure, None, config.retries > 0


async def run_replay(targets: Sequence[str], trace: Trace, config: ReplayConfig, stats: ReplayStats | None = None, *,
                     loop_forever: bool = False, stop: threading.Event | None = None,
                     on_done: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic,
                     plan: list[Phase] | None = None) -> ReplayStats:
    """Replay the schedule against ``targets`` (base URLs), open loop; once, or in a loop until
    ``stop`` is set when ``loop_forever``. Returns the stats (also filled in place). ``plan``:
    phases built elsewhere (e.g. a named workload's stream, `workloads.fleet_workloads`) sent
    once instead of the config's schedule."""
    if not targets:
        raise ValueError("no target to send requests to")
    if plan is not None and loop_forever:
        raise ValueError("a given plan is sent once: loop_forever needs the config's schedule")
    targets = [t.rstrip("/") for t in targets]
    k = config.time_scale
    if k != 1.0 and clock is time.monotonic:  # modelled seconds, as the emulated nodes' clocks
        clock = modelled_clock(k)
    stats = stats or ReplayStats(config.slo_ms, clock=clock, wall_per_s=k)
    tasks: set[asyncio.Task] = set()
    counter = 0

    async def one(phase: Phase, body: dict, scheduled_s: float, first: int) -> None:
        failure, answer, client_retried = await _send(sender, targets, first, body, config, stats,
                                                       phase.name)
        latency_ms = (clock() - scheduled_s) * 1e3
        served_by = _served_by(answer, answer["_target"]) if answer else None
        stats.on_done(phase.regime, latency_ms if failure is None else None, failure, served_by,
                      client_retried or (answer is not None and _was_retried(answer)), phase=phase.name,
                      answer=answer)
        if on_done is not None:
            on_done()

    sender = _Sender(targets, config)
    try:
        cycle, ahead = 0, None
        while True:
            if plan is None or cycle:
                plan = ahead if ahead is not None else build_plan(trace, config, cycle)
            # the next pass, built now when its users' first requests are planted in this one
            plant_ahead = loop_forever and config.explicit_candidates and config.plant_next_item
            ahead = build_plan(trace, config, cycle + 1) if plant_ahead else None
            streams = _following_streams(plan, ahead)
            stats.cycle = cycle
            cands: dict = {}  # each phase stream's candidates, made when its first request goes
            start = clock()
            if cycle == 0:
                stats.started_s = start
            for phase in plan:
                arrivals = phase.stream.arrival_s
                for i in phase.indices:
                    if stop is not None and stop.is_set():
                        break
                    due = start + phase.offset_s + float(arrivals[i])
                    delay = due - clock()
                    if delay > 0:
                        await asyncio.sleep(delay * k)
                    sc = None
                    if config.explicit_candidates:
                        sc = cands.get(id(phase.stream))
                        if sc is None:
                            from .candidates import StreamCandidates

                            sc = cands[id(phase.stream)] = StreamCandidates(
                                phase.stream, trace, config.seed, plant_next=config.plant_next_item,
                                then=streams.get(id(phase.stream)))
                    body = request_body(phase.stream, i, config.top_k, sc)
                    stats.on_sent(phase.regime, max(0.0, clock() - due) * 1e3, phase=phase.name)
                    task = asyncio.create_task(one(phase, body, due, counter))
                    counter += 1
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            if stop is not None and stop.is_set():
                break
            # the cycle's full length even if its last request came early
            rest = start + cycle_length_s(config, cycle) - clock()
            if rest > 0 and loop_forever:
                await asyncio.sleep(rest * k)
            cycle += 1
            if not loop_forever:
                break
        if tasks:  # every request ends in an outcome: served, or failed by the client's timeout
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await sender.close()
    return stats


def replay(targets: Sequence[str], trace: Trace, config: ReplayConfig, *, progress: bool = False) -> dict:
    """Run one pass of the schedule and return the JSON report."""
    from tqdm import tqdm

    plan_total = sum(p.num_requests for p in build_plan(trace, config))
    stats = ReplayStats(config.slo_ms)
    t0 = time.monotonic()
    with tqdm(total=plan_total, desc="racer replay", unit="req", file=sys.stderr,
              disable=not progress, mininterval=0.5) as bar:
        def tick() -> None:
            bar.update(1)
            if bar.n % 50 == 0:
                s = stats.snapshot()
                bar.set_postfix(phase=s["phase"], failed=s["requests_failed"], p99_ms=s["recent_p99_ms"],
                                refresh=False)

        asyncio.run(run_replay(targets, trace, config, stats, on_done=tick))
    wall = time.monotonic() - t0
    out = {"targets": list(targets), "trace": trace.name,
           "config": {**asdict(config), "schedule": list(config.schedule),
                      "phase_s": list(config.phase_s) if config.phase_s is not None else None},
           **stats.report(), "wall_s": round(wall, 3)}
    out["offered_rps"] = round(out["requests_sent"] / config.duration_s, 2)
    out["served_rps"] = round(out["requests_served"] / wall, 2) if wall > 0 else None
    return out
