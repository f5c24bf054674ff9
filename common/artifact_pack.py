"""One way to pack an artifact (a policy's three files, a model checkpoint's directory) into a tar.

`pack_artifact` writes the canonical tar: names sorted, USTAR headers, times, owners and groups
zero, mode 0644, no compression. The same files give the same bytes, so the same digest. The
control plane stores every uploaded artifact in this form (`control_plane.artifacts`), the
registry client uploads in it (`racer policy push`, `racer model push`), and the dashboard's
download of an artifact is it.

The bounds on what an artifact may unpack to are here (``MAX_*``); the two readers apply them:
the control plane's `control_plane.artifacts.unpack_artifact` (headers walked before inflating,
members and unpacked bytes bounded, regular files only) and the node agent's
`node_agent.downloads.unpack_artifact` (members and bytes bounded, no links or special files,
no path that leaves the destination).
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterable, Mapping
from pathlib import Path

# What an artifact may unpack to, checked from the tar headers before a member's bytes are read,
# by both readers. A policy artifact is three small files (a few KB to a few MB); a checkpoint a
# few files, its weights the largest.
MAX_ARTIFACT_MEMBERS = 64
MAX_ARTIFACT_UNPACKED_BYTES = 64 * 2**20
MAX_CHECKPOINT_MEMBERS = 32
MAX_CHECKPOINT_UNPACKED_BYTES = 256 * 2**20

#: a policy artifact's files (`racer policy export` writes them, `node_agent.artifact` reads them)
ARTIFACT_FILES = ("manifest.json", "policy.onnx", "golden.npz")
#: the files of a model checkpoint directory that go to the registry (`racer model train` writes
#: them; `racer model push` and racer up send them)
CHECKPOINT_FILES = ("manifest.json", "weights.pt", "config.json", "items.json", "figures.json")


def pack_artifact(files: Mapping[str, bytes]) -> bytes:
    """The canonical tar of ``files`` (name -> bytes): sorted names, zero times and owners, mode 0644."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(files):
            data = files[name]
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def pack_directory(src: Path, names: Iterable[str]) -> bytes:
    """The canonical tar of the named files of ``src`` that exist (`pack_artifact`)."""
    src = Path(src)
    return pack_artifact({name: (src / name).read_bytes() for name in names if (src / name).is_file()})
