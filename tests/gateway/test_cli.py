"""The real commands: `switchboard serve` as users start it, and the tenant/key/db commands."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import httpx
import openai
import pytest

import services

SWITCHBOARD = str(Path(sys.executable).parent / "switchboard")


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SWITCHBOARD, *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def home_env(tmp_path: Path, smollm2_dir: Path) -> dict[str, str]:
    """A fresh home that already holds the fetched SmolLM2 (linked, not copied)."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / smollm2_dir.name).symlink_to(smollm2_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    env.update(SWITCHBOARD_HOME=str(home), SWITCHBOARD_CONFIG=str(tmp_path / "switchboard.toml"))
    env.update(SWITCHBOARD_ROUTER_AUTO_TRAIN="false")  # no router trained in the background of these tests
    return env


def test_serve_answers_the_openai_client(home_env: dict[str, str], tmp_path: Path) -> None:
    port = services.free_port()
    (tmp_path / "switchboard.toml").write_text(
        f'port = {port}\nlog_level = "warning"\n\n[tiers.small]\nmodel = "smollm2-135m-instruct"\nthreads = 1\n'
    )
    server = subprocess.Popen(
        [SWITCHBOARD, "serve"], env=home_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        created = cli(home_env, "tenant", "create", "acme")
        assert created.returncode == 0, created.stderr
        key = created.stdout.strip()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(
            model="small", messages=[{"role": "user", "content": "Name the capital of France."}], temperature=0
        )
        assert "Paris" in reply.choices[0].message.content
        assert (Path(home_env["SWITCHBOARD_HOME"]) / "switchboard.db").exists()  # the embedded default
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(30)
    assert server.returncode == 0


def test_tenant_and_key_commands(home_env: dict[str, str], postgres_url: str) -> None:
    for env in (home_env, {**home_env, "SWITCHBOARD_DATABASE_URL": postgres_url}):
        upgraded = cli(env, "db", "upgrade")
        assert upgraded.returncode == 0 and "revision 0006" in upgraded.stderr
        first = cli(env, "tenant", "create", "acme")
        assert first.returncode == 0 and first.stdout.startswith("sk-sb-")
        again = cli(env, "tenant", "create", "acme")
        assert again.returncode == 1 and "already exists" in again.stderr and "Traceback" not in again.stderr
        second = cli(env, "key", "create", "acme", "--role", "finance")
        assert second.returncode == 0 and second.stdout.strip() != first.stdout.strip()
        revoked = cli(env, "key", "revoke", first.stdout.strip()[:20])
        assert revoked.returncode == 0
        missing = cli(env, "key", "revoke", "sk-sb-nothing-like-this")
        assert missing.returncode == 1 and "no key" in missing.stderr
        ops = cli(env, "tenant", "create", "ops", "--operator", "--role", "admin")
        assert ops.returncode == 0 and "operator tenant ops; its admin key" in ops.stderr


def test_adapter_commands(home_env: dict[str, str], smollm2_dir: Path, tmp_path: Path) -> None:
    """add checks the files against the tier's checkpoint before keeping anything; list and remove."""
    pytest.importorskip("peft")
    from lora_adapters import make_adapter

    (tmp_path / "switchboard.toml").write_text('[tiers.small]\nmodel = "smollm2-135m-instruct"\nweights = "bf16"\n')
    adapter = make_adapter(smollm2_dir, tmp_path / "support", 1)
    assert cli(home_env, "tenant", "create", "acme").returncode == 0
    added = cli(home_env, "adapter", "add", "acme", "small", "support", str(adapter))
    assert added.returncode == 0, added.stderr
    assert "registered small:support for acme: rank 4" in added.stderr
    listed = [json.loads(line) for line in cli(home_env, "adapter", "list", "--tenant", "acme").stdout.splitlines()]
    assert [(a["model"], a["source"], a["created_by"]) for a in listed] == [("small:support", "uploaded", "cli")]
    again = cli(home_env, "adapter", "add", "acme", "small", "support", str(adapter))
    assert again.returncode == 1 and "replace it explicitly" in again.stderr and "Traceback" not in again.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    (broken / "adapter_model.safetensors").write_bytes(b"")
    bad = cli(home_env, "adapter", "add", "acme", "small", "broken", str(broken))
    assert bad.returncode == 1 and "is not JSON" in bad.stderr and "Traceback" not in bad.stderr
    assert cli(home_env, "adapter", "add", "acme", "huge", "x", str(adapter)).returncode == 1
    assert cli(home_env, "adapter", "add", "nobody", "small", "x", str(adapter)).returncode == 1
    removed = cli(home_env, "adapter", "remove", "acme", "small", "support")
    assert removed.returncode == 0, removed.stderr
    assert cli(home_env, "adapter", "list").stdout == ""
    folder = Path(home_env["SWITCHBOARD_HOME"]) / "adapters"
    assert [p for p in folder.rglob("*") if p.is_file()] == []  # neither the checked files nor the broken ones


def test_budgets_reconcile_rewrites_counters_from_the_ledger(
    home_env: dict[str, str], redis_server: str, redis_namespace: str
) -> None:
    import redis

    from core.db.database import Database
    from core.settings import Settings
    from gateway.accounting.ledger import Ledger, UsageRecord
    from gateway.accounting.tenants import authenticate, create_tenant

    env = {**home_env, "SWITCHBOARD_REDIS_URL": redis_server, "SWITCHBOARD_REDIS_NAMESPACE": redis_namespace}
    db = Database(Settings(home=Path(home_env["SWITCHBOARD_HOME"])).database)
    db.upgrade()
    who = authenticate(db, create_tenant(db, "acme").key)
    rec = UsageRecord.from_columns(
        "r1", who.tenant_id, who.key_id, "completions", "m", "small", 10, 5, 1, "ok", "stop", cost=Decimal("0.125")
    )
    Ledger(db, Path(home_env["SWITCHBOARD_HOME"]) / "spool").record(rec)
    done = cli(env, "budgets", "reconcile")
    assert done.returncode == 0 and "rewrote 4 spend counters" in done.stderr, done.stderr
    r = redis.Redis.from_url(redis_server)
    day = datetime.now(UTC).date()
    money = r.get(f"{redis_namespace}:spend:{who.tenant_id}:daily:{day.isoformat()}:money")
    tokens = r.get(f"{redis_namespace}:spend:{who.tenant_id}:monthly:{day.strftime('%Y-%m')}:tokens")
    assert (int(money), int(tokens)) == (1_250_000_000, 15)  # $0.125 in 1e-10 units; 10 + 5 tokens
    db.dispose()


def test_models_list_and_bad_settings(home_env: dict[str, str], tmp_path: Path) -> None:
    listed = cli(home_env, "models", "list")
    assert listed.returncode == 0
    assert "smollm2-135m-instruct" in listed.stdout and "fetched" in listed.stdout
    (tmp_path / "switchboard.toml").write_text('[tiers.small]\ndtype = "int3"\n')
    bad = cli(home_env, "db", "upgrade")
    assert bad.returncode == 1 and "invalid settings" in bad.stderr and "dtype" in bad.stderr


def test_a_child_process_loads_the_gateways_own_settings_from_its_environment(tmp_path: Path) -> None:
    """`settings_environment` (how the distill schedule hands its settings to `switchboard distill`): a child's
    `Settings()` equals them, secrets, nested tiers and aliases included, whatever the parent's environment held."""
    from core.settings import Settings, settings_environment

    settings = Settings(home=tmp_path, database_url="sqlite:///x.db", key_secret="s3cret", port=0,
                        tiers={"small": {"model": str(tmp_path / "m"), "dtype": "fp32", "max_num_seqs": 3},
                               "large": {"model": str(tmp_path / "l"), "url": "http://127.0.0.1:9/v1",
                                         "api_key": "k"}},
                        model_aliases={"gpt-4o-mini": "small"}, tuning_check_seconds=0)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")} | settings_environment(settings)
    env |= {"SWITCHBOARD_CONFIG": str(tmp_path / "none.toml"), "PYTHONPATH": os.getcwd()}
    code = ("import json; from core.settings import Settings, settings_environment as e; s = Settings(); "
            "print(json.dumps([e(s), s.key_secret.get_secret_value(), s.tiers['large'].api_key.get_secret_value(), "
            "s.tiers['small'].max_num_seqs, s.model_aliases]))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    child_env, secret, api_key, seqs, aliases = json.loads(done.stdout)
    assert child_env == settings_environment(settings)  # every field, the secrets in the clear
    assert (secret, api_key, seqs, aliases) == ("s3cret", "k", 3, {"gpt-4o-mini": "small"})
