"""The learned router in the gateway: `model: "auto"`, per-tenant calibration, online relabeling.

A router is trained here on synthetic labels (long, many-step math and many-requirement code fail on
the small tier, short chat passes) and served by a live gateway on PostgreSQL and Redis whose `small`
and `large` tiers are both SmolLM2: the tiers differ in name, price and ledger row, which is what the
gateway's side of routing is about. Ordering is checked with timestamps (when the response's last byte
went out, when the shadow run began), never with durations.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
import sqlalchemy as sa
from pydantic import Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import services
from core import audit
from core.db.database import Database
from core.db.models import RoutedPrompt
from core.settings import Settings
from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import authenticate, create_tenant, tenant_by_name
from gateway.api.deps import app_services, running_pipeline
from gateway.app import create_app
from gateway.cli import main
from gateway.routing.shadow_rows import LABELS_FILE
from live import LiveServer, serve_gateway, start_server
from policies.policy import Policy, RouterSettings
from policies.tune_prompts import tenant_prompts
from router_model.drift import LargeShareWindow, Shares
from router_model.encoder import RouterEncoder
from router_model.examples import Example, split_examples
from router_model.kinds import TEXT, TOOLS_NOTE
from router_model.model import load_router, read_metadata, save_router, write_metadata
from router_model.routed_prompts import RoutedPromptStore
from router_model.synthetic import synthetic_examples, write_label_file
from router_model.train import train_router

SIMPLE = "Hi! How are you today?"
HARD = (
    "Fatima has 312 marbles. Then Fatima sells 45 marbles. Then Fatima buys 17 marbles. Then Fatima trades 62 "
    "marbles. Then Fatima loses 33 marbles. Then Fatima finds 9 marbles. Each week this repeats 7 times and 25% "
    "are lost. How many marbles does Fatima have at the end? Solve it step by step."
)
P_HEADER = "x-switchboard-route-p-small"


def with_tools(e: Example) -> Example:
    """The example asked with a tool offered: labels of the tools kind, so tool requests are in distribution."""
    note = {"role": "system", "content": f"{TOOLS_NOTE} 1 tools: lookup."}
    return replace(e, id=f"{e.id}/tools", messages=[note, *e.messages])


@pytest.fixture(scope="module")
def router_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    train, heldout = split_examples(synthetic_examples(200, seed=1), test_size=0.25, seed=0)
    # tool-kind labels on both sides: a kind is known only with enough held-out prompts to keep its floor on
    train, heldout = [*train, *(with_tools(e) for e in train[::3])], [*heldout, *(with_tools(e) for e in heldout[::2])]
    result = train_router(train, heldout, RouterEncoder(), seed=0, folds=2, candidates=("hist_gb",), large_share=0.4)
    return save_router(result.router, tmp_path_factory.mktemp("router") / "router")


HOLD = "x-test-hold-response"  # the test middleware holds such a response's last part back a little


class ResponseSent:
    """Outermost ASGI middleware: when each response's last body byte was handed to the server, by request id.

    With the HOLD header it waits a moment before passing that last part on, so that anything started
    before the response is complete shows a timestamp before it (no speed is asserted).
    """

    def __init__(self, app: ASGIApp, sent: dict[str, float], loops: list[asyncio.AbstractEventLoop]) -> None:
        self.app = app
        self.sent = sent
        self.loops = loops  # the server's event loop, once it served a request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.loops:
            self.loops.append(asyncio.get_running_loop())
        request_id = ""
        hold = dict(scope.get("headers", [])).get(HOLD.encode()) == b"1"

        async def recording(message: Message) -> None:
            nonlocal request_id
            if message["type"] == "http.response.start":
                request_id = dict(message.get("headers", [])).get(b"x-request-id", b"").decode()
            last = message["type"] == "http.response.body" and not message.get("more_body")
            if last and hold:
                await asyncio.sleep(0.3)
            await send(message)
            if last:
                self.sent[request_id] = time.time()

        await self.app(scope, receive, recording)


@dataclass
class Gateway:
    live: LiveServer
    home: Path
    url: str
    router_dir: Path
    sent: dict[str, float]
    loops: list[asyncio.AbstractEventLoop]

    def tenant(self, **router: Any) -> tuple[str, str, int]:
        """A new tenant whose policy has these router settings (no shadow or explore runs unless asked): (name,
        app key, id)."""
        router.setdefault("shadow_share", 0.0)
        router.setdefault("explore_share", 0.0)
        name = f"t-{uuid.uuid4().hex[:10]}"
        issued = create_tenant(self.live.db, name)
        found = tenant_by_name(self.live.db, name)
        assert found is not None
        allowed = router.pop("allowed_tiers", None)
        policy = Policy(router=RouterSettings(**router), allowed_tiers=allowed)
        app_services(self.live.app).policies.save(found.id, policy, "test")
        return name, issued.key, found.id

    def chat(self, key: str, content: str, model: str = "auto", hold: bool = False, **body: Any) -> httpx.Response:
        payload = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8}
        payload |= {"temperature": 0} | body
        return httpx.post(
            f"{self.live.base_url}/v1/chat/completions",
            json=payload,
            headers={"Authorization": f"Bearer {key}", HOLD: "1" if hold else "0"},
            timeout=120,
        )

    def labels(self) -> dict[str, dict]:
        """The shadow label rows by request id."""
        return {row["request_id"]: row for row in self.labels_all() if row.get("direction", "shadow") == "shadow"}

    def labels_all(self) -> list[dict]:
        """Every live label row, shadow and explore, in order."""
        path = self.home / LABELS_FILE
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for_label(self, request_id: str, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (row := self.labels().get(request_id)) is not None:
                return row
            time.sleep(0.05)
        raise AssertionError(f"no label row for {request_id}")


@pytest.fixture(scope="module")
def gateway(
    small_engine: AsyncEngine,
    router_dir: Path,
    postgres_server: str,
    redis_server: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Gateway]:
    url, drop = services.create_database(postgres_server)
    home = tmp_path_factory.mktemp("home")
    namespace = f"sbtest-{uuid.uuid4().hex[:10]}"
    settings = Settings(
        home=home,
        database_url=url,
        redis_url=redis_server,
        redis_namespace=namespace,
        tiers={"small": {"model": "unused"}, "large": {"model": "unused"}},
        router_dir=router_dir,
        shadow_runs=True,  # the test suite turns them off (tests/conftest.py); tenants here ask for them
    )
    db = Database(url)
    app = create_app(settings, engines={"small": small_engine, "large": small_engine}, database=db)
    sent: dict[str, float] = {}
    loops: list[asyncio.AbstractEventLoop] = []
    app.add_middleware(ResponseSent, sent=sent, loops=loops)
    live, stop = start_server(app, db)
    yield Gateway(live, home, url, router_dir, sent, loops)
    stop()
    db.dispose()
    drop()
    services.delete_namespace(redis_server, namespace)


def _p(r: httpx.Response) -> float:
    assert re.fullmatch(r"[01]\.\d{3}", r.headers[P_HEADER]), r.headers[P_HEADER]
    return float(r.headers[P_HEADER])


def _row(gw: Gateway, request_id: str) -> Any:
    (row,) = gw.live.wait_for_usage(request_id)
    return row


def test_auto_sends_a_simple_prompt_small_and_a_hard_one_large(gateway: Gateway) -> None:
    _, key, _ = gateway.tenant(mode="large_share")  # no calibration: the router's global threshold
    threshold = load_router(gateway.router_dir).threshold
    simple, hard = gateway.chat(key, SIMPLE), gateway.chat(key, HARD)
    assert simple.status_code == hard.status_code == 200, (simple.text, hard.text)
    assert simple.json()["model"] == hard.json()["model"] == "auto"  # the model asked for, as for fallbacks
    assert (simple.headers["x-switchboard-tier"], hard.headers["x-switchboard-tier"]) == ("small", "large")
    assert _p(simple) >= threshold > _p(hard)

    small_row, large_row = _row(gateway, simple.json()["id"]), _row(gateway, hard.json()["id"])
    assert (small_row.route, small_row.tier) == ("auto", "small")
    assert (large_row.route, large_row.tier) == ("auto", "large")
    # routing's saving against the always-large counterfactual: all of it on small, nothing on large
    # (the prompt prefix may already sit in the shared engine's KV cache: that part is the cache's saving)
    assert small_row.saved_routing > 0
    levers = ("saved_routing", "saved_cache", "saved_speculation", "saved_policy", "saved_verifier")
    assert sum(getattr(small_row, k) for k in levers) == small_row.counterfactual_cost - small_row.cost
    assert large_row.saved_routing == 0 and large_row.cost > 0
    assert large_row.counterfactual_cost - large_row.cost == large_row.saved_cache  # the KV prefix cache's, if any

    direct = gateway.chat(key, HARD, model="small")
    assert direct.headers["x-switchboard-tier"] == "small" and P_HEADER not in direct.headers
    assert _row(gateway, direct.json()["id"]).route == "direct"

    # the cache keys on the tier the router chose: a direct request for that tier answers the same question
    again = gateway.chat(key, SIMPLE, model="small")
    assert again.headers["x-switchboard-cache"] == "hit"
    assert again.headers["x-switchboard-cache-source"] == simple.json()["id"]

    auth = {"Authorization": f"Bearer {key}"}
    models = httpx.get(f"{gateway.live.base_url}/v1/models", headers=auth).json()
    assert [m["id"] for m in models["data"]][:3] == ["small", "large", "auto"]
    assert httpx.get(f"{gateway.live.base_url}/v1/models/auto", headers=auth).status_code == 200


def test_the_policy_decides_threshold_tiers_and_whether_every_request_is_routed(gateway: Gateway) -> None:
    _, everything_large, _ = gateway.tenant(mode="threshold", threshold=1.0)  # P < 1 always: large
    r = gateway.chat(everything_large, SIMPLE)
    assert r.headers["x-switchboard-tier"] == "large"

    # route_all: a request naming a tier is routed anyway
    _, routed, _ = gateway.tenant(route_all=True, mode="threshold", threshold=1.0)
    r = gateway.chat(routed, SIMPLE, model="small")
    assert r.status_code == 200 and r.json()["model"] == "small" and r.headers["x-switchboard-tier"] == "large"
    assert _row(gateway, r.json()["id"]).route == "auto"

    # the policy's allowed tiers have the last word
    _, small_only, _ = gateway.tenant(route_all=True, allowed_tiers=["small"])
    r = gateway.chat(small_only, HARD, model="small")
    assert r.headers["x-switchboard-tier"] == "small" and _p(r) < 0.2
    _, none_routable, _ = gateway.tenant(allowed_tiers=[])
    r = gateway.chat(none_routable, SIMPLE)
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    models = httpx.get(f"{gateway.live.base_url}/v1/models", headers={"Authorization": f"Bearer {none_routable}"})
    assert models.json()["data"] == []

    # completions: text prompts, routed on the hardest of them; token ids cannot be read
    _, plain, _ = gateway.tenant(mode="large_share")
    base, auth = gateway.live.base_url, {"Authorization": f"Bearer {plain}"}

    def complete(prompt: object) -> httpx.Response:
        return httpx.post(
            f"{base}/v1/completions",
            json={"model": "auto", "prompt": prompt, "max_tokens": 2},
            headers=auth,
            timeout=60,
        )

    assert complete(SIMPLE).headers["x-switchboard-tier"] == "small"
    r = complete([SIMPLE, HARD])
    assert r.status_code == 200 and r.headers["x-switchboard-tier"] == "large" and len(r.json()["choices"]) == 2
    r = complete([1, 2, 3])
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_quality_floor_routes_by_the_threshold_it_implies(gateway: Gateway) -> None:
    """Mode quality_ratio: each tenant's requests go large exactly when P(small is good enough) falls below
    the threshold its floor implies on the router's held-out curve; a higher floor sends more large."""
    router = load_router(gateway.router_dir)
    implied = {ratio: router.threshold_for_floor(ratio, kind=TEXT) for ratio in (0.5, 1.0)}  # on text's own curve
    assert all(v is not None for v in implied.values())
    assert implied[0.5][1] <= implied[1.0][1]  # type: ignore[index]
    for ratio, (threshold, _) in implied.items():  # type: ignore[misc]
        _, key, _ = gateway.tenant(mode="quality_ratio", quality_ratio=ratio)
        for content in (SIMPLE, HARD):
            r = gateway.chat(key, content)
            assert r.status_code == 200
            assert r.headers["x-switchboard-tier"] == ("large" if _p(r) < threshold else "small"), (ratio, content)


def test_shadow_runs_start_after_the_response_and_log_label_rows(gateway: Gateway, tmp_path: Path) -> None:
    unbilled_name, unbilled, _ = gateway.tenant(store_prompts=True, shadow_share=1.0)
    _, billed, _ = gateway.tenant(store_prompts=True, shadow_share=1.0, shadow_billed=True)
    _, never, _ = gateway.tenant(store_prompts=True, shadow_share=0.0)
    verdict_only_name, verdict_only, _ = gateway.tenant(mode="large_share", shadow_share=1.0)  # keeps no conversations

    # greedy: the large tier (the same model here) answers the same, so no judge is needed
    same = gateway.chat(unbilled, SIMPLE, hold=True)
    # sampled: the answers differ, so the large tier judges
    judged = gateway.chat(unbilled, "Tell me a fun fact about cats.", hold=True, temperature=1.0, seed=3, max_tokens=12)
    with httpx.stream(
        "POST",
        f"{gateway.live.base_url}/v1/chat/completions",
        json={"model": "auto", "messages": [{"role": "user", "content": SIMPLE}], "max_tokens": 6, "stream": True},
        headers={"Authorization": f"Bearer {billed}", HOLD: "1"},
        timeout=120,
    ) as streamed:
        assert streamed.headers["x-switchboard-tier"] == "small"
        streamed_id = streamed.headers["x-request-id"]
        streamed_text = "".join(streamed.iter_text())
    assert streamed_text.endswith("data: [DONE]\n\n")
    skipped = gateway.chat(never, SIMPLE)
    unkept = gateway.chat(verdict_only, SIMPLE, hold=True)
    for r in (same, judged, skipped, unkept):
        assert r.status_code == 200 and r.headers["x-switchboard-tier"] == "small"

    rows = {rid: gateway.wait_for_label(rid) for rid in (same.json()["id"], judged.json()["id"], streamed_id)}
    for rid, row in rows.items():
        assert row["started"] >= gateway.sent[rid]  # the response's last byte went out before the shadow run began
        assert row["id"] == f"live/{rid}" and row["source"] == "live" and row["large_ok"] is True
        assert row["label"] == row["small_ok"] and row["large_model"] == "unused@bf16/bf16" and row["served"] == "small"
        assert row["messages"][-1]["role"] == "user" and row["large_tokens"] > 0
    assert rows[same.json()["id"]]["small_ok"] is True and rows[same.json()["id"]]["judge"] is None
    assert rows[same.json()["id"]]["small_tokens"] == same.json()["usage"]["completion_tokens"]
    assert rows[judged.json()["id"]]["judge"] is not None and rows[judged.json()["id"]]["judge_tokens"] > 0
    assert skipped.json()["id"] not in gateway.labels()  # shadow_share 0: none
    # a tenant whose policy keeps no conversations gets a verdict for its estimate, and nothing to train on
    bare = gateway.wait_for_label(unkept.json()["id"])
    assert "messages" not in bare and bare["small_ok"] is True and bare["tenant"] == verdict_only_name

    # one ledger row per shadow run, route "shadow", on the large tier; unbilled: nothing on the tenant's bill
    free = _row(gateway, f"{same.json()['id']}-shadow")
    assert (free.route, free.tier, free.status) == ("shadow", "large", "ok")
    assert free.cost == free.counterfactual_cost == free.prompt_tokens == free.completion_tokens == 0
    paid = _row(gateway, f"{streamed_id}-shadow")
    assert paid.route == "shadow" and paid.prompt_tokens > 0 and paid.cost > 0
    assert paid.counterfactual_cost == 0  # an always-large gateway would not have run it
    uncached = (paid.prompt_tokens * Decimal("0.50") + paid.completion_tokens * Decimal("2.00")) / 1_000_000
    assert paid.saved_routing == -uncached  # its price is routing's overhead
    assert paid.counterfactual_cost - paid.cost == paid.saved_routing + paid.saved_cache + paid.saved_speculation
    assert not gateway.live.usage_rows(request_id=f"{skipped.json()['id']}-shadow")

    # each verdict counts toward its tenant's quality estimate against always-large, shown to the operator
    assert {rows[rid]["tenant"] for rid in (same.json()["id"], judged.json()["id"])} == {unbilled_name}
    ops = create_tenant(gateway.live.db, f"ops-{uuid.uuid4().hex[:8]}", operator=True, role="admin").key
    stats = httpx.get(f"{gateway.live.base_url}/v1/admin/router", headers={"Authorization": f"Bearer {ops}"}).json()
    summary = stats["tenants"][unbilled_name]["quality"]
    assert summary["floor"] == 0.95 and summary["recalibration"] is None  # the default floor
    quality = summary["estimate"]
    ok = sum(rows[rid]["small_ok"] for rid in (same.json()["id"], judged.json()["id"]))
    assert (quality["judged"], quality["ok"], quality["cheaper_share"]) == (2, ok, 1.0)  # both served small
    assert quality["low"] <= quality["ratio"] == ok / 2 <= quality["high"]
    assert quality["tiers"] == {"small": {"share": 1.0, "ok": ok, "judged": 2}}

    # the live labels train a router (`--from-logs`), beside labels from elsewhere
    labels = write_label_file(synthetic_examples(120, seed=5), tmp_path / "labels.jsonl")
    shutil.copy(gateway.home / LABELS_FILE, tmp_path / LABELS_FILE)
    out = tmp_path / "retrained"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SWITCHBOARD_HOME", str(tmp_path))
        argv = ["router", "train", "--labels", str(labels), "--from-logs", "--router", str(out), "--folds", "2"]
        assert main(argv) == 0
    meta = read_metadata(out)
    assert meta["label_file"] == str(out / "train-labels.jsonl")
    assert meta["n_train"] + meta["n_heldout"] == 120 + len(rows) and meta["labels_train"]["live"]["n"] >= 1
    # (the verdict without its conversation is not among them)


def test_a_new_tenant_is_held_to_the_default_quality_floor(gateway: Gateway) -> None:
    """No policy saved: the built-in default holds `auto` to 0.95 of always-large's quality on the router's
    held-out curve, shadow-runs 5% of the cheaper tiers' answers, and checks code answers against their
    prompts' examples with a cascade to large; the semantic cache answers a reworded repeat."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    key = create_tenant(gateway.live.db, name).key
    found = tenant_by_name(gateway.live.db, name)
    assert found is not None
    current = app_services(gateway.live.app).policies.current(found.id)
    router, checks = current.policy.router, current.policy.verifiers
    assert current.version == 0 and (router.mode, router.quality_ratio, router.shadow_share) == (
        "quality_ratio",
        0.95,
        0.05,
    )
    assert router.shadow_warmup == 50
    assert checks.checks == ["prompt_examples"] and checks.cascade and checks.cascade_to == "large"
    assert current.policy.cache.enabled and current.policy.cache.semantic
    stage = running_pipeline(gateway.live.app).routing
    implied = load_router(gateway.router_dir).threshold_for_floor(0.95, kind=TEXT)
    assert implied is not None and stage.threshold(current.policy, name, TEXT)[:2] == (implied[0], "floor")
    for content in (SIMPLE, HARD):
        r = gateway.chat(key, content)
        assert r.status_code == 200
        assert r.headers["x-switchboard-tier"] == ("large" if _p(r) < implied[0] else "small"), content
    first = gateway.chat(key, SIMPLE)
    reworded = gateway.chat(key, "Please, " + SIMPLE[:1].lower() + SIMPLE[1:])
    assert first.headers["x-switchboard-cache"] == "hit" and reworded.headers["x-switchboard-cache"] == "semantic-hit"
    assert reworded.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]


def test_a_tenant_measured_short_of_its_floor_is_recalibrated_toward_large(gateway: Gateway) -> None:
    """A planted bad small tier: the tenant's earlier shadow verdicts say its answers were not good enough.
    The next shadow run's verdict brings the estimate's upper end below the floor: the gateway saves a
    policy version aiming the curve higher by the shortfall (audited as `switchboard`), the threshold
    rises, and the estimate starts over on fresh verdicts."""
    name, key, tenant_id = gateway.tenant(shadow_share=1.0, quality_ratio=0.5, allowed_tiers=["small"])
    stage = running_pipeline(gateway.live.app).routing
    policies = app_services(gateway.live.app).policies
    before = policies.current(tenant_id)
    for _ in range(40):
        stage.floor.verdicts.add(name, False)
    r = gateway.chat(key, SIMPLE, hold=True)
    assert r.status_code == 200 and r.headers["x-switchboard-tier"] == "small"  # the only tier it may use
    row = gateway.wait_for_label(r.json()["id"])
    deadline = time.monotonic() + 30
    while (after := policies.current(tenant_id)).version == before.version and time.monotonic() < deadline:
        time.sleep(0.05)
    assert after.version == before.version + 1
    recalibration = after.policy.router.recalibration
    ratio = 1 - (1 - row["small_ok"] / 41)  # every routed request served small: c = 1
    assert recalibration is not None and recalibration.judged == 41
    assert recalibration.ratio == pytest.approx(ratio, abs=1e-4) and recalibration.high < 0.5
    assert recalibration.offset == pytest.approx(0.5 - ratio, abs=1e-4)
    assert after.policy.router.floor == pytest.approx(1 - ratio, abs=1e-4)
    entry = audit.entries(gateway.live.db, tenant_id)[0]
    assert (entry.actor, entry.action, entry.target) == (
        "switchboard",
        "policy.recalibrate",
        f"policy v{after.version}",
    )
    assert entry.after["router"]["recalibration"]["offset"] == recalibration.offset
    old, new = (stage.threshold(v.policy, name) for v in (before, after))
    assert new[0] >= old[0] and (new[2] or 0) >= (old[2] or 0)  # toward large
    ops = create_tenant(gateway.live.db, f"ops-{uuid.uuid4().hex[:8]}", operator=True, role="admin").key
    stats = httpx.get(f"{gateway.live.base_url}/v1/admin/router", headers={"Authorization": f"Bearer {ops}"}).json()
    summary = stats["tenants"][name]["quality"]
    assert summary["recalibration"]["judged"] == 41 and summary["aimed_at"] == pytest.approx(1 - ratio, abs=1e-4)
    assert summary["estimate"] is None  # no verdict since


def test_a_new_tenant_s_first_verdicts_are_drawn_at_the_warm_up_share(gateway: Gateway) -> None:
    """Until a tenant has `shadow_warmup` verdicts since its last recalibration, half its cheaper answers or
    more are drawn, so that its estimate means something early; then the policy's share; a recalibration
    starts the warm-up again; a share of 0 turns it off."""
    from gateway.routing.shadow import WARMUP_SHARE

    name, _, tenant_id = gateway.tenant(shadow_share=0.05, shadow_warmup=3)
    policies = app_services(gateway.live.app).policies
    relabeler = running_pipeline(gateway.live.app).routing.relabeler
    assert relabeler is not None and WARMUP_SHARE == 0.5
    current = policies.current(tenant_id)
    assert relabeler.share(current, name) == WARMUP_SHARE
    relabeler.runs._running[name] = 1  # a run under way counts toward the warm-up
    for _ in range(2):
        relabeler.verdicts.add(name, True)
    assert relabeler.share(current, name) == 0.05
    relabeler.runs._ended(name)
    assert relabeler.share(current, name) == WARMUP_SHARE and name not in relabeler.runs._running
    relabeler.verdicts.add(name, True)
    assert relabeler.share(current, name) == 0.05
    body = current.policy.model_dump(mode="json")
    body["router"]["recalibration"] = {"offset": 0.01, "judged": 3, "ratio": 0.9, "high": 0.94}
    recalibrated = policies.save(tenant_id, Policy.model_validate(body), "test")
    assert relabeler.share(policies.current(tenant_id), name) == WARMUP_SHARE  # fresh verdicts count again
    body["router"]["shadow_share"] = 0.0
    assert recalibrated < policies.save(tenant_id, Policy.model_validate(body), "test")
    assert relabeler.share(policies.current(tenant_id), name) == 0.0


def test_a_tiny_answer_is_judged_and_counted_for_its_tier(gateway: Gateway) -> None:
    """Shadow runs take tiny-served answers too: the row says which tier served and keeps its verdict
    under that tier's name (it trains no small-tier label), and the verdict counts for tiny."""
    from gateway.routing.shadow_rows import ShadowJob

    name, key, tenant_id = gateway.tenant(shadow_share=1.0)
    key_id = authenticate(gateway.live.db, key).key_id
    policies = app_services(gateway.live.app).policies
    relabeler = running_pipeline(gateway.live.app).routing.relabeler
    assert relabeler is not None and relabeler.wants(policies.current(tenant_id), "tiny", name)
    assert not relabeler.wants(policies.current(tenant_id), "large", name)
    rid = f"tiny-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": SIMPLE}]
    job = ShadowJob(rid, "chat.completions", tenant_id, name, key_id, policies.current(tenant_id), messages,
                    "I am a banana.", 5, "stop", 16, served="tiny")  # fmt: skip
    assert httpx.get(f"{gateway.live.base_url}/healthz").status_code == 200  # the server's loop is known
    row = asyncio.run_coroutine_threadsafe(relabeler.run(job), gateway.loops[0]).result(120)
    assert row is not None and row["served"] == "tiny" and isinstance(row["tiny_ok"], bool)
    assert "small_ok" not in row and "label" not in row and "messages" not in row
    assert row["tiny_tokens"] == 5 and row["large_tokens"] > 0 and row["judge"] is not None
    assert relabeler.verdicts.counts(name) == {"tiny": (int(row["tiny_ok"]), 1)}


def test_calibrating_a_tenant_writes_a_policy_version(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    name, key, tenant_id = gateway.tenant(store_prompts=True)
    _, other, other_id = gateway.tenant()
    assert gateway.chat(other, HARD).status_code == 200
    r = gateway.chat(key, HARD)
    assert r.status_code == 200
    store = RoutedPromptStore(gateway.live.db)
    deadline = time.monotonic() + 30
    while not store.recent(tenant_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.recent(tenant_id) == [[{"role": "user", "content": HARD}]]
    with gateway.live.db.session() as s:  # the tenant whose policy keeps no prompts has none kept
        row = s.scalar(sa.select(RoutedPrompt).where(RoutedPrompt.tenant_id == tenant_id))
        assert row is not None and row.request_id == r.json()["id"] and row.tier == "large"
        assert s.scalar(sa.select(sa.func.count()).where(RoutedPrompt.tenant_id == other_id)) == 0

    monkeypatch.setenv("SWITCHBOARD_DATABASE_URL", gateway.url)
    monkeypatch.setenv("SWITCHBOARD_HOME", str(gateway.home))
    calibrate = ["router", "calibrate", "--router", str(gateway.router_dir), "--tenant", name]
    assert main([*calibrate, "--large-share", "0.3"]) == 1
    assert "1 routed prompts stored, too few" in capsys.readouterr().err

    for e in synthetic_examples(130, seed=11):
        store.add(tenant_id, "calibration", e.messages, 0.5, "small")
    assert main([*calibrate, "--large-share", "0.3"]) == 0
    assert "policy v2" in capsys.readouterr().out  # v1: the test's own
    policy = app_services(gateway.live.app).policies.version(tenant_id, 2).policy
    calibration = policy.router.calibration
    assert calibration is not None and policy.router.mode == "large_share" and policy.router.large_share == 0.3
    assert calibration.prompts == 131 and abs(calibration.large_share - 0.3) <= 0.02
    assert calibration.router == read_metadata(gateway.router_dir)["model_sha256"]
    assert policy.router.store_prompts  # the rest of the policy stays as it was
    (entry, *_) = audit.entries(gateway.live.db, tenant_id)
    assert (entry.actor, entry.action, entry.target) == ("cli", "policy.update", "policy v2")
    assert entry.after["router"]["calibration"]["threshold"] == calibration.threshold

    # the gateway routes the tenant by it (policies reach it within a second): every call large
    assert main([*calibrate, "--large-share", "1.0"]) == 0
    deadline = time.monotonic() + 10
    while (tier := gateway.chat(key, SIMPLE).headers["x-switchboard-tier"]) != "large" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert tier == "large"

    # drift: the large share of recent decisions against what their thresholds were calibrated to send
    ops = create_tenant(gateway.live.db, f"ops-{uuid.uuid4().hex[:8]}", operator=True, role="admin").key
    stats = httpx.get(f"{gateway.live.base_url}/v1/admin/router", headers={"Authorization": f"Bearer {ops}"}).json()
    assert stats["loaded"] and stats["router"]["id"] == calibration.router
    mine, everyone = stats["tenants"][name], stats["drift"]
    assert everyone["decisions"] >= mine["decisions"] >= 2 and 0 < mine["large_share"] <= 1
    assert 0 < mine["calibrated_large_share"] <= 1
    metrics = httpx.get(f"{gateway.live.base_url}/metrics").text
    scraped = {m[0]: float(m[1]) for m in re.findall(r"^(switchboard_router_\w*large_share) (\S+)$", metrics, re.M)}
    later = httpx.get(f"{gateway.live.base_url}/v1/admin/router", headers={"Authorization": f"Bearer {ops}"}).json()
    assert scraped == {
        "switchboard_router_large_share": pytest.approx(later["drift"]["large_share"]),
        "switchboard_router_calibrated_large_share": pytest.approx(later["drift"]["calibrated_large_share"]),
    }
    # another tenant's admin sees its own tenant only
    tenant_admin = create_tenant(gateway.live.db, f"t-{uuid.uuid4().hex[:8]}", role="admin").key
    own = httpx.get(f"{gateway.live.base_url}/v1/admin/router", headers={"Authorization": f"Bearer {tenant_admin}"})
    assert own.status_code == 200 and own.json()["drift"] is None and own.json()["tenants"] == {}


def test_auto_without_a_router_is_a_clear_404(
    small_engine: AsyncEngine, sqlite_url: str, tmp_path: Path, router_dir: Path
) -> None:
    stale = tmp_path / "stale"
    shutil.copytree(router_dir, stale)
    write_metadata(read_metadata(stale) | {"feature_version": "minilm-l6+cheap-0"}, stale)
    for directory, reason in ((None, "none at"), (stale, "retrain")):
        extra = {} if directory is None else {"router_dir": directory}
        live, stop = serve_gateway(small_engine, tmp_path / f"home-{reason[:5]}", sqlite_url, **extra)
        try:
            key = live.new_key()
            payload = {"model": "auto", "messages": [{"role": "user", "content": SIMPLE}], "max_tokens": 2}
            r = httpx.post(
                f"{live.base_url}/v1/chat/completions", json=payload, headers={"Authorization": f"Bearer {key}"}
            )
            error = r.json()["error"]
            assert r.status_code == 404 and error["code"] == "model_not_found" and error["param"] == "model"
            assert "no router is configured" in error["message"] and reason in error["message"]
            models = httpx.get(f"{live.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
            aliases = Settings.model_fields["model_aliases"].default_factory()  # type: ignore[misc]  # the operator's defaults for the embedding model, listed too
            assert [m["id"] for m in models["data"] if m["id"] not in aliases] == ["small"]
        finally:
            stop()


def test_a_tenant_that_routes_everything_is_served_as_asked_without_a_router(
    small_engine: AsyncEngine, sqlite_url: str, tmp_path: Path
) -> None:
    live, stop = serve_gateway(small_engine, tmp_path, sqlite_url)
    try:
        name = f"t-{uuid.uuid4().hex[:8]}"
        key = create_tenant(live.db, name).key
        found = tenant_by_name(live.db, name)
        assert found is not None
        app_services(live.app).policies.save(found.id, Policy(router=RouterSettings(route_all=True)), "test")
        payload = {"model": "small", "messages": [{"role": "user", "content": SIMPLE}], "max_tokens": 2}
        r = httpx.post(f"{live.base_url}/v1/chat/completions", json=payload, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.headers["x-switchboard-tier"] == "small" and P_HEADER not in r.headers
        assert live.wait_for_usage(r.json()["id"])[0].route == "direct"
    finally:
        stop()


def test_the_routed_prompts_migration_upgrades_and_downgrades(database: Database) -> None:
    assert database.current_revision() == "0006"
    assert "routed_prompts" in sa.inspect(database.engine).get_table_names()
    database.downgrade("0002")
    tables = set(sa.inspect(database.engine).get_table_names())
    assert "routed_prompts" not in tables and {"usage", "policy_versions", "audit_log"} <= tables
    database.upgrade()
    assert database.current_revision() == "0006" and "routed_prompts" in sa.inspect(database.engine).get_table_names()
    create_tenant(database, "acme")
    found = tenant_by_name(database, "acme")
    assert found is not None
    store = RoutedPromptStore(database, keep=3)
    for i in range(5):
        store.add(found.id, f"r{i}", [{"role": "user", "content": f"q{i}"}], 0.5, "small")
    store.prune(found.id)
    assert [m[0]["content"] for m in store.recent(found.id)] == ["q4", "q3", "q2"]  # the newest kept, newest first


def test_the_drift_window_compares_like_with_like() -> None:
    window = LargeShareWindow(size=4)
    assert window.shares() == Shares(0, None, None)
    window.add(True, None)  # a fixed threshold: counts as a call, expects nothing
    assert window.shares() == Shares(1, 1.0, None)
    for large, expected in ((False, 0.25), (False, 0.25), (True, 0.5), (False, 0.5)):
        window.add(large, expected)
    assert window.shares() == Shares(4, 0.25, 0.375)  # the first decision fell out of the window


def stored_prompts(gateway: Gateway) -> tuple[dict[int, list[str]], dict[int, str]]:
    """Two tenants that store routed prompts each send their own prompt through `auto`: what each tenant's
    store holds afterwards, and what each sent, by tenant id."""
    tenants = [gateway.tenant(store_prompts=True) for _ in range(2)]
    sent = {t: f"{HARD} ({uuid.uuid4().hex[:6]})" for _, _, t in tenants}  # two distinct conversations
    ids = []
    for _, key, t in tenants:
        r = gateway.chat(key, sent[t])
        assert r.status_code == 200
        ids.append(r.json()["id"])
    deadline = time.monotonic() + 30
    with gateway.live.db.session() as s:
        stored = sa.select(sa.func.count()).where(RoutedPrompt.request_id.in_(ids))
        while s.scalar(stored) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    store = RoutedPromptStore(gateway.live.db)
    return {t: [m[0]["content"] for m in store.recent(t)] for t in sent}, sent


def test_two_storing_tenants_each_keep_only_their_own_routed_prompts(gateway: Gateway) -> None:
    kept, sent = stored_prompts(gateway)
    assert kept == {t: [content] for t, content in sent.items()}
    for t, content in sent.items():  # policy tuning samples a tenant's stored prompts: its own only
        sampled = tenant_prompts(gateway.live.db, t, 10, ["small", "large"])
        assert [p.messages[0]["content"] for p in sampled] == [content]


def test_the_routed_prompt_check_sees_a_swapped_tenant_id(gateway: Gateway) -> None:
    store = running_pipeline(gateway.live.app).routing.prompts
    add = store.add
    # the deliberately broken gateway: each prompt stored under the id before its tenant's (the tenants
    # of `stored_prompts` are made one after the other, so the second tenant's goes to the first)
    store.add = lambda tenant_id, *args: add(tenant_id - 1, *args)  # type: ignore[method-assign]
    try:
        kept, sent = stored_prompts(gateway)
    finally:
        del store.add
    one, two = sent
    assert kept == {one: [sent[two]], two: []}  # what the check above fails on


def test_auto_routes_tool_requests_seeing_the_tools(gateway: Gateway) -> None:
    """A tool request goes through `auto` like any other: routed, its calls valid, and what the router read
    (and the tenant's store keeps) names the tools offered and how many."""
    _, key, tenant_id = gateway.tenant(store_prompts=True)
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        for name in ("get_weather", "get_time")]  # fmt: skip
    r = gateway.chat(key, "What's the weather in Oslo?", tools=tools, tool_choice="required", max_tokens=48)
    assert r.status_code == 200, r.text
    assert r.headers["x-switchboard-tier"] in ("small", "large") and r.headers[P_HEADER]
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls and all(json.loads(c["function"]["arguments"])["city"] for c in calls)
    deadline = time.monotonic() + 30
    while not (kept := RoutedPromptStore(gateway.live.db).recent(tenant_id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    (conversation,) = kept
    assert conversation[0] == {"role": "system", "content": "The assistant may call 2 tools: get_time, get_weather."}
    assert conversation[1]["content"] == "What's the weather in Oslo?"


def test_a_tool_loop_stays_on_the_tier_its_first_turn_went_to(gateway: Gateway) -> None:
    """The turn after a call carries a result that, asked afresh, the router sends large; inside the loop it stays on
    the loop's tier (`x-switchboard-route: small; lock`), unless the tenant's policy turns the lock off."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]  # fmt: skip

    def loop(key: str) -> tuple[httpx.Response, httpx.Response]:
        first = gateway.chat(key, SIMPLE, tools=tools, tool_choice="required", max_tokens=48)
        assert first.status_code == 200 and first.headers["x-switchboard-tier"] == "small", first.text
        call = first.json()["choices"][0]["message"]["tool_calls"][0]
        turn = [{"role": "user", "content": SIMPLE}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": HARD}]  # fmt: skip
        body = {"model": "auto", "messages": turn, "tools": tools, "max_tokens": 8, "temperature": 0}
        then = httpx.post(f"{gateway.live.base_url}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        assert then.status_code == 200, then.text
        return first, then

    _, key, _ = gateway.tenant(mode="large_share")
    assert gateway.chat(key, HARD).headers["x-switchboard-tier"] == "large"  # the result's text, asked afresh
    _, then = loop(key)
    assert then.headers["x-switchboard-tier"] == "small"
    assert then.headers["x-switchboard-route"] == "small; lock" and P_HEADER not in then.headers
    assert _row(gateway, then.json()["id"]).route == "auto"
    _, unlocked, _ = gateway.tenant(mode="large_share", lock_tool_loops=False)
    _, fresh = loop(unlocked)
    assert P_HEADER in fresh.headers and not fresh.headers["x-switchboard-route"].endswith("lock")


@pytest.mark.parametrize("model", ["large", "auto"])
def test_the_agents_sdk_runs_a_tool_loop_on_a_named_tier_and_on_auto(gateway: Gateway, model: str) -> None:
    """The OpenAI Agents SDK on its default settings (the Responses API) through `large` and `auto`: the tool is
    called and its result answered; under `auto` the turn after the call is held to the loop's tier."""
    agents = pytest.importorskip("agents")
    import openai

    _, key, tenant_id = gateway.tenant(mode="large_share")
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=40)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny, 21 C"

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{gateway.live.base_url}/v1", api_key=key, max_retries=0)
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=160, temperature=0)
    responses = agents.OpenAIResponsesModel(model=model, openai_client=client)
    agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                         model_settings=settings, model=responses)  # fmt: skip

    async def run() -> Any:
        try:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls and isinstance(result.final_output, str)
    with gateway.live.db.session() as s:
        rows = s.execute(sa.text("SELECT tier, endpoint FROM usage WHERE tenant_id = :t ORDER BY created_at"),
                         {"t": tenant_id}).all()  # fmt: skip
    assert len(rows) >= 2 and {r.endpoint for r in rows} == {"responses"}
    assert {r.tier for r in rows} == ({"large"} if model == "large" else {rows[0].tier})  # no switch inside the loop
