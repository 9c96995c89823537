"""The README's and the guides' commands, run one after another as written, as a new user would.

The commands are read from the ```bash blocks of README.md and docs/*.md
(tests/doc_commands.py), so a change to the docs is a change to this test.
They run in order in a fresh folder holding what a clone holds for them
(train.py and config/), on the tiny model: to each ``train.py`` command only
overrides that make the run small are added, never a key the command sets
itself. Whatever one run leaves behind (its run folder, checkpoints, dumps) the
next command meets, as it would on a user's disk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ragen.trainer.tracking import read_metrics
from tests.doc_commands import ROOT, DocCommand, doc_commands


def small_run(model_path: str, steps: int) -> dict[str, str]:
    """key -> value of the overrides that make a train.py run small."""
    return {
        "model_path": model_path,
        "trainer.total_training_steps": str(steps),
        "trainer.logger": "[jsonl]",
        "es_manager.train.env_groups": "2",
        "es_manager.train.group_size": "2",
        "es_manager.train.env_configs.n_groups": "[2]",
        "es_manager.val.env_groups": "2",
        "es_manager.val.env_configs.tags": "[BanditHintedTest]",
        "es_manager.val.env_configs.n_groups": "[2]",
        "actor_rollout_ref.actor.ppo_mini_batch_size": "4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "2",
    }


# keys that must agree: a command that sets one of a set keeps the config's others of it
LINKED = (
    ("es_manager.train.env_groups", "es_manager.train.env_configs.tags", "es_manager.train.env_configs.n_groups"),
    ("es_manager.val.env_groups", "es_manager.val.env_configs.tags", "es_manager.val.env_configs.n_groups"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
)


def run_steps(commands: list[DocCommand]) -> dict[int, int]:
    """index of each train.py command -> its run's steps: two (an update, then a step on the updated
    weights), or the highest step that the commands after it, up to the next run, name (step_000004.jsonl:
    they read its run folder through ``latest``)."""
    steps: dict[int, int] = {}
    for i, command in enumerate(commands):
        if command.is_train:
            run, steps[i] = i, 2
        elif steps:
            steps[run] = max([steps[run], *(int(n) for n in re.findall(r"step_(\d+)", command.text))])
    return steps


def argv_for(command: DocCommand, small: dict[str, str]) -> list[str]:
    """A train.py command's words, with the overrides of ``small`` that it does not set itself."""
    own = {word.split("=", 1)[0].lstrip("+~") for word in command.argv if "=" in word}
    kept = own.union(*(keys for keys in LINKED if own & set(keys)))
    return [*command.argv, *(f"{k}={v}" for k, v in small.items() if k not in kept)]


def run_folder(log: str) -> Path:
    found = re.findall(r"^run folder: (.+)$", Path(log).read_text(), re.M)
    assert found, f"no run folder printed in {log}"
    return Path(found[-1])


def outcome_metrics(run: Path) -> list[dict]:
    """A run's metrics without what the machine measures (its timings and memory)."""
    return [{k: v for k, v in row.items() if "timing/" not in k and "memory/" not in k}
            for row in read_metrics(run / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_documented_commands_run_in_order_on_a_fresh_clone(tiny_model_path, tmp_path):
    commands = [c for c in doc_commands() if c.skip is None]
    trains = [c for c in commands if c.is_train]
    # the scenario the docs lead a user through must be there, or this test checks nothing
    assert [c.argv for c in trains[:2]] == [("python", "train.py")] * 2, "the README runs `python train.py` twice"
    assert any("--config-name" in c.argv and "base-parallel" in c.argv for c in trains)
    assert any(any(w.startswith("trainer.rollout_data_dir=") for w in c.argv) for c in trains)
    assert any(c.argv[:3] == ("python", "-m", "ragen.tools.viewer") for c in commands)
    assert any(c.argv[:3] == ("python", "-m", "ragen.tools.replay") for c in commands)

    clone = tmp_path / "clone"
    clone.mkdir()
    shutil.copy(ROOT / "train.py", clone)
    shutil.copytree(ROOT / "config", clone / "config")
    steps = run_steps(commands)
    plan = {"cwd": str(clone), "results": str(tmp_path / "results.json"),
            "steps": [{"argv": argv_for(c, small_run(tiny_model_path, steps[i])) if c.is_train else list(c.argv),
                       "env": dict(c.env)} for i, c in enumerate(commands)]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "doc_commands.py"), str(tmp_path / "plan.json")],
                          env=env, capture_output=True, text=True, timeout=840)
    results = json.loads((tmp_path / "results.json").read_text()) if (tmp_path / "results.json").is_file() else []
    for command, result in zip(commands, results):
        log = Path(result["log"]).read_text()
        assert result["rc"] == 0, (f"{command.source}: `{command.text}` exited with {result['rc']}, after "
                                   f"{[c.source for c in commands[:commands.index(command)]]}:\n{log[-4000:]}")
    assert len(results) == len(commands), proc.stderr[-4000:]

    # "Two runs of the same command give the same metrics": the README's two `python train.py`
    first, second = [run_folder(r["log"]) for c, r in zip(commands, results) if c.argv == ("python", "train.py")][:2]
    assert first != second
    assert outcome_metrics(first) == outcome_metrics(second)
