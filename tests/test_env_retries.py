"""A failing env is retried alone on a fresh instance (same seed, recorded
actions replayed) before it ends in ``error``; every env that ends in error or
timeout is reported with its tag and seed."""

from __future__ import annotations

import json
import logging
import random
import shlex
from dataclasses import replace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ragen.env.base import BaseDiscreteActionEnv
from ragen.llm.scripted import ScriptedEngine
from ragen.llm_agent import AgentSetup, LLMAgentProxy
from ragen.serving import DirectClient
from ragen.rollout.scheduler import KeptEnvs, run_envs
from ragen.rollout.types import RolloutResult, StopReason
from ragen.tools.check import main as check_main

from tests.rollout_helpers import ROOT, custom_envs, fault_tag, loop_config, sequential, specs_for

pytestmark = pytest.mark.timeout(120)


def _specs(fault: str = "none", transient: bool = False, tmp_path=None, **kw):
    clean = specs_for(["Fault"], [4], 2, custom_envs(Fault=fault_tag()))
    marker = str(tmp_path / "marker") if transient else ""
    faulty = specs_for(["Fault"], [4], 2, custom_envs(Fault=fault_tag(fault, fault_seed=clean[2].seed,
                                                                          marker=marker, **kw)))
    return clean, faulty, clean[2].seed


def _run(specs, config, isolate=True):
    return run_envs(specs, DirectClient(ScriptedEngine()), config, kept_envs=KeptEnvs(), isolate_errors=isolate)


@pytest.mark.parametrize("fault", ["raise_step", "raise_reset"])
def test_a_transient_failure_is_retried_to_the_fault_free_trajectory(tmp_path, fault):
    clean, faulty, _ = _specs(fault, transient=True, tmp_path=tmp_path)
    reference, _ = _run(clean, loop_config())
    trajectories, stats = _run(faulty, loop_config())
    assert trajectories == reference
    assert stats.env_retries == 1 and stats.env_errors == 0


def test_a_timed_out_call_is_retried_too(tmp_path):
    clean, faulty, _ = _specs("hang_step", transient=True, tmp_path=tmp_path, hang_s=5)
    reference, _ = _run(clean, loop_config())
    trajectories, stats = _run(faulty, loop_config(env_timeout_s=0.5))
    assert trajectories == reference
    assert stats.env_retries == 1


def test_a_retried_env_in_a_worker_does_not_fail_its_shard(tmp_path):
    """Without isolation (a parallel worker), a transient failure no longer
    raises: the retry recovers it in place."""
    clean, faulty, _ = _specs("raise_step", transient=True, tmp_path=tmp_path)
    reference, _ = _run(clean, loop_config())
    trajectories, stats = _run(faulty, loop_config(), isolate=False)
    assert trajectories == reference and stats.env_retries == 1


def test_a_persistent_failure_ends_only_its_own_envs_after_the_retries():
    clean, faulty, bad_seed = _specs("raise_step")
    reference, _ = _run(clean, loop_config())
    trajectories, stats = _run(faulty, replace(loop_config(), env_retries=2))
    bad = [t for t in trajectories if t.seed == bad_seed]
    assert len(bad) == 2 and all(t.stop_reason is StopReason.ERROR for t in bad)
    assert all("injected step failure" in t.error for t in bad)
    assert [t for t in trajectories if t.seed != bad_seed] == [t for t in reference if t.seed != bad_seed]
    assert stats.env_retries == 2 * 2 and stats.env_errors == 2


def test_no_retry_when_env_retries_is_0(tmp_path):
    _, faulty, bad_seed = _specs("raise_step", transient=True, tmp_path=tmp_path)
    trajectories, stats = _run(faulty, replace(loop_config(), env_retries=0))
    assert [t.stop_reason for t in trajectories if t.seed == bad_seed].count(StopReason.ERROR) == 1
    assert stats.env_retries == 0


class FlakyEnv(BaseDiscreteActionEnv):
    """Not deterministic for its seed (process-global entropy), and fails on
    its second step once: a retry cannot bring a fresh instance back to it."""

    ACTION_LOOKUP = {1: "Up", 2: "Down"}
    failed = False

    def reset(self, seed=None, **kwargs):
        self.value = random.SystemRandom().randint(10_000, 10**9)
        self.steps = 0
        return f"value={self.value}"

    def step(self, action):
        self.steps += 1
        if self.steps == 2 and not FlakyEnv.failed:
            FlakyEnv.failed = True
            raise RuntimeError("flaky")
        self.value += 1
        return f"value={self.value}", 0.0, False, {"action_is_valid": True, "action_is_effective": True,
                                                  "success": False}


def test_a_retry_that_cannot_reproduce_the_state_says_why():
    FlakyEnv.failed = False
    tag = {"env_type": "tests.test_env_retries:FlakyEnv", "max_actions_per_traj": 10, "env_config": {}}
    specs = specs_for(["Flaky"], [1], 1, {"Flaky": tag})
    trajectories, stats = _run(specs, loop_config(max_turn=4))
    assert trajectories[0].stop_reason is StopReason.ERROR
    assert "not deterministic for its seed" in trajectories[0].error and stats.env_retries == 1


def test_failed_envs_are_listed_with_tag_seed_and_error():
    _, faulty, bad_seed = _specs("raise_reset")
    trajectories = sequential(faulty, loop_config())
    result = RolloutResult(trajectories=trajectories, specs=faulty)
    failed = result.failed_envs
    assert [(f["tag"], f["seed"], f["stop_reason"]) for f in failed] == [("Fault", bad_seed, "error")] * 2
    assert all("injected reset failure" in f["error"] and f["env_type"] == "tests.fault_envs:FaultEnv"
               for f in failed)


def test_the_rollout_log_names_each_failed_env_and_how_to_check_it(caplog, tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        cfg = OmegaConf.to_container(compose("base", overrides=[
            "engine=scripted", "es_manager.train.env_groups=2", "es_manager.train.group_size=1",
            "es_manager.train.env_configs.tags=[Fault]", "es_manager.train.env_configs.n_groups=[2]",
            "agent_proxy.env_retries=0", "seed.train=40",
            "+custom_envs.Fault={env_type: 'tests.fault_envs:FaultEnv', config_type: 'tests.fault_envs:FaultEnvConfig', "
            "env_config: {fault: raise_reset, fault_seed: 41}}"]), resolve=True)
    with LLMAgentProxy(AgentSetup.from_config(cfg), ScriptedEngine()) as proxy, \
            caplog.at_level(logging.WARNING, logger="ragen.rollout.backends.base"):
        result = proxy.rollout("train")
    assert [f["seed"] for f in result.failed_envs] == [41]
    lines = [r.getMessage() for r in caplog.records if r.name == "ragen.rollout.backends.base"
             and "ended in error" in r.getMessage()]
    assert len(lines) == 1
    assert "tag Fault, seed 41" in lines[0]
    # Issue 59: the command named the tag, which only this run's config defines ("unknown env type
    # 'Fault'"); it names the env as the worker built it, and runs anywhere
    command = lines[0].split("| check it alone: ")[1]
    assert command == result.failed_envs[0]["check"]
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "ragen.tools.check"] and argv[-2:] == ["--first-seed", "41"]
    report_path = tmp_path / "report.json"
    assert check_main([*argv[3:], "--seeds", "1", "--json", str(report_path)]) == 1
    checks = {r["name"]: r for r in json.loads(report_path.read_text())["results"]}
    assert checks["build"]["status"] == "pass" and "FaultEnv from FaultEnvConfig" in checks["build"]["message"]
    assert checks["reset"]["status"] == "fail" and "injected reset failure" in checks["reset"]["message"]
    assert result.metrics["rollout/env_retries"] == 0
