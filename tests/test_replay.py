"""Replay (ragen.replay): a dumped episode played again in this process gives
the same prompts, observations, rewards and done flags; a difference is
reported where it is."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm_agent.dump import read_dump, write_dump
from ragen.llm_agent.inference import DirectClient, SharedLLMInferenceManager
from ragen.llm_agent.parallel_rollout import ParallelRolloutManager
from ragen.llm_agent.rollout_loop import KeptEnvs, run_envs
from ragen.llm_agent.types import RolloutResult
from ragen.replay import main, replay

from tests.fault_envs import FaultEnv
from tests.rollout_helpers import ROOT, custom_envs, fault_tag, loop_config, specs_for

ENGINE = {"malformed_rate": 0.15, "seed": 3}
LAYOUT = (["SimpleSokoban", "FrozenLake", "Bandit", "Countdown", "Broken"], [2, 2, 1, 1, 1], 2)


def _specs():
    seed = specs_for(*LAYOUT, custom_envs(Broken=fault_tag()))[-1].seed
    return specs_for(*LAYOUT, custom_envs(Broken=fault_tag("raise_step", fault_seed=seed)))


@pytest.fixture(scope="module")
def parallel_dump(tmp_path_factory):
    """A dump of a parallel (loky) rollout with malformed answers and a failing env."""
    specs, config = _specs(), loop_config(max_turn=5, depth=2)
    with SharedLLMInferenceManager(ScriptedEngine(**ENGINE), coalesce_wait_s=0.005) as shared, \
            ParallelRolloutManager(shared, n_jobs=2, backend="loky") as prm:
        result = prm.rollout(specs, config)
    return write_dump(tmp_path_factory.mktemp("dump"), "step_000001", result, config, split="train", step=1)


@pytest.mark.timeout(300)
def test_every_env_of_a_parallel_rollout_replays_identically(parallel_dump, capsys):
    assert main([str(parallel_dump)]) == 0
    out = capsys.readouterr().out
    n = len(read_dump(parallel_dump))
    assert out.count(": identical") == n and f"{n} of {n} envs identical" in out
    assert "(Broken," in out  # the env that failed in the rollout fails the same way again


def _tampered(path, tmp_path, env_id, edit) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    edit(next(r for r in rows if r["env_id"] == env_id))
    out = tmp_path / "tampered.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(out)


def _a_turn_with_steps(path, tag: str) -> tuple[int, int]:
    """(env_id, turn) of a later turn of ``tag`` that stepped the env."""
    for r in read_dump(path):
        if r.trajectory.tag == tag:
            for i, t in enumerate(r.trajectory.turns):
                if i > 0 and t.steps:
                    return r.env_id, i
    raise AssertionError(f"no {tag} turn with steps in the dump")


def test_a_changed_reward_is_reported_at_its_turn_and_step(parallel_dump, tmp_path, capsys):
    env_id, turn = _a_turn_with_steps(parallel_dump, "SimpleSokoban")

    def edit(row):
        row["turns"][turn]["steps"][0]["reward"] += 1.0

    path = _tampered(parallel_dump, tmp_path, env_id, edit)
    assert main([path, "--env-id", str(env_id)]) == 1
    out = capsys.readouterr().out
    assert f"env {env_id} " in out and f"differs at turn {turn}, step 0 " in out and ": reward: dump " in out
    # the other envs are untouched
    others = [r.env_id for r in read_dump(path) if r.env_id != env_id][:3]
    assert main([path] + [a for i in others for a in ("--env-id", str(i))]) == 0


def test_a_changed_observation_and_prompt_are_reported(parallel_dump, tmp_path, capsys):
    env_id, turn = _a_turn_with_steps(parallel_dump, "FrozenLake")

    def edit_obs(row):
        row["turns"][turn]["steps"][-1]["observation"] += "!"

    assert main([_tampered(parallel_dump, tmp_path, env_id, edit_obs), "--env-id", str(env_id)]) == 1
    assert f"differs at turn {turn}, step " in capsys.readouterr().out

    def edit_prompt(row):
        row["turns"][0]["prompt"]["messages"][0]["content"] = "another system message"

    assert main([_tampered(parallel_dump, tmp_path, env_id, edit_prompt), "--env-id", str(env_id)]) == 1
    assert "differs at turn 0: prompt: message 0 (system)" in capsys.readouterr().out


def test_the_engine_regenerates_the_same_answers(parallel_dump, capsys):
    args = [str(parallel_dump), "--engine", "scripted"] + [f"--engine-opt={k}={v}" for k, v in ENGINE.items()]
    assert main(args) == 0
    assert "envs identical" in capsys.readouterr().out
    # another policy answers otherwise, and the replay says where
    assert main([str(parallel_dump), "--engine", "scripted", "--engine-opt", "seed=99", "--env-id", "0"]) == 1
    assert "differs at turn 0: response" in capsys.readouterr().out


def test_env_calls_run_in_the_calling_thread_and_raise_on_request(monkeypatch, tmp_path):
    specs = specs_for(["Broken"], [1], 1, custom_envs(Broken=fault_tag()))
    seed = specs[0].seed
    specs = specs_for(["Broken"], [1], 1, custom_envs(Broken=fault_tag("raise_step", fault_seed=seed)))
    config = loop_config(max_turn=3)
    trajectories, _ = run_envs(specs, DirectClient(ScriptedEngine()), config, kept_envs=KeptEnvs())
    path = write_dump(tmp_path, "d", RolloutResult(trajectories, specs), config, split="train", step=0)
    (record,) = read_dump(path)
    threads = []
    step = FaultEnv.step

    def recording_step(self, action):
        threads.append(threading.current_thread())
        return step(self, action)

    monkeypatch.setattr(FaultEnv, "step", recording_step)
    assert replay(record).identical  # the error is the dump's error
    assert threads and all(t is threading.main_thread() for t in threads)  # so pdb works in the env
    with pytest.raises(RuntimeError, match="injected step failure"):
        replay(record, raise_errors=True)


@pytest.mark.timeout(300)
def test_greedy_hf_decoding_replays_the_dump(tiny_model_path, tmp_path):
    from ragen.llm.hf import HFEngine
    from ragen.llm.types import SamplingParams

    specs = specs_for(["SimpleSokoban", "Bandit"], [1, 1], 2, custom_envs())
    config = loop_config(max_turn=2)
    config = type(config)(**{**config.__dict__, "sampling": SamplingParams(temperature=0.0, max_tokens=12)})
    engine = HFEngine.from_config({}, tiny_model_path)
    trajectories, _ = run_envs(specs, DirectClient(engine), config, kept_envs=KeptEnvs())
    path = write_dump(tmp_path, "d", RolloutResult(trajectories, specs), config, split="val", step=0)
    fresh = HFEngine.from_config({}, tiny_model_path)
    assert all(replay(record, fresh).identical for record in read_dump(path))


@pytest.mark.parametrize("case", ["missing", "truncated", "foreign", "env_id"])
def test_bad_input_is_one_error_line_never_a_traceback(parallel_dump, tmp_path, case):
    path, args = str(parallel_dump), []
    if case == "missing":
        path = str(tmp_path / "nothing.jsonl")
    elif case == "truncated":
        text = parallel_dump.read_text()
        (tmp_path / "cut.jsonl").write_text(text[: len(text) - 100])
        path = str(tmp_path / "cut.jsonl")
    elif case == "foreign":
        (tmp_path / "other.jsonl").write_text('{"messages": []}\n')
        path = str(tmp_path / "other.jsonl")
    else:
        args = ["--env-id", "999"]
    proc = subprocess.run([sys.executable, "-m", "ragen.replay", path, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: ") and path in proc.stderr
    expected = {"missing": "no such file", "truncated": "truncated", "foreign": "line 1: not a ragen rollout dump",
                "env_id": "[999] not in the dump; its env ids: 0-13"}[case]
    assert expected in proc.stderr
