"""The code jail's plain rules (no audit hook: the kernel refuses) and its fail-closed path: no writes outside
its directory, no sockets, no processes, no reads outside the interpreter's files, limits; each rule shown to
matter by the same program succeeding outside the jail. Where a protection is missing (forced with
`SWITCHBOARD_JAIL_WITHOUT`, which only takes protections away) nothing runs, the checks say `unavailable`,
and only `--unsafe-local-grading` graders fall back to the old fence. Hostile programs that got out of the
old fence: tests/grading/test_sandbox_escapes.py."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

import grading.sandbox as sandbox
from grading.jail.machine import WITHOUT_ENV
from grading.sandbox import JailUnavailable, jail_status, require_jail, run_python
from verifiers.answers import CodeTests
from verifiers.base import Action, Context, Trace
from verifiers.hook import VerifierHook
from verifiers.prompt_examples import PromptExamples


def unsandboxed(program: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=30, cwd=cwd)


@pytest.fixture(autouse=True)
def fresh_status(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(sandbox, "_unsafe", sandbox.threading.Event())  # no test leaves the fence allowed
    jail_status.cache_clear()
    yield
    jail_status.cache_clear()


def test_this_machine_builds_the_whole_jail() -> None:
    """The CI machines have every layer; the status says which, and the canary was refused everything."""
    status = jail_status()
    assert status.available, status.reason
    layers = status.layers
    assert layers["seccomp"].startswith("on") and layers["self_test"].startswith("passed")
    assert layers["bubblewrap"].startswith("on") or layers["landlock"].startswith("on")
    assert status.as_dict()["jail"] == "on"


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
        assert not result.passed and "Error" in result.stderr, name
    assert not outside.exists() and victim.read_text() == "keep me"
    # inside its own directory it may write, read back, rename and delete
    inside = run_python("open('notes.txt', 'w').write('hi')\nassert open('notes.txt').read() == 'hi'\n"
                        "import os\nos.mkdir('d')\nos.rename('notes.txt', 'd/n.txt')\nos.remove('d/n.txt')\n"
                        "import tempfile\ntempfile.TemporaryFile().write(b'x')\nprint('ok')\n")  # fmt: skip
    assert inside.passed and inside.stdout.strip() == "ok", inside.stderr
    assert unsandboxed(attempts["open"]).returncode == 0 and outside.exists()  # the same code, unfenced


def test_no_reads_outside_the_interpreters_files(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    program = f"print(open({str(secret)!r}).read())"
    result = run_python(program)
    assert not result.passed and "hunter2" not in result.stdout
    assert "hunter2" in unsandboxed(program).stdout
    stdlib = run_python("import json, hashlib, decimal, fractions\nprint(json.dumps(hashlib.md5(b'a').hexdigest()))")
    assert stdlib.passed and "0cc175b9c0f1b6a831c399e269772661" in stdlib.stdout


def test_no_sockets_of_any_family(redis_server: str) -> None:
    url = urlparse(redis_server)
    program = (
        "import socket\n"
        f"s = socket.create_connection(({url.hostname!r}, {url.port}), timeout=2)\n"
        "s.sendall(b'PING\\r\\n')\nprint(s.recv(16))\n"
    )
    result = run_python(program)
    assert not result.passed and "PermissionError" in result.stderr and "PONG" not in result.stdout
    assert "PONG" in unsandboxed(program).stdout  # the same program reaches Redis outside
    for family in ("AF_UNIX", "AF_INET6", "AF_NETLINK"):
        refused = run_python(f"import socket; socket.socket(socket.{family})")
        assert not refused.passed and "PermissionError" in refused.stderr, family


def test_no_processes_but_threads_run() -> None:
    for code in (
        "import subprocess; subprocess.run(['true'])",
        "import os; os.system('true') and exit(1)",
        "import os; os.fork()",
        "import os; os.execv('/bin/true', ['true'])",
        "import ctypes; assert ctypes.CDLL(None).fork() == -1; raise SystemExit(1)",
    ):
        result = run_python(code)
        assert not result.passed, code
    threads = run_python("import threading\nout = []\nt = threading.Thread(target=out.append, args=(1,))\n"
                         "t.start(); t.join()\nassert out == [1]\nexit(0)\n")  # fmt: skip
    assert threads.passed, threads.stderr
    assert unsandboxed("import os; raise SystemExit(os.system('true'))").returncode == 0


def test_a_runaway_program_is_killed_at_its_limit() -> None:
    started = time.monotonic()
    result = run_python("while True:\n    pass\n", timeout=1.5)
    assert result.timed_out and not result.passed
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("without", "why"),
    [
        ("seccomp", "no seccomp filter"),
        ("bubblewrap", "running as root"),  # as root only bubblewrap can switch the run to an unprivileged uid
        ("bubblewrap,landlock", ""),
    ],
)
def test_a_missing_protection_runs_nothing(
    without: str, why: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import os

    monkeypatch.setenv(WITHOUT_ENV, without)
    status = jail_status()
    assert not status.available and why in status.reason and status.as_dict()["jail"] == "unavailable"
    if os.geteuid() != 0 and without == "bubblewrap":
        pytest.fail("as another user than root, without bubblewrap the jail is Landlock's: run the tests as root")
    marker = tmp_path / "ran"
    with pytest.raises(JailUnavailable):
        run_python(f"open({str(marker)!r}, 'w')")
    with pytest.raises(JailUnavailable):  # a grader too, unless the operator allowed the old fence
        run_python(f"open({str(marker)!r}, 'w')", local_grading=True)
    assert not marker.exists()
    with pytest.raises(SystemExit, match="--unsafe-local-grading"):
        require_jail(False)
    with pytest.raises(SystemExit, match="cannot jail"):
        require_jail(True, "the checks", unsafe_allowed=False)
    # the checks say so and serve the answer; nothing ran
    code = "```python\ndef add(a, b):\n    return a + b\n```"
    trace = Trace(0, text=code, finished=True)
    prompt = (f"Complete add.\n\n```python\nopen({str(marker)!r}, 'w')\n\n"
              'def add(a, b):\n    """The sum.\n    >>> add(2, 3)\n    5\n    """\n```')  # fmt: skip
    for verifier, context in ((PromptExamples(), Context(prompt=prompt)), (CodeTests(), Context(tests="assert 1"))):
        verdict = verifier.check(context, [Trace(0, text=code, finished=True)])[0]
        assert verdict.action is Action.UNAVAILABLE and "no jail" in verdict.reason, verdict
    hook = VerifierHook(None, Context(prompt=prompt), ["r0"], checks=PromptExamples())
    hook.traces["r0"] = trace
    hook.run_checks()
    assert [a["action"] for a in hook.summary()] == ["unavailable"] and not hook.failed
    assert not marker.exists()


def test_unsafe_local_grading_runs_graders_under_the_old_fence_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WITHOUT_ENV, "seccomp")
    require_jail(True)  # the operator's --unsafe-local-grading
    graded = run_python("import os; print(os.getuid())", local_grading=True)
    assert graded.passed and graded.stdout.strip()  # ran, under the audit hook
    assert "sandbox: socket" in run_python("import socket; socket.socket()", local_grading=True).stderr
    with pytest.raises(JailUnavailable):  # a tenant's check never runs unjailed
        run_python("print(1)")


def test_humaneval_canonical_solutions_all_pass_in_the_jail() -> None:
    """All 164, graded as the router's labels are (a stub returning None fails them, so passing means something)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from grading.datasets import load_humaneval_items
    from grading.graders import grade_humaneval

    items = load_humaneval_items(Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser())
    with ThreadPoolExecutor(2) as pool:
        passed = list(pool.map(lambda it: grade_humaneval(it, it.grading["canonical_solution"]), items))
        stubs = list(pool.map(lambda it: grade_humaneval(it, "    return None\n"), items[:20]))
    assert len(items) == 164 and [it.id for it, ok in zip(items, passed, strict=True) if not ok] == []
    assert not any(stubs)


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "bench.savings", "--requests", "4"],
        ["-m", "gateway.cli", "router", "label", "--sources", "humaneval", "--per-source", "1"],
    ],
    ids=["bench.savings", "router label"],
)
def test_what_grades_humaneval_refuses_to_start_without_a_jail(command: list[str], tmp_path: Path) -> None:
    import os

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, WITHOUT_ENV: "seccomp", "OMP_NUM_THREADS": "1", "SWITCHBOARD_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, *command], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "cannot jail it" in done.stderr and "--unsafe-local-grading" in done.stderr
    assert list(tmp_path.iterdir()) == []  # refused before fetching, loading or writing anything
