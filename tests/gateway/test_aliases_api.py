"""Model aliases on a live gateway: the names apps hard-code reach a tier, `auto` or the embedding model, on every
wire format, operator-wide (`model_aliases`) and per tenant (the policy's `aliases`, audited like any policy
change); responses keep the name asked for, the ledger keeps it beside the tier; `/v1/models` lists what a key may
call; a tenant's aliases are its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import create_tenant
from live import LiveServer, serve_gateway

OPERATOR = {"gpt-4o-mini": "small", "text-embedding-3-small": "minilm"}
ASK = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def live(small_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    home: Path = tmp_path_factory.mktemp("aliases")
    server, stop = serve_gateway(small_engine, home, f"sqlite:///{home / 'db.sqlite'}", model_aliases=OPERATOR)
    yield server
    stop()


def tenant(live: LiveServer) -> tuple[str, str]:
    """A new tenant's name and its admin key (which may edit the tenant's own policy)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    return name, create_tenant(live.db, name, role="admin").key


def put_policy(live: LiveServer, name: str, key: str, policy: dict) -> httpx.Response:
    return httpx.put(f"{live.base_url}/v1/admin/tenants/{name}/policy", json=policy,
                     headers={"Authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip


def test_an_operator_alias_serves_every_wire_and_the_ledger_keeps_both_names(live: LiveServer) -> None:
    _, key = tenant(live)
    client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=ASK, max_tokens=4)
    chat = raw.parse()
    assert chat.model == "gpt-4o-mini" and raw.headers["x-switchboard-tier"] == "small"
    (row,) = live.wait_for_usage(chat.id)
    assert (row.requested_model, row.tier) == ("gpt-4o-mini", "small")
    response = client.responses.create(model="gpt-4o-mini", input="Say hi.", max_output_tokens=4)
    assert response.model == "gpt-4o-mini" and live.wait_for_usage(response.id)[0].tier == "small"
    message = httpx.post(f"{live.base_url}/v1/messages", headers={"x-api-key": key}, timeout=60,
                         json={"model": "gpt-4o-mini", "max_tokens": 4, "messages": ASK}).json()  # fmt: skip
    assert message["model"] == "gpt-4o-mini" and live.wait_for_usage(message["id"])[0].tier == "small"
    embedded = client.embeddings.create(model="text-embedding-3-small", input="hi")
    assert len(embedded.data[0].embedding) == 384
    (row,) = live.usage_rows(endpoint="embeddings", tenant_id=live.usage_rows(request_id=chat.id)[0].tenant_id)
    assert (row.requested_model, row.tier) == ("text-embedding-3-small", "minilm")
    assert {"small", "gpt-4o-mini", "text-embedding-3-small"} <= {m.id for m in client.models.list()}


def test_a_tenants_aliases_are_its_own_and_checked(live: LiveServer) -> None:
    name, key = tenant(live)
    assert (
        put_policy(live, name, key, {"aliases": {"claude-haiku-4-5": "small", "default": "minilm"}}).status_code == 200
    )
    mine = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=key, max_retries=0)
    assert (
        mine.chat.completions.create(model="claude-haiku-4-5", messages=ASK, max_tokens=2).model == "claude-haiku-4-5"
    )
    assert mine.embeddings.create(model="default", input="hi").data  # was a 404 naming minilm
    assert {"claude-haiku-4-5", "default"} <= {m.id for m in mine.models.list()}
    assert mine.models.retrieve("claude-haiku-4-5").id == "claude-haiku-4-5"
    _, other_key = tenant(live)
    theirs = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=other_key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        theirs.chat.completions.create(model="claude-haiku-4-5", messages=ASK, max_tokens=2)
    assert "claude-haiku-4-5" not in {m.id for m in theirs.models.list()}
    for aliases, param in (({"x": "ghost"}, "aliases.x"), ({"small": "small"}, "aliases.small")):
        r = put_policy(live, name, key, {"aliases": aliases})
        assert r.status_code == 422 and r.json()["error"]["param"] == param, r.text
    audit = httpx.get(f"{live.base_url}/v1/admin/audit", params={"tenant": name},
                      headers={"Authorization": f"Bearer {key}"}, timeout=30).json()  # fmt: skip
    assert any((entry.get("after") or {}).get("aliases") for entry in audit)


def test_anthropics_client_lists_the_models_with_its_key_header(live: LiveServer) -> None:
    anthropic = pytest.importorskip("anthropic")
    _, key = tenant(live)
    models = anthropic.Anthropic(base_url=live.base_url, api_key=key, max_retries=0).models.list()
    assert {"small", "gpt-4o-mini"} <= {m.id for m in models.data} and models.data[0].type == "model"
