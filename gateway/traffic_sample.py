"""Traffic samples: what a gateway keeps of its requests for a what-if replay, with every id hashed.

Per sampled request (`Sampler.record`): the time, a keyed hash of the user id, the history
length, the history's most recent ``max_items`` item ids, the new items and the explicit
candidates (each list capped at ``max_items``), all hashed with the same key, so an item's reuse
across requests and users is kept and its id is not; the candidate count, the node chosen and the
status the client got. The gateway sends them in batches to ``POST
/api/v1/gateways/{gateway_id}/samples`` (`gateway.uplink.Uplink.send_samples`).

**Keyed hash** (`KeyedHash`): HMAC-SHA256(key, domain || id as 8 bytes little-endian two's
complement), its first 8 bytes read as a little-endian signed int64 (SQL BIGINT). The domains
(``racer-user\\0``, ``racer-item\\0``) keep a user and an item with the same number apart. The
key is the operator's (``--sample-key-file`` / ``$RACER_SAMPLE_KEY``, at least 16 characters), the
same on every gateway: a user hashes alike whichever gateway serves it, and without the key the
hashes cannot be tested against guessed ids.

**Sampling by user**, never by request (SHARDS-style spatial sampling): a user is sampled iff
``(user_hash mod 2^32) < rate * 2^32``, and then every request of the user is kept. A row sample
would keep 1 in 10 of each user's requests and dilute the reuse a replay measures about tenfold;
a user sample keeps each sampled user's reuse whole, and the fraction of users is the rate.

**Cost on the request path**: one HMAC of the user id per request (about 1 µs; none at rate 0);
a sampled request's id lists are sliced (C-level list slices, a few µs), nothing more. The ids are
converted and hashed later, in the sender's batches (`Sampler.prepare`): ``np.unique`` over the
whole batch, a sorted cache of ids already hashed (`np.searchsorted`), one HMAC per id never
seen, the event loop yielded every `HASH_SLICE` of them. Raw ids live only in the gateway's memory
until then (seconds), and are never logged or sent.

**Bounded**: at most ``max_pending`` samples and ``max_pending_bytes`` of ids wait (hashed or
not); past either the oldest is dropped and counted (``on_drop``; the gateway's
``racer_gateway_samples_dropped_total``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from common.contract import MAX_SAMPLE_CANDIDATES, MAX_SAMPLE_HISTORY_LEN, MAX_SAMPLE_ITEMS

SAMPLE_KEY_ENV = "RACER_SAMPLE_KEY"
MIN_KEY_CHARS = 16
#: the gateway's default cap on each list it keeps (the history's most recent ids)
DEFAULT_SAMPLE_MAX_ITEMS = 1024
#: samples waiting in a gateway, and the memory their ids take (8 bytes an id once hashed, about
#: `RAW_ID_BYTES` before), at most
MAX_PENDING_SAMPLES = 20_000
MAX_PENDING_SAMPLE_BYTES = 64 * 2**20
RAW_ID_BYTES = 40
#: ids hashed between two yields to the event loop (about 1 ms), and samples prepared at once
HASH_SLICE = 1024
PREPARE_CHUNK = 32
#: ids whose hashes are kept for the next batches (16 MB); past it the cache starts again
HASH_CACHE_ENTRIES = 1 << 20

USER_DOMAIN = b"racer-user\0"
ITEM_DOMAIN = b"racer-item\0"
_EMPTY = np.empty(0, dtype=np.int64)


def sample_key(text: str | None) -> bytes | None:
    """The key bytes of ``text`` (None: none given); ValueError when it is too short to be secret."""
    if text is None:
        return None
    if len(text) < MIN_KEY_CHARS:
        raise ValueError(f"the sample key must have at least {MIN_KEY_CHARS} characters (a random secret, the same "
                         f"on every gateway), got {len(text)}")
    return text.encode()


class KeyedHash:
    """HMAC-SHA256 of ids under one key, truncated to signed int64 (see the module docstring).

    The HMAC's inner and outer SHA-256 states are keyed once (RFC 2104) and copied per id: about
    1 µs per id, half of `hmac.digest`'s cost; checked against `hmac.digest` at construction."""

    def __init__(self, key: bytes) -> None:
        if not key:
            raise ValueError("a keyed hash needs a key")
        k = hashlib.sha256(key).digest() if len(key) > 64 else key
        k = k.ljust(64, b"\0")
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in k))
        inner = hashlib.sha256(bytes(b ^ 0x36 for b in k))
        self._user = inner.copy()
        self._user.update(USER_DOMAIN)
        self._item = inner.copy()
        self._item.update(ITEM_DOMAIN)
        probe = (12345).to_bytes(8, "little", signed=True)
        if self._one(self._item, probe) != hmac.digest(key, ITEM_DOMAIN + probe, "sha256")[:8]:
            raise AssertionError("the keyed hash is not HMAC-SHA256")  # never: RFC 2104, spelt out

    def _one(self, inner, data: bytes) -> bytes:
        i = inner.copy()
        i.update(data)
        o = self._outer.copy()
        o.update(i.digest())
        return o.digest()[:8]

    def user(self, user_id: int) -> int:
        """The user's hash, a signed int64."""
        return int.from_bytes(self._one(self._user, user_id.to_bytes(8, "little", signed=True)), "little",
                              signed=True)

    def item(self, item_id: int) -> int:
        return int.from_bytes(self._one(self._item, item_id.to_bytes(8, "little", signed=True)), "little",
                              signed=True)

    def items(self, ids: np.ndarray) -> np.ndarray:
        """The hashes of int64 ``ids``, one HMAC each (no cache)."""
        raw = memoryview(np.ascontiguousarray(ids, dtype="<i8").tobytes())
        out = bytearray(len(raw))
        one, inner = self._one, self._item
        for k in range(0, len(raw), 8):
            out[k:k + 8] = one(inner, raw[k:k + 8])
        return np.frombuffer(bytes(out), dtype="<i8").astype(np.int64)


def sampled(user_hash: int, rate: float) -> bool:
    """Whether a user with this hash is sampled at ``rate`` (all its requests, or none)."""
    return (user_hash & 0xFFFFFFFF) < _threshold(rate)


def _threshold(rate: float) -> int:
    if not (isinstance(rate, (int, float)) and 0.0 <= rate <= 1.0):
        raise ValueError(f"the sample rate must be in [0, 1], got {rate!r}")
    return int(math.floor(rate * 2**32))


@dataclass
class _Raw:
    """A sampled request whose item ids are not hashed yet (in memory only)."""
    seq: int
    ts_s: float
    user_hash: int
    history_len: int
    items: list
    new_items: list
    candidates: list
    num_candidates: int | None
    node_id: str | None
    status: int | None


def _raw_bytes(r: _Raw) -> int:
    """Memory of a sample not hashed yet: its lists hold the request's int objects (8 + 32 bytes an id)."""
    return 200 + RAW_ID_BYTES * (len(r.items) + len(r.new_items) + len(r.candidates))


def _ready_bytes(row: dict) -> int:
    return 200 + 8 * (len(row["items"]) + len(row["new_items"]) + len(row["candidates"]))


def _part(v, cap: int, tail: bool) -> list | None:
    """At most ``cap`` of the ids in list ``v`` (the last ones with ``tail``): a C-level slice, the
    ids' conversion waits for the sender; None when ``v`` is not a list."""
    if not v:
        return []
    if not isinstance(v, list):
        return None
    return v if len(v) <= cap else (v[-cap:] if tail else v[:cap])


def _int64(v: list) -> np.ndarray | None:
    """``v`` as int64 ids; None when it is not a list of integers that fit."""
    try:
        return np.fromiter(v, dtype=np.int64, count=len(v))
    except (TypeError, ValueError, OverflowError):
        return None


class Sampler:
    """A gateway's traffic sampler and its bounded buffer (see the module docstring).

    ``pick`` (every request) says whether the user is sampled; ``record`` keeps a sampled
    request; ``prepare`` (the sender, every interval) hashes the ids of what was recorded; ``peek``,
    ``body`` and ``pop`` / ``drop`` hand the hashed samples to the sender, oldest first. ``on_drop(n,
    reason)`` is told of every sample dropped (``buffer_full`` or the sender's ``refused``)."""

    def __init__(self, key: bytes, rate: float, *, max_items: int = DEFAULT_SAMPLE_MAX_ITEMS,
                 max_pending: int = MAX_PENDING_SAMPLES, max_pending_bytes: int = MAX_PENDING_SAMPLE_BYTES,
                 on_drop: Callable[[int, str], None] | None = None, clock: Callable[[], float] = time.time,
                 seq0: int | None = None, cache_entries: int = HASH_CACHE_ENTRIES) -> None:
        if not 1 <= max_items <= MAX_SAMPLE_ITEMS:
            raise ValueError(f"max_items must be in [1, {MAX_SAMPLE_ITEMS}], got {max_items!r}")
        self.hash = KeyedHash(key)
        self.rate = float(rate)
        self._threshold = _threshold(rate)
        self.max_items = int(max_items)
        self.max_pending = int(max_pending)
        self.max_pending_bytes = int(max_pending_bytes)
        self.on_drop = on_drop
        self.clock = clock
        # per sample, idempotent at the control plane on (gateway_id, seq); µs at start, so a
        # restarted gateway's numbers stay above the last run's unless it sampled over 1 per µs
        self.seq = int(clock() * 1e6) if seq0 is None else int(seq0)
        self._raw: collections.deque[_Raw] = collections.deque()
        self._ready: collections.deque[dict] = collections.deque()
        self._bytes = 0  # what the samples waiting hold (`_raw_bytes`, `_ready_bytes`)
        self._cache_keys = _EMPTY
        self._cache_vals = _EMPTY
        self.cache_entries = int(cache_entries)
        self.num_recorded = 0
        self.num_skipped = 0  # sampled requests whose ids were not lists of int64 integers
        self.dropped: collections.Counter = collections.Counter()
        self.hashed_ids = 0  # HMACs of item ids (cache misses)

    # ------------------------------------------------------------------- request path ---
    def pick(self, user_id: int) -> int | None:
        """The user's hash when the user is sampled, else None."""
        h = self.hash.user(user_id)
        return h if (h & 0xFFFFFFFF) < self._threshold else None

    def record(self, user_hash: int, body: dict, *, node_id: str | None, status: int | None,
               ts_s: float | None = None) -> bool:
        """Keep one request of a sampled user (``body``: the parsed request; its id lists are sliced,
        not copied id by id; ``ts_s``: when it arrived, wall s, default now); False when they are
        not lists (nothing kept)."""
        cap = self.max_items
        history = body.get("history") or []
        items = _part(history, cap, True)
        new = _part(body.get("new_items"), cap, False)
        cands_in = body.get("candidates")
        cands = _part(cands_in, cap, False)
        if items is None or new is None or cands is None:
            self.num_skipped += 1
            return False
        if isinstance(cands_in, list) and cands_in:
            num_cands = min(len(cands_in), MAX_SAMPLE_CANDIDATES)
        else:
            n = body.get("num_candidates")
            num_cands = n if type(n) is int and 1 <= n <= MAX_SAMPLE_CANDIDATES else None
        r = _Raw(self.seq, self.clock() if ts_s is None else ts_s, user_hash,
                 min(len(history), MAX_SAMPLE_HISTORY_LEN), items, new, cands, num_cands, node_id, status)
        self.seq += 1
        self._raw.append(r)
        self._bytes += _raw_bytes(r)
        self.num_recorded += 1
        if len(self._raw) + len(self._ready) > self.max_pending or self._bytes > self.max_pending_bytes:
            self._bound()
        return True

    # ------------------------------------------------------------------------- sender ---
    @property
    def pending(self) -> int:
        return len(self._raw) + len(self._ready)

    @property
    def ready(self) -> int:
        return len(self._ready)

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def _bound(self) -> None:
        """Drop the oldest samples (hashed first: they are older) until both bounds hold."""
        n = 0
        while (self._raw or self._ready) and (len(self._raw) + len(self._ready) > self.max_pending
                                             or self._bytes > self.max_pending_bytes):
            if self._ready:
                self._bytes -= _ready_bytes(self._ready.popleft())
            else:
                self._bytes -= _raw_bytes(self._raw.popleft())
            n += 1
        if n:
            self._dropped(n, "buffer_full")

    def _dropped(self, n: int, reason: str) -> None:
        self.dropped[reason] += n
        if self.on_drop is not None:
            self.on_drop(n, reason)

    async def prepare(self) -> int:
        """Hash the item ids of the samples recorded so far, `PREPARE_CHUNK` samples at a time
        (yielding to the event loop between chunks, and every `HASH_SLICE` new ids); they join the
        samples ready to send, oldest first. Returns how many."""
        todo, done = len(self._raw), 0
        while todo > 0 and self._raw:
            chunk = [self._raw.popleft() for _ in range(min(PREPARE_CHUNK, todo, len(self._raw)))]
            todo -= len(chunk)
            self._bytes -= sum(_raw_bytes(r) for r in chunk)
            try:
                done += await self._prepare(chunk)
            except BaseException:  # cancelled (the gateway stops): back where it was, for the last flush
                self._raw.extendleft(reversed(chunk))
                self._bytes += sum(_raw_bytes(r) for r in chunk)
                raise
            self._bound()
            if todo > 0:
                await asyncio.sleep(0)
        return done

    async def _prepare(self, raws: list[_Raw]) -> int:
        arrays, kept = [], []
        for r in raws:
            a = [_int64(r.items), _int64(r.new_items), _int64(r.candidates)]
            if any(x is None for x in a):
                self.num_skipped += 1
                continue
            arrays += a
            kept.append(r)
        flat = np.concatenate(arrays) if arrays else _EMPTY
        uniq, inv = np.unique(flat, return_inverse=True)
        hashed = (await self._lookup(uniq))[inv.reshape(-1)]
        pos = 0
        for r in kept:
            row = {"seq": r.seq, "ts_s": r.ts_s, "user_hash": r.user_hash, "history_len": r.history_len}
            for name in ("items", "new_items", "candidates"):
                n = len(getattr(r, name))
                row[name] = hashed[pos:pos + n]
                pos += n
            row.update(num_candidates=r.num_candidates, node_id=r.node_id, status=r.status)
            self._ready.append(row)
            self._bytes += _ready_bytes(row)
        return len(kept)

    async def _lookup(self, uniq: np.ndarray) -> np.ndarray:
        """Hashes of sorted distinct ids ``uniq``: the cache's, and one HMAC for each id not in it."""
        out = np.empty(len(uniq), dtype=np.int64)
        keys, vals = self._cache_keys, self._cache_vals
        if len(keys):
            pos = np.minimum(np.searchsorted(keys, uniq), len(keys) - 1)
            hit = keys[pos] == uniq
            out[hit] = vals[pos[hit]]
        else:
            hit = np.zeros(len(uniq), dtype=bool)
        miss = uniq[~hit]
        if len(miss):
            parts = []
            for k in range(0, len(miss), HASH_SLICE):
                parts.append(self.hash.items(miss[k:k + HASH_SLICE]))
                if k + HASH_SLICE < len(miss):
                    await asyncio.sleep(0)
            mh = np.concatenate(parts)
            out[~hit] = mh
            self.hashed_ids += len(miss)
            keys, vals = self._cache_keys, self._cache_vals  # unchanged: one sender at a time
            if len(keys) + len(miss) > self.cache_entries:
                self._cache_keys, self._cache_vals = miss[-self.cache_entries:], mh[-self.cache_entries:]
            else:
                at = np.searchsorted(keys, miss)
                self._cache_keys, self._cache_vals = np.insert(keys, at, miss), np.insert(vals, at, mh)
        return out

    def peek(self, max_samples: int, max_bytes: int) -> list[dict]:
        """The oldest ready samples (their id lists int64 arrays): at most ``max_samples``, and
        about ``max_bytes`` of JSON (always one)."""
        out, size = [], 0
        for row in self._ready:
            est = 200 + 21 * (len(row["items"]) + len(row["new_items"]) + len(row["candidates"]))
            if out and (len(out) >= max_samples or size + est > max_bytes):
                break
            out.append(row)
            size += est
        return out

    @staticmethod
    def as_json(row: dict) -> dict:
        """A ready sample as the JSON object the control plane takes."""
        return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in row.items()}

    @staticmethod
    async def body(rows: list[dict]) -> bytes:
        """``{"samples": [...]}`` of ``rows`` (from `peek`), encoded one sample at a time and
        yielding to the event loop every few (1,000 ids take about 0.1 ms to write as JSON)."""
        parts = []
        for k, row in enumerate(rows):
            parts.append(json.dumps(Sampler.as_json(row), separators=(",", ":")))
            if k % 8 == 7 and k + 1 < len(rows):
                await asyncio.sleep(0)
        return ('{"samples":[' + ",".join(parts) + "]}").encode()

    def pop(self, rows: list[dict]) -> int:
        """Forget ``rows`` (a `peek`, sent): those still at the front; the bound may have dropped
        some while they were on their way. Returns how many were still there."""
        ids = {id(r) for r in rows}
        n = 0
        while self._ready and id(self._ready[0]) in ids:
            self._bytes -= _ready_bytes(self._ready.popleft())
            n += 1
        return n

    def drop(self, rows: list[dict], reason: str) -> None:
        """Forget ``rows`` (a `peek`) and count them dropped (refused for good)."""
        n = self.pop(rows)
        if n:
            self._dropped(n, reason)

    def describe(self) -> dict:
        return {"rate": self.rate, "max_items": self.max_items, "recorded": self.num_recorded,
                "skipped": self.num_skipped, "pending": self.pending, "pending_bytes": self._bytes,
                "dropped": dict(self.dropped),
                "hashed_ids": self.hashed_ids, "cached_ids": int(len(self._cache_keys))}
