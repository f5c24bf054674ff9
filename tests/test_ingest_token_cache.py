"""The control plane's token cache (`control_plane.auth.TokenCache`) and the ingest writer's
shared commits (`control_plane.ingest.IngestWriter`).

Requests find their token in the cache without I/O; one refresh re-reads every cached token and
drops the revoked; a revocation made by this process holds even against a read that began
before it; an entry nobody could confirm ages out. Batches arriving within the writer's linger
share one commit, and each still gets its own stored/duplicate counts."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError

from control_plane.auth import TokenCache
from db.engine import make_engine, session_factory, upgrade
from db import queries
from db.models import Node, Token

ADMIN = "test-admin-token-cache"


@pytest.fixture()
def db(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'cp.db'}")
    upgrade(engine)
    yield session_factory(engine)
    engine.dispose()


def _token(factory, secret: str, role: str = "node", node_id: str | None = "n1") -> int:
    with factory.begin() as s:
        return queries.add_token(s, name=secret, role=role, secret=secret, now_s=1.0, node_id=node_id).id


def _revoke_elsewhere(factory, token_id: int) -> None:
    """What another replica (or `racer token revoke`) does: the row changes, this cache is not told."""
    with factory.begin() as s:
        s.execute(update(Token).where(Token.id == token_id).values(revoked=True))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_cached_token_revoked_elsewhere_is_dropped_by_the_next_refresh_and_others_stay(db):
    a, b = _token(db, "secret-a"), _token(db, "secret-b", node_id="n2")
    cache = TokenCache(db, refresh_s=5.0, clock=Clock())
    assert cache.lookup("secret-a").token_id == a and cache.lookup("secret-b").token_id == b
    _revoke_elsewhere(db, a)
    assert cache.cached("secret-a").token_id == a  # until the refresh: at most refresh_s
    assert cache.refresh() == {"confirmed": 1, "dropped": 1}
    assert cache.cached("secret-a") is None and cache.lookup("secret-a") is None
    assert cache.cached("secret-b").node_id == "n2"


def test_an_entry_nobody_confirmed_for_max_age_is_read_again(db):
    a = _token(db, "secret-a")
    clock = Clock()
    cache = TokenCache(db, refresh_s=5.0, clock=clock)
    assert cache.max_age_s == 10.0
    assert cache.lookup("secret-a").token_id == a
    _revoke_elsewhere(db, a)
    clock.t += 9.9  # no refresh ran (the database was unreachable, say): still trusted
    assert cache.cached("secret-a") is not None
    clock.t += 0.1
    assert cache.cached("secret-a") is None
    assert cache.lookup("secret-a") is None  # read again: revoked


class _RevokeDuringRead:
    """A session factory whose next session, when opened, first runs ``during`` (a revocation
    arriving while a lookup or a refresh reads the database)."""

    def __init__(self, factory) -> None:
        self.factory, self.during = factory, None

    def __call__(self, **kw):
        during, self.during = self.during, None
        if during is not None:
            during()
        return self.factory(**kw)


def test_a_local_revocation_is_not_undone_by_a_read_that_began_before_it(db):
    a = _token(db, "secret-a")
    factory = _RevokeDuringRead(db)
    cache = TokenCache(factory, refresh_s=5.0, clock=Clock())
    # a lookup reads the token, valid then; the revocation lands before the lookup stores it
    factory.during = lambda: cache.forget_id(a)
    assert cache.lookup("secret-a").token_id == a  # that request began before the revocation
    assert cache.cached("secret-a") is None  # but the token is not cached
    # a refresh reads it valid; the node's tokens are revoked here meanwhile: not put back
    assert cache.lookup("secret-a").token_id == a
    factory.during = lambda: cache.forget_node("n1")
    assert cache.refresh() == {"confirmed": 0, "dropped": 0}
    assert cache.cached("secret-a") is None


def test_revocations_over_http_and_by_another_process_on_a_running_control_plane(tmp_path):
    from control_plane.api import create_app
    from control_plane.settings import Settings

    url = f"sqlite:///{tmp_path / 'cp.db'}"
    app = create_app(Settings(database_url=url, scheduler=False, admin_token=ADMIN, token_refresh_s=3600.0),
                     clock=lambda: 2000.0)
    with TestClient(app) as c:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        made = [c.post("/api/v1/tokens", json={"role": "viewer", "name": f"v{i}"}, headers=admin).json()
                for i in range(2)]
        heads = [{"Authorization": f"Bearer {m['token']}"} for m in made]
        assert [c.get("/api/v1/whoami", headers=h).status_code for h in heads] == [200, 200]
        # over HTTP on this process: at once
        assert c.post(f"/api/v1/tokens/{made[0]['id']}/revoke", json={"reason": "x"}, headers=admin).status_code == 200
        assert c.get("/api/v1/whoami", headers=heads[0]).status_code == 401
        # by another process: at the next refresh (here its period is an hour, so the test runs it)
        other = make_engine(url)
        with session_factory(other).begin() as s:
            s.execute(update(Token).where(Token.id == made[1]["id"]).values(revoked=True))
        other.dispose()
        assert c.get("/api/v1/whoami", headers=heads[1]).status_code == 200
        assert app.state.tokens.refresh()["dropped"] == 1
        assert c.get("/api/v1/whoami", headers=heads[1]).status_code == 401
        assert c.get("/api/v1/whoami", headers=admin).status_code == 200


def _report_row(node_id: str, seq: int) -> dict:
    return dict(node_id=node_id, seq=seq, ts_s=1.0, interval_s=1.0, emb_share=0.5, emb_share_target=0.5,
                received_s=1.0, throughput_rps=10.0, num_requests=10, queue_depth=0.0, refill_bytes=0,
                decision_source=None)


def test_batches_arriving_within_the_linger_share_one_commit_and_keep_their_own_counts(db):
    from control_plane.cp_metrics import ControlPlaneMetrics
    from control_plane.ingest import IngestWriter

    with db.begin() as s:
        for nid in ("w1", "w2", "w3"):
            s.add(Node(node_id=nid, address="http://127.0.0.1:1", device="cpu", cost_profile={}, status="up",
                       registered_at_s=0.0, last_seen_s=0.0, report_interval_s=1.0, num_restarts=0))
    metrics = ControlPlaneMetrics()
    writer = IngestWriter(db, metrics, max_rows=5000, linger_s=1.0)

    async def three():
        return await asyncio.gather(*(writer.submit(nid, [_report_row(nid, q) for q in seqs], [], [],
                                                    (1.0, max(seqs), 0.5, None))
                                      for nid, seqs in (("w1", [0, 1]), ("w2", [0]), ("w3", [5, 6, 7]))))

    try:
        assert asyncio.run(three()) == [(2, 0), (1, 0), (3, 0)]
        # w1's replay and a new report: one stored, one duplicate, in the next commit
        again = asyncio.run(asyncio.wait_for(writer.submit("w1", [_report_row("w1", 1), _report_row("w1", 2)], [], [],
                                                           (1.0, 2, 0.5, None)), 30))
        assert again == (1, 1)
    finally:
        writer.close()
    commits = metrics.ingest_commit_rows.collect()[0].samples
    count = next(x.value for x in commits if x.name.endswith("_count"))
    total = next(x.value for x in commits if x.name.endswith("_sum"))
    assert (count, total) == (2, 8)
    with db() as s:
        assert queries.highest_report_seq(s, "w1") == 2
        assert s.get(Node, "w3").last_report_seq == 7


def test_the_writer_takes_a_fresh_connection_after_a_failed_commit(db):
    from control_plane.cp_metrics import ControlPlaneMetrics
    from control_plane.ingest import IngestWriter

    writer = IngestWriter(db, ControlPlaneMetrics(), linger_s=0.0)
    try:
        with pytest.raises((IntegrityError, sqlite3.IntegrityError)):  # not registered: the foreign key refuses
            asyncio.run(asyncio.wait_for(writer.submit("ghost", [_report_row("ghost", 0)], [], [],
                                                       (1.0, 0, 0.5, None)), 30))
        assert writer._conn is None
        with db.begin() as s:
            s.add(Node(node_id="ghost", address="http://127.0.0.1:1", device="cpu", cost_profile={}, status="up",
                       registered_at_s=0.0, last_seen_s=0.0, report_interval_s=1.0, num_restarts=0))
        assert asyncio.run(asyncio.wait_for(writer.submit("ghost", [_report_row("ghost", 0)], [], [],
                                                          (1.0, 0, 0.5, None)), 30)) == (1, 0)
        assert writer._conn is not None
    finally:
        writer.close()
