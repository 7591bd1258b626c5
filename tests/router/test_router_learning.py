"""A tenant's routing learned from its own traffic, both ways, through real shadow and explore runs
(`gateway.routing.explore`, `gateway.routing.learning`), on the router gateway of `test_router_gateway`: SmolLM2
serves both tiers there, so a hard prompt's small answer (greedy, the same model) is as good as large's, and the
explore runs find it so. The shipped (synthetic) router sends such prompts large: the tenant's verdicts say
otherwise, and its routing moves toward small, audited, its estimate over the floor; nobody else's moves.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import test_router_gateway as shared
from test_router_gateway import HARD, Gateway

from core import audit
from gateway.accounting.tenants import create_key
from gateway.api.deps import app_services, running_pipeline
from gateway.routing.learning import MIN_SEEN
from router_model.tenant_layer import MIN_FRESH

ROUTE = "x-switchboard-route"
# a floor of 0.5, the shipped curve aimed at 0.95 (as after a recalibration toward large): hard prompts go large
AIMED = {"offset": 0.45, "judged": 0, "ratio": 0.5, "high": 0.5}
# the router gateway's module fixtures (pytest names a fixture by the attribute that holds it here)
router_gateway, router_dir = shared.gateway, shared.router_dir


def hard(i: int) -> str:
    """A hard prompt no earlier one repeats (the response cache would answer a repeat, and explore only fresh ones)."""
    return HARD.replace("312", str(1000 + i)).replace("45", str(50 + i % 40))


def explore_rows(gw: Gateway, tenant: str) -> list[dict]:
    return [r for r in gw.labels_all() if r.get("tenant") == tenant and r.get("direction") == "explore"]


def wait(until: object, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not until() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.1)


def test_a_tenant_whose_small_tier_does_as_well_on_hard_prompts_is_moved_toward_small(router_gateway: Gateway) -> None:
    name, key, tenant_id = router_gateway.tenant(
        explore_share=1.0, shadow_share=1.0, quality_ratio=0.5, recalibration=AIMED
    )
    _, other, other_id = router_gateway.tenant(explore_share=0.0, quality_ratio=0.5, recalibration=AIMED)
    policies = app_services(router_gateway.live.app).policies
    before = policies.current(tenant_id)
    sent = 0
    while sent < MIN_SEEN + MIN_FRESH + 10 and policies.current(tenant_id).version == before.version:
        r = router_gateway.chat(key, hard(sent))
        assert r.status_code == 200 and r.headers["x-switchboard-tier"] == "large", r.text  # the shipped router's
        sent += 1
        if sent >= MIN_SEEN:  # explore runs finish behind the requests: give the verdicts a moment to come
            wait(lambda n=sent: len(explore_rows(router_gateway, name)) >= n - 2, timeout=30)
    wait(lambda: policies.current(tenant_id).version > before.version)
    after = policies.current(tenant_id)
    learned = after.policy.router.learned
    assert learned is not None, f"no learning after {sent} requests, {len(explore_rows(router_gateway, name))} verdicts"
    assert learned.large_share < learned.large_share_before and learned.low >= 0.5  # toward small, over the floor
    assert sum(ok for tiers in learned.cells.values() for ok, _ in tiers.values()) >= MIN_FRESH
    entry = audit.entries(router_gateway.live.db, tenant_id)[0]
    assert (entry.actor, entry.action) == ("switchboard", "policy.recalibrate") and "toward small" in after.note
    assert entry.after is not None and entry.after["router"]["learned"]["threshold"] == learned.threshold

    # the tenant's next hard prompt goes small, by its own verdicts; the other tenant's still goes large
    mine, theirs = router_gateway.chat(key, hard(900)), router_gateway.chat(other, hard(900))
    assert mine.headers["x-switchboard-tier"] == "small" and "learned" in mine.headers[ROUTE], mine.headers
    assert theirs.headers["x-switchboard-tier"] == "large" and "learned" not in theirs.headers[ROUTE]
    assert policies.current(other_id).policy.router.learned is None

    # the shadow estimate on what small now serves stays over the floor
    for i in range(901, 904):
        assert router_gateway.chat(key, hard(i)).headers["x-switchboard-tier"] == "small"
    stage = running_pipeline(router_gateway.live.app).routing
    wait(lambda: (e := stage.floor.estimate(name)) is not None and e.judged >= 3)
    found = stage.floor.estimate(name)
    assert found is not None and found.ratio >= 0.5

    # its admins see it, and can reset it: its routing forgets, and learns only from verdicts that come after
    admin = create_key(router_gateway.live.db, name, role="admin").key
    auth = {"Authorization": f"Bearer {admin}"}
    stats = httpx.get(f"{router_gateway.live.base_url}/v1/admin/router", headers=auth).json()
    assert set(stats["tenants"]) == {name}  # a tenant's admin sees its own tenant only
    seen = stats["tenants"][name]["learning"]
    assert seen["active"] and seen["threshold"] == learned.threshold and seen["explore"]["runs"] >= MIN_FRESH
    assert seen["curve"] and float(seen["explore"]["cost_usd"]) > 0
    reset = httpx.post(f"{router_gateway.live.base_url}/v1/admin/router/tenants/{name}/learning/reset", headers=auth)
    assert reset.status_code == 200, reset.text
    now = policies.current(tenant_id).policy.router
    assert now.learned is None and now.learn_since > 0
    assert audit.entries(router_gateway.live.db, tenant_id)[0].action == "policy.reset_learning"
    again = router_gateway.chat(key, hard(950))
    assert again.headers["x-switchboard-tier"] == "large" and "learned" not in again.headers[ROUTE]
    other_admin = create_key(router_gateway.live.db, name, role="app").key  # an app key may not reset
    refused = httpx.post(f"{router_gateway.live.base_url}/v1/admin/router/tenants/{name}/learning/reset",
                         headers={"Authorization": f"Bearer {other_admin}"})  # fmt: skip
    assert refused.status_code in (401, 403)


def test_exploring_stays_within_its_share_and_the_operator_pays(router_gateway: Gateway) -> None:
    name, key, _ = router_gateway.tenant(explore_share=0.25, explore_warmup=0)
    ids = []
    for i in range(40):
        r = router_gateway.chat(key, hard(2000 + i), hold=True)
        assert r.headers["x-switchboard-tier"] == "large"
        ids.append(r.json()["id"])
    time.sleep(3)
    running = running_pipeline(router_gateway.live.app).routing.explorer
    assert running is not None
    wait(lambda: running.runs.idle, timeout=60)
    rows = explore_rows(router_gateway, name)
    # Binomial(40, 0.25): outside [1, 22] once in ~10^5 runs; exploring everything (40) or nothing fails
    assert 1 <= len(rows) <= 22, len(rows)
    for row in rows:
        assert row["judged_tier"] == "small" and row["served"] == "large" and row["request_id"] in ids
        assert row["started"] >= router_gateway.sent[row["request_id"]]  # after the response went out, never before
        assert float(row["cost_usd"]) > 0  # what it cost at the tenant's prices...
        (ledger,) = router_gateway.live.usage_rows(request_id=f"{row['request_id']}-explore-small")
        assert (ledger.route, ledger.tier, ledger.status) == ("explore", "small", "ok")
        assert ledger.cost == 0 and ledger.prompt_tokens == ledger.completion_tokens == 0  # ...paid by the operator

    billed_name, billed, _ = router_gateway.tenant(explore_share=1.0, shadow_billed=True)
    r = router_gateway.chat(billed, hard(3000))
    wait(lambda: len(explore_rows(router_gateway, billed_name)) == 1)
    (ledger,) = router_gateway.live.usage_rows(request_id=f"{r.json()['id']}-explore-small")
    assert ledger.route == "explore" and ledger.cost > 0 and ledger.completion_tokens > 0  # billed: the tenant's


def test_one_tenants_verdicts_never_reach_anothers_routing(router_gateway: Gateway) -> None:
    stage = running_pipeline(router_gateway.live.app).routing
    one, key_one, _ = router_gateway.tenant(explore_share=1.0, quality_ratio=0.5, recalibration=AIMED)
    two, _, two_id = router_gateway.tenant(explore_share=1.0, quality_ratio=0.5, recalibration=AIMED)
    for i in range(5):
        router_gateway.chat(key_one, hard(4000 + i))
    wait(lambda: len(explore_rows(router_gateway, one)) >= 5)
    identities = stage.learning.identities
    router = stage.service.router.id if stage.service is not None else ""
    assert stage.learning.verdicts.count(one, identities, router) >= 5
    assert stage.learning.verdicts.count(two, identities, router) == 0
    assert stage.learning.verdicts.cells(two, identities, router) == {}
    policies = app_services(router_gateway.live.app).policies
    assert policies.current(two_id).policy.router.learned is None


def test_a_tier_under_the_tenants_adapter_is_explored_under_it_and_learned_apart(
    router_gateway: Gateway, smollm2_dir: Path, tmp_path: Path
) -> None:
    """A tenant whose policy serves small under its adapter: explore runs small under that adapter (the engine
    loads it), the verdicts carry its name beside the tier's identity, so verdicts on the bare small tier never
    count for it; replacing its files forgets what was learned, and other tenants' verdicts stay the bare tier's."""
    from lora_adapters import make_adapter

    from engines.lora import load_adapter
    from gateway.adapters.policy import forget_learning_if_default, serve_by_default

    pipeline = running_pipeline(router_gateway.live.app)
    store, stage = pipeline.adapters.store, pipeline.routing
    assert store is not None and stage.explorer is not None
    name, key, tenant_id = router_gateway.tenant(explore_share=1.0, quality_ratio=0.5, recalibration=AIMED)
    plain, plain_key, _ = router_gateway.tenant(explore_share=1.0, quality_ratio=0.5, recalibration=AIMED)
    engine = pipeline.engines["small"]
    files = make_adapter(smollm2_dir, tmp_path / "mine", 3)
    record = store.register(tenant_id, "small", "mine", files, lambda d: load_adapter(d, engine.engine.model),
                            actor="test")  # fmt: skip
    policies = app_services(router_gateway.live.app).policies
    serve_by_default(policies, tenant_id, "small", "mine", "test", "adapter")
    for i in range(3):
        assert router_gateway.chat(key, hard(5000 + i)).headers["x-switchboard-tier"] == "large"
        assert router_gateway.chat(plain_key, hard(5000 + i)).headers["x-switchboard-tier"] == "large"
    wait(lambda: len(explore_rows(router_gateway, name)) >= 3 and len(explore_rows(router_gateway, plain)) >= 3)
    base = stage.learning.identities["small"]
    assert {r["small_model"] for r in explore_rows(router_gateway, name)} == {f"{base}+mine"}
    assert {r["small_model"] for r in explore_rows(router_gateway, plain)} == {base}
    assert record.key in engine.engine.adapters  # the explore runs loaded it
    policy = policies.current(tenant_id).policy
    router = stage.service.router.id if stage.service is not None else ""
    assert stage.learning.of(policy)["small"] == f"{base}+mine"
    assert stage.learning.verdicts.count(name, stage.learning.of(policy), router) >= 3
    assert stage.learning.verdicts.count(name, stage.learning.identities, router) == 0  # not the bare tier's
    version = forget_learning_if_default(policies, tenant_id, "small", "mine", "test")
    assert version is not None and policies.current(tenant_id).policy.router.learn_since > 0
    assert stage.learning.verdicts.count(name, stage.learning.of(policies.current(tenant_id).policy), router,
                                         since=policies.current(tenant_id).policy.router.learn_since) == 0  # fmt: skip
