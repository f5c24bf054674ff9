"""SQL history of the control plane: typed SQLAlchemy 2 models (`db.models`), the engine and
session factory with Alembic-run migrations (`db.engine`), and query functions that take a
session and never commit (`db.queries`). SQLite by default; PostgreSQL through psycopg 3."""
