"""One way to pack an artifact (a policy's three files, a model checkpoint's directory) into a tar.

`pack_artifact` writes the canonical tar: names sorted, USTAR headers, times, owners and groups
zero, mode 0644, no compression. The same files give the same bytes, so the same digest. The
control plane stores every uploaded artifact in this form (`control_plane.artifacts`), the
registry client uploads in it (`racer policy push`, `racer model push`), and the dashboard's
download of an artifact is it.

The bounds on what an artifact may unpack to are here (``MAX_*``); the two readers apply them:
an upload's reader here, `unpack_artifact` (into memory: headers walked before inflating,
members and unpacked bytes bounded, regular files only; the upload check runs it in a child with
limits) and the node agent's `node_agent.downloads.unpack_artifact` (onto disk: members and bytes
bounded, no links or special files, no path that leaves the destination).
"""

from __future__ import annotations

import io
import os
import tarfile
import zlib
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


# ---- unpacking an upload, bounded
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


REQUIRED_FILES = ("manifest.json", "weights.pt", "config.json", "items.json")


def unpack_checkpoint(data: bytes, *, max_members: int = MAX_CHECKPOINT_MEMBERS,
                      max_bytes: int = MAX_CHECKPOINT_UNPACKED_BYTES) -> dict[str, bytes]:
    """A checkpoint's files from an uploaded tar (or tar.gz); ValueError says what is wrong."""
    return unpack_artifact(data, max_members=max_members, max_bytes=max_bytes, names=CHECKPOINT_FILES,
                           required=REQUIRED_FILES, what="model checkpoint", writer="racer model train")
