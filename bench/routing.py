"""The gateway's routing decision: time per decision through the router thread, as `model: "auto"` pays it.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.routing [--router DIR] [--prompts shipped|synthetic] [-n 300]

Loads a saved router (or trains one on synthetic labels, which is all the timing needs), then routes
prompts through `router_model.serving.RouterService` (one torch thread, its own thread, no embedding
cache): one at a time (the latency a lone request sees: p50, p90, and the routing thread's CPU time),
and `--concurrency` at once (queued on the one router thread: the latency a burst sees). `shipped` prompts are
the ones `switchboard router label` labels (GSM8K, HumanEval, MT-bench, chats: median 80 word pieces
after the cap); `synthetic` are shorter. The last line is one JSON object.

`--quality LABELS` instead answers whether the cap keeps quality: it trains a router on the label
file's training split with the embedded text capped and uncapped, and prints both held-out APGRs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import THREADS, say


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", type=Path, help="a saved router (default: train one on synthetic labels)")
    ap.add_argument("--prompts", choices=("shipped", "synthetic"), default="shipped")
    ap.add_argument("-n", type=int, default=300, help="decisions timed one at a time")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--home", type=Path, default=Path("~/.cache/switchboard").expanduser())
    ap.add_argument("--uncapped", action="store_true", help="embed as before the cap (2,000 + 600 characters)")
    ap.add_argument("--quality", type=Path, metavar="LABELS", help="held-out APGR capped and uncapped, then exit")
    args = ap.parse_args()
    if args.quality:
        compare_quality(args.quality, args.home)
        return
    if args.uncapped:
        uncap()

    from router_model.encoder import RouterEncoder
    from router_model.examples import split_examples
    from router_model.features import embedding_text
    from router_model.model import load_router, save_router
    from router_model.serving import RouterService
    from router_model.synthetic import synthetic_examples
    from router_model.train import train_router

    directory = args.router
    if directory is None:
        scratch = tempfile.TemporaryDirectory()
        train, held = split_examples(synthetic_examples(200, seed=1), test_size=0.25, seed=0)
        say("training a router on 200 synthetic labels")
        result = train_router(train, held, RouterEncoder(), seed=0, folds=2, candidates=("hist_gb",))
        directory = save_router(result.router, Path(scratch.name) / "router")
    if args.prompts == "shipped":
        from grading.datasets import SOURCES, load_items

        conversations = [i.messages for i in load_items(args.home, list(SOURCES), per_source={"gsm8k": 300})]
    else:
        conversations = [e.messages for e in synthetic_examples(args.n, seed=7)]
    rng = random.Random(0)
    sample = [rng.choice(conversations) for _ in range(args.n)]
    tokenizer = load_router(directory).embedder._load().tokenizer  # type: ignore[attr-defined]
    pieces = sorted(len(tokenizer(embedding_text(c))["input_ids"]) for c in sample)

    service = RouterService.load(directory, threads=1)
    service.router.embedder = RouterEncoder(cache_size=0)  # every decision embeds: no prompt is free
    service.router.p_small_ok([[{"role": "user", "content": "warm up"}]])

    def cpu_ms(conversation: object) -> float:
        start = time.thread_time()
        service.router.p_small_ok([conversation])  # type: ignore[list-item]
        return 1000 * (time.thread_time() - start)

    async def run() -> tuple[list[float], list[float], list[float]]:
        alone = []
        for c in sample:
            start = time.perf_counter()
            await service.p_small_ok(c)
            alone.append(1000 * (time.perf_counter() - start))
        cpu = [await asyncio.get_running_loop().run_in_executor(service._pool, cpu_ms, c) for c in sample[:100]]

        async def timed(c: object) -> float:
            start = time.perf_counter()
            await service.p_small_ok(c)  # type: ignore[arg-type]
            return 1000 * (time.perf_counter() - start)

        burst: list[float] = []
        for i in range(0, len(sample), args.concurrency):
            burst += await asyncio.gather(*(timed(c) for c in sample[i : i + args.concurrency]))
        return alone, cpu, burst

    alone, cpu, burst = asyncio.run(run())
    service.close()

    def q(xs: list[float], f: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(f * len(xs)))]

    print(f"{len(sample)} {args.prompts} prompts, embedded word pieces p50 {q(pieces, 0.5)} p90 {q(pieces, 0.9)}")
    print(f"{'':28} {'p50 ms':>8} {'p90 ms':>8}")
    print(f"{'one at a time (wall)':28} {statistics.median(alone):>8.1f} {q(alone, 0.9):>8.1f}")
    print(f"{'one at a time (CPU, 1 thr.)':28} {statistics.median(cpu):>8.1f} {q(cpu, 0.9):>8.1f}")
    print(f"{f'{args.concurrency} at once (wall, each)':28} {statistics.median(burst):>8.1f} {q(burst, 0.9):>8.1f}")
    out = {
        "prompts": args.prompts,
        "capped": not args.uncapped,
        "n": len(sample),
        "word_pieces_p50": q(pieces, 0.5),
        "route_p50_ms": round(statistics.median(alone), 2),
        "route_p90_ms": round(q(alone, 0.9), 2),
        "route_cpu_p50_ms": round(statistics.median(cpu), 2),
        "burst_p50_ms": round(statistics.median(burst), 2),
        "concurrency": args.concurrency,
        "omp_threads": THREADS,
    }
    print(json.dumps(out))


def uncap() -> None:
    """Embed as before the cap: the last turn whole up to 2,000 characters, 600 of context (MiniLM stops at 256)."""
    from router_model import features

    features.LAST_TURN_HEAD_CHARS, features.LAST_TURN_TAIL_CHARS, features.CONTEXT_CHARS = 2000, 1, 600


def compare_quality(labels: Path, home: Path) -> None:
    from router_model.encoder import RouterEncoder
    from router_model.examples import load_examples, split_examples
    from router_model.train import train_router

    train, held = split_examples(load_examples(labels, home), 0.2, 0)
    apgr = {}
    for name in ("capped", "uncapped"):
        if name == "uncapped":
            uncap()
        say(f"training {name} on {len(train)} prompts")
        result = train_router(train, held, RouterEncoder(), seed=0)
        apgr[name] = result.router.metadata["heldout_eval"]["apgr"]
        print(f"{name:9} held-out APGR {apgr[name]:.3f} ({result.router.metadata['classifier']})")
    print(json.dumps({"labels": str(labels), "n_heldout": len(held), "apgr_capped": apgr["capped"],
                      "apgr_uncapped": apgr["uncapped"]}))  # fmt: skip


if __name__ == "__main__":
    main()
