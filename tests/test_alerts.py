"""Alerts: each condition fires on the control plane's records and clears when it ends
(``GET /api/v1/alerts`` on the real app and a SQLite database, time driven by the app's clock),
and the shipped Prometheus rules parse and read only metrics the processes export (scraped from
a real control plane, gateway and emulated node agent; the agent's policy asks for a split below
its guard bound, so the pinned-at-a-bound alert fires on its real decisions)."""

from __future__ import annotations

import httpx
import promql_parser as promql
import pytest
import yaml
from fastapi.testclient import TestClient

from control_plane.alerts import ALERTS
from control_plane.api import create_app
from control_plane.jobs import job_node_liveness
from control_plane.settings import Settings
from db.models import Rollout

from .conftest import REPO
from .cp_util import report, token_maker

ADMIN = "admin-token-for-alerts-0123456789"
RULES = REPO / "deploy" / "prometheus" / "racer-alerts.yml"


def _gw_report(seq: int, ts: float, attainment: float) -> dict:
    return {"seq": seq, "ts_s": ts, "interval_s": 60.0, "slo_ms": 30.0, "num_requests": 100, "num_ok": 100,
            "num_failed": 0, "num_retried": 0, "num_503": 0, "p50_ms": 5.0, "p99_ms": 20.0,
            "slo_attainment": attainment, "outcomes": {"ok": {"num_requests": 100, "p50_ms": 5.0, "p99_ms": 20.0}},
            "statuses": {"200": 100}, "nodes": [], "num_live_nodes": 1, "num_nodes": 1}


def _decision(clamped: bool) -> dict:
    guard = {"action": "min", "limit": 0.05, "prev": 0.05, "proposal_in": 0.01, "source_in": "base",
             "step_limit": True, "taken_back": 0.0} if clamped else \
        {"action": None, "limit": None, "prev": 0.3, "proposal_in": 0.3, "source_in": "base", "step_limit": True,
         "taken_back": 0.0}
    return {"source": "guard" if clamped else "base", "emb_share": 0.05 if clamped else 0.3, "reason": "t",
            "layers": [{"layer": "base", "proposal": 0.01 if clamped else 0.3, "acted": True},
                       {"layer": "guard", "proposal": 0.05 if clamped else 0.3, "acted": clamped, "detail": guard}]}


def test_each_alert_fires_on_its_condition_and_clears_when_it_ends(tmp_path):
    now = [1_000_000.0]
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'cp.db'}", scheduler=False, admin_token=ADMIN),
                     clock=lambda: now[0])
    with TestClient(app) as c:
        admin = {"Authorization": f"Bearer {ADMIN}"}

        token = token_maker(c, ADMIN)

        def firing() -> set:
            r = c.get("/api/v1/alerts", headers=admin)
            assert r.status_code == 200, r.text
            assert all(a["alert"] in ALERTS and a["severity"] in ("page", "ticket") and a["summary"] for a in r.json())
            return {(a["alert"], a["target"]) for a in r.json()}

        assert firing() == set()
        assert c.get("/api/v1/alerts").status_code == 401
        node_tok = token("node", node_id="n1")
        assert c.get("/api/v1/alerts", headers=node_tok).status_code == 403
        assert c.get("/api/v1/alerts", headers=token("viewer")).status_code == 200

        # the clients' SLO: an hour met, then misses. Five bad minutes burn the 5-min window but
        # not the hour's (a blip does not page); ten do; ten good ones clear the short window
        gw = token("router")
        t0 = now[0]
        seq = iter(range(10_000))

        def gw_minutes(start: float, minutes: int, attainment: float) -> None:
            rs = [_gw_report(next(seq), start + 60 * k, attainment) for k in range(minutes)]
            assert c.post("/api/v1/gateways/gw-a/reports", json={"reports": rs}, headers=gw).status_code == 200

        gw_minutes(t0 - 3600, 60, 1.0)
        assert not {a for a, _ in firing()} & {"RacerSLOBurnFast", "RacerSLOBurnSlow"}
        gw_minutes(t0, 5, 0.0)
        now[0] = t0 + 299
        assert ("RacerSLOBurnFast", "clients") not in firing()
        gw_minutes(t0 + 300, 5, 0.0)
        now[0] = t0 + 599
        assert ("RacerSLOBurnFast", "clients") in firing()
        gw_minutes(t0 + 600, 10, 1.0)
        now[0] = t0 + 1199
        assert ("RacerSLOBurnFast", "clients") not in firing()

        # a node down, and back
        node = {**node_tok, "Content-Type": "application/json"}
        r = c.post("/api/v1/nodes/register", headers=node, json={
            "node_id": "n1", "address": "http://127.0.0.1:9", "device": "cpu",
            "cost_profile": {"kv_recompute_us_per_token": 2.0, "emb_transfer_us_per_row": 1.0,
                             "service_time_us": 500.0, "queue_capacity": 64}})
        assert r.status_code == 200, r.text
        rseq = iter(range(1, 10_000))

        def node_reports(*reps) -> None:
            r = c.post("/api/v1/nodes/n1/reports", headers=node, json={"reports": list(reps)})
            assert r.status_code == 200, r.text

        node_reports(report(next(rseq), ts_s=now[0], num_reports_dropped=0))
        st = app.state
        now[0] += 30
        assert job_node_liveness(st.factory, st.settings, st.metrics, now[0])["marked_down"] == ["n1"]
        assert ("RacerNodeDown", "node:n1") in firing()
        node_reports(report(next(rseq), ts_s=now[0], num_reports_dropped=0))
        assert ("RacerNodeDown", "node:n1") not in firing()

        # pinned at a bound: at least half of ten decisions in the window clamped to one bound
        t = now[0]
        node_reports(*[report(next(rseq), ts_s=t + k, decision=_decision(k % 3 == 0)) for k in range(12)])
        now[0] = t + 12
        assert ("RacerNodePinnedAtBound", "node:n1") not in firing()  # 4 of 12
        node_reports(*[report(next(rseq), ts_s=t + 12 + k, decision=_decision(k % 4 != 0)) for k in range(12)])
        now[0] = t + 24
        assert ("RacerNodePinnedAtBound", "node:n1") in firing()  # 4 + 9 of 24
        now[0] = t + 24 + st.settings.alert_window_s
        assert ("RacerNodePinnedAtBound", "node:n1") not in firing()

        # dropped reports: a rise in the count fires for the window; the first count seen does not
        node_reports(report(next(rseq), ts_s=now[0], num_reports_dropped=0))
        assert ("RacerReportsDropped", "node:n1") not in firing()
        node_reports(report(next(rseq), ts_s=now[0], num_reports_dropped=4))
        assert ("RacerReportsDropped", "node:n1") in firing()
        node_reports(report(next(rseq), ts_s=now[0] + 1, num_reports_dropped=4))
        now[0] += st.settings.alert_window_s + 2
        assert ("RacerReportsDropped", "node:n1") not in firing()

        # a rollout rolled back within the hour
        with st.factory.begin() as s:
            s.add(Rollout(kind="policy", state="rolled_back", config={}, created_by="t", created_at_s=now[0] - 100,
                          updated_at_s=now[0] - 50, reason="canary P99 +40% over baseline"))
        got = [a for a in c.get("/api/v1/alerts", headers=admin).json() if a["alert"] == "RacerRolloutRolledBack"]
        assert len(got) == 1 and "canary P99" in got[0]["summary"]
        now[0] += 3600
        assert not [a for a, _ in firing() if a == "RacerRolloutRolledBack"]


def _metric_names(expr) -> set[str]:
    """Every metric name a parsed PromQL expression reads."""
    out, todo = set(), [expr]
    while todo:
        e = todo.pop()
        name = getattr(e, "name", None)
        if type(e).__name__ == "VectorSelector" and name:
            out.add(name)
        for attr in ("lhs", "rhs", "expr", "args", "vector_selector", "param"):
            v = getattr(e, attr, None)
            if v is None:
                continue
            todo.extend(v if isinstance(v, (list, tuple)) else [v])
    return out


def _rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_the_shipped_prometheus_rules_parse_and_name_each_condition():
    rules = _rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    assert set(ALERTS) <= set(names)  # every condition the control plane evaluates has its rule
    for r in rules:
        assert r["labels"]["severity"] in ("page", "ticket") and r["annotations"]["summary"], r["alert"]
        assert _metric_names(promql.parse(r["expr"])), r["alert"]
    with pytest.raises(ValueError):  # the parser refuses what Prometheus would (a check that it checks)
        promql.parse("0.5 * on (instance) group_left sum(x)")


@pytest.mark.slow
def test_the_rules_read_metrics_the_processes_export_and_a_pinned_node_fires(tmp_path):
    """A control plane, an emulated agent whose policy asks for 0.01 (under the guard's 0.05) and a
    gateway in front of it, all real processes: every metric the rules read appears in one of their
    /metrics (``up`` is Prometheus's own), and the pinned-at-a-bound alert fires on the agent's
    real decisions, on /api/v1/alerts and in its racer_decisions_at_bound_total."""
    from .procs import free_port, racer_cmd, spawn, stop, wait_http
    from .test_node_agent import write_taobao_csv
    from .test_node_reporter import ControlPlane, wait_for
    from .test_reporter_parts import export_constant_policy

    cp = ControlPlane(tmp_path)
    cp.start()
    agent = gateway = None
    try:
        token = cp.node_token("p0")
        csv = write_taobao_csv(tmp_path / "UserBehavior_small.csv")
        policy = export_constant_policy(tmp_path / "p001", 0.01)
        aport, gport = free_port(), free_port()
        agent = spawn(racer_cmd("node-agent", "--port", str(aport), "--trace", "taobao", "--path", str(csv),
                                "--emulate", "a100-hstu", "--time-scale", "2", "--num-pages", "64", "--policy",
                                str(policy), "--control-interval-s", "0.2", "--control-plane", cp.url,
                                "--node-id", "p0", "--state-dir", str(tmp_path / "state")),
                      tmp_path / "agent.log", env={"RACER_NODE_TOKEN": token})
        wait_http(f"http://127.0.0.1:{aport}/healthz", agent, 120, tmp_path / "agent.log")
        gateway = spawn(racer_cmd("gateway", "--nodes", f"http://127.0.0.1:{aport}", "--trace", "taobao", "--path",
                                  str(csv), "--port", str(gport)), tmp_path / "gateway.log")
        wait_http(f"http://127.0.0.1:{gport}/healthz", gateway, 120, tmp_path / "gateway.log")
        with httpx.Client(timeout=30) as h:
            for u in range(4):
                r = h.post(f"http://127.0.0.1:{gport}/v1/recommend",
                           json={"user_id": u, "history": list(range(u, u + 12)), "num_candidates": 8})
                assert r.status_code == 200, r.text
            with cp.api() as api:
                got = wait_for(lambda: [a for a in api.get("/alerts").json() if a["alert"] == "RacerNodePinnedAtBound"],
                               90, "the pinned-at-a-bound alert")
            assert got[0]["target"] == "node:p0" and "min emb_share 0.05" in got[0]["summary"]
            urls = (cp.url + "/metrics", f"http://127.0.0.1:{aport}/metrics", f"http://127.0.0.1:{gport}/metrics")
            wanted = set().union(*(_metric_names(promql.parse(r["expr"])) for r in _rules())) - {"up"}

            def scrape():  # the liveness and rollout jobs set their gauges on their first runs
                texts = [h.get(u).text for u in urls]
                exported = {line.split("{")[0].split(" ")[0] for t in texts for line in t.splitlines()
                            if line and not line.startswith("#")}
                return texts if wanted <= exported else None

            texts = wait_for(scrape, 30, "every metric the rules read")
        assert any(line.startswith('racer_decisions_at_bound_total{bound="min"}') and float(line.split()[-1]) > 0
                   for line in texts[1].splitlines())
        assert 'racer_gateway_slo_requests_total{outcome="within"}' in texts[2]
    finally:
        for p in (gateway, agent):
            if p is not None:
                stop(p)
        cp.stop()
