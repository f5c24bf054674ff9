"""no push secrets in the database: routers.push_token dropped (the control plane derives each
router's push token from its secret key, kept outside the database; a gateway registers again
within a minute and is given the new one)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05 14:00:00.000000
"""
from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("UPDATE routers SET pushed_version = NULL")  # pushed again, with the derived token
    with op.batch_alter_table('routers') as batch_op:
        batch_op.drop_column('push_token')


def downgrade() -> None:
    with op.batch_alter_table('routers') as batch_op:
        batch_op.add_column(sa.Column('push_token', sa.String(length=512), nullable=True))
