"""The weights in force at a gateway: a document the control plane pushes or the gateway pulls
(`WeightsSync.apply_weights`, judged by `gateway.decisions.weights_verdict`), or, without a
control plane, cost profiles re-derived from each node's ``GET /v1/metrics``
(`gateway.decisions.profile_from_metrics`). `WeightsSync` holds these methods of
`gateway.gateway.Gateway`."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx

from common.weights import CostProfile

from .decisions import WeightsInForce, profile_from_metrics, weights_verdict
from .state import GatewayState

log = logging.getLogger("racer.gateway")

DEFAULT_PROFILE = CostProfile(kv_recompute_us_per_token=1.0, emb_transfer_us_per_row=1.0, service_time_us=2_000.0,
                              queue_capacity=64)
PROFILE_FIELDS = ("kv_recompute_us_per_token", "emb_transfer_us_per_row", "service_time_us", "queue_capacity")


class WeightsSync(GatewayState):
    """The weights in force: their version, source (``control_plane`` or ``node_metrics``), time
    and per-node reasons (``weights_*``), and the profiles they set in the router's state."""

    def apply_weights(self, payload: dict) -> dict:
        """Apply a weights document (push or pull); raises ValueError naming the bad field."""
        if not isinstance(payload, dict):
            raise ValueError("body: must be a JSON object")
        version = payload.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version: must be an integer >= 0, got {version!r}")
        nodes = payload.get("nodes")
        if not isinstance(nodes, dict):
            raise ValueError("nodes: must be an object {node_id: cost profile}")
        profiles = {}
        for nid, p in nodes.items():
            if not isinstance(p, dict):
                raise ValueError(f"nodes.{nid}: must be an object")
            missing = [f for f in PROFILE_FIELDS if f not in p]
            if missing:
                raise ValueError(f"nodes.{nid}.{missing[0]}: field required")
            try:
                profiles[nid] = CostProfile(**{f: p[f] for f in PROFILE_FIELDS})
            except ValueError as e:
                raise ValueError(f"nodes.{nid}: {e}") from None
        computed = payload.get("computed_at_s")
        verdict = weights_verdict(version, WeightsInForce(self.weights_version, self.weights_source,
                                                          self.weights_computed_at_s))
        if not verdict.apply:
            if verdict.current:  # a push of what a pull already brought: nothing to do
                return {"applied": False, "current": True, "version": version, "reason": verdict.reason}
            return {"applied": False, "current": False, "reason": verdict.reason}
        st = self.router.state
        known = [n for n in profiles if n in st.index]
        # the state is rebuilt from this version alone: a node it does not name goes back to the
        # defaults instead of keeping what an older version said (a bad old profile never outlives it)
        for n, i in st.index.items():
            if n in profiles:
                st.profiles[i] = profiles[n]
                self.weights_reasons[n] = str(nodes[n].get("reason", "control plane"))[:512]
            else:
                st.profiles[i] = DEFAULT_PROFILE
                self.weights_reasons[n] = f"not in weights version {version}: defaults"
        if st.index:
            first = next(iter(st.index))
            st.set_profile(first, st.profiles[st.index[first]])  # re-derives the weights once
        self.weights_version = version
        self.weights_source = "control_plane"
        self.weights_computed_at_s = float(computed) if isinstance(computed, (int, float)) else time.time()
        self.metrics.weights_version.set(version)
        return {"applied": True, "version": version, "nodes": known,
                "ignored_unknown_nodes": sorted(set(profiles) - set(known))}

    async def _refresh_weights(self) -> None:
        if self.control_plane:
            try:
                r = await self.client.get(self.control_plane + "/api/v1/router/weights", headers=self._headers(),
                                          timeout=5.0)
                if r.status_code == 200:
                    self.apply_weights(r.json())
                else:
                    log.warning(json.dumps({"event": "weights_pull_failed", "status": r.status_code,
                                            "error": r.text[:200]}))
            except (httpx.HTTPError, ValueError) as e:
                log.warning(json.dumps({"event": "weights_pull_failed", "error": f"{type(e).__name__}: {e}"}))
            return
        if self.weights_source == "control_plane":  # a pushed document is in force: keep it
            return
        st = self.router.state
        changed = False

        async def one(i: int) -> None:
            nonlocal changed
            link = self.links[i]
            try:
                r = await self.client.get(link.address + "/v1/metrics", timeout=2.0)
                r.raise_for_status()
                costs = r.json().get("miss_costs") or {}
            except (httpx.HTTPError, ValueError):
                return
            old = st.profiles[i]
            p, self.weights_reasons[link.node_id] = profile_from_metrics(old, costs, link.service_time_us,
                                                                         self.config.queue_capacity)
            if p != old:
                st.profiles[i] = p
                changed = True

        await asyncio.gather(*(one(i) for i in range(len(self.links))))
        if changed or self.weights_computed_at_s is None:
            st.set_profile(0, st.profiles[0])
            self.weights_version += 1
            self.weights_computed_at_s = time.time()
            self.metrics.weights_version.set(self.weights_version)
