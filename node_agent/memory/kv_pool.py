"""Paged KV block pool over the arena's pages ``[emb_pages, num_pages)`` (vLLM v1 block_pool
style: the pool manages page ids, owners and LRU order; the arena owns the tensor).

A page holds ``page_tokens`` tokens of K and V for every layer; its view is
``[num_layers, 2, page_tokens, num_heads, head_dim]`` (axis 1: 0 = K, 1 = V). Token ``t`` of a
user sits in page ``block_table[t // page_tokens]`` at offset ``t % page_tokens``. The pages hold
only K and V: which tokens they are (item ids and timestamps) is recorded beside the block table
(`CachedSequence`), so the pool alone says what a user's pages hold.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .arena import Arena
from .free_pages import EMB, FREE, FreePages
from .ghosts import KVGhostList
from .mrc import KVReuse


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


@dataclass(frozen=True)
class CachedSequence:
    """What the pool holds of one user's sequence (`KVPool.lookup_sequence`).

    ``num_tokens``: the tokens whose K/V the pages hold (0: none); ``items`` / ``ts``: their item
    ids and timestamps, oldest first (views, valid until the user's next append or eviction;
    ``None`` when the pages' tokens were appended without them); ``evicted``: nothing is cached
    because the pool evicted the user's recorded tokens for space (LRU, or a boundary move)."""

    num_tokens: int
    items: np.ndarray | None = None
    ts: np.ndarray | None = None
    evicted: bool = False


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
    """One user's record: its pages, its token count and (optionally) which tokens they are."""

    __slots__ = ("block_table", "num_tokens", "items", "ts")

    def __init__(self) -> None:
        self.block_table: list[int] = []
        self.num_tokens = 0
        self.items: np.ndarray | None = None  # int64 [capacity]: the first num_tokens are recorded
        self.ts: np.ndarray | None = None  # float64 [capacity]

    def record(self, start: int, items: np.ndarray, ts: np.ndarray) -> None:
        """Tokens ``[start, start + len(items))`` get these item ids and timestamps (the earlier
        ones are recorded already)."""
        n = start + len(items)
        cap = 0 if self.items is None else len(self.items)
        if n > cap:
            cap = max(n, 2 * cap, 64)
            ni, nt = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.float64)
            if start:
                ni[:start], nt[:start] = self.items[:start], self.ts[:start]
            self.items, self.ts = ni, nt
        self.items[start:n] = items
        self.ts[start:n] = ts


class TokenRecords:
    """Which tokens the pool's pages hold: the item ids and timestamps of each user's cached
    tokens (kept on the user's block-table entry), and the users evicted while recorded.

    A user's record covers all its cached tokens or none: appended without their ids, a user's
    tokens are no longer recorded. A user evicted while recorded (for space: LRU, a boundary
    move; or by ``evict`` unless told to forget) is remembered until its next lookup or append,
    so that lookup can say its K/V were evicted rather than never cached; `forget` forgets all of
    them, amortised (the pool's owner calls it between batches).
    """

    def __init__(self) -> None:
        self.num_recorded = 0  # users whose tokens are recorded
        self.evicted: set[int] = set()
        self._forget_at = 1024

    def appended(self, entry: _UserKV, start: int, items: np.ndarray | None, ts: np.ndarray | None) -> None:
        """``entry``'s tokens ``[start, entry.num_tokens)`` were just given pages."""
        if items is not None and (start == 0 or entry.items is not None):
            self.num_recorded += entry.items is None
            entry.record(start, items, ts)
        elif entry.items is not None:
            entry.items = entry.ts = None
            self.num_recorded -= 1

    def freed(self, user_id: int, entry: _UserKV, remember: bool) -> None:
        """``user_id``'s pages were freed (``remember``: as an eviction its next lookup tells)."""
        if entry.items is not None:
            self.num_recorded -= 1
            if remember:
                self.evicted.add(user_id)

    def sequence(self, user_id: int, entry: _UserKV | None) -> CachedSequence:
        """What the pool holds of ``user_id``'s sequence (``entry``: its block-table entry, None
        when nothing is cached); a user remembered as evicted is then forgotten."""
        if entry is None:
            evicted = user_id in self.evicted
            if evicted:
                self.evicted.remove(user_id)
            return CachedSequence(0, evicted=evicted)
        n = entry.num_tokens
        if entry.items is None:
            return CachedSequence(n)
        return CachedSequence(n, entry.items[:n], entry.ts[:n])

    def forget(self) -> None:
        """Forget the users evicted while recorded (their next lookup is a plain miss).
        Amortised: only once the recorded and the remembered users together have doubled (plus
        1024) since the last time it forgot them."""
        if self.num_recorded + len(self.evicted) > self._forget_at:
            self.evicted.clear()
            self._forget_at = 2 * self.num_recorded + 1024

    def check_invariants(self, users: dict[int, _UserKV]) -> list[str]:
        out: list[str] = []
        recorded = [u for u, e in users.items() if e.items is not None]
        if len(recorded) != self.num_recorded:
            out.append(f"kv: {len(recorded)} users recorded but the count says {self.num_recorded}")
        for u in recorded:
            e = users[u]
            if len(e.items) < e.num_tokens or len(e.ts) != len(e.items):
                out.append(f"kv: user {u} has {e.num_tokens} tokens but a record of {len(e.items)}")
        if not self.evicted.isdisjoint(users):
            out.append("kv: a user both cached and remembered as evicted")
        return out


class KVPool:
    """Per-user block tables over the KV pages of the arena.

    **Allocation order:** highest-numbered free page first (`FreePages`). Pages next to the EMB
    boundary are then the last to fill, so growing the slab usually takes free pages (metadata
    only).

    **Eviction order:** whole users, least recently used first, where ``lookup`` and ``append``
    count as use. A user's pages are all freed at once (partial KV is worth little: the model
    needs the whole prefix). ``append`` never evicts the user it appends to; a user whose total
    need exceeds the pool is dropped instead (``append`` returns ``None``).

    Page metadata is a numpy ``page_owner`` array (``EMB``, ``FREE`` or the user id).

    **Token records** (`TokenRecords`, ``records``): ``append`` may be given the new tokens' item
    ids and timestamps; the user's entry then says which tokens its pages hold
    (`lookup_sequence`), as vLLM's block table knows its blocks' hashes.

    **Ghost list** (``config.ghost_probes``, `KVGhostList`): users evicted for space are
    remembered with their pages and tokens; a lookup miss of one counts, per probe, as a hit of a
    pool that much larger (``stats.ghost_hits``, ``ghost_hit_tokens``: the recomputation that much
    more memory would have saved). Users dropped by ``evict`` (stale K/V) are not ghosts.
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
        self.free = FreePages(self.page_owner)
        self.num_free = self.num_pages - self.kv_start
        self.num_used = 0
        self._users: OrderedDict[int, _UserKV] = OrderedDict()  # LRU first
        self._residency: OrderedDict[int, bool] = OrderedDict()
        self.records = TokenRecords()
        self.stats = KVPoolStats()
        self.ghosts = KVGhostList(cfg.ghost_probe_pages, self.num_pages)
        self.stats.ghost_hits = self.stats.ghost_hit_tokens = (0,) * len(self.ghosts.pages)
        # the miss-ratio curve (config.miss_curves): the pool's hits at every size, refusals included
        self.reuse = KVReuse(self.num_pages, self.page_tokens) if cfg.miss_curves_on else None

    # --------------------------------------------------------------------------- freeing ---
    def _free_user(self, user_id: int, entry: _UserKV, remember: bool) -> None:
        pages = entry.block_table
        self.page_owner[pages] = FREE
        self.free.push(pages)
        self.num_free += len(pages)
        self.num_used -= len(pages)
        self.stats.num_evicted_users += 1
        self.stats.evicted_tokens += entry.num_tokens
        self._residency[user_id] = False
        self._residency.move_to_end(user_id)
        self.records.freed(user_id, entry, remember)

    def _evict_lru(self, protect: int | None) -> int | None:
        for uid in self._users:
            if uid != protect:
                entry = self._users.pop(uid)
                self._free_user(uid, entry, remember=True)
                if self.ghosts.pages:
                    self.ghosts.add(uid, len(entry.block_table), entry.num_tokens)
                return uid
        return None

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
            if self.ghosts.pages:
                ghost = self.ghosts.probe(user_id, self.num_used, self.num_kv_pages)
                if ghost is not None:
                    hit, tokens = ghost
                    st.ghost_hits = tuple(a + h for a, h in zip(st.ghost_hits, hit))
                    st.ghost_hit_tokens = tuple(a + tokens * h for a, h in zip(st.ghost_hit_tokens, hit))
            return 0
        self._users.move_to_end(user_id)
        st.num_hits += 1
        st.hit_tokens += entry.num_tokens
        return entry.num_tokens

    def lookup_sequence(self, user_id: int, history_tokens: int | None = None) -> CachedSequence:
        """``lookup`` (the same LRU touch and counts), with the tokens recorded for the user. A
        miss of a user evicted for space while recorded says so (``evicted``), once: the pool
        then forgets it."""
        self.lookup(user_id, history_tokens)
        return self.records.sequence(user_id, self._users.get(user_id))

    def recorded_tokens(self, user_id: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Copies of the item ids and timestamps of ``user_id``'s cached tokens (None: nothing
        cached, or not recorded), without touching the LRU order."""
        entry = self._users.get(user_id)
        if entry is None or entry.items is None:
            return None
        n = entry.num_tokens
        return entry.items[:n].copy(), entry.ts[:n].copy()

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

    def append(self, user_id: int, num_tokens: int, items: np.ndarray | None = None,
               ts: np.ndarray | None = None) -> KVAppend | None:
        """Give ``num_tokens`` more tokens of ``user_id`` pages, evicting LRU users if needed.

        ``items`` / ``ts`` (optional, ``num_tokens`` each): the new tokens' item ids and
        timestamps, recorded with the user's pages (`lookup_sequence`); appended without them,
        the user's tokens are no longer recorded. Returns ``None`` (and drops the user's KV) when
        the user's whole history cannot fit in the pool even if it were empty; other users are
        left alone in that case."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if user_id < 0:
            raise ValueError(f"user ids must be >= 0, got {user_id}")
        if items is not None and not len(items) == len(ts) == num_tokens:
            raise ValueError(f"items and ts must give the {num_tokens} new tokens")
        self.records.evicted.discard(user_id)
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
                self._free_user(user_id, entry, remember=False)
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
        new_pages = self.free.pop_many(extra, self.kv_start)
        if new_pages:
            self.page_owner[new_pages] = user_id
            entry.block_table.extend(new_pages)
            self.num_free -= extra
            self.num_used += extra
        entry.num_tokens = total
        self.records.appended(entry, start, items, ts)
        st = self.stats
        st.num_appends += 1
        st.appended_tokens += num_tokens
        return KVAppend(user_id, start, num_tokens, tuple(new_pages), tuple(evicted))

    def evict(self, user_id: int, forget: bool = False) -> bool:
        """Drop ``user_id``'s KV and record; False when it held none. A recorded user is
        remembered as evicted (`lookup_sequence`) unless ``forget`` (K/V its owner found stale)."""
        entry = self._users.pop(user_id, None)
        if entry is None:
            return False
        self._free_user(user_id, entry, remember=not forget)
        return True

    def evict_all(self) -> None:
        """Drop every user's KV and record, least recently used first, and forget the users
        evicted before (K/V computed by other weights)."""
        for u in list(self._users):
            self.evict(u, forget=True)
        self.records.evicted.clear()

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
        self.free.cut_run(to_page)  # the run's pages below to_page are gone
        occ = np.flatnonzero(rng >= 0) + lo
        src = occ.tolist()
        dst = [self.free.pop(self.kv_start) for _ in src]
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
        return out + self.free.check_invariants(ks) + self.records.check_invariants(self._users)
