"""train.py end to end: the Hydra command line on the tiny model (hf engine), in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ragen.trainer.tracking import read_metrics
from tests.rollout_helpers import ROOT


def _run(args: list[str], tmp_path, config_name: str = "base", timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), "--config-name", config_name,
                           f"hydra.run.dir={tmp_path / 'hydra'}", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def _small(model_path: str, run_dir) -> list[str]:
    return [
        f"model_path={model_path}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=1",
        "trainer.save_freq=1",
        "es_manager.train.env_groups=2",
        "es_manager.train.group_size=4",
        "es_manager.train.env_configs.n_groups=[2]",
        "es_manager.val.env_groups=2",
        "es_manager.val.env_configs.tags=[BanditHintedTest]",
        "es_manager.val.env_configs.n_groups=[2]",
        "agent_proxy.max_turn=1",
        "agent_proxy.enable_think=false",
        "custom_envs.BanditHinted.max_tokens=8",
        "custom_envs.BanditHintedTest.max_tokens=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "algorithm.adv_estimator=reinforce",
        "actor_rollout_ref.model.lora_rank=0",
    ]


@pytest.mark.parametrize("config_name", ["base", "base-parallel"])
def test_train_py_two_steps(tiny_model_path, tmp_path, config_name):
    run_dir = tmp_path / "run"
    extra = ["agent_proxy.parallel_n_jobs=2"] if config_name == "base-parallel" else []
    proc = _run([*_small(tiny_model_path, run_dir), *extra], tmp_path, config_name)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]  # baseline, then the two steps
    assert rows[0]["policy_version"] == 0 and rows[2]["policy_version"] == 2
    for key in ("train/reward", "val/success", "actor/pg_loss", "timing/step_s"):
        assert key in rows[2], key
    assert (run_dir / "checkpoints" / "global_step_2" / "state.pt").is_file()
    assert (run_dir / "learning_curve.png").stat().st_size > 0
    assert "step 2/2" in proc.stdout  # the one-line summary
    assert "learning_curve.png" in proc.stdout

    # a second call with trainer.resume=true continues from the step-2 checkpoint: one more step, logged once
    again = _run([*_small(tiny_model_path, run_dir), *extra, "trainer.resume=true",
                  "trainer.total_training_steps=3"], tmp_path, config_name)
    assert again.returncode == 0, again.stderr[-5000:]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2, 3]


def test_without_matplotlib_train_py_names_only_what_it_wrote(tiny_model_path, tmp_path):
    """No matplotlib (docs/vllm_cpu.md's venv lacked it): one warning that says what to install, no
    traceback, and no `learning curve:` line for a file that is not there."""
    fake = tmp_path / "no_matplotlib"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(fake), str(ROOT)])}
    args = [*_small(tiny_model_path, run_dir), "trainer.total_training_steps=1", "trainer.test_freq=0",
            "trainer.val_before_train=false"]
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'hydra'}", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert not (run_dir / "learning_curve.png").exists()
    assert "learning curve:" not in proc.stdout
    assert f"run folder: {run_dir}" in proc.stdout and "metrics.jsonl" in proc.stdout
    assert "no learning curve drawn: No module named 'matplotlib'" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_train_py_bad_config_names_the_key(tiny_model_path, tmp_path):
    proc = _run([*_small(tiny_model_path, tmp_path / "run"), "algorithm.adv_estimator=nope"], tmp_path)
    assert proc.returncode == 2
    assert "algorithm.adv_estimator" in proc.stderr
    assert "Traceback" not in proc.stderr


RAISES_ON_IMPORT = "raise RuntimeError('broken at import')\n"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("args,needle", [
    (["custom_envs.BanditHinted.env_type=h29_no_such_pkg.mod:Env"],
     "error: custom_envs.BanditHinted.env_type: cannot import 'h29_no_such_pkg.mod:Env': ModuleNotFoundError"),
    (["custom_envs.BanditHinted.env_type=h29_raises_on_import:Env"],
     "error: custom_envs.BanditHinted.env_type: cannot import 'h29_raises_on_import:Env': RuntimeError: "
     "broken at import"),
    (["seed.train=x"], "error: seed.train must be an integer, got 'x'"),
    (["agent_proxy.env_timeout_s=0"], "error: agent_proxy.env_timeout_s must be > 0 seconds, got 0; for no limit "
                                      "write null"),
    (["agent_proxy.rollout_timeout_s=0"], "error: agent_proxy.rollout_timeout_s must be > 0 seconds"),
    (["engine=hf", "engine.replicas=0"], "error: engine.replicas must be an integer >= 1, got 0"),
])
def test_train_py_bad_input_is_one_error_line_before_any_model_loads(tmp_path, args, needle):
    """model_path names no model: each error must come before one would load."""
    (tmp_path / "h29_raises_on_import.py").write_text(RAISES_ON_IMPORT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'hydra'}",
                           "model_path=/nonexistent/model", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(needle), proc.stderr[-3000:]



@pytest.mark.timeout(300)
def test_a_cluster_without_its_package_is_one_error_line_before_any_model_loads(tmp_path):
    """+cluster=dask where dask.distributed does not import (a module of that name on the path that
    raises ImportError, as a missing install does): one line naming the package and the extra, exit 2."""
    (tmp_path / "distributed.py").write_text("raise ImportError('h29: not installed')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'hydra'}",
                           "model_path=/nonexistent/model", "+cluster=dask"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines == ["error: agent_proxy.parallel_backend=dask needs dask.distributed, which is not installed: "
                     "pip install 'dask[distributed]' (or pip install -e '.[dask]')"], proc.stderr[-3000:]


def test_a_run_whose_envs_all_fail_stops_and_exits_1_naming_why(tiny_model_path, tmp_path):
    """Issue 59, item 11: every env raising at reset, train.py ran all its steps, skipped every update,
    saved a checkpoint and exited 0."""
    run_dir = tmp_path / "run"
    proc = _run([*_small(tiny_model_path, run_dir), "trainer.total_training_steps=6", "trainer.test_freq=0",
                 "trainer.val_before_train=false", "trainer.max_failed_steps=2",
                 "+custom_envs.Broken={env_type: 'tests.fault_envs:WrongTypesEnv', env_instruction: x, "
                 "max_actions_per_traj: 2, max_tokens: 8}",
                 "es_manager.train.env_configs.tags=[Broken]"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: training failed: 2 steps in a row failed (trainer.max_failed_steps=2); step 2: 8 of 8 envs of " \
           "the train rollout ended in error or timeout; the first: tag Broken" in proc.stderr
    assert "Traceback" not in proc.stderr and f"run folder: {run_dir}" in proc.stderr
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]


@pytest.mark.timeout(180)
def test_off_a_terminal_train_py_writes_whole_lines(tiny_model_path, tmp_path, capsys):
    """Output to a file or a pipe: no progress bar, whose `\\r` redraws would be glued to the log
    lines (train.py's own bar, the transformers bar of loading the weights); the step lines say how
    far the run has got. In process: train.run with pytest's captured (not a terminal) streams."""
    import importlib.util

    from tests.test_trainer import compose_cfg

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    cfg = compose_cfg([*_small(tiny_model_path, tmp_path / "run"), "trainer.total_training_steps=1",
                       "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[console,jsonl]"])
    train.run(cfg)
    out, err = capsys.readouterr()
    assert "step 1/1 | reward" in out and f"run folder: {tmp_path / 'run'}" in out
    assert "\r" not in out + err, err[-2000:]
