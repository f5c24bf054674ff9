"""Run the control plane: ``racer control-plane`` / ``python -m control_plane.main``."""

from __future__ import annotations

import argparse
import logging
import sys

from common.config import default_of

from .settings import Settings


def serve(settings: Settings, *, log_level: str = "warning") -> None:
    from common.http_server import serve_forever  # the shared TCP_NODELAY-correct helper

    from .api import asgi_app

    app = asgi_app(settings)
    serve_forever(app, host=settings.host, port=settings.port, log_level=log_level, timeouts=http_timeouts(settings),
                  native=getattr(app, "native", None))


def http_timeouts(settings: Settings, environ=None):
    """`common.http_server.HttpTimeouts` from the environment, with an idle kept-alive
    connection living past ``send_period_s`` (plus 5 s) unless ``RACER_HTTP_KEEP_ALIVE_S`` says
    otherwise: a node sends once a send period on its kept-alive connection, and one closed just
    as it sends costs the node a failed request and a new connection."""
    import dataclasses
    import os

    from common.http_server import HttpTimeouts

    env = os.environ if environ is None else environ
    t = HttpTimeouts.from_env(env)
    if settings.send_period_s is not None and not env.get("RACER_HTTP_KEEP_ALIVE_S"):
        t = dataclasses.replace(t, keep_alive_s=max(t.keep_alive_s, settings.send_period_s + 5.0))
    return t


def add_args(p: argparse.ArgumentParser) -> None:
    """The options override ``RACER_*`` environment variables, which override `Settings`' defaults
    (so an option's own default is None; its help shows the Settings default)."""
    host, port = default_of(Settings, "host"), default_of(Settings, "port")
    p.add_argument("--db", default=None, help="database URL (default $RACER_DATABASE_URL or sqlite:///racer-control-plane.db)")
    p.add_argument("--host", default=None, help=f"listen address (default $RACER_HOST or {host})")
    p.add_argument("--port", type=int, default=None, help=f"port (default $RACER_PORT or {port})")
    jobs = p.add_mutually_exclusive_group()
    jobs.add_argument("--no-scheduler", action="store_true", help="serve the API only, never run the jobs")
    jobs.add_argument("--jobs-only", action="store_true",
                      help="run the jobs only (elected as any replica), serving /healthz and /metrics but not the "
                           "API: the API replicas then run with --no-scheduler")
    p.add_argument("--secret-key-file", default=None, metavar="PATH",
                   help="the key routers' push tokens are derived from (made, mode 0600, when missing; default "
                        "$RACER_SECRET_KEY, else <database file>.key beside a SQLite database, else pushes are off)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")


def settings_from_args(args) -> Settings:
    kw = dict(database_url=args.db, host=args.host, port=args.port, secret_key_file=args.secret_key_file)
    if args.no_scheduler:
        kw["scheduler"] = False
    if args.jobs_only:
        kw["scheduler"], kw["serve_api"] = True, False
    return Settings.from_env(**kw)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="racer control-plane")
    add_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("apscheduler", "alembic", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    why = database_problem(settings.database_url)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    serve(settings, log_level=args.log_level)
    return 0


def database_problem(url: str) -> str | None:
    """Why the database at ``url`` cannot be used (one line: a corrupted file, an unreachable
    server), or None. Checked before serving, so the answer is that line, not a traceback from
    the server's start-up."""
    from sqlalchemy import text
    from sqlalchemy.exc import SQLAlchemyError

    from db.engine import make_engine

    try:
        engine = make_engine(url)
    except ValueError as e:
        return str(e)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1")).first()
            if engine.dialect.name == "sqlite":
                conn.execute(text("SELECT count(*) FROM sqlite_master")).first()
    except SQLAlchemyError as e:
        orig = getattr(e, "orig", e)
        return f"the database {engine.url.render_as_string(hide_password=True)} is not usable: {type(orig).__name__}: {orig}"
    finally:
        engine.dispose()
    return None


if __name__ == "__main__":
    raise SystemExit(main())
