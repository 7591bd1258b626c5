"""A failing test whose server process died unasked reports the death first (a pytest plugin; conftest.py loads it).

A server that crashes mid-test (llama.cpp's server on a CPU whose instructions its build misuses, say) shows up
in the test as the next thing the test did: `Server disconnected without sending a response`, then `Connection
refused`. The failure report then starts with the death instead: the short summary line reads `<server> died
(killed by SIGILL (signal 4), pid N); then <the test's error>`, and a section quotes the end of the server's log.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

from services import ServerProcess


def deaths() -> list[str]:
    return [d for server in ServerProcess.running if (d := server.death()) is not None]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, pytest.TestReport]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed or not (found := deaths()):
        return
    headline = "; ".join(d.split(";", 1)[0] for d in found)
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        crash.message = f"{headline}; then {crash.message}"
    else:
        report.longrepr = f"{headline}; then:\n{report.longrepr}"
    for text in found:
        report.sections.insert(0, ("a server died", text))
