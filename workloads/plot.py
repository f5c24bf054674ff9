"""Plots of a request stream over time: an interactive HTML (Plotly) and a PNG (matplotlib).

Both show the same four panels from `RequestStream.window_stats`: request rate, hot-user ratio,
history length (p50 / p99) and item popularity skew, with burst windows shaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .regimes import RequestStream

PANELS = (
    ("rate_rps", "request rate (req/s)"),
    ("hot_user_ratio", "hot-user ratio (top-1% users' share)"),
    ("history_len", "history length (items)"),
    ("item_top1pct_share", "top-1% items' share of lookups"),
)


def stream_figure(stream: RequestStream, stats: dict[str, np.ndarray], title: str):
    """The Plotly figure (pure: data in, figure out)."""
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go

    fig = make_subplots(rows=len(PANELS), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=[label for _, label in PANELS])
    t = stats["t_s"]
    for row, (key, label) in enumerate(PANELS, start=1):
        if key == "history_len":
            fig.add_trace(go.Scatter(x=t, y=stats["history_len_p50"], name="history p50", mode="lines"), row=row, col=1)
            fig.add_trace(go.Scatter(x=t, y=stats["history_len_p99"], name="history p99", mode="lines"), row=row, col=1)
        else:
            fig.add_trace(go.Scatter(x=t, y=stats[key], name=label, mode="lines"), row=row, col=1)
    for s, e in stream.bursts:
        fig.add_vrect(x0=s, x1=e, fillcolor="crimson", opacity=0.15, line_width=0, row="all", col=1)
    fig.update_xaxes(title_text="time (s)", row=len(PANELS), col=1)
    fig.update_layout(title=title, height=220 * len(PANELS), showlegend=False, template="plotly_white")
    return fig


def write_stream_plots(stream: RequestStream, out_dir: str | Path, *, window_s: float = 1.0,
                       name: str | None = None) -> dict[str, str]:
    """Write ``<name>.html`` and ``<name>.png`` into ``out_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = stream.config
    name = name or f"workload_{stream.trace.name}_{cfg.regime}"
    stats = stream.window_stats(window_s)
    title = (f"{stream.trace.name} / {cfg.regime}: {len(stream):,} requests, {stream.num_users:,} users, "
             f"{cfg.rate_rps:g} req/s base, seed {cfg.seed}")

    html = out / f"{name}.html"
    stream_figure(stream, stats, title).write_html(html, include_plotlyjs=True, full_html=True)

    fig, axes = plt.subplots(len(PANELS), 1, figsize=(11, 2.4 * len(PANELS)), sharex=True)
    t = stats["t_s"]
    for ax, (key, label) in zip(axes, PANELS):
        if key == "history_len":
            ax.plot(t, stats["history_len_p50"], label="p50")
            ax.plot(t, stats["history_len_p99"], label="p99")
            ax.legend(loc="upper left", fontsize=8)
        else:
            ax.plot(t, stats[key])
        for i, (s, e) in enumerate(stream.bursts):
            ax.axvspan(s, e, color="crimson", alpha=0.15, label="burst" if i == 0 and key == "rate_rps" else None)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    if stream.bursts:
        axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("time (s)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png = out / f"{name}.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return {"html": str(html), "png": str(png)}
