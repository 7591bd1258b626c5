"""`switchboard models`: fetch, list, quantize, build MoE, distill and evaluate registry models."""

from __future__ import annotations

import argparse
from pathlib import Path

from gateway.cli.common import Failure, load_settings

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add `models` and its actions."""
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


def _models_fetch(args: argparse.Namespace) -> int:
    from engines.checkpoints.fetch import fetch_model

    settings = load_settings()
    names = args.names or sorted({t.model for t in settings.tiers.values() if t.is_registry_model})
    for name in names:
        print(fetch_model(name, settings.home_dir))
    return 0


def _models_list(_: argparse.Namespace) -> int:
    from engines.checkpoints.fetch import is_fetched
    from engines.checkpoints.registry import REGISTRY

    home = load_settings().home_dir
    for name, entry in REGISTRY.items():
        state = "fetched" if is_fetched(home, name) else "not fetched"
        print(f"{name:32} {state:12} {entry.description}")
    installed = installed_models(home / "models")
    if installed:
        print(f"\ninstalled in {home / 'models'}:")
        for name, what in installed:
            print(f"{name:45} {what}")
    return 0


def installed_models(models: Path) -> list[tuple[str, str]]:
    """(directory, what it holds) for every model directory under `models`: architecture, shape, weight
    format, or why the engine cannot serve it."""
    import json

    from engines.models.config import ModelConfig, UnsupportedModelError

    found = []
    for d in sorted(p for p in models.iterdir() if p.is_dir() and (p / "config.json").is_file()):
        try:
            cfg = ModelConfig.from_dir(d)
        except (UnsupportedModelError, KeyError, ValueError) as exc:
            found.append((d.name, f"not servable: {exc}"))
            continue
        quant = d / "quantization.json"
        fmt = json.loads(quant.read_text()).get("weights", "?") if quant.is_file() else "float"
        moe = f", {cfg.num_experts} experts top-{cfg.num_experts_per_tok}" if cfg.num_experts else ""
        found.append(
            (d.name, f"{cfg.architecture}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}{moe}, {fmt}")
        )
    return found


def _models_eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from engines.checkpoints.fetch import fetch_model
    from engines.checkpoints.quantized import fetch_quantized
    from engines.engine import Engine, EngineConfig
    from engines.models.config import UnsupportedModelError
    from gateway.runtime.model_quality import evaluate

    home = load_settings().home_dir
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
        raise Failure(str(exc)) from None
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

    home = load_settings().home_dir
    gguf = None
    if args.src in REGISTRY:
        src = fetch_model(args.src, home)
        if args.weights == "int4":
            gguf = assemble_gguf(registry_model(args.src), home / "gguf")
    elif Path(args.src).expanduser().is_dir():
        src = Path(args.src).expanduser()
    else:
        raise Failure(f"{args.src} is neither a registry model nor a directory")
    try:
        out = quantize_checkpoint(src, Path(args.dst).expanduser(), args.weights, gguf=gguf)
    except (UnsupportedModelError, ValueError) as exc:
        raise Failure(str(exc)) from None
    print(out)
    return 0


def _models_moe(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engines.checkpoints.fetch import fetch_model
    from engines.checkpoints.moe_build import build_moe
    from engines.checkpoints.registry import REGISTRY
    from engines.models.config import UnsupportedModelError

    if args.src in REGISTRY:
        src = fetch_model(args.src, load_settings().home_dir)
    elif Path(args.src).expanduser().is_dir():
        src = Path(args.src).expanduser()
    else:
        raise Failure(f"{args.src} is neither a registry model nor a directory")
    try:
        report = build_moe(
            src, Path(args.dst).expanduser(), experts=args.experts, top_k=args.top_k, method=args.method,
            shared=args.shared, calibration_tokens=args.calibration_tokens,
        )  # fmt: skip
    except (UnsupportedModelError, ValueError) as exc:
        raise Failure(str(exc)) from None
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

    home = load_settings().home_dir

    def resolve(name: str, quantized: bool) -> Path:
        if name in REGISTRY:
            return fetch_quantized(name, home, "int8") if quantized else fetch_model(name, home)
        if Path(name).expanduser().is_dir():
            return Path(name).expanduser()
        raise Failure(f"{name} is neither a registry model nor a directory")

    config = DistillConfig(steps=args.steps, train_layers=args.train_layers)
    summary = distill(resolve(args.student, False), resolve(args.teacher, True), Path(args.dst).expanduser(), config)
    print(f"held-out KL(teacher || draft), top-{config.top_k}: {summary['kl_before']:.4f} → {summary['kl_after']:.4f}")
    print(Path(args.dst).expanduser())
    return 0
