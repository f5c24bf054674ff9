"""A profile derived from a node's measurements says, field by field, where each figure came from
(common/device_model.py `from_node_profile`, simulator/profiles.py `PaperScale.profile`), and
its two compute figures reproduce the measurements they were fitted to."""

from __future__ import annotations

import json
from dataclasses import fields

import numpy as np
import pytest

from common.device_model import ORIGINS, A100_HSTU, CostProfile, cost_profile_json, request_compute_us
from simulator.profiles import PaperScale, from_node_profile

PROFILE_FIELDS = [f.name for f in fields(CostProfile) if f.name not in ("name", "sources", "calibrated")]
KEPT = ("batch_overhead_us", "request_overhead_us", "batch_speedup", "max_batch", "emb_row_bytes",
        "kv_bytes_per_token", "page_tokens", "hbm_cache_bytes", "link_bytes_per_s")


def node_profile(tmp_path, a: float, b: float, lengths=(64, 256, 1024), **extra):
    """A ``racer node profile`` file whose recompute figures follow the cost model exactly:
    a prefill of L tokens costs a L + b L (L - 1) / 2, so per token a + b (L - 1) / 2."""
    f = tmp_path / "node_profile.json"
    f.write_text(json.dumps({"name": "node", "device": "cpu", "link_emulated": False,
                             "kv_recompute_us_per_token": {str(L): a + b * (L - 1) / 2 for L in lengths},
                             "emb_transfer_us_per_row": 3.5, **extra}))
    return f


def test_the_fitted_compute_figures_reproduce_the_measured_recompute_costs(tmp_path):
    a, b = 2.0, 0.004
    prof = from_node_profile(node_profile(tmp_path, a, b))
    assert prof.token_us == pytest.approx(a) and prof.attn_us_per_ctx == pytest.approx(b)
    for L in (64, 256, 1024):  # the simulator's prefill of L uncached tokens, per token
        per_token = request_compute_us(prof, np.array([0]), np.array([L]), np.array([0]), np.array([0]))[0] / L
        assert per_token == pytest.approx(a + b * (L - 1) / 2)


def test_every_field_of_a_derived_profile_is_labelled_measured_emulated_or_assumed(tmp_path):
    prof = from_node_profile(node_profile(tmp_path, 2.0, 0.004, emb_hit_us_per_row=0.2))
    assert sorted(prof.sources) == sorted(PROFILE_FIELDS)
    assert all(v.startswith(ORIGINS) for v in prof.sources.values()), prof.sources
    for name in ("token_us", "attn_us_per_ctx", "emb_transfer_us_per_row", "emb_hit_us_per_row"):
        assert prof.sources[name].startswith("measured by racer node profile (cpu)"), (name, prof.sources[name])
    for name in KEPT:  # the A100's batching, overheads and sizes, kept and said so
        assert prof.sources[name].startswith("assumed from a100-hstu"), (name, prof.sources[name])
        assert getattr(prof, name) == getattr(A100_HSTU, name)
    assert prof.sources["batch_speedup"].endswith(A100_HSTU.sources["batch_speedup"])
    assert prof.sources["cand_us"].startswith("assumed equal to token_us")
    # the labels travel in the profile's JSON and come back from it
    out = tmp_path / "profile.json"
    out.write_text(json.dumps(prof.to_json()))
    assert cost_profile_json(out).sources == prof.sources


def test_an_emulated_link_an_emulated_agent_and_a_missing_figure_are_labelled_so(tmp_path):
    link = from_node_profile(node_profile(tmp_path, 2.0, 0.004, link_emulated=True))
    assert link.sources["emb_transfer_us_per_row"].startswith("emulated link over a measured gather")
    assert link.sources["token_us"].startswith("measured by racer node profile (cpu+link-emulated)")
    assert link.sources["emb_hit_us_per_row"].startswith("assumed from a100-hstu")  # not in the file
    agent = from_node_profile(node_profile(tmp_path, 2.0, 0.004, lengths=(128,), emulated={"profile": "a100-hstu"}))
    assert agent.sources["token_us"].startswith("emulated by racer node profile (emulated:a100-hstu)")
    assert agent.sources["emb_transfer_us_per_row"].startswith("emulated")
    assert agent.sources["attn_us_per_ctx"] == "assumed 0: emulated at one history length only"
    assert agent.attn_us_per_ctx == 0.0


def test_the_paper_scale_profile_labels_the_fields_it_scales(tmp_path):
    scaled = PaperScale().profile()
    for name in ("kv_bytes_per_token", "page_tokens", "hbm_cache_bytes", "link_bytes_per_s"):
        assert scaled.sources[name].startswith("assumed from PaperScale (simulator/profiles.py) at scale 1/192")
    assert scaled.sources["token_us"] == A100_HSTU.sources["token_us"]
    node = from_node_profile(node_profile(tmp_path, 2.0, 0.004))
    both = PaperScale().profile(node)
    assert both.sources["token_us"].startswith("measured") and both.sources["batch_speedup"].startswith("assumed")
