"""The allocator's layers as functions (proposal in, (proposal, LayerTrace) out) and their
composition in `SmartAllocator.decide`: each decision carries every layer's trace, its flat
fields are read from them, and its reason is rendered from them."""

from __future__ import annotations

import json
import math

import pytest

from common.contract import DETAIL_FIELDS, LAYERS
from node_agent.allocator import (AllocatorConfig, GuardConfig, OperatingPointTuner, Override, RecoveryConfig,
                                  RecoveryController, ResidualAdapter, ResidualConfig, SmartAllocator, TunerConfig,
                                  base_layer, guard_layer, override_layer, recovery_layer, residual_layer)
from node_agent.allocator.trace import render_reason
from node_agent.features import NUM_FEATURES
from tests.test_allocator import constant_policy, window

import numpy as np


@pytest.fixture(scope="module")
def c60(tmp_path_factory):
    return constant_policy(tmp_path_factory.mktemp("c60") / "p", 0.6)


def test_base_layer_proposes_or_holds_with_its_reason():
    share, t = base_layer(None, "invalid WindowStats: p99_ms must be finite", 0.42)
    assert share == 0.42 and not t.acted and t.detail["hold_reason"].startswith("invalid")
    assert math.isnan(t.detail["output"]) and t.to_dict()["detail"]["output"] is None
    share, t = base_layer(None, None, 0.3)
    assert (share, t.acted, t.detail["hold_reason"]) == (0.3, False, "no base policy loaded")


def test_guard_layer_names_the_guard_and_its_limit():
    g = GuardConfig(min_emb_share=0.1, max_emb_share=0.9, max_step_up=0.05, max_step_down=0.1)
    share, t = guard_layer(0.8, 0.5, g, "residual")
    assert share == pytest.approx(0.55) and t.acted
    assert (t.detail["action"], t.detail["limit"], t.detail["source_in"]) == ("step_up", 0.05, "residual")
    share, t = guard_layer(0.95, 0.5, g, "override", step_limit=False)
    assert (share, t.detail["action"], t.detail["limit"]) == (0.9, "max", 0.9)
    share, t = guard_layer(0.45, 0.5, g, "base")
    assert share == 0.45 and not t.acted and t.detail["action"] is None and t.detail["limit"] is None


def test_override_layer_in_force_then_expired():
    ov = Override(0.7, set_at_s=0.0, expires_at_s=10.0, reason="maintenance")
    share, t, note = override_layer(ov, 5.0, 0.4, "base")
    assert (share, t.acted, note) == (0.7, True, None)
    assert t.detail["proposal_in"] == 0.4 and t.detail["reason"] == "maintenance"
    share, t, note = override_layer(ov, 10.0, 0.4, "base")
    assert (share, t.acted) == (0.4, False) and note == "override 0.7000 expired at t=10s"


def test_recovery_layer_caps_a_burst_kv_ward():
    rc = RecoveryController(RecoveryConfig(warmup_s=2.0))
    for i in range(5):  # baseline
        share, t, note = recovery_layer(rc, 100.0, 0.02, float(i), 0.6, 0.6, "base")
        assert share == 0.6 and not t.acted and note is None
    share, t, note = recovery_layer(rc, 400.0, 0.2, 5.0, 0.6, 0.7, "residual")
    d = t.detail
    assert t.acted and d["event"] == "entered" and d["phase"] == "burst" and d["capped"]
    assert share == pytest.approx(0.45) and d["cap"] == pytest.approx(0.45) and d["entry_emb_share"] == 0.6
    share, t, _ = recovery_layer(rc, 400.0, 0.2, 6.0, 0.45, 0.3, "base")
    assert share == 0.3 and t.acted and not t.detail["capped"]  # already under the cap


def test_residual_layer_adds_the_correction_and_the_tuner_offset():
    tuner = OperatingPointTuner(TunerConfig(confidence=0.0))
    adapter = ResidualAdapter(ResidualConfig())
    row = np.zeros(NUM_FEATURES, dtype=np.float32)
    # EMB-ward gradient: the EMB slab's ghost list says 10% more would save far more
    stats = window(emb_marginal_us=400.0, kv_marginal_us=0.0, load=0.5, num_requests=1000)
    share, t = residual_layer(adapter, tuner, row, stats, 0.5, 0.5, GuardConfig(), True)
    d = t.detail
    assert t.acted and d["tuner_action"] == "emb_ward" and d["tuner_step"] > 0
    assert share == pytest.approx(0.5 + d["correction"] + d["offset"])
    share2, t2 = residual_layer(adapter, tuner, row, stats, 0.5, share, GuardConfig(), False)  # under an override
    assert t2.detail["tuner_action"] is None and t2.detail["offset"] == d["offset"] and share2 == pytest.approx(share)


def test_decision_carries_every_layer_and_its_reason_is_rendered_from_them(c60):
    cfg = AllocatorConfig(guard=GuardConfig(max_step_up=0.05), device="cpu", recovery=RecoveryConfig(warmup_s=1.0))
    alloc = SmartAllocator(cfg, policy_dir=c60)
    alloc.set_override(0.3, now_s=0.0, expires_at_s=2.0, reason="drill")
    seen = []
    for i in range(6):
        d = alloc.decide(window(emb_share=0.5, emb_marginal_us=300.0, kv_marginal_us=0.0), float(i))
        names = [t.layer for t in d.layers]
        assert names[0] == "base" and names[-1] == "guard" and names == sorted(names, key=LAYERS.index)
        assert d.layers[-1].proposal == d.emb_share and d.layers[-2].proposal == d.proposed_emb_share
        assert d.reason == render_reason(d.layers, d.notes)
        for t in d.layers:
            assert len(t.values) == len(DETAIL_FIELDS[t.layer])
        json.dumps(d.to_dict(), allow_nan=False)
        seen.append((d.source, names, d))
    assert seen[0][0] == "override" and "override" in seen[0][1]
    assert seen[2][2].notes == ("override 0.3000 expired at t=2s",) and not seen[2][2].override_active
    # after the override: the base's 0.6 plus the tuner's EMB-ward offset, step-limited from 0.3
    d = seen[3][2]
    assert d.source == "guard" and d.layer_source == "residual" and d.guard_action == "step_up"
    res, guard = d.layer("residual"), d.layer("guard")
    assert d.tuner_offset == pytest.approx(res.detail["offset"] - guard.detail["taken_back"])
    assert d.tuner_step == pytest.approx(res.detail["tuner_step"] - guard.detail["taken_back"])
    if guard.detail["taken_back"] != 0.0:
        assert "the step limit took back" in d.reason
    assert d.reason.startswith("step limited to +0.05 from 0.3500; residual: base policy ")
    first = seen[2][2]  # the first decision after the override: its expiry in brackets
    assert first.reason.startswith("step limited to +0.05 from 0.3000; residual: base policy ")
    assert first.reason.endswith(" [override 0.3000 expired at t=2s]")


def test_every_allocator_is_a_node_allocator_driven_by_the_same_control_step(c60):
    """The simulator's baselines and the SmartAllocator share one interface (`NodeAllocator`):
    `decide_step` drives each node's allocator, and every decision says its source and why."""
    from node_agent.control import NodeAllocator, decide_step
    from simulator.allocators import HeuristicAllocator, ScheduleAllocator, StaticAllocator
    from simulator.smart import make_smart_allocator

    smart = make_smart_allocator("racer", c60)
    allocs = [StaticAllocator(0.3), HeuristicAllocator(step=0.05), ScheduleAllocator([0.5, 0.2, 0.8], 1.0), smart]
    for a in allocs:
        a.reset(2, 0.5)
        assert all(isinstance(n, NodeAllocator) for n in a.nodes)
    assert isinstance(smart.nodes[0], SmartAllocator) and smart.allocators is smart.nodes
    kv_costly = window(kv_hit_rate=0.1, history_len_p50=400.0, history_len_p99=800.0)  # KV misses cost more
    got = {a.name: [a.decide(0, kv_costly, float(t)) for t in range(3)] for a in allocs}
    assert got["static:0.30"] == [0.3, 0.3, 0.3]
    assert got["heuristic"] == pytest.approx([0.45, 0.4, 0.35])
    assert got["oracle"] == [0.5, 0.2, 0.8]
    reasons = {a.name: a.last_decisions[0].reason for a in allocs}
    assert reasons["static:0.30"] == "static split 0.3000"
    assert reasons["heuristic"].startswith("miss time per request: EMB ") and "KV-ward -0.05 to 0.3500" in reasons["heuristic"]
    assert reasons["oracle"] == "oracle: window 2's share 0.8000"
    assert {a.name: dict(a.decisions_by_source) for a in allocs[:3]} == {
        "static:0.30": {"static": 3}, "heuristic": {"heuristic": 3}, "oracle": {"schedule": 3}}
    assert sum(smart.decisions_by_source.values()) == 3 and smart.last_decisions[1] is None
    d = decide_step(StaticAllocator(0.7).make_node(0, 0.5), kv_costly, 9.0)
    assert d.to_dict() == {"now_s": 9.0, "emb_share": 0.7, "source": "static", "reason": "static split 0.7000"}
