"""Observability through a live gateway serving SmolLM2: `GET /metrics` counters agree with the
ledger, engine gauges are read at scrape time, 429s are counted; JSON logs carry request ids and
never a prompt or a completion."""

from __future__ import annotations

import io
import json
import logging
import math
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import authenticate
from gateway.api.deps import app_config, app_services, set_config
from gateway.http.logging_setup import configure, request_id_var
from live import LiveServer, start_server
from policies.policy import Policy

QUESTION = [{"role": "user", "content": "Name the capital of France."}]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def server(small_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from core.db.database import Database
    from core.settings import Settings
    from gateway.app import create_app

    home: Path = tmp_path_factory.mktemp("home")
    url = f"sqlite:///{home / 'switchboard.db'}"
    db = Database(url)
    settings = Settings(home=home, database_url=url, tiers={"small": {"model": "unused"}})
    live, stop = start_server(create_app(settings, engines={"small": small_engine}, database=db), db)
    yield live
    stop()
    db.dispose()


def scrape(live: LiveServer, **headers: str) -> Samples:
    r = httpx.get(f"{live.base_url}/metrics", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def client_for(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(api_key=live.new_key(), base_url=f"{live.base_url}/v1", max_retries=0, timeout=120)


def test_counters_agree_with_the_ledger(server: LiveServer) -> None:
    client = client_for(server)
    ids, statuses = [], []
    for _ in range(2):  # the same deterministic request twice: a miss, then a hit
        raw = client.chat.completions.with_raw_response.create(
            model="small",
            messages=QUESTION,
            temperature=0,
            max_tokens=12,  # type: ignore[arg-type]
        )
        statuses.append(raw.headers["x-switchboard-cache"])
        ids.append(raw.parse().id)
    assert statuses == ["miss", "hit"]
    rows = [row for rid in ids for row in server.wait_for_usage(rid)]
    assert len(rows) == 2
    everything = server.usage_rows()  # every row this app wrote: the counters cover exactly these
    m = scrape(server)

    for status in ("miss", "hit"):
        expected = sum(1 for r in everything if r.cache_status == status)
        got = value(
            m, "switchboard_requests_total", tier="small", endpoint="chat.completions", status="ok", cache=status
        )
        assert got == expected >= 1
    kinds = {
        "prompt": "prompt_tokens",
        "cached_prompt": "cached_prompt_tokens",
        "completion": "completion_tokens",
        "draft_proposed": "draft_proposed",
        "draft_accepted": "draft_accepted",
    }
    for kind, column in kinds.items():
        assert value(m, "switchboard_tokens_total", tier="small", kind=kind) == sum(
            getattr(r, column) for r in everything
        )
    assert value(m, "switchboard_tokens_total", tier="small", kind="completion") > 0
    cost = float(sum(r.cost for r in everything))
    assert cost > 0 and math.isclose(value(m, "switchboard_cost_usd_total", tier="small"), cost, rel_tol=1e-9)
    counterfactual = float(sum(r.counterfactual_cost for r in everything))
    assert math.isclose(value(m, "switchboard_counterfactual_cost_usd_total", tier="small"), counterfactual)
    assert value(m, "switchboard_routed_requests_total", tier="small", route="direct") == len(everything)

    # first-token latency: one observation per request the engine ran (cache hits run nothing)
    engine_runs = sum(1 for r in everything if r.cache_status not in ("hit", "semantic-hit"))
    assert value(m, "switchboard_ttft_seconds_count", tier="small") == engine_runs >= 1
    assert value(m, "switchboard_ttft_seconds_sum", tier="small") > 0
    assert value(m, "switchboard_time_per_output_token_seconds_count", tier="small") == engine_runs

    # engine gauges, read at scrape time
    assert ("switchboard_kv_utilization", frozenset({("tier", "small")})) in m
    assert 0.0 <= value(m, "switchboard_kv_utilization", tier="small") <= 1.0
    assert value(m, "switchboard_kv_blocks_capacity", tier="small") > 0
    assert value(m, "switchboard_engine_alive", tier="small") == 1.0
    assert ("switchboard_engine_waiting", frozenset({("tier", "small")})) in m
    assert value(m, "switchboard_cache_errors_total", cache="response") == 0.0


def test_rate_limit_429s_are_counted(server: LiveServer) -> None:
    key = server.new_key()
    who = authenticate(server.db, key)
    assert who is not None
    app_services(server.app).policies.save(
        who.tenant_id, Policy.model_validate({"rate_limits": {"key_rpm": 1}}), "test"
    )
    before = value(scrape(server), "switchboard_throttled_requests_total", reason="rate_limit")
    client = openai.OpenAI(api_key=key, base_url=f"{server.base_url}/v1", max_retries=0, timeout=120)
    client.chat.completions.create(model="small", messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="small", messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]
    after = value(scrape(server), "switchboard_throttled_requests_total", reason="rate_limit")
    assert after == before + 1


def test_metrics_can_require_an_admin_key(server: LiveServer) -> None:
    config = app_config(server.app)
    set_config(server.app, replace(config, settings=config.settings.model_copy(update={"metrics_public": False})))
    try:
        assert httpx.get(f"{server.base_url}/metrics").status_code == 401
        app_key = server.new_key()
        assert (
            httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {app_key}"}).status_code == 403
        )
        from gateway.accounting.tenants import create_tenant

        admin = create_tenant(server.db, f"ops-{uuid.uuid4().hex[:8]}", role="admin").key
        scrape(server, Authorization=f"Bearer {admin}")
    finally:
        set_config(server.app, config)


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    """The gateway's JSON logging into a buffer, at DEBUG; the root logger and uvicorn's restored after."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    access = logging.getLogger("uvicorn.access")
    saved_access = (list(access.handlers), access.level, access.propagate)
    buffer = io.StringIO()
    configure("debug", "json", logging.StreamHandler(buffer))
    access.setLevel(logging.INFO)  # the test server runs uvicorn at warning; its access lines are under test
    quiet = [logging.getLogger(n) for n in ("openai", "httpx", "httpcore")]
    levels = [q.level for q in quiet]
    for q in quiet:  # the client's own debug logs (request bodies) are not the gateway's
        q.setLevel(logging.WARNING)
    try:
        yield buffer
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
        access.handlers[:] = saved_access[0]
        access.setLevel(saved_access[1])
        access.propagate = saved_access[2]


def test_logs_are_json_with_request_ids(json_logs: io.StringIO) -> None:
    token = request_id_var.set("rid-direct-1")
    try:
        logging.getLogger("gateway.test").info("stored %d rows", 3, extra={"tenant_id": 7})
    finally:
        request_id_var.reset(token)
    logging.getLogger("gateway.test").warning("outside any request")
    first, second = (json.loads(line) for line in json_logs.getvalue().splitlines())
    assert first["message"] == "stored 3 rows" and first["request_id"] == "rid-direct-1"
    assert first["level"] == "INFO" and first["logger"] == "gateway.test" and first["tenant_id"] == 7
    assert first["ts"].endswith("Z")
    assert "request_id" not in second


def test_a_chat_request_logs_its_id_and_never_its_text(server: LiveServer, json_logs: io.StringIO) -> None:
    secret = f"zebra-quokka-{uuid.uuid4().hex[:8]}"
    client = client_for(server)
    raw = client.chat.completions.with_raw_response.create(
        model="small",
        messages=[{"role": "user", "content": f"Repeat after me: {secret}"}],
        temperature=0,
        max_tokens=16,
        extra_headers={"x-request-id": "rid-from-client-42"},
    )
    answer = raw.parse()
    # the completion's id takes over: response body, header, ledger row and log lines agree
    assert raw.headers["x-request-id"] == answer.id
    completion = answer.choices[0].message.content or ""
    assert server.wait_for_usage(answer.id)
    lines = [json.loads(line) for line in json_logs.getvalue().splitlines()]  # every line is JSON
    access = [e for e in lines if e["logger"] == "uvicorn.access" and e.get("path") == "/v1/chat/completions"]
    assert access and access[0]["request_id"] == answer.id and access[0]["status"] == 200
    text = json_logs.getvalue()
    assert secret not in text and "Repeat after me" not in text
    if len(completion.strip()) >= 8:  # a long enough completion to be unmistakable
        assert completion.strip() not in text
    # elsewhere the client's id is echoed and logged; a request without one gets a fresh one
    r = httpx.get(f"{server.base_url}/healthz", headers={"x-request-id": "rid-from-client-42"})
    assert r.headers["x-request-id"] == "rid-from-client-42"
    health = [e for e in map(json.loads, json_logs.getvalue().splitlines()) if e.get("path") == "/healthz"]
    assert health and health[0]["request_id"] == "rid-from-client-42"
    assert len(httpx.get(f"{server.base_url}/healthz").headers["x-request-id"]) == 32


def test_metrics_and_logs_name_no_tenant_and_no_key(server: LiveServer, json_logs: io.StringIO) -> None:
    """Metrics are labelled by tier, never by tenant: a scrape (which an operator may share) tells nothing of
    who sent what, and neither do the logs. Two tenants with unmistakable names send a request each."""
    from gateway.accounting.tenants import create_tenant

    tenants = {f"acme-{uuid.uuid4().hex[:8]}": None, f"globex-{uuid.uuid4().hex[:8]}": None}
    for name in tenants:
        issued = create_tenant(server.db, name)
        who = authenticate(server.db, issued.key)
        assert who is not None
        tenants[name] = (issued.key, who.tenant_id)  # type: ignore[assignment]
        client = openai.OpenAI(api_key=issued.key, base_url=f"{server.base_url}/v1", max_retries=0, timeout=120)
        client.chat.completions.create(model="small", messages=QUESTION, max_tokens=4, seed=1)
    r = httpx.get(f"{server.base_url}/metrics", timeout=30)
    labels = {k for family in text_string_to_metric_families(r.text) for s in family.samples for k in s.labels}
    assert labels and not {k for k in labels if "tenant" in k or "key" in k or "user" in k}
    logs = json_logs.getvalue()
    for name, (key, _) in tenants.items():  # type: ignore[misc]
        assert name not in r.text and key not in r.text
        assert name not in logs and key not in logs and key[:16] not in logs
