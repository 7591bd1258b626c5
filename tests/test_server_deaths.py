"""A server that dies mid-test is reported as a death (tests/server_deaths.py), not as the connection error the test
saw next. An inner pytest run starts a small HTTP server that, asked for /crash, logs a line and raises SIGILL on
itself (as llama.cpp's server did at an AMX tile load); the same test with a server the test itself killed is
reported as the plain failure it is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CRASHER = """
import os, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/crash":
            print("about to run an instruction this CPU refuses", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGILL)
        self.send_response(200)
        self.end_headers()

HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""

INNER = """
import sys
import httpx
import pytest
import services

@pytest.fixture
def server(tmp_path):
    port = services.free_port()
    server = services.ServerProcess(tmp_path / "crasher.log", "the crashing server")
    server.launch([sys.executable, {crasher!r}, str(port)], f"http://127.0.0.1:{{port}}/", timeout=30)
    yield server, f"http://127.0.0.1:{{port}}"
    server.stop()  # after the report: as a module's server fixture does

def test_the_server_crashes(server):
    httpx.get(f"{{server[1]}}/crash")

def test_the_test_killed_its_server(server):
    server[0].kill()
    httpx.get(f"{{server[1]}}/")
"""


def test_a_failed_test_names_its_dead_server_with_the_signal_and_log(tmp_path: Path) -> None:
    crasher = tmp_path / "crasher.py"
    crasher.write_text(CRASHER)
    (tmp_path / "test_inner.py").write_text(INNER.format(crasher=str(crasher)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "COLUMNS": "1000", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "server_deaths", "-p", "no:cacheprovider", "-rf", "-q", "--noconftest",
         "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 1 and "2 failed" in out, out
    summary = {line.split(" ")[1].split("::")[1]: line for line in out.splitlines() if line.startswith("FAILED ")}
    crashed, killed = summary["test_the_server_crashes"], summary["test_the_test_killed_its_server"]
    assert "the crashing server died (killed by SIGILL (signal 4)" in crashed
    assert "; then " in crashed and ("ConnectError" in crashed or "RemoteProtocolError" in crashed)
    assert "a server died" in out and "about to run an instruction this CPU refuses" in out  # the log's tail
    assert "died" not in killed and "ConnectError" in killed  # killed by the test: no death to report
