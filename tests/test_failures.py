"""Failures of the whole system under load (127.0.0.1, bounded in time): the control plane
restarted while `racer up` replays the trace, and PostgreSQL restarted while node agents report.
(kill -9 of a node agent is in test_up.py; a read-only or full data folder too.)

Each checks, in SQL, that no node report was lost or stored twice (`tests/dbcheck.py`) and that
the stored state is still valid."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from racer.up import available_commands

from .conftest import REPO
from .dbcheck import check_database, gaps, report_seqs
from .procs import skip_or_fail

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

_COMMANDS = available_commands()
_SYSTEM = {"control-plane", "node-agent"} <= _COMMANDS


def needs_system(test):
    """The test needs a control plane and node agents that report to it."""
    import functools

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        if not _SYSTEM:
            skip_or_fail("this build has no control plane with reporting node agents")
        return test(*args, **kwargs)

    return wrapper


def _wait(pred, timeout_s: float, what: str, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except (httpx.HTTPError, OSError, ValueError, KeyError, TypeError):
            last = None
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _state(data: Path) -> dict:
    return json.loads((data / "processes.json").read_text())["processes"]


class Api:
    def __init__(self, url: str, token: str):
        self.url, self.h = url.rstrip("/") + "/api/v1", {"Authorization": f"Bearer {token}"}

    def get(self, path: str, **params):
        r = httpx.get(self.url + path, headers=self.h, params=params, timeout=10.0)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: dict):
        r = httpx.post(self.url + path, headers=self.h, json=body, timeout=10.0)
        assert r.status_code < 300, (path, r.status_code, r.text)
        return r.json()


def _start_up(tmp_path: Path, data: Path, duration_s: float, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "racer", "up", "--nodes", "2", "--data-dir", str(data), "--duration",
           str(duration_s), "--rate", "6", "--phase-s", "5", "--dashboard-port", "0", "--json", *extra]
    err = open(tmp_path / "up.err", "w")
    try:
        return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    finally:
        err.close()


def _finish(proc: subprocess.Popen, tmp_path: Path) -> dict:
    """Stop racer up (SIGTERM, as Ctrl-C would) and return its JSON report."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    assert proc.returncode == 0, (tmp_path / "up.err").read_text()[-4000:]
    return json.loads(out)


def _load_running(data: Path) -> bool:
    up = data / "logs" / "up.log"
    return up.exists() and "replaying" in up.read_text()


def _nodes_reporting(api: Api, n: int) -> dict | None:
    nodes = {x["node_id"]: x for x in api.get("/nodes")}
    if len(nodes) >= n and all(x["last_report_seq"] is not None for x in nodes.values()):
        return nodes
    return None


@needs_system
def test_control_plane_restart_under_load_loses_no_report_and_stores_none_twice(tmp_path):
    data = tmp_path / "racer-data"
    proc = _start_up(tmp_path, data, 600)  # stopped by SIGTERM once the checks are done
    try:
        cp = _wait(lambda: _state(data)["control-plane"], 240, "racer up to start")
        token = _wait(lambda: (data / "operator_token").read_text().strip(), 30, "the operator token")
        api = Api(cp["url"], token)
        _wait(lambda: _load_running(data), 300, "racer up to start the load")
        nodes = _wait(lambda: _nodes_reporting(api, 2), 240, "both node agents to register and report")
        time.sleep(3)  # under load
        ov = api.post("/overrides", {"node_id": "node-0", "emb_share": 0.4, "ttl_s": 3600,
                                     "reason": "failure test: must survive a control-plane restart"})
        before = {k: api.get(k) for k in ("/overrides", "/policies", "/rollouts")}
        seq_at_kill = {k: v["last_report_seq"] for k, v in nodes.items()}

        os.killpg(cp["pid"], signal.SIGTERM)  # racer up sees it exit and starts it again
        new = _wait(lambda: (s := _state(data)["control-plane"])["pid"] != cp["pid"] and s, 60,
                    "racer up to restart the control plane")
        assert new["restarts"] == 1
        _wait(lambda: httpx.get(cp["url"] + "/healthz", timeout=2).status_code == 200, 120,
              "the control plane to answer again")
        # the agents replay what they buffered, then keep reporting
        _wait(lambda: all(v["last_report_seq"] >= seq_at_kill[k] + 5 for k, v in
                          {x["node_id"]: x for x in api.get("/nodes")}.items()), 120,
              "reports after the restart")
        after = {k: api.get(k) for k in ("/overrides", "/policies", "/rollouts")}
        assert after == before
        assert [o["id"] for o in after["/overrides"] if o["state"] == "active"] == [ov["id"]]
        # the override still reaches node-0
        node0 = _state(data)["node-0"]["url"]
        _wait(lambda: httpx.get(node0 + "/v1/metrics", timeout=5).json()["allocator"]["last_decision"]["source"]
              == "override", 60, "node-0 to keep applying the override")
    finally:
        rep = _finish(proc, tmp_path)
    assert rep["requests_lost"] == 0 and rep["requests_served"] > 0
    assert rep["processes"]["control-plane"]["restarts"] == 1
    db = f"sqlite:///{data / 'racer.db'}"
    seqs = report_seqs(db)
    assert set(seqs) == {"node-0", "node-1"}
    for node, s in seqs.items():
        assert s[0] == 0 and gaps(s) == [], (node, gaps(s)[:20])
        # reports made after the restart reached the database (what the wait above saw)
        assert len(s) == len(set(s)) and s[-1] >= seq_at_kill[node] + 5
    assert check_database(db) == []


# ------------------------------------------------------------------------------- PostgreSQL ---
def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / name).exists():
            return str(d / name)
    return None


class OwnPostgres:
    """A PostgreSQL server of this test's own (initdb in a temp folder, 127.0.0.1, a free port), so
    restarting it disturbs nobody else's database. As root it runs as the ``postgres`` user."""

    def __init__(self, root: Path, port: int):
        self.initdb, self.ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        self.root, self.port = root, port
        self.data = root / "pgdata"
        self.sock = root / "sock"
        self.run: list[str] = []
        if os.geteuid() == 0:
            self.run = ["runuser", "-u", "postgres", "--"]

    def init(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.sock.mkdir(exist_ok=True)
        if self.run:
            shutil.chown(self.root, "postgres")
            shutil.chown(self.sock, "postgres")
        subprocess.run([*self.run, self.initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                        "--no-sync"], check=True, capture_output=True)

    def start(self) -> None:
        opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.sock} -c fsync=off"
        subprocess.run([*self.run, self.ctl, "-D", str(self.data), "-o", opts, "-l", str(self.root / "pg.log"), "-w",
                        "start"], check=True, capture_output=True)

    def stop(self, mode: str = "fast") -> None:
        subprocess.run([*self.run, self.ctl, "-D", str(self.data), "-m", mode, "-w", "stop"], capture_output=True)

    def sql(self, statement: str, dbname: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname=dbname, autocommit=True) as c:
            c.execute(statement)


@pytest.fixture
def own_postgres(tmp_path):
    from .procs import free_port

    pg = OwnPostgres(Path(f"/tmp/racer-pg-{os.getpid()}-{free_port()}"), free_port())
    if not (pg.initdb and pg.ctl):
        skip_or_fail("PostgreSQL server binaries (initdb, pg_ctl) not installed (.ci/run installs them)")
    try:
        pg.init()
        pg.start()
    except (subprocess.CalledProcessError, OSError, LookupError) as e:
        shutil.rmtree(pg.root, ignore_errors=True)
        skip_or_fail(f"cannot run a PostgreSQL server here: {e}")
    try:
        yield pg
    finally:
        pg.stop("immediate")
        shutil.rmtree(pg.root, ignore_errors=True)


@needs_system
def test_postgresql_restart_during_ingestion_loses_no_report(tmp_path, own_postgres):
    pg = own_postgres
    pg.sql("create database racer")
    url = f"postgresql+psycopg://postgres@127.0.0.1:{pg.port}/racer"
    data = tmp_path / "racer-data"
    proc = _start_up(tmp_path, data, 600, "--db", url)
    try:
        cp = _wait(lambda: _state(data)["control-plane"], 240, "racer up to start")
        token = _wait(lambda: (data / "operator_token").read_text().strip(), 30, "the operator token")
        api = Api(cp["url"], token)
        _wait(lambda: _load_running(data), 300, "racer up to start the load")
        nodes = _wait(lambda: _nodes_reporting(api, 2), 240, "both node agents to register and report")
        seq_at_restart = {k: v["last_report_seq"] for k, v in nodes.items()}
        pg.stop("fast")  # running transactions are cut
        time.sleep(8.0)
        pg.start()
        # once PostgreSQL is back, the control plane (restarted by racer up if it had to exit)
        # stores what the agents kept
        _wait(lambda: all(v["last_report_seq"] >= seq_at_restart[k] + 10 for k, v in
                          {x["node_id"]: x for x in api.get("/nodes")}.items()), 180,
              "reports after PostgreSQL is back")
    finally:
        rep = _finish(proc, tmp_path)
    assert rep["requests_lost"] == 0
    seqs = report_seqs(url)
    assert set(seqs) == {"node-0", "node-1"}
    for node, s in seqs.items():
        assert s[0] == 0 and gaps(s) == [], (node, gaps(s)[:20])
        assert s[-1] >= seq_at_restart[node] + 10
    assert check_database(url) == []
    print(f"\ncontrol-plane restarts during the PostgreSQL outage: {rep['processes']['control-plane']['restarts']}")
