"""trainer.allocator: train.py runs again with tcmalloc preloaded where it is installed, once;
a missing library is a warning under auto and an error naming the key under tcmalloc."""

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
    from ragen.allocator import relaunch_with, tcmalloc_loaded
    print("start", flush=True)
    relaunch_with(sys.argv[1])
    print("loaded" if tcmalloc_loaded() else "system", sys.argv[1:])
""")


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _probe(tmp_path, *args: str) -> list[str]:
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": path}, check=True)
    return out.stdout.splitlines()


@pytest.mark.skipif(allocator.find_tcmalloc() is None,
                    reason="tcmalloc is not installed (apt-get install libtcmalloc-minimal4)")
def test_auto_runs_the_command_again_with_tcmalloc_once_and_keeps_its_arguments(tmp_path):
    lines = _probe(tmp_path, "auto", "x=1")
    # the first process printed "start" and was replaced; the second printed it again and went on
    assert lines == ["start", "start", "loaded ['auto', 'x=1']"]


def test_system_keeps_the_process_as_it_is(tmp_path):
    assert _probe(tmp_path, "system") == ["start", "system ['system']"]


def test_a_relaunch_that_did_not_take_is_not_tried_again(monkeypatch, caplog):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.setattr(allocator, "tcmalloc_loaded", lambda: False)
    monkeypatch.setenv(allocator._RELAUNCHED, "1")
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("relaunched twice"))
    with caplog.at_level(logging.WARNING):
        allocator.relaunch_with("auto")
    assert "not in use" in caplog.text


def test_a_missing_tcmalloc_is_a_warning_under_auto_and_an_error_naming_the_key_when_asked_for(monkeypatch, caplog):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    monkeypatch.setattr(allocator, "tcmalloc_loaded", lambda: False)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("relaunched without a library"))
    with caplog.at_level(logging.WARNING):
        allocator.relaunch_with("auto")
    assert "libtcmalloc-minimal4" in caplog.text
    with pytest.raises(ValueError, match="trainer.allocator=tcmalloc.*libtcmalloc-minimal4"):
        allocator.relaunch_with("tcmalloc")


def test_an_unknown_allocator_is_refused_by_train_py_naming_the_key():
    out = subprocess.run([sys.executable, "train.py", "trainer.allocator=jemalloc"], capture_output=True, text=True,
                         timeout=60, cwd=_ROOT)
    assert out.returncode == 2
    assert "trainer.allocator: unknown allocator 'jemalloc'" in out.stderr
