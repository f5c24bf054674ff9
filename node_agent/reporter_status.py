"""What the reporter says about its link to the control plane (the agent's ``/v1/metrics``
``control_plane`` part): shared by the reporter thread and the directives it applies, behind
one lock, read by the agent's HTTP threads."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("racer.node_agent.reporter")

#: most recent events kept (registrations, overrides, policy and model loads)
MAX_EVENTS = 20


@dataclass
class ReporterStatus:
    registered: bool = False
    connected: bool = False
    last_error: str | None = None
    last_success_s: float | None = None
    num_sent: int = 0
    num_report_posts: int = 0  # report requests the control plane acknowledged
    num_duplicates: int = 0
    num_rejected: int = 0
    num_send_errors: int = 0
    num_directive_pulls: int = 0
    policy_version: str | None = None
    policy_error: str | None = None
    override: dict | None = None
    events: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    wall_clock: Callable[[], float] | None = field(default=None, repr=False, compare=False)

    def update(self, **values) -> None:
        """Set fields under the lock."""
        with self.lock:
            for k, v in values.items():
                setattr(self, k, v)

    def add(self, **counts: int) -> None:
        """Add to counters under the lock."""
        with self.lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def event(self, msg: str) -> None:
        log.info("%s", msg)
        with self.lock:
            self.events = (self.events + [{"t_s": self.wall_clock(), "event": msg}])[-MAX_EVENTS:]

    def error(self, msg: str) -> None:
        """A call to the control plane failed (unreachable, or refused)."""
        with self.lock:
            self.connected = False
            self.last_error = msg
            self.num_send_errors += 1

    def ok(self) -> None:
        """A call to the control plane succeeded."""
        with self.lock:
            self.connected = True
            self.last_success_s = self.wall_clock()
