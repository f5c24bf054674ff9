"""The one grammar of the ids that name a thing in a URL path: node ids and policy ids (a policy
registry's versions). 1-128 ASCII letters, digits, ``_ . : -``, starting with a letter or digit:
no ``/``, ``?``, ``#``, ``%``, space, control character or non-ASCII letter, and never ``.`` or
``..``, so an id is one path segment as it stands (URLs still escape it, `path_segment`).
Model versions are SHA-256 digests (64 lowercase hex digits), a subset."""

from __future__ import annotations

import re
from urllib.parse import quote

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}$"
_ID = re.compile(ID_PATTERN)


def id_problem(value: object, what: str = "id") -> str | None:
    """Why ``value`` is not a valid id (None: it is)."""
    if not isinstance(value, str):
        return f"{what} must be a string, got {type(value).__name__}"
    if _ID.fullmatch(value) is None:
        shown = value if len(value) <= 40 else value[:40] + "..."
        return (f"{what} {shown!r} ({len(value)} characters) must be 1-128 ASCII letters, digits or _ . : -, "
                f"starting with a letter or digit")
    return None


def path_segment(value: str) -> str:
    """``value`` escaped as one URL path segment."""
    return quote(value, safe="")
