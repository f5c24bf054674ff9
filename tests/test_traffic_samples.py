"""Traffic samples for a what-if replay: the gateway samples its traffic by user (every request of
the sampled users, none of the others), every id a keyed hash (`gateway.traffic_sample`),
and the control plane stores them (``POST /api/v1/gateways/{gateway_id}/samples``: bound to the
gateway's token, capped, strict) and keeps them for a retention and under a row cap.

- the sampler: HMAC-SHA256 truncated to int64, stable for a key and different across keys; all or
  nothing per user and the fraction of users near the rate; lists capped; the buffer bounded
  (the oldest dropped, counted); the gateway's sender splits a refused batch and drops only what
  is refused alone;
- the route on the real app (SQLite file): another gateway's token gets 403, a batch over the cap
  413, bad input 422 with nothing stored; read back in pages; the retention job's window and cap;
- the database's own bytes hold no raw user or item id;
- real processes (a control plane, a node agent, two gateways): the samples of a gateway at rate 1
  arrive, hashed with its key, naming the node; a gateway at rate 0 sends none.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sqlite3
import time

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from common.contract import MAX_SAMPLE_BATCH, MAX_SAMPLE_ITEMS
from gateway.traffic_sample import KeyedHash, Sampler, sample_key, sampled

from .cp_util import token_maker

ADMIN = "racer_test_admin_traffic_samples"
KEY = b"racer-test-sample-key-0123456789"


def _h64(key: bytes, domain: bytes, x: int) -> int:
    return int.from_bytes(hmac.digest(key, domain + x.to_bytes(8, "little", signed=True), "sha256")[:8], "little",
                          signed=True)


def _prepared(s: Sampler) -> list[dict]:
    """Every sample ``s`` holds, hashed, as the JSON objects the control plane takes."""
    async def run():
        await s.prepare()
        return json.loads(await s.body(s.peek(10**6, 10**12)))["samples"]
    return asyncio.run(run())


# ----------------------------------------------------------------------------------- the sampler ---
def test_keyed_hash_is_hmac_sha256_as_int64_stable_for_a_key_and_different_across_keys():
    h, again, other = KeyedHash(KEY), KeyedHash(KEY), KeyedHash(KEY[::-1])
    for x in (0, 1, 5, 2**40 + 3, 2**63 - 1):
        assert h.user(x) == again.user(x) == _h64(KEY, b"racer-user\0", x)
        assert h.item(x) == _h64(KEY, b"racer-item\0", x)
        assert h.user(x) != other.user(x) and h.item(x) != other.item(x)
        assert h.user(x) != h.item(x)  # a user and an item with the same number stay apart
    ids = np.array([7, -3, 2**62, 7], dtype=np.int64)
    assert h.items(ids).tolist() == [h.item(int(x)) for x in ids]
    assert h.items(ids).dtype == np.int64 and -(2**63) <= min(h.items(ids).tolist())
    assert len({h.user(u) for u in range(10_000)}) == 10_000
    with pytest.raises(ValueError, match="at least 16"):
        sample_key("short")
    assert sample_key(None) is None and sample_key("x" * 16) == b"x" * 16


def test_sampling_is_by_user_all_or_nothing_and_the_fraction_of_users_is_the_rate():
    rate, users = 0.1, 20_000
    s = Sampler(KEY, rate)
    picked = {u for u in range(users) if s.pick(u) is not None}
    # binomial: sd = sqrt(0.1 * 0.9 / 20000) = 0.0021; 4 sd
    assert abs(len(picked) / users - rate) < 0.0085, len(picked) / users
    h = KeyedHash(KEY)
    assert picked == {u for u in range(users) if sampled(h.user(u), rate)}
    assert all((h.user(u) & 0xFFFFFFFF) < rate * 2**32 for u in picked)
    # every request of a sampled user, none of another's: 5 requests each of 2,000 users, interleaved
    s = Sampler(KEY, 0.25)
    for k in range(5):
        for u in range(2000):
            uh = s.pick(u)
            if uh is not None:
                assert s.record(uh, {"user_id": u, "history": [u, k], "new_items": [k]}, node_id="n0", status=200)
    rows = _prepared(s)
    per_user: dict[int, int] = {}
    for r in rows:
        per_user[r["user_hash"]] = per_user.get(r["user_hash"], 0) + 1
    assert set(per_user.values()) == {5} and len(per_user) == len({u for u in range(2000) if s.pick(u) is not None})
    assert abs(len(per_user) / 2000 - 0.25) < 0.04
    # a user sample of 10% keeps each sampled user's reuse whole; the rate's ends: none, all
    assert all(Sampler(KEY, 0.0).pick(u) is None for u in range(1000))
    assert all(Sampler(KEY, 1.0).pick(u) == h.user(u) for u in range(1000))
    with pytest.raises(ValueError):
        Sampler(KEY, 1.5)


def test_lists_are_capped_hashed_with_reuse_kept_and_the_buffer_is_bounded():
    h = KeyedHash(KEY)
    s = Sampler(KEY, 1.0, max_items=4, clock=lambda: 1234.5, seq0=100)
    body = {"user_id": 9, "history": list(range(1000, 1010)), "new_items": [1, 2, 3, 4, 5, 6],
            "candidates": [7, 8, 9, 10, 11]}
    assert s.record(s.pick(9), body, node_id="n1", status=200)
    assert s.record(s.pick(9), {"user_id": 9, "history": list(range(1000, 1012)), "num_candidates": 32},
                    node_id="n2", status=502)
    assert not s.record(s.pick(9), {"user_id": 9, "history": "not a list"}, node_id="n1", status=200)
    a, b = _prepared(s)
    assert (a["seq"], a["ts_s"], a["user_hash"], a["history_len"], a["node_id"], a["status"]) == (
        100, 1234.5, h.user(9), 10, "n1", 200)
    assert a["items"] == [h.item(x) for x in (1006, 1007, 1008, 1009)]  # the history's most recent
    assert a["new_items"] == [h.item(x) for x in (1, 2, 3, 4)] and a["candidates"] == [h.item(x) for x in (7, 8, 9, 10)]
    assert a["num_candidates"] == 5  # the request's whole count, the ids capped
    assert b["items"] == [h.item(x) for x in (1008, 1009, 1010, 1011)] and b["items"][:2] == a["items"][2:]
    assert (b["history_len"], b["candidates"], b["num_candidates"], b["status"]) == (12, [], 32, 502)
    assert s.num_skipped == 1 and s.hashed_ids == 14
    # the same ids again: from the cache, no HMAC
    s.pop(s.peek(10, 10**9))
    s.record(s.pick(9), body, node_id="n1", status=200)
    assert _prepared(s)[0]["items"] == a["items"] and s.hashed_ids == 14
    with pytest.raises(ValueError):
        Sampler(KEY, 1.0, max_items=MAX_SAMPLE_ITEMS + 1)
    # bounded: the oldest go first, counted
    drops: list = []
    s = Sampler(KEY, 1.0, max_pending=3, on_drop=lambda n, why: drops.append((n, why)), seq0=0)
    for u in range(5):
        s.record(s.pick(u), {"user_id": u, "history": [u]}, node_id="n", status=200)
    assert s.pending == 3 and drops == [(1, "buffer_full"), (1, "buffer_full")]
    assert [r["seq"] for r in _prepared(s)] == [2, 3, 4]
    s = Sampler(KEY, 1.0, max_pending_bytes=10_000, seq0=0)
    for u in range(20):
        s.record(s.pick(u), {"user_id": u, "history": list(range(100))}, node_id="n", status=200)
    assert s.pending_bytes <= 10_000 and s.dropped["buffer_full"] == 20 - s.pending
    # a batch on its way while the bound drops it: its answer forgets only what is still there
    s = Sampler(KEY, 1.0, max_pending=4, seq0=0)
    for u in range(4):
        s.record(s.pick(u), {"user_id": u, "history": [u]}, node_id="n", status=200)
    asyncio.run(s.prepare())
    batch = s.peek(3, 10**9)
    for u in range(4, 6):  # two more: the two oldest of the batch go
        s.record(s.pick(u), {"user_id": u, "history": [u]}, node_id="n", status=200)
    assert s.pop(batch) == 1 and [r["seq"] for r in _prepared(s)] == [3, 4, 5]


def test_a_cancelled_preparation_loses_nothing():
    from gateway import traffic_sample

    s = Sampler(KEY, 1.0, seq0=0)
    n = 3 * traffic_sample.PREPARE_CHUNK + 5
    for u in range(n):
        s.record(s.pick(u), {"user_id": u, "history": list(range(u, u + 50))}, node_id="n", status=200)

    async def run():
        task = asyncio.create_task(s.prepare())
        await asyncio.sleep(0)  # it yields between chunks (and within one, every HASH_SLICE new ids)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ready = s.ready
        assert 0 < ready < n and s.pending == n  # the chunk cut short is back where it was
        assert await s.prepare() == n - ready and await s.prepare() == 0

    asyncio.run(run())
    assert sorted(r["seq"] for r in _prepared(s)) == list(range(n)) and s.dropped == {}


def test_the_gateway_refuses_to_sample_without_a_key_and_sends_in_batches_dropping_only_the_refused():
    from gateway.config import GatewayConfig
    from gateway.gateway import Gateway
    from prometheus_client import generate_latest

    cfg = GatewayConfig(sample_rate=1.0)
    with pytest.raises(ValueError, match="needs the samples' key"):
        Gateway([], cfg, control_plane="http://cp", token="tok")
    with pytest.raises(ValueError, match="with --control-plane only"):
        Gateway([], cfg, sample_key=KEY)
    assert Gateway([], GatewayConfig(), control_plane="http://cp").sampler is None  # rate 0: no hashing at all
    for bad in ({"sample_rate": -0.1}, {"sample_rate": 1.01}, {"sample_max_items": 0},
                {"sample_max_items": MAX_SAMPLE_ITEMS + 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GatewayConfig(**bad)

    sent: list[list[dict]] = []
    raw_ids = {7_777_000_000_000 + k for k in range(40)}
    bad_seq = 1012  # the 13th sample: refused (422) whatever batch it is in

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v1/gateways/gw-s/samples"
        assert request.headers["authorization"] == "Bearer tok"
        text = request.content.decode()
        assert not any(str(x) in text for x in raw_ids)  # only hashes leave the gateway
        samples = json.loads(text)["samples"]
        if len(samples) > 8:
            return httpx.Response(413, json={"detail": "body too large"})
        if any(x["seq"] == bad_seq for x in samples):
            return httpx.Response(422, json={"detail": [{"loc": ["body", "samples", 0], "msg": "bad"}]})
        sent.append(samples)
        return httpx.Response(200, json={"stored": len(samples), "duplicates": 0})

    async def run():
        gw = Gateway([], cfg, control_plane="http://cp", token="tok", gateway_id="gw-s", sample_key=KEY)
        gw.client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(503)))
        smp = gw.sampler
        smp.seq = 1000
        for k in range(40):
            smp.record(smp.pick(k), {"user_id": k, "history": [7_777_000_000_000 + k]}, node_id="n0", status=200)
        await gw.send_samples()  # the control plane away: kept
        assert smp.pending == 40 and gw.describe_clients()["samples"]["error"].startswith("503")
        await gw.client.aclose()
        gw.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        await gw.send_samples()  # 413 on 40: halves until 8 or fewer; the 422 one dropped alone
        assert smp.pending == 0 and gw.samples_sent == 39 and smp.dropped["refused"] == 1
        assert gw.describe_clients()["samples"]["sent"] == 39
        await gw.client.aclose()
        return generate_latest(gw.metrics.registry).decode()

    metrics = asyncio.run(run())
    assert sum(len(b) for b in sent) == 39 and all(len(b) <= 8 for b in sent)
    assert sorted(x["seq"] for b in sent for x in b) == [k for k in range(1000, 1040) if k != bad_seq]
    assert 'racer_gateway_samples_dropped_total{reason="refused"} 1.0' in metrics
    assert 'racer_gateway_samples_dropped_total{reason="buffer_full"} 0.0' in metrics
    assert "racer_gateway_samples_sent_total 39.0" in metrics


# ------------------------------------------------------------------------------------- the route ---
@pytest.fixture()
def api(tmp_path):
    from control_plane.api import create_app
    from control_plane.settings import Settings

    now = [2000.0]
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'cp.db'}", scheduler=False, admin_token=ADMIN,
                              max_sample_body_bytes=256 * 2**10), clock=lambda: now[0])
    with TestClient(app) as c:
        yield c, token_maker(c, ADMIN), now, app


ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


def _sample(seq: int, ts: float = 1999.0, **kw) -> dict:
    d = {"seq": seq, "ts_s": ts, "user_hash": -(2**63) + seq, "history_len": 3, "items": [11, -12, 2**63 - 1],
         "new_items": [4], "candidates": [], "num_candidates": 16, "node_id": "n0", "status": 200}
    d.update(kw)
    return d


def _stored(c, **params) -> list[dict]:
    r = c.get("/api/v1/traffic-samples", params={"limit": 5000, **params}, headers=ADMIN_H)
    assert r.status_code == 200, r.text
    return r.json()["samples"]


def test_samples_are_bound_to_the_gateways_token_like_its_reports(api):
    from .test_client_view import _report

    c, token, _, _ = api
    gw, other, viewer, node = token("router"), token("router"), token("viewer"), token("node", node_id="n1")
    url = "/api/v1/gateways/gw-1/samples"
    r = c.post(url, json={"samples": [_sample(1), _sample(2)]}, headers=gw)
    assert r.status_code == 200 and r.json() == {"stored": 2, "duplicates": 0}, r.text
    r = c.post(url, json={"samples": [_sample(2), _sample(3)]}, headers=gw)  # a batch sent again after a lost answer
    assert r.json() == {"stored": 1, "duplicates": 1}
    # another gateway's token may not write gw-1's samples (nor its reports) while gw-1's is valid
    r = c.post(url, json={"samples": [_sample(4)]}, headers=other)
    assert r.status_code == 403 and "another token" in r.json()["detail"]
    assert c.post("/api/v1/gateways/gw-1/reports", json={"reports": [_report(1, 1999.0)]},
                  headers=other).status_code == 403
    for h in (viewer, node):
        assert c.post(url, json={"samples": [_sample(4)]}, headers=h).status_code == 403
    assert c.post(url, json={"samples": [_sample(4)]}).status_code == 401
    # an id claimed by its first report is bound for samples too
    assert c.post("/api/v1/gateways/gw-2/reports", json={"reports": [_report(1, 1999.0)]},
                  headers=other).status_code == 200
    assert c.post("/api/v1/gateways/gw-2/samples", json={"samples": [_sample(1)]}, headers=gw).status_code == 403
    assert c.post("/api/v1/gateways/gw-2/samples", json={"samples": [_sample(9)]}, headers=other).status_code == 200
    assert c.post("/api/v1/gateways/gw-3/samples", json={"samples": [_sample(1)]},
                  headers=ADMIN_H).status_code == 200  # an operator may too
    assert sorted((x["gateway_id"], x["seq"]) for x in _stored(c)) == [
        ("gw-1", 1), ("gw-1", 2), ("gw-1", 3), ("gw-2", 9), ("gw-3", 1)]
    # read back: viewer and operator, not a gateway's token
    assert c.get("/api/v1/traffic-samples", headers=viewer).status_code == 200
    assert c.get("/api/v1/traffic-samples", headers=gw).status_code == 403
    x = _stored(c, gateway_id="gw-1")[0]
    assert x["items"] == [11, -12, 2**63 - 1] and x["user_hash"] == -(2**63) + 1 and x["received_s"] == 2000.0
    assert (x["history_len"], x["new_items"], x["candidates"], x["num_candidates"], x["node_id"], x["status"]) == (
        3, [4], [], 16, "n0", 200)


def test_a_batch_over_the_cap_gets_413_and_bad_input_422_storing_nothing(api):
    c, token, _, _ = api
    h = {**token("router"), "content-type": "application/json"}
    url = "/api/v1/gateways/gw-h/samples"
    big = {"samples": [_sample(k, history_len=4096, items=[2**62 + k] * 4096) for k in range(4)]}  # ~330 KB
    body = json.dumps(big)
    assert 256 * 2**10 < len(body) < 2**20
    r = c.post(url, content=body, headers=h)
    assert r.status_code == 413 and "max_sample_body_bytes" in r.json()["detail"], r.text
    big["samples"][0]["user_hash"] = True  # over the cap: 413 before the body is validated
    assert c.post(url, content=json.dumps(big), headers=h).status_code == 413
    r = c.post(url, content=b'{"samples": [' + b" " * (2**20 + 10) + b"]}", headers=h)  # the gate's cap, the route's
    assert r.status_code == 413 and "max_sample_body_bytes" in r.json()["detail"], r.text
    hostile = [
        {"samples": []},
        {"samples": [_sample(1), _sample(1)]},
        {"samples": [_sample(k) for k in range(MAX_SAMPLE_BATCH + 1)]},
        {"samples": [_sample(1, user_hash=2**63)]},
        {"samples": [_sample(1, user_hash=-(2**63) - 1)]},
        {"samples": [_sample(1, user_hash=True)]},
        {"samples": [_sample(1, user_hash="5")]},
        {"samples": [_sample(1, items=[1.5])]},
        {"samples": [_sample(1, items=["7"])]},
        {"samples": [_sample(1, items=[2**64])]},
        {"samples": [_sample(1, history_len=MAX_SAMPLE_ITEMS + 10, items=[1] * (MAX_SAMPLE_ITEMS + 1))]},
        {"samples": [_sample(1, items=[1, 2, 3, 4])]},  # more ids than the history had
        {"samples": [_sample(1, new_items=[[1]])]},
        {"samples": [_sample(1, candidates=[1, 2, 3], num_candidates=2)]},
        {"samples": [_sample(1, num_candidates=0)]},
        {"samples": [_sample(1, history_len=-1)]},
        {"samples": [_sample(1, history_len=2**31)]},
        {"samples": [_sample(-1)]},
        {"samples": [_sample(1, ts_s=1e12)]},
        {"samples": [_sample(1, ts_s=-1.0)]},
        {"samples": [_sample(1, ts_s=2000.0 + 601)]},  # ahead of the control plane's clock
        {"samples": [_sample(1, status=600)]},
        {"samples": [_sample(1, node_id="bad id")]},
        {"samples": [_sample(1, node_id="")]},
        {"samples": [_sample(1, user_id=5)]},  # a raw id has no field to go in
        {"samples": [{k: v for k, v in _sample(1).items() if k != "user_hash"}]},
        {"samples": "x"}, {"samples": [None]}, [], "null",
    ]
    for bad in hostile:
        r = c.post(url, content=json.dumps(bad), headers=h)
        assert r.status_code == 422, (str(bad)[:200], r.text[:300])
    for raw in (b'{"samples": [{"seq": 1, "ts_s": NaN}]}', b'{"samples": [{"seq": 1, "ts_s": Infinity}]}',
                b'{"samples": [', b"\xff\xfe"):
        assert c.post(url, content=raw, headers=h).status_code == 422
    r = c.post(url, json={"samples": [_sample(1, ts_s=2000.0 + 601)]}, headers=h)
    assert r.json()["detail"][0]["loc"] == ["body", "samples", 0, "ts_s"]
    assert c.post("/api/v1/gateways/bad%20id/samples", json={"samples": [_sample(1)]}, headers=h).status_code == 422
    assert _stored(c) == []
    for q in ({"after_ts_s": 1.0}, {"after_id": 3}, {"limit": 0}, {"limit": 5001}, {"start_s": "x"},
              {"gateway_id": "bad id"}):
        assert c.get("/api/v1/traffic-samples", params=q, headers=ADMIN_H).status_code == 422, q


def test_samples_read_back_in_pages_over_a_window(api):
    c, token, _, _ = api
    h = token("router")
    ts = [1500.0, 1200.0, 1800.0, 1200.0, 1900.0, 1700.0, 1100.0]
    assert c.post("/api/v1/gateways/gw-p/samples", json={"samples": [_sample(k, t) for k, t in enumerate(ts)]},
                  headers=h).json()["stored"] == 7
    got, cursor = [], {}
    while True:
        r = c.get("/api/v1/traffic-samples", params={"limit": 3, "start_s": 1150.0, "end_s": 1900.0, **cursor},
                  headers=ADMIN_H).json()
        got += [(x["ts_s"], x["seq"]) for x in r["samples"]]
        if r["next"] is None:
            break
        cursor = r["next"]
    assert got == [(1200.0, 1), (1200.0, 3), (1500.0, 0), (1700.0, 5), (1800.0, 2)]  # time order, then stored order
    assert _stored(c, gateway_id="gw-other") == []


def test_retention_deletes_old_samples_and_the_oldest_beyond_the_row_cap(api):
    from control_plane.jobs import job_retention
    from control_plane.settings import Settings
    from .test_client_view import _report

    c, token, _, app = api
    h = token("router")
    # stored in this order: seq 0..9 at times 1000..1009, then seq 10, 11 with old times (a late batch)
    samples = [_sample(k, 1000.0 + k) for k in range(10)] + [_sample(10, 1001.5), _sample(11, 1008.5)]
    assert c.post("/api/v1/gateways/gw-r/samples", json={"samples": samples}, headers=h).json()["stored"] == 12
    assert c.post("/api/v1/gateways/gw-r/reports", json={"reports": [_report(1, 1000.0)]}, headers=h).status_code == 200
    factory = app.state.factory
    # kept 500 s: at 1505 everything before 1005 goes (seq 0..4 and the late seq 10)
    out = job_retention(factory, Settings(sample_retention_s=500.0), None, now_s=1505.0)
    assert out["traffic_samples_deleted"] == 6 and out["traffic_samples_over_cap"] == 0
    assert sorted(x["seq"] for x in _stored(c)) == [5, 6, 7, 8, 9, 11]
    assert out["gateway_reports_deleted"] == 0 and out["gateways_deleted"] == 0  # the reports keep their own
    # at most 4 rows: the oldest stored go (5 and 6), whatever their times
    out = job_retention(factory, Settings(sample_retention_s=500.0, sample_max_rows=4), None, now_s=1505.0)
    assert out["traffic_samples_deleted"] == 2 and out["traffic_samples_over_cap"] == 2
    assert sorted(x["seq"] for x in _stored(c)) == [7, 8, 9, 11]
    out = job_retention(factory, Settings(sample_retention_s=500.0, sample_max_rows=4), None, now_s=1505.0)
    assert out["traffic_samples_deleted"] == 0  # nothing more to do
    assert len(c.get("/api/v1/gateway-reports", headers=ADMIN_H).json()) == 1


def test_the_database_holds_no_raw_user_or_item_id(api, tmp_path):
    """A gateway's sampler turns requests into a batch; the control plane stores it; then every
    value of every table, and every byte of the database's files, is searched for the raw ids (as
    numbers, as decimal text and as packed int64 of either byte order): none is there, and the
    stored hashes are the keyed ones."""
    c, token, _, _ = api
    users = [7_340_000_000_000_000_000 + u for u in range(5)]
    items = [9_100_000_000_000 + k for k in range(50)]
    s = Sampler(KEY, 1.0, clock=lambda: 1999.0)
    for k, u in enumerate(users):
        s.record(s.pick(u), {"user_id": u, "history": items[k:k + 20], "new_items": items[40 + k:42 + k],
                             "candidates": items[:10]}, node_id="node-0", status=200)
    batch = _prepared(s)
    r = c.post("/api/v1/gateways/gw-db/samples", json={"samples": batch}, headers=token("router"))
    assert r.json() == {"stored": 5, "duplicates": 0}, r.text
    h = KeyedHash(KEY)
    stored = _stored(c)
    assert sorted(x["user_hash"] for x in stored) == sorted(h.user(u) for u in users)
    assert {i for x in stored for i in x["items"] + x["new_items"] + x["candidates"]} <= {h.item(i) for i in items}
    raw = set(users) | set(items)
    needles = [str(x).encode() for x in raw] + [x.to_bytes(8, o, signed=True) for x in raw for o in ("little", "big")]
    db = tmp_path / "cp.db"
    con = sqlite3.connect(db)
    try:
        tables = [t for (t,) in con.execute("select name from sqlite_master where type = 'table'")]
        assert "traffic_samples" in tables
        for t in tables:
            for row in con.execute(f'select * from "{t}"'):
                for v in row:
                    if isinstance(v, int):
                        assert v not in raw, (t, v)
                    elif isinstance(v, (str, bytes)):
                        b = v.encode() if isinstance(v, str) else v
                        assert not any(n in b for n in needles), (t, b[:100])
    finally:
        con.close()
    files = [p for p in tmp_path.iterdir() if p.name.startswith("cp.db")]
    data = {p.name: p.read_bytes() for p in files}  # the file, its WAL, anything SQLite keeps beside it
    for name, b in data.items():
        assert not any(n in b for n in needles), name
    # and the search sees what is stored: each stored hash's packed bytes are there
    hashed = {i for x in stored for i in x["items"]}
    assert all(any(i.to_bytes(8, "little", signed=True) in b for b in data.values()) for i in hashed)


# ------------------------------------------------------------------------------- real processes ---
@pytest.mark.slow
def test_real_gateways_send_samples_at_rate_1_and_none_at_rate_0(tmp_path):
    """A control plane, a node agent registered there, and two gateways reading their nodes from it
    with router tokens: the one at --sample-rate 1 stores every request it served (hashed with its
    key, naming the node), the one at rate 0 none, although its client reports arrive."""
    from .cp_util import ControlPlane, Database, wait_for
    from .procs import free_port, racer_cmd, spawn, start_agent, stop, wait_http
    from .test_node_agent import write_taobao_csv

    csv = write_taobao_csv(tmp_path / "UserBehavior_small.csv")
    agent, agent_url, agent_log = start_agent(tmp_path, "agent", csv)
    db = Database("sqlite", tmp_path)
    cp = ControlPlane(db.url, tmp_path / "cp.log")
    gws = []
    try:
        wait_http(agent_url + "/healthz", agent, 120, agent_log)
        r = cp.client(cp.token("node", "node-s0", node_id="s0")).post("/nodes/register", json={
            "node_id": "s0", "address": agent_url, "device": "cpu", "policy_version": None,
            "cost_profile": {"kv_recompute_us_per_token": 4.0, "emb_transfer_us_per_row": 2.0,
                             "service_time_us": 3000.0, "queue_capacity": 48}})
        assert r.status_code == 200, r.text
        key_file = tmp_path / "sample.key"
        key_file.write_text(KEY.decode() + "\n")
        urls = {}
        for gid, extra in (("gw-on", ["--sample-rate", "1", "--sample-key-file", str(key_file),
                                      "--sample-interval-s", "0.3"]), ("gw-off", [])):
            port = free_port()
            gws.append(spawn(racer_cmd("gateway", "--control-plane", cp.base, "--gateway-id", gid, "--port", str(port),
                                       "--client-report-interval-s", "0.5", *extra), tmp_path / f"{gid}.log",
                             env={"RACER_GATEWAY_TOKEN": cp.token("router", gid)}))
            urls[gid] = f"http://127.0.0.1:{port}"
        for p, (gid, url) in zip(gws, urls.items()):
            wait_http(url + "/healthz", p, 60, tmp_path / f"{gid}.log")
        users = list(range(1000, 1012))
        with httpx.Client(timeout=30) as h:
            for gid, url in urls.items():
                for u in users:
                    r = h.post(url + "/v1/recommend", json={"user_id": u, "history": list(range(u % 50, u % 50 + 12)),
                                                            "new_items": [u % 7], "num_candidates": 8})
                    assert r.status_code == 200 and r.json()["served_by"] == "s0", r.text
            metrics = h.get(urls["gw-on"] + "/metrics").text
        assert 'racer_gateway_samples_dropped_total{reason="buffer_full"} 0.0' in metrics
        rows = wait_for(lambda: (lambda x: x if len(x) >= len(users) else None)(
            cp.admin.get("/traffic-samples", params={"gateway_id": "gw-on"}).json()["samples"]), 30)
        hk = KeyedHash(KEY)
        assert sorted(x["user_hash"] for x in rows) == sorted(hk.user(u) for u in users)
        by_user = {x["user_hash"]: x for x in rows}
        for u in users:
            x = by_user[hk.user(u)]
            assert x["items"] == [hk.item(i) for i in range(u % 50, u % 50 + 12)] and x["history_len"] == 12
            assert x["new_items"] == [hk.item(u % 7)] and (x["num_candidates"], x["node_id"], x["status"]) == (
                8, "s0", 200)
            assert abs(x["ts_s"] - time.time()) < 300
        # gw-off reported what its clients saw, and sent no sample
        wait_for(lambda: sum(r["num_requests"] for r in cp.admin.get(
            "/gateway-reports", params={"gateway_id": "gw-off"}).json()) >= len(users), 30)
        assert cp.admin.get("/traffic-samples", params={"gateway_id": "gw-off"}).json()["samples"] == []
        assert f"racer_gateway_samples_sent_total {float(len(users))}" in httpx.get(urls["gw-on"] + "/metrics").text
        assert httpx.get(urls["gw-off"] + "/v1/clients").json()["samples"] is None
    finally:
        for p in gws:
            stop(p)
        stop(agent)
        cp.stop()
        db.drop()
