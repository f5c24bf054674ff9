"""The errors the ``racer`` command line prints without a traceback (one line, exit status 2)."""

from __future__ import annotations


class UsageError(Exception):
    """An error the user can fix (a missing file, a bad option, a busy port or folder): `racer.cli.main`
    prints it as one line on stderr and exits with status 2."""


class UpError(UsageError):
    """A problem with ``racer up`` the user can fix (bad option, unwritable data folder, busy folder
    or port); one line."""
