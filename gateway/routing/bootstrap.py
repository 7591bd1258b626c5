"""`model: "auto"` on a fresh machine: the router trained from the shipped labels on first start.

At startup, with `router_auto_train` on (the default) and no router loaded, the gateway looks at the
router directory (`router_dir`, default HOME/router):

    no router.json there                  train one from the shipped labels (router_model/data/labels-full-run.jsonl)
    a router whose files are whole, but   train a new one over it: this code computes other features (today
    that this code refuses to load        that is the one refusal of whole files: a feature_version mismatch)
    anything else (router.joblib missing  leave it alone: `auto` stays a 404 saying why (it may be a
    or not the one router.json names)     `switchboard router train` writing it right now)

A router that loads is never touched. Training (MiniLM over every labeled prompt, then scikit-learn:
about 25 s on two CPUs for the 1,351 shipped prompts) runs on a thread of its own once the server is up,
so named tiers are served meanwhile; until the router is saved and warmed up, `auto` answers 503
`router_building` with a `retry-after` (`RoutingStage.await_router`), then the routing stage takes it
(`RoutingStage.use_router`). A failed training is logged and `auto` is a 404 saying why.

Replicas starting together on one router directory hold an exclusive `flock` on DIR/.train.lock while
they look and train: the first trains and saves, the others wait, look again and load what it saved
(`save_router` replaces each file atomically; the lock keeps two trainings from interleaving theirs).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import anyio

from core.settings import Settings
from gateway.routing.stage import RoutingStage
from router_model.label import SHIPPED_LABELS
from router_model.model import METADATA_FILE, MODEL_FILE, RouterLoadError, load_router, save_router
from router_model.serving import RouterService

__all__ = ["LABELS", "RouterBootstrap", "Stopped", "ensure_router", "router_state", "start_bootstrap"]

log = logging.getLogger(__name__)

LABELS: Path = SHIPPED_LABELS  # the labels a missing router is trained from (tests point this at a small file)
LOCK_FILE = ".train.lock"
_POLL_S = 0.2  # how often a replica waiting for another's training checks whether the gateway is stopping

Verdict = Literal["load", "train", "leave"]


class Stopped(Exception):
    """The gateway stopped while this process waited for another one's training."""


def router_state(directory: Path) -> tuple[Verdict, str]:
    """What to do with the router directory: load it, train one (and why), or leave it alone (and why)."""
    if not (directory / METADATA_FILE).is_file():
        return "train", f"no router at {directory}"
    try:
        load_router(directory)
    except RouterLoadError as exc:
        old = _whole_router_version(directory)
        if old is None:
            return "leave", str(exc)
        return "train", f"the router at {directory} (features {old!r}) cannot be loaded"
    return "load", f"router at {directory}"


def _whole_router_version(directory: Path) -> str | None:
    """The feature version of a router whose model file is the one its metadata names; None if it is not whole."""
    try:
        metadata = json.loads((directory / METADATA_FILE).read_text())
        digest = hashlib.sha256((directory / MODEL_FILE).read_bytes()).hexdigest()
    except (OSError, ValueError):
        return None
    if not isinstance(metadata, dict) or metadata.get("model_sha256") != digest:
        return None
    return str(metadata.get("feature_version"))


def ensure_router(
    directory: Path, labels: Path, home: Path, stopping: Callable[[], bool] = lambda: False, threads: int = 1
) -> str:
    """Make sure `directory` holds a router this code loads, training one from `labels` on `threads` OpenMP
    threads where `router_state` says so, under the directory's lock. Returns what happened, for the log;
    RouterLoadError where the router there is to be left alone, Stopped where `stopping()` turned true
    while another process trained."""
    with _locked(directory, stopping):
        verdict, why = router_state(directory)
        if verdict == "load":
            return f"another process saved a router at {directory} meanwhile"
        if verdict == "leave":
            raise RouterLoadError(why)
        from router_model.encoder import RouterEncoder
        from router_model.train import train_from_labels

        start = time.perf_counter()
        with _openmp_threads(threads):
            result = train_from_labels(labels, RouterEncoder(), home=home)
        seconds = time.perf_counter() - start
        if router_state(directory)[0] == "load":  # a `switchboard router train` saved one meanwhile: it wins
            return f"{why}: trained one, but a router was saved there meanwhile; kept that one"
        # An outdated router.json goes first: interrupted between save_router's two writes, the directory
        # then reads as "no router" (trained again next start), never as an old router.json naming a new model.
        (directory / METADATA_FILE).unlink(missing_ok=True)
        save_router(result.router, directory)
    meta = result.router.metadata
    apgr = meta.get("metrics", {}).get(meta.get("classifier"), {}).get("heldout_apgr")
    scored = f", held-out APGR {apgr:.2f}" if isinstance(apgr, float) else ""
    about = f"{meta.get('classifier')} on features {meta.get('feature_version')!r}{scored}"
    return f"{why}: trained one from {_described(labels)} in {seconds:.1f} s ({about})"


def _described(labels: Path) -> str:
    return "the shipped labels" if labels == SHIPPED_LABELS else str(labels)


@contextlib.contextmanager
def _openmp_threads(threads: int) -> Iterator[None]:
    """This thread's OpenMP threads (torch's intra-op ones among them), not the process's: the engines keep
    theirs. MiniLM over the labels one prompt at a time gains nothing from more, and on a busy two-CPU
    machine two threads made it 10x slower than one (spinning at every barrier)."""
    import torch
    from threadpoolctl import ThreadpoolController

    torch.get_num_threads()  # torch sets up this thread's OpenMP first, so that it cannot undo the limit
    with ThreadpoolController().limit(limits=threads, user_api="openmp"):
        yield


@contextlib.contextmanager
def _locked(directory: Path, stopping: Callable[[], bool]) -> Iterator[None]:
    """An exclusive flock on DIR/.train.lock, polled so that a stopping gateway need not wait for it."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_FILE, "a") as handle:
        waiting = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    log.info("another process is building the router at %s: waiting for it", directory)
                    waiting = True
                if stopping():
                    raise Stopped from None
                time.sleep(_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class RouterBootstrap:
    """The thread that builds the router after startup and hands it to the routing stage on the event loop."""

    def __init__(self, settings: Settings, stage: RoutingStage, loop: asyncio.AbstractEventLoop) -> None:
        self.settings = settings
        self.stage = stage
        self.loop = loop
        self._stop = threading.Event()
        # A daemon: stopping the gateway never waits for a training (the next start looks again).
        self.thread = threading.Thread(target=self._run, name="router-bootstrap", daemon=True)

    def stop(self) -> None:
        """On the event loop, before the routing stage closes: a router finished later is not swapped in."""
        self._stop.set()

    def _run(self) -> None:
        directory = self.settings.router_path
        try:
            threads = self.settings.router_threads  # the routing thread's share of the CPUs
            done = ensure_router(directory, LABELS, self.settings.home_dir, self._stop.is_set, threads)
            service = RouterService.load(directory, self.settings.router_threads)
        except Stopped:
            return
        except Exception as exc:  # a failed training leaves `auto` unavailable, saying why; the gateway runs on
            log.error("model auto is unavailable: building the router at %s failed: %s", directory, exc)
            self._hand_over(None, f"no router is configured (building one at {directory} failed: {exc})")
            return
        log.info("%s; router loaded from %s (%s)", done, directory, service.router.metadata.get("classifier"))
        self._hand_over(service, "")

    def _hand_over(self, service: RouterService | None, unavailable: str) -> None:
        def apply() -> None:
            if self._stop.is_set():  # the stage is closing or closed
                if service is not None:
                    service.close()
                return
            self.stage.use_router(service, unavailable)

        try:
            self.loop.call_soon_threadsafe(apply)
        except RuntimeError:  # the event loop is closed: the gateway has stopped
            if service is not None:
                service.close()


async def start_bootstrap(settings: Settings, stage: RoutingStage) -> RouterBootstrap | None:
    """At startup: if the stage has no router and `router_state` says to train one, mark `auto` as being built
    and start the training thread. None where there is nothing to do (a router loaded, the switch off, or
    a router to leave alone)."""
    if not settings.router_auto_train or stage.service is not None:
        return None
    verdict, why = await anyio.to_thread.run_sync(router_state, settings.router_path)
    if verdict == "leave":
        return None
    if verdict == "load":  # saved since the stage looked
        stage.await_router(f"the router at {settings.router_path} is being loaded")
    else:
        log.info("%s: training one from %s after startup; until then `auto` answers 503", why, _described(LABELS))
        stage.await_router(f"the router is being trained from {_described(LABELS)} ({why})")
    bootstrap = RouterBootstrap(settings, stage, asyncio.get_running_loop())
    bootstrap.thread.start()
    return bootstrap
