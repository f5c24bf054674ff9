"""A decision's layer traces from the allocator to the control plane and back, over real HTTP:
what the node agent's reporter sends (`node_agent.reports.report_layers` of a real decision) is stored
and returned by GET /decisions; a hostile layers payload gets a 422 and nothing is stored."""

from __future__ import annotations

import json

import pytest

from node_agent.allocator import LAYERS, AllocatorConfig, SmartAllocator
from node_agent.reports import report_layers
from tests.test_allocator import window

from .cp_util import REPO, ControlPlane, Database, register, report


@pytest.fixture(scope="module")
def cp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp_layers")
    c = ControlPlane(Database("sqlite", tmp).url, tmp / "cp.log")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def lay2(cp):
    node = cp.node("lay2")
    register(node, "lay2")
    return node


def _decision(i: int) -> dict:
    alloc = SmartAllocator(AllocatorConfig(device="cpu"), policy_dir=REPO / "policies" / "default")
    alloc.set_override(0.3, now_s=0.0, expires_at_s=1.0, reason="drill ünïcode")
    for t in range(i + 1):
        d = alloc.decide(window(emb_marginal_us=50.0, kv_marginal_us=10.0), float(t))
    rec = json.loads(json.dumps(d.to_dict()))  # what the agent's /v1/metrics carries
    return {"source": rec["source"], "emb_share": rec["emb_share"], "reason": rec["reason"],
            "prev_emb_share": rec["prev_emb_share"], "features": rec["features"],
            "layers": report_layers(rec["layers"])}


def test_layers_are_stored_and_returned(cp):
    node = cp.node("lay1")
    register(node, "lay1")
    decisions = [_decision(0), _decision(2)]
    assert [t["layer"] for t in decisions[0]["layers"]] == ["base", "residual", "recovery", "override", "guard"]
    r = node.post("/nodes/lay1/reports", json={"reports": [report(i, ts_s=100.0 + i, decision=d)
                                                           for i, d in enumerate(decisions)]})
    assert r.status_code == 200, r.text
    items = sorted(cp.admin.get("/decisions", params={"node_id": "lay1"}).json()["items"], key=lambda x: x["seq"])
    assert [it["layers"] for it in items] == [d["layers"] for d in decisions]
    ov = items[0]["layers"][3]
    assert ov["acted"] and ov["detail"]["reason"] == "drill ünïcode" and ov["proposal"] == 0.3
    # a decision without layers (an older agent) is stored with none
    r = node.post("/nodes/lay1/reports", json={"reports": [report(5, ts_s=105.0, decision={
        "source": "base", "emb_share": 0.5, "reason": "x"})]})
    assert r.status_code == 200
    items = cp.admin.get("/decisions", params={"node_id": "lay1", "q": "x"}).json()["items"]
    assert [it["layers"] for it in items if it["seq"] == 5] == [None]


@pytest.mark.parametrize("layers, loc", [
    ([{"layer": "base", "acted": True}] * (len(LAYERS) + 1), ["layers"]),
    ([{"layer": "oracle", "acted": True}], ["layers", 0, "layer"]),
    ([{"layer": "base", "proposal": 1e300}], ["layers", 0, "proposal"]),
    ([{"layer": "base", "detail": {f"k{i}": 1.0 for i in range(17)}}], ["layers", 0, "detail"]),
    ([{"layer": "base", "detail": {"x": {"nested": 1}}}], ["layers", 0, "detail", "x"]),
    ([{"layer": "base", "detail": {"x": "y" * 501}}], ["layers", 0, "detail", "x"]),
    ([{"layer": "base", "acted": "yes"}], ["layers", 0, "acted"]),
])
def test_hostile_layers_get_422_and_nothing_is_stored(cp, lay2, layers, loc):
    node = lay2
    r = node.post("/nodes/lay2/reports", json={"reports": [report(0, ts_s=1.0, decision={
        "source": "base", "emb_share": 0.5, "layers": layers})]})
    assert r.status_code == 422, r.text
    got = r.json()["detail"][0]["loc"]
    assert got[:3] == ["body", "reports", 0] and got[3:4] == ["decision"] and got[4:4 + len(loc)] == loc
    assert cp.admin.get("/decisions", params={"node_id": "lay2"}).json()["total"] == 0
