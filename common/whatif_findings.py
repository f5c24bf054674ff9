"""A what-if run's findings (`simulator.sampled.findings`, stored in the run's result) in words:
the lines `racer whatif` prints under its table and the dashboard's What-if page lists."""

from __future__ import annotations


def findings_lines(findings: dict | None, *, explain: bool = False) -> list[str]:
    """The best static split over the look-ahead oracle (with ``explain``: what that says), then
    each policy's regret, one line each; none for findings that lack them."""
    f = findings or {}
    lines = []
    if "best_static_over_oracle_pct" in f:
        lines.append(f"best static ({f['best_static']}) over the look-ahead oracle: "
                     f"{f['best_static_over_oracle_pct']:+.2f}% P99"
                     + (" (what a dynamic split was worth)" if explain else ""))
    for name, g in (f.get("policy_regret") or {}).items():
        lines.append(f"regret of {name}: " + ", ".join(f"{k.replace('_pct', '').replace('_', ' ')} {v:+.2f}%"
                                                       for k, v in g.items()))
    return lines
