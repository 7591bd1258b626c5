"""Tenants and their API keys: create, issue, revoke, authenticate.

A key is `sk-sb-` plus 43 random URL-safe characters (256 bits). Only its sha256 is stored, with the
first characters as a lookup prefix; a plain hash is enough because the keys are random, not chosen.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gateway.db.database import Database
from gateway.db.models import ApiKey, Tenant, utcnow

KEY_PREFIX = "sk-sb-"
PREFIX_LEN = len(KEY_PREFIX) + 10
ROLES = ("app", "admin", "finance")
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


class TenantError(ValueError):
    """A tenant or key operation that cannot be done; the message says why."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: resolved from a valid key on every request."""

    tenant_id: int
    tenant_name: str
    key_id: int
    key_prefix: str
    role: str


@dataclass(frozen=True)
class IssuedKey:
    tenant: str
    key: str  # shown once, never stored
    prefix: str
    role: str


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_tenant(db: Database, name: str) -> IssuedKey:
    if not _TENANT_NAME.fullmatch(name):
        raise TenantError("tenant names are 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit")
    try:
        with db.session() as s:
            tenant = Tenant(name=name)
            s.add(tenant)
            s.flush()
            return _issue(s, tenant, "app")
    except IntegrityError:
        raise TenantError(f"tenant {name!r} already exists") from None


def create_key(db: Database, tenant_name: str, role: str = "app") -> IssuedKey:
    if role not in ROLES:
        raise TenantError(f"role must be one of {', '.join(ROLES)}")
    with db.session() as s:
        tenant = s.scalar(select(Tenant).where(Tenant.name == tenant_name))
        if tenant is None:
            raise TenantError(f"no tenant named {tenant_name!r}")
        return _issue(s, tenant, role)


def revoke_key(db: Database, prefix: str) -> None:
    with db.session() as s:
        key = s.scalar(select(ApiKey).where(ApiKey.prefix == prefix[:PREFIX_LEN]))
        if key is None or len(prefix) < PREFIX_LEN:
            raise TenantError(f"no key with prefix {prefix!r}")
        if key.revoked_at is None:
            key.revoked_at = utcnow()


def authenticate(db: Database, key: str) -> Principal | None:
    if not key.startswith(KEY_PREFIX) or len(key) <= PREFIX_LEN:
        return None
    with db.session() as s:
        row = s.execute(
            select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.prefix == key[:PREFIX_LEN])
        ).first()
    if row is None:
        return None
    api_key, tenant = row
    if api_key.revoked_at is not None or not hmac.compare_digest(api_key.key_hash, hash_key(key)):
        return None
    return Principal(tenant.id, tenant.name, api_key.id, api_key.prefix, api_key.role)


def _issue(session: Session, tenant: Tenant, role: str) -> IssuedKey:
    while True:
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        prefix = key[:PREFIX_LEN]
        if session.scalar(select(ApiKey.id).where(ApiKey.prefix == prefix)) is None:
            break
    session.add(ApiKey(tenant_id=tenant.id, prefix=prefix, key_hash=hash_key(key), role=role))
    return IssuedKey(tenant=tenant.name, key=key, prefix=prefix, role=role)
