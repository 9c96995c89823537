"""The env registry: names, import paths, config building and its error messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragen.env import (
    REGISTERED_ENV_CONFIGS,
    REGISTERED_ENVS,
    BanditEnv,
    CountdownEnv,
    FrozenLakeEnv,
    SokobanEnv,
    SokobanEnvConfig,
    make_env,
    make_env_config,
    register_env,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def importable_tests(monkeypatch):
    """Make ``tests.custom_env_example`` importable however pytest was started."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))


def test_builtin_names():
    assert {"sokoban", "frozen_lake", "bandit", "countdown"} <= set(REGISTERED_ENVS)
    assert set(REGISTERED_ENVS) == set(REGISTERED_ENV_CONFIGS)
    for name, cls in [("sokoban", SokobanEnv), ("frozen_lake", FrozenLakeEnv), ("bandit", BanditEnv), ("countdown", CountdownEnv)]:
        env = make_env(name)
        assert type(env) is cls
        assert isinstance(env.config, REGISTERED_ENV_CONFIGS[name])


def test_env_built_from_config_class_as_ragen_does():
    config = make_env_config("sokoban", {"dim_x": 7, "dim_y": 8, "num_boxes": 2})
    assert isinstance(config, SokobanEnvConfig) and config.dim_room == (7, 8)
    env = make_env("sokoban", config)  # an existing config object passes through
    assert env.config is config
    assert env.reset(seed=0).count("\n") == 6


def test_unknown_env_type_lists_registered_names():
    with pytest.raises(ValueError) as err:
        make_env("sokobon", tag="MyTag")
    message = str(err.value)
    assert message.startswith("custom_envs.MyTag.env_type: unknown env type 'sokobon'")
    for name in ("sokoban", "frozen_lake", "bandit", "countdown"):
        assert name in message


def test_custom_env_by_import_path_without_config_class(importable_tests):
    env = make_env("tests.custom_env_example:MyEnv", {"limit": 2})
    assert type(env).__name__ == "MyEnv"
    assert env.config == {"limit": 2}  # no config class: the plain mapping
    env.reset(seed=0)
    assert env.step(1)[3]["action_is_valid"]
    assert make_env("tests.custom_env_example:MyEnv").config is None


def test_an_env_without_a_config_class_is_said_once_at_config_read(importable_tests, caplog):
    """Issue 59, item 12: the env got a dict where it read attributes, and nobody said so."""
    import logging

    with caplog.at_level(logging.WARNING, logger="ragen.env"):
        for _ in range(3):
            make_env_config("tests.custom_env_example:MyEnv", {"limit": 2}, tag="Unchecked")
    said = [r.getMessage() for r in caplog.records if "custom_envs.Unchecked.env_config" in r.getMessage()]
    assert len(said) == 1 and "no config class" in said[0] and "plain dict" in said[0] and "'limit': 2" in said[0]


def test_custom_env_with_config_type(importable_tests):
    env = make_env(
        "tests.custom_env_example:MyEnv", {"limit": 4}, config_type="tests.custom_env_example:MyEnvConfig"
    )
    assert type(env.config).__name__ == "MyEnvConfig" and env.limit == 4
    with pytest.raises(ValueError, match=r"^custom_envs\.Mine\.env_config\.limit: must be >= 1"):
        make_env("tests.custom_env_example:MyEnv", {"limit": 0},
                 config_type="tests.custom_env_example:MyEnvConfig", tag="Mine")


def test_custom_env_with_config_cls_attribute(importable_tests):
    env = make_env("tests.custom_env_example:MyEnvWithConfig", {"limit": 5})
    assert type(env.config).__name__ == "MyEnvConfig"
    with pytest.raises(ValueError, match=r"^custom_envs\.Mine\.env_config\.bogus: unknown key"):
        make_env("tests.custom_env_example:MyEnvWithConfig", {"bogus": 1}, tag="Mine")


def test_register_custom_env(importable_tests):
    from tests.custom_env_example import MyEnv, MyEnvConfig

    register_env("my_counter", MyEnv, MyEnvConfig)
    try:
        env = make_env("my_counter", {"limit": 3})
        assert isinstance(env, MyEnv) and isinstance(env.config, MyEnvConfig)
    finally:
        REGISTERED_ENVS.pop("my_counter")
        REGISTERED_ENV_CONFIGS.pop("my_counter")
    with pytest.raises(ValueError):
        register_env("bad:name", MyEnv, MyEnvConfig)


@pytest.mark.parametrize(
    "env_type,config_type,pattern",
    [
        ("no_such_package.mod:Env", None, r"custom_envs\.T\.env_type: cannot import 'no_such_package\.mod:Env': ModuleNotFoundError"),
        ("tests.custom_env_example:Nope", None, r"custom_envs\.T\.env_type: .*has no attribute 'Nope'"),
        ("tests.custom_env_example:MyEnv", "tests.custom_env_example:Missing", r"custom_envs\.T\.config_type: .*'Missing'"),
    ],
)
def test_bad_import_paths_name_the_path_and_the_failure(importable_tests, env_type, config_type, pattern):
    with pytest.raises(ImportError, match=pattern):
        make_env(env_type, config_type=config_type, tag="T")


@pytest.mark.parametrize("source,pattern", [
    (None, r"custom_envs\.T\.env_type: cannot import 'h29_no_such_pkg\.mod:Env': ModuleNotFoundError: .*PYTHONPATH"),
    ("raise RuntimeError('broken at import')\n",
     r"custom_envs\.T\.env_type: cannot import 'h29_raises_on_import:Env': RuntimeError: broken at import "
     r"\(raised by module 'h29_raises_on_import' while it was imported\)"),
    ("import h29_missing_dependency\n",
     r"custom_envs\.T\.env_type: cannot import 'h29_raises_on_import:Env': ModuleNotFoundError: "
     r"No module named 'h29_missing_dependency' \(raised by module 'h29_raises_on_import'"),
])
def test_an_env_type_that_does_not_import_is_a_config_error(tmp_path, monkeypatch, source, pattern):
    """A ValueError (what the command lines turn into one error line, rc 2) naming the tag and the module,
    whatever the module raised while it was imported."""
    env_type = "h29_no_such_pkg.mod:Env"
    if source is not None:
        (tmp_path / "h29_raises_on_import.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        env_type = "h29_raises_on_import:Env"
    with pytest.raises(ValueError, match=pattern) as err:
        make_env_config(env_type, None, tag="T")
    assert isinstance(err.value, ImportError)


def test_malformed_import_path():
    with pytest.raises(ValueError, match="package.module:ClassName"):
        make_env(":Env", tag="T")
    with pytest.raises(ValueError, match="not a class"):
        make_env("os:sep", tag="T")


@pytest.mark.parametrize(
    "env_type,values,expected",
    [
        ("sokoban", {"dim_x": 6, "dim_y": 6, "num_boxes": 40},
         "custom_envs.LargerSokoban.env_config.num_boxes: 40 boxes do not fit in a 6x6 room"),
        ("sokoban", {"dim_x": 2, "dim_y": 2}, "custom_envs.LargerSokoban.env_config.dim_x: the room must be at least 3x3"),
        ("sokoban", {"max_steps": -5}, "custom_envs.LargerSokoban.env_config.max_steps: must be >= 1"),
        ("sokoban", {"num_boxes": 1.5}, "custom_envs.LargerSokoban.env_config.num_boxes: expected an integer"),
        ("sokoban", {"num_box": 2}, "custom_envs.LargerSokoban.env_config.num_box: unknown key for SokobanEnvConfig"),
        ("frozen_lake", {"size": 0}, "custom_envs.LargerSokoban.env_config.size: must be >= 2"),
    ],
)
def test_bad_config_values_name_field_and_tag(env_type, values, expected):
    with pytest.raises(ValueError) as err:
        make_env(env_type, values, tag="LargerSokoban")
    assert str(err.value).startswith(expected)


def test_errors_without_a_tag_still_name_the_field():
    with pytest.raises(ValueError, match=r"^env_config\.num_boxes: "):
        make_env_config("sokoban", {"num_boxes": 0})
    with pytest.raises(ValueError, match=r"^env_config: expected a mapping"):
        make_env_config("sokoban", [1, 2])


def test_omegaconf_containers_become_plain_python():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create(
        {"dim_room": [7, 7], "num_boxes": 1, "grid_lookup": {0: "W", 1: ".", 2: "G", 3: "C", 4: "B", 5: "A", 6: "@"}}
    )
    config = make_env_config("sokoban", cfg, tag="X")
    assert config.dim_room == (7, 7)
    assert type(config.grid_lookup) is dict
    assert "W" in make_env("sokoban", cfg).reset(seed=1)


def test_every_tag_in_envs_yaml_builds():
    omegaconf = pytest.importorskip("omegaconf")
    spec = omegaconf.OmegaConf.load(REPO_ROOT / "config" / "envs.yaml")
    tags = set(spec.custom_envs)
    assert {"SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab", "CoordSokoban", "FrozenLake",
            "CoordFrozenLake", "Bandit", "BanditTest", "BanditHinted", "BanditHintedTest", "Countdown"} <= tags
    for tag, entry in spec.custom_envs.items():
        assert {"env_type", "max_actions_per_traj", "env_instruction", "max_tokens", "env_config"} <= set(entry)
        env = make_env(entry.env_type, entry.env_config, entry.get("config_type"), tag=tag)
        assert isinstance(env.reset(seed=0), str)
    larger = make_env_config("sokoban", spec.custom_envs.LargerSokoban.env_config)
    assert (larger.dim_room, larger.num_boxes, larger.search_depth) == ((8, 8), 2, 10)  # RAGEN's entry


def test_plain_value_errors_from_user_configs_get_the_tag(importable_tests):
    with pytest.raises(ValueError, match=r"^custom_envs\.F\.env_config: .*boom"):
        make_env("tests.custom_env_example:MyEnv", {"limit": 1},
                 config_type="tests.custom_env_example:StrictConfig", tag="F")
