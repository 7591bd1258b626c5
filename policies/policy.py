"""A tenant's policy: which tiers it may use, how it is routed, how sampling is capped, what it may
spend and what each tier costs it. Validated by pydantic; stored as JSON, one row per version.

Unknown fields are errors (a typo must not silently mean "no limit"); every error carries its field
path, which the admin API and the console show.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PER_MILLION = Decimal(1_000_000)
# Prices per million tokens with at most 4 decimal places keep every per-token cost exact at 10 places.
Price = Annotated[Decimal, Field(ge=0, le=1_000_000, decimal_places=4)]
Money = Annotated[Decimal, Field(ge=0, le=10**12, decimal_places=10)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TierPrice(_Strict):
    """USD per million tokens. Cached prompt tokens hit the KV prefix cache; draft-accepted completion
    tokens were drafted by the small tier and only verified by this one."""

    prompt: Price
    cached_prompt: Price | None = None  # default: the prompt price
    completion: Price
    draft_accepted: Price | None = None  # default: the completion price

    @property
    def cached(self) -> Decimal:
        return self.prompt if self.cached_prompt is None else self.cached_prompt

    @property
    def drafted(self) -> Decimal:
        return self.completion if self.draft_accepted is None else self.draft_accepted


class RouterCalibration(_Strict):
    """A threshold computed on this tenant's own routed prompts (`switchboard router calibrate --tenant`)."""

    threshold: float = Field(ge=0.0, le=1.0)
    large_share: float = Field(ge=0.0, le=1.0, description="the share of the calibration prompts it sent large")
    prompts: int = Field(ge=1, description="how many of the tenant's prompts it was computed on")
    router: str = Field(min_length=1, max_length=128, description="the router it is for (its model's sha256)")


class FloorRecalibration(_Strict):
    """What the gateway wrote when a tenant's measured quality fell short of its floor
    (`gateway.routing.quality_floor`): the held-out curve is then aimed `offset` above the floor, and the next
    recalibration waits for fresh shadow verdicts (counted from `judged`)."""

    offset: float = Field(ge=0.0, le=1.0, description="added to quality_ratio when the floor's threshold is computed")
    judged: int = Field(ge=0, description="the tenant's shadow verdicts when it was made; later ones decide the next")
    ratio: float = Field(ge=0.0, le=1.0, description="the estimated quality ratio that triggered it")
    high: float = Field(ge=0.0, le=1.0, description="the upper end of that estimate's 95% interval")


class LearnedRouting(_Strict):
    """What the gateway learned from a tenant's own verdicts (`gateway.routing.learning`): the cells' counts its
    routing reads (`router_model.tenant_layer`), for one router and the tier identities they were judged on,
    and the threshold that keeps the floor on the tenant's mix. A snapshot, saved as a policy version: every
    replica routes alike, and each move is audited and can be rolled back."""

    router: str = Field(description="the id of the router whose regions the cells name")
    threshold: float = Field(ge=0.0, le=1.0, description="a tier serves when its posterior P(good enough) reaches it")
    identities: dict[str, str] = Field(description="tier → model@weights/dtype the verdicts judged")
    cells: dict[str, dict[str, tuple[int, int]]] = Field(description="kind/region → tier → (good enough, judged)")
    verdicts: int = Field(ge=0, description="the verdicts it was learned from")
    shadow_judged: int = Field(0, ge=0, description="the tenant's shadow verdicts then: its estimate restarts there")
    ratio: float = Field(ge=0.0, le=1.0, description="the estimated quality ratio on the tenant's mix")
    low: float = Field(ge=-1.0, le=1.0, description="its 95% lower end")
    large_share: float = Field(ge=0.0, le=1.0, description="the share of the tenant's recent prompts it sends large")
    large_share_before: float = Field(ge=0.0, le=1.0, description="the share the routing before it sent large")
    prompts: int = Field(ge=0, description="the tenant's recent routed prompts it was estimated on")
    made: float = Field(ge=0.0, description="epoch seconds")


class RouterSettings(_Strict):
    """The learned router (`model: "auto"`): a request goes to the large tier when P(small is good enough)
    falls below the threshold. Mode "quality_ratio" (the default): the threshold that holds `auto` to
    `quality_ratio` of always-large's quality on the router's held-out curve with the fewest large calls
    (aimed higher by `recalibration` once the tenant's shadow runs measured it short; the global threshold
    for a router without a curve). Mode "threshold": `threshold` itself. Mode "large_share": the tenant's
    `calibration` (if it was computed for the router being served), else the router's global threshold."""

    mode: Literal["threshold", "large_share", "quality_ratio"] = "quality_ratio"
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    quality_ratio: float = Field(
        0.95, gt=0.0, le=1.0, description="mode quality_ratio: auto's quality as a share of always-large's"
    )
    large_share: float = Field(0.25, ge=0.0, le=1.0, description="the share of large calls calibration aims for")
    calibration: RouterCalibration | None = None
    recalibration: FloorRecalibration | None = None
    route_all: bool = Field(False, description="route every request, whatever tier its `model` names")
    lock_tool_loops: bool = Field(
        True, description="a turn inside a tool loop (or a continued response) goes to its conversation's first tier"
    )
    store_prompts: bool = Field(
        False, description="keep routed conversations (SQL; and in shadow label rows) to calibrate and retrain on"
    )
    shadow_share: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="share of routed tiny- and small-tier answers re-run on the large tier and judged (the estimate)",
    )
    shadow_warmup: int = Field(
        50,
        ge=0,
        le=10_000,
        description="until the tenant has this many verdicts since its last recalibration, answers are drawn at "
        "half or more (gateway.routing.shadow.WARMUP_SHARE) so that its estimate is worth reading early; 0: no warm-up",
    )
    shadow_billed: bool = Field(False, description="shadow and explore runs are priced and count against the budgets")
    explore_share: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="share of routed large-tier answers also run on the cheaper tiers and judged against large's",
    )
    explore_warmup: int = Field(
        50,
        ge=0,
        le=10_000,
        description="until the tenant has this many explore verdicts, large answers are explored at half or more",
    )
    learn: bool = Field(
        True, description="route by the tenant's own verdicts once they clear the floor (mode quality_ratio)"
    )
    learned: LearnedRouting | None = None
    learn_since: float = Field(
        0.0, ge=0.0, description="epoch seconds: verdicts before this are not learned from (a reset)"
    )

    @property
    def floor(self) -> float:
        """The quality ratio the held-out curve is aimed at: the floor, raised by a recalibration."""
        offset = self.recalibration.offset if self.recalibration is not None else 0.0
        return min(1.0, self.quality_ratio + offset)


class SamplingLimits(_Strict):
    """Caps every request obeys, and defaults for what a request leaves unset (`policies.sampling` applies
    both; `switchboard policy tune` proposes them)."""

    max_tokens_cap: int | None = Field(None, ge=1, description="completion tokens per choice, at most")
    temperature_max: float | None = Field(None, ge=0.0, le=2.0)
    top_p_max: float | None = Field(None, gt=0.0, le=1.0)
    default_stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=16)
    temperature_default: float | None = Field(None, ge=0.0, le=2.0, description="when a request sets none (else 1)")
    top_p_default: float | None = Field(None, gt=0.0, le=1.0, description="when a request sets none (else 1)")
    frequency_penalty_default: float | None = Field(None, ge=-2.0, le=2.0, description="when a request sets none")
    presence_penalty_default: float | None = Field(None, ge=-2.0, le=2.0, description="when a request sets none")
    system_instruction: str | None = Field(
        None, min_length=1, max_length=2000, description="added to every chat request's system message"
    )


Mask = Literal["timestamps", "dates", "uuids", "request_ids", "hex", "base64"]


class CacheSettings(_Strict):
    """The response cache: which requests it keys alike (normalization), how long and how many it keeps."""

    enabled: bool = True
    ttl_seconds: int = Field(3600, ge=1)
    max_entries: int = Field(10_000, ge=0, description="per tenant; the least recently stored go first")
    deterministic_only: bool = Field(True, description="cache only temperature 0 or seeded requests")
    fold_whitespace: bool = True
    masks: list[Mask] = Field(
        default_factory=lambda: ["timestamps", "dates", "uuids", "request_ids", "hex", "base64"],
        description="volatile spans replaced by a placeholder before keying",
    )
    # On by default: with its guards (numbers, negation, entities, quoted strings, content words, and a
    # template's filled-in slot judged on its own) none of bench.cache's 167 hits was another question's
    # answer, nor any of the 94 differing shipped pairs; a reworded repeat is then free (docs/caches.md).
    semantic: bool = Field(True, description="also answer a reworded repeat of an earlier question")
    semantic_threshold: float | None = Field(
        None, gt=0.0, le=1.0, description="cosine similarity for a semantic hit; default: the calibrated one"
    )


class DegenerationSettings(_Strict):
    min_repeats: int = Field(4, ge=2, description="periods a loop must repeat to be stopped")
    min_tokens: int = Field(32, ge=4, description="tokens a loop must cover to be stopped")
    max_items: int = Field(60, ge=1, description="list items before a list counts as runaway")


class ConfidenceSettings(_Strict):
    window: int = Field(64, ge=4, description="tokens per group confidence")
    threshold: float | None = Field(None, ge=0.0, description="prune below this group confidence (calibrated)")
    prune_quantile: float = Field(0.25, ge=0.0, le=1.0, description="without a threshold: prune this lowest share")
    min_keep: int = Field(2, ge=1, description="choices never pruned below this many")
    consensus: float = Field(0.95, gt=0.5, le=1.0, description="vote share that stops the rest")
    min_votes: int = Field(3, ge=1)


class VerifierSettings(_Strict):
    enabled: list[Literal["degeneration", "confidence"]] = Field(
        default_factory=list, description="in-flight verifiers, combined with `combine`"
    )
    combine: Literal["any", "all"] = "any"
    every_n_tokens: int = Field(16, ge=1)
    degeneration: DegenerationSettings = Field(default_factory=DegenerationSettings)
    confidence: ConfidenceSettings = Field(default_factory=ConfidenceSettings)
    # On by default: a code answer is run against the examples its own prompt gives (no tokens, ~0.1 s;
    # docs/verifiers.md) and retried on `cascade_to` when one fails.
    checks: list[Literal["math", "code", "structure", "probe", "prompt_examples", "program_of_thought", "resample"]] = (
        Field(
            default_factory=lambda: ["prompt_examples"],
            description="final answer checks: a failed one escalates (see `cascade`)",
        )
    )
    probe_threshold: float | None = Field(
        None, ge=0.0, le=1.0, description="the probe escalates answers below this P(right); default: its own"
    )
    cascade: bool = Field(True, description="retry an answer that failed a check (or looped) on `cascade_to`")
    cascade_to: str = Field("large", min_length=1, max_length=32)


class LoggingSettings(_Strict):
    """What the gateway's log may hold about this tenant's traffic. Off by default: counts and ids only."""

    log_prompts: bool = Field(
        False, description="log each request's prompts and completions (with its request id and tenant id)"
    )


AdapterName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")]  # as gateway.adapters registers them


class DistillSettings(_Strict):
    """`switchboard distill` on a schedule (`gateway.adapters.schedule`; by hand: the command): a run once the
    period has passed since the last one began and the tenant has stored `min_new_prompts` prompts since; it
    deploys only an adapter its held-out gate passes. Needs `router.store_prompts`: it trains on them."""

    schedule: Literal["off", "daily", "weekly"] = "off"
    name: AdapterName = Field("distilled", description="the adapter it trains and deploys (requests: small:NAME)")
    min_new_prompts: int = Field(200, ge=10, le=100_000, description="prompts stored since the last run, at least")
    epochs: int = Field(2, ge=1, le=10)


class TuningSettings(_Strict):
    """Policy tuning on a schedule (`switchboard policy tune` by hand): each run stores a proposal for an
    admin to apply or reject; it applies itself only if the tenant opted in with `auto_apply`."""

    schedule: Literal["off", "daily", "weekly"] = "off"
    dataset: Literal["gsm8k", "humaneval", "mtbench", "chat"] | None = Field(
        None, description="the prompts replayed: a shipped data set, or None for the tenant's stored prompts"
    )
    sample: int = Field(50, ge=5, le=2000, description="prompts per run")
    tolerance: float = Field(0.02, ge=0.0, le=0.5, description="quality (0-1) a proposal may lose on the sample")
    auto_apply: bool = Field(False, description="apply a scheduled run's proposal without an admin's approval")


class RateLimits(_Strict):
    """Per minute; None means no limit."""

    key_rpm: int | None = Field(None, ge=1)
    key_tpm: int | None = Field(None, ge=1)
    tenant_rpm: int | None = Field(None, ge=1)
    tenant_tpm: int | None = Field(None, ge=1)


class Budget(_Strict):
    period: Literal["daily", "monthly"]
    money: Money | None = Field(None, description="USD in the period")
    tokens: int | None = Field(None, ge=0, description="prompt + completion tokens in the period")
    hard: bool = True  # hard: refuse requests that could exceed it; soft: only report

    @model_validator(mode="after")
    def _something(self) -> Budget:
        if self.money is None and self.tokens is None:
            raise ValueError("a budget needs `money`, `tokens` or both")
        return self


# USD per million tokens, roughly in proportion to the parameters each tier reads per token
# (135M, 494M, 1.5B): what a hosted model of that size costs.
DEFAULT_PRICES = {
    # `/v1/embeddings` on the in-process MiniLM (gateway.pipeline.embeddings): prompt tokens only
    "minilm": TierPrice(prompt=Decimal("0.01"), cached_prompt=Decimal("0.01"), completion=Decimal("0")),
    "tiny": TierPrice(prompt=Decimal("0.03"), cached_prompt=Decimal("0.003"), completion=Decimal("0.10")),
    "small": TierPrice(prompt=Decimal("0.10"), cached_prompt=Decimal("0.01"), completion=Decimal("0.40")),
    "large": TierPrice(
        prompt=Decimal("0.50"),
        cached_prompt=Decimal("0.05"),
        completion=Decimal("2.00"),
        draft_accepted=Decimal("1.00"),
    ),
}


ModelName = Annotated[str, Field(min_length=1, max_length=100)]
Problem = tuple[tuple[str | int, ...], str]  # a field's path and what is wrong with it


class Policy(_Strict):
    allowed_tiers: list[str] | None = Field(None, description="None: every tier the gateway serves")
    router: RouterSettings = Field(default_factory=RouterSettings)
    sampling: SamplingLimits = Field(default_factory=SamplingLimits)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    verifiers: VerifierSettings = Field(default_factory=VerifierSettings)
    rate_limits: RateLimits = Field(default_factory=RateLimits)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    tuning: TuningSettings = Field(default_factory=TuningSettings)
    distill: DistillSettings = Field(default_factory=DistillSettings)
    budgets: list[Budget] = Field(default_factory=list, max_length=8)
    prices: dict[str, TierPrice] = Field(default_factory=lambda: dict(DEFAULT_PRICES))
    counterfactual_tier: str = Field("large", description="what every request is compared against")
    aliases: dict[ModelName, ModelName] = Field(
        default_factory=dict,
        max_length=64,
        description="a model name apps send (`gpt-4o-mini`, a Claude id) → the tier, `auto` or embedding model that "
        "serves it; over the operator's `model_aliases`",
    )
    adapters: dict[str, AdapterName] = Field(
        default_factory=dict,
        max_length=16,
        description="tier → this tenant's LoRA adapter that serves it by default: requests naming the tier and those "
        "routed to it run under the adapter (`tier:NAME` names one explicitly)",
    )

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        """Refuse a lone surrogate (JSON can escape one) in any string or key: it could be stored but not served."""
        stack = [data]
        while stack:  # a loop, not recursion: how deep a body nests is the client's choice
            item = stack.pop()
            if isinstance(item, str):
                try:
                    item.encode()
                except UnicodeEncodeError:
                    raise ValueError("strings must be valid Unicode (one holds a lone surrogate)") from None
            elif isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list | tuple):
                stack.extend(item)
        return data

    @field_validator("budgets")
    @classmethod
    def _one_per_period(cls, budgets: list[Budget]) -> list[Budget]:
        periods = [b.period for b in budgets]
        if len(set(periods)) != len(periods):
            raise ValueError("at most one budget per period")
        return budgets

    @model_validator(mode="after")
    def _priced(self) -> Policy:
        if self.allowed_tiers is not None:
            missing = [t for t in self.allowed_tiers if t not in self.prices]
            if missing:
                raise ValueError(f"allowed tiers without a price: {', '.join(missing)}")
        if self.counterfactual_tier not in self.prices:
            raise ValueError(f"counterfactual_tier {self.counterfactual_tier!r} has no price")
        if self.distill.schedule != "off" and not self.router.store_prompts:
            raise ValueError("distill.schedule needs router.store_prompts: a run trains on the stored prompts")
        return self

    def allows(self, tier: str) -> bool:
        return self.allowed_tiers is None or tier in self.allowed_tiers

    def price(self, tier: str) -> TierPrice:
        """A tier without a price of its own costs what the counterfactual tier costs (never free)."""
        return self.prices.get(tier) or self.prices[self.counterfactual_tier]

    def check_tiers(self, served: list[str], callable_: tuple[str, ...] = ()) -> list[Problem]:
        """(field path, message) for every tier named here that the gateway does not serve; an alias may also name
        one of `callable_` (`auto`, an embedding model)."""
        problems: list[Problem] = []
        for i, t in enumerate(self.allowed_tiers or []):
            if t not in served:
                problems.append((("allowed_tiers", i), f"no tier named {t!r}; served: {', '.join(served)}"))
        targets = [*served, *callable_]
        for name, target in self.aliases.items():
            if target not in targets:
                problems.append((("aliases", name), f"{target!r} is not served here; one of {', '.join(targets)}"))
            elif name in served:
                problems.append((("aliases", name), f"{name!r} is a tier's own name: an alias cannot hide it"))
        for tier in self.adapters:
            if tier not in served:
                problems.append((("adapters", tier), f"no tier named {tier!r}; served: {', '.join(served)}"))
        return problems
