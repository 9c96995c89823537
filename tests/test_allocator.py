"""trainer.allocator: train.py runs again with tcmalloc (where installed) or mimalloc (which ragen
ships) preloaded, once; a missing library is a warning under auto and an error naming the key
when asked for by name."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from ragen import allocator

pytestmark = pytest.mark.timeout(120)

_PROBE = textwrap.dedent("""
    import sys
    from ragen.allocator import loaded, relaunch_with
    print("start", flush=True)
    relaunch_with(sys.argv[1])
    print(loaded() or "system", sys.argv[1:])
""")


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _probe(tmp_path, *args: str) -> list[str]:
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": path}, check=True)
    return out.stdout.splitlines()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mimalloc is preloaded on Linux")
def test_ragen_ships_mimalloc_and_auto_runs_the_command_again_with_an_allocator_once_keeping_its_arguments(tmp_path):
    assert allocator.find_library("mimalloc"), "cmeel-mimalloc, a dependency of ragen on Linux, is not installed"
    lines = _probe(tmp_path, "auto", "x=1")
    # the first process printed "start" and was replaced; the second printed it again and went on
    expected = "tcmalloc" if allocator.find_library("tcmalloc") else "mimalloc"
    assert lines == ["start", "start", f"{expected} ['auto', 'x=1']"]


@pytest.mark.skipif(allocator.find_library("tcmalloc") is None,
                    reason="tcmalloc is not installed (apt-get install libtcmalloc-minimal4)")
def test_tcmalloc_when_asked_for(tmp_path):
    assert _probe(tmp_path, "tcmalloc") == ["start", "start", "tcmalloc ['tcmalloc']"]


def test_system_keeps_the_process_as_it_is(tmp_path):
    assert _probe(tmp_path, "system") == ["start", "system ['system']"]


def _found(*names):
    return lambda name: f"/lib/lib{name}.so" if name in names else None


def test_auto_takes_tcmalloc_before_mimalloc_and_mimalloc_where_tcmalloc_is_missing(monkeypatch):
    monkeypatch.setattr(allocator, "loaded", lambda: None)
    monkeypatch.delenv(allocator._RELAUNCHED, raising=False)
    preloads = []

    def execve(path, argv, env):
        preloads.append(env["LD_PRELOAD"].split()[0])

    monkeypatch.setattr(os, "execve", execve)
    for found in (("mimalloc", "tcmalloc"), ("mimalloc",)):
        monkeypatch.setattr(allocator, "find_library", _found(*found))
        allocator.relaunch_with("auto")
    assert preloads == ["/lib/libtcmalloc.so", "/lib/libmimalloc.so"]


class _Library:
    """A process's symbols as ctypes finds them: those of ``names`` record their calls."""

    def __init__(self, *names):
        self.calls = []
        for name in names:
            setattr(self, name, lambda *args, name=name: self.calls.append(name))


@pytest.mark.parametrize("names, called", [
    (("mi_collect", "malloc_trim"), "mi_collect"),
    (("MallocExtension_ReleaseFreeMemory", "malloc_trim"), "MallocExtension_ReleaseFreeMemory"),
    (("malloc_trim",), "malloc_trim"),
])
def test_give_back_asks_the_allocator_in_use_to_return_freed_memory(monkeypatch, names, called):
    library = _Library(*names)
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: library)
    allocator.give_back()
    assert library.calls == [called]


def test_give_back_returns_what_mimalloc_holds(tmp_path):
    """In a process on mimalloc, memory freed and not yet purged goes back at the call."""
    script = tmp_path / "freed.py"
    script.write_text(textwrap.dedent("""
        from ragen.allocator import give_back, loaded
        assert loaded() == "mimalloc"
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096
        blocks = [bytearray(1 << 16) for _ in range(8000)]  # 512 MiB in small blocks
        del blocks
        before = rss()
        give_back()
        print(before - rss())
    """))
    library = allocator.find_library("mimalloc")
    if library is None:
        pytest.skip("mimalloc is not installed")
    path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, "PYTHONPATH": path, "LD_PRELOAD": library,
                              "MIMALLOC_PURGE_DELAY": "100000"})
    assert int(out.stdout) > 256 * 2**20, out.stdout


def test_a_running_allocator_that_auto_would_take_is_kept(monkeypatch):
    monkeypatch.setattr(allocator, "find_library", _found("mimalloc", "tcmalloc"))
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("relaunched an allocator already in use"))
    for running in ("mimalloc", "tcmalloc"):
        monkeypatch.setattr(allocator, "loaded", lambda: running)
        allocator.relaunch_with("auto")


def test_a_relaunch_that_did_not_take_is_not_tried_again(monkeypatch, caplog):
    monkeypatch.setattr(allocator, "find_library", _found("mimalloc"))
    monkeypatch.setattr(allocator, "loaded", lambda: None)
    monkeypatch.setenv(allocator._RELAUNCHED, "mimalloc")
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("relaunched twice"))
    with caplog.at_level(logging.WARNING):
        allocator.relaunch_with("auto")
    assert "not in use" in caplog.text


def test_a_missing_allocator_is_a_warning_under_auto_and_an_error_naming_the_key_when_asked_for(monkeypatch, caplog):
    monkeypatch.setattr(allocator, "find_library", _found())
    monkeypatch.setattr(allocator, "loaded", lambda: None)
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("relaunched without a library"))
    with caplog.at_level(logging.WARNING):
        allocator.relaunch_with("auto")
    assert "cmeel-mimalloc" in caplog.text
    with pytest.raises(ValueError, match="trainer.allocator=tcmalloc.*libtcmalloc-minimal4"):
        allocator.relaunch_with("tcmalloc")
    with pytest.raises(ValueError, match="trainer.allocator=mimalloc.*cmeel-mimalloc"):
        allocator.relaunch_with("mimalloc")


def test_an_unknown_allocator_is_refused_by_train_py_naming_the_key():
    out = subprocess.run([sys.executable, "train.py", "trainer.allocator=jemalloc"], capture_output=True, text=True,
                         timeout=60, cwd=_ROOT)
    assert out.returncode == 2
    assert "trainer.allocator: unknown 'jemalloc'" in out.stderr  # the config's check, before any relaunch
