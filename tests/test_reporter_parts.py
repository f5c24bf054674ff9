"""The reporter's parts without a control plane: the on-disk spool (sequence numbers, bound,
restart), artifact unpacking, the registration cost profile, and policy directives served by a
real HTTP server (digest mismatch and unloadable artifacts keep the old policy)."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import tarfile
import threading
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from node_agent.downloads import unpack_artifact
from node_agent.registration import cost_profile
from node_agent.reporter import Reporter, ReporterConfig
from node_agent.spool import ReportSpool

REPO = Path(__file__).resolve().parents[1]


def export_constant_policy(out_dir: Path, emb_share: float) -> Path:
    """A policy artifact of the current feature schema that always proposes ``emb_share``."""
    import math

    import torch

    from policies.actor import make_initial_actor
    from policies.export import export_actor

    actor = make_initial_actor(0)
    with torch.no_grad():
        actor.head.weight.zero_()
        actor.head.bias.fill_(math.log(emb_share / (1 - emb_share)))
    export_actor(actor, out_dir)
    return Path(out_dir)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    return export_constant_policy(tmp_path_factory.mktemp("policy") / "p06", 0.6)


def test_spool_numbers_reports_in_order_and_survives_a_restart(tmp_path):
    sp = ReportSpool(tmp_path, max_reports=10)
    assert [sp.append({"x": i}) for i in range(4)] == [0, 1, 2, 3]
    assert [r["seq"] for r in sp.peek(3)] == [0, 1, 2] and [r["x"] for r in sp.peek(2)] == [0, 1]
    sp.remove([0, 1])
    again = ReportSpool(tmp_path, max_reports=10)  # a restarted agent
    assert len(again) == 2 and [r["seq"] for r in again.peek(10)] == [2, 3]
    assert again.append({"x": 9}) == 4  # never reuses a number
    again.remove([2, 3, 4])
    third = ReportSpool(tmp_path, max_reports=10)
    assert len(third) == 0 and third.append({}) == 5  # the counter survives an empty spool


def test_spool_is_bounded_dropping_the_oldest_and_counting(tmp_path):
    sp = ReportSpool(tmp_path, max_reports=3)
    for i in range(7):
        sp.append({"x": i})
    assert [r["seq"] for r in sp.peek(10)] == [4, 5, 6] and sp.num_dropped == 4
    assert sorted(p.name for p in (tmp_path / "spool").iterdir()) == ["0000000004.json", "0000000005.json",
                                                                     "0000000006.json"]
    assert ReportSpool(tmp_path, max_reports=2).num_dropped == 5  # a smaller bound at restart drops one more
    sp2 = ReportSpool(tmp_path, max_reports=2)
    assert [r["seq"] for r in sp2.peek(10)] == [5, 6]


def test_spool_raises_the_counter_past_what_the_control_plane_has(tmp_path):
    sp = ReportSpool(tmp_path, max_reports=5)
    sp.raise_next_seq(100)
    assert sp.append({}) == 100
    sp.raise_next_seq(50)
    assert sp.append({}) == 101


def test_unreadable_spooled_report_is_dropped_and_counted(tmp_path):
    sp = ReportSpool(tmp_path, max_reports=5)
    sp.append({"x": 1})
    sp.append({"x": 2})
    (tmp_path / "spool" / "0000000000.json").write_text("{not json")
    assert [r["seq"] for r in sp.peek(5)] == [1] and sp.num_dropped == 1


def _break_the_disk(spool_dir: Path) -> None:
    """Make every write under ``spool_dir`` fail, for root too: the spool folder becomes a file."""
    import shutil

    shutil.rmtree(spool_dir)
    spool_dir.write_text("not a folder")


def test_a_report_the_disk_refuses_is_kept_in_memory_and_sent_in_order(tmp_path):
    sp = ReportSpool(tmp_path, max_reports=100, max_memory_reports=3)
    assert [sp.append({"x": i}) for i in range(2)] == [0, 1]
    _break_the_disk(tmp_path / "spool")
    assert [sp.append({"x": i}) for i in range(2, 4)] == [2, 3]
    assert len(sp) == 4 and sp.num_in_memory == 2 and sp.num_unspooled == 2 and sp.num_dropped == 0
    assert sp.disk_error and "spool report 3" in sp.disk_error  # the last refusal
    # disk and memory in one order; the disk's are unreadable now: dropped and counted
    assert [r["seq"] for r in sp.peek(10)] == [2, 3] and sp.num_dropped == 2
    sp.remove([2])
    assert [r["x"] for r in sp.peek(10)] == [3] and len(sp) == 1


def test_the_in_memory_part_is_bounded_dropping_the_oldest_and_counting(tmp_path):
    sp = ReportSpool(tmp_path, max_reports=100, max_memory_reports=3)
    _break_the_disk(tmp_path / "spool")
    for i in range(7):
        sp.append({"x": i})
    assert [r["seq"] for r in sp.peek(10)] == [4, 5, 6] and sp.num_dropped == 4 and sp.num_unspooled == 7


def test_the_disk_writable_again_is_used_again(tmp_path):
    sp = ReportSpool(tmp_path, max_reports=100, max_memory_reports=10)
    _break_the_disk(tmp_path / "spool")
    sp.append({"x": 0})
    (tmp_path / "spool").unlink()
    (tmp_path / "spool").mkdir()
    sp.append({"x": 1})
    assert sp.disk_error is None and sp.num_in_memory == 1 and (tmp_path / "spool" / "0000000001.json").exists()
    assert [r["seq"] for r in sp.peek(10)] == [0, 1]


def test_a_spool_folder_that_cannot_be_created_still_takes_reports(tmp_path):
    (tmp_path / "state").write_text("a file where the state folder should be")
    sp = ReportSpool(tmp_path / "state", max_reports=10, max_memory_reports=5)
    assert sp.disk_error is not None and sp.append({"x": 1}) == 0 and sp.num_in_memory == 1


def _tar(files: dict[str, bytes], top: str | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}/{name}" if top else name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_unpack_artifact_accepts_tar_targz_zip_and_one_top_folder(tmp_path, policy_dir):
    files = {"manifest.json": b"{}", "policy.onnx": b"onnx", "golden.npz": b"npz"}
    for i, blob in enumerate([_tar(files), _tar(files, top="art")]):
        unpack_artifact(blob, tmp_path / str(i))
        assert {p.name: p.read_bytes() for p in (tmp_path / str(i)).iterdir()} == files
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
    unpack_artifact(zbuf.getvalue(), tmp_path / "z")
    assert (tmp_path / "z" / "policy.onnx").read_bytes() == b"onnx"
    # a plain tar whose last member is a zip (golden.npz is one) is still a tar
    real = {n: (policy_dir / n).read_bytes() for n in ("manifest.json", "policy.onnx", "golden.npz")}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name in ("manifest.json", "policy.onnx", "golden.npz"):
            info = tarfile.TarInfo(name)
            info.size = len(real[name])
            t.addfile(info, io.BytesIO(real[name]))
    assert zipfile.is_zipfile(io.BytesIO(buf.getvalue()))
    unpack_artifact(buf.getvalue(), tmp_path / "t")
    assert {p.name: p.read_bytes() for p in (tmp_path / "t").iterdir()} == real


@pytest.mark.parametrize("name", ["../evil", "/abs/evil"])
def test_unpack_artifact_refuses_paths_that_leave_it(tmp_path, name):
    with pytest.raises(RuntimeError, match="leaves the artifact"):
        unpack_artifact(_tar({name: b"x", "policy.onnx": b"y"}), tmp_path / "d")
    with pytest.raises(RuntimeError, match="neither a zip nor a tar"):
        unpack_artifact(b"garbage", tmp_path / "e")


def _tar_with(kind: bytes, name: str = "policy.onnx") -> bytes:
    """A tar holding one member of tar type ``kind`` (a link, a fifo) beside manifest.json."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        info = tarfile.TarInfo("manifest.json")
        info.size = 2
        t.addfile(info, io.BytesIO(b"{}"))
        odd = tarfile.TarInfo(name)
        odd.type, odd.linkname = kind, "/etc/passwd"
        t.addfile(odd)
    return buf.getvalue()


def test_unpack_artifact_keeps_its_bounds_and_refuses_links_and_special_files(tmp_path):
    many = {f"f{i}.bin": b"x" for i in range(5)}
    unpack_artifact(_tar(many), tmp_path / "ok", max_members=5)
    with pytest.raises(RuntimeError, match="more than 4 members"):
        unpack_artifact(_tar(many), tmp_path / "count", max_members=4)
    big = {"policy.onnx": b"x" * 600, "golden.npz": b"y" * 500}
    with pytest.raises(RuntimeError, match="more than 1000 bytes"):
        unpack_artifact(_tar(big), tmp_path / "size", max_bytes=1000)
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("policy.onnx", b"\0" * 5000)  # a few bytes packed, 5000 unpacked: refused from the header
    with pytest.raises(RuntimeError, match="more than 1000 bytes"):
        unpack_artifact(zbuf.getvalue(), tmp_path / "zip", max_bytes=1000)
    for kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
        with pytest.raises(RuntimeError, match="holds a link"):
            unpack_artifact(_tar_with(kind), tmp_path / f"link{kind!r}")
    with pytest.raises(RuntimeError, match="special file"):
        unpack_artifact(_tar_with(tarfile.FIFOTYPE), tmp_path / "fifo")
    assert not (tmp_path / "size").exists()  # a refused archive writes nothing


def test_one_canonical_tar_that_both_readers_take(tmp_path):
    from common.artifact_pack import pack_artifact, pack_directory
    from common.artifact_pack import unpack_artifact as control_plane_unpack

    files = {"policy.onnx": b"onnx", "manifest.json": b"{}", "golden.npz": b"npz"}
    tar = pack_artifact(files)
    assert pack_artifact(dict(reversed(list(files.items())))) == tar  # names sorted: the same bytes
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        assert [(m.name, m.mtime, m.uid, m.gid, m.mode) for m in t.getmembers()] == [
            ("golden.npz", 0, 0, 0, 0o644), ("manifest.json", 0, 0, 0, 0o644), ("policy.onnx", 0, 0, 0, 0o644)]
    assert control_plane_unpack(tar) == files
    unpack_artifact(tar, tmp_path / "node")
    assert {p.name: p.read_bytes() for p in (tmp_path / "node").iterdir()} == files
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    assert pack_directory(tmp_path, [*files, "weights.pt"]) == tar  # a missing file is left out


def test_registration_cost_profile_from_the_node_profile():
    p = cost_profile({"kv_recompute_us_per_token": {"128": 2.0, "512": 3.0, "2048": 9.0},
                      "emb_transfer_us_per_row": 4.0}, queue_capacity=64)
    assert p == {"kv_recompute_us_per_token": 3.0, "emb_transfer_us_per_row": 4.0,
                 "service_time_us": 512 * 3.0 + 256 * 4.0, "queue_capacity": 64}
    assert cost_profile(None, queue_capacity=8, service_time_us=100.0)["service_time_us"] == 100.0
    assert cost_profile(None, queue_capacity=8, arena_bytes=2**20)["arena_bytes"] == 2**20  # for the operators


@pytest.mark.parametrize("kw, field", [({"control_plane_url": "cp:80"}, "control_plane_url"),
                                       ({"node_id": "a b"}, "node_id"), ({"token": ""}, "token"),
                                       ({"batch_size": 5000}, "batch_size"),
                                       ({"max_buffered_reports": 0}, "max_buffered_reports")])
def test_reporter_config_names_the_bad_field(kw, field):
    base = dict(control_plane_url="http://127.0.0.1:1", token="t", node_id="n0",
                advertise_url="http://127.0.0.1:2", state_dir="/tmp/x")
    with pytest.raises(ValueError, match=field):
        ReporterConfig(**{**base, **kw})


class _Files(http.server.BaseHTTPRequestHandler):
    blobs: dict[str, bytes] = {}
    posted: list = []

    def do_GET(self):  # noqa: N802
        blob = self.blobs.get(self.path)
        self.send_response(200 if blob is not None else 404)
        self.send_header("Content-Length", str(len(blob or b"")))
        self.end_headers()
        self.wfile.write(blob or b"")

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.posted.append((self.path, json.loads(body), self.headers.get("Authorization")))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *a):
        pass


@pytest.fixture()
def file_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    _Files.blobs, _Files.posted = {}, []
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", _Files
    srv.shutdown()
    srv.server_close()


def _agent_with_policy(policy: Path):
    from node_agent.agent import AgentConfig, NodeAgent
    from node_agent.allocator import AllocatorConfig, SmartAllocator
    from tests.test_node_agent import small_engine

    alloc = SmartAllocator(AllocatorConfig(), policy_dir=policy)
    return NodeAgent(small_engine(), AgentConfig(control_interval_s=0.1), allocator=alloc)


def _artifact_blob(policy: Path, onnx: bytes | None = None) -> bytes:
    """An uncompressed tar, golden.npz last (as the control plane's canonical tar ends with a zip)."""
    files = {n: (policy / n).read_bytes() for n in ("manifest.json", "policy.onnx", "golden.npz")}
    if onnx is not None:
        files["policy.onnx"] = onnx
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_policy_directives_verify_the_digest_and_keep_the_old_policy_on_failure(tmp_path, file_server, policy_dir):
    url, handler = file_server
    agent = _agent_with_policy(policy_dir)
    old = agent.allocator.policy
    rep = Reporter(agent, ReporterConfig(control_plane_url=url, token="tok", node_id="n0",
                                         advertise_url="http://127.0.0.1:9", state_dir=str(tmp_path)))
    try:
        good = _artifact_blob(policy_dir)
        handler.blobs["/a/good"] = good
        # 1. wrong digest: refused before unpacking, old policy kept, failure confirmed
        rep.apply_policy({"version": "v-bad-digest", "digest": "0" * 64, "download_url": "/a/good"})
        assert agent.allocator.policy is old and rep.policy_version == old.policy_id
        path, body, auth = handler.posted[-1]
        assert path == "/api/v1/nodes/n0/policy" and auth == "Bearer tok"
        assert body["status"] == "failed" and "digest mismatch" in body["error"] and body["policy_version"] == "v-bad-digest"
        # the same (version, digest) is not retried
        n = len(handler.posted)
        rep.apply_policy({"version": "v-bad-digest", "digest": "0" * 64, "download_url": "/a/good"})
        assert len(handler.posted) == n
        # 2. right digest but the ONNX file does not match the manifest: load refused, old kept
        broken = _artifact_blob(policy_dir, onnx=b"not an onnx model")
        handler.blobs["/a/broken"] = broken
        rep.apply_policy({"version": "v-broken", "digest": "sha256:" + hashlib.sha256(broken).hexdigest(),
                          "download_url": "/a/broken"})
        assert agent.allocator.policy is old
        body = handler.posted[-1][1]
        assert body["status"] == "failed" and "PolicyLoadError" in body["error"]
        assert rep.status()["policy_error"].startswith("PolicyLoadError")
        # 3. a good artifact: loaded (a new OnnxPolicy object), confirmed, reported from now on
        rep.apply_policy({"version": "v-good", "digest": hashlib.sha256(good).hexdigest(), "download_url": "/a/good"})
        assert agent.allocator.policy is not old and rep.policy_version == "v-good"
        assert handler.posted[-1][1] == {"policy_version": "v-good", "status": "loaded", "error": None}
        assert rep.status()["policy_error"] is None
        # 4. the version it runs: one confirmation per directive, no download
        n = len(handler.posted)
        for _ in range(3):
            rep.apply_policy({"version": "v-good", "digest": hashlib.sha256(good).hexdigest(), "rollout_id": 7})
        assert len(handler.posted) == n + 1
    finally:
        rep.stop()


def test_override_directive_expiry_is_converted_to_the_agent_clock(tmp_path, file_server, policy_dir):
    url, _ = file_server
    agent = _agent_with_policy(policy_dir)
    t = [100.0]
    agent.clock = lambda: t[0]
    rep = Reporter(agent, ReporterConfig(control_plane_url=url, token="tok", node_id="n0",
                                         advertise_url="http://127.0.0.1:9", state_dir=str(tmp_path)))
    try:
        od = {"override_id": 3, "emb_share": 0.25, "expires_at_s": 5_000.0 + 30.0, "reason": "pin", "scope": "cluster"}
        rep.apply_override(od, server_now_s=5_000.0)  # 30 s left on the control plane's clock
        ov = agent.allocator.override
        assert ov.emb_share == 0.25 and ov.expires_at_s == pytest.approx(130.0)  # 100 + 30 and "override 3, cluster" in ov.reason
        rep.apply_override(od, server_now_s=5_001.0)  # the same override again: left alone
        assert agent.allocator.override is ov
        rep.apply_override(None, server_now_s=5_002.0)  # no longer sent: cleared
        assert agent.allocator.override is None
        # the agent's time of the request is the reference (the override ends early, never late)
        rep.apply_override({**od, "override_id": 6}, server_now_s=5_000.0, agent_now_s=95.0)
        assert agent.allocator.override.expires_at_s == pytest.approx(125.0)
        rep.apply_override(None, server_now_s=5_002.0)
        rep.apply_override({**od, "override_id": 4, "expires_at_s": 4_999.0}, server_now_s=5_000.0)  # past: ignored
        assert agent.allocator.override is None
        rep.apply_override({**od, "override_id": 5, "emb_share": 0.999}, server_now_s=5_000.0)  # outside the bounds
        assert agent.allocator.override is None
        assert rep.status()["override"]["applied"] is False and "guard bounds" in rep.status()["override"]["error"]
        # an operator's own (local) override is never cleared by the control plane's absence of one
        mine = agent.allocator.set_override(0.4, now_s=t[0])
        rep.apply_override(None, server_now_s=5_003.0)
        assert agent.allocator.override is mine
    finally:
        rep.stop()


def test_bursts_are_reported_when_they_start_and_when_they_end(tmp_path, file_server, policy_dir):
    url, _ = file_server
    agent = _agent_with_policy(policy_dir)
    t = [0.0]
    agent.clock = lambda: t[0]
    rep = Reporter(agent, ReporterConfig(control_plane_url=url, token="tok", node_id="n0",
                                         advertise_url="http://127.0.0.1:9", state_dir=str(tmp_path)),
                   wall_clock=lambda: 1_000_000.0 + t[0])
    rec = agent.allocator.recovery
    try:
        seen = []
        for s in range(40):  # 1 s intervals: 15 s of baseline, a 3x burst from 15 s to 24 s, then normal
            now = float(s)
            t[0] = now
            rate, hot = (300.0, 0.3) if 15 <= s < 24 else (100.0, 0.1)
            rec.update(rate, hot, now, 0.5)
            seen.append((s, rep.reports.bursts(now)))
        sent = [(s, b) for s, bs in seen for b in bs]
        assert len(sent) == 2, sent
        (s0, start), (s1, end) = sent
        assert s0 == 15 and start == {"start_s": 1_000_015.0, "end_s": None, "magnitude": pytest.approx(3.0)}
        assert s1 > 24 and end["start_s"] == 1_000_015.0 and end["end_s"] == 1_000_000.0 + s1
        assert end["magnitude"] == pytest.approx(3.0)
    finally:
        rep.stop()


def test_a_control_step_report_is_valid_for_the_control_plane(tmp_path, file_server, policy_dir):
    """The report `on_control` builds passes the wire contract's input model, the one the control
    plane validates it with."""
    from common import contract
    from node_agent.engine import RecRequest

    url, _ = file_server
    agent = _agent_with_policy(policy_dir)
    agent.miss_costs = {"kv_recompute_us_per_token": {"128": 2.0}, "emb_transfer_us_per_row": 1.0}
    rep = Reporter(agent, ReporterConfig(control_plane_url=url, token="tok", node_id="n0",
                                         advertise_url="http://127.0.0.1:9", state_dir=str(tmp_path)))
    try:
        empty = agent.control_step(agent.clock())  # a window without requests: figures are null
        now = agent.clock()
        for u in range(5):
            r = agent.engine.serve(RecRequest(u, list(range(u, u + 10)), [], top_k=2), now_s=now)
            agent.metrics.record(now, r.latency.total_us, emb_requested=r.emb_rows, emb_hits=r.emb_hits,
                                 kv_tokens=r.num_history, kv_hit_tokens=r.kv_hit_tokens, user=u, history_len=10)
        busy = agent.control_step(agent.clock())
        reports = [rep.reports.build(o) for o in (empty, busy)]
        for i, r in enumerate(reports):
            contract.ReportIn.model_validate({**r, "seq": i})
        assert reports[0]["p99_ms"] is None and reports[0]["slo_attainment"] is None
        assert reports[1]["num_requests"] == 5 and reports[1]["p50_ms"] <= reports[1]["p99_ms"]
        assert reports[1]["decision"]["source"] in ("base", "residual", "guard")
        assert reports[1]["policy_version"] == agent.allocator.policy.policy_id
    finally:
        rep.stop()


def test_node_agent_control_plane_options_fail_early_in_one_line(tmp_path, capsys, monkeypatch):
    from racer.cli import main as racer_main

    monkeypatch.delenv("RACER_NODE_TOKEN", raising=False)
    csv = tmp_path / "missing.csv"  # never read: the options are refused first
    assert racer_main(["node-agent", "--trace", "taobao", "--path", str(csv), "--control-plane", "http://cp:8600"]) == 2
    err = capsys.readouterr().err
    assert "--control-plane needs --token" in err and err.count("\n") == 1
    assert racer_main(["node-agent", "--trace", "taobao", "--path", str(csv), "--control-plane", "http://cp:8600",
                       "--token", "t", "--node-id", "bad id"]) == 2
    assert "node_id must be" in capsys.readouterr().err
    assert racer_main(["node-agent", "--trace", "taobao", "--path", str(csv), "--control-plane", "cp:8600",
                       "--token", "t"]) == 2
    assert "control_plane_url must start with http" in capsys.readouterr().err


def _emulated_engine(clock, profile: str = "a100-hstu", time_scale: float = 10.0):
    """`tests.test_node_agent.small_engine`'s engine on an emulated device, on ``clock``."""
    from node_agent.emulated import EmulationConfig
    from node_agent.engine import Engine
    from tests.test_node_agent import small_engine

    return Engine(replace(small_engine().config, emulation=EmulationConfig(profile, time_scale)), clock=clock)


def test_reports_and_registration_say_what_the_figures_are(tmp_path):
    """An emulated agent (a `ScaledClock`, K = 10): its reports carry ``device_mode`` emulated and
    the profile, a wall-clock ``ts_s`` (the wall time at the clock's origin plus the wall seconds
    since: a fixed offset would lag (K-1)/K of the elapsed time) and a modelled ``interval_s``; it
    registers its label as ``device`` and `Engine.device_info` in the cost profile, both taken by
    the control plane's input models. A real engine says real; an engine that does not say is
    unknown (null) and registers its device."""
    from common import contract
    from node_agent.agent import AgentConfig, NodeAgent
    from node_agent.emulated import ScaledClock
    from tests.test_node_agent import small_engine

    perf = [1_000.0]
    clock = ScaledClock(10.0, wall=lambda: perf[0])
    agent = NodeAgent(_emulated_engine(clock), AgentConfig(control_interval_s=1.0), clock=clock)
    cfg = dict(control_plane_url="http://127.0.0.1:9", token="tok", node_id="n0", advertise_url="http://127.0.0.1:9")
    rep = Reporter(agent, ReporterConfig(**cfg, state_dir=str(tmp_path / "emu")),
                   wall_clock=lambda: 5_000_000.0 + perf[0])
    try:
        perf[0] += 100.0  # 100 wall seconds: 10 modelled ones
        now = clock()
        assert now == pytest.approx(1_010.0)
        r = rep.reports.build({"now_s": now, "window": {"interval_s": 1.0}})
        assert r["ts_s"] == pytest.approx(5_001_100.0)  # the wall clock's now (an offset would give 5_001_010)
        assert r["interval_s"] == 1.0 and (r["device_mode"], r["device_profile"]) == ("emulated", "a100-hstu")
        contract.ReportIn.model_validate({**r, "seq": 0})
        assert rep.device_label() == "emulated a100-hstu (uncalibrated, modelled time, x10)"
        prof = rep.registration_profile()
        assert prof["device"] == agent.engine.device_info() == {
            "mode": "emulated", "profile": "a100-hstu", "time_scale": 10.0, "calibrated": False, "time": "modelled",
            "label": "emulated a100-hstu (uncalibrated, modelled time, x10)"}
        assert contract.CostProfileIn(**prof).device.mode == "emulated"
        contract.RegisterIn(node_id="n0", address="http://127.0.0.1:9", device=rep.device_label(), cost_profile=prof)
    finally:
        rep.stop()

    real = NodeAgent(small_engine(), AgentConfig(control_interval_s=1.0))
    rep = Reporter(real, ReporterConfig(**cfg, state_dir=str(tmp_path / "real")), wall_clock=lambda: 7_000.0)
    try:
        r = rep.reports.build({"now_s": real.clock(), "window": {"interval_s": 1.0}})
        assert r["ts_s"] == pytest.approx(7_000.0, abs=1.0)  # the agent's clock plus the offset fixed at start
        assert (r["device_mode"], r["device_profile"]) == ("real", None)
        assert rep.device_label() == "cpu" and rep.registration_profile()["device"]["mode"] == "real"
    finally:
        rep.stop()

    from node_agent.engine import Engine, LinkEmulationConfig

    linked = NodeAgent(Engine(replace(small_engine().config, link=LinkEmulationConfig(mode="on"))), AgentConfig())
    rep = Reporter(linked, ReporterConfig(**cfg, state_dir=str(tmp_path / "link")))
    try:
        r = rep.reports.build({"now_s": linked.clock(), "window": {"interval_s": 1.0}})
        assert (r["device_mode"], r["device_profile"]) == ("link-emulated", None)
        assert rep.device_label() == "cpu (EMB link emulated)"
    finally:
        rep.stop()

    real.engine.device_info = None  # an engine that does not say (an older one, a test's fake)
    rep = Reporter(real, ReporterConfig(**cfg, state_dir=str(tmp_path / "mute")))
    try:
        r = rep.reports.build({"now_s": real.clock(), "window": {"interval_s": 1.0}})
        assert (r["device_mode"], r["device_profile"]) == (None, None)
        assert rep.device_label() == "cpu" and "device" not in rep.registration_profile()
        contract.ReportIn.model_validate({**r, "seq": 0})
    finally:
        rep.stop()


def test_device_info_is_bounded_and_unknown_when_the_engine_does_not_say():
    from types import SimpleNamespace

    from node_agent.reports import device_info

    def eng(fn):
        return SimpleNamespace(device_info=fn)

    def boom():
        raise RuntimeError("no")

    assert device_info(SimpleNamespace(device="cpu")) is None  # no method
    assert device_info(eng(boom)) is None
    assert device_info(eng(lambda: {"mode": "quantum"})) is None
    assert device_info(eng(lambda: "emulated")) is None
    assert device_info(eng(lambda: {"mode": "link-emulated", "time": "measured", "label": "cpu (EMB link emulated)",
                                    "profile": "dropped"})) == {
        "mode": "link-emulated", "time": "measured", "label": "cpu (EMB link emulated)"}
    got = device_info(eng(lambda: {"mode": "emulated", "profile": "p" * 500, "time_scale": float("nan"),
                                   "calibrated": 1, "time": "later", "label": "x" * 500, "other": 1}))
    assert got == {"mode": "emulated", "profile": "p" * 128, "label": "x" * 128}


def test_an_override_expiry_on_an_emulated_clock_is_in_modelled_seconds(tmp_path, policy_dir):
    """The control plane's 30 s left are wall seconds: 3 modelled seconds at K = 10."""
    from node_agent.agent import AgentConfig, NodeAgent
    from node_agent.allocator import AllocatorConfig, SmartAllocator
    from node_agent.emulated import ScaledClock

    perf = [50.0]
    clock = ScaledClock(10.0, wall=lambda: perf[0])
    agent = NodeAgent(_emulated_engine(clock), AgentConfig(control_interval_s=1.0), clock=clock,
                      allocator=SmartAllocator(AllocatorConfig(), policy_dir=policy_dir))
    rep = Reporter(agent, ReporterConfig(control_plane_url="http://127.0.0.1:9", token="tok", node_id="n0",
                                         advertise_url="http://127.0.0.1:9", state_dir=str(tmp_path)))
    try:
        perf[0] += 20.0  # modelled now: 52
        rep.apply_override({"override_id": 1, "emb_share": 0.25, "expires_at_s": 5_030.0, "reason": "pin",
                            "scope": "node"}, server_now_s=5_000.0)
        assert agent.allocator.override.expires_at_s == pytest.approx(52.0 + 3.0)
    finally:
        rep.stop()


def test_the_agents_prometheus_metrics_say_what_the_figures_are():
    """``racer_node_device_info`` names the mode, profile, time and time scale; on an emulated
    device the latency histogram's HELP says its seconds are modelled."""
    from node_agent.agent import AgentConfig, NodeAgent
    from node_agent.emulated import ScaledClock
    from node_agent.exporter import render
    from tests.test_node_agent import small_engine

    clock = ScaledClock(10.0)
    emu = render(NodeAgent(_emulated_engine(clock), AgentConfig(), clock=clock))[0].decode()
    assert ('racer_node_device_info{mode="emulated",profile="a100-hstu",time="modelled",time_scale="10"} 1.0'
            in emu), emu
    help_line = next(x for x in emu.splitlines() if x.startswith("# HELP racer_request_latency_seconds "))
    assert "modelled seconds of an emulated device, profile a100-hstu (uncalibrated)" in help_line
    real = render(NodeAgent(small_engine(), AgentConfig()))[0].decode()
    assert 'racer_node_device_info{mode="real",profile="",time="measured",time_scale="1"} 1.0' in real
    help_line = next(x for x in real.splitlines() if x.startswith("# HELP racer_request_latency_seconds "))
    assert "(measured;" in help_line and "modelled" in help_line  # says what an emulated device's would be


def test_a_restarted_node_resumes_its_allocator_state_and_sets_a_bad_one_aside(tmp_path):
    """Each control step's allocator snapshot is kept in the state folder, and a restarted node
    (after a kill -9 too) resumes it instead of starting again at --emb-share: the split always
    (the boundary moves there at once), the residual and the tuner when the same policy runs; a
    snapshot it cannot read is set aside."""
    import json

    import numpy as np

    from node_agent.control import current_target
    from node_agent.reporter import ALLOCATOR_FILE, Reporter, ReporterConfig

    low = export_constant_policy(tmp_path / "p02", 0.2)
    cfg = dict(control_plane_url="http://127.0.0.1:9", token="t", node_id="n-restart",
               advertise_url="http://127.0.0.1:9", state_dir=str(tmp_path / "state"))
    first = _agent_with_policy(low)
    rep = Reporter(first, ReporterConfig(**cfg))
    assert rep.restore_allocator() is None  # nothing kept yet
    for k in range(40):
        rep.on_control(first.control_step(first.clock()))
    first.allocator.tuner.offset = -0.07  # as a tuner that had moved
    first.allocator.residual.load_weights(np.linspace(-0.01, 0.01, len(first.allocator.residual._w)))
    rep.on_control(first.control_step(first.clock()))
    rep._keep_allocator()
    kept = json.loads((tmp_path / "state" / ALLOCATOR_FILE).read_text())
    assert kept["emb_share"] < 0.35 and kept["tuner_offset"] == -0.07, kept  # it had moved from 0.5
    rep.stop()

    second = _agent_with_policy(low)  # the restarted process: --emb-share 0.5 again
    assert abs(current_target(second.engine.mm) - 0.5) < 0.01
    rep2 = Reporter(second, ReporterConfig(**cfg))
    said = rep2.restore_allocator()
    assert said and "residual weights and tuner offset -0.070" in said, said
    assert abs(current_target(second.engine.mm) - kept["emb_share"]) < 0.01
    assert second.allocator.tuner.offset == -0.07
    assert np.allclose(second.allocator.residual._w, kept["residual_weights"])
    assert any("restored" in e["event"] for e in rep2.status()["events"])
    rep2.stop()

    other = _agent_with_policy(export_constant_policy(tmp_path / "p06", 0.6))  # another policy: the split only
    said = Reporter(other, ReporterConfig(**cfg)).restore_allocator()
    assert "start afresh" in said and other.allocator.tuner.offset == 0.0
    assert abs(current_target(other.engine.mm) - kept["emb_share"]) < 0.01

    (tmp_path / "state" / ALLOCATOR_FILE).write_text('{"version": 1, "emb_share": 7}')
    third = _agent_with_policy(low)
    rep3 = Reporter(third, ReporterConfig(**cfg))
    assert rep3.restore_allocator() is None and abs(current_target(third.engine.mm) - 0.5) < 0.01
    assert (tmp_path / "state" / (ALLOCATOR_FILE + ".bad")).exists()
    assert any("not restored" in e["event"] for e in rep3.status()["events"])
