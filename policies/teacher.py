"""Teacher labels for the imitation warm start: a policy artifact's shares as ``--bc-data``.

When the feature schema changes but a feature keeps its meaning on one side (schema 1 -> 2: the
simulator, and so the training, always fed `load` as the busy fraction; only the node agent fed
queue depth), an older policy can still teach a new one on states of the new schema. This module
writes the same ``.npz`` files as `policies.imitation` (``X``, ``y``, ``episode``, ``episodes``,
``wall_s``) with ``y`` = the teacher artifact's share for each state instead of the oracle's:

- ``--states FILE.npz``: relabel the states of an existing collection (e.g. the oracle episodes
  of `python -m policies.imitation`);
- ``--episodes N``: run the paper table's setting (`EnvConfig.like_table`, ``--nodes`` nodes) with
  the teacher choosing every node's split, and keep the states it visits (on-policy for the
  teacher; no oracle forks, so an episode costs a plain simulation).

A teacher with fewer inputs than this schema (schema 1 or 2: 16 features; schema 3 appends six)
reads the first ones. The teacher is read with onnxruntime directly, without the runtime's schema check (that check is
for serving; here the schema gap is the point, and the output records the teacher's id and
schema in ``episodes``)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from node_agent.features import FEATURE_NAMES, NUM_FEATURES


def _teacher(artifact_dir):
    import onnxruntime as ort

    d = Path(artifact_dir)
    manifest = json.loads((d / "manifest.json").read_text())
    k = manifest.get("actor_config", {}).get("num_features")
    if not (isinstance(k, int) and 1 <= k <= NUM_FEATURES):
        raise ValueError(f"{d}: teacher takes {k} features, this schema has {NUM_FEATURES}")
    if list(manifest.get("feature_names", [])) != list(FEATURE_NAMES[:k]):
        raise ValueError(f"{d}: the teacher's feature names are not this schema's first {k}")
    sess = ort.InferenceSession(str(d / manifest["onnx_file"]), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name

    def share(X: np.ndarray) -> np.ndarray:
        # a teacher of an older schema reads the features it knows: later schemas append theirs
        return sess.run(None, {name: np.ascontiguousarray(X[:, :k], dtype=np.float32)})[0].reshape(-1).astype(np.float32)

    label = f"teacher {manifest['policy_id']} (feature schema {manifest['feature_schema_version']})"
    return share, label


def relabel(states_path, artifact_dir) -> dict:
    """The states of an imitation ``.npz`` with the teacher's shares as labels."""
    share, label = _teacher(artifact_dir)
    with np.load(states_path) as z:
        X, ep, meta, wall = z["X"].astype(np.float32), z["episode"], json.loads(str(z["episodes"])), float(z["wall_s"])
    return {"X": X, "y": share(X), "episode": ep, "wall_s": wall,
            "episodes": [{**m, "labels": label} for m in meta]}


def rollout(artifact_dir, episodes: int, config, *, seed: int = 21_000) -> dict:
    """States of ``episodes`` episodes of ``config`` (an `EnvConfig`) where the teacher picks every
    node's split (episode ``e`` is `AllocatorEnv.reset` with seed ``seed + e``)."""
    from .env import AllocatorEnv

    share, label = _teacher(artifact_dir)
    env = AllocatorEnv(config.validate())
    xs, ys, eps, meta = [], [], [], []
    t0 = time.perf_counter()
    for e in range(episodes):
        obs, info = env.reset(seed=seed + e)
        done = False
        while not done:
            a = share(obs)
            xs.append(obs.astype(np.float32))
            ys.append(a)
            eps.append(np.full(len(a), e, dtype=np.int64))
            obs, _, term, trunc, _ = env.step(a.astype(np.float64))
            done = term or trunc
        meta.append({"seed": seed + e, "labels": label, "states": "teacher's own rollout",
                     **{k: v for k, v in info.items() if isinstance(v, (str, int, float))}})
    return {"X": np.concatenate(xs), "y": np.concatenate(ys), "episode": np.concatenate(eps), "episodes": meta,
            "wall_s": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    """``python -m policies.teacher --teacher DIR (--states FILE.npz | --episodes N) --out FILE.npz``"""
    import argparse

    import torch

    from .imitation import save_oracle_data

    ap = argparse.ArgumentParser(prog="python -m policies.teacher", description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", required=True, help="policy artifact directory whose shares are the labels")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--states", help="imitation .npz whose states to relabel")
    src.add_argument("--episodes", type=int, help="episodes to roll out with the teacher")
    ap.add_argument("--out", required=True)
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--rate-spread", type=float, default=0.2)
    ap.add_argument("--trace", default="taobao,amazon")
    ap.add_argument("--regimes", default="steady,trend,burst")
    ap.add_argument("--seed", type=int, default=21_000)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.states:
        data = relabel(a.states, a.teacher)
    else:
        from .env import EnvConfig

        cfg = EnvConfig.like_table(num_nodes=a.nodes, duration_s=a.duration, rate_spread=a.rate_spread,
                                   traces=tuple(x for x in a.trace.split(",") if x),
                                   regimes=tuple(x for x in a.regimes.split(",") if x))
        data = rollout(a.teacher, a.episodes, cfg, seed=a.seed)
    save_oracle_data(data, a.out)
    y = data["y"]
    print(f"{len(y)} states labelled by {data['episodes'][0]['labels'] if data['episodes'] else '?'}: share "
          f"min/p50/max {y.min():.3f}/{np.median(y):.3f}/{y.max():.3f} -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
