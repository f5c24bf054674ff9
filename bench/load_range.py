"""Does a real node agent feed the policy the `load` the simulator trained it on?

    python -m bench.load_range --json [--duration 20] [--rate 40] [--train-data A.npz,B.npz]

`load` is the busy fraction of the control interval (`node_agent.features.WindowStats`). Prints
the range (min, p5, p50, p95, max) of every window's ``load``

- ``simulator``: the PPO training environment (`policies.env.AllocatorEnv` in the paper table's
  setting, `EnvConfig.like_table`, 4 nodes) on a Taobao trend episode of ``--sim-duration`` s,
  holding emb_share 0.5: every node's `WindowStats` (the policy's training inputs);
- ``training_data`` (with ``--train-data``): the ``load`` feature of the imitation samples the
  shipped policy was cloned from (`python -m policies.imitation` files);
- ``agent``: a real `NodeAgent` built as ``racer node-agent --trace taobao --policy
  policies/default`` builds it (engine on this machine's device, the shipped policy, miss costs
  measured at start), its device worker running, fed the Taobao trend stream
  (`workloads.generate`, ``regime="trend"``) in real time at ``--rate`` requests per second for
  ``--duration`` s; the load of each control step (``NodeAgent.recent_effects``), also logged by
  the agent (logger ``racer.node_agent``, INFO).

The agent's range depends on how fast this machine serves the model at ``--rate``: the check is
that it is a busy fraction on the simulator's scale (not ~0, as the old queue-depth definition
gave), not that the two ranges coincide.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_POLICY = Path(__file__).resolve().parent.parent / "policies" / "default"


def _range(xs) -> dict:
    xs = np.asarray(list(xs), dtype=np.float64)
    if not len(xs):
        return {"n": 0}
    q = np.percentile(xs, [0, 5, 50, 95, 100])
    return {"n": int(len(xs)), "min": round(float(q[0]), 4), "p5": round(float(q[1]), 4),
            "p50": round(float(q[2]), 4), "p95": round(float(q[3]), 4), "max": round(float(q[4]), 4)}


def simulator_loads(duration_s: float, seed: int) -> list[float]:
    from policies.env import AllocatorEnv, EnvConfig

    env = AllocatorEnv(EnvConfig.like_table(num_nodes=4, traces=("taobao",), regimes=("trend",),
                                            duration_s=duration_s, rate_spread=0.0))
    _, info = env.reset(seed=seed, options={"initial_share": 0.5})
    loads = [s.load for s in info["stats"]]
    while True:
        _, _, _, trunc, info = env.step(np.full(env.num_agents, 0.5))
        loads += [s.load for s in info["stats"]]
        if trunc:
            break
    env.close()
    return loads


def training_data_loads(paths: list[str]) -> list[float]:
    from node_agent.features import FEATURE_NAMES

    j = FEATURE_NAMES.index("load")
    out: list[float] = []
    for p in paths:
        with np.load(p, allow_pickle=False) as z:
            out += z["X"][:, j].astype(np.float64).tolist()
    return out


def agent_loads(duration_s: float, rate_rps: float, policy: str, seed: int, device: str) -> tuple[list[float], dict]:
    from node_agent.cli import add_node_parser, build_agent
    from workloads import generate, load_trace

    p = argparse.ArgumentParser()
    add_node_parser(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["node-agent", "--trace", "taobao", "--policy", policy, "--device", device,
                         "--max-history-len", "512", "--num-candidates", "128", "--num-pages", "2048"])
    agent = build_agent(args, announce=lambda m: print(f"agent: {m}", file=sys.stderr))
    trace = load_trace("taobao")
    stream = generate(trace, regime="trend", rate_rps=rate_rps, duration_s=duration_s, seed=seed,
                      max_history_len=448, num_candidates=128)  # history + new items within the engine's 512
    from node_agent.engine import RecRequest

    async def replay() -> dict:
        t0 = time.perf_counter()
        tasks = []
        for i in range(len(stream)):
            wait = float(stream.arrival_s[i]) - (time.perf_counter() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
            req = RecRequest(int(stream.user[i]), stream.history(i).tolist(), stream.new_items(i).tolist(),
                             num_candidates=128, top_k=10, arrival_s=agent.clock())
            tasks.append(asyncio.ensure_future(agent.submit(req)))
        res = await asyncio.gather(*tasks, return_exceptions=True)
        errors = sorted({f"{type(r).__name__}: {r}"[:120] for r in res if isinstance(r, BaseException)})
        return {"num_requests": len(stream), "num_failed": sum(isinstance(r, BaseException) for r in res),
                "errors": errors[:3], "wall_s": round(time.perf_counter() - t0, 2)}

    agent.start()
    try:
        info = asyncio.run(replay())
        time.sleep(agent.config.control_interval_s * 1.5)  # one more control step after the last request
    finally:
        agent.stop()
    effects = list(agent.recent_effects)
    loads = [e.stats.load for e in effects if e.stats.num_requests > 0]
    info.update({"control_steps": len(effects), "device": str(agent.engine.device),
                 "policy_loaded": agent.allocator is not None and agent.allocator.policy is not None,
                 "decision_sources": sorted({e.decision.source for e in effects if e.decision is not None})})
    return loads, info


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.load_range", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--duration", type=float, default=20.0, help="agent replay, seconds (default 20)")
    ap.add_argument("--rate", type=float, default=40.0, help="agent replay rate, requests/s (default 40)")
    ap.add_argument("--sim-duration", type=float, default=20.0, help="simulated episode, seconds (default 20)")
    ap.add_argument("--train-data", default=None, help="comma-separated imitation .npz files")
    ap.add_argument("--policy", default=str(DEFAULT_POLICY))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    out: dict = {"simulator": _range(simulator_loads(a.sim_duration, a.seed))}
    if a.train_data:
        out["training_data"] = _range(training_data_loads(a.train_data.split(",")))
    loads, info = agent_loads(a.duration, a.rate, a.policy, a.seed, a.device)
    out["agent"] = {**_range(loads), **info, "rate_rps": a.rate}
    print(json.dumps(out) if a.json else json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
