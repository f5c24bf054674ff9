"""Secrets a process is started with (bearer tokens), taken where ``ps`` cannot show them.

``add_secret_arguments`` gives a command ``--NAME-file PATH`` beside ``--NAME``; `read_secret`
takes the flag, else the file (its first line, at most 4 KiB), else the environment variable. A
secret on the command line shows in ``ps`` to every local user: it still works, with a warning.

The *fleet token* is the one the gateway and the node agents share (``RACER_FLEET_TOKEN``): it
guards what names users or node addresses (an agent's ``/v1/residency`` and ``/v1/admin/reset``,
the gateway's ``GET /v1/router``). A process bound to a non-loopback address refuses to start
without one (`require_fleet_token`); on loopback without one those views are open to local
callers, and the process says so at start. ``racer up`` always draws one.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import sys

MAX_SECRET_FILE_BYTES = 4096
FLEET_TOKEN_ENV = "RACER_FLEET_TOKEN"


def add_secret_arguments(group, name: str, env: str, what: str, *, file_only: bool = False) -> None:
    """``--NAME`` (unless ``file_only``) and ``--NAME-file`` on an argparse group."""
    dest = name.replace("-", "_")
    if not file_only:
        group.add_argument(f"--{name}", dest=dest, default=None,
                           help=f"{what} (shows in ps: prefer --{name}-file or ${env})")
    else:
        group.set_defaults(**{dest: None})
    group.add_argument(f"--{name}-file", dest=f"{dest}_file", default=None, metavar="PATH",
                       help=f"file whose first line is the {what} (default: ${env})")


def read_secret(args, name: str, env: str, prog: str = "racer") -> str | None:
    """The secret ``--NAME``, else ``--NAME-file``'s first line, else ``$env``; None when none is
    given. ValueError for a file that cannot be read, is larger than 4 KiB or holds no line."""
    dest = name.replace("-", "_")
    value = getattr(args, dest, None)
    if value:
        print(f"{prog}: warning: --{name} shows in ps to every local user; use --{name}-file or ${env}",
              file=sys.stderr, flush=True)
        return value
    path = getattr(args, f"{dest}_file", None)
    if path:
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_SECRET_FILE_BYTES + 1)
        except OSError as e:
            raise ValueError(f"--{name}-file {path}: {e.strerror or e}") from None
        if len(data) > MAX_SECRET_FILE_BYTES:
            raise ValueError(f"--{name}-file {path}: larger than {MAX_SECRET_FILE_BYTES} bytes (a token is one line)")
        lines = data.decode("utf-8", "replace").strip().splitlines()
        if not lines or not lines[0].strip():
            raise ValueError(f"--{name}-file {path}: empty (expected the {name.replace('-', ' ')} on its first line)")
        return lines[0].strip()
    return os.environ.get(env) or None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address to listen on) is only reachable from this machine."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def require_fleet_token(token: str | None, host: str, what: str) -> None:
    """ValueError when ``what`` would listen on a non-loopback ``host`` without a fleet token."""
    if not token and not is_loopback(host):
        raise ValueError(f"{what} listens on {host} without a fleet token: its user and node views would be open "
                         f"to the network. Give --fleet-token-file PATH or ${FLEET_TOKEN_ENV} (the same on the "
                         f"gateway and every agent), or listen on 127.0.0.1")


def bearer_ok(authorization: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``token`` (always, when there is no token)."""
    if not token:
        return True
    return secrets.compare_digest((authorization or "").encode(), f"Bearer {token}".encode())
