"""`model: "auto"` on the small tier's hidden state with three tiers, through a live gateway.

The router is trained here on synthetic labels with `tiny_ok`, its hidden-state classifiers on states the
gateway's own small engine computes (SmolLM2, layer 20), so the states the gateway reads at serving time are
the ones it was trained on. tiny, small and large are all that one engine: what is under test is the
gateway's side (the prefill-only request in the engine's batches, the cheapest tier that meets the floor,
the text fallback, the prefix cache reuse), not the models.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

import services
from core.db.database import Database
from core.settings import Settings
from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import create_tenant, tenant_by_name
from gateway.api.deps import app_services
from gateway.app import create_app
from live import LiveServer, start_server
from policies.policy import Policy, RouterSettings
from router_model.encoder import RouterEncoder
from router_model.examples import Example, split_examples
from router_model.hidden import HiddenSpec
from router_model.model import LARGE, SMALL, cheapest_tier, load_router, save_router
from router_model.synthetic import synthetic_examples
from router_model.train import HiddenData, train_router

LAYER = 20
TIERS = {"tiny": {"model": "unused"}, "small": {"model": "unused"}, "large": {"model": "unused"}}
MODEL = "unused@bf16/bf16"  # `router_model.label.tier_model` of the small tier above
# > one 16-token KV block after the chat template, so the routing prefill leaves full blocks cached
LONG = (
    "Please read this carefully. My grocery list has apples, pears, bread, milk, eggs, rice, beans, "
    "coffee and tea on it. Which of these items are drinks? Answer with a short list."
)


def states(engine: AsyncEngine, examples: list[Example]) -> np.ndarray:
    """The engine's hidden states of the examples' prompts, as the gateway will compute them."""

    async def all_states() -> list[np.ndarray]:
        ids = [engine.tokenizer.encode_chat([dict(m) for m in e.messages]) for e in examples]
        return [s.numpy() for s in await asyncio.gather(*(engine.hidden_state(i, LAYER, "train") for i in ids))]

    return np.stack(asyncio.run(all_states()))


@pytest.fixture(scope="module")
def router_dir(small_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(0)
    examples = [
        dataclasses.replace(e, tiny_ok=bool(e.small_ok and rng.random() < 0.6)) for e in synthetic_examples(240, seed=2)
    ]
    train, held = split_examples(examples, test_size=0.25, seed=0)
    spec = HiddenSpec("small", MODEL, LAYER, small_engine.engine.model.config.hidden_size)
    hidden = HiddenData(spec, states(small_engine, train), states(small_engine, held))
    result = train_router(
        train, held, RouterEncoder(), folds=2, candidates=("logistic_pca",), hidden=hidden, bootstrap=50
    )
    assert result.router.hidden_classifier is not None, "the SmolLM2 states should beat text on these labels"
    assert "tiny" in result.router.cheaper
    return save_router(result.router, tmp_path_factory.mktemp("router") / "router")


@dataclass
class Gateway:
    live: LiveServer
    router_dir: Path

    def tenant(self, allowed_tiers: list[str] | None = None, **router: object) -> str:
        name = f"t-{uuid.uuid4().hex[:10]}"
        issued = create_tenant(self.live.db, name)
        found = tenant_by_name(self.live.db, name)
        assert found is not None
        policy = Policy(router=RouterSettings(**router), allowed_tiers=allowed_tiers)  # type: ignore[arg-type]
        app_services(self.live.app).policies.save(found.id, policy, "test")
        return issued.key

    def chat(self, key: str, content: str) -> httpx.Response:
        body = {"model": "auto", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
        r = httpx.post(
            f"{self.live.base_url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return r

    def stats(self) -> dict:
        stage = app_services(self.live.app).pipeline.routing
        return stage.stats(None)


@pytest.fixture(scope="module")
def gateway(
    small_engine: AsyncEngine,
    router_dir: Path,
    postgres_server: str,
    redis_server: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Gateway]:
    url, drop = services.create_database(postgres_server)
    namespace = f"sbtest-{uuid.uuid4().hex[:10]}"
    settings = Settings(
        home=tmp_path_factory.mktemp("home"), database_url=url, redis_url=redis_server, redis_namespace=namespace,
        tiers=TIERS, router_dir=router_dir,
    )  # fmt: skip
    db = Database(url)
    app = create_app(settings, engines={t: small_engine for t in TIERS}, database=db)
    live, stop = start_server(app, db)
    yield Gateway(live, router_dir)
    stop()
    db.dispose()
    drop()
    services.delete_namespace(redis_server, namespace)


def parse(r: httpx.Response) -> tuple[dict[str, float], str]:
    """(P per tier, what it was read from); any notes after them (`unknown far`) are left out: `unknown`."""
    predicted, features, *_ = r.headers["x-switchboard-route"].split("; ")
    return {t: float(p) for t, p in (x.split("=") for x in predicted.split(","))}, features


def unknown(r: httpx.Response) -> bool:
    """The router's labels do not cover the prompt: it goes large whatever its P (`router_model.regions`)."""
    return "; unknown " in r.headers["x-switchboard-route"]


@pytest.mark.parametrize("threshold", [0.2, 0.5, 0.8])
def test_auto_picks_the_cheapest_tier_whose_predicted_success_meets_the_floor(
    gateway: Gateway, small_engine: AsyncEngine, threshold: float
) -> None:
    key = gateway.tenant(mode="threshold", threshold=threshold)
    router = load_router(gateway.router_dir)
    prompts = ["Hi! How are you today?", LONG, synthetic_examples(40, seed=9)[7].messages[0]["content"]]
    for content in prompts:
        r = gateway.chat(key, str(content))
        p_ok, features = parse(r)
        assert features == "hidden" and set(p_ok) == {"tiny", SMALL}
        assert float(r.headers["x-switchboard-route-ms"]) > 0
        want = LARGE if unknown(r) else cheapest_tier(p_ok, threshold, ["tiny", SMALL, LARGE])
        assert r.headers["x-switchboard-tier"] == want
        # the gateway's prediction is the router's on the state the engine computes for this prompt
        ids = small_engine.tokenizer.encode_chat([{"role": "user", "content": str(content)}])
        state = asyncio.run(small_engine.hidden_state(ids, LAYER, "check")).numpy()
        expected = router.p_ok([{"role": "user", "content": str(content)}], state)
        assert p_ok == pytest.approx(expected, abs=0.02)  # bf16: batched and cached prefills differ a little


def test_under_the_default_floor_tiny_serves_what_the_router_scores_as_easy(gateway: Gateway) -> None:
    """Mode quality_ratio (the default's, here at a floor the synthetic curve can keep with tiny on it): the
    threshold is the floor's on the curve that routes tiny too, and a prompt whose P(tiny ok) meets it is
    served by tiny; one that the router scores as hard goes large."""
    key = gateway.tenant(quality_ratio=0.8)  # the default policy's mode, a lower floor
    found = load_router(gateway.router_dir).threshold_for_floor(0.8, tiny=True)
    assert found is not None
    threshold = found[0]
    served = {}
    for content in ["Hi! How are you today?", "Thanks, that is all.", LONG, *synthetic_prompts(12)]:
        r = gateway.chat(key, content)
        p_ok, _ = parse(r)
        served[content] = r.headers["x-switchboard-tier"]
        want = LARGE if unknown(r) else cheapest_tier(p_ok, threshold, ["tiny", SMALL, LARGE])
        assert served[content] == want, (content, p_ok)
    assert "tiny" in served.values() and "large" in served.values(), served


def test_a_calibrated_large_share_routes_between_small_and_large_only(gateway: Gateway) -> None:
    """Mode large_share: its threshold was calibrated on P(small ok) for a share of large calls, so tiny (whose
    P(tiny ok) it never saw) is not on its ladder; a tenant allowed tiny alone is still served by tiny."""
    router = load_router(gateway.router_dir)
    key = gateway.tenant(mode="large_share")  # no calibration of its own: the router's global threshold
    for content in ["Hi! How are you today?", "Thanks, that is all.", *synthetic_prompts(6)]:
        r = gateway.chat(key, content)
        p_ok, _ = parse(r)
        want = LARGE if unknown(r) else cheapest_tier(p_ok, router.threshold, [SMALL, LARGE])
        assert r.headers["x-switchboard-tier"] == want, content
    only_tiny = gateway.tenant(mode="large_share", allowed_tiers=["tiny"])
    assert gateway.chat(only_tiny, "Hi! How are you today?").headers["x-switchboard-tier"] == "tiny"


def synthetic_prompts(n: int) -> list[str]:
    """The synthetic labels' kinds of prompt (short chat, long arithmetic, many-requirement code)."""
    return [str(e.messages[0]["content"]) for e in synthetic_examples(n, seed=21)]


def test_the_routing_prefill_is_reused_and_gives_the_same_state_from_the_cache(gateway: Gateway) -> None:
    key = gateway.tenant(mode="threshold", threshold=0.0)  # everything meets the floor: tiny serves
    first = gateway.chat(key, LONG + " (1)")
    assert first.headers["x-switchboard-tier"] == "tiny"
    (row,) = gateway.live.wait_for_usage(first.json()["id"])
    # the routing prefill of the same prompt, same tenant salt, left its full blocks in the prefix cache
    assert row.cached_prompt_tokens >= 16 and row.prompt_tokens > row.cached_prompt_tokens
    second = gateway.chat(key, LONG + " (1)")  # routed again: its state now comes from cached blocks
    assert parse(second)[0] == pytest.approx(parse(first)[0], abs=0.02)


def test_a_busy_small_tier_routes_on_text(gateway: Gateway) -> None:
    key = gateway.tenant(mode="threshold", threshold=0.5)
    source = app_services(gateway.live.app).pipeline.routing.hidden
    assert source is not None
    before = dict(source.counts)
    source.max_waiting = -1  # any queue counts as busy
    try:
        r = gateway.chat(key, LONG)
    finally:
        source.max_waiting = 8
    p_ok, features = parse(r)
    assert features == "text" and set(p_ok) == {"tiny", SMALL}
    assert source.counts["busy"] == before.get("busy", 0) + 1
    assert gateway.stats()["hidden_states"]["busy"] >= 1
