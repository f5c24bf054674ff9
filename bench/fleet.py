"""The fleet A/B: the whole system on real node-agent processes against static splits.

    racer bench fleet --quick --json                   # local agents, about 30 minutes on 2 cores (63 runs)
    racer bench fleet --emulate a100-hstu --quick --json   # emulated A100s: kv-heavy, emb-heavy, day at
                                                       # loads 0.5, 0.75, 3 rounds each, then RACER against
                                                       # the single best static over them (bench.fleet_across)
    python -m bench.fleet --out fleet_ab               # the full run (resumable)
    racer bench fleet --nodes http://a:8100,http://b:8100 --configs 0.5/least_load,0.5/racer

**Configurations** (``--configs``, each ``SPLIT/ROUTER``): SPLIT a static ``emb_share`` (the agents
run ``--emb-share S`` and no allocator) or ``racer`` (the SmartAllocator: ``--policy``, the shipped
policy unless ``--policy DIR``, starting at 0.5); ROUTER one of the gateway's routers. The default
set: static 0.2 / 0.5 / 0.8 with ``least_load`` and with ``round_robin``, static 0.5 with the
``racer`` router, the full RACER (``racer/racer``), and an A/A copy of ``0.5/least_load``
(``0.5/least_load#2``: the same configuration again, the bench's own noise). The default
configuration an operator would run without RACER is ``0.5/round_robin``.

**One run**: every agent is restarted cold (empty caches), a gateway with the configuration's
router is started in front of them, and the same seeded schedule stream (``--schedule``,
``REGIME:SECONDS``: one stream in which users keep their identity, `workloads.replay`) is sent
open loop through the gateway. Recorded per phase and overall: P50 / P99 (from each request's
scheduled time), SLO attainment (failures count as misses), throughput, the KV and EMB hit rates
summed from the answers, and the fleet's mean ``emb_share`` (each agent's ``/v1/metrics``
sampled every 0.5 s).

**Load from a capacity rule stated before any run** (`find_capacity`): the fleet's steady
capacity is the highest rate whose steady-regime P99 stays within the SLO with no failure at
static 0.5 + ``least_load`` (rates doubled from ``--capacity-start`` until one fails, then
bisected); every configuration then runs at ``--loads`` (default 0.5, 0.75, 0.95) of it. The
trend and burst phases go above the base rate, as they do in production. Nothing here is tuned
toward a configuration.

**Noise**: the machine is shared. Configurations run interleaved in ``--rounds`` rounds (default
3), each in its own order of every (configuration, load) pair (`round_order`: a Williams design,
so no run always comes first or always follows the same one); each figure is reported as
the median and range over rounds, and the findings compare medians. Every run is saved under
``--out`` (``runs/``), so an interrupted bench resumes; ``fleet_p99.png`` plots P99 per phase per
configuration, one panel per load.

**Sizing** (`Sizing`): the agents are sized so that the EMB/KV trade-off exists: the arena is
``--arena-table`` (default 1.4%, the paper-scale setting's) of the embedding table's bytes, and a
small K/V per token (1 layer, 1 head of 2 dims, float16: 8 bytes) against 512-byte embedding rows
puts about 500 mean users' K/V in the arena, the paper-scale setting's figure; the output states
both ratios and the users each node sees.

``--nodes URL,...`` points the bench at a running fleet instead: it cannot restart those agents or
set their split, so it compares the configurations' routers on the fleet as deployed (each
configuration's split is reported as ``deployed``) with a gateway of its own per run.

Findings (`findings`), per load: ``racer_over_best_static_pct`` (RACER's median P99 over the best
static configuration's in hindsight at that load), ``racer_over_default_pct`` (over
``0.5/round_robin``), ``racer_router_over_least_load_pct`` (``0.5/racer`` over
``0.5/least_load``) and, with an A/A copy, ``aa_over_original_pct`` (the copy over its original).
``verdicts`` judges the targets (RACER at most 5% above the best static, the racer router at most
2% above least_load) with a 90% interval from the pair's own round-to-round spread, rounds as
blocks (`block_interval`): met, not met or undecided, and the rounds a decision needs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gateway.router import POLICIES as ROUTERS  # the gateway's routers
from simulator.capacity import bracket_and_bisect

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = ("0.2/least_load", "0.5/least_load", "0.8/least_load", "0.2/round_robin", "0.5/round_robin",
                   "0.8/round_robin", "0.5/racer", "racer/racer", "0.5/least_load#2")
QUICK_CONFIGS = ("0.2/least_load", "0.5/least_load", "0.8/least_load", "0.5/round_robin", "0.5/racer",
                 "racer/racer", "0.5/least_load#2")
DEFAULT_KEY = "0.5/round_robin"  # what an operator runs without RACER
RACER_KEY = "racer/racer"
CAPACITY_KEY = "0.5/least_load"  # the capacity rule's configuration
SCHEDULE = "steady:30,trend:30,burst:15,steady:30"
SLO_MS = 100.0
QUICK_SCHEDULE = "steady:4,trend:4,burst:3,steady:4"
#: an emulated --quick without --workload runs each of these (their best splits differ:
#: docs/workloads.md states their figures), 8 s of each (modelled)
EMULATED_WORKLOADS = ("kv-heavy", "emb-heavy", "day")
QUICK_EMULATED_WORKLOAD_S = 8.0
#: local agents' nice: on a machine they share with the gateway and the load generator, equal
#: priority lets a burst starve the gateway (the backlog then waits outside it, in no node's
#: queue); below theirs, the backlog builds at the nodes, as on a fleet whose gateway has its own
#: cores (docs/fleet.md)
AGENT_NICE = 10


# ------------------------------------------------------------------------------ configurations


@dataclass(frozen=True)
class FleetConfig:
    """One configuration under test: ``split`` a static emb_share, or None for the allocator;
    ``copy`` > 1 runs the same configuration again under a key of its own (``SPLIT/ROUTER#N``):
    an A/A control, whose distance from its original is the bench's own noise on this machine."""

    split: float | None
    router: str
    copy: int = 1

    @property
    def base_key(self) -> str:
        return f"{'racer' if self.split is None else format(self.split, 'g')}/{self.router}"

    @property
    def key(self) -> str:
        return self.base_key if self.copy == 1 else f"{self.base_key}#{self.copy}"

    @property
    def name(self) -> str:
        name = f"{'allocator' if self.split is None else f'static {self.split:g}'} + {self.router}"
        return name if self.copy == 1 else f"{name} (copy {self.copy})"


def williams_rows(n: int) -> list[list[int]]:
    """Orders of ``n`` runs, one per round, balanced for position and for carry-over (a Williams
    design): over the rows each run is in every position equally often and follows every other
    run equally often (``n`` rows when ``n`` is even, ``2n`` when odd). A run can leave something
    behind for the next (a cold start's garbage, a warm host), so no configuration may always
    come first or always follow the same one."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        if len(first) % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def round_order(n: int, rnd: int, seed: int) -> list[int]:
    """The order of round ``rnd``'s ``n`` (configuration, load) runs: a row of `williams_rows`
    (cycled), with the runs' labels drawn once per ``seed``."""
    labels = np.random.default_rng(seed).permutation(n)
    rows = williams_rows(n)
    return [int(labels[i]) for i in rows[rnd % len(rows)]]


def parse_configs(text: str) -> list[FleetConfig]:
    """``"0.2/least_load,racer/racer,0.5/least_load#2"`` -> configurations (``#N``, N >= 2: an A/A
    copy); a clear ValueError naming a bad part."""
    out: list[FleetConfig] = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        split, sep, router = part.partition("/")
        if not sep:
            raise ValueError(f"--configs: {part!r} is not SPLIT/ROUTER (e.g. 0.5/least_load or racer/racer)")
        router, hashed, n = router.partition("#")
        copy = 1
        if hashed:
            if not (n.isdigit() and 2 <= int(n) <= 9):
                raise ValueError(f"--configs: {part!r}: a copy is SPLIT/ROUTER#N with N in 2..9")
            copy = int(n)
        if router not in ROUTERS:
            raise ValueError(f"--configs: {part!r}: router must be one of {', '.join(ROUTERS)}")
        if split == "racer":
            cfg = FleetConfig(None, router, copy)
        else:
            try:
                s = float(split)
            except ValueError:
                raise ValueError(f"--configs: {part!r}: SPLIT must be an emb_share in [0, 1] or 'racer'") from None
            if not (math.isfinite(s) and 0.0 <= s <= 1.0):
                raise ValueError(f"--configs: {part!r}: SPLIT must be an emb_share in [0, 1] or 'racer'")
            cfg = FleetConfig(s, router, copy)
        if cfg.key in {c.key for c in out}:
            raise ValueError(f"--configs: {part!r} is given twice")
        out.append(cfg)
    if not out:
        raise ValueError("--configs: name at least one configuration")
    return out


def parse_loads(text: str) -> list[float]:
    try:
        loads = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--loads: want comma-separated fractions of capacity, got {text!r}") from None
    if not loads or not all(math.isfinite(x) and 0.0 < x <= 2.0 for x in loads):
        raise ValueError(f"--loads: want fractions of capacity in (0, 2], got {text!r}")
    return loads


# ------------------------------------------------------------------------------------- sizing


@dataclass(frozen=True)
class Sizing:
    """The agents' model and memory (`Sizing.describe` states the ratios they give).

    K/V per token = 2 (K and V) x layers x heads x head_dim x the K/V type's bytes; an embedding
    row is ``embedding_dim`` float32s; a page holds ``page_tokens`` tokens of K/V and must hold
    whole rows. The arena is ``arena_table`` of the table's bytes, in whole pages."""

    arena_table: float = 0.014
    history_scale: float = 1.0
    embedding_dim: int = 128
    num_layers: int = 1
    num_heads: int = 1
    head_dim: int = 2
    kv_dtype: str = "float16"
    page_tokens: int = 64
    max_history_len: int = 128
    num_candidates: int = 32

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_heads * self.head_dim * (4 if self.kv_dtype == "float32" else 2)

    @property
    def row_bytes(self) -> int:
        return 4 * self.embedding_dim

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.kv_bytes_per_token

    def num_pages(self, num_items: int) -> int:
        return max(16, int(round(self.arena_table * num_items * self.row_bytes / self.page_bytes)))

    def model_args(self) -> list[str]:
        return ["--embedding-dim", str(self.embedding_dim), "--num-layers", str(self.num_layers),
                "--num-heads", str(self.num_heads), "--head-dim", str(self.head_dim),
                "--page-tokens", str(self.page_tokens), "--kv-dtype", self.kv_dtype]

    def agent_args(self, num_items: int) -> list[str]:
        return [*self.model_args(), "--num-pages", str(self.num_pages(num_items)),
                "--max-history-len", str(self.max_history_len), "--num-candidates", str(self.num_candidates),
                "--max-candidates", str(max(256, self.num_candidates))]

    def describe(self, num_items: int, mean_history_len: float, users_per_node: float) -> dict:
        arena = self.num_pages(num_items) * self.page_bytes
        table = num_items * self.row_bytes
        user_kv = mean_history_len * self.kv_bytes_per_token
        return {"arena_bytes": arena, "table_bytes": table, "arena_over_table": round(arena / table, 5),
                "mean_user_kv_bytes": round(user_kv, 1),
                "arena_over_mean_user_kv": round(arena / user_kv, 1) if user_kv else None,
                "users_per_node": round(users_per_node, 1), "page_bytes": self.page_bytes,
                "num_pages": self.num_pages(num_items), "kv_bytes_per_token": self.kv_bytes_per_token,
                "row_bytes": self.row_bytes,
                "paper_scale": {"arena_over_table": 0.014, "arena_over_mean_user_kv": 500}}


@dataclass(frozen=True)
class Emulation:
    """Emulated agents (``--emulate PROFILE --time-scale K``, `node_agent.emulated`): the device's
    time charged from ``profile`` under the paper-scale scale model (`simulator.profiles.PaperScale`
    at ``paper_scale``: the K/V bytes per token, page and link shrunk by one factor, rows and every
    time cost kept), exactly as the simulator's nodes; each modelled second takes ``time_scale``
    wall seconds. The arena is ``arena_table`` of the table's bytes in the profile's row bytes."""

    profile: str
    time_scale: float
    paper_scale: float = 1 / 192

    def device_profile(self):
        from simulator.profiles import PaperScale, get_profile

        return PaperScale(scale=self.paper_scale).profile(get_profile(self.profile))

    def write_profile(self, workdir: Path) -> Path:
        out = workdir / "emulated_profile.json"
        out.write_text(json.dumps(self.device_profile().to_json(), indent=1) + "\n")
        return out

    def num_pages(self, num_items: int, arena_table: float) -> int:
        prof = self.device_profile()
        return max(16, int(round(arena_table * num_items * prof.emb_row_bytes / prof.page_bytes)))

    def agent_args(self, profile_path: Path, sizing: Sizing, num_items: int) -> list[str]:
        prof = self.device_profile()
        return ["--emulate", str(profile_path), "--time-scale", format(self.time_scale, "g"),
                "--page-tokens", str(prof.page_tokens), "--num-pages", str(self.num_pages(num_items, sizing.arena_table)),
                "--max-history-len", str(sizing.max_history_len), "--num-candidates", str(sizing.num_candidates),
                "--max-candidates", str(max(256, sizing.num_candidates))]

    def describe(self, num_items: int, sizing: Sizing, mean_history_len: float, users_per_node: float) -> dict:
        prof = self.device_profile()
        pages = self.num_pages(num_items, sizing.arena_table)
        arena, table = pages * prof.page_bytes, num_items * prof.emb_row_bytes
        user_kv = mean_history_len * prof.kv_bytes_per_token
        return {"arena_bytes": arena, "table_bytes": table, "arena_over_table": round(arena / table, 5),
                "mean_user_kv_bytes": round(user_kv, 1),
                "arena_over_mean_user_kv": round(arena / user_kv, 1) if user_kv else None,
                "users_per_node": round(users_per_node, 1), "page_bytes": prof.page_bytes, "num_pages": pages,
                "kv_bytes_per_token": prof.kv_bytes_per_token, "row_bytes": prof.emb_row_bytes,
                "paper_scale": {"arena_over_table": 0.014, "arena_over_mean_user_kv": 500}}

    def device(self) -> dict:
        prof = self.device_profile()
        return {"mode": "emulated", "profile": prof.name, "calibrated": bool(prof.calibrated), "time": "modelled",
                "time_scale": self.time_scale,
                "note": "every latency, rate and capacity here is in modelled time from the profile's cost model; "
                        "the caches, allocator, router, gateway and HTTP are real",
                "latency_basis": NODE_BASIS}


# -------------------------------------------------------------------------------------- fleets


def _measure_profile(workdir: Path, sizing: Sizing) -> Path:
    """``racer node profile`` of the agents' model: their miss costs (the allocator's and the
    router's weights)."""
    out = workdir / "node_profile.json"
    if not out.exists():
        subprocess.run([sys.executable, "-m", "racer", "node", "profile", *sizing.model_args(),
                        "--lengths", "64,128,256", "--repeats", "3", "--num-candidates", str(sizing.num_candidates),
                        "--out", str(out), "--no-progress"], cwd=REPO, check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    return out


class LocalFleet:
    """``num_nodes`` node agents and one gateway started here, restarted cold for every run."""

    external = False

    def __init__(self, workdir: Path, num_nodes: int, trace_kind: str, path: str | None, num_items: int,
                 sizing: Sizing, policy: str, slo_ms: float, agent_nice: int = 0,
                 emulation: Emulation | None = None) -> None:
        self.workdir, self.num_nodes, self.trace_kind, self.path = workdir, num_nodes, trace_kind, path
        self.num_items, self.sizing, self.policy, self.slo_ms = num_items, sizing, policy, slo_ms
        self.agent_nice = agent_nice
        self.emulation = emulation
        if emulation is None:
            self.profile = _measure_profile(workdir, sizing)
            self.device_args = [*sizing.agent_args(num_items), "--profile", str(self.profile)]
        else:  # the emulated device's miss costs are its profile's: nothing to measure
            self.profile = emulation.write_profile(workdir)
            self.device_args = emulation.agent_args(self.profile, sizing, num_items)
        self.agents: list = []  # bench.gateway.Proc
        self.gateway = None

    def start(self, cfg: FleetConfig) -> str:
        """Cold agents with ``cfg``'s split and a gateway with its router; the gateway's URL.
        The agents are started once and reset in place for every later run (``POST
        /v1/admin/reset``: a new engine with cold caches, the split, the allocator on or off, no
        metrics or control history), which cuts a run's start from seconds per agent (a process
        that imports torch and loads the model) to one call each; an agent that exited is
        started again with the rest."""
        from bench.gateway import Proc, free_port

        trace = ["--trace", self.trace_kind, *(["--path", self.path] if self.path else [])]
        if self.agents and all(a.proc.poll() is None for a in self.agents):
            self.stop_gateway()
            self._reset_agents(cfg)
            return self._start_gateway(cfg, trace)
        self.stop()
        split = ["--emb-share", "0.5", "--policy", self.policy, "--allow-reset"]  # a reset picks the configuration
        for i in range(self.num_nodes):
            args = ["node-agent", *trace, *self.device_args, *split, "--slo-ms", format(self.slo_ms, "g"),
                    "--seed", "1", "--control-interval-s", "1"]
            self.agents.append(Proc(args, self.workdir / f"agent{i}.log", free_port(), nice=self.agent_nice).start())
        for a in self.agents:
            a.wait_ready()
        self._reset_agents(cfg)
        return self._start_gateway(cfg, trace)

    def _start_gateway(self, cfg: FleetConfig, trace: list[str]) -> str:
        from bench.gateway import Proc, free_port

        # the residency feed every 0.2 s of the agents' time (modelled for emulated agents, as the simulator's
        # nodes report every 0.25 s)
        k = 1.0 if self.emulation is None else self.emulation.time_scale
        self.gateway = Proc(["gateway", "--nodes", ",".join(a.url for a in self.agents), "--router", cfg.router,
                             *trace, "--report-interval-s", format(0.2 * k, "g")], self.workdir / "gateway.log",
                            free_port()).start()
        self.gateway.wait_ready()
        return self.gateway.url

    def _reset_agents(self, cfg: FleetConfig) -> None:
        import httpx

        body = {"emb_share": 0.5 if cfg.split is None else cfg.split, "allocator": cfg.split is None}
        with httpx.Client(timeout=60.0) as c:
            for a in self.agents:
                r = c.post(f"{a.url}/v1/admin/reset", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"reset of {a.url} failed: HTTP {r.status_code} {r.text[:300]}")

    def stop_gateway(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        self.gateway = None

    def end_run(self) -> None:
        """After a run: the agents stay up for the next run's reset; the gateway stops."""
        self.stop_gateway()

    @property
    def node_urls(self) -> list[str]:
        return [a.url for a in self.agents]

    def pids(self) -> dict[str, list[int]]:
        """The running processes by role (``gateway``, ``agents``), for their CPU time."""
        return {"gateway": [self.gateway.proc.pid] if self.gateway else [],
                "agents": [a.proc.pid for a in self.agents]}

    def stop(self) -> None:
        from bench.gateway import stop_all

        stop_all(([self.gateway] if self.gateway else []) + self.agents)
        self.agents, self.gateway = [], None


class ExternalFleet:
    """Node agents someone else runs (``--nodes``): only the gateway is started here, per run."""

    external = True

    def __init__(self, workdir: Path, node_urls: list[str], trace_kind: str, path: str | None) -> None:
        self.workdir, self._nodes, self.trace_kind, self.path = workdir, node_urls, trace_kind, path
        self.gateway = None

    def start(self, cfg: FleetConfig) -> str:
        from bench.gateway import Proc, free_port

        self.stop()
        trace = ["--trace", self.trace_kind, *(["--path", self.path] if self.path else [])]
        self.gateway = Proc(["gateway", "--nodes", ",".join(self._nodes), "--router", cfg.router, *trace,
                             "--report-interval-s", "0.2"], self.workdir / "gateway.log", free_port()).start()
        self.gateway.wait_ready()
        return self.gateway.url

    @property
    def node_urls(self) -> list[str]:
        return list(self._nodes)

    def pids(self) -> dict[str, list[int]]:
        """Only the gateway runs here; the agents' CPU is someone else's to measure."""
        return {"gateway": [self.gateway.proc.pid] if self.gateway else []}

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        self.gateway = None

    end_run = stop


class ShareSampler(threading.Thread):
    """Every ``every_s``: the agents' mean ``emb_share`` (``GET /v1/metrics``) at
    ``time.monotonic()`` (the replay's clock)."""

    def __init__(self, urls: list[str], every_s: float = 0.5, clock=time.monotonic) -> None:
        super().__init__(daemon=True)
        self.urls, self.every_s, self.clock = urls, every_s, clock
        self.samples: list[tuple[float, float]] = []  # (monotonic s, mean emb_share over the agents that answered)
        self.halt = threading.Event()

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=1.0) as client:
            while not self.halt.is_set():
                shares = []
                for u in self.urls:
                    try:
                        v = client.get(f"{u}/v1/metrics").json().get("emb_share")
                    except (httpx.HTTPError, ValueError, AttributeError):
                        continue
                    if isinstance(v, (int, float)) and math.isfinite(v):
                        shares.append(float(v))
                if shares:
                    self.samples.append((self.clock(), float(np.mean(shares))))
                self.halt.wait(self.every_s)

    def mean(self, a: float = -math.inf, b: float = math.inf) -> float | None:
        xs = [s for t, s in self.samples if a <= t < b]
        return round(float(np.mean(xs)), 4) if xs else None


# ----------------------------------------------------------------------------------------- runs


def replay_config(schedule: str, rate_rps: float, seed: int, slo_ms: float, sizing: Sizing,
                  num_users: int | None = None, time_scale: float = 1.0, emulated: bool = False):
    from workloads.replay import ReplayConfig, parse_phases

    regimes, phase_s = parse_phases(schedule)
    return ReplayConfig(schedule=regimes, phase_s=phase_s, rate_rps=float(rate_rps), duration_s=float(sum(phase_s)),
                        seed=seed, num_users=num_users, slo_ms=slo_ms, timeout_s=10.0 * time_scale,
                        time_scale=time_scale, explicit_candidates=emulated, history_scale=sizing.history_scale,
                        num_candidates=sizing.num_candidates, max_history_len=sizing.max_history_len,
                        max_new_items=min(32, sizing.max_history_len // 4))


def workload_plan(trace, rc, workload: str | None):
    """The phases a run sends: the config's schedule (`workloads.replay.build_plan`), or one phase
    holding a named workload's stream (`workloads.fleet_workloads`) at ``rc``'s rate for its
    duration, its requests shaped as the schedule's (candidates, new items, history cap)."""
    from workloads.replay import Phase, build_plan

    if workload is None:
        return build_plan(trace, rc)
    from workloads.fleet_workloads import workload_stream
    from workloads.sessions import StreamShape

    shape = StreamShape(num_candidates=rc.num_candidates, max_new_items=rc.max_new_items,
                        max_history_len=rc.max_history_len - rc.max_new_items, history_scale=rc.history_scale)
    stream = workload_stream(workload, trace, rate_rps=rc.rate_rps, duration_s=rc.duration_s, seed=rc.seed,
                             shape=shape)
    return [Phase(workload, 0.0, stream, 0.0, rc.duration_s)]


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used (Linux ``/proc``), None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _cpu_ms_per_request(procs, served: int) -> float | None:
    """CPU ms per served request of ``procs`` (``(pid, cpu_s before)``), None where unknown."""
    used = [(cpu_s(pid), before) for pid, before in procs]
    if not served or not used or any(a is None or b is None for a, b in used):
        return None
    return round(sum(a - b for a, b in used) / served * 1e3, 4)


def run_once(fleet, cfg: FleetConfig, trace, schedule: str, rate_rps: float, seed: int, slo_ms: float,
             sizing: Sizing, num_users: int | None = None, time_scale: float = 1.0,
             workload: str | None = None, emulated: bool = False) -> dict:
    """One run of ``cfg`` at ``rate_rps``: restart, replay the schedule through the gateway, stop.
    With local processes it also says their CPU ms per served request (gateway, agents). With
    emulated agents (``time_scale`` K) the schedule is sent K times slower and every figure is
    read in modelled time."""
    import asyncio

    from workloads.replay import ReplayStats, modelled_clock, run_replay

    rc = replay_config(schedule, rate_rps, seed, slo_ms, sizing, num_users, time_scale, emulated)
    plan = workload_plan(trace, rc, workload)
    clock = time.monotonic if time_scale == 1.0 else modelled_clock(time_scale)
    url = fleet.start(cfg)
    try:
        stats = ReplayStats(slo_ms, clock=clock, wall_per_s=time_scale)
        sampler = ShareSampler(fleet.node_urls, every_s=0.5 * time_scale, clock=clock)
        sampler.start()
        pids = fleet.pids()
        before = {k: [(p, cpu_s(p)) for p in v] for k, v in pids.items()}
        try:
            asyncio.run(run_replay([url], trace, rc, stats, clock=clock, plan=plan))
        finally:
            sampler.halt.set()
            sampler.join(5)
        rep = stats.report()
        cpu = {f"{k}_cpu_ms_per_request": _cpu_ms_per_request(v, rep["requests_served"]) for k, v in before.items()}
        t0 = stats.started_s if stats.started_s is not None else 0.0
        phases = {}
        for ph in plan:
            fig = dict(rep["phases"].get(ph.name, {}))
            fig["mean_share"] = sampler.mean(t0 + ph.start_s, t0 + ph.end_s)
            if emulated:
                fig = _node_basis(fig)
            phases[ph.name] = fig
    finally:
        fleet.end_run()
    out = {"config": cfg.key, "rate_rps": rate_rps, "seed": seed, "p50_ms": rep["latency_ms"]["p50"],
            "p99_ms": rep["p99_ms"], "slo_attainment": rep["slo_attainment"],
            "throughput_rps": round(rep["requests_served"] / rc.duration_s, 2),
            "offered_rps": round(rep["requests_sent"] / rc.duration_s, 2),
            "requests_sent": rep["requests_sent"], "requests_failed": rep["requests_failed"],
            "failures": rep["failures"], "kv_hit_rate": rep["kv_hit_rate"], "emb_hit_rate": rep["emb_hit_rate"],
            "multi_pass_share": rep["multi_pass_share"], "node_p99_ms": rep["node_p99_ms"], "tail_ms": rep["tail_ms"],
            "cache_stage_share": rep["cache_stage_share"],
            "mean_share": sampler.mean(),
            "served_by": rep["served_by"],
            "dispatch_lag_ms_p99": rep["dispatch_lag_ms_p99"], "phases": phases,
            "gateway_cpu_ms_per_request": cpu.get("gateway_cpu_ms_per_request"),
            "agents_cpu_ms_per_request": cpu.get("agents_cpu_ms_per_request"),
            "node_p50_ms": rep["node_p50_ms"], "node_slo_attainment": rep["node_slo_attainment"]}
    return _node_basis(out) if emulated else out


#: what an emulated run's latency figures are (`_node_basis`)
NODE_BASIS = ("the emulated devices' own time: from a request's arrival at its node to its modelled completion (queue, "
              "EMB, link, compute); the client's end-to-end figures, which add this VM's gateway, HTTP and load "
              "generator time (divided by the time scale), are under client_*")


def _node_basis(fig: dict) -> dict:
    """An emulated run's figures on the devices' own time: ``p99_ms``, ``p50_ms`` and
    ``slo_attainment`` become the nodes' (failures count as misses), the client's end to end move to
    ``client_*``. On a 2-core VM the host's own time (gateway, HTTP, load generator, a thread
    descheduled) is this machine's, not the fleet's, and would drown the device's."""
    out = dict(fig)
    for k in ("p99_ms", "p50_ms", "slo_attainment"):
        out[f"client_{k}"] = fig.get(k)
    out["p99_ms"], out["p50_ms"] = fig.get("node_p99_ms"), fig.get("node_p50_ms")
    out["slo_attainment"] = fig.get("node_slo_attainment")
    out["latency_basis"] = "node"
    return out


def _passes(run: dict, slo_ms: float) -> bool:
    return run["requests_failed"] == 0 and run["p99_ms"] is not None and run["p99_ms"] <= slo_ms


def find_capacity(run_at, slo_ms: float, start_rps: float, iters: int, progress=None) -> tuple[float, list[dict]]:
    """The highest rate whose steady P99 is within ``slo_ms`` with no failure: ``run_at(rate)``
    (a steady run at static 0.5 + least_load) at ``start_rps`` doubled until a rate fails (halved
    until one passes when the first fails), then ``iters`` bisections between the last pass and
    the first failure. Returns (capacity, the probes in order)."""
    probes: list[dict] = []

    def probe(rate: float) -> bool:
        r = run_at(rate)
        probes.append(r)
        if progress is not None:
            progress(r)
        return _passes(r, slo_ms)

    found = bracket_and_bisect(probe, start_rps, iters, max_rate=1e5, min_rate=0.5)
    if found.lo is None:
        raise RuntimeError(f"the fleet meets the {slo_ms:g} ms SLO at no rate down to {found.stop_rate:g} req/s: "
                           f"{probes[-1]['p99_ms']} ms P99 at the lowest")
    return found.lo, probes


# ------------------------------------------------------------------------------------ judging


def _stat(values) -> dict | None:
    xs = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    if not xs:
        return None
    return {"median": round(float(np.median(xs)), 4), "min": round(min(xs), 4), "max": round(max(xs), 4), "n": len(xs)}


FIGURES = ("p99_ms", "p50_ms", "slo_attainment", "throughput_rps", "kv_hit_rate", "emb_hit_rate", "multi_pass_share",
           "mean_share", "node_p99_ms", "cache_stage_share", "gateway_cpu_ms_per_request",
           "agents_cpu_ms_per_request", "client_p99_ms", "client_p50_ms")


def aggregate(runs: list[dict], configs: list[FleetConfig], loads: list[float]) -> list[dict]:
    """Per (load, configuration): each figure's median and range over the rounds, overall and per
    phase, and ``tail_ms``: the medians over the rounds of where the slowest 1% spent their time
    (`workloads.replay._Tally.tail`)."""
    out = []
    for load in loads:
        for cfg in configs:
            rs = [r for r in runs if r["config"] == cfg.key and r["load"] == load]
            if not rs:
                continue
            row = {"config": cfg.key, "name": cfg.name, "load": load, "rate_rps": rs[0]["rate_rps"], "rounds": len(rs)}
            for f in FIGURES:
                row[f] = _stat(r.get(f) for r in rs)
            row["requests_failed"] = _stat(r["requests_failed"] for r in rs)
            tails = [r["tail_ms"] for r in rs if r.get("tail_ms")]
            row["tail_ms"] = ({k: round(float(np.median([t[k] for t in tails])), 2) for k in tails[0] if k != "n"}
                              if tails else None)
            row["phases"] = {ph: {f: _stat(r["phases"].get(ph, {}).get(f) for r in rs) for f in FIGURES}
                             for ph in rs[0]["phases"]}
            out.append(row)
    return out


def _median_p99(rows: list[dict], key: str, load: float, figure: str = "p99_ms") -> float | None:
    for r in rows:
        if r["config"] == key and r["load"] == load and r.get(figure) is not None:
            return r[figure]["median"]
    return None


def _pct_over(a: float | None, b: float | None) -> float | None:
    return round((a / b - 1.0) * 100.0, 2) if a is not None and b else None


def _paired_logs(runs, key: str, base: str, load: float, figure: str) -> list[float]:
    """log(``key`` / ``base``) of ``figure`` in each round that ran both at ``load``."""
    by: dict = {}
    for r in runs:
        v = r.get(figure)
        if r["load"] == load and r["config"] in (key, base) and isinstance(v, (int, float)) and v > 0:
            by.setdefault(r["round"], {})[r["config"]] = float(v)
    return [math.log(v[key] / v[base]) for v in by.values() if key in v and base in v]


def paired_pct(runs: list[dict], key: str, base: str, load: float, figure: str = "p99_ms") -> float | None:
    """``key``'s P99 (``figure``) over ``base``'s, paired by round: the geometric mean over the
    rounds that ran both at ``load`` of their ratio (a round runs them minutes apart, so the
    machine's slow drifts cancel), as a percentage; None without such a round."""
    logs = _paired_logs(runs, key, base, load, figure)
    return _pct(sum(logs) / len(logs)) if logs else None


#: the targets the verdicts judge, % of P99 (RACER over the best static configuration; the racer
#: router over least_load at the same split)
TARGETS_PCT = {"racer_over_best_static": 5.0, "racer_router_over_least_load": 2.0}
#: an A/A interval must leave [-AA_RESOLUTION_PCT, +AA_RESOLUTION_PCT] to fail the control: a
#: quarter of the smallest target, below anything a verdict decides (runs of a deterministic
#: emulated device can repeat to 0.01%, and then a steady 0.03% between two copies excludes 0)
AA_RESOLUTION_PCT = 0.5
#: one-sided 95% quantiles of Student's t for 1..30 degrees of freedom (beyond: the normal's)
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
        1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)
MAX_ROUNDS_FOR_WIDTH = 10_000


def _t95(df: int) -> float:
    return _T95[df - 1] if df <= len(_T95) else 1.645


def _pct(log_ratio: float) -> float:
    return round(100.0 * (math.exp(log_ratio) - 1.0), 2)


def block_interval(runs, load: float, key: str, base: str, target_pct: float | None = None) -> dict | None:
    """``key``'s P99 over ``base``'s at ``load`` with a 90% interval (each bound one-sided 95%),
    rounds as blocks: the mean over the rounds that ran both of their log P99 difference (a
    round's drift falls out), its standard error from the spread of those differences and
    Student's t on rounds - 1 degrees of freedom. The noise is the pair's own, not pooled over
    every configuration: near capacity some configurations' runs are bimodal (a backlog forms or
    it does not) while others' agree within a percent, and a pooled spread would charge the
    first kind's noise to every comparison. ``sd_log`` is one run's log P99 sd implied by the
    differences (theirs over sqrt 2); ``half_width_pct`` the difference the rounds run can
    resolve; ``rounds_for_width`` the rounds whose interval would be as narrow as the target.
    With ``target_pct`` (``key`` at most that much above ``base``): ``verdict`` ``met`` (the
    upper bound within the target), ``not met`` (the lower bound above it) or ``undecided``.
    None when no round ran both."""
    d = _paired_logs(runs, key, base, load, "p99_ms")
    if not d:
        return None
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n >= 2 else None
    out = {"base": base, "rounds": n, "pct": _pct(mean), "sd_log": None if sd is None else round(sd / math.sqrt(2), 4),
           "lo_pct": None, "hi_pct": None, "half_width_pct": None}
    half = None
    if sd is not None:
        half = _t95(n - 1) * sd / math.sqrt(n)
        out.update(lo_pct=_pct(mean - half), hi_pct=_pct(mean + half), half_width_pct=_pct(half))
    if target_pct is None:
        return out
    goal = math.log1p(target_pct / 100.0)
    out["verdict"] = ("undecided" if half is None else "met" if mean + half <= goal
                      else "not met" if mean - half > goal else "undecided")
    need = None
    if sd is not None:  # the same noise, more rounds
        need = 2 if sd == 0.0 else next((m for m in range(2, MAX_ROUNDS_FOR_WIDTH + 1)
                                          if _t95(m - 1) * sd / math.sqrt(m) <= goal), None)
    out["rounds_for_width"] = need
    return out


def findings(rows: list[dict], configs: list[FleetConfig], loads: list[float], runs=()) -> dict:
    """Per load (keyed as in ``loads``): RACER over the best static configuration in hindsight (any
    configuration whose split is static, whatever its router), over
    the default (0.5 + round_robin), and the racer router over least_load at split 0.5, on medians;
    with ``runs``, the last also paired by round (`paired_pct`); and the last on the node agents'
    own P99 (``node_p99_ms``: queue and compute, the part a router decides, without the HTTP and
    process scheduling that share the machine's cores). With an A/A copy among ``configs``
    (``#N``, never a candidate for the best static), the copy over its original (on medians and
    paired) and over the best static configuration: what an identical configuration scores, the
    floor under which no difference in the other findings is the configurations'.

    ``verdicts`` judges the targets in `TARGETS_PCT` per load (`block_interval`: ``met``, ``not
    met`` or ``undecided``, the difference the rounds can resolve and the rounds the target's
    width would need), against the best static configuration chosen on medians; with an A/A
    copy, ``aa_over_original`` gives the copy's interval, which should hold 0 (a check of the
    noise model): where it lies wholly beyond `AA_RESOLUTION_PCT` of 0, every verdict at that
    load is ``undecided`` and says what it was (``overruled``)."""
    runs = list(runs)
    statics = [c.key for c in configs if c.split is not None and c.copy == 1]
    aa = next((c for c in configs if c.copy > 1), None)
    out: dict = {"racer_over_best_static_pct": {}, "best_static": {}, "racer_over_default_pct": {},
                 "racer_router_over_least_load_pct": {}, "racer_router_over_least_load_paired_pct": {},
                 "racer_router_over_least_load_node_pct": {}, "racer_router_over_least_load_node_paired_pct": {}}
    verdicts = {name: {"target_pct": t, "by_load": {}} for name, t in TARGETS_PCT.items()}
    if aa is not None:
        out.update({"aa_control": aa.key, "aa_over_original_pct": {}, "aa_over_original_paired_pct": {},
                    "aa_over_best_static_pct": {}})
        verdicts["aa_over_original"] = {"target_pct": None, "by_load": {}}
    for load in loads:
        k = format(load, "g")
        racer = _median_p99(rows, RACER_KEY, load)
        best = min(((p, s) for s in statics if (p := _median_p99(rows, s, load)) is not None), default=None)
        out["best_static"][k] = best[1] if best else None
        out["racer_over_best_static_pct"][k] = _pct_over(racer, best[0] if best else None)
        if aa is not None:  # the same configuration again: how far the bench's noise alone moves a figure
            aa_p99 = _median_p99(rows, aa.key, load)
            out["aa_over_original_pct"][k] = _pct_over(aa_p99, _median_p99(rows, aa.base_key, load))
            out["aa_over_original_paired_pct"][k] = paired_pct(runs, aa.key, aa.base_key, load)
            out["aa_over_best_static_pct"][k] = _pct_over(aa_p99, best[0] if best else None)
        out["racer_over_default_pct"][k] = _pct_over(racer, _median_p99(rows, DEFAULT_KEY, load))
        for name, figure in (("racer_router_over_least_load", "p99_ms"),
                             ("racer_router_over_least_load_node", "node_p99_ms")):
            out[f"{name}_pct"][k] = _pct_over(_median_p99(rows, "0.5/racer", load, figure),
                                              _median_p99(rows, "0.5/least_load", load, figure))
            out[f"{name}_paired_pct"][k] = paired_pct(runs, "0.5/racer", "0.5/least_load", load, figure)
        by = verdicts["racer_over_best_static"]["by_load"]
        by[k] = block_interval(runs, load, RACER_KEY, best[1], TARGETS_PCT["racer_over_best_static"]) \
            if best else None
        verdicts["racer_router_over_least_load"]["by_load"][k] = block_interval(
            runs, load, "0.5/racer", "0.5/least_load", TARGETS_PCT["racer_router_over_least_load"])
        if aa is not None:
            a = verdicts["aa_over_original"]["by_load"][k] = block_interval(runs, load, aa.key, aa.base_key)
            if a is not None and a["lo_pct"] is not None and (a["lo_pct"] > AA_RESOLUTION_PCT
                                                              or a["hi_pct"] < -AA_RESOLUTION_PCT):
                # the control failed: two runs of one configuration differ beyond the interval, so
                # the noise is not what the interval assumes (heavy tails, runs that are not
                # independent) and no verdict at this load stands
                for name in TARGETS_PCT:
                    v = verdicts[name]["by_load"][k]
                    if v is not None and v["verdict"] != "undecided":
                        v["verdict"], v["overruled"] = "undecided", (
                            f"was {v['verdict']}: the A/A interval excludes 0 (beyond {AA_RESOLUTION_PCT:g}%)")
    out["verdicts"] = verdicts
    return out


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_plot(rows: list[dict], loads: list[float], path: Path) -> str | None:
    """P99 per phase per configuration (median, range as error bars), one panel per load."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(loads), figsize=(6 * len(loads), 4.5), squeeze=False, sharey=True)
    for ax, load in zip(axes[0], loads):
        rs = [r for r in rows if r["load"] == load]
        if not rs:
            continue
        phases = list(rs[0]["phases"])
        x = np.arange(len(phases))
        w = 0.8 / max(1, len(rs))
        for i, r in enumerate(rs):
            med = [((r["phases"][p]["p99_ms"] or {}).get("median", np.nan)) for p in phases]
            lo = [m - ((r["phases"][p]["p99_ms"] or {}).get("min", m)) for p, m in zip(phases, med)]
            hi = [((r["phases"][p]["p99_ms"] or {}).get("max", m)) - m for p, m in zip(phases, med)]
            ax.bar(x + i * w - 0.4 + w / 2, med, w, yerr=[lo, hi], capsize=2, label=r["name"])
        ax.set_xticks(x)
        ax.set_xticklabels(phases, rotation=20, fontsize=8)
        ax.set_title(f"load {load:g} of capacity ({rs[0]['rate_rps']:g} req/s)")
        ax.set_yscale("log")  # a burst's backlog (seconds) beside the steady phases' tens of ms
        ax.set_ylabel("P99 (ms, log scale), median of rounds")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def write_verdict_plot(verdicts: dict, path: Path) -> str | None:
    """The verdicts as intervals: one row per (comparison, load), the point estimate, its 90%
    interval, the target as a dashed line, colour by verdict; log-ratio axis labelled in %."""
    rows = [(name, load, x, v["target_pct"]) for name, v in verdicts.items()
            for load, x in v["by_load"].items() if x is not None and x.get("lo_pct") is not None]
    if not rows:
        return None
    plt = _pyplot()
    if plt is None:
        return None
    colours = {"met": "tab:green", "not met": "tab:red", "undecided": "tab:grey", None: "tab:blue"}
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.6))
    for i, (name, load, x, target) in enumerate(reversed(rows)):
        lo, mid, hi = (math.log1p(x[k] / 100.0) for k in ("lo_pct", "pct", "hi_pct"))
        c = colours.get(x.get("verdict"), "tab:grey")
        ax.plot([lo, hi], [i, i], color=c, lw=3)
        ax.plot([mid], [i], "o", color="black", ms=4)
        if target is not None:
            t = math.log1p(target / 100.0)
            ax.plot([t, t], [i - 0.35, i + 0.35], "--", color="black", lw=1)
        label = (f"{name} @ {load}" + (f": {x['verdict']}" if x.get("verdict") else "")
                 + (" (overruled: the A/A copy's interval excludes 0)" if x.get("overruled") else ""))
        ax.annotate(label, (0.0, i), xytext=(4, 6), textcoords="offset points", fontsize=7)
    ax.axvline(0.0, color="black", lw=0.5)
    ticks = [-0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 9.0]
    ax.set_xticks([math.log1p(t) for t in ticks])
    ax.set_xticklabels([f"{t * 100:+.0f}%" for t in ticks], fontsize=7)
    ax.set_yticks([])
    ax.set_xlabel("P99 over the base configuration's (90% interval; dashed: the target)")
    ax.set_title("fleet A/B verdicts (grey undecided, green met, red not met, blue the A/A copy)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ----------------------------------------------------------------------------------------- main


def _save(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_fleet(args) -> dict:
    from tqdm import tqdm

    resolve_defaults(args)
    from workloads import load_trace
    from workloads.replay import build_plan

    configs = parse_configs(args.configs or ",".join(QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS))
    loads = parse_loads(args.loads)
    workload = args.workload
    if workload is not None:  # one stream of the named workload; the schedule only carries its length
        schedule = f"steady:{args.workload_s or (15.0 if args.quick else 60.0):g}"
    else:
        schedule = args.schedule or (QUICK_SCHEDULE if args.quick else SCHEDULE)
    rounds = args.rounds
    sizing = Sizing(arena_table=args.arena_table, history_scale=args.history_scale,
                    max_history_len=args.max_history_len)
    emulation = Emulation(args.emulate, args.time_scale, args.paper_scale) if args.emulate else None
    k = args.time_scale if emulation is not None else 1.0
    trace = load_trace(args.trace, args.path)
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="racer-bench-fleet-"))
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    work = out_dir / "work"
    work.mkdir(exist_ok=True)
    steady_s = float(args.capacity_s or (8.0 if args.quick else 20.0))
    settings = {"trace": trace.name, "schedule": schedule, "configs": [c.key for c in configs], "loads": loads,
                "rounds": rounds, "slo_ms": args.slo_ms, "seed": args.seed,
                # (history_scale only when set: folders saved before it resume)
                "sizing": {k: v for k, v in asdict(sizing).items() if k != "history_scale" or v != 1.0},
                "nodes": args.nodes or args.num_nodes, "policy": args.policy, "capacity_steady_s": steady_s}
    if emulation is not None:  # (absent without it: folders saved before the option resume)
        settings.update(emulation=asdict(emulation), trace_kind=args.trace, trace_path=args.path)
    if workload is not None:
        settings["workload"] = workload
    agent_nice = 0 if args.nodes else (AGENT_NICE if args.agent_nice is None else args.agent_nice)
    if agent_nice:  # (absent at 0: folders saved before the option resume with --agent-nice 0)
        settings["agent_nice"] = agent_nice
    prev = _load(out_dir / "settings.json")
    if prev is not None and {**prev, "rounds": rounds} != settings:  # more rounds: the saved ones stay
        raise SystemExit(f"{out_dir} holds a bench with other settings ({out_dir / 'settings.json'}); "
                         f"give another --out or remove it (only --rounds may change)")
    _save(out_dir / "settings.json", settings)
    if args.nodes:
        fleet = ExternalFleet(work, [u.strip().rstrip("/") for u in args.nodes.split(",") if u.strip()],
                              args.trace, args.path)
        num_nodes = len(fleet.node_urls)
    else:
        fleet = LocalFleet(work, args.num_nodes, args.trace, args.path, trace.num_items, sizing, args.policy,
                           args.slo_ms, agent_nice=agent_nice, emulation=emulation)
        num_nodes = args.num_nodes
    say = (lambda m: print(f"bench fleet: {m}", file=sys.stderr, flush=True)) if args.progress else (lambda m: None)
    cap_cfg = next(c for c in parse_configs(CAPACITY_KEY))
    warm = False  # a run has served on these agents in this process (a capacity probe counts)
    try:
        cap = _load(out_dir / "capacity.json")
        if cap is None and args.capacity is not None:
            cap = {"capacity_rps": round(args.capacity, 2), "given": True, "probes": []}
            _save(out_dir / "capacity.json", cap)
        elif cap is not None and args.capacity is not None and abs(cap["capacity_rps"] - args.capacity) > 1e-6:
            raise SystemExit(f"{out_dir} holds capacity {cap['capacity_rps']:g} req/s, not --capacity "
                             f"{args.capacity:g}; give another --out")
        if cap is None:
            def run_at(rate):
                return run_once(fleet, cap_cfg, trace, f"steady:{steady_s:g}", rate, args.seed, args.slo_ms, sizing,
                                time_scale=k, workload=workload, emulated=emulation is not None)

            say(f"capacity: steady {steady_s:g} s at static 0.5 + least_load, P99 within {args.slo_ms:g} ms")
            capacity, probes = find_capacity(
                run_at, args.slo_ms, args.capacity_start, args.capacity_iters,
                progress=lambda r: say(f"  {r['rate_rps']:g} req/s: P99 {r['p99_ms']} ms, "
                                       f"{r['requests_failed']} failed"))
            cap = {"capacity_rps": round(capacity, 2), "probes": [
                {k: p[k] for k in ("rate_rps", "p99_ms", "p50_ms", "slo_attainment", "requests_failed")}
                for p in probes]}
            _save(out_dir / "capacity.json", cap)
            warm = True
        capacity = cap["capacity_rps"]
        say(f"capacity {capacity:g} req/s; loads {', '.join(f'{x:g}' for x in loads)}")
        pairs = [(c, load) for c in configs for load in loads]
        runs = []
        bar = tqdm(total=rounds * len(pairs), desc="bench fleet", unit="run", disable=not args.progress,
                   file=sys.stderr)
        with bar:
            for rnd in range(rounds):
                for j in round_order(len(pairs), rnd, args.seed):
                    cfg, load = pairs[int(j)]
                    f = out_dir / "runs" / f"r{rnd}_{load:g}_{cfg.key.replace('/', '+')}.json"
                    r = _load(f)
                    if r is None:
                        if not warm and not args.nodes:
                            # a fresh agent's first run pays its first-use costs (emulated, kv-heavy and
                            # emb-heavy: P99 6-26% above its A/A copy's): one unmeasured run takes them
                            say(f"warm-up run ({cfg.key} at {load:g}, not measured)")
                            run_once(fleet, cfg, trace, schedule, round(load * capacity, 2), args.seed,
                                     args.slo_ms, sizing, time_scale=k, workload=workload,
                                     emulated=emulation is not None)
                        r = run_once(fleet, cfg, trace, schedule, round(load * capacity, 2), args.seed, args.slo_ms,
                                     sizing, time_scale=k, workload=workload, emulated=emulation is not None)
                        warm = True
                        r.update(round=rnd, load=load)
                        _save(f, r)
                    runs.append(r)
                    bar.set_postfix(config=cfg.key, load=load, p99=r["p99_ms"], refresh=False)
                    bar.update(1)
    finally:
        fleet.stop()
    rows = aggregate(runs, configs, loads)
    plan = workload_plan(trace, replay_config(schedule, capacity, args.seed, args.slo_ms, sizing), workload)
    stream = plan[0].stream  # one stream for the whole schedule
    users = len(np.unique(stream.user))
    hist = float(np.mean(stream.history_len)) if len(stream) else 0.0
    result = {"capacity_rps": capacity, "capacity": cap,
              "loads": {format(x, "g"): round(x * capacity, 2) for x in loads},
              "configs": rows, "findings": findings(rows, configs, loads, runs),
              "num_nodes": num_nodes, "external_fleet": bool(args.nodes), "schedule": schedule, "rounds": rounds,
              "workload": workload,
              "trace": trace.name, "slo_ms": args.slo_ms,
              "sizing": (sizing.describe(trace.num_items, hist, users / max(1, num_nodes)) if emulation is None else
                         emulation.describe(trace.num_items, sizing, hist, users / max(1, num_nodes))),
              "device": (emulation.device() if emulation is not None else
                         {"mode": "external" if args.nodes else "cpu-compute", "time": "measured"}),
              "cpu_count": os.cpu_count(), "agent_nice": agent_nice, "out": str(out_dir)}
    png = write_plot(rows, loads, out_dir / "fleet_p99.png")
    result["plot"] = png
    result["verdict_plot"] = write_verdict_plot(result["findings"]["verdicts"], out_dir / "fleet_verdicts.png")
    _save(out_dir / "fleet.json", result)
    if emulation is not None:  # the simulator on the same stream, sizing and profile (bench/sim_to_real.py)
        from bench.sim_to_real import compare

        say("sim-to-real: the simulator on the same streams")
        s2r = compare(out_dir)
        result["sim_to_real"] = {"by_load": s2r["by_load"], "rows": s2r["rows"]}
        _save(out_dir / "fleet.json", result)
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    from workloads.loaders import LOADERS

    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--quick", action="store_true",
                   help=f"short phases ({QUICK_SCHEDULE}) and six configurations ({','.join(QUICK_CONFIGS)})")
    p.add_argument("--out", default=None, help="directory for the runs, the JSON and the plot (a rerun resumes)")
    p.add_argument("--nodes", default=None,
                   help="URLs of a running fleet's node agents (comma-separated): compare routers on it as deployed "
                        "(default: start --num-nodes local agents)")
    p.add_argument("--num-nodes", type=int, default=4, help="local node agents (default 4)")
    p.add_argument("--configs", default=None,
                   help="SPLIT/ROUTER,... (SPLIT an emb_share or racer; SPLIT/ROUTER#N, N in 2..9: an A/A copy "
                        "of SPLIT/ROUTER, the bench's own noise)")
    p.add_argument("--loads", default=None,
                   help="fractions of the steady capacity (default 0.5,0.75,0.95; emulated --quick 0.5,0.75)")
    p.add_argument("--agent-nice", type=int, default=None, choices=range(0, 20), metavar="N",
                   help=f"local agents' CPU priority, nice 0-19 (default {AGENT_NICE}): below the gateway's and "
                        f"the load generator's, as if those had cores of their own, so a burst's backlog builds "
                        f"at the nodes; 0: the same priority")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds, a new order each (default 3); more on a saved --out runs only the new ones")
    p.add_argument("--schedule", default=None, help=f"REGIME:SECONDS,... (default {SCHEDULE})")
    p.add_argument("--workload", default=None, metavar="NAME",
                   help="send one named workload's stream instead of --schedule (workloads.fleet_workloads: kv-heavy, "
                        "emb-heavy, day, trace-order); the capacity rule probes the same workload")
    p.add_argument("--workloads", default=None, metavar="NAME,...",
                   help=f"one bench per workload (each in OUT/NAME), then RACER against the single best static "
                        f"configuration over them (bench.fleet_across); an emulated --quick without --workload runs "
                        f"{','.join(EMULATED_WORKLOADS)}")
    p.add_argument("--workload-s", type=float, default=None,
                   help="seconds of a --workload run (default 60, quick 15)")
    p.add_argument("--trace", default="taobao", choices=sorted(LOADERS), help="trace (default taobao)")
    p.add_argument("--path", default=None, help="trace file (default: the sample)")
    p.add_argument("--slo-ms", type=float, default=None,
                   help=f"latency SLO of the capacity rule and the attainment figures (default {SLO_MS:g}: on a CPU "
                        f"the small model's light-load P99 is 40-50 ms, docs/fleet.md; with --emulate 30, the paper's)")
    p.add_argument("--seed", type=int, default=0, help="the streams' seed (default 0)")
    p.add_argument("--policy", default=str(REPO / "policies" / "default"),
                   help="allocator policy of the racer configurations (default: the shipped one)")
    p.add_argument("--arena-table", type=float, default=0.014,
                   help="arena bytes as a fraction of the embedding table's (default 0.014)")
    p.add_argument("--capacity-start", type=float, default=None,
                   help="first rate of the capacity search (req/s; default 20, with --emulate 300)")
    p.add_argument("--capacity-iters", type=int, default=3, help="bisections of the capacity search (default 3)")
    p.add_argument("--capacity", type=float, default=None, metavar="RPS",
                   help="the steady capacity (req/s), given instead of searched: loads are fractions of it "
                        "(a rerun of a bench whose capacity.json says the figure)")
    p.add_argument("--capacity-s", type=float, default=None, help="seconds of each capacity probe (default 20, quick 8)")
    p.add_argument("--emulate", default=None, metavar="PROFILE",
                   help="emulated agents (racer node-agent --emulate): the device's time charged from PROFILE (a100-hstu "
                        "or a profile JSON) under the paper-scale scale model; every figure is in modelled time")
    p.add_argument("--time-scale", type=float, default=None, metavar="K",
                   help="with --emulate: wall seconds per modelled second (default 5)")
    p.add_argument("--paper-scale", type=float, default=None, metavar="F",
                   help="with --emulate: the scale model's factor (K/V bytes per token, page, link x F; default 1/6144)")
    p.add_argument("--history-scale", type=float, default=None, metavar="S",
                   help="first histories S x the trace's lengths (workloads.regimes; default 1, with --emulate 20)")
    p.add_argument("--max-history-len", type=int, default=None, metavar="N",
                   help=f"most history + new items per request (default {Sizing.max_history_len}, with --emulate 4096)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


#: defaults that depend on the agents (`resolve_defaults`): CPU-compute agents, emulated devices
MODE_DEFAULTS = {
    "cpu": {"slo_ms": SLO_MS, "capacity_start": 20.0, "time_scale": 1.0, "paper_scale": 1 / 192,
            "history_scale": 1.0, "max_history_len": Sizing.max_history_len},
    # emulated A100s: the paper's 30-ms SLO; histories of GPU weight (a user's first history 20x its Taobao
    # length, up to 4,096 items) under a scale model whose 16-byte K/V tokens keep the arena at a few hundred
    # mean users' K/V; K=5 keeps the host under half of its two cores at 0.75 of capacity
    "emulated": {"slo_ms": 30.0, "capacity_start": 300.0, "time_scale": 5.0, "paper_scale": 1 / 6144,
                 "history_scale": 20.0, "max_history_len": 4096},
}


def resolve_defaults(args) -> None:
    """Fill the options left unset with the defaults of the agents' kind (`MODE_DEFAULTS`); an
    emulated ``--quick`` runs loads 0.5 and 0.75 (the verdicts' loads) and 8-s workloads."""
    emulated = bool(getattr(args, "emulate", None))
    mode = MODE_DEFAULTS["emulated" if emulated else "cpu"]
    for k, v in mode.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    quick = emulated and getattr(args, "quick", False)
    if getattr(args, "loads", None) is None:
        args.loads = "0.5,0.75" if quick else "0.5,0.75,0.95"
    if getattr(args, "workload_s", None) is None and quick:
        args.workload_s = QUICK_EMULATED_WORKLOAD_S


def runs_every_workload(args) -> bool:
    """``--workloads``, or an emulated ``--quick`` without ``--workload`` or ``--schedule``: one bench
    per workload (`workload_list`) and RACER against the single best static configuration over them."""
    return bool(getattr(args, "workloads", None)) or (
        bool(args.emulate) and args.quick and args.workload is None and not args.schedule)


def workload_list(args) -> tuple[str, ...]:
    given = getattr(args, "workloads", None)
    return tuple(w.strip() for w in given.split(",") if w.strip()) if given else EMULATED_WORKLOADS


def run_workloads(args) -> dict:
    """`run_fleet` on each workload of `workload_list` (default `EMULATED_WORKLOADS`) in turn, each in ``OUT/<workload>`` (each
    resumes on its own), then `bench.fleet_across` over them: ``{"workloads": {name: result},
    "across": ..., "out"}``. Each workload searches its own capacity."""
    import copy

    from bench.fleet_across import across

    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="racer-bench-fleet-"))
    results = {}
    for name in workload_list(args):
        a = copy.copy(args)
        a.workload, a.workloads, a.out = name, None, str(base / name)
        if args.progress:
            print(f"bench fleet: workload {name} ({base / name})", file=sys.stderr, flush=True)
        results[name] = run_fleet(a)
    out = {"workloads": results, "across": across(results), "out": str(base)}
    _save(base / "fleet_workloads.json", out)
    return out


def check_args(p: argparse.ArgumentParser, args) -> None:
    resolve_defaults(args)
    try:
        if args.configs:
            parse_configs(args.configs)
        parse_loads(args.loads)
        if args.schedule:
            from workloads.replay import parse_phases

            if parse_phases(args.schedule)[1] is None:
                raise ValueError("--schedule: give REGIME:SECONDS phases (one stream, users keep their identity)")
    except ValueError as e:
        p.error(str(e))
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.capacity is not None and not (math.isfinite(args.capacity) and args.capacity > 0):
        p.error("--capacity must be a positive number of requests per second")
    if not args.nodes and args.num_nodes < 1:
        p.error("--num-nodes must be at least 1")
    if not (0.0 < args.arena_table < 1.0):
        p.error("--arena-table must be in (0, 1)")
    if not (args.slo_ms > 0 and math.isfinite(args.slo_ms)):
        p.error("--slo-ms must be a positive number")
    if not args.nodes and not Path(args.policy).is_dir():
        p.error(f"--policy {args.policy}: not a policy directory")
    if args.workload is not None:
        if args.schedule:
            p.error("--workload and --schedule: give one")
        from workloads.fleet_workloads import get_spec

        try:
            get_spec(args.workload)
        except ValueError as e:
            p.error(f"--workload: {e}")
    if args.workload_s is not None and not (math.isfinite(args.workload_s) and args.workload_s > 0):
        p.error("--workload-s must be a positive number of seconds")
    if args.emulate and args.nodes:
        p.error("--emulate starts emulated agents here; --nodes points at agents someone else runs")
    if args.workloads is not None:
        if args.workload is not None or args.schedule:
            p.error("--workloads runs several workloads: not with --workload or --schedule")
        from workloads.fleet_workloads import get_spec

        names = workload_list(args)
        try:
            for name in names:
                get_spec(name)
        except ValueError as e:
            p.error(f"--workloads: {e}")
        if not names or len(set(names)) != len(names):
            p.error("--workloads: give distinct workload names")
    if runs_every_workload(args) and args.capacity is not None:
        p.error(f"--capacity is one workload's: give --workload NAME with it (without, the bench runs "
                f"{', '.join(workload_list(args))}, each searching its own capacity)")
    if not (math.isfinite(args.history_scale) and 0 < args.history_scale <= 1000):
        p.error("--history-scale must be in (0, 1000]")
    if args.max_history_len is not None and not 2 <= args.max_history_len <= 1 << 16:
        p.error("--max-history-len must be in [2, 65536]")
    if not (math.isfinite(args.paper_scale) and 0 < args.paper_scale <= 1):
        p.error("--paper-scale must be in (0, 1]")
    if not (math.isfinite(args.time_scale) and args.time_scale >= 1e-3):
        p.error("--time-scale must be a finite number >= 0.001")
    if args.emulate:
        from common.device_model import get_profile

        try:
            get_profile(args.emulate)
        except (ValueError, OSError, TypeError) as e:
            p.error(f"--emulate: {e}")
    if args.nodes and args.agent_nice is not None:
        p.error("--agent-nice sets the priority of agents this bench starts, not of --nodes")


def add_fleet_parser(sub) -> argparse.ArgumentParser:
    """``racer bench fleet`` (the same as ``python -m bench.fleet``)."""
    p = sub.add_parser("fleet", help="A/B of the whole system on real node agents against static splits",
                       description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=lambda args: (check_args(p, args), cmd_fleet(args))[1])
    return p


def cmd_fleet(args) -> int:
    if runs_every_workload(args):
        res = run_workloads(args)
        if args.json:
            print(json.dumps(res))
        else:
            from bench.fleet_across import format_across

            for name, r in res["workloads"].items():
                print(f"== workload {name}")
                print(format_rows(r))
            print("== across the workloads")
            print(format_across(res["across"]))
        return 0
    res = run_fleet(args)
    if args.json:
        print(json.dumps(res))
    else:
        print(format_rows(res))
    return 0


def format_rows(res: dict) -> str:
    dev = res.get("device") or {}
    lines = [f"EMULATED devices ({dev['profile']}, {'calibrated' if dev['calibrated'] else 'uncalibrated'}): "
             f"every figure in modelled time (x{dev['time_scale']:g} wall)"] if dev.get("mode") == "emulated" else []
    lines += [f"capacity {res['capacity_rps']:g} req/s ({res['num_nodes']} nodes, static 0.5 + least_load, "
             f"steady P99 within {res['slo_ms']:g} ms); {res['rounds']} rounds; medians [min-max]"]
    for r in res["configs"]:
        p = r["p99_ms"] or {}
        lines.append(f"  load {r['load']:<5g} {r['name']:<28} P99 {p.get('median')} [{p.get('min')}-{p.get('max')}] ms"
                     f"  SLO {(r['slo_attainment'] or {}).get('median')}  share {(r['mean_share'] or {}).get('median')}"
                     f"  KV hit {(r['kv_hit_rate'] or {}).get('median')}"
                     f"  EMB hit {(r['emb_hit_rate'] or {}).get('median')}"
                     f"  multi-pass {(r['multi_pass_share'] or {}).get('median')}"
                     f"  node P99 {(r.get('node_p99_ms') or {}).get('median')} ms"
                     f"  cache stages {(r.get('cache_stage_share') or {}).get('median')} of node time"
                     f"  CPU ms/request gateway {(r.get('gateway_cpu_ms_per_request') or {}).get('median')}"
                     f" agents {(r.get('agents_cpu_ms_per_request') or {}).get('median')}")
        if r.get("tail_ms"):
            lines.append("      slowest 1%, mean ms: " + ", ".join(f"{k} {v:g}" for k, v in r["tail_ms"].items()))
    for name, v in res["findings"].get("verdicts", {}).items():
        for load, x in v["by_load"].items():
            if x is None:
                continue
            head = f"  {name} at load {load}" + (f" (target {v['target_pct']:g}%)" if v["target_pct"] is not None
                                                 else "")
            lines.append(f"{head}: {x['pct']:+g}% over {x['base']} [90%: {x['lo_pct']}, {x['hi_pct']}]"
                         + (f" {x['verdict']}" + (f" ({x['overruled']})" if x.get("overruled") else "")
                            + f"; the target's width needs {x['rounds_for_width']} rounds" if "verdict" in x else ""))
    lines.append("findings: " + json.dumps(res["findings"]))
    for k in ("plot", "verdict_plot"):
        if res.get(k):
            lines.append(f"{k.replace('_', ' ')}: {res[k]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    check_args(p, args)
    return cmd_fleet(args)


if __name__ == "__main__":
    sys.exit(main())
