"""The state a `gateway.gateway.Gateway` sets up and its parts share: `RequestPath`, `NodeWatch`,
`WeightsSync`, `RegistrySync` and `Uplink` derive from `GatewayState`, which declares it;
`Gateway.__init__` sets it."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx
    import numpy as np

    from .client_view import ClientView
    from .config import GatewayConfig
    from .decisions import HealthPolicy
    from .metrics import GatewayMetrics
    from .nodes import NodeLink
    from .router import Router
    from .traffic_sample import Sampler


class GatewayState:
    """Declarations only (every attribute is set by `Gateway.__init__`), and the control plane's
    bearer header."""

    # the settings, the clock, the metrics
    config: GatewayConfig
    clock: Callable[[], float]
    metrics: GatewayMetrics
    # the nodes: the router's state, what the gateway knows of each besides, the health thresholds
    router: Router | None
    links: list[NodeLink]
    item_shard: np.ndarray | None
    health_policy: HealthPolicy
    # HTTP to the nodes' feeds and the control plane, and the secrets it carries or wants
    client: httpx.AsyncClient | None
    control_plane: str | None
    token: str | None
    advertise_url: str | None
    push_token: str | None
    registered: bool
    registered_at_s: float
    fleet_token: str | None
    _fleet_headers: dict
    # the weights in force
    weights_version: int
    weights_source: str
    weights_computed_at_s: float | None
    weights_reasons: dict[str, str]
    # what clients see and the traffic samples, sent under ``gateway_id``
    gateway_id: str | None
    client_view: ClientView
    client_reports: collections.deque
    client_report_error: str | None
    client_reports_sent: int
    client_reports_dropped: int
    sampler: Sampler | None
    sample_error: str | None
    samples_sent: int

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}
