"""The control plane's settings (one typed config; environment variables ``RACER_*`` and the
``racer control-plane`` options set them). Every default is listed in docs/control_plane.md."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from common.config import ranged, validate
from common.contract import DEFAULT_MAX_EMB_SHARE, DEFAULT_MIN_EMB_SHARE, MAX_SEND_PERIOD_S


def _period(default: float, doc: str = ""):
    """A duration in seconds: a positive finite number."""
    return ranged(default, lo=0, lo_open=True, doc=doc)


@dataclass(frozen=True)
class Settings:
    """- ``database_url``: SQLAlchemy URL (``RACER_DATABASE_URL``; default a SQLite file);
    - ``host`` / ``port``: where the API listens;
    - ``report_interval_s``: the control interval nodes are told to report at;
    - ``send_period_s``: how often nodes are told to send their reports and pull their directives
      (None: every control step; at fleet scale a few seconds, so each request carries several
      reports: `bench.ingest --reports-per-request`). Liveness counts in the longer of the two;
    - ``liveness_missed_intervals``: a node is "down" after this many report intervals without one;
    - ``weights_period_s``, ``rollout_period_s``, ``override_period_s``, ``liveness_period_s``,
      ``retention_period_s``: job periods;
    - ``weights_window_s``: reported miss costs from this far back feed the weights (median);
    - ``weights_rel_change``: a node's cost must move by more than this fraction (or a node
      join/leave) for a new weights version;
    - ``rollup_step_s``, ``raw_retention_s``, ``rollup_retention_s``: downsampling and retention;
    - ``min_override_emb_share`` / ``max_override_emb_share``: the allocator's guard bounds
      (default: `common.contract.DEFAULT_MIN_EMB_SHARE` / ``DEFAULT_MAX_EMB_SHARE``, the allocator's
      `GuardConfig` defaults) outside which overrides are refused;
    - ``scheduler``: False runs the API without jobs (a replica that never schedules);
    - ``serve_api``: False runs the jobs without the API (``racer control-plane --jobs-only``: a
      process that takes part in the election and, leading, runs the jobs, serving only
      ``/healthz`` and ``/metrics``), so the jobs' Python never shares an interpreter with report
      ingestion; the API replicas then run with ``scheduler`` False;
    - ``leader_poll_s``: how often a standby replica tries to become the scheduler leader;
    - ``ingest_max_rows``: most report rows one group commit writes; ``ingest_linger_s``: how long
      after a batch arrives the writer waits for others to share its commit (`control_plane.ingest`);
    - ``token_refresh_s``: how often the cached tokens are re-read together
      (`control_plane.auth.TokenCache`): a token revoked on another replica stops working here
      within this time (within twice it while the database cannot be read);
    - ``push_timeout_s``: timeout of one weight push to a router;
    - ``admin_token``: the first operator token (``RACER_ADMIN_TOKEN``; else generated and printed once);
    - ``secret_key`` / ``secret_key_file``: the key the routers' push tokens are derived from
      (`control_plane.auth.load_secret_key`; default ``<database file>.key`` beside SQLite);
    - ``max_body_bytes``: most bytes of a request body (registration, tokens, overrides, rollouts,
      confirmations, any other route); ``max_report_body_bytes``: of a report batch;
      ``max_policy_body_bytes``: of a policy upload. A larger body gets 413, counted on the bytes
      received (chunked bodies too), after the token is checked (`control_plane.gate`);
      ``max_sample_body_bytes``: of a gateway's traffic-sample batch (413 beyond);
    - ``sample_retention_s`` / ``sample_max_rows``: the gateways' traffic samples are kept this long
      (by their time) and at most this many (the oldest stored deleted beyond it), by the retention job;
    - ``node_reports_per_s`` / ``node_burst_reports`` and ``node_report_bytes_per_s`` /
      ``node_burst_report_bytes``: each node's ingestion quota (`control_plane.quota`), sustained
      and burst; past either, a batch gets 429 with ``Retry-After``. The bursts hold a full spool
      flushed after an outage; the bytes burst is at least ``max_report_body_bytes``;
    - ``artifact_check_memory_bytes``, ``artifact_check_cpu_s``, ``artifact_check_wall_s``: the
      limits of the child process that unpacks and checks an uploaded policy or checkpoint
      (`control_plane.artifacts.check_upload`): address space, CPU seconds, wall seconds.
    - ``slo_objective``, ``alert_window_s``, ``pinned_fraction``: the alerts (`control_plane.alerts`):
      the clients' SLO objective whose error budget the burn-rate alerts watch, the window of the
      pinned-at-a-bound and reports-dropped alerts, and the share of a window's decisions clamped
      to one guard bound that counts as pinned.
    - ``whatif_max_window_s``: the longest window a what-if may be asked to replay;
      ``whatif_max_samples``: most traffic samples one what-if replays (a window holding more is cut
      to its most recent ones, and the run says so); ``whatif_wall_s`` / ``whatif_memory_bytes``:
      the time and address-space limits of the process that runs it (`control_plane.whatif`);
      ``whatif_period_s``: the scheduled what-if over the last ``whatif_window_s`` (None: off, the
      default; 86400: daily); ``whatif_shares``: the static split grid it runs, comma-separated
      emb_share values in [0, 1] (the look-ahead oracle chooses among them too).
    """

    database_url: str | None = None
    host: str = "127.0.0.1"
    port: int = ranged(8600, lo=0, hi=65535, integer=True, doc="port (0: a free one)")
    report_interval_s: float = _period(1.0)
    send_period_s: float | None = ranged(None, lo=0, lo_open=True, hi=MAX_SEND_PERIOD_S, optional=True,
                                         doc="how often nodes send their reports (None: every control step)")
    liveness_missed_intervals: float = ranged(5.0, lo=0, lo_open=True)
    weights_period_s: float = _period(10.0)
    rollout_period_s: float = _period(5.0)
    override_period_s: float = _period(1.0)
    liveness_period_s: float = _period(2.0)
    retention_period_s: float = _period(300.0)
    weights_window_s: float = _period(60.0)
    weights_rel_change: float = ranged(0.05, lo=0, hi=1, hi_open=True)
    rollup_step_s: float = _period(60.0)
    raw_retention_s: float = _period(7 * 86400.0)
    rollup_retention_s: float = _period(90 * 86400.0)
    min_override_emb_share: float | None = None
    max_override_emb_share: float | None = None
    scheduler: bool = True
    serve_api: bool = True
    leader_poll_s: float = _period(2.0)
    ingest_max_rows: int = 5000
    ingest_linger_s: float = ranged(0.015, lo=0, hi=1, doc="wait for other batches to share a commit, s")
    token_refresh_s: float = _period(5.0, "how often the cached tokens are re-read (revocations elsewhere reach here)")
    push_timeout_s: float = _period(2.0)
    admin_token: str | None = None
    secret_key: str | None = None
    secret_key_file: str | None = None
    max_body_bytes: int = ranged(2**20, lo=1024, integer=True)
    slo_objective: float = ranged(0.99, lo=0, hi=1, lo_open=True, hi_open=True,
                                  doc="share of the clients' requests meant to meet the SLO (the alerts' budget)")
    alert_window_s: float = _period(600.0)
    pinned_fraction: float = ranged(0.5, lo=0, hi=1, lo_open=True)
    max_report_body_bytes: int = ranged(16 * 2**20, lo=1024, integer=True)
    max_policy_body_bytes: int = ranged(64 * 2**20, lo=1024, integer=True)
    max_sample_body_bytes: int = ranged(2**20, lo=1024, integer=True,
                                        doc="most bytes of a gateway's traffic-sample batch")
    sample_retention_s: float = _period(7 * 86400.0, "how long the gateways' traffic samples are kept, s")
    sample_max_rows: int = ranged(5_000_000, lo=1, integer=True, doc="most traffic samples kept (the oldest go)")
    node_reports_per_s: float = ranged(20.0, lo=0, lo_open=True, doc="reports a node may store per second, sustained")
    node_burst_reports: int = ranged(20_000, lo=1, integer=True, doc="reports a node may store at once")
    node_report_bytes_per_s: float = ranged(256 * 2**10, lo=0, lo_open=True,
                                            doc="report-batch body bytes a node may send per second, sustained")
    node_burst_report_bytes: int = ranged(64 * 2**20, lo=1024, integer=True,
                                          doc="report-batch body bytes a node may send at once")

    whatif_max_window_s: float = _period(7 * 86400.0, "the longest window a what-if replays, s")
    whatif_max_samples: int = ranged(200_000, lo=1, integer=True,
                                     doc="most traffic samples one what-if replays (the most recent ones)")
    whatif_wall_s: float = ranged(1800.0, lo=0, lo_open=True, doc="wall seconds one what-if may run")
    whatif_memory_bytes: int = ranged(8 * 2**30, lo=256 * 2**20, integer=True,
                                      doc="address space of the process that runs a what-if")
    whatif_period_s: float | None = ranged(None, lo=60, optional=True,
                                           doc="period of the scheduled what-if (None: off)")
    whatif_window_s: float = _period(6 * 3600.0, "the window of the scheduled what-if, s")
    whatif_shares: str = "0.1,0.3,0.5,0.7,0.9"  # the static split grid (and the look-ahead oracle's)

    artifact_check_memory_bytes: int = ranged(4 * 2**30, lo=64 * 2**20, integer=True,
                                              doc="address space of an upload's check (torch needs about 1 GiB)")
    artifact_check_cpu_s: int = ranged(60, lo=1, integer=True, doc="CPU seconds of an upload's check")
    artifact_check_wall_s: float = ranged(120.0, lo=0, lo_open=True, doc="wall seconds of an upload's check")

    def check_limits(self):
        from .artifacts import CheckLimits

        return CheckLimits(self.artifact_check_memory_bytes, self.artifact_check_cpu_s, self.artifact_check_wall_s)

    def __post_init__(self) -> None:
        validate(self)
        self.whatif_grid()
        if not self.serve_api and not self.scheduler:
            raise ValueError("serve_api and scheduler are both off: such a process would do nothing (--jobs-only "
                             "runs the jobs, --no-scheduler the API)")
        if self.node_burst_report_bytes < self.max_report_body_bytes:
            raise ValueError(f"node_burst_report_bytes ({self.node_burst_report_bytes}) must be at least "
                             f"max_report_body_bytes ({self.max_report_body_bytes}): a full batch would never pass")

    def whatif_grid(self) -> tuple[float, ...]:
        """``whatif_shares`` as numbers; ValueError unless 1-21 distinct values in [0, 1]."""
        try:
            grid = tuple(sorted({float(x) for x in self.whatif_shares.split(",") if x.strip()}))
        except ValueError:
            grid = ()
        if not 1 <= len(grid) <= 21 or any(not 0.0 <= g <= 1.0 for g in grid):
            raise ValueError(f"whatif_shares must be 1 to 21 comma-separated emb_share values in [0, 1], got "
                             f"{self.whatif_shares!r}")
        return grid

    def guard_bounds(self) -> tuple[float, float]:
        lo = DEFAULT_MIN_EMB_SHARE if self.min_override_emb_share is None else self.min_override_emb_share
        hi = DEFAULT_MAX_EMB_SHARE if self.max_override_emb_share is None else self.max_override_emb_share
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
