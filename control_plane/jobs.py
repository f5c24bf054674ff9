"""Scheduled jobs and the one scheduler per cluster.

`Scheduling` runs an APScheduler 3 ``BackgroundScheduler`` in the replica that leads:

- PostgreSQL: the leader holds a session-level ``pg_try_advisory_lock(SCHEDULER_LOCK_KEY)`` on a
  dedicated connection; standbys retry every ``leader_poll_s``; when the leader's process or
  connection dies, PostgreSQL releases the lock and a standby takes over. The leader checks its
  connection on every poll and stops its scheduler if it is lost.
- SQLite: one process per database file, so the process leads.

The ``scheduler_lease`` row records who leads (for the summary); ``job_runs`` records every run
(instance, start, duration, outcome). Each job is a thin function over one transaction, safe to
run twice, timed; an exception is recorded and logged and stops no other job (each job has its
own APScheduler entry, ``max_instances=1``, ``coalesce=True``).

Jobs: ``router_weights`` (recompute, store on change, push to routers), ``rollout_evaluation``,
``override_expiry``, ``node_liveness``, ``retention`` (downsampling and retention), ``whatif``
(off by default). The pre-aggregated recent history needs no job: each report batch's
transaction adds its reports to it (`db.queries.insert_reports`).
"""

from __future__ import annotations

import datetime
import functools
import logging
import threading
import time
import traceback

import httpx
from sqlalchemy import text

from common.weights import CostProfile, derive_weights
from db import queries
from db.models import Router, SchedulerLease

from .auth import load_secret_key, push_token_for
from . import rollout_service

log = logging.getLogger("racer.control_plane.jobs")

SCHEDULER_LOCK_KEY = 0x52414346  # "RACF"
JOB_STAGGER_S = 0.37  # the k-th job's runs start k times this after the leader's start (`job_schedule`)
COST_FIELDS = ("kv_recompute_us_per_token", "emb_transfer_us_per_row", "service_time_us", "queue_capacity")


# ------------------------------------------------------------------------------------------ the jobs
def _within_band(stored: float, band: tuple | None, tol: float) -> bool:
    """Hysteresis on a reported cost: the stored figure stays while it lies within the window's
    interquartile range of reports (widened by ``tol``). A node whose reports alternate between
    two values (its history lengths crossing two profiled points) has both in that range, so the
    weights do not flip between them every period; a real move takes the whole range with it."""
    if band is None or band[0] is None or band[2] is None:
        return False
    lo, hi = band[0], band[2]
    return lo - tol * abs(lo) <= stored <= hi + tol * abs(hi)


def compute_weights(s, settings, now_s: float) -> tuple[dict, dict, str] | None:
    """The weights payload the cluster should have now, its inputs, and why it differs from the
    stored version; None when nothing changed (or no node is up). A node's figure changes when it
    moves by more than ``weights_rel_change`` and, for a reported miss cost, the stored figure has
    left the window's interquartile range of reports (`_within_band`: no version per period from
    a cost that alternates between two values).

    Cheap when nothing changed (the common case, every period): the up nodes' profiles and the
    reported medians come from SQL as plain values, are compared with the stored version first,
    and only the entries of nodes that joined or moved are validated and given a reason string.
    (With 1,000 nodes, building every entry each period held the GIL ~80 ms per run and showed
    up as a stall in the report ingestion of the same process.)"""
    nodes = queries.up_node_profiles(s, COST_FIELDS)
    if not nodes:
        return None
    reported = queries.recent_miss_cost_bands(s, now_s - settings.weights_window_s)
    profiles, sources, bands = {}, {}, {}
    for nid, registered in nodes:
        prof = {k: registered[k] for k in COST_FIELDS}
        src = dict.fromkeys(COST_FIELDS, "registered")
        for k, band in reported.get(nid, {}).items():
            prof[k], src[k] = band[1], "reported median"
            bands[nid, k] = band
        profiles[nid], sources[nid] = prof, src
    prev = queries.latest_weights_nodes(s)
    prev_nodes = prev[1] if prev is not None else {}
    changes, changed = [], set()
    for nid in sorted(set(prev_nodes) - set(profiles)):
        changes.append(f"{nid} left (down or gone)")
    for nid in sorted(set(profiles) - set(prev_nodes)):
        changes.append(f"{nid} joined")
        changed.add(nid)
    tol = settings.weights_rel_change
    for nid in sorted(set(profiles) & set(prev_nodes)):
        for k in COST_FIELDS:
            a, b = float(prev_nodes[nid][k]), float(profiles[nid][k])
            if abs(b - a) > tol * max(abs(a), 1e-12) and not _within_band(a, bands.get((nid, k)), tol):
                changes.append(f"{nid} {k} {a:.6g} -> {b:.6g}")
                changed.add(nid)
    if not changes:
        return None
    payload, inputs = {}, {}
    for nid, prof in profiles.items():
        inputs[nid] = {"profile": prof, "source": sources[nid]}
        if nid not in changed:  # unchanged nodes keep their stored figures: small drifts never accumulate
            payload[nid] = prev_nodes[nid]
            continue
        CostProfile(**prof)  # validates (finite, >= 0, capacity >= 1)
        why = ", ".join(f"{k}={prof[k]:.6g} ({sources[nid][k]})" for k in COST_FIELDS)
        payload[nid] = {**prof, "reason": why}
    derive_weights([CostProfile(**{k: payload[i][k] for k in COST_FIELDS}) for i in sorted(payload)])
    if prev is None:
        return payload, inputs, f"first weights for {len(payload)} nodes"
    return payload, inputs, "; ".join(changes)


def secret_key_of(settings, factory) -> bytes | None:
    """The control plane's secret key (`control_plane.auth.load_secret_key`) for the database
    ``factory`` opens."""
    engine = factory.kw["bind"]
    return load_secret_key(settings.secret_key, settings.secret_key_file,
                           engine.url.database if engine.dialect.name == "sqlite" else None)


def push_weights(factory, settings, metrics) -> dict:
    """POST the latest weights to every router that does not have them yet. The version's row
    (every node's entry and its inputs) is read only when some router lacks it: every period with
    nothing to push stays a two-row query (at 1,000 nodes, loading it held the GIL ~50 ms a period
    in the process serving the reports)."""
    with factory() as s:
        version = queries.latest_weights_version(s)
        if version is None:
            return {"pushed": 0, "failed": 0}
        routers = [(r.url, r.token_id) for r in queries.list_routers(s) if r.pushed_version != version]
        if not routers:
            return {"pushed": 0, "failed": 0, "version": version}
        w = queries.latest_weights(s)
    key = secret_key_of(settings, factory)
    if key is None:  # no key: no push token to send; gateways pull the weights
        return {"pushed": 0, "failed": 0, "version": w.version, "off": "no secret key"}
    routers = [(url, push_token_for(key, url, token_id)) for url, token_id in routers]
    body = {"version": w.version, "computed_at_s": w.computed_at_s, "nodes": w.nodes}

    def push(url: str, push_token: str | None) -> str | None:
        """One push: None, or what failed (the status or the error's kind: never the answer's
        body, which the control plane has no business showing its viewers)."""
        headers = {"Authorization": f"Bearer {push_token}"} if push_token else {}
        try:
            resp = httpx.post(url.rstrip("/") + "/v1/router/weights", json=body, headers=headers,
                              timeout=settings.push_timeout_s)
            return None if resp.status_code < 300 else f"HTTP {resp.status_code}"
        except httpx.TimeoutException:
            return f"timeout after {settings.push_timeout_s:g} s"
        except httpx.HTTPError as e:
            return type(e).__name__

    results = {}
    if routers:  # at once: a router that never answers costs one timeout, not one per router
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(16, len(routers)), thread_name_prefix="racer-weights-push") as pool:
            for (url, _), err in zip(routers, pool.map(lambda r: push(*r), routers)):
                results[url] = err
    now = time.time()
    with factory.begin() as s:
        for url, err in results.items():
            r = s.get(Router, url)
            if r is None:
                continue
            r.last_push_s, r.last_error = now, err
            if err is None:
                r.pushed_version = w.version
            metrics.weight_pushes.labels("ok" if err is None else "error").inc()
    return {"pushed": sum(e is None for e in results.values()), "failed": sum(e is not None for e in results.values()),
            "version": w.version}


def job_router_weights(factory, settings, metrics, now_s: float) -> dict:
    with factory.begin() as s:
        got = compute_weights(s, settings, now_s)
        if got is not None:
            payload, inputs, reason = got
            w = queries.add_weights(s, computed_at_s=now_s, nodes=payload, inputs=inputs, reason=reason)
            version = w.version
        else:
            version = queries.latest_weights_version(s)
    if version is not None:
        metrics.weights_version.set(version)
    out = {"changed": got is not None, "version": version}
    out.update(push_weights(factory, settings, metrics))
    return out


def job_rollout_evaluation(factory, settings, metrics, now_s: float) -> dict:
    with factory.begin() as s:
        out = rollout_service.evaluate(s, now_s) or {"rollout_id": None}
        for state, n in queries.rollout_state_counts(s).items():
            metrics.rollouts.labels(state).set(n)
        return out


def job_override_expiry(factory, settings, metrics, now_s: float) -> dict:
    with factory.begin() as s:
        due = queries.due_overrides(s, now_s)
        for o in due:
            o.state, o.ended_at_s = "expired", now_s
            queries.audit(s, ts_s=now_s, actor="system", action="override.expire", target=f"override:{o.id}",
                          before={"state": "active", "emb_share": o.emb_share, "node_id": o.node_id,
                                  "expires_at_s": o.expires_at_s},
                          after={"state": "expired"}, reason="expiry time reached")
        metrics.overrides_active.set(len(queries.active_overrides(s)))
        return {"expired": [o.id for o in due]}


def job_node_liveness(factory, settings, metrics, now_s: float) -> dict:
    with factory.begin() as s:
        down = queries.mark_down(s, now_s=now_s, missed_intervals=settings.liveness_missed_intervals,
                                 send_period_s=settings.send_period_s)
        for nid in down:
            queries.audit(s, ts_s=now_s, actor="system", action="node.down", target=f"node:{nid}",
                          before={"status": "up"}, after={"status": "down"},
                          reason=f"no report for {settings.liveness_missed_intervals:g} report intervals")
        counts = {"up": 0, "down": 0, **queries.node_status_counts(s)}
        for k, v in counts.items():
            metrics.nodes.labels(k).set(v)
        return {"marked_down": down, **counts}


def job_retention(factory, settings, metrics, now_s: float) -> dict:
    with factory.begin() as s:
        out = queries.rollup_and_prune(s, now_s=now_s, step_s=settings.rollup_step_s,
                                       raw_retention_s=settings.raw_retention_s,
                                       rollup_retention_s=settings.rollup_retention_s)
        # the gateways' reports (what clients saw) are kept as long as the nodes' raw reports
        out["gateway_reports_deleted"] = queries.prune_gateway_reports(s, before_s=now_s - settings.raw_retention_s)
        # the gateways' traffic samples: their own retention, and a cap on their rows (the oldest go)
        pruned = queries.prune_traffic_samples(s, before_s=now_s - settings.sample_retention_s,
                                               max_rows=settings.sample_max_rows)
        out["traffic_samples_deleted"] = pruned["expired"] + pruned["over_cap"]
        out["traffic_samples_over_cap"] = pruned["over_cap"]
        # a gateway forgotten (no report left, silent for raw_retention_s) takes its samples along
        out["gateways_deleted"] = queries.prune_gateways(s, before_s=now_s - settings.raw_retention_s)
        return out


def job_whatif(factory, settings, metrics, now_s: float) -> dict:
    """The scheduled what-if over the last ``whatif_window_s`` (``whatif_period_s``; off by default)."""
    from .whatif import scheduled

    return scheduled(factory, settings, now_s)


JOBS = {
    "router_weights": (job_router_weights, "weights_period_s"),
    "rollout_evaluation": (job_rollout_evaluation, "rollout_period_s"),
    "override_expiry": (job_override_expiry, "override_period_s"),
    "node_liveness": (job_node_liveness, "liveness_period_s"),
    "retention": (job_retention, "retention_period_s"),
    "whatif": (job_whatif, "whatif_period_s"),  # None: off
}


def job_schedule(settings) -> dict[str, tuple[float, float]]:
    """Job name -> (period, offset of its runs from the leader's start), s, for the jobs that are
    on. The k-th job's runs are offset by k * `JOB_STAGGER_S` within its period: jobs started
    together would otherwise run together at every common multiple of their periods (at 1,000
    nodes the weights, rollout and liveness jobs together stalled report ingestion)."""
    out = {}
    for k, (name, (_, period_attr)) in enumerate(JOBS.items()):
        period = getattr(settings, period_attr)
        if period is not None:  # None: a job that is off
            out[name] = (period, (k * JOB_STAGGER_S) % period)
    return out


# ------------------------------------------------------------------------------------- leadership
class Scheduling:
    """Leader election plus the scheduler of the leading replica (see the module docstring)."""

    def __init__(self, engine, factory, settings, metrics, instance: str, clock=time.time):
        self.engine, self.factory, self.settings, self.metrics = engine, factory, settings, metrics
        self.instance, self.clock = instance, clock
        self._conn = None
        self._sched = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.leader = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="racer-leader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._step_down()

    def run_job(self, name: str) -> None:
        fn, _ = JOBS[name]
        now = self.clock()
        t0 = time.perf_counter()
        ok, err, summary = True, None, None
        try:
            summary = fn(self.factory, self.settings, self.metrics, now)
        except Exception as e:  # noqa: BLE001 - recorded; the other jobs keep running
            ok, err = False, f"{type(e).__name__}: {e}"
            log.error("job %s failed: %s\n%s", name, err, traceback.format_exc())
        dt = time.perf_counter() - t0
        self.metrics.job_runs.labels(name, "ok" if ok else "error").inc()
        self.metrics.job_duration.labels(name).observe(dt)
        try:
            with self.factory.begin() as s:
                queries.record_job_run(s, job=name, instance=self.instance, started_s=now, duration_s=dt, ok=ok,
                                       error=err, summary=_jsonable(summary))
        except Exception as e:  # noqa: BLE001
            log.error("could not record the run of job %s: %s", name, e)

    def _try_lead(self) -> bool:
        return self._on_leader_conn("SELECT pg_try_advisory_lock(:k)", {"k": SCHEDULER_LOCK_KEY}, connect=True,
                                    log_failure=functools.partial(log.warning, "leader election: %s"))

    def _still_leader(self) -> bool:
        return self._on_leader_conn("SELECT 1", {}, connect=False,
                                    log_failure=functools.partial(log.error, "lost the leader connection: %s"))

    def _on_leader_conn(self, sql: str, params: dict, *, connect: bool, log_failure) -> bool:
        """``sql``'s one value, as a bool, on the connection that holds the scheduler lock (opened
        first with ``connect``); always True off PostgreSQL. A failure is logged, the connection
        dropped (and the lock with it), and the answer False."""
        if self.engine.dialect.name != "postgresql":
            return True
        try:
            if connect and self._conn is None:
                self._conn = self.engine.connect()
            got = bool(self._conn.execute(text(sql), params).scalar())
            self._conn.commit()
            return got
        except Exception as e:  # noqa: BLE001
            log_failure(e)
            self._drop_conn()
            return False

    def _drop_conn(self) -> None:
        if self._conn is not None:
            try:
                self._conn.invalidate()
                self._conn.close()
            except Exception:  # noqa: BLE001
                pass
            self._conn = None

    def _become_leader(self) -> None:
        from apscheduler.schedulers.background import BackgroundScheduler

        now = self.clock()
        with self.factory.begin() as s:
            lease = s.get(SchedulerLease, "scheduler")
            if lease is None:
                s.add(SchedulerLease(name="scheduler", holder=self.instance, acquired_s=now, renewed_s=now))
            else:
                lease.holder, lease.acquired_s, lease.renewed_s = self.instance, now, now
        sched = BackgroundScheduler(timezone="UTC")
        start = datetime.datetime.now(datetime.timezone.utc)
        for name, (period, offset) in job_schedule(self.settings).items():
            sched.add_job(self.run_job, "interval", args=[name], id=name, name=name, seconds=period,
                          start_date=start + datetime.timedelta(seconds=offset), max_instances=1, coalesce=True,
                          misfire_grace_time=None)
        sched.start()
        self._sched, self.leader = sched, True
        self.metrics.is_leader.set(1)
        log.info("%s leads the scheduler", self.instance)

    def _step_down(self) -> None:
        if self._sched is not None:
            try:
                self._sched.shutdown(wait=True)
            except Exception:  # noqa: BLE001
                pass
            self._sched = None
        if self.leader:
            self.leader = False
            self.metrics.is_leader.set(0)
        self._drop_conn()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.leader:
                if self._try_lead():
                    try:
                        self._become_leader()
                    except Exception as e:  # noqa: BLE001
                        log.error("could not start the scheduler: %s", e)
                        self._step_down()
            else:
                if not self._still_leader():
                    self._step_down()
                else:
                    try:
                        with self.factory.begin() as s:
                            lease = s.get(SchedulerLease, "scheduler")
                            if lease is not None and lease.holder == self.instance:
                                lease.renewed_s = self.clock()
                    except Exception as e:  # noqa: BLE001
                        log.warning("lease renewal: %s", e)
            self._stop.wait(self.settings.leader_poll_s)


def _jsonable(x):
    import json

    try:
        json.dumps(x)
        return x
    except (TypeError, ValueError):
        return {"repr": repr(x)}


__all__ = ["JOBS", "Scheduling", "compute_weights", "job_schedule", "push_weights"]
