"""``racer control-plane`` and ``racer token create | revoke | list`` (added to the racer command line)."""

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
    """Create a token (a node token per ``--node-id``, bound to it) and print each secret once:
    one line per token, in the order given (``--json``: one JSON object per line)."""
    import sys

    from db import queries
    from db.engine import make_engine, session_factory, upgrade

    from .auth import new_secret

    node_ids = list(args.node_id or [])
    if args.role == "node" and not node_ids:
        print("racer token create: error: --role node needs --node-id ID (a node token is bound to the one node id "
              "it acts as)", file=sys.stderr)
        return 2
    if args.role != "node" and (node_ids or args.replace):
        print("racer token create: error: --node-id and --replace apply to --role node only", file=sys.stderr)
        return 2
    bad = [n for n in node_ids if not _valid_node_id(n)]
    if bad or len(set(node_ids)) != len(node_ids):
        print(f"racer token create: error: node ids must be distinct, 1-128 letters, digits or _ . : - "
              f"(got {', '.join(map(repr, bad or node_ids))})", file=sys.stderr)
        return 2
    engine = make_engine(args.db)
    upgrade(engine)
    now = time.time()
    outs = []
    with session_factory(engine).begin() as s:
        for node_id in node_ids or [None]:
            secret = new_secret()
            replaced = queries.revoke_node_tokens(s, node_id) if args.replace and node_id else []
            name = args.name or (f"{args.role}-{node_id}" if node_id else args.role)
            t = queries.add_token(s, name=name, role=args.role, secret=secret, now_s=now, node_id=node_id)
            queries.audit(s, ts_s=now, actor="cli", action="token.create", target=f"token:{t.id}",
                          before={"revoked_token_ids": replaced} if replaced else None,
                          after={"name": t.name, "role": t.role, "node_id": node_id}, reason="racer token create")
            outs.append({"id": t.id, "name": t.name, "role": t.role, "node_id": node_id, "token": secret,
                         "replaced_token_ids": replaced})
    engine.dispose()
    for out in outs:
        print(json.dumps(out) if args.json else out["token"])
    return 0


def cmd_token_revoke(args) -> int:
    """Revoke tokens by id (a leaked or retired gateway's, an operator's): they are refused from
    then on (other control-plane replicas within their token cache's few seconds); audited."""
    import sys

    from db import queries
    from db.engine import make_engine, session_factory, upgrade

    engine = make_engine(args.db)
    upgrade(engine)
    now = time.time()
    try:
        with session_factory(engine).begin() as s:
            found = queries.tokens_by_id(s, args.token_id)
            missing = sorted(set(args.token_id) - {t.id for t in found})
            if missing:
                print(f"racer token revoke: error: no token with id {', '.join(map(str, missing))} (nothing revoked)",
                      file=sys.stderr)
                return 2
            for t in found:
                was = t.revoked
                t.revoked = True
                queries.audit(s, ts_s=now, actor="cli", action="token.revoke", target=f"token:{t.id}",
                              before={"revoked": was}, after={"revoked": True},
                              reason=args.reason or "racer token revoke")
                print(f"token {t.id} ({t.role}, {t.name}): {'already revoked' if was else 'revoked'}")
    finally:
        engine.dispose()
    return 0


def cmd_token_list(args) -> int:
    """Every token's id, role, name, bound node and state (never a secret: only digests are stored)."""
    from db import queries
    from db.engine import make_engine, session_factory, upgrade

    engine = make_engine(args.db)
    upgrade(engine)
    with session_factory(engine)() as s:
        rows = [{"id": t.id, "role": t.role, "name": t.name, "node_id": t.node_id, "revoked": t.revoked,
                 "created_at_s": t.created_at_s} for t in queries.tokens_by_id(s, None)]
    engine.dispose()
    for r in rows:
        print(json.dumps(r) if args.json else
              f"{r['id']:>5}  {r['role']:<8} {'revoked' if r['revoked'] else 'valid':<8} {r['name']}"
              + (f"  (node {r['node_id']})" if r["node_id"] else ""))
    return 0


def _valid_node_id(text: str) -> bool:
    from common.ids import id_problem

    return id_problem(text) is None


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
    c.add_argument("--node-id", action="append", metavar="ID",
                   help="with --role node (required there): the node id the token is bound to, the only node it may "
                        "act as; repeat it for one token per id (one secret per line, in this order)")
    c.add_argument("--replace", action="store_true",
                   help="with --role node: revoke the other tokens bound to each id (a lost or leaked token; the "
                        "node may then register with the new one)")
    c.add_argument("--name", default=None, help="a name for the audit log (default: the role, and the node id)")
    c.add_argument("--db", default=None, help="database URL (default $RACER_DATABASE_URL or the SQLite file)")
    c.add_argument("--json", action="store_true", help="print {id, name, role, token}")
    c.set_defaults(func=cmd_token_create)
    r = tsub.add_parser("revoke", help="revoke tokens by id (refused from then on; audited)",
                        description="Revoke bearer tokens by id (see `racer token list`). A gateway id or a node "
                                    "bound to a revoked token may then be claimed by another token.")
    r.add_argument("token_id", type=int, nargs="+", metavar="ID")
    r.add_argument("--reason", default=None, help="why, for the audit log")
    r.add_argument("--db", default=None, help="database URL (default $RACER_DATABASE_URL or the SQLite file)")
    r.set_defaults(func=cmd_token_revoke)
    ls = tsub.add_parser("list", help="list tokens (ids, roles, names, bound nodes; never secrets)",
                         description="List the control plane's bearer tokens.")
    ls.add_argument("--db", default=None, help="database URL (default $RACER_DATABASE_URL or the SQLite file)")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.set_defaults(func=cmd_token_list)
