"""Our config/envs.yaml tags with RAGEN's names are RAGEN's entries, key for key and character for character.

The fixture ``tests/fixtures/ragen/envs_yaml.json`` holds RAGEN's
``config/envs.yaml`` entries of the env types we have (made by
``make_envs_yaml_fixture.py`` beside it). Ours are read as ``train.py`` reads
them: Hydra composes ``config/base.yaml`` (which takes ``envs.yaml``), resolved.
"""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ragen.rollout.envs import EnvSpecMaker

from tests.rollout_helpers import ROOT

FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "ragen" / "envs_yaml.json").read_text())


def _composed(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        return OmegaConf.to_container(compose("base", overrides=list(overrides)), resolve=True)


@pytest.fixture(scope="module")
def our_envs() -> dict:
    # through JSON as the fixture went: integer keys (grid_lookup's) become strings on both sides
    return json.loads(json.dumps(_composed()["custom_envs"]))


def test_the_fixture_holds_ragens_tags_of_our_env_types():
    assert set(FIXTURE["entries"]) == {"SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab", "CoordSokoban",
                                       "Countdown", "Bandit", "BanditTest", "FrozenLake", "CoordFrozenLake"}
    assert set(FIXTURE["left_out"]) == {"VisualSimpleSokoban"}


@pytest.mark.parametrize("tag", sorted(FIXTURE["entries"]))
def test_our_entry_is_ragens(our_envs, tag):
    assert tag in our_envs, f"custom_envs.{tag}: RAGEN's tag is missing from config/envs.yaml"
    ours, ragens = our_envs[tag], FIXTURE["entries"][tag]
    assert list(ours) == list(ragens), f"custom_envs.{tag}: keys differ"
    for key in ragens:
        assert ours[key] == ragens[key], f"custom_envs.{tag}.{key}: {ours[key]!r} is not RAGEN's {ragens[key]!r}"


@pytest.mark.parametrize("tag", sorted(FIXTURE["left_out"]))
def test_tags_we_cannot_run_are_not_in_our_envs(our_envs, tag):
    assert tag not in our_envs


def test_every_ragen_tag_makes_env_specs(our_envs):
    """RAGEN's entries are accepted as they stand (env_config: null included)."""
    tags = sorted(FIXTURE["entries"])
    split = {"env_groups": len(tags), "group_size": 1, "env_configs": {"tags": tags, "n_groups": [1] * len(tags)}}
    specs = EnvSpecMaker("train", split, our_envs, 0).make_specs()
    by_tag = {s.tag: s for s in specs}
    assert set(by_tag) == set(tags)
    for tag in tags:
        assert by_tag[tag].env_instruction == FIXTURE["entries"][tag]["env_instruction"], tag
        assert by_tag[tag].max_tokens == FIXTURE["entries"][tag]["max_tokens"], tag


def test_the_default_job_keeps_its_hinted_bandit():
    """`python train.py` trains on BanditHinted (a worked example, 10-token answers), not RAGEN's Bandit."""
    cfg = _composed()
    assert cfg["es_manager"]["train"]["env_configs"]["tags"] == ["BanditHinted"]
    assert cfg["es_manager"]["val"]["env_configs"]["tags"] == ["BanditHinted", "BanditHintedTest"]
    for tag, split in (("BanditHinted", "train"), ("BanditHintedTest", "test")):
        entry = cfg["custom_envs"][tag]
        assert entry["max_tokens"] == 10 and entry["format_example"]["answer"] == "<answer> wolf </answer>"
        assert entry["env_config"] == {"split": split}


@pytest.mark.parametrize("preset", ["env_bound", "mixed"])
def test_benchmark_presets_keep_larger_sokoban_at_depth_300(preset):
    """RAGEN's LargerSokoban has search_depth 10; the presets' figures in BENCHMARKS.md are at 300."""
    cfg = _composed(f"benchmark={preset}")
    assert cfg["custom_envs"]["LargerSokoban"]["env_config"]["search_depth"] == 300
