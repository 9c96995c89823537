"""The sandbox: its limits, and hostile programs kept in their box, run as the tests' user and as an
ordinary account created for the test (where the tests run as root, as CI does)."""

from __future__ import annotations

import json
import logging
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile

import pytest

from ragen.env import sandbox
from ragen.env.sandbox import Limits, RunStatus, SandboxError, SandboxUnavailable, run_python, spawn_python

from tests.sandbox_attacks import ATTACKS, attack, runs_left

pytestmark = pytest.mark.timeout(120)

FAST = Limits(cpu_s=1, wall_s=3, memory_mb=256, output_bytes=16 * 1024)
USER = "ragen-sandbox-test"


@pytest.fixture(autouse=True)
def no_process_survives():
    yield
    assert runs_left() == []


# ----- limits ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("code, status, words", [
    ("while True: pass", RunStatus.TIME_LIMIT, ""),
    ("import time\ntime.sleep(60)", RunStatus.TIME_LIMIT, ""),
    ("x = bytearray(2 * 1024 ** 3)", RunStatus.MEMORY_LIMIT, "MemoryError"),
    ("while True: print('x' * 1000)", RunStatus.OUTPUT_LIMIT, ""),
    ("open('big', 'wb').write(b'x' * (4 * 1024 * 1024))", RunStatus.OK, "File too large"),
])
def test_runaway_code_ends_with_its_limit(code, status, words):
    run = run_python(code, "", FAST)
    assert run.status is status
    assert words in run.stderr + run.stdout
    assert run.wall_s < FAST.wall_s + 3


def test_the_child_sees_no_secret_no_package_and_a_private_folder(monkeypatch):
    monkeypatch.setenv("MY_API_KEY", "s3cret")
    run = run_python("import os, sys\nprint(sorted(os.environ))\nprint(os.getcwd())\n"
                     "import importlib.util\nprint(importlib.util.find_spec('ragen'), importlib.util.find_spec('torch'))",
                     "", FAST)
    env, cwd, specs = run.stdout.splitlines()
    assert "MY_API_KEY" not in env and cwd == "/tmp" and specs == "None None"


def test_stdin_and_exit_codes():
    run = run_python("import sys\nprint(sum(map(int, input().split())))\nsys.exit(3)", "2 40\n", FAST)
    assert (run.status, run.exit_code, run.stdout) == (RunStatus.OK, 3, "42\n")


def test_a_cpu_limit_is_a_time_limit_whatever_runs_beside_it():
    """The verdict follows from the code's CPU time, on a loaded machine too (runs in threads)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda _: run_python("while True: pass", "", FAST), range(6)))
    assert [r.status for r in runs] == [RunStatus.TIME_LIMIT] * 6


def test_a_sandbox_that_fails_to_start_is_an_error_never_a_verdict(monkeypatch):
    monkeypatch.setattr(sandbox, "_command", lambda *a, **k: ["/bin/sh", "-c", "echo 'wrapper: failed' >&2; exit 0"])
    with pytest.raises(SandboxError, match="wrapper: failed"):
        run_python("print('hi')", "", FAST)


def test_a_long_lived_sandbox_talks_over_its_pipes_and_is_reaped():
    box = spawn_python(["-m", "json.tool"], Limits(cpu_s=10, wall_s=10), packages=False)
    try:
        out, _ = box.proc.communicate(b'{"a": [1, 2]}', timeout=10)
    finally:
        box.close()
    assert json.loads(out) == {"a": [1, 2]}


# ----- backends ----------------------------------------------------------------------------------------------

def test_an_unknown_backend_is_refused_naming_it():
    with pytest.raises(ValueError, match="sandbox: 'chroot' is not one of"):
        sandbox.backend("chroot")


def test_sandbox_none_runs_unisolated_with_one_loud_warning(caplog):
    sandbox._resolved.cache_clear()
    with caplog.at_level(logging.WARNING, logger="ragen.env.sandbox"):
        run = run_python("import os\nprint(os.getuid())", "", Limits(sandbox="none"))
        run_python("print(1)", "", Limits(sandbox="none"))
    assert run.stdout.strip() == str(os.getuid())
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "sandbox: none" in caplog.records[0].message


@pytest.mark.parametrize("name", ["bwrap", "unshare"])
def test_each_backend_isolates_where_it_works(name):
    if name == "bwrap" and NO_BWRAP:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    try:
        sandbox.backend(name)
    except SandboxUnavailable as exc:
        if name == "unshare" and os.geteuid() != 0:
            pytest.skip(f"the unshare backend is root's: {exc}")
        raise
    out = attack(sandbox, "proc_of_others", "ragen-mark-" + secrets.token_hex(6))
    assert out["stdout"].startswith("none") and "read mem" not in out["stdout"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the unshare backend is root's")
@pytest.mark.parametrize("packages", [False, True])
def test_the_unshare_backend_leaves_every_mount_read_only_and_no_capability(packages, tmp_path):
    limits = Limits(sandbox="unshare", cpu_s=20, wall_s=30, memory_mb=2048)
    target = "/etc/ragen-sandbox-" + secrets.token_hex(4)
    box = spawn_python(["-m", "timeit", "-n1", "-r1",
                        f"open('/proc/self/status').read().index('CapEff:\\t0000000000000000'); open({target!r}, 'w')"],
                       limits, packages=packages)
    try:
        box.proc.wait(30)
        err = box.proc.stderr.read().decode()
    finally:
        box.close()
    assert "Read-only file system" in err and not os.path.exists(target), err


def test_the_code_env_refuses_an_unknown_sandbox_naming_the_key():
    from ragen.env import make_env_config

    with pytest.raises(ValueError, match="sandbox"):
        make_env_config("code", {"sandbox": "chroot"})


# ----- attacks -----------------------------------------------------------------------------------------------

def _as_user(name: str, marker: str) -> dict:
    """The attack run by an ordinary account (created here), with the system's Python and a copy of
    sandbox.py, as a user on a cluster runs it."""
    if os.geteuid() != 0:
        return attack(sandbox, name, marker)  # the tests' user is an ordinary one already
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", USER], check=True)
    folder = tempfile.mkdtemp(prefix="ragen-attack-")  # pytest's tmp_path is root's alone
    try:
        shutil.copy(sandbox.__file__, os.path.join(folder, "sandbox.py"))
        shutil.copy(os.path.join(os.path.dirname(__file__), "sandbox_attacks.py"), folder)
        for path in (folder, *(os.path.join(folder, n) for n in os.listdir(folder))):
            os.chmod(path, 0o755)
        proc = subprocess.run(["runuser", "-u", USER, "--", "/usr/bin/python3",
                               os.path.join(folder, "sandbox_attacks.py"), folder, name, marker],
                              capture_output=True, text=True, timeout=90, cwd=pwd.getpwnam(USER).pw_dir)
    finally:
        shutil.rmtree(folder)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _check(name: str, out: dict) -> None:
    stdout = out["stdout"]
    assert out["files_left"] == [] and out["processes_left"] == [], out
    assert out["bystander_alive"], out
    if name == "network":
        assert stdout.startswith("blocked"), out
    elif name == "files_outside":
        assert "refused" in stdout or "wrote" in stdout, out  # written in its own tmpfs, gone after
    elif name == "proc_of_others":
        assert stdout.startswith("none") and "read mem" not in stdout and "read environ" not in stdout, out
    elif name == "forks":
        assert int(stdout) <= Limits().processes, out
    elif name == "memory_across_forks":
        assert out["status"] == RunStatus.MEMORY_LIMIT.value and stdout.count("held") < 5, out
    elif name == "setsid_child":
        assert stdout == "left\n", out
    elif name == "kill_all":
        assert "after" in stdout, out
    elif name == "ptrace":
        assert "seized" not in stdout and stdout.count("refused") == 2, out
    elif name == "notes_between_runs":
        assert out["second"].startswith("none []"), out


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_an_attack_stays_in_its_box(name):
    _check(name, attack(sandbox, name, "ragen-mark-" + secrets.token_hex(6)))


NO_BWRAP = shutil.which("bwrap") is None


@pytest.mark.skipif(os.geteuid() != 0 or NO_BWRAP or not os.path.exists("/usr/bin/python3"),
                    reason="as root with bubblewrap installed (.ci/run installs it); run as an ordinary user, "
                           "the tests above are that user's")
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_an_attack_stays_in_its_box_as_an_ordinary_user(name):
    _check(name, _as_user(name, "ragen-mark-" + secrets.token_hex(6)))


@pytest.mark.skipif(os.geteuid() != 0, reason="creates an account")
def test_an_ordinary_user_without_bubblewrap_is_refused_naming_the_fix():
    out = _as_user("no_backend", "")
    assert "apt-get install bubblewrap" in out["refused"] and "sandbox: none" in out["refused"]


_FROM_TMP = """
import sys
import ragen
assert ragen.__file__.startswith(sys.argv[1]), ragen.__file__
from ragen.env import make_env
env = make_env("reasoning_gym", {"dataset": "chain_sum", "sandbox": sys.argv[2]})
env.reset(seed=0)
_, reward, _, info = env.step(env.item["answer"])
print("scored", reward)
env.close()
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["bwrap", "unshare"])
def test_a_scorer_runs_where_ragen_is_imported_from_a_folder_under_tmp(name, tmp_path):
    """A checkout (or a venv) under /tmp, which the sandbox replaces with a private one: the scorer
    process still imports ragen's modules from it (they are bound on top, read-only)."""
    pytest.importorskip("reasoning_gym")
    if name == "bwrap" and NO_BWRAP:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    if name == "unshare" and os.geteuid() != 0:
        pytest.skip("the unshare backend is root's")
    checkout = tmp_path / "checkout"
    shutil.copytree(os.path.dirname(os.path.dirname(os.path.abspath(sandbox.__file__))), checkout / "ragen",
                    ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-c", _FROM_TMP, str(checkout), name], cwd=tmp_path, capture_output=True,
                          text=True, timeout=200, env={**os.environ, "PYTHONPATH": str(checkout)})
    assert proc.returncode == 0 and "scored 1.0" in proc.stdout, proc.stderr[-3000:]
