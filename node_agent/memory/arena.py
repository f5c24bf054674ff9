"""The arena: one device allocation cut into fixed-size pages, shared by the EMB slab and the KV
pool.

Layout (``P = num_pages``, ``E = emb_pages``, ``R = rows_per_page``)::

    page:   0 ........ E-1 | E ........................ P-1
            EMB slab        | KV pool
    rows:   0 ...... E*R-1  (one contiguous [E*R, emb_dim] view)

The slab is always the contiguous run of pages ``[0, E)``, so its rows are one ``[E*R, emb_dim]``
view and slab row ``r`` lies in page ``r // R``. The KV pool owns pages ``[E, P)``; KV page ``p``
is the view ``kv_pages()[p]`` of shape ``[num_layers, 2, page_tokens, num_heads, head_dim]``
(index 0 of the second axis is K, 1 is V). Moving the boundary changes only ``E``: no byte moves.

The storage is a flat ``uint8`` tensor reinterpreted per user (``emb_dtype`` rows, ``kv.dtype``
pages). With ``payload=False`` there is no tensor at all (the simulator's metadata-only mode):
every view is ``None`` and copies are only counted. The arena holds only the boundary and the
tensor; which page belongs to whom is the pools' metadata (``EmbCache``, ``KVPool``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .config import MemoryConfig, resolve_device, torch_dtype


class Arena:
    """Owner of the device tensor and of the EMB/KV boundary ``emb_pages``.

    Only the ``MemoryManager`` moves the boundary (``set_emb_pages``), after the pools have
    released or accepted the pages that change sides.
    """

    def __init__(self, config: MemoryConfig) -> None:
        self.config = config
        self.num_pages = config.num_pages
        self.page_bytes = config.page_bytes
        self.rows_per_page = config.rows_per_page
        self.row_bytes = config.row_bytes
        self.emb_dim = config.emb_dim
        self.payload = config.payload
        self.device = resolve_device(config.device) if config.payload else torch.device("cpu")
        self.emb_pages = config.pages_for_share(config.initial_emb_share)
        self._storage: torch.Tensor | None = None
        self._emb_rows: torch.Tensor | None = None
        self._kv_pages: torch.Tensor | None = None
        self._page_bytes_view: torch.Tensor | None = None
        if config.payload:
            self._storage = torch.zeros(
                self.num_pages * self.page_bytes, dtype=torch.uint8, device=self.device
            )
            self._emb_rows = self._storage.view(torch_dtype(config.emb_dtype)).view(
                config.max_rows, config.emb_dim
            )
            self._kv_pages = self._storage.view(torch_dtype(config.kv.dtype)).view(
                self.num_pages, *config.kv.page_shape
            )
            self._page_bytes_view = self._storage.view(self.num_pages, self.page_bytes)

    # -- boundary ----------------------------------------------------------------------------
    @property
    def emb_share(self) -> float:
        return self.emb_pages / self.num_pages

    @property
    def emb_rows(self) -> int:
        return self.emb_pages * self.rows_per_page

    @property
    def num_kv_pages(self) -> int:
        return self.num_pages - self.emb_pages

    def set_emb_pages(self, emb_pages: int) -> None:
        if not 0 <= emb_pages <= self.num_pages:
            raise ValueError(f"emb_pages must be in [0, {self.num_pages}], got {emb_pages}")
        self.emb_pages = emb_pages

    # -- views -------------------------------------------------------------------------------
    def all_rows(self) -> torch.Tensor | None:
        """``[num_pages * rows_per_page, emb_dim]`` over the whole arena; rows past the slab
        (``>= emb_rows``) are KV memory. ``None`` in metadata-only mode."""
        return self._emb_rows

    def slab(self) -> torch.Tensor | None:
        """The EMB slab, ``[emb_rows, emb_dim]`` (a view; ``None`` in metadata-only mode)."""
        return None if self._emb_rows is None else self._emb_rows[: self.emb_rows]

    def kv_pages(self) -> torch.Tensor | None:
        """Every page as KV, ``[num_pages, num_layers, 2, page_tokens, num_heads, head_dim]``.

        Only pages ``>= emb_pages`` are KV; the rest is slab memory. A paged-attention kernel
        takes this tensor plus a block table. ``None`` in metadata-only mode."""
        return self._kv_pages

    def page_view(self, page: int) -> torch.Tensor | None:
        """KV page ``page`` as ``[num_layers, 2, page_tokens, num_heads, head_dim]`` (a view)."""
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} outside [0, {self.num_pages})")
        return None if self._kv_pages is None else self._kv_pages[page]

    # -- copies ------------------------------------------------------------------------------
    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> int:
        """Copy whole pages ``src[i] -> dst[i]`` on the device (one gather + one scatter).
        Returns the bytes copied; counted the same in metadata-only mode (nothing moves)."""
        if len(src) != len(dst):
            raise ValueError("src and dst must have the same length")
        if not src:
            return 0
        if self._page_bytes_view is not None:
            s = torch.as_tensor(list(src), dtype=torch.int64, device=self.device)
            d = torch.as_tensor(list(dst), dtype=torch.int64, device=self.device)
            self._page_bytes_view.index_copy_(0, d, self._page_bytes_view.index_select(0, s))
        return len(src) * self.page_bytes

    def check_invariants(self) -> list[str]:
        out: list[str] = []
        if not 0 <= self.emb_pages <= self.num_pages:
            out.append(f"arena: emb_pages {self.emb_pages} outside [0, {self.num_pages}]")
        if self.payload:
            if self._storage is None or self._storage.numel() != self.num_pages * self.page_bytes:
                out.append("arena: storage missing or of the wrong size")
            elif self._emb_rows is None or self._emb_rows.data_ptr() != self._storage.data_ptr():
                out.append("arena: EMB row view does not start at the arena's first byte")
        elif self._storage is not None:
            out.append("arena: metadata-only arena holds a tensor")
        return out
