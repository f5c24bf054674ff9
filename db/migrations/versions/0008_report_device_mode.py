"""what a report's figures are: node_reports.device_mode ("real", "link-emulated" or "emulated":
modelled time) and node_reports.device_profile (an emulated device's cost profile), both nullable
(null: the node did not say)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-09 10:00:00.000000
"""
from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('node_reports') as batch_op:
        batch_op.add_column(sa.Column('device_mode', sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column('device_profile', sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('node_reports') as batch_op:
        batch_op.drop_column('device_profile')
        batch_op.drop_column('device_mode')
