"""Shared fixtures: real models from the registry, real PostgreSQL, live servers.

Models are fetched once into `$SWITCHBOARD_HOME` (default ~/.cache/switchboard) and reused by later
runs. PostgreSQL is the local server, or a throwaway one (see tests/services.py); every test database
is created fresh and dropped afterwards.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import services
import skip_audit
from server_deaths import pytest_runtest_makereport  # noqa: F401  (a hook: failures report dead servers)

if TYPE_CHECKING:  # the engine and the gateway load only for the tests that ask for them
    from engines.async_engine import AsyncEngine
    from live import LiveServer

# Tests build their settings explicitly; nothing from the developer's shell or a switchboard.toml leaks in.
for _name in list(os.environ):
    if _name.startswith("SWITCHBOARD_") and _name != "SWITCHBOARD_HOME" and not _name.startswith("SWITCHBOARD_TEST_"):
        del os.environ[_name]
os.environ["SWITCHBOARD_CONFIG"] = "/nonexistent/switchboard.toml"
# One key secret for every gateway, CLI and test in this process and the servers it starts: keys made
# here must authenticate there, whatever home directory each one uses.
os.environ["SWITCHBOARD_KEY_SECRET"] = "switchboard-tests-key-secret"
# A gateway without a router would train one from the shipped labels after startup (~20 s of CPU each):
# tests ask for that with `router_auto_train=True` (tests/gateway/test_router_bootstrap.py).
os.environ["SWITCHBOARD_ROUTER_AUTO_TRAIN"] = "false"
# Default policies shadow-run 5% of tiny- and small-served `auto` answers on the large tier: a test's ledger
# rows and engine steps must not depend on that draw. Tests of it turn it on (tests/router/test_router_gateway.py).
os.environ["SWITCHBOARD_SHADOW_RUNS"] = "false"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The Triton kernel tests run under the interpreter (tests/triton_support.py), which `triton.jit` reads as it
# decorates, Triton's own `tl.sum` and the rest of its library included, at `import triton`. Some test modules
# import Triton through peft/transformers before any kernel test module is collected, and the kernels then failed
# ("Cannot call @triton.jit'd outside of the scope of a kernel"): so it is set here, first. Compiled runs are
# tests/test_gpu.py's (--noconftest) and `triton_support.on_gpu`'s child processes.
os.environ["TRITON_INTERPRET"] = "1"

MODELS_HOME = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser()


def pytest_addoption(parser: pytest.Parser) -> None:
    skip_audit.add_option(parser)  # --only-gpu-skips, which .ci/run passes


def pytest_configure(config: pytest.Config) -> None:
    skip_audit.configure(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Give what the in-process gateways froze back to the collector, so that interpreter shutdown frees it.

    Gateway startup moves every live object into the collector's permanent generation (`gc.freeze()` in
    gateway/app.py), which is never collected, not even at exit. Triton's nanobind extension then finds its
    objects still alive at shutdown and prints ~40 lines of "nanobind: leaked ... instances" after pytest's
    summary (once a kernel test and a live-server test ran in one session).
    """
    gc.unfreeze()


def fetched(name: str) -> Path:
    from engines.checkpoints.fetch import fetch_model

    return fetch_model(name, MODELS_HOME)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return fetched("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen05_dir() -> Path:
    return fetched("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    return fetched("gemma3-270m")


@pytest.fixture(scope="session")
def qwen_int8_pair() -> tuple[Path, Path]:
    """(0.5B, 1.5B) int8 checkpoints, quantized once into the models cache (as the tiers serve them)."""
    from engines.checkpoints.quantized import fetch_quantized

    return tuple(
        fetch_quantized(n, MODELS_HOME, "int8", progress=False)
        for n in ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
    )  # type: ignore[return-value]


# --- databases -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    url = services.postgres_url()
    yield url
    services.stop_all()


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test."""
    url, drop = services.create_database(postgres_server)
    yield url
    drop()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'switchboard.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def database(database_url: str) -> Iterator:
    from core.db.database import Database

    db = Database(database_url)
    db.upgrade()
    yield db
    db.dispose()


@pytest.fixture(scope="session")
def redis_server() -> str:
    """The local Redis (or a throwaway one); tests keep apart by key namespace, never by flushing."""
    return services.redis_url()


@pytest.fixture
def redis_namespace() -> Iterator[str]:
    import uuid

    ns = f"sbtest-{uuid.uuid4().hex[:10]}"
    yield ns
    services.delete_namespace(services.redis_url(), ns)


# --- engines and live servers ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def small_engine(smollm2_dir: Path) -> Iterator[AsyncEngine]:
    """SmolLM2-135M-Instruct in bf16 behind a running engine thread, shared by the API tests."""
    from live import running_engine

    with running_engine(smollm2_dir, "bf16") as engine:
        yield engine


@pytest.fixture(scope="module")
def live(small_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The gateway on a real port, serving SmolLM2 as `small`, on SQLite only: for API tests that are about the
    OpenAI contract, not the database."""
    from live import serve_gateway

    home = tmp_path_factory.mktemp("live")
    server, stop = serve_gateway(small_engine, home, f"sqlite:///{home / 'db.sqlite'}")
    yield server
    stop()


@pytest.fixture
def client(live: LiveServer) -> Any:
    """The official `openai` client on `live`, with a new tenant's key."""
    import openai

    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=live.new_key(), max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def live_server(
    request: pytest.FixtureRequest, small_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """The gateway on a real port, serving SmolLM2 as `small`, on SQLite and on PostgreSQL."""
    from live import serve_gateway

    home = tmp_path_factory.mktemp("home")
    if request.param == "sqlite":
        url, drop = f"sqlite:///{home / 'switchboard.db'}", None
    else:
        server_url = request.getfixturevalue("postgres_server")
        url, drop = services.create_database(server_url)
    live, stop = serve_gateway(small_engine, home, url, max_request_bytes=256 * 1024)
    yield live
    stop()
    if drop:
        drop()
