"""history at commit: the pre-aggregated buckets (node_report_buckets) are kept in each report's
own transaction, so the roll-up job's watermark (history_rollup_state) and the index it searched
(node_reports.received_s) go. Buckets the job had not reached yet are recomputed from the raw
reports first (every bucket from the oldest report received after the watermark; all of them
where the job never ran).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06 10:30:00.000000
"""
from alembic import op
import sqlalchemy as sa


revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    from db.queries import rebuild_history

    conn = op.get_bind()
    mark = conn.execute(sa.text("SELECT received_to_s FROM history_rollup_state WHERE name = 'history'")).scalar()
    if mark is None:
        rebuild_history(conn)
    else:
        since = conn.execute(sa.text("SELECT min(ts_s) FROM node_reports WHERE received_s >= :m"),
                             {"m": mark}).scalar()
        if since is not None:
            rebuild_history(conn, since_ts_s=float(since))
    with op.batch_alter_table('node_reports', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_node_reports__received_s'))
    op.drop_table('history_rollup_state')


def downgrade() -> None:
    # the old roll-up job starts over from no watermark: it aggregates every stored raw report
    op.create_table('history_rollup_state',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('received_to_s', sa.Float(precision=53), nullable=False),
    sa.Column('updated_s', sa.Float(precision=53), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_history_rollup_state'))
    )
    with op.batch_alter_table('node_reports', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_node_reports__received_s'), ['received_s'], unique=False)
