"""The capacity search shared by the simulator and the fleet bench (simulator.capacity)."""

from __future__ import annotations

import pytest

from simulator.capacity import bracket_and_bisect


def below(limit, unjudged=()):
    return lambda r: None if r in unjudged else r <= limit


def test_fleet_search_doubles_then_bisects_as_measured():
    # the fleet's measured capacity search (docs/fleet.md): 20, 40 pass, 80 fails, then 60, 70, 75
    f = bracket_and_bisect(below(72.0), 20.0, 3, max_rate=1e5, min_rate=0.5)
    assert f.rates == [20.0, 40.0, 80.0, 60.0, 70.0, 75.0]
    assert (f.lo, f.hi) == (70.0, 75.0)


def test_simulator_search_as_measured():
    # simulator.table.steady_capacity's probes on an 8-node quick setting, 3 bisections
    f = bracket_and_bisect(below(7_300.0), 400.0, 3, max_bracket_probes=12)
    assert f.rates == [400.0, 800.0, 1_600.0, 3_200.0, 6_400.0, 12_800.0, 9_600.0, 8_000.0, 7_200.0]
    assert (f.lo, f.hi) == (7_200.0, 8_000.0)


def test_halves_while_failing_and_stops_at_the_rate_floor():
    f = bracket_and_bisect(below(3.0), 20.0, 2, min_rate=0.5)
    assert f.rates == [20.0, 10.0, 5.0, 2.5, 3.75, 3.125] and (f.lo, f.hi) == (2.5, 3.125)
    none = bracket_and_bisect(below(0.1), 2.0, 3, min_rate=0.5)
    assert none.rates == [2.0, 1.0, 0.5] and none.lo is None and none.hi == 0.5 and none.stop_rate == 0.5


def test_budget_bound_and_unjudged_rates_stop_the_bracket():
    f = bracket_and_bisect(below(1e9), 1.0, 3, max_bracket_probes=4)
    assert f.rates == [1.0, 2.0, 4.0, 8.0] and f.hi is None and f.lo == 8.0 and f.stop_rate == 16.0
    g = bracket_and_bisect(below(1e9), 1.0, 3, max_rate=4.0)
    assert g.rates == [1.0, 2.0, 4.0] and g.hi is None and g.stop_rate == 4.0
    u = bracket_and_bisect(below(100.0, unjudged={5.0}), 20.0, 3)
    assert u.rates == [20.0, 40.0, 80.0, 160.0, 120.0, 100.0, 110.0]
    v = bracket_and_bisect(below(1.0, unjudged={5.0}), 20.0, 3)  # halving reaches a rate it cannot judge
    assert v.rates == [20.0, 10.0, 5.0] and v.lo is None and v.stop_rate == 5.0


def test_bisection_counts_an_unjudged_mid_as_a_fail():
    f = bracket_and_bisect(below(100.0, unjudged={60.0}), 40.0, 1)
    assert f.rates == [40.0, 80.0, 160.0, 120.0] and (f.lo, f.hi) == (80.0, 120.0)
    g = bracket_and_bisect(below(100.0, unjudged={60.0}), 80.0, 1)
    assert (g.lo, g.hi) == (80.0, 120.0)
    h = bracket_and_bisect(lambda r: None if r == 60.0 else r <= 100.0, 40.0, 0)
    assert h.rates == [40.0, 80.0, 160.0]


@pytest.mark.parametrize("start, iters", [(0.0, 1), (float("inf"), 1), (1.0, -1)])
def test_bad_arguments(start, iters):
    with pytest.raises(ValueError):
        bracket_and_bisect(below(1.0), start, iters)
