"""Artifacts a node downloads from the control plane: a policy (named by its version) or a model
checkpoint (named by its digest), each a tar (`common.artifact_pack`).

`download_artifact` fetches the archive, checks its SHA-256 against the digest the directive
names, and unpacks it (`unpack_artifact`) into a fresh folder of the state folder
(``policies/`` or ``models/``). The unpacking keeps the bounds the control plane's reader keeps
(`common.artifact_pack.unpack_artifact`): at most `MAX_ARTIFACT_MEMBERS` members and
`MAX_ARTIFACT_UNPACKED_BYTES` bytes for a policy, `MAX_CHECKPOINT_MEMBERS` and
`MAX_CHECKPOINT_UNPACKED_BYTES` for a checkpoint, counted from the headers before a member is
read; links, special files and paths that leave the folder are refused.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
import zipfile
from pathlib import Path
from urllib.parse import urljoin

from common.artifact_pack import (MAX_ARTIFACT_MEMBERS, MAX_ARTIFACT_UNPACKED_BYTES, MAX_CHECKPOINT_MEMBERS,
                                  MAX_CHECKPOINT_UNPACKED_BYTES)

#: (most members, most unpacked bytes) of a download, by kind
LIMITS = {"policy": (MAX_ARTIFACT_MEMBERS, MAX_ARTIFACT_UNPACKED_BYTES),
          "model": (MAX_CHECKPOINT_MEMBERS, MAX_CHECKPOINT_UNPACKED_BYTES)}


def safe_name(name: str) -> str:
    """``name`` as one file name: letters, digits and ``. _ -``, at most 100 characters."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:100]


class _Budget:
    """Counts an archive's members and bytes from their headers; RuntimeError past a bound."""

    def __init__(self, max_members: int, max_bytes: int) -> None:
        self.max_members, self.max_bytes = max_members, max_bytes
        self.num_members = self.num_bytes = 0

    def take(self, name: str, size: int) -> None:
        self.num_members += 1
        self.num_bytes += max(0, int(size))
        if self.num_members > self.max_members:
            raise RuntimeError(f"artifact archive holds more than {self.max_members} members")
        if self.num_bytes > self.max_bytes:
            raise RuntimeError(f"artifact archive unpacks to more than {self.max_bytes} bytes (at {name})")


def _zip_members(data: bytes, budget: _Budget) -> list[tuple[str, bytes]]:
    members = []
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        infos = [i for i in z.infolist() if not i.is_dir()]
        for info in infos:
            budget.take(info.filename, info.file_size)
        for info in infos:
            members.append((info.filename, z.read(info)))  # read stops at the declared size
    return members


def _tar_members(data: bytes, budget: _Budget) -> list[tuple[str, bytes]]:
    members = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as t:  # a stream: headers in order
            for m in t:
                if m.issym() or m.islnk():
                    raise RuntimeError(f"policy archive holds a link: {m.name}")
                if m.isdir():
                    continue
                if not m.isreg():
                    raise RuntimeError(f"artifact archive holds a special file: {m.name}")
                budget.take(m.name, m.size)
                members.append((m.name, t.extractfile(m).read(m.size)))
    except (tarfile.TarError, EOFError, OSError) as e:
        raise RuntimeError(f"policy artifact is neither a zip nor a tar archive: {e}") from None
    return members


def unpack_artifact(data: bytes, dest: Path, *, max_members: int = MAX_ARTIFACT_MEMBERS,
                    max_bytes: int = MAX_ARTIFACT_UNPACKED_BYTES) -> None:
    """Unpack an artifact archive (tar, tar.gz or zip) into ``dest``: its files (policy.onnx,
    golden.npz, manifest.json; a checkpoint's) end up directly in ``dest`` (one top folder is
    stripped). More than ``max_members`` members or ``max_bytes`` bytes, links, special files and
    paths that leave ``dest`` are refused (RuntimeError)."""
    budget = _Budget(max_members, max_bytes)
    # by the leading magic bytes: a tar holding golden.npz (itself a zip) would pass is_zipfile
    members = _zip_members(data, budget) if data[:4] == b"PK\x03\x04" else _tar_members(data, budget)
    if not members:
        raise RuntimeError("policy archive is empty")
    parts = [Path(n).parts for n, _ in members]
    strip = 1 if all(len(p) > 1 for p in parts) and len({p[0] for p in parts}) == 1 else 0
    for (name, blob), p in zip(members, parts):
        rel = Path(*p[strip:])
        if rel.is_absolute() or ".." in rel.parts:
            raise RuntimeError(f"policy archive path leaves the artifact: {name}")
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(blob)


def download_artifact(client, control_plane_url: str, state_dir: str | Path, version: str, digest: str, url: str,
                      kind: str = "policy") -> Path:
    """Fetch ``url`` (absolute, or relative to the control plane) with ``client`` (an
    ``httpx.Client``), check the SHA-256 against ``digest`` (``sha256:`` prefix optional), unpack
    it into ``state_dir/policies/`` or ``state_dir/models/`` and return that folder. RuntimeError
    says what failed."""
    full = url if url.startswith(("http://", "https://")) else urljoin(control_plane_url + "/", url.lstrip("/"))
    r = client.get(full)
    if r.status_code != 200:
        raise RuntimeError(f"download of {kind} {version}: HTTP {r.status_code}: {r.text[:300]}")
    data = r.content
    want = digest.split(":", 1)[1] if digest.startswith("sha256:") else digest
    got = hashlib.sha256(data).hexdigest()
    if got != want.lower():
        raise RuntimeError(f"{kind} {version}: digest mismatch: got sha256 {got}, expected {want}")
    dest = Path(state_dir) / ("policies" if kind == "policy" else "models") / f"{safe_name(version)[:64]}-{got[:16]}"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    max_members, max_bytes = LIMITS[kind]
    unpack_artifact(data, dest, max_members=max_members, max_bytes=max_bytes)
    return dest
