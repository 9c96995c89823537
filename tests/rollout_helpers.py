"""Shared helpers of the rollout tests: env sets, engines and comparisons."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from omegaconf import OmegaConf

from ragen.llm import make_engine
from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import SamplingParams
from ragen.rollout.context import ContextConfig
from ragen.rollout.envs import EnvSpecMaker
from ragen.serving import DirectClient
from ragen.rollout.scheduler import KeptEnvs, LoopConfig, run_envs

ROOT = Path(__file__).resolve().parents[1]


def custom_envs(**extra) -> dict:
    envs = OmegaConf.to_container(OmegaConf.load(ROOT / "config" / "envs.yaml"), resolve=True)["custom_envs"]
    envs.update(extra)
    return envs


def fault_tag(fault: str = "none", fault_seed: int = -1, marker: str = "", **kw) -> dict:
    return {
        "env_type": "tests.fault_envs:FaultEnv",
        "config_type": "tests.fault_envs:FaultEnvConfig",
        "max_actions_per_traj": 8,
        "env_instruction": "Bring the value to 0.",
        "env_config": {"fault": fault, "fault_seed": fault_seed, "marker": marker, **kw},
    }


def specs_for(tags: list[str], n_groups: list[int], group_size: int, envs: dict, seed: int = 7):
    es = EnvSpecMaker("train", {"env_groups": sum(n_groups), "group_size": group_size,
                                   "env_configs": {"tags": tags, "n_groups": n_groups}}, envs, seed)
    return es.make_specs()


def streaming_engine(**decode):
    """The scripted policy (10% malformed answers) timed as an engine that batches continuously."""
    return make_engine({"name": "scripted", "malformed_rate": 0.1, "continuous_batching": {
        "step_s": 0.0005, "tokens_median": 20, "tokens_sigma": 1.0, **decode}})


TRAIN_SPLIT = {"env_groups": 4, "group_size": 2,
               "env_configs": {"tags": ["SimpleSokoban", "FrozenLake"], "n_groups": [2, 2]}}
VAL_SPLIT = {"env_groups": 3, "group_size": 1, "env_configs": {"tags": ["Bandit", "Countdown"], "n_groups": [2, 1]}}


def agent_setup(val: dict = VAL_SPLIT, **agent_proxy):
    """An ``AgentSetup`` of a small train and val split (seeds 3 and 11, 3 turns, 2 workers)."""
    from ragen.llm_agent import AgentSetup

    return AgentSetup.from_config({
        "custom_envs": custom_envs(),
        "seed": {"train": 3, "val": 11},
        "agent_proxy": {"max_turn": 3, "parallel_n_jobs": 2, **agent_proxy},
        "es_manager": {"train": TRAIN_SPLIT, "val": val},
    })


def loop_config(max_turn: int = 4, max_tokens: int = 128, **kw) -> LoopConfig:
    """``max_tokens``: the sampling's cap (response_length); a tag's max_tokens bounds its answers lower only."""
    return LoopConfig(context=ContextConfig(max_actions_per_turn=3), sampling=SamplingParams(max_tokens=max_tokens),
                      max_turn=max_turn, **kw)


def sequential(specs, config: LoopConfig, engine=None):
    engine = engine or ScriptedEngine(malformed_rate=0.1)
    trajectories, _ = run_envs(specs, DirectClient(engine), config, kept_envs=KeptEnvs(), isolate_errors=True)
    return trajectories


def rollouts_at_once(prm, n: int, specs, config: LoopConfig, within_s: float = 60.0, **rollout_kw) -> list:
    """``n`` calls of ``prm.rollout(specs, config)`` started together from
    ``n`` threads (``max_concurrent_rollouts: n``); their results in thread
    order. Re-raises the first error; fails if a rollout has not returned
    within ``within_s`` (its thread is a daemon: a hang does not stop the run)."""
    start = threading.Barrier(n)
    results: list = [None] * n
    errors: list = [None] * n

    def run(i: int) -> None:
        try:
            start.wait(within_s)
            results[i] = prm.rollout(specs, config, **rollout_kw)
        except BaseException as exc:  # handed to the test
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,), name=f"test-rollout-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + within_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"rollouts {hung} of {n} at once did not return within {within_s} s"
    for exc in errors:
        if exc is not None:
            raise exc
    return results
