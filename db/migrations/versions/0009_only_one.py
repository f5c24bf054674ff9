""""only one" held by the database: at most one active policy, one active model, one open rollout
of each kind and one active override per node (and one for the cluster), as partial unique
indexes, so parallel requests cannot each see none and each add one. And routers.token_id: the
router token that registered a URL (only it changes that URL's push token while it is valid).

Rows a race left behind before this revision are settled first: of several active policies
(models) the one the control plane's own query returns stays active and the rest are retired; of
several open rollouts of a kind the newest stays open and the rest are rolled back; of several
active overrides of one node the newest stays and the rest are cleared.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05 11:00:00.000000
"""
from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

OPEN = "('pending', 'baking', 'paused')"


def _settle() -> None:
    conn = op.get_bind()
    for table in ("policies", "models"):
        keep = conn.execute(sa.text(f"SELECT version FROM {table} WHERE status = 'active' LIMIT 1")).scalar()
        if keep is not None:
            conn.execute(sa.text(f"UPDATE {table} SET status = 'retired' WHERE status = 'active' AND version != :v"),
                         {"v": keep})
    for (kind,) in conn.execute(sa.text(f"SELECT DISTINCT kind FROM rollouts WHERE state IN {OPEN}")).all():
        newest = conn.execute(sa.text(f"SELECT max(id) FROM rollouts WHERE state IN {OPEN} AND kind = :k"),
                              {"k": kind}).scalar()
        conn.execute(sa.text(f"UPDATE rollouts SET state = 'rolled_back' WHERE state IN {OPEN} AND kind = :k "
                             f"AND id != :i"), {"k": kind, "i": newest})
    rows = conn.execute(sa.text("SELECT id, node_id FROM overrides WHERE state = 'active' ORDER BY id DESC")).all()
    seen = set()
    for oid, node in rows:
        if node in seen:
            conn.execute(sa.text("UPDATE overrides SET state = 'cleared', ended_at_s = created_at_s WHERE id = :i"),
                         {"i": oid})
        seen.add(node)


def upgrade() -> None:
    _settle()
    with op.batch_alter_table('routers') as batch_op:
        batch_op.add_column(sa.Column('token_id', sa.Integer(), nullable=True))
    active = sa.text("status = 'active'")
    op.create_index("uq_policies_one_active", "policies", ["status"], unique=True,
                    sqlite_where=active, postgresql_where=active)
    op.create_index("uq_models_one_active", "models", ["status"], unique=True,
                    sqlite_where=active, postgresql_where=active)
    open_ = sa.text(f"state IN {OPEN}")
    op.create_index("uq_rollouts_one_open", "rollouts", ["kind"], unique=True,
                    sqlite_where=open_, postgresql_where=open_)
    on = sa.text("state = 'active'")
    op.create_index("uq_overrides_one_active", "overrides", [sa.text("coalesce(node_id, '*')")], unique=True,
                    sqlite_where=on, postgresql_where=on)


def downgrade() -> None:
    op.drop_index("uq_overrides_one_active", "overrides")
    op.drop_index("uq_rollouts_one_open", "rollouts")
    op.drop_index("uq_models_one_active", "models")
    op.drop_index("uq_policies_one_active", "policies")
    with op.batch_alter_table('routers') as batch_op:
        batch_op.drop_column('token_id')
