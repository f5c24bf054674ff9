"""``racer gateway``: the command line (`add_gateway_parser`) and the process it runs
(`cmd_gateway`: a `gateway.gateway.Gateway` behind `gateway.app.create_app`)."""

from __future__ import annotations

import logging
import socket

from common.config import add_config_arguments, config_kwargs
from common.secrets_args import FLEET_TOKEN_ENV, add_secret_arguments, read_secret, require_fleet_token

from .app import create_app
from .config import GatewayConfig
from .gateway import Gateway
from .traffic_sample import SAMPLE_KEY_ENV
from .traffic_sample import sample_key as traffic_sample_key
from .uplink import gateway_id_from


def _node_list(text: str) -> list[tuple[str, str]]:
    out = []
    for part in text.split(","):
        url = part.strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--nodes: {url!r} is not an http(s) URL")
        out.append((url.split("://", 1)[1], url))
    if not out:
        raise ValueError("--nodes: no node URL given")
    if len({n for n, _ in out}) != len(out):
        raise ValueError("--nodes: a node is listed twice")
    return out


def cmd_gateway(args) -> int:
    from common.http_server import serve_forever  # TCP_NODELAY on accepted connections

    if bool(args.nodes) == bool(args.control_plane):
        raise ValueError("give exactly one of --nodes and --control-plane")
    cfg = GatewayConfig(**config_kwargs(args, CLI_CONFIG_FIELDS))
    nodes = _node_list(args.nodes) if args.nodes else []
    item_shard = None
    if args.trace:
        from workloads.loaders import load_trace

        item_shard = load_trace(args.trace, args.path, num_shards=args.num_shards).item_shard
    if args.advertise_url and not args.control_plane:
        raise ValueError("--advertise-url applies with --control-plane only")
    fleet_token = read_secret(args, "fleet-token", FLEET_TOKEN_ENV, prog="racer gateway")
    require_fleet_token(fleet_token, args.host, "the gateway")
    token = read_secret(args, "token", "RACER_GATEWAY_TOKEN", prog="racer gateway")
    push_token = read_secret(args, "push-token", "RACER_GATEWAY_PUSH_TOKEN", prog="racer gateway")
    if push_token and args.control_plane:
        raise ValueError("--push-token-file / $RACER_GATEWAY_PUSH_TOKEN apply without --control-plane only: the "
                         "control plane gives a registered gateway its push token")
    sample_key = traffic_sample_key(read_secret(args, "sample-key", SAMPLE_KEY_ENV, prog="racer gateway"))
    gw = Gateway(nodes, cfg, item_shard=item_shard, control_plane=args.control_plane,
                 token=token,
                 advertise_url=args.advertise_url, push_token=push_token, gateway_id=args.gateway_id,
                 fleet_token=fleet_token, sample_key=sample_key)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    def ready(host: str, port: int) -> None:
        if not fleet_token:
            print(f"racer gateway: no fleet token (${FLEET_TOKEN_ENV}): GET /v1/router is open to local callers",
                  flush=True)
        if gw.gateway_id is None:
            gw.gateway_id = gateway_id_from(f"{socket.gethostname() if host in ('0.0.0.0', '::') else host}:{port}")
        print(f"racer gateway: serving on http://{host}:{port} (router {cfg.router}, "
              f"{len(nodes) if nodes else 'registry'} nodes)", flush=True)

    serve_forever(create_app(gw), args.host, args.port, log_level=args.log_level, ready=ready)
    print("racer gateway: stopped", flush=True)
    return 0


#: the `GatewayConfig` fields the command line sets (``--router``, ``--report-interval-s``, ...)
CLI_CONFIG_FIELDS = ("router", "num_shards", "report_interval_s", "health_interval_s", "health_timeout_s",
                     "health_failures", "health_successes", "request_timeout_s", "max_body_bytes", "slo_ms",
                     "client_report_interval_s", "sample_rate", "sample_max_items", "sample_interval_s")


def add_gateway_parser(subparsers) -> None:
    """Add ``gateway`` to racer's top-level subparsers."""
    from workloads.loaders import LOADERS

    g = subparsers.add_parser("gateway", help="route recommendation requests to node agents (EMB-KV-aware)",
                              description="The gateway: POST /v1/recommend routed by the chosen router to the "
                                          "node agents, with residency feeds, health checks and retries.")
    g.add_argument("--nodes", default=None, help="node agent URLs, comma-separated (http://host:port,...)")
    g.add_argument("--control-plane", default=None, help="control plane URL: node list and weights from it")
    add_secret_arguments(g, "token", "RACER_GATEWAY_TOKEN",
                         "bearer token sent to the control plane (a router token: it lists nodes, reads weights and "
                         "registers the gateway)")
    add_secret_arguments(g, "push-token", "RACER_GATEWAY_PUSH_TOKEN",
                         "secret weight pushes to this gateway must carry, without --control-plane (with one, the "
                         "control plane gives it when the gateway registers; without either, pushes are refused)",
                         file_only=True)
    add_secret_arguments(g, "sample-key", SAMPLE_KEY_ENV,
                         "key of the traffic samples' keyed hash of user and item ids (--sample-rate > 0; a random "
                         "secret of at least 16 characters, the same on every gateway)", file_only=True)
    add_secret_arguments(g, "fleet-token", FLEET_TOKEN_ENV,
                         "token shown to the agents' /v1/residency and wanted on GET /v1/router (the same on every "
                         "agent; needed to listen beyond loopback)", file_only=True)
    g.add_argument("--advertise-url", default=None,
                   help="this gateway's URL as the control plane reaches it: registered with POST /api/v1/routers "
                        "for weight pushes (default: none, weights are pulled only)")
    g.add_argument("--trace", default=None, choices=sorted(LOADERS),
                   help="trace the nodes serve: its item -> shard map feeds the EMB term (default: none, no EMB term)")
    g.add_argument("--path", default=None, help="trace file (default: the sample)")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (0: a free one; default 8000)")
    add_config_arguments(g, GatewayConfig, CLI_CONFIG_FIELDS)
    g.add_argument("--gateway-id", default=None,
                   help="this gateway's id in its client-side reports to the control plane (default: the "
                        "--advertise-url's host:port, else host:port)")
    g.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn log level (default warning)")
    g.set_defaults(func=cmd_gateway)
