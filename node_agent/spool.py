"""The node's report spool: the reports not yet acknowledged by the control plane, and the
sequence counter, in one state folder; both survive a restart of the agent, a kill -9 and a
crash of the machine.

Durability: every file is written whole to a temporary name, flushed and fsync'd, renamed into
place, and the folder fsync'd (`write_durably`), so after any crash a spooled report's file holds
the whole report or is absent, and a rename the spool reported done is on the disk. The counter
(``state.json``) is kept before the report that takes the number is written: a crash between the
two leaves a gap in the numbers, never a number given to two reports. The control plane stores a
report once per (node id, seq), so a report sent again after a lost answer is stored once.
tests/test_spool_crash.py kills writers and agents with SIGKILL at random points and compares
what was stored with what was written.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from pathlib import Path

from common.contract import MAX_SEQ

log = logging.getLogger("racer.node_agent.spool")

#: most reports kept in memory when the disk refuses them (``ReporterConfig.max_memory_reports``)
DEFAULT_MEMORY_REPORTS = 2_000


def fsync_dir(directory: Path) -> None:
    """Make the folder's entries (a rename, a new file) durable; a filesystem that cannot fsync a
    folder is logged, not fatal (the file itself was fsync'd)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:
        log.warning("could not open %s to fsync it: %s", directory, e)
        return
    try:
        os.fsync(fd)
    except OSError as e:
        log.warning("could not fsync the folder %s: %s", directory, e)
    finally:
        os.close(fd)


def write_durably(path: Path, data: str, tmp: Path | None = None) -> None:
    """Write ``data`` to ``path`` whole: a temporary file (``tmp``, default ``path`` + ``.tmp``)
    written, fsync'd and renamed over ``path``, then the folder fsync'd. OSError when the disk
    refuses; the temporary file is removed then."""
    tmp = tmp if tmp is not None else path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


class ReportSpool:
    """The report buffer and sequence counter of one node (one directory), on disk where it can be.

    ``state.json`` holds ``next_seq`` and ``num_dropped``; ``spool/<seq>.json`` one report each.
    `append` assigns the next sequence number, keeps the counter first (a crash then leaves a
    gap, never a reused number), then writes the report (`write_durably`).

    A report the disk refuses (full, read-only, gone) is kept in memory instead and sent like the
    others: the spool is the on-disk files plus that in-memory part, in one sequence order. The
    in-memory part holds at most ``max_memory_reports``; the whole spool at most ``max_reports``.
    Beyond either bound the oldest report (of the part over its bound) is deleted and counted in
    ``num_dropped``. ``num_unspooled`` counts the reports the disk refused (kept in memory);
    ``disk_error`` is the last refusal, None once a write succeeds again. Without a writable
    ``state.json`` the counter lives in memory; the control plane's ``last_report_seq`` at the
    next registration keeps numbers from being reused after a restart. Used by the reporter
    thread only.
    """

    def __init__(self, directory: str | Path, max_reports: int, max_memory_reports: int | None = None) -> None:
        self.dir = Path(directory)
        self.spool = self.dir / "spool"
        self.max_reports = max_reports
        self.max_memory_reports = min(max_reports, max_memory_reports or DEFAULT_MEMORY_REPORTS)
        self.disk_error: str | None = None
        self.num_unspooled = 0
        self._mem: dict[int, dict] = {}  # seq -> report the disk refused, in insertion (= seq) order
        try:
            self.spool.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._disk_failed("create the spool folder", e)
        state = {}
        sp = self.dir / "state.json"
        if sp.exists():
            try:
                state = json.loads(sp.read_text())
            except (OSError, ValueError) as e:
                log.error("unreadable %s (%s): sequence numbers continue after the spool's", sp, e)
        for tmp in self.spool.glob("*.tmp"):  # a write a crash cut short: its number was never used
            tmp.unlink(missing_ok=True)
        self._seqs: deque[int] = deque(sorted(int(p.stem) for p in self.spool.glob("*.json") if p.stem.isdigit()))
        self.next_seq = max(int(state.get("next_seq", 0)), (self._seqs[-1] + 1) if self._seqs else 0)
        self.num_dropped = int(state.get("num_dropped", 0))
        while len(self._seqs) > self.max_reports:
            self._drop_oldest()
        self._save_state()

    def __len__(self) -> int:
        return len(self._seqs) + len(self._mem)

    @property
    def num_in_memory(self) -> int:
        return len(self._mem)

    def _path(self, seq: int) -> Path:
        return self.spool / f"{seq:010d}.json"

    def _disk_failed(self, what: str, e: OSError) -> None:
        msg = f"could not {what} in {self.dir}: {e}"
        if self.disk_error is None:  # once per episode, not once per report
            log.error("%s; reports are kept in memory (at most %d) and sent from there", msg,
                      self.max_memory_reports)
        self.disk_error = msg

    def _save_state(self) -> None:
        try:
            write_durably(self.dir / "state.json", json.dumps({"next_seq": self.next_seq,
                                                                "num_dropped": self.num_dropped}))
        except OSError as e:
            self._disk_failed("save state.json", e)

    def _drop_oldest(self, memory_only: bool = False) -> None:
        oldest_mem = next(iter(self._mem), None)
        if memory_only or not self._seqs or (oldest_mem is not None and oldest_mem < self._seqs[0]):
            del self._mem[oldest_mem]
        else:
            seq = self._seqs.popleft()
            self._path(seq).unlink(missing_ok=True)
        self.num_dropped += 1

    def raise_next_seq(self, at_least: int) -> None:
        """Never send a number the control plane has already seen (e.g. after the state was lost)."""
        if at_least > self.next_seq:
            self.next_seq = at_least
            self._save_state()

    def append(self, report: dict) -> int:
        """Number ``report`` and keep it (on disk, else in memory); returns its sequence number.
        When this returns, the report is on the disk (or, the disk refusing, in memory)."""
        seq = self.next_seq
        if seq > MAX_SEQ:
            raise OverflowError("report sequence numbers exhausted")
        self.next_seq = seq + 1
        while len(self) >= self.max_reports:
            self._drop_oldest()
        self._save_state()
        body = dict(report, seq=seq)
        try:
            write_durably(self._path(seq), json.dumps(body), tmp=self.spool / f"{seq:010d}.tmp")
        except OSError as e:
            self._disk_failed(f"spool report {seq}", e)
            self.num_unspooled += 1
            while len(self._mem) >= self.max_memory_reports:
                self._drop_oldest(memory_only=True)
            self._mem[seq] = body
            return seq
        if self.disk_error is not None:
            log.warning("the spool is writable again (%s)", self.dir)
            self.disk_error = None
        self._seqs.append(seq)
        return seq

    def peek(self, n: int) -> list[dict]:
        """The oldest ``n`` reports, in sequence order, from disk or memory (unreadable files are
        dropped and counted)."""
        out = []
        disk = list(self._seqs)[: n]
        seqs = sorted(disk + list(self._mem)[: n])[: n] if self._mem else disk
        for seq in seqs:
            if seq in self._mem:
                out.append(self._mem[seq])
                continue
            try:
                out.append(json.loads(self._path(seq).read_text()))
            except (OSError, ValueError) as e:
                log.error("dropping unreadable spooled report %d: %s", seq, e)
                self.remove([seq])
                self.num_dropped += 1
                self._save_state()
        return out

    def remove(self, seqs) -> None:
        """Delete acknowledged reports. A deletion a crash undoes only sends the report again,
        which the control plane stores once: the folder is not fsync'd here."""
        gone = set(seqs)
        for s in gone:
            if self._mem.pop(s, None) is None:
                try:
                    self._path(s).unlink(missing_ok=True)
                except OSError as e:
                    log.error("could not delete spooled report %d: %s", s, e)
        self._seqs = deque(s for s in self._seqs if s not in gone)
