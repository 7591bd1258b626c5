"""Prompt logging is off by default and opt-in per tenant, through a live gateway on PostgreSQL.

Two tenants send the same kinds of requests, each with a marker string of its own: answered ones
(chat, streamed chat, completions), refused ones (schema, unsupported field, context too long, bad
UTF-8) and one that hits an unhandled error quoting its prompt. Every log line the process writes is
captured as the gateway's JSON formatter renders it, access log included. The opted-in tenant's
prompts and completions appear once per answered request, with its request id and tenant id; the
other tenant's text, every API key and every Authorization header never appear at all.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

import services
from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import create_key, create_tenant, tenant_by_name
from gateway.http.logging_setup import JSONFormatter
from live import LiveServer, serve_gateway


class Captured(logging.Handler):
    """Each record as the JSON log line it becomes, rendered when emitted (in the request's context)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(JSONFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def live(
    small_engine: AsyncEngine, postgres_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    url, drop = services.create_database(postgres_server)
    server, stop = serve_gateway(small_engine, tmp_path_factory.mktemp("home"), url)
    yield server
    stop()
    drop()


@pytest.fixture
def captured(live: LiveServer) -> Iterator[Captured]:
    """Every log line of the process, uvicorn's access log included (the test server sets it to warnings)."""
    handler, root = Captured(), logging.getLogger()
    uvicorn = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "uvicorn.access")]
    saved = (root.level, [(u.level, u.propagate) for u in uvicorn])
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    for u in uvicorn:
        u.setLevel(logging.INFO)
        u.propagate = True
    yield handler
    root.removeHandler(handler)
    root.setLevel(saved[0])
    for u, (level, propagate) in zip(uvicorn, saved[1], strict=True):
        u.setLevel(level)
        u.propagate = propagate


@dataclass
class Tenant:
    id: int
    key: str  # an app key: what sends the requests
    admin_key: str
    marker: str


def tenant(live: LiveServer, log_prompts: bool) -> Tenant:
    name = f"t-{uuid.uuid4().hex[:10]}"
    admin = create_tenant(live.db, name, role="admin").key
    if log_prompts:  # through the policy API, as an operator would
        r = httpx.put(
            f"{live.base_url}/v1/admin/tenants/{name}/policy",
            json={"logging": {"log_prompts": True}},
            headers={"Authorization": f"Bearer {admin}"},
        )
        assert r.status_code == 200 and r.json()["policy"]["logging"] == {"log_prompts": True}, r.text
    key = create_key(live.db, name, "app").key
    found = tenant_by_name(live.db, name)
    assert found is not None
    return Tenant(found.id, key, admin, f"ZEBRA-{uuid.uuid4().hex[:12]}")


def send_everything(live: LiveServer, t: Tenant) -> dict[str, str]:
    """The tenant's requests; returns the ids of the answered ones by kind."""
    chat, completions = f"{live.base_url}/v1/chat/completions", f"{live.base_url}/v1/completions"
    auth = {"Authorization": f"Bearer {t.key}"}
    say = [{"role": "user", "content": f"Repeat after me: {t.marker}"}]
    answered = {}
    r = httpx.post(chat, json={"model": "small", "messages": say, "max_tokens": 12, "temperature": 0}, headers=auth)
    assert r.status_code == 200, r.text
    answered["chat"] = r.json()["id"]
    body = {"model": "small", "messages": say, "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", chat, json=body, headers=auth, timeout=60) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    answered["stream"] = json.loads(events[0])["id"]
    r = httpx.post(completions, json={"model": "small", "prompt": t.marker, "max_tokens": 6}, headers=auth)
    assert r.status_code == 200, r.text
    answered["completion"] = r.json()["id"]

    refused = [
        httpx.post(chat, json={"model": "small", "messages": say, "temperature": 5}, headers=auth),
        httpx.post(chat, json={"model": "small", "messages": say, "audio": {"voice": "alloy"}}, headers=auth),
        httpx.post(
            chat, json={"model": "small", "messages": [{"role": "user", "content": t.marker * 3000}]}, headers=auth
        ),
        httpx.post(chat, content=json.dumps({"model": "small", "messages": say}).encode() + b"\xff", headers=auth),
        httpx.post(chat, json={"model": "small", "messages": say}, headers={"Authorization": f"Bearer {t.key}x"}),
    ]
    assert [r.status_code for r in refused] == [400, 400, 400, 400, 401]
    return answered


def test_prompts_are_logged_only_for_the_tenant_that_opted_in(
    live: LiveServer, captured: Captured, small_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    open_, shut = tenant(live, log_prompts=True), tenant(live, log_prompts=False)
    answered = send_everything(live, open_)
    for request_id in [*answered.values(), *send_everything(live, shut).values()]:
        assert live.wait_for_usage(request_id)  # billed, so its prompt line (if any) is written

    # An unhandled error whose message quotes the prompt, as a pydantic or KeyError message would.
    tokenizer, encode_chat = small_engine.engine.tokenizer, small_engine.engine.tokenizer.encode_chat

    def failing(messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if any("EXPLODE" in m["content"] for m in messages):
            raise KeyError(f"no template for {messages!r}")
        return encode_chat(messages, tools)

    monkeypatch.setattr(tokenizer, "encode_chat", failing)
    for t in (open_, shut):
        r = httpx.post(
            f"{live.base_url}/v1/chat/completions",
            json={"model": "small", "messages": [{"role": "user", "content": f"EXPLODE {t.marker}"}]},
            headers={"Authorization": f"Bearer {t.key}"},
        )
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"

    text = "\n".join(captured.lines)
    entries = [json.loads(line) for line in captured.lines]
    # The capture saw the requests at all: access lines (paths only) and the unhandled errors' stacks.
    assert any(e.get("path") == "/v1/chat/completions" and e.get("status") == 200 for e in entries)
    unhandled = [e for e in entries if e["message"].startswith("unhandled KeyError")]
    assert len(unhandled) == 2 and all(e["exc"].endswith("builtins.KeyError") for e in unhandled)

    for secret in (shut.marker, shut.key, shut.admin_key, open_.key, open_.admin_key, "Bearer", "EXPLODE"):
        assert secret not in text, [line for line in captured.lines if secret in line]
    logged = [e for e in entries if e["message"] == "prompt and completion"]
    assert {e["request_id"] for e in logged} == set(answered.values())  # once per answered request
    assert all(e["tenant_id"] == open_.id and e["outcome"] == "ok" for e in logged)
    assert all(any(open_.marker in p for p in e["prompts"]) for e in logged)
    assert all(e["completions"] and all(isinstance(c, str) for c in e["completions"]) for e in logged)
    # Only those lines: the refused requests and the failed one logged no text, opted in or not.
    assert [e for e in entries if open_.marker in json.dumps(e)] == logged


def test_the_logged_completion_is_the_answer(live: LiveServer, captured: Captured) -> None:
    t = tenant(live, log_prompts=True)
    r = httpx.post(
        f"{live.base_url}/v1/completions",
        json={"model": "small", "prompt": f"{t.marker} is", "max_tokens": 8, "temperature": 0, "n": 2},
        headers={"Authorization": f"Bearer {t.key}"},
    )
    assert r.status_code == 200
    live.wait_for_usage(r.json()["id"])
    (entry,) = [json.loads(line) for line in captured.lines if "prompt and completion" in line]
    assert entry["request_id"] == r.json()["id"] and entry["tier"] == "small"
    assert entry["prompts"] == [f"{t.marker} is"]  # one prompt, two choices
    assert entry["completions"] == [c["text"] for c in r.json()["choices"]]
