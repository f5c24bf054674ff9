"""The SmartAllocator ablations as simulator allocators (simulator/smart.py)."""

from __future__ import annotations

import numpy as np
import pytest

from node_agent.allocator import AllocatorConfig, GuardConfig
from policies.actor import make_initial_actor
from policies.export import export_actor
from simulator import SimConfig, simulate
from simulator.smart import DEFAULT_ARTIFACT, SMART_SPECS, SmartAllocatorSim, make_smart_allocator, smart_config
from simulator.allocators import POLICY_SPECS, needs_ghost_lists
from simulator.table import _make_allocator
from workloads import generate, synthetic_trace

SPECS = ("racer", "ppo", "ppo+residual", "ppo+recovery")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """An untrained actor (CleanRL init: the mean action is ~0.5 everywhere), exported and checked."""
    out = tmp_path_factory.mktemp("policy") / "artifact"
    export_actor(make_initial_actor(0), out)
    return out


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(num_users=400, num_items=4_000, mean_seq_len=80.0, seed=0)


@pytest.fixture(scope="module")
def burst_stream(trace):
    """One 4-s burst (rate x4 from a fresh hot set), placed after the recovery controller's 10-s warm-up."""
    for seed in range(50):
        s = generate(trace, regime="burst", rate_rps=400.0, duration_s=24.0, num_users=2_000, seed=seed,
                     num_bursts=1, burst_duration_s=4.0)
        if 12.0 <= s.bursts[0][0] <= 16.0:
            return s
    raise AssertionError("no seed places the burst after the warm-up")


SIM = SimConfig(num_nodes=4, cache_fraction=0.5)


def test_spec_configs():
    assert set(SMART_SPECS) == set(SPECS) == set(POLICY_SPECS)  # the table's ghost-list rule knows every row
    on = {s: (smart_config(s).residual.enabled, smart_config(s).recovery.enabled) for s in SPECS}
    assert on == {"racer": (True, True), "ppo": (False, False), "ppo+residual": (True, False),
                  "ppo+recovery": (False, True)}
    # the residual layer is the adapter and the operating-point tuner; every policy row reads the ghost
    # lists (its base policy's schema-3 features include the marginal utilities)
    assert {s: smart_config(s).tuner.enabled for s in SPECS} == {"racer": True, "ppo": False, "ppo+residual": True,
                                                                 "ppo+recovery": False}
    assert [s for s in SPECS + ("ppo@ghost", "static:0.5", "oracle") if needs_ghost_lists(s)] == \
        ["racer", "ppo", "ppo+residual", "ppo+recovery", "ppo@ghost"]
    base = AllocatorConfig(guard=GuardConfig(max_step_up=0.02))
    assert smart_config("ppo", base).guard.max_step_up == 0.02  # the other settings come from the base config
    with pytest.raises(ValueError, match="unknown SmartAllocator spec"):
        make_smart_allocator("ppo+magic")


def test_missing_artifact_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no policy artifact"):
        make_smart_allocator("racer", tmp_path / "nothing")


@pytest.mark.parametrize("spec", SPECS)
def test_each_spec_runs_in_a_small_cluster(spec, artifact, trace):
    stream = generate(trace, regime="steady", rate_rps=300.0, duration_s=8.0, num_users=1_500, seed=1)
    alloc = make_smart_allocator(spec, artifact)
    assert isinstance(alloc, SmartAllocatorSim) and alloc.name == spec
    res = simulate(stream, SIM, alloc)
    assert res.allocator == spec and res.router == "racer"
    assert len(alloc.allocators) == SIM.num_nodes
    g = alloc.config.guard
    assert np.all((res.targets >= g.min_emb_share - 1e-12) & (res.targets <= g.max_emb_share + 1e-12))
    assert np.all((res.shares >= 0) & (res.shares <= 1))
    n_decisions = (res.targets.shape[0] - 1) * SIM.num_nodes  # no decision before the first window ends
    assert sum(alloc.decisions_by_source.values()) == n_decisions
    assert set(alloc.decisions_by_source) <= {"base", "residual", "recovery", "guard"}
    if spec in ("ppo", "ppo+recovery"):
        assert alloc.decisions_by_source["residual"] == 0
        assert all(a.state()["residual"]["num_updates"] == 0 for a in alloc.allocators)
    if spec in ("racer", "ppo+residual"):  # the adapter learnt from every interval's outcome after the first
        assert all(a.state()["residual"]["num_updates"] > 0 for a in alloc.allocators)
    summary = res.summary()
    assert summary["num_requests"] == len(stream) and 0 < summary["slo_attainment"] <= 1


def test_the_table_builds_the_specs_by_name(artifact):
    if not (DEFAULT_ARTIFACT / "manifest.json").is_file():
        pytest.skip("no shipped policy in policies/default")
    for spec in SPECS:
        alloc = _make_allocator(spec, None, SIM)
        assert alloc.name == spec and alloc.artifact_dir == DEFAULT_ARTIFACT
        alloc.reset(2, 0.5)  # loads and checks the shipped policy on every node
        assert all(a.policy is not None for a in alloc.allocators)


def test_recovery_shifts_toward_kv_during_a_burst(artifact, burst_stream):
    start, end = burst_stream.bursts[0]
    runs = {}
    for spec in ("ppo", "ppo+recovery"):
        alloc = make_smart_allocator(spec, artifact)
        runs[spec] = (simulate(burst_stream, SIM, alloc), alloc)
    base_res, base_alloc = runs["ppo"]
    rec_res, rec_alloc = runs["ppo+recovery"]
    assert base_alloc.decisions_by_source["recovery"] == 0
    assert rec_alloc.decisions_by_source["recovery"] > 0
    # windows wholly inside the burst, after the first decision in it (targets[w] is set at w's start)
    w0, w1 = int(np.ceil(start)) + 1, int(np.floor(end))
    assert w1 > w0
    in_burst = slice(w0, w1)
    base_share = base_res.targets[in_burst].mean()
    rec_share = rec_res.targets[in_burst].mean()
    assert rec_share <= base_share - 0.1, (rec_share, base_share)  # kv_shift 0.15 below the split at entry
    # before the burst both run the same base policy on the same stream
    assert np.allclose(rec_res.targets[: int(start)], base_res.targets[: int(start)])
    # and control is handed back afterwards: the split climbs again (step-limited) once the burst ends
    assert rec_res.targets[-1].mean() > rec_res.targets[in_burst].mean()
    assert any(a.recovery.phase == "normal" for a in rec_alloc.allocators)
