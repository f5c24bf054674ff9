"""Engine and session factory; the schema is made by Alembic (``upgrade(engine)``).

- ``make_engine(url)``: SQLite gets WAL, ``synchronous=NORMAL``, foreign keys, a busy timeout and
  a `WAL_SIZE_LIMIT` on every connection; servers checkpoint in the background (`checkpoint_wal`,
  which starts the WAL over every few MB; `reclaim_wal` after a full disk). PostgreSQL URLs are
  normalised to psycopg 3 (``postgresql+psycopg://``).
- ``session_factory(engine)``: ``Session`` objects with ``expire_on_commit=False``; callers (the
  API routes, the jobs) own the transaction: ``with factory.begin() as s: queries.f(s, ...)``.
- ``upgrade(engine)``: ``alembic upgrade head`` run in-process (the control plane calls it on
  start; concurrent replicas on PostgreSQL serialise on an advisory lock).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

DEFAULT_DATABASE_URL = "sqlite:///racer-control-plane.db"
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
MIGRATION_LOCK_KEY = 0x52414345  # "RACE": advisory lock taken while migrating on PostgreSQL
#: bytes a SQLite WAL file keeps after a checkpoint resets it (``journal_size_limit``), and past
#: which the background checkpointer forces that reset (TRUNCATE) instead of a passive checkpoint:
#: a WAL otherwise keeps its largest size for good, and on a full disk grows into whatever is freed
WAL_SIZE_LIMIT = 64 * 2**20
#: WAL bytes (frames since the WAL last started over) past which the checkpointer follows its
#: PASSIVE pass with a RESTART (`checkpoint_wal`), and the most it then waits for readers
WAL_RESTART_BYTES = 4 * 2**20
RESTART_WAIT_MS = 50


def normalize_url(url: str) -> str:
    """``postgres://`` / ``postgresql://`` -> ``postgresql+psycopg://`` (psycopg 3)."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def database_url(url: str | None = None) -> str:
    return normalize_url(url or os.environ.get("RACER_DATABASE_URL") or DEFAULT_DATABASE_URL)


def make_engine(url: str | None = None, *, pool_size: int = 10, background_checkpoint: bool = False) -> Engine:
    """``background_checkpoint`` (SQLite): connections never checkpoint the WAL on commit (which
    would fsync inside a writer's commit); a daemon thread checkpoints every second instead
    (`checkpoint_wal`), so the ingestion writer's commits stay short and the WAL starts over every
    few megabytes. For long-running servers only."""
    url = database_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # noqa: ANN001
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
            if background_checkpoint:
                cur.execute("PRAGMA wal_autocheckpoint=0")
            cur.close()

        if background_checkpoint:
            _start_checkpointer(engine)
        return engine
    if not url.startswith("postgresql"):
        raise ValueError(f"unsupported database URL {url!r}: use sqlite:///PATH or postgresql+psycopg://...")
    return create_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)


def _start_checkpointer(engine: Engine, period_s: float = 1.0) -> None:
    import threading
    import weakref

    ref = weakref.ref(engine)

    def run() -> None:
        while True:
            time.sleep(period_s)
            eng = ref()
            if eng is None:
                return
            try:
                checkpoint_wal(eng)
            except Exception:  # noqa: BLE001 - a busy or disposed database: try again later
                pass
            del eng

    threading.Thread(target=run, name="racer-sqlite-checkpoint", daemon=True).start()


def _wal_bytes(engine: Engine) -> int:
    path = engine.url.database
    try:
        return os.path.getsize(f"{path}-wal") if path and path != ":memory:" else 0
    except OSError:
        return 0


def checkpoint_wal(engine: Engine, restart_bytes: int = WAL_RESTART_BYTES,
                   restart_wait_ms: int = RESTART_WAIT_MS) -> str:
    """One pass of the background checkpointer (SQLite); returns what it did.

    A PASSIVE checkpoint copies the WAL's frames into the database without blocking anyone, but
    under a steady writer it never finishes (the writer appends while it copies), and SQLite starts
    the WAL over only after a finished one: the WAL grows until the TRUNCATE at `WAL_SIZE_LIMIT`
    holds the writer for seconds. So past ``restart_bytes`` of frames a RESTART follows the PASSIVE
    pass: it copies the few frames written meanwhile and makes the next writer start the WAL over,
    holding writers for that copy and at most ``restart_wait_ms`` more for readers still on old
    frames (it gives up, "restart-busy", rather than stall the ingestion writer behind a long
    read). Returns "truncate" or "truncate-busy" past `WAL_SIZE_LIMIT` (after a full disk),
    "restart" / "restart-busy", or "passive"."""
    if _wal_bytes(engine) > WAL_SIZE_LIMIT:
        return "truncate" if reclaim_wal(engine) else "truncate-busy"
    with engine.connect() as conn:
        _, frames, _ = conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        page = conn.exec_driver_sql("PRAGMA page_size").scalar()
        if frames * (page + 24) <= restart_bytes:
            return "passive"
        (timeout,) = conn.exec_driver_sql("PRAGMA busy_timeout").fetchone()
        conn.exec_driver_sql(f"PRAGMA busy_timeout={int(restart_wait_ms)}")
        try:
            busy, _, _ = conn.exec_driver_sql("PRAGMA wal_checkpoint(RESTART)").fetchone()
        finally:
            conn.exec_driver_sql(f"PRAGMA busy_timeout={int(timeout)}")
    return "restart-busy" if busy else "restart"


def reclaim_wal(engine: Engine) -> bool:
    """SQLite: copy the WAL into the database and truncate it to zero bytes (``wal_checkpoint
    (TRUNCATE)``, waiting up to the busy timeout for readers and writers); True when it did.
    After a full disk the WAL holds every page written since the last reset, and a write that
    grew it would take the space freed before the checkpoint could use it. Other databases:
    nothing to do (True)."""
    if engine.dialect.name != "sqlite":
        return True
    with engine.connect() as conn:
        busy, _, _ = conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    return not busy


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(engine: Engine):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to ``revision`` (Alembic, in this process)."""
    from alembic import command

    cfg = alembic_config(engine)
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
            conn.commit()
        try:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
            conn.commit()
        finally:
            if engine.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK_KEY})
                conn.commit()


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()
