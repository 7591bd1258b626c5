"""`model: "auto"` on a fresh machine: a gateway without a usable router trains one from the shipped labels
after startup (`gateway/routing/bootstrap.py`), and never touches one that loads.

A small synthetic label file stands in for the shipped one (`router_bootstrap.LABELS`), so a training takes
seconds; `train_from_labels` is wrapped to count its calls and, where a test needs the router to stay in the
making, to hold them. Live gateways serve SmolLM2 (the tiny profile's tier) as `small` on PostgreSQL and
Redis, and are asked with the official `openai` client. Behaviour only, never timing.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

import router_model.train
import services
from core.settings import Settings
from engines.async_engine import AsyncEngine
from gateway.api.deps import app_config
from gateway.routing import bootstrap as router_bootstrap
from gateway.routing.bootstrap import Stopped, ensure_router
from live import LiveServer, serve_gateway
from router_model.encoder import RouterEncoder
from router_model.examples import split_examples
from router_model.model import RouterLoadError, load_router, read_metadata, save_router, write_metadata
from router_model.synthetic import synthetic_examples, write_label_file
from router_model.train import TrainResult, train_router

SIMPLE = "Hi! How are you today?"
WAIT_S = 600.0  # a bound for a training on a busy machine, not a speed asserted


@pytest.fixture(scope="module")
def labels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_label_file(synthetic_examples(120, seed=3), tmp_path_factory.mktemp("labels") / "labels.jsonl")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A router as an operator's `switchboard router train` leaves it (trained the quick way)."""
    train, heldout = split_examples(synthetic_examples(120, seed=1), test_size=0.25, seed=0)
    result = train_router(train, heldout, RouterEncoder(), seed=0, folds=2, candidates=("hist_gb",))
    return save_router(result.router, tmp_path_factory.mktemp("trained") / "router")


class Trainings:
    """`train_from_labels`, counted; while `gate` is clear a training waits for it."""

    def __init__(self) -> None:
        self.calls: list[Path] = []
        self.started = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.real = router_model.train.train_from_labels

    def __call__(self, labels: Path, embedder: Any, **kwargs: Any) -> TrainResult:
        self.calls.append(Path(labels))
        self.started.set()
        assert self.gate.wait(WAIT_S)
        return self.real(labels, embedder, **kwargs)


@pytest.fixture
def trainings(monkeypatch: pytest.MonkeyPatch, labels: Path) -> Trainings:
    counted = Trainings()
    monkeypatch.setattr(router_bootstrap, "LABELS", labels)
    monkeypatch.setattr(router_model.train, "train_from_labels", counted)
    return counted


@pytest.fixture
def gateway(
    small_engine: AsyncEngine, postgres_server: str, redis_server: str, tmp_path: Path
) -> Iterator[Callable[..., LiveServer]]:
    """Starts live gateways on a fresh PostgreSQL database and Redis with this router directory; stops them after."""
    url, drop = services.create_database(postgres_server)
    started: list[tuple[LiveServer, Callable[[], None]]] = []

    def start(router_dir: Path, auto_train: bool = True) -> LiveServer:
        home = tmp_path / f"home-{len(started)}"
        extra = {"redis_url": redis_server, "router_dir": router_dir, "router_auto_train": auto_train}
        live, stop = serve_gateway(small_engine, home, url, **extra)
        started.append((live, stop))
        return live

    yield start
    for live, stop in reversed(started):
        stop()
        services.delete_namespace(redis_server, app_config(live.app).settings.redis_namespace)
    drop()


def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=live.new_key(), max_retries=0)


def ask(c: openai.OpenAI, model: str = "auto") -> Any:
    messages = [{"role": "user", "content": SIMPLE}]
    return c.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=2, temperature=0)


def wait_for_auto(c: openai.OpenAI) -> Any:
    """Ask for `auto` until the router is in; every answer before is the 503 saying it is being built."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            return ask(c)
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and exc.code == "router_building", exc
            time.sleep(0.2)
    raise AssertionError("the router was not built")


def files(directory: Path) -> dict[str, tuple[str, int]]:
    """Every file in the directory: its sha256 and modification time."""
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())
    }


DEFAULT_ALIASES = Settings.model_fields["model_aliases"].default_factory()  # type: ignore[misc]


def model_ids(c: openai.OpenAI) -> list[str]:
    """The tiers (and `auto`) listed, without the operator's default aliases of the embedding model."""
    return [m.id for m in c.models.list() if m.id not in DEFAULT_ALIASES]


def test_a_fresh_gateway_trains_a_router_and_then_routes_auto(
    gateway: Callable[..., LiveServer], trainings: Trainings, labels: Path, tmp_path: Path, caplog: Any
) -> None:
    caplog.set_level(logging.INFO, logger=router_bootstrap.__name__)
    trainings.gate.clear()  # the router stays in the making while the gateway is looked at
    directory = tmp_path / "router"
    c = client(gateway(directory))

    with pytest.raises(openai.APIStatusError) as building:
        ask(c)
    assert building.value.status_code == 503 and building.value.code == "router_building"
    assert building.value.response.headers["retry-after"] == "5"
    assert "being trained" in building.value.message
    served = ask(c, "small")  # named tiers are served meanwhile
    assert served.headers["x-switchboard-tier"] == "small" and served.parse().choices
    assert model_ids(c) == ["small"]

    trainings.gate.set()
    raw = wait_for_auto(c)
    reply = raw.parse()
    assert reply.model == "auto" and reply.choices and raw.headers["x-switchboard-tier"] == "small"
    assert 0 < float(raw.headers["x-switchboard-route-p-small"]) < 1
    assert model_ids(c) == ["small", "auto"]
    assert trainings.calls == [labels]
    assert load_router(directory).metadata["label_file"] == str(labels.resolve())
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"no router at {directory}: trained one from {labels} in ") for m in said), said


def test_a_router_that_loads_is_never_retrained(
    gateway: Callable[..., LiveServer], trainings: Trainings, trained: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "router"
    shutil.copytree(trained, directory)
    before = files(directory)
    raw = ask(client(gateway(directory)))  # at once: loaded at startup
    assert raw.headers["x-switchboard-tier"] == "small"
    assert trainings.calls == [] and files(directory) == before


def test_a_router_trained_on_other_features_is_rebuilt(
    gateway: Callable[..., LiveServer], trainings: Trainings, trained: Path, labels: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "router"
    shutil.copytree(trained, directory)
    stale = read_metadata(directory) | {"feature_version": "minilm-l6+cheap-0"}
    write_metadata(stale, directory)
    with pytest.raises(RouterLoadError, match="trained on features"):
        load_router(directory)

    raw = wait_for_auto(client(gateway(directory)))
    assert raw.parse().model == "auto" and raw.headers["x-switchboard-tier"] == "small"
    rebuilt = load_router(directory)  # loads: trained on this code's features
    assert rebuilt.metadata["feature_version"] != stale["feature_version"]
    assert rebuilt.id != stale["model_sha256"] and rebuilt.metadata["label_file"] == str(labels.resolve())
    assert trainings.calls == [labels]


def test_a_router_whose_files_do_not_match_is_left_alone(
    gateway: Callable[..., LiveServer], trainings: Trainings, trained: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "router"
    shutil.copytree(trained, directory)
    with open(directory / "router.joblib", "ab") as f:  # e.g. a `router train` between its two writes
        f.write(b"\0")
    before = files(directory)
    with pytest.raises(openai.NotFoundError) as missing:
        ask(client(gateway(directory)))
    assert missing.value.code == "model_not_found" and "not the model" in missing.value.message
    assert trainings.calls == [] and files(directory) == before


def test_with_the_switch_off_auto_is_a_404_as_before(
    gateway: Callable[..., LiveServer], trainings: Trainings, tmp_path: Path
) -> None:
    directory = tmp_path / "router"
    c = client(gateway(directory, auto_train=False))
    with pytest.raises(openai.NotFoundError) as missing:
        ask(c)
    assert missing.value.code == "model_not_found"
    assert "no router is configured" in missing.value.message and "none at" in missing.value.message
    assert model_ids(c) == ["small"]
    assert trainings.calls == [] and not directory.exists()


def test_two_replicas_starting_together_train_once(trainings: Trainings, labels: Path, tmp_path: Path) -> None:
    """Two bootstraps on one directory (threads here; each opens the lock file itself, as processes do)."""
    directory = tmp_path / "router"
    trainings.gate.clear()
    done: dict[str, str] = {}
    first = threading.Thread(target=lambda: done.setdefault("first", ensure_router(directory, labels, tmp_path)))
    first.start()
    assert trainings.started.wait(WAIT_S)  # the first holds the lock and trains

    with pytest.raises(Stopped):  # a gateway stopping meanwhile does not wait for the other's training
        ensure_router(directory, labels, tmp_path, stopping=lambda: True)
    waiting = threading.Event()

    def stopping() -> bool:
        waiting.set()  # asked only while the lock is held by another
        return False

    second = threading.Thread(
        target=lambda: done.setdefault("second", ensure_router(directory, labels, tmp_path, stopping))
    )
    second.start()
    assert waiting.wait(WAIT_S)
    trainings.gate.set()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert len(trainings.calls) == 1
    assert "trained one from" in done["first"] and "another process saved a router" in done["second"]
    assert load_router(directory).metadata["label_file"] == str(labels.resolve())
