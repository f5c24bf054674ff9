"""Paged KV block pool over the arena's pages ``[emb_pages, num_pages)`` (vLLM v1 block_pool
style: the pool manages page ids, owners and LRU order; the arena owns the tensor).

A page holds ``page_tokens`` tokens of K and V for every layer; its view is
``[num_layers, 2, page_tokens, num_heads, head_dim]`` (axis 1: 0 = K, 1 = V). Token ``t`` of a
user sits in page ``block_table[t // page_tokens]`` at offset ``t % page_tokens``.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .arena import Arena
from .mrc import KVReuse

FREE = -1  # page_owner of a free KV page
EMB = -2  # page_owner of a page in the EMB slab


@dataclass(frozen=True)
class KVAppend:
    """Result of ``append``: the user's tokens ``[start_token, start_token + num_tokens)`` now
    have pages; ``new_pages`` were allocated for them; ``evicted_users`` were evicted (LRU
    order) to make room."""

    user_id: int
    start_token: int
    num_tokens: int
    new_pages: tuple[int, ...]
    evicted_users: tuple[int, ...]


@dataclass(frozen=True)
class KVRelease:
    """Result of handing the pages ``[from_page, to_page)`` to the EMB slab."""

    from_page: int
    to_page: int
    free_pages_taken: int
    migrated: tuple[tuple[int, int], ...]  # (old page, new page)
    evicted_users: tuple[int, ...]
    bytes_copied: int


@dataclass(frozen=True)
class ResidencyDelta:
    """Net residency changes since the last drain, for the router: ``added`` users now hold KV
    on this node, ``evicted`` users no longer do (each user at most once, in order of change)."""

    added: tuple[int, ...]
    evicted: tuple[int, ...]


@dataclass
class KVPoolStats:
    num_lookups: int = 0
    num_hits: int = 0
    hit_tokens: int = 0
    num_appends: int = 0
    appended_tokens: int = 0
    num_rejected: int = 0  # appends whose user could never fit in the pool
    num_evicted_users: int = 0
    evicted_tokens: int = 0
    num_migrated_pages: int = 0
    bytes_copied: int = 0
    ghost_hits: tuple[int, ...] = ()  # per ghost probe: lookup misses a pool that much larger would have hit
    ghost_hit_tokens: tuple[int, ...] = ()  # per probe: the tokens those users had cached when evicted

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_lookups if self.num_lookups else 0.0


class _UserKV:
    __slots__ = ("block_table", "num_tokens")

    def __init__(self) -> None:
        self.block_table: list[int] = []
        self.num_tokens = 0


class KVPool:
    """Per-user block tables over the KV pages of the arena.

    **Allocation order:** highest-numbered free page first. Pages next to the EMB boundary are
    then the last to fill, so growing the slab usually takes free pages (metadata only).

    **Eviction order:** whole users, least recently used first, where ``lookup`` and ``append``
    count as use. A user's pages are all freed at once (partial KV is worth little: the model
    needs the whole prefix). ``append`` never evicts the user it appends to; a user whose total
    need exceeds the pool is dropped instead (``append`` returns ``None``).

    Page metadata is a numpy ``page_owner`` array (``EMB``, ``FREE`` or the user id). Free pages
    are a *bottom run* ``[kv_start, run_end)`` (all free, next to the boundary) plus a lazy
    max-heap of the free pages above it (stale entries are skipped when popped; freed pages are
    appended and the heap rebuilt only when popped one by one). Pages given
    back by the slab extend the run and pages taken by the slab shorten it, both in O(1), so
    moving the boundary over free pages costs a few slice operations whatever their number.

    **Ghost list** (``config.ghost_probes``): users evicted for space (LRU evictions, also
    those forced by a boundary move) are remembered with their pages, their tokens and the
    pages evicted up to theirs. On a lookup miss of such a user, everything in the pool now and
    everything evicted after it was used more recently, so (LRU's stack property) a pool would
    still hold it if it had ``used + evicted since + its pages`` pages; when that is at most
    a probe's pages (``ghost_pages``) more than the pool has, the miss is a *ghost hit* of that
    probe and ``ghost_hit_tokens`` (its cached tokens then) the recomputation that much more
    memory would have saved.
    Evicted users that came back are counted as still in the way (an undercount), but whole-user
    LRU over users whose K/V grows is not a stack algorithm (a larger pool can evict a different
    user), so ghost hits are estimates that can also exceed a larger pool's extra hits (by up to
    ~12% on simulator-like random sequences). Users dropped by ``evict`` (stale K/V) are not
    ghosts.
    """

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        cfg = arena.config
        self.page_tokens = cfg.kv.page_tokens
        self.page_shape = cfg.kv.page_shape
        self.page_bytes = cfg.page_bytes
        self.num_pages = cfg.num_pages
        self.kv_start = arena.emb_pages
        self.page_owner = np.full(self.num_pages, FREE, dtype=np.int64)
        self.page_owner[: self.kv_start] = EMB
        # Free pages: the "bottom run" [kv_start, run_end) is free and not in the heap; every
        # other free page is in the max-heap ``_heap`` (negated ids; stale entries are skipped).
        self.run_end = self.num_pages
        self._heap: list[int] = []
        self._heap_dirty = False  # entries appended since the last heapify
        self.num_free = self.num_pages - self.kv_start
        self.num_used = 0
        self._users: OrderedDict[int, _UserKV] = OrderedDict()  # LRU first
        self._residency: OrderedDict[int, bool] = OrderedDict()
        self.stats = KVPoolStats()
        self.ghost_pages = cfg.ghost_probe_pages
        self.stats.ghost_hits = self.stats.ghost_hit_tokens = (0,) * len(self.ghost_pages)
        self._evicted_pages = 0  # pages freed by evictions so far
        self._ghosts: OrderedDict[int, tuple[int, int, int]] = OrderedDict()  # user -> (evicted up to it, pages, tokens)
        # the miss-ratio curve (config.miss_curves): the pool's hits at every size, refusals included
        self.reuse = KVReuse(self.num_pages, self.page_tokens) if cfg.miss_curves_on else None

    # ------------------------------------------------------------------------ page lists ---
    def _pop_free(self) -> int:
        """The highest free page: from the heap (pages >= run_end), else the run's top."""
        owner = self.page_owner
        heap = self._heap
        if self._heap_dirty:
            heapq.heapify(heap)
            self._heap_dirty = False
        while heap:
            p = -heapq.heappop(heap)
            if p >= self.run_end and owner[p] == FREE:  # entries below run_end are stale
                return p
        if self.run_end > self.kv_start:
            self.run_end -= 1
            return self.run_end
        raise RuntimeError("kv pool: no free page while num_free > 0")

    def _pop_free_many(self, k: int) -> list[int]:
        """The ``k`` highest free pages, highest first: the same pages, in the same order, as
        ``k`` calls of `_pop_free` (for more than a few pages, one scan of the pages above the
        run instead of ``k`` heap pops, after which the heap is rebuilt without stale entries)."""
        if k <= 4:
            return [self._pop_free() for _ in range(k)]
        hi = np.flatnonzero(self.page_owner[self.run_end:] == FREE) + self.run_end
        take = min(k, len(hi))
        out = hi[len(hi) - take:][::-1].tolist()
        # the heap becomes exactly the free pages above the run that were not taken: negated
        # and in descending page order it is sorted, hence already a heap
        self._heap = (-hi[: len(hi) - take][::-1]).tolist()
        self._heap_dirty = False
        rest = k - len(out)
        if rest:
            if self.run_end - rest < self.kv_start:
                raise RuntimeError("kv pool: no free page while num_free > 0")
            out.extend(range(self.run_end - 1, self.run_end - rest - 1, -1))
            self.run_end -= rest
        return out

    def _push_free(self, pages: list[int]) -> None:
        if len(pages) > 8 or self._heap_dirty:  # heapified when next popped one by one; a scan of
            # the pages above the run (`_pop_free_many`) rebuilds it without a heapify at all
            self._heap.extend([-p for p in pages])
            self._heap_dirty = True
        else:
            for p in pages:
                heapq.heappush(self._heap, -p)
        if len(self._heap) > 2 * self.num_pages + 64:  # drop stale entries
            hi = np.flatnonzero(self.page_owner[self.run_end:] == FREE) + self.run_end
            self._heap = [-int(p) for p in hi]
            self._heap_dirty = True

    def _free_user(self, user_id: int, entry: _UserKV) -> None:
        pages = entry.block_table
        self.page_owner[pages] = FREE
        self._push_free(pages)
        self.num_free += len(pages)
        self.num_used -= len(pages)
        self.stats.num_evicted_users += 1
        self.stats.evicted_tokens += entry.num_tokens
        self._residency[user_id] = False
        self._residency.move_to_end(user_id)

    def _evict_lru(self, protect: int | None) -> int | None:
        for uid in self._users:
            if uid != protect:
                entry = self._users.pop(uid)
                self._free_user(uid, entry)
                if self.ghost_pages:
                    self._add_ghost(uid, len(entry.block_table), entry.num_tokens)
                return uid
        return None

    def _add_ghost(self, user_id: int, pages: int, tokens: int) -> None:
        ghosts = self._ghosts
        ghosts.pop(user_id, None)
        self._evicted_pages += pages
        ghosts[user_id] = (self._evicted_pages, pages, tokens)
        floor = self._evicted_pages - self.ghost_pages[-1] - self.num_pages
        while ghosts:  # drop the ghosts no pool of this arena plus the probe could hold (oldest first)
            uid = next(iter(ghosts))
            if ghosts[uid][0] >= floor:
                break
            del ghosts[uid]

    def _ghost_distance(self, mark: int, pages: int) -> int:
        """Pages beyond the pool's size that LRU would need to still hold a ghost."""
        return self.num_used + (self._evicted_pages - mark) + pages - self.num_kv_pages

    # -------------------------------------------------------------------------- requests ---
    @property
    def num_kv_pages(self) -> int:
        return self.num_pages - self.kv_start

    def lookup(self, user_id: int, history_tokens: int | None = None) -> int:
        """Tokens of ``user_id`` cached here (0: none); a hit makes the user most recent.
        ``history_tokens`` (optional): the request's history length, the miss-ratio curve's
        denominator (without it the curve counts the user's tokens after its append)."""
        if self.reuse is not None:
            self.reuse.lookup(user_id, history_tokens)
        st = self.stats
        st.num_lookups += 1
        entry = self._users.get(user_id)
        if entry is None:
            if self.ghost_pages and user_id in self._ghosts:
                mark, pages, tokens = self._ghosts.pop(user_id)
                d = self._ghost_distance(mark, pages)
                if d <= self.ghost_pages[-1]:
                    hit = [d <= g for g in self.ghost_pages]
                    st.ghost_hits = tuple(a + h for a, h in zip(st.ghost_hits, hit))
                    st.ghost_hit_tokens = tuple(a + tokens * h for a, h in zip(st.ghost_hit_tokens, hit))
            return 0
        self._users.move_to_end(user_id)
        st.num_hits += 1
        st.hit_tokens += entry.num_tokens
        return entry.num_tokens

    def num_tokens(self, user_id: int) -> int:
        """Cached tokens without touching the LRU order."""
        entry = self._users.get(user_id)
        return 0 if entry is None else entry.num_tokens

    def block_table(self, user_id: int) -> tuple[int, ...]:
        entry = self._users.get(user_id)
        return () if entry is None else tuple(entry.block_table)

    def __contains__(self, user_id: int) -> bool:
        return user_id in self._users

    def users_lru(self) -> list[int]:
        """Resident users, least recently used first (the eviction order)."""
        return list(self._users)

    def append(self, user_id: int, num_tokens: int) -> KVAppend | None:
        """Give ``num_tokens`` more tokens of ``user_id`` pages, evicting LRU users if needed.

        Returns ``None`` (and drops the user's KV) when the user's whole history cannot fit in
        the pool even if it were empty; other users are left alone in that case."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if user_id < 0:
            raise ValueError(f"user ids must be >= 0, got {user_id}")
        entry = self._users.get(user_id)
        start = 0 if entry is None else entry.num_tokens
        total = start + num_tokens
        T = self.page_tokens
        need_pages = -(-total // T)
        if self.reuse is not None:
            self.reuse.append(user_id, total, refused=need_pages > self.num_kv_pages)
        if need_pages > self.num_kv_pages:
            self.stats.num_rejected += 1
            if entry is not None:
                del self._users[user_id]
                self._free_user(user_id, entry)
            return None
        have = 0 if entry is None else len(entry.block_table)
        extra = need_pages - have
        evicted: list[int] = []
        while extra > self.num_free:
            victim = self._evict_lru(protect=user_id)
            if victim is None:  # cannot happen: need_pages <= num_kv_pages
                raise RuntimeError("kv pool: no user left to evict")
            evicted.append(victim)
        if entry is None:
            entry = _UserKV()
            self._users[user_id] = entry
            self._residency[user_id] = True
            self._residency.move_to_end(user_id)
        else:
            self._users.move_to_end(user_id)
        new_pages = self._pop_free_many(extra)
        if new_pages:
            self.page_owner[new_pages] = user_id
            entry.block_table.extend(new_pages)
            self.num_free -= extra
            self.num_used += extra
        entry.num_tokens = total
        st = self.stats
        st.num_appends += 1
        st.appended_tokens += num_tokens
        return KVAppend(user_id, start, num_tokens, tuple(new_pages), tuple(evicted))

    def evict(self, user_id: int) -> bool:
        """Drop ``user_id``'s KV; False when it held none."""
        entry = self._users.pop(user_id, None)
        if entry is None:
            return False
        self._free_user(user_id, entry)
        return True

    def drain_residency(self) -> ResidencyDelta:
        """Net residency changes since the last drain (the router applies them idempotently)."""
        added = tuple(u for u, on in self._residency.items() if on)
        evicted = tuple(u for u, on in self._residency.items() if not on)
        self._residency.clear()
        return ResidencyDelta(added, evicted)

    # ------------------------------------------------------------------------ K/V payload ---
    def block_table_tensor(self, user_id: int) -> torch.Tensor:
        """The user's pages as an int64 tensor on the arena's device (for paged kernels that
        index ``arena.kv_pages()``)."""
        return torch.tensor(self.block_table(user_id), dtype=torch.int64, device=self.arena.device)

    def page_views(self, user_id: int) -> list[torch.Tensor]:
        """One view ``[num_layers, 2, page_tokens, num_heads, head_dim]`` per page of the user,
        in token order; writes through them land in the arena."""
        pages = self.arena.kv_pages()
        if pages is None:
            raise RuntimeError("kv pool: metadata-only arena has no K/V tensors")
        return [pages[p] for p in self.block_table(user_id)]

    def write(self, user_id: int, start_token: int, kv: torch.Tensor) -> None:
        """Write ``kv`` ``[num_layers, 2, n, num_heads, head_dim]`` as the user's tokens
        ``[start_token, start_token + n)`` (which must already have pages)."""
        pages = self.arena.kv_pages()
        if pages is None:
            raise RuntimeError("kv pool: metadata-only arena has no K/V tensors")
        L, _, T, H, D = self.page_shape
        n = kv.shape[2]
        if tuple(kv.shape) != (L, 2, n, H, D):
            raise ValueError(f"kv must be [{L}, 2, n, {H}, {D}], got {list(kv.shape)}")
        if start_token < 0 or start_token + n > self.num_tokens(user_id):
            raise ValueError(
                f"tokens [{start_token}, {start_token + n}) outside the user's "
                f"{self.num_tokens(user_id)} cached tokens"
            )
        pos = torch.arange(start_token, start_token + n, device=pages.device)
        bt = self.block_table_tensor(user_id)
        page_idx = bt.index_select(0, torch.div(pos, T, rounding_mode="floor"))
        offs = pos % T
        src = kv.to(device=pages.device, dtype=pages.dtype).permute(2, 0, 1, 3, 4)
        pages[page_idx, :, :, offs] = src  # [n, L, 2, H, D] into (page, offset) per token

    def read(self, user_id: int, num_tokens: int | None = None) -> torch.Tensor:
        """The user's first ``num_tokens`` (default: all cached) tokens as a new contiguous
        tensor ``[num_layers, 2, num_tokens, num_heads, head_dim]``."""
        pages = self.arena.kv_pages()
        if pages is None:
            raise RuntimeError("kv pool: metadata-only arena has no K/V tensors")
        have = self.num_tokens(user_id)
        n = have if num_tokens is None else num_tokens
        if not 0 <= n <= have:
            raise ValueError(f"read {n} tokens of a user with {have} cached")
        L, _, T, H, D = self.page_shape
        bt = self.block_table_tensor(user_id)
        g = pages.index_select(0, bt)  # [m, L, 2, T, H, D]
        g = g.permute(1, 2, 0, 3, 4, 5).reshape(L, 2, bt.numel() * T, H, D)
        return g[:, :, :n].contiguous()

    def read_layers(self, user_id: int,
                    num_tokens: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The user's K and V per layer, each ``[tokens, num_heads, head_dim]`` (the shape of
        ``node_agent.model.hstu.KVState``'s lists)."""
        kv = self.read(user_id, num_tokens)
        return [kv[i, 0] for i in range(kv.shape[0])], [kv[i, 1] for i in range(kv.shape[0])]

    def write_layers(self, user_id: int, start_token: int, k: list[torch.Tensor],
                     v: list[torch.Tensor]) -> None:
        """Write per-layer K and V (each ``[n, num_heads, head_dim]``) at ``start_token``."""
        if len(k) != self.page_shape[0] or len(v) != self.page_shape[0]:
            raise ValueError(f"need K and V for {self.page_shape[0]} layers")
        self.write(user_id, start_token,
                   torch.stack([torch.stack([kk, vv]) for kk, vv in zip(k, v)]))

    # -------------------------------------------------------------------- boundary moves ---
    def release_low_pages(self, to_page: int) -> KVRelease:
        """Hand pages ``[kv_start, to_page)`` to the EMB slab.

        Free pages there move with metadata only. An occupied page is migrated (a device copy,
        counted) into a free page at or above ``to_page``; when there are fewer such free pages
        than occupied pages, least recently used users are evicted whole until there are enough
        (an eviction frees pages on both sides of ``to_page``)."""
        lo = self.kv_start
        if not lo <= to_page <= self.num_pages:
            raise ValueError(f"release to page {to_page} from kv_start {lo}")
        owner = self.page_owner
        rng = owner[lo:to_page]
        evicted: list[int] = []
        while True:
            occupied = int((rng >= 0).sum())
            free_outside = self.num_free - ((to_page - lo) - occupied)
            if occupied <= free_outside:
                break
            victim = self._evict_lru(protect=None)
            if victim is None:
                raise RuntimeError("kv pool: occupied pages but no user to evict")
            evicted.append(victim)
        free_mask = rng == FREE
        taken = int(free_mask.sum())
        rng[free_mask] = EMB
        self.num_free -= taken
        self.kv_start = to_page
        self.run_end = max(self.run_end, to_page)  # the run's pages below to_page are gone
        occ = np.flatnonzero(rng >= 0) + lo
        src = occ.tolist()
        dst = [self._pop_free() for _ in src]
        if src:
            uids = owner[occ]
            owner[dst] = uids
            owner[occ] = EMB
            remap = dict(zip(src, dst))
            for uid in np.unique(uids).tolist():
                entry = self._users[uid]
                entry.block_table = [remap.get(p, p) for p in entry.block_table]
            self.num_free -= len(src)
        migrated = list(zip(src, dst))
        bytes_copied = self.arena.copy_pages(src, dst)
        self.stats.num_migrated_pages += len(migrated)
        self.stats.bytes_copied += bytes_copied
        return KVRelease(lo, to_page, taken, tuple(migrated), tuple(evicted), bytes_copied)

    def accept_pages(self, from_page: int) -> int:
        """Take pages ``[from_page, kv_start)`` back from the EMB slab as free pages."""
        hi = self.kv_start
        if not 0 <= from_page <= hi:
            raise ValueError(f"accept from page {from_page} with kv_start {hi}")
        n = hi - from_page
        if n:
            self.page_owner[from_page:hi] = FREE  # they extend the bottom run down: O(1)
            self.num_free += n
            self.kv_start = from_page
        return n

    # ------------------------------------------------------------------------ invariants ---
    def check_invariants(self) -> list[str]:
        out: list[str] = []
        owner = self.page_owner
        ks = self.kv_start
        if ks != self.arena.emb_pages:
            out.append(f"kv: kv_start {ks} != arena emb_pages {self.arena.emb_pages}")
        if not np.all(owner[:ks] == EMB):
            out.append("kv: a page below kv_start is not EMB")
        if np.any(owner[ks:] == EMB):
            out.append("kv: a page at or above kv_start is marked EMB")
        n_free = int(np.sum(owner == FREE))
        n_used = int(np.sum(owner >= 0))
        if n_free != self.num_free:
            out.append(f"kv: num_free {self.num_free} but {n_free} free pages")
        if n_used != self.num_used:
            out.append(f"kv: num_used {self.num_used} but {n_used} owned pages")
        if ks + self.num_free + self.num_used != self.num_pages:
            out.append(
                f"kv: emb {ks} + used {self.num_used} + free {self.num_free} != {self.num_pages}"
            )
        seen: set[int] = set()
        total = 0
        T = self.page_tokens
        for uid, entry in self._users.items():
            bt = entry.block_table
            if entry.num_tokens < 1 or len(bt) != -(-entry.num_tokens // T):
                out.append(f"kv: user {uid} has {entry.num_tokens} tokens in {len(bt)} pages")
            for p in bt:
                if p in seen:
                    out.append(f"kv: page {p} is in two block tables")
                seen.add(p)
                if owner[p] != uid:
                    out.append(f"kv: page {p} of user {uid} is owned by {owner[p]}")
            total += len(bt)
        if total != n_used:
            out.append(f"kv: block tables hold {total} pages but {n_used} are owned")
        if not ks <= self.run_end <= self.num_pages:
            out.append(f"kv: run_end {self.run_end} outside [{ks}, {self.num_pages}]")
        elif not np.all(owner[ks: self.run_end] == FREE):
            out.append("kv: a page of the bottom free run is not free")
        heap_pages = {-h for h in self._heap}
        above = np.flatnonzero(owner[self.run_end:] == FREE) + self.run_end
        missing = set(above.tolist()) - heap_pages
        if missing:
            out.append(f"kv: free pages missing from the free heap: {sorted(missing)[:5]}")
        return out
