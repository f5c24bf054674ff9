"""decision layers: each allocator decision keeps every layer's trace (decisions.layers, JSON,
null for decisions stored before)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 07:00:00.000000
"""
from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('decisions') as batch_op:
        batch_op.add_column(sa.Column('layers', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('decisions') as batch_op:
        batch_op.drop_column('layers')
