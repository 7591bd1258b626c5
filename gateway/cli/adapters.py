"""`switchboard adapter`: register, list and remove a tenant's LoRA adapters (PEFT directories) for a tier.

    switchboard adapter add acme small support ./my-adapter   # then `model: "small:support"` for acme's keys
    switchboard adapter list [--tenant acme]
    switchboard adapter remove acme small support

`add` checks the files against the tier's checkpoint as configured here (its config: shapes and layers, without
loading its weights) before anything is kept, exactly as the admin API's upload does against the loaded model.
A running gateway serves a new adapter at once and stops serving a removed one within `CACHE_S` (5 s).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.cli.common import Failure, load_settings, open_database

if TYPE_CHECKING:
    from core.db.database import Database

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add `adapter` and its actions."""
    adapter = sub.add_parser("adapter", help="tenants' LoRA adapters").add_subparsers(metavar="ACTION")
    add = adapter.add_parser("add", help="register a PEFT adapter directory as TIER:NAME for a tenant")
    add.add_argument("tenant")
    add.add_argument("tier")
    add.add_argument("name")
    add.add_argument("path", type=Path, help="holds adapter_config.json and adapter_model.safetensors")
    add.add_argument("--replace", action="store_true", help="replace the tenant's adapter of this name")
    add.set_defaults(handler=_add)
    listing = adapter.add_parser("list", help="the adapters, as JSON lines")
    listing.add_argument("--tenant", help="only this tenant's")
    listing.set_defaults(handler=_list)
    remove = adapter.add_parser("remove", help="remove a tenant's adapter (not while its policy serves it)")
    remove.add_argument("tenant")
    remove.add_argument("tier")
    remove.add_argument("name")
    remove.set_defaults(handler=_remove)


def _add(args: argparse.Namespace) -> int:
    from engines.lora import AdapterError, check_adapter
    from gateway.adapters import AdapterConflict, AdapterStore

    settings = load_settings()
    tier = settings.tiers.get(args.tier)
    if tier is None:
        raise Failure(f"no tier named {args.tier!r}; served: {', '.join(settings.tiers)}")
    if tier.is_remote:
        raise Failure(f"tier {args.tier!r} is served by a remote server: it runs no adapters")
    model_dir = settings.model_dir(tier)
    if not (model_dir / "config.json").exists():
        raise Failure(f"tier {args.tier!r}'s checkpoint is not here ({model_dir}); run `switchboard models fetch`")
    db = open_database()
    store = AdapterStore(db, settings.home_dir)
    try:
        record = store.register(_tenant(db, args.tenant), args.tier, args.name, args.path,
                                lambda folder: check_adapter(folder, model_dir), actor="cli",
                                replace=args.replace)  # fmt: skip
    except (AdapterError, AdapterConflict) as exc:
        raise Failure(str(exc)) from None
    if args.replace:
        from gateway.adapters.policy import forget_learning_if_default
        from policies.store import PolicyStore

        forget_learning_if_default(PolicyStore(db), record.tenant_id, args.tier, args.name, "cli")
    size = record.size_bytes / 1e6
    print(f"registered {record.model} for {args.tenant}: rank {record.rank}, {size:.1f} MB", file=sys.stderr)
    print(json.dumps(record.as_dict()))
    return 0


def _list(args: argparse.Namespace) -> int:
    from gateway.adapters import AdapterStore

    db = open_database()
    tenant_id = _tenant(db, args.tenant) if args.tenant else None
    for record in AdapterStore(db, load_settings().home_dir).list(tenant_id):
        print(json.dumps({"tenant_id": record.tenant_id, **record.as_dict()}))
    return 0


def _remove(args: argparse.Namespace) -> int:
    from gateway.adapters import AdapterConflict, AdapterStore, UnknownAdapter
    from policies.store import PolicyStore

    db = open_database()
    tenant_id = _tenant(db, args.tenant)
    in_use = PolicyStore(db).current(tenant_id).policy.adapters.get(args.tier) == args.name
    try:
        AdapterStore(db, load_settings().home_dir).delete(tenant_id, args.tier, args.name, actor="cli", in_use=in_use)
    except (UnknownAdapter, AdapterConflict) as exc:
        raise Failure(str(exc)) from None
    print(f"removed {args.tier}:{args.name} of {args.tenant}", file=sys.stderr)
    return 0


def _tenant(db: Database, name: str) -> int:
    from gateway.accounting.tenants import tenant_by_name

    tenant = tenant_by_name(db, name)
    if tenant is None:
        raise Failure(f"no tenant named {name!r}")
    return tenant.id
