"""Run the control plane: ``racer control-plane`` / ``python -m control_plane.main``."""

from __future__ import annotations

import argparse
import logging
import sys

from .settings import Settings


def serve(settings: Settings, *, log_level: str = "warning") -> None:
    from .api import asgi_app

    app = asgi_app(settings)
    try:
        from node_agent.server import serve_forever  # the shared TCP_NODELAY-correct helper
    except ImportError:
        serve_forever = None
    if serve_forever is not None:
        serve_forever(app, host=settings.host, port=settings.port, log_level=log_level)
        return
    # until node_agent.server is merged: the same socket set-up (proto IPPROTO_TCP, so asyncio sets
    # TCP_NODELAY on accepted connections and a response's head and body are not held by Nagle)
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on", timeout_graceful_shutdown=5,
                            proxy_headers=False, backlog=4096)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=None, help="database URL (default $RACER_DATABASE_URL or sqlite:///racer-control-plane.db)")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8600)")
    p.add_argument("--no-scheduler", action="store_true", help="serve the API only, never run the jobs")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")


def settings_from_args(args) -> Settings:
    kw = dict(database_url=args.db, host=args.host, port=args.port)
    if args.no_scheduler:
        kw["scheduler"] = False
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
    serve(settings, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
