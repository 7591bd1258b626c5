"""`switchboard policy`: tune a tenant's sampling policy, list, apply and reject its proposals."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from gateway.cli.common import Failure, load_settings, open_database
from grading.sandbox import add_unsafe_flag, require_jail

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add `policy` and its actions."""
    policy = sub.add_parser("policy", help="tenant policies: tuning proposals").add_subparsers(metavar="ACTION")
    tune = policy.add_parser("tune", help="replay prompts under candidate sampling policies and propose the cheapest")
    tune.add_argument("tenant", metavar="TENANT")
    tune.add_argument(
        "--dataset", choices=("gsm8k", "humaneval", "mtbench", "chat"), help="default: the tenant's stored prompts"
    )
    tune.add_argument("--sample", type=int, default=50, metavar="N", help="prompts replayed (default: 50)")
    tune.add_argument("--tier", default="small", help="the tier a data set is answered on (default: small)")
    tune.add_argument("--judge-tier", default="large", help="the tier judging open answers (default: large)")
    tune.add_argument("--max-tokens", type=int, default=512, metavar="N", help="what a request asks for (512)")
    tune.add_argument("--tolerance", type=float, default=0.02, help="quality (0-1) a proposal may lose (0.02)")
    tune.add_argument("--stop", action="append", default=[], metavar="TEXT", help="a stop string to try (repeat)")
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument("--plot", metavar="PATH", help="also write the PNG here (it is stored with the proposal)")
    add_unsafe_flag(tune)
    tune.set_defaults(handler=_policy_tune)
    plist = policy.add_parser("proposals", help="a tenant's tuning proposals")
    plist.add_argument("tenant", metavar="TENANT")
    plist.set_defaults(handler=_policy_proposals)
    papply = policy.add_parser("apply", help="apply a tuning proposal as the tenant's new policy version")
    papply.add_argument("tenant", metavar="TENANT")
    papply.add_argument("proposal", type=_proposal_id, metavar="ID")
    papply.set_defaults(handler=_policy_apply)
    preject = policy.add_parser("reject", help="reject a tuning proposal")
    preject.add_argument("tenant", metavar="TENANT")
    preject.add_argument("proposal", type=_proposal_id, metavar="ID")
    preject.add_argument("--reason", default="")
    preject.set_defaults(handler=_policy_reject)


def _proposal_id(text: str) -> int:
    """A proposal's number, as the API takes it (a 32-bit column)."""
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= 2**31 - 1):
        raise argparse.ArgumentTypeError(f"not a proposal number: {text!r}")
    return int(text)


def _proposal_stores(tenant: str) -> tuple[int, Any, Any]:
    from gateway.accounting.tenants import tenant_by_name
    from policies.proposals import ProposalStore
    from policies.store import PolicyStore

    db = open_database()
    found = tenant_by_name(db, tenant)
    if found is None:
        raise Failure(f"no tenant named {tenant!r}")
    policies = PolicyStore(db)
    return found.id, policies, ProposalStore(db, policies)


def _policy_tune(args: argparse.Namespace) -> int:
    settings = load_settings()
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.max_threads))  # before torch starts, as in serve
    import asyncio

    from engines.protocol import EngineUnavailable
    from gateway.runtime.tiers import load_engines
    from policies.tune_report import table
    from policies.tune_run import TuneRequest, tune_tenant
    from policies.tuning import TuningError
    from verifiers.policy import tuning_hook

    if args.sample < 1 or args.max_tokens < 1 or not 0 <= args.tolerance <= 1:
        raise Failure("--sample and --max-tokens must be at least 1, --tolerance between 0 and 1")
    if args.dataset == "humaneval":
        require_jail(args.unsafe_local_grading)
    tenant_id, policies, proposals = _proposal_stores(args.tenant)
    request = TuneRequest(
        tenant_id, dataset=args.dataset, sample=args.sample, tier=args.tier, judge_tier=args.judge_tier,
        max_tokens=args.max_tokens, tolerance=args.tolerance, stops=[[s] for s in args.stop], seed=args.seed,
    )  # fmt: skip
    engines = load_engines(settings)
    for engine in set(engines.values()):
        engine.start()
    try:
        pid, _ = asyncio.run(
            tune_tenant(request, engines, policies, proposals, settings.home_dir, "cli", hooks=tuning_hook,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
        )  # fmt: skip
    except (TuningError, EngineUnavailable, OSError) as exc:
        raise Failure(str(exc)) from None
    finally:
        for engine in set(engines.values()):
            engine.shutdown()
    proposal = proposals.get(tenant_id, pid)
    print(table(proposal.report))
    if args.plot:
        png = proposals.plot(tenant_id, pid)
        Path(args.plot).expanduser().write_bytes(png or b"")
    if proposal.status == "proposed":
        print(f"proposal {pid}: review it in the console, or `switchboard policy apply {args.tenant} {pid}`")
    else:
        print(f"proposal {pid}: policy v{proposal.base_version} in force is already the cheapest that keeps quality")
    return 0


def _policy_proposals(args: argparse.Namespace) -> int:
    tenant_id, _, proposals = _proposal_stores(args.tenant)
    for p in proposals.list(tenant_id):
        r = p.report
        print(
            f"{p.id:5}  {p.status:9}  from v{p.base_version}  {r.get('chosen')}: "
            f"{r.get('token_reduction', 0):.1%} fewer tokens, quality {r.get('quality_delta', 0):+.3f}"
        )
    return 0


def _policy_apply(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import IntegrityError

    from policies.proposals import ProposalError

    tenant_id, _, proposals = _proposal_stores(args.tenant)
    try:
        version = proposals.apply(tenant_id, args.proposal, "cli")
    except ProposalError as exc:
        raise Failure(str(exc)) from None
    except IntegrityError:
        raise Failure("the policy changed at the same moment; run it again") from None
    print(f"proposal {args.proposal} applied: {args.tenant} is on policy v{version}")
    return 0


def _policy_reject(args: argparse.Namespace) -> int:
    from policies.proposals import ProposalError

    tenant_id, _, proposals = _proposal_stores(args.tenant)
    try:
        proposals.reject(tenant_id, args.proposal, "cli", args.reason)
    except ProposalError as exc:
        raise Failure(str(exc)) from None
    print(f"proposal {args.proposal} rejected")
    return 0
