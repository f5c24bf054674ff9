"""Workloads: real-trace loaders and the Steady / Trend / Burst request regimes."""

from .loaders import LOADERS, TraceFormatError, default_path, load_trace
from .regimes import REGIMES, RegimeConfig, Request, RequestStream, generate
from .trace import Trace, shard_map, synthetic_trace

__all__ = [
    "LOADERS", "REGIMES", "RegimeConfig", "Request", "RequestStream", "Trace", "TraceFormatError",
    "default_path", "generate", "load_trace", "shard_map", "synthetic_trace",
]
