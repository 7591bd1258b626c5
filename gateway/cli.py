"""The `switchboard` command: serve, models, tenants, keys and the database.

Heavy imports (torch, transformers) happen inside the commands that need them, so `switchboard
tenant create` answers at once and `serve` can set OMP_NUM_THREADS before torch starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.settings import Settings
from engines.checkpoints.fetch import FetchError
from gateway.tenants import TenantError

if TYPE_CHECKING:
    from core.db.database import Database


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
    except (_Failure, FetchError, TenantError) as exc:  # expected failures: one line, no traceback
        print(f"switchboard: {exc}", file=sys.stderr)
        return 1


class _Failure(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchboard", description="An LLM inference gateway that makes tokens cheap.")
    p.add_argument("--config", help="TOML settings file (default: $SWITCHBOARD_CONFIG or ./switchboard.toml)")
    sub = p.add_subparsers(metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the gateway (fetches the tiers' models on first start)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.set_defaults(handler=_serve)

    models = sub.add_parser("models", help="registry models").add_subparsers(metavar="ACTION")
    fetch = models.add_parser("fetch", help="download, verify and convert models (default: the tiers' models)")
    fetch.add_argument("names", nargs="*", metavar="NAME")
    fetch.set_defaults(handler=_models_fetch)
    models.add_parser("list", help="models the registry ships and whether they are fetched").set_defaults(
        handler=_models_list
    )
    qz = models.add_parser("quantize", help="store an int8 or int4 checkpoint of a model")
    qz.add_argument("src", metavar="SRC", help="a registry name (int4 keeps its GGUF's 4-bit blocks) or a HF directory")
    qz.add_argument("dst", metavar="DST", help="the directory to write (safetensors plus quantization.json)")
    qz.add_argument("--weights", required=True, choices=("int8", "int4"))
    qz.set_defaults(handler=_models_quantize)
    moe = models.add_parser("moe", help="build a sparse MoE checkpoint from a dense model")
    moe.add_argument("src", metavar="SRC", help="a registry name or a HF directory (dense Qwen2 or Llama)")
    moe.add_argument("dst", metavar="DST", help="the directory to write (a HF Qwen2-MoE or Mixtral checkpoint)")
    moe.add_argument("--experts", type=int, required=True, metavar="E")
    moe.add_argument("--top-k", type=int, required=True, metavar="K", help="experts each token runs")
    moe.add_argument("--method", required=True, choices=("upcycle", "split"))
    moe.add_argument("--shared", type=int, default=0, metavar="N", help="split: neurons every token runs")
    moe.add_argument("--calibration-tokens", type=int, default=4096, metavar="N", help="split: router fit")
    moe.set_defaults(handler=_models_moe)
    dist = models.add_parser("distill", help="train a draft model toward its target's next-token distribution")
    dist.add_argument("dst", metavar="DST", help="the directory to write the distilled draft to (resumes there)")
    dist.add_argument("--student", default="qwen2.5-coder-0.5b-instruct", help="the draft: registry name or HF dir")
    dist.add_argument("--teacher", default="qwen2.5-coder-1.5b-instruct", help="the target (its int8 checkpoint)")
    dist.add_argument("--steps", type=int, default=64, help="training windows of 256 tokens")
    dist.add_argument("--train-layers", type=int, default=6, help="last decoder layers trained")
    dist.set_defaults(handler=_models_distill)
    ev = models.add_parser("eval", help="perplexity and GSM8K accuracy, to judge a quantized variant")
    ev.add_argument("model", metavar="MODEL", help="a registry name (fetched if missing) or a model directory")
    ev.add_argument("--weights", choices=("bf16", "int8", "int4"), help="default: as stored (registry: bf16)")
    ev.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    ev.add_argument("--ppl-tokens", type=int, default=4096, metavar="N", help="held-out tokens (0 skips)")
    ev.add_argument("--gsm8k", type=int, default=64, metavar="N", help="first N GSM8K test problems (0 skips)")
    ev.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ev.set_defaults(handler=_models_eval)

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

    db = sub.add_parser("db", help="database").add_subparsers(metavar="ACTION")
    db.add_parser("upgrade", help="bring the schema up to date").set_defaults(handler=_db_upgrade)

    budgets = sub.add_parser("budgets", help="spend counters").add_subparsers(metavar="ACTION")
    rec = budgets.add_parser("reconcile", help="rewrite the spend counters from the SQL ledger")
    rec.add_argument("--stale-after", type=float, default=3600.0, metavar="S", help="drop older reservations")
    rec.set_defaults(handler=_budgets_reconcile)

    router = sub.add_parser("router", help="the learned complexity router").add_subparsers(metavar="ACTION")
    rlabel = router.add_parser("label", help="label shipped prompts by what the small and large tiers get right")
    rlabel.add_argument("--out", metavar="PATH", help="JSONL to add rows to (default: router_model/data/labels.jsonl)")
    rlabel.add_argument("--per-source", type=int, metavar="N", help="a seeded sample (default: 300 GSM8K, all else)")
    rlabel.add_argument("--sources", nargs="+", choices=("gsm8k", "humaneval", "mtbench", "chat"), help="default: all")
    rlabel.add_argument("--seed", type=int, default=0, help="the sample's seed")
    rlabel.add_argument("--max-tokens", type=int, default=512, metavar="N", help="longest answer of either tier")
    rlabel.add_argument("--concurrency", type=int, default=24, metavar="N", help="items in flight at once")
    rlabel.add_argument("--keep-text", action="store_true", help="also store both answers in each row")
    rlabel.set_defaults(handler=_router_label)
    where = {"help": "the router's directory (default: HOME/router)", "metavar": "DIR"}
    rtrain = router.add_parser("train", help="train on a label file; keeps the best of the candidate classifiers")
    rtrain.add_argument("--labels", metavar="PATH", help="default: router label's (router_model/data/labels.jsonl)")
    rtrain.add_argument("--router", **where)
    rtrain.add_argument("--test-size", type=float, default=0.2, help="held-out share, stratified by source")
    rtrain.add_argument("--seed", type=int, default=0)
    rtrain.add_argument("--folds", type=int, default=5, help="cross-validation folds that pick the classifier")
    rtrain.add_argument(
        "--from-logs", action="store_true", help="also learn from the gateway's live labels (HOME/router-labels.jsonl)"
    )
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
    vprobe.set_defaults(handler=_verifiers_train_probe)

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
    return p


def _settings() -> Settings:
    from pydantic import ValidationError

    from gateway.tenants import use_key_secret

    try:
        settings = Settings()
    except ValidationError as exc:
        raise _Failure(f"invalid settings:\n{exc}") from None
    use_key_secret(settings.key_secret.get_secret_value() if settings.key_secret else None, settings.home_dir)
    return settings


def _database() -> Database:
    from core.db.database import Database

    db = Database(_settings().database)
    db.upgrade()
    return db


def _serve(args: argparse.Namespace) -> int:
    settings = _settings()
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if overrides:
        settings = settings.model_copy(update=overrides)
    # OpenMP reads this once, when torch starts: set it before the first torch import.
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.max_threads))
    from gateway.logging_setup import configure

    configure(settings.log_level, settings.log_format)
    import uvicorn

    from gateway.app import create_app
    from gateway.tiers import ensure_models

    ensure_models(settings)  # before the server starts, so progress bars show on a plain terminal
    # log_config=None: uvicorn keeps our root handler (its own config would print plain text)
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level, log_config=None
    )
    return 0


def _models_fetch(args: argparse.Namespace) -> int:
    from engines.checkpoints.fetch import fetch_model

    settings = _settings()
    names = args.names or sorted({t.model for t in settings.tiers.values() if t.is_registry_model})
    for name in names:
        print(fetch_model(name, settings.home_dir))
    return 0


def _models_list(_: argparse.Namespace) -> int:
    from engines.checkpoints.fetch import is_fetched
    from engines.checkpoints.registry import REGISTRY

    home = _settings().home_dir
    for name, entry in REGISTRY.items():
        state = "fetched" if is_fetched(home, name) else "not fetched"
        print(f"{name:32} {state:12} {entry.description}")
    return 0


def _models_eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from engines.checkpoints.fetch import fetch_model
    from engines.checkpoints.quantized import fetch_quantized
    from engines.engine import Engine, EngineConfig
    from engines.models.config import UnsupportedModelError
    from gateway.model_quality import evaluate

    home = _settings().home_dir
    path = Path(args.model).expanduser()
    config = EngineConfig(kv_cache_dtype=args.kv_cache_dtype)
    try:
        if path.is_dir():  # a directory: float weights are quantized on load, a quantized one must match
            engine = Engine.from_dir(path, config=config, weights=args.weights)
        elif args.weights in (None, "bf16"):
            engine = Engine.from_dir(fetch_model(args.model, home), config=config)
        else:  # a registry model: judge the checkpoint a tier with these weights serves
            engine = Engine.from_dir(fetch_quantized(args.model, home, args.weights), config=config)
    except UnsupportedModelError as exc:
        raise _Failure(str(exc)) from None
    result = {"model": args.model, "weights": engine.model.weights_format, "kv_cache_dtype": args.kv_cache_dtype}
    result |= evaluate(engine, home, ppl_tokens=args.ppl_tokens, gsm8k=args.gsm8k, progress=True)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.model}  weights={result['weights']}  kv_cache_dtype={args.kv_cache_dtype}")
    if "perplexity" in result:
        print(
            f"  perplexity  {result['perplexity']:>9.3f}  over {result['ppl_tokens_scored']} held-out tokens "
            f"(windows of {result['ppl_window']}), {result['ppl_seconds']:.1f} s"
        )
    if "gsm8k_accuracy" in result:
        print(
            f"  gsm8k       {result['gsm8k_accuracy']:>9.3f}  {result['gsm8k_correct']}/{result['gsm8k_n']} correct, "
            f"greedy, {result['gsm8k_seconds']:.1f} s"
        )
    print(f"  total {result['seconds']:.1f} s")
    return 0


def _models_quantize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engines.checkpoints.fetch import assemble_gguf, fetch_model, registry_model
    from engines.checkpoints.quantized import quantize_checkpoint
    from engines.checkpoints.registry import REGISTRY
    from engines.models.config import UnsupportedModelError

    home = _settings().home_dir
    gguf = None
    if args.src in REGISTRY:
        src = fetch_model(args.src, home)
        if args.weights == "int4":
            gguf = assemble_gguf(registry_model(args.src), home / "gguf")
    elif Path(args.src).expanduser().is_dir():
        src = Path(args.src).expanduser()
    else:
        raise _Failure(f"{args.src} is neither a registry model nor a directory")
    try:
        out = quantize_checkpoint(src, Path(args.dst).expanduser(), args.weights, gguf=gguf)
    except (UnsupportedModelError, ValueError) as exc:
        raise _Failure(str(exc)) from None
    print(out)
    return 0


def _models_moe(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engines.checkpoints.fetch import fetch_model
    from engines.checkpoints.moe_build import build_moe
    from engines.checkpoints.registry import REGISTRY
    from engines.models.config import UnsupportedModelError

    if args.src in REGISTRY:
        src = fetch_model(args.src, _settings().home_dir)
    elif Path(args.src).expanduser().is_dir():
        src = Path(args.src).expanduser()
    else:
        raise _Failure(f"{args.src} is neither a registry model nor a directory")
    try:
        report = build_moe(
            src, Path(args.dst).expanduser(), experts=args.experts, top_k=args.top_k, method=args.method,
            shared=args.shared, calibration_tokens=args.calibration_tokens,
        )  # fmt: skip
    except (UnsupportedModelError, ValueError) as exc:
        raise _Failure(str(exc)) from None
    if report is not None:
        print(f"router recall {report.router_recall:.3f}, active MLP fraction {report.active_mlp_fraction:.3f}")
    print(Path(args.dst).expanduser())
    return 0


def _models_distill(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engines.checkpoints.fetch import fetch_model
    from engines.checkpoints.quantized import fetch_quantized
    from engines.checkpoints.registry import REGISTRY
    from engines.speculative.distill import DistillConfig, distill

    home = _settings().home_dir

    def resolve(name: str, quantized: bool) -> Path:
        if name in REGISTRY:
            return fetch_quantized(name, home, "int8") if quantized else fetch_model(name, home)
        if Path(name).expanduser().is_dir():
            return Path(name).expanduser()
        raise _Failure(f"{name} is neither a registry model nor a directory")

    config = DistillConfig(steps=args.steps, train_layers=args.train_layers)
    summary = distill(resolve(args.student, False), resolve(args.teacher, True), Path(args.dst).expanduser(), config)
    print(f"held-out KL(teacher || draft), top-{config.top_k}: {summary['kl_before']:.4f} → {summary['kl_after']:.4f}")
    print(Path(args.dst).expanduser())
    return 0


def _tenant_create(args: argparse.Namespace) -> int:
    from gateway.tenants import create_tenant

    issued = create_tenant(_database(), args.name, operator=args.operator, role=args.role)
    kind = "operator tenant" if args.operator else "tenant"
    print(f"created {kind} {issued.tenant}; its {issued.role} key (shown once, store it now):", file=sys.stderr)
    print(issued.key)
    return 0


def _key_create(args: argparse.Namespace) -> int:
    from gateway.tenants import create_key

    issued = create_key(_database(), args.tenant, args.role)
    print(f"new {issued.role} key for {issued.tenant} (shown once, store it now):", file=sys.stderr)
    print(issued.key)
    return 0


def _key_revoke(args: argparse.Namespace) -> int:
    from gateway.tenants import revoke_key

    revoke_key(_database(), args.prefix)
    print(f"revoked {args.prefix}", file=sys.stderr)
    return 0


def _budgets_reconcile(args: argparse.Namespace) -> int:
    import asyncio

    from policies.budgets import Budgets
    from policies.counters import RedisCounters

    settings = _settings()
    if not settings.redis_url:
        print("no redis_url: counters live in the gateway process and rebuild from SQL on start", file=sys.stderr)
        return 0

    async def run() -> int:
        counters = RedisCounters(settings.redis_url, settings.redis_namespace)  # type: ignore[arg-type]
        try:
            return await Budgets(_database(), counters, settings.redis_namespace).reconcile(args.stale_after)
        finally:
            await counters.close()

    print(f"rewrote {asyncio.run(run())} spend counters from the ledger", file=sys.stderr)
    return 0


def _router_label(args: argparse.Namespace) -> int:
    settings = _settings()
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.max_threads))  # before torch starts, as in serve
    from gateway.tiers import load_engines
    from grading.datasets import SOURCES
    from router_model.label import DEFAULT_OUT, LabelError, label_tiers

    if (args.per_source is not None and args.per_source < 1) or args.max_tokens < 1 or args.concurrency < 1:
        raise _Failure("--per-source, --max-tokens and --concurrency must be at least 1")
    out = Path(args.out).expanduser() if args.out else DEFAULT_OUT
    try:
        print(label_tiers(
            settings, lambda: load_engines(settings), out,
            sources=args.sources or SOURCES, per_source=args.per_source, seed=args.seed,
            max_tokens=args.max_tokens, concurrency=args.concurrency, keep_text=args.keep_text,
        ))  # fmt: skip
    except LabelError as exc:
        raise _Failure(str(exc)) from None
    return 0


def _verifiers_train_probe(args: argparse.Namespace) -> int:
    settings = _settings()
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.max_threads))  # before torch starts, as in serve
    from gateway.tiers import load_engines
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
        raise _Failure(f"no in-process tier {args.tier!r}; the tiers are {', '.join(settings.tiers)}")
    directory = Path(args.out).expanduser() if args.out else settings.probe_path
    labels = Path(args.labels).expanduser() if args.labels else DEFAULT_OUT
    tier = settings.tiers[args.tier]
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
        raise _Failure(str(exc)) from None
    probe.save(directory)
    print(summary(rows, probe, directory))
    return 0


def _router_dir(args: argparse.Namespace) -> Path:
    return Path(args.router).expanduser() if args.router else _settings().router_path


def _router_heldout(args: argparse.Namespace, metadata: dict) -> list:
    """The labeled examples a saved router was not trained on, from --labels or its own label file."""
    from router_model.examples import load_examples
    from router_model.train import heldout_examples

    labels = args.labels or metadata.get("label_file")
    if not labels:
        raise _Failure("no label file: pass --labels")
    examples = heldout_examples(load_examples(Path(labels).expanduser(), _settings().home_dir), metadata)
    if not examples:
        raise _Failure(f"every prompt in {labels} trained this router: nothing held out")
    return examples


def _router_train(args: argparse.Namespace) -> int:
    from router_model.encoder import RouterEncoder
    from router_model.evaluate import evaluate_router, format_table
    from router_model.model import save_router
    from router_model.train import format_scores, train_from_labels

    if args.labels:
        labels = Path(args.labels).expanduser()
    else:
        from router_model.label import DEFAULT_OUT as labels
    if args.from_logs:  # the shipped labels (if any) and the live ones, as one file kept beside the router
        from gateway.shadow import labels_path
        from router_model.examples import merge_label_files

        live = labels_path(_settings().home_dir)
        if not live.is_file():
            raise _Failure(f"no live labels at {live}: the gateway writes them for tenants with router.shadow_share")
        files = [labels, live] if args.labels or labels.is_file() else [live]
        directory = _router_dir(args)
        directory.mkdir(parents=True, exist_ok=True)
        try:
            labels = merge_label_files(files, directory / "train-labels.jsonl")
        except ValueError as exc:
            raise _Failure(str(exc)) from None
    try:
        result = train_from_labels(
            labels, RouterEncoder(), home=_settings().home_dir, test_size=args.test_size,
            seed=args.seed, folds=args.folds,
        )  # fmt: skip
    except (OSError, ValueError) as exc:
        raise _Failure(str(exc)) from None
    meta = result.router.metadata
    print(f"{meta['n_train']} prompts trained, {meta['n_heldout']} held out; features {meta['feature_version']}")
    print(format_scores(result.scores, meta["classifier"]))
    print(format_table(evaluate_router(result.heldout_p, result.heldout)))
    print(f"threshold {meta['threshold']:.4f} ({meta['threshold_from']})")
    print(save_router(result.router, _router_dir(args)))
    return 0


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
                raise _Failure("--quality-floor needs labels, not --prompts")
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
        raise _Failure(str(exc)) from None
    source = args.prompts or "held-out labels"
    if args.tenant:
        if len(conversations) < calibrate.MIN_TENANT_PROMPTS:
            raise _Failure(f"{len(conversations)} prompts are too few for a tenant threshold "
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
        raise _Failure("--quality-floor needs labels; a tenant's routed prompts have none: use --large-share")
    try:
        router = load_router(directory)
        done = calibrate_tenant(_database(), router, args.tenant, args.large_share)
    except (OSError, ValueError) as exc:
        raise _Failure(str(exc)) from None
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
        raise _Failure(str(exc)) from None
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


def _proposal_id(text: str) -> int:
    """A proposal's number, as the API takes it (a 32-bit column)."""
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= 2**31 - 1):
        raise argparse.ArgumentTypeError(f"not a proposal number: {text!r}")
    return int(text)


def _proposal_stores(tenant: str) -> tuple[int, Any, Any]:
    from gateway.tenants import tenant_by_name
    from policies.proposals import ProposalStore
    from policies.store import PolicyStore

    db = _database()
    found = tenant_by_name(db, tenant)
    if found is None:
        raise _Failure(f"no tenant named {tenant!r}")
    policies = PolicyStore(db)
    return found.id, policies, ProposalStore(db, policies)


def _policy_tune(args: argparse.Namespace) -> int:
    settings = _settings()
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.max_threads))  # before torch starts, as in serve
    import asyncio

    from engines.protocol import EngineUnavailable
    from gateway.tiers import load_engines
    from policies.tune_report import table
    from policies.tune_run import TuneRequest, tune_tenant
    from policies.tuning import TuningError
    from verifiers.policy import tuning_hook

    if args.sample < 1 or args.max_tokens < 1 or not 0 <= args.tolerance <= 1:
        raise _Failure("--sample and --max-tokens must be at least 1, --tolerance between 0 and 1")
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
        raise _Failure(str(exc)) from None
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
        raise _Failure(str(exc)) from None
    except IntegrityError:
        raise _Failure("the policy changed at the same moment; run it again") from None
    print(f"proposal {args.proposal} applied: {args.tenant} is on policy v{version}")
    return 0


def _policy_reject(args: argparse.Namespace) -> int:
    from policies.proposals import ProposalError

    tenant_id, _, proposals = _proposal_stores(args.tenant)
    try:
        proposals.reject(tenant_id, args.proposal, "cli", args.reason)
    except ProposalError as exc:
        raise _Failure(str(exc)) from None
    print(f"proposal {args.proposal} rejected")
    return 0


def _db_upgrade(_: argparse.Namespace) -> int:
    db = _database()
    print(f"database at revision {db.current_revision()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
