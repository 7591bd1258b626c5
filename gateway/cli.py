"""The `switchboard` command: serve, models, tenants, keys and the database.

Heavy imports (torch, transformers) happen inside the commands that need them, so `switchboard
tenant create` answers at once and `serve` can set OMP_NUM_THREADS before torch starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engines.fetch import FetchError
from gateway.settings import Settings
from gateway.tenants import TenantError

if TYPE_CHECKING:
    from gateway.db.database import Database


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
    return p


def _settings() -> Settings:
    from pydantic import ValidationError

    try:
        return Settings()
    except ValidationError as exc:
        raise _Failure(f"invalid settings:\n{exc}") from None


def _database() -> Database:
    from gateway.db.database import Database

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
    from engines.fetch import fetch_model

    settings = _settings()
    names = args.names or sorted({t.model for t in settings.tiers.values() if t.is_registry_model})
    for name in names:
        print(fetch_model(name, settings.home_dir))
    return 0


def _models_list(_: argparse.Namespace) -> int:
    from engines.fetch import is_fetched
    from engines.registry import REGISTRY

    home = _settings().home_dir
    for name, entry in REGISTRY.items():
        state = "fetched" if is_fetched(home, name) else "not fetched"
        print(f"{name:32} {state:12} {entry.description}")
    return 0


def _models_eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from engines.engine import Engine, EngineConfig
    from engines.fetch import fetch_model
    from engines.model_config import UnsupportedModelError
    from engines.quality import evaluate
    from engines.quantized_checkpoint import fetch_quantized

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

    from engines.fetch import assemble_gguf, fetch_model, registry_model
    from engines.model_config import UnsupportedModelError
    from engines.quantized_checkpoint import quantize_checkpoint
    from engines.registry import REGISTRY

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

    from engines.fetch import fetch_model
    from engines.model_config import UnsupportedModelError
    from engines.moe_build import build_moe
    from engines.registry import REGISTRY

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

    from engines.distill import DistillConfig, distill
    from engines.fetch import fetch_model
    from engines.quantized_checkpoint import fetch_quantized
    from engines.registry import REGISTRY

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


def _db_upgrade(_: argparse.Namespace) -> int:
    db = _database()
    print(f"database at revision {db.current_revision()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
