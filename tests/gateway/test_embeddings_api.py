"""`POST /v1/embeddings` through a live gateway and the official `openai` client: the vectors are
sentence-transformers' own for all-MiniLM-L6-v2 (its `SentenceTransformer`, run directly), as floats or base64,
from text or token ids; each request is one ledger row priced in Decimal and held to the tenant's rate limits;
bad input is a 4xx naming the field."""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from core.embedder import minilm_path
from gateway.accounting.tenants import authenticate
from live import LiveServer
from policies.policy import PER_MILLION, Policy, RateLimits

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "héllo wörld"]


@pytest.fixture(scope="module")
def reference() -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path()), device="cpu")


def post(live: LiveServer, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{live.base_url}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )


def test_vectors_are_sentence_transformers_own_and_billed_once(live: LiveServer, reference: Any) -> None:
    key = live.new_key()
    client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=key, max_retries=0)
    r = client.embeddings.create(model="minilm", input=TEXTS)  # the client asks for base64 and decodes it
    expected = reference.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert got.shape == (3, 384) and [d.index for d in r.data] == [0, 1, 2] and r.model == "minilm"
    assert np.abs(got - expected).max() < 1e-5
    counts = [len(reference.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(counts)
    floats = post(live, key, {"model": "all-MiniLM-L6-v2", "input": TEXTS[1], "encoding_format": "float"})
    assert floats.status_code == 200
    assert np.abs(np.array(floats.json()["data"][0]["embedding"]) - expected[1]).max() < 1e-5
    ids = reference.tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]
    by_ids = post(live, key, {"model": "minilm", "input": [ids], "encoding_format": "float"}).json()
    assert np.abs(np.array(by_ids["data"][0]["embedding"]) - expected[0]).max() < 1e-5
    tenant = authenticate(live.db, key)
    assert tenant is not None
    rows = {row.request_id: row for row in live.usage_rows(tenant_id=tenant.tenant_id)}
    assert len(rows) == 3 and all(row.endpoint == "embeddings" and row.tier == "minilm" for row in rows.values())
    (first,) = [row for row in rows.values() if row.prompt_tokens == sum(counts)]
    assert first.completion_tokens == 0 and first.status == "ok"
    assert first.cost == Decimal(sum(counts)) * Decimal("0.01") / PER_MILLION == first.counterfactual_cost


def test_embeddings_are_held_to_rate_limits(live: LiveServer) -> None:
    key = live.new_key()
    who = authenticate(live.db, key)
    assert who is not None
    from policies.store import PolicyStore

    PolicyStore(live.db).save(who.tenant_id, Policy(rate_limits=RateLimits(key_rpm=1)), actor="test")
    if (second := time.time() % 60) > 55:  # the counters' windows are calendar minutes: both requests in one
        time.sleep(60.5 - second)
    assert post(live, key, {"model": "minilm", "input": "one"}).status_code == 200
    refused = post(live, key, {"model": "minilm", "input": "two"})
    assert refused.status_code == 429 and refused.json()["error"]["code"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "minilm", "input": "x", "dimensions": 128}, 400, "dimensions"),
        ({"model": "minilm", "input": ["fine", "word " * 300]}, 400, "input[1]"),
        ({"model": "minilm", "input": [[1, 2, 99999999]]}, 400, "input[0]"),
        ({"model": "text-embedding-4-huge", "input": "x"}, 404, "model"),
        ({"model": "small", "input": "x"}, 404, "model"),  # a chat tier
        ({"model": "minilm", "input": []}, 400, "input"),
        ({"model": "minilm", "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ],
)
def test_bad_embedding_requests_name_the_field_and_bill_nothing(
    live: LiveServer, body: dict[str, Any], status: int, param: str
) -> None:
    key = live.new_key()
    r = post(live, key, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param or r.json()["error"]["param"].startswith(param)
    who = authenticate(live.db, key)
    assert who is not None and live.usage_rows(tenant_id=who.tenant_id) == []
