"""Alembic's migrations of the SQL schema (`versions/`, one file per revision), run by `core.db.database`."""

__all__: list[str] = []
