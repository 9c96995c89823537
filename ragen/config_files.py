"""Where ragen's YAML configs are, for tools that run from an installed ragen.

The repository's ``config/`` folder (Hydra's config tree for ``train.py``)
holds the one copy of every YAML file. In the source tree ``ragen/_config`` is
a symlink to it, and ``setup.py`` ships the files under it as package data, so
``python -m ragen.tools.check`` and ``python -m ragen.tools.soak`` find ``envs.yaml``
and ``soak.yaml`` next to ragen's modules, whether ragen is installed editable
(or run from a checkout) or not. ``compose`` is a config of them composed by
Hydra, as plain data (the tools' ``--config-name``).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any, Sequence

__all__ = ["compose", "config_dir"]


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

    with initialize_config_dir(str((where or config_dir()).resolve()), version_base=None):
        cfg = hydra_compose(config_name, overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)
