"""The learned router on a label file: held-out APGR and CPTs against baselines, and routing latency.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.router --labels PATH [--router DIR] [--plot PATH]
    OMP_NUM_THREADS=2 .venv/bin/python -m bench.router --synthetic 400      # smoke check, no real labels

Trains on the label file's training split (seeded, stratified by source; six classifiers compared by
cross-validated APGR, as `switchboard router train` does) or, with `--router`, loads a saved router;
then evaluates on the held-out split (the prompts the router was not trained on): quality against the
share of large-tier calls, APGR, CPT(50%), CPT(80%), against random routing, the prompt-length heuristic
and the optimal router. `route_p50_ms` is the median time of one routing decision on the CPU (embedding
included, no embedding cache) over a few hundred held-out prompts, one at a time. `--synthetic N`
writes a synthetic label file of N prompts with a learnable signal (`router_model.synthetic`) and runs
on it. The last line is one JSON object; CPTs are shares of calls (0-1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import THREADS, say


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--labels", type=Path, help="a label file from `switchboard router label`")
    src.add_argument("--synthetic", type=int, metavar="N", help="a synthetic label file of N prompts")
    ap.add_argument("--router", type=Path, help="evaluate this saved router instead of training one")
    ap.add_argument("--test-size", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--timing-prompts", type=int, default=300, metavar="N", help="routing decisions timed")
    ap.add_argument("--plot", type=Path, help="write the curves here (PNG)")
    args = ap.parse_args()

    from router_model.encoder import RouterEncoder
    from router_model.evaluate import evaluate_router, format_table, metrics_json, plot_curves
    from router_model.examples import load_examples, split_examples
    from router_model.model import load_router
    from router_model.synthetic import synthetic_examples, write_label_file
    from router_model.train import format_scores, heldout_examples, train_router

    labels = args.labels
    if args.synthetic:
        scratch = tempfile.TemporaryDirectory()  # removed when the script exits
        labels = Path(scratch.name) / "labels.jsonl"
        write_label_file(synthetic_examples(args.synthetic, args.seed), labels)
    examples = load_examples(labels)
    embedder = RouterEncoder()
    if args.router:
        router = load_router(args.router, embedder)
        heldout = heldout_examples(examples, router.metadata)
        if not heldout:
            sys.exit(f"{labels}: every labeled prompt trained the router at {args.router}")
        p = router.p_small_ok([e.messages for e in heldout])
        n_train = router.metadata.get("n_train")
    else:
        train, heldout = split_examples(examples, args.test_size, args.seed)
        say(f"training on {len(train)} prompts, {len(heldout)} held out")
        result = train_router(train, heldout, embedder, seed=args.seed, folds=args.folds)
        router, p, n_train = result.router, result.heldout_p, len(train)
        print(format_scores(result.scores, router.metadata["classifier"]))
    evaluation = evaluate_router(p, heldout)
    print(format_table(evaluation))
    if args.plot:
        say(f"plot: {plot_curves(evaluation, args.plot)}")

    # One decision at a time, as the gateway makes them; a cache-less embedder so no prompt is free.
    router.embedder = RouterEncoder(cache_size=0)
    prompts = [heldout[i % len(heldout)].messages for i in range(max(args.timing_prompts, 1))]
    router.route(prompts[0])  # loads MiniLM
    times = []
    for messages in prompts:
        start = time.perf_counter()
        router.route(messages)
        times.append(time.perf_counter() - start)
    route_p50_ms = 1000 * statistics.median(times)
    print(f"routing decision: p50 {route_p50_ms:.1f} ms over {len(times)} prompts ({THREADS} threads)")

    result_json = {
        **metrics_json(evaluation),
        "route_p50_ms": round(route_p50_ms, 2),
        "n_labeled": len(examples),
        "n_train": n_train,
        "classifier": router.metadata.get("classifier"),
        "labels": "synthetic" if args.synthetic else str(labels),
    }
    print(json.dumps(result_json))


if __name__ == "__main__":
    main()
