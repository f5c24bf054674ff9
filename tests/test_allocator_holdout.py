"""The allocator on traces no policy was trained or tuned on, where the best split is known by
construction (`bench.regret.holdout_grid`): a lightly loaded cluster whose users return within
seconds with long histories (KV-heavy, at the grid's light load: load < 0.2), and one where every
request is a new user (EMB-heavy, at the grid's busy load, SLO attainment still 100%: at the light
load the split moves its P99 by under 1% and the greedy oracle's share is noise).
`racer` starts at 0.5 like every adaptive allocator and must reach the replay oracle's share (the
band of grid shares its replay cannot tell from the best, on a grid spanning the guard range) and
its P99 within a stated number of control intervals, from the ghost lists alone; the shipped base
policy's proposal on these traces is no help (it was fitted to other settings)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from simulator.smart import DEFAULT_ARTIFACT

pytestmark = [pytest.mark.skipif(not (DEFAULT_ARTIFACT / "manifest.json").is_file(),
                                 reason="no shipped policy in policies/default"),
              pytest.mark.slow]  # each case: the replay oracle and two runs of 4 nodes x 20 s (~30-60 s)

# control intervals (1 s each) racer gets to come within 0.1 of the oracle's share, from 0.5:
# the KV-ward step limit is 0.1 per interval, the EMB-ward one 0.05, and the sign test wants 4
# readings (convergence bound: docs/allocator.md, "Operating-point tuner")
WITHIN_INTERVALS = 10
ORACLE_SHARES = (0.05, 0.2, 0.5, 0.8, 0.95)


LOAD = {"kv-heavy": "light", "emb-heavy": "busy"}


def _setting(family: str):
    from bench.regret import holdout_config, holdout_grid

    st = next(s for s in holdout_grid(quick=True, loads=(LOAD[family],))
              if s.family == family and s.regime == "steady")
    return st, holdout_config(st, True, ("racer",))


def _runs(family: str):
    from simulator.cluster import oracle_replay, simulate
    from simulator.smart import make_smart_allocator
    from simulator.table import GHOST_PROBES, _stream, sim_config

    st, cfg = _setting(family)
    stream = _stream(cfg, "steady")
    scfg = replace(sim_config(cfg), ghost_probes=GHOST_PROBES)
    # the oracle's grid spans the guard range (0.05-0.95), so its share can be where racer's is
    oracle, schedule = oracle_replay(stream, scfg, ORACLE_SHARES, "racer")
    racer = simulate(stream, scfg, make_smart_allocator("racer"), "racer")
    ppo = simulate(stream, scfg, make_smart_allocator("ppo"), "racer")
    return st, oracle, np.array(schedule), racer, ppo


@pytest.mark.parametrize("family", ["kv-heavy", "emb-heavy"])
def test_racer_reaches_the_oracles_share_on_a_constructed_trace(family):
    st, oracle, schedule, racer, ppo = _runs(family)
    target = float(schedule[WITHIN_INTERVALS:].mean())
    # the construction holds: the oracle's split lies on the known side
    assert (target <= 0.3) if st.known == "kv" else (target >= 0.7), schedule
    # lightly loaded: every request within the SLO, so the tail is service time, not queueing
    assert oracle.summary()["slo_attainment"] >= 0.99
    shares = racer.shares.mean(axis=1)  # per control window, over the nodes
    assert shares[0] == pytest.approx(0.5, abs=0.11)
    # "the oracle's share" of a window: the grid shares its replay cannot tell from the best one
    # (`oracle_bands`: within two standard errors of the best window P99), the chosen one included
    bands = oracle.extra["oracle_bands"]
    dist = [max(0.0, min(bands[w]) - s, s - max(bands[w])) for w, s in enumerate(shares)]
    assert all(d <= 0.1 for d in dist[WITHIN_INTERVALS:]), (shares.round(3), bands[WITHIN_INTERVALS:])
    assert racer.summary()["p99_ms"] <= 1.05 * oracle.summary()["p99_ms"]
    # where the base policy alone misses the oracle's band (it proposes the share of the settings
    # it was fitted to), the tuner is what reaches it; where the base alone is already near it (the
    # EMB-heavy trace), there is nothing for the tuner to add and the checks above are the claim
    base = ppo.shares.mean(axis=1)
    base_dist = [max(0.0, min(bands[w]) - s, s - max(bands[w])) for w, s in enumerate(base)]
    if float(np.mean(base_dist[WITHIN_INTERVALS:])) > 0.1:
        assert np.mean(dist[WITHIN_INTERVALS:]) < np.mean(base_dist[WITHIN_INTERVALS:])
        assert racer.summary()["p99_ms"] < ppo.summary()["p99_ms"]
    if family == "kv-heavy":
        # by construction the base alone is slower here than the oracle's splits (over the whole
        # run: with the load-aware router most single windows cannot tell the shares apart, so
        # the bands alone no longer show it), and racer must recover that
        assert ppo.summary()["p99_ms"] > 1.02 * oracle.summary()["p99_ms"], (ppo.summary(), oracle.summary())
        assert racer.summary()["p99_ms"] < ppo.summary()["p99_ms"]
