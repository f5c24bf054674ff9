"""A multi-host fleet on one machine: the control plane, the gateway and two node agents, each in
its own Linux network namespace (tests/netns.py), talking only over real HTTP on 10.77.0.0/24.

Wiring: a namespace ``racermh-lan`` holds a bridge; ``racermh-cp`` (10.77.0.2), ``racermh-gw``
(10.77.0.3), ``racermh-a0`` (10.77.0.10) and ``racermh-a1`` (10.77.0.11) each have an ``eth0``
(a veth pair whose other end is a port of that bridge), and the root namespace, where the test
itself runs, joins through ``racermh-h`` (10.77.0.1). No namespace has a route anywhere else and
IPv6 is off on the segment. Every host's ``/etc/hosts`` (``/etc/netns/<ns>/hosts``) names the
control plane ``racer-control-plane``, as the chart's Service does in a cluster.

The processes are started as the Helm chart starts them (deploy/helm/racer/templates, emulated
agents): ``racer control-plane --host 0.0.0.0 --port 8600`` with ``RACER_DATABASE_URL``,
``RACER_ADMIN_TOKEN``, ``RACER_SECRET_KEY`` and settings as ``RACER_<NAME>``; ``racer gateway
--control-plane http://racer-control-plane:8600 --host 0.0.0.0 --port 8000 --router racer --trace
synthetic --advertise-url http://<its IP>:8000`` with ``RACER_GATEWAY_TOKEN`` (a router token made
by ``racer token create`` in the control plane's namespace, as docs/deploy.md does with ``kubectl
exec``) and ``RACER_FLEET_TOKEN``; ``racer node-agent --host 0.0.0.0 --port 8100 --trace synthetic
--emulate a100-hstu --time-scale 2 --control-plane ... --node-id racer-node-agent-K --token-file
<dir>/racer-node-agent-K --advertise-url http://<its IP>:8100 --state-dir ...`` (plus small
``extraArgs``) with ``RACER_FLEET_TOKEN``. Every process binds 0.0.0.0, so the fleet token is
required (common/secrets_args.py).

What it shows, in order (one fleet for the module; a client thread sends requests to the gateway
throughout): a request flows through the gateway to an agent; both nodes' reports are stored;
an override reaches its node's allocator; a policy rollout (shipped policy active, a derived
candidate on a canary, promoted by hand) ends with every node reporting the candidate; one
agent's cable pulled for 8 s while it serves requests from inside its namespace loses no report
(every seq 0..last stored once); the control plane's cable pulled for 8 s loses no report of
either node while the gateway keeps answering.

Needs root (network namespaces) and iproute2; skipped without them (without ``ip`` it fails under
``RACER_CI_STRICT=1``). About 45 s on a 2-core VM.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from . import netns
from .conftest import REPO
from .procs import skip_or_fail, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PREFIX = "racermh"
HOSTS = {"cp": 2, "gw": 3, "a0": 10, "a1": 11}
AGENTS = {"a0": "racer-node-agent-0", "a1": "racer-node-agent-1"}  # host -> node id (the pod names)
CP_NAME = "racer-control-plane"  # the chart's Service name with the release named "racer"
CP_PORT, GW_PORT, AGENT_PORT = 8600, 8000, 8100  # the chart's ports
INTERVAL_S = 0.5  # the control plane's report_interval_s, and the agents' control interval
# the chart's controlPlane.settings, as the container gets them (RACER_<NAME>); fast jobs for a test
CP_SETTINGS = {"report_interval_s": INTERVAL_S, "override_period_s": 0.5, "rollout_period_s": 0.5,
               "liveness_period_s": 0.5, "weights_period_s": 1, "leader_poll_s": 0.5}
# nodeAgent.emulated {profile, timeScale} and nodeAgent.extraArgs
EMULATED = ["--emulate", "a100-hstu", "--time-scale", "2"]
AGENT_EXTRA = ["--num-pages", "64", "--control-interval-s", str(INTERVAL_S)]
ADMIN = "racer_mh_admin_" + secrets.token_hex(12)
FLEET = "racer_mh_fleet_" + secrets.token_hex(12)
SECRET_KEY = secrets.token_hex(32)


def _skip_reason() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    return netns.unavailable(PREFIX)


def racer_argv(*args: str) -> list[str]:
    """``racer ARGS``, the console script the chart's containers run (``python -m racer`` without one)."""
    exe = Path(sys.executable).with_name("racer")
    return [str(exe), *args] if exe.exists() else [sys.executable, "-m", "racer", *args]


def base_env() -> dict:
    """This process's environment without RACER_* settings or proxies: each process gets only
    what the chart gives it."""
    drop = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RACER_") and k.lower() not in drop}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    return env


def client(base: str, token: str | None = None, timeout_s: float = 10.0) -> httpx.Client:
    h = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=base, headers=h, timeout=timeout_s, trust_env=False)


def wait_for(pred, timeout_s: float, what: str, step_s: float = 0.25, detail=None):
    """Poll ``pred`` until truthy (transport errors count as not yet); AssertionError naming
    ``what`` and ``detail()`` otherwise."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except (httpx.HTTPError, ValueError, KeyError) as e:
            last = f"{type(e).__name__}: {e}"
        else:
            if last:
                return last
        time.sleep(step_s)
    extra = f"\n{detail()}" if detail else ""
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last: {str(last)[:1500]}{extra}")


class Traffic:
    """POST /v1/recommend to the gateway from the root namespace, ``rate_rps`` a second, each
    outcome kept as (wall time, status or error, served_by)."""

    def __init__(self, base: str, rate_rps: float = 4.0):
        self.base, self.rate = base, rate_rps
        self.results: list[tuple[float, object, str | None]] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="multihost-traffic")

    def _run(self) -> None:
        i = 0
        with client(self.base, timeout_s=15.0) as c:
            while not self._stop.is_set():
                i += 1
                body = {"user_id": i % 23, "history": [(i * 7 + k * 13) % 5000 for k in range(16 + i % 24)],
                        "new_items": [(i * 11) % 5000], "num_candidates": 16, "top_k": 3}
                t = time.time()
                try:
                    r = c.post("/v1/recommend", json=body)
                    self.results.append((t, r.status_code, r.headers.get("x-racer-served-by")))
                except httpx.HTTPError as e:
                    self.results.append((t, f"{type(e).__name__}: {e}", None))
                self._stop.wait(1.0 / self.rate)

    def between(self, t0: float, t1: float) -> list:
        return [r for r in list(self.results) if t0 <= r[0] <= t1]

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(30)


class Fleet:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.lan = netns.Lan(PREFIX, HOSTS, names={CP_NAME: "cp"})
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.cp_url = f"http://{self.lan.addr('cp')}:{CP_PORT}"  # from the root namespace
        self.gw_url = f"http://{self.lan.addr('gw')}:{GW_PORT}"
        self.agent_url = {h: f"http://{self.lan.addr(h)}:{AGENT_PORT}" for h in AGENTS}
        self.db_url = f"sqlite:///{tmp / 'control-plane' / 'racer-control-plane.db'}"
        self.traffic: Traffic | None = None

    # ---- processes
    def spawn(self, name: str, host: str, argv: list[str], env: dict) -> subprocess.Popen:
        """``argv`` in ``host``'s namespace (its own process group), output to ``<name>.log``."""
        log = self.tmp / f"{name}.log"
        self.logs[name] = log
        with open(log, "ab") as out:
            p = subprocess.Popen(self.lan.exec_argv(host, argv), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True, env={**base_env(), **env})
        self.procs[name] = p
        return p

    def tails(self, n: int = 1500) -> str:
        return "\n".join(f"--- {k} (exit {self.procs[k].poll()}):\n{p.read_text(errors='replace')[-n:]}"
                         for k, p in self.logs.items() if p.exists())

    def wait_healthy(self, name: str, url: str, timeout_s: float = 120.0) -> dict:
        p = self.procs[name]

        def ok():
            assert p.poll() is None, f"{name} exited with {p.returncode}:\n{self.tails()}"
            with client(url, timeout_s=2.0) as c:
                r = c.get("/healthz")
                return r.json() if r.status_code == 200 else None
        return wait_for(ok, timeout_s, f"{name}'s /healthz at {url}", detail=self.tails)

    def api(self) -> httpx.Client:
        return client(f"{self.cp_url}/api/v1", ADMIN, timeout_s=60.0)

    def in_cp(self, *args: str) -> str:
        """``racer ARGS`` in the control plane's namespace with its database (``kubectl exec``)."""
        r = subprocess.run(self.lan.exec_argv("cp", racer_argv(*args)), cwd=REPO, capture_output=True, text=True,
                           timeout=120, env={**base_env(), "RACER_DATABASE_URL": self.db_url})
        assert r.returncode == 0, f"racer {' '.join(args)}: exit {r.returncode}: {r.stderr[-2000:]}"
        return r.stdout

    def start(self) -> None:
        self.lan.up()
        (self.tmp / "control-plane").mkdir()
        cp_env = {"RACER_DATABASE_URL": self.db_url, "RACER_ADMIN_TOKEN": ADMIN, "RACER_SECRET_KEY": SECRET_KEY,
                  **{f"RACER_{k.upper()}": str(v) for k, v in CP_SETTINGS.items()}}
        self.spawn("control-plane", "cp", racer_argv("control-plane", "--host", "0.0.0.0", "--port", str(CP_PORT),
                                                      "--log-level", "warning"), cp_env)
        self.wait_healthy("control-plane", self.cp_url, 90)
        # the tokens, from the control plane's own command line in its namespace (docs/deploy.md)
        router_token = self.in_cp("token", "create", "--role", "router", "--name", "gateways").strip()
        ids = list(AGENTS.values())
        node_tokens = self.in_cp("token", "create", "--role", "node",
                                 *[a for i in ids for a in ("--node-id", i)]).split()
        assert len(node_tokens) == len(ids) and router_token, "racer token create printed no tokens"
        token_dir = self.tmp / "node-tokens"  # the node-token Secret's mount: one file per node id
        token_dir.mkdir(mode=0o700)
        for node_id, tok in zip(ids, node_tokens):
            (token_dir / node_id).write_text(tok + "\n")
            (token_dir / node_id).chmod(0o400)
        cp_service = f"http://{CP_NAME}:{CP_PORT}"
        for host, node_id in AGENTS.items():
            argv = racer_argv("node-agent", "--host", "0.0.0.0", "--port", str(AGENT_PORT), "--trace", "synthetic",
                              *EMULATED, "--control-plane", cp_service, "--node-id", node_id,
                              "--token-file", str(token_dir / node_id),
                              "--advertise-url", f"http://{self.lan.addr(host)}:{AGENT_PORT}",
                              "--state-dir", str(self.tmp / "state" / node_id), "--log-level", "warning",
                              *AGENT_EXTRA)
            self.spawn(host, host, argv, {"RACER_FLEET_TOKEN": FLEET})
        self.spawn("gateway", "gw", racer_argv(
            "gateway", "--control-plane", cp_service, "--host", "0.0.0.0", "--port", str(GW_PORT),
            "--router", "racer", "--trace", "synthetic", "--advertise-url", f"{self.gw_url}",
            "--log-level", "warning"), {"RACER_GATEWAY_TOKEN": router_token, "RACER_FLEET_TOKEN": FLEET})
        for host in AGENTS:
            self.wait_healthy(host, self.agent_url[host], 150)
        self.wait_healthy("gateway", self.gw_url, 90)  # 200 once an agent is live in its view
        self.traffic = Traffic(self.gw_url)
        self.traffic.start()

    def close(self) -> None:
        if self.traffic is not None:
            self.traffic.stop()
        for name in ("gateway", *AGENTS, "control-plane"):
            if name in self.procs:
                stop(self.procs[name], 15)
        self.lan.down()

    # ---- views
    def agent_metrics(self, host: str) -> dict:
        with client(self.agent_url[host]) as c:
            return c.get("/v1/metrics").json()

    def nodes(self, api: httpx.Client) -> dict[str, dict]:
        r = api.get("/nodes")
        assert r.status_code == 200, r.text
        return {n["node_id"]: n for n in r.json()}

    def reports(self, api: httpx.Client, node_id: str) -> list[dict]:
        r = api.get("/reports", params={"node_id": node_id, "limit": 100_000, "start_s": time.time() - 3600})
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    why = _skip_reason()
    if why is not None:
        if "not installed" in why:
            skip_or_fail(why)  # a missing package: CI must provide it
        pytest.skip(why)  # no privilege for namespaces: not a missing piece
    import fcntl

    lock = open("/tmp/racer-multihost-test.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pytest.skip("another run of tests/test_multihost.py holds its namespaces (/tmp/racer-multihost-test.lock)")
    f = Fleet(tmp_path_factory.mktemp("multihost"))
    t0 = time.monotonic()
    try:
        f.start()
        print(f"\nmultihost: fleet up in {time.monotonic() - t0:.1f} s (logs in {f.tmp})")
        yield f
    finally:
        f.close()
        lock.close()


def assert_all_seqs(api: httpx.Client, fleet: Fleet, node_id: str) -> list[int]:
    """Every report seq of ``node_id`` from 0 to the last stored once; returns them."""
    seqs = [r["seq"] for r in fleet.reports(api, node_id)]
    assert seqs, f"no report of {node_id}"
    assert len(seqs) == len(set(seqs)), f"{node_id}: a report stored twice"
    missing = sorted(set(range(max(seqs) + 1)) - set(seqs))
    assert not missing, f"{node_id}: reports lost, seqs {missing[:50]} missing of 0..{max(seqs)}"
    return sorted(seqs)


def report_period_s(api: httpx.Client, fleet: Fleet, node_id: str) -> float:
    """The wall seconds between ``node_id``'s stored reports (median of its last 10 gaps): an
    emulated agent's control interval is in modelled seconds, ``--time-scale`` wall seconds each."""
    ts = [r["ts_s"] for r in fleet.reports(api, node_id)][-11:]
    gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
    assert gaps, f"too few reports of {node_id}"
    return gaps[len(gaps) // 2]


def test_a_request_flows_from_the_root_namespace_through_the_gateway_to_an_agent(fleet):
    served = set()
    with client(fleet.gw_url, timeout_s=30.0) as c:
        for u in range(12):
            r = c.post("/v1/recommend", json={"user_id": 1000 + u, "history": list(range(u, u + 30)),
                                              "num_candidates": 16, "top_k": 3})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["served_by"] in AGENTS.values() and r.headers["x-racer-served-by"] == body["served_by"]
            served.add(body["served_by"])
        # the gateway knows the agents by the addresses they advertised, from the control plane
        view = c.get("/v1/router", headers={"Authorization": f"Bearer {FLEET}"})
        assert view.status_code == 200, view.text
        assert c.get("/v1/router").status_code == 401  # bound beyond loopback: the fleet token guards it
    text = view.text
    for host in AGENTS:
        assert fleet.agent_url[host] in text, text[:2000]
    # the agent itself answers over its namespace address, and its residency feed wants the fleet token
    with client(fleet.agent_url["a0"]) as c:
        assert c.get("/v1/residency").status_code == 401
    print(f"multihost: 12 requests through the gateway, served by {sorted(served)}")


def test_both_nodes_report_to_the_control_plane(fleet):
    with fleet.api() as api:
        def both():
            nodes = fleet.nodes(api)
            return all(i in nodes and nodes[i]["status"] == "up" and (nodes[i]["last_report_seq"] or 0) >= 4
                       for i in AGENTS.values()) and nodes
        nodes = wait_for(both, 60, "both nodes up with 5 reports stored")
        for host, node_id in AGENTS.items():
            n = nodes[node_id]
            assert n["address"] == fleet.agent_url[host] and n["device_mode"] == "emulated", n
            rows = fleet.reports(api, node_id)
            assert len(rows) >= 5 and all(r["device_mode"] == "emulated" for r in rows), rows[-2:]
        # the client thread's requests show in the stored reports
        wait_for(lambda: sum((r["num_requests"] or 0) for i in AGENTS.values() for r in fleet.reports(api, i)) > 0,
                 30, "a stored report counting requests")
        # the gateway reached the control plane too: it registered (advertised) for weight pushes
        r = api.get("/routers")
        assert r.status_code == 200 and fleet.gw_url in r.text, r.text[:1000]


def test_an_override_reaches_its_node_and_only_it(fleet):
    host, node_id = "a1", AGENTS["a1"]
    with fleet.api() as api:
        r = api.post("/overrides", json={"node_id": node_id, "emb_share": 0.3, "ttl_s": 120,
                                         "reason": "multihost test: pin a1's split"})
        assert r.status_code == 201, r.text
        ov = r.json()

        def applied():
            m = fleet.agent_metrics(host)
            o = m.get("control_plane", {}).get("override")
            dec = m["allocator"].get("last_decision") or {}
            return (o and o.get("applied") and o.get("override_id") == ov["id"] and dec.get("source") == "override"
                    and m) or None
        m = wait_for(applied, 20, f"override {ov['id']} applied on {node_id}",
                     detail=lambda: fleet.agent_metrics(host).get("control_plane"))
        assert m["control_plane"]["override"]["emb_share"] == pytest.approx(0.3)
        assert m["allocator"]["last_decision"]["emb_share"] == pytest.approx(0.3)
        wait_for(lambda: abs(fleet.agent_metrics(host)["target_emb_share"] - 0.3) <= 1.0 / 64, 10,
                 "the arena's target split at the override")
        other = fleet.agent_metrics("a0")
        assert other["control_plane"]["override"] is None, other["control_plane"]
        # cleared (a rollout leaves a pinned node out): it leaves the agent too
        r = api.post(f"/overrides/{ov['id']}/clear", json={"reason": "multihost test: done"})
        assert r.status_code == 200, r.text
        wait_for(lambda: fleet.agent_metrics(host)["control_plane"]["override"] is None, 20, "the override cleared")


def test_a_policy_rollout_reaches_every_node(fleet, tmp_path):
    from racer.policy_seed import derive_candidate, upload

    shipped_dir = REPO / "policies" / "default"
    with fleet.api() as api:
        api_url = f"{fleet.cp_url}/api/v1"
        shipped, _ = upload(api_url, ADMIN, shipped_dir)
        r = api.post(f"/policies/{shipped}/activate", json={"reason": "multihost test: the baseline"})
        assert r.status_code == 200, r.text
        ids = list(AGENTS.values())

        def on(version):
            def check():
                nodes = fleet.nodes(api)
                return all(nodes[i]["policy_version"] == version and nodes[i]["policy_error"] is None for i in ids)
            return check
        wait_for(on(shipped), 60, f"every node confirming the active policy {shipped}",
                 detail=lambda: {i: (n["policy_version"], n["policy_error"]) for i, n in fleet.nodes(api).items()})
        candidate = derive_candidate(shipped_dir, tmp_path / "candidate")["policy_id"]
        cand_version, status = upload(api_url, ADMIN, tmp_path / "candidate")
        assert status == "registered" and cand_version != shipped, (cand_version, status, candidate)
        r = api.post("/rollouts", json={"policy_version": cand_version, "canary_fraction": 0.5, "bake_time_s": 1.0,
                                        "min_samples": 3, "auto": False, "reason": "multihost test: a canary"})
        assert r.status_code == 201, r.text
        ro = r.json()
        roles = {n["node_id"]: n["role"] for n in ro["nodes"]}
        assert sorted(roles.values()) == ["baseline", "canary"], ro["nodes"]
        canary = next(i for i, role in roles.items() if role == "canary")
        baseline = next(i for i, role in roles.items() if role == "baseline")
        baking = wait_for(lambda: (x := api.get(f"/rollouts/{ro['id']}").json())["state"] == "baking" and x, 60,
                          "the canary confirming the candidate (state baking)",
                          detail=lambda: api.get(f"/rollouts/{ro['id']}").json())
        nodes = fleet.nodes(api)
        assert nodes[canary]["policy_version"] == cand_version and nodes[baseline]["policy_version"] == shipped
        r = api.post(f"/rollouts/{ro['id']}/promote", json={"reason": "multihost test: promote by hand"})
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "promoted", r.json()
        wait_for(on(cand_version), 60, f"every node confirming the promoted {cand_version}",
                 detail=lambda: {i: (n["policy_version"], n["policy_error"]) for i, n in fleet.nodes(api).items()})
        # ... and reporting windows run on it
        wait_for(lambda: all(fleet.reports(api, i)[-1]["policy_version"] == cand_version for i in ids), 30,
                 "each node's newest report naming the candidate")
        assert api.get(f"/policies/{cand_version}").json()["status"] == "active"
    for host in AGENTS:
        assert fleet.agent_metrics(host)["control_plane"]["policy_version"] == cand_version
    print(f"multihost: rollout {ro['id']} of {cand_version} (canary {canary}) baking after "
          f"{baking['bake_started_s'] - ro['created_at_s']:.1f} s, promoted; every node runs it")


# served inside a namespace on its loopback: the agent keeps serving while its cable is out
LOCAL_LOAD = """
import sys, time, httpx
ok = 0; end = time.time() + float(sys.argv[1])
with httpx.Client(base_url="http://127.0.0.1:%d", timeout=10, trust_env=False) as c:
    while time.time() < end:
        r = c.post("/v1/recommend", json={"user_id": ok %% 7, "history": list(range(ok %% 50, ok %% 50 + 20)),
                                          "num_candidates": 16, "top_k": 3})
        ok += r.status_code == 200
        time.sleep(0.1)
    st = c.get("/v1/metrics").json()["control_plane"]
print(ok, st["num_buffered"], st["connected"], st["num_dropped"])
""" % AGENT_PORT


def test_an_agent_whose_link_goes_down_loses_no_report(fleet):
    host, node_id = "a1", AGENTS["a1"]
    down_s = 8.0
    with fleet.api() as api:
        wait_for(lambda: fleet.agent_metrics(host)["control_plane"]["num_buffered"] == 0, 20, "an empty spool")
        before = fleet.nodes(api)[node_id]["last_report_seq"]
        period = report_period_s(api, fleet, node_id)
        expected = int(0.6 * down_s / period)  # reports made while cut off, with a margin
        t_down = time.time()
        fleet.lan.set_link(host, False)
        try:
            # requests to the agent from inside its namespace while its cable is out
            local = subprocess.Popen(fleet.lan.exec_argv(host, [sys.executable, "-c", LOCAL_LOAD, str(down_s)]),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base_env())
            # the gateway, whose health checks took the agent out of rotation, sends all to a0
            time.sleep(5.0)
            via_gw = []
            with client(fleet.gw_url, timeout_s=15.0) as c:
                for u in range(6):
                    r = c.post("/v1/recommend", json={"user_id": 2000 + u, "history": list(range(u, u + 20)),
                                                      "num_candidates": 16, "top_k": 3})
                    via_gw.append((r.status_code, r.headers.get("x-racer-served-by")))
            out, err = local.communicate(timeout=down_s + 30)
            assert local.returncode == 0, err[-2000:]
            served_local, buffered, connected, dropped = out.split()
            # the control plane saw nothing of it meanwhile
            during = fleet.nodes(api)[node_id]["last_report_seq"]
        finally:
            fleet.lan.set_link(host, True)
        t_up = time.time()
        assert int(served_local) > 10, out
        assert int(buffered) >= expected and connected == "False" and dropped == "0", out
        assert via_gw == [(200, AGENTS["a0"])] * len(via_gw), via_gw
        assert during <= before + 2, (before, during)  # at most what was in flight when the cable went
        wait_for(lambda: fleet.agent_metrics(host)["control_plane"]["num_buffered"] == 0, 60,
                 "the spool sent after the link came back",
                 detail=lambda: fleet.agent_metrics(host)["control_plane"])
        wait_for(lambda: fleet.nodes(api)[node_id]["status"] == "up", 20, "the node up again")
        seqs = assert_all_seqs(api, fleet, node_id)
        rows = fleet.reports(api, node_id)
    in_outage = [x for x in rows if t_down + period < x["ts_s"] < t_up - period]
    assert len(in_outage) >= expected - 2, ([x["seq"] for x in in_outage], period)
    assert sum(x["num_requests"] or 0 for x in in_outage) > 0  # the requests it served while cut off
    print(f"multihost: {node_id} cut off {t_up - t_down:.1f} s: {served_local} requests served locally, "
          f"{buffered} reports spooled (one per {period:.2f} s), stored 0..{seqs[-1]} with no gap "
          f"({len(in_outage)} from the outage); "
          f"the gateway sent its requests to {AGENTS['a0']} meanwhile; "
          f"client thread meanwhile: {[x[1:] for x in fleet.traffic.between(t_down, t_up)]}")


def test_the_control_planes_link_going_down_loses_no_report(fleet):
    # longer than the agents' 5 s HTTP timeout: a reporter spools its queued reports to disk only
    # between send attempts, so a shorter outage leaves them in its memory queue (still not lost)
    down_s = 8.0
    with fleet.api() as api:
        for host in AGENTS:
            wait_for(lambda: fleet.agent_metrics(host)["control_plane"]["num_buffered"] == 0, 30, "empty spools")
        period = max(report_period_s(api, fleet, i) for i in AGENTS.values())
        t_down = time.time()
        fleet.lan.set_link("cp", False)
        peak = {h: 0 for h in AGENTS}
        try:
            while time.time() - t_down < down_s:
                for h in AGENTS:
                    peak[h] = max(peak[h], fleet.agent_metrics(h)["control_plane"]["num_buffered"])
                time.sleep(0.25)
        finally:
            fleet.lan.set_link("cp", True)
        t_up = time.time()
        for h in AGENTS:
            wait_for(lambda: fleet.agent_metrics(h)["control_plane"]["num_buffered"] == 0, 60,
                     f"{h}'s spool sent after the control plane came back",
                     detail=lambda: fleet.agent_metrics(h)["control_plane"])
        seqs = {i: assert_all_seqs(api, fleet, i) for i in AGENTS.values()}
        in_outage = {i: [x["seq"] for x in fleet.reports(api, i) if t_down + period < x["ts_s"] < t_up - period]
                     for i in AGENTS.values()}
    assert all(v >= 1 for v in peak.values()), (peak, period)  # spooled on disk while it was out
    assert all(len(v) >= int(0.6 * down_s / period) - 2 for v in in_outage.values()), (in_outage, period)
    # the gateway kept routing with the node list it held
    during = fleet.traffic.between(t_down + 1, t_up)
    assert during and all(x[1] == 200 for x in during), during[-10:]
    print(f"multihost: control plane cut off {t_up - t_down:.1f} s: peak spooled {peak}; stored "
          f"{ {i: f'0..{s[-1]}' for i, s in seqs.items()} } with no gap "
          f"({ {i: len(v) for i, v in in_outage.items()} } made during the outage); "
          f"{len(during)} gateway requests answered 200")
