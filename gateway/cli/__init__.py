"""The `switchboard` command: serve, models, tenants, keys and the database.

Heavy imports (torch, transformers) happen inside the commands that need them, so `switchboard
tenant create` answers at once and `serve` can set OMP_NUM_THREADS before torch starts.

Each area module registers its own subcommands; `_parser` adds them in the order `--help` lists them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from engines.checkpoints.fetch import FetchError
from gateway.accounting.tenants import TenantError
from gateway.cli import adapters, db, distill, models, policy, router, serve, tenants, verifiers
from gateway.cli.common import Failure

__all__ = ["main"]

# serve, models, tenant, key, adapter, distill, db, router, verifiers, policy: the order `switchboard --help` shows
_AREAS = (serve, models, tenants, adapters, distill, db, router, verifiers, policy)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.config:
        os.environ["SWITCHBOARD_CONFIG"] = args.config
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except (Failure, FetchError, TenantError) as exc:  # expected failures: one line, no traceback
        print(f"switchboard: {exc}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchboard", description="An LLM inference gateway that makes tokens cheap.")
    p.add_argument("--config", help="TOML settings file (default: $SWITCHBOARD_CONFIG or ./switchboard.toml)")
    sub = p.add_subparsers(metavar="COMMAND")
    for area in _AREAS:
        area.register(sub)
    return p
