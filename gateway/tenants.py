"""Tenants and their API keys: create, issue, revoke, authenticate.

A key is `sk-sb-` plus 43 random URL-safe characters (256 bits). Only its sha256 is stored, with the
first characters as a lookup prefix; a plain hash is enough because the keys are random, not chosen.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gateway import audit
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
    operator: bool = False  # a key of the operator's tenant: admin and finance reach every tenant

    @property
    def actor(self) -> str:
        """How the audit log names this caller."""
        return f"{self.role}:{self.key_prefix}"

    def may_see(self, tenant_id: int) -> bool:
        return self.operator or tenant_id == self.tenant_id


@dataclass(frozen=True)
class IssuedKey:
    tenant: str
    key: str  # shown once, never stored
    prefix: str
    role: str


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_tenant(
    db: Database, name: str, *, operator: bool = False, role: str = "app", actor: str = "cli"
) -> IssuedKey:
    """A new tenant and its first key (an `app` key unless `role` says otherwise)."""
    if not _TENANT_NAME.fullmatch(name):
        raise TenantError("tenant names are 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit")
    if role not in ROLES:
        raise TenantError(f"role must be one of {', '.join(ROLES)}")
    try:
        with db.session() as s:
            tenant = Tenant(name=name, is_operator=operator)
            s.add(tenant)
            s.flush()
            audit.record(s, actor, "tenant.create", name, tenant_id=tenant.id, after={"operator": operator})
            return _issue(s, tenant, role, actor)
    except IntegrityError:
        raise TenantError(f"tenant {name!r} already exists") from None


def create_key(db: Database, tenant_name: str, role: str = "app", *, actor: str = "cli") -> IssuedKey:
    if role not in ROLES:
        raise TenantError(f"role must be one of {', '.join(ROLES)}")
    with db.session() as s:
        tenant = s.scalar(select(Tenant).where(Tenant.name == tenant_name))
        if tenant is None:
            raise TenantError(f"no tenant named {tenant_name!r}")
        return _issue(s, tenant, role, actor)


def revoke_key(db: Database, prefix: str, *, actor: str = "cli", tenant_id: int | None = None) -> None:
    """Revoke by prefix; with `tenant_id`, only a key of that tenant."""
    with db.session() as s:
        key = s.scalar(select(ApiKey).where(ApiKey.prefix == prefix[:PREFIX_LEN]))
        if key is None or len(prefix) < PREFIX_LEN or (tenant_id is not None and key.tenant_id != tenant_id):
            raise TenantError(f"no key with prefix {prefix!r}")
        if key.revoked_at is None:
            key.revoked_at = utcnow()
            audit.record(s, actor, "key.revoke", key.prefix, tenant_id=key.tenant_id, before={"role": key.role})
    with _recent_lock:  # a revoked key stops working in this process at once
        _recent.clear()


def tenant_by_name(db: Database, name: str) -> Tenant | None:
    with db.session() as s:
        return s.scalar(select(Tenant).where(Tenant.name == name))


def list_tenants(db: Database, only: int | None = None) -> list[Tenant]:
    with db.session() as s:
        q = select(Tenant).order_by(Tenant.name)
        if only is not None:
            q = q.where(Tenant.id == only)
        return list(s.scalars(q))


def list_keys(db: Database, tenant_id: int) -> list[ApiKey]:
    with db.session() as s:
        return list(s.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.id)))


# Keys that authenticated in the last second, so a burst of requests does not query SQL per request.
# Revoking a key here drops the cache at once; another gateway process honours a revocation within AUTH_TTL.
AUTH_TTL = 1.0
_recent: dict[tuple[str, str], tuple[float, Principal]] = {}  # (database url, key hash) → (expiry, who)
_recent_lock = threading.Lock()


def recently_authenticated(db: Database, key: str) -> Principal | None:
    """The principal of a key that authenticated less than AUTH_TTL ago (no SQL: safe on the event loop)."""
    hit = _recent.get((db.url, hash_key(key)))
    return hit[1] if hit is not None and hit[0] > time.monotonic() else None


def authenticate(db: Database, key: str) -> Principal | None:
    if not key.startswith(KEY_PREFIX) or len(key) <= PREFIX_LEN:
        return None
    who = _authenticate(db, key)
    if who is not None:
        with _recent_lock:
            if len(_recent) > 10_000:  # bounded: many distinct keys just fall back to SQL
                _recent.clear()
            _recent[(db.url, hash_key(key))] = (time.monotonic() + AUTH_TTL, who)
    return who


def _authenticate(db: Database, key: str) -> Principal | None:
    with db.session() as s:
        row = s.execute(
            select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.prefix == key[:PREFIX_LEN])
        ).first()
    if row is None:
        return None
    api_key, tenant = row
    if api_key.revoked_at is not None or not hmac.compare_digest(api_key.key_hash, hash_key(key)):
        return None
    return Principal(tenant.id, tenant.name, api_key.id, api_key.prefix, api_key.role, tenant.is_operator)


def _issue(session: Session, tenant: Tenant, role: str, actor: str) -> IssuedKey:
    while True:
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        prefix = key[:PREFIX_LEN]
        if session.scalar(select(ApiKey.id).where(ApiKey.prefix == prefix)) is None:
            break
    session.add(ApiKey(tenant_id=tenant.id, prefix=prefix, key_hash=hash_key(key), role=role))
    audit.record(session, actor, "key.create", prefix, tenant_id=tenant.id, after={"role": role})
    return IssuedKey(tenant=tenant.name, key=key, prefix=prefix, role=role)
