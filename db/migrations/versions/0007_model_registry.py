"""model registry and model rollouts: a models table (checkpoints stored as canonical tars),
rollouts of kind "policy" or "model" (rollouts.kind, rollouts.model_version; policy_version
nullable), the model each node confirmed (nodes.model_digest, nodes.model_error) and, per report,
the model served and its online quality (node_reports.model_digest, node_reports.model_quality)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 07:05:00.000000
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'models',
        sa.Column('version', sa.String(length=64), nullable=False),
        sa.Column('digest', sa.String(length=64), nullable=False),
        sa.Column('artifact', sa.LargeBinary(), nullable=False),
        sa.Column('manifest', sa.JSON(), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('uploaded_by', sa.String(length=128), nullable=False),
        sa.Column('uploaded_at_s', sa.Float(precision=53), nullable=False),
        sa.PrimaryKeyConstraint('version', name=op.f('pk_models')),
    )
    with op.batch_alter_table('rollouts') as batch_op:
        batch_op.add_column(sa.Column('kind', sa.String(length=16), server_default='policy', nullable=False))
        batch_op.add_column(sa.Column('model_version', sa.String(length=64), nullable=True))
        batch_op.alter_column('policy_version', existing_type=sa.String(length=256), nullable=True)
        batch_op.create_foreign_key(op.f('fk_rollouts__model_version__models'), 'models', ['model_version'],
                                    ['version'])
    with op.batch_alter_table('nodes') as batch_op:
        batch_op.add_column(sa.Column('model_digest', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('model_error', sa.Text(), nullable=True))
    with op.batch_alter_table('node_reports') as batch_op:
        batch_op.add_column(sa.Column('model_digest', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('model_quality', sa.Float(precision=53), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('node_reports') as batch_op:
        batch_op.drop_column('model_quality')
        batch_op.drop_column('model_digest')
    with op.batch_alter_table('nodes') as batch_op:
        batch_op.drop_column('model_error')
        batch_op.drop_column('model_digest')
    op.execute("DELETE FROM rollout_steps WHERE rollout_id IN (SELECT id FROM rollouts WHERE kind = 'model')")
    op.execute("DELETE FROM rollout_nodes WHERE rollout_id IN (SELECT id FROM rollouts WHERE kind = 'model')")
    op.execute("DELETE FROM rollouts WHERE kind = 'model'")
    with op.batch_alter_table('rollouts') as batch_op:
        batch_op.drop_constraint(op.f('fk_rollouts__model_version__models'), type_='foreignkey')
        batch_op.drop_column('model_version')
        batch_op.drop_column('kind')
        batch_op.alter_column('policy_version', existing_type=sa.String(length=256), nullable=False)
    op.drop_table('models')
