"""What clients see, end to end with real processes: a control plane, one `racer node-agent`
reporting to it, a `racer gateway` (router token) reporting its clients' view, `racer dashboard`,
and load through the gateway naming its phase. In headless Chromium the overview leads with the
client-side P99 and SLO attainment beside the nodes' own and the load phase (its bursts shaded on
the clients' chart); the agent is killed
(kill -9): the clients' failures (5xx, 503) and the "no request served" banner appear on the
overview; the gateway stops: a stall of its reports raises the banner."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.dashboard import CHROMIUM, free_port, launch_browser, sign_in, start_control_plane, start_dashboard, stop

from .procs import SMALL_AGENT_ARGS
from .test_node_agent import write_taobao_csv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
sync_api = pytest.importorskip("playwright.sync_api")
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} missing (.ci/run installs Debian's chromium)", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
PHASE = "burst[0-60s]"


def _spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    f = open(log, "ab")
    try:
        return subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})})
    finally:
        f.close()


def _until(pred, timeout_s: float, what: str, poll_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except (httpx.HTTPError, KeyError, IndexError, TypeError) as e:
            last = f"{type(e).__name__}: {e}"
        else:
            if last:
                return last
        time.sleep(poll_s)
    raise AssertionError(f"{what} not seen within {timeout_s:g} s; last: {str(last)[:1500]}")


class Load(threading.Thread):
    """Requests through the gateway at a steady pace, each naming the load phase."""

    def __init__(self, url: str, bodies: list[bytes], rate_rps: float = 25.0):
        super().__init__(daemon=True)
        self.url, self.bodies, self.period = url, bodies, 1.0 / rate_rps
        self.halt = threading.Event()
        self.statuses: list[int] = []

    def run(self) -> None:
        with httpx.Client(timeout=5.0) as c:
            k = 0
            while not self.halt.is_set():
                try:
                    r = c.post(self.url + "/v1/recommend", content=self.bodies[k % len(self.bodies)],
                               headers={"content-type": "application/json", "x-racer-load-phase": PHASE})
                    self.statuses.append(r.status_code)
                except httpx.HTTPError:
                    self.statuses.append(0)
                k += 1
                self.halt.wait(self.period)


def test_clients_view_leads_the_overview_and_shows_a_killed_agents_failures_and_a_stall(tmp_path):
    from bench.gateway import make_bodies

    admin = "racer_test_admin_" + secrets.token_hex(8)
    cp_port, dash_port, agent_port, gw_port = free_port(), free_port(), free_port(), free_port()
    cp_url, gw_url = f"http://127.0.0.1:{cp_port}", f"http://127.0.0.1:{gw_port}"
    csv = write_taobao_csv(tmp_path / "UserBehavior_small.csv")
    procs: dict[str, subprocess.Popen | None] = {}
    load = None
    t0 = time.monotonic()
    try:
        procs["cp"] = start_control_plane(f"sqlite:///{tmp_path / 'cp.db'}", cp_port, admin, tmp_path / "cp.log",
                                          report_interval_s=1.0)
        api = httpx.Client(base_url=cp_url + "/api/v1", headers={"Authorization": f"Bearer {admin}"}, timeout=30)

        def token(role: str, **kw) -> str:
            r = api.post("/tokens", json={"role": role, "name": f"test-{role}", **kw})
            assert r.status_code == 201, r.text
            return r.json()["token"]

        procs["agent"] = _spawn([sys.executable, "-m", "racer", "node-agent", "--port", str(agent_port), "--trace",
                                 "taobao", "--path", str(csv), *SMALL_AGENT_ARGS, "--control-plane", cp_url,
                                 "--token", token("node", node_id="node-1"), "--node-id", "node-1",
                                 "--state-dir", str(tmp_path / "agent-state")], tmp_path / "agent.log")
        _until(lambda: [n for n in api.get("/nodes").json() if n["node_id"] == "node-1"], 120, "the agent registered")
        procs["gw"] = _spawn([sys.executable, "-m", "racer", "gateway", "--control-plane", cp_url, "--port",
                              str(gw_port), "--trace", "taobao", "--path", str(csv), "--gateway-id", "gw-test",
                              "--health-interval-s", "0.3", "--health-timeout-s", "0.3", "--health-failures", "2",
                              "--request-timeout-s", "3", "--slo-ms", "500", "--client-report-interval-s", "1"],
                             tmp_path / "gateway.log", env={"RACER_GATEWAY_TOKEN": token("router")})
        procs["dash"] = start_dashboard(cp_url, dash_port, tmp_path / "dashboard.log", refresh_s=1.0)
        _until(lambda: httpx.get(gw_url + "/healthz", timeout=1).status_code == 200, 60, "the gateway serving")
        load = Load(gw_url, make_bodies("taobao", str(csv), 200, num_candidates=32, max_history_len=128))
        load.start()

        def last_report():
            gws = {g["gateway_id"]: g for g in api.get("/gateways").json()}
            return gws["gw-test"]["last_report"]

        rep = _until(lambda: (lambda r: r if r and r["num_ok"] > 0 else None)(last_report()), 60,
                     "a gateway report with requests served")
        assert rep["load_phase"] == PHASE and rep["p99_ms"] > 0 and rep["details"]["nodes"][0]["node_id"] == "node-1"
        startup_s = time.monotonic() - t0
        console: list[str] = []
        with sync_api.sync_playwright() as p:
            browser = launch_browser(p)
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
            sign_in(page, f"http://127.0.0.1:{dash_port}/", admin)

            def text(cid: str) -> str:
                return page.inner_text(f"#{cid}") if page.query_selector(f"#{cid}") else ""

            def chart(i: int) -> list:  # trace i of the clients' chart: the values drawn (None: a gap)
                return page.evaluate("""(i) => { const el = document.querySelector('#g-clients .js-plotly-plot');
                    return el && el.data && el.data[i] ? Array.from(el.data[i].y) : []; }""", i)

            # the clients' P99 and SLO attainment, with the nodes' own beside them, and the phase
            _until(lambda: "live" in text("cv-state") and "ms" in text("cv-p99") and "%" in text("cv-slo")
                   and "ms" in text("nv-p99") and "%" in text("nv-slo"), 60, "client-side and node figures")
            assert PHASE in text("cv-phase")
            _until(lambda: "node-1" in text("cv-nodes") and "ms" in text("cv-nodes"), 30,
                   "node-1's queueing before the node")
            _until(lambda: any(v is not None and v > 0 for v in chart(0)), 30, "the clients' P99 in the chart")
            _until(lambda: page.evaluate("""() => { const el = document.querySelector('#g-clients .js-plotly-plot');
                return (el.layout.shapes || []).filter(s => s.name === 'load_burst').length; }"""), 30,
                   "the load's burst phase shaded in the chart")
            box_c, box_n = page.locator("#cv-p99").bounding_box(), page.locator("#nv-p99").bounding_box()
            assert box_c and box_n and abs(box_c["x"] - box_n["x"]) < 200  # in the same card
            assert not page.locator("#client-banner").is_visible()
            page.screenshot(path=str(tmp_path / "clients-live.png"), full_page=True)

            # kill -9 the only agent: the clients get 502 then 503 (no live node); the overview says so
            procs["agent"].send_signal(signal.SIGKILL)
            procs["agent"].wait(10)
            _until(lambda: "failing" in text("cv-state") and text("cv-503") not in ("", "–", "0"), 60,
                   "the clients' failures on the overview")
            banner = page.inner_text("#client-banner")
            assert "no request served" in banner and "503" in banner, banner
            assert int(text("cv-errors")) >= int(text("cv-503")) > 0
            assert text("cv-p99") == "–"  # nothing served: a gap, not 0 ms
            _until(lambda: any(v is not None and v > 0 for v in chart(1)), 30, "failed requests in the chart")
            row = page.inner_text("#cv-nodes-tbl tbody tr")
            assert row.split("\t")[:2] == ["node-1", "no"], row  # out of the gateway's rotation
            page.screenshot(path=str(tmp_path / "clients-failing.png"), full_page=True)
            rep = last_report()
            assert rep["num_ok"] == 0 and rep["num_503"] > 0 and rep["slo_attainment"] == 0.0

            # the gateway stops: no report for more than one interval raises the stall banner
            load.halt.set()
            stop(procs["gw"])
            _until(lambda: "stalled" in page.inner_text("#client-banner") and "gw-test" in
                   page.inner_text("#client-banner"), 30, "the stall banner")
            assert "stalled" in text("cv-state") and text("cv-p99") == "–"
            page.screenshot(path=str(tmp_path / "clients-stalled.png"), full_page=True)
            browser.close()
        mine = [m for m in console if any(k in m for k in ("cv-", "nv-", "client-banner", "client_cards"))]
        assert not mine, mine
        print(f"clients view: start-up {startup_s:.1f} s, whole test {time.monotonic() - t0:.1f} s, "
              f"{len(load.statuses)} requests, statuses {sorted(set(load.statuses))}")
    finally:
        if load is not None:
            load.halt.set()
        for name in ("dash", "gw", "agent", "cp"):
            stop(procs.get(name))
