"""Where ragen's YAML configs are, for tools that run from an installed ragen.

The repository's ``config/`` folder (Hydra's config tree for ``train.py``)
holds the one copy of every YAML file. In the source tree ``ragen/_config`` is
a symlink to it, and ``setup.py`` ships the files under it as package data, so
``python -m ragen.tools.check`` and ``python -m ragen.tools.soak`` find ``envs.yaml``
and ``soak.yaml`` next to ragen's modules, whether ragen is installed editable
(or run from a checkout) or not. ``compose`` is a config of them composed by
Hydra, as plain data (the tools' ``--config-name``).

``run_name`` is the OmegaConf resolver ``ragen.run_name`` that the YAML names a
run's experiment with (``trainer.experiment_name``): after what it trains.
``register_resolvers`` registers it; Hydra does so itself as it starts, by
importing ``hydra_plugins/ragen_resolvers`` (Hydra imports every module of the
``hydra_plugins`` namespace), so a config composed by Hydra anywhere (train.py,
``compose``, a test, a script) resolves.
"""

from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["compose", "config_dir", "register_resolvers", "run_name"]


def config_dir() -> Path:
    """The folder of ragen's YAML configs (``envs.yaml``, ``soak.yaml``,
    ``base.yaml``, ``engine/``, ...): ``ragen/_config`` of the imported ragen."""
    # ragen is installed as plain files (never zipped): Hydra needs a real folder
    return Path(str(files("ragen").joinpath("_config")))


def compose(config_name: str, overrides: Sequence[str] = (), where: Path | None = None) -> dict[str, Any]:
    """Config ``config_name`` of ``where`` (default: ``config_dir()``) composed by Hydra with
    ``overrides``, as plain data, interpolations resolved."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_resolvers()  # where Hydra's plugins are not installed with ragen (an older editable install)
    with initialize_config_dir(str((where or config_dir()).resolve()), version_base=None):
        cfg = hydra_compose(config_name, overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


def run_name(tags: Sequence[str] | None, envs: Mapping[str, Any] | None, estimator: str) -> str:
    """``<env types>_<estimator>``: what a run trains, as its experiment's name. The env types
    are those of the train ``tags`` (``custom_envs.<tag>.env_type``; a tag without an entry
    by its own name), each once, in order, joined by ``-``: ``bandit_grpo`` (BanditHinted),
    ``sokoban_grpo`` (SimpleSokoban), ``sokoban-frozen_lake_reinforce``. An env type named by
    an import path (``pkg.envs:MyEnv``) gives its last part; anything but letters, digits
    and ``_`` becomes ``_``, so the name is one folder."""
    kinds: list[str] = []
    for tag in tags or ():
        entry = (envs or {}).get(tag)
        env_type = str((entry.get("env_type") if isinstance(entry, Mapping) else None) or tag)
        kind = _folder_part(re.split(r"[:.]", env_type)[-1])
        if kind not in kinds:
            kinds.append(kind)
    return f"{'-'.join(kinds) or 'run'}_{_folder_part(str(estimator))}"


def _folder_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "_", text).strip("_") or "x"


def register_resolvers() -> None:
    """Register ``ragen.run_name`` with OmegaConf (again: harmless)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("ragen.run_name"):
        OmegaConf.register_new_resolver("ragen.run_name", run_name)
