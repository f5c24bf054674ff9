"""Hostile clients beside a real one: does an attack without a token hurt the clients it shares a
server with?

    python -m bench.hostile [--json] [--seconds 8] [--rate 20]

Starts a control plane (SQLite), one node agent, a gateway in front of it and the dashboard, all
on 127.0.0.1. Per target (``gateway``, ``control_plane``, ``agent``, ``dashboard``) a client
sends ``--rate`` requests/s for ``--seconds`` with no attack, then the same with the attacks
running against that target:

- **huge headers**: four connections each send one request head whose one header grows in
  1-MiB writes (up to 100 MiB a connection, reconnecting when the server closes);
- **absurd chunk**: connections that send ``Transfer-Encoding: chunked`` with a chunk size of
  ``ffffffffffffffffff`` and stream data after it;
- **slow heads**: 200 connections that send part of a head and then nothing.

Per target it prints the client's P99 under attack over its P99 without, its failed requests,
the attack's bytes the server took before refusing, and the target's peak RSS growth:
``{"targets": {NAME: {"p99_ratio", "failed", "p99_ms", "p99_ms_base", "attack_mib_sent",
"rss_growth_mb", ...}}}``. The targets' own limits are the defaults (32-KiB heads, 10-s head
timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from bench.dashboard import _env, _wait_http, free_port, start_control_plane, start_dashboard, stop

ROOT = Path(__file__).resolve().parents[1]
HEAD_CONNECTIONS = 4
HEAD_TOTAL_BYTES = 100 * 2**20
CHUNK_CONNECTIONS = 2
SLOW_CONNECTIONS = 200


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _start(cmd: list[str], log: Path, url: str, env: dict | None = None) -> subprocess.Popen:
    f = open(log, "ab")
    proc = subprocess.Popen(cmd, env=_env(env), stdout=f, stderr=subprocess.STDOUT, cwd=str(ROOT))
    f.close()
    _wait_http(url, proc, 90, log)
    return proc


class Attack:
    """The attacks on one ``port`` in background threads until `stop`."""

    def __init__(self, port: int, path: str) -> None:
        self.port, self.path = port, path
        self.done = threading.Event()
        self.sent = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._huge_head, daemon=True) for _ in range(HEAD_CONNECTIONS)]
        self.threads += [threading.Thread(target=self._absurd_chunk, daemon=True) for _ in range(CHUNK_CONNECTIONS)]
        self.threads.append(threading.Thread(target=self._slow_heads, daemon=True))

    def start(self) -> "Attack":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(15)

    def _count(self, n: int) -> None:
        with self.lock:
            self.sent += n

    def _stream(self, head: bytes, part: bytes, total: int) -> None:
        """One connection: ``head``, then ``part`` repeatedly until ``total`` bytes, the server
        closes, or the attack ends."""
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=15)
        except OSError:
            time.sleep(0.1)
            return
        try:
            s.sendall(head)
            n = 0
            while n < total and not self.done.is_set():
                s.sendall(part)
                n += len(part)
                self._count(len(part))
        except OSError:  # refused: closed or reset by the server
            pass
        finally:
            s.close()

    def _huge_head(self) -> None:
        part = b"a" * 2**20
        while not self.done.is_set():
            self._stream(f"GET {self.path} HTTP/1.1\r\nHost: x\r\nX-Big: ".encode(), part, HEAD_TOTAL_BYTES)

    def _absurd_chunk(self) -> None:
        part = b"a" * 2**20
        while not self.done.is_set():
            self._stream(f"POST {self.path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Transfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n".encode(), part, HEAD_TOTAL_BYTES)

    def _slow_heads(self) -> None:
        socks = []
        try:
            while not self.done.is_set():
                while len(socks) < SLOW_CONNECTIONS and not self.done.is_set():
                    try:
                        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                        s.sendall(f"GET {self.path} HTTP/1.1\r\nHost: x\r\n".encode())
                        socks.append(s)
                    except OSError:
                        break
                self.done.wait(0.5)
                alive = []
                for s in socks:  # the ones the server closed are replaced
                    s.setblocking(False)
                    try:
                        closed = s.recv(1) == b""
                    except BlockingIOError:
                        closed = False
                    except OSError:
                        closed = True
                    if closed:
                        s.close()
                    else:
                        alive.append(s)
                socks = alive
        finally:
            for s in socks:
                s.close()


def client_run(request, seconds: float, rate: float, pid: int) -> dict:
    """Open-loop requests at ``rate``/s for ``seconds`` (latency from each one's scheduled time),
    and the target's peak RSS meanwhile."""
    lat, failed, errors = [], 0, []
    rss = [_rss_mb(pid)]
    t0 = time.perf_counter()
    n = int(seconds * rate)
    with httpx.Client(timeout=10.0) as c:
        for i in range(n):
            due = t0 + i / rate
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            try:
                r = request(c)
                ok = r.status_code == 200
            except httpx.HTTPError as e:
                ok = False
                errors.append(type(e).__name__)
            if ok:
                lat.append((time.perf_counter() - due) * 1e3)
            else:
                failed += 1
            if i % 10 == 0:
                rss.append(_rss_mb(pid))
    a = np.array(lat) if lat else np.array([float("nan")])
    return {"requests": n, "failed": failed, "p50_ms": round(float(np.percentile(a, 50)), 2),
            "p99_ms": round(float(np.percentile(a, 99)), 2), "peak_rss_mb": round(max(rss), 1),
            "errors": sorted(set(errors))}


def run(seconds: float, rate: float, progress=print) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="racer-hostile-"))
    procs: list[subprocess.Popen] = []
    admin = secrets.token_urlsafe(24)
    try:
        cp_port = free_port()
        cp = start_control_plane(f"sqlite:///{tmp / 'cp.db'}", cp_port, admin, tmp / "cp.log")
        procs.append(cp)
        cp_url = f"http://127.0.0.1:{cp_port}"
        ap = free_port()
        agent = _start([sys.executable, "-m", "racer", "node-agent", "--port", str(ap), "--trace", "synthetic",
                        "--emulate", "a100-hstu"], tmp / "agent.log", f"http://127.0.0.1:{ap}/healthz")
        procs.append(agent)
        gp = free_port()
        gw = _start([sys.executable, "-m", "racer", "gateway", "--nodes", f"http://127.0.0.1:{ap}", "--port", str(gp)],
                    tmp / "gateway.log", f"http://127.0.0.1:{gp}/healthz")
        procs.append(gw)
        dp = free_port()
        dash = start_dashboard(cp_url, dp, tmp / "dashboard.log")
        procs.append(dash)
        body = {"user_id": 7, "history": [1, 2, 3, 4], "new_items": [5], "top_k": 3}
        auth = {"Authorization": f"Bearer {admin}"}
        targets = {
            "gateway": (gp, gw.pid, "/v1/recommend", lambda c: c.post(f"http://127.0.0.1:{gp}/v1/recommend", json=body)),
            "control_plane": (cp_port, cp.pid, "/api/v1/summary",
                              lambda c: c.get(f"{cp_url}/api/v1/summary", headers=auth)),
            "agent": (ap, agent.pid, "/v1/recommend", lambda c: c.post(f"http://127.0.0.1:{ap}/v1/recommend", json=body)),
            "dashboard": (dp, dash.pid, "/_dash-update-component", lambda c: c.get(f"http://127.0.0.1:{dp}/")),
        }
        out = {}
        for name, (port, pid, path, request) in targets.items():
            client_run(request, 1.0, rate, pid)  # warm-up
            base = client_run(request, seconds, rate, pid)
            attack = Attack(port, path).start()
            try:
                hit = client_run(request, seconds, rate, pid)
            finally:
                attack.stop()
            ratio = hit["p99_ms"] / base["p99_ms"] if base["p99_ms"] > 0 else float("nan")
            out[name] = {"p99_ratio": round(ratio, 3), "failed": hit["failed"], "p99_ms": hit["p99_ms"],
                         "p99_ms_base": base["p99_ms"], "p50_ms": hit["p50_ms"], "p50_ms_base": base["p50_ms"],
                         "failed_base": base["failed"], "requests": hit["requests"],
                         "attack_mib_sent": round(attack.sent / 2**20, 1),
                         "rss_growth_mb": round(hit["peak_rss_mb"] - base["peak_rss_mb"], 1),
                         "errors": hit["errors"], "alive": os.path.exists(f"/proc/{pid}")}
            progress(f"bench hostile: {name}: P99 {base['p99_ms']} -> {hit['p99_ms']} ms (x{ratio:.2f}), "
                     f"{hit['failed']} failed, attack sent {attack.sent / 2**20:.0f} MiB")
        return {"seconds": seconds, "rate_rps": rate,
                "attacks": {"huge_head_connections": HEAD_CONNECTIONS, "absurd_chunk_connections": CHUNK_CONNECTIONS,
                            "slow_head_connections": SLOW_CONNECTIONS},
                "targets": out,
                "ok": all(v["failed"] == 0 and v["p99_ratio"] <= 2.0 for v in out.values())}
    finally:
        for p in reversed(procs):
            stop(p)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--seconds", type=float, default=8.0, help="seconds of each client run (default 8)")
    p.add_argument("--rate", type=float, default=20.0, help="the client's requests per second (default 20)")
    args = p.parse_args(argv)
    if not (0 < args.seconds <= 600 and 0 < args.rate <= 1000):
        p.error("--seconds must be in (0, 600] and --rate in (0, 1000]")
    res = run(args.seconds, args.rate, progress=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(res))
    else:
        for name, v in res["targets"].items():
            print(f"{name:<14} P99 {v['p99_ms_base']} -> {v['p99_ms']} ms (x{v['p99_ratio']}), {v['failed']} failed, "
                  f"attack {v['attack_mib_sent']} MiB sent, RSS +{v['rss_growth_mb']} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
