"""The console's routing form: allowed tiers, the routing mode and its value, the router's curve with the
operating point marked, a preview with the dry run's cost before and after, a confirmation that saves, and
what the tenant's own verdicts taught its routing (its curve beside the router's) with a reset.

A router is trained on synthetic labels (as tests/router does) and served by a live gateway on
PostgreSQL and Redis whose `small` and `large` tiers are both SmolLM2; a second gateway has no router.
Over HTTP first, then in headless Chromium.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import httpx
import numpy as np
import pytest

import services
from core import audit
from core.db.database import Database
from core.db.models import RoutedPrompt
from core.settings import Settings
from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import create_key, create_tenant, tenant_by_name
from gateway.api.deps import app_services
from gateway.app import create_app
from gateway.console.chart import MAX_CURVE_POINTS, curve_chart, usd
from live import LiveServer, start_server
from policies.policy import Budget, LearnedRouting, Policy, RouterSettings, SamplingLimits
from policies.store import Versioned
from router_model.calibrate import threshold_for_quality_floor, threshold_for_share
from router_model.curve import operating_point, routing_curve
from router_model.drift import LargeShareWindow
from router_model.encoder import RouterEncoder
from router_model.evaluate import quality_curve
from router_model.examples import load_examples, split_examples
from router_model.kinds import TEXT
from router_model.model import load_router, save_router
from router_model.synthetic import synthetic_examples, write_label_file
from router_model.tenant_layer import Seen, Verdict, cell_of
from router_model.train import heldout_examples, train_router

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
SIMPLE = "Hi! How are you today?"
HARD = (
    "Fatima has 312 marbles. Then Fatima sells 45 marbles. Then Fatima buys 17 marbles. Then Fatima trades 62 "
    "marbles. Then Fatima loses 33 marbles. Each week this repeats 7 times and 25% are lost. How many marbles "
    "does Fatima have at the end? Solve it step by step."
)


@pytest.fixture(scope="module")
def router_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("router")
    examples = synthetic_examples(160, seed=3)
    train, heldout = split_examples(examples, test_size=0.25, seed=0)
    result = train_router(train, heldout, RouterEncoder(), seed=0, folds=2, candidates=("hist_gb",), large_share=0.3)
    result.router.metadata["label_file"] = str(write_label_file(examples, home / "labels.jsonl"))
    return save_router(result.router, home / "router")


@dataclass
class Gateway:
    live: LiveServer
    operator_admin: str
    operator_finance: str

    @property
    def url(self) -> str:
        return self.live.base_url

    def tenant(self, policy: Policy | None = None) -> tuple[str, int, str, str]:
        """A new tenant (name, id, app key, admin key), with `policy` saved as its v1."""
        name = f"t-{uuid.uuid4().hex[:8]}"
        app_key = create_tenant(self.live.db, name).key
        admin_key = create_key(self.live.db, name, "admin").key
        found = tenant_by_name(self.live.db, name)
        assert found is not None
        if policy is not None:
            self.policies.save(found.id, policy, "test")
        return name, found.id, app_key, admin_key

    @property
    def policies(self):  # noqa: ANN201  (the app's PolicyStore)
        return app_services(self.live.app).policies


def _gateway(
    small_engine: AsyncEngine, postgres_server: str, redis_server: str, home: Path, router: Path
) -> Iterator[Gateway]:
    url, drop = services.create_database(postgres_server)
    namespace = f"sbtest-{uuid.uuid4().hex[:10]}"
    settings = Settings(
        home=home,
        database_url=url,
        redis_url=redis_server,
        redis_namespace=namespace,
        tiers={"small": {"model": "unused"}, "large": {"model": "unused"}},
        router_dir=router,
    )
    db = Database(url)
    app = create_app(settings, engines={"small": small_engine, "large": small_engine}, database=db)
    live, stop = start_server(app, db)
    try:
        operator = create_tenant(db, "ops", operator=True, role="admin").key
        yield Gateway(live, operator, create_key(db, "ops", "finance").key)
    finally:
        stop()
        db.dispose()
        drop()
        services.delete_namespace(redis_server, namespace)


@pytest.fixture(scope="module")
def gw(
    small_engine: AsyncEngine,
    router_dir: Path,
    postgres_server: str,
    redis_server: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Gateway]:
    yield from _gateway(small_engine, postgres_server, redis_server, tmp_path_factory.mktemp("home"), router_dir)


@pytest.fixture(scope="module")
def plain(
    small_engine: AsyncEngine, postgres_server: str, redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    home = tmp_path_factory.mktemp("plain")
    yield from _gateway(small_engine, postgres_server, redis_server, home, home / "no-router")


@pytest.fixture(scope="module")
def heldout_p(router_dir: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the page should draw for a tenant without stored prompts: the router's held-out curve."""
    router = load_router(router_dir)
    examples = heldout_examples(load_examples(Path(router.metadata["label_file"])), router.metadata)
    p = router.p_small_ok([e.messages for e in examples])
    return p, np.array([e.small_ok for e in examples]), np.array([e.large_ok for e in examples])


def form_token(text: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', text)
    assert found, "the page has no form with a CSRF token"
    return found.group(1)


def signed_in(gw: Gateway, key: str) -> httpx.Client:
    client = httpx.Client(base_url=gw.url, follow_redirects=False, timeout=120)
    r = client.post("/console/login", data={"key": key, "csrf": form_token(client.get("/console/login").text)})
    assert r.status_code == 303, r.text
    return client


def hidden(text: str, name: str) -> str:
    found = re.search(rf'<input type="hidden" name="{name}" value="([^"]*)"', text)
    assert found, f"no hidden {name}"
    return html.unescape(found.group(1))


def confirm(client: httpx.Client, name: str, token: str, preview: str) -> httpx.Response:
    """Post the preview's confirmation form, as its button does."""
    fields = {k: hidden(preview, k) for k in ("base", "proposed", "note")}
    return client.post(f"{routing(name)}/confirm", data={"csrf": token, **fields})


def dollars(text: str, id_: str) -> Decimal:
    found = re.search(rf'id="{id_}">-?\$([\d,.]+)<', text)
    assert found, f"no #{id_}"
    return Decimal(found.group(1).replace(",", ""))


def errors(text: str) -> str:
    return text.split('id="routing-errors"')[1].split("</div>")[0]


def routing(name: str) -> str:
    return f"/console/tenants/{name}/policy/routing"


# --- over HTTP -----------------------------------------------------------------------------------------


def test_the_form_is_for_admins_who_see_the_tenant(gw: Gateway) -> None:
    name, _, _, admin_key = gw.tenant()
    other, _, _, other_admin = gw.tenant()
    admin = signed_in(gw, admin_key)
    page = admin.get(routing(name))
    assert page.status_code == 200
    for tier in app_services(gw.live.app).pipeline.engines:  # a box per tier this gateway serves, whatever they are
        assert f'name="tier:{tier}"' in page.text
    assert 'name="any_tier" id="any-tier" checked' in page.text  # the default policy allows any tier
    assert 'value="quality_ratio" id="mode-quality_ratio" checked' in page.text  # the default: 0.95 of large's
    assert 'id="quality_ratio" min="0" max="1" step="any" value="0.95"' in page.text
    assert 'id="measured-quality"' in page.text and "not measured yet" in page.text  # no shadow verdict yet
    assert f"{routing(name)}" in admin.get(f"/console/tenants/{name}/policy").text  # linked from the editor

    assert admin.get(routing(other)).status_code == 404  # another tenant's admin: as if it did not exist
    assert signed_in(gw, other_admin).get(routing(other)).status_code == 200
    finance = signed_in(gw, gw.operator_finance)
    r = finance.get(routing(name))
    assert r.status_code == 403 and "needs a key with the admin role" in r.text
    r = finance.post(routing(name), data={"csrf": form_token(finance.get("/console/finance").text)})
    assert r.status_code == 403
    with httpx.Client(base_url=gw.url, follow_redirects=False) as anonymous:
        assert anonymous.get(routing(name)).headers["location"] == "/console/login"


def test_the_measured_quality_stands_beside_the_floor_on_the_routing_and_finance_pages(gw: Gateway) -> None:
    """The estimate from the tenant's shadow verdicts (planted here as the shadow runs add them: 40 answers
    served small, 30 of 40 judged good enough) with its interval and the floor, on both pages."""
    name, _, app_key, admin_key = gw.tenant()
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": "small", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {app_key}"},
        timeout=60,
    )
    assert r.status_code == 200  # usage, so that the finance page has a row for the tenant
    floor = app_services(gw.live.app).pipeline.routing.floor
    for i in range(40):
        floor.add(name, "small", Policy())
        floor.verdicts.add(name, i % 4 != 0)
    found = floor.estimate(name)
    assert found is not None and found.ratio == 0.75 and found.high < 0.95
    shown = f'{found.ratio:.3f}</span> <span class="muted">[{found.low:.3f}, {found.high:.3f}] on 40 shadow verdicts'
    page = signed_in(gw, admin_key).get(routing(name)).text
    measured = page.split('id="measured-quality"')[1].split("</section>")[0]
    assert shown in measured and "floor 0.95" in measured and "short of the floor" in measured
    finance = signed_in(gw, gw.operator_finance).get("/console/finance").text
    row = next(line for line in finance.split("<tr>") if f"<td>{name}</td>" in line)
    assert shown in row and "floor 0.95" in row


def test_the_curve_is_the_routers_on_its_held_out_labels_with_the_point_in_force(
    gw: Gateway, router_dir: Path, heldout_p: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> None:
    name, _, _, admin_key = gw.tenant()
    page = signed_in(gw, admin_key).get(routing(name)).text
    p, small, large = heldout_p
    svg = page.split('id="routing-curve"')[1].split("</svg>")[0]
    line = re.search(r'<polyline class="curve" points="([^"]+)"', svg)
    assert line and len(line.group(1).split()) == len(routing_curve(p, small, large).points)
    assert svg.count('class="mark current"') == 1 and 'class="mark proposed"' not in svg
    assert f"the router's {len(p)} held-out labeled prompts" in html.unescape(page)
    router = load_router(router_dir)
    floor = router.threshold_for_floor(0.95)  # the default policy's: 0.95 of always-large's quality
    point = operating_point(p, small, large, floor[0] if floor is not None else router.threshold)
    assert f"In force: {100 * point.large_share:.1f}% large, quality {point.quality:.3f}" in page
    assert 'id="mode-quality_floor" disabled' not in page  # labeled: a quality floor can be set


def test_bad_choices_are_shown_back_and_nothing_is_saved(gw: Gateway) -> None:
    name, tid, _, admin_key = gw.tenant()
    admin = signed_in(gw, admin_key)
    token = form_token(admin.get(routing(name)).text)
    cases = [
        ({"tier:small": "on", "mode": "threshold", "threshold": "abc"}, "threshold", "from 0 to 1"),
        ({"tier:small": "on", "mode": "large_share", "large_share": "1.5"}, "large_share", "from 0 to 1"),
        ({"tier:small": "on", "mode": "large_share", "large_share": "nan"}, "large_share", "from 0 to 1"),
        ({"tier:small": "on", "mode": "bogus"}, "mode", "choose one of"),
        ({"mode": "threshold", "threshold": "0.5"}, "allowed_tiers", "at least one tier"),
    ]
    for data, param, message in cases:
        r = admin.post(routing(name), data={"csrf": token, **data})
        assert r.status_code == 422, (data, r.status_code)
        assert f'<code class="path">{param}</code>' in errors(r.text) and message in errors(r.text), data
        assert 'id="preview"' not in r.text and 'id="routing-form"' in r.text  # the form is shown back
    r = admin.post(routing(name), data={"csrf": token, "tier:small": "on", "mode": "threshold", "threshold": "abc"})
    assert 'name="threshold" id="threshold" min="0" max="1" step="any" value="abc"' in r.text  # as typed
    r = admin.post(routing(name), data={"tier:small": "on", "mode": "threshold", "threshold": "0.5"})
    assert r.status_code == 403 and "security token" in r.text
    r = admin.post(f"{routing(name)}/confirm", data={"csrf": token, "base": "0", "proposed": "[]"})
    assert r.status_code == 422 and "preview it again" in r.text
    bad = '{"allowed_tiers": ["small"], "router": {"mode": "threshold", "threshold": 7}}'
    r = admin.post(f"{routing(name)}/confirm", data={"csrf": token, "base": "0", "proposed": bad})
    assert r.status_code == 422 and '<code class="path">router.threshold</code>' in errors(r.text)
    assert gw.policies.current(tid).version == 0


def wait_for(check, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def routed_traffic(gw: Gateway, app_key: str, tid: int, prompts: tuple[str, ...]) -> list[str]:
    """Send each prompt as `model: "auto"`; once its ledger row and stored prompt are in, the tiers that served."""
    served = []
    for content in prompts:
        r = httpx.post(
            f"{gw.url}/v1/chat/completions",
            json={"model": "auto", "messages": [{"role": "user", "content": content}], "max_tokens": 8},
            headers={"Authorization": f"Bearer {app_key}"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        served.append(r.headers["x-switchboard-tier"])

    def stored() -> int:
        with gw.live.db.session() as s:
            return s.query(RoutedPrompt).filter(RoutedPrompt.tenant_id == tid).count()

    wait_for(lambda: len(gw.live.usage_rows(tenant_id=tid)) == len(prompts) and stored() == len(prompts))
    return served


def test_the_preview_shows_the_dry_runs_cost_and_confirming_saves_only_routing(gw: Gateway) -> None:
    policy = Policy(
        router=RouterSettings(store_prompts=True),
        sampling=SamplingLimits(max_tokens_cap=64, temperature_default=0.3),
        budgets=[Budget(period="daily", money=Decimal("10"))],
    )
    name, tid, app_key, admin_key = gw.tenant(policy)
    served = routed_traffic(gw, app_key, tid, (SIMPLE, "What's the capital of France?", HARD))
    assert "small" in served  # SIMPLE goes small at the router's threshold

    admin = signed_in(gw, admin_key)
    token = form_token(admin.get(routing(name)).text)
    form = {"csrf": token, "tier:small": "on", "tier:large": "on", "mode": "threshold", "threshold": "1"}
    r = admin.post(routing(name), data={**form, "note": "everything large"})
    assert r.status_code == 200, errors(r.text)
    preview = r.text.split('id="preview"')[1].split("</section>")[0]
    assert f"{served.count('small')} to large, 0 to small" in preview
    before, after = dollars(preview, "cost-before"), dollars(preview, "cost-after")
    assert before == sum(row.cost for row in gw.live.usage_rows(tenant_id=tid)) and after > before
    assert "router.mode" in preview and "router.threshold" in preview and "allowed_tiers" in preview
    assert 'class="mark proposed"' in r.text  # both operating points on the curve
    assert "100.0%" in preview  # the proposed point sends everything large
    assert gw.policies.current(tid).version == 1  # a preview saves nothing

    r = confirm(admin, name, token, preview)
    assert r.status_code == 303 and r.headers["location"] == f"{routing(name)}?saved=2"
    assert 'id="saved">Saved v2.' in admin.get(r.headers["location"]).text
    saved = gw.policies.current(tid)
    assert saved.version == 2 and saved.note == "everything large"
    assert saved.policy.allowed_tiers == ["small", "large"]
    assert (saved.policy.router.mode, saved.policy.router.threshold) == ("threshold", 1.0)
    untouched = policy.model_dump(mode="json")
    for key in ("sampling", "budgets", "cache", "verifiers", "prices", "rate_limits", "tuning"):
        assert saved.policy.model_dump(mode="json")[key] == untouched[key], key
    assert saved.policy.router.store_prompts

    (entry, *_) = audit.entries(gw.live.db, tid, 1)
    assert (entry.action, entry.target) == ("policy.update", "policy v2") and entry.actor.startswith("admin:")
    assert admin_key.startswith(entry.actor.removeprefix("admin:"))
    assert entry.before == untouched and entry.after == saved.policy.model_dump(mode="json")
    assert "router.threshold" in admin.get(f"/console/audit?tenant={name}").text

    r = confirm(admin, name, token, preview)  # the same preview, once more
    assert r.status_code == 409 and "changed since this preview" in r.text
    assert gw.policies.current(tid).version == 2


def test_a_new_large_share_is_calibrated_on_the_tenants_own_prompts(gw: Gateway, router_dir: Path) -> None:
    name, tid, _, admin_key = gw.tenant(Policy(allowed_tiers=["small", "large"]))
    p = np.random.default_rng(7).uniform(0.05, 0.95, 120)
    with gw.live.db.session() as s:
        s.add_all(
            RoutedPrompt(tenant_id=tid, request_id=f"r{i}", messages=[], p_small_ok=float(x), tier="small")
            for i, x in enumerate(p)
        )
    admin = signed_in(gw, admin_key)
    page = admin.get(routing(name)).text
    assert "this tenant's 120 most recent routed prompts" in html.unescape(page)
    assert 'id="mode-quality_floor" disabled' in page  # no labels there: the router's prediction only
    token = form_token(page)
    r = admin.post(routing(name), data={"csrf": token, "any_tier": "on", "mode": "large_share", "large_share": "0.5"})
    assert r.status_code == 200, errors(r.text)
    r = confirm(admin, name, token, r.text)
    assert r.status_code == 303
    policy = gw.policies.current(tid).policy
    assert policy.allowed_tiers is None and (policy.router.mode, policy.router.large_share) == ("large_share", 0.5)
    calibration = policy.router.calibration
    assert calibration is not None and calibration.prompts == 120
    assert calibration.threshold == threshold_for_share(p, 0.5) and calibration.large_share == 0.5
    assert calibration.router == load_router(router_dir).id
    routing_stage = app_services(gw.live.app).pipeline.routing
    assert routing_stage.threshold(policy, name)[:2] == (calibration.threshold, "tenant")

    r = admin.post(
        routing(name), data={"csrf": token, "any_tier": "on", "mode": "quality_floor", "quality_floor": "0.5"}
    )
    assert r.status_code == 422 and "needs labeled prompts" in errors(r.text)


def test_a_quality_floor_is_saved_as_the_threshold_that_keeps_it(
    gw: Gateway, heldout_p: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> None:
    name, tid, _, admin_key = gw.tenant()
    p, small, large = heldout_p
    floor = round(float(small.mean() + large.mean()) / 2, 3)
    admin = signed_in(gw, admin_key)
    token = form_token(admin.get(routing(name)).text)
    data = {"csrf": token, "tier:large": "on", "mode": "quality_floor", "quality_floor": str(floor)}
    r = admin.post(routing(name), data=data)
    assert r.status_code == 200, errors(r.text)
    assert f"(quality floor {floor:g})" in r.text
    r = confirm(admin, name, token, r.text)
    assert r.status_code == 303
    policy = gw.policies.current(tid).policy
    assert policy.allowed_tiers == ["large"] and policy.router.mode == "threshold"
    assert policy.router.threshold == threshold_for_quality_floor(p, small, large, floor)
    assert operating_point(p, small, large, policy.router.threshold).quality >= floor


def test_without_a_router_the_form_edits_tiers_and_mode_and_says_why_there_is_no_curve(plain: Gateway) -> None:
    name, tid, _, admin_key = plain.tenant()
    admin = signed_in(plain, admin_key)
    page = admin.get(routing(name)).text
    unavailable = page.split('id="curve-unavailable"')[1].split("</p>")[0]
    assert "The curve is unavailable" in unavailable and "no router is configured" in unavailable
    assert 'id="routing-curve"' not in page and 'id="mode-quality_floor" disabled' in page
    token = form_token(page)
    r = admin.post(routing(name), data={"csrf": token, "tier:small": "on", "mode": "large_share", "large_share": "0.4"})
    assert r.status_code == 200, errors(r.text)
    preview = r.text.split('id="preview"')[1].split("</section>")[0]
    assert "nothing is re-routed" in preview and 'id="cost-before">$0.00<' in preview
    r = confirm(admin, name, token, r.text)
    assert r.status_code == 303
    policy = plain.policies.current(tid).policy
    assert policy.allowed_tiers == ["small"]
    assert (policy.router.mode, policy.router.large_share, policy.router.calibration) == ("large_share", 0.4, None)
    r = admin.post(routing(name), data={"csrf": token, "tier:small": "on", "mode": "large_share", "large_share": "0.4"})
    assert 'id="no-change"' in r.text and 'id="confirm"' not in r.text


def test_a_router_without_held_out_labels_or_tenant_prompts_gives_the_reason(gw: Gateway, tmp_path: Path) -> None:
    from types import SimpleNamespace

    from gateway.console.routing_plan import curve_data
    from gateway.routing.stage import RoutingStage

    _, tid, _, _ = gw.tenant()
    for metadata, why in (({}, "names no label file"), ({"label_file": str(tmp_path / "gone")}, "no such label file")):
        router = SimpleNamespace(id=f"r-{len(metadata)}", metadata=metadata)
        stage = RoutingStage(SimpleNamespace(router=router), {})  # type: ignore[arg-type]
        found = curve_data(gw.live.db, stage, tmp_path, tid)
        assert isinstance(found, str) and "0 routed prompts stored (fewer than 100)" in found and why in found


# --- what the tenant's own verdicts taught ---------------------------------------------------------------


def learned_routing(router: str) -> LearnedRouting:
    return LearnedRouting(
        router=router, threshold=0.42, identities={}, cells={}, verdicts=6, shadow_judged=3, ratio=0.9712,
        low=0.9613, large_share=0.18, large_share_before=0.31, prompts=30, made=time.time(),
    )  # fmt: skip


def taught(gw: Gateway, name: str, policy: Policy) -> str:
    """Plant what a tenant's routed requests and verdicts leave in the routing stage: 30 routed prompts under
    `policy` and 10 verdicts (7 shadow, 3 explore, $0.0005 each); the router's id."""
    stage = app_services(gw.live.app).pipeline.routing
    assert stage.service is not None
    router = stage.service.router.id
    stage.tenant_drift.setdefault(name, LargeShareWindow()).add(False, None)  # as a routed request leaves them
    stage.floor.add(name, "small", policy)  # with the policy it ran under
    cell = cell_of(TEXT, 0, True)
    for p in np.random.default_rng(1).uniform(0.2, 0.95, 30):
        stage.learning.add(name, Seen(cell, True, {"small": float(p)}), bool(p < 0.5))
    identity = stage.learning.identities.get("small", "")
    for i, direction in enumerate(["shadow"] * 7 + ["explore"] * 3):
        verdict = Verdict("small", identity, i % 5 != 0, cell, router, time.time(), direction, Decimal("0.0005"))
        stage.learning.verdicts.add(name, verdict)
    return router


def learned_section(text: str) -> str:
    return text.split('id="learned"')[1].split("</section>")[0]


def test_the_routing_page_shows_what_the_tenants_verdicts_taught(gw: Gateway) -> None:
    name, tid, _, admin_key = gw.tenant()
    admin = signed_in(gw, admin_key)
    section = learned_section(admin.get(routing(name)).text)
    assert "No learning data yet: this tenant has had no routed request since the gateway started." in section
    assert 'id="learning-reset"' not in section  # nothing to reset

    stage = app_services(gw.live.app).pipeline.routing
    assert stage.service is not None
    policy = Policy(router=RouterSettings(learned=learned_routing(stage.service.router.id), explore_share=0.05))
    gw.policies.save(tid, policy, "test")
    router = taught(gw, name, policy)
    assert stage.stats({name})["tenants"][name]["learning"]["active"]  # as `GET /v1/admin/router` says it
    page = admin.get(routing(name)).text
    section = learned_section(page)
    assert "<strong>active</strong>: threshold 0.4200" in section
    quality = section.split('id="learning-quality">')[1].split("</td>")[0]
    assert "0.971</span> of always-large's, 95% low end 0.961 · floor 0.950" in quality
    assert "short of the floor" not in quality
    assert "31.0% → 18.0%" in section
    counted = stage.learning.verdicts.count(name, stage.learning.identities, router)
    assert counted == 10  # the planted verdicts count for the tier identity the gateway serves
    assert "10 since the last reset in 1 cell, 4 fresh since the last learning" in section  # 10 less the 6 learned
    share = stage.explorer.share(Versioned(0, policy), name, router) if stage.explorer is not None else 0.0
    explore = f"{100 * share:.1f}% of large answers explored now; 3 runs, {usd(Decimal('0.0015'))}"
    assert explore in section and f"7 runs, {usd(Decimal('0.0035'))}" in section
    assert "They are operator-paid" in section and "<code>router.shadow_billed</code> is off" in section
    # the learned curve, beside the router's: x the share sent large, y the quality ratio, the learned point marked
    assert 'id="routing-curve"' in page
    svg = section.split('id="learned-curve"')[1].split("</svg>")[0]
    found = stage.learning.summary(name, policy, router, ["small", "large"])
    line = re.search(r'<polyline class="curve" points="([^"]+)"', svg)
    assert found["curve"] and line and len(line.group(1).split()) == len(found["curve"])
    assert svg.count('class="mark current"') == 1 and "learned: 18% of requests large, quality 0.971" in svg
    assert "this tenant's 30 most recent routed prompts" in section
    assert 'action="/console/tenants/' + name + '/policy/routing/learning/reset"' in section

    # what the policy in force says, at once (not what the tenant's last routed request ran under)
    off = Policy(router=RouterSettings(learned=policy.router.learned, learn=False, shadow_billed=True))
    gw.policies.save(tid, off, "test")
    section = learned_section(admin.get(routing(name)).text)
    assert "not active" in section and "learning is off for this tenant (router.learn)" in section
    assert 'id="learning-quality"' not in section and 'id="learned-curve"' in section
    assert "This policy bills them (<code>router.shadow_billed</code>)" in section


def test_an_admin_resets_what_the_tenants_verdicts_taught(gw: Gateway) -> None:
    name, tid, _, admin_key = gw.tenant()
    stage = app_services(gw.live.app).pipeline.routing
    assert stage.service is not None
    policy = Policy(router=RouterSettings(learned=learned_routing(stage.service.router.id)))
    gw.policies.save(tid, policy, "test")
    taught(gw, name, policy)
    admin = signed_in(gw, admin_key)
    page = admin.get(routing(name)).text
    assert "<strong>active</strong>" in learned_section(page)
    started = time.time()
    r = admin.post(f"{routing(name)}/learning/reset", data={"csrf": form_token(page)})
    assert r.status_code == 303 and r.headers["location"] == f"{routing(name)}?reset=2"
    page = admin.get(r.headers["location"]).text
    assert 'id="reset">Reset what it learned: v2' in page
    section = learned_section(page)
    assert "not active" in section and "nothing learned yet" in section
    assert "0 since the last reset in 0 cells, 0 fresh" in section  # the planted verdicts came before the reset

    saved = gw.policies.current(tid)
    assert saved.version == 2 and saved.policy.router.learned is None
    assert saved.policy.router.learn_since > 0 and saved.policy.router.learn_since >= started - 1
    (entry, *_) = audit.entries(gw.live.db, tid, 1)
    assert (entry.action, entry.target) == ("policy.reset_learning", "policy v2") and entry.actor.startswith("admin:")
    assert admin_key.startswith(entry.actor.removeprefix("admin:"))
    assert entry.before["router"]["learned"] is not None and entry.after["router"]["learned"] is None


def test_only_an_admin_of_the_tenant_resets_what_it_learned(gw: Gateway) -> None:
    name, tid, app_key, admin_key = gw.tenant(Policy(router=RouterSettings(learned=learned_routing("r"))))
    other_name, _, _, other_admin = gw.tenant()
    admin = signed_in(gw, admin_key)
    page = admin.get(routing(name)).text
    section = learned_section(page)  # no routed request yet, but a learned routing in the policy: resettable
    assert "No learning data yet" in section and 'id="reset-learning"' in section
    reset = f"{routing(name)}/learning/reset"

    finance = signed_in(gw, gw.operator_finance)
    r = finance.post(reset, data={"csrf": form_token(finance.get("/console/finance").text)})
    assert r.status_code == 403 and "needs a key with the admin role" in r.text
    with httpx.Client(base_url=gw.url, follow_redirects=False) as app:
        login = app.get("/console/login").text
        r = app.post("/console/login", data={"key": app_key, "csrf": form_token(login)})
        assert r.status_code == 403 and "Only admin and finance keys can sign in" in r.text
        assert app.post(reset, data={"csrf": form_token(login)}).headers["location"] == "/console/login"
    other = signed_in(gw, other_admin)
    r = other.post(reset, data={"csrf": form_token(other.get(routing(other_name)).text)})
    assert r.status_code == 404  # another tenant's admin: as if it did not exist
    r = admin.post(reset, data={})
    assert r.status_code == 403 and "security token" in r.text
    current = gw.policies.current(tid)
    assert current.version == 1 and current.policy.router.learned is not None and current.policy.router.learn_since == 0

    operator = signed_in(gw, gw.operator_admin)  # the operator's admin may, as it may save the routing form
    r = operator.post(reset, data={"csrf": form_token(operator.get(routing(name)).text)})
    assert r.status_code == 303 and gw.policies.current(tid).policy.router.learned is None


# --- the curve and its chart, without a server ----------------------------------------------------------------


def test_the_curve_is_evaluates_quality_curve_with_a_threshold_at_each_point() -> None:
    rng = np.random.default_rng(0)
    p = np.round(rng.uniform(0.01, 0.99, 300), 2)  # ties: a threshold cannot split them
    small, large = rng.random(300) < p, rng.random(300) < 0.8
    curve, reference = routing_curve(p, small, large), quality_curve(p, small, large)
    assert np.allclose([c.large_share for c in curve.points], reference.shares)
    assert np.allclose([c.quality for c in curve.points], reference.quality)
    for point in curve.points:
        assert operating_point(p, small, large, point.threshold) == point
    expected = routing_curve(p, p, np.ones(300))  # probabilities: expected quality
    assert expected.q_small == pytest.approx(p.mean()) and expected.q_large == pytest.approx(1.0)
    with pytest.raises(ValueError):
        routing_curve(p, small, large[:-1])


def test_the_chart_thins_a_long_curve_and_keeps_its_ends_and_marks_in_the_plot() -> None:
    points = [(k / 5000, 0.4 + 0.3 * (k / 5000) ** 0.5) for k in range(5001)]
    chart = curve_chart(points, [("current", 0.25, 0.55, "in force"), ("proposed", 1.0, 0.7, "proposed")])
    vertices = [tuple(map(float, v.split(","))) for v in chart.line.split()]
    assert len(vertices) <= MAX_CURVE_POINTS + 1
    assert vertices[0] == (chart.left, chart.plot_bottom) and vertices[-1][0] == chart.plot_right
    for m in chart.marks:
        assert chart.left <= m.x <= chart.plot_right and chart.plot_top <= m.y <= chart.plot_bottom
    assert [t.text for t in chart.y_ticks] == ["0.4", "0.5", "0.6", "0.7"]


# --- in a browser --------------------------------------------------------------------------------------


@pytest.fixture
def browser() -> Iterator:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(f"needs Chromium at {CHROMIUM} and its driver at {CHROMEDRIVER}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,2000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_an_admin_previews_and_saves_routing_in_the_browser(gw: Gateway, browser: object, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    assert isinstance(browser, WebDriver)
    driver, wait = browser, WebDriverWait(browser, 60)
    name, tid, app_key, _ = gw.tenant(Policy(router=RouterSettings(store_prompts=True)))
    served = routed_traffic(gw, app_key, tid, (SIMPLE, HARD, "Name a famous painter."))
    driver.get(f"{gw.url}/console/login")
    driver.find_element(By.ID, "key").send_keys(gw.operator_admin)
    driver.find_element(By.CSS_SELECTOR, "form[action='/console/login'] button[type=submit]").click()
    wait.until(ec.url_to_be(f"{gw.url}/console"))

    driver.get(f"{gw.url}/console/tenants/{name}/policy")
    driver.find_element(By.ID, "routing-link").click()
    curve = wait.until(ec.visibility_of_element_located((By.ID, "routing-curve")))
    assert curve.size["width"] > 300 and driver.find_elements(By.CSS_SELECTOR, "#routing-curve circle.mark.current")

    driver.find_element(By.ID, "any-tier").click()  # off: the boxes decide
    driver.find_element(By.ID, "tier-large").click()  # off: small only
    driver.find_element(By.ID, "mode-threshold").click()
    value = driver.find_element(By.ID, "threshold")
    value.clear()
    value.send_keys("0.35")
    driver.find_element(By.ID, "note").send_keys("small only")
    driver.find_element(By.ID, "preview-button").click()
    wait.until(ec.visibility_of_element_located((By.ID, "preview")))
    assert driver.find_element(By.ID, "cost-before").text.startswith("$")
    assert driver.find_element(By.ID, "cost-after").text.startswith("$")
    assert f"{served.count('large')} to small" in driver.find_element(By.ID, "dry-run").text  # small only
    assert driver.find_elements(By.CSS_SELECTOR, "#routing-curve circle.mark.proposed")
    assert "allowed_tiers" in driver.find_element(By.ID, "changes").text
    points = driver.find_element(By.ID, "operating-points").text
    assert "only small is allowed: everything goes there" in points and "0.0%" in points  # small only: none large

    shot = tmp_path / "console-routing.png"
    assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 0
    if target := os.environ.get("SWITCHBOARD_TEST_SCREENSHOTS"):  # keep it for a person to look at
        shutil.copy(shot, Path(target) / shot.name)

    driver.find_element(By.ID, "confirm").click()
    saved = wait.until(ec.presence_of_element_located((By.ID, "saved")))
    assert saved.text == "Saved v2."
    policy = gw.policies.current(tid).policy
    assert policy.allowed_tiers == ["small"] and (policy.router.mode, policy.router.threshold) == ("threshold", 0.35)
