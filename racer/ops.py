"""The operator's command line against a running system: overrides and rollouts.

    racer override list [--state active]
    racer override set (--node NODE | --cluster) --emb-share X [--ttl-s S] --reason TEXT
    racer override clear ID --reason TEXT
    racer rollout list [--kind policy|model]
    racer rollout start (--policy VERSION | --model DIGEST) [--canary-fraction F] [--bake-time-s S]
                        [--manual] --reason TEXT
    racer rollout {promote,pause,resume,rollback} ID --reason TEXT

Where: ``--control-plane URL``, else the control plane of the ``racer up`` whose data folder is
``--data-dir`` (default ``racer-data``: its ``processes.json``). Who: the token in ``RACER_TOKEN``,
else the file ``--token-file`` (default ``DATA/operator_token``, what ``racer up`` writes); never
a token on the command line, where ``ps`` shows it. ``--json`` prints the API's answer. Exit 0 on
success, 1 when the control plane refused (its reason on stderr), 2 when it could not be reached
or the options are wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from common.ids import path_segment

ROLLOUT_EVENTS = ("promote", "pause", "resume", "rollback")


class OpsError(Exception):
    """A refusal or an unreachable control plane: ``code`` is the exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control-plane", default=None, metavar="URL",
                   help="the control plane (default: the one in DATA/processes.json)")
    p.add_argument("--data-dir", default="racer-data", help="racer up's data folder (default racer-data)")
    p.add_argument("--token-file", default=None,
                   help="file holding an operator token (default: $RACER_TOKEN, else DATA/operator_token)")
    p.add_argument("--json", action="store_true", help="print the API's answer as JSON")


def _where(args) -> tuple[str, str]:
    """(the API's base URL, the token)."""
    data = Path(args.data_dir)
    url = args.control_plane
    if url is None:
        state = data / "processes.json"
        try:
            url = json.loads(state.read_text())["control-plane"]["url"]
        except (OSError, ValueError, KeyError, TypeError):
            raise OpsError(f"no --control-plane given and no control plane in {state} (is racer up running "
                           f"with --data-dir {args.data_dir}?)", 2) from None
    token = os.environ.get("RACER_TOKEN", "").strip() if args.token_file is None else ""
    if not token:
        path = Path(args.token_file) if args.token_file else data / "operator_token"
        try:
            token = path.read_text().strip()
        except OSError as e:
            raise OpsError(f"no token: set RACER_TOKEN or give --token-file ({path}: {e.strerror})", 2) from None
    return url.rstrip("/") + "/api/v1", token


def _call(args, method: str, path: str, body: dict | None = None, params: dict | None = None):
    import httpx

    api, token = _where(args)
    try:
        r = httpx.request(method, api + path, json=body, params=params, timeout=30.0,
                          headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError as e:
        raise OpsError(f"{api}: {type(e).__name__}: {e}", 2) from None
    try:
        out = r.json()
    except ValueError:
        out = {"detail": r.text[:300]}
    if r.status_code >= 400:
        detail = out.get("detail", out) if isinstance(out, dict) else out
        if isinstance(detail, list):
            detail = "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}" if isinstance(d, dict)
                               else str(d) for d in detail)
        raise OpsError(f"refused (HTTP {r.status_code}): {detail}", 1)
    return out


def _override_line(o: dict) -> str:
    scope = o["node_id"] or "cluster"
    exp = "never" if o.get("expires_at_s") is None else f"{o['expires_at_s']:.0f}"
    return f"{o['id']:>5}  {o['state']:<8} {scope:<16} emb_share {o['emb_share']:<5g} expires {exp:<11} {o['reason']}"


def _rollout_line(r: dict) -> str:
    ver = r.get("policy_version") or r.get("model_version") or ""
    canary = ",".join(n["node_id"] for n in r.get("nodes", []) if n["role"] == "canary")
    return (f"{r['id']:>5}  {r['kind']:<6} {r['state']:<11} {ver[:24]:<24} over {str(r.get('baseline_version'))[:24]:<24}"
            f" canary {canary}")


def cmd_override(args) -> int:
    if args.action == "list":
        out = _call(args, "GET", "/overrides", params={"state": args.state} if args.state else None)
        lines = [_override_line(o) for o in out]
    elif args.action == "set":
        body = {"node_id": None if args.cluster else args.node, "emb_share": args.emb_share, "reason": args.reason}
        if args.ttl_s is not None:
            body["ttl_s"] = args.ttl_s
        out = _call(args, "POST", "/overrides", body)
        lines = ["set " + _override_line(out)]
    else:
        out = _call(args, "POST", f"/overrides/{args.id}/clear", {"reason": args.reason})
        lines = ["cleared " + _override_line(out)]
    print(json.dumps(out) if args.json else "\n".join(lines) if lines else "(none)")
    return 0


def cmd_rollout(args) -> int:
    if args.action == "list":
        out = _call(args, "GET", "/rollouts", params={"kind": args.kind})
        lines = [_rollout_line(r) for r in out]
    elif args.action == "start":
        body = {"kind": "model" if args.model else "policy", "reason": args.reason,
                "canary_fraction": args.canary_fraction, "auto": not args.manual}
        body["model_version" if args.model else "policy_version"] = args.model or args.policy
        if args.bake_time_s is not None:
            body["bake_time_s"] = args.bake_time_s
        out = _call(args, "POST", "/rollouts", body)
        lines = ["started " + _rollout_line(out)]
    else:
        out = _call(args, "POST", f"/rollouts/{args.id}/{path_segment(args.action)}", {"reason": args.reason})
        lines = [f"{args.action}: " + _rollout_line(out)]
    print(json.dumps(out) if args.json else "\n".join(lines) if lines else "(none)")
    return 0


def _run(fn):
    def go(args) -> int:
        try:
            return fn(args)
        except OpsError as e:
            print(f"racer {args.command}: {e}", file=sys.stderr)
            return e.code
    return go


def add_override_parser(sub) -> None:
    p = sub.add_parser("override", help="list, set and clear emb_share overrides on a running system",
                       description=__doc__.split("\n\n")[0])
    acts = p.add_subparsers(dest="action", required=True)
    ls = acts.add_parser("list", help="overrides, newest first")
    ls.add_argument("--state", choices=("active", "cleared", "expired"), default=None)
    st = acts.add_parser("set", help="pin a node's (or every node's) emb_share")
    who = st.add_mutually_exclusive_group(required=True)
    who.add_argument("--node", help="the node's id")
    who.add_argument("--cluster", action="store_true", help="every node (a node's own override wins)")
    st.add_argument("--emb-share", type=float, required=True, help="the share of the arena for the EMB cache")
    st.add_argument("--ttl-s", type=float, default=None, help="expire after this many seconds (default never)")
    st.add_argument("--reason", required=True, help="why (audited)")
    cl = acts.add_parser("clear", help="end an override")
    cl.add_argument("id", type=int)
    cl.add_argument("--reason", required=True)
    for a in (ls, st, cl):
        _common(a)
        a.set_defaults(func=_run(cmd_override), command="override")


def add_rollout_parser(sub) -> None:
    p = sub.add_parser("rollout", help="start, list, promote, pause, resume and roll back rollouts",
                       description=__doc__.split("\n\n")[0])
    acts = p.add_subparsers(dest="action", required=True)
    ls = acts.add_parser("list", help="rollouts, newest first")
    ls.add_argument("--kind", choices=("policy", "model"), default="policy")
    st = acts.add_parser("start", help="a canary rollout of a registered policy or model")
    what = st.add_mutually_exclusive_group(required=True)
    what.add_argument("--policy", help="the policy version")
    what.add_argument("--model", help="the model's digest (64 hex digits)")
    st.add_argument("--canary-fraction", type=float, default=0.25)
    st.add_argument("--bake-time-s", type=float, default=None)
    st.add_argument("--manual", action="store_true", help="the judge pauses instead of promoting or rolling back")
    st.add_argument("--reason", required=True)
    parsers = [ls, st]
    for ev in ROLLOUT_EVENTS:
        e = acts.add_parser(ev, help=f"{ev} a rollout")
        e.add_argument("id", type=int)
        e.add_argument("--reason", required=True)
        parsers.append(e)
    for a in parsers:
        _common(a)
        a.set_defaults(func=_run(cmd_rollout), command="rollout")
