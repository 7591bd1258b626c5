"""Admin, policy and finance APIs through a live gateway on SQLite and PostgreSQL: roles, tenant
isolation, validation errors with field paths, the audit trail, policy enforcement, and reports
that equal the raw ledger."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from decimal import Decimal

import httpx
import openai
import pytest
import sqlalchemy as sa

from core.db.models import AuditEntry, Usage, UsageDaily
from gateway.accounting.tenants import authenticate, create_key, create_tenant
from gateway.api.deps import app_services
from live import LiveServer

QUESTION = [{"role": "user", "content": "Name the capital of France."}]


def http(live: LiveServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=live.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


@pytest.fixture(scope="module")
def keys(live_server: LiveServer) -> dict[str, str]:
    """An operator tenant's admin and finance keys, and two ordinary tenants with an app, an admin and a
    finance key each."""
    db, tag = live_server.db, uuid.uuid4().hex[:6]
    out = {"op_admin": create_tenant(db, f"ops-{tag}", operator=True, role="admin").key}
    out["op_finance"] = create_key(db, f"ops-{tag}", "finance").key
    for t in ("a", "b"):
        name = f"{t}-{tag}"
        out[f"{t}_app"] = create_tenant(db, name).key
        out[f"{t}_admin"] = create_key(db, name, "admin").key
        out[f"{t}_finance"] = create_key(db, name, "finance").key
        out[t] = name
    return out


@pytest.fixture
def ask(live_server: LiveServer) -> Iterator:
    def ask(key: str, **kw: object) -> openai.types.chat.ChatCompletion:
        client = openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key=key, max_retries=0, timeout=120)
        # no-store: these tests are about what the engine's runs cost, not about the response cache
        body = {"max_tokens": 6, "extra_body": {"cache": "no-store"}, **kw}
        return client.chat.completions.create(model="small", messages=QUESTION, **body)

    yield ask


def test_roles_guard_admin_and_finance(live_server: LiveServer, keys: dict[str, str]) -> None:
    a = keys["a"]
    with http(live_server, keys["a_app"]) as app:
        for path in ("/v1/admin/tenants", f"/v1/admin/tenants/{a}/policy", "/v1/finance/costs", "/v1/admin/audit"):
            r = app.get(path)
            assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_role", path
        assert app.put(f"/v1/admin/tenants/{a}/policy", json={}).status_code == 403
    with http(live_server, keys["a_finance"]) as fin:
        assert fin.get(f"/v1/admin/tenants/{a}/policy").status_code == 200  # finance reads policies (prices)
        r = fin.put(f"/v1/admin/tenants/{a}/policy", json={"sampling": {"max_tokens_cap": 5}})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        assert fin.post(f"/v1/admin/tenants/{a}/policy/rollback", json={"version": 0}).status_code == 403
        assert fin.get("/v1/admin/tenants").status_code == 403
    with http(live_server, keys["a_admin"]) as adm:
        assert adm.get("/v1/finance/costs").status_code == 403  # admins do not read the money
        r = adm.post("/v1/admin/tenants", json={"name": f"x-{uuid.uuid4().hex[:6]}"})
        assert r.status_code == 403  # only the operator creates tenants
    with http(live_server, "sk-sb-nope-nope-nope-nope") as anon:
        assert anon.get("/v1/admin/tenants").status_code == 401


def test_tenants_never_see_each_other(live_server: LiveServer, keys: dict[str, str], ask: object) -> None:
    a, b = keys["a"], keys["b"]
    ask(keys["a_app"])  # type: ignore[operator]
    ask(keys["b_app"])  # type: ignore[operator]
    with http(live_server, keys["a_admin"]) as adm:
        assert [t["name"] for t in adm.get("/v1/admin/tenants").json()] == [a]
        for path in (f"/v1/admin/tenants/{b}/policy", f"/v1/admin/tenants/{b}/keys", f"/v1/admin/audit?tenant={b}"):
            r = adm.get(path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found", path
        assert adm.put(f"/v1/admin/tenants/{b}/policy", json={}).status_code == 404
        b_prefix = keys["b_app"][:16]
        assert adm.delete(f"/v1/admin/keys/{b_prefix}").status_code == 404  # not theirs to revoke
        assert all(e["tenant_id"] == authenticate(live_server.db, keys["a_app"]).tenant_id
                   for e in adm.get("/v1/admin/audit").json())  # fmt: skip
    with http(live_server, keys["a_finance"]) as fin:
        assert fin.get(f"/v1/finance/costs?tenant={b}").status_code == 404
        assert {r["tenant"] for r in fin.get("/v1/finance/costs").json()["data"]} == {a}
        assert {r["tenant"] for r in fin.get("/v1/finance/savings").json()["data"]} == {a}
        assert b not in fin.get("/v1/finance/costs.csv").text
    with http(live_server, keys["a_app"]) as app:
        own = app.get("/v1/usage").json()["data"]
        assert own and all(r["tenant"] == a for r in own)
    with http(live_server, keys["op_finance"]) as op:
        assert {a, b} <= {r["tenant"] for r in op.get("/v1/finance/costs").json()["data"]}
        assert op.get(f"/v1/finance/costs?tenant={b}").json()["data"][0]["tenant"] == b


def test_invalid_policies_are_422_with_field_paths(live_server: LiveServer, keys: dict[str, str]) -> None:
    with http(live_server, keys["a_admin"]) as adm:
        bad = {"sampling": {"max_tokens_cap": 0}, "budgets": [{"period": "weekly", "money": "1"}], "oops": 1}
        r = adm.put(f"/v1/admin/tenants/{keys['a']}/policy", json=bad)
        err = r.json()["error"]
        assert r.status_code == 422 and err["code"] == "invalid_policy" and err["type"] == "invalid_request_error"
        assert {d["param"] for d in err["details"]} == {"sampling.max_tokens_cap", "budgets.0.period", "oops"}
        assert err["param"] in {d["param"] for d in err["details"]} and err["message"].startswith(err["param"])
        r = adm.put(f"/v1/admin/tenants/{keys['a']}/policy", json={"allowed_tiers": ["small", "ghost"]})
        assert r.status_code == 422  # "ghost" has no price
        r = adm.put(
            f"/v1/admin/tenants/{keys['a']}/policy",
            json={"allowed_tiers": ["large"], "prices": {"large": {"prompt": 1, "completion": 2}}},
        )
        assert r.status_code == 422 and r.json()["error"]["param"] == "allowed_tiers.0"  # not served here
        r = adm.put(
            f"/v1/admin/tenants/{keys['a']}/policy", content=b"[1, 2]", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400  # not an object: the body's shape, like any request's (a policy's content: 422)
        r = adm.post(f"/v1/admin/tenants/{keys['a']}/policy/rollback", json={"version": 999})
        assert r.status_code == 404 and r.json()["error"]["param"] == "version"


def test_policies_are_enforced_versioned_and_audited(
    live_server: LiveServer, keys: dict[str, str], ask: object
) -> None:
    a = keys["a"]
    tenant_id = authenticate(live_server.db, keys["a_app"]).tenant_id
    path = f"/v1/admin/tenants/{a}/policy"
    with http(live_server, keys["op_admin"]) as op:  # the operator's admin edits any tenant
        r = op.put(path, json={"sampling": {"max_tokens_cap": 3, "temperature_max": 0.0}, "note": "cap"})
        assert r.status_code == 200 and r.json()["version"] >= 1
        v_cap = r.json()["version"]
    app_services(live_server.app).policies.invalidate(tenant_id)
    reply = ask(keys["a_app"], max_tokens=50, temperature=1.5)  # type: ignore[operator]
    assert reply.usage.completion_tokens <= 3 and reply.choices[0].finish_reason in ("length", "stop")
    (row,) = live_server.wait_for_usage(reply.id)
    assert (row.requested_max_tokens, row.effective_max_tokens, row.policy_version) == (50, 3, v_cap)
    if reply.choices[0].finish_reason == "length":
        assert row.saved_policy > 0  # the cap stopped a request that wanted more
    again = ask(keys["a_app"], max_tokens=50, temperature=1.5)  # type: ignore[operator]
    assert again.choices[0].message.content == reply.choices[0].message.content  # temperature clamped to 0

    with http(live_server, keys["a_admin"]) as adm:
        r = adm.put(path, json={"allowed_tiers": [], "note": "lock out"})
        assert r.status_code == 200
        app_services(live_server.app).policies.invalidate(tenant_id)
        with pytest.raises(openai.PermissionDeniedError) as info:
            ask(keys["a_app"])  # type: ignore[operator]
        assert info.value.code == "model_not_allowed"
        with http(live_server, keys["a_app"]) as app:
            assert app.get("/v1/models").json()["data"] == []
        dry = adm.post(f"{path}/dry-run", json={"policy": {"sampling": {"max_tokens_cap": 1}}}).json()
        assert dry["requests"] >= 2 and dry["clamped"] >= 1 and Decimal(dry["cost_after"]) < Decimal(dry["cost_before"])
        versions = adm.get(f"{path}/versions").json()
        assert [v["version"] for v in versions] == sorted((v["version"] for v in versions), reverse=True)
        r = adm.post(f"{path}/rollback", json={"version": v_cap})
        assert r.status_code == 200 and r.json()["policy"]["sampling"]["max_tokens_cap"] == 3
        assert r.json()["version"] == versions[0]["version"] + 1
        app_services(live_server.app).policies.invalidate(tenant_id)
        assert ask(keys["a_app"]).usage.completion_tokens <= 3  # type: ignore[operator]
        issued = adm.post(f"/v1/admin/tenants/{a}/keys", json={"role": "finance"}).json()
        assert adm.delete(f"/v1/admin/keys/{issued['prefix']}").status_code == 204
        assert authenticate(live_server.db, issued["key"]) is None
        log = adm.get(f"/v1/admin/audit?tenant={a}").json()
    actions = [(e["action"], e["actor"].split(":")[0]) for e in log]
    assert actions[:5] == [
        ("key.revoke", "admin"),
        ("key.create", "admin"),
        ("policy.rollback", "admin"),
        ("policy.update", "admin"),
        ("policy.update", "admin"),
    ]
    assert log[3]["after"]["allowed_tiers"] == [] and log[3]["before"]["sampling"]["max_tokens_cap"] == 3
    with live_server.db.session() as s:  # every change is in the log, in SQL
        n = s.scalar(sa.select(sa.func.count()).select_from(AuditEntry).where(AuditEntry.tenant_id == tenant_id))
    assert n >= 8  # tenant and 3 keys created, 2 updates, a rollback, a key created and revoked


def test_reports_equal_the_raw_ledger(live_server: LiveServer, keys: dict[str, str], ask: object) -> None:
    for i in range(3):
        ask(keys["b_app"], seed=i)  # type: ignore[operator]
    tenant_id = authenticate(live_server.db, keys["b_app"]).tenant_id
    columns = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "cost", "counterfactual_cost",
               "saved_cache", "saved_routing", "saved_policy")  # fmt: skip
    with live_server.db.session() as s:
        raw = s.execute(
            sa.select(sa.func.count(), *(sa.func.sum(getattr(Usage, c)) for c in columns)).where(
                Usage.tenant_id == tenant_id
            )
        ).one()
        rolled = s.execute(
            sa.select(sa.func.sum(UsageDaily.requests), *(sa.func.sum(getattr(UsageDaily, c)) for c in columns)).where(
                UsageDaily.tenant_id == tenant_id
            )
        ).one()
    assert tuple(raw) == tuple(rolled) and raw[0] >= 3
    with http(live_server, keys["op_finance"]) as fin:
        (costs,) = fin.get(f"/v1/finance/costs?tenant={keys['b']}&group_by=tier").json()["data"]
        (saved,) = fin.get(f"/v1/finance/savings?tenant={keys['b']}").json()["data"]
        csv = fin.get(f"/v1/finance/costs.csv?tenant={keys['b']}&group_by=day,tier,model")
    assert costs["requests"] == raw[0] and Decimal(costs["cost"]) == raw[4]
    assert Decimal(saved["saved"]) == raw[5] - raw[4]
    assert csv.headers["content-type"].startswith("text/csv") and csv.text.splitlines()[0].startswith(
        "tenant,day,tier,model"
    )
    assert Decimal(csv.text.splitlines()[1].split(",")[-2]) == raw[4]


MONEY_KEY = re.compile(r"cost|saved|spent|spend|money|price|amount|usd", re.IGNORECASE)
NOT_MONEY = re.compile(r"share|rate|ratio|pct|tokens|count", re.IGNORECASE)  # saved_share: a fraction


def money_values(found: object, path: str = "", money: bool = False) -> Iterator[tuple[str, object]]:
    """(path, value) of every field whose name, or whose container's name, says it is money (`prices`'
    entries too), anywhere in a JSON document; null values (a price left to its default) are skipped."""
    items = found.items() if isinstance(found, dict) else enumerate(found) if isinstance(found, list) else []
    for k, v in items:
        here = f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]"
        named = isinstance(k, str) and bool(MONEY_KEY.search(k)) and not NOT_MONEY.search(k)
        is_money = (money or named) and not (isinstance(k, str) and NOT_MONEY.search(k))
        if isinstance(v, dict | list):
            yield from money_values(v, here, is_money)
        elif is_money and v is not None:
            yield here, v


def test_money_in_every_json_response_is_a_decimal_string(
    live_server: LiveServer, keys: dict[str, str], ask: object
) -> None:
    a = keys["a"]
    ask(keys["a_app"])  # type: ignore[operator]
    admin = keys["a_admin"]
    with http(live_server, admin) as adm:  # prices and a money budget in the policy
        policy = {
            "budgets": [{"period": "monthly", "money": "12.50"}],
            "prices": {t: {"prompt": "0.3", "completion": "0.9"} for t in ("small", "large")},
        }
        r = adm.put(f"/v1/admin/tenants/{a}/policy", json=policy)
        assert r.status_code == 200, r.text
    path = f"/v1/admin/tenants/{a}/policy"
    reads = [
        (keys["a_app"], "GET", "/v1/usage", None),
        (keys["a_finance"], "GET", "/v1/finance/costs?group_by=day,tier,model", None),
        (keys["a_finance"], "GET", "/v1/finance/savings", None),
        (keys["a_finance"], "GET", path, None),
        (admin, "GET", f"{path}/versions", None),
        (admin, "POST", f"{path}/dry-run", {"policy": {"sampling": {"max_tokens_cap": 1}}}),
    ]
    seen = 0
    for key, method, url, body in reads:
        with http(live_server, key) as client:
            r = client.request(method, url, json=body)
        assert r.status_code == 200, (url, r.text)
        for where, value in money_values(r.json()):
            seen += 1
            assert isinstance(value, str), f"{url}{where} is {value!r}, not a decimal string"
            Decimal(value)  # raises on anything but a number
    assert seen >= 20  # costs, savings by lever, prices and the budget were all looked at
