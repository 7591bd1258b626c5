"""Tenants and their API keys: create, issue, revoke, authenticate.

A key is `sk-sb-` plus 43 random URL-safe characters (256 bits). Only its HMAC-SHA256 under a server
secret is stored, with the first characters as a lookup prefix, and compared in constant time. The
secret lives outside the database (setting `key_secret`, else the file `key-secret` in the home
directory, created once, mode 0600), so a copy of the database alone cannot test candidate keys
offline. Keys stored by earlier versions as a plain sha256 still work and are rehashed on first use.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core import audit
from core.db.database import UNREACHABLE, Database
from core.db.models import ApiKey, Tenant, utcnow

log = logging.getLogger(__name__)

KEY_PREFIX = "sk-sb-"
PREFIX_LEN = len(KEY_PREFIX) + 10
ROLES = ("app", "admin", "finance")
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


class TenantError(ValueError):
    """A tenant or key operation that cannot be done; the message says why."""


class OperatorOnly(TenantError):
    """What only the operator's keys may do (create tenants), asked by another tenant's key."""


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

    @property
    def scope(self) -> int | None:
        """The one tenant this caller's lists, reports and audit cover; None: every tenant (the operator's)."""
        return None if self.operator else self.tenant_id

    def may_see(self, tenant_id: int) -> bool:
        return self.operator or tenant_id == self.tenant_id


@dataclass(frozen=True)
class IssuedKey:
    tenant: str
    key: str  # shown once, never stored
    prefix: str
    role: str


_configured_secret: bytes | None = None


def use_key_secret(secret: str | None, home: Path) -> None:
    """The process's key secret: `secret` if given, else the home directory's `key-secret` file. The
    server and the CLI call this with their settings; without a call, `SWITCHBOARD_KEY_SECRET` or the
    file in `SWITCHBOARD_HOME` (default ~/.cache/switchboard) is used."""
    global _configured_secret
    _configured_secret = _load_secret(secret, str(home.expanduser()))


@functools.cache
def _load_secret(secret: str | None, home: str) -> bytes:
    if secret:
        return secret.encode()
    path = Path(home) / "key-secret"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:  # O_EXCL: two processes starting at once agree on one secret
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path.read_bytes()
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        return path.read_bytes()


def _key_secret() -> bytes:
    if _configured_secret is not None:
        return _configured_secret
    home = os.environ.get("SWITCHBOARD_HOME") or "~/.cache/switchboard"
    return _load_secret(os.environ.get("SWITCHBOARD_KEY_SECRET"), str(Path(home).expanduser()))


def hash_key(key: str) -> str:
    return hmac.new(_key_secret(), key.encode(), hashlib.sha256).hexdigest()


def _legacy_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_tenant(
    db: Database,
    name: str,
    *,
    operator: bool = False,
    role: str = "app",
    actor: str = "cli",
    by: Principal | None = None,
) -> IssuedKey:
    """A new tenant and its first key (an `app` key unless `role` says otherwise); `by`: the API caller, who
    must hold one of the operator's keys (`OperatorOnly`); the CLI and the tests create as the operator."""
    if by is not None and not by.operator:
        raise OperatorOnly("Only the operator's admin keys create tenants.")
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
        key_hash = key.key_hash
    with _recent_lock:  # a revoked key stops working in this process at once
        _recent.pop((db.url, key_hash), None)


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
# Revoking a key here drops it at once; another gateway process honours a revocation within 2 × AUTH_TTL.
# While the database cannot be reached, a key that authenticated in the last STALE_FOR seconds keeps
# working (an outage must not lock every client out); keys not seen that recently get a 503. The
# moment the database answers again, it decides: a key revoked meanwhile stops working.
AUTH_TTL = 1.0
STALE_FOR = 300.0
RETRY_AFTER = 1.0  # seconds an unreachable database is not asked again: recent keys are served meanwhile
MAX_CACHED = 10_000
_recent: dict[tuple[str, str], tuple[float, Principal]] = {}  # (database url, key hash) → (when, who)
_unreachable_until: dict[str, float] = {}  # database url → when to try it again
_recent_lock = threading.Lock()
_refreshing: set[tuple[str, str]] = set()  # keys whose expired entry one caller is checking again


def recently_authenticated(db: Database, key: str) -> Principal | None:
    """The principal of a key that authenticated less than AUTH_TTL ago, or less than STALE_FOR ago while
    the database is unreachable (no SQL: safe on the event loop)."""
    cache_key = (db.url, hash_key(key))
    hit = _recent.get(cache_key)
    if hit is None:
        return None
    age = time.monotonic() - hit[0]
    down = time.monotonic() < _unreachable_until.get(db.url, 0.0)
    if age < AUTH_TTL or (down and age < STALE_FOR):
        return hit[1]
    # Just expired: the first caller checks it again in SQL (None sends it to `authenticate`), the others
    # keep the cached answer for at most another AUTH_TTL, so a burst on one key does not query SQL at once.
    if age < 2 * AUTH_TTL:
        with _recent_lock:
            if cache_key in _refreshing:
                return hit[1]
            _refreshing.add(cache_key)
    return None


def authenticate(db: Database, key: str) -> Principal | None:
    """The key's principal, None for an unknown or revoked key. With the database unreachable: the
    principal it had within STALE_FOR seconds, else the database's error (the API answers 503)."""
    if not key.startswith(KEY_PREFIX) or len(key) <= PREFIX_LEN:
        return None
    cache_key = (db.url, hash_key(key))
    try:
        who = _authenticate(db, key)
    except UNREACHABLE:
        _refreshing.discard(cache_key)
        _unreachable_until[db.url] = time.monotonic() + RETRY_AFTER
        hit = _recent.get(cache_key)
        if hit is not None and time.monotonic() - hit[0] < STALE_FOR:
            log.warning("database unreachable: serving a key that authenticated %.0f s ago", time.monotonic() - hit[0])
            return hit[1]
        raise
    _unreachable_until.pop(db.url, None)
    with _recent_lock:
        _refreshing.discard(cache_key)
        if who is None:  # unknown or revoked: the database's word wins over what was cached
            _recent.pop(cache_key, None)
            return None
        if len(_recent) >= MAX_CACHED:  # bounded: forget the oldest; many distinct keys just fall back to SQL
            oldest = sorted(_recent, key=lambda k: _recent[k][0])[: MAX_CACHED // 10]
            for k in oldest:
                del _recent[k]
        _recent[cache_key] = (time.monotonic(), who)
    return who


def _authenticate(db: Database, key: str) -> Principal | None:
    with db.session() as s:
        row = s.execute(
            select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.prefix == key[:PREFIX_LEN])
        ).first()
    if row is None:
        return None
    api_key, tenant = row
    if api_key.revoked_at is not None:
        return None
    keyed = hash_key(key)
    if not hmac.compare_digest(api_key.key_hash, keyed):
        if not hmac.compare_digest(api_key.key_hash, _legacy_hash(key)):
            return None
        with db.session() as s:  # stored by an earlier version: keep only the keyed hash from now on
            s.execute(update(ApiKey).where(ApiKey.id == api_key.id).values(key_hash=keyed))
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
