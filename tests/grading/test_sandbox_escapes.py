"""The code jail against hostile programs (tests/escapes.py): 28 that each got out of the old fence (an audit
hook, limits and `unshare -rn`: what `run_python` was before the jail) and 4 it held by other means, shown
to get out of a plain interpreter instead. Every one is shown to succeed outside the jail in this same
module (`test_each_escape_gets_out_of_the_old_fence`, `test_the_held_ones_get_out_of_a_plain_interpreter`),
so none of the jail's passes can be vacuous; then the jail must stop each, as this machine builds it, with
bubblewrap alone (no Landlock), and with Landlock and seccomp alone (not root, user namespaces off)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import escapes
import services
from escapes import CASES, PLAIN_CASES, VICTIM, Case, Target
from grading.jail.machine import WITHOUT_ENV
from grading.sandbox import jail_status, run_python, run_unjailed

ROOT = Path(__file__).resolve().parents[2]
SECRET = f"planted-secret-{uuid.uuid4().hex}"
ALL = CASES + PLAIN_CASES


@pytest.fixture(scope="module")
def evil(tmp_path_factory: pytest.TempPathFactory) -> str:
    return escapes.evil_b64(escapes.build_evil(tmp_path_factory.mktemp("evil")))


@pytest.fixture(scope="module")
def pg(postgres_server: str) -> Iterator[tuple[str, str]]:
    """(psql's connection string over the Unix socket, the socket's path) of a fresh database holding SECRET."""
    url, drop = services.create_database(postgres_server)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("create table secret_table (v text)"))
        conn.execute(sa.text("insert into secret_table values (:v)"), {"v": SECRET})
        socket_dir = conn.execute(sa.text("show unix_socket_directories")).scalar_one().split(",")[0].strip()
    engine.dispose()
    u = sa.make_url(url)
    yield f"host={socket_dir} port={u.port} user={u.username} dbname={u.database}", f"{socket_dir}/.s.PGSQL.{u.port}"
    drop()


def _shadow_line() -> str:
    try:
        return Path("/etc/shadow").read_text().splitlines()[0]
    except (OSError, IndexError):
        return ""


def make_target(tmp: Path, evil: str, pg: tuple[str, str]) -> Target:
    tag = f"sbjail{uuid.uuid4().hex[:12]}"
    outside, home, other = tmp / "outside", tmp / "home", tmp / "switchboard-sandbox-other"
    for d in (outside, home, other / "work"):
        d.mkdir(parents=True)
    (outside / "victim.txt").write_text(VICTIM)
    (home / "switchboard.db").write_text(f"tenants and keys: {SECRET}")
    (other / "work" / "answer.py").write_text(f"# {SECRET}")
    other.chmod(0o700)
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", SECRET],
                                env={"SENTINEL_SECRET": SECRET})  # fmt: skip
    redis_port = int(services.redis_url().rsplit(":", 1)[1].split("/")[0])
    return Target(outside, outside / f"marker-{tag}", outside / "victim.txt", SECRET, home, other, sentinel,
                  pg[0], pg[1], f"pwned_{tag}", redis_port, f"sbtest-{tag}:pwned", tag, evil,
                  _shadow_line())  # fmt: skip


@pytest.fixture
def target(tmp_path: Path, evil: str, pg: tuple[str, str]) -> Iterator[Target]:
    t = make_target(tmp_path, evil, pg)
    yield t
    t.sentinel.kill()
    t.sentinel.wait()
    escapes.survivors(t, "")
    import redis

    redis.Redis(port=t.redis_port).delete(t.redis_key)


def effect_of(case: Case, t: Target, out: str) -> str | None:
    return case.effect(t, out)


def needs_shadow(case: Case, t: Target) -> None:
    if "shadow" in case.name and not t.shadow_line:
        pytest.fail("the /etc/shadow cases need a readable /etc/shadow to plant against (run the tests as root)")


@pytest.fixture
def fresh_status() -> Iterator[None]:
    """For a test that changes what the machine offers: the status is computed again, before and after."""
    jail_status.cache_clear()
    yield
    jail_status.cache_clear()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_escape_gets_out_of_the_old_fence(case: Case, target: Target) -> None:
    needs_shadow(case, target)
    result = run_unjailed(escapes.program(case, target), timeout=20)
    assert effect_of(case, target, escapes.output(result)), f"{case.name} did not get out: {result}"


@pytest.mark.parametrize("case", PLAIN_CASES, ids=[c.name for c in PLAIN_CASES])
def test_the_held_ones_get_out_of_a_plain_interpreter(case: Case, target: Target) -> None:
    result = escapes.plain(case, target)
    assert effect_of(case, target, escapes.output(result)), f"{case.name} did not get out: {result}"


@pytest.mark.parametrize("case", ALL, ids=[c.name for c in ALL])
def test_the_jail_stops_each_escape(case: Case, target: Target) -> None:
    assert jail_status().available, jail_status().reason
    needs_shadow(case, target)
    result = run_python(escapes.program(case, target), timeout=20)
    assert effect_of(case, target, escapes.output(result)) is None, escapes.output(result)[-1500:]
    assert not result.timed_out


def test_bubblewrap_alone_stops_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, evil: str, pg: tuple[str, str], fresh_status: None
) -> None:
    """No Landlock (as on a kernel without it): the namespaces, the uid and seccomp hold on their own."""
    monkeypatch.setenv(WITHOUT_ENV, "landlock")
    status = jail_status()
    assert status.available and status.plan is not None and status.plan.landlock_abi == 0, status.as_dict()
    for i, case in enumerate(ALL):
        t = make_target(tmp_path / str(i), evil, pg)
        try:
            out = escapes.output(run_python(escapes.program(case, t), timeout=20))
            assert effect_of(case, t, out) is None, f"{case.name}: {out[-800:]}"
        finally:
            t.sentinel.kill()
            t.sentinel.wait()


# A host whose user namespaces are off, as Docker's default profile and Ubuntu's AppArmor rule make them:
# every clone or unshare with CLONE_NEWUSER is refused (EPERM), clone3 answers ENOSYS. Then, as user 1000,
# the jail can only be Landlock and seccomp; with Landlock refused too (ENOSYS: an old kernel) there is none.
CHILD = """\
import errno, json, os, sys
import pyseccomp as sc
f = sc.SyscallFilter(sc.ALLOW)
for call in ("unshare", "clone"):
    f.add_rule(sc.ERRNO(errno.EPERM), call, sc.Arg(0, sc.MASKED_EQ, 0x10000000, 0x10000000))
f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
if os.environ.get("NO_LANDLOCK"):
    for call in ("landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self"):
        f.add_rule(sc.ERRNO(errno.ENOSYS), call)
f.load()
from grading.sandbox import JailUnavailable, jail_status, run_python
programs = json.load(sys.stdin)
out = {"uid": os.geteuid(), "status": jail_status().as_dict(), "outputs": []}
for p in programs:
    try:
        r = run_python(p, timeout=20)
        out["outputs"].append(r.stdout + "\\n" + r.stderr)
    except JailUnavailable as exc:
        out["outputs"].append("unavailable: " + str(exc))
print(json.dumps(out))
"""


def in_a_host_without_user_namespaces(programs: list[str], *, real_uid: bool = False, **env: str) -> dict:
    """Run `programs` through `run_python` as user 1000 on a host whose user namespaces are off (CHILD's filter).
    By default user 1000 is the host's root underneath (a user namespace maps it): file modes and capabilities
    then stop nothing, only the jail does. `real_uid`: a real unprivileged uid (setpriv in a mount namespace
    where the interpreter's home is reachable), for what the kernel counts per real user (RLIMIT_NPROC)."""
    if real_uid:
        base = os.path.realpath(sys.base_prefix)  # the interpreter, under a home only root may enter (/root)
        parents = [a for p in reversed(Path(base).parents[:-2]) for a in ("--dir", str(p))]  # 0755, not 0700
        reach = ["--tmpfs", "/root", *parents, "--ro-bind", base, base] if base.startswith("/root/") else []
        outer = ["bwrap", "--bind", "/", "/", *reach,
                 "--dev", "/dev", "--proc", "/proc", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                 "--chdir", str(ROOT), "--", "setpriv", "--reuid", "1000", "--regid", "1000",
                 "--clear-groups"]  # fmt: skip
    else:
        outer = ["bwrap", "--unshare-user", "--uid", "1000", "--gid", "1000", "--bind", "/", "/", "--dev", "/dev",
                 "--proc", "/proc", "--chdir", str(ROOT), "--"]  # fmt: skip
    done = subprocess.run([*outer, sys.executable, "-c", CHILD], input=json.dumps(programs), capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_landlock_and_seccomp_alone_stop_them_without_root_or_user_namespaces(
    tmp_path: Path, evil: str, pg: tuple[str, str]
) -> None:
    # Not the thread bomb: user 1000 here is root underneath, which the kernel exempts from RLIMIT_NPROC
    # (the next test bounds it for a real user).
    cases = [c for c in ALL if c.name != "thread bomb"]
    targets = [make_target(tmp_path / str(i), evil, pg) for i in range(len(cases))]
    try:
        got = in_a_host_without_user_namespaces([escapes.program(c, t) for c, t in zip(cases, targets, strict=True)])
        status = got["status"]
        assert got["uid"] == 1000 and status["jail"] == "on", status
        assert status["layers"]["bubblewrap"].startswith("off") and status["layers"]["landlock"].startswith("on")
        for case, t, out in zip(cases, targets, got["outputs"], strict=True):
            assert not out.startswith("unavailable"), out
            assert effect_of(case, t, out) is None, f"{case.name}: {out[-800:]}"
    finally:
        for t in targets:
            t.sentinel.kill()
            t.sentinel.wait()


def test_bombs_are_bounded_for_a_real_unprivileged_user_without_user_namespaces(tmp_path: Path, evil: str) -> None:
    bombs = [c for c in CASES if c.name in ("fork bomb", "thread bomb")]
    t = make_target(tmp_path, evil, ("", ""))
    try:
        got = in_a_host_without_user_namespaces([escapes.program(c, t) for c in bombs], real_uid=True)
        assert got["uid"] == 1000 and got["status"]["layers"]["bubblewrap"].startswith("off"), got["status"]
        for case, out in zip(bombs, got["outputs"], strict=True):
            assert "started" in out and effect_of(case, t, out) is None, f"{case.name}: {out[-800:]}"
    finally:
        t.sentinel.kill()
        t.sentinel.wait()


def test_without_user_namespaces_or_landlock_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    got = in_a_host_without_user_namespaces([f"open({str(marker)!r}, 'w')"], NO_LANDLOCK="1")
    assert got["status"]["jail"] == "unavailable" and "Landlock" in got["status"]["reason"], got["status"]
    assert got["outputs"][0].startswith("unavailable") and not marker.exists()
