"""Hostile clients beside a real one: does an attack without a token hurt the clients it shares a
server with?

    python -m bench.hostile [--json] [--seconds 15] [--rate 20] [--attacks A,..] [--targets T,..]

Starts a control plane (SQLite), one node agent, a gateway in front of it and the dashboard, all
on 127.0.0.1. Per target (``gateway``, ``control_plane``, ``agent``, ``dashboard``) a client
sends ``--rate`` requests/s for ``--seconds`` with no attack, then the same with the attacks
running against that target:

- **huge headers**: four connections each send one request head whose one header grows in
  1-MiB writes (up to 100 MiB a connection; refused, it is reopened 0.1 s later);
- **absurd chunk**: two connections that send ``Transfer-Encoding: chunked`` with a chunk size
  of ``ffffffffffffffffff`` and stream data after it (reopened likewise);
- **slow heads**: 200 connections that send part of a head and then nothing (each one the
  server closes is replaced).

The attacks run in a process of their own, the client in the bench's; the client's run under
attack starts 3 s after the attack did.

Per target it prints the client's P99 under attack over its P99 without, its failed requests,
the bytes the attack offered (written into its sockets, most of them never read by the server),
and the target's peak RSS growth:
``{"targets": {NAME: {"p99_ratio", "failed", "p99_ms", "p99_ms_base", "attack_mib_offered",
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

from bench.dashboard import _env, _wait_http, free_port, start_control_plane, start_dashboard, stop
from bench.stats import few_samples_note, p99, pct

ROOT = Path(__file__).resolve().parents[1]
HEAD_CONNECTIONS = 4
HEAD_TOTAL_BYTES = 100 * 2**20
CHUNK_CONNECTIONS = 2
SLOW_CONNECTIONS = 200
ATTACKS = ("huge_head", "absurd_chunk", "slow_heads")
#: the client measures once the attack has run this long: the sustained attack, not the attacker's
#: own start-up (a Python process and 200 connections opened at once, on the same two cores)
ATTACK_WARMUP_S = 3.0
TARGETS = ("gateway", "control_plane", "agent", "dashboard")


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
    """The attacks on one ``port``, in a process of their own (so the client beside them measures
    the server, not a shared interpreter), until `stop`. Each attacking connection is refused
    and reopened after ``REOPEN_S``: a persistent attacker, not a connection flood."""

    def __init__(self, port: int, path: str, attacks: tuple[str, ...] = ATTACKS) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.done = ctx.Event()
        self.sent = ctx.Value("q", 0)
        self.proc = ctx.Process(target=_attack_main, args=(port, path, self.done, self.sent, attacks), daemon=True)

    def start(self) -> "Attack":
        self.proc.start()
        return self

    def stop(self) -> None:
        self.done.set()
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()

    @property
    def sent_bytes(self) -> int:
        return int(self.sent.value)


#: an attacking connection, once refused, is reopened after this long
REOPEN_S = 0.1


def _attack_main(port: int, path: str, done, sent, attacks: tuple[str, ...]) -> None:
    def count(n: int) -> None:
        with sent.get_lock():
            sent.value += n

    def stream(head: bytes, part: bytes, total: int) -> None:
        """One connection: ``head``, then ``part`` until ``total`` bytes, a refusal, or the end."""
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=15)
        except OSError:
            done.wait(REOPEN_S)
            return
        try:
            s.sendall(head)
            n = 0
            while n < total and not done.is_set():
                s.sendall(part)
                n += len(part)
                count(len(part))
        except OSError:  # refused: closed or reset by the server
            pass
        finally:
            s.close()
        done.wait(REOPEN_S)

    part = b"a" * 2**20

    def huge_head() -> None:
        while not done.is_set():
            stream(f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Big: ".encode(), part, HEAD_TOTAL_BYTES)

    def absurd_chunk() -> None:
        while not done.is_set():
            stream(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Transfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n".encode(), part, HEAD_TOTAL_BYTES)

    def slow_heads() -> None:
        socks = []
        try:
            while not done.is_set():
                while len(socks) < SLOW_CONNECTIONS and not done.is_set():
                    try:
                        c = socket.create_connection(("127.0.0.1", port), timeout=5)
                        c.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode())
                        socks.append(c)
                    except OSError:
                        break
                done.wait(0.5)
                alive = []
                for c in socks:  # the ones the server closed are replaced
                    c.setblocking(False)
                    try:
                        closed = c.recv(1) == b""
                    except BlockingIOError:
                        closed = False
                    except OSError:
                        closed = True
                    if closed:
                        c.close()
                    else:
                        alive.append(c)
                socks = alive
        finally:
            for c in socks:
                c.close()

    threads = []
    if "huge_head" in attacks:
        threads += [threading.Thread(target=huge_head, daemon=True) for _ in range(HEAD_CONNECTIONS)]
    if "absurd_chunk" in attacks:
        threads += [threading.Thread(target=absurd_chunk, daemon=True) for _ in range(CHUNK_CONNECTIONS)]
    if "slow_heads" in attacks:
        threads.append(threading.Thread(target=slow_heads, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join()


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
    return {"requests": n, "failed": failed, "p50_ms": pct(lat, 50, 2), **p99(lat, 2).fields("p99_ms"),
            "peak_rss_mb": round(max(rss), 1),
            "errors": sorted(set(errors))}


def run(seconds: float, rate: float, progress=print, attacks: tuple[str, ...] = ATTACKS,
        only: tuple[str, ...] = TARGETS) -> dict:
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
            if name not in only:
                continue
            client_run(request, 1.0, rate, pid)  # warm-up
            base = client_run(request, seconds, rate, pid)
            attack = Attack(port, path, attacks).start()
            time.sleep(ATTACK_WARMUP_S)  # the attack under way (its process started, its connections open)
            try:
                hit = client_run(request, seconds, rate, pid)
            finally:
                attack.stop()
            ratio = (hit["p99_ms"] / base["p99_ms"] if hit["p99_ms"] is not None and base["p99_ms"]
                     else float("nan"))
            out[name] = {"p99_ratio": round(ratio, 3), "failed": hit["failed"], "p99_ms": hit["p99_ms"],
                         "p99_ms_base": base["p99_ms"], "p50_ms": hit["p50_ms"], "p50_ms_base": base["p50_ms"],
                         "p99_ms_samples": hit["p99_ms_samples"], "p99_ms_base_samples": base["p99_ms_samples"],
                         "p99_ms_few_samples": hit["p99_ms_few_samples"] or base["p99_ms_few_samples"],
                         "failed_base": base["failed"], "requests": hit["requests"],
                         "attack_mib_offered": round(attack.sent_bytes / 2**20, 1),
                         "rss_growth_mb": round(hit["peak_rss_mb"] - base["peak_rss_mb"], 1),
                         "errors": hit["errors"], "alive": os.path.exists(f"/proc/{pid}")}
            progress(f"bench hostile: {name}: P99 {base['p99_ms']} -> {hit['p99_ms']} ms (x{ratio:.2f}), "
                     f"{hit['failed']} failed, the attack offered {attack.sent_bytes / 2**20:.0f} MiB"
                     f"{few_samples_note(min(hit['p99_ms_samples'], base['p99_ms_samples']))}")
        return {"seconds": seconds, "rate_rps": rate,
                "attacks": {"huge_head_connections": HEAD_CONNECTIONS * ("huge_head" in attacks),
                            "absurd_chunk_connections": CHUNK_CONNECTIONS * ("absurd_chunk" in attacks),
                            "slow_head_connections": SLOW_CONNECTIONS * ("slow_heads" in attacks),
                            "reopen_s": REOPEN_S},
                "targets": out,
                "ok": all(v["failed"] == 0 and v["p99_ratio"] <= 2.0 for v in out.values())}
    finally:
        for p in reversed(procs):
            stop(p)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--seconds", type=float, default=15.0, help="seconds of each client run (default 15)")
    p.add_argument("--rate", type=float, default=20.0, help="the client's requests per second (default 20)")
    p.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, of {', '.join(ATTACKS)} (default all)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)} (default all)")
    args = p.parse_args(argv)
    if not (0 < args.seconds <= 600 and 0 < args.rate <= 1000):
        p.error("--seconds must be in (0, 600] and --rate in (0, 1000]")
    attacks = tuple(a.strip() for a in args.attacks.split(",") if a.strip())
    only = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    if not attacks or set(attacks) - set(ATTACKS) or not only or set(only) - set(TARGETS):
        p.error(f"--attacks: some of {', '.join(ATTACKS)}; --targets: some of {', '.join(TARGETS)}")
    res = run(args.seconds, args.rate, progress=lambda m: print(m, file=sys.stderr, flush=True), attacks=attacks,
              only=only)
    if args.json:
        print(json.dumps(res))
    else:
        for name, v in res["targets"].items():
            print(f"{name:<14} P99 {v['p99_ms_base']} -> {v['p99_ms']} ms (x{v['p99_ratio']}), {v['failed']} failed, "
                  f"attack offered {v['attack_mib_offered']} MiB, RSS +{v['rss_growth_mb']} MB"
                  f"{few_samples_note(min(v['p99_ms_samples'], v['p99_ms_base_samples']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
