"""Labeled examples: the rows of a label file joined with their conversations, and the held-out split.

A label file (`switchboard router label`) has one JSON object per line with at least `id`, `source`,
`small_ok` and `large_ok`. A row may carry its `messages` itself (synthetic files do); otherwise they
come from `grading.datasets`, the shipped prompts the labels were made from, by id.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from router_model.features import Messages

DEFAULT_HOME = Path("~/.cache/switchboard").expanduser()


class LabelFileError(ValueError):
    """A label file that cannot be read as labels."""


@dataclass(frozen=True)
class Example:
    id: str
    source: str
    small_ok: bool
    large_ok: bool
    messages: Messages
    tiny_ok: bool | None = None  # labels made with a tiny tier (SmolLM2-135M) say whether it would do
    needs_call: bool | None = None  # a tool request's labels say whether a right answer calls a tool (BFCL knows)


def read_label_rows(path: Path) -> list[dict]:
    """The rows of a JSONL label file; the last row of an id wins. A run still appending is fine:
    `label_store.read_rows` skips its unterminated last line. Live rows that cannot train a router (a
    tiny answer's verdict, or one kept without its conversation) are left out."""
    from router_model.label_store import read_rows

    if not Path(path).is_file():
        raise LabelFileError(f"{path}: no such label file (`switchboard router label` writes one)")
    try:
        found = read_rows(Path(path))
    except ValueError as exc:
        raise LabelFileError(str(exc)) from None
    rows: dict[str, dict] = {}
    for n, row in enumerate(found, 1):
        if row.get("source") == "live" and ("small_ok" not in row or "messages" not in row):
            continue  # a verdict that trains nothing: on a tiny answer, or without its conversation (store_prompts off)
        missing = [k for k in ("id", "source", "small_ok", "large_ok") if k not in row]
        if missing:
            raise LabelFileError(f"{path}: row {n}: missing {', '.join(missing)}")
        rows[str(row["id"])] = row
    if not rows:
        raise LabelFileError(f"{path}: no labels")
    return list(rows.values())


def merge_label_files(paths: Sequence[Path], out: Path) -> Path:
    """One label file from several (the shipped labels and the gateway's live ones): a later row of an id wins."""
    import json

    rows: dict[str, dict] = {}
    for path in paths:
        rows |= {str(r["id"]): r for r in read_label_rows(path)}
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows.values()), encoding="utf-8")
    tmp.replace(out)
    return out


def load_examples(path: Path, home: Path = DEFAULT_HOME) -> list[Example]:
    """The label file's examples, sorted by id so that a split never depends on the file's order.

    `home` is where the shipped prompts' data is fetched to (the settings' home)."""
    rows = read_label_rows(path)
    missing = [str(r["id"]) for r in rows if "messages" not in r]
    try:
        shipped = dataset_messages(missing, home) if missing else {}
    except KeyError as exc:
        raise LabelFileError(f"{path}: ids that are not shipped prompts: {exc.args[0]}") from None
    examples = [
        Example(
            id=str(r["id"]),
            source=str(r["source"]),
            small_ok=bool(r["small_ok"]),
            large_ok=bool(r["large_ok"]),
            messages=r["messages"] if "messages" in r else shipped[str(r["id"])],
            tiny_ok=None if r.get("tiny_ok") is None else bool(r["tiny_ok"]),
            needs_call=None if r.get("needs_call") is None else bool(r["needs_call"]),
        )
        for r in rows
    ]
    return sorted(examples, key=lambda e: e.id)


def dataset_messages(ids: Iterable[str], home: Path = DEFAULT_HOME) -> dict[str, Messages]:
    """Messages of shipped prompts by id, from `grading.datasets`; KeyError for an unknown id."""
    from grading.datasets import items_by_id

    return {i: item.messages for i, item in items_by_id(home, ids).items()}


def split_examples(
    examples: Sequence[Example], test_size: float = 0.2, seed: int = 0
) -> tuple[list[Example], list[Example]]:
    """(train, held-out): seeded and stratified by source, so every source is in both in proportion."""
    from sklearn.model_selection import train_test_split

    examples = sorted(examples, key=lambda e: e.id)  # the split depends on the ids, not on their order
    counts = Counter(e.source for e in examples)
    # A source with a single example cannot be split in proportion; it goes to training.
    lone = [e for e in examples if counts[e.source] < 2]
    rest = [e for e in examples if counts[e.source] >= 2]
    held_n = round(test_size * len(rest))
    sources = len({e.source for e in rest})  # each side needs one example of every source at least
    if held_n < sources or len(rest) - held_n < sources:
        raise LabelFileError(f"{len(examples)} examples are too few for a held-out split of {test_size:.0%}")
    train, held = train_test_split(rest, test_size=held_n, random_state=seed, stratify=[e.source for e in rest])
    return sorted(train + lone, key=lambda e: e.id), sorted(held, key=lambda e: e.id)


def ids_hash(examples: Iterable[Example]) -> str:
    """sha256 of the sorted ids, one per line: names a training set without listing it."""
    return hashlib.sha256("\n".join(sorted(e.id for e in examples)).encode()).hexdigest()


def label_summary(examples: Sequence[Example]) -> dict[str, dict[str, float]]:
    """Per source (and "all"): count and the small and large tiers' acceptable rates."""
    groups: dict[str, list[Example]] = {"all": list(examples)}
    for e in examples:
        groups.setdefault(e.source, []).append(e)
    return {
        name: {
            "n": len(g),
            "small_ok": sum(e.small_ok for e in g) / len(g),
            "large_ok": sum(e.large_ok for e in g) / len(g),
        }
        for name, g in groups.items()
        if g
    }
