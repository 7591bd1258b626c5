"""What every command shares: the settings, the database and the one-line failure."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.settings import Settings

if TYPE_CHECKING:
    from core.db.database import Database

__all__ = ["Failure", "load_settings", "open_database"]


class Failure(Exception):
    """An expected failure: `main` prints it on one line, without a traceback, and exits 1."""


def load_settings() -> Settings:
    from pydantic import ValidationError

    from gateway.accounting.tenants import use_key_secret

    try:
        settings = Settings()
    except ValidationError as exc:
        raise Failure(f"invalid settings:\n{exc}") from None
    use_key_secret(settings.key_secret.get_secret_value() if settings.key_secret else None, settings.home_dir)
    return settings


def open_database() -> Database:
    from core.db.database import Database

    db = Database(load_settings().database)
    db.upgrade()
    return db
