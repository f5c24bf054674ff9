"""The control plane's settings (one typed config; environment variables ``RACER_*`` and the
``racer control-plane`` options set them). Every default is listed in docs/control_plane.md."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Settings:
    """- ``database_url``: SQLAlchemy URL (``RACER_DATABASE_URL``; default a SQLite file);
    - ``host`` / ``port``: where the API listens;
    - ``report_interval_s``: the control interval nodes are told to report at;
    - ``liveness_missed_intervals``: a node is "down" after this many report intervals without one;
    - ``weights_period_s``, ``rollout_period_s``, ``override_period_s``, ``liveness_period_s``,
      ``retention_period_s``: job periods;
    - ``weights_window_s``: reported miss costs from this far back feed the weights (median);
    - ``weights_rel_change``: a node's cost must move by more than this fraction (or a node
      join/leave) for a new weights version;
    - ``rollup_step_s``, ``raw_retention_s``, ``rollup_retention_s``: downsampling and retention;
    - ``history_rollup_period_s``: period of the job that keeps the pre-aggregated recent history
      current; ``history_rollup_margin_s``: how far behind its run time its watermark stays (a
      report committed up to this long after it was received is still picked up);
    - ``min_override_emb_share`` / ``max_override_emb_share``: the allocator's guard bounds
      (node_agent.allocator.GuardConfig defaults) outside which overrides are refused;
    - ``scheduler``: False runs the API without jobs (a replica that never schedules);
    - ``leader_poll_s``: how often a standby replica tries to become the scheduler leader;
    - ``ingest_max_rows``: most report rows one group commit writes;
    - ``push_timeout_s``: timeout of one weight push to a router;
    - ``admin_token``: the first operator token (``RACER_ADMIN_TOKEN``; else generated and printed once);
    - ``max_body_bytes``: most bytes of a request body (registration, tokens, overrides, rollouts,
      confirmations, any other route); ``max_report_body_bytes``: of a report batch;
      ``max_policy_body_bytes``: of a policy upload. A larger body gets 413, counted on the bytes
      received (chunked bodies too), after the token is checked (`control_plane.gate`).
    """

    database_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8600
    report_interval_s: float = 1.0
    liveness_missed_intervals: float = 5.0
    weights_period_s: float = 10.0
    rollout_period_s: float = 5.0
    override_period_s: float = 1.0
    liveness_period_s: float = 2.0
    retention_period_s: float = 300.0
    history_rollup_period_s: float = 5.0
    history_rollup_margin_s: float = 10.0
    weights_window_s: float = 60.0
    weights_rel_change: float = 0.05
    rollup_step_s: float = 60.0
    raw_retention_s: float = 7 * 86400.0
    rollup_retention_s: float = 90 * 86400.0
    min_override_emb_share: float | None = None
    max_override_emb_share: float | None = None
    scheduler: bool = True
    leader_poll_s: float = 2.0
    ingest_max_rows: int = 5000
    push_timeout_s: float = 2.0
    admin_token: str | None = None
    max_body_bytes: int = 2**20
    max_report_body_bytes: int = 16 * 2**20
    max_policy_body_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        problems = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_s") and v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)
                                                                  and v > 0):
                problems.append(f"{f.name} must be a finite number > 0, got {v!r}")
        if not 0 <= self.weights_rel_change < 1:
            problems.append(f"weights_rel_change must be in [0, 1), got {self.weights_rel_change}")
        if not 1 <= self.port <= 65535 and self.port != 0:
            problems.append(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_body_bytes", "max_report_body_bytes", "max_policy_body_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1024:
                problems.append(f"{name} must be an integer >= 1024, got {v!r}")
        if self.liveness_missed_intervals <= 0:
            problems.append(f"liveness_missed_intervals must be > 0, got {self.liveness_missed_intervals}")
        if problems:
            raise ValueError("invalid control-plane settings: " + "; ".join(problems))

    def guard_bounds(self) -> tuple[float, float]:
        from node_agent.allocator import GuardConfig

        g = GuardConfig()
        lo = g.min_emb_share if self.min_override_emb_share is None else self.min_override_emb_share
        hi = g.max_emb_share if self.max_override_emb_share is None else self.max_override_emb_share
        return float(lo), float(hi)

    @staticmethod
    def from_env(**overrides) -> Settings:
        """Settings from ``RACER_<FIELD>`` environment variables, then ``overrides`` (non-None)."""
        kw = {}
        for f in fields(Settings):
            raw = os.environ.get("RACER_" + f.name.upper())
            if raw is None or raw == "":
                continue
            if f.type in ("bool",):
                kw[f.name] = raw.lower() in ("1", "true", "yes", "on")
            elif f.type == "int":
                kw[f.name] = int(raw)
            elif "float" in f.type:
                kw[f.name] = float(raw)
            else:
                kw[f.name] = raw
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return Settings(**kw)
