"""The ledger at scale: finance-report latency over a bulk-loaded ledger, and the request-path overhead of
policy + budget + ledger against a no-op engine.

    .venv/bin/python -m bench.ledger [--rows 100000] [--requests 2000]

Needs the PostgreSQL and Redis the tests use (tests/services.py: the local servers, or throwaway ones
started from the installed binaries). No model runs and torch does no work, so no OMP_NUM_THREADS.

1. Finance report. A fresh PostgreSQL database gets 20 tenants (Zipf-sized) and --rows synthetic usage
   rows over the three full months before this one, across tiers and models, priced with the default
   policy (`policies.pricing.charge`), bulk-inserted; then `rebuild_rollup`, a check that the rollup
   equals the raw sums, and ANALYZE (what autovacuum would do soon after a load). Timed, --reps times:
   the finance report for the largest tenant and the middle month, `reports.costs` by day plus
   `reports.savings` (from the daily rollup), and, as the baseline, the same two answers computed by
   GROUP BY over the raw usage rows. `report_ms` is the rollup report's median.
2. Request path. The real `Pipeline` over a no-op engine (answers every request at once, STOP, with
   64 tokens), a tenant whose policy has daily and monthly hard budgets and key/tenant rate limits
   (all far from refusing), `RedisCounters` on Redis and the ledger on PostgreSQL; and again on SQLite
   with `LocalCounters`, for information. Each request is `start_chat` and then `events()` to the end,
   sequential in one asyncio loop, after a warm-up. Overhead per request = the policy lookup (the
   store's 1 s cache and any thread hop included) + `Budgets.admit` + everything after the engine's
   last output (`Meter.bill` in gateway/pipeline/metering.py: pricing, the ledger row and rollup upsert in their thread,
   `Budgets.settle`), timed around those stages; `overhead_p50_ms`/`overhead_p99_ms` are its
   percentiles on PostgreSQL + Redis. As a cross-check, the same requests run, interleaved, through a
   pipeline whose policy store, budgets and ledger are in-memory no-ops: the difference of the whole
   requests' medians (`overhead_diff_p50_ms`) is what the real stores add beyond the thread hops and
   the pricing that pipeline still does.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from bench import from_tests
from bench.ledger_path import print_paths, request_path
from bench.ledger_rows import finance_report, print_report
from bench.ledger_stats import ms, pct
from core.db.database import Database


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.ledger", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000, help="synthetic usage rows")
    ap.add_argument("--reps", type=int, default=50, help="timed runs of each report")
    ap.add_argument("--requests", type=int, default=2000, help="timed requests per pipeline")
    ap.add_argument("--warmup", type=int, default=200, help="untimed requests per pipeline first")
    args = ap.parse_args()

    svc = from_tests("services")  # the PostgreSQL and Redis the test suite uses
    url, drop = svc.create_database(svc.postgres_url())
    redis_url = svc.redis_url()
    db = Database(url)
    tmp = tempfile.TemporaryDirectory(prefix="sb-bench-ledger-")
    sq = Database(f"sqlite:///{tmp.name}/bench.db")
    try:
        db.upgrade()
        sq.upgrade()
        timing = finance_report(db, args.rows, args.reps)
        home = Path(tmp.name)
        paths = asyncio.run(request_path(db, sq, redis_url, home, args.requests, args.warmup))
    finally:
        db.dispose()
        sq.dispose()
        drop()
        tmp.cleanup()
        svc.stop_all()  # throwaway servers started for this run, if any

    print_report(timing, args.rows)
    summary = print_paths(paths, args.requests, args.warmup)
    live, stub = summary["postgresql+redis"], summary["no-op stand-ins"]
    diff = round(live["p50"] - stub["p50"], 3)
    result = {
        "rows": args.rows,
        "backend": "postgresql+redis",
        "report_ms": ms(statistics.median(timing.t_roll)),
        "report_p99_ms": ms(pct(timing.t_roll, 99)),
        "report_raw_ms": ms(statistics.median(timing.t_raw)),
        "report_raw_p99_ms": ms(pct(timing.t_raw, 99)),
        "report_month_rows": timing.month_rows,
        "rollup_check": timing.same,
        "overhead_p50_ms": live["over_p50"],
        "overhead_p99_ms": live["over_p99"],
        "overhead_mean_ms": live["over_mean"],
        "overhead_diff_p50_ms": diff,
        "request_p50_ms": live["p50"],
        "stub_request_p50_ms": stub["p50"],
        "sqlite_overhead_p50_ms": summary["sqlite+local"]["over_p50"],
        "sqlite_overhead_p99_ms": summary["sqlite+local"]["over_p99"],
        "requests": args.requests,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
