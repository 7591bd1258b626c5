"""A gateway on a real port in a background thread, and helpers to inspect what it stored."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from fastapi import FastAPI

import services
from core.db.database import Database
from core.db.models import Usage, as_utc
from engines.async_engine import AsyncEngine
from gateway.accounting.ledger import UsageRecord
from gateway.accounting.tenants import create_tenant
from gateway.api.deps import running_pipeline

# How long a request's usage row must have been stored before `wait_for_usage` returns it: a second billing
# of the same request (an abort racing the end of its stream, say) attempted within it fails the wait.
# Counted from the row's `created_at` (set when the request is priced, just before the write), so rows
# stored a while ago, as when a test checks a batch of requests in turn, cost no wait.
SETTLE_SECONDS = 1.5


@contextmanager
def running_engine(model_dir: Path, dtype: str, name: str = "small") -> Iterator[AsyncEngine]:
    """A checkpoint behind a started engine thread, shut down on exit."""
    from engines.engine import Engine

    engine = AsyncEngine(Engine.from_dir(model_dir, dtype=dtype), name=name)
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


@dataclass
class LiveServer:
    base_url: str
    db: Database
    app: FastAPI
    # Ledger writes per request id: the request id is the ledger's primary key, so a second billing of
    # one request adds no row (the database refuses it); it shows here.
    ledger_writes: Counter[str] = field(default_factory=Counter)

    def new_key(self, tenant: str | None = None) -> str:
        return create_tenant(self.db, tenant or f"t-{uuid.uuid4().hex[:10]}").key

    def usage_rows(self, **where: object) -> list[Usage]:
        with self.db.session() as s:
            q = sa.select(Usage)
            for k, v in where.items():
                q = q.where(getattr(Usage, k) == v)
            return list(s.scalars(q))

    def wait_for_usage(self, request_id: str, timeout: float = 15.0) -> list[Usage]:
        """The request's usage rows once it is billed and settled; [] if none is stored within `timeout`.

        Settled: the row has been stored `SETTLE_SECONDS`, and fails if the gateway wrote the request's
        usage more than once meanwhile (a duplicate the ledger refused leaves one row, so the rows alone
        would not show it)."""
        deadline = time.monotonic() + timeout
        while not (rows := self.usage_rows(request_id=request_id)):
            if time.monotonic() > deadline:
                return []
            time.sleep(0.05)
        newest = max(as_utc(row.created_at) for row in rows)
        if (wait := SETTLE_SECONDS - (datetime.now(UTC) - newest).total_seconds()) > 0:
            time.sleep(wait)
        rows = self.usage_rows(request_id=request_id)
        writes = self.ledger_writes[request_id]
        assert writes <= len(rows), f"usage for {request_id} was written {writes} times: billed twice"
        return rows

    def count_ledger_writes(self) -> None:
        """Count this gateway's ledger writes by request id (`ledger_writes`), once it has started."""
        pipeline = running_pipeline(self.app)
        if pipeline is None:  # not a gateway app
            return
        ledger, write = pipeline.ledger, pipeline.ledger.write

        async def counted(rec: UsageRecord) -> None:
            self.ledger_writes[rec.request_id] += 1
            await write(rec)

        ledger.write = counted  # type: ignore[method-assign]


def run_in_thread(
    app: Any, *, lifespan: str = "on", log_level: str = "warning", timeout: float = 60
) -> tuple[str, Callable[[], None]]:
    """Any ASGI app on a free port in a background thread: its base URL, and a function that stops it."""
    import uvicorn

    port = services.free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level, lifespan=lifespan))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(30)

    return f"http://127.0.0.1:{port}", stop


def start_server(app: FastAPI, db: Database) -> tuple[LiveServer, Callable[[], None]]:
    url, stop = run_in_thread(app)
    live = LiveServer(url, db, app)
    live.count_ledger_writes()
    return live, stop


def serve_gateway(
    engine: AsyncEngine, home: Path, database_url: str, **settings: Any
) -> tuple[LiveServer, Callable[[], None]]:
    """The gateway over `engine` as tier `small`, on a real port; Redis keys (if `redis_url` is given) under a
    namespace of its own. The returned function stops it and closes its database connections."""
    from core.settings import Settings
    from gateway.app import create_app

    db = Database(database_url)
    config = Settings(
        home=home,
        database_url=database_url,
        redis_namespace=f"sbtest-{uuid.uuid4().hex[:10]}",
        tiers={"small": {"model": "unused"}},
        **settings,
    )
    live, stop = start_server(create_app(config, engines={"small": engine}, database=db), db)

    def close() -> None:
        stop()
        db.dispose()

    return live, close
