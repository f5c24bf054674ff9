"""The `racer` command: help everywhere, describe/plot outputs, clear errors for bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from racer.cli import COMMANDS, Command, build_parser, command_in, main

from .conftest import TAOBAO_SAMPLE


def all_subcommand_paths(parser, prefix=()):
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        for name, sub in action.choices.items():
            yield prefix + (name,)
            yield from all_subcommand_paths(sub, prefix + (name,))


def test_help_on_every_subcommand(capsys):
    paths = list(all_subcommand_paths(build_parser()))
    assert ("workload", "describe") in paths and ("workload", "plot") in paths
    # every name in the table is built by its registrar (and nothing else is)
    assert {p[0] for p in paths} == set(COMMANDS)
    for path in [()] + paths:
        with pytest.raises(SystemExit) as e:
            main(list(path) + ["--help"])
        assert e.value.code == 0
        assert "usage: racer" in capsys.readouterr().out


@pytest.fixture
def small_csv(tmp_path):
    rows = [f"{u},{100 + (u * 7 + k) % 13},{k % 3},pv,{1000 + k}" for u in range(1, 30) for k in range(u % 5 + 2)]
    p = tmp_path / "ub.csv"
    p.write_text("\n".join(rows) + "\n1,2,3,pv")
    return p


def test_describe_json(small_csv, capsys):
    assert main(["workload", "describe", "--trace", "taobao", "--path", str(small_csv), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("num_users", "num_items", "num_interactions", "num_skipped_lines", "seq_len_p50",
                "seq_len_p99", "top1pct_item_share"):
        assert key in d
    assert d["num_users"] == 29 and d["num_skipped_lines"] == 1


def test_describe_with_regime_adds_stream(small_csv, capsys):
    assert main(["workload", "describe", "--trace", "taobao", "--path", str(small_csv), "--regime", "trend",
                 "--rate", "200", "--duration", "10", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["stream"]["regime"] == "trend" and d["stream"]["num_requests"] > 1000


def test_bad_input_exits_2_with_one_line(tmp_path, small_csv, capsys):
    assert main(["workload", "describe", "--trace", "taobao", "--path", str(tmp_path / "missing.csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("racer: error: trace file not found") and err.count("\n") == 1
    bad = tmp_path / "bad.csv"
    bad.write_text("1,2,3,pv,5\n1,2,3,pv,x\n1,2,3,pv,6\n")
    assert main(["workload", "describe", "--trace", "taobao", "--path", str(bad)]) == 2
    assert f"{bad}:2: timestamp 'x' is not a number" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # the option's range, read from RegimeConfig: argparse refuses it
        main(["workload", "plot", "--trace", "taobao", "--path", str(small_csv), "--regime", "burst",
              "--rate", "-5", "--out", str(tmp_path)])
    assert e.value.code == 2 and "argument --rate: must be a positive number, got -5" in capsys.readouterr().err


def test_plot_writes_html_and_png(small_csv, tmp_path, capsys):
    out = tmp_path / "plots"
    assert main(["workload", "plot", "--trace", "taobao", "--path", str(small_csv), "--regime", "burst",
                 "--rate", "300", "--duration", "60", "--out", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    html, png = res["files"]["html"], res["files"]["png"]
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    text = open(html, encoding="utf-8").read()
    assert "request rate" in text and "hot-user ratio" in text
    assert len(res["bursts_s"]) == 2
    assert text.count('"type":"rect"') >= 2 * 4  # each burst shaded on each of the 4 panels


def test_console_script_runs_as_a_process(small_csv):
    exe = shutil.which("racer") or str(__import__("pathlib").Path(sys.executable).with_name("racer"))
    out = subprocess.run([exe, "workload", "describe", "--trace", "taobao", "--path", str(small_csv), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["num_skipped_lines"] == 1


@pytest.mark.skipif(not TAOBAO_SAMPLE.exists(), reason="../shared/data not present")
def test_describe_default_path_is_the_sample(capsys):
    assert main(["workload", "describe", "--trace", "taobao", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["num_users"] == 815 and d["num_items"] == 55368


def test_describe_json_rounds_figures_to_what_they_mean(tmp_path, capsys):
    import numpy as np

    lens = [3 * u + 1 for u in range(1, 31)]  # user u has 3u+1 interactions: p99 = 88.13
    rows = [f"{u},{100 + (u * 7 + k) % 53},{k % 3},pv,{1000 + k}" for u, n in zip(range(1, 31), lens)
            for k in range(n)]
    csv = tmp_path / "ub.csv"
    csv.write_text("\n".join(rows) + "\n")
    assert main(["workload", "describe", "--trace", "taobao", "--path", str(csv), "--regime", "trend",
                 "--rate", "200", "--duration", "10", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    raw = float(np.percentile(lens, 99))
    assert raw != round(raw, 1) and d["seq_len_p99"] == round(raw, 1)
    lengths = {k: v for k, v in {**d, **d["stream"]}.items() if "len" in k and isinstance(v, (int, float))}
    assert len(lengths) >= 7
    assert all(v == round(v, 1) for v in lengths.values()), lengths

    def floats(x):
        if isinstance(x, dict):
            for v in x.values():
                yield from floats(v)
        elif isinstance(x, float):
            yield x

    assert all(v == round(v, 4) for v in floats(d))  # rates and shares: at most 4 decimals


@pytest.mark.parametrize("argv, message", [
    (["dashboard", "--control-plane", "http://h:1", "--port", "70000"], "--port: must be in [0, 65535], got 70000"),
    (["dashboard", "--control-plane", "http://h:1", "--refresh-s", "nan"], "--refresh-s: must be a positive number"),
    (["node-agent", "--trace", "taobao", "--port", "-1"], "--port: must be in [0, 65535], got -1"),
    (["node-agent", "--trace", "taobao", "--emb-share", "1.5"], "--emb-share: must be in [0, 1], got 1.5"),
    (["node-agent", "--trace", "taobao", "--max-batch", "two"], "--max-batch: must be an integer, got 'two'"),
    (["policy", "export", "--tolerance", "x"], "--tolerance: must be a number, got 'x'"),
])
def test_every_command_line_words_range_errors_alike(argv, message, capsys):
    """node_agent.argtypes is the one set of converters: the same wording in every command."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def _modules_after(argv: list[str]) -> set[str]:
    """The modules a fresh interpreter has imported after ``racer ARGV`` (which exits)."""
    code = ("import json, sys\nfrom racer.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
            "    pass\nprint(json.dumps(sorted(sys.modules)), file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    return set(json.loads(p.stderr.strip().splitlines()[-1]))


HEAVY = {"torch", "fastapi", "dash", "uvicorn", "onnxruntime", "sqlalchemy", "plotly"}


def test_racer_help_imports_no_subcommand_module():
    """`racer --help` lists the table: none of torch, fastapi, dash (nor numpy, nor any
    subcommand's module) is imported to print it."""
    mods = _modules_after(["--help"])
    assert "racer.cli" in mods
    assert not mods & (HEAVY | {"numpy", "racer.up", "racer.workload", "policies", "node_agent", "control_plane"})


def test_a_subcommand_help_imports_that_subcommand_only():
    mods = _modules_after(["up", "--help"])
    assert "racer.up" in mods and not mods & HEAVY
    assert not mods & {"policies", "control_plane", "dashboard", "simulator", "node_agent.engine"}
    mods = _modules_after(["workload", "describe", "--help"])
    assert "racer.workload" in mods and not mods & (HEAVY | {"racer.up"})


def test_the_command_is_the_first_word_that_is_not_an_option():
    assert command_in(["--version"]) is None and command_in([]) is None
    assert command_in(["-h", "up", "--nodes", "2"]) == "up"
    assert command_in(["node", "profile", "--json"]) == "node"


def test_a_subcommand_whose_module_is_missing_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(COMMANDS, "ghost", Command("no_such_racer_module:add_parser", "a command never installed"))
    assert main(["ghost", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("racer: error: racer ghost needs the Python package 'no_such_racer_module'")
    assert err.count("\n") == 1
    with pytest.raises(SystemExit) as e:  # the other commands are listed without importing it
        main(["--help"])
    assert e.value.code == 0 and "a command never installed" in capsys.readouterr().out


def test_no_import_cycle_among_racer_modules():
    """Module-level imports inside racer/ (what runs at import time): racer.cli imports no
    subcommand, so nothing that racer.cli registers can import it back into a cycle."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "racer"
    graph: dict[str, set[str]] = {}
    for f in root.glob("*.py"):
        mod = f"racer.{f.stem}"
        for node in ast.parse(f.read_text()).body:  # top level only: imports inside functions are lazy
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
                graph.setdefault(mod, set()).update(f"racer.{n}" for n in names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("racer."):
                graph.setdefault(mod, set()).add(node.module)
    assert graph["racer.cli"] <= {"racer.errors", "racer.__version__"}

    def reaches(a: str, b: str, seen: frozenset = frozenset()) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in graph.get(a, ()))

    assert [m for m in graph if reaches(m, m)] == []


def test_config_backed_options_default_to_the_config_fields():
    """Options declared from a config (common.config.add_config_arguments) parse, when left out, to
    exactly the config's defaults: no default is written twice."""
    from common.config import config_kwargs, default_of
    from node_agent import cli as node_cli
    from node_agent.agent import AgentConfig
    from node_agent.engine import EngineConfig, LinkEmulationConfig
    from node_agent.model import cli as model_cli
    from node_agent.model.train import TrainConfig
    from node_agent.profile import ProfileConfig
    from node_agent.reporter import ReporterConfig
    from racer import workload
    from workloads.replay import ReplayConfig

    def parsed(*argv):
        return build_parser([argv[0]]).parse_args(list(argv))

    agent = parsed("node-agent", "--trace", "taobao")
    cases = [(agent, AgentConfig, node_cli.AGENT_FIELDS, ""), (agent, EngineConfig, node_cli.ENGINE_FIELDS, ""),
             (agent, ReporterConfig, node_cli.REPORTER_FIELDS, ""),
             (agent, LinkEmulationConfig, node_cli.LINK_FIELDS, "link-"),
             (parsed("node", "profile"), ProfileConfig, node_cli.PROFILE_FIELDS, ""),
             (parsed("replay", "--trace", "taobao", "--gateway", "http://h:1"), ReplayConfig, workload.REPLAY_FIELDS, ""),
             (parsed("model", "train", "--trace", "taobao", "--out", "x"), TrainConfig, model_cli.TRAIN_FIELDS, "")]
    for args, cls, names, prefix in cases:
        assert config_kwargs(args, names, prefix=prefix) == {n: default_of(cls, n) for n in names}, cls.__name__
