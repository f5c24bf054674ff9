"""What the control plane tells a node (``GET /api/v1/nodes/{id}/directives``), applied on the node.

- **override**: the override in force goes to `SmartAllocator.set_override` (its expiry converted
  from the control plane's clock, by the ``now_s`` of the answer, to the agent's; on an emulated
  device the time left is divided by its time scale, as a wall second is 1/K modelled second),
  and is cleared when the control plane no longer sends it;
- **policy**: a version other than the one running is downloaded, its SHA-256 checked against the
  digest, unpacked (`node_agent.downloads`), and loaded with `SmartAllocator.load_policy` (on any
  failure the old policy keeps running); the outcome is confirmed with
  ``POST /api/v1/nodes/{id}/policy`` ({policy_version, status: loaded|failed, error}), retried
  until the control plane acknowledges it. A version that failed is not retried until the
  control plane names another one (or another digest);
- **model**: a checkpoint (named by its digest) other than the one served is handled the same
  way (`Directives.apply_model`): downloaded, checked by the checkpoint loader against the served
  config and item count, swapped in on the device worker (`NodeAgent.swap_model`, i.e.
  `Engine.load_checkpoint`; a refused checkpoint leaves the current model serving), and confirmed
  with ``POST /api/v1/nodes/{id}/model`` ({model_version, status, error}).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.contract import API, MAX_ERROR_CHARS, MAX_SEND_PERIOD_S
from common.ids import path_segment

from .downloads import download_artifact
from .reports import WallTime, finite_or_none


@dataclass
class _AppliedOverride:
    key: tuple
    override: object  # the allocator's Override object we set


@dataclass
class _Slot:
    """One kind of version the control plane hands out (a policy, a model) and where it stands."""

    kind: str  # "policy" or "model": the download's folder and the confirmation's route
    field: str  # the version's name in the confirmation
    route: str  # the registry's collection
    confirmed_key: tuple | None = None  # (version, digest, rollout) confirmed as running
    failed: tuple[str, str] | None = None  # (version, digest) that failed: not tried again
    pending: dict | None = None  # an outcome the control plane has not acknowledged


def config_policy_version(policy) -> str | None:
    """The version a node reports before the control plane gave it one: its local artifact's id."""
    return None if policy is None else getattr(policy, "policy_id", None)


class Directives:
    """The node's side of the directives; called from the reporter thread only. ``client`` is the
    reporter's ``httpx.Client`` (base URL and token set), ``status`` its `ReporterStatus`."""

    def __init__(self, agent, client, config, status, wall: WallTime) -> None:
        self.agent = agent
        self.config = config
        self.status = status
        self.wall = wall
        self._client = client
        self._applied_override: _AppliedOverride | None = None
        self.send_period_s: float | None = None  # the control plane's send period (None: every control step)
        self._policy = _Slot("policy", "policy_version", "policies")
        self._model = _Slot("model", "model_version", "models")
        # the policy version the node runs (a control-plane version once one was loaded)
        pol = getattr(agent.allocator, "policy", None) if agent.allocator is not None else None
        self.policy_version: str | None = config_policy_version(pol)
        status.update(policy_version=self.policy_version)

    def set_send_period(self, value) -> None:
        """Follow the control plane's ``send_period_s`` (from registration or a directives answer);
        a value that is not a number in (0, MAX_SEND_PERIOD_S] means every control step."""
        period = finite_or_none(value)
        period = period if period is not None and 0 < period <= MAX_SEND_PERIOD_S else None
        if period != self.send_period_s:
            self.status.event(f"send period {period if period is not None else 'every control step'}"
                              f"{' s' if period is not None else ''} (the control plane's)")
        self.send_period_s = period

    @property
    def model_digest(self) -> str | None:
        """The digest of the checkpoint the engine serves (None: random weights)."""
        return (getattr(self.agent.engine, "model_info", None) or {}).get("digest")

    def pull(self, wall_now_s: float) -> bool:
        """Pull and apply the directives; False when the control plane did not answer them."""
        sent_at = self.agent.clock()  # the control plane's now_s is at or after this instant
        r = self._client.get(f"{API}/nodes/{self.config.node_id}/directives")
        if r.status_code == 404:
            self.status.update(registered=False)
            self.status.error(f"directives: HTTP 404 ({r.text[:200]}); registering again")
            return False
        if r.status_code != 200:
            self.status.error(f"directives: HTTP {r.status_code}: {r.text[:500]}")
            return False
        d = r.json()
        self.status.add(num_directive_pulls=1)
        self.status.ok()
        self.set_send_period(d.get("send_period_s"))
        server_now = finite_or_none(d.get("now_s"))
        self.apply_override(d.get("override"), server_now if server_now is not None else wall_now_s,
                            agent_now_s=sent_at)
        if d.get("policy"):
            self.apply_policy(d["policy"])
        if d.get("model"):
            self.apply_model(d["model"])
        return True

    def confirm_pending(self) -> bool:
        """Send the confirmations not yet acknowledged; False when one was not."""
        return self._confirm(self._policy) and self._confirm(self._model)

    def _clear_override(self, alloc) -> None:
        if self._applied_override is None:
            return
        if alloc.override is self._applied_override.override:
            alloc.clear_override()
            self.status.event(f"override {self._applied_override.key[0]} cleared by the control plane")
        self._applied_override = None
        self.status.update(override=None)

    def apply_override(self, od: dict | None, server_now_s: float, agent_now_s: float | None = None) -> None:
        """Apply the control plane's override (None: clear the one it set before).

        ``agent_now_s`` is the agent's time matching ``server_now_s``; the time the directive
        request was sent is used, which the control plane's clock can only have passed: the
        override then ends a round trip early at worst, never late."""
        alloc = self.agent.allocator
        if alloc is None:
            if od is not None:
                self.status.update(override={**od, "applied": False, "error": "no allocator on this node"})
            return
        if od is None:
            self._clear_override(alloc)
            return
        key = (od.get("override_id"), od.get("emb_share"), od.get("expires_at_s"))
        if self._applied_override is not None and self._applied_override.key == key:
            return  # applied already (the allocator drops it itself when it expires)
        now = self.agent.clock()
        ref = now if agent_now_s is None else agent_now_s
        exp = od.get("expires_at_s")
        # the control plane's seconds are wall seconds: on an emulated device (a ScaledClock) one
        # of them is 1/K of the agent's modelled second
        expires = None if exp is None else ref + (float(exp) - server_now_s) / self.wall.time_scale
        if expires is not None and expires <= now:
            return  # expired already by the control plane's clock; its expiry job will drop it
        reason = f"{od.get('reason', '')} (override {od.get('override_id')}, {od.get('scope', 'node')})"
        try:
            ov = alloc.set_override(float(od["emb_share"]), now_s=now, expires_at_s=expires, reason=reason)
        except (ValueError, KeyError, TypeError) as e:
            self.status.update(override={**od, "applied": False, "error": str(e)})
            self.status.event(f"override {od.get('override_id')} refused: {e}")
            self._applied_override = _AppliedOverride(key, None)
            return
        self._applied_override = _AppliedOverride(key, ov)
        self.status.update(override={**od, "applied": True, "expires_at_agent_s": expires})
        self.status.event(f"override {od.get('override_id')} applied: emb_share {ov.emb_share:.4f}"
                          + ("" if expires is None else f" for {expires - now:.1f} s"))

    def apply_policy(self, pol: dict) -> None:
        """Run the policy version the control plane names (``pol``: version, digest, download_url,
        rollout_id); on any failure the old policy keeps running."""
        alloc = self.agent.allocator

        def load(fetch: Callable[[], Path]) -> None:
            if alloc is None:
                raise RuntimeError("no allocator on this node (start the agent with --policy or --control-plane)")
            alloc.load_policy(fetch(), now_s=self.agent.clock())

        version = str(pol.get("version"))
        tried, error = self._apply_version(self._policy, pol, self.policy_version, load)
        if not tried:
            return
        if error is None:
            self.policy_version = version
            self.status.event(f"policy {version} loaded")
        else:
            self.status.event(f"policy {version} refused, keeping {self.policy_version}: {error}")
        self.status.update(policy_version=self.policy_version, policy_error=error)
        self._confirm(self._policy)

    def apply_model(self, md: dict) -> None:
        """Serve the checkpoint the control plane names (``md``: version = checkpoint digest, digest
        = the tar's SHA-256, download_url). Downloaded, checked (tar digest, then every file's and
        the manifest's digest, the config and item count this node serves, and the item-id mapping
        of the trace it serves: a checkpoint trained on another trace or item order with as many
        items would rank with every item's embedding in another item's place), then swapped in on
        the device worker (`NodeAgent.swap_model` -> `Engine.load_checkpoint`); on any failure the
        current model keeps serving. The outcome is confirmed with ``POST /nodes/{id}/model``."""
        version = str(md.get("version"))

        def load(fetch: Callable[[], Path]) -> None:
            from .model.checkpoint import load_checkpoint

            ecfg = self.agent.engine.config
            ck = load_checkpoint(fetch(), digest=version, num_items=ecfg.num_items, config=ecfg.model,
                                 item_keys_sha256=self.agent.info.get("item_keys_sha256"))
            self.agent.call_on_worker(lambda: self.agent.swap_model(ck)).result(timeout=120.0)

        tried, error = self._apply_version(self._model, md, self.model_digest, load)
        if not tried:
            return
        if error is None:
            self.status.event(f"model {version[:16]} loaded")
        else:
            self.status.event(f"model {version[:16]} refused, keeping {str(self.model_digest)[:16]}: {error}")
        self._confirm(self._model)

    def _apply_version(self, slot: _Slot, d: dict, running: str | None,
                       load: Callable[[Callable[[], Path]], None]) -> tuple[bool, str | None]:
        """Load the version directive ``d`` names unless it runs already (then confirm it once per
        directive) or failed already with that digest. ``load`` gets the download as a callable.
        Returns (whether a load was tried, its error); the outcome waits in ``slot.pending``."""
        version, digest = str(d.get("version")), str(d.get("digest", ""))
        key = (version, digest, d.get("rollout_id"))
        if version == running:
            if slot.confirmed_key != key:
                slot.confirmed_key = key
                slot.pending = _outcome(slot.field, version, None)
                self._confirm(slot)
            return False, None
        if slot.failed == (version, digest):
            return False, None
        url = d.get("download_url") or f"{API}/{slot.route}/{path_segment(version)}/artifact"
        error = None
        try:
            load(lambda: download_artifact(self._client, self.config.control_plane_url, self.config.state_dir,
                                           version, digest, url, kind=slot.kind))
        except Exception as e:  # noqa: BLE001 - any failure keeps the current version
            error = f"{type(e).__name__}: {e}"
        slot.failed = None if error is None else (version, digest)
        if error is None:
            slot.confirmed_key = key
        slot.pending = _outcome(slot.field, version, error)
        return True, error

    def _confirm(self, slot: _Slot) -> bool:
        """Send the slot's outcome (``POST /nodes/{id}/policy`` or ``/model``) until acknowledged."""
        if slot.pending is None:
            return True
        r = self._client.post(f"{API}/nodes/{self.config.node_id}/{slot.kind}", json=slot.pending)
        if r.status_code >= 300:
            self.status.error(f"{slot.kind} confirmation: HTTP {r.status_code}: {r.text[:500]}")
            return False
        slot.pending = None
        return True


def _outcome(field: str, version: str, error: str | None) -> dict:
    """The body of a policy or model confirmation."""
    return {field: version, "status": "loaded" if error is None else "failed",
            "error": None if error is None else error[:MAX_ERROR_CHARS]}
