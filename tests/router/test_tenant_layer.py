"""The tenant's own routing layer, without a gateway: cells, posteriors, the learned threshold on a tenant's mix,
tier identities, regions and kinds (`router_model.tenant_layer`, `router_model.regions`, `router_model.kinds`,
`gateway.routing.learning`)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from gateway.routing.learning import TenantLearning
from grading.graders import number_agreement
from policies.policy import LearnedRouting, Policy, RouterSettings
from router_model.kinds import TEXT, TOOLS, TOOLS_NOTE, request_kind
from router_model.quality import TenantVerdicts
from router_model.regions import fit_regions
from router_model.tenant_layer import (
    PRIOR_WEIGHT,
    LearningVerdicts,
    Seen,
    Verdict,
    cell_of,
    learn_threshold,
    posterior,
    posterior_p_ok,
    verdict_of,
)

SMALL_A, SMALL_B = "qwen-0.5b@int8/bf16", "qwen-0.5b-distilled@int8/bf16"


def learned_routing(**changes: object) -> LearnedRouting:
    """A learned routing for router r1 and the small tier SMALL_A, as `gateway.routing.learning` saves one."""
    fields: dict[str, object] = dict(
        router="r1", threshold=0.5, identities={"small": SMALL_A}, cells={"text/3": {"small": (5, 6)}}, verdicts=6,
        ratio=0.97, low=0.95, large_share=0.2, large_share_before=0.5, prompts=100, made=time.time(),
    )  # fmt: skip
    return LearnedRouting.model_validate(fields | changes)


def verdicts(cell: str, ok: int, bad: int, tier: str = "small", identity: str = SMALL_A) -> list[Verdict]:
    now = time.time()
    return [Verdict(tier, identity, i < ok, cell, "r1", now, "explore") for i in range(ok + bad)]


def test_the_posterior_starts_at_the_routers_p_and_follows_the_tenants_verdicts() -> None:
    assert posterior(0.3, True, 0, 0)[0] == pytest.approx(0.3)
    assert posterior(0.3, False, 0, 0)[0] == 0.0  # unlike the labels: nothing trusted before verdicts
    mean, var = posterior(0.3, True, 40, 40)
    assert mean == pytest.approx((PRIOR_WEIGHT * 0.3 + 40) / (PRIOR_WEIGHT + 40)) and mean > 0.85
    assert var < posterior(0.3, True, 4, 4)[1]  # more verdicts, less doubt
    assert posterior(0.9, True, 0, 40)[0] < 0.2  # and down where the tenant's small tier fails


def test_the_learned_threshold_moves_a_cell_the_tenant_verdicts_good_toward_small_and_no_other() -> None:
    facts, maths = cell_of(TEXT, 3, True), cell_of(TEXT, 7, True)
    seen = [Seen(facts, True, {"small": 0.3}) for _ in range(30)] + [
        Seen(maths, True, {"small": 0.3}) for _ in range(70)
    ]
    cells = {facts: {"small": (60, 60)}, maths: {"small": (10, 60)}}
    found = learn_threshold(seen, cells, floor=0.9, ladder=["small", "large"])
    assert found is not None and found.low >= 0.91
    assert found.large_share == pytest.approx(0.7)  # the facts go small, the maths stay large
    used = {c: posterior_p_ok({"small": 0.3}, c, True, cells)["small"] for c in (facts, maths)}
    assert used[facts] >= found.threshold > used[maths]
    # the same prompts without verdicts: the shipped P alone keeps the floor only by sending everything large
    assert learn_threshold(seen, {}, floor=0.9, ladder=["small", "large"]) is None


def test_the_learned_threshold_never_trusts_a_cell_the_labels_do_not_cover_without_verdicts() -> None:
    tools = cell_of(TOOLS, 1, False)
    seen = [Seen(tools, False, {"small": 0.99, "tiny": 0.99}) for _ in range(50)]
    assert learn_threshold(seen, {}, floor=0.5, ladder=["tiny", "small", "large"]) is None
    found = learn_threshold(seen, {tools: {"small": (50, 50)}}, floor=0.5, ladder=["tiny", "small", "large"])
    assert found is not None and found.shares["small"] == 1.0 and found.shares["tiny"] == 0.0  # tiny: no verdicts


def test_verdicts_count_per_tenant_per_tier_identity_and_router() -> None:
    store = LearningVerdicts()
    for v in verdicts("text/3", 5, 1):
        store.add("one", v)
    assert store.cells("one", {"small": SMALL_A}, "r1") == {"text/3": {"small": (5, 6)}}
    assert store.cells("two", {"small": SMALL_A}, "r1") == {}  # another tenant's never count
    assert store.cells("one", {"small": SMALL_B}, "r1") == {}  # a changed small tier starts over
    assert store.cells("one", {"small": SMALL_A}, "r2") == {}  # another router's regions mean other cells
    assert store.count("one", {"small": SMALL_A}, "r1", since=time.time() + 60) == 0  # a reset forgets


def test_a_changed_tier_identity_turns_the_learned_routing_off_until_its_own_verdicts_come() -> None:
    learned = learned_routing()
    policy = Policy(router=RouterSettings(learned=learned))
    same = TenantLearning(LearningVerdicts(), TenantVerdicts(), {"small": SMALL_A, "large": "l"})
    changed = TenantLearning(LearningVerdicts(), TenantVerdicts(), {"small": SMALL_B, "large": "l"})
    assert same.active(policy, "r1") is learned
    assert same.active(policy, "r2") is None  # another router
    assert changed.active(policy, "r1") is None
    off = Policy(router=RouterSettings(learned=learned, learn=False))
    assert same.active(off, "r1") is None


def test_label_rows_give_verdicts_and_explore_rows_stay_out_of_the_served_estimate() -> None:
    row = {"source": "live", "tenant": "one", "direction": "explore", "served": "large", "judged_tier": "small",
           "small_ok": True, "large_ok": True, "small_model": SMALL_A, "cell": "text/3", "router": "r1",
           "started": 1.0, "cost_usd": "0.0001"}  # fmt: skip
    verdict = verdict_of(row)
    assert verdict is not None and (verdict.tier, verdict.ok, verdict.direction) == ("small", True, "explore")
    assert str(verdict.cost) == "0.0001"
    served = TenantVerdicts()
    served.load([row])
    assert served.judged("one") == 0  # it judged a tier that did not serve
    assert verdict_of({**row, "cell": None} | {"source": "label"}) is None


def test_regions_place_prompts_and_say_which_are_far_from_every_label() -> None:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 384))
    labeled = np.vstack([c + 0.05 * rng.normal(size=(50, 384)) for c in centres]).astype(np.float32)
    regions = fit_regions(labeled)
    near, far = regions.place(np.vstack([centres[2] + 0.05 * rng.normal(size=384), rng.normal(size=384)]))
    assert near.known and not far.known and far.distance > regions.radius
    assert near.region == regions.place(labeled[100:101])[0].region  # the same region as its labeled neighbours


def test_request_kinds() -> None:
    assert request_kind([{"role": "user", "content": "hi"}]) == TEXT
    assert request_kind([{"role": "system", "content": f"{TOOLS_NOTE} 2 tools: a, b."}, {"role": "user"}]) == TOOLS
    assert request_kind([{"role": "assistant", "tool_calls": [{"id": "1"}]}, {"role": "tool", "content": "x"}]) == TOOLS


def test_word_problems_are_judged_by_their_final_numbers() -> None:
    q = "Tom has 3 apples and buys 5 more. How many apples does he have?"
    assert number_agreement(q, "3 + 5 = 8. The answer is 8.", "He has 8") is True
    assert number_agreement(q, "The answer is 8.", "He has 9 apples") is False
    assert number_agreement("Write a haiku about 2 cats and 3 dogs.", "8", "9") is None  # no quantity asked
    assert number_agreement(q, "The answer is 8.", "I am not sure.") is None  # the judge decides


def test_the_floor_holds_per_kind_of_request_not_only_on_average() -> None:
    text, tools = cell_of(TEXT, 1, True), cell_of(TOOLS, 1, True)
    seen = [Seen(text, True, {"small": 0.5}) for _ in range(90)] + [
        Seen(tools, True, {"small": 0.5}) for _ in range(10)
    ]
    cells = {text: {"small": (200, 200)}, tools: {"small": (60, 100)}}
    found = learn_threshold(seen, cells, floor=0.9, ladder=["small", "large"])
    assert found is not None and found.large_share == pytest.approx(0.1)  # on average small would do; tools: not


def test_a_learned_routing_the_verdicts_no_longer_support_is_removed() -> None:
    store = LearningVerdicts()
    for v in verdicts("text/3", 5, 40):
        store.add("one", v)
    learning = TenantLearning(store, TenantVerdicts(), {"small": SMALL_A, "large": "l"})
    for _ in range(30):
        learning.add("one", Seen("text/3", True, {"small": 0.6}), large=False)
    learned = learned_routing(cells={"text/3": {"small": (5, 5)}}, verdicts=5, large_share=0.0, prompts=30)
    policy = Policy(router=RouterSettings(learned=learned))
    moved, note = learning._learn("one", policy, "r1", ["small", "large"], learned)
    assert moved is not None and moved.router.learned is None and "goes" in note  # toward large
