"""Cluster simulator: the node agent's memory code, the real router and the allocators on a
virtual clock with a cost model, to run 32+ node clusters on one machine."""

from .allocators import Allocator, HeuristicAllocator, ScheduleAllocator, StaticAllocator, make_allocator
from .cluster import SimConfig, SimResult, simulate
from .profiles import A100_HSTU, PROFILES, CostProfile, from_node_profile, get_profile

__all__ = [
    "A100_HSTU", "PROFILES", "Allocator", "CostProfile", "HeuristicAllocator", "ScheduleAllocator", "SimConfig",
    "SimResult", "StaticAllocator", "from_node_profile", "get_profile", "make_allocator", "simulate",
]
