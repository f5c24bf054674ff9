"""The Override page: set or clear an emb_share override (one node or cluster-wide), drain and
retire a node, and the audit log. Every action asks for confirmation first (`ask`,
`ask_retire` fill the ``pending`` store; `dashboard.confirm` runs it). The tables are sent only
when they changed since the last tick (a hash per output in the ``tables-key`` store)."""

from __future__ import annotations

import hashlib
import json

import dash_bootstrap_components as dbc
from dash import Input, Output, State, ctx, dcc, html, no_update

from .client import ApiError, Unavailable
from .common import col, fmt_t, grid, jsonable, short, time_col

ACTION_BUTTONS = ("btn-ov-submit", "btn-ov-clear")  # the policies tab's: dashboard.policies_tab


def _form(viewer: bool) -> dbc.Card:
    return dbc.Card(dbc.CardBody([
        html.H6("Set an emb_share override"),
        dbc.Row([
            dbc.Col([dbc.Label("scope"), dbc.RadioItems(id="ov-scope", value="node", inline=True, options=[
                {"label": "one node", "value": "node"}, {"label": "cluster-wide", "value": "cluster"}])], lg=3),
            dbc.Col([dbc.Label("node", html_for="ov-node"),
                     dcc.Dropdown(id="ov-node", placeholder="node"),
                     html.Div(id="ov-current", className="small text-muted mt-1")], lg=3),
            dbc.Col([dbc.Label("emb_share (0-1)"), dbc.Input(id="ov-share", type="number", min=0, max=1,
                                                              step=0.01, value=0.5)], lg=2),
            dbc.Col([dbc.Label("expires after (min, empty = never)"),
                     dbc.Input(id="ov-ttl", type="number", min=0, step=1)], lg=2),
        ]),
        dbc.Row([dbc.Col([dbc.Label("reason"), dbc.Input(id="ov-reason", placeholder="why (required)")], lg=8),
                 dbc.Col(dbc.Button("Submit override…", id="btn-ov-submit", disabled=viewer, color="danger",
                                    className="mt-4"),
                         lg=2)]),
        html.Div(id="ov-error", className="text-danger small mt-2"),
    ]), className="mb-3")


def _retire(viewer: bool) -> dbc.Card:
    return dbc.Card(dbc.CardBody([
        html.H6("Drain and retire a node"),
        html.Div("The node leaves the gateways' node list (requests in flight finish), its tokens are revoked "
                 "and its overrides cleared; its history stays. A new token for its id brings it back.",
                 className="small text-muted mb-2"),
        dbc.Row([dbc.Col([dbc.Label("node"), dcc.Dropdown(id="retire-node", placeholder="node")], lg=3),
                 dbc.Col([dbc.Label("reason"), dbc.Input(id="retire-reason", placeholder="why (required)")], lg=5),
                 dbc.Col(dbc.Button("Retire node…", id="btn-node-retire", disabled=viewer, color="danger",
                                    className="mt-4"), lg=2)]),
        html.Div(id="retire-error", className="text-danger small mt-2"),
    ]), className="my-3")


def layout(viewer: bool) -> list:
    viewer_note = dbc.Alert("Signed in as a viewer: you can see everything, and every control is disabled "
                            "(an operator token is needed to act).", id="viewer-note", color="secondary",
                            is_open=viewer, className="py-2")
    return [viewer_note, html.Div([
        _form(viewer),
        html.H6("Active overrides"),
        grid("grid-overrides", [col("id"), col("scope"), col("emb_share", "emb_share"), col("reason", flex=2),
                                col("created_by", "by"), time_col("created", "created (UTC)"),
                                time_col("expires", "expires (UTC)")], height=220, selectable=True, row_id="id"),
        dbc.Row([dbc.Col(dbc.Input(id="ov-clear-reason", placeholder="why clear it (required)"), lg=6),
                 dbc.Col(dbc.Button("Clear selected override…", id="btn-ov-clear", disabled=viewer,
                                    color="secondary"), lg=3)], className="my-2"),
        _retire(viewer),
        html.H6("Audit log", className="mt-3"),
        grid("grid-audit", [time_col("time", "time (UTC)"), col("actor"), col("action"), col("target"),
                            col("before", minWidth=160), col("after", minWidth=160), col("reason", flex=2)],
             height=360, page_size=10),
    ], className="pt-2")]


def current_share_text(nodes: list[dict], node_id: str | None) -> str:
    """What the override dialogs show of the nodes' present emb_share (``nodes``: the node rows);
    ``node_id`` None: the cluster's range."""
    if node_id is not None:
        n = next((n for n in nodes if n.get("node_id") == node_id), None)
        if n is None or n.get("emb_share") is None:
            return f"{node_id} has reported no emb_share yet"
        return f"{node_id} is at emb_share {float(n['emb_share']):.3f} now"
    vals = [float(n["emb_share"]) for n in nodes if n.get("emb_share") is not None]
    if not vals:
        return "no node has reported an emb_share yet"
    return f"the {len(vals)} nodes are at emb_share {min(vals):.3f}-{max(vals):.3f} now"


def override_rows(ovs: list[dict]) -> list[dict]:
    return [{"id": str(o["id"]), "scope": o.get("node_id") or "cluster", "emb_share": o["emb_share"],
             "reason": o["reason"], "created_by": o.get("created_by"), "created": fmt_t(o["created_at_s"]),
             "expires": fmt_t(o.get("expires_at_s")) or "never"}
            for o in ovs if o.get("state", "active") == "active"]


def audit_rows(items: list[dict]) -> list[dict]:
    return [{"id": a["id"], "time": fmt_t(a["ts_s"]), "actor": a["actor"], "action": a["action"],
             "target": a["target"], "before": short(a.get("before")), "after": short(a.get("after")),
             "reason": a.get("reason", "")} for a in items]


def ask_override(scope, node, share, ttl, reason, nodes) -> dict:
    """The override form's confirmation (naming the node's current emb_share), or what is missing."""
    problems = []
    if share is None or not (0 <= float(share) <= 1):
        problems.append("emb_share must be a number in [0, 1]")
    if scope == "node" and not node:
        problems.append("choose a node (or cluster-wide scope)")
    if not (reason or "").strip():
        problems.append("a reason is required")
    if ttl is not None and float(ttl) <= 0:
        problems.append("expiry must be positive minutes or empty")
    if problems:
        return {"pending": None, "open": False, "body": no_update, "error": "; ".join(problems)}
    target = f"node {node}" if scope == "node" else "every node (cluster-wide)"
    exp = f"for {float(ttl):g} min" if ttl else "until cleared"
    payload = {"emb_share": float(share), "reason": reason.strip(), "node_id": node if scope == "node" else None,
               "ttl_s": float(ttl) * 60 if ttl else None}
    now_text = current_share_text(nodes or [], node if scope == "node" else None)
    return {"pending": {"kind": "override", "payload": payload}, "open": True,
            "body": f"Set emb_share to {float(share):.3f} on {target} {exp}? {now_text}. Reason: {reason.strip()}",
            "error": ""}


def ask_clear(selected, clear_reason, nodes) -> dict:
    """The clear button's confirmation, or what is missing."""
    if not selected:
        return {"pending": None, "open": False, "body": no_update,
                "error": "select an active override in the table first"}
    if not (clear_reason or "").strip():
        return {"pending": None, "open": False, "body": no_update, "error": "a reason for clearing is required"}
    o = selected[0]
    scope_node = o["scope"] if o["scope"] != "cluster" else None
    return {"pending": {"kind": "clear", "id": int(o["id"]), "reason": clear_reason.strip()}, "open": True,
            "body": f"Clear override #{o['id']} ({o['scope']}, emb_share {o['emb_share']})? "
                    f"{current_share_text(nodes or [], scope_node)}; the allocator takes over again. "
                    f"Reason: {clear_reason.strip()}", "error": ""}


ASK_OUTPUTS = {"pending": Output("pending", "data"), "open": Output("confirm-modal", "is_open"),
               "body": Output("confirm-body", "children"), "error": Output("ov-error", "children")}
RETIRE_OUTPUTS = {"pending": Output("pending", "data", allow_duplicate=True),
                  "open": Output("confirm-modal", "is_open", allow_duplicate=True),
                  "body": Output("confirm-body", "children", allow_duplicate=True),
                  "error": Output("retire-error", "children")}


def register(app, client, sessions) -> None:
    @app.callback(output={"overrides": Output("grid-overrides", "rowData"), "audit": Output("grid-audit", "rowData"),
                          "keys": Output("tables-key", "data")},
                  inputs=dict(_n=Input("tick-go", "data"), tab=Input("tabs", "value"), _acted=Input("acted", "data")),
                  state=dict(sid=State("sid", "data"), keys=State("tables-key", "data")), prevent_initial_call=True)
    def action_tables(_n, tab, _acted, sid, keys):
        """The override page's tables (the policies page's: dashboard.policies_tab); each is sent
        only when it changed since the last tick (a hash per output in the tables-key store)."""
        s = sessions.get(sid)
        out = {"overrides": no_update, "audit": no_update, "keys": no_update}
        if s is None or tab != "override":
            return out
        keys = dict(keys or {}) if ctx.triggered_id == "tick-go" else {}
        try:
            out["overrides"] = override_rows(client.overrides(s.token, state="active"))
            out["audit"] = audit_rows(client.audit(s.token, limit=200)["items"])
        except (Unavailable, ApiError):
            return dict(out, keys=no_update)
        for i, name in enumerate(("overrides", "audit")):
            h = hashlib.sha1(json.dumps(out[name], sort_keys=True, default=jsonable).encode()).hexdigest()[:16]
            if keys.get(str(i)) == h:
                out[name] = no_update
            keys[str(i)] = h
        out["keys"] = keys
        return out

    @app.callback(Output("ov-current", "children"), Input("ov-node", "value"), Input("ov-scope", "value"),
                  Input("nodes-data", "data"), prevent_initial_call=True)
    def override_current(node, scope, nodes):
        return current_share_text(nodes or [], node if scope == "node" else None)

    @app.callback(output=ASK_OUTPUTS,
                  inputs=dict(_submit=Input("btn-ov-submit", "n_clicks"), _clear=Input("btn-ov-clear", "n_clicks"),
                              _cancel=Input("btn-cancel", "n_clicks")),
                  state=dict(scope=State("ov-scope", "value"), node=State("ov-node", "value"),
                             share=State("ov-share", "value"), ttl=State("ov-ttl", "value"),
                             reason=State("ov-reason", "value"), selected=State("grid-overrides", "selectedRows"),
                             clear_reason=State("ov-clear-reason", "value"), nodes=State("nodes-data", "data"),
                             sid=State("sid", "data")),
                  prevent_initial_call=True)
    def ask(_submit, _clear, _cancel, scope, node, share, ttl, reason, selected, clear_reason, nodes, sid):
        """The override form's and the clear button's confirmation, or what is missing."""
        trig = ctx.triggered_id
        if trig == "btn-cancel" or not ctx.triggered or not ctx.triggered[0].get("value"):
            return {"pending": None, "open": False, "body": no_update, "error": no_update}
        s = sessions.get(sid)
        if s is None or s.role != "operator":
            return {"pending": None, "open": False, "body": no_update, "error": "an operator token is needed"}
        if trig == "btn-ov-submit":
            return ask_override(scope, node, share, ttl, reason, nodes)
        if trig == "btn-ov-clear":
            return ask_clear(selected, clear_reason, nodes)
        return {"pending": None, "open": False, "body": no_update, "error": no_update}

    @app.callback(Output("retire-node", "options"), Input("ov-node", "options"), prevent_initial_call=True)
    def retire_options(options):
        return options  # the node list the override form shows

    @app.callback(output=RETIRE_OUTPUTS, inputs=dict(n=Input("btn-node-retire", "n_clicks")),
                  state=dict(node=State("retire-node", "value"), reason=State("retire-reason", "value"),
                             sid=State("sid", "data")), prevent_initial_call=True)
    def ask_retire(n, node, reason, sid):
        s = sessions.get(sid)
        if not n:
            return {"pending": no_update, "open": no_update, "body": no_update, "error": no_update}
        if s is None or s.role != "operator":
            return {"pending": None, "open": False, "body": no_update, "error": "an operator token is needed"}
        if not node or not (reason or "").strip():
            return {"pending": None, "open": False, "body": no_update, "error": "choose a node and give a reason"}
        return {"pending": {"kind": "retire", "node_id": node, "reason": reason.strip()}, "open": True,
                "body": f"Retire node {node}? It leaves the node list (the gateways stop sending it requests), its "
                        f"tokens are revoked and its overrides cleared. Reason: {reason.strip()}", "error": ""}
