"""Miss-ratio curves (node_agent/memory/mrc.py) against exact LRU caches, the KV pool's refusals on
the curve, the bounded sampler, and the curve layer of the allocator (node_agent/allocator/curve.py)
from the curves to the decision's trace."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from common.contract import DETAIL_FIELDS, LAYERS, parse_curve_text
from node_agent.allocator import (AllocatorConfig, CurveConfig, CurveGuard, GuardConfig, ResidualConfig, SmartAllocator,
                                  curve_layer)
from node_agent.allocator.curve import expected_costs
from node_agent.control import control_step
from node_agent.memory import KVLayout, MemoryConfig, MemoryManager, MissCurves
from node_agent.memory.mrc import EmbReuse, KVReuse, key_hash
from tests.test_allocator import constant_policy, window


def _exact_emb_lru(batches, cap_rows):
    """Hit fraction (repeats counted) of a row LRU that stamps a batch at once."""
    lru, hits, tot = OrderedDict(), 0, 0
    for b in batches:
        for x in b.tolist():
            tot += 1
            hits += x in lru
        for x in dict.fromkeys(b.tolist()):
            if x in lru:
                lru.move_to_end(x)
            else:
                lru[x] = 1
                if len(lru) > cap_rows:
                    lru.popitem(last=False)
    return hits / tot


def test_emb_curve_at_rate_one_is_the_exact_lru_hit_rate():
    rng = np.random.default_rng(1)
    batches = (rng.zipf(1.1, size=40_000) % 3_000).astype(np.int64).reshape(-1, 40)
    e = EmbReuse(100, 10, max_keys=4_096, half_life=1e12)
    for b in batches:
        e.record(b)
    assert e.rate == 1.0 and e.check_invariants() == []
    for pages in (5, 20, 60):
        # one lookup's rows share a stamp (their order within it is the slab's choice): the curve
        # puts each at the middle of its lookup's rows, within 0.015 of the exact LRU
        assert float(e.hit_fraction([pages])[0]) == pytest.approx(_exact_emb_lru(batches, pages * 10), abs=0.015)


def test_emb_sampler_is_bounded_and_lowers_its_rate():
    rng = np.random.default_rng(2)
    e = EmbReuse(50, 8, max_keys=64)
    for _ in range(200):
        e.record(rng.integers(0, 5_000, size=30).astype(np.int64))
    assert e.num_keys <= 64 and e.rate < 0.1 and e.check_invariants() == []
    assert len(e.pos) == 64 and len(e.hits) == 257  # memory fixed by max_keys and num_bins
    # every followed key hashes under the threshold; the same key is followed or not, always
    keys = np.array(list(e._slot), dtype=np.int64)
    assert (key_hash(keys) < np.uint64(e.threshold)).all()


def test_kv_curve_shows_a_refused_user_as_a_cliff_at_its_size():
    """One user of 40 tokens (3 pages of 16) returns every request; a pool of 2 pages refuses it
    (KVPool.append -> None) and never caches it, yet its curve says 3 pages would hit."""
    cfg = MemoryConfig(num_pages=10, num_items=100, emb_dim=4, kv=KVLayout(num_layers=1, num_heads=1, head_dim=4,
                                                                            page_tokens=16),
                       initial_emb_share=0.8, payload=False, device="cpu", miss_curves=True)
    mm = MemoryManager(cfg)
    assert mm.kv.num_kv_pages == 2
    for _ in range(20):
        cached = mm.kv.lookup(7, history_tokens=40)
        assert cached == 0
        assert mm.kv.append(7, 40) is None  # refused: 3 pages > 2
    assert mm.kv.stats.num_rejected == 20 and mm.kv.reuse.num_refused > 19
    k = mm.kv.reuse
    assert k.hit_fraction([2.9])[0] < 0.1  # 2.9 pages: still a miss
    assert k.hit_fraction([3.1])[0] > 0.9  # 19 of 20 lookups hit 40 of 40 tokens once it fits
    curves = mm.miss_curves()
    # share 0.6 leaves 4 pages to the pool, 0.8 leaves 2 (the curve's bins are 1/256 of the arena)
    kv_at = dict(zip(curves.shares, curves.kv_hit_rate))
    assert kv_at[0.6] > 0.9 and kv_at[0.8] == 0.0
    assert mm.check_invariants() == []


def test_kv_curve_matches_a_whole_user_lru_with_growing_users():
    rng = np.random.default_rng(3)
    users = (rng.zipf(1.3, size=6_000) % 200).tolist()
    k = KVReuse(200, 16, half_life=1e12)
    size: dict[int, int] = {}
    for u in users:
        h = size.get(u, 0)
        k.lookup(u, h)
        size[u] = h + 20 if h + 20 < 600 else 20
        k.append(u, size[u])
    for pool in (40, 120):
        lru, used, hit, tot, sz = OrderedDict(), 0, 0, 0, {}
        for u in users:
            h = sz.get(u, 0)
            tot += h
            if u in lru:
                hit += min(lru[u][1], h)
                lru.move_to_end(u)
            new = h + 20 if h + 20 < 600 else 20
            sz[u] = new
            if u in lru:
                used -= lru.pop(u)[0]
            pages = -(-new // 16)
            if pages > pool:
                continue
            while used + pages > pool:
                used -= lru.popitem(last=False)[1][0]
            lru[u] = (pages, new)
            used += pages
        assert k.hit_fraction([pool])[0] == pytest.approx(hit / tot, abs=0.02)


def _curves(kv_hit, emb_hit, tokens=400.0, shares=(0.1, 0.2, 0.3, 0.4, 0.5)):
    return MissCurves(tuple(shares), tuple(emb_hit), tuple(kv_hit), 1e4, 1e3, 1.0, 1.0, tokens, 0.0)


def test_expected_costs_and_the_curve_layer_refuse_a_step_over_a_cliff():
    # the K/V fit up to share 0.3 and not above; EMB gains a little with share
    cur = _curves(kv_hit=(0.9, 0.9, 0.9, 0.02, 0.02), emb_hit=(0.5, 0.55, 0.6, 0.65, 0.7), tokens=4000.0)
    st = window(emb_share=0.3, load=0.5, num_requests=100, interval_s=1.0, emb_lookups_per_request=100.0,
                kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=1.0)
    shares, cost = expected_costs(cur, st)
    assert list(shares) == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert cost[3] > 2 * cost[2]  # over the cliff
    g = GuardConfig()
    state = CurveGuard(CurveConfig())
    # a proposal over the cliff from 0.3: the minimum (0.3) saves > 25%: to the minimum
    out, t = curve_layer(state, cur, st, 0.4, 0.3, g)
    assert (out, t.acted, t.detail["action"], t.detail["min_share"]) == (0.3, True, "to_minimum", 0.3)
    pairs = parse_curve_text(t.detail["curve"])
    assert [s for s, _ in pairs] == [0.1, 0.2, 0.3, 0.4, 0.5] and pairs[3][1] == pytest.approx(cost[3], abs=0.1)
    # a proposal at the minimum passes
    out, t = curve_layer(CurveGuard(), cur, st, 0.3, 0.3, g)
    assert (out, t.acted, t.detail["action"]) == (0.3, False, "pass")
    # no evidence: the layer passes and says why
    thin = MissCurves(cur.shares, cur.emb_hit_rate, cur.kv_hit_rate, 10.0, 2.0, 1.0, 1.0, 400.0, 0.0)
    out, t = curve_layer(CurveGuard(), thin, st, 0.45, 0.3, g)
    assert (out, t.acted, t.detail["action"]) == (0.45, False, "no_curve")


def test_curve_layer_refuses_a_step_that_costs_more_without_a_large_saving():
    # flat except for a bump at 0.4: the minimum saves < 25% of the proposal's cost, the step's rise > 25%
    cur = _curves(kv_hit=(0.5, 0.5, 0.5, 0.3, 0.5), emb_hit=(0.5,) * 5)
    st = window(emb_share=0.3, load=0.2, num_requests=100, interval_s=1.0, emb_lookups_per_request=50.0,
                kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=1.0)
    cfg = CurveConfig(move_gain=0.9, hold_gain=0.5, cliff_gain=0.1)
    out, t = curve_layer(CurveGuard(cfg), cur, st, 0.4, 0.3, GuardConfig())
    assert (out, t.detail["action"]) == (0.3, "refuse_step") and t.acted


def test_curve_layer_holds_the_split_in_a_flat_valley():
    """The dead band: where the split in force is within ``flat_gain`` of the curve's minimum, a
    proposal elsewhere is held at the split in force; ``flat_gain=0`` lets it pass."""
    # the KV hit rises 0.400 -> 0.410 from 0.5 to 0.1: under 1% of the expected time per request
    cur = _curves(kv_hit=(0.41, 0.4075, 0.405, 0.4025, 0.40), emb_hit=(0.5,) * 5)
    st = window(emb_share=0.5, load=0.4, num_requests=100, interval_s=1.0, emb_lookups_per_request=50.0,
                kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=1.0)
    shares, cost = expected_costs(cur, st)
    assert 0.0 < (cost[4] - cost[0]) / cost[4] < 0.01
    out, t = curve_layer(CurveGuard(), cur, st, 0.45, 0.5, GuardConfig())
    assert (out, t.acted, t.detail["action"]) == (0.5, True, "flat")
    out, t = curve_layer(CurveGuard(CurveConfig(flat_gain=0.0)), cur, st, 0.45, 0.5, GuardConfig())
    assert (out, t.acted, t.detail["action"]) == (0.45, False, "pass")
    # it holds the split it chose, not one a later layer forced: after a burst's cap put the split
    # in force at 0.3, the dead band still holds 0.5, so the split goes back when the cap ends
    g = CurveGuard()
    assert curve_layer(g, cur, st, 0.5, 0.5, GuardConfig())[0] == 0.5 and g.anchor == 0.5
    out, t = curve_layer(g, cur, st, 0.45, 0.3, GuardConfig())
    assert (out, t.detail["action"]) == (0.5, "flat")
    # the same valley made steeper (10x the recompute cost) is no longer flat: the step passes
    steep = window(emb_share=0.5, load=0.4, num_requests=100, interval_s=1.0, emb_lookups_per_request=50.0,
                   kv_recompute_us_per_token=20.0, emb_transfer_us_per_row=1.0)
    out, t = curve_layer(CurveGuard(), cur, steep, 0.45, 0.5, GuardConfig())
    assert (out, t.detail["action"]) == (0.45, "pass")
    with pytest.raises(ValueError, match="flat_gain"):
        CurveConfig(flat_gain=0.3)


@pytest.mark.parametrize("flat_gain", [0.01, 0.0])
def test_a_flat_curve_keeps_the_split_and_the_tuners_offset_does_not_wind_up(tmp_path, flat_gain):
    """A tuner that reads a steady EMB-ward gradient on a flat curve: with the dead band the split
    stays at the base's 0.5 and the tuner's step is taken back every interval (its offset stays 0);
    without it the split walks EMB-ward."""
    from node_agent.allocator import TunerConfig

    policy = constant_policy(tmp_path / "p", 0.5)
    cfg = AllocatorConfig(device="cpu", tuner=TunerConfig(confidence=0.0), curve=CurveConfig(flat_gain=flat_gain))
    alloc = SmartAllocator(cfg, policy_dir=policy)
    cur = _curves(kv_hit=(0.418, 0.418, 0.419, 0.419, 0.420, 0.420, 0.421, 0.421, 0.422),  # ~0.5% over the range
                  emb_hit=(0.5,) * 9, shares=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9))
    share = 0.5
    for i in range(12):
        alloc.read_curves(cur)
        d = alloc.decide(window(emb_share=share, emb_marginal_us=400.0, kv_marginal_us=0.0, load=0.4,
                                num_requests=1000, interval_s=1.0, emb_lookups_per_request=50.0,
                                kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=1.0), float(i))
        share = d.emb_share
    if flat_gain:
        assert share == pytest.approx(0.5) and alloc.tuner.offset == pytest.approx(0.0, abs=1e-9)
        c = d.layer("curve").detail
        assert c["action"] == "flat" and c["taken_back"] > 0 and d.tuner_offset == pytest.approx(0.0, abs=1e-9)
        assert "dead band" in d.reason
    else:
        assert share > 0.6 and alloc.tuner.offset > 0.1


def test_smart_allocator_runs_the_curve_layer_from_the_control_step(tmp_path):
    """`control_step` hands the manager's curves to the allocator; the decision's trace carries the
    curve layer between residual and recovery; without curves the layer does not run."""
    policy = constant_policy(tmp_path / "p", 0.6)
    assert LAYERS.index("curve") == LAYERS.index("residual") + 1
    assert len(DETAIL_FIELDS["curve"]) <= 16
    cfg = MemoryConfig(num_pages=64, num_items=500, emb_dim=4,
                       kv=KVLayout(num_layers=1, num_heads=1, head_dim=4, page_tokens=16),
                       initial_emb_share=0.6, payload=False, device="cpu", miss_curves=True)
    mm = MemoryManager(cfg)
    import torch

    rng = np.random.default_rng(4)
    for i in range(400):  # users of 15 pages each that fit only in a pool of 45+ pages (share <= 0.3)
        u = int(rng.integers(0, 3))
        mm.kv.lookup(u, 240)
        mm.kv.append(u, 240 - mm.kv.num_tokens(u)) if mm.kv.num_tokens(u) < 240 else None
        mm.emb.lookup(torch.from_numpy(rng.integers(0, 500, size=20)))
    # (without the first decision's jump, which the next test covers)
    alloc = SmartAllocator(AllocatorConfig(curve=CurveConfig(first_jump=False)), policy_dir=policy)
    st = window(emb_share=0.6, load=0.6, num_requests=400, emb_lookups_per_request=20.0, kv_hit_rate=0.0,
                kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=1.0)
    eff = control_step(alloc, st, mm, 1.0)
    d = eff.decision
    names = [t.layer for t in d.layers]
    assert names[:3] == ["base", "residual", "curve"]
    c = d.layer("curve").detail
    assert c["action"] == "to_minimum" and c["min_share"] <= 0.3
    assert d.source == "guard" and d.emb_share == pytest.approx(0.5)  # the step limit paces the move KV-ward
    assert "miss-ratio curves" in d.reason
    # a decision without curves has no curve layer
    d2 = alloc.decide(st, 2.0)
    assert "curve" not in [t.layer for t in d2.layers]
    # the curve guard's state is in the allocator's state
    assert alloc.state()["curve"]["num_actions"]["to_minimum"] == 1


def test_curves_off_by_default_and_on_with_the_ghost_lists():
    base = dict(num_pages=8, num_items=10, emb_dim=4, payload=False, device="cpu")
    assert MemoryManager(MemoryConfig(**base)).miss_curves() is None
    assert MemoryManager(MemoryConfig(**base, ghost_probes=(0.1,))).miss_curves() is not None
    assert MemoryManager(MemoryConfig(**base, ghost_probes=(0.1,), miss_curves=False)).miss_curves() is None


def test_one_lookup_with_more_new_ids_than_the_sampler_follows_lowers_the_rate_and_returns():
    """A paper-scale lookup can bring more distinct sampled ids than the sampler has slots (4,096
    rows) while it follows none yet: the threshold must fall by the incoming ids too (else the
    make-room loop never ends); the bound and the invariants hold after it."""
    from node_agent.memory.mrc import EmbReuse

    r = EmbReuse(1024, 64)
    assert r.record(np.arange(50_000, dtype=np.int64)) <= r.max_keys
    assert r.num_keys <= r.max_keys and r.rate < 0.1 and r.check_invariants() == []
    for k in range(5):
        r.record(np.random.default_rng(k).integers(0, 10**6, 30_000))
        assert r.num_keys <= r.max_keys and r.check_invariants() == []


def test_curve_layer_jumps_down_a_cliff_at_once_and_paces_a_growth(tmp_path):
    """Above a KV cliff (the minimum, KV-ward of the split in force, saves at least ``jump_gain`` of
    the split in force's time) the step-down limit is waived: the split reaches the minimum in one
    decision. A move EMB-ward to a minimum stays paced by the step-up limit (new rows need a refill),
    and below ``jump_gain`` the step-down limit paces a KV-ward move as before."""
    # the K/V fit at shares 0.1 and 0.2 only; the EMB hit barely moves
    cur = _curves(kv_hit=(0.9, 0.9, 0.02, 0.02, 0.02), emb_hit=(0.5, 0.52, 0.54, 0.56, 0.58), tokens=4000.0)
    st = window(emb_share=0.5, load=0.5, num_requests=100, interval_s=1.0, emb_lookups_per_request=100.0,
                kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=1.0)
    g = GuardConfig()
    out, t = curve_layer(CurveGuard(), cur, st, 0.5, 0.5, g)
    s_min = t.detail["min_share"]
    assert s_min <= 0.2 and (out, t.acted, t.detail["action"]) == (s_min, True, "jump")
    assert t.detail["cost_prev_us"] >= 2 * t.detail["cost_min_us"]
    # the same curve with a jump_gain above its saving: an ordinary to_minimum
    out, t = curve_layer(CurveGuard(CurveConfig(jump_gain=0.99, first_jump=False)), cur, st, 0.5, 0.5, g)
    assert (out, t.detail["action"]) == (s_min, "to_minimum")

    # through the allocator: one decision from 0.5 to the minimum (the guards' max_step_down is 0.1)
    policy = constant_policy(tmp_path / "p", 0.5)

    def decide(config, curves, stats, share):  # the first decision: the split in force is the stats'
        assert stats.emb_share == share
        alloc = SmartAllocator(config, policy_dir=policy)
        alloc.read_curves(curves)
        return alloc.decide(stats, 1.0)

    d = decide(AllocatorConfig(), cur, st, 0.5)
    assert d.emb_share == pytest.approx(s_min) and d.layer("curve").detail["action"] == "jump"
    assert d.layer("guard").detail["action"] is None and "at once" in d.reason
    d = decide(AllocatorConfig(curve=CurveConfig(jump_gain=0.99, first_jump=False)), cur, st, 0.5)
    assert d.emb_share == pytest.approx(0.4) and d.layer("guard").detail["action"] == "step_down"
    # the mirror image: the minimum EMB-ward of the split in force is reached at the step-up limit only
    up = _curves(kv_hit=(0.02,) * 5, emb_hit=(0.01, 0.01, 0.01, 0.99, 0.5), tokens=10.0)
    st_up = window(emb_share=0.1, load=0.5, num_requests=100, interval_s=1.0, emb_lookups_per_request=2000.0,
                   kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=1.0)
    d = decide(AllocatorConfig(), up, st_up, 0.1)
    assert d.layer("curve").detail["min_share"] == 0.4 and d.layer("curve").detail["action"] == "to_minimum"
    assert d.emb_share == pytest.approx(0.1 + g.max_step_up) and d.layer("guard").detail["action"] == "step_up"


def test_the_first_decision_on_the_curves_jumps_to_a_kv_ward_minimum(tmp_path):
    """The configured split has no curve behind it: the layer's first decision on evidence takes a
    KV-ward minimum it moves to at once, even where the saving is under ``jump_gain``; later
    decisions are paced again, and so is a restored split's first one (chosen on evidence)."""
    cur = _curves(kv_hit=(0.9, 0.9, 0.02, 0.02, 0.02), emb_hit=(0.5, 0.52, 0.54, 0.56, 0.58), tokens=4000.0)
    st = window(emb_share=0.5, load=0.5, num_requests=100, interval_s=1.0, emb_lookups_per_request=100.0,
                kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=1.0)
    g = GuardConfig()
    cfg = CurveConfig(jump_gain=0.99)  # the saving is under it: only the first decision jumps
    gs = CurveGuard(cfg)
    out, t = curve_layer(gs, None, st, 0.5, 0.5, g)  # no evidence yet: not the first decision on it
    assert t.detail["action"] == "no_curve" and not gs.evidenced
    out, t = curve_layer(gs, cur, st, 0.5, 0.5, g)
    s_min = t.detail["min_share"]
    assert s_min <= 0.2 and (out, t.detail["action"], gs.jumped_first) == (s_min, "jump", True)
    out, t = curve_layer(gs, cur, st, 0.5, 0.5, g)
    assert (out, t.detail["action"], gs.jumped_first) == (s_min, "to_minimum", False)

    policy = constant_policy(tmp_path / "p", 0.5)
    alloc = SmartAllocator(AllocatorConfig(curve=cfg), policy_dir=policy)
    alloc.read_curves(cur)
    d = alloc.decide(st, 1.0)
    assert d.emb_share == pytest.approx(s_min) and d.layer("guard").detail["action"] is None
    assert "first decision on the curves" in d.reason
    # back at 0.5 (an operator's restore): the second decision is paced by max_step_down
    alloc.restore({**alloc.snapshot(), "emb_share": 0.5})
    alloc.read_curves(cur)
    d = alloc.decide(st, 2.0)
    assert d.emb_share == pytest.approx(0.5 - g.max_step_down) and d.layer("guard").detail["action"] == "step_down"
    # a fresh allocator restored from a snapshot: its split was chosen on evidence, no first jump
    fresh = SmartAllocator(AllocatorConfig(curve=cfg), policy_dir=policy)
    fresh.restore({**alloc.snapshot(), "emb_share": 0.5})
    fresh.read_curves(cur)
    d = fresh.decide(st, 3.0)
    assert d.emb_share == pytest.approx(0.5 - g.max_step_down) and "first decision" not in d.reason
    # an EMB-ward minimum is never jumped to (new rows need a refill)
    up = _curves(kv_hit=(0.02,) * 5, emb_hit=(0.01, 0.01, 0.01, 0.99, 0.5), tokens=10.0)
    st_up = window(emb_share=0.1, load=0.5, num_requests=100, interval_s=1.0, emb_lookups_per_request=2000.0,
                   kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=1.0)
    alloc = SmartAllocator(AllocatorConfig(), policy_dir=constant_policy(tmp_path / "q", 0.1))
    alloc.read_curves(up)
    d = alloc.decide(st_up, 1.0)
    assert d.emb_share == pytest.approx(0.1 + g.max_step_up) and d.layer("guard").detail["action"] == "step_up"


def test_a_busy_node_moves_to_the_curves_minimum_at_a_smaller_saving():
    """A minimum that saves 10-25% of the proposal's time: a lightly loaded node keeps the proposal
    (under ``move_gain``), a busy one (busy fraction at least ``busy_load``) moves to it (at least
    ``busy_move_gain``); with ``busy_load`` above the node's load, or ``busy_move_gain`` at
    ``move_gain``, it does not."""
    cur = _curves(kv_hit=(0.8, 0.7, 0.6, 0.5, 0.4), emb_hit=(0.5, 0.52, 0.54, 0.56, 0.58), tokens=400.0)
    g = GuardConfig()

    def run(load, **kw):
        st = window(emb_share=0.5, load=load, num_requests=100, interval_s=1.0, emb_lookups_per_request=100.0,
                    kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=1.0)
        out, t = curve_layer(CurveGuard(CurveConfig(first_jump=False, **kw)), cur, st, 0.5, 0.5, g)
        assert CurveConfig().busy_move_gain <= t.detail["gain"] < CurveConfig().move_gain
        return out, t.detail["action"]

    assert run(0.3) == (0.5, "pass")
    assert run(0.6) == (0.1, "to_minimum")
    assert run(0.6, busy_load=0.7) == (0.5, "pass")
    assert run(0.6, busy_move_gain=0.25) == (0.5, "pass")
    with pytest.raises(ValueError, match="flat_gain"):
        CurveConfig(busy_move_gain=0.01)
    with pytest.raises(ValueError, match="busy_load"):
        CurveConfig(busy_load=1.5)


def test_the_kv_tail_curve_sees_the_long_histories_that_need_a_larger_pool():
    """Six short users (2 pages) and one long one (40 pages) return in turn: the cut settles at the
    90th percentile of the histories (inside the long user's), the tail's curve is the long user's
    (a hit only once the pool holds all 52 pages) while the mean's is mostly the short users' (hits
    from 12 pages on)."""
    rng = np.random.default_rng(3)
    k = KVReuse(200, 16)
    for _ in range(600):
        u = int(rng.integers(0, 7))
        toks = 640 if u == 0 else int(rng.integers(20, 33))
        k.lookup(u, toks)
        k.append(u, toks)
    assert 32 < k.tail_cut <= 640
    assert k.tail_tokens() == pytest.approx(640, rel=0.05)
    mean, tail = k.hit_fraction([20, 60]), k.tail_hit_fraction([20, 60])
    assert tail[0] < 0.05 < 0.9 < tail[1]  # the long user fits only in the larger pool
    assert mean[0] > 0.05 > tail[0]  # the short users (a fifth of the tokens) fit in the small one
    assert k.mean_tokens() < k.tail_tokens()


def _tail_curves(kv_hit, kv_tail_hit, tokens, tail_tokens, emb_hit, shares=(0.1, 0.2, 0.3, 0.4, 0.5)):
    return MissCurves(tuple(shares), tuple(emb_hit), tuple(kv_hit), 1e4, 1e3, 1.0, 1.0, tokens, 0.0,
                      tuple(kv_tail_hit), tail_tokens)


def test_the_tail_term_moves_a_light_loads_minimum_to_where_the_long_histories_fit():
    # the mean user fits everywhere; the tail's long histories only at 0.1 and 0.2; EMB gains a
    # little with share. The mean time says 0.5, the tail says 0.2
    cur = _tail_curves(kv_hit=(0.9,) * 5, kv_tail_hit=(0.9, 0.9, 0.1, 0.1, 0.1), tokens=200.0, tail_tokens=2000.0,
                       emb_hit=(0.5, 0.55, 0.6, 0.65, 0.7))
    st = window(emb_share=0.5, load=0.1, num_requests=100, interval_s=1.0, emb_lookups_per_request=100.0,
                kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=1.0)
    _, mean = expected_costs(cur, st, tail=False)
    _, both = expected_costs(cur, st)
    assert int(np.argmin(mean)) == 4 and int(np.argmin(both)) == 1
    assert both[2] - mean[2] == pytest.approx((2000 * 0.9 - 2000 * 0.1) * 2.0, rel=1e-6)  # over its minimum
    out, t = curve_layer(CurveGuard(), cur, st, 0.5, 0.5, GuardConfig())
    assert (out, t.detail["action"]) == (0.2, "jump")
    out, t = curve_layer(CurveGuard(CurveConfig(tail=False)), cur, st, 0.5, 0.5, GuardConfig())
    assert (out, t.detail["action"]) == (0.5, "pass")
    # no tail curve (an older report's curves), or a tail no longer than the mean: the mean alone
    old = _curves(kv_hit=(0.9,) * 5, emb_hit=(0.5, 0.55, 0.6, 0.65, 0.7), tokens=200.0)
    assert np.allclose(expected_costs(old, st)[1], mean)
    short = _tail_curves((0.9,) * 5, (0.1,) * 5, 200.0, 150.0, (0.5, 0.55, 0.6, 0.65, 0.7))
    assert np.allclose(expected_costs(short, st)[1], mean)
    flat = _tail_curves((0.9,) * 5, (0.3,) * 5, 200.0, 2000.0, (0.5, 0.55, 0.6, 0.65, 0.7))
    assert np.allclose(expected_costs(flat, st)[1], mean)  # a tail the split cannot help adds nothing


def test_a_saturated_nodes_queue_term_reads_the_offered_load_and_grows_past_rho_max():
    """Below ``rho_max`` the saturation term changes nothing; on a saturated node (busy fraction 1)
    the offered load (arrivals x time per request) sets ``rho``, and past ``rho_max`` the cost
    follows the M/M/1 curve's tangent there instead of the cap, so a share that serves 0.55% faster
    saves a backlog's worth (2-3%) and is out of the dead band, where the cap saw 0.55% and held."""
    cur = _curves(kv_hit=(0.525, 0.5, 0.5, 0.5, 0.5), emb_hit=(0.5,) * 5, tokens=1000.0)
    kw = dict(emb_share=0.5, num_requests=100, interval_s=1.0, emb_lookups_per_request=10.0,
              kv_recompute_us_per_token=2.0, emb_transfer_us_per_row=1.0)
    light = window(load=0.5, arrival_rate_rps=100.0, **kw)
    for a, b in zip(expected_costs(cur, light, saturation=True), expected_costs(cur, light, saturation=False)):
        assert np.array_equal(a, b)
    busy = window(load=1.0, arrival_rate_rps=120.0, **kw)  # 100 served in the second, 120 arrived: offered 1.2
    _, capped = expected_costs(cur, busy, saturation=False)
    _, grown = expected_costs(cur, busy, saturation=True)
    service = np.array([10_000.0 - 55.0, 10_000.0, 10_000.0, 10_000.0, 10_000.0])  # µs: S_now 10 ms
    assert capped == pytest.approx(service / 0.05)
    rho = 1.2 * service / 10_000.0
    assert grown == pytest.approx(service / 0.05 * (1.0 + (rho - 0.95) / 0.05))
    assert 1.0 - capped[0] / capped[4] == pytest.approx(0.0055)
    assert 1.0 - grown[0] / grown[4] > 0.02
    # the tuner's step KV-ward from 0.5: the cap's 0.55% is inside the 1% dead band (held at 0.5),
    # the backlog's saving is not (the step passes)
    g = GuardConfig()
    out, t = curve_layer(CurveGuard(CurveConfig(saturation=False)), cur, busy, 0.45, 0.5, g)
    assert (out, t.detail["action"]) == (0.5, "flat")
    out, t = curve_layer(CurveGuard(CurveConfig(saturation=True)), cur, busy, 0.45, 0.5, g)
    assert (out, t.detail["action"]) == (0.45, "pass")
    assert CurveConfig().saturation is True


def test_below_saturation_the_tangent_prices_only_a_share_that_would_overload_the_node():
    """At a busy fraction of 0.9 the node is not saturated (offered load = busy fraction), and a
    share whose service time is 10% longer would put it at 0.99: with ``saturation`` its cost is
    the M/M/1 tangent's at 0.99, above the cap's; shares under ``rho_max`` cost the same either way."""
    cur = _curves(kv_hit=(0.5, 0.5, 0.5, 0.5, 0.45), emb_hit=(0.5,) * 5, tokens=1000.0)
    st = window(emb_share=0.3, load=0.9, num_requests=100, interval_s=1.0, arrival_rate_rps=150.0,
                emb_lookups_per_request=10.0, kv_recompute_us_per_token=20.0, emb_transfer_us_per_row=1.0)
    _, capped = expected_costs(cur, st, saturation=False)
    _, grown = expected_costs(cur, st, saturation=True)
    s_now = 9_000.0  # 0.9 s busy over 100 requests, µs
    service = s_now + 1000.0 + 0.5 * 50.0  # 50 more missed tokens (20 µs each), 50 more rows half-missed
    rho = 0.9 * service / s_now
    assert rho > 0.95 and capped[4] == pytest.approx(service / 0.05)
    assert grown[4] == pytest.approx(service / 0.05 * (1.0 + (rho - 0.95) / 0.05))
    assert np.array_equal(capped[:4], grown[:4])


def test_on_a_saturated_node_the_tangent_keeps_the_jumps_the_capped_cost_makes(tmp_path):
    """With ``saturation`` the tangent's T (here 42x the service time at every share) dwarfs the
    tail's extra recompute, which decides this node's split: the minimum saves 4.5% over the split
    in force, under ``move_gain``. The capped cost sees the same minimum as a 67% saving, a cliff
    the node stands above; on a saturated node the layer keeps that jump (its thresholds were set
    on the capped cost) and takes it at once."""
    cur = _tail_curves(kv_hit=(0.5,) * 5, kv_tail_hit=(0.9, 0.9, 0.1, 0.1, 0.1), tokens=1000.0,
                       tail_tokens=50_000.0, emb_hit=(0.5,) * 5)
    st = window(emb_share=0.5, load=1.0, num_requests=1000, interval_s=1.0, arrival_rate_rps=3000.0,
                emb_lookups_per_request=10.0, kv_recompute_us_per_token=1.0, emb_transfer_us_per_row=1.0)
    _, capped = expected_costs(cur, st, saturation=False)
    _, grown = expected_costs(cur, st, saturation=True)
    assert 1.0 - capped[0] / capped[4] == pytest.approx(40_000 / 60_000)  # tail 44,500 vs 4,500 µs; T 20,000
    assert 1.0 - grown[0] / grown[4] < CurveConfig().move_gain
    for saturation in (False, True):
        out, t = curve_layer(CurveGuard(CurveConfig(saturation=saturation)), cur, st, 0.5, 0.5, GuardConfig())
        assert (out, t.detail["action"]) == (0.1, "jump"), saturation
    # the decision says which cost took it
    policy = constant_policy(tmp_path / "p", 0.5)
    alloc = SmartAllocator(AllocatorConfig(device="cpu", residual=ResidualConfig(enabled=False)), policy_dir=policy)
    alloc.read_curves(cur)
    d = alloc.decide(st, 0.0)
    assert d.emb_share == pytest.approx(0.1) and "the capped queueing cost sees a cliff" in d.reason
    # below saturation the tangent prices nothing differently here, and the capped jump stands as it was
    light = window(emb_share=0.5, load=0.5, num_requests=1000, interval_s=1.0, arrival_rate_rps=500.0,
                   emb_lookups_per_request=10.0, kv_recompute_us_per_token=1.0, emb_transfer_us_per_row=1.0)
    out, t = curve_layer(CurveGuard(CurveConfig(saturation=True)), cur, light, 0.5, 0.5, GuardConfig())
    assert t.detail["action"] == "jump"


@pytest.mark.parametrize("holds_split", [False, True])
def test_the_dead_band_holds_the_split_the_guards_let_through_with_flat_holds_split(tmp_path, holds_split):
    """A base policy that asks for 0.9 where the curve is flat: the curve layer passes its first
    proposal (the curve then not flat, its minimum under ``move_gain``), the step limit lets 0.55
    through, and the curve is flat from then on. The dead band holds the layer's last choice:
    by default the base's 0.9, the proposal itself, which passes and which the guards walk to at
    0.05 an interval across a valley where nothing is gained; with ``flat_holds_split`` the split
    the guards let through, 0.55."""
    policy = constant_policy(tmp_path / "p", 0.9)
    cfg = AllocatorConfig(device="cpu", residual=ResidualConfig(enabled=False),
                          curve=CurveConfig(flat_holds_split=holds_split))
    alloc = SmartAllocator(cfg, policy_dir=policy)
    shares9 = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    sloped = _curves(kv_hit=tuple(0.445 - 0.003125 * i for i in range(9)), emb_hit=(0.5,) * 9, shares=shares9)
    flat = _curves(kv_hit=(0.42,) * 9, emb_hit=(0.5,) * 9, shares=shares9)
    share, out = 0.5, []
    for i in range(6):
        alloc.read_curves(sloped if i == 0 else flat)
        d = alloc.decide(window(emb_share=share, load=0.4, num_requests=1000, interval_s=1.0,
                                emb_lookups_per_request=50.0, kv_recompute_us_per_token=2.0,
                                emb_transfer_us_per_row=1.0), float(i))
        share = d.emb_share
        out.append((round(share, 4), d.layer("curve").detail["action"]))
    assert out[0] == (0.55, "pass")
    if holds_split:
        assert out[1:] == [(0.55, "flat")] * 5
    else:
        assert [s for s, _ in out] == [0.55, 0.6, 0.65, 0.7, 0.75, 0.8]
        assert all(a == "pass" for _, a in out[1:]), out


@pytest.mark.parametrize("paced, load, declined", [(False, 1.0, False), (False, 0.5, True), (True, 1.0, True)])
def test_a_saturated_nodes_burst_cap_is_not_declined_unless_paced(tmp_path, paced, load, declined):
    """A burst where the curve is flat (the cap would save nothing by it): below saturation, or
    with ``paced``, the cap is declined and the base's 0.6 stands; on a saturated node with
    ``paced`` off (the default) the cap is taken, at once (the curves' histograms still hold the
    reuse from before the burst)."""
    from node_agent.allocator import RecoveryConfig

    policy = constant_policy(tmp_path / "p", 0.6)
    cfg = AllocatorConfig(device="cpu", residual=ResidualConfig(enabled=False),
                          recovery=RecoveryConfig(warmup_s=0.0, paced=paced))
    alloc = SmartAllocator(cfg, policy_dir=policy)
    flat = _curves(kv_hit=(0.5,) * 5, emb_hit=(0.5,) * 5, shares=(0.1, 0.3, 0.5, 0.7, 0.9))
    for i, (rate, hot) in enumerate([(1000.0, 0.02)] * 3 + [(4000.0, 0.12)]):
        alloc.read_curves(flat)
        d = alloc.decide(window(emb_share=0.6, load=load, arrival_rate_rps=rate, hot_user_ratio=hot), float(i))
    rec = d.layer("recovery").detail
    assert rec["event"] == "entered" and rec["cap"] == pytest.approx(0.45)
    assert rec["cap_declined"] is declined
    assert d.emb_share == pytest.approx(0.6 if declined else 0.45)
