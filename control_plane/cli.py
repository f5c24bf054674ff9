"""``racer control-plane`` and ``racer token create`` (added to the racer command line)."""

from __future__ import annotations

import json
import logging
import time


def cmd_control_plane(args) -> int:
    from .main import serve, settings_from_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("apscheduler", "alembic", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    serve(settings_from_args(args), log_level=args.log_level)
    return 0


def cmd_token_create(args) -> int:
    from db import queries
    from db.engine import make_engine, session_factory, upgrade

    from .auth import new_secret

    engine = make_engine(args.db)
    upgrade(engine)
    secret = new_secret()
    now = time.time()
    with session_factory(engine).begin() as s:
        t = queries.add_token(s, name=args.name or args.role, role=args.role, secret=secret, now_s=now)
        queries.audit(s, ts_s=now, actor="cli", action="token.create", target=f"token:{t.id}",
                      after={"name": t.name, "role": t.role}, reason="racer token create")
        out = {"id": t.id, "name": t.name, "role": t.role, "token": secret}
    engine.dispose()
    print(json.dumps(out) if args.json else secret)
    return 0


def add_control_plane_parser(sub) -> None:
    from .main import add_args

    cp = sub.add_parser("control-plane", help="run the control plane (API, SQL history, jobs)",
                        description="The operator control plane; see docs/control_plane.md.")
    add_args(cp)
    cp.set_defaults(func=cmd_control_plane)

    tok = sub.add_parser("token", help="manage control-plane bearer tokens")
    tsub = tok.add_subparsers(dest="token_command", metavar="SUBCOMMAND", required=True)
    c = tsub.add_parser("create", help="create a token and print its secret once",
                        description="Create a bearer token in the control plane's database.")
    c.add_argument("--role", required=True, choices=("node", "operator", "viewer", "router"))
    c.add_argument("--name", default=None, help="a name for the audit log (default: the role)")
    c.add_argument("--db", default=None, help="database URL (default $RACER_DATABASE_URL or the SQLite file)")
    c.add_argument("--json", action="store_true", help="print {id, name, role, token}")
    c.set_defaults(func=cmd_token_create)
