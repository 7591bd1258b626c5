"""`switchboard db` and `switchboard budgets`: the schema and the spend counters."""

from __future__ import annotations

import argparse
import sys

from gateway.cli.common import load_settings, open_database

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add `db` and `budgets` and their actions."""
    db = sub.add_parser("db", help="database").add_subparsers(metavar="ACTION")
    db.add_parser("upgrade", help="bring the schema up to date").set_defaults(handler=_db_upgrade)

    budgets = sub.add_parser("budgets", help="spend counters").add_subparsers(metavar="ACTION")
    rec = budgets.add_parser("reconcile", help="rewrite the spend counters from the SQL ledger")
    rec.add_argument("--stale-after", type=float, default=3600.0, metavar="S", help="drop older reservations")
    rec.set_defaults(handler=_budgets_reconcile)


def _db_upgrade(_: argparse.Namespace) -> int:
    db = open_database()
    print(f"database at revision {db.current_revision()}", file=sys.stderr)
    return 0


def _budgets_reconcile(args: argparse.Namespace) -> int:
    import asyncio

    from policies.budgets import Budgets
    from policies.counters import RedisCounters

    settings = load_settings()
    if not settings.redis_url:
        print("no redis_url: counters live in the gateway process and rebuild from SQL on start", file=sys.stderr)
        return 0

    async def run() -> int:
        counters = RedisCounters(settings.redis_url, settings.redis_namespace)  # type: ignore[arg-type]
        try:
            return await Budgets(open_database(), counters, settings.redis_namespace).reconcile(args.stale_after)
        finally:
            await counters.close()

    print(f"rewrote {asyncio.run(run())} spend counters from the ledger", file=sys.stderr)
    return 0
