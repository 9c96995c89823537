"""Replay (ragen.tools.replay): a dumped episode played again in this process gives
the same prompts, observations, rewards and done flags; a difference is
reported where it is."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import tracemalloc

import pytest
import yaml

from ragen.llm.scripted import ScriptedEngine
from ragen.rollout.dump import read_dump, write_dump
from ragen.serving import DirectClient, SharedLLMInferenceManager
from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings
from ragen.rollout.scheduler import KeptEnvs, run_envs
from ragen.rollout.types import RolloutResult
from ragen.env.allowed import EnvTypeNotAllowed, allowed_env_types
from ragen.tools.replay import first_difference, main, replay

from tests.dump_cases import BAD_DUMPS, write_bad_dump
from tests.fault_envs import FaultEnv
from tests.rollout_helpers import ROOT, custom_envs, fault_tag, loop_config, specs_for

ENGINE = {"malformed_rate": 0.15, "seed": 3}
LAYOUT = (["SimpleSokoban", "FrozenLake", "Bandit", "Countdown", "Broken"], [2, 2, 1, 1, 1], 2)


# the dump's FaultEnv is test code: replay builds it only when allowed
FAULT_TYPES = ("tests.fault_envs:FaultEnv", "tests.fault_envs:FaultEnvConfig")
ALLOW_FAULT = [a for t in FAULT_TYPES for a in ("--allow-env-type", t)]


def _specs():
    seed = specs_for(*LAYOUT, custom_envs(Broken=fault_tag()))[-1].seed
    return specs_for(*LAYOUT, custom_envs(Broken=fault_tag("raise_step", fault_seed=seed)))


@pytest.fixture(scope="module")
def parallel_dump(tmp_path_factory):
    """A dump of a parallel (loky) rollout with malformed answers and a failing env."""
    specs, config = _specs(), loop_config(max_turn=5)
    with SharedLLMInferenceManager(ScriptedEngine(**ENGINE), coalesce_wait_s=0.005) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend="loky")) as prm:
        result = prm.rollout(specs, config)
    return write_dump(tmp_path_factory.mktemp("dump"), "step_000001", result, config, split="train", step=1)


@pytest.fixture(scope="module")
def fault_config(tmp_path_factory):
    """A config of the user's whose custom_envs names the dump's FaultEnv tag."""
    path = tmp_path_factory.mktemp("config") / "envs.yaml"
    path.write_text(yaml.safe_dump({"custom_envs": {"Broken": fault_tag()}}))
    return path


@pytest.mark.timeout(300)
def test_every_env_of_a_parallel_rollout_replays_identically(parallel_dump, fault_config, capsys):
    assert main([str(parallel_dump), "--config", str(fault_config)]) == 0
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


@pytest.mark.timeout(120)
def test_an_env_config_past_its_bounds_is_refused_before_any_env_is_built(parallel_dump, tmp_path, capsys):
    record = next(r for r in read_dump(parallel_dump) if r.spec.tag == "SimpleSokoban")

    def edit(row):
        row["spec"]["env_config"].update(dim_x=2**40, dim_y=2**40)

    path = _tampered(parallel_dump, tmp_path, record.env_id, edit)
    message = (f"line {record.line}: custom_envs.SimpleSokoban.env_config.dim_x: the room is at most 64x64 "
               f"(walls included), got 1099511627776x1099511627776")
    for chosen in (["--env-id", str(record.env_id)], []):  # the env alone, or the whole dump
        assert main([path, *chosen, *ALLOW_FAULT]) == 2
        captured = capsys.readouterr()
        assert captured.err == f"error: {path} {message}\n" and not captured.out
    with pytest.raises(ValueError, match=re.escape(message)):  # the API too
        replay(read_dump(path)[record.line - 1])


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
    args = [str(parallel_dump), "--engine", "scripted", *ALLOW_FAULT] + \
        [f"--engine-opt={k}={v}" for k, v in ENGINE.items()]
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
    allowed = allowed_env_types(allow=FAULT_TYPES)
    assert replay(record, env_types=allowed).identical  # the error is the dump's error
    assert threads and all(t is threading.main_thread() for t in threads)  # so pdb works in the env
    with pytest.raises(RuntimeError, match="injected step failure"):
        replay(record, raise_errors=True, env_types=allowed)

def test_the_engine_gives_the_dumped_prompt_ids_and_a_changed_one_is_reported(tmp_path, capsys):
    specs, config = specs_for(["SimpleSokoban", "FrozenLake"], [1, 1], 2, custom_envs()), loop_config(max_turn=4)
    trajectories, _ = run_envs(specs, DirectClient(ScriptedEngine(**ENGINE)), config, kept_envs=KeptEnvs())
    path = write_dump(tmp_path, "d", RolloutResult(trajectories, specs), config, split="train", step=0)
    assert all(t.has_prompt_ids for r in read_dump(path) for t in r.trajectory.turns)
    scripted = ["--engine", "scripted"] + [f"--engine-opt={k}={v}" for k, v in ENGINE.items()]
    assert main([str(path), *scripted]) == 0
    assert main([str(path)]) == 0  # the recorded answers: no prompt ids to compare
    env_id, turn = _a_turn_with_steps(path, "SimpleSokoban")

    def edit(row):
        row["turns"][turn]["prompt_ids"][-1] += 1

    capsys.readouterr()
    assert main([_tampered(path, tmp_path, env_id, edit), "--env-id", str(env_id), *scripted]) == 1
    assert f"differs at turn {turn}: prompt ids: the dump has " in capsys.readouterr().out


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
    proc = subprocess.run([sys.executable, "-m", "ragen.tools.replay", path, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: ") and path in proc.stderr
    expected = {"missing": "no such file", "truncated": "truncated", "foreign": "line 1: not a ragen rollout dump",
                "env_id": "[999] not in the dump; its env ids: 0-13"}[case]
    assert expected in proc.stderr


# ----------------------------------------------------------------------------- a dump is data: env types


def _crafted(parallel_dump, tmp_path, env_type: str, env_config: dict, config_type=None) -> str:
    """The dump with its first line's env type replaced (what a hostile dump would say)."""
    def edit(row):
        row["spec"].update(env_type=env_type, env_config=env_config, config_type=config_type)

    return _tampered(parallel_dump, tmp_path, read_dump(parallel_dump)[0].env_id, edit)


def _python(code: str, *args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


ZEN = "Beautiful is better than ugly"
_API = """
import json, os, sys
from ragen.rollout.dump import read_dump
from ragen.tools.replay import replay
from ragen.env.allowed import EnvTypeNotAllowed
try:
    replay(read_dump(sys.argv[1])[0])
    refused = None
except EnvTypeNotAllowed as exc:
    refused = str(exc)
print(json.dumps({"refused": refused, "this": "this" in sys.modules, "touched": os.path.exists(sys.argv[2])}))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["cli", "api"])
def test_a_crafted_dump_runs_nothing_and_imports_nothing(parallel_dump, tmp_path, how):
    touched = tmp_path / "touched_by_popen"
    popen = _crafted(parallel_dump, tmp_path, "subprocess:Popen", {"touch": 1, str(touched): 2})
    (tmp_path / "zen").mkdir()
    zen = _crafted(parallel_dump, tmp_path / "zen", "this:X", {})
    for path, name in ((popen, "subprocess:Popen"), (zen, "this:X")):
        if how == "cli":
            proc = _python("", "-m", "ragen.tools.replay", path, cwd=tmp_path)
            assert proc.returncode == 2, proc.stdout + proc.stderr
            assert proc.stderr.startswith(f"error: {path} line 1: env type '{name}'"), proc.stderr
            assert f"--allow-env-type {name}" in proc.stderr and "--config" in proc.stderr
            assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
            assert ZEN not in proc.stdout  # `this` prints the Zen of Python when imported
        else:
            proc = _python(_API, path, str(touched), cwd=tmp_path)
            assert proc.returncode == 0, proc.stderr
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            assert result["refused"] and f"env type '{name}'" in result["refused"]
            assert not result["this"] and not result["touched"]
        assert not touched.exists()


def test_allowed_env_types_come_from_the_registry_the_config_and_the_flag(tmp_path):
    from ragen.env.allowed import AllowedEnvTypes

    assert AllowedEnvTypes().allows("sokoban") and not AllowedEnvTypes().allows("this:X")
    with pytest.raises(EnvTypeNotAllowed, match=r"config type 'subprocess:Popen'.*--allow-env-type subprocess:Popen"):
        AllowedEnvTypes().check("sokoban", "subprocess:Popen", "SimpleSokoban")  # a config class is code too
    config = tmp_path / "envs.yaml"
    config.write_text(yaml.safe_dump({"custom_envs": {"Mine": {"env_type": "tests.custom_env_example:MyEnv",
                                                               "config_type": "tests.custom_env_example:MyEnvConfig"},
                                                      "Sok": {"env_type": "sokoban"}}}))
    allowed = allowed_env_types([config], ["pkg.mod:Other"])
    assert allowed.paths == {"tests.custom_env_example:MyEnv", "tests.custom_env_example:MyEnvConfig",
                             "pkg.mod:Other"}
    assert allowed.allows("tests.custom_env_example:MyEnv", "tests.custom_env_example:MyEnvConfig")
    assert not allowed.allows(" tests.custom_env_example:MyEnv")  # exactly as the setup writes it
    # a Hydra config with a defaults list is composed from its folder: ragen's own base config names no import path
    assert allowed_env_types([ROOT / "config" / "base.yaml"]).paths == frozenset()
    hydra_dir = tmp_path / "conf"
    hydra_dir.mkdir()
    (hydra_dir / "main.yaml").write_text("defaults:\n  - envs\n  - _self_\nseed: 1\n")
    (hydra_dir / "envs.yaml").write_text(config.read_text())
    assert allowed_env_types([hydra_dir / "main.yaml"]).paths == allowed.paths - {"pkg.mod:Other"}


@pytest.mark.parametrize("args, message", [
    (["--allow-env-type", "sokoban"], "--allow-env-type 'sokoban': expected an import path"),
    (["--config", "/nonexistent/envs.yaml"], "/nonexistent/envs.yaml: no such config file"),
    (["--config", "{tmp}/bad.yaml"], "bad.yaml: not a readable YAML config"),
    (["--config", "{tmp}/main.yaml"], "main.yaml: cannot compose this Hydra config (MissingConfigException"),
    (["--config", str(ROOT / "config" / "engine" / "hf.yaml")], "hf.yaml: no custom_envs mapping in it"),
])
def test_a_bad_allow_option_is_one_error_line(parallel_dump, tmp_path, args, message):
    (tmp_path / "bad.yaml").write_text("custom_envs: [a\n  b: c\n")
    (tmp_path / "main.yaml").write_text("defaults:\n  - no_such_file\n")
    args = [a.format(tmp=tmp_path) for a in args]
    proc = _python("", "-m", "ragen.tools.replay", str(parallel_dump), *args, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.timeout(300)
def test_a_custom_env_named_by_the_users_config_replays(tmp_path):
    mine = {"env_type": "tests.custom_env_example:MyEnv", "config_type": "tests.custom_env_example:MyEnvConfig",
            "max_actions_per_traj": 4, "env_instruction": "Count up.", "env_config": {"limit": 3}}
    specs = specs_for(["Mine", "Bandit"], [2, 1], 1, custom_envs(Mine=mine))
    config = loop_config(max_turn=3)
    trajectories, _ = run_envs(specs, DirectClient(ScriptedEngine(seed=1)), config, kept_envs=KeptEnvs())
    path = write_dump(tmp_path, "d", RolloutResult(trajectories, specs), config, split="train", step=0)
    envs_yaml = tmp_path / "my_envs.yaml"
    envs_yaml.write_text(yaml.safe_dump({"custom_envs": {"Mine": mine}}))
    proc = _python("", "-m", "ragen.tools.replay", str(path), "--config", str(envs_yaml), cwd=tmp_path)
    assert proc.returncode == 0 and "3 of 3 envs identical" in proc.stdout, proc.stdout + proc.stderr
    without = _python("", "-m", "ragen.tools.replay", str(path), cwd=tmp_path)
    assert without.returncode == 2 and "tests.custom_env_example:MyEnv" in without.stderr


@pytest.mark.parametrize("case", sorted(BAD_DUMPS))
def test_a_wrong_typed_or_repeated_field_is_one_error_line(parallel_dump, tmp_path, case):
    bad, message = write_bad_dump(parallel_dump, case, tmp_path / "bad.jsonl")
    proc = _python("", "-m", "ragen.tools.replay", str(bad), *ALLOW_FAULT, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"error: {bad} {message}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
def test_a_huge_max_turn_in_a_dump_does_not_keep_the_replay_going(parallel_dump, tmp_path, capsys):
    record = next(r for r in read_dump(parallel_dump) if r.trajectory.stop_reason.value == "max_turns")

    def edit(row):
        row["loop"]["max_turn"] = 10 ** 9

    path = _tampered(parallel_dump, tmp_path, record.env_id, edit)
    # the replay plays one turn past the dump's last, where it differs, and stops
    assert main([path, "--env-id", str(record.env_id)]) == 1
    n = len(record.trajectory.turns)
    assert f"differs at turn {n}: the replay went on past the dump's last turn" in capsys.readouterr().out


# an env that never ends: an episode as long as max_turn
ENDLESS = {"env_type": "tests.custom_env_example:MyEnvWithConfig", "max_actions_per_traj": 10**6,
           "env_instruction": "Count up.", "env_config": {"limit": 10**9}}


def _long_episode(tmp_path, turns: int):
    specs = specs_for(["Endless"], [1], 1, custom_envs(Endless=ENDLESS))
    config = loop_config(max_turn=turns)
    trajectories, _ = run_envs(specs, DirectClient(ScriptedEngine(seed=1)), config, kept_envs=KeptEnvs())
    (record,) = read_dump(write_dump(tmp_path, f"d{turns}", RolloutResult(trajectories, specs), config,
                                     split="train", step=0))
    return record


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["recorded", "scripted"])
def test_replay_memory_grows_linearly_with_the_turns(tmp_path, engine):
    """Each turn appends its prompt's ids to the episode's: twice the turns is twice the
    dump, and must be about twice the memory, not four times (every turn's whole prompt kept)."""
    allowed = allowed_env_types(allow=["tests.custom_env_example:MyEnvWithConfig"])
    peaks = {}
    for turns in (100, 200):
        record = _long_episode(tmp_path, turns)
        assert len(record.trajectory.turns) == turns and all(t.has_prompt_ids for t in record.trajectory.turns)
        tracemalloc.start()
        try:
            result = replay(record, ScriptedEngine(seed=1) if engine == "scripted" else None, env_types=allowed)
            peaks[turns] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert result.identical, result.difference
    assert peaks[200] < 2.5 * peaks[100], {k: f"{v / 2**20:.1f} MiB" for k, v in peaks.items()}


@pytest.mark.timeout(300)
def test_a_trained_steps_dump_replays_with_its_checkpoint_and_the_base_model_says_why_it_differs(
        tiny_model_path, tmp_path, capsys):
    """A dump sampled by policy version 1 (a LoRA adapter, saved in a checkpoint as the trainer saves
    it): the base model's replay differs and says that the dump came from version 1 and the engine
    is the base model; with --checkpoint the adapter is loaded and the replay is identical."""
    import torch

    from ragen.llm.hf import HFEngine
    from ragen.llm.types import SamplingParams
    from ragen.trainer import checkpoint as ckpt
    from ragen.trainer.config import ModelSection
    from ragen.trainer.policy import apply_lora, trainable_state

    engine = HFEngine.from_config({}, tiny_model_path)
    peft = apply_lora(engine.model, ModelSection(lora_rank=4))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained adapter: B is not 0
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    engine.bump_policy_version()
    run = tmp_path / "run"
    folder = ckpt.save_checkpoint(run, 1, {"step": 1, "policy_version": 1, "lora": True,
                                           "model": trainable_state(engine.model, peft)},
                                  {"policy_version": 1, "lora_rank": 4}, peft_model=peft)
    specs = specs_for(["SimpleSokoban", "Bandit"], [1, 1], 1, custom_envs())
    config = loop_config(max_turn=2)
    config = type(config)(**{**config.__dict__, "sampling": SamplingParams(temperature=0.0, max_tokens=12)})
    trajectories, _ = run_envs(specs, DirectClient(engine), config, kept_envs=KeptEnvs())
    engine.close()
    assert {t.policy_version for tr in trajectories for t in tr.turns} == {1}
    path = write_dump(tmp_path, "step_000002", RolloutResult(trajectories, specs), config, split="train", step=2)

    hf = ["--engine", "hf", "--model", tiny_model_path]
    assert main([str(path), *hf]) == 1
    out = capsys.readouterr().out
    assert "differs at" in out and ("the dump's answers were sampled by policy version 1; the engine answers as "
                                    "version 0, the base model: replay with --checkpoint") in out
    assert main([str(path), *hf, "--checkpoint", str(folder)]) == 0, capsys.readouterr().out
    assert main([str(path), *hf, "--checkpoint", str(run)]) == 2
    assert "is not a checkpoint folder" in capsys.readouterr().err
    assert main([str(path), "--engine", "scripted", "--checkpoint", str(folder)]) == 2
    assert "--checkpoint loads a checkpoint's weights into the hf engine" in capsys.readouterr().err


def test_a_programs_info_is_compared_and_its_captured_output_is_not(parallel_dump):
    record = read_dump(parallel_dump)[0]
    program = {"info": {"answer": 4}, "traceback": None, "stdout": "thinking\n", "stderr": ""}
    dumped = dataclasses.replace(record, trajectory=dataclasses.replace(record.trajectory, program=program))
    assert first_difference(record, record.trajectory) is None  # an env's episode: none on either side
    same_info = dataclasses.replace(record.trajectory, program={**program, "stdout": "", "stderr": "warning\n"})
    assert first_difference(dumped, same_info) is None
    other_info = dataclasses.replace(record.trajectory, program={**program, "info": {"answer": 5}})
    assert first_difference(dumped, other_info) == \
        "end of episode: program info: dump {'answer': 4}, replay {'answer': 5}"
    assert first_difference(dumped, record.trajectory).startswith("end of episode: program info: ")
