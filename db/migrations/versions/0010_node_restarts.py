"""a node's restarts: nodes.started_at_s (when the agent process that registered last started,
wall seconds; null: it did not say) and nodes.num_restarts (registrations from a process started
at another time than the one before)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05 12:00:00.000000
"""
from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('nodes') as batch_op:
        batch_op.add_column(sa.Column('started_at_s', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('num_restarts', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('nodes') as batch_op:
        batch_op.drop_column('num_restarts')
        batch_op.drop_column('started_at_s')
