"""Escalation checks per kind of request, measured where they fire: how well each one tells the small tier's
wrong answers from its right ones, per source, on labeled answers, and what it costs.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.checks --labels PATH [--limit N] [--split held|all]
        [--checks prompt_examples program_of_thought resample probe] [--answer-missing] [--probe DIR]

The label file is `switchboard router label --keep-text`'s: rows with id, source, small_ok, large_ok and the
small tier's answer (`small_text`); the prompts come from `grading.datasets` by id. Rows without a text
are skipped, unless `--answer-missing` has the small tier answer them again (greedily, as labeling did;
GSM8K and HumanEval only, graded afresh: the label is the grade of the text the check sees; kept in
`--out`'s answers file, so a rerun does not answer them again). `--split held` (default) measures on the
router's held-out 20% (`router_model.examples.split_examples`, seed 0, over every row of the file);
`--limit N` takes at most N rows of each source.

Checks, and where they are measured: `prompt_examples` (code: every source, so that its silence elsewhere
shows), `program_of_thought` and `resample` (math: GSM8K; they ask the small tier, through the same
`verifiers.ask.tier_ask` the gateway uses, `--concurrency` checks at once so the engine batches them),
`probe` (every source, open chat included; the probe in `--probe` or the settings' probe directory, else
one trained here on the train split's texts). A check escalating is the prediction "small was wrong".
Per check and source: rows, wrong answers, escalations, precision and recall of "wrong" (with counts),
the cascade's accuracy (an escalated row takes the large tier's label) against small and large alone,
and the check's own cost: tokens it asked the tier for and seconds, per row. Each (row, check) result is
appended to `--out`'s results file as it comes, so an interrupted run resumes. The table, then one JSON
line: {"rows": ..., "checks": {check: {source: {...}}}}.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import say  # also checks OMP_NUM_THREADS

CHECKS = ("prompt_examples", "program_of_thought", "resample", "probe")
ASKING = ("program_of_thought", "resample")
WHERE: dict[str, tuple[str, ...] | None] = {  # sources each check is measured on (None: every source)
    "prompt_examples": None,
    "program_of_thought": ("gsm8k",),
    "resample": ("gsm8k",),
    "probe": None,
}
SILENT = ("the prompt gives no examples", "no tier to ask", "could not ask")  # the check did not look
ANSWERABLE = ("gsm8k", "humaneval")  # `--answer-missing`: sources graded without a judge


@dataclass(frozen=True)
class Case:
    """A labeled answer: the prompt, the small tier's text, whether it (and the large tier's) was right."""

    id: str
    source: str
    small_ok: bool
    large_ok: bool
    text: str | None  # None: the row has none (yet)
    messages: list[dict[str, str]]

    @property
    def question(self) -> str:
        return self.messages[-1]["content"]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.checks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", type=Path, help="a label file with texts (default: router label's)")
    ap.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS))
    ap.add_argument("--split", choices=("held", "all"), default="held", help="held-out rows only, or every row")
    ap.add_argument("--limit", type=int, metavar="N", help="at most N rows of each source")
    ap.add_argument("--sources", nargs="+", help="only these sources")
    ap.add_argument("--answer-missing", action="store_true", help="answer rows without a text on the small tier")
    ap.add_argument("--tier", default="small", help="the tier whose answers are checked and asked (default: small)")
    ap.add_argument("--probe", type=Path, metavar="DIR", help="a trained answer probe (default: the settings')")
    ap.add_argument("--threads", type=int, metavar="N", help="torch threads of the tier (default: its setting)")
    ap.add_argument("--concurrency", type=int, default=4, help="checks at once (asks batch in the engine)")
    ap.add_argument("--out", type=Path, metavar="DIR", help="results and answers (default: HOME/bench-checks)")
    args = ap.parse_args()
    if {"prompt_examples", "program_of_thought"} & set(args.checks):  # they run model-written code
        from grading.sandbox import require_jail

        require_jail(False, "the prompt_examples and program_of_thought checks", unsafe_allowed=False)

    from core.settings import Settings
    from router_model.label import DEFAULT_OUT, tier_model

    settings = Settings()
    labels = (args.labels or DEFAULT_OUT).expanduser()
    out = (args.out or settings.home_dir / "bench-checks").expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tier = settings.tiers[args.tier]
    if args.threads:
        tier = tier.model_copy(update={"threads": args.threads})
    model = tier_model(tier)
    check_model(labels, model)
    engine = _Tier(settings.model_copy(update={"tiers": {args.tier: tier}}), args.tier)
    train, held = load_cases(labels, settings.home_dir, args.split, args.sources)
    held = [c for c in held if c.text is not None or (args.answer_missing and c.source in ANSWERABLE)]
    held = limited(held, args.limit)
    if args.answer_missing:
        held = answered(held, engine, out / "answers.jsonl", model)
    cases = [c for c in held if c.text is not None]
    say(f"{len(cases)} rows with texts ({args.split}): " + ", ".join(f"{s} {n}" for s, n in counts(cases).items()))
    results_file = out / "results.jsonl"
    results = read_results(results_file, model)
    for name in args.checks:
        todo = [c for c in cases if applies(name, c) and (c.id, name) not in results]
        if not todo:
            continue
        check = make_check(name, args.probe or settings.probe_path, [c for c in train if c.text is not None])
        if check is None:
            continue
        ask = engine.ask_factory() if name in ASKING else None
        for row in measure(name, check, todo, ask, args.concurrency, model):
            append(results_file, row)
            results[(row["id"], name)] = row
    engine.close()
    wanted = {c.id for c in cases}
    kept = [r for (i, name), r in results.items() if i in wanted and name in args.checks]
    report = summarize(kept)
    print_table(report)
    print(json.dumps({"rows": len(cases), "split": args.split, "labels": str(labels), "checks": report}))


# --- the rows ------------------------------------------------------------------------------------------


def check_model(labels: Path, model: str) -> None:
    """Exit unless the label file's small answers are `model`'s (the checks ask it about them)."""
    from router_model.examples import read_label_rows

    others = {str(r["small_model"]) for r in read_label_rows(labels) if r.get("small_model")} - {model}
    if others:
        raise SystemExit(f"{labels} holds answers of {sorted(others)}, not of the tier's {model}: configure the tier")


def load_cases(
    labels: Path, home: Path, split: str, sources: Iterable[str] | None = None
) -> tuple[list[Case], list[Case]]:
    """(train, measured): the label file's rows as cases (text None where the row has none), split as the
    router splits them (`split` "all": nothing to train on, every row measured)."""
    from router_model.examples import load_examples, read_label_rows, split_examples

    rows = {str(r["id"]): r for r in read_label_rows(labels)}
    examples = load_examples(labels, home)
    if sources:
        examples = [e for e in examples if e.source in set(sources)]
    train, held = ([], examples) if split == "all" else split_examples(examples, 0.2, seed=0)

    def case(e: Any) -> Case:
        text = rows[e.id].get("small_text")
        return Case(e.id, e.source, e.small_ok, e.large_ok, text, list(e.messages))  # type: ignore[arg-type]

    return [case(e) for e in train], [case(e) for e in held]


def answered(cases: list[Case], tier: _Tier, answers: Path, model: str) -> list[Case]:
    """`cases` with the small tier's graded answer where the row has no text (GSM8K and HumanEval)."""
    from grading.datasets import items_by_id
    from verifiers.probe_data import SOURCES, answer_items

    missing = [c for c in cases if c.text is None and c.source in SOURCES]  # SOURCES == ANSWERABLE
    if not missing:
        return cases
    items = items_by_id(tier.settings.home_dir, [c.id for c in missing])
    rows = answer_items(tier.engine_if_needed(answers, model, missing), model, [items[c.id] for c in missing],
                        answers, max_tokens=512)  # fmt: skip
    by_id = {r["id"]: r for r in rows}
    return [
        Case(c.id, c.source, bool(by_id[c.id]["correct"]), c.large_ok, by_id[c.id]["answer"], c.messages)
        if c.id in by_id
        else c
        for c in cases
    ]


def limited(cases: list[Case], limit: int | None) -> list[Case]:
    """At most `limit` cases of each source, those with a text first (the rest would need answering), by id."""
    if limit is None:
        return cases
    taken: dict[str, int] = {}
    out = []
    for c in sorted(cases, key=lambda c: c.text is None):  # stable: by id within each group
        if taken.get(c.source, 0) < limit:
            taken[c.source] = taken.get(c.source, 0) + 1
            out.append(c)
    return sorted(out, key=lambda c: c.id)


def counts(cases: Iterable[Case]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in cases:
        out[c.source] = out.get(c.source, 0) + 1
    return dict(sorted(out.items()))


def applies(name: str, case: Case) -> bool:
    where = WHERE[name]
    return where is None or case.source in where


# --- the checks ----------------------------------------------------------------------------------------


class _Tier:
    """The checked tier's engine, loaded on first use: the sync engine to answer, then its thread for asks."""

    def __init__(self, settings: Any, name: str) -> None:
        self.settings, self.name = settings, name
        self._engine: Any = None
        self._portal: Any = None
        self._portal_cm: Any = None

    def load(self) -> Any:
        if self._engine is None:
            from gateway.runtime.tiers import load_engines

            self._engine = load_engines(self.settings)[self.name]  # the settings hold this tier alone
        return self._engine

    def engine_if_needed(self, answers: Path, model: str, missing: list[Case]) -> Any:
        from verifiers.probe_data import answered as already

        done = already(answers, model)
        return None if all(c.id in done for c in missing) else self.load().engine

    def ask_factory(self) -> Callable[[Callable[[int, int], None]], Any]:
        """Asks on the tier's engine thread, through a blocking portal; each with its own token counter."""
        import anyio.from_thread

        from verifiers.ask import tier_ask

        engine = self.load()
        engine.start()
        if self._portal is None:
            self._portal_cm = anyio.from_thread.start_blocking_portal()
            self._portal = self._portal_cm.__enter__()
        return lambda spent: tier_ask(engine, portal=self._portal, spent=spent)

    def close(self) -> None:
        if self._portal_cm is not None:
            self._portal_cm.__exit__(None, None, None)
        if self._engine is not None:
            self._engine.shutdown()


def make_check(name: str, probe_dir: Path, train: list[Case]) -> Any:
    """The check `name` as the gateway builds it; the probe loaded from `probe_dir`, else trained on `train`
    (None, said why, where neither can be had)."""
    from verifiers.policy import CHECKS as BUILT

    if name != "probe":
        return BUILT[name]()
    from router_model.encoder import RouterEncoder
    from verifiers.probe import AnswerProbe, ProbeCheck, load_probe

    encoder = RouterEncoder()
    probe = load_probe(probe_dir, encoder)
    if probe is None:
        labels = [c.small_ok for c in train]
        if len(train) < 20 or all(labels) or not any(labels):
            say(f"probe: none in {probe_dir} and {len(train)} training texts (both classes, 20+ needed): skipped")
            return None
        probe = AnswerProbe.train([(c.question, c.text) for c in train], labels, encoder)
        say(f"probe: trained on {len(train)} train-split texts (out-of-fold AUC {probe.metadata['cv_auc']:.3f})")
    return ProbeCheck(probe)


def measure(
    name: str, check: Any, cases: list[Case], ask_factory: Callable | None, concurrency: int, model: str
) -> Iterable[dict]:
    """Each case's verdict from `check`, with the tokens its asks took and its seconds, as they finish."""
    from verifiers.base import Context, Trace

    lock = threading.Lock()

    def one(case: Case) -> dict:
        spent = [0, 0]

        def count(prompt: int, completion: int) -> None:
            with lock:
                spent[0] += prompt
                spent[1] += completion

        ask = ask_factory(count) if ask_factory is not None else None
        context = Context(prompt=case.question, messages=case.messages, ask=ask)
        start = time.perf_counter()
        verdict = check.check(context, [Trace(0, [], case.text, finished=True, finish_reason="stop")])[0]
        return {"id": case.id, "source": case.source, "check": name, "model": model,
                "small_ok": case.small_ok, "large_ok": case.large_ok, "action": str(verdict.action),
                "score": round(verdict.score, 4), "reason": verdict.reason,
                "seconds": round(time.perf_counter() - start, 3), "prompt_tokens": spent[0],
                "completion_tokens": spent[1]}  # fmt: skip

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        for i, row in enumerate(pool.map(one, cases), 1):
            say(f"{name} {i}/{len(cases)} {row['id']}: {row['action']} ({row['reason'][:90]})")
            yield row


# --- results -------------------------------------------------------------------------------------------


def read_results(path: Path, model: str) -> dict[tuple[str, str], dict]:
    from router_model.label_store import read_rows

    rows = read_rows(path) if path.exists() else []
    return {(r["id"], r["check"]): r for r in rows if r.get("model") == model}


def append(path: Path, row: dict) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")


def summarize(results: Iterable[dict]) -> dict[str, dict[str, dict]]:
    """Per check, per source (and "all"): counts, precision and recall of "small was wrong", cascade
    accuracy, the check's cost per row."""
    groups: dict[str, dict[str, list[dict]]] = {}
    for r in results:
        by_source = groups.setdefault(r["check"], {})
        by_source.setdefault(r["source"], []).append(r)
        by_source.setdefault("all", []).append(r)
    return {check: {s: _metrics(rows) for s, rows in sorted(g.items())} for check, g in sorted(groups.items())}


def _metrics(rows: list[dict]) -> dict[str, Any]:
    n = len(rows)
    wrong = sum(not r["small_ok"] for r in rows)
    escalated = [r for r in rows if r["action"] == "escalate"]
    caught = sum(not r["small_ok"] for r in escalated)
    looked = sum(not any(s in r["reason"] for s in SILENT) for r in rows)
    cascade = sum(r["large_ok"] if r["action"] == "escalate" else r["small_ok"] for r in rows)
    return {
        "rows": n,
        "looked": looked,
        "wrong": wrong,
        "escalated": len(escalated),
        "caught": caught,
        "precision": round(caught / len(escalated), 3) if escalated else None,
        "recall": round(caught / wrong, 3) if wrong else None,
        "small_acc": round(sum(r["small_ok"] for r in rows) / n, 3),
        "cascade_acc": round(cascade / n, 3),
        "large_acc": round(sum(r["large_ok"] for r in rows) / n, 3),
        "tokens_per_row": round(sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows) / n, 1),
        "completion_tokens_per_row": round(sum(r["completion_tokens"] for r in rows) / n, 1),
        "seconds_per_row": round(sum(r["seconds"] for r in rows) / n, 3),
    }


def print_table(report: dict[str, dict[str, dict]]) -> None:
    head = f"{'check':<19} {'source':<10} {'rows':>5} {'looked':>6} {'wrong':>5} {'esc':>4} {'caught':>6} "
    print(head + f"{'prec':>6} {'recall':>6} {'small':>6} {'cascade':>7} {'large':>6} {'tok/row':>8} {'s/row':>7}")

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    for check, by_source in report.items():
        for source, m in by_source.items():
            print(
                f"{check:<19} {source:<10} {m['rows']:>5} {m['looked']:>6} {m['wrong']:>5} {m['escalated']:>4} "
                f"{m['caught']:>6} {fmt(m['precision']):>6} {fmt(m['recall']):>6} {m['small_acc']:>6.3f} "
                f"{m['cascade_acc']:>7.3f} {m['large_acc']:>6.3f} {m['tokens_per_row']:>8.1f} "
                f"{m['seconds_per_row']:>7.2f}"
            )


if __name__ == "__main__":
    main()
