"""``racer dashboard``: serve the operator dashboard (a client of the control-plane API)."""

from __future__ import annotations

from node_agent.argtypes import port, positive_float, positive_int


def add_dashboard_parser(subparsers) -> None:
    db = subparsers.add_parser("dashboard", help="the operator dashboard (Dash), a client of the control-plane API",
                               description="Serve the operator dashboard. Operators and viewers sign in in the "
                                           "browser with a control-plane token (kept on this server, never in a URL "
                                           "or a log).")
    db.add_argument("--control-plane", required=True, metavar="URL",
                    help="control-plane base URL, e.g. http://127.0.0.1:8600")
    db.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    db.add_argument("--port", type=port, default=8050, help="port (default 8050; 0: a free one)")
    db.add_argument("--refresh-s", type=positive_float, default=2.0, help="live refresh period, s (default 2)")
    db.add_argument("--timeout-s", type=positive_float, default=3.0,
                    help="control-plane request timeout, s (default 3)")
    db.add_argument("--slo-ms", type=positive_float, default=30.0,
                    help="the latency SLO drawn on P99 charts, ms (default 30, the node agent's default)")
    db.add_argument("--range-s", type=positive_int, default=900, help="initial time range, s (default 900)")
    db.set_defaults(func=cmd_dashboard)


def cmd_dashboard(args) -> int:
    from .app import run

    if not args.control_plane.startswith(("http://", "https://")):
        raise ValueError(f"--control-plane must be an http:// or https:// URL, got {args.control_plane!r}")
    run(args.control_plane, host=args.host, port=args.port, refresh_s=args.refresh_s, timeout_s=args.timeout_s,
        slo_ms=args.slo_ms, range_s=args.range_s)
    return 0
