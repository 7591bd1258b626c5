"""`switchboard verifiers`: train the answer probe."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gateway.cli.common import Failure, load_settings
from grading.sandbox import add_unsafe_flag, require_jail

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add `verifiers` and its actions."""
    verifiers = sub.add_parser("verifiers", help="verifiers that stop, prune or escalate answers").add_subparsers(
        metavar="ACTION"
    )
    vprobe = verifiers.add_parser(
        "train-probe", help="train the answer probe on the small tier's graded answers to the router's labeled prompts"
    )
    vprobe.add_argument("--labels", metavar="PATH", help="default: router label's (router_model/data/labels.jsonl)")
    vprobe.add_argument("--out", metavar="DIR", help="the probe's directory (default: HOME/probe)")
    vprobe.add_argument("--tier", default="small", help="the tier whose answers it judges (default: small)")
    vprobe.add_argument("--max-tokens", type=int, default=512, metavar="N", help="longest answer (as labeled)")
    vprobe.add_argument("--sources", nargs="+", choices=("gsm8k", "humaneval"), help="default: both")
    add_unsafe_flag(vprobe)
    vprobe.set_defaults(handler=_verifiers_train_probe)


def _verifiers_train_probe(args: argparse.Namespace) -> int:
    settings = load_settings()
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.max_threads))  # before torch starts, as in serve
    from gateway.runtime.tiers import load_engines
    from router_model.encoder import RouterEncoder
    from router_model.label import DEFAULT_OUT, tier_model
    from verifiers.probe_data import (
        ANSWERS_FILE,
        SOURCES,
        answer_items,
        answered,
        labeled_items,
        summary,
        train_from_answers,
    )

    if args.tier not in settings.tiers or settings.tiers[args.tier].is_remote:
        raise Failure(f"no in-process tier {args.tier!r}; the tiers are {', '.join(settings.tiers)}")
    directory = Path(args.out).expanduser() if args.out else settings.probe_path
    labels = Path(args.labels).expanduser() if args.labels else DEFAULT_OUT
    tier = settings.tiers[args.tier]
    if "humaneval" in (args.sources or SOURCES):
        require_jail(args.unsafe_local_grading)
    try:
        items = labeled_items(labels, settings.home_dir, args.sources or SOURCES)
        answers, model = directory / ANSWERS_FILE, tier_model(tier)
        done, engine = answered(answers, model), None
        if any(item.id not in done for item in items):  # load the tier only to answer
            only = settings.model_copy(update={"tiers": {args.tier: tier}})
            engine = load_engines(only)[args.tier].engine  # type: ignore[attr-defined]
        rows = answer_items(engine, model, items, answers, max_tokens=args.max_tokens)
        probe = train_from_answers(rows, RouterEncoder())
    except (OSError, ValueError) as exc:
        raise Failure(str(exc)) from None
    probe.save(directory)
    print(summary(rows, probe, directory))
    return 0
