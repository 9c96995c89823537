"""Hostile programs run in the sandbox, and what each one left behind, seen from outside.

Imported by tests/test_sandbox.py (as the user running the tests) and run as a script by a created
account: ``python3 sandbox_attacks.py <folder of sandbox.py> <attack> <marker>`` prints the outcome
as JSON. Standard library only, so the system's Python runs it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

ATTACKS = {
    # each: (script, limits) - the script's {port}, {marker}, {driver} filled in
    "network": ("""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("connected")
except OSError as exc:
    print("blocked", exc)
""", {}),
    "files_outside": ("""
import os
for folder in ("/tmp", "/var/tmp", "/dev/shm", {home!r}):
    try:
        with open(os.path.join(folder, "{marker}"), "wb") as f:
            f.write(b"x" * (8 << 20))
        print("wrote", folder)
    except OSError as exc:
        print("refused", folder, exc)
""", {}),
    "proc_of_others": ("""
import os
found = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for name in ("cmdline", "environ"):
            try:
                with open(f"/proc/{{pid}}/{{name}}", "rb") as f:
                    if b"{marker}" in f.read():
                        found.append((pid, name))
            except OSError:
                pass
print("found" if found else "none", found)
for what in ("mem", "environ"):
    try:
        with open("/proc/{driver}/" + what, "rb") as f:
            print("read", what, len(f.read(4096)))
    except OSError as exc:
        print("no", what, exc)
""", {}),
    "forks": ("""
import os, time
n = 0
for i in range(300):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    n += 1
print(n)
""", {"wall_s": 2}),
    "memory_across_forks": ("""
import os, time
for i in range(5):
    if os.fork() == 0:
        held = b"x" * (150 << 20)
        print("held", flush=True)
        time.sleep(3)
        os._exit(0)
time.sleep(3.5)
""", {"memory_mb": 300, "wall_s": 6, "cpu_s": 5}),
    "setsid_child": ("""
import os
if os.fork() == 0:
    os.setsid()
    os.execv("/bin/sh", ["sh", "-c", "sleep 60", "{marker}"])
print("left")
""", {}),
    "kill_all": ("""
import os, signal
try:
    os.kill(-1, signal.SIGKILL)
except OSError as exc:
    print(exc)
print("after")
""", {}),
    "ptrace": ("""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for pid in ({driver}, 1):
    if libc.ptrace(0x4206, pid, 0, 0) == 0:  # PTRACE_SEIZE
        print("seized", pid)
    else:
        print("refused", pid, ctypes.get_errno())
""", {}),
    "notes_between_runs": ("""
import os
for folder in ("/tmp", "/var/tmp", "/dev/shm"):
    with open(os.path.join(folder, "note-{marker}"), "w") as f:
        f.write("hello")
""", {}),
}

# what a second run sees of the first's notes and of other runs' folders
READ_NOTES = """
import os
seen = [name for folder in ("/tmp", "/var/tmp", "/dev/shm") for name in os.listdir(folder)]
print("notes" if any("{marker}" in n for n in seen) else "none", [n for n in seen if "ragen-code-" in n and n != ".ragen-code-run"])
"""


def attack(sandbox, name: str, marker: str) -> dict:
    """Run the attack ``name`` in ``sandbox`` (the module), with a secret in this process's environment
    and in a bystander's command line, and a listening port; return what it printed and what is left."""
    script, overrides = ATTACKS[name]
    os.environ["RAGEN_TEST_SECRET"] = marker
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", f"engine.api_key={marker}"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    home = os.path.expanduser("~")
    limits = sandbox.Limits(**{"cpu_s": 2, "wall_s": 4, "memory_mb": 256, **overrides})
    try:
        text = script.format(port=listener.getsockname()[1], marker=marker, driver=os.getpid(), home=home)
        run = sandbox.run_python(text, "", limits)
        out = {"status": run.status.value, "stdout": run.stdout, "stderr": run.stderr[-2000:]}
        if name == "notes_between_runs":
            out["second"] = sandbox.run_python(READ_NOTES.format(marker=marker), "", limits).stdout
        time.sleep(0.2)
        out["bystander_alive"] = bystander.poll() is None
        out["files_left"] = [os.path.join(folder, n) for folder in ("/tmp", "/var/tmp", "/dev/shm", home)
                             if os.path.isdir(folder) for n in os.listdir(folder) if marker in n]
        out["processes_left"] = _processes_with(marker, exclude=bystander.pid)
        return out
    finally:
        bystander.kill()
        bystander.wait()
        listener.close()
        for path in out.get("files_left", []) if "out" in locals() else []:
            os.remove(path)


def _processes_with(marker: str, exclude: int) -> list[str]:
    """Processes whose command line holds ``marker``, but for the bystander and this one and its
    ancestors (whose command lines name it)."""
    mine = {exclude, os.getpid(), *_ancestors(os.getpid())}
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) not in mine:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(pid)
            except OSError:
                continue
    return found


def runs_left() -> list[str]:
    """This process's one-shot sandboxed runs (``run_python``) still alive: descendants whose command
    line runs a run's ``main.py`` (other processes' runs on a shared machine are theirs; a scorer pool's
    long-lived processes live as long as this process)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if re.search(r"ragen-code-\S*/main\.py", cmd) and os.getpid() in _ancestors(int(entry)):
                found.append(f"{entry}: {cmd}")
    return found


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            break
        chain.append(pid)
    return chain


if __name__ == "__main__":
    folder, which, token = sys.argv[1:4]
    sys.path.insert(0, folder)
    import sandbox as module  # noqa: E402 - the copy of ragen/env/sandbox.py in ``folder``

    if which == "no_backend":
        module._BWRAP = None
        try:
            print(json.dumps({"backend": module.backend("auto")}))
        except module.SandboxUnavailable as exc:
            print(json.dumps({"refused": str(exc)}))
    else:
        print(json.dumps(attack(module, which, token)))
