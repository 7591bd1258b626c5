"""`switchboard router label`: what our own tiers get right, one JSONL row per prompt.

Every item runs through each tier (small and large, and tiny where the settings have one) greedily, up
to `concurrency` items in flight so each engine batches them; GSM8K and HumanEval answers are graded as
they finish (HumanEval's sandboxes on worker threads, so the engines keep stepping), and on open chat
each smaller tier's answer, once it and the large one are in, is judged on the large tier against the
large answer (ahead of waiting answers, so items finish and get written early). Identical answers need
no judge.

A row: id, source, `<tier>_ok` (large on open chat: true by definition, its answer is the reference),
label (= small_ok), prompt_tokens (the small tier's), `<tier>_tokens` and `<tier>_finish` of each answer,
seconds (admission to row), judge (the small answer's judge reply; null when graded or identical),
tiny_judge, and each tier's model (`<tier>_model`). `keep_text` adds `<tier>_text`.

Rows are appended and flushed one by one; a rerun skips ids already in the file (an interrupted run
loses only its in-flight items) and refuses a file labeled by other models. A row lacking a tier the
settings now have (tiny, added later) is completed: only that tier runs (and the large one again, on
open chat without a stored large answer to judge against), and a merged row is appended; the last row
of an id wins.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from core.settings import Settings, TierSettings
from engines.async_engine import AsyncEngine
from engines.engine import Engine
from engines.protocol import RequestRejected
from engines.request import EngineRequest, RequestOutput
from engines.sampling import SamplingParams
from grading.datasets import ANSWER_TOKENS, SOURCES, Item, load_items
from grading.graders import GRADERS, judge_messages, parse_verdict
from router_model.label_store import Row, open_appender, read_rows

DEFAULT_OUT = Path(__file__).parent / "data" / "labels.jsonl"
# The largest shipped label file (all three tiers' verdicts where labeled): what routers are trained on by
# default (`router train`, the gateway's first-start bootstrap); its labeling run resumes into it.
SHIPPED_LABELS = Path(__file__).parent / "data" / "labels-full-run.jsonl"
DEFAULT_LIMITS: dict[str, int | None] = {"gsm8k": 300}  # every item of the other sources
MAX_TOKENS = 512
CONCURRENCY = 24
JUDGE_MAX_TOKENS = 16
TIERS = ("tiny", "small", "large")  # the tiers a row can say something about; small and large are required


class LabelError(RuntimeError):
    """The run cannot go ahead as asked; the message says why."""


@dataclass
class Answer:
    text: str
    tokens: int
    finish: str


@dataclass
class _Job:
    item: Item
    started: float
    run: tuple[str, ...]  # the tiers answering in this run
    prior: Row = field(default_factory=dict)  # the item's earlier row, when completing it
    prompt_tokens: int = 0
    pieces: dict[str, list[str]] = field(default_factory=dict)  # role → text so far
    answers: dict[str, Answer] = field(default_factory=dict)
    ok: dict[str, bool | Future[bool]] = field(default_factory=dict)  # tier → verdict, or a grading on its way
    judges: dict[str, str] = field(default_factory=dict)  # tier → the judge's reply on its answer

    def done(self, tiers: Sequence[str]) -> bool:
        return all(t in self.ok for t in tiers) and all(not isinstance(v, Future) or v.done() for v in self.ok.values())

    def verdict(self, tier: str) -> bool:
        v = self.ok[tier]
        return v.result() if isinstance(v, Future) else v


def tier_model(tier: TierSettings) -> str:
    """What a row records about the model that answered: enough to tell two labelings apart."""
    return f"{tier.model}@{tier.weights}/{tier.dtype}"


def pending_items(items: Iterable[Item], out: Path, models: Mapping[str, str]) -> list[tuple[Item, Row]]:
    """The items `out` has no complete row for (with the row they have, or {}): no row, or one without a
    verdict of a tier in `models`. LabelError if its rows came from other models."""
    try:
        rows = {str(r["id"]): r for r in read_rows(out)}
    except ValueError as exc:
        raise LabelError(str(exc)) from None
    for row in rows.values():
        for tier, model in models.items():
            if f"{tier}_model" in row and row[f"{tier}_model"] != model:
                raise LabelError(
                    f"{out} was labeled with {tier} = {row[f'{tier}_model']}, not {model}; write to another --out"
                )
    return [
        (item, rows.get(item.id, {})) for item in items if any(f"{t}_ok" not in rows.get(item.id, {}) for t in models)
    ]


class _Run:
    """The items in flight on the engines, their gradings and judgements."""

    def __init__(
        self, engines: Mapping[str, Engine], pool: ThreadPoolExecutor, *, max_tokens: int, bars: dict[str, tqdm]
    ) -> None:
        self.engines = {**engines, "judge": engines["large"]}
        self.tiers = tuple(t for t in TIERS if t in engines)
        self.pool = pool
        self.max_tokens = max_tokens
        self.bars = bars
        self.jobs: dict[str, _Job] = {}
        self.requests: dict[str, tuple[_Job, str]] = {}  # request id → (job, role)

    def admit(self, item: Item, prior: Row) -> None:
        run = tuple(t for t in self.tiers if f"{t}_ok" not in prior)
        chat = item.source not in GRADERS
        if chat and "large" not in run and not prior.get("large_text"):
            run = (*run, "large")  # the smaller answers are judged against the large one: it must be at hand
        job = self.jobs[item.id] = _Job(item, time.perf_counter(), run, prior)
        job.prompt_tokens = int(prior.get("prompt_tokens", 0))
        for tier in self.tiers:
            if tier not in run:
                job.ok[tier] = bool(prior[f"{tier}_ok"])
                job.answers[tier] = Answer(str(prior.get(f"{tier}_text", "")), int(prior[f"{tier}_tokens"]),
                                           str(prior[f"{tier}_finish"]))  # fmt: skip
        longest = min(self.max_tokens, ANSWER_TOKENS.get(item.source, self.max_tokens))  # a fact's answer: 32
        for tier in run:
            job.ok.pop(tier, None)
            self._submit(job, tier, item.messages, longest, priority=0)

    def _submit(self, job: _Job, role: str, messages: list[dict[str, str]], max_tokens: int, priority: int) -> None:
        engine = self.engines[role.split("-")[0]]
        rid = f"{job.item.id}#{role}"
        prompt = engine.tokenizer.encode_chat(messages)
        if role == "small":
            job.prompt_tokens = len(prompt)
        budget = max(1, min(max_tokens, engine.max_model_len - len(prompt)))  # the context caps it
        params = SamplingParams(max_tokens=budget, temperature=0.0)
        try:
            engine.add_request(EngineRequest(rid, prompt, params, priority=priority))
        except RequestRejected:  # too long for this tier: an empty answer, which grades as wrong
            self._answered(job, role, Answer("", 0, "rejected"))
            return
        self.requests[rid] = (job, role)
        job.pieces[role] = []

    def step(self) -> bool:
        """One step of each engine with work (tiers sharing one engine step it once); False if none had."""
        stepped = False
        for engine in {id(e): e for e in self.engines.values()}.values():
            if engine.has_unfinished():
                stepped = True
                for out in engine.step():
                    self._output(out)
        return stepped

    def _output(self, out: RequestOutput) -> None:
        if out.request_id not in self.requests:
            return  # someone else's request
        job, role = self.requests[out.request_id]
        job.pieces[role].append(out.text)
        if out.finished:
            del self.requests[out.request_id]
            text = "".join(job.pieces.pop(role))
            self._answered(job, role, Answer(text, out.completion_tokens, str(out.finish_reason)))

    def _answered(self, job: _Job, role: str, answer: Answer) -> None:
        self.bars[role.split("-")[0]].update(1)
        source = job.item.source
        if role.startswith("judge-"):  # judge-<tier>: no clear yes is not good enough
            tier = role.removeprefix("judge-")
            job.judges[tier] = answer.text
            job.ok[tier] = parse_verdict(answer.text) is True
            return
        job.answers[role] = answer
        if source in GRADERS:
            job.ok[role] = self.pool.submit(GRADERS[source], job.item, answer.text)
            return
        if "large" not in job.answers:
            return
        job.ok["large"] = True  # open chat: the large answer is the reference
        large = job.answers["large"].text
        for tier in [t for t in job.run if t != "large" and t in job.answers and t not in job.ok]:
            if job.answers[tier].text.strip() == large.strip():
                job.ok[tier] = True
                self.bars["judge"].update(1)
            elif f"{job.item.id}#judge-{tier}" not in self.requests:
                messages = judge_messages(job.item.question, large, job.answers[tier].text)
                self._submit(job, f"judge-{tier}", messages, JUDGE_MAX_TOKENS, -1)

    def gradings(self) -> list[Future[bool]]:
        return [v for job in self.jobs.values() for v in job.ok.values() if isinstance(v, Future) and not v.done()]

    def finished(self, keep_text: bool, models: Mapping[str, str]) -> list[Row]:
        rows = []
        for job in [j for j in self.jobs.values() if j.done(self.tiers)]:
            del self.jobs[job.item.id]
            row: Row = dict(job.prior) | {"id": job.item.id, "source": job.item.source}
            for tier in job.run:
                answer = job.answers[tier]
                row |= {f"{tier}_ok": job.verdict(tier), f"{tier}_tokens": answer.tokens,
                        f"{tier}_finish": answer.finish, f"{tier}_model": models[tier]}  # fmt: skip
                if keep_text:
                    row[f"{tier}_text"] = answer.text
            row |= {"label": row["small_ok"], "prompt_tokens": job.prompt_tokens}
            if "small" in job.run:
                row |= {"judge": job.judges.get("small"), "seconds": round(time.perf_counter() - job.started, 3)}
            if "tiny" in job.run:
                row["tiny_judge"] = job.judges.get("tiny")
            rows.append(row)
        return rows


def label_items(
    items: list[Item],
    engines: Mapping[str, Engine],
    out: Path,
    *,
    models: Mapping[str, str],
    max_tokens: int = MAX_TOKENS,
    concurrency: int = CONCURRENCY,
    keep_text: bool = False,
    progress: bool = True,
    threads: int | None = None,
) -> int:
    """Label the items `out` has no complete row for yet, appending a row as each completes; returns how
    many. `engines`: tier → engine (small and large, tiny optional). The engines step on this thread,
    with `threads` torch threads if given."""
    queue = deque(pending_items(items, out, models))
    if not queue:
        return 0
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _label(queue, engines, out, models, max_tokens, concurrency, keep_text, progress)
    finally:
        torch.set_num_threads(before)


def _label(
    queue: deque[tuple[Item, Row]],
    engines: Mapping[str, Engine],
    out: Path,
    models: Mapping[str, str],
    max_tokens: int,
    concurrency: int,
    keep_text: bool,
    progress: bool,
) -> int:
    totals = {t: sum(f"{t}_ok" not in row for _, row in queue) for t in engines}
    totals["judge"] = sum(item.source not in GRADERS for item, _ in queue)
    bars = {
        role: tqdm(total=totals[role], desc=role, unit="answer", position=i, disable=not progress or not totals[role])
        for i, role in enumerate(totals)
    }
    written = 0
    with open_appender(out) as append, ThreadPoolExecutor(max_workers=2, thread_name_prefix="grade") as pool:
        run = _Run(engines, pool, max_tokens=max_tokens, bars=bars)
        try:
            while queue or run.jobs:
                while queue and len(run.jobs) < concurrency:
                    run.admit(*queue.popleft())
                stepped = run.step()
                for row in run.finished(keep_text, models):
                    append(row)
                    written += 1
                if not stepped and run.jobs:  # the engines are idle: only gradings are left to wait for
                    gradings = run.gradings()
                    if not gradings:
                        raise RuntimeError(f"stalled with {len(run.jobs)} items in flight and nothing running")
                    wait(gradings, timeout=1.0, return_when=FIRST_COMPLETED)
        finally:
            for rid, (_, role) in list(run.requests.items()):  # interrupted: free what is still running
                run.engines[role.split("-")[0]].abort(rid)
            for bar in bars.values():
                bar.close()
    return written


def summary(rows: list[Row], *, new: int, seconds: float, out: Path) -> str:
    """Items per source with each tier's ok rate (over the rows that have it), for the end of a run."""
    rows = list({str(r["id"]): r for r in rows}.values())  # the last row of an id
    tiers = [t for t in TIERS if any(f"{t}_ok" in r for r in rows)]
    lines = [f"labeled {new} new items in {seconds:.1f} s; {out} holds {len(rows)}", ""]
    lines.append(f"{'source':10} {'items':>6} " + " ".join(f"{t + '_ok':>9}" for t in tiers))
    by_source: dict[str, list[Row]] = {}
    for row in rows:
        by_source.setdefault(row["source"], []).append(row)
    order = [s for s in SOURCES if s in by_source] + sorted(set(by_source) - set(SOURCES))
    for source, group in [(s, by_source[s]) for s in order] + [("all", rows)]:
        rates = []
        for t in tiers:
            have = [r[f"{t}_ok"] for r in group if f"{t}_ok" in r]
            rates.append(f"{Counter(have)[True] / len(have):>9.3f}" if have else f"{'-':>9}")
        lines.append(f"{source:10} {len(group):>6} " + " ".join(rates))
    return "\n".join(lines)


def label_tiers(
    settings: Settings,
    load_engines: Callable[[], Mapping[str, object]],
    out: Path = DEFAULT_OUT,
    *,
    sources: Iterable[str] = SOURCES,
    per_source: int | None = None,
    seed: int = 0,
    max_tokens: int = MAX_TOKENS,
    concurrency: int = CONCURRENCY,
    keep_text: bool = False,
    progress: bool = True,
) -> str:
    """Label the shipped prompts with the configured `small` and `large` tiers (and `tiny`, if configured);
    returns the summary.

    `per_source`: items of each source (default: 300 of GSM8K, all of the rest), a seeded sample.
    `load_engines` gives the tiers' engines by name (the gateway's loader); it is called only if something
    is left to label."""
    missing = [name for name in ("small", "large") if name not in settings.tiers]
    if missing:
        raise LabelError(f"labeling needs tiers named small and large; the settings have no {', '.join(missing)}")
    started = time.perf_counter()
    limits = DEFAULT_LIMITS if per_source is None else per_source
    items = load_items(settings.home_dir, list(sources), per_source=limits, seed=seed, progress=progress)
    models = {t: tier_model(settings.tiers[t]) for t in TIERS if t in settings.tiers}
    new = 0
    if pending_items(items, out, models):
        loaded = load_engines()
        engines = {t: loaded[t] for t in models}
        if not all(isinstance(e, AsyncEngine) for e in engines.values()):
            raise LabelError("labeling runs every tier in this process; a remote tier cannot be labeled")
        new = label_items(
            items,
            {t: e.engine for t, e in engines.items()},  # type: ignore[attr-defined]
            out,
            models=models,
            max_tokens=max_tokens,
            concurrency=concurrency,
            keep_text=keep_text,
            progress=progress,
            threads=settings.max_threads,  # the tiers' `threads`, as their engine threads would use
        )
    return summary(read_rows(out), new=new, seconds=time.perf_counter() - started, out=out)
