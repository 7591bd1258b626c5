"""`switchboard distill` on each tenant's schedule (`distill` in its policy; by hand: the command).

Every `distill_check_seconds` (`gateway.runtime.periodic`) the gateway looks for due tenants: a schedule on, the
period (a day, a week, as tuning's) passed since their last scheduled run began, and at least `min_new_prompts`
prompts stored since that run read them (all of them count before the first run). A due tenant's run is the command
itself in a child process, with the gateway's own settings (`core.settings.settings_environment`), at the lowest
CPU priority (nice 19: live traffic first) and in its own memory, freed when it ends; one run at a time per gateway;
what it prints goes to `<name>.log` beside its work folder. It deploys only an adapter its held-out gate passes, as
the command does.

A run starts from an empty work folder (new prompts, new teacher answers); one cut short (the gateway stopped
during it) resumes where it was at the next check, whatever the period. Each tenant's state is
`<name>.schedule.json` beside the work folder (`$SWITCHBOARD_HOME/distill/t<tenant>/`): when the last run began
and ended, its exit status, and the newest stored prompt it could read. A run that failed waits for its next period.
A gateway that dies takes its run with it (the child gets SIGTERM on Linux). Replicas sharing a database each keep
their own state: let one of them run the schedules (`distill_check_seconds` 0 on the others).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio
from sqlalchemy import func, select

from core.db.database import Database
from core.db.models import RoutedPrompt, Tenant
from core.settings import Settings, settings_environment
from gateway.runtime.tuning import PERIODS
from policies.policy import DistillSettings
from policies.store import PolicyStore

__all__ = ["DistillSchedule", "ScheduledRun"]

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class ScheduledRun:
    """One tenant's last scheduled run, as `<name>.schedule.json` keeps it."""

    started: float  # epoch seconds
    newest_prompt: int  # the newest stored prompt's id when it began: later ones are new for the next run
    finished: float | None = None
    returncode: int | None = None


def _lowly() -> None:
    """In the child before it runs: the lowest CPU priority, and (Linux) a SIGTERM when the gateway dies, so a
    gateway killed outright leaves no run behind that a restart would start a second time."""
    os.nice(19)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class DistillSchedule:
    def __init__(self, settings: Settings, db: Database, policies: PolicyStore, options: Sequence[str] = ()) -> None:
        """`options`: more arguments for every run's command (the training's rank, learning rate, ...)."""
        self.settings = settings
        self.db = db
        self.policies = policies
        self.options = tuple(options)

    def folder(self, tenant_id: int) -> Path:
        return self.settings.home_dir / "distill" / f"t{tenant_id}"

    def _state_path(self, tenant_id: int, name: str) -> Path:
        return self.folder(tenant_id) / f"{name}.schedule.json"

    def state(self, tenant_id: int, name: str) -> ScheduledRun | None:
        path = self._state_path(tenant_id, name)
        return ScheduledRun(**json.loads(path.read_text())) if path.exists() else None

    def _save(self, tenant_id: int, name: str, run: ScheduledRun) -> None:
        path = self._state_path(tenant_id, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(".part")
        part.write_text(json.dumps(asdict(run)))
        part.replace(path)  # whole or not at all: a crash never leaves half a state

    def _prompts(self, tenant_id: int, after: int) -> tuple[int, int]:
        """(how many of the tenant's stored prompts are newer than id `after`, the newest id)."""
        with self.db.session() as s:
            count, newest = s.execute(
                select(func.count(RoutedPrompt.id), func.max(RoutedPrompt.id)).where(
                    RoutedPrompt.tenant_id == tenant_id, RoutedPrompt.id > after
                )
            ).one()
        return count, newest or after

    def due(self, now: float | None = None) -> list[tuple[int, str, DistillSettings]]:
        """(tenant id, name, its distill settings) of every tenant whose schedule asks for a run now."""
        now = time.time() if now is None else now
        with self.db.session() as s:
            tenants = list(s.execute(select(Tenant.id, Tenant.name).order_by(Tenant.id)))
        out = []
        for tenant_id, name in tenants:
            policy = self.policies.current(tenant_id).policy
            settings = policy.distill
            if settings.schedule == "off" or not policy.router.store_prompts:
                continue
            last = self.state(tenant_id, settings.name)
            if last is not None and last.finished is None:  # cut short: resume it now
                out.append((tenant_id, name, settings))
                continue
            if last is not None and now - last.started < PERIODS[settings.schedule].total_seconds():
                continue
            new, _ = self._prompts(tenant_id, last.newest_prompt if last else 0)
            if new >= settings.min_new_prompts:
                out.append((tenant_id, name, settings))
        return out

    def command(self, tenant: str, settings: DistillSettings) -> list[str]:
        return [sys.executable, "-m", "gateway.cli", "distill", "--tenant", tenant, "--name", settings.name,
                "--epochs", str(settings.epochs), *self.options]  # fmt: skip

    async def run(self, tenant_id: int, tenant: str, settings: DistillSettings) -> int:
        """One tenant's run, to its end; its exit status."""
        last = self.state(tenant_id, settings.name)
        folder = self.folder(tenant_id)
        if last is None or last.finished is not None:  # a new run: new prompts, new answers, a new adapter
            shutil.rmtree(folder / settings.name, ignore_errors=True)
            _, newest = await anyio.to_thread.run_sync(self._prompts, tenant_id, 0)
            last = ScheduledRun(started=time.time(), newest_prompt=newest)
            self._save(tenant_id, settings.name, last)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
        env |= settings_environment(self.settings) | {"SWITCHBOARD_CONFIG": str(folder / "no-config.toml")}
        log.info("tenant %d: scheduled distill of small:%s begins (log %s)", tenant_id, settings.name, folder)
        with (folder / f"{settings.name}.log").open("ab") as out:
            child = await asyncio.create_subprocess_exec(
                *self.command(tenant, settings), env=env, stdout=out, stderr=out, preexec_fn=_lowly
            )
            try:
                code = await child.wait()
            except asyncio.CancelledError:  # the gateway stops: so does the run, resumed at the next start
                child.terminate()
                await asyncio.shield(child.wait())
                raise
        last.finished, last.returncode = time.time(), code
        self._save(tenant_id, settings.name, last)
        level = logging.INFO if code == 0 else logging.WARNING
        log.log(level, "tenant %d: scheduled distill of small:%s ended with status %d", tenant_id, settings.name, code)
        return code

    async def run_due(self, now: float | None = None) -> list[int]:
        """Run every due tenant's distill, one after another; the exit statuses."""
        codes = []
        for tenant_id, tenant, settings in await anyio.to_thread.run_sync(self.due, now):
            codes.append(await self.run(tenant_id, tenant, settings))
        return codes
