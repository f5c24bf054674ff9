"""A what-if from the dashboard, in a real browser, over `racer up --sample-rate 1`: traffic flows
and the gateway samples it (the control plane stores the samples); an operator opens the What-if
page, starts a run over the last 15 minutes, its progress shows, then its table (every static
split of the grid, the look-ahead oracle, and the registry's policies), its chart and its sentence
appear, the start button disabled while it runs; `racer whatif --show` prints the same run.
Headless Chromium through Playwright (Debian's /usr/bin/chromium); any console error fails it.
The control plane runs a two-share grid (RACER_WHATIF_SHARES) so the run takes a minute, not ten."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from .conftest import REPO
from .test_up_browser import CHROMIUM, CHROMIUM_FLAGS, _need_everything, _wait

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_a_whatif_started_from_the_dashboard_shows_progress_table_and_sentence(tmp_path):
    _need_everything()
    from playwright.sync_api import sync_playwright

    from .test_dashboard_browser import click_tab

    data = tmp_path / "racer-data"
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "racer", "up", "--data-dir", str(data), "--duration", "900", "--dashboard-port",
           "0", "--sample-rate", "1", "--json"]
    err = open(tmp_path / "up.err", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
                                 "RACER_WHATIF_SHARES": "0.2,0.8", "RACER_WHATIF_MAX_SAMPLES": "3000"})
    try:
        dash_url = None
        while time.monotonic() - t0 < 240 and dash_url is None:
            assert proc.poll() is None, (tmp_path / "up.err").read_text()[-3000:]
            for line in (tmp_path / "up.err").read_text().splitlines():
                if line.startswith("racer up: dashboard"):
                    dash_url = line.split()[-1]
            time.sleep(0.5)
        assert dash_url, "racer up printed no dashboard URL"
        token = (data / "operator_token").read_text().strip()
        assert (data / "sample.key").stat().st_mode & 0o777 == 0o600
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            console: list[str] = []
            page.on("console", lambda m: console.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: console.append(f"page error: {e}"))
            page.goto(dash_url)
            page.fill("#login-token", token)
            page.click("#btn-login")
            page.wait_for_selector("#main", state="visible", timeout=60_000)
            # traffic flows: the clients' view is live (the gateway serves, and samples)
            _wait(lambda: "live" in page.inner_text("#cv-state"), t0, 300, "live traffic in the overview")
            time.sleep(20)  # some traffic in the window
            click_tab(page, "What-if")
            page.wait_for_selector("#wi-start", timeout=30_000)
            assert page.is_enabled("#wi-start")
            page.click("#wi-window")
            page.click("text=last 15 min")
            page.click("#wi-start")
            _wait(lambda: "started over" in page.inner_text("#wi-start-msg"), t0, 400, "the what-if started")
            # its progress shows while it runs (the bar and what it is running), and the button waits
            _wait(lambda: "running" in page.inner_text("#wi-progress-note"), t0, 400, "the what-if's progress")
            assert not page.is_enabled("#wi-start")
            page.screenshot(path=str(tmp_path / "whatif-running.png"), full_page=True)
            # done: the sentence, the table and the chart
            _wait(lambda: "On the last" in page.inner_text("#wi-sentence"), t0, 1000, "the what-if's sentence")
            sentence = page.inner_text("#wi-sentence")
            assert "perfect dynamic split" in sentence, sentence
            table = page.inner_text("#wi-table")
            # racer up registers the shipped policy (active) and a candidate: both have a row
            for name in ("static:0.20", "static:0.80", "oracle_lookahead", "active", "candidate"):
                assert name in table, table
            assert "over the look-ahead oracle" in table
            traces = page.evaluate("""() => { const el = document.querySelector('#wi-graph .js-plotly-plot');
                                     return el && el.data ? el.data.map(t => t.name) : null; }""")
            assert traces and "oracle_lookahead" in traces and "static:0.20" in traces, traces
            assert "100%" in page.inner_text("#wi-progress") and page.is_enabled("#wi-start")
            page.screenshot(path=str(tmp_path / "whatif-done.png"), full_page=True)
            browser.close()
        assert not console, console
        # the command line reads the same run
        show = subprocess.run([sys.executable, "-m", "racer", "whatif", "--show", "--data-dir", str(data)],
                              cwd=REPO, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert show.returncode == 0, show.stderr
        assert "static:0.20" in show.stdout and sentence.strip() in show.stdout, show.stdout
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=180)
        err.close()
