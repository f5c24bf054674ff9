"""One scheduler per cluster: two control-plane processes on one PostgreSQL database; each job
runs once per period (from one replica), and the standby takes over when the leader stops."""

from __future__ import annotations

import time

import httpx
import pytest

from .cp_util import ControlPlane, Database, backends, register, report, wait_for

PG = [p for p in backends() if getattr(p, "values", [p])[0] == "postgresql"]

PERIODS = {"router_weights": 0.5, "rollout_evaluation": 0.3, "override_expiry": 0.2, "node_liveness": 0.5}


@pytest.mark.slow
@pytest.mark.parametrize("backend", PG)
def test_two_replicas_on_one_postgresql_run_each_job_once_per_period(backend, tmp_path):
    d = Database(backend, tmp_path)
    a = b = None
    try:
        a = ControlPlane(d.url, tmp_path / "a.log")
        b = ControlPlane(d.url, tmp_path / "b.log")
        leaders = lambda: [httpx.get(c.base + "/healthz").json() for c in (a, b)]  # noqa: E731
        wait_for(lambda: sum(h["leader"] for h in leaders()) == 1, timeout_s=20)
        t0 = time.time()
        time.sleep(6.0)
        t1 = time.time()
        hs = leaders()
        assert sum(h["leader"] for h in hs) == 1, hs
        leader = next(h["instance"] for h in hs if h["leader"])
        runs = a.admin.get("/jobs", params={"since_s": t0, "limit": 10000}).json()
        runs = [r for r in runs if r["started_s"] < t1]
        for job, period in PERIODS.items():
            mine = sorted(r["started_s"] for r in runs if r["job"] == job)
            assert {r["instance"] for r in runs if r["job"] == job} == {leader}, job
            expected = (t1 - t0) / period
            # once per period: two schedulers would show two instances and about twice the runs
            # (lower bound loose: on a loaded machine a late run can be coalesced with the next)
            assert 0.5 * expected <= len(mine) <= 1.25 * expected + 2, (job, len(mine), expected)
            assert all(r["ok"] for r in runs if r["job"] == job), job
        # the leader stops: the standby takes over (the advisory lock dies with its session)
        (lead, stand) = (a, b) if hs[0]["leader"] else (b, a)
        lead.stop()
        wait_for(lambda: httpx.get(stand.base + "/healthz").json()["leader"], timeout_s=20)
        new = httpx.get(stand.base + "/healthz").json()["instance"]
        t2 = time.time()
        wait_for(lambda: [r for r in stand.admin.get("/jobs", params={"since_s": t2}).json()
                          if r["job"] == "override_expiry" and r["instance"] == new], timeout_s=10)
        assert stand.admin.get("/summary").json()["leader"] == new
    finally:
        for c in (a, b):
            if c is not None:
                c.stop()
        d.drop()


def test_sqlite_replica_leads_alone(tmp_path):
    d = Database("sqlite", tmp_path)
    c = ControlPlane(d.url, tmp_path / "c.log")
    try:
        wait_for(lambda: httpx.get(c.base + "/healthz").json()["leader"], timeout_s=10)
        runs = wait_for(lambda: c.admin.get("/jobs", params={"job": "node_liveness"}).json(), timeout_s=10)
        assert runs[0]["ok"] and runs[0]["summary"] is not None
        assert "racer_cp_scheduler_leader 1.0" in httpx.get(c.base + "/metrics").text
    finally:
        c.stop()


@pytest.mark.parametrize("backend", backends())
def test_jobs_only_process_runs_the_jobs_beside_an_api_replica(backend, tmp_path):
    """``--jobs-only``: a process that is elected and runs the jobs, serving only /healthz and
    /metrics, beside an API replica with no scheduler on the same database; the API replica's
    reports reach the jobs (a node it registered is seen alive by the jobs process's liveness)."""
    d = Database(backend, tmp_path)
    api = jobs = None
    try:
        api = ControlPlane(d.url, tmp_path / "api.log", scheduler=False)
        jobs = ControlPlane(d.url, tmp_path / "jobs.log", args=("--jobs-only",))
        wait_for(lambda: httpx.get(jobs.base + "/healthz").json()["leader"], timeout_s=20)
        health = httpx.get(jobs.base + "/healthz").json()
        assert health["instance"].endswith(":jobs") and not httpx.get(api.base + "/healthz").json()["leader"]
        assert "racer_cp_scheduler_leader 1.0" in httpx.get(jobs.base + "/metrics").text
        # no API there: not the reports, not the tokens, not the summary, not the OpenAPI document
        for path in ("/api/v1/summary", "/api/v1/nodes/n1/reports", "/openapi.json", "/docs"):
            assert httpx.get(jobs.base + path).status_code == 404, path
        assert httpx.post(jobs.base + "/api/v1/tokens", json={"role": "node"},
                          headers={"Authorization": f"Bearer {ControlPlane.ADMIN}"}).status_code == 404
        node = api.node("n1")
        register(node, "n1")
        now = time.time()
        assert node.post("/nodes/n1/reports", json={"reports": [report(0, now)]}).status_code == 200
        runs = wait_for(lambda: [x for x in api.admin.get("/jobs", params={"job": "node_liveness",
                                                                            "since_s": now}).json()
                                 if x["ok"] and x["started_s"] > now + 0.1], timeout_s=20)
        assert {x["instance"] for x in runs} == {health["instance"]}
        assert runs[-1]["summary"]["up"] == 1  # the node the API replica registered, seen by the jobs process
        assert api.admin.get("/summary").json()["leader"] == health["instance"]
    finally:
        for c in (api, jobs):
            if c is not None:
                c.stop()
        d.drop()


def test_a_process_with_neither_api_nor_jobs_is_refused(tmp_path):
    from control_plane.main import main
    from control_plane.settings import Settings

    with pytest.raises(ValueError, match="would do nothing"):
        Settings(serve_api=False, scheduler=False)
    with pytest.raises(SystemExit) as e:  # the two flags are exclusive on the command line
        main(["--db", f"sqlite:///{tmp_path}/x.db", "--jobs-only", "--no-scheduler"])
    assert e.value.code == 2


def test_jobs_started_together_never_run_together():
    """Each job's runs are offset from the others' within its period, so no two of the default
    schedule's jobs fire at the same instant over an hour (the weights, rollout and liveness jobs
    firing together stalled report ingestion at 1,000 nodes), and a job that is off is left out."""
    from control_plane.jobs import job_schedule
    from control_plane.settings import Settings

    sched = job_schedule(Settings())
    assert "whatif" not in sched and {"router_weights", "node_liveness", "retention"} <= set(sched)
    fires = {}
    for name, (period, offset) in sched.items():
        assert 0 <= offset < period
        k = 0
        while offset + k * period < 3600:
            at = round(offset + k * period, 6)
            assert at not in fires, (name, fires.get(at), at)
            fires[at] = name
            k += 1
    assert job_schedule(Settings(whatif_period_s=60.0))["whatif"][0] == 60.0
