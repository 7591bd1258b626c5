"""One tuning for one tenant, end to end: its prompts, its policy in force, the candidates' runs, the
report's plot, and the stored proposal. The CLI, the admin API's schedule and the tests call this."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio

from engines.protocol import TierEngine
from policies.proposals import ProposalStore
from policies.store import PolicyStore
from policies.tune_prompts import dataset_prompts, tenant_prompts
from policies.tune_quality import Judge, grader
from policies.tune_report import plot_png
from policies.tuning import Candidate, Grade, HookFactory, Tuning, TuningError, tune


@dataclass(frozen=True)
class TuneRequest:
    tenant_id: int
    dataset: str | None = None  # None: the tenant's stored prompts
    sample: int = 50
    tier: str = "small"  # the tier a data set's prompts are answered on
    judge_tier: str = "large"
    max_tokens: int = 512
    tolerance: float = 0.02
    stops: Sequence[Sequence[str]] = ()
    seed: int = 0


async def tune_tenant(
    request: TuneRequest,
    engines: Mapping[str, TierEngine],
    policies: PolicyStore,
    proposals: ProposalStore,
    home: Path,
    actor: str,
    *,
    hooks: HookFactory,
    variants: Sequence[Candidate] | None = None,
    grade: Grade | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[int, Tuning]:
    """The stored proposal's id and the tuning behind it. `grade`: instead of the checks and the judge (a
    tenant's own check of its answers); `hooks`: the policies' in-flight verifiers (see `tuning.request_for`)."""
    if request.sample < 1:
        raise TuningError("the sample needs at least one prompt")
    # SQL, files, plotting and tokenizing go to threads: on a serving gateway this runs on its event loop.
    if request.dataset is None:
        prompts = await anyio.to_thread.run_sync(
            tenant_prompts, policies.db, request.tenant_id, request.sample, list(engines), request.seed
        )
    else:
        if request.tier not in engines:
            raise TuningError(f"no tier {request.tier!r}; the tiers are {', '.join(engines)}")
        prompts = await anyio.to_thread.run_sync(
            dataset_prompts, home, request.dataset, request.sample, request.tier, request.seed
        )
    judge = None
    if grade is None and any(p.grader == "judge" for p in prompts):
        if request.judge_tier not in engines:
            raise TuningError(f"no judge tier {request.judge_tier!r}; the tiers are {', '.join(engines)}")
        judge = Judge(engines[request.judge_tier])
    current = await anyio.to_thread.run_sync(policies.current, request.tenant_id)
    progress(f"tuning on {len(prompts)} prompts from policy v{current.version}")
    tuning = await tune(
        current.policy,
        prompts,
        engines,
        grade or grader(judge),
        hooks=hooks,
        max_tokens=request.max_tokens,
        tolerance=request.tolerance,
        stops=request.stops,
        variants=variants,
        progress=progress,
        seed=request.seed,
    )
    report = tuning.as_dict()
    source = request.dataset or "stored prompts"
    plot = await anyio.to_thread.run_sync(plot_png, report, f"Policy tuning, {source}")
    report["source"] = source
    pid = await anyio.to_thread.run_sync(
        lambda: proposals.save(request.tenant_id, current.version, tuning, plot, actor, report=report)
    )
    return pid, tuning
