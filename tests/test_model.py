"""The HSTU model: incremental prefill equals full recompute; ranking equals per-candidate prefill."""

from __future__ import annotations

import pytest
import torch

from node_agent.model import HSTUModel, KVState, ModelConfig, log_bucket


@pytest.fixture(scope="module")
def model():
    return HSTUModel(ModelConfig(embedding_dim=32, num_layers=3, num_heads=2, qk_dim=16, v_dim=8, seed=5))


def seq(n, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, d, generator=g)
    ts = torch.cumsum(torch.rand(n, generator=g, dtype=torch.float64) * 500, 0) + 1.5e9
    return rows, ts


def test_log_bucket():
    d = torch.tensor([-3, 0, 1, 2, 3, 4, 7, 8, 1000])
    assert log_bucket(d, 8).tolist() == [0, 0, 1, 2, 2, 3, 3, 4, 7]


@pytest.mark.parametrize("splits", [[0, 40], [0, 1, 40], [0, 17, 18, 33, 40], [0, 39, 40]])
def test_incremental_prefill_equals_full(model, splits):
    rows, ts = seq(40)
    x = model.tokens(rows)
    full_out, full_kv = model(x, ts)
    outs, kv = [], None
    for a, b in zip(splits, splits[1:]):
        o, new = model(x[a:b], ts[a:b], past=kv)
        kv = new if kv is None else kv.append(new)
        outs.append(o)
    assert torch.allclose(torch.cat(outs), full_out, atol=1e-5)
    for li in range(3):
        assert torch.allclose(kv.k[li], full_kv.k[li], atol=1e-5)
        assert torch.allclose(kv.v[li], full_kv.v[li], atol=1e-5)


def test_history_prefix_outputs_do_not_depend_on_the_future(model):
    rows, ts = seq(30, seed=1)
    out_a, _ = model(model.tokens(rows), ts)
    rows_b = rows.clone()
    rows_b[20:] = torch.randn(10, 32)
    out_b, _ = model(model.tokens(rows_b), ts)
    assert torch.allclose(out_a[:20], out_b[:20], atol=1e-6)
    assert not torch.allclose(out_a[20:], out_b[20:], atol=1e-3)


def test_rank_equals_each_candidate_appended_alone(model):
    rows, ts = seq(25, seed=2)
    _, kv = model(model.tokens(rows), ts)
    cands = torch.randn(7, 32, generator=torch.Generator().manual_seed(9))
    now = float(ts[-1]) + 60.0
    scores = model.rank(cands, kv, now_ts=now)
    assert scores.shape == (7,)
    for i in range(7):
        out, _ = model(model.tokens(cands[i : i + 1]), torch.tensor([now], dtype=torch.float64), past=kv)
        ref = (model.norm_out(out) * cands[i : i + 1]).sum(-1)
        assert torch.allclose(scores[i], ref[0], atol=1e-5)
    # candidates do not see each other: dropping some leaves the others' scores unchanged
    assert torch.allclose(model.rank(cands[:3], kv, now_ts=now), scores[:3], atol=1e-6)


def test_time_bias_matters(model):
    rows, ts = seq(12, seed=3)
    a, _ = model(model.tokens(rows), ts)
    b, _ = model(model.tokens(rows), ts * 0 + ts[0])
    assert not torch.allclose(a, b, atol=1e-4)


def test_weights_are_deterministic_per_seed():
    a = HSTUModel(ModelConfig(seed=1))
    b = HSTUModel(ModelConfig(seed=1))
    c = HSTUModel(ModelConfig(seed=2))
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_bad_config():
    with pytest.raises(ValueError, match=r"num_heads must be an integer in \[1, 64\]"):
        ModelConfig(num_heads=0).validate()


def test_kvstate_prefix_and_append(model):
    rows, ts = seq(10, seed=4)
    _, kv = model(model.tokens(rows), ts)
    assert kv.length == 10 and kv.prefix(4).length == 4
    again = kv.prefix(4).append(KVState([k[4:] for k in kv.k], [v[4:] for v in kv.v], kv.timestamps[4:]))
    assert all(torch.equal(a, b) for a, b in zip(again.k, kv.k))
