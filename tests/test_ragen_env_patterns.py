"""RAGEN's env modules and envs.yaml run here unchanged.

The envs of ``tests/ragen_style_envs.py`` use the patterns RAGEN's own modules
rely on (config set before the base ``__init__``, ``reset`` re-running
``__init__``, gymnasium / gym-sokoban base classes, ``all_seed`` around
global-RNG generation, numpy values in ``step``, ``ACTION_LOOKUP`` from 1,
``render(mode)``); ``tests/ragen_envs.yaml`` is written the way RAGEN's
``config/envs.yaml`` is (``parallel_friendly``, ``max_workers``,
``env_config: null``). Each runs sequentially and in parallel with identical
results.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ragen.env import make_env, make_env_config
from ragen.env.base import BaseDiscreteActionEnv, BaseEnv
from ragen.llm.scripted import ScriptedEngine
from ragen.rollout.envs import EnvSpecMaker
from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings
from ragen.serving import SharedLLMInferenceManager
from ragen.rollout.types import StopReason

from tests import ragen_style_envs
from tests.rollout_helpers import loop_config, sequential, specs_for

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

RAGEN_ENVS = OmegaConf.load(Path(__file__).with_name("ragen_envs.yaml"))["custom_envs"]
MODULE_ENVS = {  # tag -> (env class, config class) in tests.ragen_style_envs
    "GymnasiumLake": ("LakeOnGymnasium", "LakeConfig"),
    "GymSokoban": ("SokobanOnGymSokoban", "BoxConfig"),
    "GymnasiumArms": ("ArmsOnGymnasium", "ArmsConfig"),
}


def _path(name: str) -> str:
    return f"tests.ragen_style_envs:{name}"


def test_base_init_keeps_a_config_set_before_it():
    class ConfigFirst(BaseDiscreteActionEnv):
        def __init__(self, config):
            self.config = config  # RAGEN's order: config first, then the base
            BaseDiscreteActionEnv.__init__(self)

        def reset(self, seed=None, **kw):
            return ""

        def step(self, action):
            return "", 0.0, True, {}

    assert ConfigFirst({"size": 3}).config == {"size": 3}


def test_base_init_still_sets_the_config_it_is_given():
    class Plain(BaseEnv):
        def reset(self, seed=None, **kw):
            return ""

        def step(self, action):
            return "", 0.0, True, {}

    assert Plain({"a": 1}).config == {"a": 1}
    assert Plain().config is None


@pytest.mark.parametrize("tag", sorted(MODULE_ENVS))
def test_null_env_config_builds_the_config_class_defaults(tag):
    env_name, config_name = MODULE_ENVS[tag]
    config = make_env_config(_path(env_name), None, config_type=_path(config_name), tag=tag)
    assert type(config).__name__ == config_name  # never None: RAGEN builds the defaults too
    env = make_env(_path(env_name), None, config_type=_path(config_name), tag=tag)
    assert env.config is not None and type(env.config).__name__ == config_name


@pytest.mark.parametrize("tag", sorted(MODULE_ENVS))
def test_ragen_style_env_resets_reproducibly_and_steps_from_action_1(tag):
    env_name, config_name = MODULE_ENVS[tag]
    env = make_env(_path(env_name), RAGEN_ENVS[tag].env_config, config_type=_path(config_name), tag=tag)
    first = env.reset(seed=11)
    assert isinstance(first, str) and first
    assert min(env.ACTION_LOOKUP) == 1
    assert env.reset(seed=12) is not None
    assert env.reset(seed=11) == first  # reset re-runs __init__ / reseeds: same seed, same state
    obs, reward, done, info = env.step(1)
    assert {"action_is_valid", "action_is_effective", "success"} <= set(info)


def test_render_modes_of_a_ragen_style_env():
    env = make_env(_path("SokobanOnGymSokoban"), None, config_type=_path("BoxConfig"))
    env.reset(seed=3)
    assert env.render() == env.render("text")
    assert env.render("coord").startswith("player at")
    assert env.render("rgb_array").ndim == 3
    with pytest.raises(ValueError, match="Invalid mode"):
        env.render("nonsense")


def test_ragen_envs_yaml_loads_with_parallel_friendly_and_max_workers():
    tags = list(RAGEN_ENVS)
    es = EnvSpecMaker("train", {"env_groups": len(tags), "group_size": 1,
                                   "env_configs": {"tags": tags, "n_groups": [1] * len(tags)}}, RAGEN_ENVS, 0)
    threads = {s.tag: s.env_threads for s in es.make_specs()}
    assert threads["GymnasiumLake"] == 4 and threads["GymnasiumArms"] == 2
    assert threads["SimpleSokoban"] == 1  # parallel_friendly: false
    assert threads["MathLike"] == 1  # neither key


@pytest.mark.parametrize("tag,start,words", [
    ("CoordSokoban", "Coordinates: \nBoard size: ", ["Boxes: (", "Targets: (", "Player", "Grid Map: \n#"]),
    ("CoordFrozenLake", "Coordinates: \nBoard size: 4 rows x 4 cols (zero-indexed).\nStart: (",
     ["Player: (", "Goal: (", "Grid Map: \n"]),
])
def test_coordinate_observations_of_ragen_coord_tags(tag, start, words):
    spec = specs_for([tag], [1], 1, OmegaConf.to_container(RAGEN_ENVS))[0]
    obs = make_env(spec.env_type, spec.env_config, tag=tag).reset(seed=spec.seed)
    assert obs.startswith(start)
    for w in words:
        assert w in obs


def test_image_observations_are_refused_with_the_key_named():
    visual = {"env_type": "sokoban", "max_actions_per_traj": 10, "env_instruction": "", "max_tokens": 100,
              "parallel_friendly": False, "max_workers": 32,
              "env_config": {"dim_x": 6, "dim_y": 6, "num_boxes": 1, "max_steps": 100, "render_mode": "rgb_array"}}
    with pytest.raises(ValueError, match=r"custom_envs.VisualSimpleSokoban.env_config.render_mode: 'rgb_array'"):
        specs_for(["VisualSimpleSokoban"], [1], 1, {"VisualSimpleSokoban": visual})


@pytest.mark.parametrize("key,value,words", [
    ("parallel_friendly", "yes", "parallel_friendly must be true or false"),
    ("max_workers", 0, "max_workers must be >= 1"),
    ("max_workers", "many", "max_workers must be an integer"),
])
def test_bad_parallel_friendly_keys_are_named(key, value, words):
    envs = OmegaConf.to_container(RAGEN_ENVS)
    envs["Bandit"][key] = value
    with pytest.raises(ValueError, match=words) as err:
        specs_for(["Bandit"], [1], 1, envs)
    assert "custom_envs.Bandit" in str(err.value)


def _all_tag_specs(group_size: int = 2, seed: int = 7):
    envs = OmegaConf.to_container(RAGEN_ENVS)
    tags = list(envs)
    n_groups = [3 if t in ("GymSokoban", "GymnasiumLake") else 1 for t in tags]
    return specs_for(tags, n_groups, group_size, envs, seed=seed)


@pytest.fixture(scope="module")
def ragen_reference():
    specs = _all_tag_specs()
    return specs, sequential(specs, loop_config(), ScriptedEngine(malformed_rate=0.1))


def test_every_ragen_tag_plays_to_a_clean_end(ragen_reference):
    specs, trajectories = ragen_reference
    assert [t.env_id for t in trajectories] == [s.env_id for s in specs]
    for t in trajectories:
        assert t.stop_reason not in (StopReason.ERROR, StopReason.TIMEOUT), (t.tag, t.error)
        assert t.turns, t.tag
    # numpy bools and scalars in info arrive as plain Python values
    lake = [tn.info for t in trajectories if t.tag == "GymnasiumLake" for tn in t.turns if tn.info]
    assert lake and all(type(i["success"]) is bool and type(i["position"]) is int for i in lake)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend,n_jobs", [("loky", 2), ("threading", 3)])
def test_ragen_config_parallel_equals_sequential(backend, n_jobs, ragen_reference):
    specs, reference = ragen_reference
    with SharedLLMInferenceManager(ScriptedEngine(malformed_rate=0.1), coalesce_wait_s=0.005) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=n_jobs, backend=backend)) as prm:
        result = prm.rollout(specs, loop_config())
    assert result.trajectories == reference
    assert result.metrics["parallel/fallbacks"] == 0


@pytest.mark.timeout(300)
def test_global_rng_env_is_identical_on_threads():
    """gym-sokoban's generator draws from the global RNG under all_seed: on the
    threading backend with many workers its rooms are still those of the
    sequential loop."""
    envs = OmegaConf.to_container(RAGEN_ENVS)
    specs = specs_for(["GymSokoban"], [12], 1, envs, seed=100)
    reference = sequential(specs, loop_config(max_turn=2), ScriptedEngine())
    with SharedLLMInferenceManager(ScriptedEngine()) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=6, backend="threading",
                                   max_env_num_per_worker=1)) as prm:
        result = prm.rollout(specs, loop_config(max_turn=2))
    assert [t.turns[0].observation for t in result.trajectories] == [t.turns[0].observation for t in reference]
    assert result.trajectories == reference


def _busy_specs(friendly: bool, max_workers: int = 4):
    tag = {"env_type": _path("BusyEnv"), "config_type": _path("BusyConfig"), "max_actions_per_traj": 2,
           "parallel_friendly": friendly, "max_workers": max_workers, "env_config": {"call_s": 0.02}}
    return specs_for(["Busy"], [4], 2, {"Busy": tag})


@pytest.mark.timeout(120)
def test_parallel_friendly_tag_steps_its_envs_on_threads_with_identical_results():
    engine = ScriptedEngine()
    ragen_style_envs.BusyEnv.max_at_once = 0
    one_by_one = sequential(_busy_specs(False), loop_config(max_turn=3), engine)
    assert ragen_style_envs.BusyEnv.max_at_once == 1

    ragen_style_envs.BusyEnv.max_at_once = 0
    threaded = sequential(_busy_specs(True, max_workers=4), loop_config(max_turn=3), engine)
    assert 1 < ragen_style_envs.BusyEnv.max_at_once <= 4
    assert threaded == one_by_one


@pytest.mark.timeout(120)
def test_parallel_friendly_env_timeouts_are_per_env():
    """Envs stepped at once are each timed on their own: a slow one times out
    alone, the others finish."""
    slow = {"env_type": _path("BusyEnv"), "config_type": _path("BusyConfig"), "max_actions_per_traj": 2,
            "parallel_friendly": True, "max_workers": 4, "env_config": {"call_s": 3.0}}
    specs = specs_for(["Busy", "Slow"], [3, 1], 2, {"Busy": {**slow, "env_config": {"call_s": 0.01}},
                                                     "Slow": slow})
    trajectories = sequential(specs, loop_config(max_turn=2, env_timeout_s=1.0), ScriptedEngine())
    reasons = {tag: {t.stop_reason for t in trajectories if t.tag == tag} for tag in ("Busy", "Slow")}
    assert reasons["Slow"] == {StopReason.TIMEOUT}
    assert StopReason.TIMEOUT not in reasons["Busy"] and StopReason.ERROR not in reasons["Busy"]


@pytest.mark.parametrize("split", ["train", "val"])
def test_reset_gets_the_split_as_mode_when_it_takes_one(split):
    envs = OmegaConf.to_container(RAGEN_ENVS)
    es = EnvSpecMaker(split, {"env_groups": 2, "group_size": 1,
                                 "env_configs": {"tags": ["GymnasiumArms", "Bandit"], "n_groups": [1, 1]}}, envs, 0)
    arms, bandit = sequential(es.make_specs(), loop_config(), ScriptedEngine())
    assert ("(evaluation)" in arms.turns[0].observation) == (split == "val")
    assert bandit.turns  # our envs take **kwargs and are not given mode


@pytest.mark.parametrize("tag", sorted(MODULE_ENVS))
def test_the_env_checker_passes_ragen_style_envs(tag):
    from ragen.env.check import check_env

    env_name, config_name = MODULE_ENVS[tag]
    report = check_env(_path(env_name), None, _path(config_name), seeds=3)
    assert report.ok, report.format()
    assert report["global_rng"].status == "pass"  # all_seed restores the global generators
