"""The decision drill-down draws the expected cost against share that the allocator's curve layer
used, from the decision record the node reports (its ``layers``), with the chosen share marked."""

from __future__ import annotations

import json

import pytest

from node_agent.allocator import CurveGuard, GuardConfig, curve_layer
from node_agent.memory import MissCurves
from tests.test_allocator import window


def _decision():
    cur = MissCurves((0.1, 0.2, 0.3, 0.4, 0.5), (0.5, 0.55, 0.6, 0.65, 0.7), (0.9, 0.9, 0.9, 0.02, 0.02),
                     1e4, 1e3, 1.0, 1.0, 4000.0, 3.0)
    st = window(emb_share=0.3, load=0.5, num_requests=100, emb_lookups_per_request=100.0,
                kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=1.0)
    out, t = curve_layer(CurveGuard(), cur, st, 0.4, 0.3, GuardConfig())
    # as the control plane stores it: JSON
    return json.loads(json.dumps({"id": 1, "node_id": "n", "ts_s": 1.7e9, "source": "guard", "emb_share": out,
                                  "prev_emb_share": 0.3, "reason": "r",
                                  "layers": [{"layer": "base", "proposal": 0.4, "acted": True, "detail": {}},
                                             t.to_dict()]}))


def test_drill_down_has_the_curve_and_marks_the_chosen_share():
    from dashboard import details as D

    dec = _decision()
    d = D.decision_detail(dec)
    c = d["curve"]
    assert c["shares"] == [0.1, 0.2, 0.3, 0.4, 0.5] and len(c["cost_us"]) == 5
    assert c["chosen"] == 0.3 and c["min_share"] == 0.3 and c["proposal_in"] == 0.4 and c["action"] == "to_minimum"
    assert c["cost_us"][3] > c["cost_us"][2]  # the cliff is on the drawn curve
    assert [n for n, _ in d["layers"]] == ["base", "curve"]
    # no curve layer (or no curve in it): nothing to draw
    assert D.decision_curve({"layers": [{"layer": "base"}]}) is None
    assert D.decision_curve({"layers": [{"layer": "curve", "detail": {"action": "no_curve", "curve": ""}}]}) is None


def test_curve_figure_draws_cost_against_share_with_the_marks():
    pytest.importorskip("dash_bootstrap_components")
    from dashboard import details as D
    from dashboard.decisions_tab import curve_figure, detail_body

    c = D.decision_curve(_decision())
    fig = curve_figure(c)
    assert list(fig.data[0].x) == c["shares"] and list(fig.data[0].y) == c["cost_us"]
    marks = {(sh["x0"], sh["line"]["dash"]) for sh in fig.layout.shapes}
    assert (0.3, "solid") in marks and (0.3, "dot") in marks and (0.4, "dash") in marks
    body = detail_body(D.decision_detail(_decision()))
    assert any(getattr(x, "id", None) == "dec-curve" for x in body)
