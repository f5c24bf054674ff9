"""Uploaded artifacts: policy artifacts (the three files `racer policy export` writes) and model
checkpoints (the directory `racer model train` writes), each uploaded as a tar and stored as one
canonical tar (`common.artifact_pack.pack_artifact`: same files, same bytes, same digest).

An upload is unpacked and checked in a child process with limits (`check_upload`): the node
agent's own check, ``python -m node_agent.upload_check KIND DIR`` (started by module name: the
control plane imports no node-agent code; what the two exchange is `common.contract`), reads
``DIR/upload``, unpacks it with `common.artifact_pack.unpack_artifact` (the tar headers walked
first, members and unpacked size bounded) and loads it as a node does. The child has an
address-space limit, a CPU-time limit and a wall-clock timeout (`CheckLimits`): a graph built to
exhaust memory, a tar built to take quadratic time, or a checker that hangs costs the child,
never the control plane, and the upload gets a 422 that says which limit it hit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

KINDS = ("policy", "model")
_OUT_OF_MEMORY = ("allocate memory", "Cannot allocate", "MemoryError", "failed to map segment", "bad_alloc")


@dataclass(frozen=True)
class CheckLimits:
    """``memory_bytes``: the child's address space (RLIMIT_AS); ``cpu_s``: its CPU seconds
    (RLIMIT_CPU); ``wall_s``: the wall-clock bound, after which it is killed."""
    memory_bytes: int = 4 * 2**30
    cpu_s: int = 60
    wall_s: float = 120.0


def _limit(limits: CheckLimits):
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 5))
        os.setpgrp()  # its own group: a timeout kills whatever it started too

    return apply


def check_upload(kind: str, data: bytes, *, active_manifest: dict | None = None,
                 limits: CheckLimits = CheckLimits()) -> tuple[dict[str, bytes], dict]:
    """(files, manifest) of an uploaded ``kind`` (``policy`` or ``model``) checked in a child
    process (see the module docstring); ValueError with the reason it is refused."""
    if kind not in KINDS:
        raise ValueError(f"unknown artifact kind {kind!r}")
    what = "policy artifact" if kind == "policy" else "model checkpoint"
    with tempfile.TemporaryDirectory(prefix=f"racer-check-{kind}-") as d:
        root = Path(d)
        (root / "upload").write_bytes(data)
        if active_manifest is not None:
            (root / "active.json").write_text(json.dumps(active_manifest))
        env = {k: v for k, v in os.environ.items() if not k.startswith("RACER_")}  # no secrets in the child
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        proc = subprocess.Popen([sys.executable, "-m", "node_agent.upload_check", kind, d],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env=env, preexec_fn=_limit(limits))
        try:
            _, err = proc.communicate(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise ValueError(f"checking the {what} took more than {limits.wall_s:g} s (the check's time limit)") from None
        rc = proc.returncode
        if rc == 0:
            manifest = json.loads((root / "manifest.json").read_text())
            files = {p.name: p.read_bytes() for p in sorted((root / "out").iterdir())}
            return files, manifest
        if rc == 1 and (root / "error.txt").exists():
            raise ValueError(_memory_noted((root / "error.txt").read_text()[:4000], limits))
        if rc == 3 or (rc < 0 and -rc in (signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)):
            raise ValueError(f"checking the {what} ran out of its memory limit ({limits.memory_bytes // 2**20} MiB)")
        if rc < 0 and -rc == signal.SIGXCPU:
            raise ValueError(f"checking the {what} used more than {limits.cpu_s} s of CPU (the check's limit)")
        tail = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
        raise ValueError(_memory_noted(f"checking the {what} failed (exit {rc}{': ' + tail[0][:300] if tail else ''})",
                                       limits))


def _memory_noted(why: str, limits: CheckLimits) -> str:
    """``why``, with the memory limit named when it tells of an allocation the limit refused."""
    if any(m in why for m in _OUT_OF_MEMORY):
        why += f" (the check's memory limit is {limits.memory_bytes // 2**20} MiB)"
    return why
