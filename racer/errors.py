"""The one error type the ``racer`` command line prints without a traceback."""

from __future__ import annotations


class UsageError(Exception):
    """An error the user can fix (a missing file, a bad option, a busy port or folder): `racer.cli.main`
    prints it as one line on stderr and exits with status 2."""
