"""Environments and their registry.

Concepts:

- **Env type**: how a config names an env class (``custom_envs.<tag>.env_type``):
  either a registered name (``"sokoban"``, ``"frozen_lake"``, ``"bandit"``,
  ``"countdown"``, ``"code"``, ``"search"``, ``"reasoning_gym"``, ``"textarena"``, ``"remote"``) or an import path ``"package.module:EnvClass"``, so users add
  envs without editing this package.
- **Env config**: the dataclass an env is built from, as in RAGEN:
  ``EnvClass(ConfigClass(**env_config))``. For a registered name the config class
  is registered with it. For an import path it is, in order: the class named by
  ``config_type`` (``"package.module:ConfigClass"``); else the env class's
  ``config_cls`` attribute, if it has one; else there is none and the env gets
  the ``env_config`` mapping itself as a plain ``dict`` (``None`` when empty).
- **Validation**: config dataclasses check their values in ``__post_init__``
  and raise ``EnvConfigError`` naming the field; ``make_env_config`` also
  rejects unknown keys and puts the tag's config path in front of the field,
  e.g. ``custom_envs.LargerSokoban.env_config.num_boxes: 40 boxes do not fit
  in a 6x6 room ...``.

``env_config`` may be any Mapping (OmegaConf's DictConfig included); it is
converted to plain dicts and lists before the config class sees it.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .bandit import BanditEnv, BanditEnvConfig
from .base import BaseDiscreteActionEnv, BaseEnv, BaseEnvConfig, BaseLanguageBasedEnv
from .config_checks import EnvConfigError, to_plain
from .code import CodeEnv, CodeEnvConfig
from .countdown import CountdownEnv, CountdownEnvConfig
from .reasoning_gym import ReasoningGymEnv, ReasoningGymEnvConfig
from .search import SearchEnv, SearchEnvConfig
from .remote import RemoteEnv, RemoteEnvConfig
from .textarena import TextArenaEnv, TextArenaEnvConfig
from .frozen_lake import FrozenLakeEnv, FrozenLakeEnvConfig
from .sokoban import SokobanEnv, SokobanEnvConfig

logger = logging.getLogger(__name__)

__all__ = [
    "REGISTERED_ENVS",
    "REGISTERED_ENV_CONFIGS",
    "BanditEnv",
    "BanditEnvConfig",
    "BaseDiscreteActionEnv",
    "BaseEnv",
    "BaseEnvConfig",
    "BaseLanguageBasedEnv",
    "CountdownEnv",
    "CountdownEnvConfig",
    "EnvConfigError",
    "EnvImportError",
    "FrozenLakeEnv",
    "FrozenLakeEnvConfig",
    "SokobanEnv",
    "SokobanEnvConfig",
    "import_object",
    "make_env",
    "make_env_config",
    "register_env",
    "resolve_env_type",
]

REGISTERED_ENVS: dict[str, type] = {}
REGISTERED_ENV_CONFIGS: dict[str, type] = {}


def register_env(name: str, env_cls: type, config_cls: type) -> None:
    """Make ``name`` usable as an ``env_type``.

    Registering the same classes again is a no-op; registering other classes
    under a taken name replaces them, with a warning in the log.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"env name must be a non-empty string without ':', got {name!r}")
    if not isinstance(env_cls, type):
        raise TypeError(f"env_cls for {name!r} must be a class, got {env_cls!r}")
    if not isinstance(config_cls, type):
        raise TypeError(f"config_cls for {name!r} must be a class, got {config_cls!r}")
    old = (REGISTERED_ENVS.get(name), REGISTERED_ENV_CONFIGS.get(name))
    if old[0] is not None and old != (env_cls, config_cls):
        logger.warning("env %r re-registered: %s replaces %s", name, env_cls.__qualname__, old[0].__qualname__)
    REGISTERED_ENVS[name] = env_cls
    REGISTERED_ENV_CONFIGS[name] = config_cls


def _where(tag: str | None, key: str) -> str:
    return f"custom_envs.{tag}.{key}" if tag else key


class EnvImportError(ImportError, ConfigError):
    """An ``env_type``/``config_type`` import path that cannot be imported.

    A ``ConfigError`` (so a ``ValueError``) too: the command lines turn
    ``ValueError`` into one ``error:`` line (exit 2), and this must take the
    same path whatever the imported module raised."""


def import_object(path: str, where: str, form: str = "package.module:ClassName") -> Any:
    """The object an import path ``package.module:name`` names (``form`` says what is expected); a
    ``ConfigError`` naming ``where`` (the config key) when it is not such a path, ``EnvImportError``
    when its module or attribute cannot be imported."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name.strip() or not attr.strip():
        raise ConfigError(f"{where}: {path!r} is not an import path of the form {form!r}")
    module_name = module_name.strip()
    try:
        obj = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # any failure while importing user code, not only ImportError
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            fix = "; is it installed, or its folder on PYTHONPATH?"
        else:
            fix = f" (raised by module {module_name!r} while it was imported); fix that module"
        raise EnvImportError(f"{where}: cannot import {path!r}: {type(exc).__name__}: {exc}{fix}") from exc
    for part in attr.strip().split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise EnvImportError(
                f"{where}: cannot import {path!r}: module {module_name!r} has no attribute {attr!r}"
            ) from exc
    return obj


def _import_object(path: str, key: str, tag: str | None) -> Any:
    obj = import_object(path, _where(tag, key))
    if not isinstance(obj, type):
        raise ConfigError(f"{_where(tag, key)}: {path!r} is not a class, got {obj!r}")
    return obj


def resolve_env_type(
    env_type: str, config_type: str | None = None, tag: str | None = None
) -> tuple[type, type | None]:
    """(env class, config class or None) for an ``env_type`` (see the module docstring)."""
    if not isinstance(env_type, str) or not env_type:
        raise ConfigError(f"{_where(tag, 'env_type')}: expected an env name or import path, got {env_type!r}")
    if env_type in REGISTERED_ENVS:
        env_cls = REGISTERED_ENVS[env_type]
        config_cls = REGISTERED_ENV_CONFIGS[env_type]
    elif ":" in env_type:
        env_cls = _import_object(env_type, "env_type", tag)
        config_cls = getattr(env_cls, "config_cls", None)
    else:
        raise ConfigError(
            f"{_where(tag, 'env_type')}: unknown env type {env_type!r}; registered: "
            f"{sorted(REGISTERED_ENVS)}; or give an import path 'package.module:EnvClass'"
        )
    if config_type is not None:
        config_cls = _import_object(config_type, "config_type", tag)
    return env_cls, config_cls


_UNCHECKED_SAID: set[tuple[str, str | None]] = set()


def _say_unchecked(env_type: str, tag: str | None, values: dict[str, Any]) -> None:
    """Once a process for each tag: an env without a config class gets its env_config as a dict, unchecked."""
    if (env_type, tag) in _UNCHECKED_SAID:
        return
    _UNCHECKED_SAID.add((env_type, tag))
    logger.warning("%s: %s has no config class (a config_cls attribute, or the tag's config_type), so its "
                   "env_config reaches it as a plain dict, keys unchecked: %r (docs/envs.md, 'Your own env')",
                   _where(tag, "env_config"), env_type, values)


def make_env_config(
    env_type: str,
    env_config: Mapping[str, Any] | None,
    config_type: str | None = None,
    tag: str | None = None,
) -> Any:
    """The config object an env of ``env_type`` is built from.

    Returns ``ConfigClass(**env_config)``, or the plain dict (``None`` when
    empty) for an env class without a config class. An ``env_config`` that is
    already an instance of the config class is returned as it is. Invalid
    values raise ``ConfigError`` (a ``ValueError``) naming
    ``custom_envs.<tag>.env_config.<field>``.
    """
    _, config_cls = resolve_env_type(env_type, config_type, tag)
    prefix = _where(tag, "env_config")
    if config_cls is not None and isinstance(env_config, config_cls):
        return env_config
    values = {} if env_config is None else to_plain(env_config)
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix}: expected a mapping of config keys to values, got {env_config!r}")
    for key in values:
        if not isinstance(key, str):
            raise ConfigError(f"{prefix}: config keys must be strings, got {key!r}")
    if config_cls is None:
        if values:
            _say_unchecked(env_type, tag, values)
        return values or None
    if dataclasses.is_dataclass(config_cls):
        known = sorted(f.name for f in dataclasses.fields(config_cls) if f.init)
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(
                f"{prefix}.{unknown[0]}: unknown key for {config_cls.__name__} "
                f"(unknown: {unknown}); known keys: {known}"
            )
    try:
        return config_cls(**values)
    except EnvConfigError as exc:
        raise exc.at(prefix) from None
    except ValueError as exc:  # a user config class validating without EnvConfigError
        raise ConfigError(f"{prefix}: {exc}") from exc
    except TypeError as exc:  # a config class that is not a dataclass, wrong arguments
        raise ConfigError(f"{prefix}: cannot build {config_cls.__name__}: {exc}") from exc


def make_env(
    env_type: str,
    env_config: Mapping[str, Any] | None = None,
    config_type: str | None = None,
    tag: str | None = None,
) -> Any:
    """A new env: ``EnvClass(make_env_config(...))``."""
    env_cls, _ = resolve_env_type(env_type, config_type, tag)
    return env_cls(make_env_config(env_type, env_config, config_type, tag))


register_env("sokoban", SokobanEnv, SokobanEnvConfig)
register_env("frozen_lake", FrozenLakeEnv, FrozenLakeEnvConfig)
register_env("bandit", BanditEnv, BanditEnvConfig)
register_env("countdown", CountdownEnv, CountdownEnvConfig)
register_env("code", CodeEnv, CodeEnvConfig)
register_env("search", SearchEnv, SearchEnvConfig)
register_env("reasoning_gym", ReasoningGymEnv, ReasoningGymEnvConfig)
register_env("textarena", TextArenaEnv, TextArenaEnvConfig)
register_env("remote", RemoteEnv, RemoteEnvConfig)


def clear_caches() -> None:
    """Forget memoized generation (Sokoban rooms), so the next resets pay their
    full cost again: benchmarks call this between timed runs."""
    from .sokoban.generator import generate_room
    from .sokoban.ragen_rooms import generate_ragen_room

    generate_room.cache_clear()
    generate_ragen_room.cache_clear()
