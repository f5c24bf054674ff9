"""node tokens bound to a node id: tokens.node_id (the one node a node token may act as) and
nodes.token_id (the token that registered the node; another token may not take the id over)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 01:20:00.000000
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # checked against alembic --autogenerate from db.models
    with op.batch_alter_table('tokens', schema=None) as batch_op:
        batch_op.add_column(sa.Column('node_id', sa.String(length=128), nullable=True))
        batch_op.create_index(batch_op.f('ix_tokens__node_id'), ['node_id'], unique=False)
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('token_id', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('token_id')
    with op.batch_alter_table('tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_tokens__node_id'))
        batch_op.drop_column('node_id')
