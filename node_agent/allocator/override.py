"""The override layer: an operator's emb_share, in force over every other layer until it expires."""

from __future__ import annotations

from dataclasses import dataclass

from node_agent.allocator.trace import LayerTrace


@dataclass(frozen=True)
class Override:
    """An operator's emb_share; in force from ``set_at_s`` until ``expires_at_s`` (None: until cleared)."""

    emb_share: float
    set_at_s: float
    expires_at_s: float | None
    reason: str

    def expired(self, now_s: float) -> bool:
        return self.expires_at_s is not None and now_s >= self.expires_at_s


def override_layer(override: Override, now_s: float, proposal: float, source_in: str) -> tuple[float, LayerTrace, str | None]:
    """The operator's share replaces the proposal while ``override`` is in force at ``now_s``.
    Returns ``(proposal, trace, note)``: ``note`` says the override expired (the caller drops it),
    else None. Detail: ``active``, ``emb_share``, ``reason``, ``expires_at_s``, ``proposal_in``,
    ``source_in``."""
    if override.expired(now_s):
        return proposal, LayerTrace("override", proposal, False, (False, override.emb_share, override.reason,
                                                                  override.expires_at_s, proposal, source_in)), \
            f"override {override.emb_share:.4f} expired at t={override.expires_at_s:g}s"
    return override.emb_share, LayerTrace("override", override.emb_share, True,
                                          (True, override.emb_share, override.reason, override.expires_at_s,
                                           proposal, source_in)), None
