"""benchmarks/hardening.py, the review's reproductions of issue 42: its cheap rows
run and report the defects refused, its JSON, its bad --cases, and its watch
of a child that hangs or eats memory."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.rollout_helpers import ROOT

SCRIPT = ROOT / "benchmarks" / "hardening.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.timeout(120)
def test_oversized_envs_and_rollouts_are_reported_refused(tmp_path):
    out = tmp_path / "rows.json"
    proc = run("--cases", "9,11", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["id"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["11a", "11b", "9a", "9b", "9c"]
    assert all(r["fixed"] is True and not r["killed"] for r in rows.values()), rows
    for row in ("9a", "9b"):
        assert rows[row]["happened"].startswith("refused at config read:")
        assert "custom_envs.SimpleSokoban.env_config.dim_x" in rows[row]["happened"]
    assert rows["9c"]["happened"].startswith("replay exited 2")
    assert "es_manager.train.group_size must be <= " in rows["11a"]["happened"]
    assert "es_manager.train.env_groups must be <= " in rows["11b"]["happened"]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| 9") or line.startswith("| 11")]
    assert len(table) == 5, table
    assert all(line.endswith("| fixed |") and ("refused" in line or "exited 2" in line) for line in table), table


def test_an_unknown_case_is_refused():
    proc = run("--cases", "9,12")
    assert proc.returncode == 2 and "--cases: unknown 12" in proc.stderr


@pytest.mark.timeout(60)
def test_a_child_that_hangs_or_eats_memory_is_killed_and_said_so(monkeypatch):
    spec = importlib.util.spec_from_file_location("hardening", SCRIPT)
    hardening = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "hardening", hardening)  # its dataclasses look their module up
    spec.loader.exec_module(hardening)
    hung = hardening.watched([sys.executable, "-c", "import time; time.sleep(60)"], 1.0, 1000,
                             stdout=subprocess.DEVNULL)
    assert hung.killed.startswith("hung (killed after 1 s") and hung.seconds < 10
    hog = hardening.watched([sys.executable, "-c", "import time; b = bytearray(400 << 20); time.sleep(60)"], 30.0,
                            200, stdout=subprocess.DEVNULL)
    assert hog.killed.startswith("past 200 MB (killed") and hog.peak_mb > 200 and hog.seconds < 20
    done = hardening.watched([sys.executable, "-c", "pass"], 30.0, 1000)
    assert done.rc == 0 and not done.killed
