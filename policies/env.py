"""The PPO training environment: one step is one control interval of the cluster simulator.

Gymnasium-style (``reset(seed=None, options=None) -> (obs, info)``, ``step(action) -> (obs,
reward, terminated, truncated, info)``) without depending on gymnasium. The environment drives
`simulator.cluster.run_cluster`, the same generator `simulator.simulate` drives with an
allocator, so training sees exactly the nodes, router, memory managers and cost model the paper
table measures.

Multi-agent with one shared policy: every node of the simulated cluster is an agent.

- **observation** ``[num_nodes, NUM_FEATURES]`` float32: `node_agent.features.build_features` of
  each node's `WindowStats` for the interval that just ended, with that node's previous interval
  as ``prev`` (the two delta features; None on an episode's first observation);
- **action** ``[num_nodes]``: each node's target ``emb_share`` in [0, 1] (the actor's
  ``sigmoid(z')``, see `policies.actor`), clipped to the runtime's bounds (`GuardConfig`'s
  ``min_emb_share`` / ``max_emb_share``) before it reaches the memory manager. With
  ``step_limit=True`` the runtime's step limit applies too (``max_step_up`` / ``max_step_down``
  from the previous decision, `apply_guards`, the order of `SmartAllocator.decide`). It is off by
  default: the action is an absolute target, so the deployed policy reaches the same split
  through the guards, only more slowly; without the limit each action decides the split of its
  own interval, which gives PPO an immediate, larger and less ambiguous effect per action to
  learn from (with the limit most sampled targets are cut to the same +0.05 / -0.1 step);
- **reward** ``[num_nodes]`` float32: from `node_reward` of each node's `WindowStats` for the
  interval that ran under the action, shared as a team reward (see `RewardConfig` for the
  formula and why); only what the nodes report, so the same signal exists on a live cluster;
- **terminated** is always False (serving has no terminal state); **truncated** is True on the
  last step of an episode (the stream ends). PPO bootstraps the value of the final observation.

Episodes. ``reset`` draws, from the environment's seeded generator: a trace (`EnvConfig.traces`),
a regime (`EnvConfig.regimes`: steady / trend / burst), the stream's seed, the cluster's request
rate (log-uniform in ``rate_rps / (1 + rate_spread) .. rate_rps * (1 + rate_spread)``) and the
split every node starts from (uniform in ``initial_share_range``, applied at once at start-up, as a
static configuration would be), so the policy learns to move from any split. ``options`` fixes
any of these (``trace``, ``regime``, ``stream_seed``, ``rate_rps``, ``initial_share``), which the
evaluation uses. The first observation is the end of the first control interval; an episode of
``duration_s`` with interval ``control_interval_s`` has ``windows - 2`` steps (``windows =
ceil(duration / interval)``): the last interval's outcome is never reported by the simulator,
so the last window runs under the held split and its figures go only to ``info["episode"]``.

Settings. `EnvConfig.like_table` takes the paper table's setting (`simulator.table.TableConfig`)
to a smaller cluster at the same per-node load; that is what `policies.train_ppo` trains on, so a
retrained policy follows the table's calibration. `EnvConfig`'s own defaults are a lighter
setting for tests and quick experiments. `EnvConfig.settings` lists several settings (`EnvSetting`:
a sample calibration, e.g. `bench.oracle_gap`'s grid from `calibration_settings`, or the
paper-scale setting, built by the paper table's own functions) and ``reset`` draws one per
episode (``options["setting"]`` fixes it; ``info`` names it), so one policy trains across them. Cost: the simulator serves roughly 2-15k requests per
wall second on one core (fewer with long histories), so a 20-s episode of 4 nodes at the table's
per-node load takes a few seconds. Every episode runs with the caches' ghost lists on
(`DEFAULT_GHOST_PROBES`, as the node agent runs by default): feature schema 3 reads the marginal
utilities they measure. Nothing reads the clock.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from common.config import ranged
from common.config import validate as validate_fields
from node_agent.allocator import GuardConfig, guard_stage

from node_agent.features import NUM_FEATURES, P99_OVER_SLO_MAX, WindowStats, build_features, miss_costs_us
from node_agent.memory import DEFAULT_GHOST_PROBES

TRACE_NAMES = ("taobao", "amazon", "synthetic")
P99_FLOOR = 0.1  # p99 / slo below this counts as this in the reward's log


@dataclass(frozen=True)
class RewardConfig:
    """The per-node reward of one control interval (the interval that ran under the action).

    With ``x = p99_ms / slo_ms``, ``lx = ln(max(x, 0.1))``, ``m = (kv_miss_us + emb_miss_us) /
    (1000 * slo_ms)`` (the expected miss time per request, `miss_costs_us`, as a fraction of the
    SLO, clipped at 4) and ``f = refill_bytes / arena_bytes``:

        reward = -( w_p99 * lx                    dense: the tail latency, on a log scale
                    + w_over * max(0, lx)         steeper once over the SLO
                    + w_slo_miss * [x > 1]        an SLO miss (the interval's P99 broke the SLO)
                    + w_miss_time * m             dense: time the split costs each request
                    + w_refill * min(f, 1) )      background refill traffic (PCIe) it caused

    An interval in which the node finished no request has no latency evidence: its P99 terms and
    ``m`` are 0. **Log scale**: the paper table compares P99s as ratios (24% below the best static
    split), and a log makes a 10% lower P99 worth the same (0.095 * w_p99) at 10 ms as at 300 ms,
    so neither a lightly loaded regime nor an overloaded one drowns the other's signal (with a
    linear ``x`` an overloaded trend episode's P99 of 25x the SLO outweighed everything else; with
    ``x`` clipped, as a first version did, overload gave no signal at all). ``lx`` is dense (P99
    moves with every split change, also far below the SLO); ``m`` is the nodes' own mean miss
    time per request: unlike P99 it does not depend on the slowest batch of the interval, so it
    ranks splits with far less noise. The log-hinge and the miss indicator fire only when the SLO
    breaks. Refill is charged because growing the EMB slab copies rows over the host link, the traffic the paper
    keeps off the critical path. Its weight is small on purpose: with ``w_refill = 0.05`` a refill
    of the whole arena costs what a 5% higher P99 costs, so one guard step of growth (0.05 of the
    arena, ``f = 0.05``) costs 0.0025, less than the latency it buys over a few intervals when more
    EMB helps; the charge discourages churn without forbidding growth (at
    ``w_refill = 1`` a first training run learnt to shrink the slab whatever the workload).

    **Team reward.** What a node receives is ``team_weight * team + (1 - team_weight) * own``,
    where ``own`` is the formula above on the node's own `WindowStats` and ``team`` is the
    request-weighted mean of every node's ``own`` (the plain mean when no node served a request).
    The default ``team_weight = 1`` gives every node the cluster's figure, because a node's own
    figure is confounded by the router: the EMB-KV-aware router sends a node with a larger EMB
    slab the requests whose embeddings it holds, so the node's own load and P99 rise while the
    cluster's fall (measured on 8 nodes, half at emb_share 0.9 and half at 0.2: the 0.9 nodes
    served 37% more requests and their own P99 was no better, on the Amazon trace worse, although
    the all-0.9 cluster beats the all-0.2 one by 12% in P99). The paper's objective, the
    cluster's P99 and SLO, is a team objective; every node runs the same policy.
    """

    w_p99: float = ranged(1.0, lo=0)
    w_over: float = ranged(1.0, lo=0)
    w_slo_miss: float = ranged(0.5, lo=0)
    w_miss_time: float = ranged(1.0, lo=0)
    w_refill: float = ranged(0.05, lo=0)
    team_weight: float = ranged(1.0, lo=0, hi=1)

    def validate(self) -> "RewardConfig":
        validate_fields(self)
        return self


def node_reward(stats: WindowStats, cfg: RewardConfig) -> tuple[float, dict[str, float]]:
    """The reward of one node's interval (see `RewardConfig`) and its terms (before the weights)."""
    f = min(stats.refill_bytes / stats.arena_bytes, 1.0)
    if stats.num_requests > 0:
        x = stats.p99_ms / stats.slo_ms
        lx = math.log(max(x, P99_FLOOR))
        kv_us, emb_us = miss_costs_us(stats)
        m = min((kv_us + emb_us) / (1000.0 * stats.slo_ms), P99_OVER_SLO_MAX)
    else:  # no latency evidence
        x = lx = m = 0.0
    over = max(0.0, lx)
    miss = 1.0 if x > 1.0 else 0.0
    cost = cfg.w_p99 * lx + cfg.w_over * over + cfg.w_slo_miss * miss + cfg.w_miss_time * m + cfg.w_refill * f
    return -cost, {"p99_over_slo": x, "log_p99_over_slo": lx, "log_over_slo": over, "slo_miss": miss,
                   "miss_time_over_slo": m, "refill_fraction": f}


def team_rewards(own: np.ndarray, num_requests: np.ndarray, team_weight: float) -> np.ndarray:
    """Each node's reward: ``team_weight * team + (1 - team_weight) * own`` with ``team`` the
    request-weighted mean of ``own`` (the plain mean when no node served a request)."""
    total = float(num_requests.sum())
    team = float(own @ num_requests) / total if total > 0 else float(own.mean())
    return team_weight * team + (1.0 - team_weight) * own


def apply_guards(targets: np.ndarray, prev: np.ndarray, guard: GuardConfig, *, step_limit: bool = True) -> np.ndarray:
    """The runtime's guard stage (`node_agent.allocator.guard_stage`, the function
    `SmartAllocator.decide` calls) on a vector of proposals: step limit from ``prev`` (the
    previous decisions; skipped with ``step_limit=False``), then the bounds."""
    return np.array([guard_stage(float(t), float(p), guard, step_limit=step_limit)[0]
                     for t, p in zip(np.asarray(targets, dtype=np.float64).reshape(-1),
                                     np.asarray(prev, dtype=np.float64).reshape(-1))])


SETTING_KINDS = ("sample", "paper-scale")
PAPER_SCALE_DEFAULT = 1 / 384  # the scale model of `bench.regret --quick` and `TableConfig.paper(quick=True)`
PAPER_TRACE_SEED = 1_000  # the paper-scale setting's trace seed: not one of the table's / regret's seeds 0-2
# The calibration grid, defined here once: `bench.oracle_gap`'s defaults (8 nodes, 1,000 req/s,
# 5,000 users, histories x10; KV bytes per token 6 / 24 / 96 KiB; cache fractions 0.25 / 1 / 4)
# and `calibration_settings` (the same load per node)
CALIBRATION_KV_KIB = (6.0, 24.0, 96.0)
CALIBRATION_CACHE_FRACTIONS = (0.25, 1.0, 4.0)
CALIBRATION_NODES, CALIBRATION_RATE_RPS, CALIBRATION_USERS = 8, 1_000.0, 5_000
CALIBRATION_RATE_RPS_PER_NODE = CALIBRATION_RATE_RPS / CALIBRATION_NODES
CALIBRATION_USERS_PER_NODE = CALIBRATION_USERS // CALIBRATION_NODES
CALIBRATION_HISTORY_SCALE = 10.0


@dataclass(frozen=True)
class EnvSetting:
    """One setting an episode can be drawn in: a cluster calibration and a workload size.

    ``setting="sample"``: the sample traces as `EnvConfig` runs them; every field left ``None``
    takes the `EnvConfig`'s own value: ``cache_fraction`` (arena = this x the trace's embedding
    table), ``history_scale``, ``rate_rps_per_node`` and ``users_per_node`` (x ``num_nodes``: the
    cluster's rate, the centre of the drawn range, and its users), ``kv_kib`` (the profile's K/V
    bytes per token in KiB, the model's size, as `bench.oracle_gap --kv-kib` varies it; None: the
    profile's own).

    ``setting="paper-scale"``: `simulator.profiles.PaperScale` at ``paper_scale``, built exactly as
    the paper table builds it (`simulator.table.TableConfig.paper` on the environment's nodes;
    the trace by `simulator.table.setting_trace`, the arena, byte sizes and profile by
    `simulator.table.sim_config`): users and rate per node from `PaperScale`, histories as built
    (``history_scale`` 1); the five sample fields must stay None. The trace is built once per
    setting from ``trace_seed`` (default 1,000, so the paper table's and `bench.regret`'s traces,
    seeds 0-2, are held out); each episode's stream seed draws the requests.

    ``traces``: the traces this setting draws from (None: `EnvConfig.traces`).
    """

    setting: str = "sample"
    cache_fraction: float | None = None
    history_scale: float | None = None
    rate_rps_per_node: float | None = None
    users_per_node: int | None = None
    kv_kib: float | None = None
    paper_scale: float = PAPER_SCALE_DEFAULT
    trace_seed: int = PAPER_TRACE_SEED
    traces: tuple[str, ...] | None = None

    _SAMPLE_FIELDS = ("cache_fraction", "history_scale", "rate_rps_per_node", "users_per_node", "kv_kib")

    @property
    def name(self) -> str:
        """A short label: ``sample`` with the fields it sets (``sample[cf=0.25,kv=6KiB]``) or
        ``paper-scale/384``."""
        if self.setting == "paper-scale":
            return f"paper-scale/{1 / self.paper_scale:g}"
        short = {"cache_fraction": "cf", "history_scale": "hs", "rate_rps_per_node": "rps/node",
                 "users_per_node": "users/node", "kv_kib": "kv"}
        parts = [f"{short[k]}={getattr(self, k):g}" + ("KiB" if k == "kv_kib" else "")
                 for k in self._SAMPLE_FIELDS if getattr(self, k) is not None]
        return "sample" + (f"[{','.join(parts)}]" if parts else "")

    def problems(self, profile: str = "a100-hstu") -> list[str]:
        """What is wrong with this setting (empty: nothing), each naming the field."""
        p = []
        label = f"setting {self.name!r}" if self.setting in SETTING_KINDS else f"setting {self.setting!r}"
        if self.setting not in SETTING_KINDS:
            return [f"{label}: setting must be one of {SETTING_KINDS}"]
        if self.traces is not None and (not self.traces or any(t not in TRACE_NAMES for t in self.traces)):
            p.append(f"{label}: traces must be None or a non-empty subset of {TRACE_NAMES}, got {self.traces!r}")
        if self.setting == "paper-scale":
            given = [k for k in self._SAMPLE_FIELDS if getattr(self, k) is not None]
            if given:
                p.append(f"{label}: {', '.join(given)} must be None (paper-scale takes its users, rate, histories "
                         f"and arena from simulator.profiles.PaperScale)")
            if self.traces is not None and "synthetic" in self.traces:
                p.append(f"{label}: traces must be taobao or amazon (paper-scale is built from a sample's sequences)")
            if not (isinstance(self.trace_seed, int) and self.trace_seed >= 0):
                p.append(f"{label}: trace_seed must be an integer >= 0, got {self.trace_seed!r}")
            try:
                from simulator.profiles import PaperScale, get_profile

                PaperScale(scale=float(self.paper_scale)).validate(get_profile(profile))
            except (ValueError, TypeError, ZeroDivisionError) as e:
                p.append(f"{label}: paper_scale: {e}")
            return p
        for k in ("cache_fraction", "history_scale", "rate_rps_per_node", "kv_kib"):
            v = getattr(self, k)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v) and v > 0):
                p.append(f"{label}: {k} must be None or a positive number, got {v!r}")
        if self.users_per_node is not None and not (isinstance(self.users_per_node, int) and self.users_per_node >= 1):
            p.append(f"{label}: users_per_node must be None or an integer >= 1, got {self.users_per_node!r}")
        if self.kv_kib is not None and not p:
            b = self.kv_kib * 1024
            if b != int(b) or int(b) % 8:
                p.append(f"{label}: kv_kib must be a whole number of bytes, a multiple of 8, got {self.kv_kib!r}")
        return p


def calibration_settings() -> tuple[EnvSetting, ...]:
    """`bench.oracle_gap`'s calibration grid as settings: K/V bytes per token x cache fraction at
    its per-node load (125 req/s, 625 users per node, histories x10)."""
    return tuple(EnvSetting(cache_fraction=cf, history_scale=CALIBRATION_HISTORY_SCALE,
                            rate_rps_per_node=CALIBRATION_RATE_RPS_PER_NODE,
                            users_per_node=CALIBRATION_USERS_PER_NODE, kv_kib=kv)
                 for kv in CALIBRATION_KV_KIB for cf in CALIBRATION_CACHE_FRACTIONS)


def parse_settings(text: str) -> tuple[EnvSetting, ...]:
    """Settings from a ``+``-separated spec: ``table`` (the `EnvConfig`'s own setting, as with no
    settings), ``calibration`` (`calibration_settings`, 9), ``paper-scale`` (Taobao at scale
    1/384) or ``paper-scale/N`` (scale 1/N). E.g. ``calibration+paper-scale``."""
    out: list[EnvSetting] = []
    parts = [x.strip() for x in str(text).split("+")]
    if not parts or any(not x for x in parts):
        raise ValueError(f"settings: want names joined by '+' (table, calibration, paper-scale[/N]), got {text!r}")
    for x in parts:
        if x == "table":
            out.append(EnvSetting())
        elif x == "calibration":
            out.extend(calibration_settings())
        elif x == "paper-scale" or x.startswith("paper-scale/"):
            denom = x.partition("/")[2]
            try:
                scale = 1 / float(denom) if denom else PAPER_SCALE_DEFAULT
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"settings: {x!r}: want paper-scale/N with N a number such as 192 or 384") from None
            out.append(EnvSetting(setting="paper-scale", paper_scale=scale, traces=("taobao",)))
        else:
            raise ValueError(f"settings: unknown setting {x!r}; use table, calibration, paper-scale or paper-scale/N "
                             f"joined by '+'")
    return tuple(out)


@dataclass(frozen=True)
class EnvConfig:
    """What an episode looks like (see the module docstring for how each episode is drawn).

    Cluster: ``num_nodes``, ``cache_fraction`` (cache bytes per node as a fraction of the trace's
    embedding table), ``slo_ms``, ``control_interval_s``, ``profile`` (a cost profile name or a
    ``racer node profile`` JSON file, `simulator.profiles.get_profile`). Workload: ``traces`` (``taobao``,
    ``amazon``: the samples under ../shared/data; ``synthetic``: `workloads.synthetic_trace`, for
    tests), ``regimes``, ``rate_rps`` (cluster-wide) with ``rate_spread``, ``duration_s``,
    ``num_users``, ``history_scale``. Start: ``initial_share_range``. ``guard``: the runtime's
    guards; ``reward``: `RewardConfig`.

    ``settings``: the settings an episode is drawn from (`EnvSetting`; uniformly, one per episode;
    ``reset(options={"setting": k})`` fixes one by index or name). Empty (the default): one
    setting, the fields above, and the episodes are drawn exactly as before settings existed (no
    extra draw). ``num_nodes``, ``slo_ms``, ``control_interval_s``, ``profile``, ``duration_s``,
    ``rate_spread``, the regimes, guards and reward are shared by every setting.
    """

    traces: tuple[str, ...] = ranged(("taobao", "amazon"), choices=TRACE_NAMES, length=(1, None))
    regimes: tuple[str, ...] = ("steady", "trend", "burst")
    num_nodes: int = ranged(4, lo=1, integer=True)
    rate_rps: float = ranged(1_500.0, lo=0, lo_open=True)
    rate_spread: float = ranged(0.5, lo=0)
    duration_s: float = ranged(20.0, lo=0, lo_open=True)
    num_users: int = ranged(12_500, lo=1, integer=True)
    history_scale: float = ranged(1.0, lo=0, lo_open=True)
    cache_fraction: float = ranged(0.5, lo=0, lo_open=True)
    slo_ms: float = ranged(30.0, lo=0, lo_open=True)
    control_interval_s: float = ranged(1.0, lo=0, lo_open=True)
    profile: str = "a100-hstu"
    initial_share_range: tuple[float, float] = ranged((0.2, 0.8), lo=0, hi=1, length=(2, 2))
    step_limit: bool = False
    guard: GuardConfig = field(default_factory=GuardConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    settings: tuple[EnvSetting, ...] = ()

    def setting_list(self) -> tuple[EnvSetting, ...]:
        """The settings episodes are drawn from: ``settings``, or the one implicit setting."""
        return tuple(self.settings) or (EnvSetting(),)

    def setting_traces(self, setting: EnvSetting) -> tuple[str, ...]:
        return tuple(setting.traces) if setting.traces is not None else tuple(self.traces)

    def setting_index(self, key) -> int:
        """A setting by index or `EnvSetting.name` (``reset``'s ``setting`` option)."""
        settings = self.setting_list()
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            if 0 <= int(key) < len(settings):
                return int(key)
            raise ValueError(f"setting {key} out of range: this environment has {len(settings)} setting(s), "
                             f"0..{len(settings) - 1}")
        names = [x.name for x in settings]
        if isinstance(key, str) and names.count(key) == 1:
            return names.index(key)
        raise ValueError(f"unknown setting {key!r}: use an index 0..{len(settings) - 1} or one of {names}")

    def validate(self) -> "EnvConfig":
        from workloads.regimes import REGIMES

        validate_fields(self)
        p = []
        if not self.regimes or any(r not in REGIMES for r in self.regimes):
            p.append(f"regimes must be a non-empty subset of {REGIMES}, got {self.regimes!r}")
        lo, hi = self.initial_share_range
        if lo > hi:
            p.append(f"initial_share_range must satisfy lo <= hi, got {self.initial_share_range!r}")
        if self.duration_s < 3 * self.control_interval_s:
            p.append("duration_s must cover at least 3 control intervals (one step)")
        if not isinstance(self.settings, tuple) or any(not isinstance(x, EnvSetting) for x in self.settings):
            p.append(f"settings must be a tuple of EnvSetting, got {self.settings!r}")
        else:
            for x in self.settings:
                p.extend(x.problems(self.profile))
                if x.setting == "paper-scale" and x.traces is None and "synthetic" in self.traces:
                    p.append(f"setting {x.name!r}: traces must be taobao or amazon (paper-scale is built from a "
                             f"sample's sequences); set its traces")
            names = [x.name for x in self.settings]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                p.append(f"settings must differ, got {dup} more than once")
        if p:
            raise ValueError("invalid EnvConfig: " + "; ".join(p))
        self.reward.validate()
        return self

    @classmethod
    def like_table(cls, table=None, num_nodes: int = 4, **overrides) -> "EnvConfig":
        """The paper table's setting (`simulator.table.TableConfig`, default: its defaults) on a
        smaller cluster: the same per-node load (``rate_rps`` and ``num_users`` scaled by
        ``num_nodes / table.num_nodes``) and the same ``history_scale``, ``cache_fraction``,
        ``slo_ms``, ``profile``, traces and regimes; ``overrides`` replace any field."""
        from simulator.table import TableConfig

        t = table or TableConfig()
        scale = num_nodes / t.num_nodes
        kw = dict(traces=("taobao", "amazon"), regimes=tuple(t.regimes), num_nodes=num_nodes,
                  rate_rps=t.rate_rps * scale, num_users=max(1, int(round(t.num_users * scale))),
                  history_scale=t.history_scale, cache_fraction=t.cache_fraction, slo_ms=t.slo_ms,
                  profile=t.profile)
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["traces"], d["regimes"] = list(self.traces), list(self.regimes)
        d["initial_share_range"] = list(self.initial_share_range)
        d["settings"] = [{"name": x.name, **{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(x).items()}}
                         for x in self.settings]
        return d


def load_env_trace(name: str):
    """The trace an episode replays: the bundled sample, or a small synthetic one for tests."""
    from workloads import load_trace, synthetic_trace

    if name == "synthetic":
        return synthetic_trace(num_users=400, num_items=4_000, mean_seq_len=80.0, seed=0)
    return load_trace(name)


class AllocatorEnv:
    """One simulated cluster; see the module docstring. ``num_agents`` = ``config.num_nodes``."""

    def __init__(self, config: EnvConfig | None = None):
        self.config = (config or EnvConfig()).validate()
        self.num_agents = self.config.num_nodes
        self.observation_shape = (self.num_agents, NUM_FEATURES)
        self.action_shape = (self.num_agents,)
        from simulator.profiles import get_profile

        self._profile = get_profile(self.config.profile)
        self._traces: dict = {}
        self._rng = np.random.default_rng(0)
        self._run = None
        self._prev_stats: list[WindowStats | None] = [None] * self.num_agents
        self._targets = np.zeros(self.num_agents)
        self._obs = np.zeros(self.observation_shape, dtype=np.float32)
        self._steps_left = 0
        self._episode: dict = {}

    # ------------------------------------------------------------------ episode set-up
    def _trace(self, name: str):
        if name not in self._traces:
            self._traces[name] = load_env_trace(name)
        return self._traces[name]

    def _sim_config(self, seed: int, setting: EnvSetting | None = None, trace_name: str = "taobao"):
        from simulator.cluster import SimConfig

        c = self.config
        st = setting or EnvSetting()
        if st.setting == "paper-scale":
            from simulator.table import sim_config

            scfg = sim_config(self.table_config(st, trace_name, seed))
            if scfg.control_interval_s != c.control_interval_s:
                scfg = replace(scfg, control_interval_s=c.control_interval_s)
            return replace(scfg, ghost_probes=DEFAULT_GHOST_PROBES)
        profile = self._profile
        if st.kv_kib is not None:  # the model's size, as `bench.oracle_gap --kv-kib` sets it
            profile = replace(profile, kv_bytes_per_token=int(st.kv_kib * 1024)).validate()
        cf = st.cache_fraction if st.cache_fraction is not None else c.cache_fraction
        return SimConfig(num_nodes=c.num_nodes, profile=profile, cache_fraction=cf,
                         slo_ms=c.slo_ms, control_interval_s=c.control_interval_s, seed=seed,
                         ghost_probes=DEFAULT_GHOST_PROBES)

    def table_config(self, setting: EnvSetting, trace_name: str, seed: int, rate_rps: float | None = None):
        """The paper table's `TableConfig` of a paper-scale ``setting`` on this environment's
        nodes (`TableConfig.paper`, with the environment's profile, SLO and episode length;
        ``seed`` and ``rate_rps`` as given, default the setting's rate): `simulator.table.sim_config`
        of it is an episode's `SimConfig` (with ``seed`` = the stream seed), and
        `simulator.table.setting_trace` of it with ``seed = setting.trace_seed`` its trace."""
        from simulator.table import TableConfig

        c = self.config
        kw = {} if rate_rps is None else {"rate_rps": float(rate_rps)}
        return TableConfig.paper(num_nodes=c.num_nodes, paper_scale=setting.paper_scale, trace=trace_name,
                                 seed=int(seed), profile=c.profile, slo_ms=c.slo_ms, duration_s=c.duration_s, **kw)

    def setting_load(self, setting: EnvSetting) -> tuple[float, int, float]:
        """``(rate_rps, num_users, history_scale)`` of a setting on this cluster: ``rate_rps`` is
        the centre of the drawn range."""
        c = self.config
        if setting.setting == "paper-scale":
            from simulator.profiles import PaperScale

            ps = PaperScale(scale=setting.paper_scale)
            return ps.rate_rps_per_node * c.num_nodes, ps.users_per_node * c.num_nodes, 1.0
        rate = c.rate_rps if setting.rate_rps_per_node is None else setting.rate_rps_per_node * c.num_nodes
        users = c.num_users if setting.users_per_node is None else setting.users_per_node * c.num_nodes
        hs = c.history_scale if setting.history_scale is None else setting.history_scale
        return float(rate), int(users), float(hs)

    def _setting_trace(self, setting: EnvSetting, trace_name: str):
        if setting.setting == "paper-scale":
            from simulator.table import setting_trace

            return setting_trace(self.table_config(setting, trace_name, setting.trace_seed))
        return self._trace(trace_name)

    def _num_windows(self, sim_cfg, duration_s: float) -> int:
        """Control windows of a run, counted as `run_cluster` counts them (it yields after each but
        the last)."""
        slice_s = sim_cfg.batch_window_ms / 1e3
        num_slices = int(math.ceil(duration_s / slice_s))
        per_window = max(1, int(round(sim_cfg.control_interval_s / slice_s)))
        return int(math.ceil(num_slices / per_window))

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        """Start an episode; ``seed`` reseeds the environment's generator (as gymnasium's reset)."""
        from simulator.cluster import run_cluster

        self.close()
        stream, sim_cfg, meta = self.draw_episode(seed, options)
        share = meta["initial_share"]
        self._steps_left = self._num_windows(sim_cfg, stream.config.duration_s) - 2
        if self._steps_left < 1:
            raise ValueError("the episode is too short for one step")
        self._run = run_cluster(stream, sim_cfg, "racer", initial_share=share, name="ppo-env")
        now_s, stats = next(self._run)
        self._prev_stats = [None] * self.num_agents
        self._targets = np.full(self.num_agents, share)
        self._obs = self._observe(stats)
        self._episode = {**meta, "bursts": [list(b) for b in stream.bursts], "num_requests": len(stream),
                         "steps": 0, "return": 0.0, "share_sum": 0.0}
        info = {"now_s": now_s, "stats": stats, **meta}
        return self._obs.copy(), info

    def draw_episode(self, seed: int | None = None, options: dict | None = None):
        """Draw an episode as `reset` does (same generator, same draws) without starting it:
        ``(stream, SimConfig, {"trace", "regime", "stream_seed", "rate_rps", "initial_share",
        "setting", "setting_name"})`` (``setting``: the index in `EnvConfig.setting_list`). The
        imitation warm start (`policies.imitation`) replays the oracle on such episodes.

        With several settings the setting is drawn first (one more draw; none with the default
        single setting, so its episodes are those drawn before settings existed), then the trace
        from that setting's traces (fixed by ``options["setting"]`` if given) and the rate around
        that setting's rate."""
        from workloads import generate

        if seed is not None:
            self._rng = np.random.default_rng(int(seed))
        c = self.config
        o = dict(options or {})
        rng = self._rng
        settings = c.setting_list()
        # draw everything first (a fixed number of draws per episode), then apply the options
        k = int(rng.integers(len(settings))) if c.settings else 0
        if "setting" in o:
            k = c.setting_index(o.pop("setting"))
        setting = settings[k]
        traces = c.setting_traces(setting)
        center_rate, num_users, history_scale = self.setting_load(setting)
        trace_name = traces[int(rng.integers(len(traces)))]
        regime = c.regimes[int(rng.integers(len(c.regimes)))]
        stream_seed = int(rng.integers(2**31 - 1))
        lo_r, hi_r = center_rate / (1 + c.rate_spread), center_rate * (1 + c.rate_spread)
        rate = float(math.exp(rng.uniform(math.log(lo_r), math.log(hi_r))))
        share = float(rng.uniform(*c.initial_share_range))
        trace_name = o.pop("trace", trace_name)
        if setting.setting == "paper-scale" and trace_name not in ("taobao", "amazon"):
            raise ValueError(f"setting {setting.name!r} needs the taobao or amazon trace, got {trace_name!r}")
        regime = o.pop("regime", regime)
        stream_seed = int(o.pop("stream_seed", stream_seed))
        rate = float(o.pop("rate_rps", rate))
        share = float(o.pop("initial_share", share))
        if o:
            raise ValueError(f"unknown reset options {sorted(o)}")
        if not c.guard.min_emb_share <= share <= c.guard.max_emb_share:
            raise ValueError(f"initial_share {share} outside the guard bounds")
        stream = generate(self._setting_trace(setting, trace_name), regime=regime, rate_rps=rate,
                          duration_s=c.duration_s, num_users=num_users, history_scale=history_scale, seed=stream_seed)
        meta = {"trace": trace_name, "regime": regime, "stream_seed": stream_seed, "rate_rps": rate,
                "initial_share": share, "setting": k, "setting_name": setting.name}
        return stream, self._sim_config(stream_seed, setting, trace_name), meta

    def _observe(self, stats: list[WindowStats]) -> np.ndarray:
        obs = np.empty(self.observation_shape, dtype=np.float32)
        for i, st in enumerate(stats):
            build_features(st, self._prev_stats[i], out=obs[i])
            self._prev_stats[i] = st
        return obs

    # ------------------------------------------------------------------ one control interval
    def step(self, action) -> tuple[np.ndarray, np.ndarray, bool, bool, dict]:
        if self._run is None:
            raise RuntimeError("call reset() before step()")
        a = np.asarray(action, dtype=np.float64).reshape(-1)
        if a.shape != self.action_shape or not np.all(np.isfinite(a)) or np.any((a < 0) | (a > 1)):
            raise ValueError(f"action must be {self.num_agents} finite emb_shares in [0, 1], got {action!r}")
        g = self.config.guard
        targets = apply_guards(a, self._targets, g, step_limit=self.config.step_limit)
        try:
            now_s, stats = self._run.send(targets.tolist())
        except StopIteration:  # cannot happen when the window count above matches the simulator's
            raise RuntimeError("the simulator ended before the episode's last step") from None
        self._targets = targets
        self._obs = self._observe(stats)
        own = np.empty(self.num_agents)
        terms: dict[str, np.ndarray] = {}
        for i, st in enumerate(stats):
            r, t = node_reward(st, self.config.reward)
            own[i] = r
            for k, v in t.items():
                terms.setdefault(k, np.empty(self.num_agents))[i] = v
        rewards = team_rewards(own, np.array([st.num_requests for st in stats], dtype=np.float64),
                               self.config.reward.team_weight).astype(np.float32)
        terms["own_reward"] = own
        self._steps_left -= 1
        ep = self._episode
        ep["steps"] += 1
        ep["return"] += float(rewards.mean())
        ep["share_sum"] += float(targets.mean())
        truncated = self._steps_left <= 0
        info = {"now_s": now_s, "stats": stats, "targets": targets, "reward_terms": terms,
                "regime": ep["regime"], "trace": ep["trace"], "setting": ep["setting"],
                "setting_name": ep["setting_name"]}
        if truncated:
            info["episode"] = self._finish()
        return self._obs.copy(), rewards, False, truncated, info

    def _finish(self) -> dict:
        """Run the last window under the held split and summarise the episode."""
        ep = dict(self._episode)
        try:
            self._run.send(self._targets.tolist())
            raise RuntimeError("the simulator yielded past the episode's last step")
        except StopIteration as stop:
            result = stop.value
        self._run = None
        summary = result.summary()
        ep.pop("share_sum")
        ep.update({"mean_reward": ep["return"] / max(1, ep["steps"]),
                   "mean_target_share": self._episode["share_sum"] / max(1, ep["steps"]),
                   "p99_ms": summary["p99_ms"], "p50_ms": summary["p50_ms"],
                   "slo_attainment": summary["slo_attainment"], "mean_share": summary["mean_share"],
                   "emb_hit_rate": summary["emb_hit_rate"], "kv_hit_rate": summary["kv_hit_rate"],
                   "refill_bytes": summary["refill_bytes"]})
        return ep

    def close(self) -> None:
        if self._run is not None:
            self._run.close()
            self._run = None
