"""The process that runs one what-if (``python -m simulator.whatif_worker RUN_ID``), started by the
control plane (`control_plane.whatif.execute`) with the database URL and its bounds in its
environment.

It reads from the database the run's row (the window, a candidate asked for by name), the fleet,
the policies and the window's traffic samples, replays them (`simulator.sampled`) and stores the
result on the row, recording its progress as it goes (at most twice a second):

- **fleet**: the registered nodes that are up (else every node not retired): their count, and the
  cost profile most of them registered. An emulated node's profile is the preset it names
  (`common.device_model.get_profile`); another node's is the A100/HSTU model with the node's
  registered miss costs (``kv_recompute_us_per_token`` per token, ``emb_transfer_us_per_row``)
  and its arena's bytes (an arena of fewer than `MIN_ARENA_PAGES` of the profile's pages: the
  simulator's default, a quarter of the window's item table, said in the stored profile). The
  sample is a fraction of the traffic (its requests over the requests
  the gateways reported in the window): the simulated cluster has that fraction of the nodes (at
  least one), so each node carries the load a fleet node carried;
- **configurations**: the static splits of the grid (the control plane's ``whatif_shares``), the look-ahead
  oracle on them, the active policy and every candidate in the registry (status "registered" or
  "canary"; only the one named when the run names one), each the node agent's SmartAllocator with
  every layer on, its artifact unpacked from the registry;
- **cut**: at most ``max_samples`` samples, the most recent of the window (the row's ``cut`` says
  from when, and how many of how many); the replay spans the samples, from the window's whole
  second before the first to a second past the last (``result.window``);
- **version**: the code that made it (``racer`` version + a digest of the simulator, node agent,
  control plane, policies and workloads sources), the window and the profile, on the row.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np


#: fewer arena pages than this under the profile's page size (a CPU node's small arena under the
#: a100-hstu model's pages) would leave no split to choose: the simulator's default arena is used
MIN_ARENA_PAGES = 64


def code_version() -> str:
    import importlib.metadata as md

    from .table import _CODE_PACKAGES, _files_digest

    try:
        version = md.version("racer")
    except md.PackageNotFoundError:
        version = "unknown"

    root = Path(__file__).resolve().parents[1]
    files = sorted(f.relative_to(root) for pkg in _CODE_PACKAGES for f in (root / pkg).rglob("*.py"))
    return f"{version}+{_files_digest(files, root)}"


def fleet_profile(nodes: list) -> tuple[object, int | None, dict]:
    """(simulator cost profile, arena bytes or None, a description) from registered nodes' profiles."""
    from dataclasses import replace

    from common.device_model import A100_HSTU, get_profile

    def key(p: dict) -> str:
        dev = p.get("device") or {}
        return json.dumps({k: p.get(k) for k in ("kv_recompute_us_per_token", "emb_transfer_us_per_row",
                                                 "arena_bytes")} | {"emulated": dev.get("profile")}, sort_keys=True)

    counts = Counter(key(n.cost_profile or {}) for n in nodes)
    chosen_key, n_same = counts.most_common(1)[0]
    reg = next(n.cost_profile for n in nodes if key(n.cost_profile or {}) == chosen_key)
    dev = reg.get("device") or {}
    arena = reg.get("arena_bytes")
    prof, how = None, None
    if dev.get("mode") == "emulated" and dev.get("profile"):
        try:
            prof, how = get_profile(dev["profile"]), f"the emulated nodes' preset {dev['profile']!r}"
        except (ValueError, KeyError, FileNotFoundError):
            prof = None
    if prof is None:
        kv = float(reg["kv_recompute_us_per_token"])
        prof = replace(A100_HSTU, name="registered", token_us=max(kv, 1e-6), cand_us=max(kv, 1e-6), attn_us_per_ctx=0.0,
                       emb_transfer_us_per_row=max(float(reg["emb_transfer_us_per_row"]), 1e-6),
                       sources={"all": "the nodes' registered miss costs over the a100-hstu model"}).validate()
        how = "the nodes' registered miss costs over the a100-hstu model"
    if arena and int(arena) // prof.page_bytes < MIN_ARENA_PAGES:
        how += (f"; the arena's {int(arena)} bytes hold fewer than {MIN_ARENA_PAGES} of the profile's "
                f"{prof.page_bytes}-byte pages: sized as the simulator's default instead (a quarter of the window's "
                f"item table)")
        arena = None
    desc = {"name": prof.name, "how": how, "nodes_with_it": n_same, "nodes": len(nodes),
            "kv_recompute_us_per_token": reg.get("kv_recompute_us_per_token"),
            "emb_transfer_us_per_row": reg.get("emb_transfer_us_per_row"), "arena_bytes": arena,
            "costs": {k: v for k, v in prof.to_json().items() if isinstance(v, (int, float))}}
    return prof, (int(arena) if arena else None), desc


def _simulated_fleet(nodes: list, num_samples: int, served: int | None, slo_ms: float):
    """``(profile, arena bytes or None, description, simulated node count)``: `fleet_profile` of the
    nodes, and as many nodes as the sampled fraction of the traffic (``num_samples`` of the
    ``served`` requests the gateways reported; at least one), so each carries a fleet node's load."""
    profile, arena, desc = fleet_profile(nodes)
    fraction = min(1.0, num_samples / served) if served else 1.0
    num_nodes = max(1, int(round(len(nodes) * fraction)))
    desc.update(fleet_nodes=len(nodes), simulated_nodes=num_nodes, sampled_fraction=round(fraction, 6),
                gateway_requests=served, slo_ms=slo_ms)
    return profile, arena, desc, num_nodes


def _read_samples(s, start_s: float, end_s: float) -> list[dict]:
    from db import queries

    rows, after = [], None
    while True:
        page = queries.traffic_samples(s, gateway_id=None, start_s=start_s, end_s=end_s, after=after, limit=5000)
        rows += [{"ts_s": r.ts_s, "user_hash": r.user_hash, "history_len": r.history_len, "items": r.items,
                  "new_items": r.new_items, "candidates": r.candidates, "num_candidates": r.num_candidates}
                 for r in page]
        if len(page) < 5000:
            return rows
        after = (page[-1].ts_s, page[-1].id)


def _policies_to_run(s, candidate: str | None) -> list[tuple]:
    """``(version, status, artifact)`` of the active policy, then (by version) the candidate named,
    or without one every policy registered or in canary."""
    from db import queries

    return sorted(((p.version, p.status, p.artifact) for p in queries.list_policies(s)
                   if p.status == "active" or (p.version == candidate if candidate else
                                               p.status in ("registered", "canary"))),
                  key=lambda x: (x[1] != "active", x[0]))  # the active one, then by version


def _unpack_policies(policies: list[tuple], d: Path) -> tuple[dict, dict]:
    """Each policy's artifact unpacked into its own folder under ``d``: ``(dirs, roles)``, by
    configuration name (``policy:<version>``) its folder and its ``(role, version)``."""
    from common.artifact_pack import unpack_artifact

    dirs, roles = {}, {}
    for version_name, status, blob in policies:
        pdir = d / f"p{len(dirs)}"
        pdir.mkdir()
        for name, data in unpack_artifact(blob).items():
            (pdir / name).write_bytes(data)
        dirs[f"policy:{version_name}"] = pdir
        roles[f"policy:{version_name}"] = ("active" if status == "active" else "candidate", version_name)
    return dirs, roles


def run(run_id: int, url: str, args: dict) -> None:
    from sqlalchemy import select

    from db import queries
    from db.engine import make_engine, session_factory
    from db.models import GatewayReport, WhatIfRun

    from .sampled import DEFAULT_SHARES, SampledRequests, WhatIfConfig, run_whatif, sampled_stream

    t_start = time.monotonic()
    deadline = t_start + float(args.get("wall_s") or 1800.0)
    engine = make_engine(url, pool_size=2)
    factory = session_factory(engine)
    last = [0.0]
    parent = os.getppid()

    def progress(f: float, note: str, force: bool = False) -> None:
        if os.getppid() != parent:
            raise RuntimeError("the control plane that started the run stopped")
        now = time.monotonic()
        if not force and now - last[0] < 0.5:
            return
        last[0] = now
        with factory.begin() as s:
            if not queries.whatif_progress(s, run_id, progress=round(float(f), 4), note=note, now_s=time.time()):
                raise RuntimeError("the run is no longer running")

    def fail(why: str) -> None:
        with factory.begin() as s:
            queries.finish_whatif(s, run_id, state="failed", now_s=time.time(), error=why)

    try:
        with factory() as s:
            r = s.get(WhatIfRun, run_id)
            if r is None or r.state != "running":
                return
            start_s, end_s, candidate = r.window_start_s, r.window_end_s, r.candidate
            nodes = [n for n in queries.list_nodes(s) if n.status == "up"] or queries.list_nodes(s)
            policies = _policies_to_run(s, candidate)
            total = queries.count_traffic_samples(s, start_s=start_s, end_s=end_s)
            keep = int(args.get("max_samples") or total)
            cut_from = (queries.traffic_sample_cut(s, start_s=start_s, end_s=end_s, keep=keep) if total > keep
                        else start_s)
            served = queries.gateway_requests_between(s, start_s=start_s, end_s=end_s)
            slo = args.get("slo_ms") or s.scalar(select(GatewayReport.slo_ms).order_by(GatewayReport.id.desc())
                                                 .limit(1))
        if not nodes:
            fail("no node is registered: the what-if needs the fleet's node count and cost profile")
            return
        progress(0.0, "reading the window's samples", force=True)
        with factory() as s:
            rows = _read_samples(s, cut_from, end_s)
        if not rows:
            fail(f"the window [{start_s:.0f}, {end_s:.0f}) holds no traffic sample any more (retention?)")
            return
        cut = None
        if total > len(rows):
            cut = {"from_s": cut_from, "kept": len(rows), "of": total, "kept_s": end_s - cut_from,
                   "why": f"at most {keep} samples a run (whatif_max_samples): the most recent ones"}
        profile, arena, desc, num_nodes = _simulated_fleet(nodes, total, served, float(slo or 30.0))
        version = code_version()
        with factory.begin() as s:
            queries.whatif_progress(s, run_id, progress=0.01, note="building the stream", now_s=time.time())
            row = s.get(WhatIfRun, run_id)
            row.profile, row.cut, row.code_version, row.num_samples = desc, cut, version, len(rows)
        # the replay spans the samples (from the whole second of the window before the first, to a
        # second past the last): empty time before or after costs simulator slices and says nothing
        replay_from = cut_from + math.floor(rows[0]["ts_s"] - cut_from)
        replay_to = min(end_s, rows[-1]["ts_s"] + 1.0)
        stream = sampled_stream(SampledRequests.from_rows(rows), start_s=replay_from, end_s=replay_to)
        del rows
        with tempfile.TemporaryDirectory(prefix="racer-whatif-") as d:
            dirs, roles = _unpack_policies(policies, Path(d))
            cfg = WhatIfConfig(num_nodes=num_nodes, profile=profile, cache_bytes=arena, policies=dirs,
                               slo_ms=float(slo or 30.0), shares=tuple(args.get("shares") or DEFAULT_SHARES))
            result = run_whatif(stream, cfg, progress=lambda f, note: progress(0.02 + 0.97 * f, note),
                                deadline_s=deadline)
        for row in result["rows"]:
            if row["config"] in roles:
                row["role"], row["version"] = roles[row["config"]]
        result["window"] = {"start_s": start_s, "end_s": end_s, "replayed_from_s": replay_from,
                            "replayed_to_s": replay_to}
        with factory.begin() as s:
            queries.finish_whatif(s, run_id, state="done", now_s=time.time(), result=_finite(result))
    except TimeoutError as e:
        fail(f"{e} ({args.get('wall_s')} s, whatif_wall_s)")
    except MemoryError:
        fail("ran out of its memory limit (whatif_memory_bytes)")
    except Exception as e:  # noqa: BLE001 - stored on the row, the reason an operator reads
        fail(f"{type(e).__name__}: {e}"[:2000])
        raise
    finally:
        engine.dispose()


def _finite(x):
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return v if np.isfinite(v) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def main(argv: list[str]) -> int:
    from control_plane.whatif import ENV_ARGS, ENV_DATABASE_URL

    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m simulator.whatif_worker RUN_ID", file=sys.stderr)
        return 2
    url = os.environ.get(ENV_DATABASE_URL)
    if not url:
        print(f"{ENV_DATABASE_URL} is not set", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    run(int(argv[0]), url, json.loads(os.environ.get(ENV_ARGS) or "{}"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
