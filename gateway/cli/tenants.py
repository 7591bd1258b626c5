"""`switchboard tenant` and `switchboard key`: create tenants, issue and revoke API keys."""

from __future__ import annotations

import argparse
import sys

from gateway.cli.common import open_database

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add `tenant` and `key` and their actions."""
    tenant = sub.add_parser("tenant", help="tenants").add_subparsers(metavar="ACTION")
    create = tenant.add_parser("create", help="create a tenant and print its first key")
    create.add_argument("name")
    create.add_argument("--operator", action="store_true", help="its admin and finance keys reach every tenant")
    create.add_argument("--role", default="app", choices=("app", "admin", "finance"), help="the first key's role")
    create.set_defaults(handler=_tenant_create)

    key = sub.add_parser("key", help="API keys").add_subparsers(metavar="ACTION")
    kc = key.add_parser("create", help="issue another key for a tenant and print it")
    kc.add_argument("tenant")
    kc.add_argument("--role", default="app", choices=("app", "admin", "finance"))
    kc.set_defaults(handler=_key_create)
    kr = key.add_parser("revoke", help="revoke a key by its prefix")
    kr.add_argument("prefix")
    kr.set_defaults(handler=_key_revoke)


def _tenant_create(args: argparse.Namespace) -> int:
    from gateway.accounting.tenants import create_tenant

    issued = create_tenant(open_database(), args.name, operator=args.operator, role=args.role)
    kind = "operator tenant" if args.operator else "tenant"
    print(f"created {kind} {issued.tenant}; its {issued.role} key (shown once, store it now):", file=sys.stderr)
    print(issued.key)
    return 0


def _key_create(args: argparse.Namespace) -> int:
    from gateway.accounting.tenants import create_key

    issued = create_key(open_database(), args.tenant, args.role)
    print(f"new {issued.role} key for {issued.tenant} (shown once, store it now):", file=sys.stderr)
    print(issued.key)
    return 0


def _key_revoke(args: argparse.Namespace) -> int:
    from gateway.accounting.tenants import revoke_key

    revoke_key(open_database(), args.prefix)
    print(f"revoked {args.prefix}", file=sys.stderr)
    return 0
