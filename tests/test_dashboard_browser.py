"""The operator dashboard in a real browser (headless Debian Chromium through Playwright) against a
real control-plane process with seeded history, a synthetic fleet reporting live over HTTP and a
real `racer node-agent` process connected to the control plane.

What an operator sees and clicks: the overview and split pages draw every node's series and the
burst shading; an override goes from the form to the node (its decisions show source
``override``) and into the audit log, then is cleared; a rollout is started and rolled back; a
viewer can do neither; a policy goes from upload to activation to a rolled-back rollout in the UI
alone, then one decision is drilled into, with no console error; the control plane stops
(banner, stale data) and comes back (data resumes, no reload). Screenshots go to the test's temporary folder (``dashboard-shots/``).
"""

from __future__ import annotations

import io
import json
import os
import secrets
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import pytest

from bench.dashboard import (CHROMIUM, free_port, launch_browser, plot_state, sign_in, start_control_plane,
                             start_dashboard, stop)
from bench.synthetic_fleet import Fleet, FleetConfig
from dashboard import figures as F

from .test_node_agent import write_taobao_csv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
sync_api = pytest.importorskip("playwright.sync_api")
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} missing (.ci/run installs Debian's chromium)", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
POLICY_DIR = REPO / "policies" / "default"
AGENT_ID = "node-agent-1"
NUM_FLEET = 6
HISTORY_S = 1200.0


def _agent_connects() -> bool:
    """Whether this tree's `racer node-agent` can join a control plane."""
    out = subprocess.run([sys.executable, "-m", "racer", "node-agent", "--help"], cwd=REPO, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    return "--control-plane" in out


AGENT = _agent_connects()
needs_agent = pytest.mark.skipif(not AGENT, reason="racer node-agent has no --control-plane")


def policy_tar(policy_id: str | None = None) -> bytes:
    """The files `racer policy export` writes, as a tar; ``policy_id`` renames the policy."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("manifest.json", "policy.onnx", "golden.npz"):
            data = (POLICY_DIR / name).read_bytes()
            if name == "manifest.json" and policy_id:
                m = json.loads(data)
                m["policy_id"] = policy_id
                data = json.dumps(m, indent=2).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Stack:
    """The processes of one test module and how to reach them."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.shots = tmp / "dashboard-shots"
        self.shots.mkdir()
        self.admin = "racer_test_admin_" + secrets.token_hex(8)
        self.cp_port, self.dash_port, self.agent_port = free_port(), free_port(), free_port()
        self.cp_url = f"http://127.0.0.1:{self.cp_port}"
        self.dash_url = f"http://127.0.0.1:{self.dash_port}/"
        self.db_url = f"sqlite:///{tmp / 'cp.db'}"
        self.cp = self.dash = self.agent = None
        self.fleet: Fleet | None = None

    def api(self, method: str, path: str, token: str | None = None, **kw):
        r = httpx.request(method, f"{self.cp_url}/api/v1{path}", headers={
            "Authorization": f"Bearer {token or self.admin}"}, timeout=30.0, **kw)
        assert r.status_code < 400, f"{method} {path}: {r.status_code} {r.text}"
        return r.json()

    def start_cp(self) -> None:
        self.cp = start_control_plane(self.db_url, self.cp_port, self.admin, self.tmp / "cp.log",
                                      report_interval_s=1.0, rollout_period_s=1.0)

    def start_agent(self, token: str) -> None:
        csv = write_taobao_csv(self.tmp / "UserBehavior_small.csv")
        cmd = [sys.executable, "-m", "racer", "node-agent", "--port", str(self.agent_port), "--trace", "taobao",
               "--path", str(csv), "--emb-share", "0.5", "--seed", "1", "--num-pages", "256",
               "--max-history-len", "256", "--control-interval-s", "0.5", "--policy", str(POLICY_DIR),
               "--control-plane", self.cp_url, "--token", token, "--node-id", AGENT_ID,
               "--state-dir", str(self.tmp / "agent-state")]
        log = open(self.tmp / "agent.log", "ab")
        self.agent = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
        log.close()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.agent.poll() is None, (self.tmp / "agent.log").read_text()[-3000:]
            nodes = {n["node_id"]: n for n in self.api("GET", "/nodes")}
            if AGENT_ID in nodes and nodes[AGENT_ID]["last_report_seq"] is not None:
                return
            time.sleep(0.5)
        raise AssertionError("the node agent never reported: " + (self.tmp / "agent.log").read_text()[-3000:])

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
        for p in (self.dash, self.agent, self.cp):
            stop(p)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("dashboard"))
    try:
        s.start_cp()
        s.viewer = s.api("POST", "/tokens", json={"role": "viewer", "name": "watcher"})["token"]
        node_token = s.api("POST", "/tokens", json={"role": "node", "name": "agent", "node_id": AGENT_ID})["token"]
        # policies: the shipped one (made active) and a candidate under another policy_id
        s.active_policy = _upload(s, policy_tar())
        s.api("POST", f"/policies/{s.active_policy}/activate", json={"reason": "test baseline"})
        s.candidate = _upload(s, policy_tar("candidate-" + secrets.token_hex(3)))
        now = time.time()
        s.fleet = Fleet(s.cp_url, s.admin, FleetConfig(num_nodes=NUM_FLEET, interval_s=2.0),
                        start_s=now - HISTORY_S, end_s=now)
        s.fleet.register()
        s.fleet.seed()
        s.fleet.live()
        if AGENT:
            s.start_agent(node_token)
        s.dash = start_dashboard(s.cp_url, s.dash_port, s.tmp / "dashboard.log", refresh_s=1.0, range_s=900)
        yield s
    finally:
        s.close()


def _upload(s: Stack, data: bytes) -> str:
    r = httpx.post(f"{s.cp_url}/api/v1/policies", content=data, timeout=60.0,
                   headers={"Authorization": f"Bearer {s.admin}", "Content-Type": "application/x-tar"})
    assert r.status_code in (200, 201), r.text
    return r.json()["version"]


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = launch_browser(p)
        yield b
        b.close()


def open_page(browser, stack: Stack, token: str, console: list | None = None):
    """A signed-in page; ``console``: a list that collects the page's console errors and uncaught
    exceptions from before the sign-in on."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    if console is not None:
        page.on("console", lambda m: console.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: console.append(f"page error: {e}"))
    sign_in(page, stack.dash_url, token)
    return page


def click_tab(page, label: str) -> None:
    page.get_by_role("tab", name=label).click() if page.get_by_role("tab", name=label).count() else \
        page.get_by_text(label, exact=True).first.click()


def wait_plot(page, gid: str, pred, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    st = None
    while time.monotonic() < deadline:
        st = plot_state(page, gid)
        if st is not None and pred(st):
            return st
        page.wait_for_timeout(250)
    raise AssertionError(f"{gid} never satisfied the condition; last state: {json.dumps(st)[:2000]}")


def choose(page, dropdown_id: str, option_text: str) -> None:
    page.click(f"#{dropdown_id}")
    page.get_by_role("option", name=option_text).first.click()


def grid_text(page, gid: str) -> str:
    return page.locator(f"#{gid}").inner_text()


def wait_text(page, gid: str, needle: str, timeout_s: float = 30.0, absent: bool = False) -> str:
    deadline = time.monotonic() + timeout_s
    txt = ""
    while time.monotonic() < deadline:
        txt = page.locator(f"#{gid}").inner_text()
        if (needle in txt) != absent:
            return txt
        page.wait_for_timeout(250)
    raise AssertionError(f"{gid}: {'still' if absent else 'never'} shows {needle!r}; text: {txt[:1500]}")


# ------------------------------------------------------------------------------- tests ---


OVERVIEW_TIME_GRAPHS = ("g-slo", "g-p99", "g-thr", "g-hits")


def test_overview_and_split_render_every_series_and_the_burst_shading(stack, browser):
    console: list[str] = []
    page = open_page(browser, stack, stack.admin, console)
    nodes = sorted([f"gpu-{i:02d}" for i in range(NUM_FLEET)] + ([AGENT_ID] if AGENT else []))
    p99 = wait_plot(page, "g-p99", lambda st: sum(1 for t in st["traces"] if t["n"] > 0) >= len(nodes))
    assert [t["name"] for t in p99["traces"][:len(nodes)]] == nodes
    assert all(t["type"] == "scatter" for t in p99["traces"][:len(nodes)])
    # plotly.js is the cartesian bundle from the dashboard's assets; the full bundle is not fetched
    scripts = page.evaluate("() => performance.getEntriesByType('resource').map(e => e.name)")
    assert any("plotly-cartesian.min.js" in u for u in scripts)
    assert not any(u.split("?")[0].endswith("/plotly.min.js") for u in scripts), scripts
    assert "ms" in p99["ytitle"] and "UTC" in p99["xtitle"]
    assert [s for s in p99["shapes"] if s["name"] == "slo"][0]["y0"] == 30
    # burst shading where the seeded bursts are (within the 15-min range)
    now = time.time()
    expected = [(s, e) for s, e, _m in stack.fleet.burst_periods() if e > now - 900]
    assert expected, "the seeded history has a burst inside the range"
    bursts = [s for s in p99["shapes"] if s["name"] == "burst"]
    assert len(bursts) >= len(expected)
    for s, e in expected:
        assert any(b["x0"] <= F.to_x(s + 2.0) and b["x1"] >= F.to_x(e - 2.0) for b in bursts), (s, e, bursts)
    for gid, names, unit in (("g-slo", ["attainment"], "%"), ("g-thr", ["served"], "req/s"),
                             ("g-hits", ["EMB hit rate (rows)", "KV hit rate (tokens)"], "%")):
        st = wait_plot(page, gid, lambda st: st["traces"] and st["traces"][0]["n"] > 0)
        assert [t["name"] for t in st["traces"][:len(names)]] == names
        assert unit in st["ytitle"] and any(s["name"] == "burst" for s in st["shapes"])
    # live: extendData brings new points without redrawing the figure
    before = {t["name"]: t["last_x"] for t in p99["traces"][:len(nodes)]}
    wait_plot(page, "g-p99", lambda st: any(t["last_x"] and t["last_x"] > before[t["name"]]
                                            for t in st["traces"][:len(nodes)] if before.get(t["name"])),
              timeout_s=40)
    page.wait_for_timeout(500)
    # every point once and in time order after live ticks (a figure Patch and extendData sent to
    # a chart together used to drop points and repeat them later: spikes)
    for gid in OVERVIEW_TIME_GRAPHS:
        xs = page.evaluate("(g) => document.querySelector('#' + g + ' .js-plotly-plot').data"
                           ".map(t => Array.from(t.x || []).filter(v => v !== null))", gid)
        for x in xs:
            assert x == sorted(x) and len(x) == len(set(x)), (gid, x)
    page.screenshot(path=str(stack.shots / "overview.png"), full_page=True)
    # the token stays on the dashboard server: not in the URL, the browser's storage, the page or a log
    assert stack.admin not in page.url
    storage = page.evaluate("() => JSON.stringify([Object.entries(sessionStorage), Object.entries(localStorage)])")
    assert stack.admin not in storage and stack.admin not in page.content()
    assert stack.admin not in (stack.tmp / "dashboard.log").read_text(errors="replace")

    click_tab(page, "EMB-KV split")
    heat = wait_plot(page, "g-heat", lambda st: st["traces"] and st["traces"][0]["rows"] == len(nodes))
    assert heat["traces"][0]["type"] == "heatmap" and any(s["name"] == "burst" for s in heat["shapes"])
    lines = wait_plot(page, "g-lines", lambda st: any(t["name"] == "decision: recovery" and t["n"] > 0
                                                      for t in st["traces"]))
    names = [t["name"] for t in lines["traces"]]
    assert names[:6] == ["gpu-00 applied", "gpu-00 target", "gpu-01 applied", "gpu-01 target",
                         "gpu-02 applied", "gpu-02 target"]
    colors = {t["meta"]: t["color"] for t in lines["traces"] if (t["name"] or "").startswith("decision: ")}
    assert colors == F.SOURCE_COLORS
    split = wait_plot(page, "g-split", lambda st: len(st["traces"]) == 2)
    assert [t["name"] for t in split["traces"]] == ["EMB slab", "KV pool"] and split["traces"][0]["n"] == len(nodes)
    page.screenshot(path=str(stack.shots / "split.png"), full_page=True)

    click_tab(page, "Bursts")
    txt = wait_text(page, "grid-bursts", "recovery decisions")
    assert "gpu-00" in txt
    page.screenshot(path=str(stack.shots / "bursts.png"), full_page=True)
    click_tab(page, "Decisions & routing")
    wait_text(page, "grid-decisions", "base policy")
    page.wait_for_timeout(1500)
    page.screenshot(path=str(stack.shots / "decisions.png"), full_page=True)
    page.close()
    assert not console, "\n".join(console)


@needs_agent
def test_operator_override_reaches_the_node_and_the_audit_log_then_clears(stack, browser):
    console: list[str] = []
    page = open_page(browser, stack, stack.admin, console)
    click_tab(page, "Override")
    page.wait_for_selector("#ov-node")
    choose(page, "ov-node", AGENT_ID)
    page.fill("#ov-share", "0.3")
    page.fill("#ov-reason", "browser test: hold the split")
    page.click("#btn-ov-submit")
    page.wait_for_selector("#confirm-modal .modal-body", state="visible")
    assert "0.300" in page.inner_text("#confirm-body") and AGENT_ID in page.inner_text("#confirm-body")
    page.click("#btn-confirm")
    result = wait_text(page, "action-result", "override #")
    assert "set" in result
    grid = wait_text(page, "grid-overrides", "browser test: hold the split")
    assert AGENT_ID in grid
    # applied on the node: its own allocator reports source "override" at 0.3 ...
    deadline = time.monotonic() + 60
    last = None
    while time.monotonic() < deadline:
        m = httpx.get(f"http://127.0.0.1:{stack.agent_port}/v1/metrics", timeout=5).json()
        last = (m.get("allocator") or {}).get("last_decision") or {}
        if last.get("source") == "override" and abs(last.get("emb_share", 0) - 0.3) < 1e-6:
            break
        time.sleep(0.5)
    assert last and last.get("source") == "override", last
    # ... and the dashboard shows the node's decisions with source override
    click_tab(page, "Decisions & routing")
    page.fill("#dec-search", AGENT_ID)
    page.press("#dec-search", "Enter")
    wait_text(page, "grid-decisions", "override", timeout_s=30)
    page.screenshot(path=str(stack.shots / "decisions-override.png"), full_page=True)
    click_tab(page, "Override")
    audit = wait_text(page, "grid-audit", "browser test: hold the split")
    assert "override" in audit
    page.screenshot(path=str(stack.shots / "override.png"), full_page=True)
    # clear it: a reason is asked for, and the dialog names the node's present emb_share
    page.locator("#grid-overrides .ag-row").first.click()
    page.click("#btn-ov-clear")
    wait_text(page, "ov-error", "a reason for clearing is required")
    page.fill("#ov-clear-reason", "browser test: hand it back")
    page.click("#btn-ov-clear")
    page.wait_for_selector("#confirm-modal .modal-body", state="visible")
    body = page.inner_text("#confirm-body")
    assert "Clear override" in body and f"{AGENT_ID} is at emb_share" in body and "hand it back" in body, body
    page.click("#btn-confirm")
    wait_text(page, "action-result", "cleared")
    wait_text(page, "grid-overrides", "browser test: hold the split", absent=True)
    wait_text(page, "grid-audit", "browser test: hand it back")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = httpx.get(f"http://127.0.0.1:{stack.agent_port}/v1/metrics", timeout=5).json()
        last = (m.get("allocator") or {}).get("last_decision") or {}
        if last.get("source") not in (None, "override"):
            break
        time.sleep(0.5)
    assert last.get("source") != "override", last
    page.close()
    assert not console, "\n".join(console)


def test_operator_starts_and_rolls_back_a_rollout_and_a_viewer_can_do_neither(stack, browser):
    viewer = open_page(browser, stack, stack.viewer)
    assert "(viewer)" in viewer.inner_text("#who")
    click_tab(viewer, "Override")
    assert viewer.locator("#viewer-note").is_visible()
    assert viewer.is_disabled("#btn-ov-submit") and viewer.is_disabled("#btn-ov-clear")
    assert viewer.is_disabled("#btn-node-retire")
    click_tab(viewer, "Policies")
    for b in ("#btn-ro-start", "#btn-ro-promote", "#btn-ro-pause", "#btn-ro-resume", "#btn-ro-rollback"):
        assert viewer.is_disabled(b), b
    assert "read-only" in viewer.inner_text("#role-note-policies")
    wait_text(viewer, "grid-policies", stack.candidate)  # a viewer sees the registry
    viewer.screenshot(path=str(stack.shots / "policies-viewer.png"), full_page=True)
    viewer.close()
    assert not [r for r in stack.api("GET", "/rollouts")]

    page = open_page(browser, stack, stack.admin)
    click_tab(page, "Policies")
    wait_text(page, "grid-policies", stack.candidate)
    assert stack.candidate in start_rollout(page, f"{stack.candidate} (registered)", "browser test rollout")
    state = wait_text(page, "ro-status", stack.candidate)
    assert "pending" in state or "baking" in state
    ros = stack.api("GET", "/rollouts")
    assert len(ros) == 1 and ros[0]["policy_version"] == stack.candidate and ros[0]["created_by"]
    # the canary nodes load the candidate and report under it: the progress chart shows both groups
    wait_text(page, "ro-state", "baking", timeout_s=60)
    fig = wait_plot(page, "g-rollout", lambda st: all(any(t["name"] == f"{g} P99" and t["n"] > 0 for t in st["traces"])
                                                      for g in ("canary", "baseline")), timeout_s=60)
    assert fig["ytitle"] == "P99 (ms)"
    wait_text(page, "grid-ro-nodes", "loaded")
    page.wait_for_timeout(1000)
    page.screenshot(path=str(stack.shots / "policies-rollout.png"), full_page=True)
    page.click("#btn-ro-rollback")
    page.wait_for_selector("#confirm-modal .modal-body", state="visible")
    assert "Rollback rollout" in page.inner_text("#confirm-body")
    page.click("#btn-confirm")
    wait_text(page, "action-result", "rolled_back")
    wait_text(page, "ro-state", "rolled_back")
    assert stack.api("GET", "/rollouts")[0]["state"] == "rolled_back"
    # the rollback raises its alert above every tab (GET /alerts), amber: a ticket, not a page
    page.wait_for_selector(".alert-RacerRolloutRolledBack", timeout=30_000)
    said = page.inner_text(".alert-RacerRolloutRolledBack")
    assert "rolled back" in said and f"rollout:{ros[0]['id']}" in said
    assert "alert-warning" in page.get_attribute(".alert-RacerRolloutRolledBack", "class")
    actions = [a["action"] for a in stack.api("GET", "/audit", params={"limit": 50})["items"]]
    assert any("rollout" in a for a in actions)
    page.screenshot(path=str(stack.shots / "policies.png"), full_page=True)
    page.close()


ROLLOUT_BUTTONS = ("#btn-ro-promote", "#btn-ro-pause", "#btn-ro-resume", "#btn-ro-rollback")


def start_rollout(page, option: str, reason: str, bake_s: float = 600) -> str:
    """Start a rollout from the Policies tab: the candidate whose dropdown option reads ``option``,
    half the nodes, a ``bake_s`` bake; returns what the confirmation said, once the page says started."""
    choose(page, "ro-policy", option)
    page.fill("#ro-fraction", "0.5")
    page.fill("#ro-bake", f"{bake_s:g}")
    page.fill("#ro-reason", reason)
    page.click("#btn-ro-start")
    page.wait_for_selector("#confirm-modal .modal-body", state="visible")
    said = page.inner_text("#confirm-body")
    page.click("#btn-confirm")
    wait_text(page, "action-result", "started")
    return said


def wait_disabled(page, selectors, disabled: bool = True, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(page.is_disabled(sel) == disabled for sel in selectors):
            return
        page.wait_for_timeout(250)
    raise AssertionError({sel: page.is_disabled(sel) for sel in selectors})


def test_policy_from_upload_to_rolled_back_and_a_decision_drill_down_without_console_errors(stack, browser):
    """The operator's policy path in the UI alone: upload an artifact's three files, activate it,
    a rollout refused without a candidate (a message, not nothing), then started, rolled back:
    the panel says rolled_back at once with every rollout action disabled; then one decision's
    drill-down. Any console error (from before the sign-in on) fails the test."""
    console: list[str] = []
    page = open_page(browser, stack, stack.admin, console)
    assert page.get_by_role("tab", name="Policies").count() == 1  # the tabs are tabs to a screen reader
    click_tab(page, "Policies")
    assert page.get_by_role("tab", name="Policies").get_attribute("aria-selected") == "true"
    wait_text(page, "grid-policies", stack.candidate)
    assert "accepted by the agent's loader" in grid_text(page, "grid-policies")  # not the raw manifest
    version = "ui-" + secrets.token_hex(3)
    manifest = json.loads((POLICY_DIR / "manifest.json").read_text())
    manifest["policy_id"] = version
    # a broken artifact is refused by the agent's loader, and the page says why
    page.set_input_files("#pol-upload input[type=file]", files=[
        {"name": "manifest.json", "mimeType": "application/json", "buffer": json.dumps(manifest).encode()},
        {"name": "policy.onnx", "mimeType": "application/octet-stream", "buffer": b"not an onnx model"},
        {"name": "golden.npz", "mimeType": "application/octet-stream",
         "buffer": (POLICY_DIR / "golden.npz").read_bytes()}])
    assert "policy artifact refused" in wait_text(page, "pol-upload-result", "refused by the control plane", timeout_s=60)
    page.set_input_files("#pol-upload input[type=file]", files=[
        {"name": "manifest.json", "mimeType": "application/json", "buffer": json.dumps(manifest).encode()},
        {"name": "policy.onnx", "mimeType": "application/octet-stream",
         "buffer": (POLICY_DIR / "policy.onnx").read_bytes()},
        {"name": "golden.npz", "mimeType": "application/octet-stream",
         "buffer": (POLICY_DIR / "golden.npz").read_bytes()}])
    assert f"policy {version} registered" in wait_text(page, "pol-upload-result", "registered", timeout_s=60)
    wait_text(page, "grid-policies", version)
    # activate it
    page.locator("#grid-policies .ag-row", has_text=version).first.click()
    page.fill("#pol-reason", "browser test: the uploaded one")
    page.click("#btn-pol-activate")
    page.wait_for_selector("#confirm-modal .modal-body", state="visible")
    assert f"Activate policy {version}" in page.inner_text("#confirm-body")
    page.click("#btn-confirm")
    wait_text(page, "action-result", f"policy {version} is active")
    assert stack.api("GET", f"/policies/{version}")["status"] == "active"
    if AGENT:  # the active-policy card says what the nodes run
        wait_text(page, "kpi-policy", version, timeout_s=60)
    # a rollout without a candidate says so
    page.click("#btn-ro-start")
    wait_text(page, "ro-error", "choose a candidate policy or model first")
    assert not page.locator("#confirm-modal .modal-body").is_visible()
    start_rollout(page, stack.candidate, "browser test: second rollout")
    deadline = time.monotonic() + 30
    while page.inner_text("#ro-state") not in ("pending", "baking") and time.monotonic() < deadline:
        page.wait_for_timeout(250)
    assert page.inner_text("#ro-state") in ("pending", "baking"), page.inner_text("#ro-status")
    wait_disabled(page, ("#btn-ro-resume", "#btn-ro-start", "#btn-pol-activate"))  # not valid while it is open
    wait_disabled(page, ("#btn-ro-promote", "#btn-ro-pause", "#btn-ro-rollback"), disabled=False)
    page.click("#btn-ro-rollback")
    page.wait_for_selector("#confirm-modal .modal-body", state="visible")
    page.click("#btn-confirm")
    wait_text(page, "action-result", "rolled_back")
    wait_text(page, "ro-state", "rolled_back", timeout_s=10)  # at once, not at the next judge's pass
    wait_disabled(page, ROLLOUT_BUTTONS, timeout_s=10)
    wait_disabled(page, ("#btn-ro-start",), disabled=False, timeout_s=10)
    assert "next action" not in page.inner_text("#ro-status")  # no stale verdict on an ended rollout
    assert "has ended" in page.inner_text("#ro-actions-note")
    if AGENT:  # the canary went back to the active policy: the nodes table says what it runs now
        wait_text(page, "grid-ro-nodes", version, timeout_s=60)
    page.screenshot(path=str(stack.shots / "policies-rolled-back.png"), full_page=True)
    # one decision's drill-down
    click_tab(page, "Decisions & routing")
    wait_text(page, "grid-decisions", "base policy")
    page.locator("#grid-decisions .ag-row [col-id=reason]").first.click()
    page.wait_for_selector("#dec-modal .modal-body", state="visible")
    body = page.inner_text("#dec-modal")
    for section in ("Reason", "Decision", "Context at that moment", "Miss costs", "Features the policy saw"):
        assert section in body, body[:2000]
    assert "time (UTC)" in body and "kv_hit_rate" in body, body[:2000]
    page.screenshot(path=str(stack.shots / "decision-drill-down.png"), full_page=True)
    page.keyboard.press("Escape")
    page.wait_for_selector("#dec-modal .modal-body", state="hidden")
    # a search holds while live decisions arrive (ticks add rows of the same search only)
    page.fill("#dec-search", "gpu-01")
    page.press("#dec-search", "Enter")
    deadline = time.monotonic() + 30
    nodes: set = set()
    while time.monotonic() < deadline:
        nodes = set(page.locator("#grid-decisions .ag-center-cols-container [col-id=node_id]").all_inner_texts())
        if nodes == {"gpu-01"}:
            break
        page.wait_for_timeout(250)
    assert nodes == {"gpu-01"}, nodes
    assert "decisions matching “gpu-01”" in page.inner_text("#dec-count")
    page.wait_for_timeout(4000)  # several live ticks, the fleet deciding every 2 s
    nodes = set(page.locator("#grid-decisions .ag-center-cols-container [col-id=node_id]").all_inner_texts())
    assert nodes == {"gpu-01"}, nodes
    page.close()
    assert not console, "\n".join(console)


def test_operator_retires_a_node_from_the_dashboard(stack, browser):
    """A spare node (its own token) is retired from the Override tab: after the confirmation it is
    out of the node list, its token is refused and the audit log has the action with its reason."""
    spare = "spare-1"
    token = stack.api("POST", "/tokens", json={"role": "node", "name": spare, "node_id": spare})["token"]
    stack.api("POST", "/nodes/register", token=token, json={
        "node_id": spare, "address": "http://127.0.0.1:9", "device": "cpu", "cost_profile": {
            "kv_recompute_us_per_token": 2.0, "emb_transfer_us_per_row": 1.0, "service_time_us": 900.0,
            "queue_capacity": 64}})
    page = open_page(browser, stack, stack.admin)
    click_tab(page, "Override")
    page.wait_for_selector("#retire-node")
    choose(page, "retire-node", spare)
    page.fill("#retire-reason", "browser test: decommission")
    page.click("#btn-node-retire")
    page.wait_for_selector("#confirm-modal .modal-body", state="visible")
    assert f"Retire node {spare}" in page.inner_text("#confirm-body")
    page.click("#btn-confirm")
    assert "retired" in wait_text(page, "action-result", f"node {spare}")
    assert spare not in [n["node_id"] for n in stack.api("GET", "/nodes")]
    r = httpx.get(f"{stack.cp_url}/api/v1/nodes/{spare}/directives", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 401
    wait_text(page, "grid-audit", "browser test: decommission")
    entry = stack.api("GET", "/audit", params={"action": "node.retire"})["items"][0]
    assert entry["target"] == f"node:{spare}" and entry["reason"] == "browser test: decommission"
    page.close()


def test_control_plane_down_shows_a_banner_with_stale_age_and_recovers_without_reload(stack, browser):
    page = open_page(browser, stack, stack.admin)
    wait_plot(page, "g-p99", lambda st: sum(1 for t in st["traces"] if t["n"] > 0) >= NUM_FLEET)
    assert not page.locator("#banner").is_visible()
    stop(stack.cp)
    t_down = time.time()
    page.wait_for_selector("#banner", state="visible", timeout=20_000)
    assert "unreachable" in page.inner_text("#banner")
    page.wait_for_timeout(2500)
    txt = page.inner_text("#banner")
    assert " old" in txt and "stale" in page.inner_text("#kpi-age")
    page.screenshot(path=str(stack.shots / "control-plane-down.png"), full_page=True)
    stack.start_cp()
    page.wait_for_selector("#banner", state="hidden", timeout=30_000)
    # the same page (no reload) draws points newer than the outage
    wait_plot(page, "g-p99", lambda st: any(t["last_x"] and t["last_x"] > F.to_x(t_down + 1)
                                            for t in st["traces"]), timeout_s=60)
    assert page.inner_text("#kpi-age") == "current"  # the data is current (whether requests are served: the client cards)
    page.screenshot(path=str(stack.shots / "control-plane-back.png"), full_page=True)
    page.close()


class SlowProxy:
    """A forwarding HTTP proxy in front of the control plane that can add a delay to every answer."""

    def __init__(self, target: str):
        import http.server
        import threading

        proxy = self
        self.delay_s = 0.0
        self.target = target

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                time.sleep(proxy.delay_s)
                try:
                    r = httpx.request(self.command, proxy.target + self.path, content=body, headers=headers, timeout=30)
                except httpx.HTTPError:
                    self.send_error(502)
                    return
                try:
                    self.send_response(r.status_code)
                    for k, v in r.headers.items():
                        if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(r.content)))
                    self.end_headers()
                    self.wfile.write(r.content)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the dashboard gave up waiting (its timeout)

            do_GET = do_POST = do_DELETE = _forward

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_slow_control_plane_raises_the_slow_banner_and_it_clears(stack, browser):
    proxy = SlowProxy(stack.cp_url)
    port = free_port()
    dash = start_dashboard(proxy.url, port, stack.tmp / "dashboard-slow.log", refresh_s=1.0, range_s=300)
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        sign_in(page, f"http://127.0.0.1:{port}/", stack.admin)
        wait_plot(page, "g-p99", lambda st: sum(1 for t in st["traces"] if t["n"] > 0) >= NUM_FLEET)
        proxy.delay_s = 2.0  # above the 1.5 s "slow" mark, below the 3 s request timeout
        page.wait_for_selector("#banner", state="visible", timeout=30_000)
        assert "slow" in page.inner_text("#banner")
        page.screenshot(path=str(stack.shots / "control-plane-slow.png"), full_page=True)
        proxy.delay_s = 0.0
        page.wait_for_selector("#banner", state="hidden", timeout=30_000)
        page.close()
    finally:
        stop(dash)
        proxy.close()
