"""The answer probe's training data and training run (`switchboard verifiers train-probe`).

The probe learns from the router's labeled prompts whose answers can be graded without a judge: GSM8K
(exact final number) and HumanEval (unit tests in the sandbox). The label file keeps no answer texts, so
the small tier answers those prompts again, greedily and as the labeling did (chat template, the same
token cap), and each answer is graded afresh: the label is the grade of the very text the probe sees.
Answers are appended to a JSONL file one by one, so an interrupted run resumes; a file written by another
model is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from engines.engine import Engine
from engines.offline import complete_all
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from grading.datasets import Item, items_by_id
from grading.graders import GRADERS
from router_model.label_store import open_appender, read_rows
from verifiers.probe import AnswerProbe

SOURCES = ("gsm8k", "humaneval")
ANSWERS_FILE = "answers.jsonl"


def labeled_items(labels: Path, home: Path, sources: Iterable[str] = SOURCES) -> list[Item]:
    """The gradable items (of `sources`: GSM8K, HumanEval) that `labels` has rows for, in its order."""
    wanted = set(sources) & set(SOURCES)
    ids = list(dict.fromkeys(r["id"] for r in read_rows(labels) if r.get("source") in wanted))
    try:
        found = items_by_id(home, ids)
    except KeyError as exc:
        raise ValueError(f"{labels}: {exc.args[0]}") from None
    return [found[i] for i in ids]


def answered(out: Path, model: str) -> dict[str, dict]:
    """The rows already in `out`, by id; a file with another model's answers is refused."""
    rows = {r["id"]: r for r in read_rows(out)} if out.exists() else {}
    other = {r["model"] for r in rows.values()} - {model}
    if other:
        raise ValueError(f"{out} holds answers of {sorted(other)}, not {model}: pass another file")
    return rows


def answer_items(
    engine: Engine | None, model: str, items: Iterable[Item], out: Path, *, max_tokens: int, progress: bool = True
) -> list[dict]:
    """Every item's graded greedy answer from `engine`: rows from `out` where already there, the rest
    generated (batched), graded (HumanEval's sandboxes on worker threads) and appended. No engine: only
    what `out` holds (ValueError if an item has no answer there)."""
    items = list(items)
    rows = answered(out, model)
    todo = {item.id: item for item in items if item.id not in rows}
    if todo and engine is None:
        raise ValueError(f"{len(todo)} items have no answer in {out} and there is no engine to answer them")
    requests = (_request(engine, item, max_tokens) for item in todo.values())  # type: ignore[arg-type]
    with (
        open_appender(out) as append,
        ThreadPoolExecutor(2) as graders,
        tqdm(total=len(items), initial=len(items) - len(todo), desc="probe answers", disable=not progress) as bar,
    ):
        pending: list[tuple[dict, Future[bool]]] = []

        def flush(wait: bool) -> None:  # rows go to the file as their grades come in, in generation order
            while pending and (wait or pending[0][1].done()):
                row, grade = pending.pop(0)
                row["correct"] = bool(grade.result())
                append(row)
                rows[row["id"]] = row
                bar.update(1)

        for c in complete_all(engine, requests) if todo else ():  # no engine when nothing is left to answer
            item = todo[c.request_id]
            row = {"id": item.id, "source": item.source, "question": item.question, "answer": c.text,
                   "finish": c.finish_reason.value, "tokens": c.completion_tokens, "model": model}  # fmt: skip
            pending.append((row, graders.submit(GRADERS[item.source], item, c.text)))
            flush(wait=False)
        flush(wait=True)
    return [rows[item.id] for item in items]


def _request(engine: Engine, item: Item, max_tokens: int) -> EngineRequest:
    prompt = engine.tokenizer.encode_chat(item.messages)
    budget = max(1, min(max_tokens, engine.max_model_len - len(prompt)))  # as labeling capped it
    return EngineRequest(item.id, prompt, SamplingParams(max_tokens=budget, temperature=0.0))


def train_from_answers(
    rows: list[dict], encoder: object, *, exclude: Callable[[str], bool] = lambda _id: False
) -> AnswerProbe:
    """A probe on graded answers (those `exclude` does not reject), its threshold the out-of-fold one with
    the best balanced accuracy."""
    kept = [r for r in rows if not exclude(r["id"])]
    probe = AnswerProbe.train([(r["question"], r["answer"]) for r in kept], [r["correct"] for r in kept], encoder)  # type: ignore[arg-type]
    probe.metadata |= {"sources": sorted({r["source"] for r in kept}), "model": kept[0]["model"] if kept else None}
    return probe


def summary(rows: list[dict], probe: AnswerProbe, directory: Path) -> str:
    by_source: dict[str, list[bool]] = {}
    for r in rows:
        by_source.setdefault(r["source"], []).append(r["correct"])
    right = ", ".join(f"{s} {sum(v)}/{len(v)}" for s, v in sorted(by_source.items()))
    m = probe.metadata
    return (
        f"answers right: {right}\n"
        f"probe: {m['n_train']} answers, out-of-fold AUC {m['cv_auc']:.3f}, threshold {m['threshold']:.3f} "
        f"(balanced accuracy {m['balanced_accuracy']:.3f}); saved in {directory}\n" + json.dumps(m)
    )
