"""The memory allocator of the training process (``trainer.allocator``): tcmalloc or mimalloc (ragen ships it).

glibc's malloc keeps most of what an update frees in its heap instead of
giving it back, so a training step's peak RSS is several times the tensors it
holds; mimalloc and tcmalloc give it back (BENCHMARKS.md, "The update: memory and time").
mimalloc comes with ragen on Linux (the ``cmeel-mimalloc`` wheel, a
dependency); tcmalloc is a system package (gperftools' ``libtcmalloc_minimal``).
An allocator is chosen before a process starts (``LD_PRELOAD``), so
``relaunch_with`` runs the same command again, once, with the library
preloaded (``os.execve``), before the trainer builds anything. The processes
it starts (rollout workers, engines) inherit it; the sandbox's do not (they
start with an empty environment).

- ``auto``: tcmalloc where installed (the fastest), else mimalloc, else the
  system's malloc, with a warning on Linux (where mimalloc should be);
- ``mimalloc`` / ``tcmalloc``: that one, or a ValueError naming the key where it is missing;
- ``system``: the C library's malloc.
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

CHOICES = ("auto", "mimalloc", "tcmalloc", "system")
AUTO_ORDER = ("tcmalloc", "mimalloc")  # the fastest that holds the memory bound first (BENCHMARKS.md)
# set in the relaunched process: a preload that did not take is reported, not tried again
_RELAUNCHED = "RAGEN_ALLOCATOR_RELAUNCHED"
_INSTALL = {
    "mimalloc": "pip install cmeel-mimalloc (a dependency of ragen on Linux)",
    "tcmalloc": "apt-get install libtcmalloc-minimal4 (Debian/Ubuntu) or gperftools-libs (Fedora)",
}


def check_choice(choice: str) -> str:
    if choice not in CHOICES:
        raise ValueError(f"trainer.allocator: unknown allocator {choice!r}; choose from {CHOICES}")
    return choice


def find_library(name: str) -> str | None:
    """The file of allocator ``name`` (mimalloc: the wheel's, else the system's), or None; Linux only."""
    if not sys.platform.startswith("linux"):
        return None
    if name == "mimalloc":
        try:
            files = importlib.metadata.files("cmeel-mimalloc") or []
        except importlib.metadata.PackageNotFoundError:
            files = []
        for f in files:
            if f.name.startswith("libmimalloc.so"):
                path = Path(str(f.locate()))
                if path.is_file():
                    return str(path.resolve())
        return ctypes.util.find_library("mimalloc")
    for lib in ("tcmalloc_minimal", "tcmalloc"):
        found = ctypes.util.find_library(lib)
        if found:
            return found
    return None


def loaded() -> str | None:
    """The allocator this process runs on where it is one of ours (its library is mapped), else None."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    return next((name for name in AUTO_ORDER if f"lib{name}" in maps), None)


def give_back() -> None:
    """Return the memory freed so far to the system, where the allocator holds on to it: between a
    step's phases (a validation rollout's caches, a rollout's, before the update), so that one
    phase's freed memory does not stay in the next one's peak. A millisecond or so."""
    try:
        lib = ctypes.CDLL(None)
    except OSError:
        return
    for symbol, args in (("mi_collect", (ctypes.c_bool(True),)), ("MallocExtension_ReleaseFreeMemory", ()),
                         ("malloc_trim", (ctypes.c_size_t(0),))):
        function = getattr(lib, symbol, None)
        if function is not None:
            function(*args)
            return


def relaunch_with(choice: str) -> None:
    """Run this process's command again with ``choice``'s allocator preloaded, where it is not
    in force yet; returns where nothing is to be done (``system``, already loaded, none found
    under ``auto``, or a relaunch that did not take)."""
    check_choice(choice)
    if choice == "system":
        return
    wanted = AUTO_ORDER if choice == "auto" else (choice,)
    running = loaded()
    if running in wanted:
        logger.info("memory allocator: %s (trainer.allocator=%s)", running, choice)
        return
    name, library = next(((n, lib) for n in wanted if (lib := find_library(n))), (None, None))
    if library is None:
        if choice != "auto":
            raise ValueError(f"trainer.allocator={choice} but no {choice} library is found: {_INSTALL[choice]}; "
                             "or set trainer.allocator=system")
        if sys.platform.startswith("linux"):
            logger.warning("trainer.allocator=auto: neither mimalloc nor tcmalloc is found, so the system's malloc "
                           "is used and a training step's peak memory is several times higher (%s)",
                           _INSTALL["mimalloc"])
        return
    if os.environ.get(_RELAUNCHED):
        logger.warning("trainer.allocator=%s: %s was preloaded but is not in use; the system's malloc is used",
                       choice, library)
        return
    preload = " ".join(p for p in (library, os.environ.get("LD_PRELOAD", "")) if p)
    env = {**os.environ, "LD_PRELOAD": preload, _RELAUNCHED: name}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)  # does not return
