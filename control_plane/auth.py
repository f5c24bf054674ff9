"""Bearer tokens with roles ``node``, ``operator``, ``viewer``, ``router``.

Tokens are 256-bit random strings (``secrets.token_urlsafe(32)``), stored as their sha256 (a
slow hash buys nothing for random secrets). ``operator`` may do everything a ``viewer`` may;
``node`` is separate (register, report, directives, confirmations, router registration);
``router`` is what a gateway needs and nothing more (list the nodes, read the weights, register
itself for weight pushes), so a gateway never holds an operator's power. A
missing or unknown token gets 401, a known token of the wrong role 403. Lookups are cached for
``ttl_s`` seconds (a revoked token stops working within that time).
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

from fastapi import HTTPException, Request

from db import queries

ROLE_IMPLIES = {"operator": {"operator", "viewer"}, "viewer": {"viewer"}, "node": {"node"}, "router": {"router"}}


@dataclass(frozen=True)
class Principal:
    token_id: int | None
    name: str
    role: str

    def has(self, role: str) -> bool:
        return role in ROLE_IMPLIES.get(self.role, set())


def new_secret() -> str:
    return "racer_" + secrets.token_urlsafe(32)


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
            p = None if t is None else Principal(t.id, t.name, t.role)
        if p is not None:
            with self._lock:
                if len(self._cache) > 10_000:
                    self._cache.clear()
                self._cache[secret] = (now, p)
        return p


def bearer(request: Request) -> str | None:
    h = request.headers.get("authorization")
    if not h:
        return None
    scheme, _, value = h.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


class Require:
    """FastAPI dependency: a token with one of ``roles`` (operator implies viewer)."""

    def __init__(self, *roles: str):
        self.roles = roles

    async def __call__(self, request: Request) -> Principal:
        secret = bearer(request)
        if secret is None:
            raise HTTPException(401, "missing bearer token (Authorization: Bearer <token>)",
                                headers={"WWW-Authenticate": "Bearer"})
        tokens = request.app.state.tokens
        p = tokens.cached(secret)
        if p is None:
            import anyio.to_thread

            p = await anyio.to_thread.run_sync(tokens.lookup, secret)
        if p is None:
            raise HTTPException(401, "unknown or revoked token", headers={"WWW-Authenticate": "Bearer"})
        if not any(p.has(r) for r in self.roles):
            raise HTTPException(403, f"role {p.role!r} may not do this (needs {' or '.join(self.roles)})")
        return p


def ensure_admin_token(factory, *, admin_token: str | None, now_s: float) -> str | None:
    """On first start: create the admin operator token (``admin_token`` if given) and return its
    secret (to print once); if an operator token already exists, add ``admin_token`` when it is
    not stored yet and return None."""
    with factory.begin() as s:
        if admin_token:
            if queries.token_by_secret(s, admin_token) is None:
                queries.add_token(s, name="admin", role="operator", secret=admin_token, now_s=now_s)
                queries.audit(s, ts_s=now_s, actor="system", action="token.create", target="token:admin",
                              after={"role": "operator", "name": "admin"}, reason="RACER_ADMIN_TOKEN")
            return None
        if queries.count_tokens(s, "operator"):
            return None
        secret = new_secret()
        queries.add_token(s, name="admin", role="operator", secret=secret, now_s=now_s)
        queries.audit(s, ts_s=now_s, actor="system", action="token.create", target="token:admin",
                      after={"role": "operator", "name": "admin"}, reason="first start")
        return secret
