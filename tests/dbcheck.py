"""Checks over the control plane's stored state, in plain SQL (SQLite or PostgreSQL): what must
hold after fuzzing, failures and restarts. `check_database` returns a list of violations (empty:
valid); `report_seqs` gives each node's stored report sequence numbers for loss/duplicate checks."""

from __future__ import annotations

from sqlalchemy import create_engine, inspect, text

SOURCES = ("base", "residual", "recovery", "override", "guard")
ROLLOUT_STATES = ("pending", "baking", "paused", "promoted", "rolled_back")


def _rows(conn, sql: str) -> list:
    return list(conn.execute(text(sql)))


def check_database(url: str) -> list[str]:
    """Violations of the stored state's invariants (referential, ranges, uniqueness, hashing)."""
    eng = create_engine(url)
    bad: list[str] = []
    try:
        tables = set(inspect(eng).get_table_names())
        with eng.connect() as c:
            def q(sql: str, what: str) -> None:
                rows = _rows(c, sql)
                if rows:
                    bad.append(f"{what}: {[tuple(r) for r in rows[:5]]}")

            if "nodes" in tables:
                q("select node_id, status from nodes where status not in ('up', 'down', 'retired')", "node status")
            if "node_reports" in tables:
                q("select node_id, seq, count(*) from node_reports group by node_id, seq having count(*) > 1",
                  "report stored twice")
                q("select r.node_id from node_reports r left join nodes n on n.node_id = r.node_id "
                  "where n.node_id is null", "report of an unknown node")
                q("select node_id, seq, emb_share from node_reports where emb_share < 0 or emb_share > 1 "
                  "or emb_share_target < 0 or emb_share_target > 1", "emb_share outside [0, 1]")
                q("select node_id, seq from node_reports where slo_attainment < 0 or slo_attainment > 1 "
                  "or p99_ms < 0 or num_requests < 0 or queue_depth < 0", "report figure out of range")
            if "decisions" in tables:
                src = ", ".join(f"'{s}'" for s in SOURCES)
                q(f"select node_id, seq, source from decisions where source not in ({src})", "decision source")
                q("select node_id, seq from decisions where emb_share < 0 or emb_share > 1", "decision share")
                q("select node_id, seq, count(*) from decisions group by node_id, seq having count(*) > 1",
                  "decision stored twice")
            if "bursts" in tables:
                q("select node_id, start_s, end_s from bursts where end_s is not null and end_s < start_s",
                  "burst ends before it starts")
            if "overrides" in tables:
                q("select id, emb_share, state from overrides where emb_share < 0 or emb_share > 1 "
                  "or state not in ('active', 'cleared', 'expired')", "override")
            if "rollouts" in tables:
                st = ", ".join(f"'{s}'" for s in ROLLOUT_STATES)
                q(f"select id, state from rollouts where state not in ({st})", "rollout state")
                q("select r.id from rollouts r left join policies p on p.version = r.policy_version "
                  "where p.version is null", "rollout of an unknown policy")
            if "rollout_nodes" in tables:
                q("select n.id from rollout_nodes n left join rollouts r on r.id = n.rollout_id where r.id is null",
                  "rollout node of an unknown rollout")
            if "tokens" in tables:
                q("select id, role from tokens where role not in ('node', 'operator', 'viewer', 'router') "
                  "or length(token_sha256) != 64", "token (role or hash)")
                if "node_id" in {col["name"] for col in inspect(c).get_columns("tokens")}:
                    q("select id, role from tokens where role != 'node' and node_id is not null",
                      "a token of another role bound to a node id")
            if "audit_log" in tables:
                q("select id from audit_log where actor is null or actor = '' or action is null or action = ''",
                  "audit entry without actor or action")
    finally:
        eng.dispose()
    return bad


def report_seqs(url: str) -> dict[str, list[int]]:
    """Each node's stored report sequence numbers, sorted."""
    eng = create_engine(url)
    try:
        with eng.connect() as c:
            out: dict[str, list[int]] = {}
            for node, seq in _rows(c, "select node_id, seq from node_reports order by node_id, seq"):
                out.setdefault(node, []).append(int(seq))
            return out
    finally:
        eng.dispose()


def gaps(seqs: list[int]) -> list[int]:
    """Sequence numbers missing between the first and the last stored one."""
    have = set(seqs)
    return [s for s in range(min(seqs), max(seqs) + 1) if s not in have] if seqs else []
