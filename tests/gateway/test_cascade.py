"""The verifier cascade through a live gateway: an answer that fails the tenant's checks is retried on the
large tier, and both attempts are billed. Both tiers are SmolLM2 (they differ in name, price and ledger
row, which is what the cascade's accounting is about)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from decimal import Decimal

import httpx
import pytest

from core.db.database import Database
from engines.async_engine import AsyncEngine
from gateway.tenants import create_key, create_tenant
from live import LiveServer, start_server

POLICY = {"verifiers": {"checks": ["math"], "cascade": True, "cascade_to": "large"}}


@pytest.fixture(scope="module")
def live(small_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from answer_samples import apple_answers

    from core.settings import Settings
    from gateway.app import create_app
    from router_model.encoder import RouterEncoder
    from verifiers.probe import AnswerProbe

    home = tmp_path_factory.mktemp("cascade")
    AnswerProbe.train(*apple_answers(), RouterEncoder()).save(home / "probe")  # the gateway loads it from home
    url = f"sqlite:///{home / 'switchboard.db'}"
    db = Database(url)
    settings = Settings(home=home, database_url=url, tiers={"small": {"model": "unused"}, "large": {"model": "unused"}})
    server, stop = start_server(
        create_app(settings, engines={"small": small_engine, "large": small_engine}, database=db), db
    )
    yield server
    stop()
    db.dispose()


def tenant_key(live: LiveServer, policy: dict) -> str:
    name = f"t-{uuid.uuid4().hex[:10]}"
    admin = create_tenant(live.db, name, role="admin").key
    r = httpx.put(
        f"{live.base_url}/v1/admin/tenants/{name}/policy", json=policy, headers={"Authorization": f"Bearer {admin}"}
    )
    assert r.status_code == 200, r.text
    return create_key(live.db, name, "app").key


def ask(live: LiveServer, key: str, content: str, **extra: object) -> httpx.Response:
    body = {"model": "small", "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 40}
    return httpx.post(
        f"{live.base_url}/v1/chat/completions",
        json={**body, "cache": "no-store", **extra},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def test_a_failed_answer_is_retried_on_the_large_tier_and_both_are_billed(live: LiveServer) -> None:
    key = tenant_key(live, POLICY)
    r = ask(live, key, "Say hello to my friend Anna in one short sentence.")  # no number: the math check fails
    assert r.status_code == 200, r.text
    assert r.headers["x-switchboard-tier"] == "large"
    first_id = r.headers["x-switchboard-cascade"].split("first=")[1]
    assert r.headers["x-switchboard-cascade"].startswith("small>large")
    assert "0:math:escalate@" in r.headers["x-switchboard-verifiers"]
    (first,) = live.wait_for_usage(first_id)
    (second,) = live.wait_for_usage(r.json()["id"])
    assert (first.tier, first.status, second.tier, second.status) == ("small", "escalated", "large", "ok")
    assert first.cost > 0 and first.counterfactual_cost == Decimal(0)  # it only cost: the cascade's overhead
    levers = ("saved_routing", "saved_cache", "saved_speculation", "saved_policy", "saved_verifier")
    for row in (first, second):
        assert row.counterfactual_cost - row.cost == sum(getattr(row, k) for k in levers)
    assert second.cost > 0 and second.counterfactual_cost >= second.cost
    assert first.verifier_actions[0]["action"] == "escalate" and r.json()["usage"] == {
        "prompt_tokens": second.prompt_tokens,
        "completion_tokens": second.completion_tokens,
        "total_tokens": second.prompt_tokens + second.completion_tokens,
    }


def test_an_answer_that_passes_is_not_retried(live: LiveServer) -> None:
    key = tenant_key(live, POLICY)
    r = ask(live, key, "What is 2 + 2? Reply with the number.")
    assert r.status_code == 200 and r.headers["x-switchboard-tier"] == "small"
    assert "x-switchboard-cascade" not in r.headers and r.headers["x-switchboard-verifiers"] == "none"
    (row,) = live.wait_for_usage(r.json()["id"])
    assert row.status == "ok" and row.tier == "small"
    # streams are not cascaded (what was streamed cannot be taken back), but the check is still recorded
    s = ask(live, key, "Say hello to my friend Anna in one short sentence.", stream=True)
    assert s.status_code == 200 and s.headers["x-switchboard-tier"] == "small"
    rid = next(line for line in s.text.splitlines() if line.startswith("data: {"))
    request_id = httpx.Response(200, content=rid[6:]).json()["id"]
    (row,) = live.wait_for_usage(request_id)
    assert row.status == "ok" and row.verifier_actions[0]["action"] == "escalate"


def test_without_a_cascade_the_failed_check_is_only_reported(live: LiveServer) -> None:
    key = tenant_key(live, {"verifiers": {"checks": ["math"]}})
    r = ask(live, key, "Say hello to my friend Anna in one short sentence.")
    assert r.headers["x-switchboard-tier"] == "small" and "x-switchboard-cascade" not in r.headers
    assert "0:math:escalate@" in r.headers["x-switchboard-verifiers"]


@pytest.mark.parametrize(("threshold", "escalated"), [(1.0, True), (0.0, False)])
def test_the_probe_check_escalates_below_its_threshold(live: LiveServer, threshold: float, escalated: bool) -> None:
    policy = {"verifiers": {"checks": ["probe"], "probe_threshold": threshold, "cascade": True}}
    r = ask(live, tenant_key(live, policy), "What is 2 + 2? Reply with the number.")
    assert r.status_code == 200, r.text
    assert r.headers["x-switchboard-tier"] == ("large" if escalated else "small")
    if escalated:  # P(right) < 1.0 always: the probe's own P is in the reason
        assert "0:probe:escalate@" in r.headers["x-switchboard-verifiers"]
        (first,) = live.wait_for_usage(r.headers["x-switchboard-cascade"].split("first=")[1])
        assert first.verifier_actions[0]["reason"].startswith("P(right) ")
    else:
        assert r.headers["x-switchboard-verifiers"] == "none"
