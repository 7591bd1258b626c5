"""The checks per kind of request through a live gateway (SmolLM2-135M as both tiers, as in test_cascade):
`prompt_examples` escalates a code answer that fails its prompt's doctest and keeps one that passes;
`program_of_thought` asks the tier that served for a program (`Context.ask`, set where the final checks
run) and escalates a planted wrong answer, keeping the right one. The answers are planted with a regex
`response_format`, so that which is right is known by construction, whatever the tiny model would say."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from core.db.database import Database
from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import create_key, create_tenant
from live import LiveServer, start_server

CODE_PROMPT = '''Complete the function in one ```python block.

```python
def add(a: int, b: int) -> int:
    """The sum of a and b.
    >>> add(2, 3)
    5
    """
```'''
RIGHT_CODE = "```python\ndef add(a, b):\n    return a + b\n```"
WRONG_CODE = "```python\ndef add(a, b):\n    return a - b\n```"
# SmolLM2-135M writes `print(2 + 3)` for this one (for "What is 2 + 3?" it wrote "# Your code here")
MATH_PROMPT = "Compute 2 + 3 with Python's print."


@pytest.fixture(scope="module")
def live(small_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from core.settings import Settings
    from gateway.app import create_app

    home = tmp_path_factory.mktemp("checks")
    url = f"sqlite:///{home / 'switchboard.db'}"
    db = Database(url)
    settings = Settings(home=home, database_url=url, tiers={"small": {"model": "unused"}, "large": {"model": "unused"}})
    server, stop = start_server(
        create_app(settings, engines={"small": small_engine, "large": small_engine}, database=db), db
    )
    yield server
    stop()
    db.dispose()


def tenant_key(live: LiveServer, checks: list[str]) -> str:
    name = f"t-{uuid.uuid4().hex[:10]}"
    admin = create_tenant(live.db, name, role="admin").key
    policy = {"verifiers": {"checks": checks, "cascade": True, "cascade_to": "large"}}
    r = httpx.put(
        f"{live.base_url}/v1/admin/tenants/{name}/policy", json=policy, headers={"Authorization": f"Bearer {admin}"}
    )
    assert r.status_code == 200, r.text
    return create_key(live.db, name, "app").key


def literal(text: str) -> str:
    """A regex matching exactly `text`."""
    return "".join(f"\\{c}" if c in r"\.^$*+?()[]{}|-/" else "\\n" if c == "\n" else c for c in text)


def planted(live: LiveServer, key: str, content: str, answer: str) -> httpx.Response:
    """A chat request whose answer is `answer`, to the letter (the grammar allows nothing else)."""
    body = {
        "model": "small",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 120,
        "response_format": {"type": "regex", "regex": literal(answer)},
        "cache": "no-store",
    }
    r = httpx.post(
        f"{live.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300
    )
    assert r.status_code == 200, r.text
    return r


def first_attempt_reason(live: LiveServer, r: httpx.Response) -> str:
    (first,) = live.wait_for_usage(r.headers["x-switchboard-cascade"].split("first=")[1])
    assert (first.tier, first.status) == ("small", "escalated")
    return first.verifier_actions[0]["reason"]


def test_prompt_examples_escalate_an_answer_that_fails_the_prompts_doctest(live: LiveServer) -> None:
    key = tenant_key(live, ["prompt_examples"])
    wrong = planted(live, key, CODE_PROMPT, WRONG_CODE)
    assert wrong.json()["choices"][0]["message"]["content"] == WRONG_CODE  # the plant took
    assert wrong.headers["x-switchboard-tier"] == "large"
    assert "0:prompt_examples:escalate@" in wrong.headers["x-switchboard-verifiers"]
    assert (
        first_attempt_reason(live, wrong)
        == "prompt examples fail: 1 of 1 examples fail; first: add(2, 3): expected '5', got '-1'"
    )
    right = planted(live, key, CODE_PROMPT, RIGHT_CODE)
    assert right.headers["x-switchboard-tier"] == "small" and "x-switchboard-cascade" not in right.headers
    assert right.headers["x-switchboard-verifiers"] == "none"


def test_program_of_thought_asks_the_serving_tier_and_escalates_a_planted_wrong_answer(live: LiveServer) -> None:
    key = tenant_key(live, ["program_of_thought"])
    wrong = planted(live, key, MATH_PROMPT, "The answer is 7.")
    assert wrong.headers["x-switchboard-tier"] == "large"
    assert "0:program_of_thought:escalate@" in wrong.headers["x-switchboard-verifiers"]
    # the tier was asked and its program ran: without `Context.ask` the check would have continued
    assert first_attempt_reason(live, wrong) == "the program prints 5, the answer 7"
    right = planted(live, key, MATH_PROMPT, "The answer is 5.")
    assert right.headers["x-switchboard-tier"] == "small" and right.headers["x-switchboard-verifiers"] == "none"
    (row,) = live.wait_for_usage(right.json()["id"])
    assert row.status == "ok" and row.verifier_actions == []
    # the program the check asked for is billed on this row at the small tier's prices, as a cost of the
    # verifier lever, and is no part of the always-large counterfactual
    usage = right.json()["usage"]
    assert row.prompt_tokens > usage["prompt_tokens"] and row.completion_tokens > usage["completion_tokens"]
    assert row.saved_verifier < 0
    levers = row.saved_routing + row.saved_cache + row.saved_speculation + row.saved_policy + row.saved_verifier
    assert row.counterfactual_cost - row.cost == levers
