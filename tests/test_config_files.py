"""``ragen.config_files``: the YAML configs ship with ragen, so its command-line
tools find them from an installed ragen, not only from a checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ragen.config_files import config_dir, run_name

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(30)
def test_config_dir_is_the_repository_config_folder():
    # one copy of each YAML: ragen/_config is config/, not a second tree
    assert config_dir().resolve() == (ROOT / "config").resolve()
    for name in ("envs.yaml", "soak.yaml", "base.yaml", "engine/scripted.yaml"):
        assert (config_dir() / name).is_file(), name


def test_run_name_names_what_the_run_trains_as_one_folder():
    envs = {"SimpleSokoban": {"env_type": "sokoban"}, "LargerSokoban": {"env_type": "sokoban"},
            "FrozenLake": {"env_type": "frozen_lake"}, "Mine": {"env_type": "my_pkg.envs:My Env"}}
    assert run_name(["SimpleSokoban"], envs, "grpo") == "sokoban_grpo"
    assert run_name(["SimpleSokoban", "FrozenLake", "LargerSokoban"], envs, "reinforce") == \
        "sokoban-frozen_lake_reinforce"
    assert run_name(["Mine"], envs, "grpo") == "My_Env_grpo"  # an import path: its last part
    assert run_name(["Not A/Tag"], envs, "grpo") == "Not_A_Tag_grpo"  # unknown: the env setup names it later
    assert run_name([], envs, "grpo") == "run_grpo"


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_tools_find_their_configs_in_a_non_editable_install(tmp_path):
    """``pip install .`` (not -e) into a folder, then run the tools from outside
    the repository with only that folder on the path: both read their default
    config (a tag of envs.yaml, soak.yaml) from the installed package."""
    src, target, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    src.mkdir()
    elsewhere.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("ragen", "config", "hydra_plugins"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=ignore)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          "--no-compile", "--quiet", "--target", str(target), str(src)],
                         cwd=elsewhere, capture_output=True, text=True, timeout=120)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    installed = target / "ragen" / "_config"
    assert (installed / "envs.yaml").is_file() and not installed.is_symlink()  # files, not a link to the checkout
    # Hydra's plugin that registers the resolver of trainer.experiment_name, wherever Hydra composes
    assert (target / "hydra_plugins" / "ragen_resolvers" / "__init__.py").is_file()

    env = {**os.environ, "PYTHONPATH": str(target)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=120)

    where = run("-c", "import ragen.env.check, ragen.tools.soak; print(ragen.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).resolve() == (target / "ragen" / "__init__.py").resolve()

    check = run("-m", "ragen.tools.check", "SimpleSokoban", "--seeds", "2")
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"tag SimpleSokoban of {installed / 'envs.yaml'}" in check.stdout and "OK: 0 failed" in check.stdout

    out = tmp_path / "soak.json"
    soak = run("-m", "ragen.tools.soak", "--rollouts", "1", "--ref", "1", "--json", str(out),
               "es_manager.train.env_groups=2", "es_manager.train.group_size=1",
               "es_manager.train.env_configs.tags=[Bandit]", "es_manager.train.env_configs.n_groups=[2]",
               "agent_proxy.parallel_n_jobs=1", "agent_proxy.max_turn=2")
    assert soak.returncode == 0, soak.stdout + soak.stderr
    assert out.is_file() and "OK" in soak.stdout
