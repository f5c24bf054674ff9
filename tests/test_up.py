"""`racer up`: the supervisor over real processes, the whole system under replay with a node agent
killed (-9) and restarted, a second run on the same data, and data folders that refuse writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from racer.cli import main as racer_main
from racer.data_folder import check_data_dir, write_atomic
from racer.errors import UpError
from racer.supervisor import ProcessSpec, Supervisor

from .conftest import REPO
from .procs import skip_or_fail


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie not yet reaped by its parent counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _group_gone(pgid: int) -> bool:
    """No live (non-zombie) process is left in process group ``pgid``."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return False
    return True


def test_supervisor_restarts_what_exits_and_stops_whole_process_groups(tmp_path):
    parent_with_child = ("import subprocess, sys, time; c = subprocess.Popen(['sleep', '300']); "
                         "print('CHILD' + 'PID', c.pid, flush=True); time.sleep(300)")
    events = []
    sup = Supervisor([ProcessSpec("steady", [sys.executable, "-c", parent_with_child]),
                      ProcessSpec("crashy", [sys.executable, "-c", "import time, sys; time.sleep(0.3); sys.exit(3)"])],
                     tmp_path, report=events.append, max_backoff_s=0.5, state_file=tmp_path / "processes.json")
    sup.start()
    first_crashy = sup["crashy"].popen.pid
    deadline = time.monotonic() + 20
    while sup["crashy"].restarts < 2 and time.monotonic() < deadline:
        sup.poll()
        time.sleep(0.05)
    assert sup["crashy"].restarts >= 2 and sup["steady"].restarts == 0
    assert sup["crashy"].exits[0]["code"] == 3
    assert any("crashy" in e and "exited with status 3" in e and "restarting" in e for e in events)
    assert any(e.startswith("crashy restarted") for e in events)
    state = json.loads((tmp_path / "processes.json").read_text())
    assert state["processes"]["crashy"]["pid"] != first_crashy and state["processes"]["crashy"]["restarts"] >= 2
    # the grandchild (sleep) lives in the steady process's group
    for _ in range(100):
        log = (tmp_path / "steady.log").read_text()
        if "child" in log:
            break
        time.sleep(0.05)
    child = int(log.split("CHILDPID", 1)[1].split()[0])
    steady_pid = sup["steady"].popen.pid
    assert os.getpgid(child) == steady_pid
    codes = sup.stop(timeout_s=5)
    assert codes["steady"] == -signal.SIGTERM
    assert _gone(child) and _gone(steady_pid) and _group_gone(steady_pid)
    sup.poll()  # stopping: nothing is restarted
    assert all(not v for v in sup.alive().values())


def test_write_atomic_leaves_nothing_behind_on_failure(tmp_path):
    write_atomic(tmp_path / "a.json", "{}\n")
    assert (tmp_path / "a.json").read_text() == "{}\n"

    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "b.json", None)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _mount_tmpfs(path: Path, opts: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
    return p.returncode == 0


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def make(name: str, opts: str) -> Path:
        path = tmp_path / name
        if not _mount_tmpfs(path, opts):
            skip_or_fail("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_read_only_data_folder_is_a_clear_error_before_anything_starts(tmpfs, capsys):
    ro = tmpfs("ro", "ro,size=1m")
    rc = racer_main(["up", "--data-dir", str(ro / "racer-data"), "--duration", "1", "--dashboard-port", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "is not writable: the file system is read-only" in err and "Traceback" not in err
    assert list(ro.iterdir()) == []


def test_full_data_folder_is_a_clear_error_and_nothing_is_half_written(tmpfs, capsys):
    full = tmpfs("full", "size=256k")
    data = full / "racer-data"
    (data / "logs").mkdir(parents=True)
    write_atomic(data / "operator_token", "racer_existing\n", mode=0o600)
    fd = os.open(full / "filler", os.O_WRONLY | os.O_CREAT)  # fill the file system
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    before = {p.name: p.read_bytes() for p in data.iterdir() if p.is_file()}
    rc = racer_main(["up", "--data-dir", str(data), "--duration", "1", "--dashboard-port", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "is not writable: no space left on the device" in err and "Traceback" not in err
    after = {p.name: p.read_bytes() for p in data.iterdir() if p.is_file()}
    assert after == before  # the token file intact, no temp or probe files left
    with pytest.raises(UpError, match="no space left"):
        check_data_dir(data)


def test_second_racer_up_on_the_same_folder_is_refused(tmp_path):
    from racer.data_folder import DataLock

    lock = DataLock(tmp_path)
    try:
        with pytest.raises(UpError, match=f"another racer up \\(pid {os.getpid()}\\) is using"):
            DataLock(tmp_path)
    finally:
        lock.release()
    DataLock(tmp_path).release()  # free again once released


def _wait(pred, timeout_s: float, what: str, every_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _state(data: Path) -> dict | None:
    try:
        return json.loads((data / "processes.json").read_text())["processes"]
    except (OSError, ValueError, KeyError):
        return None


def _healthy(url: str) -> dict | None:
    try:
        r = httpx.get(f"{url}/healthz", timeout=1.0)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _gateway_live(gw_url: str, node_url: str, fleet_token: str) -> bool | None:
    try:
        nodes = httpx.get(f"{gw_url}/v1/router", headers={"Authorization": f"Bearer {fleet_token}"},
                          timeout=2.0).json().get("nodes", [])
    except (httpx.HTTPError, ValueError):
        return None
    for n in nodes if isinstance(nodes, list) else []:
        if str(n.get("address", "")).rstrip("/") == node_url:
            return bool(n.get("live"))
    return None


def _node_out_events(gateway_log: Path, node_id: str) -> int:
    """How many times the gateway's log says it took ``node_id`` out of rotation."""
    try:
        lines = gateway_log.read_text().splitlines()
    except OSError:
        return 0
    return sum('"event": "node_out"' in ln and f'"node": "{node_id}"' in ln for ln in lines)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_racer_up_survives_kill_9_of_a_node_agent_and_a_second_run_reuses_the_data(tmp_path):
    """4 node agents under replay; node-1 is killed with SIGKILL: every request is served (after a
    retry) or failed with a counted reason, none lost; the gateway (when this build has one) takes
    node-1 out of rotation; racer up restarts it and it serves again. All processes stop cleanly
    at --duration and a second run reuses the tokens and the cost profile."""
    data = tmp_path / "racer-data"
    cmd = [sys.executable, "-m", "racer", "up", "--nodes", "4", "--data-dir", str(data), "--duration", "600",
           "--rate", "8", "--phase-s", "5", "--dashboard-port", "0", "--json", "--status-every-s", "5"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    err = open(tmp_path / "up.err", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        up_log = data / "logs" / "up.log"

        def tails(*files: Path) -> str:
            return "".join(f"\n--- end of {f}:\n" + (f.read_text()[-3000:] if f.exists() else "(none)")
                           for f in files or (up_log, tmp_path / "up.err"))

        def load_running():
            assert proc.poll() is None, f"racer up exited ({proc.returncode}) while starting" + tails()
            s = _state(data)
            return s if s is not None and up_log.exists() and "replaying" in up_log.read_text() else None

        try:  # a shared CI box can be slow: a generous bound, and what racer up said if it is passed
            state = _wait(load_running, 420, "racer up to start its processes and the load")
        except AssertionError as e:
            raise AssertionError(str(e) + tails()) from None
        # no token in any process's arguments (what `ps` shows): they go in the environment
        secrets_ = [(data / "operator_token").read_text().strip()]
        secrets_ += [p.read_text().strip() for p in data.glob("node_token.*")]
        secrets_ += [p.read_text().strip() for p in data.glob("router_token.*")]  # the gateway's own
        fleet = (data / "fleet_token").read_text().strip()  # the gateway's and the agents'
        secrets_ += [fleet, (data / "secret_key").read_text().strip()]
        assert len(secrets_) == 8
        for name, entry in state.items():
            try:
                argv = Path(f"/proc/{entry['pid']}/cmdline").read_bytes().decode(errors="replace")
            except OSError:  # gone (restarting): nothing to read
                continue
            assert argv and not any(t in argv for t in secrets_), f"{name} has a token in its arguments"
        # each agent its own token, bound to its node id, in its own environment
        node_tokens = {f.name.rsplit(".", 1)[1]: f.read_text().strip() for f in data.glob("node_token.*")}
        assert sorted(node_tokens) == [f"node-{k}" for k in range(4)] and len(set(node_tokens.values())) == 4
        for name, token in node_tokens.items():
            try:
                environ = Path(f"/proc/{state[name]['pid']}/environ").read_bytes().split(b"\0")
            except OSError:  # gone (restarting): nothing to read
                continue
            assert f"RACER_NODE_TOKEN={token}".encode() in environ, f"{name} does not run with its own token"
        victim = state["node-1"]
        node_url, old_pid = victim["url"], victim["pid"]
        gw_url = state.get("gateway", {}).get("url")
        assert _healthy(node_url)["status"] == "ok"
        # who holds which user's cache, and the agents' addresses: the fleet token's views only
        assert httpx.get(f"{node_url}/v1/residency", timeout=5).status_code == 401
        if gw_url:
            assert httpx.get(f"{gw_url}/v1/router", params={"user": 1}, timeout=5).status_code == 401
            assert _gateway_live(gw_url, node_url, fleet) is True
        time.sleep(3)  # under load
        gw_log = data / "logs" / "gateway.log"
        outs_before = _node_out_events(gw_log, "node-1")
        # racer up restarts node-1 at once, and a new agent can answer /healthz before the gateway's
        # third failed check (one a second): whether the gateway takes it out would then be a race.
        # racer up is held (SIGSTOP) while node-1 is dead, so the gateway sees a dead node for as
        # long as it needs; the restart follows once it goes on (SIGCONT)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            os.kill(old_pid, signal.SIGKILL)
            if gw_url:
                try:
                    _wait(lambda: _gateway_live(gw_url, node_url, fleet) is False
                          or _node_out_events(gw_log, "node-1") > outs_before, 30,
                          "the gateway to take node-1 out of rotation")
                except AssertionError as e:
                    raise AssertionError(str(e) + tails(gw_log, data / "logs" / "node-1.log")) from None
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        new = _wait(lambda: (s := _state(data)) and s["node-1"]["pid"] != old_pid and s["node-1"], 30,
                    "racer up to restart node-1")
        assert new["restarts"] == 1
        # the new node-1 process serves requests again
        # the load goes on after the restart: the new node-1 process serves several requests
        _wait(lambda: (h := _healthy(node_url)) and h["num_served"] >= 5, 90, "the restarted node-1 to serve")
        if gw_url:
            _wait(lambda: _gateway_live(gw_url, node_url, fleet) is True, 30, "the gateway to put node-1 back")
        time.sleep(3)
        proc.send_signal(signal.SIGTERM)  # as Ctrl-C would
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        err.close()
    assert proc.returncode == 0, (tmp_path / "up.err").read_text()[-3000:]
    rep = json.loads(out)
    assert rep["stopped_by"] == "signal SIGTERM"
    # how many were sent depends on how fast this machine got through the steps above (a
    # condition, not a clock, ends each wait): the load spanned the kill and the restart
    assert rep["requests_sent"] > 20 and rep["requests_lost"] == 0
    assert rep["requests_served"] + rep["requests_failed"] == rep["requests_sent"]
    assert set(rep["failures"]) <= {"connect", "timeout", "http_502", "http_503", "http_504"} or not rep["failures"]
    assert rep["requests_served"] >= 0.9 * rep["requests_sent"]
    # the gateways' own SLO attainment over the load, printed beside the load generator's
    gw = rep["gateways"]
    assert gw is not None and 0 < gw["num_requests"] <= rep["requests_sent"] and 0 <= gw["slo_attainment"] <= 1, gw
    assert "as the gateways reported it" in (tmp_path / "up.err").read_text()
    p1 = rep["processes"]["node-1"]
    assert p1["restarts"] == 1 and p1["exits"][0]["code"] == -signal.SIGKILL
    # every process stopped on SIGTERM (status 0 from its handler, or the signal's default action;
    # never SIGKILL after the stop timeout) and nothing is left running
    assert all(p["exit_code"] in (0, -signal.SIGTERM) for p in rep["processes"].values()), rep["processes"]
    assert "did not stop within" not in (tmp_path / "up.err").read_text()
    final = _state(data)
    assert all(_gone(p["pid"]) for p in final.values())
    text = (tmp_path / "up.err").read_text()
    assert "node-1 (pid" in text and "killed by SIGKILL" in text and "node-1 restarted" in text
    token = (data / "operator_token").read_text()
    # where the token is, never the token itself: not on a captured stream, not in the log
    assert f"operator token in {data / 'operator_token'}" in text and token.strip() not in text
    assert token.strip() not in (data / "logs" / "up.log").read_text()
    for name in rep["processes"]:
        assert (data / "logs" / f"{name}.log").stat().st_size > 0
    profile_mtime = (data / "node_profile.json").stat().st_mtime

    # a second racer up on the same folder: same tokens, the profile is not measured again
    p = subprocess.run([sys.executable, "-m", "racer", "up", "--nodes", "2", "--data-dir", str(data), "--duration",
                        "4", "--rate", "5", "--dashboard-port", "0", "--json"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rep2 = json.loads(p.stdout)
    assert rep2["requests_lost"] == 0 and rep2["requests_served"] > 0
    assert (data / "operator_token").read_text() == token and token.strip() not in p.stderr + p.stdout
    # and the agents' tokens: the same ones
    assert {f.name.rsplit(".", 1)[1]: f.read_text().strip() for f in data.glob("node_token.*")} == node_tokens
    assert (data / "node_profile.json").stat().st_mtime == profile_mtime
    assert "measuring this machine's miss costs" not in p.stderr
    # the shipped policy active and the derived candidate registered, the same ones on the second run
    shipped = json.loads((REPO / "policies" / "default" / "manifest.json").read_text())["policy_id"]
    assert rep["policies"]["active"] == shipped and rep["policies"]["candidate"] != shipped
    assert rep2["policies"]["active"] == shipped and rep2["policies"]["candidate"] == rep["policies"]["candidate"]
    assert "activated" not in rep2["policies"]  # already active: not activated again
    # the checkpoint the nodes serve is the registry's active model (a model rollout's baseline)
    model = rep["policies"]["model"]
    assert model["active"] == model["model"] and len(model["model"]) == 64, model
    assert rep2["policies"]["model"]["active"] == model["model"] and "activated" not in rep2["policies"]["model"]


def test_soak_rss_growth_is_measured_after_warm_up():
    from bench.soak import rss_growth

    samples = [(0.0, 100), (10.0, 500), (20.0, 1000), (30.0, 1000), (40.0, 1010), (50.0, 1020), (60.0, 1050),
               (70.0, 1040), (80.0, 1060)]
    g = rss_growth(samples, warmup_s=20.0)
    # after warm-up: median(1000, 1000, 1010) = 1000; end: median(1050, 1040, 1060) = 1050
    assert g == {"rss_after_warmup_bytes": 1000, "rss_end_bytes": 1050, "rss_growth_pct": 5.0}
    assert rss_growth(samples[:5], warmup_s=20.0) is None  # too few samples after warm-up


def test_a_taken_dashboard_port_is_refused_before_anything_is_made(tmp_path, capsys):
    """A second racer up with another data folder while the first holds the dashboard's port:
    one clear line, exit 2, and no data folder left behind."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        data = tmp_path / "second"
        t0 = time.monotonic()
        rc = racer_main(["up", "--data-dir", str(data), "--duration", "1", "--dashboard-port", str(port)])
        took_s = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2 and f"--dashboard-port {port} is taken" in err and "Nothing was started or written" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not data.exists()
    assert took_s < 10  # refused before any work (no profile, no processes)


def test_ports_are_chosen_first_and_distinct():
    import argparse
    import socket

    from racer.up import claim_ports

    args = argparse.Namespace(dashboard_port=0, control_plane_port=0, gateway_port=0)
    ports = claim_ports(args)
    assert sorted(ports) == ["control-plane", "dashboard", "gateway"] and len(set(ports.values())) == 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    s.close()
    args.control_plane_port = args.gateway_port = free
    with pytest.raises(UpError, match="another of racer up's processes has that port"):
        claim_ports(args)


def test_the_derived_candidate_passes_the_agents_loader_and_differs(tmp_path):
    """racer up's second policy: built from the shipped one without torch in about a second,
    accepted by the agent's own loader, a different policy_id and different outputs; derived again
    it is the same artifact (the registry sees the same digest)."""
    import numpy as np

    from node_agent.allocator.base import OnnxPolicy
    from racer.policy_seed import artifact_tar, derive_candidate

    shipped = REPO / "policies" / "default"
    out = tmp_path / "candidate"
    m = derive_candidate(shipped, out)
    src = json.loads((shipped / "manifest.json").read_text())
    assert m["policy_id"] != src["policy_id"] and m["derived_from"]["policy_id"] == src["policy_id"]
    pol = OnnxPolicy(out, device="cpu")
    assert pol.policy_id == m["policy_id"]
    base = np.load(shipped / "golden.npz")["outputs"].ravel()
    cand = np.load(out / "golden.npz")["outputs"].ravel()
    assert np.all(cand < base + 1e-7) and np.mean(base - cand) > 0.05  # a smaller emb_share, everywhere
    tar = artifact_tar(out)
    import shutil

    shutil.rmtree(out)
    assert derive_candidate(shipped, out)["policy_id"] == m["policy_id"]
    for f in out.iterdir():  # derived at another time: the tar carries no file times
        os.utime(f, (1e9, 1e9))
    assert artifact_tar(out) == tar
    assert derive_candidate(shipped, out)["policy_id"] == m["policy_id"]  # reused as it is


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_gateway_that_exits_while_starting_is_restarted_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """A dependant's slow or failed start never ends the run: the gateway exits twice before it
    serves (as one that gave up on a slow control plane would); racer up restarts it with a
    back-off, says so, and the load starts once it answers."""
    import racer.up as up_module

    real_plan = up_module.plan_processes
    counter = tmp_path / "gateway-starts"

    def plan_with_a_failing_gateway(*a, **kw):
        plan = real_plan(*a, **kw)
        gw = next(s for s in plan.specs if s.name == "gateway")
        # the first two runs give up 2 s after they start (as a gateway that found no control plane
        # did), the third is the real gateway
        wrapper = ("import os, sys, time; f = sys.argv[1]; n = int(open(f).read()) if os.path.exists(f) else 0; "
                   "open(f, 'w').write(str(n + 1)); "
                   "(time.sleep(2), sys.exit(3)) if n < 2 else os.execv(sys.argv[2], sys.argv[2:])")
        gw.argv = [sys.executable, "-c", wrapper, str(counter), *gw.argv]
        return plan

    monkeypatch.setattr(up_module, "plan_processes", plan_with_a_failing_gateway)
    rc = racer_main(["up", "--nodes", "1", "--data-dir", str(tmp_path / "data"), "--duration", "3", "--rate", "5",
                     "--dashboard-port", "0", "--no-policies", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    rep = json.loads(out.strip().splitlines()[-1])
    assert rep["processes"]["gateway"]["restarts"] == 2 and int(counter.read_text()) == 3
    assert [e["code"] for e in rep["processes"]["gateway"]["exits"]] == [3, 3]
    assert "gateway restarted" in err and rep["requests_served"] > 0 and rep["requests_lost"] == 0
    assert rep["startup"]["url_s"] is not None and rep["startup"]["first_served_s"] is not None


def _up_args(**kw):
    import argparse

    base = dict(nodes=3, trace="taobao", path=None, policy=None, model="none", slo_ms=50.0, duration=None,
                phase_s=15.0, first_phase_s=None, dashboard_port=0, control_plane_port=0, gateway_port=0)
    return argparse.Namespace(**{**base, **kw})


def test_agent_ports_are_drawn_apart_from_the_claimed_ones_and_the_gateway_id_is_the_folders(tmp_path, monkeypatch):
    import racer.up as up_module

    claimed = {"control-plane": 41001, "gateway": 41002, "dashboard": 41003}
    draws = iter([41001, 41002, 41003, 42000, 42000, 41002, 42001, 42002])  # free_port may hand any of them out
    monkeypatch.setattr(up_module, "free_port", lambda host="127.0.0.1": next(draws))
    commands = {"control-plane", "node-agent", "gateway", "dashboard", "token"}
    plan = up_module.plan_processes(_up_args(), tmp_path / "a", commands, "op", {}, None, "sqlite:///x.db", claimed)
    node_ports = [int(u.rsplit(":", 1)[1]) for u in plan.node_urls]
    assert node_ports == [42000, 42001, 42002]
    gw = next(s for s in plan.specs if s.name == "gateway")
    gid = gw.argv[gw.argv.index("--gateway-id") + 1]
    assert gid == up_module.gateway_id_for(tmp_path / "a") == up_module.gateway_id_for(tmp_path / "x" / ".." / "a")
    assert gid != up_module.gateway_id_for(tmp_path / "b") and gid.startswith("racer-up-")
    import re

    assert re.fullmatch(r"[A-Za-z0-9_.:\-]{1,128}", gid)  # what the control plane takes as a gateway id


def test_token_create_output_larger_than_a_pipe_does_not_hold_start_up(tmp_path, monkeypatch):
    """Hundreds of agents: `racer token create` prints ~160 bytes each; read only after it exits,
    a pipe would fill (64 KiB) and hold it forever."""
    import racer.up as up_module

    fake = ("import json, sys; a = sys.argv[1:]; ids = [a[i + 1] for i, x in enumerate(a) if x == '--node-id']; "
            "[print(json.dumps({'id': k, 'name': 'node-' + n, 'role': 'node', 'node_id': n, 'token': 'racer_' + 'x' * 80 "
            "+ n})) for k, n in enumerate(ids)]")
    monkeypatch.setattr(up_module, "_racer", lambda *a: [sys.executable, "-c", fake, *a])
    (tmp_path / "logs").mkdir()
    ids = [f"node-{k}" for k in range(600)]
    proc = up_module.start_token_create(tmp_path, "sqlite:///t.db", ids, lambda line: None)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("racer token create was held by its own output")
    tokens = up_module.finish_token_create(tmp_path, "sqlite:///t.db", ids, proc)
    assert sorted(tokens) == sorted(ids) and tokens["node-599"].endswith("node-599")
    kept = up_module._token_path(tmp_path, "sqlite:///t.db", "node-7")
    assert kept.stat().st_mode & 0o777 == 0o600
    assert not up_module._token_out_path(tmp_path).exists()  # the secrets' transit file is gone


def _fake_http(monkeypatch, answers, seen):
    """httpx.get/post answering from ``answers``: (method, path) -> Response (or an exception)."""
    def call(method):
        def f(url, **kw):
            path = httpx.URL(url).path
            seen.append((method, path, kw.get("timeout"), kw.get("json")))
            a = answers[(method, path)]
            if isinstance(a, Exception):
                raise a
            a = a() if callable(a) else a
            a.request = httpx.Request(method, url)
            return a
        return f

    monkeypatch.setattr(httpx, "get", call("GET"))
    monkeypatch.setattr(httpx, "post", call("POST"))


@pytest.mark.parametrize("answer", ["5xx", "not json", "timeout"])
def test_a_control_plane_answering_badly_is_tried_again_on_a_later_tick(tmp_path, monkeypatch, answer):
    """Checking the tokens once the control plane answers: a 5xx, a 200 that is not JSON or a
    timeout is tried again on a later tick (the run goes on), with short timeouts."""
    from types import SimpleNamespace

    import racer.up as up_module

    up_module.write_atomic(up_module._token_path(tmp_path, "sqlite:///t.db", "node-0"), "kept\n", mode=0o600)
    bad = {"5xx": lambda: httpx.Response(503, text="busy"), "not json": lambda: httpx.Response(200, text="<html>"),
           "timeout": httpx.ReadTimeout("slow")}[answer]
    seen: list = []
    _fake_http(monkeypatch, {("GET", "/api/v1/whoami"): bad, ("POST", "/api/v1/tokens"): bad}, seen)
    cp = SimpleNamespace(popen=object(), ready_s=1.0, restarts=0)
    said: list = []
    fake = SimpleNamespace(sup=SimpleNamespace(__getitem__=None), data_dir=tmp_path, db_url="sqlite:///t.db",
                           plan=SimpleNamespace(control_plane_url="http://cp"), operator_token="op",
                           nodes=["node-0"], say=lambda line, **kw: said.append(line), has=lambda n: True,
                           times=up_module.StartTimes())
    fake.sup = type("Sup", (), {"__getitem__": lambda self, n: cp, "check_ready": lambda self, p: True})()
    up_module._Up.step_control_plane(fake)  # no exception: the run goes on
    assert fake.times.control_plane_s is None and cp.ready_s is None and "trying again" in said[-1]
    assert seen and all(t is not None and t <= 2.0 for _, _, t, _ in seen)


def test_the_gateway_gets_its_own_router_token_kept_for_the_next_run(tmp_path, monkeypatch):
    import racer.up as up_module

    made: list = []

    def create():
        made.append(1)
        return httpx.Response(201, json={"id": 9, "token": f"racer_router{len(made)}", "role": "router"})

    known = {"role": "router", "node_id": None}
    seen: list = []
    _fake_http(monkeypatch, {("POST", "/api/v1/tokens"): create,
                             ("GET", "/api/v1/whoami"): lambda: httpx.Response(200, json=known)}, seen)
    t1 = up_module.ensure_router_token(tmp_path, "sqlite:///t.db", "http://cp", "op", lambda line: None)
    assert t1 == "racer_router1" and seen[-1][3] == {"role": "router", "name": up_module.gateway_id_for(tmp_path)}
    kept = next(tmp_path.glob("router_token.*"))
    assert kept.read_text().strip() == t1 and kept.stat().st_mode & 0o777 == 0o600
    assert up_module.ensure_router_token(tmp_path, "sqlite:///t.db", "http://cp", "op", lambda line: None) == t1
    assert len(made) == 1  # the kept one, known to the control plane: reused
    known["role"] = "viewer"  # not a router token there (another database): a new one
    assert up_module.ensure_router_token(tmp_path, "sqlite:///t.db", "http://cp", "op", lambda line: None) == \
        "racer_router2"


def test_a_bad_model_is_refused_before_anything_starts(tmp_path, capsys):
    """--model naming no checkpoint, or a damaged one: one line, exit 2, nothing made (the agents
    would refuse it and be restarted forever)."""
    import shutil

    from node_agent.model.shipped import shipped_checkpoint

    data = tmp_path / "data"
    rc = racer_main(["up", "--data-dir", str(data), "--duration", "1", "--model", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert rc == 2 and "--model" in err and "no such directory" in err and not data.exists()
    broken = tmp_path / "ckpt"
    shutil.copytree(shipped_checkpoint("taobao"), broken)
    with open(broken / "items.json", "a") as f:
        f.write(" ")
    rc = racer_main(["up", "--data-dir", str(data), "--duration", "1", "--model", str(broken)])
    err = capsys.readouterr().err
    assert rc == 2 and "items.json has digest" in err and not data.exists()
    from racer.up import _validate

    _validate(_up_args(model=str(shipped_checkpoint("taobao"))))  # a good one passes


def test_a_start_after_the_candidate_was_rolled_back_says_so(tmp_path):
    """Every start said the candidate was "registered", even after an operator had rolled it
    back; now the start line gives the candidate's status in the registry."""
    import httpx

    from racer.policy_seed import seed_policies

    from .cp_util import ControlPlane

    cp = ControlPlane(f"sqlite:///{tmp_path}/cp.db", tmp_path / "cp.log", scheduler=False)
    try:
        said: list[str] = []
        first = seed_policies(cp.base, cp.ADMIN, REPO / "policies" / "default", tmp_path / "data", said.append)
        assert first["candidate_status"] == "registered" and "ready for a rollout" in said[-1]
        auth = {"Authorization": f"Bearer {cp.ADMIN}"}
        ro = httpx.post(f"{cp.base}/api/v1/rollouts", headers=auth, timeout=30,
                        json={"policy_version": first["candidate"], "reason": "a canary"}).json()
        r = httpx.post(f"{cp.base}/api/v1/rollouts/{ro['id']}/rollback", headers=auth, timeout=30,
                       json={"reason": "worse"})
        assert r.status_code == 200, r.text
        second = seed_policies(cp.base, cp.ADMIN, REPO / "policies" / "default", tmp_path / "data", said.append)
        assert second["candidate"] == first["candidate"] and second["candidate_status"] == "rolled_back"
        assert f"candidate {first['candidate']} rolled_back" in said[-1] and "ready for a rollout" not in said[-1]
    finally:
        cp.stop()
