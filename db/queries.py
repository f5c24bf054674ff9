"""Query functions over the control plane's tables. Each takes a `Session`, may flush, and
never commits: the caller (an API route, a job) owns the transaction."""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import and_, case, delete, func, or_, select, true, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.engine import Connection

from .models import (REPORT_FIGURES, REQUEST_WEIGHTED, AuditEntry, Burst, Decision, Gateway, GatewayReport,
                     JobRun,
                     Node, NodeReport, NodeReportBucket, NodeReportRollup, Override, Policy, Router,
                     RouterWeightsVersion, Rollout, RolloutNode, RolloutStep, Token, bucket_sum_columns, ModelVersion,
                     TrafficSample)


def bucket_figures():
    """One node's figures over a bucket of its reports, as SQL aggregates (labelled by figure).

    Reports cover windows of different lengths (a control step delayed by a long batch is
    followed by a very short window whose rate is high and noisy), so the bucket's throughput
    is the reports' rates weighted by the time each covers, ``sum(rate * interval_s) /
    sum(interval_s)`` (the requests over that time), not the plain mean of the rates (with
    which one short window can lift a bucket to several times the load); SLO attainment and
    the hit rates are weighted by each report's requests (the plain mean where no report in
    the bucket had any); every other figure is the plain mean."""
    cols = []
    for k in REPORT_FIGURES:
        col = getattr(NodeReport, k)
        if k == "throughput_rps":
            expr = func.sum(col * NodeReport.interval_s) / func.nullif(func.sum(NodeReport.interval_s), 0.0)
        elif k in REQUEST_WEIGHTED:
            w = case((col.is_not(None), NodeReport.num_requests), else_=None)
            expr = func.coalesce(func.sum(col * NodeReport.num_requests) / func.nullif(func.sum(w) * 1.0, 0.0),
                                 func.avg(col))
        else:
            expr = func.avg(col)
        cols.append(expr.label(k))
    return cols


def dialect_insert(session: Session | Connection, table):
    """The dialect's own INSERT (for ON CONFLICT DO NOTHING on SQLite and PostgreSQL)."""
    name = (session.get_bind() if isinstance(session, Session) else session).dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise ValueError(f"unsupported dialect {name}")


def sha256_text(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


# ---- audit
def audit(session: Session, *, ts_s: float, actor: str, action: str, target: str, before: dict | None = None,
          after: dict | None = None, reason: str = "") -> AuditEntry:
    e = AuditEntry(ts_s=ts_s, actor=actor, action=action, target=target, before=before, after=after, reason=reason)
    session.add(e)
    return e


def audit_page(session: Session, *, start_s: float | None, end_s: float | None, actor: str | None,
               action: str | None, target: str | None, offset: int, limit: int) -> tuple[int, list[AuditEntry]]:
    conds = []
    if start_s is not None:
        conds.append(AuditEntry.ts_s >= start_s)
    if end_s is not None:
        conds.append(AuditEntry.ts_s < end_s)
    if actor:
        conds.append(AuditEntry.actor == actor)
    if action:
        conds.append(AuditEntry.action == action)
    if target:
        conds.append(AuditEntry.target.contains(target, autoescape=True))
    total = session.scalar(select(func.count()).select_from(AuditEntry).where(*conds))
    rows = session.scalars(select(AuditEntry).where(*conds).order_by(AuditEntry.id.desc())
                           .offset(offset).limit(limit)).all()
    return int(total or 0), list(rows)


# ---- tokens
def token_by_secret(session: Session, secret: str, revoked: bool | None = False) -> Token | None:
    """The token whose secret is ``secret``: not revoked (default), revoked (True) or either (None)."""
    q = select(Token).where(Token.token_sha256 == sha256_text(secret))
    if revoked is not None:
        q = q.where(Token.revoked.is_(revoked))
    return session.scalar(q)


def valid_tokens_by_sha256(session: Session, digests: Sequence[str]) -> list[tuple[str, int, str, str, str | None]]:
    """(token_sha256, id, name, role, node_id) of the tokens among ``digests`` that exist and are
    not revoked (one query per 500 digests)."""
    out = []
    digests = list(digests)
    for i in range(0, len(digests), 500):
        out.extend(tuple(r) for r in session.execute(
            select(Token.token_sha256, Token.id, Token.name, Token.role, Token.node_id)
            .where(Token.token_sha256.in_(digests[i:i + 500]), Token.revoked.is_(False))))
    return out


def add_token(session: Session, *, name: str, role: str, secret: str, now_s: float,
              node_id: str | None = None) -> Token:
    """A new token (``node_id``: the node a node token is bound to)."""
    t = Token(name=name, role=role, token_sha256=sha256_text(secret), created_at_s=now_s, revoked=False,
              node_id=node_id)
    session.add(t)
    session.flush()
    return t


def token_valid(session: Session, token_id: int) -> bool:
    """Whether token ``token_id`` exists and is not revoked."""
    return bool(session.scalar(select(func.count()).select_from(Token).where(Token.id == token_id,
                                                                            Token.revoked.is_(False))))


def revoke_node_tokens(session: Session, node_id: str) -> list[int]:
    """Revoke every valid token bound to ``node_id``; returns their ids."""
    ids = list(session.scalars(select(Token.id).where(Token.node_id == node_id, Token.revoked.is_(False))
                               .order_by(Token.id)).all())
    if ids:
        session.execute(update(Token).where(Token.id.in_(ids)).values(revoked=True))
    return ids


def tokens_by_id(session: Session, ids: Sequence[int] | None) -> list[Token]:
    """The tokens with these ids (every token when ``ids`` is None), by id."""
    q = select(Token).order_by(Token.id)
    if ids is not None:
        q = q.where(Token.id.in_(list(ids)))
    return list(session.scalars(q).all())


def count_tokens(session: Session, role: str | None = None, *, revoked: bool | None = None) -> int:
    """Tokens of ``role`` (None: any): revoked or not (None), or only those that are (True) or not (False)."""
    q = select(func.count()).select_from(Token)
    if role:
        q = q.where(Token.role == role)
    if revoked is not None:
        q = q.where(Token.revoked.is_(revoked))
    return int(session.scalar(q) or 0)


# ---- nodes and reports
def upsert_node(session: Session, *, node_id: str, address: str, device: str, cost_profile: dict,
                policy_version: str | None, now_s: float, report_interval_s: float,
                token_id: int | None = None, started_at_s: float | None = None) -> tuple[Node, dict | None]:
    """Register (or re-register) a node, by token ``token_id``; returns the node and its
    previous registration (or None). Whether that token may is the caller's check. A process
    started at another time (``started_at_s``) than the one registered before is a restart
    (``num_restarts`` + 1)."""
    node = session.get(Node, node_id)
    before = None
    if node is None:
        node = Node(node_id=node_id, registered_at_s=now_s, num_restarts=0)
        session.add(node)
    else:
        before = {"address": node.address, "device": node.device, "cost_profile": node.cost_profile,
                  "policy_version": node.policy_version, "status": node.status, "token_id": node.token_id,
                  "started_at_s": node.started_at_s}
        if started_at_s is not None and node.started_at_s is not None and abs(started_at_s - node.started_at_s) > 1e-3:
            node.num_restarts = (node.num_restarts or 0) + 1
    if started_at_s is not None:
        node.started_at_s = started_at_s
    node.address, node.device, node.cost_profile = address, device, cost_profile
    node.policy_version, node.status, node.last_seen_s = policy_version, "up", now_s
    node.report_interval_s = report_interval_s
    node.token_id = token_id
    session.flush()
    return node, before


def list_nodes(session: Session, include_retired: bool = False) -> list[Node]:
    """The registered nodes by id; retired ones only with ``include_retired``."""
    q = select(Node).order_by(Node.node_id)
    if not include_retired:
        q = q.where(Node.status != "retired")
    return list(session.scalars(q).all())


def _json_value(v):
    """A JSON column's value as the driver returns it (SQLite: text; PostgreSQL: parsed)."""
    import json

    return json.loads(v) if isinstance(v, (str, bytes)) else v


def _driver_rows(session: Session, sql: str, args: tuple = ()) -> list[tuple]:
    """Rows of ``sql`` (``?`` placeholders) on the driver connection of the session's transaction,
    without SQLAlchemy's per-row result processing (for a scheduled job's reads of every node)."""
    dbapi = session.connection().connection.driver_connection
    if session.get_bind().dialect.name == "postgresql":
        sql = sql.replace("?", "%s")
    cur = dbapi.cursor()
    try:
        cur.execute(sql, args)
        return cur.fetchall()
    finally:
        cur.close()


def up_node_profiles(session: Session, fields: Sequence[str]) -> list[tuple[str, dict]]:
    """(node_id, ``fields`` of its registered cost profile) of every node whose status is up, by
    node id: numeric fields extracted by the database (no JSON parsed here: the weights job reads
    every node's every period)."""
    pg = session.get_bind().dialect.name == "postgresql"
    for f in fields:
        if not f.isidentifier():
            raise ValueError(f"not a profile field: {f!r}")
    cols = ", ".join(f"cost_profile ->> '{f}'" if pg else f"json_extract(cost_profile, '$.{f}')" for f in fields)
    rows = _driver_rows(session, f"SELECT node_id, {cols} FROM nodes WHERE status = 'up' ORDER BY node_id")
    if pg:  # ->> gives the JSON number's text: back to the int or float it was
        return [(row[0], {f: _json_number(v) for f, v in zip(fields, row[1:])}) for row in rows]
    return [(row[0], dict(zip(fields, row[1:]))) for row in rows]


def _json_number(text: str | None):
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return float(text)


def registered_device(cost_profile: dict | None) -> tuple[str | None, str | None]:
    """(device_mode, device_profile) a node registered (its cost profile's ``device``; (None,
    None): it did not say)."""
    dev = (cost_profile or {}).get("device")
    if not isinstance(dev, dict) or not isinstance(dev.get("mode"), str):
        return None, None
    prof = dev.get("profile") if dev["mode"] == "emulated" else None
    return dev["mode"], prof if isinstance(prof, str) else None


def node_devices(session: Session, nodes: Sequence[Node]) -> dict[str, tuple[str | None, str | None]]:
    """node_id -> (device_mode, device_profile) of each of ``nodes``: from its latest report
    (the one of its ``last_report_seq``, read by the (node_id, seq) key) when that says, else
    from its registration (`registered_device`)."""
    out = {n.node_id: registered_device(n.cost_profile) for n in nodes}
    ids = [n.node_id for n in nodes if n.last_report_seq is not None]
    for i in range(0, len(ids), 500):  # bounded IN lists
        q = (select(NodeReport.node_id, NodeReport.device_mode, NodeReport.device_profile)
             .join(Node, and_(Node.node_id == NodeReport.node_id, Node.last_report_seq == NodeReport.seq))
             .where(Node.node_id.in_(ids[i:i + 500]), NodeReport.device_mode.is_not(None)))
        for nid, mode, prof in session.execute(q):
            out[nid] = (mode, prof)
    return out


def latest_throughputs(session: Session, nodes: Sequence[Node]) -> dict[str, float]:
    """node_id -> the request rate (req/s) of its latest report (the one of its
    ``last_report_seq``); nodes without a report are absent."""
    out: dict[str, float] = {}
    ids = [n.node_id for n in nodes if n.last_report_seq is not None]
    for i in range(0, len(ids), 500):  # bounded IN lists
        q = (select(NodeReport.node_id, NodeReport.throughput_rps)
             .join(Node, and_(Node.node_id == NodeReport.node_id, Node.last_report_seq == NodeReport.seq))
             .where(Node.node_id.in_(ids[i:i + 500])))
        out.update({nid: float(v) for nid, v in session.execute(q)})
    return out


def node_status_counts(session: Session) -> dict[str, int]:
    """Nodes per status ({"up": n, "down": m}), counted in SQL (no ORM objects loaded)."""
    return {str(st): int(n) for st, n in session.execute(select(Node.status, func.count()).group_by(Node.status))}


ROLLOUT_STATES = ("pending", "baking", "paused", "promoted", "rolled_back")


def rollout_state_counts(session: Session) -> dict[str, int]:
    """Rollouts per state, every state present (0 where none), counted in SQL."""
    got = {str(st): int(n) for st, n in session.execute(select(Rollout.state, func.count()).group_by(Rollout.state))}
    return {st: got.get(st, 0) for st in ROLLOUT_STATES}


def known_node_ids(session: Session, node_ids: Iterable[str]) -> set[str]:
    ids = list(set(node_ids))
    return set(session.scalars(select(Node.node_id).where(Node.node_id.in_(ids))).all()) if ids else set()


# The ingestion hot path: plain SQL on the driver connection of the session's transaction (the
# SQLAlchemy executemany machinery costs ~5x more per row here). SQLite: multi-row INSERTs whose
# RETURNING tells inserted from duplicate; PostgreSQL: one statement over unnest() arrays.
_REPORT_COLS = [c.name for c in NodeReport.__table__.columns if c.name != "id"]
_SQLITE_ROWS_PER_INSERT = 999 // len(_REPORT_COLS)  # within SQLite's oldest limit of 999 parameters
_DECISION_COLS = [c.name for c in Decision.__table__.columns if c.name != "id"]
_PG_TYPES = {"node_id": "text", "seq": "int", "num_requests": "int", "refill_bytes": "int", "policy_version": "text",
             "model_digest": "text", "device_mode": "text", "device_profile": "text",
             "decision_source": "text", "source": "text", "reason": "text", "features": "json", "layers": "json"}


def _pg_unnest(cols: list[str], rows: Sequence[dict]) -> tuple[str, list]:
    import json

    arrays = []
    for c in cols:
        vals = [r.get(c) for r in rows]
        if _PG_TYPES.get(c) == "json":
            vals = [None if v is None else json.dumps(v, ensure_ascii=False, separators=(",", ":")) for v in vals]
        arrays.append(vals)
    casts = ", ".join(f"%s::{_PG_TYPES.get(c, 'float8')}[]" for c in cols)
    return f"SELECT * FROM unnest({casts})", arrays


def _driver(bind: Session | Connection) -> tuple:
    """(the DBAPI connection, whether it is PostgreSQL's) under a Session or a Core Connection (the
    ingestion writer's: no Session's bookkeeping on the hot path)."""
    if isinstance(bind, Session):
        return bind.connection().connection.driver_connection, bind.get_bind().dialect.name == "postgresql"
    return bind.connection.driver_connection, bind.dialect.name == "postgresql"


def insert_reports(session: Session | Connection, rows: Sequence[dict]) -> set[tuple[str, int]]:
    """Insert report rows, skipping any (node_id, seq) already stored (ON CONFLICT DO NOTHING on
    both dialects), and add the rows inserted to the pre-aggregated history (`NodeReportBucket`)
    in the same transaction, in the same statement on PostgreSQL; returns the keys actually
    inserted."""
    if not rows:
        return set()
    conn, pg = _driver(session)
    cols = _REPORT_COLS
    if pg:
        select_sql, arrays = _pg_unnest(cols, rows)
        # one statement: the rows, then every history step's buckets from the rows inserted
        sql = (f"WITH ins AS (INSERT INTO node_reports ({', '.join(cols)}) {select_sql} "
               f"ON CONFLICT (node_id, seq) DO NOTHING RETURNING *), {_STEPS_CTE}, "
               f"history AS ({_history_add_sql('ins', 'true')} RETURNING 1) SELECT node_id, seq FROM ins")
        with conn.cursor() as cur:
            cur.execute(sql, arrays)
            return {(r[0], r[1]) for r in cur.fetchall()}
    cur = conn.cursor()
    inserted, first_id = set(), None
    one = f"({', '.join('?' * len(cols))})"
    try:
        for i in range(0, len(rows), _SQLITE_ROWS_PER_INSERT):  # one statement a chunk: few GIL hand-offs
            part = rows[i:i + _SQLITE_ROWS_PER_INSERT]
            cur.execute(f"INSERT INTO node_reports ({', '.join(cols)}) VALUES {', '.join([one] * len(part))} "
                        f"ON CONFLICT (node_id, seq) DO NOTHING RETURNING id, node_id, seq",
                        [r.get(c) for r in part for c in cols])
            for rid, nid, seq in cur.fetchall():
                inserted.add((nid, seq))
                first_id = rid if first_id is None else min(first_id, rid)
        if first_id is not None:
            # this transaction holds SQLite's write lock: the rows it inserted are exactly those
            # from the first one's id on (a new row's id is above every stored one)
            cur.execute(f"WITH {_STEPS_CTE} {_history_add_sql('node_reports NOT INDEXED', 'id >= ?', per_row=True)}",
                        (first_id,))
    finally:
        cur.close()
    return inserted


def insert_decisions(session: Session | Connection, rows: Sequence[dict]) -> None:
    if not rows:
        return
    import json

    conn, pg = _driver(session)
    cols = _DECISION_COLS
    if pg:
        select_sql, arrays = _pg_unnest(cols, rows)
        with conn.cursor() as cur:
            cur.execute(f"INSERT INTO decisions ({', '.join(cols)}) {select_sql} ON CONFLICT (node_id, seq) DO NOTHING",
                        arrays)
        return
    conn.executemany(f"INSERT INTO decisions ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
                     f"ON CONFLICT (node_id, seq) DO NOTHING",
                     [[(None if r.get(c) is None else json.dumps(r[c], ensure_ascii=False, separators=(",", ":")))
                       if c in ("features", "layers") else r.get(c)
                       for c in cols] for r in rows])


def upsert_bursts(session: Session | Connection, rows: Sequence[dict]) -> None:
    """Insert bursts; a burst already stored (same node and start) gets its end and magnitude."""
    if not rows:
        return
    ins = dialect_insert(session, Burst)
    stmt = ins.on_conflict_do_update(index_elements=["node_id", "start_s"],
                                     set_={"end_s": func.coalesce(ins.excluded.end_s, Burst.end_s),
                                           "magnitude": ins.excluded.magnitude})
    for r in rows:  # one statement per row: ON CONFLICT DO UPDATE cannot touch one row twice per statement
        session.execute(stmt, r)


def highest_report_seq(session: Session, node_id: str) -> int | None:
    """The highest sequence number stored for ``node_id`` (raw reports, else the node's last one)."""
    top = session.scalar(select(func.max(NodeReport.seq)).where(NodeReport.node_id == node_id))
    last = session.scalar(select(Node.last_report_seq).where(Node.node_id == node_id))
    vals = [v for v in (top, last) if v is not None]
    return max(vals) if vals else None


def touch_nodes(session: Session | Connection, seen: dict[str, tuple[float, int, float, str | None]]) -> None:
    """Mark nodes seen and up: node_id -> (last_seen_s, last_report_seq, emb_share, policy_version).
    A retired node stays retired (only a new registration brings it back)."""
    if not seen:
        return
    conn, pg = _driver(session)
    if pg:
        ids = list(seen)
        with conn.cursor() as cur:
            cur.execute("UPDATE nodes SET last_seen_s = v.seen, last_report_seq = v.seq, emb_share = v.share, "
                        "status = 'up' FROM unnest(%s::text[], %s::float8[], %s::int[], %s::float8[]) "
                        "AS v(node_id, seen, seq, share) WHERE nodes.node_id = v.node_id "
                        "AND nodes.status <> 'retired'",
                        [ids, [seen[k][0] for k in ids], [seen[k][1] for k in ids], [seen[k][2] for k in ids]])
        return
    conn.executemany("UPDATE nodes SET last_seen_s = ?, last_report_seq = ?, emb_share = ?, status = 'up' "
                     "WHERE node_id = ? AND status <> 'retired'", [(v[0], v[1], v[2], k) for k, v in seen.items()])


def mark_down(session: Session, *, now_s: float, missed_intervals: float, send_period_s: float | None = None
              ) -> list[str]:
    """Nodes whose last report is older than ``missed_intervals`` report intervals (or send periods,
    when ``send_period_s`` is longer: a node sends its reports that often): status "down"."""
    interval = Node.report_interval_s
    if send_period_s:
        interval = case((Node.report_interval_s > send_period_s, Node.report_interval_s), else_=send_period_s)
    stale = session.scalars(select(Node.node_id).where(
        Node.status == "up", Node.last_seen_s < now_s - missed_intervals * interval)).all()
    if stale:
        session.execute(update(Node).where(Node.node_id.in_(stale)).values(status="down"))
    return list(stale)


def _window_conds(key_col, key: str | None, ts_col, start_s: float | None, end_s: float | None) -> list:
    """WHERE terms of a read of one source's rows in a window: ``key_col == key`` (None: every
    source), ``start_s <= ts_col < end_s`` (None: open)."""
    conds = []
    if key is not None:
        conds.append(key_col == key)
    if start_s is not None:
        conds.append(ts_col >= start_s)
    if end_s is not None:
        conds.append(ts_col < end_s)
    return conds


def _report_conds(node_id: str | None, start_s: float | None, end_s: float | None) -> list:
    """WHERE terms of a raw-report read: one node (None or empty: all), ``start_s <= ts_s < end_s``
    (None: open)."""
    return _window_conds(NodeReport.node_id, node_id or None, NodeReport.ts_s, start_s, end_s)


def _raw_buckets(session: Session, *, node_id: str | None, start_s: float | None, end_s: float | None,
                 step_s: float, limit: int) -> list[dict]:
    """Per-node ``step_s`` buckets grouped from the raw reports (`bucket_figures`)."""
    conds = _report_conds(node_id, start_s, end_s)
    bucket = (func.floor(NodeReport.ts_s / step_s) * step_s).label("bucket")
    cols = bucket_figures()
    q = (select(NodeReport.node_id, bucket, func.count().label("n"), *cols).where(*conds)
         .group_by(NodeReport.node_id, bucket).order_by(bucket, NodeReport.node_id).limit(limit))
    return [_bucket_row(r) for r in session.execute(q)]


def _bucket_row(r) -> dict:
    """A (node_id, bucket, n, *REPORT_FIGURES) result row as the API's history row."""
    d = {"node_id": r[0], "ts_s": float(r[1]), "num_reports": int(r[2])}
    for k, v in zip(REPORT_FIGURES, r[3:]):
        d[k] = None if v is None else float(v)
    return d


# ---- pre-aggregated recent history (node_report_buckets, kept at each report's commit)
HISTORY_STEPS = (5.0, 30.0, 300.0)  # the stored steps; a read at a multiple of one groups its rows
SUM_COLUMNS = tuple(c.name for c in bucket_sum_columns())
_BUCKET_NAMES = ["node_id", "step_s", "bucket_s", *SUM_COLUMNS]


def _sum_exprs() -> list[tuple[str, str]]:
    """(`bucket_sum_columns` name, SQL aggregate over raw report columns) for one group of reports:
    the same text on SQLite and PostgreSQL, over ``node_reports`` or a CTE of its rows."""
    out = [("num_reports", "count(*)"), ("sum_interval_s", "sum(interval_s)"),
           ("sum_rate_x_interval", "sum(throughput_rps * interval_s)")]
    for f in REPORT_FIGURES:
        out += [(f"sum_{f}", f"sum({f})"), (f"cnt_{f}", f"count({f})")]
    for f in REQUEST_WEIGHTED:
        out += [(f"wsum_{f}", f"sum({f} * num_requests)"),
                (f"w_{f}", f"sum(CASE WHEN {f} IS NOT NULL THEN num_requests END)")]
    assert [n for n, _ in out] == list(SUM_COLUMNS)
    return out


def _row_sum_exprs() -> list[tuple[str, str]]:
    """`_sum_exprs` of a group of one report, as plain expressions over its columns (no aggregate):
    what a report adds to each of its buckets."""
    out = [("num_reports", "1"), ("sum_interval_s", "interval_s"),
           ("sum_rate_x_interval", "throughput_rps * interval_s")]
    for f in REPORT_FIGURES:
        out += [(f"sum_{f}", f), (f"cnt_{f}", f"({f} IS NOT NULL)")]
    for f in REQUEST_WEIGHTED:
        out += [(f"wsum_{f}", f"{f} * num_requests"), (f"w_{f}", f"CASE WHEN {f} IS NOT NULL THEN num_requests END")]
    assert [n for n, _ in out] == list(SUM_COLUMNS)
    return out


# the stored steps as a CTE (one statement adds a batch to every step)
_STEPS_CTE = "steps(level) AS (VALUES " + ", ".join(f"(CAST({lv!r} AS DOUBLE PRECISION))"
                                                   for lv in map(float, HISTORY_STEPS)) + ")"


@functools.lru_cache(maxsize=None)
def _history_add_sql(source: str, where: str, merge: str = "add", per_row: bool = False) -> str:
    """INSERT .. SELECT of the buckets at every stored step (the CTE `_STEPS_CTE`, which the
    statement's WITH must name) of the reports in ``source`` that match ``where``, upserted into
    ``node_report_buckets``: ``merge`` "add" adds them to the stored sums (new reports joining a
    bucket: sums add, and SQL's NULL sum stays NULL only where both are), "replace" overwrites
    them (a bucket recomputed from all its reports). Rows go in key order, so concurrent writers
    (replicas on PostgreSQL) lock buckets in one order. ``per_row`` (SQLite, "add" only): no
    grouping, each report upserted into its buckets in turn (SQLite lets one statement update a
    row again; PostgreSQL does not), which costs SQLite two fifths of the grouped statement's CPU
    when most buckets get one report a commit."""
    bucket = "floor(ts_s / level) * level"
    t = "node_report_buckets"
    if per_row:
        assert merge == "add"
        exprs = _row_sum_exprs()
        sets = ", ".join(f"{n} = coalesce({t}.{n} + excluded.{n}, {t}.{n}, excluded.{n})" for n, _ in exprs)
        return (f"INSERT INTO {t} ({', '.join(_BUCKET_NAMES)}) "
                f"SELECT node_id, level, {bucket}, {', '.join(e for _, e in exprs)} FROM {source} CROSS JOIN steps "
                f"WHERE {where} ON CONFLICT (node_id, step_s, bucket_s) DO UPDATE SET {sets}")
    exprs = _sum_exprs()
    if merge == "add":
        sets = ", ".join(f"{n} = coalesce({t}.{n} + excluded.{n}, {t}.{n}, excluded.{n})" for n, _ in exprs)
    else:
        sets = ", ".join(f"{n} = excluded.{n}" for n, _ in exprs)
    # SQLite's upsert needs a WHERE in its SELECT (a parsing ambiguity otherwise)
    return (f"INSERT INTO {t} ({', '.join(_BUCKET_NAMES)}) "
            f"SELECT node_id, level, {bucket}, {', '.join(e for _, e in exprs)} FROM {source} CROSS JOIN steps "
            f"WHERE {where} GROUP BY node_id, level, {bucket} ORDER BY node_id, level, {bucket} "
            f"ON CONFLICT (node_id, step_s, bucket_s) DO UPDATE SET {sets}")


def rebuild_history(conn, since_ts_s: float | None = None) -> None:
    """Recompute every stored bucket from the raw reports (those of report times from
    ``since_ts_s``'s buckets on; None: all), replacing what is stored, on the SQLAlchemy
    connection ``conn`` (for a database whose buckets were not kept at commit: the migration that
    began keeping them). Takes the buckets' table lock on PostgreSQL, so a writer's additions wait
    for it (and count on top of it)."""
    pg = conn.dialect.name == "postgresql"
    if pg:
        conn.exec_driver_sql("LOCK TABLE node_report_buckets IN SHARE ROW EXCLUSIVE MODE")
    where, args = "true", ()
    if since_ts_s is not None:
        top = HISTORY_STEPS[-1]
        where, args = ("ts_s >= %s" if pg else "ts_s >= ?"), (math.floor(since_ts_s / top) * top,)
    conn.exec_driver_sql(f"WITH {_STEPS_CTE} {_history_add_sql('node_reports', where, merge='replace')}", args)


def figures_of_sums(col) -> list:
    """The `bucket_figures` of a group of `NodeReportBucket` rows (``col(name)``: the column),
    computed from the sum of their sums: the same figures as grouping their raw reports."""
    def S(name):
        return func.sum(col(name))

    out = []
    for k in REPORT_FIGURES:
        mean = S(f"sum_{k}") / func.nullif(S(f"cnt_{k}") * 1.0, 0.0)
        if k == "throughput_rps":
            expr = S("sum_rate_x_interval") / func.nullif(S("sum_interval_s"), 0.0)
        elif k in REQUEST_WEIGHTED:
            expr = func.coalesce(S(f"wsum_{k}") / func.nullif(S(f"w_{k}") * 1.0, 0.0), mean)
        else:
            expr = mean
        out.append(expr.label(k))
    return out


def history_level(step_s: float) -> float | None:
    """The largest stored step that divides ``step_s`` (None: read the raw reports)."""
    for level in sorted(HISTORY_STEPS, reverse=True):
        k = step_s / level
        if k >= 1 and abs(k - round(k)) < 1e-9:
            return level
    return None


def _aligned(t: float | None, step_s: float) -> bool:
    if t is None:
        return True
    k = t / step_s
    return abs(k - round(k)) < 1e-9


def stored_level(step_s: float, start_s: float | None, end_s: float | None) -> float | None:
    """The stored step whose buckets serve a bucketed read of ``[start_s, end_s)`` at ``step_s``:
    the largest one dividing ``step_s``, where both range edges lie on ``step_s`` edges; None
    when none can (the read groups raw reports). The stored buckets hold every committed report
    (`insert_reports` adds each to them in its own transaction), so such a read is exact."""
    level = history_level(step_s)
    if level is None or not _aligned(start_s, step_s) or not _aligned(end_s, step_s):
        return None
    return level


def _stored_buckets(session: Session, *, node_id: str | None, start_s: float | None, end_s: float | None,
                    step_s: float, level: float, limit: int) -> list[dict]:
    B = NodeReportBucket.__table__
    conds = [B.c.step_s == level]
    if end_s is not None:
        conds.append(B.c.bucket_s < end_s)
    if node_id:
        conds.append(B.c.node_id == node_id)
    if start_s is not None:
        conds.append(B.c.bucket_s >= start_s)
    bucket = (func.floor(B.c.bucket_s / step_s) * step_s).label("bucket")
    q = (select(B.c.node_id, bucket, func.sum(B.c.num_reports).label("n"), *figures_of_sums(lambda n: B.c[n]))
         .where(*conds).group_by(B.c.node_id, bucket).order_by(bucket, B.c.node_id).limit(limit))
    return [_bucket_row(r) for r in session.execute(q)]


def report_history(session: Session, *, node_id: str | None, start_s: float | None, end_s: float | None,
                   step_s: float | None, limit: int) -> list[dict]:
    """Raw reports (step_s None), or per-node ``step_s`` buckets (`bucket_figures`). Buckets are
    grouped from the pre-aggregated `NodeReportBucket` rows where they can serve the read
    (`stored_level`), else from the raw reports; raw rows already dropped by retention come from
    the stored rollups of the same step."""
    conds = _report_conds(node_id, start_s, end_s)
    if not step_s:
        rows = session.scalars(select(NodeReport).where(*conds).order_by(NodeReport.ts_s, NodeReport.node_id)
                               .limit(limit)).all()
        out = []
        for r in rows:
            d = {k: getattr(r, k) for k in REPORT_FIGURES}
            d.update(node_id=r.node_id, seq=r.seq, ts_s=r.ts_s, policy_version=r.policy_version,
                     decision_source=r.decision_source, model_digest=r.model_digest, model_quality=r.model_quality,
                     device_mode=r.device_mode, device_profile=r.device_profile)
            out.append(d)
        return out
    level = stored_level(step_s, start_s, end_s)
    if level is not None:
        out = _stored_buckets(session, node_id=node_id, start_s=start_s, end_s=end_s, step_s=step_s,
                              level=level, limit=limit)
    else:
        out = _raw_buckets(session, node_id=node_id, start_s=start_s, end_s=end_s, step_s=step_s, limit=limit)
    have = {(d["node_id"], d["ts_s"]) for d in out}
    rconds = [NodeReportRollup.step_s == step_s]
    if node_id:
        rconds.append(NodeReportRollup.node_id == node_id)
    if start_s is not None:
        rconds.append(NodeReportRollup.bucket_s >= start_s)
    if end_s is not None:
        rconds.append(NodeReportRollup.bucket_s < end_s)
    for r in session.scalars(select(NodeReportRollup).where(*rconds).limit(limit)):
        if (r.node_id, r.bucket_s) not in have:
            out.append(dict(node_id=r.node_id, ts_s=r.bucket_s, num_reports=r.num_reports, **r.figures))
    out.sort(key=lambda d: (d["ts_s"], d["node_id"]))
    return out[:limit]


CLUSTER_SUMS = ("throughput_rps", "num_requests", "refill_bytes")


def _cluster_of(per_node, limit: int):
    cols = [(func.sum(per_node.c["avg_" + k]) if k in CLUSTER_SUMS else
             func.sum(per_node.c["sum_" + k]) / func.nullif(func.sum(per_node.c["cnt_" + k]), 0)).label(k)
            for k in REPORT_FIGURES]
    return (select(per_node.c.bucket, func.sum(per_node.c.n).label("n"), func.count().label("nodes"), *cols)
            .group_by(per_node.c.bucket).order_by(per_node.c.bucket).limit(limit))


def cluster_history(session: Session, *, start_s: float | None, end_s: float | None, step_s: float,
                    limit: int) -> list[dict]:
    """The cluster per ``step_s`` bucket: throughput, requests and refill bytes summed over nodes
    (each node's `bucket_figures` value in the bucket), every other figure the mean over all
    reports in the bucket. From the pre-aggregated buckets where they serve the read, else the raw
    reports (`stored_level`, as `report_history`); buckets already rolled up by retention are left out."""
    level = stored_level(step_s, start_s, end_s)
    if level is not None:
        B = NodeReportBucket.__table__
        bucket = (func.floor(B.c.bucket_s / step_s) * step_s).label("bucket")
        conds = [B.c.step_s == level]
        if end_s is not None:
            conds.append(B.c.bucket_s < end_s)
        if start_s is not None:
            conds.append(B.c.bucket_s >= start_s)
        figs = {c.name: c for c in figures_of_sums(lambda n: B.c[n])}
        per_node = (select(B.c.node_id, bucket, func.sum(B.c.num_reports).label("n"),
                           *[figs[k].element.label("avg_" + k) for k in CLUSTER_SUMS],
                           *[func.sum(B.c["sum_" + k]).label("sum_" + k) for k in REPORT_FIGURES],
                           *[func.sum(B.c["cnt_" + k]).label("cnt_" + k) for k in REPORT_FIGURES])
                    .where(*conds).group_by(B.c.node_id, bucket).subquery())
        return [_cluster_row(r) for r in session.execute(_cluster_of(per_node, limit))]
    conds = _report_conds(None, start_s, end_s)
    bucket = (func.floor(NodeReport.ts_s / step_s) * step_s).label("bucket")
    per_node = (select(NodeReport.node_id, bucket, func.count().label("n"),
                       *[c.element.label("avg_" + c.name) for c in bucket_figures() if c.name in CLUSTER_SUMS],
                       *[func.sum(getattr(NodeReport, k)).label("sum_" + k) for k in REPORT_FIGURES],
                       *[func.count(getattr(NodeReport, k)).label("cnt_" + k) for k in REPORT_FIGURES])
                .where(*conds).group_by(NodeReport.node_id, bucket).subquery())
    return [_cluster_row(r) for r in session.execute(_cluster_of(per_node, limit))]


def _cluster_row(r) -> dict:
    return dict(node_id="*", ts_s=float(r.bucket), num_reports=int(r.n),
                **{k: (None if getattr(r, k) is None else float(getattr(r, k))) for k in REPORT_FIGURES})


def rollup_and_prune(session: Session, *, now_s: float, step_s: float, raw_retention_s: float,
                     rollup_retention_s: float, max_rows: int = 50_000) -> dict:
    """Downsample raw reports older than ``raw_retention_s`` into ``step_s`` rollups, delete them,
    and drop rollups older than ``rollup_retention_s``. Idempotent (rollups upsert by bucket)."""
    cutoff = now_s - raw_retention_s
    cutoff = (cutoff // step_s) * step_s  # whole buckets only
    bucket = (func.floor(NodeReport.ts_s / step_s) * step_s).label("bucket")
    cols = bucket_figures()
    q = (select(NodeReport.node_id, bucket, func.count().label("n"), *cols).where(NodeReport.ts_s < cutoff)
         .group_by(NodeReport.node_id, bucket).limit(max_rows))
    rows = [dict(node_id=r.node_id, step_s=step_s, bucket_s=float(r.bucket), num_reports=int(r.n),
                 figures={k: (None if getattr(r, k) is None else float(getattr(r, k))) for k in REPORT_FIGURES})
            for r in session.execute(q)]
    if rows:
        ins = dialect_insert(session, NodeReportRollup)
        session.execute(ins.on_conflict_do_update(index_elements=["node_id", "step_s", "bucket_s"],
                                                  set_={"num_reports": ins.excluded.num_reports,
                                                        "figures": ins.excluded.figures}), rows)
    deleted = session.execute(delete(NodeReport).where(NodeReport.ts_s < cutoff)).rowcount
    session.execute(delete(NodeReportBucket).where(NodeReportBucket.bucket_s < cutoff))  # their raw rows are gone
    dropped = session.execute(delete(NodeReportRollup).where(
        NodeReportRollup.bucket_s < now_s - rollup_retention_s)).rowcount
    ddel = session.execute(delete(Decision).where(Decision.ts_s < now_s - rollup_retention_s)).rowcount
    return {"rollups": len(rows), "raw_deleted": int(deleted or 0), "rollups_dropped": int(dropped or 0),
            "decisions_dropped": int(ddel or 0)}


def decisions_page(session: Session, *, node_id: str | None, source: str | None, q: str | None,
                   start_s: float | None, end_s: float | None, offset: int, limit: int) -> tuple[int, list[Decision]]:
    conds = []
    if node_id:
        conds.append(Decision.node_id == node_id)
    if source:
        conds.append(Decision.source == source)
    if q:
        conds.append(or_(Decision.reason.contains(q, autoescape=True), Decision.node_id.contains(q, autoescape=True)))
    if start_s is not None:
        conds.append(Decision.ts_s >= start_s)
    if end_s is not None:
        conds.append(Decision.ts_s < end_s)
    total = session.scalar(select(func.count()).select_from(Decision).where(*conds))
    rows = session.scalars(select(Decision).where(*conds).order_by(Decision.ts_s.desc(), Decision.id.desc())
                           .offset(offset).limit(limit)).all()
    return int(total or 0), list(rows)


def decisions_by_source(session: Session, since_s: float) -> dict[str, int]:
    q = select(Decision.source, func.count()).where(Decision.ts_s >= since_s).group_by(Decision.source)
    return {s: int(n) for s, n in session.execute(q)}


def bursts(session: Session, *, node_id: str | None, start_s: float | None, end_s: float | None,
           limit: int) -> list[Burst]:
    conds = []
    if node_id:
        conds.append(Burst.node_id == node_id)
    if start_s is not None:
        conds.append(or_(Burst.end_s.is_(None), Burst.end_s >= start_s))
    if end_s is not None:
        conds.append(Burst.start_s < end_s)
    return list(session.scalars(select(Burst).where(*conds).order_by(Burst.start_s.desc()).limit(limit)).all())


def latest_reports(session: Session, since_s: float) -> list[NodeReport]:
    """Each node's newest report received since ``since_s``."""
    sub = (select(NodeReport.node_id, func.max(NodeReport.seq).label("seq")).where(NodeReport.ts_s >= since_s)
           .group_by(NodeReport.node_id).subquery())
    return list(session.scalars(select(NodeReport).join(
        sub, and_(NodeReport.node_id == sub.c.node_id, NodeReport.seq == sub.c.seq))).all())


def window_values(session: Session, node_ids: Sequence[str], *, since_s: float, until_s: float,
                  policy_version: str | None = None, model_digest: str | None = None) -> dict[str, list[float]]:
    """Per-window values of the judged figures (slo_attainment, p99_ms, model_quality) of reports
    from these nodes with at least one request, optionally only those that ran ``policy_version``
    or served the checkpoint ``model_digest``."""
    out: dict[str, list[float]] = {"slo_attainment": [], "p99_ms": [], "model_quality": []}
    if not node_ids:
        return out
    conds = [NodeReport.node_id.in_(list(node_ids)), NodeReport.ts_s >= since_s, NodeReport.ts_s <= until_s,
             NodeReport.num_requests > 0]
    if policy_version is not None:
        conds.append(NodeReport.policy_version == policy_version)
    if model_digest is not None:
        conds.append(NodeReport.model_digest == model_digest)
    for slo, p99, q in session.execute(select(NodeReport.slo_attainment, NodeReport.p99_ms, NodeReport.model_quality)
                                       .where(*conds)):
        if slo is not None:
            out["slo_attainment"].append(float(slo))
        if p99 is not None:
            out["p99_ms"].append(float(p99))
        if q is not None:
            out["model_quality"].append(float(q))
    return out


def quality_windows(session: Session, node_ids: Sequence[str], *, since_s: float) -> dict[str, tuple[int, int]]:
    """Per node with traffic since ``since_s``: (its report windows with requests, those of them
    that carry model_quality)."""
    if not node_ids:
        return {}
    rows = session.execute(select(NodeReport.node_id, func.count(), func.count(NodeReport.model_quality))
                           .where(NodeReport.node_id.in_(list(node_ids)), NodeReport.ts_s >= since_s,
                                  NodeReport.num_requests > 0).group_by(NodeReport.node_id))
    return {n: (int(w), int(q)) for n, w, q in rows}


def recent_miss_costs(session: Session, since_s: float) -> dict[str, dict[str, float]]:
    """node_id -> median of the reported miss costs since ``since_s`` (nodes that reported any;
    the upper one for an even count: ``sorted(v)[n // 2]``), from `recent_miss_cost_bands`."""
    return {nid: {name: band[1] for name, band in costs.items()}
            for nid, costs in recent_miss_cost_bands(session, since_s).items()}


def recent_miss_cost_bands(session: Session, since_s: float) -> dict[str, dict[str, tuple[float, float, float]]]:
    """node_id -> cost name -> ``(lower quartile, median, upper quartile)`` of the miss costs
    reported since ``since_s``: ``sorted(v)[k]`` for k = n // 4, n // 2 and 3n // 4. One scan of
    the window in which the database counts each node's distinct pairs of values (a node reports
    a few: its profiled points), so one row per node and pair reaches Python, and the quantiles
    are read off the running counts (window functions sorting every report held the database
    about 0.45 s a run at 1,000 nodes and 60 s; this takes about 0.05 s)."""
    names = ("kv_recompute_us_per_token", "emb_transfer_us_per_row")
    sqlite_db = session.get_bind().dialect.name == "sqlite"
    # SQLite would walk the (node_id, seq) index for the grouping's order: every stored report
    src = "node_reports INDEXED BY ix_node_reports__ts_s" if sqlite_db else "node_reports"
    sql = (f"SELECT node_id, {', '.join(names)}, count(*) FROM {src} WHERE ts_s >= ? "
           f"GROUP BY node_id, {', '.join(names)}")
    counts: dict[tuple[str, str], dict[float, int]] = {}
    for nid, *vals, c in _driver_rows(session, sql, (float(since_s),)):
        for name, v in zip(names, vals):
            if v is not None:
                d = counts.setdefault((nid, name), {})
                d[float(v)] = d.get(float(v), 0) + int(c)
    out: dict[str, dict[str, tuple]] = {}
    for (nid, name), d in counts.items():
        if len(d) == 1:  # one value (most nodes): every quantile is it
            v = next(iter(d))
            out.setdefault(nid, {})[name] = (v, v, v)
            continue
        n = sum(d.values())
        want, band, seen, i = [n // 4, n // 2, (3 * n) // 4], [], 0, 0
        for v in sorted(d):
            seen += d[v]
            while i < 3 and want[i] < seen:
                band.append(v)
                i += 1
        out.setdefault(nid, {})[name] = tuple(band)
    return out


# ---- routers and weights
def latest_weights(session: Session) -> RouterWeightsVersion | None:
    return session.scalar(select(RouterWeightsVersion).order_by(RouterWeightsVersion.version.desc()).limit(1))


def latest_weights_version(session: Session) -> int | None:
    """The latest weights version's number (None: no version yet)."""
    v = _driver_rows(session, "SELECT max(version) FROM router_weights")[0][0]
    return None if v is None else int(v)


_LATEST_WEIGHTS: list = [None]  # ((database, version, computed_at_s), payload) last read by `latest_weights_nodes`


def latest_weights_nodes(session: Session) -> tuple[int, dict] | None:
    """(version, per-node payload) of the latest weights, without the version's inputs (what the
    weights job compares against every period). A version is never rewritten, so the payload is
    parsed once per version (of one database, at one computed time) and kept: at 3,000 nodes
    parsing it held the GIL for tens of ms every period. Treat it as read-only."""
    head = _driver_rows(session, "SELECT version, computed_at_s FROM router_weights ORDER BY version DESC LIMIT 1")
    if not head:
        return None
    key = (str(session.get_bind().engine.url), int(head[0][0]), float(head[0][1]))
    got = _LATEST_WEIGHTS[0]
    if got is None or got[0] != key:
        rows = _driver_rows(session, "SELECT nodes FROM router_weights WHERE version = ?", (key[1],))
        got = _LATEST_WEIGHTS[0] = (key, _json_value(rows[0][0]))
    return got[0][1], got[1]


def weights_history(session: Session, limit: int) -> list[RouterWeightsVersion]:
    return list(session.scalars(select(RouterWeightsVersion).order_by(RouterWeightsVersion.version.desc())
                                .limit(limit)).all())


def add_weights(session: Session, *, computed_at_s: float, nodes: dict, inputs: dict, reason: str
                ) -> RouterWeightsVersion:
    prev = latest_weights(session)
    w = RouterWeightsVersion(version=(prev.version + 1) if prev else 1, computed_at_s=computed_at_s, nodes=nodes,
                             inputs=inputs, reason=reason)
    session.add(w)
    session.flush()
    return w


def upsert_router(session: Session, url: str, now_s: float, token_id: int | None = None) -> tuple[Router, bool]:
    """Register a router (again) for the token ``token_id``; another token (so another push token)
    means the next push goes out again."""
    r = session.get(Router, url)
    if r is not None:
        if token_id != r.token_id:
            r.token_id, r.pushed_version = token_id, None
        return r, False
    r = Router(url=url, registered_at_s=now_s, token_id=token_id)
    session.add(r)
    session.flush()
    return r, True


def count_routers(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Router)) or 0)


def list_routers(session: Session) -> list[Router]:
    return list(session.scalars(select(Router).order_by(Router.url)).all())


# ---- overrides
def active_overrides(session: Session, node_id: str | None = None) -> list[Override]:
    q = select(Override).where(Override.state == "active")
    if node_id is not None:
        q = q.where(or_(Override.node_id == node_id, Override.node_id.is_(None)))
    return list(session.scalars(q.order_by(Override.id.desc())).all())


def list_overrides(session: Session, *, state: str | None, limit: int) -> list[Override]:
    q = select(Override)
    if state:
        q = q.where(Override.state == state)
    return list(session.scalars(q.order_by(Override.id.desc()).limit(limit)).all())


def due_overrides(session: Session, now_s: float) -> list[Override]:
    return list(session.scalars(select(Override).where(
        Override.state == "active", Override.expires_at_s.is_not(None), Override.expires_at_s <= now_s)).all())


# ---- policies and rollouts
def active_policy(session: Session) -> Policy | None:
    return session.scalar(select(Policy).where(Policy.status == "active").limit(1))


def list_policies(session: Session) -> list[Policy]:
    return list(session.scalars(select(Policy).order_by(Policy.uploaded_at_s.desc())).all())


def open_rollout(session: Session, kind: str = "policy") -> Rollout | None:
    """The rollout of ``kind`` ("policy" or "model") in progress ("pending", "baking" or
    "paused"); at most one of each kind at a time."""
    return session.scalar(select(Rollout).where(Rollout.state.in_(("pending", "baking", "paused")),
                                                Rollout.kind == kind).order_by(Rollout.id.desc()).limit(1))


def rollouts(session: Session, limit: int, kind: str | None = "policy") -> list[Rollout]:
    """The newest rollouts of ``kind`` (None: of both kinds)."""
    q = select(Rollout)
    if kind is not None:
        q = q.where(Rollout.kind == kind)
    return list(session.scalars(q.order_by(Rollout.id.desc()).limit(limit)).all())


def active_model(session: Session) -> ModelVersion | None:
    return session.scalar(select(ModelVersion).where(ModelVersion.status == "active").limit(1))


def list_models(session: Session) -> list[ModelVersion]:
    return list(session.scalars(select(ModelVersion).order_by(ModelVersion.uploaded_at_s.desc())).all())


def rollout_nodes(session: Session, rollout_id: int) -> list[RolloutNode]:
    return list(session.scalars(select(RolloutNode).where(RolloutNode.rollout_id == rollout_id)
                                .order_by(RolloutNode.node_id)).all())


def rollout_steps(session: Session, rollout_id: int) -> list[RolloutStep]:
    return list(session.scalars(select(RolloutStep).where(RolloutStep.rollout_id == rollout_id)
                                .order_by(RolloutStep.id)).all())


def rollout_role(session: Session, rollout_id: int, node_id: str) -> RolloutNode | None:
    return session.scalar(select(RolloutNode).where(RolloutNode.rollout_id == rollout_id,
                                                    RolloutNode.node_id == node_id))


# ---- jobs
def record_job_run(session: Session, **kw: Any) -> None:
    session.add(JobRun(**kw))


def job_runs(session: Session, job: str | None, since_s: float | None, limit: int = 1000) -> list[JobRun]:
    q = select(JobRun)
    if job:
        q = q.where(JobRun.job == job)
    if since_s is not None:
        q = q.where(JobRun.started_s >= since_s)
    return list(session.scalars(q.order_by(JobRun.id.desc()).limit(limit)).all())


# ---- gateways: what clients see
def gateway(session: Session, gateway_id: str) -> Gateway | None:
    return session.get(Gateway, gateway_id)


def touch_gateway(session: Session, *, gateway_id: str, token_id: int | None, now_s: float, last_seq: int,
                  interval_s: float) -> Gateway:
    """Create or update the row of ``gateway_id`` (the caller has checked the token may report as it)."""
    gw = session.get(Gateway, gateway_id)
    if gw is None:
        gw = Gateway(gateway_id=gateway_id, token_id=token_id, first_seen_s=now_s, last_seen_s=now_s,
                     last_seq=last_seq, interval_s=interval_s)
        session.add(gw)
    else:
        gw.last_seen_s = now_s
        gw.last_seq = last_seq if gw.last_seq is None else max(gw.last_seq, last_seq)
        gw.interval_s = interval_s
        gw.token_id = token_id  # the caller allowed it: the same token, or the one before is no longer valid
    session.flush()
    return gw


_GATEWAY_REPORT_COLS = [c.name for c in GatewayReport.__table__.columns if c.name != "id"]


def insert_gateway_reports(session: Session, rows: Sequence[dict]) -> set[tuple[str, int]]:
    """Insert gateway report rows, skipping any (gateway_id, seq) already stored (ON CONFLICT DO
    NOTHING on both dialects); returns the keys actually inserted."""
    if not rows:
        return set()
    stmt = (dialect_insert(session, GatewayReport).on_conflict_do_nothing(index_elements=["gateway_id", "seq"])
            .returning(GatewayReport.__table__.c.seq))
    inserted = set()
    conn = session.connection()
    for r in rows:  # a few rows per request (one per interval a gateway buffered)
        if conn.execute(stmt, {c: r.get(c) for c in _GATEWAY_REPORT_COLS}).first() is not None:
            inserted.add((r["gateway_id"], r["seq"]))
    return inserted


def _gateway_window(model, gateway_id: str | None, start_s: float | None, end_s: float | None) -> list:
    """WHERE terms of a read of a gateway's rows (``model``: `GatewayReport` or `TrafficSample`):
    one gateway (None: all), ``start_s <= ts_s < end_s`` (None: open)."""
    return _window_conds(model.gateway_id, gateway_id, model.ts_s, start_s, end_s)


def gateway_reports(session: Session, *, gateway_id: str | None, start_s: float | None, end_s: float | None,
                    limit: int) -> list[GatewayReport]:
    """Gateway reports with ``start_s <= ts_s < end_s``, oldest first (the newest ``limit``)."""
    conds = _gateway_window(GatewayReport, gateway_id, start_s, end_s)
    rows = session.scalars(select(GatewayReport).where(*conds).order_by(GatewayReport.ts_s.desc(),
                                                                         GatewayReport.id.desc()).limit(limit)).all()
    return list(reversed(rows))


def prune_gateway_reports(session: Session, *, before_s: float) -> int:
    """Delete gateway reports with ``ts_s < before_s`` or received before it (a gateway's clock
    may claim a far future: the control plane's receipt time bounds how long anything is kept);
    how many."""
    return int(session.execute(delete(GatewayReport).where(
        or_(GatewayReport.ts_s < before_s, GatewayReport.received_s < before_s))).rowcount or 0)


def prune_gateways(session: Session, *, before_s: float) -> int:
    """Forget gateways last seen before ``before_s`` that have no report left (their id may be
    claimed anew); how many."""
    has_reports = select(GatewayReport.id).where(GatewayReport.gateway_id == Gateway.gateway_id).exists()
    return int(session.execute(delete(Gateway).where(Gateway.last_seen_s < before_s, ~has_reports)
                               .execution_options(synchronize_session=False)).rowcount or 0)


def list_gateways(session: Session) -> list[tuple[Gateway, GatewayReport | None]]:
    """Every gateway that ever reported, with its newest report (by seq)."""
    out = []
    for gw in session.scalars(select(Gateway).order_by(Gateway.gateway_id)).all():
        last = session.scalar(select(GatewayReport).where(GatewayReport.gateway_id == gw.gateway_id)
                              .order_by(GatewayReport.seq.desc()).limit(1))
        out.append((gw, last))
    return out


# ---- gateways: traffic samples (a what-if replay's input; every id a keyed hash)
def claim_gateway(session: Session, *, gateway_id: str, token_id: int | None, now_s: float) -> Gateway:
    """The row of ``gateway_id``, made (claimed by ``token_id``) when it has none, or bound to
    ``token_id`` (the caller has checked it may act as that gateway). A sample batch does not
    touch ``last_seen_s``: a gateway's staleness is about its reports."""
    gw = session.get(Gateway, gateway_id)
    if gw is None:
        gw = Gateway(gateway_id=gateway_id, token_id=token_id, first_seen_s=now_s, last_seen_s=now_s, last_seq=None,
                     interval_s=1.0)
        session.add(gw)
    else:
        gw.token_id = token_id
    session.flush()
    return gw


def insert_traffic_samples(session: Session, rows: Sequence[dict]) -> int:
    """Insert traffic-sample rows (one gateway's, distinct seq), skipping any (gateway_id, seq)
    already stored; returns how many were inserted. Two identical batches at once: one of them
    fails on the unique constraint (IntegrityError), and its sender sends it again."""
    if not rows:
        return 0
    gateway_id = rows[0]["gateway_id"]
    seqs = [r["seq"] for r in rows]
    stored: set[int] = set()
    for k in range(0, len(seqs), 500):
        stored.update(session.scalars(select(TrafficSample.seq).where(TrafficSample.gateway_id == gateway_id,
                                                                      TrafficSample.seq.in_(seqs[k:k + 500]))))
    new = [r for r in rows if r["seq"] not in stored]
    if new:
        session.execute(TrafficSample.__table__.insert(), new)
    return len(new)


def traffic_samples(session: Session, *, gateway_id: str | None, start_s: float | None, end_s: float | None,
                    after: tuple[float, int] | None, limit: int) -> list[TrafficSample]:
    """Traffic samples with ``start_s <= ts_s < end_s``, in (ts_s, id) order, the first ``limit``
    after the cursor ``after`` = (ts_s, id) of the last one read."""
    conds = _gateway_window(TrafficSample, gateway_id, start_s, end_s)
    if after is not None:
        conds.append(or_(TrafficSample.ts_s > after[0], and_(TrafficSample.ts_s == after[0],
                                                             TrafficSample.id > after[1])))
    return list(session.scalars(select(TrafficSample).where(*conds).order_by(TrafficSample.ts_s, TrafficSample.id)
                                .limit(limit)).all())


def prune_traffic_samples(session: Session, *, before_s: float, max_rows: int) -> dict[str, int]:
    """Delete traffic samples with ``ts_s < before_s`` (``expired``), then the oldest stored (lowest
    id) beyond the newest ``max_rows`` (``over_cap``)."""
    expired = int(session.execute(delete(TrafficSample).where(TrafficSample.ts_s < before_s)).rowcount or 0)
    over = 0
    if int(session.scalar(select(func.count()).select_from(TrafficSample)) or 0) > max_rows:
        cut = session.scalar(select(TrafficSample.id).order_by(TrafficSample.id.desc()).offset(max_rows).limit(1))
        if cut is not None:
            over = int(session.execute(delete(TrafficSample).where(TrafficSample.id <= cut)).rowcount or 0)
    return {"expired": expired, "over_cap": over}


# ---- what-if runs (a stored window of traffic samples replayed through the simulator)
from .models import WhatIfRun  # noqa: E402 (kept with the functions that use it)


def count_traffic_samples(session: Session, *, start_s: float, end_s: float) -> int:
    """How many traffic samples have ``start_s <= ts_s < end_s`` (every gateway)."""
    return int(session.scalar(select(func.count()).select_from(TrafficSample)
                              .where(TrafficSample.ts_s >= start_s, TrafficSample.ts_s < end_s)) or 0)


def traffic_sample_cut(session: Session, *, start_s: float, end_s: float, keep: int) -> float:
    """The time from which the last ``keep`` samples of the window ``[start_s, end_s)`` run (the
    window's start when it holds no more)."""
    t = session.scalar(select(TrafficSample.ts_s).where(TrafficSample.ts_s >= start_s, TrafficSample.ts_s < end_s)
                       .order_by(TrafficSample.ts_s.desc(), TrafficSample.id.desc()).offset(keep - 1).limit(1))
    return start_s if t is None else float(t)


def gateway_requests_between(session: Session, *, start_s: float, end_s: float) -> int:
    """Requests the gateways reported in report windows whose time lies in ``[start_s, end_s)``."""
    return int(session.scalar(select(func.coalesce(func.sum(GatewayReport.num_requests), 0))
                              .where(GatewayReport.ts_s >= start_s, GatewayReport.ts_s < end_s)) or 0)


def running_whatif(session: Session) -> WhatIfRun | None:
    return session.scalar(select(WhatIfRun).where(WhatIfRun.state == "running").limit(1))


def whatif_runs(session: Session, *, limit: int, state: str | None = None) -> list[WhatIfRun]:
    """The newest what-if runs first (their results deferred to the caller's reads)."""
    q = select(WhatIfRun).order_by(WhatIfRun.id.desc()).limit(limit)
    if state is not None:
        q = q.where(WhatIfRun.state == state)
    return list(session.scalars(q).all())


def latest_whatif(session: Session, *, state: str | None = None, candidate: str | None = None) -> WhatIfRun | None:
    """The newest what-if run (of ``state``; naming policy ``candidate`` when given)."""
    q = select(WhatIfRun).order_by(WhatIfRun.id.desc()).limit(1)
    if state is not None:
        q = q.where(WhatIfRun.state == state)
    if candidate is not None:
        q = q.where(WhatIfRun.candidate == candidate)
    return session.scalar(q)


def whatif_progress(session: Session, run_id: int, *, progress: float, note: str, now_s: float) -> bool:
    """Record a running run's progress; False when it is no longer running (failed meanwhile)."""
    n = session.execute(update(WhatIfRun).where(WhatIfRun.id == run_id, WhatIfRun.state == "running")
                        .values(progress=progress, progress_note=note[:500], updated_s=now_s)).rowcount
    return bool(n)


def finish_whatif(session: Session, run_id: int, *, state: str, now_s: float, result: dict | None = None,
                  error: str | None = None, **fields) -> bool:
    """Mark a running run ``state`` ("done" or "failed"); False when it was not running."""
    values = dict(state=state, finished_s=now_s, updated_s=now_s, result=result, error=error, **fields)
    if state == "done":
        values.update(progress=1.0)
    n = session.execute(update(WhatIfRun).where(WhatIfRun.id == run_id, WhatIfRun.state == "running")
                        .values(**values)).rowcount
    return bool(n)
