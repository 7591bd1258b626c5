"""Schemathesis against the gateway's own OpenAPI document, through a live server on PostgreSQL and Redis.

Every operation gets generated requests, valid and invalid, sent with an operator's admin key (its
finance key for the finance routes), and each answer must: not be a 5xx; have a status, content type,
headers and body the document declares; reject what the document says is invalid (a string for a
number, an unknown tenant name pattern, a date that is not YYYY-MM-DD); and be a 401 without the
key. Not checked: that everything valid by the schema is accepted, since some refusals cannot be
written as a schema (a prompt longer than the context, n × prompts over `max_n`, an unknown model).

The operator tenant's policy caps completions at 4 tokens, so requests that reach SmolLM2 stay short.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis

import services
from core.settings import Settings
from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import create_key, create_tenant, tenant_by_name
from gateway.api.deps import app_services
from gateway.app import create_app
from live import LiveServer, serve_gateway
from policies.policy import Policy, SamplingLimits

# The document of an app built like the live one (its routes do not depend on the running state).
DOC = create_app(Settings(tiers={"small": {"model": "unused"}}), engines={}).openapi()
CONFIG = {
    "generation": {
        "max-examples": 10,  # per operation and phase: the file runs in well under a minute
        "allow-extra-parameters": False,  # unknown query parameters are ignored, as most APIs do
        "database": "none",  # no example database written into the working tree
        "deterministic": True,  # the same cases every run: explore with more examples by hand, not in CI
    },
    "phases": {"stateful": {"enabled": False}},
    "checks": {"positive_data_acceptance": {"enabled": False}},  # see the module docstring
}
schema = schemathesis.openapi.from_dict(DOC, config=schemathesis.Config.from_dict(CONFIG))
KEYS: dict[str, str] = {}  # role -> key, filled by the `gateway` fixture


@schema.auth(refresh_interval=None)
class BearerKey:
    """Tells schemathesis the bearer scheme is taken care of (so it does not count a request without
    it as merely invalid data): coverage cases are built at collection, before any key exists, so the
    test sends the real key itself."""

    def get(self, case: schemathesis.Case, ctx: schemathesis.AuthContext) -> str:
        return "set-by-the-test"

    def set(self, case: schemathesis.Case, data: str, ctx: schemathesis.AuthContext) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


@pytest.fixture(scope="module")
def gateway(
    small_engine: AsyncEngine, postgres_server: str, redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    url, drop = services.create_database(postgres_server)
    home: Path = tmp_path_factory.mktemp("home")
    live, stop = serve_gateway(small_engine, home, url, redis_url=redis_server)
    ops = create_tenant(live.db, f"ops-{uuid.uuid4().hex}", operator=True, role="admin")
    tenant = tenant_by_name(live.db, ops.tenant)
    assert tenant is not None
    app_services(live.app).policies.save(
        tenant.id, Policy(sampling=SamplingLimits(max_tokens_cap=4)), "test", "short answers"
    )
    KEYS.update(admin=ops.key, finance=create_key(live.db, ops.tenant, "finance").key)
    yield live
    KEYS.clear()
    stop()
    drop()


def test_the_server_serves_the_document_under_test(gateway: LiveServer) -> None:
    assert httpx.get(f"{gateway.base_url}/openapi.json").json() == DOC


@schema.parametrize()
def test_no_server_errors_and_answers_as_documented(case: schemathesis.Case, gateway: LiveServer) -> None:
    key = KEYS["finance" if case.path.startswith("/v1/finance") else "admin"]
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str) and len(case.body["model"]) % 4:
        case.body["model"] = "small"  # most generations should reach the engine, some an unknown model
    case.call_and_validate(base_url=gateway.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
