"""The skip audit `.ci/run` turns on (`pytest --only-gpu-skips`): the run fails if anything skipped for a
reason outside `ALLOWED`.

A CI machine has no GPU (and may be an AVX2-only CPU), so the GPU-only tests (and the AVX-512 VNNI
kernel's) skip there, saying so; nothing else may. Any other skip (no
Chromium, an extra not installed, a server binary missing...) is a check the CI machine could run and
silently did not, so it fails the run, named in a "skip audit" section of the summary (pyproject's `-ra`
lists every skip with its reason too). Without the option nothing changes: a developer's machine may skip
what it lacks. Test and collection skips both count (a module skipped whole at import is one report);
expected failures (`xfail`) are not skips.
"""

from __future__ import annotations

import pytest

# How a skip's reason starts for it to be allowed: hardware a CI machine may lack. The reason every GPU-only
# skip gives (tests/test_gpu.py's `cuda` marker, the Triton kernel tests' bf16 cases: tests/triton_support.py),
# and the AVX-512 VNNI and AMX builds' tests on a CPU without those (Zen 3; AMD and older Intel for AMX;
# tests/engines/kernels/test_cpu_dispatch.py), where the builds they are compared with still run every test.
ALLOWED = ("needs a CUDA device", "this CPU has no AVX-512 VNNI", "this CPU has no AMX")

OPTION = "--only-gpu-skips"


def add_option(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION,
        action="store_true",
        help="fail the run if a test skips for any reason but a missing CUDA device (tests/skip_audit.py)",
    )


def configure(config: pytest.Config) -> None:
    if config.getoption(OPTION):
        config.pluginmanager.register(SkipAudit(), "switchboard-skip-audit")


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


class SkipAudit:
    def __init__(self) -> None:
        self.skips: list[tuple[str, str]] = []  # (node id, reason)

    def _note(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append((report.nodeid, skip_reason(report)))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._note(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._note(report)

    def refused(self) -> list[tuple[str, str]]:
        return [(node, reason) for node, reason in self.skips if not reason.startswith(ALLOWED)]

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.refused() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        refused = self.refused()
        terminalreporter.section("skip audit", red=bool(refused), green=not refused)
        allowed = len(self.skips) - len(refused)
        terminalreporter.line(f"{allowed} skipped for a reason allowed ({', '.join(map(repr, ALLOWED))}...)")
        if refused:
            terminalreporter.line(f"{len(refused)} skipped for a reason not allowed: the run fails", red=True)
            for node, reason in refused:
                terminalreporter.line(f"  {node}: {reason}", red=True)
