"""The ``racer node`` and ``racer node-agent`` subcommands; racer/cli.py registers them with
`add_node_parser`.

    racer node profile [--json] [--out FILE] [--lengths 128,512,2048] [--repeats 5] [--model DIR] ...
    racer node-agent --port P --trace KIND [--path PATH] [--emb-share 0.5] [--slo-ms 30] [--seed 0]
                     [--policy DIR] [--profile FILE] [--model DIR] ...

Options backed by a config field (``*_FIELDS`` below) read their default, help and range from
it (`common.config.add_config_arguments`), so building these parsers imports the engine and agent
modules (torch, fastapi); ``racer --help`` builds none of them and stays fast.
Errors a user can fix raise ValueError / FileNotFoundError, which racer's ``main`` prints as one
line with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from common.config import add_config_arguments, config_kwargs, default_of
from common.secrets_args import FLEET_TOKEN_ENV, add_secret_arguments

from .argtypes import port, positive_int

log = logging.getLogger("racer.node_agent")

# options whose default, help and range are read from a config's fields (`common.config.add_config_arguments`)
MODEL_FIELDS = ("embedding_dim", "num_layers", "num_heads", "qk_dim")  # ModelConfig; --head-dim sets qk_dim and v_dim
LINK_FIELDS = ("mode", "bandwidth_gb_per_s", "latency_us")  # LinkEmulationConfig, as --link-*
PROFILE_FIELDS = ("repeats", "emb_batch_rows", "num_candidates")  # ProfileConfig
ENGINE_FIELDS = ("num_pages", "max_history_len", "max_candidates", "default_top_k")  # EngineConfig (and emb_share)
AGENT_FIELDS = ("slo_ms", "max_batch", "batch_window_us", "max_queue", "max_body_bytes", "large_prefill_tokens",
                "max_prefill_tokens_per_batch", "request_timeout_s", "control_interval_s",
                "metrics_window_s")  # AgentConfig
REPORTER_FIELDS = ("max_buffered_reports", "max_memory_reports", "service_time_us")  # ReporterConfig


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from .engine import EngineConfig
    from .model import ModelConfig

    g = p.add_argument_group("model (HSTU; a trained checkpoint with --model, else weights initialised from --seed)")
    g.add_argument("--model", default=None, metavar="DIR",
                   help="a checkpoint directory (racer model train): its weights, item table and shape are used "
                        "and --embedding-dim, --num-layers, --num-heads and --head-dim are ignored; it must have "
                        "been trained on the trace served here (default: random weights from --seed)")
    add_config_arguments(g, ModelConfig, MODEL_FIELDS, flags={"qk_dim": "--head-dim"},
                         helps={"qk_dim": "per-head size of Q, K and V (one size: the KV pages store K and V alike)"})
    add_config_arguments(g, EngineConfig, ["page_tokens"])
    kv_dtype, device, seed = (default_of(EngineConfig, "kv_dtype"), default_of(EngineConfig, "device"),
                              default_of(ModelConfig, "seed"))
    g.add_argument("--kv-dtype", choices=("float32", "float16", "bfloat16"), default=kv_dtype,
                   help=f"K/V storage type in the pages (default {kv_dtype})")
    g.add_argument("--device", default=device, help=f"auto (CUDA when torch sees a GPU, else CPU), cpu, cuda[:N] "
                                                    f"(default {device})")
    g.add_argument("--threads", type=positive_int, default=1,
                   help="torch intra-op threads on the CPU (default 1: these VMs are shared)")
    g.add_argument("--seed", type=int, default=seed, help=f"seed of the model weights and the item table (default {seed})")


def _add_link_args(p: argparse.ArgumentParser) -> None:
    from .engine import LinkEmulationConfig

    g = p.add_argument_group("link emulation (charges EMB misses what a PCIe link would; see docs/engine.md)")
    add_config_arguments(g, LinkEmulationConfig, LINK_FIELDS, prefix="link-", flags={"mode": "--link-emulation"})


def _model_config(args):
    from .model import ModelConfig

    kw = config_kwargs(args, MODEL_FIELDS)
    return ModelConfig(**kw, v_dim=kw["qk_dim"], seed=args.seed)


def _checkpoint(args, trace=None):
    """The checkpoint of ``--model`` (verified; with ``trace``, checked against its items), or None."""
    if not getattr(args, "model", None):
        return None
    from .model.checkpoint import load_checkpoint

    return load_checkpoint(args.model, item_keys=None if trace is None else list(trace.item_keys))


def _link_config(args):
    from .engine import LinkEmulationConfig

    return LinkEmulationConfig(**config_kwargs(args, LINK_FIELDS, prefix="link-"))


def _set_threads(args) -> None:
    import torch

    torch.set_num_threads(args.threads)


# ------------------------------------------------------------------------------------ profile ---


def cmd_node_profile(args) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from .profile import ProfileConfig, measure_profile, parse_lengths, profile_steps

    _set_threads(args)
    ckpt = _checkpoint(args)
    cfg = ProfileConfig(model=ckpt.config if ckpt is not None else _model_config(args),
                        lengths=parse_lengths(args.lengths), **config_kwargs(args, PROFILE_FIELDS),
                        page_tokens=args.page_tokens, kv_dtype=args.kv_dtype, link=_link_config(args),
                        device=args.device, seed=args.seed)
    out = Path(args.out) if args.out else None
    if out is not None and out.parent and not out.parent.exists():
        raise FileNotFoundError(f"--out: directory {out.parent} does not exist")
    with tqdm(total=profile_steps(cfg), desc="racer node profile", unit="run", delay=2.0, file=sys.stderr,
              disable=args.no_progress) as bar:
        prof = measure_profile(cfg, progress=lambda: bar.update(1), checkpoint=ckpt)
    if out is not None:  # a file only when asked for: never a stray node_profile.json in the cwd
        out.write_text(json.dumps(prof, indent=2) + "\n")
    if args.json:
        print(json.dumps(prof))
    else:
        kv = ", ".join(f"{k}: {v:.3g}" for k, v in prof["kv_recompute_us_per_token"].items())
        print(f"device {prof['device']} (link emulated: {prof['link_emulated']})\n"
              f"  kv_recompute_us_per_token  {{{kv}}}\n"
              f"  emb_transfer_us_per_row    {prof['emb_transfer_us_per_row']:.4g}\n"
              f"  emb_hit_us_per_row         {prof['emb_hit_us_per_row']:.4g}\n"
              f"  kv_read_us_per_token       {prof['kv_read_us_per_token']:.4g}\n"
              f"  rank_us_per_candidate      {prof['rank_us_per_candidate']:.4g}"
              + (f"\nwrote {out}" if out is not None else ""))
    return 0


# --------------------------------------------------------------------------------- node agent ---


def build_agent(args, *, announce=None):
    """The engine and agent of ``racer node-agent`` from parsed arguments (also used by tests)."""
    from workloads.loaders import load_trace

    from .agent import AgentConfig, NodeAgent
    from .engine import Engine, EngineConfig

    _set_threads(args)
    emulation, clock, refill = _emulation(args)
    trace = load_trace(args.trace, args.path, max_rows=args.max_rows)
    ckpt = _checkpoint(args, trace)  # refused here (CheckpointError) before anything starts
    ecfg = EngineConfig(
        model=ckpt.config if ckpt is not None else _model_config(args), num_items=trace.num_items,
        item_seed=args.seed, page_tokens=args.page_tokens, kv_dtype=args.kv_dtype, emb_share=args.emb_share,
        **config_kwargs(args, ENGINE_FIELDS),
        default_num_candidates=min(args.default_num_candidates, args.max_candidates, trace.num_items),
        link=_link_config(args), device="cpu" if emulation is not None else args.device, emulation=emulation,
        **({"refill": refill} if refill is not None else {}))
    acfg = AgentConfig(**config_kwargs(args, AGENT_FIELDS))
    engine = Engine(ecfg, item_popularity=trace.item_popularity(), checkpoint=ckpt,
                    **({"clock": clock} if clock is not None else {}))
    allocator = None
    costs = None
    if args.profile:
        costs = _read_costs(args.profile)
    elif emulation is not None:  # the emulated device's miss costs are its profile's
        costs = emulated_costs(engine.emu.profile)
    control_plane = getattr(args, "control_plane", None)
    if args.policy or control_plane:
        # with a control plane the allocator exists even without a policy: it applies overrides and
        # the policy versions the control plane hands out (without a policy it holds the split)
        from .allocator import AllocatorConfig, PolicyLoadError, SmartAllocator

        allocator = SmartAllocator(AllocatorConfig(initial_emb_share=args.emb_share))
        try:
            if args.policy:
                allocator.load_policy(args.policy)
        except PolicyLoadError as e:  # e.g. another feature schema: run on, holding the split, and say why
            msg = f"policy refused, running without it (the split stays at {args.emb_share}): {e}"
            log.warning("%s", msg)
            if announce:
                announce(msg)
        if costs is None:  # the allocator needs the node's miss costs: measure them now (a few seconds)
            from .profile import ProfileConfig, measure_profile

            if announce:
                announce("no --profile given: measuring the node's miss costs for the allocator")
            prof = measure_profile(ProfileConfig(model=ecfg.model, lengths=(128, 512), repeats=3,
                                                 page_tokens=ecfg.page_tokens, kv_dtype=ecfg.kv_dtype,
                                                 link=ecfg.link, device=args.device, seed=args.seed),
                                   checkpoint=ckpt)
            costs = {k: prof[k] for k in ("kv_recompute_us_per_token", "emb_transfer_us_per_row",
                                          "emb_hit_us_per_row")}
    from .model.checkpoint import item_keys_digest

    info = {"trace": trace.name, "trace_path": trace.source_path, "num_users_in_trace": trace.num_users,
            "item_keys_sha256": item_keys_digest(list(trace.item_keys)),
            "policy": args.policy, "profile": args.profile, "model": dict(engine.model_info)}
    from .residency_feed import ResidencyFeed

    feed = ResidencyFeed(trace.item_shard, trace.item_popularity(), num_shards=trace.num_shards)
    agent = NodeAgent(engine, acfg, allocator=allocator, miss_costs=costs, info=info, residency=feed,
                      clock=clock)
    if getattr(args, "allow_reset", False):
        pop = trace.item_popularity()

        def rebuild(emb_share: float, with_allocator: bool):
            from dataclasses import replace

            eng = Engine(replace(ecfg, emb_share=emb_share), item_popularity=pop, checkpoint=ckpt,
                         **({"clock": clock} if clock is not None else {}))
            if not with_allocator:
                return eng, None
            if not args.policy:
                raise ValueError("an allocator needs a policy: start the agent with --policy DIR")
            from .allocator import AllocatorConfig, SmartAllocator

            alloc = SmartAllocator(AllocatorConfig(initial_emb_share=emb_share))
            alloc.load_policy(args.policy)
            return eng, alloc

        agent.reset_factory = rebuild
    return agent


def _emulation(args):
    """``--emulate`` / ``--time-scale``: (EmulationConfig, ScaledClock, RefillConfig), or Nones."""
    prof_name = getattr(args, "emulate", None)
    if not prof_name:
        if getattr(args, "time_scale", 1.0) != 1.0 or getattr(args, "refill_link_fraction", None) is not None:
            raise ValueError("--time-scale and --refill-link-fraction need --emulate PROFILE")
        return None, None, None
    from .emulated import EmulationConfig, ScaledClock, emulated_refill
    emu = EmulationConfig(prof_name, args.time_scale)
    prof = emu.resolve()  # an unknown preset or a bad file is refused here
    frac = 0.1 if args.refill_link_fraction is None else args.refill_link_fraction
    return emu, ScaledClock(emu.time_scale), emulated_refill(prof, frac)


def emulated_costs(profile) -> dict:
    """The miss costs an emulated agent's allocator and router weights read: its profile's."""
    return {"kv_recompute_us_per_token": profile.kv_recompute_us_per_token,
            "emb_transfer_us_per_row": profile.emb_transfer_us_per_row,
            "emb_hit_us_per_row": profile.emb_hit_us_per_row}


def _read_costs(path: str) -> dict:
    from .profile import read_node_profile

    data = read_node_profile(path)
    return {k: data[k] for k in ("kv_recompute_us_per_token", "emb_transfer_us_per_row", "emb_hit_us_per_row")
            if k in data}


def _node_token(args) -> str:
    from common.secrets_args import read_secret

    token = read_secret(args, "token", "RACER_NODE_TOKEN", prog="racer node-agent")
    if not token:
        raise ValueError("--control-plane needs --token-file (or RACER_NODE_TOKEN): a token of role node")
    return token


def reporter_config(args, host: str, port: int):
    """The `ReporterConfig` of ``racer node-agent --control-plane ...`` once the port is known."""
    import socket

    from .reporter import ReporterConfig, default_node_id, default_state_dir

    token = _node_token(args)
    node_id = args.node_id or default_node_id(port)
    if args.advertise_url:
        advertise = args.advertise_url.rstrip("/")
    else:
        h = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        advertise = f"http://{'[' + h + ']' if ':' in h else h}:{port}"
    return ReporterConfig(control_plane_url=args.control_plane.rstrip("/"), token=token, node_id=node_id,
                          advertise_url=advertise, state_dir=args.state_dir or default_state_dir(node_id),
                          **config_kwargs(args, REPORTER_FIELDS))


def cmd_node_agent(args) -> int:
    from .agent import create_app
    from common.http_server import serve_forever
    from common.secrets_args import read_secret, require_fleet_token

    def announce(msg: str) -> None:
        print(f"racer node-agent: {msg}", flush=True)

    fleet_token = read_secret(args, "fleet-token", FLEET_TOKEN_ENV, prog="racer node-agent")
    require_fleet_token(fleet_token, args.host, "the node agent")
    if args.control_plane:
        reporter_config(args, args.host, args.port or 1)  # refuse a bad option (token, ids, URLs) before loading
    agent = build_agent(args, announce=announce)
    agent.fleet_token = fleet_token
    eng = agent.engine

    def ready(host: str, port: int) -> None:
        announce(f"serving on http://{host}:{port} (device {eng.device_info()['label']}, "
                 f"{eng.config.num_items} items, emb_share {eng.mm.emb_share:.3f}, "
                 f"allocator: {'on' if agent.allocator is not None else 'off'})")
        if not fleet_token:
            announce(f"no fleet token (${FLEET_TOKEN_ENV}): /v1/residency is open to local callers")
        mi = eng.model_info
        announce(f"model: checkpoint {mi['path']} (digest {mi['digest']})" if mi["kind"] == "checkpoint"
                 else f"model: random weights from seed {mi['seed']} (no --model)")
        if args.control_plane:
            from .reporter import Reporter

            rep = Reporter(agent, reporter_config(args, host, port))
            agent.reporter = rep
            resumed = rep.restore_allocator()  # what the previous process of this node had learned
            if resumed:
                announce(f"allocator resumed: {resumed}")
            agent.control_hooks.append(rep.on_control)
            rep.start()
            announce(f"reporting to {args.control_plane} as node {rep.config.node_id} "
                     f"(spool {rep.config.state_dir}, next seq {rep.spool.next_seq}, {len(rep.spool)} buffered)")

    try:
        serve_forever(create_app(agent), args.host, args.port, log_level=args.log_level, ready=ready)
    finally:
        if agent.reporter is not None:
            agent.reporter.stop()
    announce("stopped")
    return 0


def add_node_parser(subparsers) -> None:
    """Add ``node`` (with ``profile``) and ``node-agent`` to racer's top-level subparsers."""
    from workloads.loaders import LOADERS

    from .agent import AgentConfig
    from .engine import EngineConfig
    from .profile import ProfileConfig
    from .reporter import ReporterConfig

    node = subparsers.add_parser("node", help="node-level tools: measure the device's cost profile",
                                 description="Tools for one serving node (one device).")
    sub = node.add_subparsers(dest="node_command", metavar="SUBCOMMAND", required=True)
    pr = sub.add_parser("profile", help="measure KV recompute, EMB transfer and hit-path costs on this device",
                        description="Measure the node's miss costs (kv_recompute_us_per_token by history length, "
                                    "emb_transfer_us_per_row) and hit-path costs, and write the cost profile "
                                    "that router weights and the simulator read.")
    _add_model_args(pr)
    _add_link_args(pr)
    lengths = ",".join(map(str, default_of(ProfileConfig, "lengths")))
    pr.add_argument("--lengths", default=lengths,
                    help=f"history lengths for kv_recompute_us_per_token (default {lengths})")
    add_config_arguments(pr, ProfileConfig, PROFILE_FIELDS)
    pr.add_argument("--out", default=None,
                    help="also write the profile to this file (default: print only, write no file)")
    pr.add_argument("--json", action="store_true", help="print the profile as one JSON object")
    pr.add_argument("--no-progress", action="store_true", help="no progress bar")
    pr.set_defaults(func=cmd_node_profile)

    ag = subparsers.add_parser("node-agent", help="serve recommendations on this node over HTTP",
                               description="The node agent: the GR engine (model, EMB cache, KV pool, Memory "
                                           "Manager) behind POST /v1/recommend, GET /healthz and GET /v1/metrics.")
    ag.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ag.add_argument("--port", type=port, default=8100, help="port (0: a free one; default 8100)")
    ag.add_argument("--trace", required=True, choices=sorted(LOADERS),
                    help="trace format; the item count comes from the trace")
    ag.add_argument("--path", default=None,
                    help="trace file (default: the sample under $RACER_DATA_DIR or ../shared/data)")
    ag.add_argument("--max-rows", type=positive_int, default=None, help="read at most this many interactions")
    add_config_arguments(ag, EngineConfig, ["emb_share"])
    add_config_arguments(ag, AgentConfig, ["slo_ms"])
    ag.add_argument("--policy", default=None,
                    help="SmartAllocator policy artifact directory (default: none, emb_share stays fixed)")
    ag.add_argument("--profile", default=None,
                    help="cost profile (racer node profile) for the allocator's miss costs (default: measured "
                         "at start when --policy is given)")
    g = ag.add_argument_group("memory and limits")
    add_config_arguments(g, EngineConfig, ENGINE_FIELDS + ("default_num_candidates",),
                         flags={"default_num_candidates": "--num-candidates", "default_top_k": "--top-k"})
    g = ag.add_argument_group("serving loop")
    add_config_arguments(g, AgentConfig, AGENT_FIELDS[1:])
    g.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn log level (default warning)")
    g = ag.add_argument_group("control plane (optional: without --control-plane the agent runs on its own)")
    g.add_argument("--control-plane", default=None, metavar="URL",
                   help="control plane base URL (http://host:port): register, report every control interval, "
                        "apply directives")
    add_secret_arguments(g, "token", "RACER_NODE_TOKEN", "bearer token of role node")
    add_secret_arguments(g, "fleet-token", FLEET_TOKEN_ENV, "token the gateway shows to read this agent's residency "
                         "feed (the same on the gateway and every agent; needed to listen beyond loopback)",
                         file_only=True)
    g.add_argument("--node-id", default=None, help="this node's id (default: <hostname>-<port>)")
    g.add_argument("--advertise-url", default=None,
                   help="the agent's URL for gateways (default: http://<host>:<port>)")
    g.add_argument("--state-dir", default=None,
                   help="report spool, sequence counter and downloaded policies "
                        "(default: $XDG_STATE_HOME or ~/.local/state, then racer/node-agent/<node-id>)")
    add_config_arguments(g, ReporterConfig, REPORTER_FIELDS)
    _add_model_args(ag)
    _add_link_args(ag)
    g = ag.add_argument_group("emulated device (the agent real, the device's time charged from a cost profile; "
                              "see docs/fleet.md)")
    g.add_argument("--emulate", default=None, metavar="PROFILE",
                   help="emulate a device: a preset (a100-hstu) or a racer node profile JSON; no model runs, the "
                        "arena is metadata only, and every figure the agent gives is in modelled time and says so")
    g.add_argument("--time-scale", type=float, default=1.0, metavar="K",
                   help="with --emulate: wall seconds per modelled second (default 1; a small machine running "
                        "many emulated agents needs more)")
    g.add_argument("--allow-reset", action="store_true",
                   help="serve POST /v1/admin/reset {emb_share, allocator}, a cold start without restarting the "
                        "process (for benches on a local fleet; off by default: no one else needs it)")
    g.add_argument("--refill-link-fraction", type=float, default=None, metavar="F",
                   help="with --emulate: the background refill's byte budget as a fraction of the profile's link "
                        "(default 0.1, the simulator's)")
    ag.set_defaults(func=cmd_node_agent)
