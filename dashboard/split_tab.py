"""The EMB-KV split page: the emb_share heatmap (every node), target vs applied emb_share with
the allocator's decisions for a few chosen nodes (the reason on hover), and the current split bars.

``render`` draws them whole; ``tick`` appends heatmap columns and decision points with `Patch`
and ``extendData``, and patches the split bars."""

from __future__ import annotations

from dash import Output, Patch, dcc, html, no_update
import dash_bootstrap_components as dbc

from . import details as D
from . import figures as F
from .client import node_series
from .common import RenderInput, TickInput, graph

SPLIT_NODES_DEFAULT = 3
RENDER_OUTPUTS = {"heat_figure": Output("g-heat", "figure"), "lines_figure": Output("g-lines", "figure"),
                  "split_figure": Output("g-split", "figure")}
TICK_OUTPUTS = {"lines_extend": Output("g-lines", "extendData"),
                "heat_patch": Output("g-heat", "figure", allow_duplicate=True),
                "lines_patch": Output("g-lines", "figure", allow_duplicate=True),
                "split_patch": Output("g-split", "figure", allow_duplicate=True)}


def source_legend() -> html.Div:
    return html.Div([html.Span("decision sources: ", className="text-muted small me-1")] + [
        html.Span([html.Span("●", style={"color": c, "fontSize": "18px"}), f" {s}"], className="me-3 small")
        for s, c in F.SOURCE_COLORS.items()], className="mb-2")


def layout():
    return html.Div([
        graph("g-heat", 260),
        dbc.Row([dbc.Col(html.Div([html.Span("nodes for target vs applied: ", className="small me-2"),
                                   dcc.Dropdown(id="split-nodes", multi=True, placeholder="first nodes")]), lg=8)],
                className="my-2"),
        source_legend(),
        graph("g-lines", 420),
        graph("g-split", 320),
    ], className="pt-2")


def split_rows(nodes: list[dict]) -> list[dict]:
    rows = []
    for n in sorted(nodes, key=lambda n: n["node_id"]):
        row = {"node_id": n["node_id"], "emb_share": n.get("emb_share")}
        arena = n.get("arena_bytes") or (n.get("cost_profile") or {}).get("arena_bytes")
        if arena:
            row["arena_bytes"] = arena
        rows.append(row)
    return rows


def render(r: RenderInput) -> dict:
    ns = node_series(r.rows)
    sel = [n for n in (r.split_sel or []) if n in r.order] or r.order[:SPLIT_NODES_DEFAULT]
    r.view["split_sel"] = sel
    dec = [d for n in sel for d in r.client.decisions(r.tok, start_s=r.start, node_id=n, limit=1000)["items"]]
    r.view["last_dec_id"] = max((d["id"] for d in dec), default=0)
    r.view["dec_since_s"] = max((d["ts_s"] for d in dec), default=None)
    return {"heat_figure": F.emb_share_heatmap({n: ns.get(n, {"t_s": []}) for n in r.order}, r.bursts, r.now,
                                               step_s=r.step),
            "lines_figure": F.share_lines_figure({n: ns.get(n, {"t_s": []}) for n in sel},
                                                 [dict(d, t_s=d["ts_s"], reason=rs)  # node-local times in UTC too
                                                  for d, rs in zip(dec, D.reasons_utc(dec, r.bursts))],
                                                 r.bursts, r.now, step_s=r.step),
            "split_figure": F.split_bar_figure(split_rows(r.nodes))}


def _heat_patch(t: TickInput, ns: dict) -> Patch | None:
    """The new heatmap columns; None when a whole range has been appended (the heatmap has no
    browser-side trimming: it is then drawn whole again, bounded at twice the range)."""
    p = Patch()
    times = F.gap_times(sorted({x for s_ in ns.values() for x in s_["t_s"]}), t.last, t.step)
    t.view["heat_cols"] = t.view.get("heat_cols", 0) + len(times)
    if t.view["heat_cols"] > t.max_points:
        return None
    p["data"][0]["x"].extend(F.to_xs(times))
    for i, node_id in enumerate(t.order):
        s_ = ns.get(node_id, {"t_s": [], "emb_share": []})
        by_t = dict(zip(s_["t_s"], s_["emb_share"]))
        p["data"][0]["z"][i].extend([by_t.get(x) for x in times])
    if t.shapes_changed:
        p["layout"]["shapes"] = F.time_shapes(t.bursts, t.now, outline=True)
    return p


def _lines_extension(t: TickInput, ns: dict, sel: list[str]):
    """``extendData`` for the target/applied lines of the chosen nodes and the decisions since the last tick."""
    view = t.view
    xs, ys, texts, idx = [], [], [], []
    for i, node_id in enumerate(sel):
        s_ = ns.get(node_id)
        if not s_:
            continue
        x, (applied, target) = F.gapped_extension(s_["t_s"], [s_["emb_share"], s_["target_emb_share"]], t.last,
                                                  t.step)
        xs += [x, x]
        ys += [applied, target]
        texts += [[""] * len(x)] * 2
        idx += [2 * i, 2 * i + 1]
    since = view.get("dec_since_s") or (t.now - 2 * t.step - 5)
    dec = [d for n in sel for d in t.client.decisions(t.tok, start_s=since, node_id=n, limit=1000)["items"]]
    view["dec_since_s"] = max([d["ts_s"] for d in dec] + [since])
    new = [d for d in dec if d["id"] > view.get("last_dec_id", 0)]
    view["last_dec_id"] = max([d["id"] for d in dec] + [view.get("last_dec_id", 0)])
    base = 2 * len(sel)
    reasons = D.reasons_utc(new, t.bursts)
    for j, src in enumerate(F.DECISION_SOURCES):
        ds = [dict(d, reason=r) for d, r in zip(new, reasons) if d["source"] == src]
        if ds:
            xs.append(F.to_xs(d["ts_s"] for d in ds))
            ys.append([d["emb_share"] for d in ds])
            texts.append([F.decision_hover(d) for d in ds])  # the reason on hover
            idx.append(base + j)
    return [{"x": xs, "y": ys, "text": texts}, idx, t.max_points] if idx else no_update


def tick(t: TickInput, out: dict) -> bool:
    """The page's partial updates, into ``out`` (named outputs) as they are made (a read that
    fails later leaves them sent with the view that counts them); False: draw it whole again."""
    sel = t.view.get("split_sel") or []
    ns = node_series(t.rows)
    if t.rows:
        heat = _heat_patch(t, ns)
        if heat is None:
            return False
        out["heat_patch"] = heat
        out["lines_extend"] = _lines_extension(t, ns, sel)
    elif t.shapes_changed:
        p = Patch()
        p["layout"]["shapes"] = F.time_shapes(t.bursts, t.now, outline=True)
        out["heat_patch"] = p
    p = Patch()
    bar = F.split_bar_figure(split_rows(t.nodes))
    p["data"][0]["x"] = list(bar.data[0].x)
    p["data"][1]["x"] = list(bar.data[1].x)
    out["split_patch"] = p
    if t.shapes_changed and sel:
        p = Patch()
        p["layout"]["shapes"] = F.time_shapes(t.bursts, t.now)
        if isinstance(out.get("lines_extend"), list):  # never a figure change and extendData together
            F.fold_extend(p, out["lines_extend"])
            out["lines_extend"] = no_update
        out["lines_patch"] = p
    return True
