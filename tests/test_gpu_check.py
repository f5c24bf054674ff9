"""`python -m bench.gpu_check`: the dry run's summary (every step ran or says why not, the dry-run
label, no figure passed off as a GPU's), the sync-warning counter of `bench._sync_debug_plugin`
on synthetic warnings, and the emulated-vs-real comparison on a tiny profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from bench._sync_debug_plugin import ALWAYS_FILTER, SYNC_MESSAGE, SyncDebugPlugin

REPO = Path(__file__).resolve().parent.parent


def _env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.update(extra)
    return env


def _strings(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)
    elif isinstance(obj, str):
        yield obj


@pytest.mark.slow
def test_the_dry_run_runs_every_step_on_the_cpu_and_says_so(tmp_path):
    out = tmp_path / "check"
    p = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out), "--json"],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["label"] == gpu_check.DRY_RUN_LABEL == "dry-run on cpu: no GPU figure"
    assert summary["mode"] == "dry-run" and summary["gpu_figures"] is False and summary["device"] == "cpu"
    assert summary["ok"] is True
    steps = summary["steps"]
    assert list(steps) == list(gpu_check.STEPS)
    for name, s in steps.items():
        assert s["status"] in ("ran", "skipped"), (name, s)
        if s["status"] == "skipped":
            assert s["reason"], name
        if "figures" in s or "device_memory" in s:  # a CPU figure always says what it is
            assert "not a GPU figure" in s["figures_are"], name
        assert not str(s.get("device", "")).startswith("cuda"), name
    # 1. install: printed, not run
    inst = steps["install"]
    assert inst["status"] == "skipped" and "dry run" in inst["reason"]
    assert "--index-url https://download.pytorch.org/whl/cu128" in inst["commands"][0]
    assert f"torch=={gpu_check.pinned_torch_version()}+cu128" in inst["commands"][0]
    assert inst["commands"][0].startswith("PIP_CONFIG_FILE=/dev/null ")
    # 2. the CUDA tests: collected and skipped on the CPU; no sync count given as a finding
    tests = steps["tests"]
    # (every CUDA-marked test skipped, at least one in each file that has the mark)
    assert tests["status"] == "ran" and tests["files"] and set(tests["outcomes"]) == {"skipped"}
    assert tests["outcomes"]["skipped"] >= len(tests["files"])
    assert tests["sync_debug_mode"] is None and tests["sync_warnings_total"] is None
    assert tests["sync_warnings_outside_tests"] is None
    counts = json.loads((out / "sync_warnings.json").read_text())
    assert counts["mode"] is None and "no CUDA device" in counts["mode_reason"]
    assert set(counts["per_test"]) and all(r["outcome"] == "skipped" for r in counts["per_test"].values())
    # 3. the benches, on the CPU, each with its file; the two without a device flag say so
    for name in ("bench_memory", "bench_engine", "bench_allocator"):
        assert steps[name]["status"] == "ran" and (out / f"{name}.json").exists()
        assert steps[name]["device"].startswith("cpu")
    for name in ("bench_memory", "bench_allocator"):
        assert "no --device flag" in steps[name]["note"]
    assert "--device cpu" in steps["bench_engine"]["command"]
    # 4. the profile on the CPU: its device memory, the device's own figures null
    prof = steps["node_profile"]
    mem = prof["device_memory"]
    assert prof["device"] == "cpu" and mem["node_bytes"] > 0
    assert mem["device_total_bytes"] is None and mem["max_memory_allocated_bytes"] is None
    # 5. emulated vs real, side by side; no sync probe without CUDA
    cmp_ = steps["compare"]
    assert cmp_["status"] == "ran" and cmp_["device"] == "cpu" and "in-process" in cmp_["how"]
    for kind in ("miss", "hit"):
        row = cmp_["figures"]["by_kind"][kind]
        assert row["real"]["p50_ms"] > 0 and row["emulated"]["p50_ms"] > 0 and row["real"]["p99_ms"] > 0
    assert cmp_["figures"]["outcomes_match"] is True
    assert cmp_["sync_probe"]["status"] == "skipped" and cmp_["sync_probe"]["sync_warnings_per_request"] is None
    # no GPU's name anywhere, and few enough files for a device run's $OUT (8 come back)
    assert not [s for s in _strings(summary) if s.startswith("cuda (")]
    assert len(list(out.iterdir())) <= 8


def test_without_a_gpu_a_gpu_run_measures_nothing_and_fails(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the real run would run")
    rc = gpu_check.main(["--skip-install", "--out", str(tmp_path), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 1 and summary["ok"] is False and summary["gpu_figures"] is False
    assert summary["label"] == "gpu run: no CUDA device"
    assert summary["steps"]["install"] == {**summary["steps"]["install"], "status": "skipped",
                                           "reason": "--skip-install"}
    for name in gpu_check.STEPS[1:]:
        step = summary["steps"][name]
        assert step["status"] == "skipped" and "sees no CUDA device" in step["reason"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def _warn_record(message: str):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn(message, UserWarning)
    return caught[0]


def test_the_counter_counts_sync_warnings_per_test_and_where_they_came_from(tmp_path):
    plugin = SyncDebugPlugin(REPO, tmp_path / "counts.json")
    w = _warn_record(SYNC_MESSAGE + " (Triggered internally at CUDAFunctions.cpp)")
    other = _warn_record("something else entirely")
    t = "tests/test_x.py::test_a"
    assert plugin.record(t, w.message, w.filename, w.lineno)  # this file: a test's own line
    assert plugin.record(t, w.message, str(REPO / "node_agent" / "engine.py"), 812)  # the code under test
    assert plugin.record(t, w.message, str(REPO / "node_agent" / "engine.py"), 812)
    assert not plugin.record(t, other.message, other.filename, other.lineno)
    assert plugin.record("", w.message, None, None)  # while collecting: no test's
    plugin.outcomes[t] = "passed"
    plugin.outcomes["tests/test_x.py::test_b"] = "passed"
    plugin.write()
    d = json.loads((tmp_path / "counts.json").read_text())
    assert d["message"] == SYNC_MESSAGE and d["mode"] is None
    assert d["sync_warnings_total"] == 4 and d["sync_warnings_outside_tests"] == 2
    a = d["per_test"][t]
    assert a["sync_warnings"] == 3 and a["outside_tests"] == 2 and a["outcome"] == "passed"
    assert a["locations"] == {"node_agent/engine.py:812": 2, f"tests/test_gpu_check.py:{w.lineno}": 1}
    assert d["per_test"]["tests/test_x.py::test_b"]["sync_warnings"] == 0
    assert d["outside_any_test"] == {"?": 1} and d["outcomes"] == {"passed": 2}
    assert d["outside_tests_locations"] == {"node_agent/engine.py:812": 2}


def test_the_plugin_counts_every_warning_of_a_pytest_run(tmp_path):
    """Run pytest with the plugin over a synthetic test file: a warning repeated on one line counts each
    time (Python alone would show it once), one raised from a helper module counts outside the tests."""
    (tmp_path / "helper_code.py").write_text(textwrap.dedent(f"""
        import warnings
        def sync():
            warnings.warn("{SYNC_MESSAGE}", UserWarning)
    """))
    (tmp_path / "test_synthetic.py").write_text(textwrap.dedent(f"""
        import warnings
        from helper_code import sync
        def test_three_on_one_line():
            for _ in range(3):
                warnings.warn("{SYNC_MESSAGE}", UserWarning)
        def test_one_in_the_code():
            sync()
            warnings.warn("unrelated", UserWarning)
        def test_none():
            pass
    """))
    out = tmp_path / "counts.json"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "bench._sync_debug_plugin",
                        "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_synthetic.py")],
                       cwd=tmp_path,
                       env=_env(RACER_SYNC_DEBUG_OUT=str(out), CUDA_VISIBLE_DEVICES=""), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads(out.read_text())
    rows = {k.split("::")[1]: v for k, v in d["per_test"].items()}
    assert rows["test_three_on_one_line"]["sync_warnings"] == 3 and rows["test_three_on_one_line"]["outside_tests"] == 0
    assert rows["test_one_in_the_code"]["sync_warnings"] == 1 and rows["test_one_in_the_code"]["outside_tests"] == 1
    assert list(rows["test_one_in_the_code"]["locations"]) == [f"{(tmp_path / 'helper_code.py').as_posix()}:4"]
    assert rows["test_none"]["sync_warnings"] == 0
    assert d["outcomes"] == {"passed": 3} and d["sync_warnings_total"] == 4
    assert ALWAYS_FILTER.startswith("always:")


def test_compare_serves_the_same_requests_on_both_engines(tmp_path):
    from node_agent.model import ModelConfig
    from node_agent.profile import ProfileConfig, measure_profile

    before = torch.get_num_threads()
    try:
        prof = measure_profile(ProfileConfig(model=ModelConfig(embedding_dim=16, num_layers=1, num_heads=2, qk_dim=8,
                                                               v_dim=8), lengths=(8, 24), repeats=1,
                                             emb_batch_rows=32, hit_history_len=16, num_candidates=8))
        path = tmp_path / "node_profile.json"
        path.write_text(json.dumps(prof))
        res = gpu_check.compare_engines(str(path), "cpu", users=4, num_items=500, num_candidates=8, sync_users=1)
    finally:
        torch.set_num_threads(before)
    assert res["outcomes_match"] and res["mismatches"] == 0
    assert res["requests"]["lengths"] == [8, 24] and set(res["by_length"]) == {"8", "24"}
    for kind in ("miss", "hit", "all"):
        row = res["by_kind"][kind]
        assert row["real"]["n"] == row["emulated"]["n"] == (8 if kind == "all" else 4)
        assert row["emulated_over_real_p50"] == pytest.approx(row["emulated"]["p50_ms"] / row["real"]["p50_ms"],
                                                              rel=1e-2)
    # a miss recomputes the history on both engines; on the emulated one it costs more modelled time
    assert res["by_kind"]["miss"]["emulated"]["p50_ms"] > res["by_kind"]["hit"]["emulated"]["p50_ms"]
    assert res["sync_probe"]["status"] == "skipped" and "no GPU figure" in res["figures_are"]
    assert "racer node-agent --emulate" in res["how"]


def test_install_commands_and_the_cuda_test_files():
    assert gpu_check.pinned_torch_version() == "2.13.0"  # constraints.txt's pin
    torch_cmd, project_cmd = gpu_check.install_commands("py", "2.13.0", "cu128", "/tmp/c.txt")
    assert torch_cmd == ["py", "-m", "pip", "install", "--index-url", "https://download.pytorch.org/whl/cu128",
                         "torch==2.13.0+cu128"]
    assert project_cmd[:6] == ["py", "-m", "pip", "install", "-c", "/tmp/c.txt"] and "-U" not in project_cmd
    files = gpu_check.cuda_test_files()
    assert "tests/test_engine.py" in files and "tests/test_gpu_check.py" not in files
    assert all(gpu_check.CUDA_MARK.search((REPO / f).read_text()) for f in files)
