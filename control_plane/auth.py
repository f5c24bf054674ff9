"""Bearer tokens with roles ``node``, ``operator``, ``viewer``, ``router``.

Tokens are 256-bit random strings (``secrets.token_urlsafe(32)``), stored as their sha256 (a
slow hash buys nothing for random secrets). ``operator`` may do everything a ``viewer`` may;
``node`` is separate (register, report, directives, confirmations, router registration);
``router`` is what a gateway needs and nothing more (list the nodes, read the weights, register
itself for weight pushes), so a gateway never holds an operator's power. A
missing or unknown token gets 401, a known token of the wrong role 403. Lookups are cached for
``ttl_s`` seconds (a revoked token stops working within that time on other replicas; the replica
that revokes a node's tokens forgets them at once).

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
    def __init__(self, factory, ttl_s: float = 5.0, clock=time.monotonic):
        self.factory, self.ttl_s, self.clock = factory, ttl_s, clock
        self._cache: dict[str, tuple[float, Principal]] = {}
        self._lock = threading.Lock()

    def cached(self, secret: str) -> Principal | None:
        """The cached principal of ``secret`` if fresh (no I/O), else None."""
        hit = self._cache.get(secret)
        if hit is not None and self.clock() - hit[0] < self.ttl_s:
            return hit[1]
        return None

    def lookup(self, secret: str) -> Principal | None:
        now = self.clock()
        with self._lock:
            hit = self._cache.get(secret)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        with self.factory() as s:
            t = queries.token_by_secret(s, secret)
            p = None if t is None else Principal(t.id, t.name, t.role, t.node_id)
        if p is not None:
            with self._lock:
                if len(self._cache) > 10_000:
                    self._cache.clear()
                self._cache[secret] = (now, p)
        return p

    def clear(self) -> None:
        """Forget every cached lookup (the next request of each token reads the database)."""
        with self._lock:
            self._cache.clear()

    def forget_id(self, token_id: int) -> None:
        """Drop the cached lookups of token ``token_id`` (its revocation takes effect here at once)."""
        with self._lock:
            for secret in [k for k, (_t, p) in self._cache.items() if p.token_id == token_id]:
                del self._cache[secret]

    def forget_node(self, node_id: str) -> None:
        """Drop the cached tokens bound to ``node_id`` (their revocation takes effect here at once)."""
        with self._lock:
            for secret in [k for k, (_t, p) in self._cache.items() if p.node_id == node_id]:
                del self._cache[secret]

    async def principal(self, secret: str) -> Principal | None:
        """`lookup` for the event loop: a fresh cache hit without I/O, else the lookup in a thread."""
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
