"""The GPU check: one command that runs the serving path's checks and benchmarks on a CUDA device.

    python -m bench.gpu_check --out DIR [--skip-install] [--device cuda] [--quick] [--json]
    python -m bench.gpu_check --dry-run --out DIR [--json]      # the plumbing, on the CPU

Steps, in order (each writes at most one file into ``--out``; ``summary.json`` collects them):

1. ``install``: a CUDA build of torch (``pip install --index-url
   https://download.pytorch.org/whl/<cuda-tag> torch==<version>+<cuda-tag>``, the version the
   project pins in constraints.txt), then the project itself with that torch held by a constraint.
   The commands are always printed. Skipped with ``--skip-install``, or when the interpreter's
   torch is already a CUDA build that sees a device. pip runs with the machine's pip config off
   (``PIP_CONFIG_FILE=/dev/null``) for the torch step: on the project's VMs that config points at
   a wheel folder holding the *CPU* build of the same version, which pip would otherwise take.
2. ``tests``: ``pytest -m cuda`` over the test files that hold ``mark.cuda``, with
   ``-p bench._sync_debug_plugin``: ``torch.cuda.set_sync_debug_mode("warn")`` for the session and
   every "called a synchronizing CUDA operation" warning counted per test and per calling line
   (``sync_warnings.json``); those from lines outside ``tests/`` are the hidden syncs.
3. ``bench_memory`` / ``bench_engine`` / ``bench_allocator``: ``python -m bench.memory --json``
   (no device flag: it runs on ``resolve_device("auto")``, CUDA when torch sees one),
   ``python -m bench.engine --json --device DEV --no-http`` (the HTTP figures test TCP, not the
   device; ``--engine-http`` adds them), ``python -m bench.allocator --json`` (no device flag: the
   policy runs on onnxruntime's CPU provider, ``AllocatorConfig.device``'s default).
4. ``node_profile``: ``racer node profile --json --device DEV --out node_profile.json``: the miss
   and hit costs and the device memory budget (arena, metadata, weights; on CUDA the device's
   total, free and peak).
5. ``compare``: the same requests through an emulated engine charged from that measured profile
   (what ``racer node-agent --emulate node_profile.json`` runs) and through the real engine on the
   device, P50/P99 side by side. In-process (`node_agent.engine.Engine`, one request at a time: no
   HTTP, batching or queueing); the emulated one on a virtual clock (modelled time, exact). On
   CUDA a few more requests are served with the sync debug mode on and their syncs counted.

``--dry-run`` runs every step on the CPU (``CUDA_VISIBLE_DEVICES=""`` for every child process, tiny
sizes): the install commands printed and not run, the CUDA tests (which skip there), the benches,
the profile and the comparison; the summary's label is "dry-run on cpu: no GPU figure" and no
figure in it is a GPU's. Exit status 0 when no step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DRY_RUN_LABEL = "dry-run on cpu: no GPU figure"
STEPS = ("install", "tests", "bench_memory", "bench_engine", "bench_allocator", "node_profile", "compare")
DEFAULT_CUDA_TAG = "cu128"
TORCH_INDEX = "https://download.pytorch.org/whl/{tag}"
#: `racer node profile` sizes of the dry run (tiny model, two short lengths)
DRY_PROFILE_ARGS = ["--embedding-dim", "16", "--num-heads", "2", "--head-dim", "8", "--num-layers", "1",
                    "--lengths", "16,64", "--repeats", "1", "--emb-batch-rows", "64", "--num-candidates", "16"]
_RACER = "import sys; from racer.cli import main; sys.exit(main(sys.argv[1:]))"
_TAIL = 3000


def pinned_torch_version(constraints: Path = REPO / "constraints.txt") -> str:
    """The torch version the project pins (``torch==X`` in constraints.txt), else 2.13.0."""
    try:
        m = re.search(r"^\s*torch\s*==\s*([^\s;#+]+)", constraints.read_text(), re.M)
    except OSError:
        m = None
    return m.group(1) if m else "2.13.0"


def install_commands(python: str, version: str, cuda_tag: str, constraint_file: str) -> list[list[str]]:
    """The pip commands of the install step: torch's CUDA build, then the project holding it."""
    return [
        [python, "-m", "pip", "install", "--index-url", TORCH_INDEX.format(tag=cuda_tag),
         f"torch=={version}+{cuda_tag}"],
        [python, "-m", "pip", "install", "-c", constraint_file, "-e", str(REPO), "pytest", "pytest-timeout"],
    ]


def _shell(cmd: list[str]) -> str:
    import shlex

    return " ".join(shlex.quote(c) for c in cmd)


def _tail(text: str | bytes | None) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text[-_TAIL:]


class Runner:
    """Runs the steps' child processes with one environment and one timeout; logs to stderr."""

    def __init__(self, dry_run: bool, timeout_s: float, quiet: bool = False) -> None:
        self.dry_run = dry_run
        self.timeout_s = timeout_s
        self.quiet = quiet
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        if dry_run:  # every child on the CPU, even on a machine with a GPU: no GPU figure can leak in
            env["CUDA_VISIBLE_DEVICES"] = ""
        self.env = env

    def say(self, msg: str) -> None:
        if not self.quiet:
            print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)

    def run(self, cmd: list[str], env: dict | None = None, timeout_s: float | None = None) -> dict:
        self.say("$ " + _shell(cmd))
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, cwd=REPO, env=env or self.env, capture_output=True, text=True,
                               timeout=timeout_s or self.timeout_s)
        except subprocess.TimeoutExpired as e:
            return {"rc": None, "wall_s": round(time.perf_counter() - t0, 2), "stdout": _tail(e.stdout),
                    "stderr": _tail(e.stderr), "timed_out": True}
        return {"rc": p.returncode, "wall_s": round(time.perf_counter() - t0, 2), "stdout": p.stdout,
                "stderr": p.stderr, "timed_out": False}


def probe_torch(runner: Runner) -> dict:
    """What the interpreter's torch is (in a child: this process never imports torch)."""
    code = ("import json, torch; a = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
            "'cuda_build': torch.version.cuda, 'cuda_available': a, "
            "'device_name': torch.cuda.get_device_name() if a else None}))")
    r = runner.run([sys.executable, "-c", code], timeout_s=120)
    if r["rc"] != 0:
        return {"torch": None, "cuda_build": None, "cuda_available": False, "device_name": None,
                "error": _tail(r["stderr"]).strip().splitlines()[-1:] or ["no output"]}
    return json.loads(r["stdout"].strip().splitlines()[-1])


def _failed(reason: str, r: dict | None = None, **kw) -> dict:
    out = {"status": "failed", "reason": reason, **kw}
    if r is not None:
        out.update(wall_s=r["wall_s"], stderr_tail=_tail(r["stderr"]), stdout_tail=_tail(r["stdout"])[-800:])
    return out


def _json_stdout(r: dict) -> dict | None:
    """The last line of a child's stdout that parses as a JSON object."""
    for line in reversed(r["stdout"].strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


# ------------------------------------------------------------------------------------ steps ---


def step_install(args, runner: Runner, out: Path) -> dict:
    version = args.torch_version or pinned_torch_version()
    probe = probe_torch(runner)
    with tempfile.NamedTemporaryFile("w", suffix="-torch-cuda.txt", delete=False) as f:
        f.write(f"torch=={version}+{args.cuda_tag}\n")
        constraint = f.name
    try:
        cmds = install_commands(sys.executable, version, args.cuda_tag, constraint)
        # as printed: the torch step's environment, and the temporary constraint file by what it holds
        shown = ["PIP_CONFIG_FILE=/dev/null " + _shell(cmds[0]),
                 _shell(cmds[1]).replace(constraint, f"<(echo torch=={version}+{args.cuda_tag})")]
        for c in shown:
            runner.say("install command: " + c)
        base = {"commands": shown, "torch_before": probe, "torch_wheel": f"torch=={version}+{args.cuda_tag}",
                "note": "the torch step runs with PIP_CONFIG_FILE=/dev/null (and no PIP_* find-links, index or "
                        "constraint variables): the machine's config may point at the CPU build of the same "
                        "version; the local label (+" + args.cuda_tag + ") refuses any CPU build"}
        if args.dry_run:
            return {"status": "skipped", "reason": "dry run: the install commands are printed, not run", **base}
        if args.skip_install:
            return {"status": "skipped", "reason": "--skip-install", **base}
        if probe.get("cuda_build") and probe.get("cuda_available"):
            return {"status": "skipped", "reason": f"torch {probe['torch']} (CUDA {probe['cuda_build']}) is already "
                                                   f"installed and sees {probe['device_name']}", **base}
        torch_env = {k: v for k, v in runner.env.items()
                     if k not in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_CONSTRAINT")}
        torch_env["PIP_CONFIG_FILE"] = os.devnull
        logs = []
        for cmd, env in zip(cmds, (torch_env, runner.env)):
            r = runner.run(cmd, env=env, timeout_s=max(runner.timeout_s, 1800))
            logs.append({"command": _shell(cmd), "rc": r["rc"], "wall_s": r["wall_s"]})
            if r["rc"] != 0:
                return _failed(f"pip failed (rc {r['rc']}{', timed out' if r['timed_out'] else ''}): "
                               f"{_shell(cmd)}", r, runs=logs, **base)
        after = probe_torch(runner)
        if not after.get("cuda_build"):
            return _failed(f"installed, but torch {after.get('torch')} is not a CUDA build", runs=logs,
                           torch_after=after, **base)
        return {"status": "ran", "runs": logs, "torch_after": after, **base}
    finally:
        os.unlink(constraint)


#: a CUDA mark in a test file: a decorator, or a module's ``pytestmark``
CUDA_MARK = re.compile(r"^\s*(@pytest\.mark\.cuda\b|pytestmark\s*=.*\bpytest\.mark\.cuda\b)", re.M)


def cuda_test_files(tests_dir: Path = REPO / "tests") -> list[str]:
    """The test files that hold a CUDA-marked test, relative to the repository."""
    return sorted(p.relative_to(REPO).as_posix() for p in tests_dir.glob("test_*.py")
                  if CUDA_MARK.search(p.read_text()))


def step_tests(args, runner: Runner, out: Path) -> dict:
    files = cuda_test_files()
    if not files:
        return {"status": "skipped", "reason": "no test file under tests/ holds pytest.mark.cuda"}
    counts = out / "sync_warnings.json"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "bench._sync_debug_plugin", "-p", "no:cacheprovider",
           "-q", *files]
    env = {**runner.env, "RACER_SYNC_DEBUG_OUT": str(counts)}
    r = runner.run(cmd, env=env)
    (out / "pytest.log").write_text(r["stdout"] + ("\n--- stderr ---\n" + r["stderr"] if r["stderr"] else ""))
    base = {"command": _shell(cmd[2:]), "files": files, "wall_s": r["wall_s"],
            "output": "sync_warnings.json", "log": "pytest.log"}
    if not counts.exists():
        return _failed(f"pytest wrote no sync counts (rc {r['rc']})", r, **base)
    data = json.loads(counts.read_text())
    hidden = data["outside_tests_locations"]  # already ordered, most first
    summary = {"outcomes": data["outcomes"], "num_tests": data["num_tests"], "sync_debug_mode": data["mode"],
               "sync_debug_reason": data["mode_reason"], "sync_warnings_total": data["sync_warnings_total"],
               "sync_warnings_outside_tests": data["sync_warnings_outside_tests"],
               "hidden_sync_locations": dict(list(hidden.items())[:20])}
    if data["mode"] is None:
        summary["note"] = ("the CUDA-marked tests skip where torch sees no GPU: this run proves the plugin's "
                           "plumbing (loaded, counted, wrote its JSON), not the serving path's syncs")
        # not measured: without the mode no warning can be raised, so a 0 would be no finding
        summary["sync_warnings_total"] = summary["sync_warnings_outside_tests"] = None
    if r["rc"] not in (0,) or data["outcomes"].get("failed") or data["outcomes"].get("error"):
        return _failed(f"pytest rc {r['rc']}: {data['outcomes']}", r, **base, **summary)
    return {"status": "ran", **base, **summary}


def _device_of(result: dict) -> str:
    return str(result.get("device", ""))


def _bench(args, runner: Runner, out: Path, name: str, cmd: list[str], note: str, pick) -> dict:
    r = runner.run(cmd)
    base = {"command": _shell(["python"] + cmd[1:]), "note": note, "wall_s": r["wall_s"]}
    if r["rc"] != 0:
        return _failed(f"rc {r['rc']}{' (timed out)' if r['timed_out'] else ''}", r, **base)
    data = _json_stdout(r)
    if data is None:
        return _failed("no JSON object on stdout", r, **base)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    dev = _device_of(data) or ("cpu (onnxruntime: " + ",".join(data.get("providers", [])) + ")")
    res = {"status": "ran", **base, "output": f"{name}.json", "device": dev, "figures": pick(data)}
    if not args.dry_run and name != "bench_allocator" and not dev.startswith("cuda"):
        return _failed(f"ran on {dev!r}, not on CUDA: not a GPU figure", r, **res)
    return res


def step_bench_memory(args, runner, out):
    cmd = [sys.executable, "-m", "bench.memory", "--json"] + (["--quick"] if args.dry_run or args.quick else [])
    return _bench(args, runner, out, "bench_memory", cmd,
                  "bench.memory has no --device flag: it runs on resolve_device('auto'), CUDA when torch sees a "
                  "GPU (the dry run hides it: CPU); --quick in the dry run (its sizes are fixed: 1M-item table)",
                  lambda d: {k: d.get(k) for k in ("lookup_vs_index_select", "hit_rate", "lookup_ids_per_s",
                                                   "boundary_move_us", "boundary_migrate_us",
                                                   "refill_bytes_per_s_max_window", "kv_append_per_s")})


def step_bench_engine(args, runner, out):
    cmd = [sys.executable, "-m", "bench.engine", "--json", "--device", args.device]
    if args.dry_run:
        cmd += ["--reps", "1"]
    elif args.quick:
        cmd += ["--quick"]
    if not args.engine_http:
        cmd += ["--no-http"]

    def pick(d):
        return {"kv_hit_speedup_2048": d.get("kv_hit_speedup_2048"), "link_emulated": d.get("link_emulated"),
                "lengths": {L: {"hit": v["hit"], "miss": v["miss"], "reps": v["reps"]}
                            for L, v in d.get("lengths", {}).items()},
                **({"http": d["http"]} if "http" in d else {})}

    return _bench(args, runner, out, "bench_engine", cmd,
                  "--no-http unless --engine-http: the HTTP figures (keep-alive vs fresh connection) test TCP, "
                  "not the device; --reps 1 in the dry run", pick)


def step_bench_allocator(args, runner, out):
    cmd = [sys.executable, "-m", "bench.allocator", "--json"]
    if args.dry_run:
        cmd += ["--rounds", "1", "--decisions", "200"]
    elif args.quick:
        cmd += ["--rounds", "5"]
    return _bench(args, runner, out, "bench_allocator", cmd,
                  "bench.allocator has no --device flag: run as is; the policy runs on onnxruntime's CPU provider "
                  "(AllocatorConfig.device defaults to cpu) on one pinned core, on a GPU machine too",
                  lambda d: {k: d.get(k) for k in ("decision_us_p50", "decision_us_p99", "target_p50_us",
                                                   "meets_target", "providers", "num_decisions")})


def step_node_profile(args, runner, out):
    path = out / "node_profile.json"
    cmd = [sys.executable, "-c", _RACER, "node", "profile", "--json", "--no-progress", "--device", args.device,
           "--out", str(path)] + (DRY_PROFILE_ARGS if args.dry_run else [])
    r = runner.run(cmd)
    base = {"command": _shell(["racer"] + cmd[3:]), "wall_s": r["wall_s"], "output": "node_profile.json"}
    if r["rc"] != 0 or not path.exists():
        return _failed(f"rc {r['rc']}{' (timed out)' if r['timed_out'] else ''}", r, **base)
    prof = json.loads(path.read_text())
    res = {"status": "ran", **base, "device": prof.get("device"), "link_emulated": prof.get("link_emulated"),
           "figures": {k: prof.get(k) for k in ("kv_recompute_us_per_token", "emb_transfer_us_per_row",
                                               "emb_hit_us_per_row", "kv_read_us_per_token", "rank_us_per_candidate")},
           "device_memory": prof.get("device_memory")}
    if not args.dry_run and not str(prof.get("device", "")).startswith("cuda"):
        return _failed(f"profiled {prof.get('device')!r}, not CUDA", r, **res)
    return res


def step_compare(args, runner, out, profile_ok: bool):
    profile = out / "node_profile.json"
    if not profile_ok or not profile.exists():
        return {"status": "skipped", "reason": "no measured profile: the node_profile step did not run"}
    path = out / "compare.json"
    sizes = (["--users", "6", "--num-items", "2000", "--num-candidates", "16", "--sync-users", "2"] if args.dry_run
             else ["--users", "16" if args.quick else "48"])
    cmd = [sys.executable, "-m", "bench.gpu_check", "_compare", "--profile", str(profile), "--device", args.device,
           "--out", str(path)] + sizes
    r = runner.run(cmd)
    base = {"command": _shell(["python"] + cmd[1:]), "wall_s": r["wall_s"], "output": "compare.json"}
    if r["rc"] != 0 or not path.exists():
        return _failed(f"rc {r['rc']}{' (timed out)' if r['timed_out'] else ''}", r, **base)
    data = json.loads(path.read_text())
    return {"status": "ran", **base, "how": data["how"], "device": data["real_device"],
            "figures": {"by_kind": data["by_kind"], "outcomes_match": data["outcomes_match"]},
            "sync_probe": data["sync_probe"]}


# ------------------------------------------------------------------- emulated vs real engine ---


class VClock:
    """A virtual clock: waits jump to their deadline (the emulated engine's modelled time, exact)."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)


def _pcts(xs: list[float]) -> dict:
    """P50 and P99 with the sample count (``n``) and, for fewer than 100, ``p99_ms_few_samples``."""
    from bench.stats import p99, pct

    return {"n": len(xs), "p50_ms": pct(xs, 50, 4), **p99(xs, 4).fields("p99_ms")}


def _side_by_side(real: list[float], emu: list[float]) -> dict:
    r, e = _pcts(real), _pcts(emu)
    row = {"real": r, "emulated": e}
    for q in ("p50_ms", "p99_ms"):
        row[f"emulated_over_real_{q[:3]}"] = (round(e[q] / r[q], 3) if r[q] and e[q] is not None else None)
    return row


def workload(users: range, lengths: list[int], new_items: int, num_items: int, num_candidates: int, seed: int):
    """Per user, two requests: L history items (a KV miss), then the same L plus ``new_items`` new
    ones (a KV hit); items Zipf(1.1) over the catalogue, timestamps increasing."""
    import numpy as np

    from node_agent.engine import RecRequest

    rng = np.random.default_rng(seed)
    cdf = np.cumsum(np.arange(1, num_items + 1, dtype=np.float64) ** -1.1)
    cdf /= cdf[-1]
    perm = rng.permutation(num_items)
    out = []
    for i, u in enumerate(users):
        L = lengths[i % len(lengths)]
        seq = perm[np.minimum(np.searchsorted(cdf, rng.random(L + new_items)), num_items - 1)].astype(np.int64)
        ts = 1.5e9 + np.cumsum(rng.exponential(300.0, size=L + new_items))
        out.append(("miss", L, RecRequest(u, seq[:L], (), ts[:L], num_candidates=num_candidates, top_k=10)))
        out.append(("hit", L, RecRequest(u, seq[:L], seq[L:], ts, num_candidates=num_candidates, top_k=10)))
    return out


def compare_engines(profile_path: str, device: str, *, users: int, num_items: int, num_candidates: int,
                    new_items: int = 8, sync_users: int = 4, warmup_users: int = 2, seed: int = 0) -> dict:
    """The same requests through the real engine on ``device`` and through an emulated engine charged
    from the profile at ``profile_path`` (see the module doc); P50/P99 by KV outcome and length."""
    import warnings
    from dataclasses import fields

    import torch

    from common.device_model import get_profile
    from node_agent.emulated import EmulationConfig
    from node_agent.engine import Engine, EngineConfig, LinkEmulationConfig
    from node_agent.model import ModelConfig

    torch.set_num_threads(1)
    data = json.loads(Path(profile_path).read_text())
    names = {f.name for f in fields(ModelConfig)}
    model = ModelConfig(**{k: v for k, v in data["model"].items() if k in names})
    st = data["settings"]
    lengths = [int(x) for x in st["lengths"]]
    le = data["link_emulation"]
    link = LinkEmulationConfig(mode="on" if le["enabled"] else "off", bandwidth_gb_per_s=le["bandwidth_gb_per_s"],
                               latency_us=le["latency_us"])
    emu_prof = get_profile(str(profile_path))
    max_len = max(lengths) + new_items
    total_users = warmup_users + users + sync_users

    def pages(rows_per_page: int, page_tokens: int) -> tuple[int, float]:
        # room for the whole catalogue in the slab and every user's K/V: no eviction on either engine, so both
        # see the same EMB misses and KV outcomes
        emb = -(-num_items // rows_per_page) + 2
        kv = total_users * (-(-max_len // page_tokens) + 1) + 2
        return emb + kv, (emb + 0.5) / (emb + kv)

    real_probe = EngineConfig(model=model, num_items=num_items, num_pages=1, page_tokens=st["page_tokens"],
                              kv_dtype=st["kv_dtype"], device="cpu").memory_config()
    n_real, share_real = pages(real_probe.rows_per_page, st["page_tokens"])
    real = Engine(EngineConfig(model=model, num_items=num_items, num_pages=n_real, emb_share=share_real,
                               page_tokens=st["page_tokens"], kv_dtype=st["kv_dtype"], link=link, device=device,
                               max_history_len=max_len, default_num_candidates=num_candidates,
                               item_seed=seed))
    n_emu, share_emu = pages(emu_prof.rows_per_page, emu_prof.page_tokens)
    clk = VClock()
    emu = Engine(EngineConfig(num_items=num_items, num_pages=n_emu, emb_share=share_emu,
                              page_tokens=emu_prof.page_tokens, max_history_len=max_len,
                              default_num_candidates=num_candidates, item_seed=seed,
                              emulation=EmulationConfig(str(profile_path))), clock=clk, now_s=clk())
    dev = real.device

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    reqs = workload(range(total_users), lengths, new_items, num_items, num_candidates, seed)
    warm, timed = reqs[:2 * warmup_users], reqs[2 * warmup_users:2 * (warmup_users + users)]
    probe = reqs[2 * (warmup_users + users):]
    for _, _, req in warm:  # first calls allocate; both engines see them, so their caches stay alike
        real.serve(req)
        emu.serve(req, now_s=clk())
    sync()
    rows, mismatches = [], 0
    for kind, L, req in timed:
        t = time.perf_counter()
        a = real.serve(req)
        sync()
        real_ms = (time.perf_counter() - t) * 1e3
        t0 = clk()
        b = emu.serve(req, now_s=t0)
        emu_ms = (clk() - t0) * 1e3
        mismatches += (a.kv.outcome != b.kv.outcome) or (a.emb_hits != b.emb_hits)
        rows.append({"kind": kind, "L": L, "real_ms": real_ms, "emulated_ms": emu_ms, "real_outcome": a.kv.outcome,
                     "emulated_outcome": b.kv.outcome, "emb_rows": a.emb_rows, "emb_hits_real": a.emb_hits,
                     "emb_hits_emulated": b.emb_hits})

    def sel(kind=None, L=None):
        keep = [r for r in rows if (kind is None or r["kind"] == kind) and (L is None or r["L"] == L)]
        return _side_by_side([r["real_ms"] for r in keep], [r["emulated_ms"] for r in keep])

    # the serving path's syncs: a few more users served with the sync debug mode on (CUDA only)
    if dev.type != "cuda":
        sync_probe = {"status": "skipped", "reason": f"the real engine runs on {dev}: CUDA's sync debug mode does "
                                                     "not apply (no GPU figure)", "sync_warnings_per_request": None}
    elif not probe:
        sync_probe = {"status": "skipped", "reason": "--sync-users 0", "sync_warnings_per_request": None}
    else:
        per_kind: dict[str, list[int]] = {"miss": [], "hit": []}
        where: dict[str, int] = {}
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for kind, _, req in probe:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    real.serve(req)
                syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
                per_kind[kind].append(len(syncs))
                for w in syncs:
                    try:
                        f = Path(w.filename).resolve().relative_to(REPO).as_posix()
                    except ValueError:
                        f = w.filename
                    where[f"{f}:{w.lineno}"] = where.get(f"{f}:{w.lineno}", 0) + 1
        finally:
            torch.cuda.set_sync_debug_mode("default")
        sync_probe = {"status": "ran", "requests": {k: len(v) for k, v in per_kind.items()},
                      "sync_warnings_per_request": {k: (round(sum(v) / len(v), 2) if v else None)
                                                    for k, v in per_kind.items()},
                      "locations": dict(sorted(where.items(), key=lambda kv: -kv[1])),
                      "note": "every host read of a device value warns: at least the answer's top-k read back to "
                              "the host is expected; the rest are syncs inside the serving path"}
    return {
        "how": ("in-process: node_agent.engine.Engine twice over the same requests, one at a time (no HTTP, no "
                "batching, no queueing): the real engine on the device (wall time of Engine.serve, synchronised) "
                "and an emulated engine built as `racer node-agent --emulate PROFILE_JSON` builds it "
                "(EngineConfig.emulation = the measured profile; metadata-only arena sized by the profile) on a "
                "virtual clock (modelled time, exact, no waiting)"),
        "profile": str(profile_path),
        "emulated_profile": emu_prof.name,
        "emulated_profile_calibrated": emu_prof.calibrated,
        "emulated_sizes_from": "the profile's base preset (a100-hstu): overheads per batch and request, row and "
                               "K/V sizes; the measured profile sets token, candidate and EMB costs",
        "real_device": str(dev) if dev.type != "cuda" else f"cuda ({torch.cuda.get_device_name(dev)})",
        "real_link_emulated": real.link.enabled,
        "requests": {"users": users, "lengths": lengths, "new_items": new_items, "num_candidates": num_candidates,
                     "num_items": num_items, "warmup_users": warmup_users},
        "by_kind": {"miss": sel("miss"), "hit": sel("hit"), "all": sel()},
        "by_length": {str(L): {"miss": sel("miss", L), "hit": sel("hit", L)} for L in lengths},
        "outcomes_match": mismatches == 0,
        "mismatches": mismatches,
        "sync_probe": sync_probe,
        "figures_are": ("measured on CUDA (real) vs modelled (emulated)" if dev.type == "cuda" else
                        f"{dev} (real) vs modelled (emulated): no GPU figure"),
    }


def _compare_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check _compare")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--users", type=int, default=48)
    ap.add_argument("--num-items", type=int, default=20_000)
    ap.add_argument("--num-candidates", type=int, default=256)
    ap.add_argument("--sync-users", type=int, default=4)
    a = ap.parse_args(argv)
    res = compare_engines(a.profile, a.device, users=a.users, num_items=a.num_items,
                          num_candidates=a.num_candidates, sync_users=a.sync_users)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


# ------------------------------------------------------------------------------------- main ---


def _print_table(summary: dict) -> None:
    print(f"{summary['label']}  ({summary['wall_s']} s, output in {summary['out']})")
    for name, s in summary["steps"].items():
        why = s.get("reason") or s.get("note") or ""
        print(f"  {name:16s} {s['status']:8s} {s.get('wall_s', ''):>7}  {why[:110]}")
    print("ok" if summary["ok"] else "FAILED: " + ", ".join(n for n, s in summary["steps"].items()
                                                            if s["status"] == "failed"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_compare"]:
        return _compare_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default: gpu_check-<date>-<time> here)")
    ap.add_argument("--dry-run", action="store_true",
                    help="every step on the CPU, tiny (the script's plumbing; no GPU figure); install not run")
    ap.add_argument("--skip-install", action="store_true", help="do not install (torch with CUDA already there)")
    ap.add_argument("--torch-version", default=None,
                    help=f"torch version to install (default: constraints.txt's pin, {pinned_torch_version()})")
    ap.add_argument("--cuda-tag", default=DEFAULT_CUDA_TAG,
                    help=f"CUDA variant of the torch wheel and its index (default {DEFAULT_CUDA_TAG})")
    ap.add_argument("--device", default="cuda", help="the device of the GPU run: cuda or cuda:N (default cuda)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions in the benches and the comparison")
    ap.add_argument("--engine-http", action="store_true", help="bench.engine with its HTTP figures (a node-agent)")
    ap.add_argument("--skip", action="append", default=[], choices=STEPS, metavar="STEP",
                    help=f"skip a step (repeatable): {', '.join(STEPS)}")
    ap.add_argument("--step-timeout", type=float, default=None,
                    help="seconds per step's child process (default 900; 180 in the dry run)")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    out = Path(args.out or time.strftime("gpu_check-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(args.dry_run, args.step_timeout or (180 if args.dry_run else 900))
    t0 = time.perf_counter()
    summary: dict = {
        "tool": "python -m bench.gpu_check", "mode": "dry-run" if args.dry_run else "gpu",
        "label": DRY_RUN_LABEL if args.dry_run else "gpu run (not finished)", "gpu_figures": False,
        "device": "cpu" if args.dry_run else args.device, "out": str(out), "argv": argv,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0], "steps": {},
    }

    def save() -> None:
        summary["wall_s"] = round(time.perf_counter() - t0, 1)
        summary["ok"] = all(s["status"] != "failed" for s in summary["steps"].values())
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def record(name: str, fn) -> dict:
        if name in args.skip:
            res = {"status": "skipped", "reason": f"--skip {name}"}
        else:
            runner.say(f"step {name}")
            t = time.perf_counter()
            try:
                res = fn()
            except Exception as e:  # a broken step is reported, the others still run
                res = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
            res.setdefault("wall_s", round(time.perf_counter() - t, 2))
        if args.dry_run and ("figures" in res or "device_memory" in res):
            res["figures_are"] = "cpu, dry run: the plumbing's output, not a GPU figure"
        summary["steps"][name] = res
        runner.say(f"step {name}: {res['status']}" + (f" ({res['reason']})" if res.get("reason") else ""))
        save()
        return res

    inst = record("install", lambda: step_install(args, runner, out))
    torch_now = inst.get("torch_after") or inst.get("torch_before") or probe_torch(runner)
    summary["torch"] = torch_now
    if not args.dry_run and not torch_now.get("cuda_available"):
        why = (f"torch {torch_now.get('torch')} (CUDA build {torch_now.get('cuda_build')}) sees no CUDA device: no "
               f"GPU figure can be measured here (use --dry-run on a machine without one)")
        for name in STEPS[1:]:
            summary["steps"][name] = {"status": "skipped", "reason": why}
        summary["label"] = "gpu run: no CUDA device"
        summary["steps"]["preflight"] = {"status": "failed", "reason": why}
        save()
        print(json.dumps(summary)) if args.json else _print_table(summary)
        return 1
    if not args.dry_run:
        summary["device"] = f"{args.device} ({torch_now.get('device_name')})"
    record("tests", lambda: step_tests(args, runner, out))
    record("bench_memory", lambda: step_bench_memory(args, runner, out))
    record("bench_engine", lambda: step_bench_engine(args, runner, out))
    record("bench_allocator", lambda: step_bench_allocator(args, runner, out))
    prof = record("node_profile", lambda: step_node_profile(args, runner, out))
    record("compare", lambda: step_compare(args, runner, out, prof["status"] == "ran"))
    if not args.dry_run:
        on_gpu = [s for n, s in summary["steps"].items() if n in ("bench_memory", "bench_engine", "node_profile")
                  and s["status"] == "ran"]
        summary["gpu_figures"] = bool(on_gpu)
        summary["label"] = f"measured on {summary['device']}"
    save()
    if args.json:
        print(json.dumps(summary))
    else:
        _print_table(summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
