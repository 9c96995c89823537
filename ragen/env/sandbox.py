"""Run untrusted Python in a subprocess with limits, and leave nothing behind.

``run_python(script, stdin, limits)`` runs ``script`` with Python (``-I``:
no user site, no ``PYTHON*`` variables) in a fresh temporary
directory, with an empty environment (no secrets inherited), under:

- ``RLIMIT_CPU`` (``cpu_s``), ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_FSIZE``
  (files it writes) and a wall limit (``wall_s``), past which the process
  group is killed;
- stdout and stderr read up to ``output_bytes`` each; past that the process
  is killed and the output marked truncated;
- its own process group, killed (SIGKILL) when the run ends, whatever ended it.

Run as root (containers, CI) with util-linux's ``unshare`` and ``setpriv``
(``isolated()``), the child also:

- runs as a uid of its own (one no account has, new for every run; no
  capabilities), so it can write only its folder and what anyone may write,
  and ``RLIMIT_NPROC`` (``processes``) bounds its forks and threads;
- runs in a network namespace with no interface up: no network;
- is the first process of a PID namespace of its own: when it ends, the
  kernel kills every process it made, even one that left its process group.

Its interpreter is then this Python when every user may run it, else the
system's ``/usr/bin/python3``. Not isolated (another user, or the tools
missing), the code runs as the calling user, on the machine's network, and a
process that leaves its group outlives the run: that is a sandbox for honest
mistakes only (docs/envs.md).
"""

from __future__ import annotations

import enum
import functools
import itertools
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

__all__ = ["Limits", "RunResult", "RunStatus", "isolated", "run_python"]

_UNSHARE, _SETPRIV = shutil.which("unshare"), shutil.which("setpriv")
_UID_BASE = 1_500_000_000  # far above any account's uid; a run's uid is this plus a counter
_uids = itertools.count()
_uid_lock = threading.Lock()
# the namespace's processes are killed at once; the wait is for the kernel to reap thousands of a fork bomb
_REAP_S = 30.0


def isolated() -> bool:
    """Whether runs get their own uid, network and PID namespace (root, with util-linux's tools, and an
    interpreter every user may run)."""
    return os.geteuid() == 0 and _UNSHARE is not None and _SETPRIV is not None and _interpreter() is not None


@functools.lru_cache(maxsize=1)
def _interpreter() -> str | None:
    """The Python an isolated run uses: this one when every user may run it, else the system's."""
    for candidate in (sys.executable, "/usr/bin/python3"):
        path = os.path.realpath(candidate)
        if os.path.isfile(path) and _others_may_run(path):
            return candidate
    return None


def _others_may_run(path: str) -> bool:
    import stat

    mode = os.stat(path).st_mode
    if not (mode & stat.S_IXOTH and mode & stat.S_IROTH):
        return False
    folder = os.path.dirname(path)
    while True:
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(folder)
        if parent == folder:
            return True
        folder = parent


def _next_uid() -> int:
    with _uid_lock:
        return _UID_BASE + (os.getpid() % 100_000) * 1000 + next(_uids) % 1000


class RunStatus(str, enum.Enum):
    """How a run ended."""

    OK = "ok"  # exited (any exit code)
    TIME_LIMIT = "time limit"  # CPU or wall time spent
    MEMORY_LIMIT = "memory limit"  # MemoryError, or killed growing past the address-space limit
    OUTPUT_LIMIT = "output truncated"  # stdout or stderr past output_bytes


@dataclass(frozen=True)
class Limits:
    """A run's bounds."""

    cpu_s: float = 2.0
    wall_s: float = 5.0
    memory_mb: int = 512
    output_bytes: int = 64 * 1024
    file_bytes: int = 1024 * 1024
    processes: int = 16


@dataclass(frozen=True)
class RunResult:
    """What a run printed and how it ended; ``cpu_s``: the child's CPU time."""

    status: RunStatus
    exit_code: int | None
    stdout: str
    stderr: str
    cpu_s: float
    wall_s: float


def _limit_child(limits: Limits, own_uid: bool) -> None:
    """In the child, before exec (a ``preexec_fn``: it calls only ``resource``, imported in the parent,
    and neither imports nor logs, so it takes no lock a parent thread may hold)."""
    cpu = max(1, int(limits.cpu_s + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))  # SIGKILL at the limit: the first process of a PID
    # namespace ignores SIGXCPU
    memory = limits.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if own_uid:  # counted for the run's own uid only: root's processes before it are exempt
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))


def run_python(script: str, stdin: str = "", limits: Limits = Limits()) -> RunResult:
    """``script`` run as described in the module docstring."""
    if isolated():
        uid = _next_uid()
        command = [_UNSHARE, "--net", "--pid", "--fork", "--kill-child", _SETPRIV, f"--reuid={uid}",
                   f"--regid={uid}", "--clear-groups", _interpreter()]
    else:
        uid, command = None, [sys.executable]
    with tempfile.TemporaryDirectory(prefix="ragen-code-") as workdir:
        path = os.path.join(workdir, "main.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(script)
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(path, uid, uid)
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [*command, "-I", "-B", path], cwd=workdir, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir},
            process_group=0, preexec_fn=lambda: _limit_child(limits, uid is not None), close_fds=True)
        try:
            out, err, status = _communicate(proc, stdin.encode("utf-8"), limits)
        finally:
            usage = _kill_all(proc, uid is not None)
        wall = time.monotonic() - t0
    cpu = usage.ru_utime + usage.ru_stime
    code = proc.returncode
    if status is RunStatus.OK:
        status = _status_of(code, err, limits, cpu)
    return RunResult(status, code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), cpu, wall)


def _communicate(proc: subprocess.Popen, data: bytes, limits: Limits) -> tuple[bytes, bytes, RunStatus]:
    """Feed stdin, read both pipes up to the byte bound, until exit or the wall limit."""
    deadline = time.monotonic() + limits.wall_s
    chunks: dict[int, list[bytes]] = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
    sizes = dict.fromkeys(chunks, 0)
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except (BrokenPipeError, OSError):  # it exited, or never read its input
        pass
    status = RunStatus.OK
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                status = RunStatus.TIME_LIMIT
                break
            for key, _ in sel.select(timeout=left):
                block = os.read(key.fd, 65536)
                if not block:
                    sel.unregister(key.fd)
                    continue
                room = limits.output_bytes - sizes[key.fd]
                chunks[key.fd].append(block[:room])
                sizes[key.fd] += len(block)
                if sizes[key.fd] > limits.output_bytes:
                    status = RunStatus.OUTPUT_LIMIT
            if status is RunStatus.OUTPUT_LIMIT:
                break
    while status is RunStatus.OK and not _exited(proc.pid):  # it may close its pipes and go on
        if time.monotonic() >= deadline:
            status = RunStatus.TIME_LIMIT
        time.sleep(0.002)
    return b"".join(chunks[proc.stdout.fileno()]), b"".join(chunks[proc.stderr.fileno()]), status


def _exited(pid: int) -> bool:
    """Whether the child has exited, left unreaped (``_kill_all`` reaps it, with its CPU time)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_all(proc: subprocess.Popen, isolated_run: bool) -> resource.struct_rusage:
    """End the run and reap it: its resource use (with its reaped children's) returned, this run's
    alone whatever other runs of this process end at the same time.

    Isolated, the namespace's first process is killed and ``unshare`` reaps it: the kernel has then
    killed every process of the namespace and waited for them (its first process cannot be reaped
    before), so nothing of the run is left. Otherwise the process group is killed."""
    if isolated_run and not _exited(proc.pid):
        for pid in _children(proc.pid):
            _kill(pid)
        deadline = time.monotonic() + _REAP_S
        while not _exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.002)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.stdout.close()
    proc.stderr.close()
    _, status, usage = os.wait4(proc.pid, 0)  # exited, or SIGKILLed: it returns at once
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _status_of(code: int | None, err: bytes, limits: Limits, cpu: float) -> RunStatus:
    # by its CPU time, not its exit status: unshare reports a child killed by SIGXCPU as exit status 1
    if code != 0 and cpu >= limits.cpu_s * 0.9:
        return RunStatus.TIME_LIMIT
    if b"MemoryError" in err[-2048:]:
        return RunStatus.MEMORY_LIMIT
    return RunStatus.OK
