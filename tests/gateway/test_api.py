"""The gateway through the official `openai` client and raw HTTP, on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import PreTrainedTokenizerBase

from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import authenticate, create_key, revoke_key
from live import LiveServer, start_server

MESSAGES = [{"role": "user", "content": "Name the capital of France."}]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture
def key(live_server: LiveServer) -> str:
    return live_server.new_key()


@pytest.fixture
def client(live_server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def prompt_ids(hf_tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_answers_and_counts_usage_like_the_tokenizer(
    live_server: LiveServer, client: openai.OpenAI, hf_tokenizer: PreTrainedTokenizerBase
) -> None:
    r = client.chat.completions.create(model="small", messages=MESSAGES, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text
    assert r.choices[0].finish_reason == "stop" and r.model == "small" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(prompt_ids(hf_tokenizer, MESSAGES))
    # the end-of-turn token is generated (and billed) but shows no text
    assert r.usage.completion_tokens == len(hf_tokenizer(text, add_special_tokens=False)["input_ids"]) + 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    (row,) = live_server.wait_for_usage(r.id)
    assert (row.prompt_tokens, row.completion_tokens, row.status, row.finish_reason, row.tier, row.endpoint) == (
        r.usage.prompt_tokens,
        r.usage.completion_tokens,
        "ok",
        "stop",
        "small",
        "chat.completions",
    )


def test_stream_concatenates_to_the_same_text(live_server: LiveServer, client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="small", messages=MESSAGES, temperature=0)
    stream = client.chat.completions.create(
        model="small", messages=MESSAGES, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert len({c.id for c in chunks}) == 1
    (row,) = live_server.wait_for_usage(chunks[0].id)
    assert row.completion_tokens == plain.usage.completion_tokens and row.status == "ok"


def test_stream_without_usage_option_sends_no_usage(client: openai.OpenAI) -> None:
    with client.chat.completions.create(model="small", messages=MESSAGES, temperature=0, stream=True) as stream:
        chunks = list(stream)
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_stop_strings(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="small", messages=MESSAGES, temperature=0, stop=["Paris", "Lyon"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == "The capital of France is "
    streamed = client.chat.completions.create(
        model="small", messages=MESSAGES, temperature=0, stop="Paris", stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "The capital of France is "


def test_max_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="small", messages=MESSAGES, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].message.content == "The capital of"
    r = client.chat.completions.create(model="small", messages=MESSAGES, temperature=0, max_completion_tokens=2)
    assert r.usage.completion_tokens == 2


def test_seed_and_n(client: openai.OpenAI) -> None:
    ask = dict(
        model="small",
        messages=[{"role": "user", "content": "Tell me a story."}],
        temperature=1.0,
        max_tokens=12,
        seed=42,
        n=2,
    )
    a, b = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 24 and a.usage.prompt_tokens == b.usage.prompt_tokens


def test_completions_endpoint(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="small", prompt=["The capital of France is", "1, 2, 3,"], max_tokens=5, temperature=0, n=2
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and "Paris" in r.choices[0].text
    assert r.choices[2].text.startswith(" 4")
    assert r.usage.completion_tokens == 20
    ids = client.completions.create(model="small", prompt=[504, 3575, 282, 4649, 314], max_tokens=5, temperature=0)
    assert "Paris" in ids.choices[0].text and ids.usage.prompt_tokens == 5
    streamed = client.completions.create(
        model="small", prompt="The capital of France is", max_tokens=5, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_models_and_health(live_server: LiveServer, client: openai.OpenAI) -> None:
    # the tier, and the operator's default aliases of the embedding model (`model_aliases`)
    assert [m.id for m in client.models.list()] == ["small", "text-embedding-3-small", "text-embedding-ada-002"]
    assert client.models.retrieve("small").id == "small"
    health = httpx.get(f"{live_server.base_url}/healthz").json()
    assert health["status"] == "ok" and health["database"] == "ok" and health["engines"]["small"]["alive"]


def assert_openai_error(
    response: httpx.Response, status: int, *, param: str | None = None, code: str | None = None
) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_bad_keys_are_401(live_server: LiveServer) -> None:
    bad = openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="sk-sb-not-a-real-key-0000", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model="small", messages=MESSAGES)
    assert info.value.status_code == 401
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["code"] == "invalid_api_key"
    url = f"{live_server.base_url}/v1/chat/completions"
    body = {"model": "small", "messages": MESSAGES}
    assert_openai_error(httpx.post(url, json=body), 401, code="missing_api_key")
    assert_openai_error(httpx.post(url, json=body, headers={"Authorization": "Basic abc"}), 401)
    key = live_server.new_key()
    revoke_key(live_server.db, key[:20])
    assert_openai_error(
        httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}), 401, code="invalid_api_key"
    )


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "small"}, 400, "messages"),
        ({"model": "small", "messages": []}, 400, "messages"),
        ({"model": "small", "messages": MESSAGES, "temperature": 5}, 400, "temperature"),
        ({"model": "small", "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "small", "messages": MESSAGES, "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": "small", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
        ({"model": "small", "messages": "hello"}, 400, "messages"),
        ({"model": "small", "messages": MESSAGES, "stop": ["a"] * 17}, 400, "stop"),
        ({"model": "small", "messages": MESSAGES, "n": 9}, 400, "n"),
        ({"model": "small", "messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
        ({"model": "small", "messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice"),
        ({"model": "small", "messages": MESSAGES, "audio": {"voice": "alloy"}}, 400, "audio"),
        ({"model": "small", "messages": MESSAGES, "max_tokens": 9000}, 400, "messages"),
        ({"model": "gpt-4o", "messages": MESSAGES}, 404, "model"),
    ],
)
def test_invalid_chat_requests_get_openai_errors(
    live_server: LiveServer, key: str, body: dict, status: int, param: str
) -> None:
    r = httpx.post(f"{live_server.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert_openai_error(r, status, param=param)


def test_malformed_bodies_are_4xx_never_500(live_server: LiveServer, key: str) -> None:
    url = f"{live_server.base_url}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    assert_openai_error(httpx.post(url, content=b'{"model": "small", "messages": [', headers=headers), 400)
    assert_openai_error(httpx.post(url, content=b"\xff\xfe not json", headers=headers), 400)
    assert_openai_error(httpx.post(url, content=b"[1, 2]", headers=headers), 400)
    assert_openai_error(httpx.post(url, content=b"", headers=headers), 400)
    huge = json.dumps({"model": "small", "messages": [{"role": "user", "content": "x" * 300_000}]})
    assert_openai_error(httpx.post(url, content=huge, headers=headers), 413, code="request_too_large")

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit must hold while the body streams in
        yield b'{"model": "small", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 10_000
        yield b'"}]}'

    assert_openai_error(httpx.post(url, content=chunked(), headers=headers), 413)
    assert_openai_error(httpx.get(f"{live_server.base_url}/v1/nothing-here", headers=headers), 404)
    assert_openai_error(httpx.get(url, headers=headers), 405)
    completions = f"{live_server.base_url}/v1/completions"
    assert_openai_error(
        httpx.post(completions, json={"model": "small", "prompt": ""}, headers=headers), 400, param="prompt"
    )
    assert_openai_error(httpx.post(completions, json={"model": "small", "prompt": [1, 10**9]}, headers=headers), 400)
    assert_openai_error(
        httpx.post(completions, json={"model": "small", "prompt": "x", "echo": True}, headers=headers),
        400,
        param="echo",
    )
    # None of those was billed: the key's only row is the one request that ran, sent last.
    ran = httpx.post(url, json={"model": "small", "messages": MESSAGES, "max_tokens": 2}, headers=headers, timeout=60)
    assert ran.status_code == 200, ran.text
    (row,) = live_server.wait_for_usage(ran.json()["id"])
    assert [r.request_id for r in live_server.usage_rows(tenant_id=row.tenant_id)] == [row.request_id]
    assert live_server.usage_rows(request_id=f"{row.request_id}-never-sent") == []


def test_usage_is_recorded_exactly_once_per_request(live_server: LiveServer, client: openai.OpenAI) -> None:
    tenant_id = None
    ids = []
    ids.append(client.chat.completions.create(model="small", messages=MESSAGES, max_tokens=4).id)
    ids.append(
        next(iter(client.chat.completions.create(model="small", messages=MESSAGES, max_tokens=4, stream=True))).id
    )
    ids.append(client.completions.create(model="small", prompt="Hello", max_tokens=4).id)
    with pytest.raises(openai.BadRequestError):  # rejected before it ran: no row
        client.chat.completions.create(model="small", messages=MESSAGES, max_tokens=9000)
    for rid in ids:
        (row,) = live_server.wait_for_usage(rid)
        tenant_id = row.tenant_id
    assert len(live_server.usage_rows(tenant_id=tenant_id)) == len(ids)


def test_client_leaving_a_stream_aborts_it_and_bills_what_ran(
    live_server: LiveServer, key: str, small_engine: AsyncEngine
) -> None:
    body = {
        "model": "small",
        "prompt": "List the numbers from 1 to 1000, one per line:\n1\n2\n",
        "max_tokens": 400,
        "stream": True,
        "temperature": 0,
    }
    with httpx.stream(
        "POST",
        f"{live_server.base_url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first[6:])["id"]
        for _ in range(5):
            next(lines)
    (row,) = live_server.wait_for_usage(request_id)
    assert row.status == "aborted" and row.finish_reason == "abort"
    assert 1 <= row.completion_tokens < 400
    deadline = time.monotonic() + 10
    while small_engine.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not small_engine.engine.has_unfinished()


def test_client_leaving_a_plain_request_aborts_it(live_server: LiveServer, key: str, small_engine: AsyncEngine) -> None:
    before = {r.request_id for r in live_server.usage_rows()}
    # greedy: a sampled run may end early by chance and answer before the client gives up
    body = {
        "model": "small",
        "prompt": "List the numbers from 1 to 1000, one per line:\n1\n2\n",
        "max_tokens": 400,
        "temperature": 0,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{live_server.base_url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(60, read=0.5),
        )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        new = [r for r in live_server.usage_rows() if r.request_id not in before]
        if new:
            break
        time.sleep(0.05)
    time.sleep(0.2)
    (row,) = [r for r in live_server.usage_rows() if r.request_id not in before]
    assert row.status == "aborted" and row.completion_tokens < 400
    assert not small_engine.engine.has_unfinished()


def test_engine_failure_is_an_openai_error_and_still_billed(
    live_server: LiveServer,
    key: str,
    client: openai.OpenAI,
    small_engine: AsyncEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_step = small_engine.engine.step
    state = {"calls": 0}

    def failing_third_step() -> list:
        state["calls"] += 1
        if state["calls"] == 3:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    monkeypatch.setattr(small_engine.engine, "step", failing_third_step)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="small", messages=MESSAGES, max_tokens=50, temperature=0)
    assert info.value.status_code == 500 and info.value.body["code"] == "engine_error"

    state["calls"] = 0
    # Greedy: the answer outlasts two steps (sampled at temperature 1, "Paris" + end could finish first).
    stream = client.chat.completions.create(model="small", messages=MESSAGES, max_tokens=50, temperature=0, stream=True)
    with pytest.raises(openai.APIError, match="engine failed"):
        for _ in stream:
            pass
    rows = live_server.usage_rows(tenant_id=authenticate(live_server.db, key).tenant_id)
    assert [(r.status, r.completion_tokens) for r in rows] == [("error", 2), ("error", 2)]


def test_a_stopped_engine_answers_503(small_engine: AsyncEngine, tmp_path: Path) -> None:
    from core.db.database import Database
    from core.settings import Settings
    from gateway.app import create_app

    stopped = AsyncEngine(small_engine.engine, name="stopped")  # its own loop; never steps
    url = f"sqlite:///{tmp_path / 'sb.db'}"
    db = Database(url)
    settings = Settings(home=tmp_path, database_url=url, tiers={"small": {"model": "unused"}})
    live, stop = start_server(create_app(settings, engines={"small": stopped}, database=db), db)
    try:
        stopped.shutdown()
        headers = {"Authorization": f"Bearer {live.new_key()}"}
        body = {"model": "small", "messages": MESSAGES}
        for stream in (False, True):
            r = httpx.post(f"{live.base_url}/v1/chat/completions", json={**body, "stream": stream}, headers=headers)
            assert_openai_error(r, 503, code="engine_unavailable")
        assert httpx.get(f"{live.base_url}/v1/models/small", headers=headers).status_code == 200
        health = httpx.get(f"{live.base_url}/healthz")
        assert health.status_code == 503 and health.json()["engines"]["small"]["alive"] is False
        assert live.usage_rows() == []
    finally:
        stop()
        db.dispose()


def test_engine_stats_need_an_admin_key(live_server: LiveServer, key: str) -> None:
    url = f"{live_server.base_url}/v1/engine/stats"
    denied = httpx.get(url, headers={"Authorization": f"Bearer {key}"})
    assert_openai_error(denied, 403)
    assert denied.json()["error"]["type"] == "permission_error"
    assert_openai_error(httpx.get(url), 401)
    principal = authenticate(live_server.db, key)
    assert principal is not None
    admin = create_key(live_server.db, principal.tenant_name, "admin").key
    stats = httpx.get(url, headers={"Authorization": f"Bearer {admin}"})
    assert stats.status_code == 200
    small = stats.json()["small"]
    assert small["alive"] is True and small["kv_blocks_total"] > 0 and small["block_size"] == 16
    assert {"waiting", "running", "kv_utilization", "prefix_hit_rate", "step_ms_p50", "preemptions"} <= small.keys()


def test_response_format_json_schema_and_regex(live_server: LiveServer, client: openai.OpenAI) -> None:
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    asked = [{"role": "user", "content": "Name the capital of France and its country, as JSON."}]
    r = client.chat.completions.create(model="small", messages=asked, temperature=0, response_format=fmt)
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, schema)
    assert r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model="small", messages=asked, temperature=0.8, seed=3, response_format=fmt, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    jsonschema.validate(json.loads(text), schema)
    any_json = client.chat.completions.create(
        model="small", messages=asked, temperature=0, response_format={"type": "json_object"}, max_tokens=200
    )
    assert isinstance(json.loads(any_json.choices[0].message.content), dict)
    pattern = {"type": "regex", "regex": "(Paris|Lyon|Nice)"}
    r = client.chat.completions.create(
        model="small", messages=asked, temperature=0, extra_body={"response_format": pattern}
    )
    assert r.choices[0].message.content in ("Paris", "Lyon", "Nice")
    # the cache keys on the format: the same question as plain text is another answer
    plain = client.chat.completions.create(model="small", messages=asked, temperature=0)
    assert plain.choices[0].message.content != r.choices[0].message.content


def test_bad_response_formats_are_4xx_naming_the_field(client: openai.OpenAI) -> None:
    # what the grammar compiler refuses and what the request's shape gets wrong are both 400s naming the field
    for fmt, status, fragment in (
        ({"type": "regex", "regex": "(unclosed"}, 400, "regex"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}, 400, "schema"),
        ({"type": "json_schema"}, 400, "json_schema"),
        ({"type": "xml"}, 400, "type"),
    ):
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="small", messages=MESSAGES, extra_body={"response_format": fmt})
        assert err.value.status_code == status, (fmt, err.value)
        assert "response_format" in json.dumps(err.value.body) and fragment in json.dumps(err.value.body)


def test_a_probe_check_needs_a_trained_probe(live_server: LiveServer) -> None:
    from gateway.accounting.tenants import create_tenant

    name = f"t-{uuid.uuid4().hex[:10]}"
    admin = create_tenant(live_server.db, name, role="admin").key
    r = httpx.put(
        f"{live_server.base_url}/v1/admin/tenants/{name}/policy",
        json={"verifiers": {"checks": ["math", "probe"]}},
        headers={"Authorization": f"Bearer {admin}"},
    )
    assert r.status_code == 422 and r.json()["error"]["param"] == "verifiers.checks", r.text
    assert "switchboard verifiers train-probe" in r.json()["error"]["message"]


def test_policy_verifiers_stop_a_loop_and_report_it(live_server: LiveServer) -> None:
    from gateway.accounting.tenants import create_key, create_tenant

    name = f"t-{uuid.uuid4().hex[:10]}"
    admin = create_tenant(live_server.db, name, role="admin").key
    policy = {"verifiers": {"enabled": ["degeneration"], "every_n_tokens": 8, "degeneration": {"min_tokens": 24}}}
    r = httpx.put(
        f"{live_server.base_url}/v1/admin/tenants/{name}/policy",
        json=policy,
        headers={"Authorization": f"Bearer {admin}"},
    )
    assert r.status_code == 200, r.text
    key = create_key(live_server.db, name, "app").key
    # SmolLM2 repeats this greedily; "the the ..." looped on Zen 5 but not on an Intel Xeon with AMX
    loop = {"model": "small", "prompt": "a b a b a b a b a b a b", "temperature": 0, "max_tokens": 200}
    r = httpx.post(
        f"{live_server.base_url}/v1/completions",
        json={**loop, "cache": "no-store"},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] < 64
    assert re.fullmatch(r"0:degeneration:stop@\d+", r.headers["x-switchboard-verifiers"]), r.headers
    (row,) = live_server.wait_for_usage(body["id"])
    assert row.verifier_actions[0]["verifier"] == "degeneration" and row.verifier_actions[0]["action"] == "stop"
    assert row.saved_verifier > 0 and row.counterfactual_cost > row.cost
    # without the policy the same request runs to its cap
    plain_key = live_server.new_key()
    r = httpx.post(
        f"{live_server.base_url}/v1/completions",
        json={**loop, "cache": "no-store"},
        headers={"Authorization": f"Bearer {plain_key}"},
        timeout=120,
    )
    assert (
        r.json()["usage"]["completion_tokens"] == 200
    )  # the default policy's check (code examples) has nothing to run
    assert r.headers["x-switchboard-verifiers"] == "none"
