"""The adapters each tenant may run: one row per (tenant, tier, name) and the PEFT files in that tenant's folder.

    $SWITCHBOARD_HOME/adapters/t<tenant id>/<digest>/adapter_config.json, adapter_model.safetensors

Registering copies the two files (nothing else from the source) into a staging folder of the tenant's, checks them
there (`check`: `engines.lora.load_adapter` against the tier's model, or `check_adapter` against its config), and
only then moves them to their digest's folder and writes the row with its audit entry: a corrupt or foreign file
leaves no row and no folder, and what was checked is byte for byte what is served. A name is replaced only when
asked (`replace`); a replaced or deleted adapter's folder goes once no row of the tenant names it.

A tenant sees only its own rows: another tenant's adapter, a deleted one and a name never registered are the
same `UnknownAdapter` (404 in the API, not a 403 that would say it exists). Calls block; routes run them in a
worker thread. Lookups are cached for `CACHE_S` per process, so a request that names an adapter costs no query.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from core import audit
from core.db.database import Database
from core.db.models import Adapter, as_utc, utcnow
from engines.lora import CONFIG, WEIGHTS, AdapterError, LoraAdapter
from gateway.adapters.names import ADAPTER_NAME

__all__ = ["AdapterConflict", "AdapterRecord", "AdapterStore", "UnknownAdapter"]

CACHE_S = 5.0  # another replica's registration or deletion reaches this one's requests within this


class UnknownAdapter(LookupError):
    """No adapter of that name on that tier for this tenant."""


class AdapterConflict(ValueError):
    """The name is taken (register with `replace`), or the tenant's policy still serves it by default."""


@dataclass(frozen=True)
class AdapterRecord:
    tenant_id: int
    tier: str
    name: str
    digest: str
    path: Path
    rank: int
    size_bytes: int
    source: str  # uploaded | distilled
    created_by: str
    created_at: datetime
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> str:
        """What a request names it by."""
        return f"{self.tier}:{self.name}"

    @property
    def key(self) -> str:
        """The engine's name for it: the tenant, tier, name and files, so that no two tenants' (or versions') meet."""
        return f"t{self.tenant_id}/{self.tier}/{self.name}@{self.digest[:16]}"

    def as_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "name": self.name, "model": self.model, "digest": self.digest, "rank": self.rank,
                "size_bytes": self.size_bytes, "source": self.source, "created_by": self.created_by,
                "created_at": self.created_at.isoformat(), "details": self.details}  # fmt: skip


def _record(row: Adapter) -> AdapterRecord:
    return AdapterRecord(row.tenant_id, row.tier, row.name, row.digest, Path(row.path), row.rank, row.size_bytes,
                         row.source, row.created_by, as_utc(row.created_at), dict(row.details or {}))  # fmt: skip


class AdapterStore:
    def __init__(self, db: Database, home: Path) -> None:
        self.db = db
        self.root = Path(home).expanduser() / "adapters"
        self._cache: dict[tuple[int, str, str], tuple[float, AdapterRecord | None]] = {}
        self._lock = threading.Lock()

    def folder(self, tenant_id: int) -> Path:
        return self.root / f"t{tenant_id}"

    def register(
        self,
        tenant_id: int,
        tier: str,
        name: str,
        source: Path,
        check: Callable[[Path], LoraAdapter],
        *,
        actor: str,
        origin: str = "uploaded",
        details: dict[str, Any] | None = None,
        replace: bool = False,
    ) -> AdapterRecord:
        """Copy, check and record the adapter in `source` (AdapterError: the files; AdapterConflict: the name)."""
        if not ADAPTER_NAME.match(name):
            raise AdapterError(f"adapter name {name!r}: lowercase letters, digits, '.', '_' and '-', at most 64")
        if not replace and self.find(tenant_id, tier, name, cached=False) is not None:
            raise AdapterConflict(f"tier {tier!r} already has an adapter {name!r}; replace it explicitly")
        staging = self.folder(tenant_id) / f".incoming-{uuid.uuid4().hex}"
        staging.mkdir(parents=True)
        try:
            for file in (CONFIG, WEIGHTS):
                if not (source / file).is_file():
                    raise AdapterError(f"no {file} (a PEFT adapter directory holds {CONFIG} and {WEIGHTS})")
                shutil.copyfile(source / file, staging / file)
            adapter = check(staging)
            final = self.folder(tenant_id) / adapter.digest
            if final.exists():  # the same files again: the folder is already this content
                shutil.rmtree(staging)
            else:
                staging.rename(final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        size = sum((final / f).stat().st_size for f in (CONFIG, WEIGHTS))
        with self.db.session() as s:
            row = s.scalars(self._select(tenant_id, tier, name)).one_or_none()
            before = _record(row).as_dict() if row is not None else None
            if row is None:
                row = Adapter(tenant_id=tenant_id, tier=tier, name=name)
                s.add(row)
            elif not replace:
                raise AdapterConflict(f"tier {tier!r} already has an adapter {name!r}; replace it explicitly")
            old_path = row.path
            row.digest, row.path, row.rank, row.size_bytes = adapter.digest, str(final), adapter.rank, size
            row.source, row.details, row.created_by = origin, details or {}, actor
            row.created_at = utcnow()
            s.flush()
            record = _record(row)
            audit.record(s, actor, "adapter.register", record.model, tenant_id=tenant_id, before=before,
                         after=record.as_dict())  # fmt: skip
        self._forget(tenant_id, tier, name)
        if old_path and old_path != str(final):
            self._sweep(tenant_id, Path(old_path))
        return record

    def find(self, tenant_id: int, tier: str, name: str, cached: bool = True) -> AdapterRecord | None:
        """The tenant's adapter `name` on `tier`, or None (another tenant's is None too)."""
        key = (tenant_id, tier, name)
        now = time.monotonic()
        if cached and (hit := self._cache.get(key)) is not None and hit[0] > now:
            return hit[1]
        with self.db.session() as s:
            row = s.scalars(self._select(tenant_id, tier, name)).one_or_none()
            found = _record(row) if row is not None else None
        with self._lock:
            self._cache[key] = (now + CACHE_S, found)
        return found

    def peek(self, tenant_id: int, tier: str, name: str) -> tuple[bool, AdapterRecord | None]:
        """(True, the cached answer of `find`) while it is fresh, else (False, None): no query, for the event loop."""
        hit = self._cache.get((tenant_id, tier, name))
        return (True, hit[1]) if hit is not None and hit[0] > time.monotonic() else (False, None)

    def get(self, tenant_id: int, tier: str, name: str) -> AdapterRecord:
        if (found := self.find(tenant_id, tier, name)) is None:
            raise UnknownAdapter(f"The model `{tier}:{name}` does not exist or you do not have access to it.")
        return found

    def list(self, tenant_id: int | None) -> list[AdapterRecord]:
        """A tenant's adapters (None: every tenant's, for the operator), by tier and name."""
        with self.db.session() as s:
            q = sa.select(Adapter).order_by(Adapter.tenant_id, Adapter.tier, Adapter.name)
            if tenant_id is not None:
                q = q.where(Adapter.tenant_id == tenant_id)
            return [_record(r) for r in s.scalars(q)]

    def delete(self, tenant_id: int, tier: str, name: str, *, actor: str, in_use: bool = False) -> AdapterRecord:
        """Remove the row and, unless another of the tenant's rows shares them, the files. `in_use`: the tenant's
        policy serves it by default (AdapterConflict: change the policy first)."""
        with self.db.session() as s:
            row = s.scalars(self._select(tenant_id, tier, name)).one_or_none()
            if row is None:
                raise UnknownAdapter(f"The model `{tier}:{name}` does not exist or you do not have access to it.")
            record = _record(row)
            if in_use:
                raise AdapterConflict(f"the tenant's policy serves `{record.model}` by default; change it first")
            s.delete(row)
            audit.record(s, actor, "adapter.delete", record.model, tenant_id=tenant_id, before=record.as_dict())
        self._forget(tenant_id, tier, name)
        self._sweep(tenant_id, record.path)
        return record

    def _select(self, tenant_id: int, tier: str, name: str) -> sa.Select[tuple[Adapter]]:
        return sa.select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.tier == tier, Adapter.name == name)

    def _forget(self, tenant_id: int, tier: str, name: str) -> None:
        with self._lock:
            self._cache.pop((tenant_id, tier, name), None)

    def _sweep(self, tenant_id: int, path: Path) -> None:
        """Delete a folder of the tenant's that no row names any more (only ever inside the tenant's folder)."""
        if path.parent != self.folder(tenant_id):
            return
        with self.db.session() as s:
            same = sa.select(sa.func.count()).where(Adapter.tenant_id == tenant_id, Adapter.path == str(path))
            named = s.scalar(same)
        if not named:
            shutil.rmtree(path, ignore_errors=True)
