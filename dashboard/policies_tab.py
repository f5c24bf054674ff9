"""The Policies tab: the registry, uploading and activating an artifact, starting a rollout, and
the current rollout's live state with only the valid actions enabled.

- **Upload**: drop a ``.tar`` (or ``.tar.gz``) of an artifact, or its three files
  (``manifest.json``, ``policy.onnx``, ``golden.npz``); the dashboard sends one tar to the
  control plane's ``POST /api/v1/policies``, where the node agent's loader checks it (manifest,
  checksums, onnx.checker, golden parity) before it is registered. A refusal shows the control
  plane's reason.
- **Activate**: select a registry row, give a reason, confirm: ``POST /policies/{v}/activate``
  (every node loads it; refused while a rollout is open).
- **Start a rollout**: a candidate must be chosen (a message says so otherwise): a registered
  policy, or a model checkpoint from the model registry (``racer model push``), which the control
  plane judges on the nodes' online quality; refused while another rollout is open (the button is
  disabled then).
- **Current rollout** (the newest, policy or model): the state badge, the judge's verdict (only
  while the rollout is open), the per-metric judgement, the nodes with their role, what they
  confirmed, and the policy (or checkpoint) each one *runs now* (from the nodes' own reports, so it is fresh after a rollback). Promote / Pause /
  Resume / Roll back are enabled only in the states the control plane accepts them in
  (`dashboard.details.ROLLOUT_ACTIONS`); a finished rollout has every one disabled.

The tab's data is fetched when the tab is opened, after any action, and on every live tick; each
output is sent only when it changed (a hash per output in the ``pol-keys`` store).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import time

import dash_bootstrap_components as dbc
from dash import Input, Output, State, ctx, dcc, html, no_update

from . import details as D
from . import figures as F
from control_plane.rollout import RolloutConfig

from .client import ApiError, ControlPlaneClient, Unavailable

ROLLOUT_BUTTONS = {"btn-ro-promote": "promote", "btn-ro-pause": "pause", "btn-ro-resume": "resume",
                   "btn-ro-rollback": "rollback"}
#: the API's own rollout defaults (one source: the bake time the form shows is the API's)
ROLLOUT_DEFAULTS = RolloutConfig()
MAX_UPLOAD_BYTES = 16 * 2**20  # an artifact is tens of KB; the shipped one 48 KB


def _t(t_s) -> str:
    return "" if t_s is None else F.x_to_text(F.to_x(t_s))


def layout(viewer: bool, graph, grid, col, time_col) -> html.Div:
    """The tab's components; ``graph``/``grid``/``col``/``time_col`` are `dashboard.app`'s builders."""
    return html.Div([
        html.H6("Policy registry"),
        html.Div("Select a row to activate it. Validation: how the node agent's loader checked the artifact.",
                 className="small text-muted mb-1"),
        grid("grid-policies", [col("version"), col("status"), col("digest"), col("uploaded_by", "by"),
                               time_col("uploaded", "uploaded (UTC)"),
                               col("validation", minWidth=320, flex=3, tooltipField="validation", wrapText=True,
                                   autoHeight=True),
                               col("evaluation", minWidth=220, flex=2, tooltipField="evaluation")],
             height=260, page_size=6, selectable=True, row_id="version"),
        dbc.Row([
            dbc.Col([dbc.Label("reason for activating", html_for="pol-reason"),
                     dbc.Input(id="pol-reason", placeholder="why (required)")], lg=6),
            dbc.Col(dbc.Button("Activate selected policy…", id="btn-pol-activate", disabled=viewer, color="primary",
                               className="mt-4"), lg=3),
        ], className="mt-2"),
        html.Div(id="pol-error", className="text-danger small mt-1", role="status"),
        dcc.Upload(id="pol-upload", multiple=True, disabled=viewer, max_size=MAX_UPLOAD_BYTES,
                   children=html.Div(["Upload a policy artifact: drop or ", html.A("choose", href="#"),
                                      " a .tar of it, or its three files (manifest.json, policy.onnx, golden.npz)"]),
                   style={"borderWidth": "1px", "borderStyle": "dashed", "borderRadius": "6px", "padding": "14px",
                          "textAlign": "center", "cursor": "not-allowed" if viewer else "pointer"},
                   className="my-2 small"),
        html.Div(id="pol-upload-result", className="small mb-2", role="status"),
        dbc.Card(dbc.CardBody([
            html.H6("Start a rollout"),
            dbc.Row([
                dbc.Col([dbc.Label("candidate policy or model", html_for="ro-policy"),
                         dcc.Dropdown(id="ro-policy", placeholder="version")], lg=3),
                dbc.Col([dbc.Label("canary fraction (0-1]", html_for="ro-fraction"),
                         dbc.Input(id="ro-fraction", type="number", value=0.25, min=0.01, max=1, step=0.01)], lg=2),
                dbc.Col([dbc.Label("bake time (s)", html_for="ro-bake"),
                         dbc.Input(id="ro-bake", type="number", value=ROLLOUT_DEFAULTS.bake_time_s, min=0)], lg=2),
                dbc.Col([dbc.Label("min samples", html_for="ro-min"),
                         dbc.Input(id="ro-min", type="number", value=10, min=3)], lg=2),
                dbc.Col([dbc.Label("reason", html_for="ro-reason"),
                         dbc.Input(id="ro-reason", placeholder="why (required to promote or roll back)")], lg=3),
            ]),
            dbc.Button("Start rollout…", id="btn-ro-start", disabled=viewer, color="primary", className="mt-2"),
            html.Div(id="ro-error", className="text-danger small mt-2", role="status"),
        ]), className="my-3"),
        html.H6("Current rollout"),
        html.Div(id="ro-status", className="mb-2"),
        dbc.ButtonGroup([dbc.Button("Promote…", id="btn-ro-promote", disabled=True, color="success"),
                         dbc.Button("Pause…", id="btn-ro-pause", disabled=True, color="warning"),
                         dbc.Button("Resume…", id="btn-ro-resume", disabled=True, color="info"),
                         dbc.Button("Roll back…", id="btn-ro-rollback", disabled=True, color="danger")],
                        className="mb-2"),
        html.Div(id="ro-actions-note", className="small text-muted mb-2"),
        graph("g-rollout", 500),
        grid("grid-ro-nodes", [col("node_id", "node"), col("role"), col("status", "confirmed"),
                               col("running", "runs now"), col("error", flex=2)], height=220, page_size=8),
        dcc.Store(id="pol-keys", data={}),
    ], className="pt-2")


def candidate_of(ro: dict) -> str:
    """What a rollout rolls out, in words: ``policy V`` or ``model <digest's first 12>``."""
    if ro.get("kind") == "model":
        return f"model {(ro.get('model_version') or '')[:12]}"
    return f"policy {ro.get('policy_version')}"


def rollout_windows(rows: list[dict], rollout: dict, step_s: float) -> list[dict]:
    """Per bucket: canary vs baseline P99 (median over nodes), SLO attainment and model quality
    (means), from the node reports since the rollout's bake started, grouped by what each node
    ran (its policy version; for a model rollout, the checkpoint it served)."""
    model = rollout.get("kind") == "model"
    key = "model_digest" if model else "policy_version"
    cand = rollout.get("model_version") if model else rollout.get("policy_version")
    base = rollout.get("baseline_version")
    since = rollout.get("bake_started_s") or rollout.get("created_at_s") or 0.0
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in rows:
        if r["ts_s"] < since:
            continue
        g = "canary" if r.get(key) == cand else "baseline" if r.get(key) == base else None
        if g:
            groups.setdefault((g, math.floor(r["ts_s"] / step_s) * step_s), []).append(r)
    out = []
    for (g, t), rs in sorted(groups.items(), key=lambda kv: kv[0][1]):
        p99 = sorted(r["p99_ms"] for r in rs if r.get("p99_ms") is not None)
        att = [r["slo_attainment"] for r in rs if r.get("slo_attainment") is not None]
        q = [r["model_quality"] for r in rs if r.get("model_quality") is not None]
        out.append({"t_s": t, "group": g, "p99_ms": p99[len(p99) // 2] if p99 else None,
                    "slo_attainment": sum(att) / len(att) if att else None,
                    "model_quality": sum(q) / len(q) if q else None, "n": len(rs)})
    return out


def running(node: dict, ro: dict | None) -> str:
    """What a rollout's node runs now, from its own reports: its policy, or for a model rollout the
    checkpoint it serves."""
    if ro and ro.get("kind") == "model":
        return (node.get("model_version") or node.get("model_digest") or "–")[:12]
    return node.get("policy_version") or "–"


def current_rollout(client: ControlPlaneClient, tok: str) -> dict | None:
    ros = client.rollouts(tok)
    return max(ros, key=lambda r: r["id"]) if ros else None


def _fmt(v, nd: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{nd}g}"
    return str(v)


def whatif_line(ro: dict | None, run: dict | None) -> str:
    """The candidate's offline judgement beside the canary's: the newest finished what-if that
    named the rollout's policy (`racer policy whatif`), its P99 over the best static and over the
    look-ahead oracle on the fleet's sampled traffic; "" when the rollout is not a policy's or no
    such run exists."""
    if not ro or ro.get("kind", "policy") != "policy" or not run or not run.get("result"):
        return ""
    key = f"policy:{ro.get('policy_version')}"
    f = run["result"].get("findings") or {}
    g = (f.get("policy_regret") or {}).get(key)
    if not g:
        return ""
    parts = [f"{k.replace('_pct', '').replace('_', ' ')} {v:+.2f}%" for k, v in g.items()]
    window = run.get("window_end_s", 0) - run.get("window_start_s", 0)
    return (f"what-if #{run['id']} on the fleet's last {window / 3600:.1f} h of sampled traffic (the simulator): "
            f"{key.split(':', 1)[1]} P99 " + ", ".join(parts))


def rollout_card(ro: dict | None, whatif: dict | None = None):
    """State badge and, while the rollout is open, the judge's verdict and next action; once it
    has ended, when and why. Per metric: sample sizes (windows) of canary and baseline, medians,
    change and the Mann-Whitney p-value; under them the candidate's what-if (`whatif_line`)."""
    if not ro:
        return html.Div("No rollout yet.", className="text-muted", id="ro-state")
    v = ro.get("verdict") or {}
    color = {"rolled_back": "danger", "promoted": "success", "paused": "warning"}.get(ro["state"], "info")
    if ro["state"] in D.OPEN_ROLLOUT_STATES:
        info = f"  verdict: {v.get('verdict') or '–'}  ·  next action: {v.get('action') or '–'}"
        if ro["state"] == "baking" and ro.get("bake_started_s") is not None:
            bake = float((ro.get("config") or {}).get("bake_time_s") or 0)
            info += f"  ·  baking since {_t(ro['bake_started_s'])} UTC ({bake:g} s to bake)"
        why = v.get("reason") or ro.get("reason") or ""
    else:
        info = f"  ended {_t(ro.get('updated_at_s'))} UTC"
        why = ro.get("reason") or ""
    base = ro.get("baseline_version") or "–"
    base = base[:12] if ro.get("kind") == "model" else base
    head = html.Div([html.Span(f"#{ro['id']} {candidate_of(ro)} (baseline {base}) ", className="me-2",
                               id="ro-candidate"),
                     dbc.Badge(ro["state"], id="ro-state", color=color),
                     html.Span(info, className="ms-3 small", id="ro-verdict")])
    rows = [html.Tr([html.Th(h) for h in ("metric", "verdict", "n canary", "n baseline", "median canary",
                                          "median baseline", "change", "p-value")])]
    for j in v.get("judgements") or []:
        rows.append(html.Tr([html.Td(j.get("metric")), html.Td(j.get("verdict")), html.Td(_fmt(j.get("n_canary"))),
                             html.Td(_fmt(j.get("n_baseline"))), html.Td(_fmt(j.get("median_canary"))),
                             html.Td(_fmt(j.get("median_baseline"))), html.Td(_fmt(j.get("change"))),
                             html.Td(_fmt(j.get("p_value")))]))
    table = html.Table(rows, className="small", style={"borderCollapse": "collapse", "width": "100%"}) \
        if len(rows) > 1 else html.Div("no judgement yet (collecting windows)", className="small text-muted")
    offline = whatif_line(ro, whatif)
    return html.Div([head, html.Div(why, className="small text-muted"), table,
                     html.Div(offline, className="small mt-1", id="ro-whatif")], className="card card-body")


TABLE_OUTPUTS = {"registry": Output("grid-policies", "rowData"), "candidates": Output("ro-policy", "options"),
                 "card": Output("ro-status", "children"), "ro_nodes": Output("grid-ro-nodes", "rowData"),
                 "figure": Output("g-rollout", "figure", allow_duplicate=True),
                 "start_disabled": Output("btn-ro-start", "disabled"),
                 "activate_disabled": Output("btn-pol-activate", "disabled"),
                 **{f"{a}_disabled": Output(b, "disabled") for b, a in ROLLOUT_BUTTONS.items()},
                 "note": Output("ro-actions-note", "children")}
ASK_OUTPUTS = {"pending": Output("pending", "data", allow_duplicate=True),
               "open": Output("confirm-modal", "is_open", allow_duplicate=True),
               "body": Output("confirm-body", "children", allow_duplicate=True),
               "ro_error": Output("ro-error", "children"), "pol_error": Output("pol-error", "children")}
UPLOAD_OUTPUTS = {"result": Output("pol-upload-result", "children"),
                  "result_class": Output("pol-upload-result", "className"),
                  "acted": Output("acted", "data", allow_duplicate=True), "contents": Output("pol-upload", "contents")}


def registry_rows(pols: list[dict]) -> list[dict]:
    return [{"version": p["version"], "status": p["status"], "digest": p["digest"][:12],
             "uploaded_by": p.get("uploaded_by"), "uploaded": _t(p.get("uploaded_at_s")),
             "validation": D.validation_text(p.get("manifest")),
             "evaluation": " · ".join(t for t in (D.training_text(p.get("evaluation")),
                                                   D.flat_text(p.get("evaluation"))) if t)} for p in pols]


def controls(operator: bool, ro: dict | None) -> dict:
    """Which buttons are enabled (``*_disabled``) and the note saying why, for the current rollout."""
    open_ = not D.can_start_rollout(ro)
    valid = D.rollout_actions(ro["state"]) if ro else set()
    out = {"start_disabled": not operator or open_, "activate_disabled": not operator or open_,
           **{f"{a}_disabled": not operator or a not in valid for a in ROLLOUT_BUTTONS.values()}}
    if not operator:
        note = "a viewer cannot act"
    elif not ro:
        note = "no rollout yet"
    elif not valid:
        note = f"rollout #{ro['id']} has ended ({ro['state']}): no action applies; start a new one above"
    else:
        note = f"valid now ({ro['state']}): " + ", ".join(a for a in ROLLOUT_BUTTONS.values() if a in valid)
    if open_ and operator:
        note += f" · starting or activating waits until rollout #{ro['id']} ends"
    out["note"] = note
    return out


def send_changed(out: dict, keys: dict) -> dict:
    """``out`` with every output whose hash is in ``keys`` (sent last tick) set to `no_update`;
    ``keys`` updated with the new hashes."""
    for name, v in out.items():
        if v is no_update:
            continue
        h = hashlib.sha1(json.dumps(v, sort_keys=True, default=_jsonable).encode()).hexdigest()[:16]
        if keys.get(name) == h:
            out[name] = no_update
        keys[name] = h
    return out


def _refused(ro_error=no_update, pol_error=no_update) -> dict:
    return {"pending": None, "open": False, "body": no_update, "ro_error": ro_error, "pol_error": pol_error}


def _confirm(pending: dict, body: str) -> dict:
    return {"pending": pending, "open": True, "body": body, "ro_error": "", "pol_error": ""}


def ask_activate(selected, pol_reason) -> dict:
    if not selected:
        return _refused("", "select a policy in the registry first")
    if not (pol_reason or "").strip():
        return _refused("", "a reason is required")
    v = selected[0]["version"]
    return _confirm({"kind": "activate", "version": v, "reason": pol_reason.strip()},
                    f"Activate policy {v}? Every node loads it (the active one now is replaced). "
                    f"Reason: {pol_reason.strip()}")


#: the value a model checkpoint has among the rollout's candidates (policies are their version)
MODEL_PREFIX = "model:"


def ask_start(ro_policy, ro_fraction, ro_bake, ro_min, ro_reason) -> dict:
    if not ro_policy:
        return _refused("choose a candidate policy or model first (upload a policy above, or `racer model push` a "
                        "checkpoint, if the list is empty)", "")
    try:
        fraction = float(ro_fraction if ro_fraction is not None else 0.25)
        bake = float(ro_bake if ro_bake is not None else ROLLOUT_DEFAULTS.bake_time_s)
        min_samples = int(ro_min if ro_min is not None else 10)
    except (TypeError, ValueError):
        return _refused("fraction, bake time and min samples must be numbers", "")
    problems = []
    if not 0 < fraction <= 1:
        problems.append("canary fraction must be in (0, 1]")
    if bake < 0:
        problems.append("bake time must be >= 0")
    if min_samples < 3:
        problems.append("min samples must be >= 3")
    if problems:
        return _refused("; ".join(problems), "")
    model = str(ro_policy).startswith(MODEL_PREFIX)
    which = ({"kind": "model", "model_version": str(ro_policy)[len(MODEL_PREFIX):]} if model
             else {"policy_version": ro_policy})
    payload = {**which, "canary_fraction": fraction, "bake_time_s": bake,
               "min_samples": min_samples, "reason": (ro_reason or "").strip() or "rollout from dashboard"}
    what = f"model {str(ro_policy)[len(MODEL_PREFIX):][:12]} (judged on its online quality)" if model \
        else f"policy {ro_policy}"
    return _confirm({"kind": "rollout", "payload": payload},
                    f"Start a rollout of {what} to {100 * fraction:g}% of nodes (bake {bake:g} s)?")


#: rollout actions that change what the fleet runs: a reason is required, as for activate, override and retire
REASON_REQUIRED = ("promote", "rollback")


def ask_rollout_action(client: ControlPlaneClient, tok: str, action: str, reason: str | None = None) -> dict:
    reason = (reason or "").strip()
    if action in REASON_REQUIRED and not reason:
        return _refused(f"a reason is required to {action} (the rollout's reason field)", "")
    try:
        ro = current_rollout(client, tok)
    except (Unavailable, ApiError) as e:
        return _refused(str(e), "")
    if not ro or action not in D.rollout_actions(ro["state"]):
        state = ro["state"] if ro else "none"
        return _refused(f"cannot {action}: the rollout is {state}", "")
    return _confirm({"kind": "rollout_action", "id": ro["id"], "action": action,
                     "reason": reason or f"{action} from the dashboard"},
                    f"{action.capitalize()} rollout #{ro['id']} ({candidate_of(ro)}, now {ro['state']})?"
                    + (f" Reason: {reason}" if reason else ""))


def upload_result(client: ControlPlaneClient, contents, filenames, s, acted) -> dict:
    """Send the chosen files (one tar); what the page says, and the ``acted`` counter on success."""
    def failed(msg: str) -> dict:
        return {"result": msg, "result_class": "small mb-2 text-danger", "acted": no_update}

    if s is None or s.role != "operator":
        return failed("an operator token is needed to upload")
    if isinstance(contents, str):
        contents, filenames = [contents], [filenames]
    try:
        named = [(str(n), base64.b64decode(c.split(",", 1)[1])) for n, c in zip(filenames or [], contents)]
        p = client.upload_policy(s.token, D.upload_body(named))
    except ValueError as e:
        return failed(str(e))
    except ApiError as e:
        return failed(f"refused by the control plane: {e.message}")
    except Unavailable as e:
        return failed(str(e))
    return {"result": f"policy {p['version']} registered (status {p['status']}; "
                      f"{D.validation_text(p.get('manifest'))})",
            "result_class": "small mb-2 text-success", "acted": (acted or 0) + 1}


def register(app, client: ControlPlaneClient, sessions, *, slo_ms: float, slo_target: float,
             step_for, default_range_s: int = 900) -> None:
    """The tab's callbacks. ``step_for``: range (s) -> bucket size (s), the dashboard's."""

    def rollout_fig(tok: str, ro: dict | None, now: float, range_s: float):
        if not ro:
            return F.rollout_figure([], slo_ms, slo_target)
        step = step_for(range_s)
        since = max(now - range_s, ro.get("bake_started_s") or ro.get("created_at_s") or 0.0)
        until = ro.get("updated_at_s") if ro.get("state") not in D.OPEN_ROLLOUT_STATES else None
        rows = client.history(tok, start_s=since, end_s=None if until is None else until + step, limit=100_000)
        return F.rollout_figure(rollout_windows(rows, ro, step), slo_ms, slo_target, kind=ro.get("kind") or "policy")

    @app.callback(output={**TABLE_OUTPUTS, "keys": Output("pol-keys", "data")},
                  inputs=dict(tab=Input("tabs", "value"), _tick=Input("tick-go", "data"),
                              _acted=Input("acted", "data")),
                  state=dict(range_s=State("range", "value"), sid=State("sid", "data"),
                             keys=State("pol-keys", "data")), prevent_initial_call=True)
    def policies_tables(tab, _tick, _acted, range_s, sid, keys):
        """Registry, candidates, rollout card and nodes, the progress chart and which buttons are
        enabled; each output only when it changed since the last tick."""
        s = sessions.get(sid)
        out = {k: no_update for k in TABLE_OUTPUTS}
        if s is None or tab != "policies":
            return dict(out, keys=no_update)
        tok = s.token
        ticking = ctx.triggered_id == "tick-go"
        keys = dict(keys or {}) if ticking else {}
        try:
            pols = client.policies(tok)
            models = client.models(tok)
            ro = current_rollout(client, tok)
            nodes = {n["node_id"]: n for n in client.nodes(tok)}
        except (Unavailable, ApiError):
            return dict(out, keys=no_update)
        whatif = None
        if ro and ro.get("kind", "policy") == "policy":
            try:  # the candidate's offline judgement, when one was run (404: none)
                whatif = client.get("/whatif-runs/latest", tok, state="done", candidate=ro["policy_version"])
            except (Unavailable, ApiError):
                whatif = None
        out.update(registry=registry_rows(pols), card=rollout_card(ro, whatif),
                   candidates=[{"label": f"{p['version']} ({p['status']})", "value": p["version"]} for p in pols
                               if p["status"] != "active"]
                   + [{"label": f"model {m['version'][:12]} ({m['status']})", "value": MODEL_PREFIX + m["version"]}
                      for m in models if m["status"] != "active"],
                   ro_nodes=[{**dict(n), "running": running(nodes.get(n["node_id"]) or {}, ro)}
                             for n in (ro or {}).get("nodes", [])])
        if not ticking or (ro and ro["state"] in D.OPEN_ROLLOUT_STATES):
            try:
                out["figure"] = rollout_fig(tok, ro, time.time(), range_s or default_range_s)
            except (Unavailable, ApiError):
                out["figure"] = no_update
        out.update(controls(s.role == "operator", ro))
        return dict(send_changed(out, keys), keys=keys)

    @app.callback(output=UPLOAD_OUTPUTS, inputs=dict(contents=Input("pol-upload", "contents")),
                  state=dict(filenames=State("pol-upload", "filename"), sid=State("sid", "data"),
                             acted=State("acted", "data")), prevent_initial_call=True)
    def upload(contents, filenames, sid, acted):
        """Send the chosen files; the upload's contents are cleared after (choosing the same files
        again is then a new upload)."""
        if not contents:
            return {k: no_update for k in UPLOAD_OUTPUTS}
        return dict(upload_result(client, contents, filenames, sessions.get(sid), acted), contents=None)

    @app.callback(output=ASK_OUTPUTS,
                  inputs=dict(_activate=Input("btn-pol-activate", "n_clicks"), _start=Input("btn-ro-start", "n_clicks"),
                              **{f"_{a}": Input(b, "n_clicks") for b, a in ROLLOUT_BUTTONS.items()}),
                  state=dict(selected=State("grid-policies", "selectedRows"), pol_reason=State("pol-reason", "value"),
                             ro_policy=State("ro-policy", "value"), ro_fraction=State("ro-fraction", "value"),
                             ro_bake=State("ro-bake", "value"), ro_min=State("ro-min", "value"),
                             ro_reason=State("ro-reason", "value"), sid=State("sid", "data")),
                  prevent_initial_call=True)
    def ask_policy(selected, pol_reason, ro_policy, ro_fraction, ro_bake, ro_min, ro_reason, sid, **_clicks):
        """The confirmation of a policy or rollout action, or a message saying what is missing."""
        trig = ctx.triggered_id
        if not ctx.triggered or not ctx.triggered[0].get("value"):
            return {k: no_update for k in ASK_OUTPUTS}
        s = sessions.get(sid)
        if s is None or s.role != "operator":
            return _refused("an operator token is needed", "an operator token is needed")
        if trig == "btn-pol-activate":
            return ask_activate(selected, pol_reason)
        if trig == "btn-ro-start":
            return ask_start(ro_policy, ro_fraction, ro_bake, ro_min, ro_reason)
        if trig in ROLLOUT_BUTTONS:
            return ask_rollout_action(client, s.token, ROLLOUT_BUTTONS[trig], ro_reason)
        return {k: no_update for k in ASK_OUTPUTS}


def _jsonable(o):
    if hasattr(o, "to_plotly_json"):
        return o.to_plotly_json()
    return str(o)
