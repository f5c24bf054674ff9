"""Bearer tokens with roles ``node``, ``operator``, ``viewer``, ``router``.

Tokens are 256-bit random strings (``secrets.token_urlsafe(32)``), stored as their sha256 (a
slow hash buys nothing for random secrets). ``operator`` may do everything a ``viewer`` may;
``node`` is separate (register, report, directives, confirmations, router registration);
``router`` is what a gateway needs and nothing more (list the nodes, read the weights, register
itself for weight pushes), so a gateway never holds an operator's power. A
missing or unknown token gets 401, a known token of the wrong role 403. Known tokens are cached
(`TokenCache`: re-read together every ``token_refresh_s``, so a token revoked on another replica
stops working within that time; the replica that revokes a token forgets it at once).

A node token is bound to one node id (``Token.node_id``): on the node routes (``/api/v1/nodes/...``:
register, reports, directives, policy confirmations) it acts as that node only
(`node_route_refusal`); a node token bound to no id (made before the binding existed) is refused
there with a 403 that says how to make a bound one. The checks run in `control_plane.gate`
before any body is read.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass

from fastapi import HTTPException, Request

from db import queries

log = logging.getLogger("racer.control_plane.auth")

ROLE_IMPLIES = {"operator": {"operator", "viewer"}, "viewer": {"viewer"}, "node": {"node"}, "router": {"router"}}


@dataclass(frozen=True)
class Principal:
    token_id: int | None
    name: str
    role: str
    node_id: str | None = None  # the node a node token is bound to

    def has(self, role: str) -> bool:
        return role in ROLE_IMPLIES.get(self.role, set())


def node_route_refusal(p: Principal, node_id: str | None) -> str | None:
    """Why ``p`` may not call a node route for ``node_id`` (None: the route names no node yet, as
    registration, whose body names it), or None when it may. Only node tokens are checked (the
    routes' roles decide who else may call them)."""
    if p.role != "node":
        return None
    if p.node_id is None:
        return (f"node token {p.name!r} is bound to no node id, so it may not act as a node; create a bound one: "
                f"racer token create --role node --node-id ID (or POST /api/v1/tokens with node_id)")
    if node_id is not None and node_id != p.node_id:
        return f"this node token is bound to node {p.node_id!r}; it may not act as node {node_id!r}"
    return None


def new_secret() -> str:
    return "racer_" + secrets.token_urlsafe(32)


# ---- the secret key: outside the database, the root of every router's push token
MIN_SECRET_KEY_CHARS = 32


def load_secret_key(secret_key: str | None, secret_key_file: str | None, sqlite_path: str | None) -> bytes | None:
    """The control plane's secret key: ``secret_key`` (``RACER_SECRET_KEY``), else the file
    ``secret_key_file``, else ``<sqlite_path>.key`` beside a SQLite database file (each made with
    a new random key, mode 0600, when missing); None for another database without either (weight
    pushes are then off: gateways pull). Replicas sharing a database must share the key."""
    import os

    if secret_key:
        if len(secret_key) < MIN_SECRET_KEY_CHARS:
            raise ValueError(f"RACER_SECRET_KEY: at least {MIN_SECRET_KEY_CHARS} characters (a random string)")
        return secret_key.encode()
    path = secret_key_file
    if path is None and sqlite_path and sqlite_path != ":memory:":
        path = sqlite_path + ".key"
    if not path:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        with open(path, "rb") as f:
            key = f.read(4097).strip()
        if len(key) < MIN_SECRET_KEY_CHARS:
            raise ValueError(f"secret key file {path}: shorter than {MIN_SECRET_KEY_CHARS} characters") from None
        return key
    key = secrets.token_hex(32).encode()
    with os.fdopen(fd, "wb") as f:
        f.write(key + b"\n")
    log.warning("secret key made in %s (mode 0600): it derives the routers' push tokens", path)
    return key


def push_token_for(key: bytes, url: str, token_id: int | None) -> str:
    """The bearer the control plane's weight pushes to the router at ``url``, registered by the
    router token ``token_id``, carry: an HMAC of both under the secret key (so the database holds
    no push secret, and another registrant's URL gets another token)."""
    import hashlib
    import hmac

    return "racer_push_" + hmac.new(key, f"router-push\n{url}\n{token_id}".encode(), hashlib.sha256).hexdigest()


class TokenCache:
    """The principals of the tokens this process has seen, by secret: a request finds its token
    here without I/O, and the database is read once per ``refresh_s`` for all of them, not once
    per token.

    - A token not cached yet is looked up on its first request (a worker thread; an unknown or
      revoked token is not cached, so it is read again on its next request).
    - `refresh` re-reads every cached token in one query (per 500) by its sha256 and drops those
      revoked or gone; `start` runs it every ``refresh_s`` on a thread of its own. A token
      revoked by another process (another replica, ``racer token revoke``) therefore stops
      working here within ``refresh_s`` plus one refresh's duration.
    - An entry is trusted for ``max_age_s`` (default twice ``refresh_s``) after the read that last
      confirmed it: while refreshes fail (the database unreachable), each request looks its token
      up again, and fails closed (503) if that fails too. So a revocation elsewhere takes effect
      here within ``max_age_s`` whatever happens.
    - A revocation made by this process (`forget_id`, `forget_node`) takes effect here at once:
      the entry is dropped, and a lookup or refresh that read the token before the revocation
      does not put it back (``_gen`` counts the forgets; a read started under an older count is
      not stored).
    """

    MAX_ENTRIES = 100_000  # past it, the cache is emptied (an attacker's tokens are never cached)

    def __init__(self, factory, refresh_s: float = 5.0, max_age_s: float | None = None, clock=time.monotonic):
        self.factory, self.refresh_s, self.clock = factory, refresh_s, clock
        self.max_age_s = 2 * refresh_s if max_age_s is None else max_age_s
        # secret -> (time of the read that confirmed it, principal, sha256 of the secret)
        self._cache: dict[str, tuple[float, Principal, str]] = {}
        self._lock = threading.Lock()
        self._gen = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def cached(self, secret: str) -> Principal | None:
        """The cached principal of ``secret`` if confirmed within ``max_age_s`` (no I/O), else None."""
        hit = self._cache.get(secret)
        if hit is not None and self.clock() - hit[0] < self.max_age_s:
            return hit[1]
        return None

    def lookup(self, secret: str) -> Principal | None:
        """The principal of ``secret`` from the cache, else from the database (then cached)."""
        p = self.cached(secret)
        if p is not None:
            return p
        now, gen = self.clock(), self._gen
        digest = queries.sha256_text(secret)
        with self.factory() as s:
            rows = queries.valid_tokens_by_sha256(s, [digest])
        if not rows:
            return None
        _sha, tid, name, role, node_id = rows[0]
        p = Principal(tid, name, role, node_id)
        with self._lock:
            if gen == self._gen:  # no revocation here since the read began
                if len(self._cache) >= self.MAX_ENTRIES:
                    self._cache.clear()
                self._cache[secret] = (now, p, digest)
        return p

    def refresh(self) -> dict:
        """Re-read every cached token; drop the revoked and the deleted, confirm the others.
        Returns counts (for tests and logs)."""
        now, gen = self.clock(), self._gen
        with self._lock:
            snapshot = {secret: digest for secret, (_t, _p, digest) in self._cache.items()}
        if not snapshot:
            return {"confirmed": 0, "dropped": 0}
        with self.factory() as s:
            rows = {r[0]: r for r in queries.valid_tokens_by_sha256(s, list(snapshot.values()))}
        confirmed = dropped = 0
        with self._lock:
            for secret, digest in snapshot.items():
                if secret not in self._cache:
                    continue  # forgotten meanwhile
                r = rows.get(digest)
                if r is None:
                    del self._cache[secret]
                    dropped += 1
                elif gen == self._gen:
                    self._cache[secret] = (now, Principal(r[1], r[2], r[3], r[4]), digest)
                    confirmed += 1
        return {"confirmed": confirmed, "dropped": dropped}

    def start(self) -> None:
        """Run `refresh` every ``refresh_s`` on a daemon thread until `stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._refresh_loop, name="racer-token-refresh", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - the entries age out; requests then look up again
                log.warning("token refresh failed: %s: %s", type(e).__name__, str(e)[:300])

    def clear(self) -> None:
        """Forget every cached token (the next request of each reads the database)."""
        with self._lock:
            self._gen += 1
            self._cache.clear()

    def forget_id(self, token_id: int) -> None:
        """Drop the cached token ``token_id`` (its revocation takes effect here at once)."""
        with self._lock:
            self._gen += 1
            for secret in [k for k, (_t, p, _d) in self._cache.items() if p.token_id == token_id]:
                del self._cache[secret]

    def forget_node(self, node_id: str) -> None:
        """Drop the cached tokens bound to ``node_id`` (their revocation takes effect here at once)."""
        with self._lock:
            self._gen += 1
            for secret in [k for k, (_t, p, _d) in self._cache.items() if p.node_id == node_id]:
                del self._cache[secret]

    async def principal(self, secret: str) -> Principal | None:
        """`lookup` for the event loop: a cache hit without I/O, else the lookup in a thread."""
        p = self.cached(secret)
        if p is None:
            import anyio.to_thread

            p = await anyio.to_thread.run_sync(self.lookup, secret)
        return p


def bearer_secret(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, else None."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def bearer(request: Request) -> str | None:
    return bearer_secret(request.headers.get("authorization"))


MISSING_TOKEN = "missing bearer token (Authorization: Bearer <token>)"
UNKNOWN_TOKEN = "unknown or revoked token"


def role_refusal(p: Principal, roles) -> str | None:
    """Why ``p`` may not call a route that accepts ``roles``, or None."""
    if any(p.has(r) for r in roles):
        return None
    return f"role {p.role!r} may not do this (needs {' or '.join(roles)})"


#: where `control_plane.gate` leaves the principal it checked (``request.state``)
PRINCIPAL_STATE = "racer_principal"


class Require:
    """FastAPI dependency: a token with one of ``roles`` (operator implies viewer). Under
    `control_plane.gate` the token was checked before the body was read; this takes the
    principal the gate found (and checks it again when a route is called without the gate)."""

    def __init__(self, *roles: str):
        self.roles = roles

    async def __call__(self, request: Request) -> Principal:
        p = request.scope.get("state", {}).get(PRINCIPAL_STATE)
        if p is None:
            secret = bearer(request)
            if secret is None:
                raise HTTPException(401, MISSING_TOKEN, headers={"WWW-Authenticate": "Bearer"})
            p = await request.app.state.tokens.principal(secret)
            if p is None:
                raise HTTPException(401, UNKNOWN_TOKEN, headers={"WWW-Authenticate": "Bearer"})
        why = role_refusal(p, self.roles)
        if why:
            raise HTTPException(403, why)
        return p


def ensure_admin_token(factory, *, admin_token: str | None, now_s: float) -> str | None:
    """On first start: create the admin operator token (``admin_token`` if given) and return its
    secret (to print once); if an operator token already exists, add ``admin_token`` when it is
    not stored yet and return None."""
    with factory.begin() as s:
        if admin_token:
            row = queries.token_by_secret(s, admin_token, revoked=None)
            if row is None:
                queries.add_token(s, name="admin", role="operator", secret=admin_token, now_s=now_s)
                queries.audit(s, ts_s=now_s, actor="system", action="token.create", target="token:admin",
                              after={"role": "operator", "name": "admin"}, reason="RACER_ADMIN_TOKEN")
            elif row.revoked:  # the revocation stands: the token grants nothing, the server still starts
                others = queries.count_tokens(s, "operator", revoked=False)
                log.warning("RACER_ADMIN_TOKEN is token %d, which was revoked: it grants nothing. %s", row.id,
                            f"{others} other operator token(s) remain." if others else
                            "No operator token remains: create one with `racer token create --role operator`.")
            return None
        if queries.count_tokens(s, "operator"):
            return None
        secret = new_secret()
        queries.add_token(s, name="admin", role="operator", secret=secret, now_s=now_s)
        queries.audit(s, ts_s=now_s, actor="system", action="token.create", target="token:admin",
                      after={"role": "operator", "name": "admin"}, reason="first start")
        return secret
