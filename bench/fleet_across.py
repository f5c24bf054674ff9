"""RACER against the one static configuration an operator would deploy to a whole fleet.

    python -m bench.fleet_across OUT_KV OUT_EMB OUT_DAY ... --json

Each ``OUT`` is a finished ``racer bench fleet --workload NAME --out OUT`` (one workload each, the
same configurations and loads). Per workload and load: RACER's median P99 against the best static
configuration in hindsight for that workload (as `bench.fleet.findings`). Across the workloads:
the **single** static configuration that is best over all of them, the one whose worst ratio to
each (workload, load)'s best static is lowest (ties: the lower geometric mean), and RACER and the
default (``0.5/round_robin``) against it, per workload and load, with RACER's worst and mean.
Ratios are of medians over each bench's rounds; a bench's own verdicts (intervals) stay in its
``fleet.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from bench.fleet import DEFAULT_KEY, RACER_KEY, parse_configs


def _median(row: dict, figure: str = "p99_ms") -> float | None:
    v = (row.get(figure) or {}).get("median")
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def _pct(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((a / b - 1) * 100, 2)


def across(results: dict[str, dict]) -> dict:
    """``results``: workload name -> its fleet.json. See the module doc. Benches on different devices
    (CPU-compute and emulated, or two profiles) are refused: their figures are not comparable."""
    kinds = {(str((r.get("device") or {}).get("mode")), str((r.get("device") or {}).get("profile")))
             for r in results.values()}
    if len(kinds) > 1:
        raise ValueError(f"the benches ran on different devices {sorted(kinds)}: compare like with like")
    cells = {}  # (workload, load) -> {config: median P99}
    for name, res in results.items():
        for row in res["configs"]:
            p = _median(row)
            if p is not None:
                cells.setdefault((name, format(row["load"], "g")), {})[row["config"]] = p
    statics = sorted({c for v in cells.values() for c in v
                      if not c.startswith("racer/") and "#" not in c
                      and parse_configs(c)[0].split is not None})
    if not cells or not statics:
        raise ValueError("no static configuration with a P99 in the benches given")
    best = {k: min((p for c, p in v.items() if c in statics), default=None) for k, v in cells.items()}
    scores = {}
    for c in statics:
        ratios = [cells[k][c] / best[k] for k in cells if c in cells[k] and best[k]]
        if len(ratios) == len(cells):  # ran everywhere
            scores[c] = (max(ratios), math.exp(sum(map(math.log, ratios)) / len(ratios)))
    if not scores:
        raise ValueError("no static configuration ran on every workload and load")
    single = min(scores, key=lambda c: scores[c])
    per = {}
    for (name, load), v in sorted(cells.items()):
        per.setdefault(name, {})[load] = {
            "best_static": min((c for c in v if c in statics), key=lambda c: v[c]),
            "racer_over_best_static_pct": _pct(v.get(RACER_KEY), best[(name, load)]),
            "racer_over_single_static_pct": _pct(v.get(RACER_KEY), v.get(single)),
            "single_static_over_best_static_pct": _pct(v.get(single), best[(name, load)]),
            "racer_over_default_pct": _pct(v.get(RACER_KEY), v.get(DEFAULT_KEY)),
        }
    vs_single = [c["racer_over_single_static_pct"] for w in per.values() for c in w.values()
                 if c["racer_over_single_static_pct"] is not None]
    return {"single_static": single, "single_static_worst_ratio": round(scores[single][0], 4),
            "single_static_geomean_ratio": round(scores[single][1], 4), "per_workload": per,
            "racer_over_single_static_worst_pct": max(vs_single) if vs_single else None,
            "racer_over_single_static_mean_pct": round(sum(vs_single) / len(vs_single), 2) if vs_single else None,
            "devices": {name: res.get("device") for name, res in results.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_across", description=__doc__.split("\n\n")[0])
    p.add_argument("outs", nargs="+", help="--out folders of finished racer bench fleet --workload runs")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    results = {}
    try:
        for o in args.outs:
            f = Path(o) / "fleet.json"
            res = json.loads(f.read_text())
            name = res.get("workload") or res.get("schedule")
            if name in results:
                raise ValueError(f"{o}: workload {name} given twice")
            results[name] = res
        out = across(results)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"fleet-across: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out) if args.json else format_across(out))
    return 0


def format_across(out: dict) -> str:
    dev = next(iter(out["devices"].values()), None) or {}
    lines = [f"EMULATED devices ({dev.get('profile')}): every figure in modelled time"] \
        if dev.get("mode") == "emulated" else []
    lines.append(f"single best static over every workload: {out['single_static']} (worst "
                 f"{out['single_static_worst_ratio']}x the per-workload best)")
    for name, loads in out["per_workload"].items():
        for load, c in loads.items():
            lines.append(f"  {name} @ {load}: best {c['best_static']}; RACER {c['racer_over_best_static_pct']}% over "
                         f"it, {c['racer_over_single_static_pct']}% over the single static, "
                         f"{c['racer_over_default_pct']}% over the default")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
