"""Alembic environment: runs against the engine the caller put in `config.attributes["engine"]`.

`switchboard db upgrade` is the way in; plain `alembic` works too with `-x url=...`.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from core.db.database import normalize_url
from core.db.models import Base

config = context.config
engine = config.attributes.get("engine")
if engine is None:
    url = context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        raise SystemExit("run migrations with `switchboard db upgrade`, or alembic -x url=DATABASE_URL")
    engine = create_engine(normalize_url(url))

with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
    )
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
