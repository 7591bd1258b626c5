"""`switchboard distill --tenant NAME`: the tenant's own small-tier adapter, from the large tier's answers to its
stored prompts; deployed (registered and made its policy's default) only if it agrees with the large tier on more
held-out prompts than the bare small tier (`gateway.adapters.distill`). Resumable: run it again after a stop and
it continues where it was (the teacher's answers and the training checkpoint are in the work folder). The last
line printed is the report as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from gateway.cli.common import Failure, load_settings, open_database

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add `distill`."""
    p = sub.add_parser("distill", help="distil a tenant's small-tier LoRA adapter from the large tier's answers")
    p.add_argument("--tenant", required=True)
    p.add_argument("--name", default="distilled", help="the adapter's name (requests: small:NAME)")
    p.add_argument("--small", default="small", help="the tier the adapter is for")
    p.add_argument("--large", default="large", help="the tier whose answers it learns")
    p.add_argument("--limit", type=int, default=2000, help="the tenant's newest stored prompts read")
    p.add_argument("--heldout", type=float, default=0.2, help="the share held out to decide stopping and deploying")
    p.add_argument("--max-tokens", type=int, default=512, help="longest teacher (and held-out) answer")
    p.add_argument("--top-k", type=int, default=8, help="the teacher's next-token distributions kept (0: answers only)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--no-deploy", action="store_true", help="train and measure, register nothing")
    p.set_defaults(handler=_distill)


def _distill(args: argparse.Namespace) -> int:
    from engines.lora.train import TrainConfig
    from gateway.accounting.tenants import tenant_by_name
    from gateway.adapters.distill import DistillError, distill

    settings = load_settings()
    db = open_database()
    tenant = tenant_by_name(db, args.tenant)
    if tenant is None:
        raise Failure(f"no tenant named {args.tenant!r}")
    if not 0 < args.heldout < 1 or args.limit < 10 or args.epochs < 1 or args.rank < 1 or not 0 <= args.top_k <= 20:
        raise Failure(
            "--heldout is a share in (0, 1); --limit at least 10; --epochs and --rank at least 1; --top-k 0 to 20"
        )
    config = TrainConfig(rank=args.rank, alpha=2 * args.rank, epochs=args.epochs, learning_rate=args.learning_rate)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        report = distill(settings, db, tenant.id, tenant.name, name=args.name, small=args.small, large=args.large,
                         limit=args.limit, heldout_share=args.heldout, max_tokens=args.max_tokens, top_k=args.top_k,
                         config=config,
                         deploy=not args.no_deploy, say=say)  # fmt: skip
    except DistillError as exc:
        raise Failure(str(exc)) from None
    say(report.why)
    print(json.dumps(report.as_dict()))
    return 0
