"""The env checker's command line (``python -m ragen.tools.check``).

    python -m ragen.tools.check sokoban
    python -m ragen.tools.check my_pkg.envs:MyEnv --config-type my_pkg.envs:MyConfig \\
        --config size=6 --config 'names=[a, b]' --seeds 8
    python -m ragen.tools.check SimpleSokoban          # a tag of config/envs.yaml

The env is a registered name, an import path ``package.module:EnvClass``, or a
tag of ``custom_envs`` in an envs YAML file (by default the ``config/envs.yaml``
shipped with ragen); ``--config key=value`` items (values parsed as YAML) go
over the tag's ``env_config``. Prints the report; exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

from ragen.config_files import config_dir
from ragen.env import to_plain
from ragen.env.check.checker import check_env

__all__ = ["main", "parse_config_args"]


def _parse_value(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_config_args(items: Sequence[str]) -> dict[str, Any]:
    """``["size=6", "names=[a, b]", "room.dim=4"]`` -> a nested dict (values as YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--config {item!r}: expected key=value")
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--config {item!r}: {part} is both a value and a mapping")
        node[parts[-1]] = _parse_value(value)
    return out


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def _default_envs_yaml() -> Path:
    return config_dir() / "envs.yaml"


def _tag_spec(name: str, envs_yaml: Path) -> dict[str, Any] | None:
    """``custom_envs.<name>`` of an envs YAML file, if ``name`` is a tag there."""
    if not envs_yaml.is_file():
        return None
    import yaml

    data = yaml.safe_load(envs_yaml.read_text()) or {}
    spec = (data.get("custom_envs") or {}).get(name)
    return spec if isinstance(spec, dict) else None


def main(argv: Sequence[str] | None = None) -> int:
    from ragen.env import REGISTERED_ENV_CONFIGS, REGISTERED_ENVS

    parser = argparse.ArgumentParser(
        prog="python -m ragen.tools.check",
        description="Check that an env keeps the contract of the rollout engine.")
    parser.add_argument("env", help="a registered env name (e.g. sokoban), an import path 'package.module:EnvClass', "
                                    "a tag of custom_envs in config/envs.yaml (e.g. SimpleSokoban), or an env "
                                    "library's item: reasoning_gym:<dataset>, textarena:<game id>")
    parser.add_argument("--config-type", default=None, help="'package.module:ConfigClass' of the env config")
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="an env_config value (parsed as YAML: 6, 0.8, true, [a, b]); repeatable")
    parser.add_argument("--seeds", type=int, default=5, help="number of seeds (0..N-1); default 5")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds start here (first..first+N-1): the seed of an env that failed in a rollout")
    parser.add_argument("--max-steps", type=int, default=20, help="steps per checked episode; default 20")
    parser.add_argument("--envs-yaml", type=Path, default=_default_envs_yaml(), help="where tags are looked up")
    parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.max_steps < 1:
        parser.error("--max-steps must be >= 1")
    try:
        overrides = parse_config_args(args.config)
    except ValueError as exc:
        parser.error(str(exc))
    env_type, config_type, env_config = args.env, args.config_type, overrides
    name, _, item = env_type.partition(":")
    shorthand = getattr(REGISTERED_ENV_CONFIGS.get(name), "SHORTHAND_KEY", None)
    if item and shorthand:  # reasoning_gym:chain_sum, textarena:Mastermind-v0
        env_type, env_config = name, {shorthand: item, **overrides}
    elif env_type not in REGISTERED_ENVS and ":" not in env_type:
        spec = _tag_spec(env_type, args.envs_yaml)
        if spec is not None:
            print(f"tag {env_type} of {args.envs_yaml}: env_type {spec.get('env_type')}")
            env_type = spec.get("env_type", env_type)
            config_type = config_type or spec.get("config_type")
            env_config = _merge(to_plain(spec.get("env_config") or {}), overrides)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    report = check_env(env_type, env_config or None, config_type, seeds=seeds, max_steps=args.max_steps)
    print(report.format())
    if args.json:
        args.json.write_text(json.dumps(report.as_dict(), indent=2))
        print(f"wrote {args.json}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
