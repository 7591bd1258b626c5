"""A gateway for a benchmark to load: `switchboard serve` in a subprocess, waited on until healthy, and what the
benchmarks that start one share (`bench.load`, `bench.savings`, `bench.soak`): its environment, a policy far
from every limit, the stop that ends it and cleans up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx

__all__ = ["ROOT", "SERVE", "far_limits", "launch_serve", "serve_env"]

ROOT = Path(__file__).resolve().parent.parent
SERVE = "import sys; from gateway.cli import main; sys.exit(main(['serve']))"  # a `python -c` program


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def serve_env(home: Path, db_url: str, port: int, **settings: str) -> dict[str, str]:
    """This process's environment, and what every benchmark's gateway runs with; `settings` add or override."""
    return {
        **os.environ,
        "SWITCHBOARD_HOME": str(home),
        "SWITCHBOARD_DATABASE_URL": db_url,
        "SWITCHBOARD_PORT": str(port),
        "SWITCHBOARD_LOG_LEVEL": "warning",  # no access log: it would cost the server CPU per request
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
        "PYTHONPATH": str(ROOT),
        **settings,
    }


def far_limits() -> dict[str, Any]:
    """Hard budgets and rate limits on every counter, all far from refusing: the budget path runs."""
    from policies.policy import Budget, RateLimits

    return {
        "budgets": [
            Budget(period="daily", money=Decimal(100_000), tokens=10**12),
            Budget(period="monthly", money=Decimal(1_000_000), tokens=10**13),
        ],
        "rate_limits": RateLimits(key_rpm=10**7, key_tpm=10**11, tenant_rpm=10**7, tenant_tpm=10**11),
    }


def launch_serve(
    code: str,
    env: dict[str, str],
    cwd: str,
    port: int,
    log: Path,
    cleanups: list[Callable[[], None]],
    *,
    stop_signal: int = signal.SIGTERM,
    ready_s: float = 300,
    poll_s: float = 0.25,
) -> tuple[subprocess.Popen[bytes], str, Callable[[], None]]:
    """Run `switchboard serve` (`code`: a `python -c` program) in `cwd` with `env`, its output in `log`, and
    wait until its /healthz on `port` answers 200: (the process, its URL, a stop that ends it with
    `stop_signal` and then runs `cleanups` in reverse). If it exits or is not healthy within `ready_s`, it is
    stopped and RuntimeError names the log."""
    out = log.open("w")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)

    def stop() -> None:
        proc.send_signal(stop_signal)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()
        for fn in reversed(cleanups):
            try:
                fn()
            except Exception as exc:  # cleanup is best effort
                say(f"cleanup: {type(exc).__name__}: {exc}")

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_s
    while True:
        if proc.poll() is not None:
            stop()
            raise RuntimeError(f"the gateway exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return proc, url, stop
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop()
            raise RuntimeError(f"the gateway did not become healthy; see {log}")
        time.sleep(poll_s)
