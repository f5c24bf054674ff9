"""pytest plugin: CUDA's sync debug mode on, and its warnings counted per test.

    RACER_SYNC_DEBUG_OUT=counts.json python -m pytest -m cuda -p bench._sync_debug_plugin FILES...

(``python -m bench.gpu_check`` runs it so.) At the session's start, where torch sees a CUDA
device, ``torch.cuda.set_sync_debug_mode("warn")``: every operation that makes the host wait for
the device (``.item()``, ``.cpu()``, ``.tolist()``, a blocking copy, ``torch.cuda.synchronize``...)
warns ``called a synchronizing CUDA operation``. A filter makes every such warning show (Python
would show one per code line), and each is counted against the test it came from and the Python
line that called the operation. A warning from a line outside ``tests/`` is a sync in the code
under test (``outside_tests``): the hidden syncs; one from a test's own line is the test reading
a result (``.cpu()`` in an assert). Without CUDA the mode cannot be set (``mode`` is null and
``mode_reason`` says why): the counts are then zero by construction, not a finding.

The counts are written as JSON to ``$RACER_SYNC_DEBUG_OUT`` (nothing when unset) at the
session's end, and the mode is set back to ``default``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

SYNC_MESSAGE = "called a synchronizing CUDA operation"
ENV_OUT = "RACER_SYNC_DEBUG_OUT"
#: a filter (pytest's ``filterwarnings`` syntax) that shows every sync warning, not one per line
ALWAYS_FILTER = f"always:.*{SYNC_MESSAGE}"


def is_sync_warning(message) -> bool:
    return SYNC_MESSAGE in str(message)


class SyncDebugPlugin:
    """Counts sync warnings per test (``record``); ``to_dict`` is what is written."""

    def __init__(self, repo_root: str | Path, out: str | Path | None = None, *, enable_cuda: bool = True) -> None:
        self.repo = Path(repo_root).resolve()
        self.out = Path(out) if out else None
        self.enable_cuda = enable_cuda
        self.mode: str | None = None
        self.mode_reason = "not set yet"
        self.torch_version: str | None = None
        self.cuda_available = False
        self.per_test: dict[str, dict] = {}
        self.outcomes: dict[str, str] = {}
        self.outside_any_test: Counter = Counter()  # warnings while collecting or configuring
        self.outside_tests_locations: Counter = Counter()  # the hidden syncs' lines, over every test

    # ------------------------------------------------------------------------------ counting --
    def _where(self, filename: str | None, lineno: int | None) -> tuple[str, bool]:
        """``path:line`` (relative to the repository when inside it) and whether it is a test's line."""
        if not filename:
            return "?", False
        p = Path(filename)
        try:
            rel = p.resolve().relative_to(self.repo).as_posix()
        except (ValueError, OSError):
            rel = p.as_posix()
        in_tests = rel.startswith("tests/") or "/tests/" in rel or p.name.startswith("test_")
        return f"{rel}:{lineno}", in_tests

    def record(self, nodeid: str, message, filename: str | None = None, lineno: int | None = None) -> bool:
        """Count one warning if it is a sync warning; returns whether it was."""
        if not is_sync_warning(message):
            return False
        where, in_tests = self._where(filename, lineno)
        if not nodeid:
            self.outside_any_test[where] += 1
            return True
        row = self.per_test.setdefault(nodeid, {"sync_warnings": 0, "outside_tests": 0, "locations": Counter()})
        row["sync_warnings"] += 1
        row["outside_tests"] += 0 if in_tests else 1
        row["locations"][where] += 1
        if not in_tests:
            self.outside_tests_locations[where] += 1
        return True

    def to_dict(self) -> dict:
        tests = {}
        for nodeid in sorted(set(self.outcomes) | set(self.per_test)):
            row = self.per_test.get(nodeid, {"sync_warnings": 0, "outside_tests": 0, "locations": Counter()})
            tests[nodeid] = {"outcome": self.outcomes.get(nodeid, "unknown"), "sync_warnings": row["sync_warnings"],
                             "outside_tests": row["outside_tests"],
                             "locations": dict(row["locations"].most_common())}
        return {
            "message": SYNC_MESSAGE,
            "mode": self.mode,
            "mode_reason": self.mode_reason,
            "torch": self.torch_version,
            "cuda_available": self.cuda_available,
            "num_tests": len(self.outcomes),
            "outcomes": dict(Counter(self.outcomes.values())),
            "sync_warnings_total": (sum(r["sync_warnings"] for r in tests.values())
                                    + sum(self.outside_any_test.values())),
            "sync_warnings_outside_tests": sum(r["outside_tests"] for r in tests.values()),
            "outside_tests_locations": dict(self.outside_tests_locations.most_common()),
            "outside_any_test": dict(self.outside_any_test),
            "per_test": tests,
        }

    def write(self) -> None:
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    # ---------------------------------------------------------------------------- the mode --
    def enable(self) -> None:
        try:
            import torch
        except ImportError as e:
            self.mode_reason = f"torch not importable ({e})"
            return
        self.torch_version = torch.__version__
        self.cuda_available = bool(torch.cuda.is_available())
        if not self.enable_cuda:
            self.mode_reason = "not asked for"
        elif not self.cuda_available:
            self.mode_reason = (f"torch {torch.__version__} sees no CUDA device (torch.version.cuda "
                                f"{torch.version.cuda}): sync debug mode cannot be set; counts are zero by "
                                f"construction")
        else:
            torch.cuda.set_sync_debug_mode("warn")
            self.mode = "warn"
            self.mode_reason = f"torch.cuda.set_sync_debug_mode('warn') on {torch.cuda.get_device_name()}"

    def disable(self) -> None:
        if self.mode is not None:
            import torch

            torch.cuda.set_sync_debug_mode("default")

    # ------------------------------------------------------------------------- pytest hooks --
    def pytest_sessionstart(self, session) -> None:
        self.enable()

    def pytest_warning_recorded(self, warning_message, when, nodeid, location) -> None:
        self.record(nodeid, warning_message.message, warning_message.filename, warning_message.lineno)

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.outcomes[report.nodeid] = report.outcome
        elif report.when == "teardown" and report.failed:
            self.outcomes[report.nodeid] = "error"

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        self.disable()
        self.write()


def pytest_configure(config) -> None:
    config.addinivalue_line("filterwarnings", ALWAYS_FILTER)
    repo = Path(__file__).resolve().parent.parent
    config.pluginmanager.register(SyncDebugPlugin(repo, os.environ.get(ENV_OUT) or None), "racer-sync-debug")
