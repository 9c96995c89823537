"""The sequential agent loop (RAGEN's): every env, group semantics, metrics,
config errors at start-up, and a real model producing parsed actions."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ragen.llm import make_engine
from ragen.llm.scripted import ScriptedEngine
from ragen.llm_agent import AgentSetup, LLMAgentProxy, StopReason
from ragen.rollout.loop_config import LoopConfig

from tests.rollout_helpers import ROOT

ALL_TAGS = ["SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab", "FrozenLake", "Bandit", "BanditTest",
            "Countdown"]


def config(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        return OmegaConf.to_container(compose("base", overrides=list(overrides)), resolve=True)


def test_full_rollout_on_every_env():
    cfg = config("engine=scripted", "es_manager.train.env_groups=7", "es_manager.train.group_size=3",
                 f"es_manager.train.env_configs.tags=[{','.join(ALL_TAGS)}]",
                 "es_manager.train.env_configs.n_groups=[1,1,1,1,1,1,1]")
    setup = AgentSetup.from_config(cfg)
    with LLMAgentProxy(setup, ScriptedEngine(malformed_rate=0.2)) as proxy:
        result = proxy.rollout("train")
        second = proxy.rollout("train")
    trajs = result.trajectories
    assert [t.env_id for t in trajs] == list(range(21))
    assert {t.tag for t in trajs} == set(ALL_TAGS)
    m = result.metrics
    assert sum(m[f"rollout/stop/{r.value}"] for r in StopReason) == 21
    assert m["rollout/n_trajectories"] == 21
    assert m["engine/calls"] == max(len(t.turns) for t in trajs)  # one batched call per turn
    for t in trajs:
        assert t.turns, t
        assert t.stop_reason in (StopReason.DONE, StopReason.MAX_TURNS, StopReason.ACTION_BUDGET)
        assert len(t.turns) <= setup.loop.max_turn
        # group members share their initial state; groups differ in seed
        first = trajs[3 * t.group_id]
        assert t.seed == first.seed and t.turns[0].observation == first.turns[0].observation
        for turn in t.turns:
            assert len(turn.executed_actions) <= len(turn.actions) <= setup.loop.context.max_actions_per_turn
            if not turn.executed_actions:
                assert turn.penalty == setup.loop.format_penalty
    assert len({t.seed for t in trajs}) == 7
    # seeds advance every rollout
    assert {t.seed for t in second.trajectories}.isdisjoint({t.seed for t in trajs})
    for tag in ALL_TAGS:
        assert f"rollout/{tag}/success" in m
    # discrete envs list their actions in the prompt, language envs do not
    sok = next(t for t in trajs if t.tag == "SimpleSokoban")
    assert sok.action_names == ["Up", "Down", "Left", "Right"]
    assert next(t for t in trajs if t.tag == "Countdown").action_names is None



def _long_answer(prompt: str, rng) -> tuple[str, float]:
    return "Up" + " " * 148, 0.0  # 150 bytes, and so 150 tokens of the scripted engine


@pytest.mark.parametrize("response_length, bound", [(10, 10), (600, 100)])
def test_an_answer_is_bounded_by_the_smaller_of_response_length_and_the_tags_max_tokens(response_length, bound):
    """SimpleSokoban's max_tokens is 100: response_length 10 bounds its answers at 10, and one
    of 600 leaves them at the tag's 100."""
    cfg = config("engine=scripted", "agent_proxy.max_turn=1",
                 f"ctx_manager.generation.response_length={response_length}",
                 "es_manager.train.env_groups=2", "es_manager.train.group_size=2",
                 "es_manager.train.env_configs.tags=[SimpleSokoban]", "es_manager.train.env_configs.n_groups=[2]")
    assert cfg["custom_envs"]["SimpleSokoban"]["max_tokens"] == 100
    engine = ScriptedEngine(answers=f"{__name__}:_long_answer")
    with LLMAgentProxy(AgentSetup.from_config(cfg), engine) as proxy:
        turns = [t for traj in proxy.rollout("train").trajectories for t in traj.turns]
    assert len(turns) == 4 and all(len(t.response_ids) == bound and t.finish_reason == "length" for t in turns)


def test_the_proxy_keeps_what_exists_at_its_start_out_of_full_collections_until_it_closes():
    import gc

    gc.unfreeze()
    cfg = config("engine=scripted", "es_manager.train.env_groups=1", "es_manager.train.group_size=1",
                 "es_manager.train.env_configs.tags=[Bandit]", "es_manager.train.env_configs.n_groups=[1]")
    with LLMAgentProxy(AgentSetup.from_config(cfg), ScriptedEngine()) as proxy:
        assert gc.get_freeze_count() > 0
        proxy.rollout("train")
    assert gc.get_freeze_count() == 0


def _sokoban_rollout(max_turn: int, max_actions_per_traj: int) -> list:
    cfg = config("engine=scripted", f"agent_proxy.max_turn={max_turn}", "es_manager.train.env_groups=4",
                 "es_manager.train.group_size=2", "es_manager.train.env_configs.tags=[SimpleSokoban]",
                 "es_manager.train.env_configs.n_groups=[4]",
                 f"custom_envs.SimpleSokoban.max_actions_per_traj={max_actions_per_traj}")
    with LLMAgentProxy(AgentSetup.from_config(cfg), ScriptedEngine()) as proxy:
        return proxy.rollout("train").trajectories


def test_action_budget_and_max_turns():
    # a budget of one action binds after the first turn, before max_turn=2
    trajs = _sokoban_rollout(max_turn=2, max_actions_per_traj=1)
    assert len(trajs) == 8
    for t in trajs:
        assert t.num_actions <= 1 and len(t.turns) == 1
        assert t.stop_reason in (StopReason.ACTION_BUDGET, StopReason.DONE)
    assert any(t.stop_reason == StopReason.ACTION_BUDGET for t in trajs)
    # a budget no three turns can spend: max_turn=3 binds, at exactly 3 turns
    trajs = _sokoban_rollout(max_turn=3, max_actions_per_traj=100)
    assert len(trajs) == 8
    for t in trajs:
        assert t.num_actions < 100
        if t.stop_reason == StopReason.DONE:
            assert len(t.turns) <= 3
        else:
            assert t.stop_reason == StopReason.MAX_TURNS and len(t.turns) == 3, (t.stop_reason, len(t.turns))
    assert sum(t.stop_reason == StopReason.MAX_TURNS for t in trajs) >= 6


@pytest.mark.parametrize("override,key", [
    ("es_manager.train.env_configs.tags=[Nope]", "es_manager.train.env_configs.tags"),
    ("es_manager.train.env_configs.n_groups=[3]", "es_manager.train.env_configs.n_groups"),
    ("es_manager.train.group_size=0", "es_manager.train.group_size"),
    ("agent_proxy.parallel_backend=spark", "agent_proxy.parallel_backend"),
    ("agent_proxy.max_turn=0", "agent_proxy.max_turn"),
    ("agent_proxy.reward_normalization.method=median", "agent_proxy.reward_normalization.method"),
    ("+custom_envs.BanditHinted.env_config.lo_arm_score=oops", "custom_envs.BanditHinted"),
    ("+custom_envs.BanditHinted.env_config.hi_arm_hiscore_prob=2",
     "custom_envs.BanditHinted.env_config.hi_arm_hiscore_prob"),
])
def test_config_errors_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        AgentSetup.from_config(config(override))


def test_real_default_model_produces_parsed_actions():
    """SmolLM2-135M-Instruct on CPU: a short rollout whose answers parse into actions."""
    cfg = config("engine=hf", "ctx_manager.generation.response_length=24", "ctx_manager.generation.temperature=0",
                 "agent_proxy.max_turn=1", "agent_proxy.enable_think=false", "es_manager.train.env_groups=2",
                 "es_manager.train.group_size=1", "es_manager.train.env_configs.tags=[SimpleSokoban,Bandit]",
                 "es_manager.train.env_configs.n_groups=[1,1]")
    setup = AgentSetup.from_config(cfg)
    engine = make_engine(cfg["engine"], cfg["model_path"])
    with LLMAgentProxy(setup, engine) as proxy:
        trajs = proxy.rollout("train").trajectories
    assert len(trajs) == 2
    responses = [t.turns[0].response for t in trajs]
    assert all(r.strip() for r in responses)
    assert any(t.turns[0].actions for t in trajs), responses


def test_a_time_limit_of_zero_is_refused_by_the_library_too():
    """0 is not "no limit" (None is) for code that builds the loop or the manager itself."""
    from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings

    with pytest.raises(ValueError, match="env_timeout_s must be > 0 seconds, got 0"):
        LoopConfig(env_timeout_s=0)
    for key in ("rollout_timeout_s", "engine_timeout_s", "fallback_env_timeout_s"):
        with pytest.raises(ValueError, match=f"agent_proxy.{key} must be > 0 seconds, got 0"):
            ParallelRolloutManager(None, ParallelSettings(**{key: 0}))
