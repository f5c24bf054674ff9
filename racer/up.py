"""``racer up``: the whole system on this machine from one command.

A supervisor (`racer.supervisor`) starts the control plane (SQLite in the data folder unless
``--db``), N node agents (CPU unless a GPU is seen, each its own process, the shipped policy;
``--devices cuda:0,cuda:1`` places them one per device, round robin), the gateway and the
dashboard; each process runs in its own process group with its log in ``DATA/logs/<name>.log``.
It then replays the Taobao trace through steady -> trend -> burst in a loop (`workloads.replay`,
open loop) against the gateway, and prints one status line: requests served, P99 and SLO
attainment over the last 30 s, the current regime, the processes up.

Start-up (`_Up`), in steps that never wait on one another: every port is chosen first (one asked
for and taken is refused before anything is written); the agents' tokens and, once per data
folder, the cost profile are made side by side; the control plane starts as soon as its schema and
the tokens exist, the agents as soon as the profile does (they spool their reports until the
control plane answers); once the control plane is healthy, its dependants start (the gateway and
the dashboard), the dashboard's URL is printed the moment it answers, then the shipped policy is
registered and activated and a derived candidate registered (`racer.policy_seed`); the load starts
once the gateway routes to the agents. A status line says what is up and what is still starting.
A dependant that exits while starting is restarted with a back-off (one that is only slow is waited
for, not restarted) and never stops the rest; only a control plane that exits three times before it
ever answered ends the run (with the end of its log).

A process that exits is reported on stderr (and in ``DATA/logs/up.log``) and restarted (with a
back-off when it keeps dying). Ctrl-C or SIGTERM (or ``--duration``) stops the replay, waits for
its requests in flight, then stops the processes in reverse order with SIGTERM to each process
group (SIGKILL after ``--stop-timeout-s``): nothing is left running, and the control plane, stopped
last, closes its database itself. A second ``racer up`` on the same data folder reuses the
database, the tokens and the cost profile; two at once on one folder are refused (a lock file).

The supervisor is generic: a list of `ProcessSpec` (argv, environment, readiness URL), which
`plan_processes` makes. The pieces are the subcommands in racer.cli's table (`available_commands`,
nothing imported): a build without ``racer gateway`` replays straight to the node agents (round
robin, one client retry); without ``racer control-plane`` or ``racer dashboard`` those are left
out and the start-up message says so.

Files in the data folder (`racer.data_folder`: written whole, temp file, fsync, rename; a write
that fails leaves nothing behind): ``operator_token`` (mode 0600; handed to the control plane as
``RACER_ADMIN_TOKEN``), ``node_profile.json`` (the
miss costs every agent reads instead of measuring them again), ``racer.db`` (SQLite), ``logs/``,
``node_token.<db hash>.node-K`` (mode 0600: agent node-K's own token, bound to node id node-K, one
per agent and database: made with ``racer token create --role node --node-id node-K`` before the
control plane starts, checked with ``/api/v1/whoami`` once it answers and remade through
``POST /api/v1/tokens`` if that database does not know it; each agent gets its token in its
environment, ``RACER_NODE_TOKEN``), ``router_token.<db hash>`` (mode 0600: the gateway's token, role
``router``, made through ``POST /api/v1/tokens`` once the control plane answers and checked with
``/api/v1/whoami`` on later runs; the gateway reports as ``racer-up-<hash of the data folder>``, one
id per folder from run to run), ``agents/node-K/`` (each agent's
report spool and downloaded policies), ``fleet_token`` (mode 0600: shared by the gateway and the
agents as ``RACER_FLEET_TOKEN``; it guards the agents' residency feeds and the gateway's
``GET /v1/router``), ``secret_key`` (mode 0600: the control plane's ``--secret-key-file``, the root of
the routers' push tokens), ``policies/candidate-<policy_id>/`` (the candidate derived
from the shipped policy, reused), ``processes.json`` (each process's pid, URL, restarts and log),
``up.lock``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from node_agent.model.shipped import resolve_model  # no torch there

from .data_folder import DataLock, check_data_dir, read_or_create_secret, write_atomic
from .errors import UpError, UsageError
from .supervisor import REPO, ProcessSpec, Supervisor, describe_exit, log_tail, rss_bytes

DEFAULT_POLICY = REPO / "policies" / "default"

# A small model per CPU node agent: four of them, the gateway, the control plane, the dashboard and
# the load generator share a laptop-class CPU.
CPU_AGENT_ARGS = ("--num-pages", "512", "--max-history-len", "256", "--embedding-dim", "32", "--num-layers", "1",
                  "--num-candidates", "64", "--threads", "1", "--control-interval-s", "2")
# (2 s control windows: at racer up's few requests per node per second, a 1 s window holds one or
# two requests, too few for the hot-user ratio to tell a burst's hot users from chance)
PROFILE_ARGS = ("--embedding-dim", "32", "--num-layers", "1", "--threads", "1", "--lengths", "64,128,256",
                "--repeats", "3", "--num-candidates", "64")


# ------------------------------------------------------------------------------- ports ---
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# ------------------------------------------------------------------------ what `racer up` runs ---
def available_commands() -> frozenset[str]:
    """The ``racer`` subcommands of this build (the names in racer.cli's table; nothing imported)."""
    from .cli import COMMANDS

    return frozenset(COMMANDS)


def _racer(*args: str) -> list[str]:
    return [sys.executable, "-m", "racer", *args]


@dataclass
class Plan:
    specs: list[ProcessSpec]
    targets: list[str]  # where the load goes
    dashboard_url: str | None
    control_plane_url: str | None
    missing: list[str]  # pieces this build lacks
    node_urls: list[str]
    fleet_token: str | None = None  # the gateway's and the agents' (common.secrets_args)


def parse_devices(text: str) -> list[str]:
    """``--devices``: comma-separated devices, each ``cpu``, ``cuda`` or ``cuda:N``."""
    out = [d.strip() for d in text.split(",") if d.strip()]
    if not out:
        raise ValueError("--devices needs at least one device, e.g. cuda:0,cuda:1")
    for d in out:
        kind, _, index = d.partition(":")
        if kind not in ("cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
            raise ValueError(f"--devices: {d!r} is not a device (cpu, cuda or cuda:N)")
    return out


def node_device(k: int, devices: Sequence[str] | None) -> str | None:
    """The device of agent ``node-k``: ``devices`` round robin; None (the agent's own choice:
    CUDA when torch sees a GPU, else the CPU) without a list."""
    return devices[k % len(devices)] if devices else None


def plan_processes(args, data_dir: Path, commands: frozenset[str] | set[str], operator_token: str,
                   node_envs: dict[str, dict[str, str]], profile: Path | None, db_url: str,
                   ports: dict[str, int] | None = None) -> Plan:
    """The process specs of ``racer up`` for the pieces this build has (``commands``: racer's
    subcommand names). Agent ``node-K`` (its process name and its node id) runs with the
    environment ``node_envs["node-K"]`` (created here, empty): its own token goes there once it is
    known. ``ports``: the ports already chosen (``control-plane``, ``gateway``, ``dashboard``); every
    other port is drawn apart from them and from each other. The gateway reports as
    `gateway_id_for` ``data_dir``."""
    host = "127.0.0.1"
    ports = dict(ports or {})
    taken = set(ports.values()) | {getattr(args, f"{n}_port", 0) or 0
                                   for n in ("control_plane", "gateway", "dashboard")}

    def draw() -> int:
        while (port := free_port()) in taken:
            pass
        taken.add(port)
        return port

    specs: list[ProcessSpec] = []
    missing = []
    env_tokens = {"RACER_ADMIN_TOKEN": operator_token}
    # the gateway shows it to the agents' residency feeds, and racer up to the gateway's GET /v1/router
    fleet = read_or_create_secret(data_dir / "fleet_token", "racer_fleet_")
    cp_url = None
    if "control-plane" in commands:
        port = ports.get("control-plane") or args.control_plane_port or draw()
        cp_url = f"http://{host}:{port}"
        # the database URL (it may hold a password) and the tokens go in the environment, not argv;
        # the secret key (the routers' push tokens come from it) in the data folder, whatever the database
        specs.append(ProcessSpec("control-plane", _racer("control-plane", "--port", str(port), "--host", host,
                                                         "--secret-key-file", str(data_dir / "secret_key")),
                                 {**env_tokens, "RACER_DATABASE_URL": db_url}, [f"{cp_url}/healthz"], url=cp_url))
    else:
        missing.append("control-plane")

    node_urls = []
    for k in range(args.nodes):
        port = draw()
        url = f"http://{host}:{port}"
        node_urls.append(url)
        env = node_envs.setdefault(f"node-{k}", {})  # its own RACER_NODE_TOKEN goes there once known
        env["RACER_FLEET_TOKEN"] = fleet
        specs.append(ProcessSpec(f"node-{k}", _agent_argv(args, k, host, port, data_dir, profile, cp_url), env,
                                 [f"{url}/healthz"], url=url))

    targets = list(node_urls)
    if "gateway" in commands:
        gw_env: dict[str, str] = {"RACER_FLEET_TOKEN": fleet}
        port = ports.get("gateway") or args.gateway_port or draw()
        gw_url = f"http://{host}:{port}"
        argv = _racer("gateway", "--port", str(port), "--host", host)
        if cp_url:
            # the token in the environment (RACER_GATEWAY_TOKEN), not argv: `_Up` puts the gateway's
            # own router token there before it starts (`ensure_router_token`); it registers (its
            # advertised URL) for the control plane's weight pushes
            argv += ["--control-plane", cp_url, "--advertise-url", gw_url]
            gw_env["RACER_GATEWAY_TOKEN"] = operator_token
        else:
            argv += ["--nodes", ",".join(node_urls)]
        argv += ["--trace", args.trace] + (["--path", args.path] if args.path else [])
        # the clients' SLO attainment it reports, as the replay's; one id per data folder from run to
        # run (its port may change), so the dashboard does not take the last run's gateway for a
        # stalled one, and two folders sharing one --db do not report as one gateway
        argv += ["--slo-ms", f"{args.slo_ms:g}", "--gateway-id", gateway_id_for(data_dir)]
        if cp_url and getattr(args, "sample_rate", 0):  # traffic samples for what-if runs (docs/whatif.md)
            argv += ["--sample-rate", f"{args.sample_rate:g}", "--sample-key-file", str(sample_key_file(data_dir))]
        specs.append(ProcessSpec("gateway", argv, gw_env, [f"{gw_url}/healthz"], url=gw_url,
                                 ready_check=lambda: gateway_routes_to(gw_url, node_urls, fleet)))
        targets = [gw_url]
    else:
        missing.append("gateway")

    dash_url = None
    if "dashboard" in commands and cp_url:
        port = ports.get("dashboard") or args.dashboard_port or draw()
        dash_url = f"http://{host}:{port}"
        argv = _racer("dashboard", "--control-plane", cp_url, "--port", str(port), "--host", host,
                      "--slo-ms", f"{args.slo_ms:g}", "--refresh-s", "2")
        specs.append(ProcessSpec("dashboard", argv, {}, [f"{dash_url}/"], url=dash_url))
    else:
        missing.append("dashboard")
    return Plan(specs, targets, dash_url, cp_url, missing, node_urls, fleet)


def _agent_argv(args, k: int, host: str, port: int, data_dir: Path, profile: Path | None,
                cp_url: str | None) -> list[str]:
    """The command line of agent ``node-K`` (its node id too): ``racer node-agent`` on ``port``
    with the small CPU model, the trace, policy, model, cost profile and device asked for, and,
    with a control plane, where to report and keep its spool."""
    argv = _racer("node-agent", "--port", str(port), "--host", host, "--trace", args.trace, *CPU_AGENT_ARGS,
                  "--seed", "0", "--slo-ms", str(args.slo_ms))
    if args.path:
        argv += ["--path", args.path]
    if args.policy:
        argv += ["--policy", str(args.policy)]
    model = resolve_model(getattr(args, "model", None), args.trace, args.path)
    if model is not None:
        argv += ["--model", str(model)]
    if profile is not None:
        argv += ["--profile", str(profile)]
    device = node_device(k, getattr(args, "devices", None))
    if device is not None:
        argv += ["--device", device]
    if cp_url:
        # the token goes in the environment: never in argv or a log; the node id is the one
        # its token is bound to
        argv += ["--control-plane", cp_url, "--node-id", f"node-{k}",
                 "--state-dir", str(data_dir / "agents" / f"node-{k}")]
    return argv


def sample_key_file(data_dir: Path) -> Path:
    """``DATA/sample.key``, the gateway's traffic-sample key (made once, mode 0600, 32 random bytes in
    hex): one key per data folder, so the hashes of a user stay the same from run to run."""
    path = Path(data_dir) / "sample.key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path


def gateway_id_for(data_dir: Path) -> str:
    """The id racer up's gateway reports as: ``racer-up-`` and a short hash of the resolved data
    folder (the same on every run of that folder, another for another folder)."""
    import hashlib

    return "racer-up-" + hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:10]


def _token_path(data_dir: Path, db_url: str, node_id: str) -> Path:
    import hashlib

    return data_dir / f"node_token.{hashlib.sha256(db_url.encode()).hexdigest()[:10]}.{node_id}"


def _kept_token(data_dir: Path, db_url: str, node_id: str) -> str | None:
    path = _token_path(data_dir, db_url, node_id)
    text = path.read_text().strip() if path.exists() else ""
    return text or None


def start_token_create(data_dir: Path, db_url: str, node_ids: Sequence[str],
                       log: Callable[[str], None]) -> subprocess.Popen | None:
    """For the agents that have no token kept for this database: make one each, bound to its node
    id, before the control plane starts (one ``racer token create --role node --node-id ID ...``,
    which also creates the schema; ``--replace`` revokes a token of that id made elsewhere), so the
    agents can start with the control plane instead of after it. The URL goes in the environment,
    not argv. None: every agent has its token."""
    missing = [n for n in node_ids if _kept_token(data_dir, db_url, n) is None]
    if not missing:
        return None
    log(f"creating a token for each of {', '.join(missing)} (racer token create --role node --node-id ...)")
    err = open(data_dir / "logs" / "token-create.log", "ab")
    # its output (the secrets, about 160 bytes an agent) to a file of mode 0600, not a pipe: a pipe
    # read only once it exits would fill with a few hundred agents and hold it forever
    out_path = _token_out_path(data_dir)
    with contextlib.suppress(FileNotFoundError):
        out_path.unlink()
    out = os.fdopen(os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
    ids = [arg for n in missing for arg in ("--node-id", n)]
    try:
        return subprocess.Popen(_racer("token", "create", "--role", "node", *ids, "--replace", "--json"), cwd=REPO,
                                stdout=out, stderr=err, start_new_session=True,
                                env={**os.environ, "RACER_DATABASE_URL": db_url, "PYTHONUNBUFFERED": "1"})
    finally:
        out.close()
        err.close()


def _token_out_path(data_dir: Path) -> Path:
    return data_dir / ".token-create.out"


def finish_token_create(data_dir: Path, db_url: str, node_ids: Sequence[str],
                        proc: subprocess.Popen | None) -> dict[str, str]:
    """Each agent's token (node id -> secret): those just created (kept in the data folder) and
    those kept from an earlier run; an agent with neither is not in the answer."""
    if proc is not None:
        proc.wait()
        try:
            out = _token_out_path(data_dir).read_text()
        except OSError:
            out = ""
        finally:
            with contextlib.suppress(OSError):
                _token_out_path(data_dir).unlink()
        try:
            rows = [json.loads(line) for line in out.splitlines() if line.strip()]
            made = {str(r["node_id"]): str(r["token"]) for r in rows}
        except (ValueError, KeyError, TypeError):
            made = {}
        if proc.returncode != 0 or not made:
            log = data_dir / "logs" / "token-create.log"
            raise UpError(f"racer token create failed for {_safe_url(db_url)}; see {log}:\n" + log_tail(log, 8))
        for node_id, secret in made.items():
            write_atomic(_token_path(data_dir, db_url, node_id), secret + "\n", mode=0o600)
    return {n: t for n in node_ids if (t := _kept_token(data_dir, db_url, n)) is not None}


def _fleet_headers(fleet_token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {fleet_token}"} if fleet_token else {}


def gateway_routes_to(gw_url: str, node_urls: Sequence[str], fleet_token: str | None = None) -> bool:
    """Whether the gateway has every one of this run's agents in rotation (GET /v1/router, with the
    fleet token): on a reused database the registry first holds the agents' old addresses, and the
    load must not start before the gateway has caught up."""
    import httpx

    nodes = httpx.get(f"{gw_url}/v1/router", headers=_fleet_headers(fleet_token), timeout=2.0).json().get("nodes")
    if not isinstance(nodes, list):
        return True  # a gateway without that view: its /healthz is all we can ask
    live = {str(n.get("address", "")).rstrip("/") for n in nodes if n.get("live")}
    return set(node_urls) <= live


class TryLater(Exception):
    """The control plane answered, but with a 5xx: ask again on a later tick (as after a connection
    error or an answer that is not JSON, ``httpx.HTTPError`` and ``ValueError``)."""


API_TIMEOUT_S = 2.0  # racer up's own API calls run inside its tick loop: short, so Ctrl-C is prompt


def _answered(r) -> None:
    if r.status_code >= 500:
        raise TryLater(f"{r.request.method} {r.request.url.path} answered {r.status_code}")


def _whoami(api: str, secret: str) -> dict | None:
    """The kept token's identity as the control plane knows it (None: it does not)."""
    import httpx

    r = httpx.get(f"{api}/whoami", headers={"Authorization": f"Bearer {secret}"}, timeout=API_TIMEOUT_S)
    _answered(r)
    if r.status_code != 200:
        return None
    who = r.json()
    if not isinstance(who, dict):
        raise ValueError("GET /whoami: not a JSON object")
    return who


def ensure_router_token(data_dir: Path, db_url: str, cp_url: str, operator_token: str,
                        log: Callable[[str], None]) -> str:
    """The gateway's token: the one kept for this database in ``DATA/router_token.<db hash>`` if the
    control plane knows it as a ``router`` token, else a new one (``POST /api/v1/tokens``, role
    router: it may list the nodes, read the weights, register the gateway and post its client
    reports, nothing else), kept there (mode 0600) for the next run. Raises like
    `ensure_node_tokens`."""
    import hashlib

    import httpx

    api = f"{cp_url}/api/v1"
    path = data_dir / f"router_token.{hashlib.sha256(db_url.encode()).hexdigest()[:10]}"
    secret = path.read_text().strip() if path.exists() else ""
    if secret and (_whoami(api, secret) or {}).get("role") == "router":
        return secret
    r = httpx.post(f"{api}/tokens", json={"role": "router", "name": gateway_id_for(data_dir)},
                   headers={"Authorization": f"Bearer {operator_token}"}, timeout=API_TIMEOUT_S)
    _answered(r)
    if r.status_code != 201:
        raise UpError(f"the control plane refused to create the gateway's token: {r.status_code} {r.text[:300]}")
    secret = str(r.json()["token"])
    write_atomic(path, secret + "\n", mode=0o600)
    log("created the gateway's token (role router)")
    return secret


def ensure_node_tokens(data_dir: Path, db_url: str, cp_url: str, operator_token: str, node_ids: Sequence[str],
                       log: Callable[[str], None]) -> dict[str, str]:
    """Each agent's token (node id -> secret): the one kept for this database in
    ``DATA/node_token.<db hash>.<node id>`` if the control plane knows it as a node token bound to
    that id (GET /api/v1/whoami), else a new one (POST /api/v1/tokens with the operator token and
    ``replace``), kept there for the next run. A connection error or timeout (``httpx.HTTPError``,
    each call at most `API_TIMEOUT_S`), a 5xx (`TryLater`) or an answer that is not JSON
    (``ValueError``) is for the caller to try again later; a 4xx refusal is an `UpError`."""
    import httpx

    api = f"{cp_url}/api/v1"
    out: dict[str, str] = {}
    made = []
    for node_id in node_ids:
        secret = _kept_token(data_dir, db_url, node_id)
        if secret:
            who = _whoami(api, secret) or {}
            if who.get("role") == "node" and who.get("node_id") == node_id:
                out[node_id] = secret
                continue
        r = httpx.post(f"{api}/tokens", json={"role": "node", "name": f"racer-up-{node_id}", "node_id": node_id,
                                              "replace": True},
                       headers={"Authorization": f"Bearer {operator_token}"}, timeout=API_TIMEOUT_S)
        _answered(r)
        if r.status_code != 201:
            raise UpError(f"the control plane refused to create a token for {node_id}: {r.status_code} {r.text[:300]}")
        out[node_id] = r.json()["token"]
        write_atomic(_token_path(data_dir, db_url, node_id), out[node_id] + "\n", mode=0o600)
        made.append(node_id)
    if made:
        log(f"created a token (role node) for each of {', '.join(made)}")
    return out


def _safe_url(url: str) -> str:
    """A database URL without its password."""
    if "://" in url and "@" in url.split("://", 1)[1]:
        scheme, rest = url.split("://", 1)
        cred, hostpart = rest.rsplit("@", 1)
        return f"{scheme}://{cred.split(':', 1)[0]}:***@{hostpart}"
    return url


def start_profile(data_dir: Path, log: Callable[[str], None]) -> subprocess.Popen | None:
    """Start measuring the agents' cost profile into the data folder unless it is there already
    (measured once, reused by every later run)."""
    if (data_dir / "node_profile.json").exists():
        return None
    log("measuring this machine's miss costs once (racer node profile) into " + str(data_dir / "node_profile.json"))
    tmp = data_dir / ".node_profile.json.tmp"
    err = open(data_dir / "logs" / "node-profile.log", "ab")
    try:
        return subprocess.Popen(_racer("node", "profile", *PROFILE_ARGS, "--out", str(tmp), "--no-progress"),
                                cwd=REPO, stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        err.close()


def finish_profile(data_dir: Path, proc: subprocess.Popen | None) -> Path:
    path = data_dir / "node_profile.json"
    if proc is None:
        return path
    tmp = data_dir / ".node_profile.json.tmp"
    if proc.wait() != 0 or not tmp.exists():
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise UpError(f"racer node profile failed; see {data_dir / 'logs' / 'node-profile.log'}:\n"
                      + log_tail(data_dir / "logs" / "node-profile.log", 8))
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------------- status ---
def status_line(elapsed_s: float, snap: dict, alive: dict[str, bool], slo_ms: float) -> str:
    p99 = "-" if snap["recent_p99_ms"] is None else f"{snap['recent_p99_ms']:.1f} ms"
    slo = "-" if snap["recent_slo_attainment"] is None else f"{100 * snap['recent_slo_attainment']:.1f}%"
    nodes = [v for k, v in alive.items() if k.startswith("node-")]
    down = [k for k, v in alive.items() if not v]
    return (f"[{elapsed_s:6.0f} s] served {snap['requests_served']} (failed {snap['requests_failed']}, retried "
            f"{snap['requests_retried']})  P99 {p99}  SLO({slo_ms:g} ms) {slo}  regime {snap['regime'] or '-'} "
            f"(cycle {snap['cycle'] + 1})  nodes {sum(nodes)}/{len(nodes)} up"
            + (f"  DOWN: {','.join(down)}" if down else ""))


class _Replayer(threading.Thread):
    """The load generator in its own thread and event loop."""

    def __init__(self, targets, trace, config, stats) -> None:
        super().__init__(name="racer-up-replay", daemon=True)
        self.targets, self.trace, self.config, self.stats = targets, trace, config, stats
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        from workloads.replay import run_replay

        try:
            asyncio.run(run_replay(self.targets, self.trace, self.config, self.stats, loop_forever=True,
                                   stop=self.stop_event))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.error = e


def _validate(args) -> None:
    """Refuse bad options before anything is written or started."""
    if args.nodes < 1:
        raise UpError(f"--nodes must be >= 1, got {args.nodes}")
    if args.duration is not None and not args.duration > 0:
        raise UpError(f"--duration must be a positive number of seconds, got {args.duration}")
    for name in ("phase_s", "first_phase_s"):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise UpError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {v}")
    if args.policy is not None and not (Path(args.policy) / "manifest.json").exists():
        raise UpError(f"--policy {args.policy}: no policy artifact there (manifest.json missing); "
                      f"racer policy export writes one")
    _validate_model(args)
    for opt in ("dashboard_port", "control_plane_port", "gateway_port"):
        v = getattr(args, opt)
        if not 0 <= v <= 65535:
            raise UpError(f"--{opt.replace('_', '-')} must be in [0, 65535], got {v}")


def _validate_model(args) -> None:
    """A ``--model`` checkpoint directory, checked as the agents will check it (the checkpoint
    loader's own `load_checkpoint`, against the trace's items) before anything starts: a bad one
    would be refused by every agent, restarted forever. ``auto`` and ``none`` need no check."""
    model = resolve_model(getattr(args, "model", None), args.trace, args.path)
    if model is None or getattr(args, "model", None) == "auto":
        return
    from node_agent.model.checkpoint import CheckpointError, load_checkpoint  # torch: only for a --model
    from workloads.loaders import load_trace

    try:
        trace = load_trace(args.trace, args.path)
    except (OSError, ValueError) as e:
        raise UpError(f"--trace {args.trace}{f' --path {args.path}' if args.path else ''}: {e}") from None
    try:
        load_checkpoint(model, item_keys=list(trace.item_keys))
    except CheckpointError as e:
        raise UpError(f"--model {args.model}: {e}") from None


def claim_ports(args) -> dict[str, int]:
    """Every listening port of the control plane, the gateway and the dashboard, chosen before any
    work: a port asked for that is taken is refused at once (nothing written, nothing started)."""
    ports: dict[str, int] = {}
    for name in ("dashboard", "control-plane", "gateway"):
        opt = f"--{name}-port"
        asked = getattr(args, f"{name.replace('-', '_')}_port")
        if asked:
            if asked in ports.values():
                raise UpError(f"{opt} {asked}: another of racer up's processes has that port")
            if not port_free(asked):
                raise UpError(f"{opt} {asked} is taken (another racer up, or another program, listens there); "
                              f"pass another ({opt} 0: a free one). Nothing was started or written.")
            ports[name] = asked
    for name in ("dashboard", "control-plane", "gateway"):
        while name not in ports:
            port = free_port()
            if port not in ports.values():
                ports[name] = port
    return ports


@dataclass
class StartTimes:
    """Seconds from ``racer up``'s start to each step (None: not reached)."""

    control_plane_s: float | None = None
    url_s: float | None = None
    load_started_s: float | None = None
    first_served_s: float | None = None


class _Up:
    """One ``racer up`` run: its data folder, processes, load and start-up steps.

    Start-up is a sequence of steps checked every 0.25 s, none of which blocks the others: the
    agents' tokens (and the cost profile, once per folder) -> the control plane and the node agents
    (they spool their reports until it answers) -> once the control plane is healthy, its
    dependants: the gateway and the dashboard, and the policies (`racer.policy_seed`) -> the
    dashboard's URL as soon as it answers -> the load once the policies are in and the gateway
    routes to the agents. A dependant that exits is restarted with a back-off (a slow one is waited
    for) and named in a status line; it never stops the others. Only the control plane exiting
    before it ever answered (a bad ``--db``, say) ends the run, with the end of its log."""

    SEED_WAIT_S = 30.0  # the load waits at most this long after the control plane for the policies
    LOAD_GRACE_S = 20.0  # the load starts this long after the gateway answers even if not every agent is in

    def __init__(self, args, data_dir: Path, ports: dict[str, int], say: Callable[..., None],
                 stop: threading.Event) -> None:
        from workloads.loaders import load_trace

        self.args, self.data_dir, self.say, self.stop = args, data_dir, say, stop
        self.t0 = time.monotonic()
        self.times = StartTimes()
        self.operator_token = read_or_create_secret(data_dir / "operator_token", "racer_")
        self.trace = load_trace(args.trace, args.path)
        self.db_url = args.db or f"sqlite:///{data_dir / 'racer.db'}"
        commands = available_commands()
        self.node_envs: dict[str, dict[str, str]] = {}
        self.profiling = start_profile(data_dir, say) if args.policy else None
        self.profile: Path | None = data_dir / "node_profile.json" if args.policy else None
        self.plan = plan_processes(args, data_dir, commands, self.operator_token, self.node_envs, self.profile,
                                   self.db_url, ports)
        if self.plan.missing:
            say("this build has no " + ", ".join(f"racer {m}" for m in self.plan.missing) +
                ("; the load goes straight to the node agents" if "gateway" in self.plan.missing else ""))
        self.sup = Supervisor(self.plan.specs, data_dir / "logs", report=lambda line: say(line, err=True),
                              state_file=data_dir / "processes.json", secrets=[self.operator_token], cancel=stop)
        self.nodes = [s.spec.name for s in self.sup.procs if s.spec.name.startswith("node-")]  # also node ids
        self.reporting = bool(self.plan.control_plane_url)
        self.tokening = (start_token_create(data_dir, self.db_url, self.nodes, say)
                         if self.reporting and "token" in commands else None)
        if self.reporting and self.tokening is None:  # every agent's token kept from an earlier run
            self.give(finish_token_create(data_dir, self.db_url, self.nodes, None))
        self.policies: dict = {}
        self.replayer: _Replayer | None = None
        self.stats = None
        self._gateway_ready_s: float | None = None
        self._seeder: threading.Thread | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def has(self, name: str) -> bool:
        return any(p.spec.name == name for p in self.sup.procs)

    def started(self, name: str) -> bool:
        return self.has(name) and self.sup[name].popen is not None

    def give(self, tokens: dict[str, str]) -> list[str]:
        """Each agent its own token (its environment); the agents whose token changed."""
        changed = []
        for name, token in tokens.items():
            if self.node_envs[name].get("RACER_NODE_TOKEN") != token:
                self.node_envs[name]["RACER_NODE_TOKEN"] = token
                self.sup.secrets.append(token)
                changed.append(name)
        return changed

    # ---- start-up steps, each called every tick until done
    def step_helpers(self) -> None:
        """The token maker and the profile, once they finish: their results to the agents."""
        if self.tokening is not None and self.tokening.poll() is not None:
            proc, self.tokening = self.tokening, None
            self.give(finish_token_create(self.data_dir, self.db_url, self.nodes, proc))
        if self.profiling is not None and self.profiling.poll() is not None:
            proc, self.profiling = self.profiling, None
            try:
                finish_profile(self.data_dir, proc)
            except UpError as e:  # each agent measures its own miss costs instead
                self.say(f"{e}; the agents measure their own miss costs", err=True)
                for p in self.sup.procs:
                    if "--profile" in p.spec.argv:
                        k = p.spec.argv.index("--profile")
                        del p.spec.argv[k:k + 2]
                self.profile = None

    def step_start(self) -> None:
        """The control plane once the schema and tokens are made; the agents once their token and
        the profile are known (an agent without a token waits for the control plane's API)."""
        if self.tokening is not None:
            return
        if self.has("control-plane") and not self.started("control-plane"):
            self.say("starting the control plane" + (f" ({self.db_url.split(':', 1)[0]})" if self.args.db else ""))
            self.sup.start(["control-plane"], wait=False)
        if not self.has("control-plane") and self.has("gateway") and not self.started("gateway"):
            self.sup.start(["gateway"], wait=False)  # no control plane to wait for: the agents' URLs given
        if self.profiling is not None:
            return
        ready = [n for n in self.nodes if not self.started(n)
                 and (not self.reporting or "RACER_NODE_TOKEN" in self.node_envs[n])]
        if ready:
            self.say("starting " + ", ".join(ready))
            self.sup.start(ready, wait=False)

    def step_control_plane(self) -> None:
        """Once the control plane answers: tokens checked (or made) through its API, the agents
        whose token changed restarted, then its dependants started and the policies seeded."""
        cp = self.sup["control-plane"]
        if cp.popen is None or not self.sup.check_ready(cp):
            if cp.popen is not None and cp.popen.poll() is not None and cp.restarts >= 2:
                log = self.data_dir / "logs" / "control-plane.log"
                raise UpError(f"the control plane {describe_exit(cp.popen.returncode)} while starting, three "
                              f"times; the end of its log ({log}):\n{log_tail(log)}")
            return
        import httpx

        try:
            tokens = ensure_node_tokens(self.data_dir, self.db_url, self.plan.control_plane_url,
                                        self.operator_token, self.nodes, self.say)
            router_token = (ensure_router_token(self.data_dir, self.db_url, self.plan.control_plane_url,
                                                self.operator_token, self.say) if self.has("gateway") else None)
        except (httpx.HTTPError, ValueError, TryLater) as e:  # gone again, or not answering well: next tick
            self.say(f"control plane {self.plan.control_plane_url}: checking the tokens failed "
                     f"({type(e).__name__}: {str(e)[:200]}); trying again", err=True)
            cp.ready_s = None
            return
        if router_token is not None:
            self.sup.secrets.append(router_token)
            self.sup["gateway"].spec.env["RACER_GATEWAY_TOKEN"] = router_token
        self.times.control_plane_s = round(self.elapsed(), 1)
        self.say(f"control plane {self.plan.control_plane_url} healthy ({self.times.control_plane_s:g} s)")
        changed = self.give(tokens)
        for name in changed:
            if self.started(name):  # a token kept from an earlier run that this database does not know
                self.sup.restart(self.sup[name], self.args.stop_timeout_s)
        dependants = [n for n in ("gateway", "dashboard") if self.has(n)]
        if dependants:
            self.say("starting " + ", ".join(dependants))
            self.sup.start(dependants, wait=False)

    def _seed(self) -> None:
        from .policy_seed import seed_model, seed_policies

        try:
            self.policies = seed_policies(self.plan.control_plane_url, self.operator_token, Path(self.args.policy),
                                          self.data_dir, self.say)
        except Exception as e:  # noqa: BLE001 - the system runs on without them; say why
            self.policies = {"error": f"{type(e).__name__}: {e}"}
            self.say(f"could not register the policies ({type(e).__name__}: {e}); the agents run "
                     f"{self.args.policy} locally", err=True)
        model = resolve_model(getattr(self.args, "model", None), self.args.trace, self.args.path)
        if model is not None:
            try:
                self.policies["model"] = seed_model(self.plan.control_plane_url, self.operator_token, Path(model),
                                                    self.say)
            except Exception as e:  # noqa: BLE001 - the nodes serve it anyway; say why the registry lacks it
                self.policies["model"] = {"error": f"{type(e).__name__}: {e}"}
                self.say(f"could not register the model ({type(e).__name__}: {e}); the agents serve {model} "
                         f"locally", err=True)

    def policies_settled(self) -> bool:
        """The policy registration is done (or not asked for, or given up waiting on after
        ``SEED_WAIT_S``): the load starts on a settled registry."""
        if not (self.args.policy and self.args.seed_policies and self.plan.control_plane_url):
            return True
        if self._seeder is not None and not self._seeder.is_alive():
            return True
        return self.elapsed() - (self.times.control_plane_s or self.elapsed()) >= self.SEED_WAIT_S

    def step_url(self) -> None:
        if not self.sup.check_ready(self.sup["dashboard"]):
            return
        self.times.url_s = round(self.elapsed(), 1)
        self.say(f"dashboard     {self.plan.dashboard_url}")  # the URL last: tools read the line's last word
        # the token itself only to a person at a terminal, never to the log or a captured stream
        token_file = self.data_dir / "operator_token"
        at_terminal = sys.stdout.isatty() and not self.args.json
        self.say(f"operator token in {token_file} (mode 0600; sign in with it)",
                 console=f"operator token {self.operator_token}  (also in {token_file})" if at_terminal else None)

    def load_ready(self) -> bool:
        """The gateway routes to every agent of this run (or to one of them, ``LOAD_GRACE_S`` after
        it answered); without a gateway, every agent answers."""
        if not self.has("gateway"):
            return all(self.sup.check_ready(self.sup[n]) for n in self.nodes)
        gw = self.sup["gateway"]
        if gw.popen is None or gw.popen.poll() is not None:
            return False
        if self.sup.check_ready(gw):
            return True
        if self._gateway_ready_s is None:
            if _get_ok(f"{gw.spec.url}/healthz"):
                self._gateway_ready_s = time.monotonic()
            return False
        return (time.monotonic() - self._gateway_ready_s >= self.LOAD_GRACE_S
                and _gateway_routes_to_any(gw.spec.url, self.plan.node_urls, self.plan.fleet_token))

    def start_load(self) -> None:
        from workloads.replay import ReplayConfig, ReplayStats

        args = self.args
        first_phase_s = min(6.0, args.phase_s) if args.first_phase_s is None else args.first_phase_s
        cfg = ReplayConfig(schedule=tuple(args.schedule), rate_rps=args.rate,
                           duration_s=args.phase_s * len(args.schedule),
                           first_cycle_s=first_phase_s * len(args.schedule), slo_ms=args.slo_ms,
                           retries=1 if "gateway" in self.plan.missing and len(self.plan.targets) > 1 else 0,
                           max_history_len=256,  # within the CPU agents' --max-history-len (CPU_AGENT_ARGS)
                           # each user's next item among the candidates: the nodes' model-quality signal
                           # (what a model rollout is judged on) gets an observation per returning user
                           explicit_candidates=True, plant_next_item=True, seed=args.seed)
        self.stats = ReplayStats(args.slo_ms)
        self.replayer = _Replayer(self.plan.targets, self.trace, cfg, self.stats)
        self.replayer.start()
        self.times.load_started_s = round(self.elapsed(), 1)
        first = f" (the first pass {first_phase_s:g} s each)" if first_phase_s != args.phase_s else ""
        self.say(f"replaying {args.trace} {' -> '.join(args.schedule)} in a loop, {args.phase_s:g} s each{first}, base "
                 f"rate {args.rate:g} req/s, to {', '.join(self.plan.targets)}"
                 + (f"; stopping after {args.duration:g} s" if args.duration else "; Ctrl-C stops everything"))

    def startup_line(self) -> str:
        """What is up and what is still coming, while starting."""
        parts = []
        for p in self.sup.procs:
            if p.popen is None:
                state = "waiting"
            elif p.popen.poll() is not None:
                state = "exited, restarting"
            elif p.ready_s is not None:
                state = "up"
            else:
                state = f"starting {self.sup.clock() - p.started_s:.0f} s"
            if p.restarts:
                state += f", restart {p.restarts}"
            parts.append((p.spec.name, state))
        nodes = [s for n, s in parts if n.startswith("node-")]
        shown = [f"{n} {s}" for n, s in parts if not n.startswith("node-")]
        shown.append(f"nodes {sum(s == 'up' for s in nodes)}/{len(nodes)} up")
        helpers = [h for h, x in (("tokens", self.tokening), ("cost profile", self.profiling)) if x is not None]
        return (f"[{self.elapsed():6.0f} s] starting: " + ", ".join(shown)
                + (f"; making {' and '.join(helpers)}" if helpers else ""))

    def tick(self) -> None:
        """One start-up step (whatever is due) and the restarts of what exited."""
        self.sup.poll(skip=self.sup["control-plane"] if self.has("control-plane")
                      and self.times.control_plane_s is None and self.sup["control-plane"].restarts >= 2 else None)
        self.step_helpers()
        self.step_start()
        if self.has("control-plane") and self.times.control_plane_s is None:
            self.step_control_plane()
        for n in self.nodes:
            if self.started(n) and self.sup[n].ready_s is None:
                self.sup.check_ready(self.sup[n], timeout_s=0.5)
        if self.plan.dashboard_url and self.times.url_s is None and self.started("dashboard"):
            self.step_url()
        if self._seeder is None and self.args.policy and self.args.seed_policies and self.times.control_plane_s \
                is not None and (self.times.url_s is not None or not self.plan.dashboard_url
                                 or self.elapsed() - self.times.control_plane_s >= self.SEED_WAIT_S / 2):
            # after the dashboard's start, which it would slow down (the control plane checks each
            # artifact with the agent's loader)
            self._seeder = threading.Thread(target=self._seed, name="racer-up-policies", daemon=True)
            self._seeder.start()
        if self.replayer is None and (self.times.control_plane_s is not None or not self.has("control-plane")) \
                and all(self.started(n) for n in self.nodes) and self.policies_settled() and self.load_ready():
            self.start_load()
        if self.replayer is not None and self.times.first_served_s is None \
                and self.stats.snapshot()["requests_served"] > 0:
            self.times.first_served_s = round(self.elapsed(), 1)
            self.say(f"first requests served ({self.times.first_served_s:g} s after start)")

    def gateways_slo(self) -> dict | None:
        """What the gateways reported over the load, for the summary beside the load generator's
        own figure: ``{"slo_attainment", "num_requests"}``, request-weighted over every report
        since the load started (None: no control plane, no load, or it did not answer)."""
        if not (self.plan.control_plane_url and self.times.load_started_s is not None):
            return None
        import httpx

        started = time.time() - (time.monotonic() - (self.t0 + self.times.load_started_s))
        try:
            rows = httpx.get(f"{self.plan.control_plane_url}/api/v1/gateway-reports", timeout=10.0,
                             params={"start_s": started, "details": "false", "limit": 100_000},
                             headers={"Authorization": f"Bearer {self.operator_token}"}).json()
        except (httpx.HTTPError, ValueError):
            return None
        pairs = [(r["slo_attainment"], r["num_requests"]) for r in rows if isinstance(r, dict)
                 and r.get("slo_attainment") is not None and r.get("num_requests")]
        n = sum(w for _, w in pairs)
        return None if not n else {"slo_attainment": round(sum(v * w for v, w in pairs) / n, 4), "num_requests": n}

    def close(self) -> dict[str, int | None]:
        if self._seeder is not None and self._seeder.is_alive():  # not mid-upload: let it finish first
            self._seeder.join(30.0)
        for helper in (self.profiling, self.tokening):
            if helper is not None and helper.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(helper.pid, signal.SIGKILL)
                helper.wait()
        if self.replayer is not None and self.replayer.is_alive():
            self.replayer.stop_event.set()
            self.replayer.join(self.replayer.config.timeout_s + 5.0)
        return self.sup.stop(self.args.stop_timeout_s)


def _get_ok(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _gateway_routes_to_any(gw_url: str, node_urls: Sequence[str], fleet_token: str | None) -> bool:
    import httpx

    try:
        nodes = httpx.get(f"{gw_url}/v1/router", headers=_fleet_headers(fleet_token), timeout=2.0).json().get("nodes")
    except (httpx.HTTPError, ValueError, AttributeError):
        return False
    live = {str(n.get("address", "")).rstrip("/") for n in nodes or () if n.get("live")}
    return bool(live & set(node_urls))


def _sample_rss(up: _Up, rss: dict[str, dict], at_s: float) -> None:
    for p in up.sup.procs + [None]:
        if p is not None and p.popen is None:
            continue
        name, pid = ("racer-up", os.getpid()) if p is None else (p.spec.name, p.popen.pid)
        r = rss_bytes(pid)
        if r is None:
            continue
        e = rss.setdefault(name, {"pid": pid, "samples": []})
        if e["pid"] != pid:  # restarted: a new process, a new series
            e.update(pid=pid, samples=[])
        e["samples"].append((round(at_s, 1), r))


def _run(up: _Up, args, rss: dict[str, dict]) -> None:
    """Start-up, then the load, until ``--duration`` of load or a signal."""
    human = sys.stderr if args.json else sys.stdout  # with --json, stdout holds the report alone
    tty = human.isatty()
    every_s = 2.0 if tty else args.status_every_s
    next_status = time.monotonic() + every_s
    next_rss = time.monotonic()
    last_startup = ""
    while not up.stop.is_set():
        now = time.monotonic()
        up.tick()
        loading = up.replayer is not None
        if loading and args.duration is not None and now - up.t0 - up.times.load_started_s >= args.duration:
            break
        if loading and up.replayer.error is not None:
            raise UpError(f"the load generator stopped: {up.replayer.error!r}")
        if loading and now >= next_rss:
            _sample_rss(up, rss, now - up.t0 - up.times.load_started_s)
            next_rss = now + args.rss_every_s
        if now >= next_status:
            if loading:
                line = status_line(now - up.t0 - up.times.load_started_s, up.stats.snapshot(), up.sup.alive(), args.slo_ms)
            else:
                line = up.startup_line()
                if not tty and line.split("] ", 1)[1] == last_startup:  # unchanged: not again in a log
                    line = ""
                else:
                    last_startup = line.split("] ", 1)[1]
            if line and tty:
                print("\r" + line[:200].ljust(120), end="", file=human, flush=True)
            elif line:
                print(line, file=human, flush=True)
            next_status = now + every_s
        up.stop.wait(0.25)
    if tty:
        print(file=human)


def cmd_up(args) -> int:
    _validate(args)
    data_dir = Path(args.data_dir).resolve()
    ports = claim_ports(args)  # before the data folder: a taken port leaves nothing behind
    made = not data_dir.exists()
    check_data_dir(data_dir)
    lock = DataLock(data_dir)
    t_start = time.monotonic()
    up_log = open(data_dir / "logs" / "up.log", "a")

    def say(line: str, err: bool = False, console: str | None = None) -> None:
        """``line`` to the log and the console; ``console`` replaces it on the console only."""
        with contextlib.suppress(ValueError):  # closed: a late line from the policy thread
            up_log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
            up_log.flush()
        print(f"racer up: {console or line}", file=sys.stderr if err or args.json else sys.stdout, flush=True)

    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum, frame) -> None:
        received.append(signum)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    up: _Up | None = None
    report: dict = {}
    rss: dict[str, dict] = {}
    codes: dict[str, int | None] = {}
    try:
        say(f"data folder {data_dir} ({'made by this run' if made else 'reused'}; logs in {data_dir / 'logs'})")
        up = _Up(args, data_dir, ports, say, stop)
        _run(up, args, rss)
        why = f"signal {signal.Signals(received[0]).name}" if received else "--duration reached"
        say(f"stopping ({why}): load generator first, then the processes")
        report = {"stopped_by": why, "gateways": up.gateways_slo()}
    except (UsageError, ValueError, OSError) as e:
        if made:
            raise UpError(f"{e}\n(this run made the data folder {data_dir}; its logs are in {data_dir / 'logs'})") \
                from None
        raise
    finally:
        if up is not None:
            codes = up.close()
        for s, h in old.items():
            signal.signal(s, h)
        if up is not None:
            say("stopped: " + ", ".join(f"{k} {describe_exit(v) if v is not None else '?'}" for k, v in
                                        reversed(list(codes.items()))))
        lock.release()
        up_log.close()
    return _final_report(up, args, report, codes, rss, t_start)


def _final_report(up: _Up, args, report: dict, codes: dict, rss: dict, t_start: float) -> int:
    from workloads.replay import ReplayStats

    stats = up.stats or ReplayStats(args.slo_ms)
    rep = stats.report()
    t_load = up.t0 + up.times.load_started_s if up.times.load_started_s is not None else time.monotonic()
    out = {**report, "elapsed_s": round(time.monotonic() - t_start, 1), "load_s": round(time.monotonic() - t_load, 1),
           "startup": asdict(up.times), "policies": up.policies,
           "dashboard_url": up.plan.dashboard_url, "control_plane_url": up.plan.control_plane_url,
           "targets": up.plan.targets, "missing": up.plan.missing, **rep,
           "processes": {p.spec.name: {"restarts": p.restarts, "exits": p.exits, "exit_code": codes.get(p.spec.name)}
                         for p in up.sup.procs},
           "rss": {k: {"pid": v["pid"], "samples": v["samples"]} for k, v in rss.items()}}
    gw = report.get("gateways") or {}
    print(f"racer up: served {rep['requests_served']} of {rep['requests_sent']} (failed {rep['requests_failed']}, "
          f"lost {rep['requests_lost']}), P99 {rep['p99_ms']} ms, SLO attainment {rep['slo_attainment']} as the load "
          f"generator saw it" + (f", {gw['slo_attainment']} as the gateways reported it ({gw['num_requests']} "
                                 f"requests; they do not see the time before they read a request)" if gw else ""),
          file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps(out))
    if args.report:
        write_atomic(Path(args.report), json.dumps(out) + "\n")
    return 0


def add_up_parser(subparsers) -> None:
    from workloads.loaders import LOADERS

    def schedule(text: str) -> list[str]:
        from workloads.replay import parse_schedule

        try:
            return list(parse_schedule(text))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    def devices(text: str) -> list[str]:
        try:
            return parse_devices(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    up = subparsers.add_parser(
        "up", help="run the whole system here: control plane, node agents, gateway, dashboard, trace replay",
        description="Start the control plane (SQLite in the data folder), N node agents with the shipped policy, "
                    "the gateway and the dashboard, then replay a trace through steady -> trend -> burst in a "
                    "loop. Prints the dashboard URL and the operator token, and one status line. Ctrl-C or "
                    "SIGTERM stops everything.")
    up.add_argument("--nodes", type=int, default=4, help="node agents (default 4)")
    up.add_argument("--devices", type=devices, default=None,
                    help="devices for the agents, one agent per device round robin, e.g. cuda:0,cuda:1 (default: "
                         "each agent's own choice, CUDA when torch sees a GPU, else the CPU)")
    up.add_argument("--trace", default="taobao", choices=sorted(LOADERS), help="trace to serve and replay (default "
                                                                                "taobao, the bundled sample)")
    up.add_argument("--path", default=None, help="trace file (default: the sample under $RACER_DATA_DIR or "
                                                 "../shared/data)")
    up.add_argument("--model", default="auto",
                    help="checkpoint every node serves (racer model train): auto (default) is the one shipped for "
                         "--trace's bundled sample (taobao's), used when --path is not given (random weights "
                         "otherwise), none is random weights, else a checkpoint directory trained on the trace")
    up.add_argument("--db", default=None, help="database URL (default: sqlite in the data folder; e.g. "
                                               "postgresql+psycopg://user@host/racer)")
    up.add_argument("--policy", default=str(DEFAULT_POLICY),
                    help="allocator policy artifact for every node (default: the shipped policies/default)")
    up.add_argument("--data-dir", default="racer-data", help="database, tokens, logs (default ./racer-data; a "
                                                             "second run reuses it)")
    up.add_argument("--duration", type=float, default=None, help="stop by itself after this many seconds of load "
                                                                 "(default: run until Ctrl-C)")
    up.add_argument("--rate", type=float, default=8.0, help="base request rate of the replay, req/s (default 8; "
                                                            "bursts reach 4x)")
    up.add_argument("--schedule", type=schedule, default=["steady", "trend", "burst"],
                    help="regimes replayed in a loop (default steady,trend,burst)")
    up.add_argument("--phase-s", type=float, default=15.0, help="seconds per regime (default 15)")
    up.add_argument("--first-phase-s", type=float, default=None,
                    help="seconds per regime in the first pass (default: 6, or --phase-s if shorter; the first "
                         "burst phase then starts 12 s into the load, after the nodes' 10 s warm-up)")
    up.add_argument("--seed", type=int, default=0, help="the replay's seed: which users and bursts (default 0)")
    up.add_argument("--slo-ms", type=float, default=50.0, help="latency SLO, ms (default 50)")
    up.add_argument("--sample-rate", type=float, default=0.0,
                    help="fraction of users whose requests the gateway samples for what-if runs (0: off, the "
                         "default; the key is made once in DATA/sample.key)")
    up.add_argument("--dashboard-port", type=int, default=8050, help="dashboard port (default 8050; 0: a free one)")
    up.add_argument("--control-plane-port", type=int, default=0, help="control plane port (default: a free one)")
    up.add_argument("--gateway-port", type=int, default=0, help="gateway port (default: a free one)")
    up.add_argument("--status-every-s", type=float, default=10.0,
                    help="status line period when stdout is not a terminal (default 10)")
    up.add_argument("--rss-every-s", type=float, default=5.0, help="RSS sampling period (default 5)")
    up.add_argument("--stop-timeout-s", type=float, default=20.0,
                    help="SIGKILL a process that has not stopped this long after SIGTERM (default 20)")
    up.add_argument("--no-policies", dest="seed_policies", action="store_false",
                    help="do not register the policy and a derived candidate in the control plane's registry")
    up.add_argument("--json", action="store_true", help="print a JSON report at the end")
    up.add_argument("--report", default=None, help="also write the JSON report to this file")
    up.set_defaults(func=cmd_up)
