"""Pure tests of dashboard.figures (no browser): series present, bursts shaded where they are,
decision sources coloured as documented, units on every axis."""

from __future__ import annotations

import json

import pytest

from dashboard import figures as F

T0 = 1_790_000_000.0


def _cluster(n=60):
    t = [T0 + i for i in range(n)]
    return {"t_s": t, "slo_attainment": [0.99 - 0.001 * i for i in range(n)], "p99_ms": [20 + i * 0.1 for i in range(n)],
            "throughput_rps": [1000.0] * n, "emb_hit_rate": [0.8] * n, "kv_hit_rate": [0.5] * n}


def _nodes(k=3, n=60):
    return {f"node-{j}": {"t_s": [T0 + i for i in range(n)], "emb_share": [0.3 + 0.01 * j] * n,
                          "target_emb_share": [0.35] * n, "p99_ms": [15.0 + j] * n} for j in range(k)}


BURSTS = [{"node_id": "node-0", "start_s": T0 + 10, "end_s": T0 + 20, "magnitude": 3.0},
          {"node_id": "node-1", "start_s": T0 + 15, "end_s": T0 + 25, "magnitude": 2.0},
          {"node_id": "node-2", "start_s": T0 + 40, "end_s": None, "magnitude": 1.5}]


def _bursts_of(fig):
    return [s for s in fig.layout.shapes if s.name == "burst"]


def _assert_axes_have_units(fig):
    lay = fig.to_plotly_json()["layout"]
    axes = [k for k in lay if k.startswith(("xaxis", "yaxis"))]
    assert axes
    for k in axes:
        title = (lay[k].get("title") or {}).get("text") or ""
        assert title, f"{k} has no title"
        assert "(" in title or k.startswith("yaxis") and title == "node", f"{k} title {title!r} names no unit"


def test_merge_periods_unions_overlaps_and_closes_open_bursts_at_now():
    assert F.merge_periods(BURSTS, now_s=T0 + 50) == [(T0 + 10, T0 + 25), (T0 + 40, T0 + 50)]
    assert F.merge_periods([]) == []


def test_time_charts_shade_the_burst_periods_where_they_are():
    figs = [F.slo_attainment_figure(_cluster(), 0.99, BURSTS, T0 + 50), F.p99_figure(_nodes(), 30.0, BURSTS, T0 + 50),
            F.throughput_figure(_cluster(), BURSTS, T0 + 50), F.hit_rate_figure(_cluster(), BURSTS, T0 + 50),
            F.share_lines_figure(_nodes(2), [], BURSTS, T0 + 50)]
    for fig in figs:
        shapes = _bursts_of(fig)
        assert [(s.x0, s.x1) for s in shapes] == [(F.to_x(T0 + 10), F.to_x(T0 + 25)), (F.to_x(T0 + 40), F.to_x(T0 + 50))]
        assert all(s.yref == "paper" and s.fillcolor == F.BURST_FILL for s in shapes)
        assert any(t.name == "burst period" for t in fig.data)
        _assert_axes_have_units(fig)
    heat = F.emb_share_heatmap(_nodes(), BURSTS, T0 + 50)
    assert len(_bursts_of(heat)) == 2
    assert F.time_shapes([], None) == [] and len(_bursts_of(F.p99_figure(_nodes(), 30.0, []))) == 0


def test_overview_series_present_with_values_and_reference_lines():
    c = _cluster()
    slo = F.slo_attainment_figure(c, 0.99)
    assert slo.data[0].name == "attainment" and slo.data[0].y[0] == pytest.approx(99.0)
    assert [s.name for s in slo.layout.shapes] == ["target"] and slo.layout.shapes[0].y0 == pytest.approx(99.0)
    assert "%" in slo.layout.yaxis.title.text
    p99 = F.p99_figure(_nodes(4), 30.0, cluster=c)
    assert [t.name for t in p99.data[:5]] == ["node-0", "node-1", "node-2", "node-3", "cluster"]
    assert all(t.type == "scatter" for t in p99.data[:5])  # SVG: the cartesian bundle has no WebGL types
    assert [s.name for s in p99.layout.shapes] == ["slo"] and p99.layout.shapes[0].y0 == 30.0
    assert "ms" in p99.layout.yaxis.title.text
    hits = F.hit_rate_figure(c)
    assert [t.name for t in hits.data[:2]] == ["EMB hit rate (rows)", "KV hit rate (tokens)"]
    assert hits.data[0].y[0] == pytest.approx(80.0) and hits.data[1].y[0] == pytest.approx(50.0)
    thr = F.throughput_figure(c)
    assert "req/s" in thr.layout.yaxis.title.text and thr.data[0].y[0] == 1000.0


def test_missing_and_non_finite_values_are_gaps():
    c = _cluster(4)
    c["p99_ms"] = [1.0, None, float("nan"), float("inf")]
    fig = F.p99_figure({}, 30.0, cluster=c)
    assert list(fig.data[0].y) == [1.0, None, None, None]
    json.dumps(fig.to_plotly_json(), default=str)  # serialisable


def test_heatmap_aligns_nodes_on_the_union_of_times():
    nodes = {"a": {"t_s": [T0, T0 + 1], "emb_share": [0.2, 0.3]}, "b": {"t_s": [T0 + 1, T0 + 2], "emb_share": [0.6, 0.7]}}
    fig = F.emb_share_heatmap(nodes)
    h = fig.data[0]
    assert h.type == "heatmap" and list(h.y) == ["a", "b"]
    assert list(h.x) == [F.to_x(T0), F.to_x(T0 + 1), F.to_x(T0 + 2)]
    assert [list(r) for r in h.z] == [[0.2, 0.3, None], [None, 0.6, 0.7]]
    assert (h.zmin, h.zmax) == (0.0, 1.0) and h.colorbar.title.text == "emb_share"


def test_decision_sources_coloured_as_documented():
    nodes = _nodes(2)
    decisions = [{"node_id": "node-0", "t_s": T0 + i, "source": src, "emb_share": 0.4, "reason": f"why {src}"}
                 for i, src in enumerate(F.DECISION_SOURCES)]
    decisions.append({"node_id": "node-9", "t_s": T0, "source": "base", "emb_share": 0.1, "reason": "not selected"})
    fig = F.share_lines_figure(nodes, decisions)
    names = [t.name for t in fig.data]
    assert names[:4] == ["node-0 applied", "node-0 target", "node-1 applied", "node-1 target"]
    assert fig.data[1].line.dash == "dash" and fig.data[0].line.dash is None
    markers = {t.meta: t for t in fig.data if t.name.startswith("decision: ")}
    assert list(markers) == list(F.DECISION_SOURCES)
    for src, t in markers.items():
        assert t.marker.color == F.SOURCE_COLORS[src]
        assert len(t.x) == 1 and "why " + src in t.text[0]  # node-9's decision is not drawn
    assert F.SOURCE_COLORS == {"base": "#1f77b4", "residual": "#2ca02c", "recovery": "#ff7f0e",
                               "override": "#d62728", "guard": "#7f7f7f"}
    assert len(set(F.SOURCE_COLORS.values())) == 5


def test_split_bar_stacks_emb_and_kv_bytes_in_mib():
    fig = F.split_bar_figure([{"node_id": "n0", "emb_bytes": 3 * F.MIB, "kv_bytes": 5 * F.MIB},
                              {"node_id": "n1", "emb_bytes": 6 * F.MIB, "kv_bytes": 2 * F.MIB}])
    emb, kv = fig.data
    assert (emb.name, kv.name) == ("EMB slab", "KV pool") and fig.layout.barmode == "stack"
    assert list(emb.x) == [3.0, 6.0] and list(kv.x) == [5.0, 2.0] and list(emb.y) == ["n0", "n1"]
    assert "MiB" in fig.layout.xaxis.title.text
    fig = F.split_bar_figure([{"node_id": "n0", "emb_share": 0.25, "arena_bytes": 8 * F.MIB}])
    assert list(fig.data[0].x) == [2.0] and list(fig.data[1].x) == [6.0]
    fig = F.split_bar_figure([{"node_id": "n0", "emb_share": 0.25}])  # arena size unknown: % of the arena
    assert list(fig.data[0].x) == [25.0] and list(fig.data[1].x) == [75.0] and "%" in fig.layout.xaxis.title.text


def test_router_weights_per_node_step_lines_with_reasons():
    hist = [{"t_s": T0, "version": 1, "nodes": {"a": {"service_time_us": 100.0, "reason": "initial"},
                                                "b": {"service_time_us": 200.0, "reason": "initial"}}},
            {"t_s": T0 + 60, "version": 2, "nodes": {"a": {"service_time_us": 150.0, "reason": "miss costs changed"},
                                                     "b": {"service_time_us": 200.0, "reason": "unchanged"}}}]
    fig = F.router_weights_figure(hist)
    assert [t.name for t in fig.data] == ["a", "b"]
    assert list(fig.data[0].y) == [100.0, 150.0] and fig.data[0].line.shape == "hv"
    assert "miss costs changed" in fig.data[0].text[1] and "µs" in fig.layout.yaxis.title.text


def test_rollout_canary_vs_baseline():
    w = [{"t_s": T0 + i, "group": g, "p99_ms": 20.0 + (5 if g == "canary" else 0), "slo_attainment": 0.99}
         for i in range(3) for g in ("canary", "baseline")]
    fig = F.rollout_figure(w, slo_ms=30.0, target=0.99)
    by = {t.name: t for t in fig.data}
    assert list(by["canary P99"].y) == [25.0] * 3 and list(by["baseline P99"].y) == [20.0] * 3
    assert list(by["canary attainment"].y) == [99.0] * 3
    assert fig.layout.yaxis.title.text == "P99 (ms)" and "%" in fig.layout.yaxis2.title.text
    empty = F.rollout_figure([], slo_ms=30.0)
    assert any(a.text == "no rollout windows yet" for a in empty.layout.annotations)


def test_extend_updates_are_small_and_indexed_by_trace():
    nodes = _nodes(32, 1)
    order = list(nodes)
    upd = F.extend_nodes(nodes, order, "p99_ms", 3600)
    data, idx, maxp = upd
    assert idx == list(range(32)) and maxp == 3600 and len(data["y"]) == 32 and data["y"][5] == [20.0]
    assert len(json.dumps(upd)) < 5_000
    assert F.extend_nodes({}, order, "p99_ms", 10) is None
    c = F.extend_cluster(_cluster(2), ["emb_hit_rate", "kv_hit_rate"], 100, scale=100)
    assert c[1] == [0, 1] and c[0]["y"][0] == [80.0, 80.0]


# the trace types in plotly.js's cartesian bundle (dashboard/assets/plotly-cartesian.min.js's header)
CARTESIAN_TRACES = {"bar", "box", "contour", "heatmap", "histogram", "histogram2d", "histogram2dcontour", "image",
                    "pie", "scatter", "scatterternary", "violin"}


def test_every_figure_uses_only_trace_types_of_the_shipped_plotly_bundle():
    from pathlib import Path

    bundle = Path(F.__file__).parent / "assets" / "plotly-cartesian.min.js"
    assert "plotly.js (cartesian - minified)" in bundle.read_text()[:200]
    c, nodes = _cluster(), _nodes(4)
    figs = [F.slo_attainment_figure(c, 0.99, BURSTS, T0 + 50), F.p99_figure(nodes, 30.0, BURSTS, T0 + 50, cluster=c),
            F.throughput_figure(c, BURSTS, T0 + 50), F.hit_rate_figure(c, BURSTS, T0 + 50),
            F.emb_share_heatmap(nodes, BURSTS, T0 + 50),
            F.share_lines_figure(nodes, [dict(node_id="node-0", t_s=T0 + 5, source="base", emb_share=0.4, reason="r")],
                                 BURSTS, T0 + 50),
            F.split_bar_figure([{"node_id": "node-0", "emb_share": 0.4}]),
            F.router_weights_figure([], "service_time_us", T0 + 50), F.rollout_figure([], 30.0, 0.99)]
    used = {t.type for f in figs for t in f.data}
    assert used and used <= CARTESIAN_TRACES, used - CARTESIAN_TRACES


def test_many_nodes_share_one_legend_entry_and_keep_their_names():
    many = F.p99_figure(_nodes(F.LEGEND_MAX_NODES + 1), 30.0)
    nodes = many.data[:F.LEGEND_MAX_NODES + 1]
    assert [t.name for t in nodes] == [f"node-{i}" for i in range(F.LEGEND_MAX_NODES + 1)]  # hover names
    assert not any(t.showlegend for t in nodes) and all(t.legendgroup == "nodes" for t in nodes)
    group = many.data[F.LEGEND_MAX_NODES + 1]
    assert group.legendgroup == "nodes" and group.name.startswith(f"{F.LEGEND_MAX_NODES + 1} nodes")
    few = F.p99_figure(_nodes(3), 30.0)
    assert [t.showlegend for t in few.data[:3]] == [True] * 3 and "nodes (hover" not in str([t.name for t in few.data])


def test_fold_extend_appends_the_points_to_the_patch():
    from dash import Patch

    ext = F.extend_nodes(_nodes(2, 3), ["node-0", "node-1"], "p99_ms", 10)
    p = Patch()
    p["layout"]["shapes"] = []
    F.fold_extend(p, ext)
    ops = p.to_plotly_json()["operations"]
    ext_ops = [(o["location"], o["params"]["value"]) for o in ops if o["operation"] == "Extend"]
    assert (["data", 0, "x"], ext[0]["x"][0]) in ext_ops and (["data", 1, "y"], ext[0]["y"][1]) in ext_ops
    assert len(ext_ops) == 4
    F.fold_extend(p, None)
    assert len(p.to_plotly_json()["operations"]) == len(ops)


# ------------------------------------------------------------- gaps, weights, details ---


def test_an_outage_is_a_gap_on_every_time_chart_never_a_line_across_it():
    t = [T0, T0 + 5, T0 + 10, T0 + 2600, T0 + 2605]  # 5 s buckets, 43 minutes with nothing
    cl = {"t_s": t, "slo_attainment": [0.9] * 5, "p99_ms": [10.0] * 5, "throughput_rps": [0.0] * 5,
          "emb_hit_rate": [0.5] * 5, "kv_hit_rate": [0.5] * 5}
    ns = {"a": {"t_s": t, "p99_ms": [10.0] * 5, "emb_share": [0.5] * 5, "target_emb_share": [0.5] * 5}}
    gap_x = F.to_x(T0 + 15)
    for fig in (F.slo_attainment_figure(cl, 0.99, step_s=5), F.throughput_figure(cl, step_s=5),
                F.hit_rate_figure(cl, step_s=5), F.p99_figure(ns, 30.0, cluster=cl, step_s=5),
                F.share_lines_figure(ns, [], step_s=5)):
        lines = [tr for tr in fig.data if tr.mode == "lines" and len(tr.x or []) > 1]
        assert lines
        for tr in lines:
            assert list(tr.x)[3] == gap_x and list(tr.y)[3] is None, (fig.layout.title.text, tr.name)
            assert len(tr.x) == 6
    # the step is inferred (median spacing) when not given
    assert list(F.throughput_figure(cl).data[0].y)[3] is None
    # the heatmap gets blank columns at both ends of the gap (a cell reaches half-way to its neighbour)
    h = F.emb_share_heatmap(ns, step_s=5).data[0]
    assert list(h.x) == F.to_xs([T0, T0 + 5, T0 + 10, T0 + 15, T0 + 2595, T0 + 2600, T0 + 2605])
    assert list(h.z[0]) == [0.5, 0.5, 0.5, None, None, 0.5, 0.5]
    # live updates: a gap before the first new point when it comes long after the last one drawn
    ext = F.extend_cluster({"t_s": [T0 + 2600, T0 + 2605], "throughput_rps": [1.0, 2.0]}, ["throughput_rps"], 100,
                           last_t_s=T0 + 10, step_s=5)
    assert ext[0]["x"][0] == F.to_xs([T0 + 15, T0 + 2600, T0 + 2605]) and ext[0]["y"][0] == [None, 1.0, 2.0]
    ext = F.extend_nodes({"a": {"t_s": [T0 + 15], "p99_ms": [3.0]}}, ["a"], "p99_ms", 100, last_t_s=T0 + 10, step_s=5)
    assert ext[0]["y"] == [[3.0]]


def test_slo_axis_is_the_whole_percent_scale_whatever_the_first_values():
    c = _cluster()
    assert tuple(F.slo_attainment_figure(c, 0.99).layout.yaxis.range) == (0, 100.5)


def test_router_weights_show_what_differs_between_nodes():
    def hist(vals):
        return [{"t_s": T0 + 60 * i, "version": i + 1,
                 "nodes": {n: {"kv_recompute_us_per_token": v[i], "reason": "r"} for n, v in vals.items()}}
                for i in range(2)]
    same = F.router_weights_figure(hist({n: [80.0, 157.8] for n in ("a", "b", "c", "d")}), "kv_recompute_us_per_token")
    assert [t.name for t in same.data] == ["all 4 nodes"] and list(same.data[0].meta) == ["a", "b", "c", "d"]
    assert [a.text for a in same.layout.annotations] == ["the same on all 4 nodes"]
    mixed = F.router_weights_figure(hist({"a": [1.0, 2.0], "b": [1.0, 2.0], "c": [5.0, 5.0]}),
                                    "kv_recompute_us_per_token")
    assert [t.name for t in mixed.data] == ["a, b", "c"] and not mixed.layout.annotations
    flat = F.router_weights_figure(hist({"a": [12288.5, 12288.5]}), "kv_recompute_us_per_token")
    assert flat.layout.yaxis.rangemode == "tozero"  # not an axis 0.001 wide around a flat line
    far = F.router_weights_figure(hist({"a": [1.0, 1.0], "b": [100.0, 100.0]}), "kv_recompute_us_per_token")
    assert far.layout.yaxis.type == "log" and far.layout.yaxis.rangemode is None


def test_rollout_actions_match_the_control_planes_state_machine():
    from control_plane.rollout import _ALLOWED

    from dashboard import details as D

    assert {a: {s.value for s in states} for a, states in _ALLOWED.items() if a != "bake"} == \
        {a: set(s) for a, s in D.ROLLOUT_ACTIONS.items()}
    assert D.rollout_actions("rolled_back") == set() and D.rollout_actions("promoted") == set()
    assert D.rollout_actions("baking") == {"promote", "rollback", "pause"}
    assert D.rollout_actions("paused") == {"promote", "rollback", "resume"}
    assert D.can_start_rollout(None) and D.can_start_rollout({"state": "rolled_back"})
    assert not D.can_start_rollout({"state": "pending"})


def test_registry_columns_and_the_active_policy_card_are_readable():
    import json as _json
    from pathlib import Path

    from dashboard import details as D

    m = _json.loads((Path(__file__).resolve().parents[1] / "policies" / "default" / "manifest.json").read_text())
    text = D.validation_text(m)
    assert text.startswith("accepted by the agent's loader") and "parity passed" in text and "{" not in text
    assert D.flat_text({"a": {"b": 0.123456, "c": 0}, "d": "x"}) == "a.b 0.123 · d x"
    # the shipped policy says how it was trained: cloned, no PPO update (its manifest's num_updates 0)
    assert m["evaluation"]["num_updates"] == 0
    assert D.training_text(m["evaluation"]).startswith("behaviour-cloned (") and "no PPO update" in \
        D.training_text(m["evaluation"])
    assert D.training_text({"num_updates": 1, "transitions": 144, "imitation": {"samples": 36}}) == \
        "PPO: 1 update (144 transitions), after cloning (36 samples)"
    assert D.training_text({"skipped": "derived by racer up; not trained or judged"}).startswith("not trained: ")
    assert D.training_text({"slo_attainment": 0.99}) == "training not recorded"
    nodes = [{"node_id": "n1", "policy_version": "v1"}, {"node_id": "n2", "policy_version": "v1"},
             {"node_id": "n3", "policy_version": "v2"}, {"node_id": "n4", "policy_version": None}]
    assert D.node_policies_text(nodes, None) == "v1 on 2 of 3 nodes · v2 on 1"
    assert D.node_policies_text(nodes + [{"node_id": "n5", "policy_version": "v3"}], "v1") == \
        "v1 on 2 of 4 nodes · v2 on 1 · +1 more"
    assert D.node_policies_text(nodes[:2], "v9") == "v1 on all 2 nodes (registry: v9)"
    assert D.node_policies_text([], "v9") == "v9 (no node reports it yet)" and D.node_policies_text([]) == "–"


def test_node_local_times_in_reasons_get_a_utc_rendering():
    from dashboard import details as D

    entered = {"node_id": "n", "ts_s": T0 + 100.0, "reason": "burst entered at t=4578.5s (rate x3.00, ...): cap"}
    assert D.clock_offset(entered) == pytest.approx(T0 + 100.0 - 4578.5)
    since = {"node_id": "n", "ts_s": T0 + 130.0, "reason": "burst since t=4578.5s (rate x2.00): cap"}
    assert D.clock_offset(since) is None
    bursts = [{"node_id": "n", "start_s": T0 + 100.0, "end_s": None}]
    assert D.clock_offset(since, bursts) == pytest.approx(T0 + 100.0 - 4578.5)
    utc = F.x_to_text(F.to_x(T0 + 100.0))[11:]
    assert D.reason_utc(since["reason"], T0 + 100.0 - 4578.5).startswith(f"burst since t=4578.5s ({utc} UTC)")
    other = {"node_id": "n", "ts_s": T0 + 140.0, "reason": "override expired at t=4590s; base"}
    texts = D.reasons_utc([entered, other])  # borrows the node's offset from the nearest decision
    assert f"({utc} UTC)" in texts[0] and "t=4590s (" in texts[1]
    assert D.reason_utc("no times here", 5.0) == "no times here"


def test_decision_drill_down_lays_out_layers_features_miss_costs_and_context():
    from dashboard import details as D

    dec = {"id": 7, "node_id": "n", "seq": 3, "ts_s": T0, "source": "recovery", "emb_share": 0.3,
           "prev_emb_share": 0.5, "policy_version": "v1", "reason": "burst entered at t=10s: cap " + "x" * 500,
           "features": {"kv_miss_cost_share": 0.7, "arrival_rate_log": 1.2},
           "layers": [{"layer": "base", "proposal": 0.5}, {"layer": "recovery", "proposal": 0.3, "cap": 0.3}],
           "tuner_offset": 0.01}
    rep = {"ts_s": T0, "kv_hit_rate": 0.4, "emb_hit_rate": 0.9, "p99_ms": 12.0, "queue_depth": 3.0,
           "kv_recompute_us_per_token": 80.5, "emb_transfer_us_per_row": 2.0}
    d = D.decision_detail(dec, rep)
    assert d["reason"].endswith("x" * 500) and "UTC" in d["reason"]  # full text, node time in UTC
    assert [name for name, _ in d["layers"]] == ["base", "recovery"] and ("cap", "0.3") in d["layers"][1][1]
    assert ("kv_miss_cost_share", "0.7") in d["features"]
    assert ("kv_recompute_us_per_token", "80.5") in d["miss_costs"] and ("kv_miss_cost_share", "0.7") in d["miss_costs"]
    assert ("kv_hit_rate", "0.4") in d["context"] and ("queue_depth", "3") in d["context"]
    assert ("tuner_offset", "0.01") in d["other"] and ("emb_share", "0.5 → 0.3") in d["summary"]
    flat = D.decision_detail({k: v for k, v in dec.items() if k != "layers"})
    assert flat["layers"] == [] and flat["context"] == []


def test_an_upload_is_one_tar_or_the_artifacts_three_files_packed():
    import io
    import tarfile

    from dashboard import details as D

    assert D.upload_body([("p.tar.gz", b"raw")]) == b"raw"
    body = D.upload_body([("golden.npz", b"g"), ("manifest.json", b"{}"), ("policy.onnx", b"o")])
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        assert sorted(tar.getnames()) == ["golden.npz", "manifest.json", "policy.onnx"]
    with pytest.raises(ValueError, match="missing: golden.npz"):
        D.upload_body([("manifest.json", b"{}"), ("policy.onnx", b"o")])


def test_override_dialogs_name_the_present_emb_share():
    from dashboard.override_tab import current_share_text

    nodes = [{"node_id": "a", "emb_share": 0.25}, {"node_id": "b", "emb_share": 0.5}, {"node_id": "c", "emb_share": None}]
    assert current_share_text(nodes, "a") == "a is at emb_share 0.250 now"
    assert current_share_text(nodes, "c") == "c has reported no emb_share yet"
    assert current_share_text(nodes, None) == "the 2 nodes are at emb_share 0.250-0.500 now"
    assert current_share_text([], None) == "no node has reported an emb_share yet"


def test_split_bars_in_bytes_from_the_registered_arena_size():
    from dashboard.split_tab import split_rows

    rows = split_rows([{"node_id": "b", "emb_share": 0.25, "cost_profile": {"arena_bytes": 8 * F.MIB}},
                        {"node_id": "a", "emb_share": 0.5, "cost_profile": {"arena_bytes": 4 * F.MIB}}])
    fig = F.split_bar_figure(rows)
    assert list(fig.data[0].y) == ["a", "b"] and list(fig.data[0].x) == [2.0, 2.0] and list(fig.data[1].x) == [2.0, 6.0]
    assert "MiB" in fig.layout.xaxis.title.text


def test_pages_fill_named_outputs():
    """Each page's render and tick fill only outputs the shared callbacks declare, by name; an
    output is declared once (no two names for one component property)."""
    from dash import Patch, no_update

    from dashboard import live, overview_tab, override_tab, policies_tab
    from dashboard.common import TickInput

    for outputs in (live.RENDER_OUTPUTS, live.TICK_OUTPUTS):
        ids = [(o.component_id, o.component_property) for o in outputs.values()]
        assert len(ids) == len(set(ids))
    out = {k: no_update for k in live.TICK_OUTPUTS}
    bursts = [{"node_id": "a", "start_s": 0.0, "end_s": 10.0, "magnitude": 2.0}]
    t = TickInput(client=None, tok="t", now=60.0, step=5, range_s=60, max_points=13, order=["a"], rows=[],
                  last=None, bursts=bursts, nodes=[], shapes_changed=True, view={}, slo_ms=30.0, slo_target=0.99)
    assert overview_tab.tick(t, out)
    assert set(out) == set(live.TICK_OUTPUTS)
    assert all(isinstance(out[f"{k}_patch"], Patch) for k in overview_tab.TICK_GRAPHS)
    assert all(out[f"{k}_extend"] is no_update for k in overview_tab.TICK_GRAPHS)  # no new points: no extend

    asked = override_tab.ask_override("node", None, 2.0, None, " ", [])
    assert asked["pending"] is None and not asked["open"]
    assert asked["error"] == ("emb_share must be a number in [0, 1]; choose a node (or cluster-wide scope); "
                              "a reason is required")
    ok = override_tab.ask_override("node", "a", 0.25, 5, "test", [{"node_id": "a", "emb_share": 0.5}])
    assert ok["open"] and ok["pending"]["payload"] == {"emb_share": 0.25, "reason": "test", "node_id": "a",
                                                       "ttl_s": 300.0}
    assert "a is at emb_share 0.500 now" in ok["body"]

    viewer = policies_tab.controls(False, None)
    assert viewer["note"] == "a viewer cannot act" and all(v for k, v in viewer.items() if k.endswith("_disabled"))
    ro = {"id": 3, "state": "baking", "policy_version": "v2"}
    op = policies_tab.controls(True, ro)
    assert op["start_disabled"] and op["activate_disabled"]  # a rollout is open
    assert set(op) == {k for k in policies_tab.TABLE_OUTPUTS if k.endswith("_disabled")} | {"note"}


def test_the_nodes_table_and_kpis_say_which_figures_are_modelled():
    """The nodes table's ``mode`` column says what each node's figures are; when any up node runs
    an emulated device the KPI figures say "modelled" and a badge says how many nodes."""
    from dashboard import live
    from dashboard.overview_tab import device_badge, kpi_values, node_rows

    emu = {"mode": "emulated", "profile": "a100-hstu", "time_scale": 10.0, "calibrated": False, "time": "modelled"}
    rows = node_rows([
        {"node_id": "d", "device_mode": None},
        {"node_id": "c", "device_mode": "real"},
        {"node_id": "b", "device_mode": "link-emulated"},
        {"node_id": "a", "device_mode": "emulated", "device_profile": "a100-hstu", "cost_profile": {"device": emu}},
        {"node_id": "a2", "device_mode": "emulated", "device_profile": "h100-cal",
         "cost_profile": {"device": {**emu, "profile": "h100-cal", "calibrated": True}}},
        {"node_id": "a3", "device_mode": "emulated", "device_profile": "other"},  # registration says nothing
    ])
    assert [(r["node_id"], r["mode"]) for r in rows] == [
        ("a", "emulated a100-hstu (uncalibrated)"), ("a2", "emulated h100-cal (calibrated)"), ("a3", "emulated other"),
        ("b", "link emulated"), ("c", "real"), ("d", "–")]
    measured = {"num_up": 4, "num_down": 0, "mean_slo_attainment": 0.995, "mean_p99_ms": 12.34,
                "total_throughput_rps": 800.0, "num_emulated": 0, "emulated_profiles": {}}
    vals = kpi_values(measured)
    assert vals[2] == "12.3 ms" and "modelled" not in " ".join(vals) and device_badge(measured) is None
    modelled = {**measured, "num_emulated": 4, "emulated_profiles": {"a100-hstu": 4}}
    vals = kpi_values(modelled)
    assert vals[1].endswith("(modelled)") and vals[2] == "12.3 ms (modelled)" and vals[3] == "800 req/s (modelled)"
    assert device_badge(modelled) == "emulated: 4 of 4 nodes (a100-hstu), modelled time"
    assert kpi_values({"num_emulated": 1})[2] == "–"  # no figure: a gap, whatever the device
    assert device_badge({}) is None  # an older control plane's summary: nothing said
    assert "device" in live.KPI_OUTPUTS and live.KPI_OUTPUTS["device"].component_id == "kpi-device"
    from dashboard.app import build_layout

    assert any(getattr(c, "id", None) == "kpi-device" for c in build_layout(1.0)._traverse())


def test_the_nodes_table_gives_each_nodes_request_rate_and_device_memory():
    from dashboard.overview_tab import memory_label, node_rows

    gpu = {"arena_bytes": 12 * 2**30, "metadata_bytes": 40 * 2**20, "device_total_bytes": 80 * 2**30,
           "device_free_bytes": 7 * 2**30}
    rows = node_rows([{"node_id": "g", "throughput_rps": 123.456, "cost_profile": gpu},
                      {"node_id": "c", "cost_profile": {"arena_bytes": 3 * 2**20, "metadata_bytes": 0}},
                      {"node_id": "n"}])
    assert [(r["node_id"], r["rate"], r["memory"]) for r in rows] == [
        ("c", None, "arena 3 MiB, metadata 0 MiB"),  # a CPU reports no device memory: not a made-up one
        ("g", "123.5", "arena 12 GiB, metadata 40 MiB, device 7 GiB free of 80 GiB"),
        ("n", None, None)]
    assert memory_label({"device_total_bytes": 2**30}) is None  # total without free: said nowhere
    assert memory_label({"arena_bytes": True}) is None


def test_a_nodes_metadata_outside_the_arena_is_its_catalogue_sized_maps():
    """`MemoryManager.metadata_bytes`: the EMB slab's per-item maps grow with the catalogue,
    the arena's own storage and the host table are not counted."""
    from node_agent.memory import KVLayout, MemoryConfig, MemoryManager

    def meta(num_items: int, payload: bool = False) -> int:
        import torch

        host = torch.zeros(num_items, 4) if payload else None
        return MemoryManager(MemoryConfig(num_pages=8, num_items=num_items, emb_dim=4, emb_dtype="float32",
                                          kv=KVLayout(1, 1, 2, 4, "float32"), payload=payload,
                                          device="cpu"), host_table=host).metadata_bytes()

    small, big = meta(1000), meta(101_000)
    assert small > 0 and 100_000 * 12 <= big - small <= 100_000 * 40  # int64 slot + float32 popularity (+ ghosts)
    assert meta(1000, payload=True) == small  # the arena (and the host table beside it) is not metadata


def test_a_reason_with_html_shows_as_text_in_hover_labels():
    """A node's decision reason is its own text: plotly renders tags in hover text (a link was
    clickable), so every part of a hover label is escaped; the line breaks are the only tags."""
    from dashboard.figures import decision_hover

    d = {"node_id": "n<1>", "source": "base", "reason": 'see <a href="http://evil">here</a> & <b>now</b> ' * 3}
    text = decision_hover(d)
    assert "<a" not in text and "<b>" not in text and "&lt;a href=" in text and "&amp;" in text
    assert text.replace("<br>", "").count("<") == 0 and "n&lt;1&gt;" in text


def test_promote_and_roll_back_ask_for_a_reason_as_activate_and_override_do():
    from dashboard.policies_tab import ROLLOUT_DEFAULTS, ask_rollout_action

    class NoCalls:  # the refusal comes before any call to the control plane
        def __getattr__(self, name):
            raise AssertionError(f"called {name}")

    for action in ("promote", "rollback"):
        out = ask_rollout_action(NoCalls(), "tok", action, "  ")
        assert "reason is required" in str(out)
    assert ROLLOUT_DEFAULTS.bake_time_s == 300.0  # the form's default is the API's


def test_the_clients_slo_headline_is_request_weighted_over_the_range():
    """The KPI once showed the mean of the nodes (~100%) while the load generator saw 93-96%.
    The headline is the gateways' reports over the range, weighted by their requests."""
    from dashboard.client_cards import range_slo

    rows = [{"ts_s": 1.0, "slo_attainment": 1.0, "num_requests": 10},
            {"ts_s": 2.0, "slo_attainment": 0.5, "num_requests": 90},
            {"ts_s": 3.0, "slo_attainment": None, "num_requests": 0}]
    assert range_slo(rows) == pytest.approx((10 * 1.0 + 90 * 0.5) / 100)  # 0.55, where the mean of intervals is 0.75
    assert range_slo([]) is None and range_slo(rows[2:]) is None


def test_the_clients_chart_counts_failures_in_whole_numbers():
    from dashboard.client_cards import clients_figure

    rows = [{"ts_s": 1000.0 + k, "p99_ms": 20.0, "num_failed": 0, "interval_s": 1.0} for k in range(30)]
    fig = clients_figure(rows, now_s=1100.0, range_s=300.0)
    y2 = fig.layout.yaxis2
    assert y2.tickformat == "d" and list(y2.range) == [0, 1] and y2.dtick == 1
    rows[3]["num_failed"] = 7
    assert clients_figure(rows, now_s=1100.0, range_s=300.0).layout.yaxis2.range is None  # autoscaled to 7


def test_a_policy_rollouts_card_shows_the_candidates_what_if_beside_the_canarys_judgement():
    """The newest finished what-if that named the rollout's candidate: its P99 over the best static
    and over the oracle on the fleet's sampled traffic, under the judge's table; nothing for a
    model rollout, for a run that did not replay the candidate, or with no run."""
    from dashboard.policies_tab import rollout_card, whatif_line

    ro = {"id": 3, "kind": "policy", "policy_version": "cand-1", "baseline_version": "base-0", "state": "baking",
          "verdict": None, "config": {}, "nodes": []}
    run = {"id": 7, "window_start_s": 0.0, "window_end_s": 6 * 3600.0,
           "result": {"findings": {"policy_regret": {"policy:cand-1": {"over_oracle_pct": 7.5,
                                                                       "over_best_static_pct": -2.25},
                                                     "policy:base-0": {"over_oracle_pct": 9.0}}}}}
    line = whatif_line(ro, run)
    assert line.startswith("what-if #7 on the fleet's last 6.0 h") and "cand-1 P99 over oracle +7.50%" in line
    assert "over best static -2.25%" in line and "base-0" not in line
    assert whatif_line({**ro, "kind": "model", "model_version": "ab" * 32}, run) == ""
    assert whatif_line({**ro, "policy_version": "other"}, run) == "" and whatif_line(ro, None) == ""
    card = rollout_card(ro, run)
    shown = [c for c in card.children if getattr(c, "id", None) == "ro-whatif"]
    assert len(shown) == 1 and shown[0].children == line
