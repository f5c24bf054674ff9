"""Helpers for the control-plane tests: database URLs (SQLite always; PostgreSQL when reachable,
and required when ``RACER_REQUIRE_POSTGRES=1``, as in CI), fresh databases, a control-plane
process on a free port, artifact tars, simulated node traffic over HTTP."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
PG_SERVER = os.environ.get("RACER_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/")
FAST_JOBS = {"RACER_WEIGHTS_PERIOD_S": "0.5", "RACER_ROLLOUT_PERIOD_S": "0.3", "RACER_OVERRIDE_PERIOD_S": "0.2",
             "RACER_LIVENESS_PERIOD_S": "0.5", "RACER_LEADER_POLL_S": "0.3", "RACER_RETENTION_PERIOD_S": "5"}


def pg_reachable() -> bool:
    try:
        import psycopg

        with psycopg.connect(PG_SERVER.rstrip("/") + "/postgres", connect_timeout=2):
            return True
    except Exception:  # noqa: BLE001
        return False


def backends() -> list:
    """pytest params: "sqlite" and "postgresql" (skipped when unreachable, unless required)."""
    pg = pytest.param("postgresql", marks=[])
    if not pg_reachable():
        if os.environ.get("RACER_REQUIRE_POSTGRES") == "1":
            pg = pytest.param("postgresql", marks=[])  # the test fails on connect: CI must provide it
        else:
            pg = pytest.param("postgresql", marks=pytest.mark.skip(reason=f"PostgreSQL not reachable at {PG_SERVER}"))
    return ["sqlite", pg]


class Database:
    """A fresh database of one backend; ``drop()`` removes it."""

    def __init__(self, backend: str, tmp_path: Path):
        self.backend = backend
        if backend == "sqlite":
            self.url = f"sqlite:///{tmp_path}/cp-{uuid.uuid4().hex[:8]}.db"
            self._name = None
        else:
            import psycopg

            self._name = f"racer_test_{uuid.uuid4().hex[:12]}"
            with psycopg.connect(PG_SERVER.rstrip("/") + "/postgres", autocommit=True) as c:
                c.execute(f'CREATE DATABASE "{self._name}"')
            self.url = PG_SERVER.rstrip("/") + "/" + self._name

    def drop(self) -> None:
        if self._name:
            import psycopg

            with psycopg.connect(PG_SERVER.rstrip("/") + "/postgres", autocommit=True) as c:
                c.execute(f'DROP DATABASE IF EXISTS "{self._name}" WITH (FORCE)')


@pytest.fixture(params=backends())
def migrated_db(request, tmp_path):
    """(engine, session factory) of a fresh database at the newest migration, on each backend."""
    from db.engine import make_engine, session_factory, upgrade

    d = Database(request.param, tmp_path)
    engine = make_engine(d.url)
    upgrade(engine)
    yield engine, session_factory(engine)
    engine.dispose()
    d.drop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ControlPlane:
    """A real control-plane process (``python -m control_plane.main``) on a free port."""

    ADMIN = "test-admin-token"

    def __init__(self, db_url: str, log_path: Path, env: dict | None = None, scheduler: bool = True,
                 args: tuple = ()):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        e = dict(os.environ, RACER_ADMIN_TOKEN=self.ADMIN, PYTHONPATH=str(REPO))
        e.update(FAST_JOBS)
        if not db_url.startswith("sqlite"):  # SQLite keeps its key beside the file; another database needs one
            e["RACER_SECRET_KEY"] = "racer_test_secret_key_0123456789abcdef"
        e.update(env or {})
        argv = [sys.executable, "-m", "control_plane.main", "--db", db_url, "--port", str(self.port)]
        if not scheduler:
            argv.append("--no-scheduler")
        argv += list(args)
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, cwd=str(REPO), env=e, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"control plane exited ({self.proc.returncode}): {log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.base + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError("control plane did not start within 60 s")
            time.sleep(0.1)
        self.admin = self.client(self.ADMIN)

    def client(self, token: str | None) -> httpx.Client:
        h = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.base + "/api/v1", headers=h, timeout=30)

    def token(self, role: str, name: str | None = None, node_id: str | None = None) -> str:
        """A new token of ``role`` (a node token is bound to ``node_id``)."""
        body = {"role": role, "name": name or role}
        if node_id is not None:
            body["node_id"] = node_id
        r = self.admin.post("/tokens", json=body)
        assert r.status_code == 201, r.text
        return r.json()["token"]

    def node(self, node_id: str) -> httpx.Client:
        """A client with a new node token bound to ``node_id`` (a node token acts as its own node only)."""
        return self.client(self.token("node", f"node-{node_id}", node_id=node_id))

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


def register(client: httpx.Client, node_id: str, policy_version: str | None = None, **cost) -> dict:
    prof = {"kv_recompute_us_per_token": 2.0, "emb_transfer_us_per_row": 1.0, "service_time_us": 500.0,
            "queue_capacity": 64}
    prof.update(cost)
    r = client.post("/nodes/register", json={"node_id": node_id, "address": "http://127.0.0.1:9", "device": "cpu",
                                             "cost_profile": prof, "policy_version": policy_version})
    assert r.status_code == 200, r.text
    return r.json()


def report(seq: int, ts_s: float | None = None, **kw) -> dict:
    d = {"seq": seq, "ts_s": time.time() if ts_s is None else ts_s, "interval_s": 1.0, "emb_share": 0.5,
         "emb_share_target": 0.5, "p50_ms": 4.0, "p99_ms": 10.0, "slo_attainment": 0.99, "throughput_rps": 100.0,
         "num_requests": 100}
    d.update(kw)
    return d


def artifact_tar(src: Path, policy_id: str | None = None, corrupt_onnx: bool = False) -> bytes:
    """A tar of the artifact at ``src`` (optionally under another policy_id, or with a corrupt ONNX file)."""
    files = {n: (src / n).read_bytes() for n in ("manifest.json", "policy.onnx", "golden.npz")}
    if policy_id is not None:
        m = json.loads(files["manifest.json"])
        m["policy_id"] = policy_id
        files["manifest.json"] = json.dumps(m).encode()
    if corrupt_onnx:
        b = bytearray(files["policy.onnx"])
        b[len(b) // 2] ^= 0xFF
        files["policy.onnx"] = bytes(b)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for n, data in files.items():
            info = tarfile.TarInfo(f"artifact/{n}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def token_maker(client, admin_token: str):
    """``token(role, **fields) -> headers``: a new token of ``role`` (named after it) made with
    ``admin_token`` through ``client`` (an in-process `TestClient`), as an Authorization header."""

    def token(role: str, **kw) -> dict:
        r = client.post("/api/v1/tokens", json={"role": role, "name": role, **kw},
                        headers={"Authorization": f"Bearer {admin_token}"})
        assert r.status_code == 201, r.text
        return {"Authorization": f"Bearer {r.json()['token']}"}

    return token


def wait_for(fn, timeout_s: float = 20.0, interval_s: float = 0.1):
    """Poll ``fn`` until it returns a truthy value; return it (or fail with the last value)."""
    deadline = time.time() + timeout_s
    last = None
    while time.time() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s; last value: {last!r}")


def stop_process(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM ``proc`` if it still runs and wait ``timeout_s`` for it to stop; then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
