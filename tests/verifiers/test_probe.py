"""The answer probe's data and training run: graded greedy answers (resumed, one model per file), the probe
trained on them, and `switchboard verifiers train-probe` end to end on the tiny profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from answer_samples import apple_answers

from engines.engine import Engine
from grading.datasets import Item, user
from grading.graders import grade_gsm8k
from router_model.label import tier_model
from router_model.label_store import read_rows
from verifiers.probe import FEATURE_VERSION, AnswerProbe, load_probe
from verifiers.probe_data import SOURCES, answer_items, labeled_items, train_from_answers

ITEMS = [
    Item("gsm8k/a", "gsm8k", user("What is 2 + 2? Reply with the number."), {"answer": "#### 4"}),
    Item("gsm8k/b", "gsm8k", user("What is 3 + 5? Reply with the number."), {"answer": "#### 8"}),
    Item("gsm8k/c", "gsm8k", user("Name a colour."), {"answer": "#### 999"}),
]


def test_answers_are_graded_resumed_and_kept_to_one_model(smollm2_dir: Path, tmp_path: Path) -> None:
    engine = Engine.from_dir(smollm2_dir, dtype="bf16")
    out = tmp_path / "answers.jsonl"
    rows = answer_items(engine, "smol", ITEMS, out, max_tokens=12, progress=False)
    assert [r["id"] for r in rows] == ["gsm8k/a", "gsm8k/b", "gsm8k/c"]
    for row, item in zip(rows, ITEMS, strict=True):
        assert row["correct"] == grade_gsm8k(item, row["answer"]) and row["question"] == item.question
        assert row["tokens"] <= 12 and row["model"] == "smol"
    assert rows[2]["correct"] is False
    assert answer_items(None, "smol", ITEMS, out, progress=False, max_tokens=12) == rows  # nothing to redo
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n")  # an interrupted run: the last answer is redone
    again = answer_items(engine, "smol", ITEMS, out, max_tokens=12, progress=False)
    assert again == rows and len(read_rows(out)) == 3  # greedy: the same text
    with pytest.raises(ValueError, match="holds answers of"):
        answer_items(None, "other", ITEMS, out, max_tokens=12, progress=False)
    with pytest.raises(ValueError, match="no engine"):
        answer_items(
            None, "smol", [*ITEMS, Item("gsm8k/d", "gsm8k", user("1 + 1?"), {"answer": "#### 2"})], out, max_tokens=12
        )


def test_the_labeled_gradable_items_are_found() -> None:
    from router_model.label import DEFAULT_OUT

    home = Path(os.environ.get("SWITCHBOARD_HOME", Path.home() / ".cache" / "switchboard")).expanduser()
    labeled = [r for r in read_rows(DEFAULT_OUT) if r["source"] in SOURCES]
    items = labeled_items(DEFAULT_OUT, home)
    assert [i.id for i in items] == [r["id"] for r in labeled] and {i.source for i in items} == set(SOURCES)


def apple_rows() -> list[dict]:
    pairs, labels = apple_answers()
    return [
        {"id": f"gsm8k/{i}", "source": "gsm8k", "question": q, "answer": a, "correct": ok, "model": "m"}
        for i, ((q, a), ok) in enumerate(zip(pairs, labels, strict=True))
    ]


def test_a_probe_trains_on_graded_answers_leaving_out_what_it_is_told() -> None:
    from router_model.encoder import RouterEncoder

    rows = apple_rows()
    probe = train_from_answers(rows, RouterEncoder(), exclude=lambda i: int(i.split("/")[1]) % 4 == 0)
    m = probe.metadata
    assert m["n_train"] == 60 and m["sources"] == ["gsm8k"] and m["model"] == "m"
    assert m["cv_auc"] > 0.9 and m["balanced_accuracy"] > 0.9 and 0.0 < m["threshold"] < 1.0


def test_train_probe_command(smollm2_dir: Path, tmp_path: Path) -> None:
    """On answers already there (generating enough right ones needs a better model than SmolLM2): the
    command reads the label file, trains, saves a probe the gateway loads."""
    from router_model.encoder import RouterEncoder
    from router_model.label_store import open_appender

    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / smollm2_dir.name).symlink_to(smollm2_dir)
    (home / "data").symlink_to(smollm2_dir.parents[1] / "data")
    labels, probe_dir = tmp_path / "labels.jsonl", tmp_path / "probe"
    rows = apple_rows()[::2]  # 20 right, 20 wrong
    with open_appender(labels) as append:
        for r in rows:
            append({"id": r["id"], "source": "gsm8k", "small_ok": r["correct"]})
    from core.settings import Settings

    model = tier_model(Settings(profile="tiny", home=home).tiers["small"])
    with open_appender(probe_dir / "answers.jsonl") as append:
        for r in rows:
            append(r | {"model": model})
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    env.update(SWITCHBOARD_HOME=str(home), SWITCHBOARD_PROFILE="tiny", SWITCHBOARD_CONFIG=str(tmp_path / "none.toml"))
    switchboard = str(Path(sys.executable).parent / "switchboard")
    args = [switchboard, "verifiers", "train-probe", "--labels", str(labels), "--out", str(probe_dir)]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "answers right: gsm8k 20/40" in done.stdout
    saved = json.loads((probe_dir / "probe.json").read_text())
    assert saved["n_train"] == 40 and saved["feature_version"] == FEATURE_VERSION and saved["model"] == model
    assert isinstance(load_probe(probe_dir, RouterEncoder()), AnswerProbe)
    bad = subprocess.run([*args[:3], "--tier", "nope"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "no in-process tier 'nope'" in bad.stderr


def test_load_probe_refuses_what_it_cannot_use(tmp_path: Path) -> None:
    from router_model.encoder import RouterEncoder

    assert load_probe(tmp_path / "none", RouterEncoder()) is None
    pairs, labels = apple_answers()
    probe = AnswerProbe.train(pairs, labels, RouterEncoder())
    probe.metadata["feature_version"] = "an-older-one"
    assert load_probe(probe.save(tmp_path / "old"), RouterEncoder()) is None
