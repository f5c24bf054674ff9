"""A synthetic fleet that talks to the control plane exactly as node agents do (real HTTP, node
tokens, ``POST /nodes/register`` then ``POST /nodes/{id}/reports`` batches): history for the
dashboard's tests (tests/test_dashboard_browser.py), its benchmark (bench/dashboard.py) and its
screenshots, without running 32 models. Its figures are made up, not measured: its nodes
register the device ``cuda:0 (synthetic)``, and a picture drawn from them says so.

`seed_history` backfills ``duration_s`` of reports for ``num_nodes`` nodes (batches of up to 1000
reports, as a node replaying its buffer would); `LiveFleet` keeps them reporting every interval
from a thread. The figures are a deterministic function of (node, time): emb_share drifts per
node, bursts (`burst_periods`) raise P99 over the SLO, lower SLO attainment and bring ``recovery``
decisions that shift the split KV-ward; the other decisions are ``base`` / ``residual`` with an
occasional ``guard``.

Not a node agent: it serves no requests. Tests that need a live node run a real one.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import httpx

API = "/api/v1"


@dataclass(frozen=True)
class FleetConfig:
    num_nodes: int = 32
    interval_s: float = 1.0
    slo_ms: float = 30.0
    bursts: tuple[tuple[float, float, float], ...] = ((0.30, 0.38, 3.0), (0.78, 0.84, 2.0))
    """Burst periods as (start, end, magnitude), start/end as fractions of the seeded span."""
    burst_nodes: float = 0.5  # fraction of nodes a burst hits
    policy_version: str | None = None
    follow_directives: bool = True
    """Live nodes pull their directives every interval as agents do: an override holds their
    emb_share (source ``override``); a policy version is "loaded" (confirmed, then reported)."""
    candidate_p99_penalty_ms: float = 3.0
    """Nodes running a policy whose id starts with ``candidate`` report this much more P99 (a
    canary that is visibly, deterministically worse)."""


def node_id(i: int) -> str:
    return f"gpu-{i:02d}"


def create_token(http: httpx.Client, admin_token: str, role: str, name: str, node_id: str | None = None) -> str:
    body = {"role": role, "name": name}
    if node_id is not None:
        body["node_id"] = node_id
    r = http.post(f"{API}/tokens", json=body, headers={"Authorization": f"Bearer {admin_token}"})
    r.raise_for_status()
    return r.json()["token"]


class Fleet:
    """``num_nodes`` synthetic nodes, each registered with its own node token (bound to its id)."""

    def __init__(self, base_url: str, admin_token: str, config: FleetConfig | None = None, *,
                 start_s: float, end_s: float):
        self.config = config or FleetConfig()
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=30.0)
        self.start_s, self.end_s = float(start_s), float(end_s)
        self.seq = {node_id(i): 0 for i in range(self.config.num_nodes)}
        self.tokens = {nid: create_token(self.http, admin_token, "node", f"synthetic-{nid}", node_id=nid)
                       for nid in self.seq}
        self.share = {node_id(i): 0.35 + 0.3 * (i % 7) / 6 for i in range(self.config.num_nodes)}
        self.policy = {nid: self.config.policy_version for nid in self.seq}
        self.override: dict[str, dict | None] = {nid: None for nid in self.seq}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_posted = 0

    def headers(self, nid: str) -> dict:
        return {"Authorization": f"Bearer {self.tokens[nid]}"}

    def register(self) -> None:
        for i, nid in enumerate(self.seq):
            r = self.http.post(f"{API}/nodes/register", headers=self.headers(nid), json={
                "node_id": nid, "address": f"http://127.0.0.1:{20000 + i}", "device": "cuda:0 (synthetic)",
                "cost_profile": {"kv_recompute_us_per_token": 2.0 + 0.1 * (i % 5),
                                 "emb_transfer_us_per_row": 0.8 + 0.05 * (i % 3),
                                 "service_time_us": 900.0 + 20 * (i % 4), "queue_capacity": 64},
                "policy_version": self.config.policy_version})
            r.raise_for_status()

    # --------------------------------------------------------------------- the figures ---
    def burst_periods(self) -> list[tuple[float, float, float]]:
        span = self.end_s - self.start_s
        return [(self.start_s + a * span, self.start_s + b * span, m) for a, b, m in self.config.bursts]

    def _in_burst(self, i: int, t: float):
        if i >= max(1, int(self.config.burst_nodes * self.config.num_nodes)):
            return None
        for s, e, m in self.burst_periods():
            if s <= t < e:
                return s, e, m
        return None

    def report(self, i: int, t: float) -> dict:
        nid = node_id(i)
        c = self.config
        prev = self.share[nid]
        burst = self._in_burst(i, t)
        wave = 0.08 * math.sin(2 * math.pi * (t / 900.0 + i / 11.0))
        base_share = min(0.9, max(0.1, 0.35 + 0.3 * (i % 7) / 6 + wave))
        seq = self.seq[nid]
        ov = self.override.get(nid)
        if ov is not None:
            target = float(ov["emb_share"])
            source, reason = "override", f"operator override {target:.4f} ({ov.get('reason', '')})"
        elif burst:
            target = max(0.1, prev - 0.04)
            source, reason = "recovery", (f"burst x{burst[2]:g}: KV-ward cap {target:.4f} (entry {prev:.4f} - 0.04) "
                                         f"under base proposal {base_share:.4f}")
        elif seq % 17 == 5:
            target = prev
            source, reason = "guard", f"step limited to +0.05 from {prev:.4f}; base: base policy p1 {base_share:.4f}"
        elif seq % 3 == 0:
            target = base_share
            source, reason = "residual", f"base policy p1 {base_share - 0.01:.4f} + residual +0.0100"
        else:
            target = base_share
            source, reason = "base", f"base policy p1 {base_share:.4f}"
        applied = prev + 0.5 * (target - prev)
        self.share[nid] = applied
        load = 1.0 + (burst[2] - 1.0) if burst else 1.0
        policy = self.policy.get(nid)
        p99 = 14.0 + 2.0 * (i % 5) + 6.0 * math.sin(t / 120.0 + i) ** 2 + (24.0 * (load - 1) / 2 if burst else 0.0)
        if policy and str(policy).startswith("candidate"):
            p99 += c.candidate_p99_penalty_ms
        att = 0.999 - (0.02 * (load - 1) if burst else 0.0) - 0.002 * (i % 3)
        rps = 400.0 * load + 20 * (i % 4)
        rep = {"seq": seq, "ts_s": t, "interval_s": c.interval_s, "emb_share": round(applied, 6),
               "emb_share_target": round(target, 6), "kv_hit_rate": round(0.55 - 0.3 * applied + (0.0 if burst else 0.1), 6),
               "emb_hit_rate": round(0.5 + 0.45 * applied - (0.1 if burst else 0.0), 6),
               "p50_ms": round(p99 / 3, 4), "p99_ms": round(p99, 4), "slo_attainment": round(max(0.0, att), 6),
               "throughput_rps": round(rps, 3), "num_requests": int(rps * c.interval_s), "queue_depth": 2.0 * load,
               "refill_bytes": 4096 * (seq % 7), "kv_recompute_us_per_token": 2.0 + 0.1 * (i % 5),
               "emb_transfer_us_per_row": 0.8 + 0.05 * (i % 3), "policy_version": policy,
               "decision": {"source": source, "emb_share": round(target, 6), "reason": reason,
                            "prev_emb_share": round(prev, 6), "features": {"load": round(load / 3, 4)}}}
        if burst and (t - burst[0]) < c.interval_s * 1.5:
            rep["bursts"] = [{"start_s": burst[0], "end_s": None, "magnitude": burst[2]}]
        elif not burst and self._in_burst(i, t - c.interval_s):
            s, _e, m = self._in_burst(i, t - c.interval_s)
            rep["bursts"] = [{"start_s": s, "end_s": t, "magnitude": m}]
        self.seq[nid] = seq + 1
        return rep

    def follow(self, nid: str) -> None:
        """Pull this node's directives and apply them (override; policy: confirm it as loaded)."""
        r = self.http.get(f"{API}/nodes/{nid}/directives", headers=self.headers(nid))
        r.raise_for_status()
        d = r.json()
        self.override[nid] = d.get("override")
        pol = d.get("policy")
        if pol and pol.get("version") != self.policy.get(nid):
            self.http.post(f"{API}/nodes/{nid}/policy", headers=self.headers(nid),
                           json={"policy_version": pol["version"], "status": "loaded"}).raise_for_status()
            self.policy[nid] = pol["version"]

    def post(self, nid: str, reports: list[dict]) -> None:
        r = self.http.post(f"{API}/nodes/{nid}/reports", headers=self.headers(nid), json={"reports": reports})
        r.raise_for_status()
        self.num_posted += len(reports)

    # -------------------------------------------------------------------------- seeding ---
    def seed(self) -> int:
        """Backfill [start_s, end_s) at ``interval_s`` for every node; returns the reports sent."""
        n = 0
        steps = int((self.end_s - self.start_s) / self.config.interval_s)
        for i, nid in enumerate(self.seq):
            batch = []
            for k in range(steps):
                batch.append(self.report(i, self.start_s + k * self.config.interval_s))
                if len(batch) == 1000:
                    self.post(nid, batch)
                    n += len(batch)
                    batch = []
            if batch:
                self.post(nid, batch)
                n += len(batch)
        return n

    def live(self, clock=time.time) -> None:
        """Report every interval from a thread (`stop` ends it), continuing the seeded history."""
        def loop():
            t_next = max(self.end_s, clock())
            while not self._stop.is_set():
                for i, nid in enumerate(self.seq):
                    try:
                        if self.config.follow_directives:
                            self.follow(nid)
                        self.post(nid, [self.report(i, t_next)])
                    except httpx.HTTPError:
                        pass  # this interval is lost (a real agent buffers and replays it; this fleet does not)
                t_next += self.config.interval_s
                self._stop.wait(max(0.0, t_next - clock()))

        self._thread = threading.Thread(target=loop, name="synthetic-fleet", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.http.close()
