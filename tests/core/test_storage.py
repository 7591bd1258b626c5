"""Migrations, tenants and keys on SQLite and on the local PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from core.db.database import Database
from core.db.models import ApiKey, Base, Usage
from gateway.accounting.ledger import Ledger, UsageRecord
from gateway.accounting.tenants import TenantError, authenticate, create_key, create_tenant, hash_key, revoke_key


def test_migration_creates_exactly_the_models_schema(database: Database) -> None:
    assert database.current_revision() == "0006"
    with database.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_migration_downgrades_and_upgrades_again(database: Database) -> None:
    database.downgrade("base")
    assert set(sa.inspect(database.engine).get_table_names()) <= {"alembic_version"}
    database.upgrade()
    assert {"tenants", "api_keys", "usage"} <= set(sa.inspect(database.engine).get_table_names())


def test_keys_are_stored_hashed_and_authenticate(database: Database) -> None:
    issued = create_tenant(database, "acme")
    assert issued.key.startswith("sk-sb-") and len(issued.key) > 40
    with database.session() as s:
        (row,) = s.scalars(sa.select(ApiKey))
        assert row.key_hash == hash_key(issued.key) and issued.key not in (row.key_hash, row.prefix)
        assert issued.key.startswith(row.prefix)
    who = authenticate(database, issued.key)
    assert who is not None and who.tenant_name == "acme" and who.role == "app"
    assert authenticate(database, issued.key[:-1] + ("A" if issued.key[-1] != "A" else "B")) is None
    assert authenticate(database, "sk-other") is None


def test_more_keys_roles_and_revocation(database: Database) -> None:
    first = create_tenant(database, "acme")
    admin = create_key(database, "acme", "admin")
    assert authenticate(database, admin.key).role == "admin"
    revoke_key(database, first.prefix)
    assert authenticate(database, first.key) is None
    assert authenticate(database, admin.key) is not None
    with pytest.raises(TenantError, match="already exists"):
        create_tenant(database, "acme")
    with pytest.raises(TenantError, match="no tenant"):
        create_key(database, "nobody")
    with pytest.raises(TenantError, match="role"):
        create_key(database, "acme", "root")
    with pytest.raises(TenantError, match="no key"):
        revoke_key(database, "sk-sb-doesnotexist")
    with pytest.raises(TenantError, match="tenant names"):
        create_tenant(database, "no spaces please")


def test_usage_rows_are_unique_per_request(database: Database, tmp_path: Path) -> None:
    issued = create_tenant(database, "acme")
    who = authenticate(database, issued.key)
    rec = UsageRecord.from_columns(
        "req-1", who.tenant_id, who.key_id, "chat.completions", "m", "small", 10, 5, 12, "ok", "stop"
    )
    recorder = Ledger(database, tmp_path / "spool.jsonl")
    recorder.record(rec)
    with pytest.raises(sa.exc.IntegrityError):
        recorder.record(rec)
    with database.session() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(Usage)) == 1


def test_usage_is_spooled_when_the_database_is_down_and_replayed(database: Database, tmp_path: Path) -> None:
    who = authenticate(database, create_tenant(database, "acme").key)
    down = Database("postgresql+psycopg://postgres@127.0.0.1:1/none?connect_timeout=1")
    spool = tmp_path / "spool.jsonl"
    rec = UsageRecord.from_columns(
        "req-2", who.tenant_id, who.key_id, "completions", "m", "small", 3, 4, 5, "aborted", "abort"
    )
    Ledger(down, spool).record(rec)
    assert spool.exists()
    recorder = Ledger(database, spool)
    assert recorder.replay_spool() == 1 and not spool.exists()
    with database.session() as s:
        (row,) = s.scalars(sa.select(Usage))
        assert (row.request_id, row.status, row.completion_tokens) == ("req-2", "aborted", 4)


def test_recent_keys_skip_sql_for_a_second_and_revocation_drops_them(database: Database) -> None:
    import time

    from gateway.accounting import tenants

    issued = create_tenant(database, "acme")
    assert tenants.recently_authenticated(database, issued.key) is None
    who = authenticate(database, issued.key)
    assert tenants.recently_authenticated(database, issued.key) == who
    revoke_key(database, issued.prefix)  # here: at once
    assert tenants.recently_authenticated(database, issued.key) is None and authenticate(database, issued.key) is None
    other = create_key(database, "acme")
    authenticate(database, other.key)
    with database.session() as s:  # revoked by another process: honoured within AUTH_TTL
        s.execute(sa.update(ApiKey).where(ApiKey.prefix == other.prefix).values(revoked_at=sa.func.now()))
    time.sleep(tenants.AUTH_TTL + 0.05)
    assert tenants.recently_authenticated(database, other.key) is None and authenticate(database, other.key) is None


def test_keys_are_stored_under_a_keyed_hash_and_old_plain_hashes_are_upgraded(
    database: Database, tmp_path: Path
) -> None:
    import hashlib

    from gateway.accounting import tenants

    issued = create_tenant(database, "acme")
    plain = hashlib.sha256(issued.key.encode()).hexdigest()
    with database.session() as s:
        row = s.scalars(sa.select(ApiKey)).one()
        assert row.key_hash == hash_key(issued.key) != plain  # a copy of the table alone cannot test keys
        row.key_hash = plain  # as an earlier version stored it
    assert authenticate(database, issued.key) is not None
    with database.session() as s:
        assert s.scalars(sa.select(ApiKey)).one().key_hash == hash_key(issued.key)  # rehashed on first use
    try:  # under another server secret the stored hash matches nothing
        tenants.use_key_secret(None, tmp_path)
        assert (tmp_path / "key-secret").stat().st_mode & 0o777 == 0o600
        tenants._recent.clear()
        assert authenticate(database, issued.key) is None
    finally:
        tenants._configured_secret = None
        tenants._recent.clear()
    assert authenticate(database, issued.key) is not None
