"""`switchboard distill` (`gateway.adapters.distill`): from one tenant's stored prompts and the large tier's answers
to a deployed adapter, gated on held-out agreement.

Both tiers are tiny random models with SmolLM2's tokenizer (its chat template and vocabulary), loaded as the
gateway loads tiers. The teacher's head is zero, so it says nothing but its token 0 (the answer text is empty):
what the student must learn is known, to stop at once. The student's random head says something else to every
prompt, so it agrees with the teacher on none of the held-out prompts before and on all of them after.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import anyio
import pytest
import torch
from pydantic import ValidationError

from core.db.database import Database
from core.settings import Settings
from engines.lora.train import TrainConfig
from gateway.accounting.tenants import create_tenant, tenant_by_name
from gateway.adapters import AdapterStore
from gateway.adapters.distill import DistillError, agrees, distill
from gateway.adapters.schedule import DistillSchedule, ScheduledRun
from policies.policy import Policy
from policies.store import PolicyStore
from router_model.routed_prompts import RoutedPromptStore
from tiny import tiny_hf_model

pytest.importorskip("peft")

TOPICS = ["rivers", "mountains", "deserts", "oceans", "forests", "islands", "volcanoes", "lakes", "glaciers", "caves"]


def tiny_chat_model(path: Path, smollm2_dir: Path, silent: bool) -> Path:
    from transformers import AutoModelForCausalLM

    tiny_hf_model("llama", path, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=False,
                  eos_token_id=2)  # fmt: skip
    if silent:
        model = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            model.lm_head.weight.zero_()  # every logit 0: the first token, id 0, every time
        model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def tiers(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiers")
    return {"teacher": tiny_chat_model(root / "teacher", smollm2_dir, silent=True),
            "student": tiny_chat_model(root / "student", smollm2_dir, silent=False)}  # fmt: skip


def setup(tmp_path: Path, small: Path, large: Path) -> tuple[Settings, Database]:
    tiers = {"small": {"model": str(small)}, "large": {"model": str(large)}}
    settings = Settings(home=tmp_path / "home", database_url=f"sqlite:///{tmp_path / 'db.sqlite'}", tiers=tiers)
    db = Database(settings.database)
    db.upgrade()
    prompts = RoutedPromptStore(db)
    for tenant, store in (("acme", True), ("other", False)):
        create_tenant(db, tenant)
        t = tenant_by_name(db, tenant)
        assert t is not None
        body = Policy().model_dump(mode="json")
        body["router"]["store_prompts"] = store
        PolicyStore(db).save(t.id, Policy.model_validate(body), "test")
        for i in range(30):
            topic = TOPICS[i % len(TOPICS)] if tenant == "acme" else f"secret {i}"
            messages = [{"role": "user", "content": f"Name {i % 7 + 2} famous {topic}, question {i}."}]
            prompts.add(t.id, f"{tenant}-{i}", messages, 0.5, "large")
        if store:  # a tool loop's turn, as routing stores it: left out
            tools = [{"role": "tools", "content": "[...]"}, {"role": "user", "content": "x"}]
            prompts.add(t.id, "tools", tools, 0.5, "large")
    return settings, db


def test_a_tenants_distilled_adapter_learns_the_teachers_answers_and_is_deployed(
    tmp_path: Path, tiers: dict[str, Path]
) -> None:
    settings, db = setup(tmp_path, tiers["student"], tiers["teacher"])
    acme = tenant_by_name(db, "acme")
    assert acme is not None
    said: list[str] = []
    config = TrainConfig(rank=4, alpha=8, learning_rate=3e-3, epochs=3, accumulate=4, warmup_steps=2, patience=2)
    report = distill(settings, db, acme.id, "acme", name="geo", limit=100, max_tokens=4, config=config,
                     say=said.append)  # fmt: skip
    assert report.data["prompts"] == 31 and report.data["skipped"] == 1  # acme's rows only, the tool turn left out
    assert report.data["examples"] + report.data["heldout"] == 30 and report.data["heldout"] >= 2
    assert report.base_agreement == 0.0 and report.adapter_agreement == 1.0, report
    assert report.deployed and report.training["seconds_per_1000_examples"] > 0
    assert report.training["heldout_loss"][-1] < report.training["base_heldout_loss"]
    (record,) = AdapterStore(db, settings.home_dir).list(acme.id)
    assert (record.model, record.source, record.details["adapter_agreement"]) == ("small:geo", "distilled", 1.0)
    assert PolicyStore(db).current(acme.id).policy.adapters == {"small": "geo"}
    other = tenant_by_name(db, "other")
    assert other is not None and AdapterStore(db, settings.home_dir).list(other.id) == []
    teacher_log = (settings.home_dir / "distill" / f"t{acme.id}" / "geo" / "teacher.jsonl").read_text()
    assert "secret" not in teacher_log and teacher_log.count("\n") == 30
    first = json.loads(teacher_log.splitlines()[0])  # the teacher's top-8 at each answer token: logit distillation
    assert len(first["top"]) == len(first["ids"]) == 4 and all(len(ids) == 8 for ids, _ in first["top"])
    # Run again: the teacher's answers and the finished training are reused.
    again = distill(settings, db, acme.id, "acme", name="geo", limit=100, max_tokens=4, config=config,
                    say=said.append, deploy=False)  # fmt: skip
    assert any("30 teacher answers kept from before, 0 to ask" in line for line in said)
    assert again.adapter_agreement == 1.0
    # Asked otherwise (a shorter limit): every answer is asked again, and the checkpoint trained on the other
    # answers is replaced, not resumed (it was an error, and a bench's second run failed on its first's folder).
    said.clear()
    third = distill(settings, db, acme.id, "acme", name="geo", limit=100, max_tokens=3, config=config,
                    say=said.append, deploy=False)  # fmt: skip
    assert not any("kept from before" in line for line in said)
    assert any("another run's" in line and "starting afresh" in line for line in said)
    assert third.adapter_agreement == 1.0 and third.training["epochs"] >= 1
    with pytest.raises(DistillError, match="keeps no prompts"):
        distill(settings, db, other.id, "other", config=config, say=said.append)


def test_an_adapter_that_does_not_agree_more_is_not_deployed(tmp_path: Path, tiers: dict[str, Path]) -> None:
    """The teacher is the student itself: the base already agrees on everything, so nothing can beat it."""
    settings, db = setup(tmp_path, tiers["student"], tiers["student"])
    acme = tenant_by_name(db, "acme")
    assert acme is not None
    config = TrainConfig(rank=4, alpha=8, learning_rate=1e-4, epochs=1, accumulate=8)
    report = distill(settings, db, acme.id, "acme", max_tokens=4, config=config, say=lambda _: None)
    assert report.base_agreement == 1.0 and not report.deployed and "not deployed" in report.why
    assert AdapterStore(db, settings.home_dir).list(acme.id) == []
    assert PolicyStore(db).current(acme.id).policy.adapters == {}


def test_agreement_reads_final_numbers_then_text() -> None:
    ask = [{"role": "user", "content": "How many?"}]
    assert agrees(ask, "So the total is 42.", "The answer is 42")
    assert not agrees(ask, "The answer is 41", "The answer is 42")
    assert agrees(ask, "Paris,  the capital", "paris, the capital") and not agrees(ask, "Lyon", "Paris")


def test_a_distill_schedule_runs_the_command_when_due_and_again_only_after_its_period_and_new_prompts(
    tmp_path: Path, tiers: dict[str, Path]
) -> None:
    settings, db = setup(tmp_path, tiers["student"], tiers["teacher"])
    acme = tenant_by_name(db, "acme")
    assert acme is not None
    policies = PolicyStore(db)
    body = policies.current(acme.id).policy.model_dump(mode="json")
    body["distill"] = {"schedule": "daily", "name": "nightly", "min_new_prompts": 20, "epochs": 3}
    policies.save(acme.id, Policy.model_validate(body), "test")
    training = ["--rank", "4", "--learning-rate", "3e-3", "--max-tokens", "4"]
    schedule = DistillSchedule(settings, db, policies, training)
    assert [(t, name) for t, name, _ in schedule.due()] == [(acme.id, "acme")]  # `other` has no schedule
    assert anyio.run(schedule.run_due) == [0]  # the command, in a child process, on the gateway's settings
    (record,) = AdapterStore(db, settings.home_dir).list(acme.id)
    assert (record.model, record.source, record.details["adapter_agreement"]) == ("small:nightly", "distilled", 1.0)
    assert policies.current(acme.id).policy.adapters == {"small": "nightly"}
    assert '"deployed": true' in (schedule.folder(acme.id) / "nightly.log").read_text()
    state = schedule.state(acme.id, "nightly")
    assert state is not None and state.returncode == 0 and state.finished is not None
    assert schedule.due() == []  # within its period
    later = time.time() + 2 * 86_400
    assert schedule.due(later) == []  # a day later, but no new prompts
    prompts = RoutedPromptStore(db)
    for i in range(20):
        prompts.add(acme.id, f"new-{i}", [{"role": "user", "content": f"Name a famous river, {i}."}], 0.5, "large")
    assert [t for t, _, _ in schedule.due(later)] == [acme.id]
    schedule._save(acme.id, "nightly", ScheduledRun(started=time.time(), newest_prompt=0))  # cut short
    assert [t for t, _, _ in schedule.due()] == [acme.id]  # resumed at the next check, whatever the period


def test_a_distill_schedule_needs_stored_prompts() -> None:
    body = Policy().model_dump(mode="json")
    body["distill"] = {"schedule": "weekly"}
    with pytest.raises(ValidationError, match=r"needs router\.store_prompts"):
        Policy.model_validate(body)
    body["router"]["store_prompts"] = True
    assert Policy.model_validate(body).distill.schedule == "weekly"
