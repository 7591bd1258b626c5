"""`switchboard router label`: what our own small and large tiers get right, one JSONL row per prompt.

Every item runs through both tiers greedily, up to `concurrency` items in flight so each engine batches
them; GSM8K and HumanEval answers are graded as they finish (HumanEval's sandboxes on worker threads, so
the engines keep stepping), and each open-chat item, once both answers are in, is judged on the large
tier (ahead of waiting answers, so items finish and get written early). Identical answers need no judge.

A row: id, source, small_ok, large_ok (open chat: true by definition, the large answer is the
reference), label (= small_ok), prompt_tokens, small_tokens / large_tokens and small_finish /
large_finish of the two answers, seconds (admission to row), judge (the judge's raw reply; null when
graded or identical) and the two tiers' models. `keep_text` adds small_text and large_text.

Rows are appended and flushed one by one; a rerun skips ids already in the file (an interrupted run
loses only its in-flight items) and refuses a file labeled by other models.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
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
from grading.datasets import SOURCES, Item, load_items
from grading.graders import GRADERS, judge_messages, parse_verdict
from router_model.label_store import Row, open_appender, read_rows

DEFAULT_OUT = Path(__file__).parent / "data" / "labels.jsonl"
DEFAULT_LIMITS: dict[str, int | None] = {"gsm8k": 300}  # every item of the other sources
MAX_TOKENS = 512
CONCURRENCY = 24
JUDGE_MAX_TOKENS = 16
ROLES = ("small", "large", "judge")


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
    prompt_tokens: int = 0
    pieces: dict[str, list[str]] = field(default_factory=dict)  # role → text so far
    answers: dict[str, Answer] = field(default_factory=dict)
    ok: dict[str, bool | Future[bool]] = field(default_factory=dict)  # tier → verdict, or a grading on its way
    judge: str | None = None

    @property
    def done(self) -> bool:
        return len(self.ok) == 2 and all(not isinstance(v, Future) or v.done() for v in self.ok.values())

    def verdict(self, tier: str) -> bool:
        v = self.ok[tier]
        return v.result() if isinstance(v, Future) else v


def tier_model(tier: TierSettings) -> str:
    """What a row records about the model that answered: enough to tell two labelings apart."""
    return f"{tier.model}@{tier.weights}/{tier.dtype}"


def pending_items(items: Iterable[Item], out: Path, models: tuple[str, str]) -> list[Item]:
    """The items `out` has no row for; raises `LabelError` if its rows came from other models."""
    try:
        rows = read_rows(out)
    except ValueError as exc:
        raise LabelError(str(exc)) from None
    for row in rows:
        if (row.get("small_model"), row.get("large_model")) != models:
            raise LabelError(
                f"{out} was labeled by {row.get('small_model')} / {row.get('large_model')}, not "
                f"{models[0]} / {models[1]}; write to another --out"
            )
    done = {row["id"] for row in rows}
    return [item for item in items if item.id not in done]


class _Run:
    """The items in flight on the two engines, their gradings and judgements."""

    def __init__(
        self, small: Engine, large: Engine, pool: ThreadPoolExecutor, *, max_tokens: int, bars: dict[str, tqdm]
    ) -> None:
        self.engines = {"small": small, "large": large, "judge": large}
        self.pool = pool
        self.max_tokens = max_tokens
        self.bars = bars
        self.jobs: dict[str, _Job] = {}
        self.requests: dict[str, tuple[_Job, str]] = {}  # request id → (job, role)

    def admit(self, item: Item) -> None:
        job = self.jobs[item.id] = _Job(item, time.perf_counter())
        for tier in ("small", "large"):
            self._submit(job, tier, item.messages, self.max_tokens, priority=0)

    def _submit(self, job: _Job, role: str, messages: list[dict[str, str]], max_tokens: int, priority: int) -> None:
        engine = self.engines[role]
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
        """One step of each engine with work (a tier pair sharing one engine steps once); False if none had."""
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
        self.bars[role].update(1)
        job.answers[role] = answer
        source = job.item.source
        if role == "judge":
            job.judge = answer.text
            job.ok["small"] = parse_verdict(answer.text) is True  # no clear yes: not good enough
        elif source in GRADERS:
            job.ok[role] = self.pool.submit(GRADERS[source], job.item, answer.text)
        elif "small" in job.answers and "large" in job.answers:  # open chat: the large tier judges
            job.ok["large"] = True
            small, large = job.answers["small"].text, job.answers["large"].text
            if small.strip() == large.strip():
                job.ok["small"] = True
                self.bars["judge"].update(1)
            else:
                self._submit(job, "judge", judge_messages(job.item.question, large, small), JUDGE_MAX_TOKENS, -1)

    def gradings(self) -> list[Future[bool]]:
        return [v for job in self.jobs.values() for v in job.ok.values() if isinstance(v, Future) and not v.done()]

    def finished(self, keep_text: bool, models: tuple[str, str]) -> list[Row]:
        rows = []
        for job in [j for j in self.jobs.values() if j.done]:
            del self.jobs[job.item.id]
            small, large = job.answers["small"], job.answers["large"]
            row: Row = {
                "id": job.item.id,
                "source": job.item.source,
                "small_ok": job.verdict("small"),
                "large_ok": job.verdict("large"),
                "label": job.verdict("small"),
                "prompt_tokens": job.prompt_tokens,
                "small_tokens": small.tokens,
                "large_tokens": large.tokens,
                "small_finish": small.finish,
                "large_finish": large.finish,
                "seconds": round(time.perf_counter() - job.started, 3),
                "judge": job.judge,
                "small_model": models[0],
                "large_model": models[1],
            }
            if keep_text:
                row |= {"small_text": small.text, "large_text": large.text}
            rows.append(row)
        return rows


def label_items(
    items: list[Item],
    small: Engine,
    large: Engine,
    out: Path,
    *,
    models: tuple[str, str],
    max_tokens: int = MAX_TOKENS,
    concurrency: int = CONCURRENCY,
    keep_text: bool = False,
    progress: bool = True,
    threads: int | None = None,
) -> int:
    """Label the items `out` has no row for yet, appending a row as each completes; returns how many.
    The engines step on this thread, with `threads` torch threads if given."""
    queue = deque(pending_items(items, out, models))
    if not queue:
        return 0
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _label(queue, small, large, out, models, max_tokens, concurrency, keep_text, progress)
    finally:
        torch.set_num_threads(before)


def _label(
    queue: deque[Item],
    small: Engine,
    large: Engine,
    out: Path,
    models: tuple[str, str],
    max_tokens: int,
    concurrency: int,
    keep_text: bool,
    progress: bool,
) -> int:
    chats = sum(item.source not in GRADERS for item in queue)
    totals = {"small": len(queue), "large": len(queue), "judge": chats}
    bars = {
        role: tqdm(total=totals[role], desc=role, unit="answer", position=i, disable=not progress or not totals[role])
        for i, role in enumerate(ROLES)
    }
    written = 0
    with open_appender(out) as append, ThreadPoolExecutor(max_workers=2, thread_name_prefix="grade") as pool:
        run = _Run(small, large, pool, max_tokens=max_tokens, bars=bars)
        try:
            while queue or run.jobs:
                while queue and len(run.jobs) < concurrency:
                    run.admit(queue.popleft())
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
                run.engines[role].abort(rid)
            for bar in bars.values():
                bar.close()
    return written


def summary(rows: list[Row], *, new: int, seconds: float, out: Path) -> str:
    """Items per source with small_ok and large_ok rates, for the end of a run."""
    lines = [f"labeled {new} new items in {seconds:.1f} s; {out} holds {len(rows)}", ""]
    lines.append(f"{'source':10} {'items':>6} {'small_ok':>9} {'large_ok':>9}")
    by_source: dict[str, list[Row]] = {}
    for row in rows:
        by_source.setdefault(row["source"], []).append(row)
    order = [s for s in SOURCES if s in by_source] + sorted(set(by_source) - set(SOURCES))
    for source, group in [(s, by_source[s]) for s in order] + [("all", rows)]:
        if group:
            small = Counter(r["small_ok"] for r in group)[True] / len(group)
            large = Counter(r["large_ok"] for r in group)[True] / len(group)
            lines.append(f"{source:10} {len(group):>6} {small:>9.3f} {large:>9.3f}")
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
    """Label the shipped prompts with the configured `small` and `large` tiers; returns the summary.

    `per_source`: items of each source (default: 300 of GSM8K, all of the rest), a seeded sample.
    `load_engines` gives the tiers' engines by name (the gateway's loader); it is called only if something
    is left to label."""
    missing = [name for name in ("small", "large") if name not in settings.tiers]
    if missing:
        raise LabelError(f"labeling needs tiers named small and large; the settings have no {', '.join(missing)}")
    started = time.perf_counter()
    limits = DEFAULT_LIMITS if per_source is None else per_source
    items = load_items(settings.home_dir, list(sources), per_source=limits, seed=seed, progress=progress)
    models = (tier_model(settings.tiers["small"]), tier_model(settings.tiers["large"]))
    new = 0
    if pending_items(items, out, models):
        engines = load_engines()
        small, large = (engines[name] for name in ("small", "large"))
        if not isinstance(small, AsyncEngine) or not isinstance(large, AsyncEngine):
            raise LabelError("labeling runs both tiers in this process; a remote tier cannot be labeled")
        new = label_items(
            items,
            small.engine,
            large.engine,
            out,
            models=models,
            max_tokens=max_tokens,
            concurrency=concurrency,
            keep_text=keep_text,
            progress=progress,
            threads=settings.max_threads,  # the tiers' `threads`, as their engine threads would use
        )
    return summary(read_rows(out), new=new, seconds=time.perf_counter() - started, out=out)
