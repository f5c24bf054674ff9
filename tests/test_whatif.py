"""What-if runs: a stored window of traffic samples replayed through the simulator
(`control_plane.whatif`, `simulator.sampled`, `simulator.whatif_worker`).

- the rebuild: a generated stream's requests, sampled and hashed as the gateway does, rebuild a
  stream whose users, times, history lengths and candidate counts are the original's and whose
  item reuse is kept (the same lookups, relabelled);
- the route on the real app and a real worker process, on SQLite and PostgreSQL: a viewer gets 403,
  bad windows 422, an empty window 422 saying why, a second start 409 while one runs; the run's
  progress is stored and moves; the result holds every static split of the grid, the look-ahead
  oracle, the active policy (with its regret) and a candidate, versioned by window, profile and
  code, with its sentence;
- consistency: a window whose traffic is a paper-table stream, sent as `racer replay` sends it
  (`workloads.replay.request_body`, explicit candidates) through the gateway's sampler at its
  arrival times, gives what-if figures within the router-seed spread of `racer bench paper-table`'s
  rows on the same stream and configurations.
"""

from __future__ import annotations

import asyncio
import os
import json
import time
from dataclasses import replace

import numpy as np
import pytest
from fastapi.testclient import TestClient

from gateway.traffic_sample import Sampler

from .cp_util import REPO, Database, artifact_tar, backends, token_maker, wait_for

ADMIN = "racer_test_admin_whatif"
KEY = b"racer-test-whatif-key-0123456789"
T0 = 1_700_000_000.0
DEFAULT_POLICY = REPO / "policies" / "default"


def _table_cfg(**kw):
    from simulator.table import TableConfig

    base = dict(trace="taobao", regimes=("steady",), num_nodes=2, rate_rps=240.0, duration_s=6.0, num_users=1500,
                history_scale=2.0,
                shares=(0.1, 0.3, 0.5, 0.7, 0.9), routers=("racer",), other_router_allocators=(),
                extra_allocators=("oracle_lookahead",), jobs=1)
    base.update(kw)
    return TableConfig.quick(**base)


def _samples_of(stream, seed: int = 0) -> list[dict]:
    """The samples a gateway at rate 1 keeps of ``stream`` sent as `racer replay --explicit-candidates`
    sends it, each at ``T0`` + its arrival time, hashed with ``KEY`` (JSON objects, as posted)."""
    from workloads.candidates import StreamCandidates
    from workloads.replay import request_body

    cands = StreamCandidates(stream, stream.trace, seed)
    s = Sampler(KEY, 1.0, max_items=4096, max_pending=10**7, max_pending_bytes=2**34, seq0=1)
    for i in range(len(stream)):
        body = request_body(stream, i, 10, cands)
        h = s.pick(body["user_id"])
        assert h is not None  # rate 1: everyone
        s.record(h, body, node_id="node-000", status=200, ts_s=T0 + float(stream.arrival_s[i]))

    async def run():
        await s.prepare()
        return json.loads(await s.body(s.peek(10**7, 10**13)))["samples"]

    return asyncio.run(run())


# ------------------------------------------------------------------------------------ the rebuild ---
def test_the_rebuilt_stream_keeps_users_times_lengths_and_reuse():
    from simulator.sampled import SampledRequests, sampled_stream
    from simulator.table import _stream

    st = _stream(_table_cfg(), "steady")
    rows = _samples_of(st)
    assert len(rows) == len(st)
    ss = sampled_stream(SampledRequests.from_rows(rows), start_s=T0, end_s=T0 + 6.0)
    assert ss.info["unknown_history_fraction"] == 0.0 and ss.info["recorded_candidate_fraction"] == 1.0
    np.testing.assert_allclose(ss.arrival_s, st.arrival_s, atol=1e-6)
    np.testing.assert_array_equal(ss.history_len, st.history_len)
    np.testing.assert_array_equal(ss.num_new_items, st.num_new_items)
    np.testing.assert_array_equal(ss.num_candidates, st.num_candidates)
    # one simulated user per real user, the same requests each
    pairs = set(zip(st.user.tolist(), ss.user.tolist()))
    assert len(pairs) == len(set(st.user.tolist())) == len(set(ss.user.tolist()))
    # item reuse kept: the lookups are the original's under one relabelling (a bijection)
    m = {}
    for i in range(0, len(st), 7):
        for a, b in zip(np.r_[st.history(i), st.new_items(i)].tolist(), np.r_[ss.history(i), ss.new_items(i)].tolist()):
            assert m.setdefault(a, b) == b
    assert len(set(m.values())) == len(m)
    assert [p[0] for p in ss.phases] == ["part1", "part2", "part3", "part4"]


def test_positions_no_sample_named_are_items_of_their_own_and_counted():
    from simulator.sampled import SampledRequests, sampled_stream

    rows = [{"ts_s": 10.0, "user_hash": 5, "history_len": 6, "items": np.array([7, 8]), "new_items": np.array([9]),
             "candidates": np.array([], dtype=np.int64), "num_candidates": None},
            {"ts_s": 11.0, "user_hash": 5, "history_len": 7, "items": np.array([8, 9]), "new_items": np.array([]),
             "candidates": np.array([7, 7]), "num_candidates": 2}]
    ss = sampled_stream(SampledRequests.from_rows(rows), num_phases=2)
    h = ss.history(1).tolist()
    assert len(h) == 7 and h[4:] == [ss.history(0)[4], ss.history(0)[5], ss.new_items(0)[0]]
    assert len(set(h[:4])) == 4 and not set(h[:4]) & set(h[4:])  # 4 unknown positions, each its own item
    assert ss.info["unknown_history_fraction"] == round(8 / 13, 6)  # 4 of 6, then 4 of 7
    assert ss.num_candidates.tolist() == [256, 2]  # the node's default where none was said
    with pytest.raises(ValueError, match="no traffic sample"):
        sampled_stream(SampledRequests.from_rows([]))


# --------------------------------------------------------------------------------- the API, a run ---
@pytest.fixture(params=backends())
def api(request, tmp_path):
    from control_plane.api import create_app
    from control_plane.settings import Settings

    d = Database(request.param, tmp_path)
    now = [T0 + 600.0]
    app = create_app(Settings(database_url=d.url, scheduler=False, admin_token=ADMIN,
                              max_sample_body_bytes=64 * 2**20, whatif_wall_s=600.0, whatif_shares="0.2,0.8"),
                     clock=lambda: now[0])
    try:
        with TestClient(app) as c:
            yield c, token_maker(c, ADMIN), now, app
            app.state.whatif.join(600) if getattr(app.state, "whatif", None) else None
    finally:
        d.drop()


def _h(tok: str) -> dict:
    return {"Authorization": f"Bearer {tok}"}


def _register(c, token, n: int, arena_bytes: int) -> None:
    for k in range(n):
        nid = f"node-{k:03d}"
        r = c.post("/api/v1/nodes/register", headers=token("node", node_id=nid), json={
            "node_id": nid, "address": f"http://127.0.0.1:{9000 + k}", "device": "emulated a100-hstu",
            "cost_profile": {"kv_recompute_us_per_token": 3.0, "emb_transfer_us_per_row": 2.0,
                             "service_time_us": 3000.0, "queue_capacity": 64, "arena_bytes": arena_bytes,
                             "device": {"mode": "emulated", "time": "modelled", "profile": "a100-hstu"}}})
        assert r.status_code == 200, r.text


def _post_samples(c, token, rows: list[dict]) -> None:
    gw = token("router")
    for k in range(0, len(rows), 500):
        r = c.post("/api/v1/gateways/gw-0/samples", json={"samples": rows[k:k + 500]}, headers=gw)
        assert r.status_code == 200, r.text


def _arena(cfg) -> int:
    from simulator.table import _stream, sim_config

    sc = sim_config(cfg)
    return int(sc.cache_fraction * _stream(cfg, "steady").trace.num_items * sc.profile.emb_row_bytes)


def _wait_done(c, run_id: int, seen: list) -> dict:
    def poll():
        r = c.get(f"/api/v1/whatif-runs/{run_id}", headers=_h(ADMIN))
        assert r.status_code == 200, r.text
        j = r.json()
        seen.append(j["progress"])
        return j if j["state"] != "running" else None

    return wait_for(poll, timeout_s=600, interval_s=0.2)


@pytest.mark.slow
def test_a_whatif_over_the_api_bounds_progress_result_and_versions(api):
    from simulator.table import _stream

    c, token, now, app = api
    cfg = _table_cfg(duration_s=4.0, rate_rps=150.0)
    url = "/api/v1/whatif-runs"
    window = {"start_s": T0, "end_s": T0 + 4.0}
    # nothing stored yet: an empty window says so, and the latest run is a 404
    r = c.post(url, json=window, headers=_h(ADMIN))
    assert r.status_code == 422 and "holds no traffic sample" in r.json()["detail"][0]["msg"], r.text
    assert c.get(url + "/latest", headers=_h(ADMIN)).status_code == 404
    _register(c, token, 2, _arena(cfg))
    _post_samples(c, token, _samples_of(_stream(cfg, "steady")))
    # the registry: an active policy and a candidate
    for pid in ("wi-active", "wi-cand"):
        r = c.post("/api/v1/policies", content=artifact_tar(DEFAULT_POLICY, policy_id=pid), headers=_h(ADMIN))
        assert r.status_code == 201, r.text
    r = c.post("/api/v1/policies/wi-active/activate", json={"reason": "test"}, headers=_h(ADMIN))
    assert r.status_code == 200, r.text

    viewer = token("viewer")
    assert c.post(url, json=window, headers=viewer).status_code == 403
    assert c.post(url, json=window, headers=token("router")).status_code == 403
    for body, field in (({"start_s": T0 + 6, "end_s": T0}, "end_s"),
                        ({"start_s": T0, "end_s": T0 + 8 * 86400.0}, "end_s"),
                        ({"start_s": T0, "end_s": T0 + 3600.0}, "end_s"),  # in the future of the app's clock
                        ({"start_s": "yesterday", "end_s": T0}, "start_s"),
                        ({"start_s": -5.0, "end_s": T0}, "start_s"),
                        ({"start_s": T0, "end_s": T0 + 6, "extra": 1}, "extra")):
        r = c.post(url, json=body, headers=_h(ADMIN))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == field, (body, r.text)
    assert c.post(url, json={**window, "candidate": "no-such-policy"}, headers=_h(ADMIN)).status_code == 404
    assert c.get(url, headers=_h(ADMIN)).json() == []  # nothing refused was stored

    r = c.post(url, json=window, headers=_h(ADMIN))
    assert r.status_code == 202, r.text
    run = r.json()
    assert run["state"] == "running" and run["num_samples"] > 0
    second = c.post(url, json=window, headers=_h(ADMIN))
    assert second.status_code == 409 and f"what-if {run['id']} is running" in second.json()["detail"]
    seen: list[float] = []
    done = _wait_done(c, run["id"], seen)
    assert done["state"] == "done", done["error"]
    assert all(0.0 <= p <= 1.0 for p in seen) and seen == sorted(seen) and done["progress"] == 1.0
    res = done["result"]
    configs = [r["config"] for r in res["rows"]]
    assert configs == ["static:0.20", "static:0.80", "policy:wi-active", "policy:wi-cand", "oracle_lookahead"]
    roles = {r["config"]: r.get("role") for r in res["rows"]}
    assert roles["policy:wi-active"] == "active" and roles["policy:wi-cand"] == "candidate"
    for row in res["rows"]:
        assert row["p99_ms"] > 0 and 0 <= row["slo_attainment"] <= 1 and 0 <= row["mean_share"] <= 1, row
        assert [p["phase"].split("[")[0] for p in row["phases"]] == ["part1", "part2", "part3", "part4"]
    f = res["findings"]
    assert f["best_static"] in configs and f["best_static_over_oracle_pct"] is not None
    assert set(f["policy_regret"]) == {"policy:wi-active", "policy:wi-cand"}
    assert "over_oracle_pct" in f["policy_regret"]["policy:wi-active"]
    # versioned: the window, the fleet and profile, the code
    assert res["window"]["start_s"] == T0 and done["window_end_s"] == T0 + 4.0 and res["shares"] == [0.2, 0.8]
    assert done["profile"]["simulated_nodes"] == 2 and "a100-hstu" in done["profile"]["name"]
    assert done["code_version"] and "+" in done["code_version"] and done["cut"] is None
    assert done["sentence"].startswith("On the last 4 s of sampled traffic, a static ")
    assert "the running policy" in done["sentence"] and "perfect dynamic split" in done["sentence"]
    # a viewer reads it; the list has no results in it
    latest = c.get(url + "/latest", headers=viewer).json()
    assert latest["id"] == run["id"] and latest["result"] == res
    assert c.get(url, headers=viewer).json()[0]["result"] is None
    assert c.get(url + "/999", headers=viewer).status_code == 404
    # judging one candidate by name: the active policy and that one only
    r = c.post(url, json={**window, "candidate": "wi-cand"}, headers=_h(ADMIN))
    assert r.status_code == 202, r.text
    done = _wait_done(c, r.json()["id"], [])
    assert [x["config"] for x in done["result"]["rows"] if x["kind"] == "policy"] == ["policy:wi-active",
                                                                                      "policy:wi-cand"]
    assert c.get(url + "/latest", params={"candidate": "wi-cand"}, headers=viewer).json()["id"] == r.json()["id"]


@pytest.mark.slow
def test_a_window_longer_than_the_cap_is_cut_to_its_most_recent_samples(tmp_path):
    from control_plane.api import create_app
    from control_plane.settings import Settings
    from simulator.table import _stream

    cfg = _table_cfg(duration_s=4.0, rate_rps=150.0)
    rows = _samples_of(_stream(cfg, "steady"))
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'cp.db'}", scheduler=False, admin_token=ADMIN,
                              max_sample_body_bytes=64 * 2**20, whatif_max_samples=200, whatif_shares="0.5"),
                     clock=lambda: T0 + 600.0)
    with TestClient(app) as c:
        token = token_maker(c, ADMIN)

        _register(c, token, 1, _arena(cfg))
        _post_samples(c, token, rows)
        r = c.post("/api/v1/whatif-runs", json={"start_s": T0, "end_s": T0 + 4.0}, headers=_h(ADMIN))
        assert r.status_code == 202, r.text
        done = _wait_done(c, r.json()["id"], [])
        app.state.whatif.join(60)
    assert done["state"] == "done", done["error"]
    cut = done["cut"]
    assert cut["kept"] == 200 and cut["of"] == len(rows) and cut["from_s"] == sorted(x["ts_s"] for x in rows)[-200]
    assert done["result"]["stream"]["num_requests"] == 200 and "most recent" in cut["why"]
    assert done["sentence"].startswith(f"On the last {cut['kept_s']:.0f} s")


# ------------------------------------------------------------------------------------ consistency ---
@pytest.mark.slow
def test_whatif_figures_are_within_the_router_seed_spread_of_the_paper_table(tmp_path):
    """The paper table's rows (static grid and the look-ahead oracle, racer router) on one stream,
    and the same stream sent as a replay sends it, sampled, stored and replayed by a what-if: each
    what-if P99 lies within the spread of the table's P99 over router seeds 0-4 (the stream
    fixed), widened by the spread's own half-width (five seeds understate it)."""
    from control_plane.api import create_app
    from control_plane.settings import Settings
    from simulator.allocators import StaticAllocator
    from simulator.cluster import simulate
    from simulator.table import _stream, run_table, sim_config

    cfg = _table_cfg(shares=(0.1, 0.5, 0.9))
    stream = _stream(cfg, "steady")
    table = {r["allocator"]: r for r in run_table(cfg, progress=False)["rows"]}
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'cp.db'}", scheduler=False, admin_token=ADMIN,
                              max_sample_body_bytes=64 * 2**20, whatif_shares="0.1,0.5,0.9"),
                     clock=lambda: T0 + 600.0)
    with TestClient(app) as c:
        token = token_maker(c, ADMIN)

        _register(c, token, cfg.num_nodes, _arena(cfg))
        _post_samples(c, token, _samples_of(stream))
        r = c.post("/api/v1/whatif-runs", json={"start_s": T0, "end_s": T0 + cfg.duration_s}, headers=_h(ADMIN))
        assert r.status_code == 202, r.text
        done = _wait_done(c, r.json()["id"], [])
        app.state.whatif.join(60)
    assert done["state"] == "done", done["error"]
    got = {r["config"]: r for r in done["result"]["rows"]}
    scfg = replace(sim_config(cfg), cache_bytes=_arena(cfg))
    print(f"\n{'configuration':<18} {'paper-table P99':>16} {'router seeds 0-4 P99 [min, max]':>32} "
          f"{'what-if P99':>12}")
    for s in cfg.shares:
        name = f"static:{s:.2f}"
        assert table[name]["num_requests"] == got[name]["num_requests"] == len(stream)
        p99 = [simulate(stream, replace(scfg, router_seed=k), StaticAllocator(s), "racer").summary()["p99_ms"]
               for k in range(5)]
        assert table[name]["p99_ms"] in p99  # the table's own run is router seed 0's
        lo, hi = min(p99), max(p99)
        print(f"{name:<18} {table[name]['p99_ms']:>16.3f} {f'[{lo:.3f}, {hi:.3f}]':>32} {got[name]['p99_ms']:>12.3f}")
        half = max((hi - lo) / 2, 0.01 * hi)
        assert lo - half <= got[name]["p99_ms"] <= hi + half, (name, got[name]["p99_ms"], p99)
        assert abs(got[name]["mean_share"] - table[name]["mean_share"]) <= 0.02
    look = table["oracle_lookahead"]["p99_ms"]
    print(f"{'oracle_lookahead':<18} {look:>16.3f} {'':>32} {got['oracle_lookahead']['p99_ms']:>12.3f}")
    assert abs(got["oracle_lookahead"]["p99_ms"] / look - 1) <= 0.10, (got["oracle_lookahead"]["p99_ms"], look)


# ------------------------------------------------------------------------------ the command line ---
@pytest.mark.slow
def test_racer_whatif_and_racer_policy_whatif_against_a_running_control_plane(tmp_path):
    """A real control plane: `racer policy whatif CANDIDATE` judges a registered policy on the last
    minutes (the table, the candidate's regret, the sentence); `racer whatif` refuses a bad window
    with the control plane's reason (exit 1) and `--show` prints the latest run."""
    import subprocess
    import sys

    from simulator.table import _stream

    from .cp_util import ControlPlane, Database

    global T0
    cfg = _table_cfg(duration_s=3.0, rate_rps=150.0)
    t_start = time.time() - 30.0
    saved, T0 = T0, t_start
    try:
        rows = _samples_of(_stream(cfg, "steady"))
    finally:
        T0 = saved
    db = Database("sqlite", tmp_path)
    cp = ControlPlane(db.url, tmp_path / "cp.log", scheduler=False,
                      env={"RACER_WHATIF_SHARES": "0.3,0.7", "RACER_MAX_SAMPLE_BODY_BYTES": str(64 * 2**20)})
    try:
        ntok = cp.token("node", "n", node_id="node-000")
        r = cp.client(ntok).post("/nodes/register", json={
            "node_id": "node-000", "address": "http://127.0.0.1:9", "device": "emulated a100-hstu",
            "cost_profile": {"kv_recompute_us_per_token": 3.0, "emb_transfer_us_per_row": 2.0,
                             "service_time_us": 3000.0, "queue_capacity": 64, "arena_bytes": _arena(cfg),
                             "device": {"mode": "emulated", "time": "modelled", "profile": "a100-hstu"}}})
        assert r.status_code == 200, r.text
        gw = cp.client(cp.token("router", "gw"))
        for k in range(0, len(rows), 500):
            assert gw.post("/gateways/gw-cli/samples", json={"samples": rows[k:k + 500]}).status_code == 200
        r = cp.admin.post("/policies", content=artifact_tar(DEFAULT_POLICY, policy_id="cli-cand"))
        assert r.status_code == 201, r.text
        tok = tmp_path / "operator_token"
        tok.write_text(cp.ADMIN + "\n")
        base = [sys.executable, "-m", "racer"]
        common = ["--control-plane", cp.base, "--token-file", str(tok), "--poll-s", "0.3"]
        env = {k: v for k, v in os.environ.items() if k != "RACER_TOKEN"} | {"PYTHONPATH": str(REPO)}

        def racer(*a):
            return subprocess.run(base + list(a), capture_output=True, text=True, timeout=600, env=env, cwd=REPO)

        out = racer("policy", "whatif", "cli-cand", "--last", "10min", *common)
        assert out.returncode == 0, out.stderr
        assert "policy:cli-cand (candidate)" in out.stdout and "static:0.30" in out.stdout, out.stdout
        assert "regret of policy:cli-cand: over oracle" in out.stdout and "On the last" in out.stdout
        assert "%" in out.stderr  # its progress, followed on stderr
        bad = racer("whatif", "--from", "now", "--to", "now-1h", *common)
        assert bad.returncode == 1 and "end_s" in bad.stderr and "must be after start_s" in bad.stderr, bad.stderr
        empty = racer("whatif", "--from", "1000", "--to", "2000", *common)
        assert empty.returncode == 1 and "holds no traffic sample" in empty.stderr, empty.stderr
        show = racer("whatif", "--show", *common)
        assert show.returncode == 0 and "policy:cli-cand (candidate)" in show.stdout, show.stdout
        assert racer("whatif", "--from", "yesterday", "--to", "now", *common).returncode == 2
    finally:
        cp.stop()
        db.drop()


def test_the_scheduled_whatif_is_off_by_default_and_skips_an_empty_window(tmp_path):
    from control_plane.jobs import JOBS
    from control_plane.settings import Settings
    from control_plane.whatif import scheduled
    from db.engine import make_engine, session_factory, upgrade

    assert Settings().whatif_period_s is None and JOBS["whatif"][1] == "whatif_period_s"
    engine = make_engine(f"sqlite:///{tmp_path / 'cp.db'}")
    upgrade(engine)
    out = scheduled(session_factory(engine), Settings(), T0)
    assert "holds no traffic sample" in out["skipped"]
    with pytest.raises(ValueError, match="whatif_shares"):
        Settings(whatif_shares="0.5,2")


# ------------------------------------------------------------------------ the page, without a browser ---
def _result() -> dict:
    def row(config, kind, p99, mean_share, **kw):
        return {"config": config, "kind": kind, "p99_ms": p99, "p50_ms": p99 / 2, "slo_attainment": 0.9,
                "mean_share": mean_share, "phases": [{"phase": "part1[0-10s]", "p99_ms": p99},
                                                     {"phase": "part2[10-20s]", "p99_ms": p99 + 1}], **kw}

    rows = [row("static:0.30", "static", 10.4, 0.3, share=0.3), row("static:0.70", "static", 12.0, 0.7, share=0.7),
            row("policy:a", "policy", 10.0, 0.5, role="active", version="a"),
            row("oracle_lookahead", "oracle", 9.7, 0.4)]
    from simulator.sampled import findings

    return {"rows": rows, "findings": findings(rows)}


def test_the_sentence_table_and_chart_of_a_result():
    from control_plane.whatif import sentence
    from dashboard.whatif_tab import table_rows, view, whatif_figure

    res = _result()
    assert res["findings"]["best_static"] == "static:0.30" and res["findings"]["best_static_over_oracle_pct"] == 7.22
    assert res["findings"]["policy_regret"]["policy:a"] == {"over_oracle_pct": 3.09, "over_best_static_pct": -3.85}
    assert sentence(res, window_s=6 * 3600) == (
        "On the last 6 h of sampled traffic, a static 0.3 split (the best of the grid) would have been 4% slower "
        "than the running policy; a perfect dynamic split would have been 7% faster than the best static "
        "(simulated P99).")
    no_policy = {"rows": [r for r in res["rows"] if r["kind"] != "policy"]}
    no_policy["findings"] = res["findings"]
    assert "the best static split was 0.3" in sentence(no_policy, window_s=900)
    assert sentence(None, window_s=60) == "No what-if result yet."
    assert [r["configuration"] for r in table_rows(res)] == ["static:0.30", "static:0.70", "policy:a",
                                                             "oracle_lookahead"]
    fig = whatif_figure(res)
    assert [t.name for t in fig.data] == ["static:0.30", "static:0.70", "policy:a", "oracle_lookahead"]
    assert list(fig.data[0].x) == ["part1[0-10s]", "part2[10-20s]"] and list(fig.data[3].y) == [9.7, 10.7]
    run = {"id": 3, "state": "running", "progress": 0.42, "progress_note": "static:0.70", "created_by": "op",
           "window_start_s": T0, "window_end_s": T0 + 60}
    v = view(run, None, operator=True)
    assert v["progress"] == 42.0 and "running: static:0.70" in v["progress_note"] and v["start_disabled"] is True
    done = dict(run, state="done", progress=1.0, result=res, sentence="S.", num_samples=10, cut=None, profile=None,
                code_version="1+abc")
    v = view(done, {"id": 3, "state": "running"}, operator=True)
    assert v["progress_label"] == "100%" and v["sentence"] == "S." and v["start_disabled"] is False
    assert view(done, {"id": 3, "state": "done"}, operator=False)["start_disabled"] is True  # a viewer
