"""Uploaded artifacts: policy artifacts (the three files `racer policy export` writes) and model
checkpoints (the directory `racer model train` writes), each uploaded as a tar and stored as one
canonical tar (`common.artifact_pack.pack_artifact`: same files, same bytes, same digest).

An upload is unpacked and checked in a child process with limits (`check_upload`): ``python -m
control_plane.artifacts KIND DIR`` reads ``DIR/upload`` (the body as received), unpacks it
(`unpack_artifact`: the tar headers walked first, members and unpacked size bounded), checks it as
a node agent would load it (a policy: ONNX checker, operator allowlist, an ONNX Runtime session,
golden parity; a checkpoint: every digest, the config against the weights, and fit with the active
model), and writes the files to ``DIR/out/`` and the manifest to ``DIR/manifest.json``; a
refusal's reason goes to ``DIR/error.txt`` (exit 1). The child has an address-space limit, a
CPU-time limit and a wall-clock timeout (`CheckLimits`): a graph built to exhaust memory, a tar
built to take quadratic time, or a checker that hangs costs the child, never the control plane,
and the upload gets a 422 that says which limit it hit. This module imports no web framework, so
the child starts quickly.

The checks are the node agent's own loaders (`node_agent.allocator.OnnxPolicy`,
`node_agent.model.checkpoint.load_checkpoint`), imported in the child only: an artifact the
control plane accepts is one a node loads, with no second copy of the checks to drift from them.
These are the control plane's only imports of node-agent code; what the two exchange over the
network is `common.contract`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

# the files an artifact holds and the bounds on what it unpacks to
from common.artifact_pack import (ARTIFACT_FILES, CHECKPOINT_FILES, MAX_ARTIFACT_MEMBERS, MAX_ARTIFACT_UNPACKED_BYTES,
                                  MAX_CHECKPOINT_MEMBERS, MAX_CHECKPOINT_UNPACKED_BYTES)


# ------------------------------------------------------------------------------------ policies
#: most bytes of a tar extension header (a PAX ``x``/``g`` record set, a GNU ``L``/``K`` long name):
#: an artifact's names are short, and Python's tarfile parses these with a regular expression whose
#: cost grows with their size (CVE-2024-6232 in Python before 3.12.6 / 3.11.10: a 232-byte gzip
#: upload froze the control plane 12.9 s)
MAX_EXTENSION_BYTES = 4096
_EXTENSION_TYPES = {b"x": "PAX header", b"g": "PAX global header", b"L": "GNU long name", b"K": "GNU long link"}


def check_tar_headers(data: bytes, max_bytes: int, max_extension_bytes: int = MAX_EXTENSION_BYTES,
                      what: str = "policy artifact") -> None:
    """Walk the archive's 512-byte headers (inflating a gzip'd one: at most ``max_bytes`` of
    members and 1 MiB of headers and padding) before tarfile reads it: ValueError for an
    extension header past ``max_extension_bytes`` or an archive that unpacks past that. Linear
    in the archive's size; anything else (not a tar, truncated) is left to tarfile to refuse."""
    if data[:2] == b"\x1f\x8b":
        d = zlib.decompressobj(wbits=31)
        limit = max_bytes + 2**20
        try:
            raw = d.decompress(data, limit + 1)
        except zlib.error:
            return  # tarfile says what is wrong
        if len(raw) > limit or d.unconsumed_tail:
            raise ValueError(f"body: the archive unpacks to more than {max_bytes} bytes (a {what} is smaller)")
    else:
        raw = data
    pos = 0
    while pos + 512 <= len(raw):
        block = raw[pos:pos + 512]
        if block == bytes(512):
            return
        size_field = block[124:136]
        if size_field[:1] and size_field[0] & 0x80:  # base-256 (GNU): a size no artifact member has
            raise ValueError("body: a tar member declares a size in base-256 (over 8 GB)")
        try:
            size = int(size_field.split(b"\0", 1)[0].strip() or b"0", 8)
        except ValueError:
            return
        kind = _EXTENSION_TYPES.get(block[156:157])
        if kind is not None and size > max_extension_bytes:
            raise ValueError(f"body: a {kind} of {size} bytes (at most {max_extension_bytes})")
        pos += 512 + -(-size // 512) * 512


def unpack_artifact(data: bytes, *, max_members: int = MAX_ARTIFACT_MEMBERS,
                    max_bytes: int = MAX_ARTIFACT_UNPACKED_BYTES, names: tuple[str, ...] = ARTIFACT_FILES,
                    required: tuple[str, ...] | None = None, what: str = "policy artifact",
                    writer: str = "racer policy export") -> dict[str, bytes]:
    """The artifact's files (``names``; all of ``required``, default all of them) from an uploaded
    tar (optionally gzip'd; a top directory is allowed). Raises ValueError saying what is wrong:
    not a tar, truncated, more than ``max_members`` members, or members whose sizes add up to more
    than ``max_bytes`` (a decompression bomb is refused from its headers, before its bytes are
    inflated). The model registry unpacks checkpoints with it too (``what``, ``writer``)."""
    check_tar_headers(data, max_bytes, what=what)
    files: dict[str, bytes] = {}
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as tar:  # a stream: members in order, no seeking
            for k, m in enumerate(tar, start=1):
                if k > max_members:
                    raise ValueError(f"body: more than {max_members} members (a {what} has {len(names)})")
                total += max(0, int(m.size))
                if total > max_bytes:
                    raise ValueError(f"body: the archive unpacks to more than {max_bytes} bytes (a {what} is "
                                     f"smaller)")
                base = os.path.basename(m.name.rstrip("/"))
                if base not in names:
                    continue
                if not m.isreg():
                    raise ValueError(f"body: {m.name} is not a regular file")
                if base in files:
                    raise ValueError(f"body: {base} appears twice")
                f = tar.extractfile(m)
                files[base] = f.read(m.size + 1) if f is not None else b""
                if len(files[base]) != m.size:
                    raise ValueError(f"body: {m.name} is truncated ({len(files[base])} of {m.size} bytes)")
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise ValueError(f"body: not a complete tar archive of a {what} ({type(e).__name__}: {e})") from None
    missing = [f for f in (names if required is None else required) if f not in files]
    if missing:
        raise ValueError(f"body: the {what} lacks {', '.join(missing)} (expected the files `{writer}` "
                         f"writes: {', '.join(names)})")
    return files


@contextlib.contextmanager
def _written(files: dict[str, bytes], prefix: str):
    """A temporary directory holding ``files``, for a loader that reads a directory; a ValueError
    raised inside names ``<upload>`` instead of the directory."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        for name, data in files.items():
            (Path(d) / name).write_bytes(data)
        try:
            yield d
        except ValueError as e:
            raise ValueError(str(e).replace(d, "<upload>")) from None


def verify_files(files: dict[str, bytes]) -> dict:
    """Check an artifact as the node agent does before using it (manifest, sha256, onnx.checker,
    I/O names/shapes/types, golden parity, finite probe outputs); returns the manifest."""
    from node_agent.allocator import OnnxPolicy  # the node's own loader (see the module docstring)

    with _written(files, "racer-policy-") as d:
        return dict(OnnxPolicy(d, device="cpu").manifest)  # PolicyLoadError is a ValueError


# --------------------------------------------------------------------------------- checkpoints
REQUIRED_FILES = ("manifest.json", "weights.pt", "config.json", "items.json")


def unpack_checkpoint(data: bytes, *, max_members: int = MAX_CHECKPOINT_MEMBERS,
                      max_bytes: int = MAX_CHECKPOINT_UNPACKED_BYTES) -> dict[str, bytes]:
    """A checkpoint's files from an uploaded tar (or tar.gz); ValueError says what is wrong."""
    return unpack_artifact(data, max_members=max_members, max_bytes=max_bytes, names=CHECKPOINT_FILES,
                           required=REQUIRED_FILES, what="model checkpoint", writer="racer model train")


def verify_checkpoint(files: dict[str, bytes], active_manifest: dict | None) -> dict:
    """Load the checkpoint as a node agent does (every digest checked); when a model is active,
    the new one must have its item count, item mapping and model config. Returns the manifest."""
    from node_agent.model.checkpoint import load_checkpoint  # the node's own loader (see the module docstring)

    with _written(files, "racer-model-") as d:
        m = dict(load_checkpoint(d).manifest)  # CheckpointError is a ValueError
    if active_manifest is not None:
        a = active_manifest
        if a.get("num_items") != m.get("num_items"):
            raise ValueError(f"trained on {m.get('num_items')} items, the active model (and the nodes serving it) "
                             f"on {a.get('num_items')}: train it on the trace the fleet serves")
        if a.get("item_keys_sha256") != m.get("item_keys_sha256"):
            raise ValueError("its item-id mapping differs from the active model's (another trace or item order)")
        ca, cm = a.get("model_config"), _config(files.get("config.json"))
        if ca is not None and cm is not None and ca != cm:
            raise ValueError(f"its model config differs from the active model's ({cm} vs {ca}): the nodes' memory "
                             "layout holds the active one")
    return m


def _config(raw: bytes | None) -> dict | None:
    try:
        return json.loads(raw) if raw is not None else None
    except ValueError:
        return None


# --------------------------------------------------------------------------- checked apart
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
        proc = subprocess.Popen([sys.executable, "-m", "control_plane.artifacts", kind, d],
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


def _child(kind: str, d: str) -> int:
    root = Path(d)
    try:
        data = (root / "upload").read_bytes()
        if kind == "policy":
            files = unpack_artifact(data)
            manifest = verify_files(files)
        else:
            active = json.loads((root / "active.json").read_text()) if (root / "active.json").exists() else None
            files = unpack_checkpoint(data)
            manifest = verify_checkpoint(files, active)
    except ValueError as e:
        (root / "error.txt").write_text(str(e))
        return 1
    except MemoryError:
        return 3
    out = root / "out"
    out.mkdir()
    for name, blob in files.items():
        (out / name).write_bytes(blob)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
