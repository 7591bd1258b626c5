"""`logprobs` / `top_logprobs` (chat), `logprobs` (completions) and `logit_bias` through a live gateway and the
official `openai` client, on SmolLM2-135M in bf16: the numbers are transformers' own log-softmax for the same
prompt and tokens (its `LlamaForCausalLM`, fp32) within bf16 tolerance, the same alone or batched, streamed or
not; the listed tokens spell the answer; the bias moves the choice; bad values are 400 naming the field."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from cpu_features import BF16_BATCH_VARIES

from engines.async_engine import AsyncEngine
from live import LiveServer

ASK = [{"role": "user", "content": "Name the capital of France."}]
BF16_TOLERANCE = 0.15  # |ours − transformers fp32| per token: bf16 weights and activations against fp32
NO_STORE = {"x-switchboard-cache-control": "no-store"}


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    common = dict(model="small", messages=ASK, temperature=0, max_tokens=12, extra_headers=NO_STORE)
    return client.chat.completions.create(**{**common, **kwargs})


def test_chat_logprobs_are_transformers_log_softmax(
    client: openai.OpenAI, small_engine: AsyncEngine, smollm2_dir: Path
) -> None:
    from transformers import LlamaForCausalLM

    r = chat(client, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in entries).decode() == r.choices[0].message.content  # they spell it
    for e in entries:  # greedy: the chosen token is the most likely one, listed first among the alternatives
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == e.logprob and e.logprob <= 0
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    tok = small_engine.tokenizer
    prompt = tok.encode_chat(ASK)
    answer = tok.encode(r.choices[0].message.content, add_special_tokens=False)
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, -1)
    got = [e.logprob for e in entries]
    assert len(got) == len(answer)
    worst = max(abs(g - float(expected[j, t])) for j, (g, t) in enumerate(zip(got, answer, strict=True)))
    assert worst < BF16_TOLERANCE, worst
    top = expected[0].topk(3)
    assert [e.token for e in entries[0].top_logprobs] == [tok.token_bytes(i).decode() for i in top.indices.tolist()]


@BF16_BATCH_VARIES  # the shared engine is bf16: on AMX a decode step of 4 rows may round otherwise than 1
def test_the_numbers_do_not_depend_on_batching_or_streaming(client: openai.OpenAI) -> None:
    alone = chat(client, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    others = [[{"role": "user", "content": q}] for q in ("Count to five.", "Say hello.", "What is 2 + 2?")]
    with ThreadPoolExecutor(4) as pool:  # the same request again, sharing its steps with three others
        futures = [pool.submit(chat, client, messages=m, logprobs=True) for m in others]
        batched = chat(client, logprobs=True, top_logprobs=2).choices[0].logprobs.content
        assert all(f.result().choices[0].logprobs.content for f in futures)
    assert [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in batched] == [
        (e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in alone
    ]
    streamed = []
    for c in chat(client, logprobs=True, top_logprobs=2, stream=True):
        if c.choices and c.choices[0].logprobs:
            streamed += c.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in alone]


def test_completions_logprobs_list_tokens_offsets_and_alternatives(client: openai.OpenAI) -> None:
    r = client.completions.create(model="small", prompt="The capital of France is", temperature=0, logprobs=2,
                                  max_tokens=6, extra_headers=NO_STORE)  # fmt: skip
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert "".join(lp.tokens) == text and len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(
        len(top) <= 2 and max(top.values()) == p for top, p in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    plain = client.completions.create(model="small", prompt="The capital of France is", temperature=0, max_tokens=6)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == text


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI, small_engine: AsyncEngine) -> None:
    first = chat(client, logprobs=True).choices[0].logprobs.content[0]
    banned = small_engine.tokenizer.encode(first.token, add_special_tokens=False)[0]
    r = chat(client, logprobs=True, logit_bias={str(banned): -100})
    assert r.choices[0].logprobs.content[0].token != first.token
    forced = small_engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = chat(client, logit_bias={str(forced): 100}, max_tokens=3)
    assert r.choices[0].message.content.startswith(" banana banana")


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"top_logprobs": 2}, 400, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"logit_bias": {"hello": 5}}, 400, "logit_bias"),
        ({"logit_bias": {"99999999": 5}}, 400, "logit_bias"),
        ({"logit_bias": {"5": 101}}, 400, "logit_bias.5"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    ],
)
def test_bad_logprobs_and_bias_are_errors_naming_the_field(
    live: LiveServer, extra: dict[str, Any], status: int, param: str
) -> None:
    r = httpx.post(f"{live.base_url}/v1/chat/completions", json={"model": "small", "messages": ASK, **extra},
                   headers={"Authorization": f"Bearer {live.new_key()}"}, timeout=120)  # fmt: skip
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
