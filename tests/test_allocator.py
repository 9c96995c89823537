"""trainer.allocator: train.py runs again with mimalloc (which ragen ships) preloaded, once, or
tcmalloc where asked for; a missing library is a warning under auto and an error naming the key
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
def test_ragen_ships_mimalloc_and_auto_runs_the_command_again_with_it_once_keeping_its_arguments(tmp_path):
    assert allocator.find_library("mimalloc"), "cmeel-mimalloc, a dependency of ragen on Linux, is not installed"
    lines = _probe(tmp_path, "auto", "x=1")
    # the first process printed "start" and was replaced; the second printed it again and went on
    assert lines == ["start", "start", "mimalloc ['auto', 'x=1']"]


@pytest.mark.skipif(allocator.find_library("tcmalloc") is None,
                    reason="tcmalloc is not installed (apt-get install libtcmalloc-minimal4)")
def test_tcmalloc_when_asked_for(tmp_path):
    assert _probe(tmp_path, "tcmalloc") == ["start", "start", "tcmalloc ['tcmalloc']"]


def test_system_keeps_the_process_as_it_is(tmp_path):
    assert _probe(tmp_path, "system") == ["start", "system ['system']"]


def _found(*names):
    return lambda name: f"/lib/lib{name}.so" if name in names else None


def test_auto_takes_mimalloc_before_tcmalloc_and_tcmalloc_where_mimalloc_is_missing(monkeypatch):
    monkeypatch.setattr(allocator, "loaded", lambda: None)
    monkeypatch.delenv(allocator._RELAUNCHED, raising=False)
    preloads = []

    def execve(path, argv, env):
        preloads.append(env["LD_PRELOAD"].split()[0])

    monkeypatch.setattr(os, "execve", execve)
    for found in (("mimalloc", "tcmalloc"), ("tcmalloc",)):
        monkeypatch.setattr(allocator, "find_library", _found(*found))
        allocator.relaunch_with("auto")
    assert preloads == ["/lib/libmimalloc.so", "/lib/libtcmalloc.so"]


def test_mimalloc_gives_freed_memory_back_at_once_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.setattr(allocator, "loaded", lambda: None)
    monkeypatch.setattr(allocator, "find_library", _found("mimalloc"))
    monkeypatch.delenv(allocator._RELAUNCHED, raising=False)
    monkeypatch.delenv("MIMALLOC_PURGE_DELAY", raising=False)
    delays = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: delays.append(env.get("MIMALLOC_PURGE_DELAY")))
    allocator.relaunch_with("auto")
    monkeypatch.setenv("MIMALLOC_PURGE_DELAY", "10")
    allocator.relaunch_with("mimalloc")
    assert delays == ["0", "10"]


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
