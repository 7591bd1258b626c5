"""A live gateway for a benchmark that asks it things: `switchboard serve` on the default profile (the Qwen pair
and SmolLM2, int8) with a router for `auto`, on SQLite in a subprocess (`bench.savings_gateway`), and one tenant
whose key the benchmark uses, its policy far from every limit and its cache off."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.savings_gateway import prepare_router, start_gateway
from bench.serve import far_limits


@contextmanager
def gateway(home: Path, out: Path, threads: int) -> Iterator[tuple[str, str, str]]:
    """(its URL, a tenant's key, its database URL) while it runs."""
    from core.db.database import Database
    from gateway.accounting.tenants import create_tenant, tenant_by_name
    from policies.policy import CacheSettings, Policy
    from policies.store import PolicyStore

    kept = out / "router"  # trained by an earlier run of this benchmark: reused
    router = prepare_router(kept if (kept / "router.json").exists() else None, "default", home, out)
    served = start_gateway(home, "default", router, embedded=True, log=out / "gateway.log", threads=threads)
    try:
        db = Database(served.db_url)
        name = f"bench-{uuid.uuid4().hex[:8]}"
        key = create_tenant(db, name, actor="bench").key
        tenant = tenant_by_name(db, name)
        assert tenant is not None
        PolicyStore(db).save(tenant.id, Policy(cache=CacheSettings(enabled=False), **far_limits()), "bench")
        db.dispose()
        yield served.url, key, served.db_url
    finally:
        served.stop()
