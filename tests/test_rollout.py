"""The canary judge (Mann-Whitney U, guardrails, minimum samples) and the rollout state machine."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from control_plane.rollout import (
    EVENTS, TERMINAL_STATES, Action, InvalidTransition, NodeLoad, RolloutConfig, RolloutState, RolloutStats,
    RolloutStatus, Verdict, WindowSamples, apply_action, apply_event, evaluate_rollout, judge_metric,
    mann_whitney_u, rank_average,
)

# ------------------------------------------------------------------ Mann-Whitney U


def u_by_pairs(x, y) -> float:
    """U of x by its definition: pairs (x_i, y_j) with x_i > y_j, ties counting one half."""
    return sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in x for b in y)


def test_u_test_without_ties_matches_the_hand_computation():
    # U = 0 (every x below every y); mean 9/2, var 3*3/12*(6+1) = 5.25; z = (0 - 4.5 + 0.5)/sqrt(5.25)
    r = mann_whitney_u([1, 2, 3], [4, 5, 6], alternative="less")
    assert r.u == 0.0
    assert r.z == pytest.approx(-4.0 / math.sqrt(5.25))
    assert r.p_value == pytest.approx(0.040428, abs=1e-6)  # Phi(-1.745743)
    g = mann_whitney_u([1, 2, 3], [4, 5, 6], alternative="greater")
    assert g.p_value == pytest.approx(1 - 0.5 * math.erfc(-(-4.5 - 0.5) / math.sqrt(5.25) / math.sqrt(2)))
    two = mann_whitney_u([1, 2, 3], [4, 5, 6])
    assert two.p_value == pytest.approx(2 * 0.040428, abs=2e-6)


def test_u_test_with_ties_matches_the_hand_computation():
    # sorted: 1 | 2 2 2 | 3 3 | 4 | 5 -> ranks 1 | 3 3 3 | 5.5 5.5 | 7 | 8; x ranks 1+3+3+5.5 = 12.5
    x, y = [1, 2, 2, 3], [2, 3, 4, 5]
    np.testing.assert_allclose(rank_average(np.array(x + y)), [1, 3, 3, 5.5, 3, 5.5, 7, 8])
    r = mann_whitney_u(x, y, alternative="less")
    assert r.u == 2.5 == u_by_pairs(x, y)
    # ties: groups of 3 and 2 -> sum(t^3 - t) = 24 + 6 = 30; var = 16/12 * (9 - 30/56)
    var = 16 / 12 * (9 - 30 / 56)
    assert r.z == pytest.approx((2.5 - 8 + 0.5) / math.sqrt(var))
    assert r.p_value == pytest.approx(0.068329, abs=1e-6)


def test_u_statistic_equals_pair_count_on_random_samples_with_ties():
    rng = np.random.default_rng(1)
    for _ in range(50):
        x = rng.integers(0, 6, size=rng.integers(1, 15)).astype(float)
        y = rng.integers(0, 6, size=rng.integers(1, 15)).astype(float)
        assert mann_whitney_u(x, y).u == u_by_pairs(x, y)


def test_normal_approximation_is_close_to_the_exact_permutation_p_value():
    # exact one-sided p by enumerating every split of the 16 pooled values into 8 + 8
    rng = np.random.default_rng(7)
    x = rng.normal(1.0, 1.0, 8)
    y = rng.normal(0.0, 1.0, 8)
    pooled = np.concatenate([x, y])
    ranks = rank_average(pooled)
    u_obs = mann_whitney_u(x, y).u
    us = np.array([ranks[list(c)].sum() - 36 for c in itertools.combinations(range(16), 8)])
    exact_greater = float((us >= u_obs).mean())
    approx = mann_whitney_u(x, y, alternative="greater").p_value
    assert abs(approx - exact_greater) < 0.01, (approx, exact_greater)
    assert exact_greater < 0.05 and approx < 0.05


def test_all_equal_values_give_no_evidence():
    r = mann_whitney_u([1.0] * 12, [1.0] * 12, alternative="less")
    assert (r.u, r.z, r.p_value) == (72.0, 0.0, 1.0)


@pytest.mark.parametrize("x, y, msg", [([], [1.0], "non-empty"), ([1.0, math.nan], [1.0], "finite"),
                                       ([1.0], [math.inf], "finite")])
def test_u_test_refuses_bad_samples(x, y, msg):
    with pytest.raises(ValueError, match=msg):
        mann_whitney_u(x, y)
    with pytest.raises(ValueError, match="alternative"):
        mann_whitney_u([1.0], [2.0], alternative="bigger")


# ------------------------------------------------------------------ the judge

CFG = RolloutConfig(bake_time_s=60.0, min_samples=10, alpha=0.01, max_p99_regression_pct=10.0,
                    max_slo_attainment_drop=0.02, load_timeout_s=30.0)


def windows(rng, n, p99=40.0, p99_sd=4.0, slo=0.97, slo_sd=0.01) -> WindowSamples:
    return WindowSamples(slo_attainment=np.clip(rng.normal(slo, slo_sd, n), 0, 1).tolist(),
                         p99_ms=rng.normal(p99, p99_sd, n).tolist())


def baking(canary: WindowSamples, baseline: WindowSamples, **kw) -> RolloutStats:
    return RolloutStats(state=RolloutState.BAKING, started_at_s=0.0, bake_started_at_s=10.0, canary=canary,
                        baseline=baseline, canary_nodes=kw.pop("nodes", {"n0": NodeLoad.LOADED}), **kw)


def test_a_deliberately_worse_canary_is_rolled_back_with_its_figures():
    rng = np.random.default_rng(0)
    worse = windows(rng, 30, p99=55.0, slo=0.90)
    base = windows(rng, 30)
    a = evaluate_rollout(baking(worse, base), now_s=100.0, config=CFG)
    assert a.action is Action.ROLLBACK and a.verdict is Verdict.FAIL
    by = {j.metric: j for j in a.judgements}
    assert by["p99_ms"].verdict is Verdict.FAIL and by["slo_attainment"].verdict is Verdict.FAIL
    assert by["p99_ms"].n_canary == 30 and by["p99_ms"].n_baseline == 30
    assert by["p99_ms"].change > 10.0 and by["p99_ms"].p_value < 1e-6
    assert by["slo_attainment"].change == pytest.approx(by["slo_attainment"].mean_baseline
                                                        - by["slo_attainment"].mean_canary)
    assert "p99_ms: canary worse" in a.reason and "slo_attainment: canary worse" in a.reason
    d = json.loads(json.dumps(a.to_dict()))
    assert d["action"] == "rollback" and d["judgements"][1]["verdict"] == "fail"


def test_worse_on_one_metric_only_is_enough_to_fail():
    rng = np.random.default_rng(3)
    canary = windows(rng, 20, p99=60.0)  # same SLO attainment, P99 50 % higher
    a = evaluate_rollout(baking(canary, windows(rng, 20)), 100.0, CFG)
    assert a.action is Action.ROLLBACK
    assert [j.verdict for j in a.judgements] == [Verdict.PASS, Verdict.FAIL]


def test_identical_distributions_are_failed_at_most_alpha_of_the_time():
    # noisy windows (P99 coefficient of variation 20 %), 15 per side: the guardrail alone would
    # fail many of these; significance (Bonferroni over the two metrics) bounds the rate by alpha
    fails = []
    for seed in range(1000):
        rng = np.random.default_rng(seed)
        a = evaluate_rollout(baking(windows(rng, 15, p99_sd=8.0), windows(rng, 15, p99_sd=8.0)), 100.0, CFG)
        fails.append(a.verdict is Verdict.FAIL)
    assert np.mean(fails) <= CFG.alpha  # measured 4 of 1000 at alpha 0.01
    # quiet windows (5 %): a fail needs a +10 % median shift, which chance does not produce
    for seed in range(300):
        rng = np.random.default_rng(seed)
        a = evaluate_rollout(baking(windows(rng, 15, p99_sd=2.0), windows(rng, 15, p99_sd=2.0)), 100.0, CFG)
        assert a.verdict is not Verdict.FAIL, a.reason
    same = windows(np.random.default_rng(9), 12)
    a = evaluate_rollout(baking(same, same), 100.0, CFG)
    assert (a.action, a.verdict) == (Action.PROMOTE, Verdict.PASS)
    assert all(j.p_value >= 0.4 for j in a.judgements)


def test_a_better_canary_is_promoted():
    rng = np.random.default_rng(4)
    a = evaluate_rollout(baking(windows(rng, 20, p99=30.0, slo=0.99), windows(rng, 20)), 100.0, CFG)
    assert (a.action, a.verdict) == (Action.PROMOTE, Verdict.PASS)


def test_significant_but_within_the_guardrail_passes():
    rng = np.random.default_rng(5)
    canary = windows(rng, 40, p99=41.2, p99_sd=0.2)  # +3 %, very low noise: significant, small
    j = judge_metric("p99_ms", canary.p99_ms, windows(rng, 40, p99=40.0, p99_sd=0.2).p99_ms, CFG)
    assert j.p_value < 1e-6 and 0 < j.change < 10.0
    assert j.verdict is Verdict.PASS and "within the guardrail" in j.reason


def test_large_but_not_significant_is_never_a_pass_and_the_bake_goes_on_for_it():
    """A random-weights model once reached promoted: its quality 0.115 against 0.246, a drop past
    the guardrail, was not significant on 13 windows (p 0.115) and so passed. A change past the
    guardrail that is not yet significant is inconclusive; the bake goes on (the judge asks again
    each period) up to max_bake_factor times bake_time_s, then pauses for an operator."""
    base = [10.0 * k for k in range(1, 11)]  # median 55
    canary = [b + 8.0 for b in base]  # median 63: +14.5 %, but U = 55 of 100 pairs
    j = judge_metric("p99_ms", canary, base, CFG)
    assert j.u == 55.0 and j.change == pytest.approx(8 / 55 * 100)
    assert j.p_value > 0.05 and j.verdict is Verdict.INCONCLUSIVE and j.worse_unproven
    assert "past the guardrail but not significant yet" in j.reason
    same = WindowSamples(slo_attainment=[0.99] * 10, p99_ms=base)
    worse = WindowSamples(slo_attainment=[0.99] * 10, p99_ms=canary)
    longest = CFG.bake_time_s * CFG.max_bake_factor
    a = evaluate_rollout(baking(worse, same), 10.0 + CFG.bake_time_s + 1.0, CFG)  # the bake began at 10 s
    assert a.action is Action.WAIT and "baking on" in a.reason
    a = evaluate_rollout(baking(worse, same), 10.0 + longest + 1.0, CFG)
    assert (a.action, a.verdict) == (Action.PAUSE, Verdict.INCONCLUSIVE)


def test_no_traffic_is_inconclusive_and_pauses():
    a = evaluate_rollout(baking(WindowSamples(), WindowSamples()), 100.0, CFG)
    assert (a.action, a.verdict) == (Action.PAUSE, Verdict.INCONCLUSIVE)
    assert "too few windows: canary 0, baseline 0, need 10" in a.reason
    assert all(j.p_value is None and j.median_canary is None for j in a.judgements)


def test_nan_windows_are_left_out_and_never_pass():
    rng = np.random.default_rng(6)
    nan = WindowSamples(slo_attainment=[math.nan] * 30, p99_ms=[math.nan] * 30)
    a = evaluate_rollout(baking(nan, windows(rng, 30)), 100.0, CFG)
    assert (a.action, a.verdict) == (Action.PAUSE, Verdict.INCONCLUSIVE)
    assert a.judgements[0].num_dropped_canary == 30 and "30 canary and 0 baseline windows" in a.reason
    # a few NaN among enough finite windows are dropped and counted; the rest is judged
    good = windows(rng, 30)
    mixed = WindowSamples(slo_attainment=list(good.slo_attainment) + [math.nan] * 3,
                          p99_ms=list(good.p99_ms) + [math.inf])
    a = evaluate_rollout(baking(mixed, windows(rng, 30)), 100.0, CFG)
    assert a.verdict is Verdict.PASS
    assert [j.num_dropped_canary for j in a.judgements] == [3, 1]


def test_too_few_windows_on_one_side_is_inconclusive():
    rng = np.random.default_rng(8)
    a = evaluate_rollout(baking(windows(rng, 9, p99=90.0), windows(rng, 40)), 100.0, CFG)
    assert (a.action, a.verdict) == (Action.PAUSE, Verdict.INCONCLUSIVE)
    assert "canary 9, baseline 40" in a.reason


def test_a_zero_baseline_p99_is_inconclusive_not_a_pass():
    j = judge_metric("p99_ms", [1.0] * 10, [0.0] * 10, CFG)
    assert j.verdict is Verdict.INCONCLUSIVE and j.change is None
    json.dumps(j.__dict__ | {"verdict": j.verdict.value})  # no inf/nan in the figures


def test_bake_time_is_respected():
    rng = np.random.default_rng(0)
    stats = baking(windows(rng, 30, p99=80.0), windows(rng, 30))  # bake started at 10 s, bake 60 s
    a = evaluate_rollout(stats, 69.0, CFG)
    assert (a.action, a.verdict) == (Action.WAIT, None) and a.bake_elapsed_s == 59.0
    assert "baking: 59 s of 60 s" in a.reason
    assert evaluate_rollout(stats, 70.0, CFG).action is Action.ROLLBACK


def pending(nodes, **kw) -> RolloutStats:
    return RolloutStats(state=RolloutState.PENDING, started_at_s=0.0, canary_nodes=nodes, **kw)


def test_pending_waits_for_every_canary_node_then_bakes():
    a = evaluate_rollout(pending({"n0": NodeLoad.LOADED, "n1": NodeLoad.ASSIGNED}), 5.0, CFG)
    assert a.action is Action.WAIT and "waiting for 1 of 2 canary nodes" in a.reason and "n1" in a.reason
    a = evaluate_rollout(pending({"n0": "loaded", "n1": "loaded"}), 6.0, CFG)
    assert a.action is Action.BAKE and a.loaded_nodes == ("n0", "n1")


def test_a_node_that_fails_to_load_rolls_back_by_default_and_is_named():
    a = evaluate_rollout(pending({"n0": NodeLoad.LOADED, "n1": NodeLoad.FAILED}), 5.0, CFG)
    assert (a.action, a.verdict) == (Action.ROLLBACK, Verdict.FAIL)
    assert a.failed_nodes == ("n1",) and "failed to load on 1 of 2 canary nodes (n1)" in a.reason


def test_tolerated_load_failures_are_shown_and_baking_goes_on():
    cfg = RolloutConfig(max_failed_canary_fraction=0.5, load_timeout_s=30.0)
    nodes = {"n0": NodeLoad.LOADED, "n1": NodeLoad.FAILED, "n2": NodeLoad.LOADED}
    a = evaluate_rollout(pending(nodes), 5.0, cfg)
    assert a.action is Action.BAKE and a.failed_nodes == ("n1",)
    # every canary node failed: rolled back whatever the tolerance
    a = evaluate_rollout(pending({"n0": "failed"}), 5.0, RolloutConfig(max_failed_canary_fraction=1.0))
    assert a.action is Action.ROLLBACK


def test_a_node_that_never_confirms_counts_as_failed_after_the_load_timeout():
    nodes = {"n0": NodeLoad.LOADED, "n1": NodeLoad.ASSIGNED}
    assert evaluate_rollout(pending(nodes), 29.0, CFG).action is Action.WAIT
    a = evaluate_rollout(pending(nodes), 30.0, CFG)
    assert a.action is Action.ROLLBACK and a.failed_nodes == ("n1",) and "load_timeout_s" in a.reason
    tolerant = RolloutConfig(max_failed_canary_fraction=0.5, load_timeout_s=30.0)
    a = evaluate_rollout(pending(nodes), 30.0, tolerant)
    assert a.action is Action.BAKE and a.failed_nodes == ("n1",)


def test_paused_and_final_rollouts_wait():
    a = evaluate_rollout(RolloutStats(state=RolloutState.PAUSED, started_at_s=0.0, bake_started_at_s=1.0,
                                      canary_nodes={"n0": "failed"}, pause_reason="inconclusive: no data"),
                         100.0, CFG)
    assert a.action is Action.WAIT and "paused: inconclusive: no data" in a.reason and a.failed_nodes == ("n0",)
    for s in TERMINAL_STATES:
        assert evaluate_rollout(RolloutStats(state=s, started_at_s=0.0), 100.0, CFG).action is Action.WAIT


def test_no_canary_node_is_inconclusive():
    a = evaluate_rollout(pending({}), 1.0, CFG)
    assert (a.action, a.verdict) == (Action.PAUSE, Verdict.INCONCLUSIVE)


@pytest.mark.parametrize("kw, field", [({"min_samples": 2}, "min_samples"), ({"alpha": 0.0}, "alpha"),
                                       ({"alpha": 0.9}, "alpha"), ({"bake_time_s": -1.0}, "bake_time_s"),
                                       ({"max_p99_regression_pct": math.nan}, "max_p99_regression_pct"),
                                       ({"max_slo_attainment_drop": 1.5}, "max_slo_attainment_drop"),
                                       ({"max_failed_canary_fraction": -0.1}, "max_failed_canary_fraction")])
def test_config_is_validated_with_the_field_named(kw, field):
    with pytest.raises(ValueError, match=field):
        RolloutConfig(**kw)


# ------------------------------------------------------------------ the state machine

ALLOWED = {
    "bake": {"pending"},
    "promote": {"pending", "baking", "paused"},
    "rollback": {"pending", "baking", "paused"},
    "pause": {"pending", "baking"},
    "resume": {"paused"},
}


@pytest.mark.parametrize("state", list(RolloutState))
@pytest.mark.parametrize("event", EVENTS)
def test_transition_table(state, event):
    status = RolloutStatus(state=state, started_at_s=0.0, updated_at_s=0.0, bake_started_at_s=1.0,
                           paused_from=RolloutState.BAKING if state is RolloutState.PAUSED else None)
    if state.value in ALLOWED[event]:
        new, step = apply_event(status, event, 5.0, actor="alice", reason="why")
        assert step.from_state is state and step.to_state is new.state and step.actor == "alice"
        assert step.at_s == 5.0 == new.updated_at_s and new.reason == "why"
    else:
        with pytest.raises(InvalidTransition, match=f"cannot {event} a rollout that is {state.value}"):
            apply_event(status, event, 5.0)


def test_unknown_event_is_refused():
    with pytest.raises(InvalidTransition, match="unknown rollout event 'abort'"):
        apply_event(RolloutStatus.new(0.0), "abort", 1.0)


def test_pause_and_resume_return_where_they_left():
    s = RolloutStatus.new(0.0)
    s, _ = apply_event(s, "pause", 1.0, actor="bob")
    s, step = apply_event(s, "resume", 2.0, actor="bob")
    assert s.state is RolloutState.PENDING and step.to_state is RolloutState.PENDING
    s, _ = apply_event(s, "bake", 3.0)
    assert s.bake_started_at_s == 3.0
    s, _ = apply_event(s, "pause", 4.0)
    s, step = apply_event(s, "resume", 5.0)
    assert s.state is RolloutState.BAKING and s.bake_started_at_s == 3.0 and step.to_dict()["to_state"] == "baking"


def run_virtual_rollout(canary_gen, baseline_gen, cfg: RolloutConfig, interval_s=5.0, until_s=600.0):
    """Drive a rollout on virtual time: one window per node per interval, the judge every interval."""
    status = RolloutStatus.new(0.0)
    loads = {"c0": NodeLoad.ASSIGNED}
    canary: dict[str, list[float]] = {"slo_attainment": [], "p99_ms": []}
    base: dict[str, list[float]] = {"slo_attainment": [], "p99_ms": []}
    steps = []
    t = 0.0
    while t < until_s and status.state not in TERMINAL_STATES and status.state is not RolloutState.PAUSED:
        t += interval_s
        if t >= 10.0:
            loads["c0"] = NodeLoad.LOADED
        if status.state is RolloutState.BAKING:
            for side, gen in ((canary, canary_gen), (base, baseline_gen)):
                w = gen()
                if w is not None:
                    side["slo_attainment"].append(w[0])
                    side["p99_ms"].append(w[1])
        stats = RolloutStats(state=status.state, started_at_s=status.started_at_s,
                             bake_started_at_s=status.bake_started_at_s, canary_nodes=loads,
                             canary=WindowSamples(**canary), baseline=WindowSamples(**base))
        action = evaluate_rollout(stats, t, cfg)
        status, step = apply_action(status, action, t)
        if step:
            steps.append(step)
    return status, steps


def test_virtual_time_rollouts_end_as_expected():
    cfg = RolloutConfig(bake_time_s=100.0, min_samples=10, load_timeout_s=60.0)
    rng = np.random.default_rng(11)
    good = lambda: (min(1.0, rng.normal(0.97, 0.01)), rng.normal(40.0, 3.0))  # noqa: E731
    bad = lambda: (min(1.0, rng.normal(0.85, 0.03)), rng.normal(70.0, 5.0))  # noqa: E731
    status, steps = run_virtual_rollout(bad, good, cfg)
    assert status.state is RolloutState.ROLLED_BACK
    assert [(s.event, s.at_s) for s in steps] == [("bake", 10.0), ("rollback", 110.0)]
    assert steps[-1].actor == "judge" and "canary worse" in steps[-1].reason
    status, steps = run_virtual_rollout(good, good, cfg)
    assert status.state is RolloutState.PROMOTED
    status, steps = run_virtual_rollout(lambda: None, lambda: None, cfg)
    assert status.state is RolloutState.PAUSED and "too few windows" in status.reason


def test_a_model_rollout_is_also_judged_on_model_quality():
    """MODEL_METRICS adds model_quality (higher is better) to the two latency metrics, each tested
    at alpha / 3; a policy rollout (METRICS) never looks at it, even when it has no windows."""
    from control_plane.rollout import METRICS, MODEL_METRICS

    rng = np.random.default_rng(0)
    lat = dict(slo_attainment=list(rng.uniform(0.98, 1.0, 20)), p99_ms=list(rng.uniform(9.0, 11.0, 20)))
    good = WindowSamples(**lat, model_quality=list(rng.uniform(0.78, 0.82, 20)))
    worse = WindowSamples(**lat, model_quality=list(rng.uniform(0.58, 0.62, 20)))
    slightly = WindowSamples(**lat, model_quality=list(rng.uniform(0.77, 0.81, 20)))
    cfg = RolloutConfig(bake_time_s=10.0, min_samples=5)

    def run(canary, metrics):
        stats = RolloutStats(state=RolloutState.BAKING, started_at_s=0.0, canary=canary, baseline=good,
                             canary_nodes={"c": NodeLoad.LOADED}, bake_started_at_s=0.0, metrics=metrics)
        return evaluate_rollout(stats, 20.0, cfg)

    a = run(worse, MODEL_METRICS)
    js = {j.metric: j for j in a.judgements}
    assert a.action is Action.ROLLBACK and a.verdict is Verdict.FAIL
    assert js["model_quality"].verdict is Verdict.FAIL and js["p99_ms"].verdict is Verdict.PASS
    assert js["model_quality"].change == pytest.approx(0.2, abs=0.01) and "model quality" in a.reason
    # significant but within the guardrail (a drop of ~0.01 < 0.02): passes
    assert run(slightly, MODEL_METRICS).action is Action.PROMOTE
    # a policy rollout: model_quality is not judged (empty here) and the verdict rests on latency
    b = run(WindowSamples(**lat), METRICS)
    assert b.action is Action.PROMOTE and [j.metric for j in b.judgements] == list(METRICS)
    # a model rollout without quality windows is inconclusive, never a pass
    c = run(WindowSamples(**lat), MODEL_METRICS)
    assert c.action is Action.PAUSE and c.verdict is Verdict.INCONCLUSIVE
