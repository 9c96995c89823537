"""Run untrusted code (a model's program, an answer a scorer evaluates) isolated, bounded, leaving nothing behind.

``run_python(script, stdin, limits)`` runs a script once; ``spawn_python(args, limits)`` starts a
long-lived sandboxed Python that talks over its stdin and stdout (``Sandboxed``). Both go through one
of the backends (``Limits.sandbox``; docs/envs.md states what each guarantees):

- ``bwrap`` (bubblewrap, Debian's ``bubblewrap`` package): for any user where user namespaces are
  allowed. No network; a file system of its own (read-only system folders and interpreter, the
  script's folder read-only, a sized private tmpfs at ``/tmp``, ``/var/tmp`` and ``/dev/shm``, its
  working folder ``/tmp``); its own PID namespace and ``/proc``; an empty environment; a new session.
  As root it first drops to a uid of its own, new for every run.
- ``unshare`` (util-linux's ``unshare`` and ``setpriv``, root only): the same namespaces and mounts
  made by a root shell inside them, then a uid of its own.
- ``none``: the code runs as the caller, on the machine's network, seeing its files. Only when named.

Under every backend: ``RLIMIT_CPU``, ``RLIMIT_AS`` (each process), ``RLIMIT_FSIZE``, a wall limit,
an output cap, a bound on processes, and memory bounded across all the run's processes: a cgroup
where one can be had (root), else a watchdog that sums the run's resident memory every few
milliseconds and kills it past ``memory_mb``. A seccomp filter (x86-64 and arm64) refuses ptrace,
reading other processes' memory, mounts, namespaces, keyrings, BPF and module loading. When the run
ends every process of it is killed and reaped, and its private file systems are gone.

``backend(name)`` probes once a process which backend works and says so in one line; ``auto`` takes
``bwrap``, then ``unshare``, and raises ``SandboxUnavailable`` when none isolates.
"""

from __future__ import annotations

import enum
import functools
import itertools
import logging
import os
import resource
import select
import shlex
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass

__all__ = ["BACKENDS", "Limits", "RunResult", "RunStatus", "Sandboxed", "SandboxError", "SandboxUnavailable",
           "backend", "process_tree", "run_python", "spawn_python"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "bwrap", "unshare", "none")
_BWRAP, _UNSHARE, _SETPRIV = shutil.which("bwrap"), shutil.which("unshare"), shutil.which("setpriv")
_UID_BASE = 1_500_000_000  # far above any account's uid; a run's uid is this plus a counter
_uids = itertools.count()
_uid_lock = threading.Lock()
_REAP_S = 30.0  # the kernel's time to reap thousands of a fork bomb's processes
_WATCH_S = 0.01  # how often the memory watchdog sums a run's resident memory
_INSIDE = "/tmp/.ragen-code-run"  # the script's folder inside the sandbox (read-only)
_STARTED = b"S"  # the prelude's byte on its started fd, written before any untrusted code runs


class SandboxUnavailable(RuntimeError):
    """No backend isolates here (or the one named does not work)."""


class SandboxError(RuntimeError):
    """The sandbox itself failed to start a run: not the code's doing, so not a verdict on it."""


class RunStatus(str, enum.Enum):
    """How a run ended."""

    OK = "ok"  # exited (any exit code)
    TIME_LIMIT = "time limit"  # CPU or wall time spent
    MEMORY_LIMIT = "memory limit"  # MemoryError, or killed growing past memory_mb
    OUTPUT_LIMIT = "output truncated"  # stdout or stderr past output_bytes


@dataclass(frozen=True)
class Limits:
    """A run's bounds, and the sandbox backend that enforces them (``BACKENDS``)."""

    cpu_s: float = 2.0
    wall_s: float = 5.0
    memory_mb: int = 512
    output_bytes: int = 64 * 1024
    file_bytes: int = 1024 * 1024
    processes: int = 16
    tmp_mb: int = 64
    sandbox: str = "auto"


@dataclass(frozen=True)
class RunResult:
    """What a run printed and how it ended; ``cpu_s``: the CPU time of all its processes."""

    status: RunStatus
    exit_code: int | None
    stdout: str
    stderr: str
    cpu_s: float
    wall_s: float


# ----- which backend -------------------------------------------------------------------------------------------

def backend(name: str = "auto") -> str:
    """The backend ``name`` resolves to here (probed once a process, said in one line); raises
    ``SandboxUnavailable`` when the one named, or for ``auto`` every one, does not isolate."""
    if name not in BACKENDS:
        raise ValueError(f"sandbox: {name!r} is not one of {list(BACKENDS)}")
    return _resolved(name)


@functools.lru_cache(maxsize=None)
def _resolved(name: str) -> str:
    if name == "none":
        logger.warning("sandbox: none - untrusted code runs as %s, on this machine's network, seeing its files and "
                       "processes. Use it only for code you trust.", _user())
        return "none"
    reasons = {}
    for candidate in (("bwrap", "unshare") if name == "auto" else (name,)):
        why = _probe(candidate)
        if why is None:
            logger.info("sandbox: %s (%s; memory across processes: %s; seccomp: %s)", candidate,
                        "a uid of its own per run" if _drops_uid(candidate, packages=False) else f"as {_user()}",
                        "cgroup" if _Cgroup.available() else "watchdog", "on" if _seccomp_program() else "off")
            return candidate
        reasons[candidate] = why
    said = "; ".join(f"{k}: {v}" for k, v in reasons.items())
    raise SandboxUnavailable(
        f"no sandbox isolates untrusted code here ({said}). Install bubblewrap (Debian/Ubuntu: apt-get install "
        f"bubblewrap) where user namespaces are allowed, or run as root with util-linux's unshare and setpriv; "
        f"to run it without isolation, say so by name: sandbox: none")


def _probe(candidate: str) -> str | None:
    """Why ``candidate`` does not work here, or None when a trial run in it isolates."""
    if candidate == "bwrap" and _BWRAP is None:
        return "bwrap not found"
    if candidate == "unshare":
        if os.geteuid() != 0:
            return "needs root"
        if _UNSHARE is None or _SETPRIV is None or _interpreter(packages=False) is None:
            return "util-linux's unshare and setpriv, and a Python every user may run, are needed"
    probe = "import os, socket\nprint(sum(p.isdigit() for p in os.listdir('/proc')) < 8, socket.if_nameindex() in ([], [(1, 'lo')]))"
    try:
        run = _run(probe, "", Limits(cpu_s=5, wall_s=20), candidate)
    except SandboxError as exc:
        return str(exc)
    if run.stdout.split() != ["True", "True"]:
        return f"a trial run was not isolated: {(run.stdout + run.stderr).strip()[-300:]!r}"
    return None


def _user() -> str:
    return "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"


def _drops_uid(name: str, packages: bool) -> bool:
    """Whether runs get a uid of their own: as root, when the interpreter is one every user may run."""
    return name != "none" and os.geteuid() == 0 and _SETPRIV is not None and _interpreter(packages) is not None and (
        _interpreter(packages) != sys.executable or _others_may_run(os.path.realpath(sys.executable)))


@functools.lru_cache(maxsize=None)
def _interpreter(packages: bool) -> str | None:
    """The Python a run uses: this one when every user may run it (or with ``packages``: always, since
    the system's has not got them), else the system's."""
    if packages:
        return sys.executable
    for candidate in (sys.executable, "/usr/bin/python3"):
        path = os.path.realpath(candidate)
        if os.path.isfile(path) and (os.geteuid() != 0 or _others_may_run(path)):
            return candidate
    return None


def _others_may_run(path: str) -> bool:
    import stat

    if not (os.stat(path).st_mode & stat.S_IXOTH and os.stat(path).st_mode & stat.S_IROTH):
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


# ----- seccomp ---------------------------------------------------------------------------------------------------

# syscalls a sandboxed program never needs: tracing and reading other processes, mounts, namespaces,
# keyrings, BPF, perf, module and kernel loading, io_uring (it bypasses the filter), handles
_DENIED = {
    "x86_64": (0xC000003E, [101, 310, 311, 312, 438, 165, 166, 155, 161, 272, 308, 248, 249, 250, 321, 298, 323,
                            175, 176, 313, 246, 320, 169, 167, 168, 163, 303, 304, 212, 425, 426, 427, 428, 429, 430,
                            431, 432]),
    "aarch64": (0xC00000B7, [117, 270, 271, 272, 438, 40, 39, 41, 51, 97, 268, 217, 218, 219, 280, 241, 282, 105,
                             106, 273, 104, 294, 142, 224, 225, 89, 264, 265, 18, 425, 426, 427, 428, 429, 430,
                             431, 432]),
}


@functools.lru_cache(maxsize=1)
def _seccomp_program() -> bytes:
    """A classic BPF program (``struct sock_filter[]``): EPERM for ``_DENIED``, and for another
    architecture's calls (x32), else allow; empty on an architecture not listed."""
    arch = os.uname().machine
    if arch not in _DENIED:
        return b""
    audit_arch, numbers = _DENIED[arch]
    ld_w_abs, jeq_k, jge_k, ret_k = 0x20, 0x15, 0x35, 0x06
    allow, eperm = 0x7FFF0000, 0x00050000 | 1
    n = len(numbers)
    prog = [(ld_w_abs, 0, 0, 4),  # seccomp_data.arch
            (jeq_k, 1, 0, audit_arch),
            (ret_k, 0, 0, eperm),
            (ld_w_abs, 0, 0, 0)]  # seccomp_data.nr
    if arch == "x86_64":  # x32 calls carry bit 30
        prog.append((jge_k, n + 1, 0, 0x40000000))
    for i, nr in enumerate(numbers):
        prog.append((jeq_k, n - i, 0, nr))
    prog += [(ret_k, 0, 0, allow), (ret_k, 0, 0, eperm)]
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


# The first code the sandboxed Python runs: install the filter, say "started" on the fd it is given and close it,
# then run the script (or module) as __main__. It takes 2 ms.
_PRELUDE = r'''
import os, sys
def _seal(program):
    if program:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(program, len(program))
        class _Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
        prog = _Prog(len(program) // 8, ctypes.addressof(buf))
        if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "seccomp")
_seal(bytes.fromhex(sys.argv[2]))
os.write(int(sys.argv[1]), b"S")
os.close(int(sys.argv[1]))
del _seal
target = sys.argv[3]
sys.argv = sys.argv[3:]
import runpy
if target == "-m":
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.path[0] = os.path.dirname(target)
    runpy.run_path(target, run_name="__main__")
'''


# ----- memory across processes ------------------------------------------------------------------------------------

class _Cgroup:
    """A run's own memory and pids cgroup (v1 here, or v2), where this process may make one (root)."""

    _roots: dict[str, str] | None = None

    def __init__(self, limits: Limits) -> None:
        roots = self._find()
        name = f"ragen-sandbox-{os.getpid()}-{next(_uids)}"
        self.paths = [os.path.join(root, name) for root in dict.fromkeys(roots.values())]
        for path in self.paths:
            os.mkdir(path)
        memory = limits.memory_mb * 1024 * 1024 + limits.tmp_mb * 3 * 1024 * 1024  # its tmpfs pages count
        self._write(roots["memory"], name, "memory.max" if _v2(roots["memory"]) else "memory.limit_in_bytes", memory)
        if not _v2(roots["memory"]):
            self._write(roots["memory"], name, "memory.memsw.limit_in_bytes", memory, optional=True)
        else:
            self._write(roots["memory"], name, "memory.swap.max", 0, optional=True)
        self._write(roots["pids"], name, "pids.max", limits.processes + 2)  # + bwrap's and the namespace's init
        self.procs = [os.path.join(path, "cgroup.procs") for path in self.paths]
        self.memory_path = os.path.join(roots["memory"], name)

    @staticmethod
    def _write(root: str, name: str, key: str, value: int, optional: bool = False) -> None:
        try:
            with open(os.path.join(root, name, key), "w") as f:
                f.write(str(value))
        except OSError:
            if not optional:
                raise

    @classmethod
    def available(cls) -> bool:
        return bool(cls._find())

    @classmethod
    def _find(cls) -> dict[str, str]:
        """controller -> the folder under which this process may make a cgroup ({} when it may not)."""
        if cls._roots is None:
            cls._roots = {}
            if os.geteuid() == 0:
                try:
                    cls._roots = _cgroup_roots()
                except OSError:
                    cls._roots = {}
        return cls._roots

    def oom_killed(self) -> bool:
        events = "memory.events" if _v2(os.path.dirname(self.memory_path)) else "memory.oom_control"  # v2, v1
        try:
            with open(os.path.join(self.memory_path, events)) as f:
                return any(line.split()[0] == "oom_kill" and int(line.split()[1]) > 0 for line in f)
        except (OSError, ValueError, IndexError):
            return False

    def remove(self) -> None:
        for path in self.paths:
            deadline = time.monotonic() + _REAP_S
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy until the kernel has reaped every process in it
                    if time.monotonic() > deadline:
                        logger.warning("sandbox: cgroup %s still busy after %.0f s", path, _REAP_S)
                        break
                    time.sleep(0.005)


def _v2(root: str) -> bool:
    return os.path.exists(os.path.join(root, "cgroup.controllers"))


def _cgroup_roots() -> dict[str, str]:
    found = {}
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    for _, controllers, path in lines:
        for controller in ("memory", "pids"):
            if controller in controllers.split(","):
                root = os.path.join("/sys/fs/cgroup", controller) + path
                if os.path.isdir(root) and os.access(root, os.W_OK):
                    found[controller] = root
    if len(found) < 2:  # v2: one hierarchy, usable when our cgroup delegates both controllers to children
        v2 = next((p for _, c, p in lines if c == ""), None)
        root = "/sys/fs/cgroup" + (v2 or "")
        try:
            with open(os.path.join(root, "cgroup.subtree_control")) as f:
                delegated = f.read().split()
        except OSError:
            delegated = []
        if {"memory", "pids"} <= set(delegated) and os.access(root, os.W_OK):
            return {"memory": root, "pids": root}
        return {}
    return found


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it (the ``children`` file of each of their threads); one that
    ends while it is read is left out."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return found


def _resident_bytes(pids: list[int]) -> int:
    page, total = resource.getpagesize(), 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
    return total


def _tasks_of(uid: int) -> int:
    """Threads this uid runs now (what ``RLIMIT_NPROC`` counts)."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                continue
    return count


# ----- a run -------------------------------------------------------------------------------------------------------

def _command(name: str, folder: str, target: list[str], limits: Limits, uid: int | None, packages: bool,
             started_fd: int) -> list[str]:
    """The command line that runs the prelude, then ``target`` (a script path or ``-m module``)."""
    python = _interpreter(packages) if name != "none" else sys.executable
    flags = ["-I", "-S", "-B"] if not packages else ["-B", "-E", "-s"]
    seal = _seccomp_program().hex() if name != "none" else ""
    inner = [python, *flags, f"{_INSIDE}/prelude.py", str(started_fd), seal, *target]
    if name == "none":
        return [python, *flags, os.path.join(folder, "prelude.py"), str(started_fd), seal,
                *[t.replace(_INSIDE, folder) for t in target]]
    if name == "bwrap":
        setpriv = [_SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
        return [*setpriv, _BWRAP, "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL",
                "--clearenv",
                "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8", "--setenv", "HOME", "/tmp",
                # the private /tmp first: a package folder under it (a checkout or venv in /tmp) is bound on top
                *_tmpfs(limits), *_binds(python, packages), "--proc", "/proc", "--dev", "/dev",
                "--ro-bind", folder, _INSIDE, "--chdir", "/tmp", *inner]
    # unshare: a root shell in the new namespaces mounts the private folders, then drops to the run's uid
    # (or, for a Python only root may run, stays uid 0 without a capability, on a read-only file system)
    setpriv = [_SETPRIV, "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    setpriv += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
    return [_UNSHARE, "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc",
            "--propagation", "private", "/bin/sh", "-c", _unshare_script(folder, limits, python, packages), "sh",
            *setpriv, *inner]


def _unshare_script(folder: str, limits: Limits, python: str, packages: bool) -> str:
    """The root shell's mounts in the new mount namespace: the script's folder read-only at _INSIDE (by
    way of /tmp's tmpfs, since / is not writable), private tmpfs at /tmp, /var/tmp and /dev/shm, the
    folders a run must not read hidden under empty ones; then the run's command ("$@")."""
    size = f"size={limits.tmp_mb}m,mode=1777"
    # with packages: the folders it imports from that lie under a private one (a checkout or venv in /tmp)
    kept = [shlex.quote(p) for p in _package_folders() if p.startswith(_PRIVATE)] if packages else []
    lines = [
        "set -e",
        # every mount read-only in this namespace (the machine's stay as they are); then the private ones
        "awk '{print $2}' /proc/self/mounts | while read -r m; do mount -o remount,bind,ro \"$m\" 2>/dev/null "
        "|| true; done",
        "mount -t tmpfs -o size=1m,mode=755 tmpfs /run",  # a place to hold folders while /tmp is replaced
        "mkdir /run/inside",
        f"mount --bind {folder} /run/inside",
        "mount -o remount,bind,ro /run/inside",
        *[line for i, path in enumerate(kept) for line in (
            f"mkdir /run/kept{i}", f"mount --bind {path} /run/kept{i}", f"mount -o remount,bind,ro /run/kept{i}")],
        f"mount -t tmpfs -o {size} tmpfs /tmp",
        f"mount -t tmpfs -o {size} tmpfs /var/tmp",
        f"mount -t tmpfs -o {size} tmpfs /dev/shm",
        f"mkdir {_INSIDE}",
        f"mount --move /run/inside {_INSIDE}",
        *[line for i, path in enumerate(kept) for line in (f"mkdir -p {path}", f"mount --move /run/kept{i} {path}")],
        *[f"mount -t tmpfs -o size=4k,mode=755 tmpfs '{path}'" for path in _hidden(python, packages)],
        "cd /tmp",
        'exec "$@"',
    ]
    return "\n".join(lines)


def _ragen_root() -> str:
    """The folder ragen is imported from (its source folder, with an editable install)."""
    import ragen

    return os.path.dirname(os.path.dirname(os.path.realpath(ragen.__file__)))


def _hidden(python: str, packages: bool) -> list[str]:
    """Folders a run must not read (the unshare backend sees the whole file system otherwise): people's
    homes, this process's folder and ragen's source (problems, datasets), installed packages unless it
    is given them; never one that holds its interpreter."""
    found = {"/home", "/root", "/srv", "/mnt", "/media", "/opt", os.getcwd(), _ragen_root()}
    if not packages:
        found |= {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    keep = [os.path.realpath(python)]
    if packages:  # it imports what this Python imports: ragen's source and the folders of sys.path stay
        keep += [_ragen_root() + "/x",
                 *(os.path.realpath(p) + "/x" for p in sys.path if p and os.path.isdir(p))]
    found = {p for p in found if p != "/" and os.path.isdir(p) and not p.startswith("/tmp")
             and not any(k.startswith(os.path.realpath(p) + "/") for k in keep)}
    return sorted(p for p in found if not any(p.startswith(q + "/") for q in found))  # one under another: hidden


def _binds(python: str, packages: bool) -> list[str]:
    """bwrap's read-only view of the system: its program folders, the interpreter's prefix, and with
    ``packages`` this Python's packages and the folders they are imported from."""
    args = []
    for top in ("/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefixes = {os.path.realpath(sys.base_prefix)} if os.path.realpath(python) == os.path.realpath(
        sys.executable) else set()
    if packages:
        prefixes |= set(_package_folders())
    for prefix in sorted(prefixes):
        if not prefix.startswith(("/usr/", "/lib")) and prefix != "/":
            args += ["--ro-bind", prefix, prefix]
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        real = os.path.realpath(sys.executable)
        if not any(real.startswith(p + "/") for p in prefixes | {"/usr", "/bin", "/lib"}):
            args += ["--ro-bind", real, real]
        if sys.executable != real:
            args += ["--ro-bind", os.path.dirname(sys.executable), os.path.dirname(sys.executable)]
    if not packages:  # the interpreter's own packages hidden: a run has the standard library alone
        for path in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
            if os.path.isdir(path) and any(path.startswith(p + "/") for p in prefixes):
                args += ["--tmpfs", path]
    return args


_PRIVATE = ("/tmp/", "/var/tmp/", "/dev/shm/")  # private (empty) in a sandbox: what it needs under them is bound


def _package_folders() -> list[str]:
    """The folders a run with packages imports from: this Python's prefix, ragen's source (an editable
    install imports ragen from it) and sys.path's folders."""
    folders = {os.path.realpath(sys.prefix), _ragen_root()} | {os.path.realpath(p) for p in sys.path
                                                                 if p and os.path.isdir(p)}
    return sorted(folders)


def _tmpfs(limits: Limits) -> list[str]:
    size = str(limits.tmp_mb * 1024 * 1024)
    return [arg for path in ("/tmp", "/var/tmp", "/dev/shm") for arg in ("--size", size, "--tmpfs", path)]


def _limit_child(limits: Limits, nproc: int | None, cgroup_procs: list[str]) -> None:
    """In the child, before exec (a ``preexec_fn``: only ``os`` and ``resource``, imported in the parent,
    so it takes no lock a parent thread may hold)."""
    for procs in cgroup_procs:
        fd = os.open(procs, os.O_WRONLY)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    cpu = max(1, int(limits.cpu_s + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    memory = limits.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if nproc is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


class Sandboxed:
    """One sandboxed process: started, talked to through ``proc``'s pipes, then ``close()``d (every
    process of it killed and reaped, its cgroup and folders removed). ``cpu_s`` after close."""

    def __init__(self, target: list[str], limits: Limits, name: str, *, packages: bool,
                 files: dict[str, str]) -> None:
        self.limits = limits
        self.name = name
        _sweep_once()
        self._folder = tempfile.TemporaryDirectory(prefix=f"ragen-code-{os.getpid()}-")
        folder = self._folder.name
        for file_name, text in {"prelude.py": _PRELUDE, **files}.items():
            with open(os.path.join(folder, file_name), "w", encoding="utf-8") as f:
                f.write(text)
        uid = _next_uid() if _drops_uid(self.name, packages) else None
        if uid is not None:  # its own folder: another run's uid cannot read it
            for path in (folder, *(os.path.join(folder, f) for f in os.listdir(folder))):
                os.chown(path, uid, uid)
        self.cgroup = _Cgroup(limits) if self.name != "none" and _Cgroup.available() else None
        self.watched = self.cgroup is None and self.name != "none"  # memory bounded by the watchdog
        nproc = None
        if self.watched:  # no pids cgroup either: RLIMIT_NPROC, counted per uid (a fresh one's starts at 0)
            nproc = limits.processes + 2 + (0 if uid is not None else _tasks_of(os.geteuid()))
        started_r, started_w = os.pipe()
        command = _command(self.name, folder, target, limits, uid, packages, started_w)
        self.t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                command, cwd=folder if self.name == "none" else "/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": folder},
                process_group=0, close_fds=True, pass_fds=(started_w,),
                preexec_fn=lambda: _limit_child(limits, nproc, self.cgroup.procs if self.cgroup else []))
        except BaseException:  # anything: the folder and cgroup go, then it is raised
            os.close(started_r)
            os.close(started_w)
            self._cleanup()
            raise
        os.close(started_w)
        self.started_fd = started_r
        self.cpu_s = 0.0
        self.oom_killed = False
        self._closed = False

    def memory_over(self) -> bool:
        """The watchdog's look (``watched``: no cgroup bounds the run): its resident memory, all its
        processes together, past its bound."""
        return _resident_bytes(process_tree(self.proc.pid)) > self.limits.memory_mb * 1024 * 1024

    def wait_started(self, timeout: float) -> None:
        """Returns once the prelude said it started; else closes the run and raises ``SandboxError``
        with what the wrapper said."""
        ready, _, _ = select.select([self.started_fd], [], [], max(0.0, timeout))
        if ready and os.read(self.started_fd, 1) == _STARTED:
            return
        words = f"no start within {timeout:.0f} s"
        if ready:  # the wrapper ended (or failed) before the prelude ran: its words are on stderr
            deadline = time.monotonic() + 1.0
            while not _exited(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.005)
            os.set_blocking(self.proc.stderr.fileno(), False)
            words = (os.read(self.proc.stderr.fileno(), 65536) or b"").decode(errors="replace")[-500:]
        self.close()
        raise SandboxError(f"sandbox ({self.name}) failed to start: {words}")

    def close(self) -> resource.struct_rusage | None:
        """Kill every process of the run, reap it, remove its folder and cgroup (once)."""
        if self._closed:
            return None
        self._closed = True
        usage = _kill_all(self.proc, self.name != "none")
        try:
            os.close(self.started_fd)
        except OSError:
            pass
        self.cpu_s = usage.ru_utime + usage.ru_stime
        self.oom_killed = self.cgroup is not None and self.cgroup.oom_killed()  # read before it is removed
        self._cleanup()
        return usage

    def _cleanup(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
        self._folder.cleanup()


@functools.lru_cache(maxsize=1)
def _sweep_once() -> None:
    """Remove what runs of processes that were killed (a loky worker SIGKILLed at shutdown) left:
    their folders (``ragen-code-<pid>-*``) and empty cgroups (``ragen-sandbox-<pid>-*``)."""
    def dead(name: str, prefix: str) -> bool:
        pid = name[len(prefix):].split("-", 1)[0]
        return pid.isdigit() and not os.path.exists(f"/proc/{pid}")

    top = tempfile.gettempdir()
    for name in os.listdir(top):
        path = os.path.join(top, name)
        if name.startswith("ragen-code-") and dead(name, "ragen-code-") and os.stat(path).st_uid == os.geteuid():
            shutil.rmtree(path, ignore_errors=True)
    for root in set(_Cgroup._find().values()):
        for name in os.listdir(root):
            if name.startswith("ragen-sandbox-") and dead(name, "ragen-sandbox-"):
                try:
                    os.rmdir(os.path.join(root, name))
                except OSError:  # not empty yet, or gone
                    pass


def spawn_python(args: list[str], limits: Limits = Limits(), *, packages: bool = True) -> Sandboxed:
    """A long-lived sandboxed Python running ``args`` (``["-m", "module", ...]``); with ``packages`` it
    sees this Python's installed packages (read-only). Its CPU limit counts for its whole life; the
    caller bounds each exchange's wall time and closes it."""
    box = Sandboxed(args, limits, backend(limits.sandbox), packages=packages, files={})
    box.wait_started(limits.wall_s)
    return box


def run_python(script: str, stdin: str = "", limits: Limits = Limits()) -> RunResult:
    """``script`` run once, as described in the module docstring. A run the sandbox failed to start is
    tried again once, then raises ``SandboxError``: a verdict follows from what the code did, never
    from the wrapper."""
    name = backend(limits.sandbox)
    try:
        return _run(script, stdin, limits, name)
    except SandboxError as exc:
        logger.warning("%s; trying once more", exc)
        return _run(script, stdin, limits, name)


def _run(script: str, stdin: str, limits: Limits, name: str) -> RunResult:
    box = Sandboxed([f"{_INSIDE}/main.py"], limits, name, packages=False, files={"main.py": script})
    started = False
    try:
        out, err, status, started = _communicate(box, stdin.encode("utf-8"), limits)
    finally:
        box.close()
    wall = time.monotonic() - box.t0
    code = box.proc.returncode
    if not started:
        raise SandboxError(f"sandbox ({name}) failed to start the run (exit {code}): "
                           f"{err.decode('utf-8', 'replace').strip()[-500:]}")
    if status is RunStatus.OK:
        status = _status_of(code, err, limits, box)
    return RunResult(status, code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), box.cpu_s, wall)


def _communicate(box: Sandboxed, data: bytes, limits: Limits) -> tuple[bytes, bytes, RunStatus, bool]:
    """Feed stdin, read both pipes up to the byte bound, until exit, the wall limit or the memory bound."""
    proc = box.proc
    deadline = box.t0 + limits.wall_s
    chunks: dict[int, list[bytes]] = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
    sizes = dict.fromkeys(chunks, 0)
    started = False
    writer = threading.Thread(target=_feed, args=(proc, data), daemon=True)
    writer.start()
    status = RunStatus.OK
    watch = box.watched
    with selectors.DefaultSelector() as sel:
        for fd in (*chunks, box.started_fd):
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():  # until both pipes and the started fd are closed
            left = deadline - time.monotonic()
            if left <= 0:
                status = RunStatus.TIME_LIMIT
                break
            for key, _ in sel.select(timeout=min(left, _WATCH_S) if watch else left):
                block = os.read(key.fd, 65536)
                if key.fd == box.started_fd:
                    started = started or block == _STARTED
                    sel.unregister(key.fd)
                    continue
                if not block:
                    sel.unregister(key.fd)
                    continue
                room = limits.output_bytes - sizes[key.fd]
                chunks[key.fd].append(block[:max(0, room)])
                sizes[key.fd] += len(block)
                if sizes[key.fd] > limits.output_bytes:
                    status = RunStatus.OUTPUT_LIMIT
            if status is RunStatus.OUTPUT_LIMIT:
                break
            if watch and box.memory_over():
                status = RunStatus.MEMORY_LIMIT
                break
    while status is RunStatus.OK and not _exited(proc.pid):  # it may close its pipes and go on
        if time.monotonic() >= deadline:
            status = RunStatus.TIME_LIMIT
        elif watch and box.memory_over():
            status = RunStatus.MEMORY_LIMIT
        else:
            time.sleep(0.002)
    return b"".join(chunks[proc.stdout.fileno()]), b"".join(chunks[proc.stderr.fileno()]), status, started


def _feed(proc: subprocess.Popen, data: bytes) -> None:
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except (BrokenPipeError, OSError, ValueError):  # it exited, never read its input, or was closed
        pass


def _exited(pid: int) -> bool:
    """Whether the child has exited, left unreaped (``_kill_all`` reaps it, with its CPU time)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already (a caller's proc.wait())
        return True


def _kill_all(proc: subprocess.Popen, namespaced: bool) -> resource.struct_rusage:
    """End the run and reap it: its resource use (with its reaped children's) returned, this run's
    alone whatever other runs of this process end at the same time.

    In a PID namespace, the wrapper's child is the namespace's first process: killed, the kernel kills
    every process of the namespace and waits for them before the wrapper sees it end, so nothing of
    the run is left. Otherwise the process group is killed."""
    if namespaced and not _exited(proc.pid):
        for pid in _children(proc.pid):
            _kill(pid)
        deadline = time.monotonic() + _REAP_S
        while not _exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.002)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        try:
            pipe.close()
        except OSError:
            pass
    try:
        _, status, usage = os.wait4(proc.pid, 0)  # exited, or SIGKILLed: it returns at once
    except ChildProcessError:  # reaped already: its exit code is the caller's, its CPU time unknown
        return resource.struct_rusage((0.0, 0.0) + (0,) * 14)
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


def _status_of(code: int | None, err: bytes, limits: Limits, box: Sandboxed) -> RunStatus:
    """From what the code did: killed by the cgroup's memory bound, killed by SIGKILL (which only
    ``RLIMIT_CPU``'s hard limit sends once the wall, output and memory bounds, ours, are ruled out),
    a CPU time at the limit (the unshare backend reports a signal's death as exit status 1), or a
    MemoryError it raised."""
    if box.oom_killed:
        return RunStatus.MEMORY_LIMIT
    if code in (-signal.SIGKILL, 128 + signal.SIGKILL) or (code != 0 and box.cpu_s >= limits.cpu_s * 0.9):
        return RunStatus.TIME_LIMIT
    if b"MemoryError" in err[-2048:]:
        return RunStatus.MEMORY_LIMIT
    return RunStatus.OK
