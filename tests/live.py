"""A gateway on a real port in a background thread, and helpers to inspect what it stored."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from fastapi import FastAPI

import services
from gateway.db.database import Database
from gateway.db.models import Usage
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


def start_server(app: FastAPI, db: Database) -> tuple[LiveServer, Callable[[], None]]:
    import uvicorn

    port = services.free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(30)

    return LiveServer(f"http://127.0.0.1:{port}", db, app), stop
