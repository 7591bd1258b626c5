"""`bench.soak`'s services of its own: a redis-server to kill and start again on the same port, a PostgreSQL
database (`soak_<pid>`) to count the ledger's rows in, and the tenants with their policies."""

from __future__ import annotations

import os
from decimal import Decimal
from typing import Any

from bench import from_tests
from bench.soak_verdict import Ledger

__all__ = ["TIGHT_TOKENS", "Postgres", "RedisProcess", "create_tenants", "free_port", "main_policy"]

TIGHT_TOKENS = 400  # soak-tight's daily token budget: a handful of requests

services = from_tests("services")  # the test suite's PostgreSQL and Redis helpers
free_port = services.free_port


class RedisProcess(services.RedisServer):
    """A redis-server of the soak's own (`tests/services.py`), without persistence, its output in `log`, to
    kill and start again on the same port; and what the soak reads from it."""

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=1)

    def held_reservations(self, namespace: str) -> int:
        """Reservations listed as in flight (policies/counters.py): none should be left once idle."""
        client = self.client()
        try:
            return int(client.hlen(f"{namespace}:reservations"))
        finally:
            client.close()

    def daily_tokens(self, namespace: str, tenant_id: int) -> tuple[int, int]:
        """(the tenant's daily token counters summed, how many windows there are)."""
        client = self.client()
        try:
            keys = list(client.scan_iter(f"{namespace}:spend:{tenant_id}:daily:*:tokens"))
            return sum(int(client.get(k) or 0) for k in keys), len(keys)
        finally:
            client.close()

    def dbsize(self) -> int | None:
        import redis

        client = self.client()
        try:
            return int(client.dbsize())
        except redis.RedisError:
            return None
        finally:
            client.close()


class Postgres:
    """A database of the soak's own (`soak_<pid>`) on the test suite's PostgreSQL server."""

    def __init__(self, server_url: str) -> None:
        import sqlalchemy as sa

        self.sa = sa
        self.name = f"soak_{os.getpid()}"
        # the admin connection lives on the server's own database: it is not one of the soak database's
        self.admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
        with self.admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
            conn.execute(sa.text(f'CREATE DATABASE "{self.name}"'))
        self.url = sa.make_url(server_url).set(database=self.name).render_as_string(hide_password=False)

    def connections(self) -> int | None:
        sql = self.sa.text("select count(*) from pg_stat_activity where datname = :name")
        try:
            with self.admin.connect() as conn:
                return int(conn.execute(sql, {"name": self.name}).scalar_one())
        except self.sa.exc.SQLAlchemyError:
            return None

    def ledger(self) -> Ledger:
        sa = self.sa
        engine = sa.create_engine(self.url, poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                found = conn.execute(
                    sa.text(
                        "select u.request_id, t.name, u.status, u.cache_status from usage u "
                        "join tenants t on t.id = u.tenant_id"
                    )
                ).all()
                dups = conn.execute(
                    sa.text("select coalesce(sum(n - 1), 0) from (select count(*) n from usage group by request_id) c")
                ).scalar_one()
        finally:
            engine.dispose()
        return Ledger({r[0]: (r[1], r[2], r[3]) for r in found}, int(dups))

    def tenant_tokens(self) -> dict[str, tuple[int, int]]:
        """Tenant name → (its id, prompt + completion tokens in its ledger rows)."""
        sa = self.sa
        engine = sa.create_engine(self.url, poolclass=sa.pool.NullPool)
        sql = sa.text(
            "select t.name, t.id, coalesce(sum(u.prompt_tokens + u.completion_tokens), 0) from tenants t "
            "left join usage u on u.tenant_id = t.id group by t.name, t.id"
        )
        try:
            with engine.connect() as conn:
                return {name: (int(tid), int(tokens)) for name, tid, tokens in conn.execute(sql)}
        finally:
            engine.dispose()

    def drop(self) -> None:
        with self.admin.connect() as conn:
            conn.execute(self.sa.text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        self.admin.dispose()


def main_policy(cap: int | None = None) -> dict[str, Any]:
    """soak-main's policy (as the admin API takes it): budgets and rate limits that never refuse."""
    policy: dict[str, Any] = {
        "budgets": [
            {"period": "daily", "money": "100000", "tokens": 10**12},
            {"period": "monthly", "money": "1000000", "tokens": 10**13},
        ],
        "rate_limits": {"key_rpm": 10**7, "key_tpm": 10**11, "tenant_rpm": 10**7, "tenant_tpm": 10**11},
    }
    if cap is not None:
        policy["sampling"] = {"max_tokens_cap": cap}
    return policy


def create_tenants(db_url: str) -> dict[str, str]:
    """The tenants and their keys: `admin` (operator, admin role), `soak-main`, `soak-open`, `soak-tight`."""
    from core.db.database import Database
    from gateway.accounting.tenants import authenticate, create_tenant
    from policies.policy import Budget, Policy
    from policies.store import PolicyStore

    db = Database(db_url)
    db.upgrade()
    keys = {"admin": create_tenant(db, "soak-admin", operator=True, role="admin").key}
    store = PolicyStore(db)
    for name in ("soak-main", "soak-open", "soak-tight"):
        keys[name] = create_tenant(db, name).key
        principal = authenticate(db, keys[name])
        assert principal is not None
        if name == "soak-main":
            store.save(principal.tenant_id, Policy.model_validate(main_policy()), "soak", note="bench/soak.py")
        elif name == "soak-tight":
            tight = Policy(budgets=[Budget(period="daily", tokens=TIGHT_TOKENS, money=Decimal(1000))])
            store.save(principal.tenant_id, tight, "soak", note="bench/soak.py")
    db.engine.dispose()
    return keys
