"""Helpers for tests that run real RACER processes on 127.0.0.1 (free ports, logs in a temp folder)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import REPO

# A small node-agent model config: starts in a few seconds and serves in ~ms on a shared CPU.
SMALL_AGENT_ARGS = ["--num-pages", "256", "--max-history-len", "256", "--embedding-dim", "32", "--num-layers", "1",
                    "--num-candidates", "32", "--control-interval-s", "0.5", "--threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def racer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "racer", *args]


def spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own process group, stdout and stderr into ``log``."""
    out = open(log, "ab")
    try:
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **(env or {})})
    finally:
        out.close()


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 90.0, log: Path | None = None) -> dict:
    """Wait until GET ``url`` answers 200; fail early when ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log and log.exists() else ""
            raise AssertionError(f"{proc.args[:4]} exited with {proc.returncode} before {url} answered:\n{tail}")
        try:
            r = httpx.get(url, timeout=1.0)
            if r.status_code == 200:
                return r.json()
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer 200 within {timeout_s} s")


def stop(proc: subprocess.Popen, timeout_s: float = 15.0) -> int:
    """SIGTERM the process group, SIGKILL it if it is still there after ``timeout_s``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    return proc.returncode


def start_agent(tmp: Path, name: str, trace_path: Path | None = None, *extra: str,
                port: int | None = None) -> tuple[subprocess.Popen, str, Path]:
    port = port or free_port()
    log = tmp / f"{name}.log"
    cmd = racer_cmd("node-agent", "--port", str(port), "--trace", "taobao", *SMALL_AGENT_ARGS, *extra)
    if trace_path is not None:
        cmd += ["--path", str(trace_path)]
    return spawn(cmd, log), f"http://127.0.0.1:{port}", log


def skip_or_fail(reason: str) -> None:
    """Skip, or fail under CI (``RACER_CI_STRICT=1``, set by .ci/run), where every piece must be there."""
    if os.environ.get("RACER_CI_STRICT") == "1":
        pytest.fail(f"RACER_CI_STRICT: {reason}")
    pytest.skip(reason)


def send_streaming(url: str, method: str, path: str, *, headers: dict | None = None, total_bytes: int,
                   chunk_bytes: int = 64 * 1024, chunked: bool = True, declare_only: bool = False) -> dict:
    """Send a request whose body is ``total_bytes`` (spaces inside a JSON object) over a raw socket,
    watching for the answer before each piece: a server that answers without reading the body is
    seen as soon as it answers. ``chunked``: Transfer-Encoding: chunked (no Content-Length);
    else a Content-Length of ``total_bytes``; ``declare_only``: that header and no body at all.
    Returns {"status", "body", "sent_bytes"} (status None: no answer)."""
    import select
    from urllib.parse import urlsplit

    u = urlsplit(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    head = [f"{method} {path} HTTP/1.1", f"Host: {u.hostname}:{u.port}", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {total_bytes}")
    sent = 0
    try:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        piece = b'{"pad": "' + b" " * max(0, chunk_bytes - 9)
        sock.settimeout(5)
        while not declare_only and sent < total_bytes:
            if select.select([sock], [], [], 0)[0]:
                break  # an answer (or a close) before the body was all sent
            data = piece[: total_bytes - sent]
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            except (BrokenPipeError, ConnectionResetError, socket.timeout):
                break
            sent += len(data)
        else:
            if chunked and not declare_only:
                with contextlib.suppress(OSError):
                    sock.sendall(b"0\r\n\r\n")
        sock.settimeout(30)
        raw = b""
        try:
            while b"\r\n\r\n" not in raw or len(raw.split(b"\r\n\r\n", 1)[1]) < _content_length(raw):
                got = sock.recv(65536)
                if not got:
                    break
                raw += got
        except (ConnectionResetError, socket.timeout):
            pass
    finally:
        sock.close()
    if not raw.startswith(b"HTTP/1.1 "):
        return {"status": None, "body": raw[:500].decode(errors="replace"), "sent_bytes": sent}
    return {"status": int(raw.split(b" ", 2)[1]), "body": raw.split(b"\r\n\r\n", 1)[-1].decode(errors="replace"),
            "sent_bytes": sent}


def _content_length(raw: bytes) -> int:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return int(value.strip())
    return 0
