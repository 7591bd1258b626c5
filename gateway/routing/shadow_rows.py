"""A shadow run's records: the job (what went out), what its two generations ran, its ledger row and meter,
and its label row in `router label`'s format; `gateway.routing.shadow`'s relabeler runs them.

Accounting, one ledger row per shadow run (`route = "shadow"`): billed (`router.shadow_billed`), priced at
the large tier's prices (`policies.pricing.charge_shadow`: counterfactual 0, the price a negative routing
saving) and settled against the run's own reservation; unbilled, the row records the run with zero tokens
and zero money, since the ledger's tokens and money are the tenant's bill.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from core.settings import Settings, TierSettings
from gateway.accounting.ledger import Ledger
from gateway.accounting.metrics import Metrics
from gateway.accounting.record import Decisions, TokenCounts, UsageRecord
from policies.budgets import Budgets, Reservation
from policies.pricing import Tokens, charge_shadow
from policies.store import Versioned
from router_model.label import tier_model
from router_model.label_store import Row
from router_model.model import LARGE, SMALL

__all__ = [
    "LABELS_FILE",
    "Answer",
    "Failed",
    "ShadowJob",
    "ShadowMeter",
    "ShadowUsage",
    "Spent",
    "adapted",
    "label_row",
    "labels_path",
    "run_cost",
    "shadow_record",
    "shadow_usage",
]

LABELS_FILE = "router-labels.jsonl"


def adapted(identity: str, adapter: str | None) -> str:
    """A tier's identity in the verdicts (model@weights/dtype), with the tenant's adapter it ran under: verdicts
    on the bare tier never count for the adapted one, nor one adapter's for another's."""
    return identity if adapter is None else f"{identity}+{adapter}"


def labels_path(home: Path) -> Path:
    """The live label log: `switchboard router train --from-logs` reads it."""
    return Path(home).expanduser() / LABELS_FILE


@dataclass(frozen=True)
class ShadowJob:
    """A routed request a cheaper tier (tiny, small) answered, as it went out."""

    request_id: str
    endpoint: str
    tenant_id: int
    tenant: str  # its name
    key_id: int
    policy: Versioned
    messages: list[dict[str, str]]
    answer_text: str  # the served tier's answer
    answer_tokens: int
    answer_finish: str | None
    max_tokens: int  # what the live request was allowed
    served: str = SMALL  # the tier that answered
    cell: str | None = None  # where the router placed the prompt (`router_model.tenant_layer.cell_of`)
    router: str = ""  # the id of the router that placed it
    explore: tuple[str, ...] = ()  # a large-served request: the cheaper tiers to run it on (`gateway.routing.explore`)


@dataclass
class Answer:
    text: str = ""
    prompt_tokens: int = 0
    tokens: int = 0
    cached: int = 0
    finish: str = "rejected"  # not run: too long for the tier


@dataclass
class Spent:
    """What a shadow run's two generations ran so far: what its ledger row counts."""

    large: Answer = field(default_factory=Answer)
    judge: Answer = field(default_factory=Answer)


class Failed(Exception):
    """The large tier failed or went away mid-run: no label; `answer` is what ran (its tokens are billed)."""

    def __init__(self, answer: Answer) -> None:
        super().__init__("the large tier failed")
        self.answer = answer


def shadow_usage(
    job: ShadowJob, rid: str, spent: Spent, settings: Settings, max_tokens: int, status: str, seconds: float
) -> ShadowUsage:
    """What the run ran, for its ledger row (`shadow_record`)."""
    large, judge = spent.large, spent.judge
    tier = settings.tiers.get(LARGE)
    return ShadowUsage(
        request_id=rid,
        endpoint=job.endpoint,
        tenant_id=job.tenant_id,
        key_id=job.key_id,
        policy=job.policy,
        tier=LARGE,
        model=tier.model if tier else LARGE,
        tokens=Tokens(
            prompt=large.prompt_tokens + judge.prompt_tokens,
            completion=large.tokens + judge.tokens,
            cached_prompt=large.cached + judge.cached,
        ),
        finish_reason=large.finish,
        max_tokens=max_tokens,
        status=status,
        seconds=seconds,
        billed=job.policy.policy.router.shadow_billed,
    )


def label_row(
    job: ShadowJob,
    prompt: int,
    spent: Spent,
    good_enough: bool,
    judged: str | None,
    seconds: float,
    started: float,
    tiers: Mapping[str, TierSettings],
    cost: Decimal = Decimal(0),
) -> Row:
    """The label row, in `router label`'s format (for the tier that served) plus the live request's: the
    large tier's `judged` verdict text (None: the answers were identical), `started` in epoch seconds, the
    prompt's `cell` and `router` (what the tenant's layer counts it in), `cost_usd` (the run at the tenant's
    prices, whoever pays)."""
    large, judge, served = spent.large, spent.judge, job.served
    row: Row = {
        "id": f"live/{job.request_id}",
        "source": "live",
        "direction": "shadow",
        "served": served,
        f"{served}_ok": good_enough,
        "large_ok": True,  # the reference, as for open chat in `router label`
    }
    if served == SMALL:
        row["label"] = good_enough
    row |= {
        "prompt_tokens": prompt,
        f"{served}_tokens": job.answer_tokens,
        "large_tokens": large.tokens,
        f"{served}_finish": job.answer_finish,
        "large_finish": large.finish,
        "seconds": round(seconds, 3),
        "judge": judged,
        "judge_prompt_tokens": judge.prompt_tokens,
        "judge_tokens": judge.tokens,
        # a routed answer ran under the tenant's default adapter of its tier, if its policy names one
        f"{served}_model": adapted(
            tier_model(tiers[served]) if served in tiers else served, job.policy.policy.adapters.get(served)
        ),
        "large_model": tier_model(tiers[LARGE]) if LARGE in tiers else LARGE,
        "request_id": job.request_id,
        "tenant_id": job.tenant_id,
        "tenant": job.tenant,
        "started": started,
        "cost_usd": str(cost),
    }
    if job.cell is not None:
        row |= {"cell": job.cell, "router": job.router}
    if job.policy.policy.router.store_prompts:  # the conversation only where the tenant lets us keep it
        row["messages"] = job.messages
    return row


@dataclass(frozen=True)
class ShadowUsage:
    """What one shadow run ran (the large tier's answer and the judge's, together), for its ledger row."""

    request_id: str  # the live request's id + `-shadow`
    endpoint: str
    tenant_id: int
    key_id: int
    policy: Versioned
    tier: str
    model: str  # the checkpoint behind the tier
    tokens: Tokens
    finish_reason: str
    max_tokens: int
    status: str  # ok | aborted | error
    seconds: float
    billed: bool  # the tenant's policy bills shadow runs (`router.shadow_billed`); else the operator pays
    route: str = "shadow"  # the ledger's route: "shadow", or "explore" (`gateway.routing.explore`)


def run_cost(run: ShadowUsage) -> Decimal:
    """What the run cost at the tenant's prices, whoever pays (the label row's `cost_usd`)."""
    return charge_shadow(run.policy.policy, run.tier, run.tokens).cost


def shadow_record(run: ShadowUsage) -> tuple[UsageRecord, Tokens]:
    """A shadow or explore run's ledger row (`route`), and the tokens it settles. Unbilled, the row records
    the run with zero tokens and zero money: the ledger's tokens and money are the tenant's bill."""
    tokens = run.tokens if run.billed else Tokens(prompt=0, completion=0)
    price = charge_shadow(run.policy.policy, run.tier, tokens)  # saved_verifier and saved_policy: 0, nothing cut
    rec = UsageRecord(
        request_id=run.request_id,
        tenant_id=run.tenant_id,
        api_key_id=run.key_id,
        endpoint=run.endpoint,
        model=run.model,
        tier=run.tier,
        latency_ms=round(run.seconds * 1000),
        status=run.status,
        finish_reason=run.finish_reason,
        tokens=TokenCounts(
            prompt=tokens.prompt,
            completion=tokens.completion,
            cached_prompt=tokens.cached_prompt,
            effective_max=run.max_tokens,
        ),
        decisions=Decisions(cache_status="bypass", route=run.route, policy_version=run.policy.version),
        charge=price,
    )
    return rec, tokens


class ShadowMeter:
    """Writes a shadow run's row down and settles its reservation (billed runs have one) to its cost."""

    def __init__(self, ledger: Ledger, budgets: Budgets, metrics: Metrics | None = None) -> None:
        self.ledger = ledger
        self.budgets = budgets
        self.metrics = metrics

    async def bill(self, run: ShadowUsage, reservation: Reservation | None) -> None:
        await self.bill_all([run], reservation)

    async def bill_all(self, runs: list[ShadowUsage], reservation: Reservation | None) -> None:
        """One row per run (an explore run's tier answer and its judge), the reservation settled to their sum."""
        cost, spent = Decimal(0), 0
        for run in runs:
            rec, tokens = shadow_record(run)
            if self.metrics is not None:
                self.metrics.record_request(rec, None, run.seconds)
            await self.ledger.write(rec)
            cost, spent = cost + rec.cost, spent + tokens.prompt + tokens.completion
        if reservation is not None:
            await self.budgets.settle(reservation, cost, spent)
