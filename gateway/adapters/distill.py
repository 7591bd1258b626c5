"""`switchboard distill`: a tenant's own adapter for the small tier, distilled from the large tier's answers to the
tenant's stored prompts, deployed only if it agrees with the large tier more often than the bare small tier does.

1. **Prompts**: the tenant's routed conversations (`routed_prompts`), which exist only where its policy says
   `router.store_prompts` (refused otherwise); newest first, at most `limit`, plain text turns only (a tool
   loop's turns are left out). Never another tenant's rows: the query is the tenant's.
2. **Teacher**: the large tier answers each one, greedy, on our engine, as the gateway serves it (the gateway
   keeps no answer text, so the answers are the large tier's now), with its top-k next-token distribution at
   each answer token (`top_k`, 8: logit distillation; the engine computes them while choosing). An answer the
   gateway's own checks reject is left out and counted: a code prompt whose own examples the answer fails
   (`grading.examples`, in the jail). The answers are kept in the work folder as they come, so a stopped run
   does not ask again (an answer asked of another teacher, or with another limit, is asked again).
3. **Split** by a hash of each conversation: `heldout_share` of them decide when training stops and whether the
   adapter is deployed, and are never trained on.
4. **Train** (`engines.lora.train`) on the small tier's float checkpoint, resumable in the work folder
   (`$SWITCHBOARD_HOME/distill/t<tenant>/<name>/`); a checkpoint there of other examples or settings (an
   earlier run's) is replaced: training starts afresh.
5. **Gate**: the small tier as served (its weights format), with and without the adapter, answers the held-out
   prompts greedily; an answer agrees with the teacher's when their final numbers match, or, for a code prompt
   with examples, when it passes them too, or else when the texts match. Deployed only if the adapter agrees on
   more held-out prompts than the base does.
6. **Deploy**: registered as the tenant's adapter (source `distilled`, the numbers in its details) and made the
   small tier's default in the tenant's policy, the routing it learned on the bare tier forgotten in the same new
   version (`gateway.adapters.policy`): learning starts again on verdicts of the adapted tier; `deploy=False`
   stops after the gate.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core.db.database import Database
from core.settings import Settings
from engines.engine import Engine
from engines.lora.adapter import LoraAdapter, load_adapter
from engines.lora.train import Example, TrainConfig, train_adapter
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from engines.tokenizer import Tokenizer
from gateway.adapters.policy import serve_by_default
from gateway.adapters.store import AdapterStore
from gateway.runtime.tiers import load_tier_engine
from grading.answers import extract_answer
from grading.examples import passes_prompt_examples
from policies.store import PolicyStore
from router_model.routed_prompts import RoutedPromptStore

__all__ = ["DistillError", "DistillReport", "agrees", "distill"]

TEXT_ROLES = {"system", "user", "assistant"}


class DistillError(ValueError):
    """The tenant cannot be distilled for (its policy stores no prompts, too few of them, tiers that differ)."""


@dataclass
class DistillReport:
    tenant: str
    name: str
    # prompts (stored conversations read), skipped (tool loops), rejected (the teacher's answer failed the
    # gateway's own check), examples (trained on), heldout
    data: dict[str, int] = field(default_factory=dict)
    # train_seconds, seconds_per_1000_examples (this run's pace), epochs, heldout_loss, base_heldout_loss
    training: dict[str, Any] = field(default_factory=dict)
    base_agreement: float = 0.0  # of the held-out prompts, the share the bare small tier agrees with large on
    adapter_agreement: float = 0.0
    deployed: bool = False
    adapter_bytes: int = 0
    why: str = ""  # why it was (not) deployed

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def agrees(conversation: Sequence[dict], student: str, teacher: str) -> bool:
    """Whether the small tier's answer says what the large tier's does (the deploy gate's measure)."""
    prompt = _question(conversation)
    theirs, ours = extract_answer(teacher), extract_answer(student)
    if theirs is not None:
        return ours == theirs
    passed = passes_prompt_examples(prompt, student)
    if passed is not None:
        return passed
    return " ".join(student.split()).lower() == " ".join(teacher.split()).lower()


def _question(conversation: Sequence[dict]) -> str:
    """What the user asked: its turns' text (what a prompt's own examples are read from)."""
    return "\n".join(str(m.get("content", "")) for m in conversation if m.get("role") == "user")


def _plain(conversation: Sequence[dict]) -> bool:
    return bool(conversation) and all(m.get("role") in TEXT_ROLES and isinstance(m.get("content"), str)
                                      for m in conversation)  # fmt: skip


def _key(conversation: Sequence[dict]) -> str:
    return hashlib.sha256(json.dumps(list(conversation), sort_keys=True).encode()).hexdigest()


Top = tuple[tuple[int, ...], tuple[float, ...]]  # one position's top-k ids and log-probabilities


def _greedy(
    engine: Engine, prompts: list[list[int]], max_tokens: int, adapter: str | None = None, top_k: int = 0
) -> list[tuple[list[int], list[Top]]]:
    """Each prompt's greedy answer (token ids, the end-of-turn token included) and, with `top_k`, each position's
    top-k next tokens as the engine computed them while choosing; batched on the engine."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=top_k or None)
    ids: dict[str, list[int]] = {}
    tops: dict[str, list[Top]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"distill-{adapter}-{i}", prompt, params, adapter=adapter,
                                         cache_salt="distill"))  # fmt: skip
    while engine.has_unfinished():
        for o in engine.step():
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
            for lp in o.logprobs:
                tops.setdefault(o.request_id, []).append((tuple(t for t, _ in lp.top), tuple(v for _, v in lp.top)))
    keys = [f"distill-{adapter}-{i}" for i in range(len(prompts))]
    return [(ids.get(k, []), tops.get(k, [])) for k in keys]


def distill(
    settings: Settings,
    db: Database,
    tenant_id: int,
    tenant: str,
    *,
    name: str = "distilled",
    small: str = "small",
    large: str = "large",
    limit: int = 2000,
    heldout_share: float = 0.2,
    max_tokens: int = 512,
    top_k: int = 8,
    config: TrainConfig | None = None,
    deploy: bool = True,
    load: Callable[[Settings, str], Engine] | None = None,
    say: Callable[[str], None] = print,
) -> DistillReport:
    """Steps 1-6 of the module's docstring for one tenant. `top_k`: the teacher's next-token distributions kept
    per answer token for logit distillation (0: its answers only). `load`: how a tier's engine is loaded (default
    `gateway.runtime.tiers.load_tier_engine`)."""
    load = load or load_tier_engine
    config = config or TrainConfig()
    report = DistillReport(tenant, name)
    _check(settings, PolicyStore(db), tenant_id, tenant, small, large)
    work = settings.home_dir / "distill" / f"t{tenant_id}" / name
    work.mkdir(parents=True, exist_ok=True)
    train, heldout = _examples(settings, db, tenant_id, large, limit, heldout_share, (max_tokens, top_k), work,
                               report, load, say)  # fmt: skip
    say(f"distilling {small} for {tenant}: {len(train)} examples, {len(heldout)} held out, "
        f"{report.data['rejected']} rejected answers, {report.data['skipped']} tool-loop prompts left out")  # fmt: skip
    started = time.monotonic()
    result = train_adapter(settings.float_dir(settings.tiers[small]), [Example(p, a, top) for _, p, a, _, top in train],
                           [Example(p, a) for _, p, a, _, _ in heldout], work / "train", config, say=say,
                           replace_other=True)  # fmt: skip
    seconds = time.monotonic() - started
    pace = seconds / max(1, (result.steps - result.resumed_from) * config.accumulate) * 1000
    report.training = {"train_seconds": round(seconds, 1), "seconds_per_1000_examples": round(pace, 1),
                       "epochs": result.epochs, "heldout_loss": result.heldout_loss,
                       "base_heldout_loss": result.base_heldout_loss}  # fmt: skip
    student = load(settings, small)
    adapter = load_adapter(result.adapter, student.model)
    _gate(student, adapter, heldout, max_tokens, report)
    report.adapter_bytes = sum(f.stat().st_size for f in result.adapter.iterdir() if f.is_file())
    if report.adapter_agreement <= report.base_agreement:
        report.why = (f"the adapter agrees with {large} on {report.adapter_agreement:.3f} of the held-out prompts, "
                      f"the base on {report.base_agreement:.3f}: not deployed")  # fmt: skip
        return report
    report.why = f"agreement {report.base_agreement:.3f} → {report.adapter_agreement:.3f} on {len(heldout)} held out"
    if deploy:
        AdapterStore(db, settings.home_dir).register(
            tenant_id, small, name, result.adapter, lambda d: load_adapter(d, student.model), actor="distill",
            origin="distilled", details=report.as_dict(), replace=True,
        )  # fmt: skip
        note = f"distilled adapter {small}:{name} deployed ({report.why}); routing learning restarts"
        serve_by_default(PolicyStore(db), tenant_id, small, name, "distill", note)
        report.deployed = True
    return report


Kept = tuple[list[dict], list[int], list[int], str, tuple[Top, ...]]  # conversation, prompt, answer ids, text, top-k


def _check(settings: Settings, policies: PolicyStore, tenant_id: int, tenant: str, small: str, large: str) -> None:
    if not policies.current(tenant_id).policy.router.store_prompts:
        raise DistillError(f"tenant {tenant!r} keeps no prompts: set its policy's router.store_prompts first")
    for tier in (small, large):
        if tier not in settings.tiers or settings.tiers[tier].is_remote:
            raise DistillError(f"tier {tier!r} is not a local tier here")
    vocabularies = [Tokenizer(settings.model_dir(settings.tiers[t])).hf.get_vocab() for t in (small, large)]
    if vocabularies[0] != vocabularies[1]:
        raise DistillError(f"tiers {small!r} and {large!r} tokenize differently: the answers cannot be trained on")


def _examples(
    settings: Settings,
    db: Database,
    tenant_id: int,
    large: str,
    limit: int,
    heldout_share: float,
    limits: tuple[int, int],
    work: Path,
    report: DistillReport,
    load: Callable[[Settings, str], Engine],
    say: Callable[[str], None],
) -> tuple[list[Kept], list[Kept]]:
    """Steps 1-3: the tenant's prompts, the teacher's answers to them (those that pass the checks), split."""
    conversations = RoutedPromptStore(db).recent(tenant_id, limit)
    plain = [c for c in conversations if _plain(c)]
    report.data = {"prompts": len(conversations), "skipped": len(conversations) - len(plain), "rejected": 0}
    if len(plain) < 10:
        raise DistillError(f"{len(plain)} stored text prompts; at least 10 are needed")
    teacher = load(settings, large)
    tier = settings.tiers[large]
    asked = {"teacher": f"{settings.model_dir(tier).name}/{tier.dtype}", "max_tokens": limits[0], "top_k": limits[1]}
    answers = _teacher_answers(teacher, plain, work / "teacher.jsonl", asked, say)
    kept: list[Kept] = []
    for conversation in plain:
        ids, text, top = answers[_key(conversation)]
        if passes_prompt_examples(_question(conversation), text) is False:
            report.data["rejected"] += 1
            continue
        kept.append((conversation, teacher.tokenizer.encode_chat(conversation), ids, text, top))
    heldout = [k for k in kept if int(_key(k[0])[:8], 16) / 0xFFFFFFFF < heldout_share]
    train = [k for k in kept if int(_key(k[0])[:8], 16) / 0xFFFFFFFF >= heldout_share]
    report.data |= {"examples": len(train), "heldout": len(heldout)}
    if not train or not heldout:
        raise DistillError(f"{len(train)} training and {len(heldout)} held-out examples: too few to decide")
    return train, heldout


def _gate(student: Engine, adapter: LoraAdapter, heldout: list[Kept], max_tokens: int, report: DistillReport) -> None:
    """Step 5: the held-out prompts' agreement with the teacher, with the adapter and without."""
    student.load_adapter("distill-candidate", adapter)
    prompts = [p for _, p, _, _, _ in heldout]
    decode = student.tokenizer.decode

    def agreement(answers: list[list[int]]) -> float:
        hits = sum(agrees(c, decode(a), t) for (c, _, _, t, _), (a, _) in zip(heldout, answers, strict=True))
        return round(hits / len(heldout), 4)

    report.base_agreement = agreement(_greedy(student, prompts, max_tokens))
    report.adapter_agreement = agreement(_greedy(student, prompts, max_tokens, "distill-candidate"))


def _teacher_answers(
    engine: Engine, conversations: list[list[dict]], path: Path, asked: dict[str, Any], say: Callable[[str], None]
) -> dict[str, tuple[list[int], str, tuple[Top, ...]]]:
    """conversation key → (answer ids, text, top-k per position), asked in batches of 16 and appended to `path` as
    they come. `asked`: the teacher (its checkpoint and dtype), max tokens and top-k; an answer kept from a run
    that asked otherwise (another teacher, a shorter limit) is asked again."""
    done: dict[str, tuple[list[int], str, tuple[Top, ...]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("asked") == asked:
                done[row["key"]] = (row["ids"], row["text"], tuple((tuple(i), tuple(v)) for i, v in row["top"]))
    todo = [c for c in conversations if _key(c) not in done]
    if len(todo) < len(conversations):
        say(f"  {len(conversations) - len(todo)} teacher answers kept from before, {len(todo)} to ask")
    started = time.monotonic()
    with path.open("a") as out:
        for i in range(0, len(todo), 16):
            batch = todo[i : i + 16]
            prompts = [engine.tokenizer.encode_chat(c) for c in batch]
            answers = _greedy(engine, prompts, asked["max_tokens"], top_k=asked["top_k"])
            for conversation, (answer, top) in zip(batch, answers, strict=True):
                text = engine.tokenizer.decode(answer)
                done[_key(conversation)] = (answer, text, tuple(top))
                row = {"key": _key(conversation), "asked": asked, "ids": answer, "text": text, "top": top}
                out.write(json.dumps(row) + "\n")
            out.flush()
            say(f"  teacher: {min(i + 16, len(todo))}/{len(todo)} answers, {time.monotonic() - started:.0f} s")
    return done
