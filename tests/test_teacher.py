"""Teacher labels (`policies.teacher`): an artifact's shares on states of the current schema, as
imitation data that `racer policy train --bc-data` reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from node_agent.features import NUM_FEATURES
from policies.env import EnvConfig
from policies.imitation import load_oracle_data, save_oracle_data
from policies.teacher import main, relabel, rollout

SCHEMA1 = Path(__file__).parent / "data" / "policy_schema1"
TINY = EnvConfig(traces=("synthetic",), regimes=("trend",), num_nodes=2, rate_rps=300.0, rate_spread=0.0,
                 duration_s=4.0, num_users=300, history_scale=1.0, cache_fraction=0.5)


def _onnx_shares(X):
    sess = ort.InferenceSession(str(SCHEMA1 / "policy.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(None, {"features": X[:, :16].astype(np.float32)})[0].reshape(-1)  # schema 1 has 16 features


def test_rollout_states_are_labelled_with_the_teachers_shares(tmp_path):
    data = rollout(SCHEMA1, 2, TINY, seed=3)
    # 4 windows of 1 s: the teacher decides after windows 1..3 (and at reset), on 2 nodes, per episode
    assert data["X"].shape[1] == NUM_FEATURES and len(data["X"]) == len(data["y"]) == len(data["episode"])
    assert sorted(set(data["episode"].tolist())) == [0, 1]
    assert np.allclose(data["y"], _onnx_shares(data["X"]), atol=1e-6)  # the teacher reads the first 16 of 22
    assert np.ptp(data["y"]) > 0  # the states differ and so do the labels
    assert all(ep["labels"] == "teacher 7225d43de870 (feature schema 1)" for ep in data["episodes"])
    f = tmp_path / "t.npz"
    save_oracle_data(data, f)
    back = load_oracle_data([f])
    assert np.array_equal(back["X"], data["X"]) and np.array_equal(back["y"], data["y"])

    out = tmp_path / "r.npz"
    assert main(["--teacher", str(SCHEMA1), "--states", str(f), "--out", str(out)]) == 0
    again = relabel(out, SCHEMA1)
    assert np.array_equal(again["X"], data["X"]) and np.allclose(again["y"], data["y"], atol=1e-6)


def test_a_teacher_whose_features_are_not_a_prefix_of_this_schema_is_refused(tmp_path):
    import json
    import shutil

    import pytest

    bad = tmp_path / "t"
    shutil.copytree(SCHEMA1, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["feature_names"] = list(reversed(m["feature_names"]))
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="not this schema's first 16"):
        relabel(tmp_path / "none.npz", bad)
