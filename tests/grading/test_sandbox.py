"""The code sandbox: no writes outside its directory, no sockets, no processes, no ctypes, and a time
limit; each fence is shown to matter by the same program succeeding outside the sandbox."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

from grading.sandbox import run_python


def unsandboxed(program: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=30)


def test_no_writes_outside_its_directory(tmp_path: Path) -> None:
    outside = tmp_path / f"escape-{uuid.uuid4().hex}"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    attempts = {
        "open": f"open({str(outside)!r}, 'w').write('x')",
        "os.open": f"import os; os.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT)",
        "remove": f"import os; os.remove({str(victim)!r})",
        "rename": f"import os; os.rename({str(victim)!r}, 'mine.txt')",
        "mkdir": f"import os; os.mkdir({str(outside)!r})",
        "append": f"open({str(victim)!r}, 'a').write('x')",
    }
    for name, code in attempts.items():
        result = run_python(code)
        assert not result.passed and "PermissionError" in result.stderr and "sandbox" in result.stderr, name
    assert not outside.exists() and victim.read_text() == "keep me"
    # inside its own directory it may write, read back and delete
    inside = run_python("open('notes.txt', 'w').write('hi')\nassert open('notes.txt').read() == 'hi'\n"
                        "import os\nos.remove('notes.txt')\nprint('ok')\n")  # fmt: skip
    assert inside.passed and inside.stdout.strip() == "ok"
    assert unsandboxed(attempts["open"]).returncode == 0 and outside.exists()  # the same code, unfenced


def test_no_sockets(redis_server: str) -> None:
    url = urlparse(redis_server)
    program = (
        "import socket\n"
        f"s = socket.create_connection(({url.hostname!r}, {url.port}), timeout=2)\n"
        "s.sendall(b'PING\\r\\n')\nprint(s.recv(16))\n"
    )
    result = run_python(program)
    assert not result.passed and "sandbox: socket" in result.stderr and "PONG" not in result.stdout
    assert "PONG" in unsandboxed(program).stdout  # the same program reaches Redis outside


def test_no_processes_and_no_ctypes() -> None:
    for code in (
        "import subprocess; subprocess.run(['true'])",
        "import os; os.system('true')",
        "import os; os.fork()",
        "import os; os.execv('/bin/true', ['true'])",
        "import ctypes; ctypes.CDLL(None)",
    ):
        result = run_python(code)
        assert not result.passed and "sandbox:" in result.stderr, code


def test_a_runaway_program_is_killed_at_its_limit() -> None:
    started = time.monotonic()
    result = run_python("while True:\n    pass\n", timeout=1.5)
    assert result.timed_out and not result.passed
    assert time.monotonic() - started < 5
