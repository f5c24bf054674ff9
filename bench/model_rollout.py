"""A model rollout in which nothing changes but the K/V: what the canary judge says of it.

    python -m bench.model_rollout --json [--bake-s 150] [--serve-s 60] [--runs 1]

Each run starts ``racer up`` (its default fleet and load, a fresh data folder, child processes),
lets it serve ``--serve-s``, then pushes the shipped checkpoint again under a new digest (the
same weights and items re-saved with another ``trace`` note) and rolls it out over the API to half
the nodes with a ``--bake-s`` bake, every other judge setting at its default, and waits for the
judge (promoted, rolled back or paused). A node that loads a model drops every user's K/V (they
were computed by the old weights), so the canary starts with cold K/V against a warm baseline:
this measures what that costs a candidate that is otherwise the baseline itself.

Prints per run: ``state`` and ``seconds`` (from the rollout's start to the judge's decision), the
judge's ``reason`` and ``judgements`` (per metric: verdict, windows a side, medians, means,
p-value), and ``buckets``: every 15 s from a minute before the rollout, the canary's and the
baseline's mean report-window KV hit rate, EMB hit rate, P99 and split. One run is one sample of a
noisy fleet on a shared machine: read the p-values, not the verdict alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench import print_figures
from bench.up import ENV, ROOT, kill_left_behind

FIELDS = ("kv_hit_rate", "emb_hit_rate", "p99_ms", "emb_share")
BUCKET_S = 15.0


def _mean(rows: list[dict], field: str) -> float | None:
    vals = [r[field] for r in rows if r.get(field) is not None]
    return round(statistics.fmean(vals), 3) if vals else None


def buckets(rows: list[dict], canary: set[str], t0: float) -> list[dict]:
    """Report windows in ``BUCKET_S`` spans from ``t0``: each side's mean of ``FIELDS``."""
    by = defaultdict(lambda: ([], []))
    for r in rows:
        by[int((r["ts_s"] - t0) // BUCKET_S)][0 if r["node_id"] in canary else 1].append(r)
    return [{"from_s": k * BUCKET_S, **{f"{side}_{f}": _mean(rs, f) for side, rs in zip(("canary", "baseline"), by[k])
                                        for f in FIELDS}}
            for k in sorted(by)]


def one_run(tmp: Path, bake_s: float, serve_s: float) -> dict:
    import httpx

    from node_agent.model.checkpoint import load_checkpoint, save_checkpoint
    from node_agent.model.shipped import resolve_model

    data = tmp / "racer-data"
    err_path = tmp / "up.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "racer", "up", "--data-dir", str(data), "--duration",
                                 str(int(serve_s + 8 * bake_s + 300)), "--dashboard-port", "0", "--json"],
                                cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=err, text=True)
    try:
        cp, deadline = None, time.monotonic() + 300
        while cp is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"racer up did not start: {err_path.read_text()[-2000:]}")
            cp = next((line.split()[4] for line in err_path.read_text().splitlines()
                       if line.startswith("racer up: control plane http")), None)
            time.sleep(0.5)
        while not (data / "operator_token").exists():
            time.sleep(0.5)
        auth = {"Authorization": f"Bearer {(data / 'operator_token').read_text().strip()}"}
        print(f"model_rollout: racer up serving; {serve_s:g} s before the rollout", file=sys.stderr, flush=True)
        time.sleep(serve_s)
        shipped = load_checkpoint(resolve_model("auto", "taobao", None))
        same = save_checkpoint(tmp / "same-model", shipped.model, shipped.item_table, shipped.item_keys,
                               trace={"path": "the shipped model re-saved: same weights, a new digest"})
        push = subprocess.run([sys.executable, "-m", "racer", "model", "push", str(tmp / "same-model"),
                               "--control-plane", cp, "--token-file", str(data / "operator_token")],
                              cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        if push.returncode != 0:
            raise SystemExit(f"racer model push failed: {push.stderr[-2000:]}")
        t0 = time.time()
        r = httpx.post(f"{cp}/api/v1/rollouts", headers=auth, timeout=60,
                       json={"kind": "model", "model_version": same["digest"], "canary_fraction": 0.5,
                             "bake_time_s": bake_s, "reason": "bench.model_rollout: the same weights"})
        if r.status_code != 201:
            raise SystemExit(f"rollout refused: {r.status_code} {r.text[:1000]}")
        rid = r.json()["id"]
        while True:
            ro = httpx.get(f"{cp}/api/v1/rollouts/{rid}", headers=auth, timeout=30).json()
            if ro["state"] in ("promoted", "rolled_back", "paused"):
                break
            print(f"model_rollout: {ro['state']} {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
            time.sleep(10)
        canary = {n["node_id"] for n in ro["nodes"] if n.get("role") == "canary"}
        rows = httpx.get(f"{cp}/api/v1/reports", params={"start_s": t0 - 60, "limit": 100_000}, headers=auth,
                         timeout=60).json()
        keep = ("verdict", "n_canary", "n_baseline", "median_canary", "median_baseline", "mean_canary",
                "mean_baseline", "p_value")
        return {"state": ro["state"], "seconds": round(time.time() - t0, 1), "reason": ro["steps"][-1]["reason"],
                "canary_nodes": sorted(canary),
                "judgements": {j["metric"]: {k: j.get(k) for k in keep} for j in (ro.get("verdict") or {}).get(
                    "judgements", [])},
                "buckets": buckets(rows, canary, t0)}
    finally:
        proc.terminate()  # racer up stops what it started on SIGTERM
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            kill_left_behind(proc, data)  # and each process it recorded, not racer up alone


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.model_rollout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bake-s", type=float, default=150.0, help="the rollout's bake_time_s (warm-up: a fifth)")
    ap.add_argument("--serve-s", type=float, default=60.0, help="seconds racer up serves before the rollout")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.bake_s <= 0 or a.serve_s < 0 or a.runs < 1:
        ap.error("--bake-s must be > 0, --serve-s >= 0, --runs >= 1")
    runs = []
    for i in range(a.runs):
        with tempfile.TemporaryDirectory(prefix="racer-model-rollout-") as d:
            runs.append(one_run(Path(d), a.bake_s, a.serve_s))
        print(f"model_rollout: run {i + 1}/{a.runs}: {runs[-1]['state']}", file=sys.stderr, flush=True)
    out = {"bake_s": a.bake_s, "serve_s": a.serve_s, "load_average": os.getloadavg(), "runs": runs}
    print_figures(out, as_json=a.json, width=14)


if __name__ == "__main__":
    main()
