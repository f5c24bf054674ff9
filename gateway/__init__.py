"""The request path, its own process (`racer gateway`): the EMB-KV-aware router (pure logic), its
residency metadata, and the gateway that runs it in front of the node agents.

`make_router(name, node_ids, profiles)` builds any policy of `POLICIES` behind one interface
(`Router.route`, `route_batch`, `report`, `complete`, `expire`); see docs/router.md. The cost
profiles and the weights derived from them are `common.weights` (the control plane validates and
stores them too). The gateway process: `gateway.gateway.Gateway`, its HTTP app `gateway.app`, its
command line `gateway.cli`; see docs/gateway.md.
"""

from common.weights import CostProfile, RouterWeights, derive_weights, expected_saving_us

from .residency import HotShardTable, KvResidency
from .router import (
    POLICIES, ROUTERS, SOURCES, BatchRouting, ClusterState, NodeReport, NoLiveNodeError, ReportOutcome,
    RequestBatch, RouteRequest, Router, RouterConfig, RoutingDecision, ScoreBreakdown, make_router, score_nodes,
)

__all__ = [
    "POLICIES", "ROUTERS", "SOURCES", "BatchRouting", "ClusterState", "CostProfile", "HotShardTable",
    "KvResidency", "NoLiveNodeError", "NodeReport", "ReportOutcome", "RequestBatch", "RouteRequest", "Router",
    "RouterConfig", "RouterWeights", "RoutingDecision", "ScoreBreakdown", "derive_weights", "expected_saving_us",
    "make_router", "score_nodes",
]
