"""Training a LoRA adapter on this CPU: what `switchboard distill` spends per 1,000 examples.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.lora_train [--model qwen2.5-coder-0.5b-instruct] [--examples 48]

Examples: GSM8K test problems as chat prompts (the small tier's template) with their reference solutions as the
answers (as long as a teacher's worked answer), `--heldout` more held out. One epoch of `engines.lora.train`
(rank 16 on every projection, 4 examples a step, fp32, transformers' model class and peft) on the float
checkpoint. The last line is one JSON object: `seconds_per_1000_examples`, `examples_per_s`, the mean prompt and
answer tokens, the held-out loss before and after, `adapter_mb`, the CPU and threads.
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
from engines.kernels.cpu_info import cpu_name
from engines.lora.train import Example, TrainConfig, train_adapter
from engines.tokenizer import Tokenizer
from grading.datasets import load_gsm8k


def examples(model_dir: Path, home: Path, n: int) -> list[Example]:
    tokenizer = Tokenizer(model_dir)
    eos = min(tokenizer.eos_token_ids)
    out = []
    for problem in load_gsm8k(home, n, progress=False):
        prompt = tokenizer.encode_chat([{"role": "user", "content": problem["question"]}])
        out.append(Example(prompt, [*tokenizer.encode(problem["answer"], add_special_tokens=False), eos]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lora_train", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--examples", type=int, default=48)
    ap.add_argument("--heldout", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--home", type=Path, default=Path("~/.cache/switchboard").expanduser())
    args = ap.parse_args()
    model_dir = args.home / "models" / args.model
    data = examples(model_dir, args.home, args.examples + args.heldout)
    train, heldout = data[: args.examples], data[args.examples :]
    config = TrainConfig(rank=args.rank, alpha=2 * args.rank, epochs=1, accumulate=4, save_every=1000)
    say(f"{args.model}: {len(train)} examples, {len(heldout)} held out, rank {args.rank}, {THREADS} threads")
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        result = train_adapter(model_dir, train, heldout, Path(tmp), config, say=say)
        seconds = time.monotonic() - started
        adapter_mb = sum(f.stat().st_size for f in result.adapter.iterdir()) / 1e6
    loop = result.seconds  # the steps and the epoch's held-out pass; not the model's load nor the base's pass
    summary = {
        "model": args.model, "cpu": cpu_name(), "threads": THREADS, "rank": args.rank, "examples": len(train),
        "seconds": round(seconds, 1), "train_seconds": round(loop, 1),
        "seconds_per_1000_examples": round(loop / len(train) * 1000, 1),
        "examples_per_s": round(len(train) / loop, 3), "step_seconds": round(loop / max(1, result.steps), 2),
        "prompt_tokens_mean": round(statistics.mean(len(e.prompt) for e in train), 1),
        "answer_tokens_mean": round(statistics.mean(len(e.answer) for e in train), 1),
        "heldout_loss_before": round(result.base_heldout_loss, 4),
        "heldout_loss_after": round(result.heldout_loss[-1], 4) if result.heldout_loss else None,
        "adapter_mb": round(adapter_mb, 1),
    }  # fmt: skip
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
