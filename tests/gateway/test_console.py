"""The web console: sign-in, roles, tenant scoping, CSRF and inline policy errors over HTTP, then the whole
admin-and-finance flow in headless Chromium. SQLite only: the API tests cover PostgreSQL."""

from __future__ import annotations

import csv
import io
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import httpx
import openai
import pytest

from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import authenticate, create_key, create_tenant, revoke_key
from gateway.api.deps import app_services
from gateway.console.session import csrf_token, session_key_id, session_token
from live import LiveServer, start_server

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


@dataclass
class Console:
    live: LiveServer
    operator_admin: str
    operator_finance: str
    acme_app: str
    acme_admin: str
    beta_admin: str

    @property
    def url(self) -> str:
        return self.live.base_url

    def tenant_id(self, key: str) -> int:
        principal = authenticate(self.live.db, key)
        assert principal is not None
        return principal.tenant_id

    def policy_version(self, key: str) -> int:
        return app_services(self.live.app).policies.current(self.tenant_id(key)).version


@pytest.fixture(scope="module")
def console(small_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    from core.db.database import Database
    from core.settings import Settings
    from gateway.app import create_app

    home = tmp_path_factory.mktemp("console")
    url = f"sqlite:///{home / 'switchboard.db'}"
    db = Database(url)
    settings = Settings(home=home, database_url=url, tiers={"small": {"model": "unused"}})
    live, stop = start_server(create_app(settings, engines={"small": small_engine}, database=db), db)
    try:
        yield Console(
            live,
            operator_admin=create_tenant(db, "ops", operator=True, role="admin").key,
            operator_finance=create_key(db, "ops", "finance").key,
            acme_app=create_tenant(db, "acme").key,
            acme_admin=create_key(db, "acme", "admin").key,
            beta_admin=create_tenant(db, "beta", role="admin").key,
        )
    finally:
        stop()
        db.dispose()


def form_token(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "the page has no form with a CSRF token"
    return found.group(1)


def try_sign_in(console: Console, key: str) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(base_url=console.url, follow_redirects=False, timeout=60)
    token = form_token(client.get("/console/login").text)
    return client, client.post("/console/login", data={"key": key, "csrf": token})


def signed_in(console: Console, key: str) -> httpx.Client:
    client, r = try_sign_in(console, key)
    assert r.status_code == 303 and r.headers["location"] == "/console"
    return client


# --- over HTTP -----------------------------------------------------------------------------------------


def test_sign_in_takes_only_admin_and_finance_keys(console: Console) -> None:
    with httpx.Client(base_url=console.url, follow_redirects=False) as anonymous:
        r = anonymous.get("/console/tenants")
        assert r.status_code == 303 and r.headers["location"] == "/console/login"

    client, r = try_sign_in(console, console.acme_app)
    assert r.status_code == 403 and "Only admin and finance keys" in r.text
    assert "sb_console" not in client.cookies
    assert client.get("/console").status_code == 303

    _, r = try_sign_in(console, "sk-sb-" + "x" * 43)
    assert r.status_code == 401 and "not valid" in r.text

    client, r = try_sign_in(console, console.acme_admin)
    assert r.status_code == 303
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
    assert console.acme_admin not in cookie  # the session names the key by id; the key never leaves the form
    page = client.get("/console")
    assert page.status_code == 200 and "/console/tenants" in page.text and "/console/finance" not in page.text
    assert "script-src" not in page.headers["content-security-policy"]  # default-src 'none': no scripts at all


def test_roles_guard_their_pages(console: Console) -> None:
    finance = signed_in(console, console.operator_finance)
    r = finance.get("/console/tenants/acme/policy")
    assert r.status_code == 403 and "needs a key with the admin role" in r.text
    assert finance.get("/console/audit").status_code == 403
    assert finance.get("/console/finance").status_code == 200

    admin = signed_in(console, console.operator_admin)
    assert admin.get("/console/finance").status_code == 403
    assert admin.get("/console/finance.csv").status_code == 403


def test_a_tenant_admin_sees_only_its_own_tenant(console: Console) -> None:
    acme = signed_in(console, console.acme_admin)
    assert acme.get("/console/tenants/acme/policy").status_code == 200
    for path in ("/console/tenants/beta/policy", "/console/tenants/beta", "/console/audit?tenant=beta"):
        assert acme.get(path).status_code == 404, path
    listing = acme.get("/console/tenants").text
    assert "/console/tenants/acme" in listing and "/console/tenants/beta" not in listing
    assert "New tenant" not in listing  # only the operator creates tenants

    token = form_token(acme.get("/console/tenants/acme").text)
    r = acme.post("/console/tenants/beta/policy", data={"csrf": token, "policy": "{}"})
    assert r.status_code == 404
    assert acme.post("/console/tenants", data={"csrf": token, "name": "gamma"}).status_code == 403

    operator = signed_in(console, console.operator_admin)
    assert operator.get("/console/tenants/beta/policy").status_code == 200


def test_an_invalid_policy_is_shown_back_with_each_field_path(console: Console) -> None:
    admin = signed_in(console, console.acme_admin)
    token = form_token(admin.get("/console/tenants/acme/policy").text)
    before = console.policy_version(console.acme_admin)

    text = '{"budgets": [{"period": "weekly"}], "sampling": {"temperature_max": 9}}'
    r = admin.post("/console/tenants/acme/policy", data={"csrf": token, "policy": text, "note": "try"})
    assert r.status_code == 422
    errors = r.text.split('id="policy-errors"')[1].split("</div>")[0]
    assert '<code class="path">budgets.0.period</code>' in errors
    assert '<code class="path">sampling.temperature_max</code>' in errors
    assert "&#34;weekly&#34;" in r.text.split('id="policy"')[1]  # the user's text is kept, escaped

    r = admin.post("/console/tenants/acme/policy", data={"csrf": token, "policy": '{"budgets": [', "note": ""})
    assert r.status_code == 422 and "line 1, column" in r.text

    r = admin.post("/console/tenants/acme/policy", data={"csrf": token, "policy": '{"allowed_tiers": ["large"]}'})
    assert r.status_code == 422 and "allowed_tiers" in r.text  # a price exists, but no such tier is served here
    assert console.policy_version(console.acme_admin) == before


def test_a_tuning_proposal_is_shown_with_its_evidence_and_applied_from_the_console(console: Console) -> None:
    import numpy as np

    from policies.tune_report import plot_png
    from policies.tuning import Candidate, Scored, choose

    tid, store = console.tenant_id(console.acme_admin), app_services(console.live.app).proposals
    current = app_services(console.live.app).policies.current(tid)

    def scored(c: Candidate, tokens: float) -> Scored:
        return Scored(c, c.apply(current.policy), np.full(8, tokens), [Decimal(tokens) / 100] * 8, np.ones(8))

    cap = Candidate("cap", {"sampling.max_tokens_cap": 64})
    tuning = choose([scored(Candidate("current", {}), 100), scored(cap, 60)], 0.02)
    pid = store.save(tid, current.version, tuning, plot_png(tuning.as_dict()), "test")
    admin = signed_in(console, console.acme_admin)
    base = "/console/tenants/acme/policy/proposals"
    assert f"{base}/{pid}" in admin.get(base).text
    page = admin.get(f"{base}/{pid}")
    assert page.status_code == 200 and "sampling.max_tokens_cap" in page.text and 'id="apply"' in page.text
    assert "40.0% fewer completion tokens" in page.text
    assert admin.get(f"{base}/{pid}/plot.png").content.startswith(b"\x89PNG")
    assert admin.get(f"{base}/99999999999").status_code == 422
    beta = signed_in(console, console.beta_admin)
    assert beta.get(f"{base}/{pid}").status_code == 404 and beta.get(f"{base}/{pid}/plot.png").status_code == 404

    token = form_token(page.text)
    r = admin.post(f"{base}/{pid}/apply", data={"csrf": token})
    assert r.status_code == 303 and console.policy_version(console.acme_admin) == current.version + 1
    assert app_services(console.live.app).policies.current(tid).policy.sampling.max_tokens_cap == 64
    again = admin.post(f"{base}/{pid}/apply", data={"csrf": token})
    assert again.status_code == 409 and "nothing to decide" in again.text


def test_posts_without_the_sessions_csrf_token_are_refused(console: Console) -> None:
    admin = signed_in(console, console.acme_admin)
    other = signed_in(console, console.operator_admin)  # a token is bound to its session, so to its key
    theirs = form_token(other.get("/console/tenants/acme/policy").text)
    before = console.policy_version(console.acme_admin)
    body = {"policy": '{"sampling": {"max_tokens_cap": 5}}', "note": "forged"}
    for token in (None, "", theirs):  # another session's token is no good either
        data = body if token is None else {**body, "csrf": token}
        r = admin.post("/console/tenants/acme/policy", data=data)
        assert r.status_code == 403 and "security token" in r.text
    assert admin.post("/console/logout", data={}).status_code == 403
    assert admin.get("/console").status_code == 200  # still signed in
    assert console.policy_version(console.acme_admin) == before

    client = httpx.Client(base_url=console.url, follow_redirects=False)
    r = client.post("/console/login", data={"key": console.acme_admin})  # no sign-in nonce, no token
    assert r.status_code == 403 and "sb_console" not in client.cookies


def test_sessions_end_with_their_key_or_their_signature() -> None:
    secret, now = b"s" * 32, 1_700_000_000.0
    token = session_token(secret, 42, now)
    assert session_key_id(secret, token, now) == 42
    assert session_key_id(b"t" * 32, token, now) is None
    assert session_key_id(secret, token, now + 9 * 3600) is None  # expired
    key_id, expiry, signature = token.split(".")
    assert session_key_id(secret, f"43.{expiry}.{signature}", now) is None
    assert session_key_id(secret, f"{key_id}.{int(expiry) + 3600}.{signature}", now) is None
    for garbage in ("garbage", "².².x", "9" * 5000 + ".1.x", ""):
        assert session_key_id(secret, garbage, now) is None
    assert csrf_token(secret, token) != signature


def test_revoking_the_key_ends_its_sessions(console: Console) -> None:
    key = create_key(console.live.db, "acme", "admin").key
    client = signed_in(console, key)
    assert client.get("/console/tenants").status_code == 200
    revoke_key(console.live.db, key)
    r = client.get("/console/tenants")
    assert r.status_code == 303 and r.headers["location"] == "/console/login"


def finance_csv(client: httpx.Client, query: str = "") -> list[dict[str, str]]:
    r = client.get(f"/console/finance.csv{query}")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    return list(csv.DictReader(io.StringIO(r.text)))


def test_finance_csv_is_scoped_to_the_session(console: Console) -> None:
    # Usage for both tenants first: with none for acme, no CSV could show acme's rows, scoped or not.
    beta_app = create_key(console.live.db, "beta").key
    for key, requests in ((console.acme_app, 2), (beta_app, 1)):
        client = openai.OpenAI(base_url=f"{console.url}/v1", api_key=key, max_retries=0, timeout=120)
        for i in range(requests):
            reply = client.chat.completions.create(
                model="small", messages=[{"role": "user", "content": f"Count to {i + 2}."}], max_tokens=4
            )
            assert console.live.wait_for_usage(reply.id)
    ids = {"acme": console.tenant_id(console.acme_app), "beta": console.tenant_id(beta_app)}
    ledger = {tenant: console.live.usage_rows(tenant_id=tid) for tenant, tid in ids.items()}
    assert len(ledger["acme"]) >= 2 and len(ledger["beta"]) == 1

    def totals(rows: list[dict[str, str]], tenant: str) -> tuple[int, Decimal]:
        mine = [r for r in rows if r["tenant"] == tenant]
        return sum(int(r["requests"]) for r in mine), sum((Decimal(r["cost"]) for r in mine), Decimal(0))

    def billed(tenant: str) -> tuple[int, Decimal]:
        return len(ledger[tenant]), sum((r.cost for r in ledger[tenant]), Decimal(0))

    # The operator's finance key sees both tenants, each as the ledger has it...
    everyone = finance_csv(signed_in(console, console.operator_finance))
    assert {"acme", "beta"} <= {r["tenant"] for r in everyone}
    assert totals(everyone, "acme") == billed("acme") and totals(everyone, "beta") == billed("beta")
    assert billed("beta")[1] > 0  # priced: the cost columns are compared, not two zeros
    # ...beta's finance key only beta's rows, the same amounts.
    client = signed_in(console, create_key(console.live.db, "beta", "finance").key)
    mine = finance_csv(client)
    assert mine and {r["tenant"] for r in mine} == {"beta"}
    assert totals(mine, "beta") == billed("beta")
    assert client.get("/console/finance.csv?tenant=acme").status_code == 404
    assert client.get("/console/finance?start=2025-02-01&end=2025-01-01").status_code == 422


# --- in a browser --------------------------------------------------------------------------------------


@pytest.fixture
def browser() -> Iterator:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(f"needs Chromium at {CHROMIUM} and its driver at {CHROMEDRIVER}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_admin_edits_a_policy_and_finance_sees_the_chart(console: Console, browser: object, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    assert isinstance(browser, WebDriver)
    driver = browser
    wait = WebDriverWait(driver, 30)

    # Some real usage for acme, so the finance chart has a day to draw.
    client = openai.OpenAI(base_url=f"{console.url}/v1", api_key=console.acme_app, max_retries=0, timeout=120)
    for prompt in ("Name a colour.", "Name a fruit."):
        client.chat.completions.create(
            model="small", messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0
        )
    acme_id = console.tenant_id(console.acme_app)
    deadline = time.monotonic() + 30
    while len(console.live.usage_rows(tenant_id=acme_id)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(console.live.usage_rows(tenant_id=acme_id)) >= 2

    def sign_in(key: str) -> None:
        driver.get(f"{console.url}/console/login")
        driver.find_element(By.ID, "key").send_keys(key)
        driver.find_element(By.CSS_SELECTOR, "form[action='/console/login'] button[type=submit]").click()
        wait.until(ec.url_to_be(f"{console.url}/console"))

    # The operator's admin caps acme's completions in the policy editor.
    sign_in(console.operator_admin)
    driver.get(f"{console.url}/console/tenants/acme/policy")
    editor = driver.find_element(By.ID, "policy")
    policy = json.loads(editor.get_attribute("value") or "")
    policy["sampling"]["max_tokens_cap"] = 48
    editor.clear()
    editor.send_keys(json.dumps(policy))
    driver.find_element(By.ID, "note").send_keys("cap completions")
    driver.find_element(By.ID, "save").click()
    saved = wait.until(ec.presence_of_element_located((By.ID, "saved")))
    assert re.fullmatch(r"Saved v\d+\.", saved.text)
    assert app_services(console.live.app).policies.current(acme_id).policy.sampling.max_tokens_cap == 48

    driver.get(f"{console.url}/console/audit")
    rows = driver.find_elements(By.CSS_SELECTOR, "tr.entry[data-action='policy.update']")
    mine = [r for r in rows if "acme" in r.text and "sampling.max_tokens_cap" in r.text]
    assert mine, "no policy.update entry for acme in the audit log"
    assert "48" in mine[0].text

    driver.find_element(By.ID, "logout").click()
    wait.until(ec.url_to_be(f"{console.url}/console/login"))
    driver.get(f"{console.url}/console/tenants")
    assert driver.current_url == f"{console.url}/console/login"

    # Finance sees acme's day as bars.
    sign_in(console.operator_finance)
    driver.get(f"{console.url}/console/finance?tenant=acme")
    bars = driver.find_elements(By.CSS_SELECTOR, "#cost-chart rect.bar")
    assert bars, "the cost chart has no bars"
    assert any(float(b.get_attribute("height") or 0) > 0 and b.size["height"] > 0 for b in bars)
    assert driver.find_elements(By.CSS_SELECTOR, "#cost-chart rect.bar.cost")
    assert "acme" in driver.find_element(By.ID, "savings").text
    assert driver.find_element(By.ID, "csv").get_attribute("href").endswith("/console/finance.csv?tenant=acme")

    shot = tmp_path / "console-finance.png"
    assert driver.save_screenshot(str(shot))
    assert shot.exists() and shot.stat().st_size > 0
