"""The control plane's node list (``GET /api/v1/nodes``, re-read every ``registry_interval_s``;
`gateway.decisions.diff_registry` says what changed) and the gateway's registration for weight
pushes (``POST /api/v1/routers``, whose answer carries the push token). `RegistrySync` holds these
methods of `gateway.gateway.Gateway`."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx

from .decisions import diff_registry
from .state import GatewayState

log = logging.getLogger("racer.gateway")

REREGISTER_S = 60.0  # a registered gateway registers again this often (its push token comes with the answer)


class RegistrySync(GatewayState):
    """Reads the node list into the gateway (`Gateway._build` when it changed) and keeps the
    registration (``push_token``, ``registered``, ``registered_at_s``) fresh."""

    async def _refresh_registry(self, first: bool = False) -> None:
        last_err = None
        for attempt in range(10 if first else 1):
            try:
                r = await self.client.get(self.control_plane + "/api/v1/nodes", headers=self._headers(), timeout=5.0)
                if r.status_code != 200:
                    raise ValueError(f"GET /api/v1/nodes answered {r.status_code}: {r.text[:200]}")
                rows = r.json()
                if isinstance(rows, dict):
                    rows = rows.get("nodes", rows.get("items", []))
                nodes = [(str(n["node_id"]), str(n["address"])) for n in rows]
                break
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                last_err = f"{type(e).__name__}: {e}"
                if first:
                    await asyncio.sleep(0.5)
        else:
            if first:
                raise RuntimeError(f"cannot read the node list from {self.control_plane}: {last_err}")
            log.warning(json.dumps({"event": "registry_failed", "error": last_err}))
            return
        diff = diff_registry([(l.node_id, l.address) for l in self.links] if self.router is not None else [], nodes)
        if diff.empty:
            if first:
                log.warning(json.dumps({"event": "registry_empty", "control_plane": self.control_plane}))
            return
        await self._register()  # until it succeeds
        if diff.changed:
            log.warning(json.dumps({"event": "nodes_changed", "nodes": [n for n, _ in diff.nodes],
                                    "reason": diff.reason}))
            self._build(diff.nodes)
            if not first:
                await self._pull_residency_all()

    async def _register(self) -> None:
        """Register this gateway for weight pushes (``POST /api/v1/routers {url}``), and again every
        `REREGISTER_S`: the answer carries the push token (it changes if the control plane's key
        does)."""
        if not self.advertise_url or (self.registered and self.clock() - self.registered_at_s < REREGISTER_S):
            return
        try:
            r = await self.client.post(self.control_plane + "/api/v1/routers", json={"url": self.advertise_url},
                                       headers=self._headers(), timeout=5.0)
            try:
                token = r.json().get("push_token") if r.status_code < 300 else None
            except (ValueError, AttributeError):
                token = None
            if isinstance(token, str) and token:
                self.push_token, self.registered, self.registered_at_s = token, True, self.clock()
            else:
                log.warning(json.dumps({"event": "register_failed", "status": r.status_code, "error": r.text[:200]}))
        except httpx.HTTPError as e:
            log.warning(json.dumps({"event": "register_failed", "error": f"{type(e).__name__}: {e}"}))
