"""The README's first command, seen in a real browser: `racer up` on a fresh data folder, then the
dashboard in headless Chromium (Playwright, Debian's /usr/bin/chromium) signed in with the
operator token `racer up` printed. It must show live EMB/KV splits of the four nodes, burst
periods and SLO attainment, what clients see beside the nodes' own; then an operator uploads a
policy, activates it, rolls out the candidate `racer up` registered and rolls it back, and opens
one decision's drill-down; then a far worse model (random weights) is pushed, rolled out from the
dashboard (shown with its own controls) and rolled back by the judge on the nodes' online model
quality; any console error fails it. The seconds from the command to each of them are printed and saved
with the screenshots under the test's temporary folder (``up-shots/``): a figure, not an assert
(the machine is shared); the assert allows 240 s.

Needs the whole system (control plane, gateway, dashboard): skipped on a build without them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from racer.up import available_commands

from .conftest import REPO
from .procs import skip_or_fail

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--no-first-run", "--disable-quic"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
_MISSING = {"control-plane", "gateway", "dashboard"} - set(available_commands())


def _need_everything() -> None:
    import importlib.util

    if importlib.util.find_spec("playwright") is None:
        skip_or_fail("playwright is not installed (the test extra has it)")
    if not Path(CHROMIUM).exists():
        skip_or_fail(f"{CHROMIUM} missing (.ci/run installs Debian's chromium)")
    if _MISSING:
        skip_or_fail(f"this build has no racer {', '.join(sorted(_MISSING))}")

PLOT_JS = """(gid) => {
  const el = document.querySelector('#' + gid + ' .js-plotly-plot');
  if (!el || !el.data) return null;
  return {traces: el.data.map(t => ({name: t.name, type: t.type, n: (t.x || []).length,
                                     rows: t.z ? t.z.length : null,
                                     cols: (t.z && t.z.length) ? t.z[0].length : null})),
          shapes: (el.layout.shapes || []).length};
}"""


def _plot(page, gid: str) -> dict | None:
    return page.evaluate(PLOT_JS, gid)


def _points(state: dict | None) -> int:
    return 0 if not state else sum(t["n"] or 0 for t in state["traces"])


def test_readme_first_command_shows_live_splits_bursts_and_slo_in_the_dashboard(tmp_path):
    _need_everything()
    from playwright.sync_api import sync_playwright

    data = tmp_path / "racer-data"
    shots = tmp_path / "up-shots"
    shots.mkdir()
    t0 = time.monotonic()
    # the README's first command after the install step (a fresh data folder: nothing measured yet)
    cmd = [sys.executable, "-m", "racer", "up", "--data-dir", str(data), "--duration", "1500", "--dashboard-port",
           "0", "--json"]
    err = open(tmp_path / "up.err", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    figures: dict[str, float] = {}

    def mark(what: str) -> None:
        figures.setdefault(what, round(time.monotonic() - t0, 1))

    try:
        dash_url = None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and dash_url is None:
            assert proc.poll() is None, (tmp_path / "up.err").read_text()[-3000:]
            for line in (tmp_path / "up.err").read_text().splitlines():
                if line.startswith("racer up: dashboard"):
                    dash_url = line.split()[-1]
            time.sleep(0.5)
        assert dash_url, "racer up printed no dashboard URL"
        mark("dashboard_url_printed_s")
        text = (tmp_path / "up.err").read_text()
        token = (data / "operator_token").read_text().strip()
        assert f"operator token in {data / 'operator_token'}" in text and token not in text
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            console: list[str] = []  # any console error, from before the sign-in on, fails the test
            page.on("console", lambda m: console.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: console.append(f"page error: {e}"))
            page.goto(dash_url)
            page.fill("#login-token", token)
            page.click("#btn-login")
            page.wait_for_selector("#main", state="visible", timeout=60_000)
            assert token not in page.url

            # SLO attainment: a live series and the KPI
            def slo_live():
                st = _plot(page, "g-slo")
                kpi = page.inner_text("#kpi-slo") if page.query_selector("#kpi-slo") else ""
                return _points(st) >= 2 and "%" in kpi
            _wait(slo_live, t0, 240, "SLO attainment in the overview")
            mark("slo_attainment_shown_s")

            # what clients see (the gateway's reports) leads, the nodes' own beside, the load's phase
            def clients_live():
                t = {c: page.inner_text(f"#{c}") if page.query_selector(f"#{c}") else ""
                     for c in ("cv-state", "cv-p99", "cv-slo", "nv-p99", "nv-slo", "cv-phase")}
                return ("live" in t["cv-state"] and "ms" in t["cv-p99"] and "%" in t["cv-slo"] and "ms" in t["nv-p99"]
                        and "%" in t["nv-slo"] and "[" in t["cv-phase"])
            _wait(clients_live, t0, 270, "the clients' P99, SLO and load phase beside the nodes'")
            mark("client_view_shown_s")
            page.screenshot(path=str(shots / "overview.png"), full_page=True)

            # EMB/KV splits: the heatmap has a row per node and columns filling in
            from .test_dashboard_browser import click_tab

            click_tab(page, "EMB-KV split")

            def splits_live():
                st = _plot(page, "g-heat")
                return st and any((t["rows"] or 0) >= 4 and (t["cols"] or 0) >= 2 for t in st["traces"])
            _wait(splits_live, t0, 240, "emb_share per node in the split heatmap")
            mark("splits_shown_s")
            page.screenshot(path=str(shots / "split.png"), full_page=True)

            # bursts: the steady -> trend -> burst loop reaches its burst phase; a node's recovery
            # controller reports it and the dashboard lists and shades it
            cp_url = next(line.split()[4] for line in (tmp_path / "up.err").read_text().splitlines()
                          if line.startswith("racer up: control plane http"))

            def bursts_live():
                import httpx

                if not httpx.get(f"{cp_url}/api/v1/bursts", headers={"Authorization": f"Bearer {token}"},
                                 timeout=10).json():
                    return False  # none detected yet (a burst lasts seconds; the first pass's may be missed)
                click_tab(page, "Overview" if page.query_selector("#grid-bursts") else "Bursts")
                click_tab(page, "Bursts")  # the tab drawn with the burst in it
                page.wait_for_timeout(2000)
                rows = page.query_selector_all("#grid-bursts .ag-center-cols-container .ag-row")
                return len(rows) >= 1
            _wait(bursts_live, t0, 300, "a burst in the bursts table")
            mark("burst_shown_s")
            page.screenshot(path=str(shots / "bursts.png"), full_page=True)
            click_tab(page, "Overview")
            time.sleep(3)
            page.screenshot(path=str(shots / "overview_with_burst.png"), full_page=True)
            _policy_path_and_a_drill_down(page, tmp_path / "up.err", token, shots)
            mark("policy_rolled_back_s")
            _a_worse_model_is_rolled_out_and_rolled_back_by_its_judge(page, tmp_path, token, shots)
            mark("model_rolled_back_s")
            browser.close()
            assert not console, "\n".join(console)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        err.close()
        (shots / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
        print(f"\nracer up -> dashboard figures (s since the command): {figures}; screenshots in {shots}")
    assert proc.returncode == 0, (tmp_path / "up.err").read_text()[-3000:]
    rep = json.loads(out)
    assert rep["stopped_by"] == "signal SIGTERM" and rep["requests_lost"] == 0 and rep["requests_served"] > 0
    # every process (the dashboard too) ends on racer up's SIGTERM by itself: exit status 0
    assert {n: p["exit_code"] for n, p in rep["processes"].items()} == {n: 0 for n in rep["processes"]}
    for f in ("overview.png", "split.png", "bursts.png"):
        assert (shots / f).stat().st_size > 10_000


def _policy_path_and_a_drill_down(page, up_err: Path, token: str, shots: Path) -> None:
    """On the system `racer up` made: upload the shipped policy's files under a new id, activate
    it, roll out the candidate `racer up` registered, roll it back (the panel says rolled_back
    at once, every rollout action disabled), then open one decision's drill-down."""
    import secrets

    import httpx

    from .test_dashboard_browser import POLICY_DIR, ROLLOUT_BUTTONS, click_tab, start_rollout, wait_disabled, wait_text

    cp = next(line.split()[4] for line in up_err.read_text().splitlines()
              if line.startswith("racer up: control plane http"))
    auth = {"Authorization": f"Bearer {token}"}
    click_tab(page, "Policies")
    version = "up-" + secrets.token_hex(3)
    manifest = json.loads((POLICY_DIR / "manifest.json").read_text())
    manifest["policy_id"] = version
    page.set_input_files("#pol-upload input[type=file]", files=[
        {"name": "manifest.json", "mimeType": "application/json", "buffer": json.dumps(manifest).encode()},
        {"name": "policy.onnx", "mimeType": "application/octet-stream",
         "buffer": (POLICY_DIR / "policy.onnx").read_bytes()},
        {"name": "golden.npz", "mimeType": "application/octet-stream",
         "buffer": (POLICY_DIR / "golden.npz").read_bytes()}])
    wait_text(page, "pol-upload-result", f"policy {version} registered", timeout_s=60)
    wait_text(page, "grid-policies", version)
    page.locator("#grid-policies .ag-row", has_text=version).first.click()
    page.fill("#pol-reason", "racer up browser test")
    page.click("#btn-pol-activate")
    page.wait_for_selector("#confirm-modal .modal-body", state="visible")
    page.click("#btn-confirm")
    wait_text(page, "action-result", f"policy {version} is active")
    pols = httpx.get(f"{cp}/api/v1/policies", headers=auth, timeout=30).json()
    items = pols["items"] if isinstance(pols, dict) else pols
    candidate = next(p["version"] for p in items if p["version"] != version and p["status"] != "active")
    start_rollout(page, candidate, "racer up browser test: a rollout")
    wait_disabled(page, ("#btn-ro-rollback",), disabled=False)
    page.click("#btn-ro-rollback")
    page.wait_for_selector("#confirm-modal .modal-body", state="visible")
    page.click("#btn-confirm")
    wait_text(page, "ro-state", "rolled_back", timeout_s=10)
    wait_disabled(page, ROLLOUT_BUTTONS, timeout_s=10)
    page.screenshot(path=str(shots / "policies_rolled_back.png"), full_page=True)
    click_tab(page, "Decisions & routing")
    wait_text(page, "grid-decisions", "base policy", timeout_s=60)
    page.locator("#grid-decisions .ag-row [col-id=reason]").first.click()
    page.wait_for_selector("#dec-modal .modal-body", state="visible")
    body = page.inner_text("#dec-modal")
    for section in ("Reason", "Decision", "Layers (in order)", "Context at that moment", "Features the policy saw"):
        assert section in body, body[:2000]
    page.screenshot(path=str(shots / "decision_drill_down.png"), full_page=True)
    page.keyboard.press("Escape")


def _a_worse_model_is_rolled_out_and_rolled_back_by_its_judge(page, tmp_path: Path, token: str,
                                                                shots: Path) -> None:
    """A checkpoint with random weights for the shipped model's items and config, pushed to the
    registry and rolled out from the Policies tab to half the nodes with a 150-s bake: the panel
    shows the model rollout with its own controls (Roll back and Promote enabled while it bakes);
    then the judge alone rolls it back, on the nodes' online model quality (each returning user's
    next item among its candidates, `node_agent.model.quality`) or on the canary's P99 with its
    quality worse, and the panel says so with every action disabled. The judge may bake on past
    150 s while the drop is not yet significant."""
    import httpx
    import torch

    from common.artifact_pack import CHECKPOINT_FILES, pack_directory
    from node_agent.model import HSTUModel
    from node_agent.model.checkpoint import load_checkpoint, save_checkpoint
    from node_agent.model.shipped import resolve_model

    from .test_dashboard_browser import ROLLOUT_BUTTONS, click_tab, start_rollout, wait_disabled, wait_text

    shipped = load_checkpoint(resolve_model("auto", "taobao", None))
    torch.manual_seed(7)
    worse = save_checkpoint(tmp_path / "worse-model", HSTUModel(shipped.config),
                            torch.randn(len(shipped.item_keys), shipped.config.embedding_dim), shipped.item_keys,
                            trace={"path": "random weights: a model far worse than the shipped one"})
    cp = next(line.split()[4] for line in (tmp_path / "up.err").read_text().splitlines()
              if line.startswith("racer up: control plane http"))
    auth = {"Authorization": f"Bearer {token}"}
    body = pack_directory(tmp_path / "worse-model", CHECKPOINT_FILES)
    r = httpx.post(f"{cp}/api/v1/models", content=body, headers={**auth, "Content-Type": "application/x-tar"},
                   timeout=120)
    assert r.status_code in (200, 201), r.text[:500]
    digest = worse["digest"]
    click_tab(page, "Policies")
    said = start_rollout(page, f"model {digest[:12]}", "racer up browser test: a worse model", bake_s=150)
    assert "judged on its online quality" in said
    wait_text(page, "ro-candidate", f"model {digest[:12]}", timeout_s=30)
    wait_disabled(page, ("#btn-ro-rollback", "#btn-ro-promote"), disabled=False, timeout_s=30)  # its own controls
    ro = max(httpx.get(f"{cp}/api/v1/rollouts", params={"kind": "all"}, headers=auth, timeout=30).json(),
             key=lambda x: x["id"])
    assert ro["kind"] == "model" and ro["model_version"] == digest and ro["config"]["canary_fraction"] == 0.5
    page.screenshot(path=str(shots / "model_rollout_baking.png"), full_page=True)
    # nobody clicks: the judge decides (150 s of bake, at most 4x that while a drop is unproven)
    wait_text(page, "ro-state", "rolled_back", timeout_s=700)
    wait_disabled(page, ROLLOUT_BUTTONS, timeout_s=30)
    card = page.inner_text("#ro-status")  # the judge's reason and its table of judgements
    # the reason's one "fail:" line lists every failed metric, "; " apart. Quality usually fails; the
    # canary's P99 may fail first (the swap dropped its users' K/V, and two shared cores are noisy),
    # and then quality need only be worse, not yet proven (the scripted path in
    # tests/test_model_rollout.py fails on quality alone)
    assert re.search(r"^fail: (?:.*; )?(?:model_quality|p99_ms): canary worse", card, re.M), card
    page.screenshot(path=str(shots / "model_rolled_back.png"), full_page=True)
    done = httpx.get(f"{cp}/api/v1/rollouts/{ro['id']}", headers=auth, timeout=30).json()
    last = done["steps"][-1]
    assert last["actor"] == "judge" and last["to_state"] == "rolled_back", last
    quality = next(j for j in done["verdict"]["judgements"] if j["metric"] == "model_quality")
    assert quality["verdict"] in ("fail", "inconclusive") and quality["mean_canary"] < quality["mean_baseline"], quality
    if quality["verdict"] == "inconclusive":
        assert re.search(r"^fail: (?:.*; )?p99_ms: canary worse", card, re.M), card


def _wait(pred, t0: float, limit_s: float, what: str) -> None:
    while time.monotonic() - t0 < limit_s:
        try:
            if pred():
                return
        except Exception:  # noqa: BLE001 - the page is re-rendering; look again
            pass
        time.sleep(1.0)
    raise AssertionError(f"{what}: not shown within {limit_s} s of the command")
