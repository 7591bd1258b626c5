"""A tenant's prompt that tries to leave the code jail, end to end on PostgreSQL (SmolLM2-135M as both tiers,
as in test_checks_live): the prompt's ```python block runs shells, psql over PostgreSQL's Unix socket,
`kill`, writes and reads outside, then defines the function its doctest calls, so the default policy's
`prompt_examples` check runs it. The planted answer fails the doctest, so the check's verdict (escalate,
with the failing example) shows the program ran; the database, the files, the sentinel process and the
gateway are untouched, and each attempt is billed once. Then, with the jail forced unavailable, the same
request is served without the check (`unavailable` in the header and the usage row) and nothing runs."""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

import escapes
import services
from core.db.database import Database
from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import create_tenant
from grading.jail.machine import WITHOUT_ENV
from grading.sandbox import jail_status
from live import LiveServer, start_server

WRONG_CODE = "```python\ndef add(a, b):\n    return a - b\n```"


@pytest.fixture(scope="module")
def live(
    small_engine: AsyncEngine, postgres_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveServer, str, Path]]:
    """The gateway on a fresh PostgreSQL database; (server, psql's connection string over the socket, home)."""
    from core.settings import Settings
    from gateway.app import create_app

    home = tmp_path_factory.mktemp("jail-live")
    url, drop = services.create_database(postgres_server)
    db = Database(url)
    tiers = {"small": {"model": "unused"}, "large": {"model": "unused"}}
    settings = Settings(home=home, database_url=url, tiers=tiers)
    server, stop = start_server(
        create_app(settings, engines={"small": small_engine, "large": small_engine}, database=db), db
    )
    with db.session() as s:
        socket_dir = s.execute(sa.text("show unix_socket_directories")).scalar_one().split(",")[0].strip()
    u = sa.make_url(url)
    yield server, f"host={socket_dir} port={u.port} user={u.username} dbname={u.database}", home
    stop()
    db.dispose()
    drop()


def hostile_prompt(psql: str, marker: Path, victim: Path, home_file: Path, sentinel: int) -> str:
    attempts = [
        f"sh(\"psql '{psql}' -c 'delete from api_keys; create table pwned ()'\")",
        f"sh('touch {marker}; kill -9 {sentinel}')",
        f"open('{victim}', 'a').write('pwned')",
        f"print(open('{home_file}').read(), open('/etc/shadow').read())",
    ]
    kit = escapes.KIT.split("def native")[0]  # the shell helpers; the prompt must fit the model's window
    tries = "".join(f"try:\n    {a}\nexcept Exception:\n    pass\n" for a in attempts)
    code = f'{kit}\n{tries}\ndef add(a, b):\n    """The sum of a and b.\n    >>> add(2, 3)\n    5\n    """\n'
    return f"Complete the function in one ```python block.\n\n```python\n{code}```"


def ask(server: LiveServer, key: str, prompt: str) -> httpx.Response:
    body = {
        "model": "small",
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": 60,
        "response_format": {"type": "regex", "regex": "".join(f"\\{c}" if c in r"\.^$*+?()[]{}|-/" else
                                                              "\\n" if c == "\n" else c for c in WRONG_CODE)},
        "cache": "no-store",
    }  # fmt: skip
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=300)  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == WRONG_CODE  # the plant took
    return r


def counts(server: LiveServer) -> tuple[int, int, bool]:
    with server.db.session() as s:
        keys = s.execute(sa.text("select count(*) from api_keys")).scalar_one()
        tenants = s.execute(sa.text("select count(*) from tenants")).scalar_one()
        pwned = s.execute(sa.text("select to_regclass('pwned') is not null")).scalar_one()
    return keys, tenants, pwned


@pytest.fixture
def scene(live: tuple[LiveServer, str, Path], tmp_path: Path) -> Iterator[dict]:
    server, psql, home = live
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    home_file = home / "usage-spool.jsonl"
    home_file.write_text(f"secret-{uuid.uuid4().hex}")
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    key = create_tenant(server.db, f"t-{uuid.uuid4().hex[:10]}").key  # the default policy: prompt_examples on
    prompt = hostile_prompt(psql, tmp_path / "marker", victim, home_file, sentinel.pid)
    yield {"server": server, "key": key, "prompt": prompt, "victim": victim, "marker": tmp_path / "marker",
           "home_file": home_file, "home_text": home_file.read_text(), "sentinel": sentinel}  # fmt: skip
    sentinel.kill()
    sentinel.wait()


def untouched(scene: dict, before: tuple[int, int, bool]) -> None:
    server = scene["server"]
    assert counts(server) == before and not before[2]  # no key deleted, no table made
    assert not scene["marker"].exists() and scene["victim"].read_text() == "keep me"
    assert scene["home_file"].read_text() == scene["home_text"]
    assert scene["sentinel"].poll() is None
    assert httpx.get(f"{server.base_url}/healthz", timeout=30).status_code == 200


def test_a_hostile_prompt_runs_in_the_jail_and_changes_nothing(scene: dict) -> None:
    assert jail_status().available, jail_status().reason
    server = scene["server"]
    before = counts(server)
    r = ask(server, scene["key"], scene["prompt"])
    assert "0:prompt_examples:escalate@" in r.headers["x-switchboard-verifiers"]  # the program ran, examples too
    first = r.headers["x-switchboard-cascade"].split("first=")[1]
    (row,) = server.wait_for_usage(first)  # each attempt billed once
    assert (row.tier, row.status) == ("small", "escalated")
    assert "add(2, 3): expected '5'" in row.verifier_actions[0]["reason"]  # run to its examples, in the jail
    assert len(server.wait_for_usage(r.json()["id"])) == 1
    untouched(scene, before)
    health = httpx.get(f"{server.base_url}/healthz", timeout=30).json()
    assert health["sandbox"]["jail"] == "on" and health["sandbox"]["layers"]["seccomp"].startswith("on")


def test_without_a_jail_the_answer_is_served_without_the_check_and_nothing_runs(
    scene: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import grading.sandbox
    from gateway.app import _report_jail

    server = scene["server"]
    monkeypatch.setenv(WITHOUT_ENV, "seccomp")
    jail_status.cache_clear()
    ran: list[str] = []
    real_run = grading.sandbox.run
    monkeypatch.setattr(grading.sandbox, "run", lambda *a, **k: ran.append("ran") or real_run(*a, **k))
    try:
        with caplog.at_level(logging.WARNING, logger="gateway.app"):
            _report_jail()  # what the gateway says at start on such a machine
        assert "no jail for code on this machine" in caplog.text and "seccomp" in caplog.text
        before = counts(server)
        r = ask(server, scene["key"], scene["prompt"])
        assert r.headers["x-switchboard-tier"] == "small" and "x-switchboard-cascade" not in r.headers
        assert "0:prompt_examples:unavailable@" in r.headers["x-switchboard-verifiers"]
        (row,) = server.wait_for_usage(r.json()["id"])
        assert row.status == "ok" and [a["action"] for a in row.verifier_actions] == ["unavailable"]
        assert "no jail" in row.verifier_actions[0]["reason"]
        assert ran == []
        untouched(scene, before)
        health = httpx.get(f"{server.base_url}/healthz", timeout=30)
        assert health.status_code == 200 and health.json()["sandbox"]["jail"] == "unavailable"
        assert "no seccomp filter" in health.json()["sandbox"]["reason"]
    finally:
        jail_status.cache_clear()
