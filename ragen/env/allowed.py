"""Which env types a data file may name: those of the user's own setup, never the file's.

A rollout dump names each env's ``env_type`` and ``config_type``; building the
env imports that module and calls that class with the dump's ``env_config``.
A dump is data (a colleague sends one), so a crafted line naming
``subprocess:Popen`` must not run anything, and one naming ``this:X`` must not
even import ``this``. Tools that build envs from a file (``ragen.tools.replay``, the
viewer's grid symbols) therefore build only the types the user's setup names:

- a registered name (``REGISTERED_ENVS``; building it imports nothing new);
- an import path that the ``custom_envs`` of a config the user passes names,
  as an ``env_type`` or a ``config_type``;
- an import path allowed by hand (``--allow-env-type package.module:Class``).

- ``AllowedEnvTypes``: that set. ``check(env_type, config_type, tag)`` raises
  ``EnvTypeNotAllowed``, naming the type and how to allow it, before anything
  is imported; ``allows(...)`` says the same as a bool.
- ``allowed_env_types(configs=(), allow=())``: the set from config files and
  import paths.
- ``add_allow_options(parser, use)``: the ``--config`` and
  ``--allow-env-type`` options of a command that reads dumps, whose values
  ``allowed_env_types`` takes.
- ``custom_envs_of(path)``: the ``custom_envs`` of a config file: an envs YAML
  (``config/envs.yaml``), the ``config.yaml`` train.py writes in a run folder,
  or a Hydra config with a defaults list (``config/base.yaml``), composed from
  its folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RagenError
from . import REGISTERED_ENVS

__all__ = ["AllowedEnvTypes", "EnvTypeNotAllowed", "add_allow_options", "allowed_env_types", "custom_envs_of"]


class EnvTypeNotAllowed(RagenError, ValueError):
    """An env or config type that the user's setup does not name; the message says how to allow it."""


@dataclass(frozen=True)
class AllowedEnvTypes:
    """The env types a file may name: registered names, plus ``paths`` (import paths)."""

    paths: frozenset[str] = frozenset()

    def refused(self, env_type: Any, config_type: Any = None) -> list[str]:
        """Which of ``env_type`` and ``config_type`` this setup does not name (as written)."""
        out = []
        if not isinstance(env_type, str) or not (env_type in REGISTERED_ENVS or env_type in self.paths):
            out.append(f"env type {env_type!r}")
        if config_type is not None and (not isinstance(config_type, str) or config_type not in self.paths):
            out.append(f"config type {config_type!r}")
        return out

    def allows(self, env_type: Any, config_type: Any = None) -> bool:
        return not self.refused(env_type, config_type)

    def check(self, env_type: Any, config_type: Any = None, tag: Any = None) -> None:
        """Raise ``EnvTypeNotAllowed`` unless this setup names ``env_type`` (and ``config_type``)."""
        refused = self.refused(env_type, config_type)
        if not refused:
            return
        names = [n for n, r in ((env_type, "env"), (config_type, "config")) if any(x.startswith(r) for x in refused)]
        flags = " ".join(f"--allow-env-type {n}" for n in names)
        allowed = ", ".join(sorted(self.paths)) or "none"
        raise EnvTypeNotAllowed(
            f"{' and '.join(refused)} (tag {tag!r}): not named by this setup (registered: "
            f"{', '.join(sorted(REGISTERED_ENVS))}; import paths allowed: {allowed}), and building it would import "
            f"and run that code. If you trust it, allow it with {flags}, or pass --config with a config whose "
            "custom_envs names it")


def _is_import_path(text: Any) -> bool:
    module, sep, attr = text.partition(":") if isinstance(text, str) else ("", "", "")
    return bool(sep and module.strip() and attr.strip())


def add_allow_options(parser: Any, use: str) -> None:
    """``--config FILE`` and ``--allow-env-type MODULE:CLASS`` (both repeatable)
    on an ``argparse`` parser; ``use`` says what the command does with an
    allowed type ("build", "build the config class of")."""
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help=f"{use} the env types named by this config's custom_envs (an envs YAML, a run "
                             "folder's config.yaml, or a Hydra config such as config/base.yaml; repeatable)")
    parser.add_argument("--allow-env-type", action="append", default=[], metavar="MODULE:CLASS",
                        help=f"{use} this env or config type, an import path the dump names (repeatable); "
                             "only for dumps you trust: it imports that module and runs its code")


def allowed_env_types(configs: Iterable[str | os.PathLike] = (), allow: Iterable[str] = ()) -> AllowedEnvTypes:
    """The registered names, the import paths named by the ``custom_envs`` of
    each config file in ``configs``, and the import paths in ``allow``.
    A bad path or config raises ``ValueError`` naming it."""
    paths = set()
    for item in allow:
        if not _is_import_path(item):
            raise ValueError(f"--allow-env-type {item!r}: expected an import path 'package.module:Class' "
                             f"(registered names need no allowing: {', '.join(sorted(REGISTERED_ENVS))})")
        paths.add(item)
    for config in configs:
        for tag, spec in custom_envs_of(config).items():
            if not isinstance(spec, Mapping):
                raise ValueError(f"{config}: custom_envs.{tag}: expected a mapping, got {spec!r}")
            paths.update(v for v in (spec.get("env_type"), spec.get("config_type")) if _is_import_path(v))
    return AllowedEnvTypes(frozenset(paths))


def custom_envs_of(path: str | os.PathLike) -> Mapping[str, Any]:
    """The ``custom_envs`` of the config file at ``path`` (see the module docstring)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such config file; give an envs YAML (config/envs.yaml), a run "
                         "folder's config.yaml or a Hydra config (config/base.yaml)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: not a readable YAML config ({_one_line(exc)})") from None
    if isinstance(data, Mapping) and "custom_envs" not in data and "defaults" in data:
        data = _compose(path)
    envs = data.get("custom_envs") if isinstance(data, Mapping) else None
    if not isinstance(envs, Mapping):
        raise ValueError(f"{path}: no custom_envs mapping in it; give an envs YAML (config/envs.yaml), a run "
                         "folder's config.yaml or a Hydra config (config/base.yaml)")
    return envs


def _compose(path: Path) -> Mapping[str, Any]:
    """A Hydra config with a defaults list, composed from its own folder."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(str(path.parent.resolve()), version_base=None):
            cfg = compose(path.stem)
        envs = OmegaConf.to_container(cfg.get("custom_envs"), resolve=True) if "custom_envs" in cfg else None
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ValueError(f"{path}: cannot compose this Hydra config ({type(exc).__name__}: {_one_line(exc)})") \
            from None
    return {"custom_envs": envs}


def _one_line(exc: BaseException) -> str:
    """An error's text on one line (YAML's and Hydra's span several): a command line prints one."""
    return " ".join(str(exc).split())
