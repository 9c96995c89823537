"""verl's dataset of ragen's env sets (``python -m ragen.tools.verl_data``)."""

from __future__ import annotations

import re

import pandas as pd
import pytest
import yaml

from ragen.rollout.envs import EnvSpecMaker
from ragen.tools.verl_data import main
from ragen.verl.setup import load_envs

pytestmark = pytest.mark.timeout(120)

SMALL = ["es_manager.train.env_groups=3", "es_manager.train.group_size=4",
         "es_manager.train.env_configs.tags=[SimpleSokoban,Bandit]", "es_manager.train.env_configs.n_groups=[2,1]",
         "es_manager.val.env_groups=5", "es_manager.val.env_configs.n_groups=[5]"]


def test_one_row_per_group_with_ragens_seeds_and_the_files_verl_reads(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--steps", "2", *SMALL]) == 0
    train = pd.read_parquet(tmp_path / "train.parquet")
    val = pd.read_parquet(tmp_path / "val.parquet")
    assert len(train) == 2 * 3 and len(val) == 5
    cfg = yaml.safe_load((tmp_path / "ragen_config.yaml").read_text())
    maker = EnvSpecMaker("train", cfg["es_manager"]["train"], cfg["custom_envs"], cfg["seed"]["train"])
    want = [(s.tag, s.seed) for r in range(2) for s in maker.make_specs(r)[::4]]  # a group's first env
    assert list(zip(train["tag"], train["seed"])) == want
    assert list(train["agent_name"]) == ["ragen_env"] * 6 and set(train["split"]) == {"train"}
    assert [e["index"] for e in train["extra_info"]] == list(range(6))
    assert list(val["seed"]) == [cfg["seed"]["val"] + g for g in range(5)]
    assert train["prompt"][0][0]["role"] == "user" and train["data_source"][0] == "ragen/SimpleSokoban"
    overrides = (tmp_path / "verl_overrides.txt").read_text().split()
    assert "actor_rollout_ref.rollout.n=4" in overrides and "data.train_batch_size=3" in overrides
    assert f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path / 'agent_loop.yaml'}" in overrides
    (entry,) = yaml.safe_load((tmp_path / "agent_loop.yaml").read_text())
    assert entry["name"] == "ragen_env" and entry["_target_"] == "ragen.verl.agent_loop.RagenEnvAgentLoop"
    envs = load_envs(entry["ragen_config"])  # what the agent loop reads
    spec, config = envs.spec(train.iloc[0].to_dict())
    assert (spec.tag, spec.seed, config.max_turn) == ("SimpleSokoban", cfg["seed"]["train"], 5)
    assert "wrote 6 train and 5 val rows" in capsys.readouterr().out


COUNTS = ["+custom_envs.Counts.env_type=agent", "+custom_envs.Counts.env_config.entry=tests.agent_programs:counts",
          "+custom_envs.Counts.env_config.tasks=tests.agent_programs:task_of"]


def test_agent_tags_rows_name_the_agent_program_loop(tmp_path):
    assert main(["--out", str(tmp_path), "--steps", "1", *COUNTS, "es_manager.train.env_groups=2",
                 "es_manager.train.env_configs.tags=[Bandit,Counts]", "es_manager.train.env_configs.n_groups=[1,1]",
                 "es_manager.val.env_groups=1", "es_manager.val.env_configs.n_groups=[1]"]) == 0
    train = pd.read_parquet(tmp_path / "train.parquet")
    assert list(zip(train["tag"], train["agent_name"])) == [("Bandit", "ragen_env"), ("Counts", "ragen_agent")]
    entries = yaml.safe_load((tmp_path / "agent_loop.yaml").read_text())
    assert [(e["name"], e["_target_"]) for e in entries] == [
        ("ragen_env", "ragen.verl.agent_loop.RagenEnvAgentLoop"),
        ("ragen_agent", "ragen.verl.agent_program_loop.RagenAgentLoop")]
    assert {e["ragen_config"] for e in entries} == {str(tmp_path / "ragen_config.yaml")}
    spec, _ = load_envs(entries[1]["ragen_config"]).spec(train.iloc[1].to_dict())
    assert spec.is_agent and spec.tag == "Counts"


def test_a_bad_config_is_refused_before_anything_is_written(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "out"), "ctx_manager.token_history=rerender"]) == 2
    assert "ctx_manager.token_history='rerender'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(["--out", str(tmp_path / "out"), "es_manager.train.env_configs.tags=[Nope]"]) == 2
    assert "Nope" in capsys.readouterr().err
    # verl trains one sequence a sample: an agent episode's first segment, never a sample per call
    assert main(["--out", str(tmp_path / "out"), *COUNTS, "agent.sample_shape=call"]) == 2
    assert "agent.sample_shape='call'" in capsys.readouterr().err


def test_an_out_folder_of_any_name_is_read_back_as_written(tmp_path):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = tmp_path / "run #1: it's [a], b\\c"
    assert main(["--out", str(out), "--steps", "1", *SMALL]) == 0
    (entry,) = yaml.safe_load((out / "agent_loop.yaml").read_text())
    assert entry["ragen_config"] == str(out / "ragen_config.yaml")
    load_envs(entry["ragen_config"])
    parser = OverridesParser.create()
    values = dict((o.key_or_group, o.value()) for o in parser.parse_overrides(
        (out / "verl_overrides.txt").read_text().splitlines()))
    assert values["data.train_files"] == str(out / "train.parquet")
    assert values["actor_rollout_ref.rollout.agent.agent_loop_config_path"] == str(out / "agent_loop.yaml")


@pytest.mark.parametrize("args,match", [
    (["--steps", "100000000"], r"--steps=100000000: 100,000,000 rollouts of es_manager.train.env_groups=3 groups "
                                r"make 300,000,000 rows, more than 1,000,000"),
    (["--steps", "0"], r"--steps=0: a whole number of training rollouts, at least 1"),
    (["trainer.total_training_steps=1e8"], r"trainer.total_training_steps=100000000.0: 100,000,000 rollouts"),
    (["trainer.total_training_steps=2.5"], r"trainer.total_training_steps=2.5: a whole number"),
])
def test_a_step_count_past_the_bound_is_refused_naming_it(tmp_path, capsys, args, match):
    assert main(["--out", str(tmp_path / "out"), *args, *SMALL]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_the_verl_extra_brings_what_verls_agent_loop_imports_and_the_docs_ask_for_nothing_by_hand():
    """verl 0.9.1 imports cachetools, uvicorn and fastapi in its agent loop without declaring them."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    setup = ast.parse((root / "setup.py").read_text())
    call = next(n for n in ast.walk(setup) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    names = {re.split(r"[<>=\[ ;]", req, maxsplit=1)[0] for req in extras["verl"]}
    assert {"verl", "pandas", "pyarrow", "cachetools", "uvicorn", "fastapi"} <= names
    docs = (root / "docs" / "verl.md").read_text()
    assert not re.search(r"pip install[^\n`#]*\b(cachetools|uvicorn|fastapi)\b", docs)
