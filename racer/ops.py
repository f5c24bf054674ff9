"""The operator's command line against a running system: overrides, rollouts and what-if runs.

    racer override list [--state active]
    racer override set (--node NODE | --cluster) --emb-share X [--ttl-s S] --reason TEXT
    racer override clear ID --reason TEXT
    racer rollout list [--kind policy|model]
    racer rollout start (--policy VERSION | --model DIGEST) [--canary-fraction F] [--bake-time-s S]
                        [--manual] --reason TEXT
    racer rollout {promote,pause,resume,rollback} ID --reason TEXT
    racer whatif (--from T --to T | --last DURATION) [--candidate VERSION] [--no-wait]
    racer whatif --show [ID]
    racer policy whatif CANDIDATE [--last DURATION] [--no-wait]

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
from common.whatif_findings import findings_lines

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
            procs = json.loads(state.read_text())
            url = procs.get("processes", procs)["control-plane"]["url"]  # racer up nests them under "processes"
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
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


def _answer(args, out, lines: list[str]) -> int:
    """Print the API's answer (``--json``) or its lines ("(none)" for none); exit status 0."""
    print(json.dumps(out) if args.json else "\n".join(lines) if lines else "(none)")
    return 0


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
    return _answer(args, out, lines)


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
    return _answer(args, out, lines)


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


# --------------------------------------------------------------------------------------- what-if ---
_UNITS = {"s": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``"6h"``, ``"90min"``, ``"30s"``, ``"2d"`` or plain seconds -> seconds (> 0)."""
    t = str(text).strip().lower()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            num, mult = t[: -len(unit)], _UNITS[unit]
            break
    else:
        num, mult = t, 1.0
    try:
        v = float(num) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a duration such as 6h, 90min, 30s or 2d, got {text!r}") from None
    if not (v > 0 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"a duration must be positive, got {text!r}")
    return v


def parse_time(text: str, now_s: float | None = None) -> float:
    """A time: Unix seconds, ISO 8601 (``2026-12-05T14:00:00Z``; no zone: UTC), ``now`` or ``now-6h``."""
    import time
    from datetime import datetime, timezone

    t = str(text).strip()
    now = time.time() if now_s is None else now_s
    if t.lower() == "now":
        return now
    if t.lower().startswith("now-"):
        return now - parse_duration(t[4:])
    try:
        return float(t)
    except ValueError:
        pass
    try:
        d = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a time: Unix seconds, ISO 8601 (2026-12-05T14:00:00Z), now or "
                                         f"now-6h; got {text!r}") from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=timezone.utc)
    return d.timestamp()


def whatif_table(run: dict) -> str:
    """A finished run as text: one line per configuration (P99, SLO attainment, mean share), the
    findings, and the sentence."""
    res = run.get("result") or {}
    lines = [f"what-if {run['id']}: window {run['window_start_s']:.0f} to {run['window_end_s']:.0f}, "
             f"{run.get('num_samples')} samples, code {run.get('code_version')}"]
    if run.get("cut"):
        lines.append(f"  cut: {run['cut']['kept']} of {run['cut']['of']} samples, from {run['cut']['from_s']:.0f} "
                     f"({run['cut']['why']})")
    prof = run.get("profile") or {}
    if prof:
        lines.append(f"  fleet: {prof.get('simulated_nodes')} simulated node(s) for {prof.get('fleet_nodes')} "
                     f"(sampled fraction {prof.get('sampled_fraction')}), profile {prof.get('name')}")
    lines.append(f"  {'configuration':<28} {'P99 ms':>9} {'SLO att.':>9} {'mean share':>11}")
    for r in res.get("rows", []):
        name = r["config"] + (f" ({r['role']})" if r.get("role") else "")
        if r.get("error"):
            lines.append(f"  {name:<28} {r['error']}")
            continue
        lines.append(f"  {name:<28} {r['p99_ms']:>9.2f} {r['slo_attainment']:>9.4f} {r['mean_share']:>11.3f}")
    lines += ["  " + x for x in findings_lines(res.get("findings"))]
    if run.get("sentence"):
        lines.append(run["sentence"])
    return "\n".join(lines)


def _follow(args, run: dict) -> dict:
    """Poll the run until it ends, printing its progress on stderr."""
    import time

    last = None
    while run["state"] == "running":
        msg = f"{100 * run['progress']:5.1f}%  {run['progress_note']}"
        if msg != last:
            print(f"what-if {run['id']}: {msg}", file=sys.stderr, flush=True)
            last = msg
        time.sleep(args.poll_s)
        run = _call(args, "GET", f"/whatif-runs/{run['id']}")
    return run


def _whatif(args, start_s: float, end_s: float, candidate: str | None) -> int:
    body = {"start_s": start_s, "end_s": end_s}
    if candidate:
        body["candidate"] = candidate
    run = _call(args, "POST", "/whatif-runs", body)
    if not args.no_wait:
        run = _follow(args, run)
    if args.json:
        print(json.dumps(run))
    elif run["state"] == "running":
        print(f"what-if {run['id']} started ({run['num_samples']} samples); follow it with: racer whatif --show "
              f"{run['id']}")
    elif run["state"] == "failed":
        print(f"what-if {run['id']} failed: {run['error']}", file=sys.stderr)
    else:
        print(whatif_table(run))
    return 0 if run["state"] != "failed" else 1


def cmd_whatif(args) -> int:
    import time

    if args.show is not None:
        run = _call(args, "GET", "/whatif-runs/latest" if args.show == "latest" else f"/whatif-runs/{int(args.show)}")
        if not args.no_wait:
            run = _follow(args, run)
        print(json.dumps(run) if args.json else whatif_table(run) if run["state"] == "done"
              else f"what-if {run['id']} {run['state']}: {run.get('error') or run['progress_note']}")
        return 0 if run["state"] != "failed" else 1
    now = time.time()
    if args.last is not None:
        if args.from_ is not None or args.to is not None:
            raise OpsError("give --last or --from/--to, not both", 2)
        return _whatif(args, now - args.last, now, args.candidate)
    if args.from_ is None or args.to is None:
        raise OpsError("give --from T --to T (or --last DURATION)", 2)
    return _whatif(args, args.from_, args.to, args.candidate)


def cmd_policy_whatif(args) -> int:
    import time

    now = time.time()
    return _whatif(args, now - args.last, now, args.candidate)


def _whatif_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-wait", action="store_true", help="return once the run has started")
    p.add_argument("--poll-s", type=parse_duration, default=1.0, help="how often to read its progress (default 1 s)")
    _common(p)


def _show_arg(text: str) -> str:
    if text != "latest" and not text.isdigit():
        raise argparse.ArgumentTypeError(f"want a run id or latest, got {text!r}")
    return text


def add_whatif_parser(sub) -> None:
    p = sub.add_parser("whatif", help="replay a window of the fleet's sampled traffic through the simulator",
                       description="What would other splits or policies have given on the fleet's own traffic? "
                                   "Replays a stored window of the gateways' traffic samples through the simulator "
                                   "(static splits, the look-ahead oracle, the active policy, the candidates) and "
                                   "prints the table and one sentence. See docs/whatif.md.")
    p.add_argument("--from", dest="from_", type=parse_time, default=None, metavar="T",
                   help="window start: Unix seconds, ISO 8601 (UTC unless a zone is given), or now-6h")
    p.add_argument("--to", type=parse_time, default=None, metavar="T", help="window end (same forms; e.g. now)")
    p.add_argument("--last", type=parse_duration, default=None, metavar="DURATION",
                   help="the window that ends now, e.g. 6h (instead of --from/--to)")
    p.add_argument("--candidate", default=None, metavar="VERSION",
                   help="judge this registered policy (with the active one) instead of every candidate")
    p.add_argument("--show", type=_show_arg, default=None, nargs="?", const="latest", metavar="ID",
                   help="show a run (default the latest) instead of starting one")
    _whatif_options(p)
    p.set_defaults(func=_run(cmd_whatif), command="whatif")


def add_policy_parser(sub):
    """``racer policy`` (`policies.cli.add_policy_parser`) with ``whatif`` added: judge a registered
    policy offline on the fleet's own last hours."""
    from policies.cli import add_policy_parser as add_base

    pol = add_base(sub)
    acts = next(a for a in pol._actions if isinstance(a, argparse._SubParsersAction))
    w = acts.add_parser("whatif", help="judge a registered policy offline on the fleet's last hours of traffic",
                        description="Replay the fleet's sampled traffic of the last hours (default 6 h) through the "
                                    "simulator with CANDIDATE, the active policy, static splits and the look-ahead "
                                    "oracle: the candidate's regret before any canary. See docs/whatif.md.")
    w.add_argument("candidate", metavar="CANDIDATE", help="the registered policy version")
    w.add_argument("--last", type=parse_duration, default=6 * 3600.0, metavar="DURATION",
                   help="the window that ends now (default 6h)")
    _whatif_options(w)
    w.set_defaults(func=_run(cmd_policy_whatif), command="policy whatif")
    return pol
