"""`switchboard router`: label prompts, train, calibrate and evaluate the learned complexity router."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.cli.common import Failure, load_settings, open_database
from grading.datasets import SOURCES
from grading.sandbox import add_unsafe_flag, require_jail

if TYPE_CHECKING:
    import numpy as np

    from core.settings import Settings
    from router_model.examples import Example
    from router_model.hidden import HiddenSpec
    from router_model.train import HiddenStates

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add `router` and its actions."""
    router = sub.add_parser("router", help="the learned complexity router").add_subparsers(metavar="ACTION")
    rlabel = router.add_parser("label", help="label shipped prompts by what the small and large tiers get right")
    rlabel.add_argument("--out", metavar="PATH", help="JSONL to add rows to (default: router_model/data/labels.jsonl)")
    rlabel.add_argument("--per-source", type=int, metavar="N", help="a seeded sample (default: 300 GSM8K, all else)")
    rlabel.add_argument("--sources", nargs="+", choices=SOURCES, help="default: all")
    rlabel.add_argument("--seed", type=int, default=0, help="the sample's seed")
    rlabel.add_argument("--max-tokens", type=int, default=512, metavar="N", help="longest answer of either tier")
    rlabel.add_argument("--concurrency", type=int, default=24, metavar="N", help="items in flight at once")
    rlabel.add_argument("--keep-text", action="store_true", help="also store both answers in each row")
    add_unsafe_flag(rlabel)
    rlabel.set_defaults(handler=_router_label)
    where = {"help": "the router's directory (default: HOME/router)", "metavar": "DIR"}
    rtrain = router.add_parser("train", help="train on a label file; keeps the best of the candidate classifiers")
    rtrain.add_argument(
        "--labels", metavar="PATH", help="default: the shipped labels (router_model/data/labels-full-run.jsonl)"
    )
    rtrain.add_argument("--router", **where)
    rtrain.add_argument("--test-size", type=float, default=0.2, help="held-out share, stratified by source")
    rtrain.add_argument("--seed", type=int, default=0)
    rtrain.add_argument("--folds", type=int, default=5, help="cross-validation folds that pick the classifier")
    rtrain.add_argument(
        "--from-logs", action="store_true", help="also learn from the gateway's live labels (HOME/router-labels.jsonl)"
    )
    rtrain.add_argument(
        "--hidden", action=argparse.BooleanOptionalAction, default=True,
        help="let classifiers on the small tier's hidden state compete (computed on that tier, cached under "
        "HOME/router-features; default: on where the small tier runs here)",
    )  # fmt: skip
    rtrain.add_argument("--hidden-layer", type=int, metavar="L", help="default: 3/4 of the small tier's depth")
    rtrain.set_defaults(handler=_router_train)
    rcal = router.add_parser("calibrate", help="set the threshold for a share of large-tier calls or a quality floor")
    rcal.add_argument("--router", **where)
    goal = rcal.add_mutually_exclusive_group(required=True)
    goal.add_argument("--large-share", type=float, metavar="S", help="share of calls to send to the large tier")
    goal.add_argument("--quality-floor", type=float, metavar="Q", help="fewest large calls keeping quality >= Q")
    rcal.add_argument("--labels", metavar="PATH", help="calibrate on its held-out prompts (default: the training file)")
    rcal.add_argument("--prompts", metavar="PATH", help="calibrate on these conversations (JSONL of {messages})")
    rcal.add_argument(
        "--tenant",
        help="calibrate this tenant only: on its routed prompts stored by the gateway, saved in its policy "
        "(with --prompts: on those, saved with the router)",
    )
    rcal.set_defaults(handler=_router_calibrate)
    reval = router.add_parser("eval", help="quality against large-tier calls on held-out labels: APGR, CPT, a plot")
    reval.add_argument("--router", **where)
    reval.add_argument("--labels", metavar="PATH", help="default: the file the router was trained on")
    reval.add_argument("--plot", metavar="PATH", help="the PNG to write (default: DIR/eval.png)")
    reval.add_argument("--json", action="store_true", help="also print the metrics as one JSON object")
    reval.set_defaults(handler=_router_eval)


def _router_label(args: argparse.Namespace) -> int:
    settings = load_settings()
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.max_threads))  # before torch starts, as in serve
    from gateway.runtime.tiers import load_engines
    from router_model.label import DEFAULT_OUT, LabelError, label_tiers

    if (args.per_source is not None and args.per_source < 1) or args.max_tokens < 1 or args.concurrency < 1:
        raise Failure("--per-source, --max-tokens and --concurrency must be at least 1")
    out = Path(args.out).expanduser() if args.out else DEFAULT_OUT
    if "humaneval" in (args.sources or SOURCES):
        require_jail(args.unsafe_local_grading)
    try:
        print(label_tiers(
            settings, lambda: load_engines(settings), out,
            sources=args.sources or SOURCES, per_source=args.per_source, seed=args.seed,
            max_tokens=args.max_tokens, concurrency=args.concurrency, keep_text=args.keep_text,
        ))  # fmt: skip
    except LabelError as exc:
        raise Failure(str(exc)) from None
    return 0


def _router_dir(args: argparse.Namespace) -> Path:
    return Path(args.router).expanduser() if args.router else load_settings().router_path


def _router_heldout(args: argparse.Namespace, metadata: dict) -> list:
    """The labeled examples a saved router was not trained on, from --labels or its own label file."""
    from router_model.examples import load_examples
    from router_model.train import heldout_examples

    labels = args.labels or metadata.get("label_file")
    if not labels:
        raise Failure("no label file: pass --labels")
    examples = heldout_examples(load_examples(Path(labels).expanduser(), load_settings().home_dir), metadata)
    if not examples:
        raise Failure(f"every prompt in {labels} trained this router: nothing held out")
    return examples


def _router_train(args: argparse.Namespace) -> int:
    from router_model.encoder import RouterEncoder
    from router_model.evaluate import evaluate_router, format_table
    from router_model.model import save_router
    from router_model.train import format_scores, train_from_labels

    if args.labels:
        labels = Path(args.labels).expanduser()
    else:
        from router_model.label import SHIPPED_LABELS as labels
    if args.from_logs:  # the shipped labels (if any) and the live ones, as one file kept beside the router
        from gateway.routing.shadow_rows import labels_path
        from router_model.examples import merge_label_files

        live = labels_path(load_settings().home_dir)
        if not live.is_file():
            raise Failure(f"no live labels at {live}: the gateway writes them for tenants with router.shadow_share")
        files = [labels, live] if args.labels or labels.is_file() else [live]
        directory = _router_dir(args)
        directory.mkdir(parents=True, exist_ok=True)
        try:
            labels = merge_label_files(files, directory / "train-labels.jsonl")
        except ValueError as exc:
            raise Failure(str(exc)) from None
    settings = load_settings()
    hidden = _hidden_states(settings, args.hidden_layer) if args.hidden else None
    try:
        result = train_from_labels(
            labels, RouterEncoder(), home=settings.home_dir, test_size=args.test_size,
            seed=args.seed, folds=args.folds, hidden_states=hidden,
        )  # fmt: skip
    except (OSError, ValueError) as exc:
        raise Failure(str(exc)) from None
    meta = result.router.metadata
    print(f"{meta['n_train']} prompts trained, {meta['n_heldout']} held out; features {meta['feature_version']}")
    print(format_scores(result.scores, meta["classifier"]))
    print(format_table(evaluate_router(result.heldout_p, result.heldout)))
    ci, ci_text = meta["apgr_ci"], meta["apgr_ci_text"]
    print(
        f"held-out APGR {meta['heldout_eval']['apgr']} (95% CI {ci[0]}-{ci[1]}, {meta['features']} features); "
        f"text only {meta['heldout_eval_text']['apgr']} ({ci_text[0]}-{ci_text[1]}); paired gain CI "
        f"{meta['apgr_gain_ci'][0]}-{meta['apgr_gain_ci'][1]}"
    )
    for tier, info in meta["tiers"].items():
        print(f"P({tier}_ok): {info}")
    print(f"threshold {meta['threshold']:.4f} ({meta['threshold_from']})")
    print(save_router(result.router, _router_dir(args)))
    return 0


def _hidden_states(settings: Settings, layer: int | None) -> HiddenStates | None:
    """The small tier's hidden states of labeled prompts, computed on an engine of that tier loaded here
    (only when some prompt is not in the feature cache yet); None where the small tier is remote or absent."""
    tier = settings.tiers.get("small")
    if tier is None or tier.is_remote:
        print("no local small tier: training on the text features only")
        return None

    def states(examples: Sequence[Example]) -> tuple[HiddenSpec, np.ndarray]:
        from gateway.runtime.tiers import load_tier_engine
        from router_model.hidden import FEATURES_DIR, HiddenSpec, conversation_states, default_layer
        from router_model.label import tier_model

        engine = load_tier_engine(settings, "small")
        cfg = engine.model.config
        chosen = default_layer(cfg.num_hidden_layers) if layer is None else layer
        spec = HiddenSpec("small", tier_model(tier), chosen, cfg.hidden_size)
        states = conversation_states(
            engine, [e.messages for e in examples], spec, settings.home_dir / FEATURES_DIR, True
        )
        return spec, states

    return states


def _router_calibrate(args: argparse.Namespace) -> int:
    from router_model import calibrate
    from router_model.evaluate import operating_point
    from router_model.model import load_router, write_metadata

    directory = _router_dir(args)
    if args.tenant and not args.prompts:
        return _router_calibrate_tenant(args, directory)
    try:
        router = load_router(directory)
        if args.prompts:
            if args.quality_floor is not None:
                raise Failure("--quality-floor needs labels, not --prompts")
            conversations, examples = calibrate.read_conversations(Path(args.prompts).expanduser()), None
        else:
            examples = _router_heldout(args, router.metadata)
            conversations = [e.messages for e in examples]
        p = router.p_small_ok(conversations)
        if args.quality_floor is not None:
            ok = ([e.small_ok for e in examples], [e.large_ok for e in examples])  # type: ignore[union-attr]
            threshold = calibrate.threshold_for_quality_floor(p, *ok, args.quality_floor)
            goal = f"quality floor {args.quality_floor}"
        else:
            threshold = calibrate.threshold_for_share(p, args.large_share)
            goal = f"large share {args.large_share}"
    except (OSError, ValueError) as exc:
        raise Failure(str(exc)) from None
    source = args.prompts or "held-out labels"
    if args.tenant:
        if len(conversations) < calibrate.MIN_TENANT_PROMPTS:
            raise Failure(f"{len(conversations)} prompts are too few for a tenant threshold "
                           f"(at least {calibrate.MIN_TENANT_PROMPTS})")  # fmt: skip
        router.metadata.setdefault("tenant_thresholds", {})[args.tenant] = threshold
        router.metadata.setdefault("tenant_large_shares", {})[args.tenant] = calibrate.large_share(p, threshold)
    else:
        router.metadata |= {"threshold": threshold, "threshold_from": f"{goal} of {len(p)} prompts ({source})"}
        router.metadata["large_share"] = calibrate.large_share(p, threshold)
    write_metadata(router.metadata, directory)
    line = f"threshold {threshold:.4f}{f' for tenant {args.tenant}' if args.tenant else ''}: "
    line += f"large share {calibrate.large_share(p, threshold):.3f} on {len(p)} prompts"
    if examples is not None:
        line += f", quality {operating_point(p, examples, threshold)[1]:.3f}"
    print(line)
    return 0


def _router_calibrate_tenant(args: argparse.Namespace, directory: Path) -> int:
    """The tenant's threshold from its routed prompts in the gateway's database, as a new policy version."""
    from router_model.calibrate_tenant import calibrate_tenant
    from router_model.model import load_router

    if args.quality_floor is not None:
        raise Failure("--quality-floor needs labels; a tenant's routed prompts have none: use --large-share")
    try:
        router = load_router(directory)
        done = calibrate_tenant(open_database(), router, args.tenant, args.large_share)
    except (OSError, ValueError) as exc:
        raise Failure(str(exc)) from None
    c = done.calibration
    print(
        f"threshold {c.threshold:.4f} for tenant {done.tenant}: large share {c.large_share:.3f} on {c.prompts} "
        f"routed prompts; policy v{done.version}"
    )
    return 0


def _router_eval(args: argparse.Namespace) -> int:
    import json

    from router_model.evaluate import evaluate_router, format_table, metrics_json, operating_point, plot_curves
    from router_model.model import load_router

    directory = _router_dir(args)
    try:
        router = load_router(directory)
        examples = _router_heldout(args, router.metadata)
    except (OSError, ValueError) as exc:
        raise Failure(str(exc)) from None
    p = router.p_small_ok([e.messages for e in examples])
    evaluation = evaluate_router(p, examples)
    print(f"router {directory}: {router.metadata.get('classifier')}, trained {router.metadata.get('created')}")
    print(format_table(evaluation))
    share, quality = operating_point(p, examples, router.threshold)
    print(f"at threshold {router.threshold:.4f}: large share {share:.3f}, quality {quality:.3f}")
    print(f"plot: {plot_curves(evaluation, Path(args.plot).expanduser() if args.plot else directory / 'eval.png')}")
    if args.json:
        print(json.dumps(metrics_json(evaluation)))
    return 0
