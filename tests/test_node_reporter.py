"""The node agent's control-plane side over real processes and real HTTP.

A real control plane (``python -m control_plane.main``, SQLite) and a real node agent
(``racer node-agent --control-plane URL --token T``) with a freshly exported policy (always emb_share 0.5):

- the agent registers and reports every control interval; stopping the control plane for 10 s
  while requests keep arriving loses no report and stores none twice (the stored sequence
  numbers are exactly 0..last, each once);
- an operator override reaches the agent, its decisions show source ``override`` (on the agent
  and in the control plane's history), it expires on time, and its creation and expiry are in
  the audit log;
- the agent's Prometheus ``/metrics`` shows the figures.

``RACER_TEST_CP_PATH`` (optional) puts another checkout first on the control plane's PYTHONPATH.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.test_node_agent import free_port, wait_healthy, write_taobao_csv
from tests.test_reporter_parts import export_constant_policy

pytest.importorskip("prometheus_client")
REPO = Path(__file__).resolve().parents[1]
CP_PATH = os.environ.get("RACER_TEST_CP_PATH") or str(REPO)
if not (Path(CP_PATH) / "control_plane" / "main.py").exists():
    pytest.skip("the control plane (control_plane/main.py) is not in this checkout", allow_module_level=True)

pytestmark = pytest.mark.slow
ADMIN = "racer_test_admin_token_0123456789"
INTERVAL_S = 0.5


class ControlPlane:
    """A control-plane process on a fixed port and SQLite file; can be stopped and started again."""

    def __init__(self, tmp: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db = f"sqlite:///{tmp / 'cp.db'}"
        self.tmp = tmp
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, **env_extra: str) -> None:
        self.starts += 1
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RACER_ADMIN_TOKEN": ADMIN, "PYTHONPATH": CP_PATH,
               "RACER_REPORT_INTERVAL_S": str(INTERVAL_S), "RACER_OVERRIDE_PERIOD_S": "0.5", **env_extra}
        out = open(self.tmp / f"cp{self.starts}.out", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "control_plane.main", "--db", self.db, "--port",
                                      str(self.port)], cwd=CP_PATH, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.tmp / f"cp{self.starts}.out").read_text()
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError("control plane did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=f"{self.url}/api/v1", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)

    def node_token(self, node_id: str) -> str:
        """A new node token bound to ``node_id`` (named ``node-NODE_ID``)."""
        with self.api() as api:
            r = api.post("/tokens", json={"role": "node", "name": f"node-{node_id}", "node_id": node_id})
            assert r.status_code == 201, r.text
            return r.json()["token"]


class Traffic:
    """Requests to the agent from a thread, a few per control interval, until stopped."""

    def __init__(self, base: str, rate_rps: float = 20.0):
        self.base = base
        self.rate = rate_rps
        self.stop_ = threading.Event()
        self.num_ok = 0
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        with httpx.Client(base_url=self.base, timeout=30) as c:
            while not self.stop_.is_set():
                i += 1
                body = {"user_id": i % 17, "history": [(i * 7 + k) % 50 for k in range(20 + i % 40)],
                        "new_items": [i % 50], "num_candidates": 16, "top_k": 3}
                try:
                    r = c.post("/v1/recommend", json=body)
                    if r.status_code == 200:
                        self.num_ok += 1
                    else:
                        self.errors.append(r.text)
                except httpx.HTTPError as e:
                    self.errors.append(str(e))
                self.stop_.wait(1.0 / self.rate)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_.set()
        self.thread.join(30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reporter")
    cp = ControlPlane(tmp)
    cp.start()
    agent_proc = None
    try:
        node_token = cp.node_token("n0")
        csv = write_taobao_csv(tmp / "UserBehavior_small.csv")
        profile = tmp / "node_profile.json"
        profile.write_text('{"device": "cpu", "kv_recompute_us_per_token": {"128": 2.0, "512": 2.5}, '
                           '"emb_transfer_us_per_row": 4.0, "emb_hit_us_per_row": 0.2}')
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "racer", "node-agent", "--port", str(port), "--trace", "taobao", "--path",
               str(csv), "--emb-share", "0.5", "--seed", "1", "--num-pages", "256", "--max-history-len", "256",
               "--control-interval-s", str(INTERVAL_S), "--policy", str(export_constant_policy(tmp / "p05", 0.5)),
               "--profile", str(profile), "--control-plane", cp.url, "--node-id", "n0",
               "--state-dir", str(tmp / "state")]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RACER_NODE_TOKEN": node_token}
        agent_proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(tmp / "agent.out", "w"),
                                      stderr=open(tmp / "agent.err", "w"), env=env)
        wait_healthy(base, agent_proc, timeout_s=120)
        yield {"cp": cp, "agent": base, "proc": agent_proc, "tmp": tmp}
    finally:
        if agent_proc is not None and agent_proc.poll() is None:
            agent_proc.send_signal(signal.SIGTERM)
            try:
                agent_proc.wait(20)
            except subprocess.TimeoutExpired:
                agent_proc.kill()
        cp.stop()


def agent_status(base: str) -> dict:
    return httpx.get(f"{base}/v1/metrics", timeout=10).json()


def wait_for(pred, timeout_s: float, what: str, step_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step_s)
    raise AssertionError(f"timed out waiting for {what}")


def stored_seqs(api: httpx.Client) -> list[int]:
    r = api.get("/reports", params={"node_id": "n0", "limit": 10000})
    assert r.status_code == 200, r.text
    return [row["seq"] for row in r.json()]


def test_registers_and_reports_every_interval(cluster):
    cp, base = cluster["cp"], cluster["agent"]
    with Traffic(base), cp.api() as api:
        wait_for(lambda: len(stored_seqs(api)) >= 6, 30, "six stored reports")
        node = api.get("/nodes/n0").json()
        assert node["status"] == "up" and node["address"] == base
        # a CPU agent emulates the EMB link (auto): its figures are measured, its misses' link modelled
        assert node["device"] == "cpu (EMB link emulated)" and node["device_mode"] == "link-emulated"
        assert node["cost_profile"]["device"] == {"mode": "link-emulated", "time": "measured",
                                                  "label": "cpu (EMB link emulated)"}
        assert node["cost_profile"]["kv_recompute_us_per_token"] == 2.5  # profiled value nearest 512 tokens
        assert node["cost_profile"]["emb_transfer_us_per_row"] == 4.0
        rows = api.get("/reports", params={"node_id": "n0", "limit": 1000}).json()
        served = [r for r in rows if r["num_requests"]]
        assert served, rows[-3:]
        r = served[-1]
        assert 0 < r["p50_ms"] <= r["p99_ms"] and 0 <= r["slo_attainment"] <= 1 and r["throughput_rps"] > 0
        assert r["emb_share"] is not None and r["policy_version"]
        assert (r["device_mode"], r["device_profile"]) == ("link-emulated", None)
        assert abs(r["ts_s"] - time.time()) < 30  # wall-clock seconds
        dec = api.get("/decisions", params={"node_id": "n0", "limit": 50}).json()
        assert dec["total"] >= 1 and {d["source"] for d in dec["items"]} <= {"base", "residual", "guard", "recovery"}
        assert all(d["features"] for d in dec["items"])


def test_override_reaches_the_agent_and_expires_on_time(cluster):
    cp, base = cluster["cp"], cluster["agent"]
    ttl = 4.0
    with Traffic(base), cp.api() as api:
        r = api.post("/overrides", json={"node_id": "n0", "emb_share": 0.3, "ttl_s": ttl, "reason": "test: pin KV"})
        assert r.status_code == 201, r.text
        ov = r.json()
        # the agent applies it: its decisions come from the override
        d = wait_for(lambda: (agent_status(base)["allocator"].get("last_decision") or {}).get("source") == "override"
                     and agent_status(base)["allocator"]["last_decision"], 5 * INTERVAL_S + 3, "an override decision")
        assert d["emb_share"] == pytest.approx(0.3) and f"override {ov['id']}" in d["reason"]
        # ... until it expires, then the layers decide again
        wait_for(lambda: time.time() > ov["expires_at_s"] + 3 * INTERVAL_S, ttl + 5, "expiry")
        last = agent_status(base)["allocator"]["last_decision"]
        assert last["source"] != "override", last
        # the control plane's history: override decisions only inside [created, expires] (+ one interval)
        wait_for(lambda: api.get("/overrides", params={"state": "expired"}).json(), 5, "the expiry job")
        items = api.get("/decisions", params={"node_id": "n0", "limit": 1000}).json()["items"]
        ovd = [x for x in items if x["source"] == "override"]
        assert ovd, "no override decision stored"
        assert all(abs(x["emb_share"] - 0.3) < 1e-9 for x in ovd)
        assert min(x["ts_s"] for x in ovd) >= ov["created_at_s"]
        assert max(x["ts_s"] for x in ovd) <= ov["expires_at_s"] + 0.01  # never past the expiry
        later = [x for x in items if x["ts_s"] > ov["expires_at_s"]]
        assert later and all(x["source"] != "override" for x in later)
        assert min(x["ts_s"] for x in later) <= ov["expires_at_s"] + INTERVAL_S + 0.25  # the next control step
        audit = api.get("/audit", params={"target": f"override:{ov['id']}", "limit": 100}).json()["items"]
        actions = sorted(a["action"] for a in audit)
        assert actions == ["override.create", "override.expire"], audit
        assert all(a["reason"] for a in audit)
        print(f"override: {len(ovd)} override decisions from t={min(x['ts_s'] for x in ovd) - ov['created_at_s']:.2f}"
              f" to t={max(x['ts_s'] for x in ovd) - ov['created_at_s']:.2f} s after creation (ttl {ttl} s); "
              f"first later decision at t={min(x['ts_s'] for x in later) - ov['created_at_s']:.2f} s")


def test_control_plane_down_10s_loses_no_report_and_stores_none_twice(cluster):
    cp, base = cluster["cp"], cluster["agent"]
    with Traffic(base) as traffic, cp.api() as api:
        wait_for(lambda: agent_status(base)["control_plane"]["num_buffered"] == 0, 20, "an empty spool")
        before = stored_seqs(api)
        cp.stop()
        t0 = time.monotonic()
        peak = 0
        while time.monotonic() - t0 < 10.0:
            st = agent_status(base)["control_plane"]
            peak = max(peak, st["num_buffered"])
            time.sleep(0.25)
        assert peak >= int(8.0 / INTERVAL_S), peak  # the reports of the outage waited on disk
        assert st["connected"] is False and st["num_dropped"] == 0
        cp.start()
        wait_for(lambda: agent_status(base)["control_plane"]["num_buffered"] == 0, 30, "the replay")
        st = agent_status(base)["control_plane"]
    with cp.api() as api:
        seqs = stored_seqs(api)
    assert traffic.num_ok > 0 and not traffic.errors[:1]
    assert len(seqs) == len(set(seqs)), "a report stored twice"
    assert sorted(seqs) == list(range(max(seqs) + 1)), "a report lost"  # 0..last, no gap
    assert len(seqs) >= len(before) + peak
    assert st["num_dropped"] == 0 and st["num_rejected"] == 0
    print(f"outage 10 s: peak buffered {peak}, stored before {len(before)}, after {len(seqs)} (seq 0..{max(seqs)}), "
          f"resent duplicates {st['num_duplicates']}, requests served {traffic.num_ok}")


def test_prometheus_metrics_of_the_agent(cluster):
    base = cluster["agent"]
    with Traffic(base):
        wait_for(lambda: agent_status(base)["metrics"]["num_requests"] > 20, 30, "some requests")
    text = httpx.get(f"{base}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, v = line.rpartition(" ")
            values[name] = float(v)
    for name in ("racer_emb_share_ratio", "racer_emb_share_target_ratio", "racer_kv_hit_ratio", "racer_emb_hit_ratio",
                 "racer_slo_attainment_ratio", "racer_queue_depth_requests", "racer_refill_bytes_total",
                 "racer_bursts_total", "racer_reports_buffered", "racer_control_plane_up"):
        assert name in values, name
    count = values["racer_request_latency_seconds_count"]
    assert count == values['racer_request_latency_seconds_bucket{le="+Inf"}'] > 20
    assert values["racer_request_latency_seconds_sum"] > 0
    assert values['racer_decisions_total{source="override"}'] >= 1  # the override test ran before
    assert sum(v for k, v in values.items() if k.startswith("racer_decisions_total")) >= 10
    assert values['racer_node_device_info{mode="link-emulated",profile="",time="measured",time_scale="1"}'] == 1


def artifact_tar(directory: Path) -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name in ("manifest.json", "policy.onnx", "golden.npz"):
            t.add(directory / name, arcname=name)
    return buf.getvalue()


def test_a_new_policy_version_is_downloaded_verified_loaded_and_confirmed(cluster, tmp_path):
    cp, base = cluster["cp"], cluster["agent"]
    export_constant_policy(tmp_path / "p07", 0.7)
    with cp.api() as api:
        r = api.post("/policies", content=artifact_tar(tmp_path / "p07"), headers={"Content-Type": "application/x-tar"})
        assert r.status_code == 201, r.text
        version = r.json()["version"]
        assert version != agent_status(base)["control_plane"]["policy_version"]
        r = api.post(f"/policies/{version}/activate", json={"reason": "test: new version"})
        assert r.status_code == 200, r.text
        try:
            wait_for(lambda: api.get("/nodes/n0").json()["policy_version"] == version, 20, "the node's confirmation")
        except AssertionError:
            raise AssertionError(f"node {api.get('/nodes/n0').json()}; agent {agent_status(base)['control_plane']}")
        node = api.get("/nodes/n0").json()
        assert node["policy_error"] is None
    st = agent_status(base)
    assert st["control_plane"]["policy_version"] == version and st["control_plane"]["policy_error"] is None
    with Traffic(base):
        wait_for(lambda: (agent_status(base)["allocator"].get("last_decision") or {}).get("policy_id") == version,
                 10, "a decision of the new policy")
    with cp.api() as api:  # later reports name the version they ran
        wait_for(lambda: any(r["policy_version"] == version for r in api.get(
            "/reports", params={"node_id": "n0", "limit": 10000}).json()), 10, "a report of the new version")


def test_a_node_that_lost_its_state_continues_numbering_above_the_stored_reports(cluster, tmp_path):
    from node_agent.reporter import Reporter, ReporterConfig
    from tests.test_reporter_parts import _agent_with_policy

    cp = cluster["cp"]
    with cp.api() as api:
        token = api.post("/tokens", json={"role": "node", "name": "node-lost", "node_id": "n-lost"}).json()["token"]

    policy = export_constant_policy(tmp_path / "p06", 0.6)

    def run(state_dir: Path, n: int) -> dict:
        agent = _agent_with_policy(policy)
        rep = Reporter(agent, ReporterConfig(control_plane_url=cp.url, token=token, node_id="n-lost",
                                             advertise_url="http://127.0.0.1:9", state_dir=str(state_dir)))
        try:
            assert rep._cycle()  # registers (and learns the highest stored seq)
            for _ in range(n):
                rep.on_control(agent.control_step(agent.clock()))
            rep._drain_inbox()
            assert rep._cycle()
            return rep.status()
        finally:
            rep.stop()

    first = run(tmp_path / "a", 3)
    second = run(tmp_path / "b", 2)  # a fresh state directory: numbering would restart at 0
    assert first["num_sent"] == 3 and second["num_sent"] == 2 and second["num_duplicates"] == 0
    with cp.api() as api:
        rows = api.get("/reports", params={"node_id": "n-lost", "limit": 100}).json()
    assert sorted(r["seq"] for r in rows) == [0, 1, 2, 3, 4]


def test_a_node_over_its_ingestion_quota_waits_as_told_and_loses_nothing(cluster):
    """A control plane whose quota is half what the node sends (1 report/s against 2, a burst of
    3: the spool is sent one report at a time) answers 429 with Retry-After: the agent keeps the
    reports, waits as told, drops none; back on the default quota, every report arrives once."""
    cp, base = cluster["cp"], cluster["agent"]
    with Traffic(base):
        wait_for(lambda: agent_status(base)["control_plane"]["num_buffered"] == 0, 20, "an empty spool")
        cp.stop()
        cp.start(RACER_NODE_REPORTS_PER_S="1", RACER_NODE_BURST_REPORTS="3")
        try:
            with cp.api() as api:
                t0, n0 = time.monotonic(), len(stored_seqs(api))
                time.sleep(8.0)
                stored = len(stored_seqs(api)) - n0
                elapsed = time.monotonic() - t0
            st = agent_status(base)["control_plane"]
            assert stored <= 3 + 1.0 * elapsed + 2, (stored, elapsed)  # the quota held
            assert stored >= 0.5 * elapsed, (stored, elapsed)  # and the node kept sending within it
            assert "429" in (st["last_error"] or "") and st["num_buffered"] > 0 and st["num_dropped"] == 0, st
        finally:
            cp.stop()
            cp.start()
        wait_for(lambda: agent_status(base)["control_plane"]["num_buffered"] == 0, 40, "the backlog sent")
    with cp.api() as api:
        seqs = stored_seqs(api)
    st = agent_status(base)["control_plane"]
    assert len(seqs) == len(set(seqs)) and sorted(seqs) == list(range(max(seqs) + 1)), "a report lost or twice"
    assert st["num_dropped"] == 0 and st["num_rejected"] == 0


def _full_tmpfs(path: Path) -> bool:
    """A 256 KiB tmpfs at ``path``, filled up (False: cannot mount here, needs root/CAP_SYS_ADMIN)."""
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        return False
    fd = os.open(path / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return True


def test_a_full_disk_loses_no_report_and_what_is_dropped_is_counted_and_shown(cluster, tmp_path):
    """The agent's state folder on a full file system: with the control plane up every report
    arrives (kept in memory, sent from there); during an outage the in-memory bound (4) drops the
    oldest, and the count reaches the agent's /metrics, /v1/metrics and the control plane's node."""
    from tests.procs import skip_or_fail

    cp = cluster["cp"]
    full = tmp_path / "full"
    if not _full_tmpfs(full):
        skip_or_fail("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    proc = None
    try:
        with cp.api() as api:
            token = api.post("/tokens", json={"role": "node", "name": "node-full", "node_id": "n-full"}).json()["token"]
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "racer", "node-agent", "--port", str(port), "--trace", "taobao", "--path",
               str(cluster["tmp"] / "UserBehavior_small.csv"), "--seed", "1", "--num-pages", "256",
               "--max-history-len", "256", "--control-interval-s", str(INTERVAL_S), "--control-plane", cp.url,
               "--node-id", "n-full", "--state-dir", str(full / "state"), "--max-memory-reports", "4",
               "--policy", str(export_constant_policy(tmp_path / "p05", 0.5))]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(tmp_path / "agent.out", "w"),
                                stderr=open(tmp_path / "agent.err", "w"),
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "RACER_NODE_TOKEN": token})
        wait_healthy(base, proc, timeout_s=120)

        def seqs() -> list[int]:
            with cp.api() as api:
                return [r["seq"] for r in api.get("/reports", params={"node_id": "n-full", "limit": 10000}).json()]

        with Traffic(base):
            wait_for(lambda: len(seqs()) >= 6, 30, "six stored reports")
            st = agent_status(base)["control_plane"]
            assert st["num_unspooled"] >= 6 and st["num_dropped"] == 0, st
            assert "No space left" in (st["spool_error"] or ""), st
            got = seqs()
            assert sorted(got) == list(range(max(got) + 1)), "a report lost on a full disk"
            cp.stop()
            time.sleep(8 * INTERVAL_S)
            st = agent_status(base)["control_plane"]
            assert st["num_in_memory"] == 4 and st["num_dropped"] >= 3, st
            cp.start()
            wait_for(lambda: agent_status(base)["control_plane"]["num_buffered"] == 0, 30, "the replay")
            dropped = agent_status(base)["control_plane"]["num_dropped"]
            with cp.api() as api:
                node = wait_for(lambda: (lambda n: n if n.get("num_reports_dropped") == dropped else None)(
                    api.get("/nodes/n-full").json()), 10, "the node's drop count at the control plane")
                listed = {n["node_id"]: n for n in api.get("/nodes").json()}
        assert node["num_reports_dropped"] == listed["n-full"]["num_reports_dropped"] == dropped >= 3
        text = httpx.get(f"{base}/metrics", timeout=10).text
        assert f"racer_reports_dropped_total {float(dropped)}" in text, text[-2000:]
        got = seqs()
        assert len(got) == len(set(got)) and max(got) + 1 - len(got) == dropped  # the gap is what was counted
        print(f"full disk: {len(got)} reports stored (seq 0..{max(got)}), {dropped} dropped by the in-memory "
              f"bound during the outage, all counted")
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        subprocess.run(["umount", "-l", str(full)], capture_output=True)


def test_a_send_period_batches_the_reports_and_loses_none(cluster):
    """The control plane's ``send_period_s`` reaches a running node through its directives: the
    node then sends several control steps' reports per request (and pulls its directives as
    often), stays up, and every report is stored once; without it, one request a step again."""
    cp, base = cluster["cp"], cluster["agent"]
    period = 3 * INTERVAL_S

    def counts() -> tuple[int, int, int]:
        st = agent_status(base)["control_plane"]
        return st["num_sent"], st["num_report_posts"], st["num_directive_pulls"]

    try:
        with Traffic(base):
            cp.stop()
            cp.start(RACER_SEND_PERIOD_S=str(period))
            wait_for(lambda: agent_status(base)["control_plane"]["send_period_s"] == period, 30, "the send period")
            wait_for(lambda: agent_status(base)["control_plane"]["num_buffered"] == 0, 30, "an empty spool")
            sent0, posts0, pulls0 = counts()
            time.sleep(12 * period)
            sent1, posts1, pulls1 = counts()
            with cp.api() as api:
                assert api.get("/nodes/n0").json()["status"] == "up"
        per_post = (sent1 - sent0) / max(posts1 - posts0, 1)
        assert 2.0 <= per_post <= 4.0, (sent1 - sent0, posts1 - posts0)
        assert posts1 - posts0 <= 14 and pulls1 - pulls0 <= 14, (posts1 - posts0, pulls1 - pulls0)
        with cp.api() as api:
            wait_for(lambda: agent_status(base)["control_plane"]["num_buffered"] == 0, 30, "the last batch")
            seqs = stored_seqs(api)
        assert len(seqs) == len(set(seqs)) and sorted(seqs) == list(range(max(seqs) + 1))
        print(f"send period {period} s: {sent1 - sent0} reports in {posts1 - posts0} requests "
              f"({per_post:.2f} a request), {pulls1 - pulls0} directive pulls in {12 * period:g} s")
    finally:
        cp.stop()
        cp.start()
    wait_for(lambda: agent_status(base)["control_plane"]["send_period_s"] is None, 30, "every step again")
    sent0, posts0, _ = counts()
    time.sleep(8 * INTERVAL_S)
    sent1, posts1, _ = counts()
    assert (sent1 - sent0) / max(posts1 - posts0, 1) < 1.6, (sent1 - sent0, posts1 - posts0)
