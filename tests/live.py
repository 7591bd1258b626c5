"""A gateway on a real port in a background thread, and helpers to inspect what it stored."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from fastapi import FastAPI

import services
from core.db.database import Database
from core.db.models import Usage
from engines.async_engine import AsyncEngine
from gateway.tenants import create_tenant


@dataclass
class LiveServer:
    base_url: str
    db: Database
    app: FastAPI

    def new_key(self, tenant: str | None = None) -> str:
        return create_tenant(self.db, tenant or f"t-{uuid.uuid4().hex[:10]}").key

    def usage_rows(self, **where: object) -> list[Usage]:
        with self.db.session() as s:
            q = sa.select(Usage)
            for k, v in where.items():
                q = q.where(getattr(Usage, k) == v)
            return list(s.scalars(q))

    def wait_for_usage(self, request_id: str, timeout: float = 15.0) -> list[Usage]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.usage_rows(request_id=request_id):
                time.sleep(0.2)  # a duplicate, if there were one, would land right after
                return self.usage_rows(request_id=request_id)
            time.sleep(0.05)
        return []


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
    return LiveServer(url, db, app), stop


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
