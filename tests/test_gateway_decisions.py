"""The gateway's pure decisions (gateway.decisions): scripted sequences over virtual
time, exact states and choices."""

from __future__ import annotations

import math

import numpy as np
import pytest

from common.weights import CostProfile
from gateway.decisions import (Attempt, HealthEvent, HealthPolicy, HealthState, RetrySnapshot, WeightsInForce,
                               choose_retry, client_report_step, diff_registry, health_transition,
                               profile_from_metrics, service_time_changed, weights_verdict)

IDS = ("a", "b", "c", "d")
INF = math.inf


def snap(score=None, alive=(True, True, True, True), load=(0.1, 0.2, 0.3, 0.4)):
    return RetrySnapshot(IDS, None if score is None else np.asarray(score, dtype=np.float64),
                         np.asarray(alive, dtype=bool), np.asarray(load, dtype=np.float64))


# ----------------------------------------------------------------------------------- retry ---
def test_retry_goes_to_the_best_scored_live_node_not_tried():
    s = snap(score=[9.0, 5.0, 7.0, 8.0], alive=[True, True, True, False])
    c = choose_retry(Attempt((0,), "connect"), s)
    assert (c.node, c.status, c.give_up) == (2, None, False)  # d scores 8 but is out of rotation
    assert c.reason.startswith("connect on a: retry on c")


def test_retry_by_score_does_not_mutate_the_snapshot():
    score, alive = np.array([9.0, 5.0, 7.0, 8.0]), np.array([True, True, True, False])
    choose_retry(Attempt((0,), "5xx"), RetrySnapshot(IDS, score, alive, np.zeros(4)))
    assert score.tolist() == [9.0, 5.0, 7.0, 8.0] and alive.tolist() == [True, True, True, False]


def test_retry_by_score_ties_go_to_the_lowest_index():
    assert choose_retry(Attempt((3,), "5xx"), snap(score=[1.0, 4.0, 4.0, 9.0])).node == 1


def test_retry_without_scores_goes_to_the_least_loaded_node_not_tried():
    s = snap(load=[0.05, INF, 0.3, 0.2])  # b out of rotation: infinite load
    assert choose_retry(Attempt((0,), "timeout"), s).node == 3
    assert choose_retry(Attempt((3,), "timeout"), s).node == 0


def test_retry_gives_up_with_504_after_a_timeout_and_502_otherwise():
    only = snap(score=[1.0, 2.0, 3.0, 4.0], alive=[False, False, True, False])
    for kind, status in (("timeout", 504), ("connect", 502), ("5xx", 502)):
        c = choose_retry(Attempt((2,), kind), only)
        assert (c.node, c.status, c.give_up) == (None, status, True)
        assert c.reason == f"{kind} on c: no other node is live to retry on"
    c = choose_retry(Attempt((0,), "connect"), snap(load=[0.1, INF, INF, INF]))
    assert (c.node, c.status) == (None, 502)


def test_retry_once_at_most():
    s = snap(score=[1.0, 2.0, 3.0, 4.0])
    first = choose_retry(Attempt((3,), "5xx"), s)
    assert first.node == 2
    second = choose_retry(Attempt((3, first.node), "timeout"), s)
    assert (second.node, second.status) == (None, 504)
    assert second.reason == "timeout on c: 2 attempts made, no more (at most 2)"
    third = choose_retry(Attempt((3, 2), "5xx"), s, max_attempts=3)  # if more were allowed: not a tried one
    assert third.node == 1


def test_retry_refuses_an_unknown_failure_kind():
    with pytest.raises(ValueError, match="attempt.kind"):
        choose_retry(Attempt((0,), "4xx"), snap())


# ---------------------------------------------------------------------------------- health ---
def run_health(events, policy=HealthPolicy(3, 2), state=HealthState()):
    """Apply ``(ok, t)`` events in order; the (live, failures, successes, change) after each."""
    out = []
    for ok, t in events:
        tr = health_transition(state, HealthEvent(ok, None if ok else f"down at {t}"), t, policy)
        state = tr.state
        out.append((state.live, state.failures, state.successes, tr.change))
    return state, out


def test_health_three_failures_out_two_successes_back_in():
    state, steps = run_health([(False, 1.0), (False, 2.0), (True, 3.0), (False, 4.0), (False, 5.0), (False, 6.0),
                               (False, 7.0), (True, 8.0), (False, 9.0), (True, 10.0), (True, 11.0), (True, 12.0)])
    assert steps == [
        (True, 1, 0, None), (True, 2, 0, None),
        (True, 0, 1, None),  # a success resets the failure count: three more needed
        (True, 1, 0, None), (True, 2, 0, None), (False, 3, 0, "out"),
        (False, 4, 0, None),  # failing while out: no change
        (False, 0, 1, None), (False, 1, 0, None),  # a failure resets the success count
        (False, 0, 1, None), (True, 0, 2, "in"),
        (True, 0, 3, None)]
    assert state == HealthState(True, 0, 3, None, 11.0)  # since_s: when it came back


def test_health_out_state_keeps_the_error_and_when():
    p = HealthPolicy(failures_out=1, successes_in=1)
    t = health_transition(HealthState(), HealthEvent(False, "connect: refused"), 42.5, p)
    assert t.change == "out" and t.state == HealthState(False, 1, 0, "connect: refused", 42.5)
    assert t.reason == "1 failures in a row (>= 1): out of rotation (connect: refused)"
    t2 = health_transition(t.state, HealthEvent(False, "healthz 500: boom"), 43.0, p)
    assert t2.change is None and t2.state == HealthState(False, 2, 0, "healthz 500: boom", 42.5)
    t3 = health_transition(t2.state, HealthEvent(True), 44.0, p)
    assert t3.change == "in" and t3.state == HealthState(True, 0, 1, None, 44.0)


def test_health_success_while_live_keeps_the_last_error():
    s = health_transition(HealthState(), HealthEvent(False, "timeout"), 1.0).state
    s = health_transition(s, HealthEvent(True), 2.0).state
    assert s == HealthState(True, 0, 1, "timeout", None)


def test_health_policy_ranges():
    for kw in ({"failures_out": 0}, {"successes_in": True}, {"failures_out": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            HealthPolicy(**kw)


# -------------------------------------------------------------------------------- registry ---
def test_registry_unchanged():
    cur = [("a", "http://h:1"), ("b", "http://h:2")]
    d = diff_registry(cur, list(cur))
    assert (d.changed, d.empty, d.added, d.removed, d.readdressed, d.reordered) == (False, False, (), (), (), False)
    assert d.reason == "unchanged: 2 nodes"


def test_registry_added_removed_readdressed():
    d = diff_registry([("a", "http://h:1"), ("b", "http://h:2"), ("c", "http://h:3")],
                      [("a", "http://h:1"), ("c", "http://h:33"), ("d", "http://h:4")])
    assert d.changed and not d.empty and not d.reordered
    assert (d.added, d.removed, d.readdressed) == (("d",), ("b",), ("c",))
    assert d.nodes == (("a", "http://h:1"), ("c", "http://h:33"), ("d", "http://h:4"))
    assert d.reason == "added d; removed b; readdressed c"


def test_registry_address_with_a_trailing_slash_is_the_same_address():
    d = diff_registry([("a", "http://h:1")], [("a", "http://h:1/")])
    assert not d.changed and d.readdressed == () and d.nodes == (("a", "http://h:1"),)


def test_registry_order_alone_counts_as_a_change():
    d = diff_registry([("a", "x"), ("b", "y")], [("b", "y"), ("a", "x")])
    assert d.changed and d.reordered and (d.added, d.removed, d.readdressed) == ((), (), ())
    assert d.reason == "the same nodes in another order"


def test_registry_empty_list_keeps_the_known_nodes_and_first_list_adds_all():
    d = diff_registry([("a", "x")], [])
    assert d.empty and not d.changed and d.nodes == (("a", "x"),)
    first = diff_registry([], [("a", "x"), ("b", "y")])
    assert first.changed and first.added == ("a", "b") and first.removed == ()


# --------------------------------------------------------------------------------- weights ---
def test_weights_verdicts():
    pulled = WeightsInForce(version=7, source="control_plane", computed_at_s=100.0)
    assert weights_verdict(8, pulled).apply
    v = weights_verdict(7, pulled)
    assert (v.apply, v.current, v.reason) == (False, True, "already in force")
    v = weights_verdict(6, pulled)
    assert (v.apply, v.current, v.reason) == (False, False, "version 6 < version in force 7")
    # derived from the nodes, or never computed: any control-plane version replaces them
    assert weights_verdict(0, WeightsInForce(12, "node_metrics", 100.0)).apply
    assert weights_verdict(3, WeightsInForce(7, "control_plane", None)).apply


def test_profile_from_metrics():
    old = CostProfile(kv_recompute_us_per_token=1.0, emb_transfer_us_per_row=2.0, service_time_us=3000.0,
                      queue_capacity=64)
    p, why = profile_from_metrics(old, {"kv_recompute_us_per_token": {"0": 4.0, "1": 8.0, "2": 5.0},
                                        "emb_transfer_us_per_row": 0.5}, 1500.0, 32)
    assert p == CostProfile(kv_recompute_us_per_token=5.0, emb_transfer_us_per_row=0.5, service_time_us=1500.0,
                            queue_capacity=32)
    assert why == "miss costs from the node's /v1/metrics"
    p, why = profile_from_metrics(old, {}, None, 64)
    assert p == old and why.startswith("defaults:")
    assert service_time_changed(1000.0, 1101.0) and not service_time_changed(1000.0, 1100.0)
    assert service_time_changed(1000.0, 899.0) and not service_time_changed(1000.0, 900.0)


# -------------------------------------------------------------------------- client reports ---
def test_client_report_steps_over_a_scripted_exchange():
    """70 pending reports, one of them refused: 422 on 60 -> halves -> ... -> the one dropped alone,
    then whole batches again."""
    steps = [(client_report_step(status, n, 60).action, client_report_step(status, n, 60).next_size)
             for status, n in ((None, 60), (503, 60), (401, 60), (409, 60), (429, 60),
                               (422, 60), (422, 30), (200, 15), (422, 15), (200, 7), (422, 7), (422, 3),
                               (422, 1), (413, 1), (403, 5), (200, 60), (302, 1))]
    assert steps == [("keep", None)] * 5 + [
        ("split", 30), ("split", 15), ("sent", None), ("split", 7), ("sent", None), ("split", 3), ("split", 1),
        ("drop", 60), ("drop", None), ("drop", None), ("sent", None), ("sent", None)]


# --------------------------------------------------------------------- the gateway's config ---
def test_gateway_command_line_reads_its_defaults_and_ranges_from_the_config(capsys):
    import argparse

    from common.config import config_kwargs
    from gateway.cli import CLI_CONFIG_FIELDS, add_gateway_parser
    from gateway.config import GatewayConfig

    p = argparse.ArgumentParser()
    add_gateway_parser(p.add_subparsers())
    args = p.parse_args(["gateway", "--nodes", "http://h:1"])
    assert GatewayConfig(**config_kwargs(args, CLI_CONFIG_FIELDS)) == GatewayConfig()
    args = p.parse_args(["gateway", "--health-failures", "5", "--slo-ms", "50", "--router", "least_load"])
    cfg = GatewayConfig(**config_kwargs(args, CLI_CONFIG_FIELDS))
    assert (cfg.health_failures, cfg.slo_ms, cfg.router) == (5, 50.0, "least_load")
    for bad in (["--client-report-interval-s", "601"], ["--health-successes", "0"], ["--slo-ms", "nan"]):
        with pytest.raises(SystemExit):
            p.parse_args(["gateway", *bad])
        assert bad[0] in capsys.readouterr().err
    with pytest.raises(ValueError, match="invalid GatewayConfig: slo_ms must be in"):
        GatewayConfig(slo_ms=1e6 + 1)
