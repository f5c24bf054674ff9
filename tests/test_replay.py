"""`racer replay`: the open-loop load generator against real node-agent processes over HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI

from racer.cli import main as racer_main
from workloads import load_trace
from workloads.replay import ReplayConfig, build_plan, parse_phases, parse_schedule, replay, request_body

from .conftest import REPO
from .procs import free_port, start_agent, stop, wait_http
from .test_node_agent import write_taobao_csv


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    return write_taobao_csv(tmp / "UserBehavior_small.csv", num_users=60, num_items=400, seed=5)


@pytest.fixture(scope="module")
def agent(tmp_path_factory, small_trace):
    tmp = tmp_path_factory.mktemp("replay_agent")
    proc, base, log = start_agent(tmp, "agent", small_trace)
    try:
        wait_http(f"{base}/healthz", proc, log=log)
        yield base
    finally:
        stop(proc)


def test_replay_schedule_against_a_node_agent_serves_every_request(agent, small_trace):
    trace = load_trace("taobao", small_trace)
    cfg = ReplayConfig(schedule=("steady", "trend", "burst"), rate_rps=15, duration_s=4.5, slo_ms=200,
                       max_history_len=256, num_candidates=32)
    plan = build_plan(trace, cfg)
    assert [p.regime for p in plan] == ["steady", "trend", "burst"]
    assert [p.offset_s for p in plan] == [0.0, 1.5, 3.0]
    expected = sum(len(p.stream) for p in plan)
    out = replay([agent], trace, cfg)
    assert out["requests_sent"] == expected > 0
    assert out["requests_served"] == expected and out["requests_failed"] == 0 and out["requests_lost"] == 0
    assert set(out["regimes"]) == {"steady", "trend", "burst"}
    assert sum(r["requests_sent"] for r in out["regimes"].values()) == expected
    lat = out["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert 0.0 <= out["slo_attainment"] <= 1.0
    assert out["served_by"] == {agent: expected}
    # the agent saw exactly these requests, with their bodies accepted
    import httpx

    m = httpx.get(f"{agent}/v1/metrics").json()
    assert m["engine"]["num_served"] >= expected and m["metrics"]["num_rejected"] == 0


def test_replay_counts_every_failure_and_client_retries_on_the_next_target(agent, small_trace):
    trace = load_trace("taobao", small_trace)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = ReplayConfig(schedule=("steady",), rate_rps=20, duration_s=1.0, timeout_s=5.0)
    out = replay([dead], trace, cfg)
    assert out["requests_sent"] > 0 and out["requests_served"] == 0
    assert out["requests_failed"] == out["requests_sent"] and out["requests_lost"] == 0
    assert out["failures"] == {"connect": out["requests_sent"]} and out["slo_attainment"] == 0.0

    cfg = ReplayConfig(schedule=("steady",), rate_rps=20, duration_s=1.0, timeout_s=5.0, retries=1, slo_ms=500)
    out = replay([dead, agent], trace, cfg)
    n = out["requests_sent"]
    assert out["requests_served"] == n and out["requests_failed"] == 0
    # every other request went to the dead target first and was retried on the agent
    assert out["client_retries"] == out["requests_retried"] == (n + 1) // 2
    assert out["served_by"] == {agent: n}


def _slow_server(delay_s: float):
    app = FastAPI()
    seen = []

    @app.post("/v1/recommend")
    async def recommend(body: dict):
        seen.append(time.monotonic())
        k = len(seen)
        await asyncio.sleep(delay_s)
        return {"items": [1], "node_id": "slow-0", "retried": k % 5 == 0}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    return server, t, f"http://127.0.0.1:{sock.getsockname()[1]}", seen


def test_replay_is_open_loop_against_a_slow_server(small_trace):
    """Requests leave on schedule although none has returned yet: ~40 requests answered after 1 s
    each take ~2 s in all, not the ~40 s a closed-loop client would need."""
    trace = load_trace("taobao", small_trace)
    server, thread, base, seen = _slow_server(1.0)
    try:
        cfg = ReplayConfig(schedule=("steady",), rate_rps=40, duration_s=1.0, slo_ms=50, timeout_s=5.0)
        out = replay([base], trace, cfg)
    finally:
        server.should_exit = True
        thread.join(5)
    n = out["requests_sent"]
    assert n >= 20 and out["requests_served"] == n
    # a closed-loop client would spread them over n seconds (one answer per second); open loop, they
    # all arrive within the 1 s schedule plus whatever a loaded machine adds (bounded far below n s)
    assert max(seen) - min(seen) < n * 1.0 / 4
    assert out["wall_s"] < n * 1.0 / 4
    assert out["latency_ms"]["p50"] >= 1000 and out["slo_attainment"] == 0.0
    assert out["served_by"] == {"slow-0": n}
    assert out["requests_retried"] == n // 5  # the gateway-style "retried": true answers


def test_replay_times_out_slow_answers_and_sends_https_targets_through_httpx(small_trace):
    trace = load_trace("taobao", small_trace)
    server, thread, base, seen = _slow_server(2.0)
    try:  # the pooled client: an answer later than timeout_s is a timeout, and nothing is lost
        out = replay([base], trace, ReplayConfig(schedule=("steady",), rate_rps=20, duration_s=0.5, timeout_s=0.3))
    finally:
        server.should_exit = True
        thread.join(5)
    n = out["requests_sent"]
    assert n > 0 and out["failures"] == {"timeout": n} and out["requests_lost"] == 0 and len(seen) == n
    # an https:// target goes through httpx (TLS); nothing listens there: every request fails to connect
    dead = f"https://127.0.0.1:{free_port()}"
    out = replay([dead], trace, ReplayConfig(schedule=("steady",), rate_rps=20, duration_s=0.5, timeout_s=5.0))
    assert out["requests_sent"] > 0 and out["failures"] == {"connect": out["requests_sent"]}


def test_replay_cli_json_and_bad_input(agent, small_trace, capsys):
    rc = racer_main(["replay", "--trace", "taobao", "--path", str(small_trace), "--regime", "steady",
                     "--rate", "10", "--duration", "1", "--gateway", agent, "--json", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["requests_lost"] == 0 and out["config"]["schedule"] == ["steady"]
    assert out["requests_served"] == out["requests_sent"] > 0
    bad = [
        (["--regime", "steady", "--schedule", "steady,burst"], "one of --regime"),
        (["--schedule", "steady,spiky"], "unknown regime 'spiky'"),
    ]
    for args, words in bad:
        rc = racer_main(["replay", "--trace", "taobao", "--path", str(small_trace), "--gateway", agent,
                         "--duration", "1", *args])
        err = capsys.readouterr().err
        assert rc == 2 and words in err, (args, err)
    out_of_range = [  # refused by the options themselves (ranges read from ReplayConfig)
        (["--rate", "-3"], "argument --rate: must be a positive number, got -3"),
        (["--retries", "9"], "argument --retries: must be an integer in [0, 5], got 9"),
    ]
    for args, words in out_of_range:
        with pytest.raises(SystemExit) as e:
            racer_main(["replay", "--trace", "taobao", "--path", str(small_trace), "--gateway", agent,
                        "--duration", "1", "--regime", "steady", *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err, (args, err)
    rc = racer_main(["replay", "--trace", "taobao", "--path", str(small_trace), "--regime", "steady",
                     "--gateway", "localhost:8000"])
    assert rc == 2 and "not an http:// or https:// URL" in capsys.readouterr().err


def test_replay_progress_bar_on_stderr_report_on_stdout(agent, small_trace):
    cmd = [sys.executable, "-m", "racer", "replay", "--trace", "taobao", "--path", str(small_trace),
           "--regime", "burst", "--rate", "10", "--duration", "1.5", "--gateway", agent, "--json"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["regimes"]["burst"]["requests_sent"] == out["requests_sent"]
    assert "racer replay" in p.stderr and "req" in p.stderr


def test_replay_timed_schedule_is_one_stream_users_keep_their_identity_across_phases(agent, small_trace, capsys):
    """``--schedule steady:1.5,trend:1,burst:1,steady:1``: one `generate_schedule` stream cut into
    four phases; a user's request in a later phase continues its history from an earlier phase;
    the report's per-phase figures (keyed like the simulator's phases) add up to what was sent."""
    import httpx

    trace = load_trace("taobao", small_trace)
    text = "steady:1.5,trend:1,burst:1,steady:1"
    schedule, phase_s = parse_phases(text)
    assert schedule == ("steady", "trend", "burst", "steady") and phase_s == (1.5, 1.0, 1.0, 1.0)
    # the config racer replay builds from these options (its defaults for the rest)
    cfg = ReplayConfig(schedule=schedule, phase_s=phase_s, duration_s=4.5, rate_rps=15, slo_ms=200)
    plan = build_plan(trace, cfg)
    names = ["steady[0-1.5s]", "trend[1.5-2.5s]", "burst[2.5-3.5s]", "steady[3.5-4.5s]"]
    assert [p.name for p in plan] == names
    stream = plan[0].stream
    assert all(p.stream is stream for p in plan)  # one stream for the pass
    # the phases tile the stream: every request in exactly one phase, by arrival time
    assert plan[0].first == 0 and plan[-1].stop == len(stream)
    assert all(a.stop == b.first for a, b in zip(plan, plan[1:]))
    for p in plan:
        t = stream.arrival_s[p.indices.start:p.indices.stop]
        assert p.num_requests > 0 and t.min() >= p.start_s and t.max() < p.end_s
    # identity kept: a user's first request of a later phase follows its own request of an earlier
    # phase (prev_request crosses the boundary) and its history continues that request's history
    first_phase = set(plan[0].indices)
    crossing = [(int(stream.prev_request[i]), i) for p in plan[1:] for i in p.indices
                if int(stream.prev_request[i]) in first_phase]
    assert crossing, "no user of phase 1 came back in a later phase"
    for j, i in crossing:
        assert stream.user[i] == stream.user[j]
        before, after = request_body(stream, j, 10), request_body(stream, i, 10)
        assert after["user_id"] == before["user_id"]
        assert len(after["history"]) >= len(before["history"])
        assert after["history"][:len(before["history"])] == before["history"]

    served_before = httpx.get(f"{agent}/v1/metrics").json()["engine"]["num_served"]
    rc = racer_main(["replay", "--trace", "taobao", "--path", str(small_trace), "--schedule", text, "--rate", "15",
                     "--slo-ms", "200", "--gateway", agent, "--json", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    expected = len(stream)
    assert rc == 0 and out["requests_sent"] == expected > 0
    assert out["requests_served"] == expected and out["requests_lost"] == 0
    assert out["config"]["schedule"] == list(schedule) and out["config"]["phase_s"] == [1.5, 1.0, 1.0, 1.0]
    assert out["config"]["duration_s"] == 4.5 and out["offered_rps"] == round(expected / 4.5, 2)
    assert list(out["phases"]) == names
    assert [out["phases"][p.name]["requests_sent"] for p in plan] == [p.num_requests for p in plan]
    assert sum(r["requests_sent"] for r in out["phases"].values()) == out["requests_sent"]
    # the regimes' figures aggregate their phases (steady played twice)
    assert out["regimes"]["steady"]["requests_sent"] == plan[0].num_requests + plan[3].num_requests
    assert sum(r["requests_sent"] for r in out["regimes"].values()) == out["requests_sent"]
    assert httpx.get(f"{agent}/v1/metrics").json()["engine"]["num_served"] - served_before == expected

    # --duration equal to the phases' sum is accepted
    rc = racer_main(["replay", "--trace", "taobao", "--path", str(small_trace), "--schedule", "steady:0.5",
                     "--duration", "0.5", "--rate", "10", "--gateway", agent, "--json", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and list(out["phases"]) == ["steady[0-0.5s]"] and out["config"]["duration_s"] == 0.5


def test_replay_equal_parts_schedule_keeps_its_per_phase_streams():
    """The old form still gives one stream per regime (own seed) laid end to end; phases are named."""
    from workloads import synthetic_trace

    trace = synthetic_trace(num_users=40, num_items=300, seed=1)
    cfg = ReplayConfig(schedule=("steady", "burst", "steady"), rate_rps=20, duration_s=3.0)
    plan = build_plan(trace, cfg)
    assert [p.name for p in plan] == ["steady[0-1s]", "burst[1-2s]", "steady[2-3s]"]
    assert [p.offset_s for p in plan] == [0.0, 1.0, 2.0]
    assert len({id(p.stream) for p in plan}) == 3
    assert all(p.indices == range(len(p.stream)) for p in plan)
    assert parse_phases("steady,trend,burst") == (("steady", "trend", "burst"), None)


def test_replay_timed_schedule_bad_input_exits_2_and_sends_nothing(agent, small_trace, capsys):
    import httpx

    served_before = httpx.get(f"{agent}/v1/metrics").json()["engine"]["num_served"]
    bad = [
        (["--schedule", "steady:2,trend"], "'trend' has no seconds but 'steady:2' has"),
        (["--schedule", "steady:2,spiky:1"], "'spiky:1': regime must be one of steady, trend, burst"),
        (["--schedule", "steady:0"], "'steady:0': seconds must be positive"),
        (["--schedule", "steady:-5,burst:1"], "'steady:-5': seconds must be positive"),
        (["--schedule", "steady:abc"], "'steady:abc': seconds must be a number"),
        (["--schedule", "steady:nan"], "'steady:nan': seconds must be positive"),
        (["--schedule", ""], "give one or more of steady, trend, burst"),
        (["--schedule", " , "], "give one or more of steady, trend, burst"),
        (["--schedule", "steady:2,burst:1", "--duration", "10"], "--duration 10 differs from the schedule's 3 s"),
        (["--regime", "steady", "--schedule", "steady:2"], "give one of --regime"),
    ]
    for args, words in bad:
        rc = racer_main(["replay", "--trace", "taobao", "--path", str(small_trace), "--gateway", agent,
                         "--rate", "10", *args])
        cap = capsys.readouterr()
        assert rc == 2 and words in cap.err and cap.out == "", (args, cap.err)
        assert cap.err.startswith("racer: error: ") and "Traceback" not in cap.err
    assert httpx.get(f"{agent}/v1/metrics").json()["engine"]["num_served"] == served_before  # nothing sent
    # the names-only parser (racer up's --schedule) says why it refuses seconds
    with pytest.raises(ValueError, match="regime names only"):
        parse_schedule("steady:60,trend:60")
    with pytest.raises(ValueError, match="must be the sum of phase_s"):
        ReplayConfig(schedule=("steady", "burst"), phase_s=(2.0, 1.0), duration_s=60.0)
    with pytest.raises(ValueError, match="phase_s has 1 entries for 2 regimes"):
        ReplayConfig(schedule=("steady", "burst"), phase_s=(2.0,), duration_s=2.0)


def test_replay_timed_schedule_in_a_loop_one_stream_per_pass(agent, small_trace):
    """`racer up`'s loop with a REGIME:SECONDS schedule: each pass is one `generate_schedule` stream
    with its own seed; a short first pass scales every phase alike; figures add up across passes."""
    from workloads.replay import ReplayStats, run_replay

    trace = load_trace("taobao", small_trace)
    cfg = ReplayConfig(schedule=("steady", "burst"), phase_s=(0.8, 0.4), duration_s=1.2, first_cycle_s=0.6,
                       rate_rps=15, slo_ms=500)
    p0, p1, p2 = (build_plan(trace, cfg, c) for c in range(3))
    assert [p.name for p in p0] == ["steady[0-0.4s]", "burst[0.4-0.6s]"]
    assert [p.name for p in p1] == [p.name for p in p2] == ["steady[0-0.8s]", "burst[0.8-1.2s]"]
    assert not (len(p1[0].stream) == len(p2[0].stream)
                and (p1[0].stream.arrival_s == p2[0].stream.arrival_s).all())  # a new seed per pass

    stats, stop_event = ReplayStats(cfg.slo_ms), threading.Event()
    t = threading.Thread(target=lambda: asyncio.run(run_replay([agent], trace, cfg, stats, loop_forever=True,
                                                               stop=stop_event)))
    t.start()
    deadline = time.monotonic() + 30
    while stats.cycle < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop_event.set()
    t.join(20)
    assert not t.is_alive() and stats.cycle >= 2
    rep = stats.report()
    assert rep["requests_lost"] == 0 and rep["requests_served"] == rep["requests_sent"] > 0
    assert {"steady[0-0.4s]", "burst[0.4-0.6s]", "steady[0-0.8s]"} <= set(rep["phases"])
    assert rep["phases"]["steady[0-0.4s]"]["requests_sent"] == p0[0].num_requests
    assert rep["phases"]["burst[0.4-0.6s]"]["requests_sent"] == p0[1].num_requests
    assert rep["phases"]["steady[0-0.8s]"]["requests_sent"] >= p1[0].num_requests
    assert sum(r["requests_sent"] for r in rep["phases"].values()) == rep["requests_sent"]


def test_a_users_last_request_of_a_pass_carries_its_first_new_item_of_the_next_pass():
    """A looping replay plants each user's next item among the candidates across passes too: a
    user's last request of one pass gets the first new item of that user's first request (with
    new items) of the next pass, so a returning user scores the node's quality signal whichever
    pass it returns in; without the next pass, that request gets none."""
    from workloads import synthetic_trace
    from workloads.candidates import StreamCandidates, first_request_by_user, next_request_of_user
    from workloads.replay import _following_streams

    trace = synthetic_trace(num_users=60, num_items=5000, seed=2)
    cfg = ReplayConfig(schedule=("steady", "burst"), phase_s=(3.0, 3.0), duration_s=6.0, rate_rps=20,
                       explicit_candidates=True, plant_next_item=True)
    plan, ahead = build_plan(trace, cfg, 0), build_plan(trace, cfg, 1)
    s, then = plan[0].stream, ahead[0].stream
    assert _following_streams(plan, ahead) == {id(s): then} and _following_streams(plan, None) == {}
    nxt, first = next_request_of_user(s), first_request_by_user(then)
    lasts = [i for i in range(len(s)) if nxt[i] < 0 and int(s.user[i]) in first
             and len(then.new_items(first[int(s.user[i])]))]
    assert len(lasts) >= 10
    planted = StreamCandidates(s, trace, seed=0, plant_next=True, then=then)
    alone = StreamCandidates(s, trace, seed=0, plant_next=True)
    got = [int(then.new_items(first[int(s.user[i])])[0]) in planted(i) for i in lasts]
    assert all(got)
    assert sum(int(then.new_items(first[int(s.user[i])])[0]) in alone(i) for i in lasts) < len(lasts) / 2
    # regime names: a stream per phase, each followed by the next phase's, the last by the next pass's
    named = ReplayConfig(schedule=("steady", "burst"), duration_s=4.0, rate_rps=20)
    p0, p1 = build_plan(trace, named, 0), build_plan(trace, named, 1)
    assert _following_streams(p0, p1) == {id(p0[0].stream): p0[1].stream, id(p0[1].stream): p1[0].stream}
