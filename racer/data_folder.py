"""The data folder of ``racer up``: files written whole, secrets made once, one run at a time.

Every file is written whole or not at all (temp file in the same folder, fsync, rename); the
folder is proved writable before anything starts (`check_data_dir`); an exclusive lock on
``up.lock`` keeps a second ``racer up`` out of a folder in use (`DataLock`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path

from .errors import UpError


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` whole or not at all (temp file in the same folder, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def check_data_dir(data_dir: Path) -> None:
    """Create the folder if needed and prove it takes a real write (a probe of 64 KiB, fsynced):
    a read-only or full folder raises `UpError` with the reason before anything starts."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "logs").mkdir(exist_ok=True)
        write_atomic(data_dir / ".write-probe", "x" * 65536)
        os.unlink(data_dir / ".write-probe")
    except OSError as e:
        why = {errno.EROFS: "the file system is read-only", errno.ENOSPC: "no space left on the device",
               errno.EACCES: "permission denied", errno.EDQUOT: "disk quota exceeded"}.get(e.errno, e.strerror)
        raise UpError(f"data folder {data_dir} is not writable: {why} ({e.__class__.__name__}: {e}); "
                      f"free space or choose another with --data-dir") from None


def read_or_create_secret(path: Path, prefix: str) -> str:
    if path.exists():
        text = path.read_text().strip()
        if text:
            return text
    secret = prefix + secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, secret + "\n", mode=0o600)
    return secret


class DataLock:
    """One ``racer up`` per data folder: an exclusive flock on ``up.lock`` (released on exit, even
    a kill -9)."""

    def __init__(self, data_dir: Path) -> None:
        import fcntl

        self.path = data_dir / "up.lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise UpError(f"another racer up (pid {other}) is using {data_dir}; stop it or pass another "
                          f"--data-dir") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
