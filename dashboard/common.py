"""What every page of the dashboard shares: the time-range constants, the component builders
(charts, KPI cards, data grids and their columns), time and number formatting, and the
dependencies a page's callbacks need (`Deps`). No callbacks here; nothing reads the network."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import dash_ag_grid as dag
import dash_bootstrap_components as dbc
from dash import dcc, html, no_update

from . import figures as F
from .client import ControlPlaneClient
from .history import HistoryCache

RANGES = [("5 min", 300), ("15 min", 900), ("1 h", 3600), ("6 h", 6 * 3600), ("24 h", 86400)]
STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600)
MAX_POINTS = 180
SLOW_MS = 1500.0
SLO_TARGET_DEFAULT = 0.99
DECISION_LIMIT = 500
BUCKET_GRACE_S = 5.0  # a bucket is drawn 5 s after its end: reports (1 s interval) arrive late under load


def step_for(range_s: float) -> int:
    """The bucket size (s) that gives at most `MAX_POINTS` points over ``range_s``."""
    for s in STEPS:
        if range_s / s <= MAX_POINTS:
            return s
    return STEPS[-1]


@dataclass
class Deps:
    """What the pages' callbacks use: the API client, the sign-ins, a pool for parallel reads,
    the shared history cache, and the SLO settings (``--slo-ms``: the API does not publish it)."""
    client: ControlPlaneClient
    sessions: object  # dashboard.signin.SessionStore
    pool: ThreadPoolExecutor
    cache: HistoryCache
    slo_ms: float
    slo_target: float


def unchanged(outputs: dict) -> dict:
    """Every named output of a callback set to `no_update` (a callback fills in what changed)."""
    return {k: no_update for k in outputs}


# ------------------------------------------------------------------------ builders ---


def graph(gid: str, height: int = 320) -> dcc.Graph:
    return dcc.Graph(id=gid, figure={"data": [], "layout": {"height": height, "template": "plotly_white"}},
                     config={"displaylogo": False, "responsive": True}, style={"minHeight": f"{height}px"})


def kpi(kid: str, label: str) -> dbc.Col:
    return dbc.Col(dbc.Card(dbc.CardBody([html.Div(label, className="text-muted small"),
                                          html.Div("–", id=kid, className="fs-5 fw-semibold")]), className="h-100"),
                   xs=6, md=3, lg=True)


def grid(gid: str, columns: list[dict], *, page_size: int = 10, height: int = 360, selectable: bool = False,
         row_id: str | None = None) -> dag.AgGrid:
    opts: dict = {"pagination": True, "paginationPageSize": page_size, "paginationPageSizeSelector": False,
                  "animateRows": False, "enableCellTextSelection": True}
    if selectable:
        opts["rowSelection"] = {"mode": "singleRow", "checkboxes": True, "enableClickSelection": True}
    extra = {"getRowId": f"params.data.{row_id}"} if row_id else {}  # row ids are strings
    return dag.AgGrid(id=gid, columnDefs=columns, rowData=[], dashGridOptions=opts, **extra,
                      defaultColDef={"resizable": True, "sortable": True, "filter": True, "minWidth": 90},
                      columnSize="responsiveSizeToFit", style={"height": f"{height}px"})


def col(name: str, header: str | None = None, **kw) -> dict:
    return {"field": name, "headerName": header or name, **kw}


def time_col(name: str, header: str) -> dict:
    return {"field": name, "headerName": header, "minWidth": 170}


def range_options(range_s: int) -> list[dict]:
    opts = [{"label": lbl, "value": v} for lbl, v in RANGES]
    if range_s not in {v for _, v in RANGES}:
        opts.append({"label": fmt_age(range_s), "value": range_s})
        opts.sort(key=lambda o: o["value"])
    return opts


# ---------------------------------------------------------------------- formatting ---


def fmt_t(t_s) -> str:
    """Unix seconds as 'YYYY-MM-DD HH:MM:SS' (UTC)."""
    return "" if t_s is None else F.x_to_text(F.to_x(t_s))


def fmt_age(age_s: float) -> str:
    if age_s < 90:
        return f"{age_s:.0f} s"
    if age_s < 5400:
        return f"{age_s / 60:.0f} min"
    return f"{age_s / 3600:.1f} h"


def pct(v) -> str:
    return "–" if v is None else f"{100 * v:.2f}%"


def short(d) -> str:
    if d is None:
        return ""
    s = json.dumps(d, separators=(",", ":"), default=str)
    return s if len(s) <= 160 else s[:157] + "…"


def jsonable(o):
    """Figures and components as JSON (for change hashes)."""
    if hasattr(o, "to_plotly_json"):
        return o.to_plotly_json()
    return str(o)




@dataclass
class RenderInput:
    """What `dashboard.live`'s render read for the active page, handed to the page's ``render``.
    ``view``: the live state (the ``view`` store) a page may add its own keys to."""
    client: ControlPlaneClient
    tok: str
    now: float
    start: float
    step: int
    range_s: float
    order: list[str]
    nodes: list[dict]
    rows: list[dict]
    bursts: list[dict]
    view: dict
    slo_ms: float
    slo_target: float
    split_sel: list[str] | None = None
    weights_field: str | None = None


@dataclass
class TickInput:
    """What a live tick read for the overview and split pages: ``rows`` are the complete buckets
    newer than ``last`` (the last drawn), ``shapes_changed`` says whether the burst shading moved."""
    client: ControlPlaneClient
    tok: str
    now: float
    step: int
    range_s: float
    max_points: int
    order: list[str]
    rows: list[dict]
    last: float | None
    bursts: list[dict]
    nodes: list[dict]
    shapes_changed: bool
    view: dict
    slo_ms: float
    slo_target: float
