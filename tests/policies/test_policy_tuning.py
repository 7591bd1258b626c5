"""Policy tuning: the policy's defaults and instruction as the gateway applies them, the candidates'
truncation against the engine's own runs, the judge, the choice under the tolerance, and a synthetic
tenant's proposal applied (audited) and then enforced by a live gateway."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import uuid
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import sqlalchemy as sa

from core.db.models import AuditEntry, PolicyProposal, RoutedPrompt
from engines.async_engine import AsyncEngine
from engines.request import EngineRequest, TokenLogprob
from engines.sampling import SamplingParams
from gateway.accounting.tenants import create_key, create_tenant, tenant_by_name
from gateway.api.deps import app_services
from live import LiveServer
from policies.policy import Policy, SamplingLimits, VerifierSettings
from policies.proposals import ProposalError, ProposalStore
from policies.sampling import Asked, instructed, resolve
from policies.store import PolicyStore
from policies.tune_quality import Judge, grader
from policies.tune_report import plot_png, table
from policies.tune_run import TuneRequest, tune_tenant
from policies.tuning import (
    CONCISE,
    Answer,
    Candidate,
    Scored,
    TunePrompt,
    TuningError,
    _caps,
    choose,
    generate,
    generation_variants,
    mined_stops,
    truncate,
    tune,
)
from verifiers.policy import tuning_hook

QUESTIONS = [
    "Name three primary colors.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "Give two tips for sleeping well.",
    "What does a thermometer measure?",
]


# --- how a policy shapes a request ---------------------------------------------------------------------


def test_defaults_fill_only_what_the_request_left_unset_and_caps_bind_them_too() -> None:
    limits = SamplingLimits(
        temperature_default=0.3, top_p_default=0.9, frequency_penalty_default=0.2, temperature_max=0.2,
        max_tokens_cap=64, default_stop=["\n\n"],
    )  # fmt: skip
    unset = resolve(limits, Asked(max_tokens=500))
    assert (unset.temperature, unset.top_p, unset.frequency_penalty, unset.presence_penalty) == (0.2, 0.9, 0.2, 0.0)
    assert unset.max_tokens == 64 and unset.stop == ("\n\n",)
    given = resolve(limits, Asked(max_tokens=10, temperature=0.1, top_p=1.0, frequency_penalty=0.0, stop=("END",)))
    assert (given.temperature, given.top_p, given.frequency_penalty, given.max_tokens) == (0.1, 1.0, 0.0, 10)
    assert given.stop == ("END",)
    plain = resolve(SamplingLimits(), Asked(max_tokens=7))
    assert (plain.temperature, plain.top_p, plain.frequency_penalty, plain.max_tokens) == (1.0, 1.0, 0.0, 7)


def test_the_instruction_joins_the_system_message_or_leads_and_the_callers_list_is_untouched() -> None:
    chat = [{"role": "user", "content": "hi"}]
    assert instructed(chat, "Be brief.") == [{"role": "system", "content": "Be brief."}, *chat]
    with_system = [{"role": "system", "content": "You are kind."}, *chat]
    out = instructed(with_system, "Be brief.")
    assert out[0]["content"] == "You are kind.\n\nBe brief." and with_system[0]["content"] == "You are kind."
    assert instructed(chat, None) is chat


def test_candidates_are_valid_policies_and_skip_what_the_policy_already_has() -> None:
    # the default policy cascades failed checks: a loop stop there is not offered (a retried loop costs more)
    assert "concise+cooler+loop stop" not in [v.name for v in generation_variants(Policy())]
    base = Policy(verifiers=VerifierSettings(cascade=False))
    variants = generation_variants(base)
    assert variants[0].name == "current" and len(variants) == 6
    for v in variants:
        Policy.model_validate(v.apply(base).model_dump(mode="json"))
    tuned = Candidate("x", {"sampling.system_instruction": CONCISE, "sampling.temperature_default": 0.3,
                            "sampling.top_p_default": 0.9}).apply(base)  # fmt: skip
    names = [v.name for v in generation_variants(tuned)]
    assert "concise" not in names and "cooler" not in names and "concise+cooler+penalty" in names
    assert base.sampling.system_instruction is None  # apply copies
    cascading = Policy.model_validate({"verifiers": {"cascade": True, "checks": ["math"]}})
    assert all("loop stop" not in v.name for v in generation_variants(cascading))  # a loop it retries costs more


def test_stop_strings_are_mined_from_how_many_answers_end() -> None:
    def answer(text: str) -> Answer:
        return Answer(_prompt(0), [1] * 10, text, 5, "stop")

    signed = "The answer.\n\nI hope this helps!"
    answers = [answer(signed), answer(signed.replace("this", "that")), answer("Short."), answer("A\n\nB c"),
               answer("Plain.\n\nI hope so.")]  # fmt: skip
    assert mined_stops(answers) == [("\n\nI hope",)]  # 3 of 5 end so; "B c" only once
    assert mined_stops(answers[2:4]) == []
    cut = truncate(answer(signed), None, ("\n\nI hope",), lambda ids: signed[: 4 * len(ids)])
    assert cut.text == "The answer." and cut.finish_reason == "stop"


def test_caps_are_quantiles_below_the_longest_answer_and_the_current_cap() -> None:
    lengths = list(range(10, 1010, 10))  # 10 … 1000
    assert _caps(lengths, None) == [None, 768, 912, 976]  # quantiles 0.75, 0.9, 0.97 rounded up to 16
    assert _caps(lengths, 950) == [None, 768, 912]
    assert _caps(list(range(10, 210, 10)), None) == [None, 160, 192]  # 0.97's 208 would cut nothing
    assert _caps([0] * 10 + [40], None) == [None, 16, 32]  # at least 16, each once


# --- the choice ------------------------------------------------------------------------------------------


def _scored(name: str, cost: str, quality: list[float], changes: dict | None = None) -> Scored:
    n = len(quality)
    return Scored(
        Candidate(name, changes if changes is not None else ({} if name == "current" else {"k": name})),
        Policy(), np.full(n, 100.0 * float(cost)), [Decimal(cost)] * n, np.array(quality, dtype=float),
    )  # fmt: skip


def test_the_cheapest_candidate_within_the_tolerance_and_not_significantly_worse_is_chosen() -> None:
    ones = [1.0] * 40
    worse = [1.0] * 36 + [0.0] * 4  # −0.10: beyond a 0.02 tolerance
    slightly = [0.985] * 40  # −0.015 on every prompt: within the tolerance, but significantly worse
    mixed = [1.0] * 19 + [0.8] + [1.0] * 20  # −0.005, its interval reaching 0
    scored = [
        _scored("current", "10", ones),
        _scored("cheapest-but-worse", "5", worse),
        _scored("consistently-worse", "6", slightly),
        _scored("fine", "7", mixed),
        _scored("dearer", "9", ones),
    ]
    t = choose(scored, tolerance=0.02)
    rows = {r.name: r for r in t.rows}
    assert t.chosen == "fine" and rows["fine"].eligible and rows["fine"].delta >= -0.02
    assert not rows["cheapest-but-worse"].eligible and not rows["consistently-worse"].eligible
    assert rows["consistently-worse"].ci_high < 0 <= rows["fine"].ci_high
    assert t.token_reduction == pytest.approx(0.3)
    assert choose(scored[:3], tolerance=0.02).chosen == "current"  # nothing qualifies: keep the policy
    with pytest.raises(TuningError):
        choose(scored[1:], tolerance=0.02)
    report = t.as_dict()
    assert report["quality_ci"][0] <= report["quality_delta"] <= report["quality_ci"][1]
    assert "> fine" in table(report) and plot_png(report).startswith(b"\x89PNG")


# --- against the engine ---------------------------------------------------------------------------------


def _prompt(i: int, tier: str = "small", grader_name: str = "judge") -> TunePrompt:
    return TunePrompt(f"p/{i}", [{"role": "user", "content": QUESTIONS[i]}], tier, grader_name)


def _run(engine: AsyncEngine, prompt: TunePrompt, params: SamplingParams, tag: str) -> Answer:
    ids = engine.tokenizer.encode_chat(prompt.messages)
    # A salt of its own: no prefix-cache hit, so each run computes its prompt as a fresh request would.
    req = EngineRequest(f"{tag}-{uuid.uuid4().hex[:6]}", ids, params, cache_salt=tag)
    (answer,) = asyncio.run(generate(engine, {req.request_id: (prompt, req)}))
    return answer


def test_a_cap_or_a_stop_string_applied_to_a_run_gives_the_engines_own_capped_run(small_engine: AsyncEngine) -> None:
    prompt = _prompt(3)
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=1234)
    full = _run(small_engine, prompt, params, "full")
    assert len(full.token_ids) >= 30
    decode = small_engine.tokenizer.decode
    capped = _run(small_engine, prompt, replace(params, max_tokens=20), "cap")
    cut = truncate(full, 20, (), decode)
    assert (cut.token_ids, cut.text, cut.finish_reason) == (capped.token_ids, capped.text, "length")
    # A stop string from the middle of the answer (its first occurrence there).
    middle = decode(full.token_ids[:25])
    stop = next(middle[i : i + 5] for i in range(len(middle) - 5, 0, -1) if middle.find(middle[i : i + 5]) == i)
    stopped = _run(small_engine, prompt, replace(params, stop=(stop,)), "stop")
    cut = truncate(full, None, (stop,), decode)
    assert stopped.finish_reason == "stop" and stopped.text == cut.text and stop not in cut.text
    assert len(cut.token_ids) == len(stopped.token_ids)


def test_the_judge_rates_one_answer_at_a_time_from_its_digit_probabilities(small_engine: AsyncEngine) -> None:
    judge = Judge(small_engine)
    digit = {d: i for i, d in judge.digits.items()}
    even = TokenLogprob(digit[3], math.log(0.5), ((digit[3], math.log(0.5)), (digit[7], math.log(0.5))))
    assert judge.score(even, "") == pytest.approx(0.5)  # rating 5 of 1-9
    assert judge.score(None, "I'd say 9.") == 1.0 and judge.unrated == 1
    scores = asyncio.run(judge.rate([("What is 2+2?", "4"), ("What is 2+2?", "The capital of France is Paris.")]))
    assert all(0.0 <= s <= 1.0 for s in scores) and judge.unrated == 1  # both read from the log-probabilities
    shown = judge.messages("Q?", "A.")[0]["content"]
    assert "Q?" in shown and "A." in shown and "policy" not in shown.lower()  # blind to who wrote it


def test_tuning_with_the_judge_proposes_a_valid_policy(small_engine: AsyncEngine) -> None:
    long = [{"role": "user", "content": "word " * (small_engine.max_model_len + 10)}]
    huge = TunePrompt("p/huge", long, "small", "judge")
    prompts = [_prompt(i) for i in range(4)] + [huge]  # one the engine would refuse is left out, not fatal
    variants = [Candidate("current", {}), Candidate("concise", {"sampling.system_instruction": CONCISE})]
    engines = {"small": small_engine}
    t = asyncio.run(
        tune(
            Policy(),
            prompts,
            engines,
            grader(Judge(small_engine)),
            hooks=tuning_hook,
            max_tokens=32,
            variants=variants,
            tolerance=0.05,
        )
    )
    assert t.skipped == 1 and t.prompts == 4
    names = [r.name for r in t.rows]
    assert names[0] == "current" and "concise" in names and len(names) >= 2
    chosen = t.proposal
    assert chosen.eligible and chosen.delta >= -0.05 and chosen.ci_high >= 0
    assert all(not r.eligible for r in t.rows if r.cost < chosen.cost)  # nothing cheaper qualified
    Policy.model_validate(t.policy.model_dump(mode="json"))
    with pytest.raises(TuningError, match="tiers"):
        asyncio.run(
            tune(Policy(), [_prompt(0, tier="large")], engines, grader(None), hooks=tuning_hook, variants=variants)
        )


# --- a synthetic tenant, end to end through a live gateway ------------------------------------------------


def _admin(live: LiveServer, tenant: str) -> tuple[dict[str, str], str]:
    admin = create_tenant(live.db, tenant, role="admin").key
    return {"Authorization": f"Bearer {admin}"}, create_key(live.db, tenant, "app").key


def test_a_synthetic_tenants_proposal_is_applied_audited_and_enforced(
    live_server: LiveServer, small_engine: AsyncEngine, tmp_path: Path
) -> None:
    live, name = live_server, f"tune-{uuid.uuid4().hex[:8]}"
    headers, app_key = _admin(live, name)
    tenant = tenant_by_name(live.db, name)
    assert tenant is not None
    with live.db.session() as s:  # the tenant's stored prompts (what `router.store_prompts` keeps)
        for i, q in enumerate(QUESTIONS):
            s.add(RoutedPrompt(tenant_id=tenant.id, request_id=f"r{i}", messages=[{"role": "user", "content": q}],
                               p_small_ok=0.9, tier="small"))  # fmt: skip
    policies: PolicyStore = app_services(live.app).policies
    proposals: ProposalStore = app_services(live.app).proposals

    async def any_answer(pairs: list) -> list[float]:  # the synthetic tenant's check: an answer was given
        return [float(bool(text.strip())) for _, text in pairs]

    variants = [Candidate("current", {}), Candidate("concise", {"sampling.system_instruction": CONCISE})]

    async def run() -> int:
        # A stop at the first line break is always tried: the haiku and the lists answer on several lines on any
        # CPU, so one cut is cheaper at no loss even where the caps and the mined stops find nothing to cut (on a
        # Zen 3, without it, only `current` and `concise` were scored, the instruction cost more than it saved,
        # and nothing was proposed).
        request = TuneRequest(tenant.id, sample=6, max_tokens=96, stops=[["\n"]])
        engines = {"small": small_engine, "large": small_engine}
        pid, _ = await tune_tenant(request, engines, policies, proposals, tmp_path, "test", hooks=tuning_hook,
                                   variants=variants, grade=any_answer)  # fmt: skip
        return pid

    pid = asyncio.run(run())
    base = f"{live.base_url}/v1/admin/tenants/{name}/policy/proposals"
    listed = httpx.get(base, headers=headers).json()
    assert [p["id"] for p in listed] == [pid] and listed[0]["status"] == "proposed", table(listed[0]["report"])
    report = listed[0]["report"]
    chosen = next(r for r in report["rows"] if r["name"] == report["chosen"])
    assert chosen["eligible"] and chosen["delta"] >= -report["tolerance"] and report["token_reduction"] > 0
    # Every answer counts alike, so an answer cut sooner is cheaper at no loss: every cap and stop string
    # is eligible, and the cheapest eligible change wins (a cap, a stop, or the concise instruction: which
    # are tried and which is cheapest depends on the answers, so on the CPU's bf16 arithmetic: on a Zen 5 a
    # cap won, on an Intel Xeon the instruction, with no cap or stop to try).
    cuts = [r for r in report["rows"] if {"sampling.max_tokens_cap", "sampling.default_stop"} & set(r["changes"])]
    assert all(r["eligible"] for r in cuts)
    assert chosen["changes"] and chosen["cost"] == min(r["cost"] for r in report["rows"] if r["eligible"])
    png = httpx.get(live.base_url + listed[0]["plot"], headers=headers)
    assert png.status_code == 200 and png.content.startswith(b"\x89PNG")

    # Another tenant's admin cannot see it; an app key cannot apply it.
    other, _ = _admin(live, f"other-{uuid.uuid4().hex[:8]}")
    assert httpx.get(f"{base}/{pid}", headers=other).status_code in (403, 404)
    assert httpx.post(f"{base}/{pid}/apply", headers={"Authorization": f"Bearer {app_key}"}).status_code == 403

    applied = httpx.post(f"{base}/{pid}/apply", headers=headers)
    assert applied.status_code == 200, applied.text
    version = applied.json()["version"]
    assert version == 1 and policies.current(tenant.id).version == 1
    again = httpx.post(f"{base}/{pid}/apply", headers=headers)
    assert again.status_code == 409 and again.json()["error"]["code"] == "proposal_decided"
    with live.db.session() as s:
        entry = s.scalar(sa.select(AuditEntry).where(AuditEntry.tenant_id == tenant.id,
                                                     AuditEntry.action == "policy.tune"))  # fmt: skip
        row = s.get(PolicyProposal, pid)
        assert entry is not None and entry.after == row.policy and row.applied_version == 1
        assert entry.actor.startswith("admin")

    # The gateway enforces the applied policy: its cap or stop string and, if chosen, its instruction.
    policy = policies.current(tenant.id).policy
    cap, stops = policy.sampling.max_tokens_cap, policy.sampling.default_stop
    client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=app_key)
    messages = [{"role": "user", "content": QUESTIONS[3]}]
    asked = (cap or 96) + 50
    r = client.chat.completions.create(model="small", messages=messages, max_tokens=asked, seed=7)  # type: ignore[arg-type]
    (usage,) = live.wait_for_usage(r.id)
    assert usage.effective_max_tokens == (cap or asked) and usage.policy_version == 1
    assert usage.completion_tokens <= (cap or asked)
    assert not any(stop in (r.choices[0].message.content or "") for stop in stops)
    shown = instructed(messages, policy.sampling.system_instruction)
    assert usage.prompt_tokens == len(small_engine.tokenizer.encode_chat(shown))

    # A proposal tuned from an older version is stale once another is in force; rejecting is audited.
    stale = proposals.save(tenant.id, 0, choose([_scored("current", "1", [1.0]), _scored("x", "0.5", [1.0])], 0.02),
                           None, "test")  # fmt: skip
    refused = httpx.post(f"{base}/{stale}/apply", headers=headers)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "proposal_stale"
    rejected = httpx.post(f"{base}/{stale}/reject", headers=headers, json={"reason": "not now"})
    assert rejected.status_code == 200 and rejected.json()["status"] == "rejected"
    with pytest.raises(ProposalError):
        proposals.get(tenant.id + 10_000, stale)
    assert httpx.get(f"{base}/999999", headers=headers).status_code == 404


def test_the_schedule_proposes_when_due_and_applies_only_when_opted_in(
    live_server: LiveServer, small_engine: AsyncEngine, tmp_path: Path
) -> None:
    from datetime import UTC, datetime, timedelta

    from gateway.runtime.tuning import TuningSchedule

    live = live_server
    policies: PolicyStore = app_services(live.app).policies
    proposals: ProposalStore = app_services(live.app).proposals
    ids = {}
    for name, auto in (("sched", False), ("auto", True)):
        tname = f"{name}-{uuid.uuid4().hex[:8]}"
        create_tenant(live.db, tname)
        tenant = tenant_by_name(live.db, tname)
        assert tenant is not None
        ids[name] = tenant.id
        body = {"tuning": {"schedule": "daily", "dataset": "mtbench", "sample": 5, "auto_apply": auto}}
        policies.save(tenant.id, Policy.model_validate(body), "test")
    quick = [Candidate("current", {}), Candidate("concise", {"sampling.system_instruction": CONCISE})]
    engines = {"small": small_engine, "large": small_engine}
    schedule = TuningSchedule(live.db, policies, proposals, engines, tmp_path, variants=quick, max_tokens=24)
    now = datetime.now(UTC)
    assert set(ids.values()) <= set(schedule.due(now))
    made = asyncio.run(schedule.run_due(now))
    mine = {p: proposals.list(t)[0] for p, t in ids.items()}
    assert {m.id for m in mine.values()} <= set(made)
    assert all(m.created_by == "schedule" for m in mine.values())
    assert mine["sched"].status in ("proposed", "unchanged") and policies.current(ids["sched"]).version == 1
    if mine["auto"].status == "applied":
        assert policies.current(ids["auto"]).version == 2 and mine["auto"].decided_by == "schedule (auto_apply)"
    else:
        assert mine["auto"].status == "unchanged" and policies.current(ids["auto"]).version == 1
    assert not set(ids.values()) & set(schedule.due(now + timedelta(hours=1)))  # done for today
    # A proposal the policy moved past is not applied by the schedule, nor does it stop the pass.
    stale = proposals.save(ids["sched"], 0, choose([_scored("current", "1", [1.0]), _scored("x", "0.5", [1.0])],
                                                   0.02), None, "test")  # fmt: skip
    asyncio.run(schedule._auto_apply(ids["sched"], stale))
    assert proposals.get(ids["sched"], stale).status == "proposed"
    # A day after the last proposal (the stale one, saved just now: on a slow CPU the run took minutes) it is due.
    assert set(ids.values()) <= set(schedule.due(datetime.now(UTC) + timedelta(days=1, minutes=1)))


def test_the_cli_tunes_a_tenant_on_a_data_set(smollm2_dir: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / smollm2_dir.name).symlink_to(smollm2_dir)
    (home / "data").symlink_to(smollm2_dir.parents[1] / "data")  # the shipped data sets, fetched already
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    env.update(SWITCHBOARD_HOME=str(home), SWITCHBOARD_PROFILE="tiny", SWITCHBOARD_CONFIG=str(tmp_path / "none.toml"))
    switchboard = str(Path(sys.executable).parent / "switchboard")

    def sb(*args: str | Path) -> subprocess.CompletedProcess:
        return subprocess.run([switchboard, *map(str, args)], capture_output=True, text=True, env=env, timeout=600)

    assert sb("tenant", "create", "acme").returncode == 0
    missing = sb("policy", "tune", "nobody", "--dataset", "gsm8k")
    assert missing.returncode == 1 and "no tenant named 'nobody'" in missing.stderr
    plot = tmp_path / "t.png"
    done = sb("policy", "tune", "acme", "--dataset", "gsm8k", "--sample", "3", "--max-tokens", "24", "--plot", plot)
    assert done.returncode == 0, done.stderr
    assert "run 1/5: current" in done.stderr and "Proposal:" in done.stdout  # the default policy: no loop stop
    assert plot.read_bytes().startswith(b"\x89PNG")
    listed = sb("policy", "proposals", "acme")
    assert listed.returncode == 0 and listed.stdout.split()[0] == "1"
