"""Connections (SQLAlchemy 2, synchronous) and schema migrations (Alembic) for one database URL.

The gateway calls into it from worker threads (`anyio.to_thread`), never from the event loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic.config import Config
from sqlalchemy import create_engine, event, exc, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.orm import Session, sessionmaker

from core import migrations

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent

# What a database that is down, restarting or out of reach raises (as opposed to a query that is wrong):
# callers answer 503 or serve what they saw recently instead of failing the request.
UNREACHABLE: tuple[type[Exception], ...] = (
    exc.OperationalError,
    exc.InterfaceError,
    exc.DisconnectionError,
    exc.TimeoutError,
)
CONNECT_TIMEOUT_S = 5  # a host that drops packets must fail a request in seconds, not the OS's minutes


def normalize_url(url: str) -> str:
    """`postgresql://` means psycopg 3 here (the driver we install), not psycopg2."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


class Database:
    def __init__(self, url: str) -> None:
        self.url = normalize_url(url)
        parsed = make_url(self.url)
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        if self.is_sqlite and parsed.database and parsed.database != ":memory:":
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        # pre-ping: pooled connections a database restart broke are replaced on checkout, not handed out
        kwargs: dict = {"pool_pre_ping": True}
        if self.is_sqlite:
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        elif parsed.get_backend_name() == "postgresql":
            kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
        self.engine: Engine = create_engine(self.url, **kwargs)
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions() as session, session.begin():
            yield session

    @contextmanager
    def snapshot(self) -> Iterator[Session]:
        """A read-only session whose queries all see the database as of the first one (nothing commits)."""
        with self._sessions() as session:
            if self.is_sqlite:  # pysqlite opens transactions only before writes: ask for one, so reads share it
                session.connection().exec_driver_sql("BEGIN")
            else:
                session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
            try:
                yield session
            finally:
                session.rollback()

    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def upgrade(self, revision: str = "head") -> None:
        from alembic import command

        command.upgrade(self._alembic_config(), revision)

    def downgrade(self, revision: str = "base") -> None:
        from alembic import command

        command.downgrade(self._alembic_config(), revision)

    def current_revision(self) -> str | None:
        from alembic.runtime.migration import MigrationContext

        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def dispose(self) -> None:
        self.engine.dispose()

    def _alembic_config(self) -> Config:
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
        cfg.attributes["engine"] = self.engine  # env.py uses it; no URL goes through ConfigParser
        return cfg


def _sqlite_pragmas(dbapi_conn: DBAPIConnection, _record: object) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA journal_mode=WAL")  # readers never block the usage writer
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()
