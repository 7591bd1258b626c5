"""Policy tuning: find the sampling policy that spends the fewest tokens without losing quality.

A sample of prompts (a tenant's stored ones, or a shipped data set) is answered under candidate
policies. Settings that change how a model writes (a concise-answer instruction, temperature and top-p
defaults, a frequency penalty, the loop-stopping verifier) each take a generation run; settings that
only end an answer sooner (a max-tokens cap, stop strings: given, or mined from how the current policy's
answers end) are applied to those runs' tokens: with the same seeds an answer under a cap is the
uncapped answer's first tokens (an answer is seeded per prompt, so runs are paired). Every answer is
graded: a number check for GSM8K, unit tests for HumanEval, the judge tier for open chat
(`policies.tune_quality`). Each candidate gets its tokens and cost per answer
and its quality against the current policy's, paired per prompt, with a bootstrap 95% interval.

The proposal is the cheapest candidate whose quality on the sample is within `tolerance` of the
current policy's and not significantly worse (the interval's upper end is at least 0); the current
policy itself always qualifies, so "keep it" is a possible answer.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

import anyio
import numpy as np

from engines.protocol import RequestRejected, TierEngine
from engines.request import EngineRequest, FinishReason, GenerationHook
from engines.sampling import SamplingParams
from policies.policy import Policy
from policies.pricing import Tokens, charge
from policies.sampling import Asked, instructed, resolve

CONCISE = (
    "Be concise: answer directly, with only the reasoning the answer needs. "
    "Do not restate the question, repeat yourself or add a summary."
)
TRUNCATING = ("sampling.max_tokens_cap", "sampling.default_stop")  # fields evaluated on a run's tokens
CAP_QUANTILES = (0.75, 0.9, 0.97)  # caps tried: these quantiles of a run's answer lengths
BOOTSTRAP = 2000
# The in-flight verifier hook a policy puts on one tuning request (None: no verifier): built above policies.
HookFactory = Callable[[Policy, "TunePrompt", str], GenerationHook | None]


class TuningError(ValueError):
    pass


@dataclass(frozen=True)
class TunePrompt:
    id: str
    messages: list[dict[str, str]]
    tier: str
    grader: str  # gsm8k | humaneval | judge
    grading: Mapping[str, str] = field(default_factory=dict)

    @property
    def question(self) -> str:
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")


@dataclass(frozen=True)
class Candidate:
    name: str
    changes: Mapping[str, Any]  # dotted policy field → value, over the current policy

    def apply(self, base: Policy) -> Policy:
        body = base.model_dump(mode="json")
        for path, value in self.changes.items():
            *parents, leaf = path.split(".")
            node = body
            for p in parents:
                node = node[p]
            node[leaf] = value
        return Policy.model_validate(body)

    @property
    def generation(self) -> tuple[tuple[str, Any], ...]:
        """The changes that need their own generation run (the rest only cut its answers)."""
        return tuple(sorted((k, _frozen(v)) for k, v in self.changes.items() if k not in TRUNCATING))


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def generation_variants(base: Policy) -> list[Candidate]:
    """How the model may be asked to write: the current policy and, where they change it, a concise
    instruction, cooler sampling, a frequency penalty and the loop-stopping verifier, in combinations."""
    s = base.sampling
    concise = {"sampling.system_instruction": CONCISE} if s.system_instruction != CONCISE else {}
    cooler: dict[str, Any] = {}
    if (s.temperature_default if s.temperature_default is not None else 1.0) > 0.3:
        cooler["sampling.temperature_default"] = 0.3
    if (s.top_p_default if s.top_p_default is not None else 1.0) > 0.9:
        cooler["sampling.top_p_default"] = 0.9
    penalty = {"sampling.frequency_penalty_default": 0.2} if s.frequency_penalty_default is None else {}
    enabled = list(base.verifiers.enabled)
    # A looped answer that a cascade retries on a larger tier costs more, not less: tuning does not model it.
    loops = {}
    if "degeneration" not in enabled and not base.verifiers.cascade:
        loops = {"verifiers.enabled": [*enabled, "degeneration"]}
    variants = [
        Candidate("current", {}),
        Candidate("concise", concise),
        Candidate("cooler", cooler),
        Candidate("concise+cooler", {**concise, **cooler}),
        Candidate("concise+cooler+penalty", {**concise, **cooler, **penalty}),
        Candidate("concise+cooler+loop stop", {**concise, **cooler, **loops} if loops else {}),
    ]
    seen: set[tuple] = set()
    out = []
    for v in variants:  # a change the current policy already has makes a variant repeat another
        if v.generation not in seen and (v.name == "current" or v.changes):
            seen.add(v.generation)
            out.append(v)
    return out


@dataclass
class Answer:
    prompt: TunePrompt
    token_ids: list[int]
    text: str
    prompt_tokens: int
    finish_reason: str


@dataclass
class Scored:
    """One candidate on the sample: per prompt, its completion tokens, cost and quality."""

    candidate: Candidate
    policy: Policy
    tokens: np.ndarray
    costs: list[Decimal]
    quality: np.ndarray

    @property
    def mean_cost(self) -> Decimal:
        return sum(self.costs, Decimal(0)) / max(len(self.costs), 1)


@dataclass(frozen=True)
class Row:
    name: str
    changes: Mapping[str, Any]
    tokens: float
    cost: Decimal  # per answer
    quality: float
    delta: float  # quality minus the current policy's, paired per prompt
    ci_low: float
    ci_high: float
    eligible: bool

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "changes": dict(self.changes), "cost": str(self.cost)}


@dataclass(frozen=True)
class Tuning:
    rows: list[Row]
    chosen: str
    prompts: int
    tolerance: float
    policy: Policy  # the chosen candidate's whole policy
    skipped: int = 0  # prompts of the sample left out: too long for their tier

    @property
    def baseline(self) -> Row:
        return next(r for r in self.rows if r.name == "current")

    @property
    def proposal(self) -> Row:
        return next(r for r in self.rows if r.name == self.chosen)

    @property
    def token_reduction(self) -> float:
        return 1.0 - self.proposal.tokens / self.baseline.tokens if self.baseline.tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen,
            "prompts": self.prompts,
            "tolerance": self.tolerance,
            "skipped": self.skipped,
            "token_reduction": round(self.token_reduction, 4),
            "quality_delta": round(self.proposal.delta, 4),
            "quality_ci": [round(self.proposal.ci_low, 4), round(self.proposal.ci_high, 4)],
            "rows": [r.as_dict() for r in self.rows],
        }


def seed_for(prompt_id: str) -> int:
    """The same seed for a prompt under every candidate: runs are paired, and a cap cuts the same answer."""
    return int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:7], "big")


def request_for(
    prompt: TunePrompt, policy: Policy, engine: TierEngine, max_tokens: int, request_id: str, hooks: HookFactory
) -> EngineRequest:
    """The request the gateway would run for `prompt` under `policy` (a client that set no sampling);
    `hooks` builds the policy's in-flight verifiers (`verifiers.policy.tuning_hook`), which sit above policies."""
    ids = engine.tokenizer.encode_chat(instructed(prompt.messages, policy.sampling.system_instruction))
    room = max(1, engine.max_model_len - len(ids))
    s = resolve(policy.sampling, Asked(max_tokens=min(max_tokens, room)))
    params = SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=seed_for(prompt.id),
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        stop=s.stop,
    )
    hook = hooks(policy, prompt, request_id)
    return EngineRequest(request_id, ids, params, priority=10, hook=hook)  # behind live traffic


async def generate(engine: TierEngine, batch: Mapping[str, tuple[TunePrompt, EngineRequest]]) -> list[Answer]:
    """Run one tier's requests (request id → its prompt and request); every answer, in no set order."""
    ids: dict[str, list[int]] = {rid: [] for rid in batch}
    texts: dict[str, list[str]] = {rid: [] for rid in batch}
    answers = []
    async with engine.open([req for _, req in batch.values()]) as stream:
        async for out in stream:
            ids[out.request_id].extend(out.new_token_ids)
            texts[out.request_id].append(out.text)
            if out.finish_reason is FinishReason.ERROR:
                raise TuningError(f"the engine failed on a tuning request: {out.error}")
            if out.finish_reason is not None:
                prompt = batch[out.request_id][0]
                text = "".join(texts[out.request_id])
                answers.append(Answer(prompt, ids[out.request_id], text, out.prompt_tokens, out.finish_reason.value))
    if len(answers) != len(batch):
        raise TuningError(f"{len(batch) - len(answers)} tuning requests never finished")
    return answers


async def answer_all(
    policy: Policy,
    prompts: Sequence[TunePrompt],
    engines: Mapping[str, TierEngine],
    max_tokens: int,
    tag: str,
    hooks: HookFactory,
) -> list[Answer]:
    """Every prompt's answer under `policy` on its tier, in the prompts' order."""
    answers: list[Answer] = []
    for tier in sorted({p.tier for p in prompts}):
        engine = engines[tier]

        def build(engine: TierEngine = engine, tier: str = tier) -> dict[str, tuple[TunePrompt, EngineRequest]]:
            batch = {}
            for i, p in enumerate(prompts):
                if p.tier == tier:
                    rid = f"{tag}-{i}"
                    batch[rid] = (p, request_for(p, policy, engine, max_tokens, rid, hooks))
            return batch

        answers.extend(await generate(engine, await anyio.to_thread.run_sync(build)))  # tokenizing: off the loop
    order = {id(p): i for i, p in enumerate(prompts)}
    return sorted(answers, key=lambda a: order[id(a.prompt)])


def truncate(answer: Answer, cap: int | None, stops: Sequence[str], decode: Callable[[list[int]], str]) -> Answer:
    """The answer the engine gives under a cap and stop strings, from the uncapped run's tokens: it
    ends after `cap` tokens or at the token completing a stop string (whose text is left out)."""
    ids = answer.token_ids
    end, reason = len(ids), answer.finish_reason
    if cap is not None and cap < end:
        end, reason = cap, "length"
    text = decode(ids[:end]) if end < len(ids) else answer.text
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    if hits:
        cut = min(hits)
        stop_len = next(len(s) for s in stops if text.find(s) == cut)
        lo, hi = 1, end  # the fewest tokens whose text holds the whole stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if len(decode(ids[:mid])) >= cut + stop_len:
                hi = mid
            else:
                lo = mid + 1
        end, text, reason = lo, text[:cut], "stop"
    return Answer(answer.prompt, ids[:end], text, answer.prompt_tokens, reason)


Grade = Callable[[Sequence[tuple[TunePrompt, str]]], Awaitable[list[float]]]


async def tune(
    base: Policy,
    prompts: Sequence[TunePrompt],
    engines: Mapping[str, TierEngine],
    grade: Grade,
    *,
    hooks: HookFactory,
    max_tokens: int = 512,
    tolerance: float = 0.02,
    stops: Sequence[Sequence[str]] = (),
    mine_stops: bool = True,
    variants: Sequence[Candidate] | None = None,
    progress: Callable[[str], None] = lambda _: None,
    seed: int = 0,
) -> Tuning:
    """Answer `prompts` under every candidate, grade them, and pick the proposal (see the module's doc)."""
    if not prompts:
        raise TuningError("no prompts to tune on")
    if missing := sorted({p.tier for p in prompts} - set(engines)):
        raise TuningError(f"the sample needs tiers this gateway does not serve: {', '.join(missing)}")
    if len({p.id for p in prompts}) != len(prompts):
        raise TuningError("prompt ids must be unique")
    variants = list(variants) if variants is not None else generation_variants(base)
    kept = await anyio.to_thread.run_sync(_fitting, prompts, [v.apply(base) for v in variants], engines)
    if not kept:
        raise TuningError("no prompt of the sample fits its tier's context under every candidate")
    skipped, prompts = len(prompts) - len(kept), kept
    if skipped:
        progress(f"{skipped} prompts left out: too long for their tier under some candidate")
    scored: list[Scored] = []
    run = uuid.uuid4().hex[:8]  # request ids unique on a live engine, whatever else runs there
    memo: dict[tuple[str, str], float] = {}  # (prompt, answer text) → quality: candidates often share answers
    tried = [tuple(stop) for stop in stops if stop]
    for vi, variant in enumerate(variants):
        policy = variant.apply(base)
        progress(f"run {vi + 1}/{len(variants)}: {variant.name}")
        answers = await answer_all(policy, prompts, engines, max_tokens, f"tune-{run}-{vi}", hooks)
        if vi == 0 and mine_stops:  # how the current policy's answers tend to end
            tried += [m for m in mined_stops(answers) if m not in tried]
        # Each cut alone (caps, then stop strings), not every combination: each one's answers are graded.
        cuts = [(cap, ()) for cap in _caps([len(a.token_ids) for a in answers], policy.sampling.max_tokens_cap)]
        cuts += [(None, stop) for stop in tried if not policy.sampling.default_stop]
        for cap, stop in cuts:
            changes, name = dict(variant.changes), variant.name
            if cap is not None:
                changes["sampling.max_tokens_cap"], name = cap, f"{name}, cap {cap}"
            if stop:
                changes["sampling.default_stop"], name = list(stop), f"{name}, stop {list(stop)!r}"
            cut = answers
            if cap or stop:  # decoding: off the loop
                cut = await anyio.to_thread.run_sync(_cut_all, answers, cap, stop, engines)
            scored.append(await _score(Candidate(name, changes), base, cut, grade, memo))
    return replace(choose(scored, tolerance, seed=seed), skipped=skipped)


def _cut_all(
    answers: list[Answer], cap: int | None, stop: tuple[str, ...], engines: Mapping[str, TierEngine]
) -> list[Answer]:
    return [truncate(a, cap, stop, engines[a.prompt.tier].tokenizer.decode) for a in answers]


def _fitting(
    prompts: Sequence[TunePrompt], policies: Sequence[Policy], engines: Mapping[str, TierEngine]
) -> list[TunePrompt]:
    """The prompts every candidate can run (with its instruction, and at least one new token): one the
    engine would refuse must not end the whole tuning."""
    instructions = {p.sampling.system_instruction for p in policies}
    kept = []
    for p in prompts:
        engine = engines[p.tier]
        try:
            for instruction in instructions:
                engine.check(engine.tokenizer.encode_chat(instructed(p.messages, instruction)), 1)
        except RequestRejected:
            continue
        kept.append(p)
    return kept


def mined_stops(answers: Sequence[Answer], min_share: float = 0.2, most: int = 2) -> list[tuple[str, ...]]:
    """Stop strings worth trying: the openings (first two words) of last paragraphs that at least
    `min_share` of the answers end with ("In summary,", "I hope", "Let me know"), as "\n\n" + opening.
    A sign-off repeated across answers is often text nobody needed; the grading says whether it was."""
    openings: Counter[str] = Counter()
    for a in answers:
        paragraphs = [p for p in a.text.split("\n\n") if p.strip()]
        if len(paragraphs) >= 2 and (words := paragraphs[-1].split()[:2]):
            openings[" ".join(words)] += 1
    floor = max(2, min_share * len(answers))
    return [("\n\n" + opening,) for opening, n in openings.most_common(most) if n >= floor]


def _caps(lengths: list[int], current: int | None) -> list[int | None]:
    """No new cap, and caps at quantiles of the run's answer lengths (rounded up to 16, at least 16) that
    would cut something and are below the current cap."""
    caps: list[int | None] = [None]
    for q in CAP_QUANTILES:
        cap = max(16, int(-(-np.quantile(lengths, q) // 16) * 16))
        if cap < max(lengths) and (current is None or cap < current) and cap not in caps:
            caps.append(cap)
    return caps


async def _score(
    candidate: Candidate, base: Policy, answers: list[Answer], grade: Grade, memo: dict[tuple[str, str], float]
) -> Scored:
    policy = candidate.apply(base)
    todo = [(a.prompt, a.text) for a in answers if (a.prompt.id, a.text) not in memo]
    for (p, text), q in zip(todo, await grade(todo) if todo else [], strict=True):
        memo[(p.id, text)] = q
    costs = [
        charge(policy, a.prompt.tier, Tokens(prompt=a.prompt_tokens, completion=len(a.token_ids))).cost for a in answers
    ]
    return Scored(
        candidate=candidate,
        policy=policy,
        tokens=np.array([len(a.token_ids) for a in answers], dtype=float),
        costs=costs,
        quality=np.array([memo[(a.prompt.id, a.text)] for a in answers], dtype=float),
    )


def paired_interval(delta: np.ndarray, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """A bootstrap interval for the mean of per-prompt differences."""
    rng = np.random.default_rng(seed)
    means = delta[rng.integers(0, len(delta), size=(BOOTSTRAP, len(delta)))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    return float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))


def choose(scored: Sequence[Scored], tolerance: float, seed: int = 0) -> Tuning:
    base = next((s for s in scored if s.candidate.name == "current"), None)
    if base is None:
        raise TuningError("the current policy must be among the candidates")
    rows = []
    for s in scored:
        delta = s.quality - base.quality
        low, high = paired_interval(delta, seed) if s is not base else (0.0, 0.0)
        mean = float(delta.mean())
        rows.append(
            Row(
                name=s.candidate.name,
                changes=s.candidate.changes,
                tokens=float(s.tokens.mean()),
                cost=s.mean_cost,
                quality=float(s.quality.mean()),
                delta=mean,
                ci_low=low,
                ci_high=high,
                eligible=mean >= -tolerance and high >= 0.0,
            )
        )
    # Cheapest eligible; on a tie the fewer changes (and the current policy first).
    best = min((r for r in rows if r.eligible), key=lambda r: (r.cost, len(r.changes)))
    chosen = next(s for s in scored if s.candidate.name == best.name)
    return Tuning(rows=rows, chosen=best.name, prompts=len(base.tokens), tolerance=tolerance, policy=chosen.policy)
