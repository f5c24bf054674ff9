"""Pure figure builders of the operator dashboard: data in, `plotly.graph_objects.Figure` out.

Nothing here does I/O, reads the clock or knows about Dash callbacks: the callbacks in
`dashboard.app` fetch data through `dashboard.client` and hand it to these functions (the first
render, a change of time range) or build small `extendData` / `Patch` updates with the helpers at
the bottom (every live tick). Tests call them directly, without a browser.

Inputs are plain columnar dicts (what `dashboard.client` returns):

- cluster series ``{"t_s": [...], "slo_attainment": [...], "p99_ms": [...], "throughput_rps": [...],
  "emb_hit_rate": [...], "kv_hit_rate": [...]}`` (values may be ``None`` = no data in that bucket);
- node series ``{node_id: {"t_s": [...], "emb_share": [...], "target_emb_share": [...],
  "p99_ms": [...], ...}}``;
- bursts ``[{"node_id", "start_s", "end_s" (None while it lasts), "magnitude", ...}]``;
- decisions ``[{"node_id", "t_s", "source", "emb_share", "reason", ...}]``.

Times are Unix seconds; axes show them as UTC date-times. Every axis names its unit.

Every chart is SVG (`Scatter`, `Heatmap`, `Bar`): a series holds at most about 180 buckets (the
dashboard's `MAX_POINTS`), so even 32 nodes' P99 lines are a few thousand points, which SVG draws
faster than WebGL sets up its contexts (browsers allow about 8 per page; software-rendered WebGL
is slow). The dashboard ships plotly.js's *cartesian* bundle (scatter, bar, heatmap, ...;
`dashboard/assets/plotly-cartesian.min.js`), a third of the full bundle, so no WebGL trace types
are available.

**Decision-source colours** (the same everywhere on the dashboard, and in docs/dashboard.md):

    base      #1f77b4  blue    the shipped ONNX base policy decided
    residual  #2ca02c  green   base policy + the online residual adapter
    recovery  #ff7f0e  orange  the burst recovery controller capped the share KV-ward
    override  #d62728  red     an operator override is in force
    guard     #7f7f7f  grey    the guard clamped or rate-limited the value (or held it)

Burst periods are shaded (`BURST_FILL`) on every time chart as layout shapes named ``burst``.
"""

from __future__ import annotations

import html as _html
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone

import plotly.graph_objects as go
from plotly.subplots import make_subplots

SOURCE_COLORS: dict[str, str] = {
    "base": "#1f77b4",
    "residual": "#2ca02c",
    "recovery": "#ff7f0e",
    "override": "#d62728",
    "guard": "#7f7f7f",
}
DECISION_SOURCES = tuple(SOURCE_COLORS)
BURST_FILL = "rgba(255, 140, 0, 0.18)"
SLO_LINE = "#d62728"
EMB_COLOR = "#1f77b4"
KV_COLOR = "#9467bd"
UNKNOWN_SOURCE_COLOR = "#000000"
MIB = 2**20

_LAYOUT = dict(
    template="plotly_white",
    margin=dict(l=64, r=24, t=48, b=48),
    height=320,
    font=dict(size=12),
    hovermode="x unified",
    uirevision="keep",  # the user's zoom survives live updates
)


# ------------------------------------------------------------------------------- helpers ---


def to_x(t_s: float | None) -> int | None:
    """Unix seconds -> what the date axes take: milliseconds since the epoch (UTC), an integer.

    Numbers rather than date strings: a third of the bytes, and the browser does not parse a
    date per point (Plotly reads numbers on a date axis as epoch milliseconds).
    """
    if t_s is None:
        return None
    return int(round(float(t_s) * 1000.0))


def to_xs(ts: Iterable[float]) -> list[int]:
    return [int(round(float(t) * 1000.0)) for t in ts]


def x_to_text(x: int | None) -> str:
    """An axis value back to 'YYYY-MM-DD HH:MM:SS' (UTC), for tables and messages."""
    if x is None:
        return ""
    return datetime.fromtimestamp(x / 1000.0, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _clean(values: Iterable) -> list:
    """None / NaN / inf -> None (a gap in the line), everything else float."""
    out = []
    for v in values:
        if v is None:
            out.append(None)
            continue
        f = float(v)
        out.append(f if math.isfinite(f) else None)
    return out


GAP_FACTOR = 2.5  # a step between two points longer than this many buckets is a gap (no data)


def gap_step_s(ts: Sequence[float], step_s: float | None = None) -> float | None:
    """The series' bucket size: ``step_s`` when given, else the median spacing of ``ts``."""
    if step_s:
        return float(step_s)
    diffs = sorted(b - a for a, b in zip(ts, ts[1:]) if b > a)
    return diffs[len(diffs) // 2] if diffs else None


def with_gaps(ts: Sequence[float], columns: Sequence[Sequence], step_s: float | None = None,
              both_ends: bool = False) -> tuple[list[float], list[list]]:
    """``ts`` and its value ``columns`` with a None point put wherever two neighbours are more than
    `GAP_FACTOR` buckets apart: a line breaks there instead of joining the last value before an
    outage to the first after it (drawing, say, 0 req/s or emb_share 0.5 across time nobody served).

    The None point sits one bucket after the earlier neighbour; ``both_ends`` adds a second one
    bucket before the later neighbour (a heatmap's cells reach half-way to their neighbours, so
    the gap needs blank cells at both ends)."""
    ts = [float(t) for t in ts]
    cols = [(list(c) + [None] * len(ts))[:len(ts)] for c in columns]
    step = gap_step_s(ts, step_s)
    if step is None or len(ts) < 2:
        return ts, cols
    limit = GAP_FACTOR * step
    out_t: list[float] = [ts[0]]
    out_c: list[list] = [[c[0]] for c in cols]
    for i in range(1, len(ts)):
        prev, t = ts[i - 1], ts[i]
        if t - prev > limit:
            fill = [prev + step] + ([t - step] if both_ends and t - step > prev + step else [])
            for x in fill:
                out_t.append(x)
                for oc in out_c:
                    oc.append(None)
        out_t.append(t)
        for oc, c in zip(out_c, cols):
            oc.append(c[i])
    return out_t, out_c


def _gapped(ts: Sequence[float], *columns: Sequence, step_s: float | None = None) -> tuple[list[int], list[list]]:
    """`with_gaps` on cleaned columns, times as axis values."""
    t, cols = with_gaps(list(ts), [_clean(c) for c in columns], step_s)
    return to_xs(t), cols


def merge_periods(bursts: Sequence[Mapping], now_s: float | None = None) -> list[tuple[float, float]]:
    """Union of the bursts' [start, end] periods (an open burst ends at ``now_s``, or its start).

    Cluster charts shade the union, so overlapping bursts of several nodes give one band.
    """
    spans = []
    for b in bursts:
        start = b.get("start_s")
        if start is None:
            continue
        end = b.get("end_s")
        if end is None:
            end = now_s if now_s is not None else start
        spans.append((float(start), max(float(start), float(end))))
    spans.sort()
    merged: list[list[float]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def burst_shapes(bursts: Sequence[Mapping], now_s: float | None = None) -> list[dict]:
    """One shaded rectangle (full plot height) per merged burst period, named ``burst``."""
    return [dict(type="rect", xref="x", yref="paper", x0=to_x(s), x1=to_x(e), y0=0, y1=1,
                 fillcolor=BURST_FILL, line=dict(width=0), layer="below", name="burst")
            for s, e in merge_periods(bursts, now_s)]


def hline_shape(y: float, name: str, color: str = SLO_LINE) -> dict:
    """A dashed horizontal reference line across the plot (SLO, target), named ``name``."""
    return dict(type="line", xref="paper", x0=0, x1=1, yref="y", y0=y, y1=y, name=name,
                line=dict(color=color, dash="dash", width=2), layer="above")


def time_shapes(bursts: Sequence[Mapping] | None, now_s: float | None, hlines: Sequence[dict] = (),
                outline: bool = False) -> list[dict]:
    """All layout shapes of a time chart: its reference lines, then the burst bands.

    The live update re-sends this list (a small `Patch`) when the bursts change, so the builders
    and the update agree on it. ``outline``: bursts drawn as dotted outlines (over a heatmap).
    """
    shapes = [dict(s) for s in hlines]
    for shape in burst_shapes(bursts or [], now_s):
        if outline:
            shape = dict(shape, fillcolor="rgba(0,0,0,0)", line=dict(color="#ff8c00", width=2, dash="dot"),
                         layer="above")
        shapes.append(shape)
    return shapes


def _base(title: str, y_title: str, x_title: str = "time (UTC)") -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=dict(text=title, x=0.01, font=dict(size=14)), **_LAYOUT)
    fig.update_xaxes(title_text=x_title, type="date")
    fig.update_yaxes(title_text=y_title)
    return fig


def _legend_top(fig: go.Figure) -> None:
    """A horizontal legend above the plot, right-aligned (the title is on the left)."""
    fig.update_layout(legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1,
                                  traceorder="normal", font=dict(size=11)),
                      margin=dict(t=64))


def _add_bursts(fig: go.Figure, bursts: Sequence[Mapping] | None, now_s: float | None,
                hlines: Sequence[dict] = (), outline: bool = False) -> None:
    fig.update_layout(shapes=time_shapes(bursts, now_s, hlines, outline))
    if not outline:
        # a legend entry for the shading (shapes have none)
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="burst period",
                                 marker=dict(symbol="square", size=12, color=BURST_FILL),
                                 hoverinfo="skip", showlegend=True))


# ---------------------------------------------------------------------------- overview ---


def slo_attainment_figure(cluster: Mapping, target: float, bursts: Sequence[Mapping] | None = None,
                          now_s: float | None = None, step_s: float | None = None) -> go.Figure:
    """SLO attainment (fraction of requests within the SLO) over time against its target, on a
    fixed 0-100% axis. ``step_s``: the buckets' size (gaps longer than `GAP_FACTOR` buckets are
    left blank; the median spacing when not given), as for every time chart here."""
    fig = _base("SLO attainment vs target", "requests within SLO (%)")
    xs, (att,) = _gapped(cluster.get("t_s", []), cluster.get("slo_attainment", []), step_s=step_s)
    y = [None if v is None else 100.0 * v for v in att]
    fig.add_trace(go.Scatter(x=xs, y=y, mode="lines", name="attainment", line=dict(color=EMB_COLOR, width=2)))
    fig.add_annotation(xref="paper", x=1, y=100.0 * target, yref="y", text=f"target {100 * target:g}%",
                       showarrow=False, xanchor="right", yanchor="top", font=dict(color=SLO_LINE))
    _add_bursts(fig, bursts, now_s, [hline_shape(100.0 * target, "target")])
    # the whole 0-100% scale: a range fitted to the first draw would drop later, lower values
    # that live updates append (a KPI card at 11% and no line)
    fig.update_yaxes(range=[0, 100.5])
    _legend_top(fig)
    return fig


LEGEND_MAX_NODES = 12


def p99_figure(nodes: Mapping[str, Mapping], slo_ms: float, bursts: Sequence[Mapping] | None = None,
               now_s: float | None = None, cluster: Mapping | None = None,
               step_s: float | None = None) -> go.Figure:
    """P99 latency per node (one line each, in ``nodes`` order) with the SLO line.

    With ``cluster`` the cluster-wide P99 is the last trace (thicker). Trace order is what the
    live `extend_nodes` update relies on.
    """
    fig = _base("P99 latency vs SLO", "P99 latency (ms)")
    # one legend entry per node up to LEGEND_MAX_NODES; beyond, one entry for the group (it
    # toggles every node; hovering a line names its node): a 32-entry legend is unreadable and
    # measuring its labels was a fifth of the browser's first draw
    grouped = len(nodes) > LEGEND_MAX_NODES
    for node_id, s in nodes.items():
        xs, (ys,) = _gapped(s.get("t_s", []), s.get("p99_ms", []), step_s=step_s)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines",
                                 name=str(node_id), line=dict(width=1), opacity=0.7, legendgroup="nodes",
                                 showlegend=not grouped))
    if grouped:  # the group's legend entry (after the node traces: extendData addresses those by index)
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=f"{len(nodes)} nodes (hover: node)",
                                 legendgroup="nodes", line=dict(width=1, color="#888888"), hoverinfo="skip"))
    if cluster is not None:
        xs, (ys,) = _gapped(cluster.get("t_s", []), cluster.get("p99_ms", []), step_s=step_s)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name="cluster", line=dict(width=3, color="#111111")))
    fig.add_annotation(xref="paper", x=0, y=slo_ms, yref="y", text=f"SLO {slo_ms:g} ms", showarrow=False,
                       xanchor="left", yanchor="bottom", font=dict(color=SLO_LINE))
    _add_bursts(fig, bursts, now_s, [hline_shape(slo_ms, "slo")])
    fig.update_layout(legend=dict(font=dict(size=10), itemsizing="constant"))
    return fig


def throughput_figure(cluster: Mapping, bursts: Sequence[Mapping] | None = None,
                      now_s: float | None = None, step_s: float | None = None) -> go.Figure:
    fig = _base("Throughput", "requests per second (req/s)")
    xs, (ys,) = _gapped(cluster.get("t_s", []), cluster.get("throughput_rps", []), step_s=step_s)
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name="served", line=dict(color="#17becf", width=2)))
    _add_bursts(fig, bursts, now_s)
    fig.update_yaxes(rangemode="tozero")
    _legend_top(fig)
    return fig


def hit_rate_figure(cluster: Mapping, bursts: Sequence[Mapping] | None = None,
                    now_s: float | None = None, step_s: float | None = None) -> go.Figure:
    """EMB row hit rate and KV token hit rate (cluster) over time, in %."""
    fig = _base("Cache hit rates", "hit rate (%)")
    xs, cols = _gapped(cluster.get("t_s", []), cluster.get("emb_hit_rate", []), cluster.get("kv_hit_rate", []),
                       step_s=step_s)
    for col, name, color in ((cols[0], "EMB hit rate (rows)", EMB_COLOR),
                             (cols[1], "KV hit rate (tokens)", KV_COLOR)):
        y = [None if v is None else 100.0 * v for v in col]
        fig.add_trace(go.Scatter(x=xs, y=y, mode="lines", name=name, line=dict(color=color, width=2)))
    _add_bursts(fig, bursts, now_s)
    fig.update_yaxes(range=[0, 100.5])
    _legend_top(fig)
    return fig


# ------------------------------------------------------------------------------- split ---


def emb_share_heatmap(nodes: Mapping[str, Mapping], bursts: Sequence[Mapping] | None = None,
                      now_s: float | None = None, step_s: float | None = None) -> go.Figure:
    """Nodes x time heatmap of emb_share (the applied share of arena pages given to the EMB slab).

    The nodes' series are aligned on the union of their timestamps (a node without a value there
    is blank). Rows are in ``nodes`` order, top to bottom. Where no node reported for more than
    `GAP_FACTOR` buckets, blank columns fill the gap (a cell otherwise reaches half-way to its
    neighbour, painting the last value across the outage).
    """
    times = sorted({t for s in nodes.values() for t in s.get("t_s", [])})
    times, _ = with_gaps(times, [], step_s, both_ends=True)
    col = {t: i for i, t in enumerate(times)}
    z = []
    for s in nodes.values():
        row: list = [None] * len(times)
        for t, v in zip(s.get("t_s", []), _clean(s.get("emb_share", []))):
            row[col[float(t)]] = v
        z.append(row)
    fig = _base("emb_share per node (fraction of arena pages in the EMB slab)", "node")
    fig.add_trace(go.Heatmap(x=to_xs(times), y=[str(n) for n in nodes], z=z, zmin=0.0, zmax=1.0,
                             colorscale="Viridis", colorbar=dict(title=dict(text="emb_share"), thickness=14),
                             hovertemplate="%{y}<br>%{x}<br>emb_share %{z:.3f}<extra></extra>",
                             name="emb_share"))
    _add_bursts(fig, bursts, now_s, outline=True)
    fig.update_yaxes(type="category", autorange="reversed", title_text="node")
    fig.update_layout(height=max(260, 60 + 16 * len(nodes)), hovermode="closest")
    return fig


def share_lines_figure(nodes: Mapping[str, Mapping], decisions: Sequence[Mapping],
                       bursts: Sequence[Mapping] | None = None, now_s: float | None = None,
                       step_s: float | None = None) -> go.Figure:
    """Target vs applied emb_share of the selected nodes, decisions marked by source colour.

    Per node: applied (solid) and target (dashed) lines. Decisions of those nodes are markers,
    one trace per decision source (coloured by `SOURCE_COLORS`, in `DECISION_SOURCES` order), each
    marker's hover text giving the node and the decision's reason.
    """
    fig = _base("Target vs applied emb_share (markers: allocator decisions by source)",
                "emb_share (fraction of arena pages)")
    palette = ["#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#31a354", "#756bb1"]
    for i, (node_id, s) in enumerate(nodes.items()):
        color = palette[i % len(palette)]
        xs, (applied, target) = _gapped(s.get("t_s", []), s.get("emb_share", []), s.get("target_emb_share", []),
                                        step_s=step_s)
        blank = [""] * len(xs)  # a text per point, so live updates can extend every trace's text alike
        fig.add_trace(go.Scatter(x=xs, y=applied, mode="lines", text=blank, hoverinfo="x+y+name",
                                   name=f"{node_id} applied", line=dict(color=color, width=2),
                                   legendgroup=str(node_id)))
        fig.add_trace(go.Scatter(x=xs, y=target, mode="lines", text=blank, hoverinfo="x+y+name",
                                   name=f"{node_id} target", line=dict(color=color, width=1.5, dash="dash"),
                                   legendgroup=str(node_id)))
    selected = {str(n) for n in nodes}
    by_source: dict[str, list[Mapping]] = {s: [] for s in DECISION_SOURCES}
    for d in decisions:
        if str(d.get("node_id")) in selected:
            by_source.setdefault(str(d.get("source")), []).append(d)
    for source, rows in by_source.items():
        fig.add_trace(go.Scatter(
            x=to_xs(r["t_s"] for r in rows), y=_clean(r.get("emb_share") for r in rows), mode="markers",
            name=f"decision: {source}", legendgroup="sources",
            marker=dict(color=SOURCE_COLORS.get(source, UNKNOWN_SOURCE_COLOR), size=7,
                        line=dict(width=0.5, color="white")),
            text=[decision_hover(r) for r in rows],
            hovertemplate="%{text}<br>emb_share %{y:.3f}<extra></extra>", meta=source))
    _add_bursts(fig, bursts, now_s)
    fig.update_yaxes(range=[0, 1])
    fig.update_layout(hovermode="closest", height=420,
                      legend=dict(orientation="v", x=1.01, xanchor="left", y=1, font=dict(size=11)))
    return fig


def decision_hover(d: Mapping) -> str:
    """A decision marker's hover text: node, source and the reason (wrapped, up to 12 lines), every
    part escaped: a reason comes from a node, and plotly renders tags in hover text."""
    return (f"{_html.escape(str(d.get('node_id')))} · {_html.escape(str(d.get('source')))}"
            f"<br>{_wrap(str(d.get('reason', '')), max_lines=12)}")


def _wrap(text: str, width: int = 80, max_lines: int = 4) -> str:
    """``text`` in lines of about ``width`` characters joined by ``<br>``, HTML-escaped (the
    only tags in the result are the line breaks)."""
    words, lines, cur = text.split(), [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    if cur:
        lines.append(cur)
    if len(lines) > max_lines:
        lines = lines[:max_lines] + ["…"]
    return "<br>".join(_html.escape(x) for x in lines)


def split_bar_figure(nodes: Sequence[Mapping]) -> go.Figure:
    """Each node's current split as a stacked horizontal bar: EMB slab vs KV pool.

    ``nodes``: ``[{"node_id", "emb_share", "arena_bytes"?}]`` or with ``emb_bytes``/``kv_bytes``.
    In MiB where the bytes are known (``emb_bytes``/``kv_bytes``, or ``arena_bytes`` x share);
    otherwise in % of the node's arena.
    """
    fig = go.Figure()
    fig.update_layout(title=dict(text="Current split per node (EMB slab vs KV pool)", x=0.01, font=dict(size=14)),
                      **{**_LAYOUT, "hovermode": "y unified"})
    ids = [str(n["node_id"]) for n in nodes]
    emb, kv = [], []
    in_bytes = all(("emb_bytes" in n and "kv_bytes" in n) or n.get("arena_bytes") for n in nodes) and bool(nodes)
    for n in nodes:
        share = n.get("emb_share")
        share = float(share) if share is not None else None
        if in_bytes:
            if "emb_bytes" in n and "kv_bytes" in n:
                e, k = float(n["emb_bytes"] or 0), float(n["kv_bytes"] or 0)
            else:
                a = float(n["arena_bytes"])
                e, k = (a * share, a * (1 - share)) if share is not None else (None, None)
            emb.append(None if e is None else e / MIB)
            kv.append(None if k is None else k / MIB)
        else:
            emb.append(None if share is None else 100 * share)
            kv.append(None if share is None else 100 * (1 - share))
    unit = "MiB" if in_bytes else "%"
    fig.add_trace(go.Bar(y=ids, x=emb, orientation="h", name="EMB slab", marker_color=EMB_COLOR,
                         hovertemplate="%{y}: EMB %{x:.1f} " + unit + "<extra></extra>"))
    fig.add_trace(go.Bar(y=ids, x=kv, orientation="h", name="KV pool", marker_color=KV_COLOR,
                         hovertemplate="%{y}: KV %{x:.1f} " + unit + "<extra></extra>"))
    fig.update_layout(barmode="stack", height=max(240, 110 + 18 * len(nodes)))
    fig.update_xaxes(title_text="arena bytes (MiB)" if in_bytes else "share of the node's arena (%)")
    fig.update_yaxes(title_text="node", type="category", autorange="reversed")
    _legend_top(fig)
    return fig


# -------------------------------------------------------------------- routing, rollouts ---


def router_weights_figure(history: Sequence[Mapping], field: str = "service_time_us",
                          now_s: float | None = None) -> go.Figure:
    """Router weight inputs over time (step lines), hover gives each change's reason: what
    differs between nodes. Nodes whose values are the same at every version share one line, named
    after them ("node-1, node-2" or "all 4 nodes"); when every node has the same values a note
    says so (four identical lines would hide each other).

    ``history``: ``[{"t_s", "version", "nodes": {node_id: {<field>: value, "reason": str}}}]``
    (one entry per pushed weights version, oldest first). With ``now_s`` each line goes on to now
    at its current value (a weight holds until the next version).
    """
    unit = field.rsplit("_", 1)[-1] if field.endswith(("_us", "_ms", "_s")) else ""
    pretty = {"service_time_us": "service time", "kv_recompute_us_per_token": "KV recompute per token",
              "emb_transfer_us_per_row": "EMB transfer per row", "queue_capacity": "queue capacity"}
    y_title = f"{pretty.get(field, field)} ({'µs' if 'us' in field.split('_') else unit or 'requests'})"
    fig = _base(f"Router weights per node: {pretty.get(field, field)}", y_title)
    per_node: dict[str, dict[str, list]] = {}
    for entry in history:
        for node_id, w in (entry.get("nodes") or {}).items():
            s = per_node.setdefault(str(node_id), {"x": [], "y": [], "text": []})  # (reasons escaped by _wrap)
            s["x"].append(to_x(entry["t_s"]))
            s["y"].append(w.get(field))
            s["text"].append(f"v{entry.get('version')}: {_wrap(str(w.get('reason', '')), 60, 3)}")
    groups: dict[tuple, list[str]] = {}
    for node_id, s in per_node.items():
        groups.setdefault(tuple(zip(s["x"], _clean(s["y"]))), []).append(node_id)
    for members in groups.values():
        s = per_node[members[0]]
        if len(members) == 1:
            name = members[0]
        elif len(members) == len(per_node):
            name = f"all {len(members)} nodes"
        else:
            name = ", ".join(members[:3]) + (f" (+{len(members) - 3})" if len(members) > 3 else "")
        sizes = [6] * len(s["x"])
        if now_s is not None and s["x"] and to_x(now_s) > s["x"][-1]:
            s["x"].append(to_x(now_s))
            s["y"].append(s["y"][-1])
            s["text"].append(s["text"][-1] + " (current)")
            sizes.append(0)
        fig.add_trace(go.Scatter(x=s["x"], y=_clean(s["y"]), text=s["text"], mode="lines+markers",
                                   line=dict(shape="hv", width=1.5), marker=dict(size=sizes), name=name,
                                   meta=members,
                                   hovertemplate="%{y:.2f}<br>%{text}<extra>" + name + "</extra>"))
    if len(groups) == 1 and len(per_node) > 1:
        fig.add_annotation(text=f"the same on all {len(per_node)} nodes", xref="paper", yref="paper", x=0.01,
                           y=0.98, showarrow=False, xanchor="left", yanchor="top",
                           font=dict(size=12, color="#6c757d"), name="identical")
    fig.update_layout(hovermode="closest", legend=dict(font=dict(size=10)))
    ys = [v for s in per_node.values() for v in _clean(s["y"]) if v is not None and v > 0]
    if ys and max(ys) / min(ys) > 50:  # nodes of very different speeds: a log axis keeps all readable
        fig.update_yaxes(type="log", title_text=y_title + ", log scale")
    else:  # from zero: a flat line would get an axis a few thousandths wide (ticks 12.2885k, 12.289k)
        fig.update_yaxes(rangemode="tozero")
    return fig


def rollout_figure(windows: Sequence[Mapping], slo_ms: float | None = None,
                   target: float | None = None, kind: str = "policy") -> go.Figure:
    """Canary vs baseline per evaluation window: P99 (ms, top) and SLO attainment (%, bottom);
    for a model rollout (``kind`` "model") the bottom panel is the online model quality its
    judge reads (HR@k of the users' next items, %).

    ``windows``: ``[{"t_s", "group": "canary"|"baseline", "p99_ms", "slo_attainment", "model_quality"}]``.
    """
    model = kind == "model"
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("P99 latency per window", "model quality per window (judged)" if model
                                        else "SLO attainment per window"))
    colors = {"canary": "#d62728", "baseline": "#1f77b4"}
    for group in ("baseline", "canary"):
        rows = sorted((w for w in windows if w.get("group") == group), key=lambda w: w["t_s"])
        xs = to_xs(w["t_s"] for w in rows)
        fig.add_trace(go.Scatter(x=xs, y=_clean(w.get("p99_ms") for w in rows), mode="lines+markers",
                                   name=f"{group} P99", line=dict(color=colors[group]), legendgroup=group),
                      row=1, col=1)
        field = "model_quality" if model else "slo_attainment"
        att = [None if v is None else 100 * v for v in _clean(w.get(field) for w in rows)]
        fig.add_trace(go.Scatter(x=xs, y=att, mode="lines+markers",
                                 name=f"{group} {'quality' if model else 'attainment'}",
                                 line=dict(color=colors[group], dash="dot"), legendgroup=group),
                      row=2, col=1)
    if slo_ms is not None:
        fig.add_hline(y=slo_ms, line=dict(color="#555", dash="dash"), row=1, col=1,
                      annotation_text=f"SLO {slo_ms:g} ms", annotation_position="top left")
    if target is not None and not model:
        fig.add_hline(y=100 * target, line=dict(color="#555", dash="dash"), row=2, col=1,
                      annotation_text=f"target {100 * target:g}%", annotation_position="bottom left")
    fig.update_layout(title=dict(text="Rollout: canary vs baseline", x=0.01, font=dict(size=14)),
                      **{**_LAYOUT, "height": 460, "hovermode": "x unified"})
    fig.update_yaxes(title_text="P99 (ms)", row=1, col=1)
    fig.update_yaxes(title_text="HR@k of next items (%)" if model else "within SLO (%)", row=2, col=1)
    fig.update_xaxes(title_text="time (UTC)", type="date", row=2, col=1)
    fig.update_xaxes(type="date", row=1, col=1)
    ts = [w["t_s"] for w in windows]
    if ts and max(ts) - min(ts) < 120:  # the first windows: show two minutes, not milliseconds
        fig.update_xaxes(range=[to_x(min(ts) - 60), to_x(max(ts) + 60)])
    if not ts:
        fig.update_xaxes(showticklabels=False)
        fig.add_annotation(text="no rollout windows yet", xref="paper", yref="paper", x=0.5, y=0.5,
                           showarrow=False, font=dict(size=14, color="#6c757d"))
    _legend_top(fig)
    fig.update_layout(height=500, margin=dict(t=90))
    return fig


# ------------------------------------------------------------------- live partial updates ---


def gapped_extension(ts: Sequence[float], columns: Sequence[Sequence], last_t_s: float | None,
               step_s: float | None) -> tuple[list[int], list[list]]:
    """New points of a live update with their gaps: inside them (`with_gaps`), and before the
    first one when it comes more than `GAP_FACTOR` buckets after ``last_t_s``, the last point
    already drawn (an outage between two ticks breaks the line too)."""
    ts = [float(t) for t in ts]
    cols = [_clean(c) for c in columns]
    if last_t_s is not None and ts:
        ts, cols = [float(last_t_s)] + ts, [[None] + c for c in cols]
        t, cols = with_gaps(ts, cols, step_s)
        t, cols = t[1:], [c[1:] for c in cols]
    else:
        t, cols = with_gaps(ts, cols, step_s)
    return to_xs(t), cols


def gap_times(ts: Sequence[float], last_t_s: float | None, step_s: float | None) -> list[float]:
    """New heatmap columns' times with blank ones where they leave a gap (`with_gaps` with
    ``both_ends``), also between ``last_t_s`` (the last column drawn) and the first new one."""
    ts = [float(t) for t in ts]
    if last_t_s is None or not ts:
        return with_gaps(ts, [], step_s, both_ends=True)[0]
    return with_gaps([float(last_t_s)] + ts, [], step_s, both_ends=True)[0][1:]


def extend_nodes(nodes: Mapping[str, Mapping], order: Sequence[str], field: str,
                 max_points: int, last_t_s: float | None = None, step_s: float | None = None) -> list | None:
    """``extendData`` for a figure with one trace per node in ``order`` (as `p99_figure` builds it):
    ``[{"x": [[...], ...], "y": [[...], ...]}, [trace indices], max_points]`` or None when empty.
    ``last_t_s`` / ``step_s``: the last time drawn and the bucket size, for the gaps (`_extension`).
    """
    xs, ys, idx = [], [], []
    for i, node_id in enumerate(order):
        s = nodes.get(node_id)
        if not s or not s.get("t_s"):
            continue
        x, (y,) = gapped_extension(s["t_s"], [s.get(field, [])], last_t_s, step_s)
        xs.append(x)
        ys.append(y)
        idx.append(i)
    if not idx:
        return None
    return [{"x": xs, "y": ys}, idx, max_points]


def fold_extend(patch, ext: list | None) -> None:
    """Append the points of an ``extendData`` update (`extend_nodes`, `extend_cluster`) to
    ``patch``, a `dash.Patch` of the same figure, instead of sending both in one answer.

    dcc.Graph mishandles a ``figure`` change and an ``extendData`` arriving together: the new
    points are dropped, and re-appended on later ticks, out of order and more than once (a line
    jumping back to an earlier time: a spike). So a tick that must change a chart's layout (its
    burst shapes) sends that chart's new points in the same `Patch`; ``maxPoints`` trimming then
    waits for the next plain ``extendData``."""
    if not ext:
        return
    data, idx = ext[0], ext[1]
    for k, i in enumerate(idx):
        for key, values in data.items():
            patch["data"][i][key].extend(values[k])


def extend_cluster(cluster: Mapping, fields: Sequence[str], max_points: int,
                   scale: float = 1.0, last_t_s: float | None = None, step_s: float | None = None) -> list | None:
    """``extendData`` for traces 0..len(fields)-1 of a cluster figure, one field each (gaps as in
    `extend_nodes`)."""
    t = cluster.get("t_s") or []
    if not t:
        return None
    x, cols = gapped_extension(t, [cluster.get(f, []) for f in fields], last_t_s, step_s)
    ys = [[None if v is None else scale * v for v in c] for c in cols]
    return [{"x": [x] * len(fields), "y": ys}, list(range(len(fields))), max_points]
