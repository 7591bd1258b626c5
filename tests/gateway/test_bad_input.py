"""Bad input through a live gateway on PostgreSQL: every one is an OpenAI-shaped 4xx naming what is
wrong, never a 500, and none of them runs a generation or writes a usage row.

The two parsing attacks (100k levels of nesting, 100k messages) are also held to a CPU budget: the
gateway must refuse them at once, not after seconds of parsing, templating or tokenizing. It is CPU
time the process spent, not wall-clock time, so a busy machine does not change it.
"""

from __future__ import annotations

import json
import resource
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import services
from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import create_tenant
from live import LiveServer, serve_gateway

MESSAGES = [{"role": "user", "content": "Name the capital of France."}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_REQUEST_BYTES = 4 << 20  # room for the 100k-message body; the 10 MB one is still over


@pytest.fixture(scope="module")
def live(
    small_engine: AsyncEngine, postgres_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    url, drop = services.create_database(postgres_server)
    home: Path = tmp_path_factory.mktemp("home")
    server, stop = serve_gateway(small_engine, home, url, max_request_bytes=MAX_REQUEST_BYTES)
    yield server
    stop()
    drop()


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {live.new_key()}", "Content-Type": "application/json"}
    with httpx.Client(base_url=live.base_url, headers=headers, timeout=60) as client:
        yield client


def openai_error(r: httpx.Response, status: int, *, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert {"message", "type", "param", "code"} <= error.keys() and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # the server runs in this process's threads
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"model": "small", "messages": [{"role": "user", "content": "hello " * 9000}]}, "messages"),
        (COMPLETIONS, {"model": "small", "prompt": "hello " * 9000}, "prompt"),
        (COMPLETIONS, {"model": "small", "prompt": [504] * 8192}, "prompt"),  # token ids: no room to answer
        (CHAT, {"model": "small", "messages": MESSAGES, "max_tokens": 8192}, "messages"),
    ],
)
def test_a_prompt_longer_than_the_context_is_context_length_exceeded(
    live: LiveServer, http: httpx.Client, path: str, body: dict, param: str
) -> None:
    error = openai_error(http.post(path, json=body), 400, param=param, code="context_length_exceeded")
    assert "8192" in error["message"]  # SmolLM2's context, named so the client knows the limit


def test_a_ten_megabyte_body_is_413_declared_or_streamed(http: httpx.Client) -> None:
    content = b'{"model": "small", "messages": [{"role": "user", "content": "' + b"x" * (10 << 20) + b'"}]}'
    openai_error(http.post(CHAT, content=content), 413, code="request_too_large")

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield content[: 1 << 20]
        for start in range(1 << 20, len(content), 1 << 20):
            yield content[start : start + (1 << 20)]

    openai_error(http.post(CHAT, content=chunked()), 413, code="request_too_large")


@pytest.mark.parametrize(
    "content",
    [
        b'{"model": "small", "messages": [{"role": "user", "content": "caf\xe9 \xff\xfe"}]}',  # Latin-1, stray bytes
        b'{"model": "small", "messages": [{"role": "user", "content": "\xc3"}]}',  # a truncated sequence
    ],
)
def test_invalid_utf8_is_400(http: httpx.Client, content: bytes) -> None:
    openai_error(http.post(CHAT, content=content), 400)


def test_a_lone_surrogate_is_400_not_a_tokenizer_crash(http: httpx.Client) -> None:
    body = b'{"model": "small", "messages": [{"role": "user", "content": "a \\ud800 b"}]}'
    openai_error(http.post(CHAT, content=body), 400, param="messages.0.content")
    # Encoded as bytes (CESU-8) it is invalid UTF-8 that Python's JSON reader lets through as the same text.
    encoded = b'{"model": "small", "messages": [{"role": "user", "content": "a \xed\xa0\x80 b"}]}'
    openai_error(http.post(CHAT, content=encoded), 400, param="messages.0.content")
    openai_error(http.post(COMPLETIONS, content=b'{"model": "small", "prompt": "\\udfff"}'), 400, param="prompt")


@pytest.mark.parametrize(
    "content",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "small", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "x": ' + b'{"a": ' * 100_000,
    ],
    ids=["bare", "in-a-field", "unclosed-objects"],
)
def test_deeply_nested_json_is_400_at_once(live: LiveServer, http: httpx.Client, content: bytes) -> None:
    before = cpu_seconds()
    openai_error(http.post(CHAT, content=content), 400)
    assert cpu_seconds() - before < 1.0  # refused by the parser's depth limit, not after walking 100k levels
    assert httpx.get(f"{live.base_url}/healthz").json()["status"] == "ok"


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("text/plain", json.dumps({"model": "small", "messages": MESSAGES})),
        ("application/x-www-form-urlencoded", "model=small&messages=hi"),  # what `curl -d` sends by default
        ("application/xml", "<model>small</model>"),
    ],
)
def test_a_body_that_is_not_sent_as_json_is_400(http: httpx.Client, content_type: str, body: str) -> None:
    error = openai_error(
        http.post(CHAT, content=body, headers={"Content-Type": content_type}), 400, code="unsupported_content_type"
    )
    assert "application/json" in error["message"] and content_type in error["message"]


def test_a_json_body_without_a_content_type_is_400(live: LiveServer, http: httpx.Client) -> None:
    r = httpx.post(
        f"{live.base_url}{CHAT}",
        content=json.dumps({"model": "small", "messages": MESSAGES}),
        headers={"Authorization": http.headers["Authorization"]},
    )
    openai_error(r, 400, code="unsupported_content_type")


@pytest.mark.parametrize("content", [b"", b"[1, 2]", b'"hello"', b"42", b"null", b"true"])
def test_an_empty_body_or_json_that_is_not_an_object_is_400(http: httpx.Client, content: bytes) -> None:
    error = openai_error(http.post(CHAT, content=content), 400)
    assert error["message"] == "The request body must be a JSON object."


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"n": 10**12}, 400, "n"),
        ({"n": 10**40}, 400, "n"),  # beyond 64 bits
        ({"n": 0}, 400, "n"),
        ({"max_tokens": -5}, 400, "max_tokens"),
        ({"max_tokens": 2**40}, 400, "max_tokens"),  # more than a ledger column holds
        ({"max_completion_tokens": -1}, 400, "max_completion_tokens"),
        ({"max_tokens": "5"}, 400, "max_tokens"),  # a string is not a number
        ({"temperature": True}, 400, "temperature"),  # nor is a boolean
        ({"seed": 2**64}, 400, "seed"),  # torch seeds from 64 bits
        ({"stream": "yes"}, 400, "stream"),
        ({"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ],
)
def test_out_of_range_and_mistyped_fields_are_4xx_naming_the_field(
    http: httpx.Client, change: dict, status: int, param: str
) -> None:
    openai_error(http.post(CHAT, json={"model": "small", "messages": MESSAGES, **change}), status, param=param)


def test_a_hundred_thousand_messages_are_refused_at_once(http: httpx.Client) -> None:
    body = json.dumps({"model": "small", "messages": [{"role": "user", "content": ""}] * 100_000}).encode()
    assert len(body) < MAX_REQUEST_BYTES  # within the body limit: the schema has to refuse it
    before = cpu_seconds()
    openai_error(http.post(CHAT, content=body), 400, param="messages")
    # Templating and tokenizing them all before the context check took seconds of CPU.
    assert cpu_seconds() - before < 1.0
    prompts = json.dumps({"model": "small", "prompt": ["hi"] * 100_000}).encode()
    openai_error(http.post(COMPLETIONS, content=prompts), 400, param="prompt")


def test_vanishing_temperature_and_top_p_are_served_greedily(http: httpx.Client) -> None:
    """5e-324 is a valid float in (0, 1]; in the float32 sampler it is 0, and it once made the engine fail."""
    body = {"model": "small", "messages": MESSAGES, "max_tokens": 3}
    greedy = http.post(CHAT, json={**body, "temperature": 0})
    for extreme in ({"temperature": 5e-324}, {"top_p": 5e-324}, {"temperature": 1e-300, "top_p": 1e-300}):
        r = http.post(CHAT, json={**body, **extreme})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]


def test_refused_requests_write_no_usage_rows(live: LiveServer, http: httpx.Client) -> None:
    served = http.post(CHAT, json={"model": "small", "messages": MESSAGES, "max_tokens": 1})
    assert served.status_code == 200
    (row,) = live.wait_for_usage(served.json()["id"])
    before = len(live.usage_rows(tenant_id=row.tenant_id))
    refused = [
        http.post(CHAT, json={"model": "small", "messages": [{"role": "user", "content": "hello " * 9000}]}),
        http.post(CHAT, content=b"[" * 100_000),
        http.post(CHAT, json={"model": "small", "messages": MESSAGES, "n": 10**12}),
        http.post(COMPLETIONS, content=b'{"model": "small", "prompt": "\\udfff"}'),
    ]
    assert [r.status_code for r in refused] == [400, 400, 400, 400]
    again = http.post(CHAT, json={"model": "small", "messages": MESSAGES, "max_tokens": 1})
    assert len(live.wait_for_usage(again.json()["id"])) == 1
    assert len(live.usage_rows(tenant_id=row.tenant_id)) == before + 1  # the served one, nothing refused


def test_a_wrong_method_is_405_naming_every_method_the_path_serves(live: LiveServer, http: httpx.Client) -> None:
    error = openai_error(http.request("PATCH", "/v1/admin/tenants"), 405)
    assert error["message"] == "Method Not Allowed"
    r = http.request("DELETE", "/v1/admin/tenants/acme/policy")
    assert r.status_code == 405 and r.headers["allow"] == "GET, PUT"  # two routes share the path


def test_text_postgresql_cannot_store_is_422_before_it_reaches_sql(live: LiveServer) -> None:
    admin = {"Authorization": f"Bearer {create_tenant(live.db, 'acme', role='admin').key}"}
    policy = f"{live.base_url}/v1/admin/tenants/acme/policy"
    put = {"headers": {**admin, "Content-Type": "application/json"}}
    openai_error(httpx.put(policy, content=b'{"note": "a\\u0000b"}', **put), 422, param="note")
    openai_error(httpx.put(policy, content=b'{"note": "a\\ud800b"}', **put), 422, param="note")
    r = httpx.put(policy, content=b'{"sampling": {"default_stop": ["\\udfff"]}}', **put)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_policy"
    for method, path in [
        ("GET", "/v1/admin/tenants/a%00b/keys"),
        ("GET", "/v1/admin/audit?tenant=a%00b"),
        ("DELETE", "/v1/admin/keys/sk-sb-%00%00%00%00%00%00%00%00%00%00"),
    ]:  # refused by the tenant name's (or key prefix's) pattern
        openai_error(httpx.request(method, f"{live.base_url}{path}", headers=admin), 400)
    assert httpx.put(policy, json={"note": "fine"}, headers=admin).status_code == 200


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_nested_300_deep_is_a_400_on_every_wire_and_the_gateway_stays_up(
    live: LiveServer, http: httpx.Client
) -> None:
    """It raised RecursionError (a 500) where the tools were rendered; now the depth is checked before anything
    walks it, with a stack, not recursion."""
    deep, fine = _nested(300), _nested(20)
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    asks = [
        (CHAT, {"model": "small", "messages": MESSAGES, "tools": [tool]}, "tools.0.function.parameters"),
        (CHAT, {"model": "small", "messages": MESSAGES, "response_format": {"type": "json_schema",
         "json_schema": {"name": "x", "schema": deep}}}, "response_format.json_schema.schema"),
        ("/v1/responses", {"model": "small", "input": "hi", "tools": [{"type": "function", "name": "f",
         "parameters": deep}]}, "tools[0].parameters"),
        ("/v1/responses", {"model": "small", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
         "schema": deep}}}, "text.format.schema"),
    ]  # fmt: skip
    for path, body, param in asks:
        error = openai_error(http.post(path, json=body), 400, param=param)
        assert "nest at most" in error["message"]
    assert httpx.get(f"{live.base_url}/healthz", timeout=30).status_code == 200
    shallow = {"model": "small", "messages": MESSAGES, "max_tokens": 4,
               "tools": [{"type": "function", "function": {"name": "f", "parameters": fine}}]}  # fmt: skip
    assert http.post(CHAT, json=shallow).status_code == 200
