"""The dashboard's only way to the system: the control plane's HTTP API (``/api/v1``).

`ControlPlaneClient` wraps one pooled `httpx.Client`. Every call takes the caller's bearer token
(the dashboard serves several signed-in users, each with their own token); the token goes into
the ``Authorization`` header only, never into a URL, a log line or an exception message.

Errors: a control plane that cannot be reached or answers too slowly raises `Unavailable`; an
answer with status >= 400 raises `ApiError` carrying the status and the API's own message (the
``detail`` of its JSON body), so the dashboard can show the operator what was wrong.

Returned values are the API's JSON (lists and dicts) plus a few helpers that reshape history
into the columnar form `dashboard.figures` takes (`cluster_series`, `node_series`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx

log = logging.getLogger("racer.dashboard.client")

API = "/api/v1"


class Unavailable(Exception):
    """The control plane did not answer (refused, reset, timed out)."""


class ApiError(Exception):
    """The control plane answered with an error status; ``message`` is its explanation."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300] or resp.reason_phrase
    detail = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, list):  # FastAPI validation errors
        parts = []
        for e in detail[:5]:
            if isinstance(e, dict):
                loc = ".".join(str(x) for x in e.get("loc", []) if x != "body")
                parts.append(f"{loc}: {e.get('msg', '')}" if loc else str(e.get("msg", "")))
            else:
                parts.append(str(e))
        return "; ".join(parts)
    return str(detail)


class ControlPlaneClient:
    """Thin typed access to the control-plane routes the dashboard uses."""

    def __init__(self, base_url: str, *, timeout_s: float = 3.0):
        base_url = base_url.rstrip("/")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"control plane URL must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s,
                                  limits=httpx.Limits(max_connections=16, max_keepalive_connections=8))
        self.last_latency_ms: float | None = None

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------------- plumbing ---
    def request(self, method: str, path: str, token: str | None, *, params: Mapping | None = None,
                json: Any = None, timeout_s: float | None = None, content: bytes | None = None,
                content_type: str | None = None) -> Any:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if content_type:
            headers["Content-Type"] = content_type
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        t0 = time.perf_counter()
        try:
            resp = self._http.request(method, API + path, params=clean, json=json, headers=headers,
                                      content=content, timeout=timeout_s or self.timeout_s)
        except httpx.TimeoutException:
            raise Unavailable(f"control plane at {self.base_url} did not answer within "
                              f"{timeout_s or self.timeout_s:g} s") from None
        except httpx.TransportError as e:
            raise Unavailable(f"control plane at {self.base_url} unreachable: {type(e).__name__}") from None
        finally:
            self.last_latency_ms = (time.perf_counter() - t0) * 1e3
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, _detail(resp))
        if resp.status_code == 204 or not resp.content:
            return None
        return resp.json()

    def get(self, path: str, token: str | None, *, timeout_s: float | None = None, **params) -> Any:
        return self.request("GET", path, token, params=params, timeout_s=timeout_s)

    def post(self, path: str, token: str | None, body: Any = None) -> Any:
        return self.request("POST", path, token, json=body if body is not None else {})

    # ---------------------------------------------------------------------------- reads ---
    def whoami(self, token: str) -> dict:
        return self.get("/whoami", token)

    def summary(self, token: str) -> dict:
        return self.get("/summary", token)

    def nodes(self, token: str) -> list[dict]:
        return self.get("/nodes", token)

    def history(self, token: str, *, start_s: float, end_s: float | None = None, step_s: float | None = None,
                node_id: str | None = None, limit: int = 100_000) -> list[dict]:
        """Node reports in [start_s, end_s), one row per node and bucket of ``step_s`` (the bucket's
        mean, ``ts_s`` its start ``floor(t / step_s) * step_s``), or raw reports without ``step_s``."""
        return self.get("/reports", token, start_s=start_s, end_s=end_s, step_s=step_s, node_id=node_id,
                        limit=limit, timeout_s=4 * self.timeout_s)

    def decisions(self, token: str, *, start_s: float | None = None, end_s: float | None = None,
                  node_id: str | None = None, source: str | None = None, q: str | None = None,
                  offset: int = 0, limit: int = 500) -> dict:
        return self.get("/decisions", token, start_s=start_s, end_s=end_s, node_id=node_id, source=source,
                        q=q, offset=offset, limit=limit)

    def bursts(self, token: str, *, start_s: float | None = None, end_s: float | None = None) -> list[dict]:
        return self.get("/bursts", token, start_s=start_s, end_s=end_s)

    def router_weights_history(self, token: str, *, limit: int = 200) -> list[dict]:
        """Pushed weight versions, newest first, each with its inputs and reason."""
        return self.get("/router/weights/history", token, limit=limit)

    def overrides(self, token: str, *, state: str | None = None) -> list[dict]:
        """Overrides (``state``: active, cleared or expired; all without)."""
        return self.get("/overrides", token, state=state)

    def audit(self, token: str, *, offset: int = 0, limit: int = 200) -> dict:
        return self.get("/audit", token, offset=offset, limit=limit)

    def policies(self, token: str) -> list[dict]:
        return self.get("/policies", token)

    def models(self, token: str) -> list[dict]:
        return self.get("/models", token)

    def rollouts(self, token: str) -> list[dict]:
        """Every kind's rollouts (policies and models), newest first."""
        return self.get("/rollouts", token, kind="all")

    def rollout(self, token: str, rollout_id: int) -> dict:
        return self.get(f"/rollouts/{int(rollout_id)}", token)

    def decision(self, token: str, decision: Mapping) -> dict | None:
        """The stored decision of a grid row (``id``, ``node_id``, ``ts_s``), with its features."""
        ts = float(decision["ts_s"])
        page = self.decisions(token, node_id=decision["node_id"], start_s=ts - 0.001, end_s=ts + 0.001, limit=50)
        return next((d for d in page["items"] if str(d["id"]) == str(decision["id"])), None)

    def report_at(self, token: str, node_id: str, ts_s: float) -> dict | None:
        """The node's raw report of the control interval at ``ts_s`` (the closest within a second)."""
        rows = self.history(token, start_s=ts_s - 1.0, end_s=ts_s + 1.0, node_id=node_id, limit=50)
        return min(rows, key=lambda r: abs(r["ts_s"] - ts_s), default=None)

    # -------------------------------------------------------------------------- actions ---
    def create_override(self, token: str, *, emb_share: float, reason: str, node_id: str | None = None,
                        ttl_s: float | None = None) -> dict:
        body = {"emb_share": emb_share, "reason": reason, "node_id": node_id}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        return self.post("/overrides", token, body)

    def clear_override(self, token: str, override_id: int, reason: str) -> dict:
        return self.post(f"/overrides/{int(override_id)}/clear", token, {"reason": reason})

    def upload_policy(self, token: str, tar: bytes) -> dict:
        """Register an artifact (a tar of its files); the control plane checks it with the node
        agent's loader first and answers 422 saying why when it is refused."""
        return self.request("POST", "/policies", token, content=tar, content_type="application/x-tar",
                            timeout_s=max(30.0, self.timeout_s))

    def activate_policy(self, token: str, version: str, reason: str) -> dict:
        from urllib.parse import quote

        return self.post(f"/policies/{quote(str(version), safe='')}/activate", token, {"reason": reason})

    def start_rollout(self, token: str, **body) -> dict:
        return self.post("/rollouts", token, body)

    def retire_node(self, token: str, node_id: str, reason: str) -> dict:
        """Drain and retire ``node_id`` (out of the node list, its tokens revoked; operator)."""
        from urllib.parse import quote

        return self.post(f"/nodes/{quote(str(node_id), safe='')}/retire", token, {"reason": reason})

    def rollout_action(self, token: str, rollout_id: int, action: str, reason: str) -> dict:
        if action not in ("promote", "pause", "resume", "rollback"):
            raise ValueError(f"unknown rollout action {action!r}")
        return self.post(f"/rollouts/{int(rollout_id)}/{action}", token, {"reason": reason})


# ---------------------------------------------------------------------- reshaping history ---

SERIES_FIELDS = ("emb_share", "emb_share_target", "p50_ms", "p99_ms", "slo_attainment", "throughput_rps",
                 "emb_hit_rate", "kv_hit_rate", "queue_depth", "num_requests")


def node_series(rows: Iterable[Mapping], fields: Sequence[str] = SERIES_FIELDS) -> dict[str, dict[str, list]]:
    """History rows -> ``{node_id: {"t_s": [...], field: [...]}}`` sorted by time; the API's
    ``emb_share_target`` is also given as ``target_emb_share`` (the figures' name)."""
    out: dict[str, dict[str, list]] = {}
    for r in sorted(rows, key=lambda r: (str(r["node_id"]), r["ts_s"])):
        s = out.setdefault(str(r["node_id"]), {"t_s": [], **{f: [] for f in fields}})
        s["t_s"].append(float(r["ts_s"]))
        for f in fields:
            s[f].append(r.get(f))
    for s in out.values():
        s["target_emb_share"] = s.get("emb_share_target", [])
    return out


def _num(v) -> float | None:
    if v is None:
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def cluster_series(rows: Iterable[Mapping]) -> dict[str, list]:
    """Cluster figures per timestamp across nodes: attainment and hit rates weighted by requests
    (plain mean where no request counts are given), the worst node's P99, summed throughput."""
    buckets: dict[float, list[Mapping]] = {}
    for r in rows:
        buckets.setdefault(float(r["ts_s"]), []).append(r)
    out: dict[str, list] = {k: [] for k in ("t_s", "slo_attainment", "p99_ms", "throughput_rps", "emb_hit_rate",
                                             "kv_hit_rate", "emb_share", "num_nodes")}
    for t in sorted(buckets):
        rs = buckets[t]
        out["t_s"].append(t)
        out["num_nodes"].append(len(rs))
        for f in ("slo_attainment", "emb_hit_rate", "kv_hit_rate", "emb_share"):
            pairs = [(_num(r.get(f)), _num(r.get("num_requests")) or 0.0) for r in rs]
            pairs = [(v, w) for v, w in pairs if v is not None]
            wsum = sum(w for _, w in pairs)
            if not pairs:
                out[f].append(None)
            elif wsum > 0 and f != "emb_share":
                out[f].append(sum(v * w for v, w in pairs) / wsum)
            else:
                out[f].append(sum(v for v, _ in pairs) / len(pairs))
        p99 = [v for v in (_num(r.get("p99_ms")) for r in rs) if v is not None]
        out["p99_ms"].append(max(p99) if p99 else None)
        thr = [v for v in (_num(r.get("throughput_rps")) for r in rs) if v is not None]
        out["throughput_rps"].append(sum(thr) if thr else None)
    return out
