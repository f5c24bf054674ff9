"""Stream shifts: item drift, KV-ward and EMB-ward bursts, schedules, and the paper-scale trace."""

import numpy as np
import pytest

from simulator.profiles import PaperScale
from workloads import synthetic_trace
from workloads.regimes import generate, generate_schedule, parse_schedule
from workloads.scale import fit_zipf_exponent, paper_scale_trace, periods_max


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(num_users=300, num_items=4_001, mean_seq_len=50, seed=2)


def test_trend_drifts_item_popularity(trace):
    s = generate(trace, regime="trend", rate_rps=400, duration_s=20, seed=1, trend_item_drift_end=0.8)
    assert s.item_drift[0] < 0.05 and s.item_drift[-1] > 0.75
    req, items = s.all_new_items()
    # the unshifted items, to see which were moved to their drifted twins
    n_new = s.num_new_items.astype(np.int64)
    starts = np.cumsum(n_new) - n_new
    pos = s.history_len.astype(np.int64)[req] + (np.arange(len(req)) - starts[req])
    users = s.user[req]
    base = s.base_user[users]
    offs = trace.offsets
    raw = trace.items[offs[base] + (pos + s.rotation[users]) % (offs[base + 1] - offs[base])]
    moved = items != raw
    early, late = s.arrival_s[req] < 5, s.arrival_s[req] > 15
    assert moved[early].mean() < 0.15 and moved[late].mean() > 0.6
    assert np.array_equal(items[moved], (raw[moved].astype(np.int64) * 2654435761 + 12345) % trace.num_items)
    # steady has no drift at all
    assert generate(trace, regime="steady", rate_rps=200, duration_s=5).item_drift is None


def test_kv_burst_users_are_drawn_by_activity(trace):
    s = generate(trace, regime="burst", rate_rps=300, duration_s=30, seed=4, num_bursts=3,
                 burst_hot_user_fraction=0.05, burst_kind="kv")
    w = trace.seq_lens[s.base_user].astype(float)
    burst_users = np.concatenate(s.burst_hot_users)
    assert w[burst_users].mean() > 1.3 * w.mean()
    assert s.item_drift is None


def test_emb_burst_brings_new_users_and_a_hot_item_set(trace):
    s = generate_schedule(trace, "steady:10,burst:10", rate_rps=100, seed=5, num_bursts=1,
                          burst_hot_user_fraction=0.02, burst_kind="emb", burst_item_set_size=32)
    assert len(s.item_sets) == 1 and len(s.item_sets[0]) == 32
    (b0, b1), = s.bursts
    assert 10 <= b0 < b1 <= 20
    in_set = s.item_set >= 0
    assert in_set.any() and np.all((s.arrival_s[in_set] >= b0) & (s.arrival_s[in_set] < b1))
    req, items = s.all_new_items()
    assert np.isin(items[in_set[req]], s.item_sets[0]).all()
    # the burst's users had sent nothing before (new users)
    seen_before = set(s.user[s.arrival_s < b0].tolist())
    assert not seen_before & set(s.burst_hot_users[0].tolist())


def test_schedule_keeps_users_and_histories_across_phases(trace):
    s = generate_schedule(trace, [("steady", 8), ("trend", 8), ("steady", 8)], rate_rps=300, seed=3,
                          trend_item_drift_end=0.5)
    assert [p[0] for p in s.phases] == ["steady", "trend", "steady"]
    assert s.phases[-1][1:] == (16.0, 24.0) and s.config.duration_s == 24.0
    assert np.all(np.diff(s.arrival_s) >= 0)
    # a user's history grows across phase boundaries: request = previous + previous's new items (or capped)
    i = np.flatnonzero((s.prev_request >= 0) & (s.arrival_s > 16) & (s.arrival_s[s.prev_request] < 8))
    assert len(i) > 0
    p = s.prev_request[i]
    assert np.all(s.history_len[i] == np.minimum(s.history_len[p] + s.num_new_items[p], s.config.max_history_len))
    # the drift reached in the trend stays in the last steady phase
    last = s.arrival_s >= 16
    assert np.allclose(s.item_drift[last], 0.5) and np.all(s.item_drift[s.arrival_s < 8] == 0)


@pytest.mark.parametrize("text", ["", "steady", "calm:10", "steady:-1", "steady:x"])
def test_parse_schedule_rejects_bad_phases(text):
    with pytest.raises(ValueError, match="schedule"):
        parse_schedule(text)


def test_paper_scale_trace_concatenates_real_sequences(trace):
    big = paper_scale_trace(trace, num_users=400, num_rows=50_000, history_tail=2_000, max_history_len=2_000, seed=1)
    assert big.num_users == 400 and big.num_items == 50_000
    lens = big.seq_lens
    pm = periods_max(trace, 2_000)
    assert lens.max() <= 2_000 and lens.max() > trace.seq_lens.max()
    assert pm == int(np.ceil(2_000 / trace.seq_lens.max()))
    # a long history is not a tiled copy: many more distinct rows than any one sample user has
    u = int(np.argmax(lens))
    assert len(np.unique(big.history(u))) > 2 * len(np.unique(trace.history(0)))
    # popularity: a skew close to the sample's fitted exponent; deterministic
    assert abs(fit_zipf_exponent(big) - fit_zipf_exponent(trace)) < 0.35
    again = paper_scale_trace(trace, num_users=400, num_rows=50_000, history_tail=2_000, max_history_len=2_000, seed=1)
    assert np.array_equal(again.items, big.items)


def test_scale_model_keeps_the_deciding_ratios():
    a, b = PaperScale(scale=1 / 192), PaperScale(scale=1 / 384)
    ra, rb = a.ratios(1_500), b.ratios(1_500)
    for k in ra:
        assert ra[k] == pytest.approx(rb[k], rel=1e-4), k
    assert a.profile().page_bytes % a.profile().emb_row_bytes == 0
    assert b.page_tokens() == 2 * a.page_tokens()
    with pytest.raises(ValueError, match="scale"):
        PaperScale(scale=1 / 100).validate()


def test_paper_scale_table_config_follows_the_setting():
    from simulator.cluster import memory_config
    from simulator.table import TableConfig, sim_config

    cfg = TableConfig.paper(quick=True)
    assert (cfg.num_nodes, cfg.paper_scale, cfg.num_users, cfg.rate_rps) == (1, 1 / 384, 31_250, 125.0)
    big = TableConfig.paper(num_nodes=4)
    assert (big.paper_scale, big.num_users, big.rate_rps, big.history_scale) == (1 / 192, 125_000, 500.0, 1.0)
    scfg = sim_config(cfg)
    ps = PaperScale(scale=1 / 384)
    assert scfg.cache_bytes == ps.scaled_arena_bytes() and scfg.profile.page_tokens == 64
    mcfg = memory_config(ps.scaled_rows(), scfg)
    # the arena in rows over the table's rows: the full-scale 1.38%
    assert mcfg.num_pages * scfg.profile.rows_per_page / ps.scaled_rows() == pytest.approx(0.01377, rel=0.01)
