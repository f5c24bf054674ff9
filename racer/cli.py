"""The ``racer`` command line: a table of subcommands, each imported only when it runs.

``racer --help`` lists every subcommand from `COMMANDS` alone: it imports no subcommand's module
(no torch, fastapi, dash or numpy), so it answers at once. ``racer NAME ...`` (and ``racer NAME
--help``) imports NAME's module and nothing of the others.

Adding a subcommand
-------------------
1. Write a registrar in your own module, ``add_x_parser(subparsers)``: it calls
   ``subparsers.add_parser("x", description=...)``, adds the options, nested subcommands if any,
   and ``set_defaults(func=cmd_x)``; ``cmd_x(args) -> int`` is the exit status. Keep the module's
   top-level imports light (import torch, fastapi and the like inside ``cmd_x``), so that
   ``racer x --help`` stays fast too.
2. Add one line to `COMMANDS` below: ``"x": Command("package.module:add_x_parser", "one-line help")``.
   The help in the table is what ``racer --help`` shows (a ``help=`` passed by the registrar is
   replaced by it). One registrar may add several top-level names (``node`` and ``node-agent``):
   give each name its own line, pointing at the same registrar; when one of them runs, only that
   name's parser is built.
3. A nested subcommand (``racer policy push``) needs no line here: the ``policy`` registrar adds
   ``push`` to its own subparsers.

Errors a user can fix (a missing file, a bad line, a bad option) print one line on stderr and exit
with status 2 (`racer.errors.UsageError`, ValueError, FileNotFoundError, ...); nothing prints a
traceback for them. Every subcommand has ``--help``; tests/test_cli.py walks them all
(``build_parser()`` with no argument builds every one).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from . import __version__
from .errors import UsageError


@dataclass(frozen=True)
class Command:
    """One top-level subcommand: ``registrar`` is ``"module:function"``, the function that adds its
    parser to racer's subparsers (imported only when this subcommand runs); ``help`` is its line
    in ``racer --help``."""

    registrar: str
    help: str

    def load(self):
        module, _, function = self.registrar.partition(":")
        return getattr(importlib.import_module(module), function)


COMMANDS: dict[str, Command] = {
    "workload": Command("racer.workload:add_workload_parser",
                        "load traces, describe them, generate and plot request streams"),
    "replay": Command("racer.workload:add_replay_parser",
                      "open-loop load generator: replay a trace through regimes against a gateway"),
    "policy": Command("racer.ops:add_policy_parser",
                      "train, export and verify SmartAllocator policies; judge one offline (policy whatif)"),
    "node": Command("node_agent.cli:add_node_parser", "node-level tools: measure the device's cost profile"),
    "node-agent": Command("node_agent.cli:add_node_parser", "serve recommendations on this node over HTTP"),
    "model": Command("node_agent.model.cli:add_model_parser",
                     "train and evaluate the GR model node agents serve; inspect and push checkpoints"),
    "gateway": Command("gateway.cli:add_gateway_parser",
                       "route recommendation requests to node agents (EMB-KV-aware)"),
    "up": Command("racer.up:add_up_parser",
                  "run the whole system here: control plane, node agents, gateway, dashboard, trace replay"),
    "dashboard": Command("dashboard.cli:add_dashboard_parser",
                         "the operator dashboard (Dash), a client of the control-plane API"),
    "bench": Command("racer.cli:add_bench_parser",
                     "experiments: the paper's table (simulator), the fleet A/B (real processes)"),
    "control-plane": Command("control_plane.cli:add_control_plane_parser",
                             "run the control plane (API, SQL history, jobs)"),
    "token": Command("control_plane.cli:add_control_plane_parser", "manage control-plane bearer tokens"),
    "override": Command("racer.ops:add_override_parser", "list, set and clear emb_share overrides (a running system)"),
    "rollout": Command("racer.ops:add_rollout_parser", "start and steer policy and model rollouts (a running system)"),
    "whatif": Command("racer.ops:add_whatif_parser",
                      "replay a window of the fleet's sampled traffic through the simulator (a running system)"),
}


def add_bench_parser(subparsers) -> None:
    """``racer bench``: the simulator's experiments and the fleet A/B."""
    from bench.fleet import add_fleet_parser
    from simulator.cli import add_bench_parser as add_simulator_bench_parser

    add_simulator_bench_parser(subparsers, more=(add_fleet_parser,))


class _OneName:
    """Stands for racer's subparsers while one registrar runs: ``add_parser(name)`` builds the real
    parser (with the table's help line); any other name the registrar adds goes to a throwaway
    parser, not built into this run."""

    def __init__(self, subparsers, name: str, help: str) -> None:
        self.subparsers, self.name, self.help = subparsers, name, help

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        if name != self.name:
            return argparse.ArgumentParser(prog=f"racer {name}", add_help=False)
        kwargs["help"] = self.help
        return self.subparsers.add_parser(name, **kwargs)


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """racer's parser with the named subcommands built in full (None: every one); the others are
    listed by name and help line only, without importing their modules."""
    wanted = set(COMMANDS) if commands is None else set(commands)
    parser = argparse.ArgumentParser(prog="racer", description=(
        "RACER: runtime EMB/KV memory splitting for generative-recommender serving."),
        epilog="`racer COMMAND --help` describes a command's options.")
    parser.add_argument("--version", action="version", version=f"racer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        if name in wanted:
            command.load()(_OneName(sub, name, command.help))
        else:
            sub.add_parser(name, help=command.help, add_help=False)
    return parser


def command_in(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (racer's own options,
    ``--help`` and ``--version``, take no value)."""
    for word in argv:
        if word == "--":
            return None
        if not word.startswith("-"):
            return word
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = command_in(argv)
    try:
        parser = build_parser([name] if name in COMMANDS else [])
    except ModuleNotFoundError as e:  # an optional dependency of that subcommand is not installed
        print(f"racer: error: racer {name} needs the Python package {e.name!r}, which is not installed "
              f"(pip install -e . installs racer's dependencies)", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"racer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
