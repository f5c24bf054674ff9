"""The confirmation dialog shared by every action: a page's ``ask`` callback puts the action in
the ``pending`` store and opens the dialog; Confirm runs it here against the control plane and
shows the result (the ``acted`` counter makes the pages read their data again)."""

from __future__ import annotations

import dash_bootstrap_components as dbc
from dash import Input, Output, State, no_update

from .client import ApiError, Unavailable

OUTPUTS = {"open": Output("confirm-modal", "is_open", allow_duplicate=True),
           "pending": Output("pending", "data", allow_duplicate=True),
           "result_open": Output("action-result", "is_open"), "result": Output("action-result", "children"),
           "result_color": Output("action-result", "color"), "acted": Output("acted", "data")}


def modal() -> dbc.Modal:
    return dbc.Modal([dbc.ModalHeader(dbc.ModalTitle("Confirm")), dbc.ModalBody(id="confirm-body"),
                      dbc.ModalFooter([dbc.Button("Cancel", id="btn-cancel", color="secondary"),
                                       dbc.Button("Confirm", id="btn-confirm", color="danger")])],
                     id="confirm-modal", is_open=False)


def run_action(client, tok: str, pending: dict) -> str:
    """Send one confirmed action; what the result line says. Raises `ApiError` / `Unavailable`."""
    kind = pending["kind"]
    if kind == "override":
        p = pending["payload"]
        o = client.create_override(tok, emb_share=p["emb_share"], reason=p["reason"], node_id=p["node_id"],
                                   ttl_s=p["ttl_s"])
        return f"override #{o['id']} set: emb_share {o['emb_share']} on {o.get('node_id') or 'the cluster'}"
    if kind == "clear":
        client.clear_override(tok, pending["id"], pending.get("reason") or "cleared from the dashboard")
        return f"override #{pending['id']} cleared"
    if kind == "retire":
        n = client.retire_node(tok, pending["node_id"], pending["reason"])
        return f"node {n['node_id']} retired"
    if kind == "activate":
        p = client.activate_policy(tok, pending["version"], pending["reason"])
        return f"policy {p['version']} is {p['status']}: every node loads it"
    if kind == "rollout":
        r = client.start_rollout(tok, **pending["payload"])
        what = f"model {(r.get('model_version') or '')[:12]}" if r.get("kind") == "model" else r["policy_version"]
        return f"rollout #{r['id']} of {what} started ({r['state']})"
    r = client.rollout_action(tok, pending["id"], pending["action"],
                              pending.get("reason") or f"{pending['action']} from the dashboard")
    return f"rollout #{r['id']}: {pending['action']} → {r['state']}"


def register(app, client, sessions) -> None:
    @app.callback(output=OUTPUTS, inputs=dict(_n=Input("btn-confirm", "n_clicks")),
                  state=dict(pending=State("pending", "data"), sid=State("sid", "data"), acted=State("acted", "data")),
                  prevent_initial_call=True)
    def execute(_n, pending, sid, acted):
        s = sessions.get(sid)
        closed = {"open": False, "pending": None}
        if not pending or s is None:
            return {**closed, "result_open": no_update, "result": no_update, "result_color": no_update,
                    "acted": no_update}
        if s.role != "operator":  # the buttons are disabled for viewers; the control plane refuses too
            return {**closed, "result_open": True, "result": "a viewer cannot act: sign in with an operator token",
                    "result_color": "danger", "acted": no_update}
        try:
            msg, color = run_action(client, s.token, pending), "success"
        except ApiError as e:
            msg, color = f"refused by the control plane: {e.message}", "danger"
        except Unavailable as e:
            msg, color = str(e), "danger"
        return {**closed, "result_open": True, "result": msg, "result_color": color, "acted": (acted or 0) + 1}
