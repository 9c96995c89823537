"""The memory allocator of the training process (``trainer.allocator``): tcmalloc where installed.

glibc's malloc keeps most of what an update frees in its heap instead of
giving it back, so a training step's peak RSS is several times the tensors it
holds; tcmalloc (gperftools' ``libtcmalloc_minimal``) gives it back, and the
update is no slower (BENCHMARKS.md, "Trainer memory"). An allocator is chosen
before a process starts (``LD_PRELOAD``), so ``relaunch_with`` runs the same
command again, once, with the library preloaded (``os.execve``), before the
trainer builds anything. The processes it starts (rollout workers, engines)
inherit it.

- ``auto``: tcmalloc where the library is found (Linux), else the system's
  malloc with a warning that says how to install it;
- ``tcmalloc``: tcmalloc, or a ValueError naming the key where it is missing;
- ``system``: the C library's malloc.
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

CHOICES = ("auto", "tcmalloc", "system")
# set in the relaunched process: a preload that did not take is reported, not tried again
_RELAUNCHED = "RAGEN_ALLOCATOR_RELAUNCHED"
_INSTALL = "apt-get install libtcmalloc-minimal4 (Debian/Ubuntu) or gperftools-libs (Fedora)"


def check_choice(choice: str) -> str:
    if choice not in CHOICES:
        raise ValueError(f"trainer.allocator: unknown allocator {choice!r}; choose from {CHOICES}")
    return choice


def find_tcmalloc() -> str | None:
    """The tcmalloc library's file name as the dynamic loader finds it, or None."""
    if not sys.platform.startswith("linux"):
        return None
    for name in ("tcmalloc_minimal", "tcmalloc"):
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def tcmalloc_loaded() -> bool:
    """Whether this process runs on tcmalloc (its library is mapped)."""
    try:
        with open("/proc/self/maps") as f:
            return "libtcmalloc" in f.read()
    except OSError:
        return False


def relaunch_with(choice: str) -> None:
    """Run this process's command again with ``choice``'s allocator preloaded, where it is not
    in force yet; returns where nothing is to be done (``system``, already loaded, not found
    under ``auto``, or a relaunch that did not take)."""
    check_choice(choice)
    if choice == "system":
        return
    if tcmalloc_loaded():
        logger.info("memory allocator: tcmalloc (trainer.allocator=%s)", choice)
        return
    library = find_tcmalloc()
    if library is None:
        if choice == "tcmalloc":
            raise ValueError(f"trainer.allocator=tcmalloc but no tcmalloc library is installed: {_INSTALL}; "
                             "or set trainer.allocator=system")
        logger.warning("trainer.allocator=auto: tcmalloc is not installed, so the system's malloc is used and a "
                       "training step's peak memory is several times higher (%s)", _INSTALL)
        return
    if os.environ.get(_RELAUNCHED):
        logger.warning("trainer.allocator=%s: %s was preloaded but is not in use; the system's malloc is used",
                       choice, library)
        return
    preload = " ".join(p for p in (library, os.environ.get("LD_PRELOAD", "")) if p)
    env = {**os.environ, "LD_PRELOAD": preload, _RELAUNCHED: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)  # does not return
