"""The gateway's settings (`GatewayConfig`): each field's range declared on it (`common.config`)
and checked at construction; `gateway.cli` reads the command line's defaults and help from them."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import ranged, validate
from common.contract import MAX_SAMPLE_ITEMS

from .router import POLICIES
from .traffic_sample import DEFAULT_SAMPLE_MAX_ITEMS

MAX_CLIENT_REPORT_INTERVAL_S = 600.0  # the control plane refuses a report's interval_s over 3600
MAX_SLO_MS = 1e6  # and its slo_ms over 1e6


def _positive(default: float, doc: str):
    return ranged(default, lo=0, lo_open=True, doc=doc)


def _count(default: int, doc: str):
    return ranged(default, lo=1, integer=True, doc=doc)


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway's settings, each field's range declared on it (`common.config`) and checked in
    ``__post_init__``; `gateway.cli.add_gateway_parser` reads the command line's defaults and help from them.

    Health checks follow SGLang's gateway (3 failures out, 2 successes back). ``request_timeout_s``
    is one forward attempt's limit (a request takes at most
    `gateway.decisions.MAX_ATTEMPTS`). ``client_report_interval_s``
    and ``slo_ms`` stay within what the control plane takes (a report's interval_s <= 3600, slo_ms
    <= 1e6): the measured interval runs a little over the configured one, so its cap is well below.
    """

    router: str = ranged("racer", choices=POLICIES, doc="routing policy")
    report_interval_s: float = _positive(0.5, "residency feed pull period, s")
    health_interval_s: float = _positive(1.0, "health check period, s")
    health_timeout_s: float = _positive(0.5, "health check timeout, s")
    health_failures: int = _count(3, "failures in a row that take a node out")
    health_successes: int = _count(2, "successes in a row that bring it back")
    request_timeout_s: float = _positive(10.0, "one forward attempt's limit, s")
    connect_timeout_s: float = _positive(1.0, "the connect part of a forward attempt's limit, s")
    weights_interval_s: float = _positive(5.0, "how often weights are pulled (control plane) or re-derived from "
                                               "the nodes' /v1/metrics, s")
    registry_interval_s: float = _positive(5.0, "how often the control plane's node list is re-read, s")
    queue_capacity: int = _count(64, "queue depth at which a node counts as full when the weights come from the "
                                     "nodes")
    num_shards: int = _count(64, "embedding shards; must match the nodes'")
    max_connections: int = _count(512, "pooled connections to all nodes together")
    max_body_bytes: int = _count(4 * 2**20, "most bytes of a request body (a recommendation or a weights "
                                            "push); a larger one gets 413 and is not forwarded; the node "
                                            "agent's default")
    slo_ms: float = ranged(30.0, lo=0, lo_open=True, hi=MAX_SLO_MS,
                           doc="latency SLO for the clients' SLO attainment, ms; as racer replay's")
    client_report_interval_s: float = ranged(1.0, lo=0.1, hi=MAX_CLIENT_REPORT_INTERVAL_S,
                                             doc="how often what clients see goes to the control plane, s; "
                                                 "with --control-plane")
    sample_rate: float = ranged(0.0, lo=0, hi=1, doc="fraction of users whose every request is sampled for a "
                                                     "what-if replay (0: off; > 0 needs --control-plane and a "
                                                     "key: --sample-key-file or $RACER_SAMPLE_KEY)")
    sample_max_items: int = ranged(DEFAULT_SAMPLE_MAX_ITEMS, lo=1, hi=MAX_SAMPLE_ITEMS, integer=True,
                                   doc="most item ids a sample keeps of each list (the history's most recent, "
                                       "the first new items and candidates); the history length is kept whole")
    sample_interval_s: float = ranged(2.0, lo=0.05, hi=600, doc="how often samples go to the control plane, s")

    def __post_init__(self) -> None:
        validate(self)
