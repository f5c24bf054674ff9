"""The report spool under kill -9: nothing lost, nothing stored twice.

Real processes only: a real control plane (``python -m control_plane.main``, SQLite) stores the
reports, exactly once per (node id, seq).

- **the spool writer**: a child process (this file run as ``python -m tests.test_spool_crash``)
  opens the node's spool (`node_agent.spool.ReportSpool`), appends reports (each says it was kept
  on stdout once `append` returned: an acknowledged report) and sends them in batches to the
  control plane, deleting them once stored. It is SIGKILLed many times: at a random instant (by
  the test), or by itself at a chosen point of the spool's file operations (an audit hook fires
  before the operation: the counter's temporary file opened or renamed, a report's temporary file
  opened or renamed, the folder opened for its fsync, an acknowledged report deleted). Each round
  restarts it on the same state folder. A last round sends what is left. Then every acknowledged
  report is stored with the number it was given, no report is stored twice (each ``ts_s``, the
  report's identity, once), at most one unacknowledged report per kill is stored (the one the
  kill cut off between `append` and its line), and nothing is counted as dropped.
- **the node agent** (slow): ``racer node-agent --control-plane`` killed with SIGKILL at random
  instants and restarted on its state folder, the control plane down for the first rounds (the
  spool grows) and up for the last. What each kill left in the spool is read before the restart;
  at the end every one of those reports is stored with the same content, no report is stored
  twice, and the numbers missing from the stored ones are at most one per kill.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
NODE = "n-crash"
T0_S = 1_700_000_000.0  # reports' ts_s: T0_S + round * 1000 + index, the identity the test checks
#: where the writer kills itself: (audit event, what its first argument must end with, in the spool folder?)
KILL_POINTS = {
    "counter-open": ("open", "state.json.tmp"),
    "counter-rename": ("os.rename", "state.json.tmp"),
    "report-open": ("open", ".tmp", "spool"),
    "report-rename": ("os.rename", ".tmp", "spool"),
    "folder-fsync": ("open", "/spool"),
    "acked-delete": ("os.remove", ".json", "spool"),
}


# ------------------------------------------------------------------------------- the child ---


def _kill_self_at(point: str, count: int) -> None:
    """SIGKILL this process at the ``count``-th time the spool reaches ``point`` (before the operation)."""
    event, suffix, *inside = KILL_POINTS[point]
    seen = [0]

    def hook(name: str, args: tuple) -> None:
        if name != event or not args or not isinstance(args[0], str):
            return
        path = args[0]
        if not path.endswith(suffix) or (inside and f"/{inside[0]}/" not in path):
            return
        seen[0] += 1
        if seen[0] >= count:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)


def _send(spool, client) -> None:
    """Send up to 5 of the oldest reports; delete them once the control plane stored them."""
    batch = spool.peek(5)
    if not batch:
        return
    r = client.post(f"/nodes/{NODE}/reports", json={"reports": batch})
    assert r.status_code == 200, r.text
    print(f"stored {r.json()['stored']} duplicates {r.json()['duplicates']}", flush=True)
    spool.remove(x["seq"] for x in batch)


def writer_main(argv: list[str]) -> int:
    """``STATE_DIR CP_URL TOKEN ROUND NUM_REPORTS [POINT COUNT]``; ``NUM_REPORTS`` 0: send what
    is left and exit."""
    import httpx

    from node_agent.spool import ReportSpool
    from tests.cp_util import report

    state_dir, cp_url, token, rnd, n = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    spool = ReportSpool(state_dir, max_reports=100_000)
    if len(argv) > 5:
        _kill_self_at(argv[5], int(argv[6]))
    with httpx.Client(base_url=f"{cp_url}/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        for i in range(n):
            ts = T0_S + rnd * 1000 + i
            seq = spool.append({k: v for k, v in report(0, ts_s=ts).items() if k != "seq"})
            print(f"acked {seq} {ts!r}", flush=True)
            if i % 3 == 2:
                _send(spool, c)
        while len(spool):
            _send(spool, c)
    print(f"done dropped {spool.num_dropped}", flush=True)
    return 0


# ------------------------------------------------------------------------------- the tests ---


def _run_writer(args: list[str], kill_after_s: float | None) -> tuple[int, list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.test_spool_crash", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    if kill_after_s is not None:
        timer = threading.Timer(kill_after_s, proc.send_signal, (signal.SIGKILL,))
        timer.start()
    out, err = proc.communicate(timeout=120)
    if kill_after_s is not None:
        timer.cancel()
    assert proc.returncode in (0, -signal.SIGKILL), err[-3000:]
    return proc.returncode, out.splitlines()


def test_a_spool_writer_killed_at_random_points_loses_nothing_and_stores_nothing_twice(tmp_path):
    from tests.cp_util import ControlPlane, register

    rng = random.Random(46)
    state = tmp_path / "state"
    cp = ControlPlane(f"sqlite:///{tmp_path / 'cp.db'}", tmp_path / "cp.log", scheduler=False)
    acked: dict[int, float] = {}
    num_kills = num_duplicates = 0
    kinds: dict[str, int] = {}
    try:
        token = cp.token("node", NODE, node_id=NODE)
        with cp.client(token) as node:
            register(node, NODE)
        cp_args = [str(state), cp.base, token]
        for rnd in range(40):
            if rnd % 2:
                point = rng.choice(sorted(KILL_POINTS))
                rc, lines = _run_writer([*cp_args, str(rnd), "60", point, str(rng.randint(1, 12))], None)
                assert rc == -signal.SIGKILL, (point, lines[-3:])  # each point is reached within 60 reports
                kinds[point] = kinds.get(point, 0) + 1
                if point == "report-rename":  # killed mid-write: the whole temporary file is there
                    assert list((state / "spool").glob("*.tmp")), "no report was being written"
            else:  # some of these end before the kill, their spool sent whole: the next starts from an empty one
                rc, lines = _run_writer([*cp_args, str(rnd), str(rng.randint(1, 60))], rng.uniform(0.05, 1.5))
                kinds["random instant"] = kinds.get("random instant", 0) + (rc != 0)
            num_kills += rc != 0
            for line in lines:
                word, *rest = line.split()
                if word == "acked":
                    assert int(rest[0]) not in acked, f"number {rest[0]} given twice"
                    acked[int(rest[0])] = float(rest[1])
                elif word == "stored":
                    num_duplicates += int(rest[2])
        rc, lines = _run_writer([*cp_args, "99", "0"], None)  # send what is left
        assert rc == 0 and lines[-1] == "done dropped 0", lines[-3:]
        num_duplicates += sum(int(x.split()[3]) for x in lines if x.startswith("stored"))
        rows = cp.admin.get("/reports", params={"node_id": NODE, "limit": 100_000}).json()
    finally:
        cp.stop()
    stored = {r["seq"]: r["ts_s"] for r in rows}
    assert len(stored) == len(rows)
    assert len(set(stored.values())) == len(rows), "a report stored twice (under two numbers)"
    lost = {s: ts for s, ts in acked.items() if stored.get(s) != ts}
    assert not lost, f"acknowledged reports not stored as acknowledged: {sorted(lost.items())[:10]}"
    unacked = set(stored) - set(acked)
    assert len(unacked) <= num_kills, (len(unacked), num_kills)
    assert not list((state / "spool").iterdir()) and json.loads((state / "state.json").read_text())["num_dropped"] == 0
    assert kinds.get("acked-delete", 0) == 0 or num_duplicates > 0  # a batch stored, not deleted: sent again
    print(f"spool crash: {num_kills} kills ({kinds}), {len(acked)} acknowledged reports, {len(rows)} stored "
          f"({len(unacked)} cut off before their acknowledgement), {num_duplicates} resent and stored once")


#: what a stored row must repeat of the report the spool held (`control_plane.schemas.ReportOut`)
COMPARED = ("seq", "ts_s", "emb_share", "emb_share_target", "num_requests", "queue_depth", "policy_version",
            "device_mode")


def _spooled(state: Path) -> dict[int, dict]:
    """The reports a killed agent left in its spool, by seq."""
    return {int(p.stem): json.loads(p.read_text()) for p in (state / "spool").glob("*.json")}


def _buffered(base: str) -> int:
    import httpx

    try:
        return int(httpx.get(f"{base}/v1/metrics", timeout=5).json()["control_plane"]["num_buffered"])
    except (httpx.HTTPError, KeyError, ValueError):
        return 0


def _wait(pred, proc: subprocess.Popen, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert proc.poll() is None, f"the agent exited ({proc.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_node_agent_killed_at_random_instants_loses_no_spooled_report_and_stores_none_twice(tmp_path):
    pytest.importorskip("prometheus_client")
    from tests.test_node_agent import free_port, wait_healthy, write_taobao_csv
    from tests.test_node_reporter import ControlPlane

    rng = random.Random(46)
    cp = ControlPlane(tmp_path)
    cp.start()
    with cp.api() as api:
        token = api.post("/tokens", json={"role": "node", "name": NODE, "node_id": NODE}).json()["token"]
    cp.stop()  # down for the first rounds: the spool grows across kills
    csv, state = write_taobao_csv(tmp_path / "trace.csv"), tmp_path / "state"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "racer", "node-agent", "--port", str(port), "--trace", "taobao", "--path", str(csv),
           "--num-pages", "256", "--max-history-len", "256", "--embedding-dim", "32", "--num-layers", "1",
           "--control-interval-s", "0.2", "--threads", "1", "--control-plane", cp.url, "--node-id", NODE,
           "--state-dir", str(state)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RACER_NODE_TOKEN": token}
    left: dict[int, dict] = {}  # what the kills left in the spool
    num_kills = 0
    try:
        for rnd in range(7):
            if rnd == 4:
                cp.start()
            with open(tmp_path / f"agent{rnd}.log", "w") as log:
                proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                wait_healthy(base, proc, timeout_s=120)
                if rnd < 4:  # the control plane is down: wait for a report to be spooled
                    _wait(lambda: _buffered(base) > 0, proc, "a spooled report")
                time.sleep(rng.uniform(0.0, 1.5))
            finally:
                proc.kill()
                proc.wait(10)
            num_kills += 1
            for seq, r in _spooled(state).items():
                assert left.get(seq, r) == r, f"report {seq} changed in the spool"
                left[seq] = r
        assert left, "no kill left a report in the spool"
        with open(tmp_path / "agent-last.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(base, proc, timeout_s=120)
            _wait(lambda: all(int(p.stem) > max(left) for p in (state / "spool").glob("*.json")), proc,
                  "the spool sent")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        with cp.api() as api:
            rows = api.get("/reports", params={"node_id": NODE, "limit": 100_000}).json()
            node = api.get(f"/nodes/{NODE}").json()
    finally:
        cp.stop()
    assert node["num_reports_dropped"] == 0, node
    by_seq = {r["seq"]: r for r in rows}
    assert len(by_seq) == len(rows) and len({r["ts_s"] for r in rows}) == len(rows), "a report stored twice"
    for seq, r in left.items():
        assert seq in by_seq, f"report {seq}, spooled when the agent was killed, was never stored"
        assert {k: by_seq[seq][k] for k in COMPARED} == {k: r.get(k) for k in COMPARED}, seq
    missing = sorted(set(range(max(by_seq) + 1)) - set(by_seq))
    assert len(missing) <= num_kills, f"numbers missing from the stored reports: {missing}"
    print(f"agent crash: {num_kills} kills, {len(left)} reports spooled at a kill, {len(rows)} stored "
          f"(seq 0..{max(by_seq)}, {len(missing)} numbers cut off by a kill)")

if __name__ == "__main__":
    sys.exit(writer_main(sys.argv[1:]))
