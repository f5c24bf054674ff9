"""Memory config validation and the arena's page layout (views, copies, metadata-only mode)."""

from __future__ import annotations

import pytest
import torch

from node_agent.memory import Arena, KVLayout, MemoryConfig, RefillConfig

LAYOUT = KVLayout(num_layers=2, num_heads=2, head_dim=4, page_tokens=2)  # 2*2*2*2*4*4 = 256 B


def test_geometry_is_derived_from_the_kv_layout():
    cfg = MemoryConfig(num_pages=8, num_items=10, emb_dim=8, kv=LAYOUT, initial_emb_share=0.25,
                       device="cpu")
    assert LAYOUT.page_shape == (2, 2, 2, 2, 4)
    assert (cfg.page_bytes, cfg.row_bytes, cfg.rows_per_page, cfg.max_rows) == (256, 32, 8, 64)
    assert cfg.pages_for_share(0.3) == 2  # rounds to the nearest page
    assert cfg.pages_for_share(0.32) == 3


@pytest.mark.parametrize("kw", [
    dict(num_pages=0),
    dict(num_items=0),
    dict(initial_emb_share=1.5),
    dict(emb_dim=6),  # 24 B rows do not divide a 256 B page
    dict(emb_dim=128),  # 512 B row > 256 B page
    dict(emb_dtype="int8"),
    dict(max_step_pages=0),
    dict(min_emb_pages=5, min_kv_pages=5),
    dict(popularity_half_life_ids=0),
    dict(device="tpu"),
    dict(device="not a device"),
])
def test_invalid_configs_are_rejected(kw):
    base = dict(num_pages=8, num_items=10, emb_dim=8, kv=LAYOUT, device="cpu")
    with pytest.raises(ValueError):
        MemoryConfig(**{**base, **kw})


def test_invalid_layouts_and_refill_configs_are_rejected():
    with pytest.raises(ValueError):
        KVLayout(num_layers=0)
    with pytest.raises(ValueError):
        KVLayout(dtype="float64")
    with pytest.raises(ValueError):
        RefillConfig(limit_bytes_per_s=0)
    with pytest.raises(ValueError):
        RefillConfig(window_s=0)


def test_floors_clamp_the_boundary():
    cfg = MemoryConfig(num_pages=8, num_items=10, emb_dim=8, kv=LAYOUT, min_emb_pages=1,
                       min_kv_pages=2, device="cpu")
    assert cfg.pages_for_share(0.0) == 1
    assert cfg.pages_for_share(1.0) == 6


def test_slab_and_kv_views_share_one_allocation():
    cfg = MemoryConfig(num_pages=4, num_items=10, emb_dim=8, kv=LAYOUT, initial_emb_share=0.5,
                       device="cpu")
    a = Arena(cfg)
    assert a.device.type == "cpu"
    assert (a.emb_pages, a.emb_rows, a.num_kv_pages, a.emb_share) == (2, 16, 2, 0.5)
    assert a.slab().shape == (16, 8)
    assert a.all_rows().shape == (32, 8)
    assert a.kv_pages().shape == (4, 2, 2, 2, 2, 4)
    # slab row r lies in page r // rows_per_page: row 8 is the first row of page 1
    a.slab()[8].fill_(7.0)
    assert a.kv_pages()[1].reshape(-1)[:8].tolist() == [7.0] * 8
    assert a.page_view(1).data_ptr() == a.slab()[8].data_ptr()
    # a page written as KV shows up in the rows past the slab
    a.page_view(3).fill_(2.0)
    assert a.all_rows()[24:32].eq(2.0).all()
    a.set_emb_pages(3)
    assert a.slab().shape == (24, 8)
    assert a.check_invariants() == []
    with pytest.raises(ValueError):
        a.set_emb_pages(5)
    with pytest.raises(IndexError):
        a.page_view(4)


def test_copy_pages_copies_whole_pages_and_counts_bytes():
    cfg = MemoryConfig(num_pages=4, num_items=10, emb_dim=8, kv=LAYOUT, device="cpu")
    a = Arena(cfg)
    a.page_view(2).copy_(torch.arange(64, dtype=torch.float32).view(2, 2, 2, 2, 4))
    assert a.copy_pages([2], [3]) == 256
    assert torch.equal(a.page_view(3), a.page_view(2))
    assert a.copy_pages([], []) == 0


def test_metadata_only_arena_has_no_tensor_but_counts_copies():
    cfg = MemoryConfig(num_pages=4, num_items=10, emb_dim=8, kv=LAYOUT, payload=False,
                       device="cpu")
    a = Arena(cfg)
    assert a.slab() is None and a.kv_pages() is None and a.page_view(0) is None
    assert a.copy_pages([1, 2], [3, 0]) == 512
    assert a.check_invariants() == []


def test_mixed_dtypes_reinterpret_the_same_bytes():
    kv = KVLayout(num_layers=1, num_heads=1, head_dim=8, page_tokens=4, dtype="float16")  # 128 B
    cfg = MemoryConfig(num_pages=2, num_items=4, emb_dim=4, emb_dtype="float32", kv=kv,
                       device="cpu")
    a = Arena(cfg)
    assert cfg.rows_per_page == 8
    assert a.kv_pages().dtype == torch.float16 and a.all_rows().dtype == torch.float32


def test_cuda_requested_without_a_gpu_fails_clearly():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    cfg = MemoryConfig(num_pages=2, num_items=4, emb_dim=8, kv=LAYOUT, device="cuda")
    with pytest.raises(ValueError):
        Arena(cfg)


@pytest.mark.cuda
def test_cuda_arena_is_on_the_gpu():
    cfg = MemoryConfig(num_pages=2, num_items=4, emb_dim=8, kv=LAYOUT, device="auto")
    a = Arena(cfg)
    assert a.device.type == "cuda"
    assert a.kv_pages().is_cuda
