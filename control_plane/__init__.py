"""Control plane: the EMB-KV-aware router (pure logic), its residency metadata and weights.

`make_router(name, node_ids, profiles)` builds any policy of `POLICIES` behind one interface
(`Router.route`, `route_batch`, `report`, `complete`, `expire`); see docs/router.md.
"""

from .residency import HotShardTable, KvResidency
from .router import (
    POLICIES, ROUTERS, SOURCES, BatchRouting, ClusterState, NodeReport, NoLiveNodeError, ReportOutcome,
    RequestBatch, RouteRequest, Router, RouterConfig, RoutingDecision, ScoreBreakdown, make_router, score_nodes,
)
from .weights import CostProfile, RouterWeights, derive_weights, expected_saving_us

__all__ = [
    "POLICIES", "ROUTERS", "SOURCES", "BatchRouting", "ClusterState", "CostProfile", "HotShardTable",
    "KvResidency", "NoLiveNodeError", "NodeReport", "ReportOutcome", "RequestBatch", "RouteRequest", "Router",
    "RouterConfig", "RouterWeights", "RoutingDecision", "ScoreBreakdown", "derive_weights", "expected_saving_us",
    "make_router", "score_nodes",
]
