"""The env checker's command line (``python -m ragen.tools.check``).

    python -m ragen.tools.check sokoban
    python -m ragen.tools.check my_pkg.envs:MyEnv --config-type my_pkg.envs:MyConfig \\
        --config size=6 --config 'names=[a, b]' --seeds 8
    python -m ragen.tools.check SimpleSokoban          # a tag of config/envs.yaml
    python -m ragen.tools.check sokoban --env-config '{"dim_room": [6, 6]}' --first-seed 7

The env is a registered name, an import path ``package.module:EnvClass``, or a
tag of ``custom_envs`` in an envs YAML file (by default the ``config/envs.yaml``
shipped with ragen); ``--env-config`` gives a whole ``env_config`` as JSON (as a
rollout's log line for a failed env does), and ``--config key=value`` items
(values parsed as YAML) go over it or over the tag's. A tag is first read as ``train.py`` reads it
(``ragen.rollout.envs.tag_spec``): what that refuses fails the build check.
Prints the report; exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

from ragen.config_files import config_dir
from ragen.env import to_plain
from ragen.env.check import CheckReport, check_env

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


def _json_object(text: str) -> dict[str, Any]:
    """``--env-config``'s value: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object {{...}} of env_config keys, got {text!r:.80}")
    return value


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def _default_envs_yaml() -> Path:
    return config_dir() / "envs.yaml"


def _custom_envs(envs_yaml: Path) -> dict[str, Any]:
    """``custom_envs`` of an envs YAML file (empty when there is no such file)."""
    if not envs_yaml.is_file():
        return {}
    import yaml

    data = yaml.safe_load(envs_yaml.read_text()) or {}
    return dict(data.get("custom_envs") or {})


def _read_as_train_does(tag: str, custom_envs: dict[str, Any], report: CheckReport) -> bool:
    """Whether ``train.py``'s config read takes ``tag``; when not, the build check fails saying why."""
    from ragen.rollout.envs import tag_spec

    try:
        tag_spec(tag, custom_envs)
    except ValueError as exc:
        report.add("build", "fail", f"train.py's config read refuses the tag: {exc}",
                   "the message names the key at fault: train.py stops there before any model loads")
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    from ragen.env import REGISTERED_ENV_CONFIGS, REGISTERED_ENVS

    parser = argparse.ArgumentParser(
        prog="python -m ragen.tools.check",
        description="Check that an env keeps the contract of the rollout engine.")
    parser.add_argument("env", help="a registered env name (e.g. sokoban), an import path 'package.module:EnvClass', "
                                    "a tag of custom_envs in config/envs.yaml (e.g. SimpleSokoban), or an env "
                                    "library's item: reasoning_gym:<dataset>, textarena:<game id>")
    parser.add_argument("--config-type", default=None, help="'package.module:ConfigClass' of the env config")
    parser.add_argument("--env-config", type=_json_object, default=None, metavar="JSON",
                        help="the whole env_config as a JSON object (--config items go over it)")
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
        overrides = _merge(args.env_config or {}, parse_config_args(args.config))
    except ValueError as exc:
        parser.error(str(exc))
    env_type, config_type, env_config = args.env, args.config_type, overrides
    name, _, item = env_type.partition(":")
    shorthand = getattr(REGISTERED_ENV_CONFIGS.get(name), "SHORTHAND_KEY", None)
    tag = None
    if item and shorthand:  # reasoning_gym:chain_sum, textarena:Mastermind-v0
        env_type, env_config = name, {shorthand: item, **overrides}
    elif env_type not in REGISTERED_ENVS and ":" not in env_type:
        custom_envs = to_plain(_custom_envs(args.envs_yaml))
        spec = custom_envs.get(env_type)
        if isinstance(spec, dict):
            print(f"tag {env_type} of {args.envs_yaml}: env_type {spec.get('env_type')}")
            tag, env_type = env_type, spec.get("env_type", env_type)
            config_type = config_type or spec.get("config_type")
            env_config = _merge(spec.get("env_config") or {}, overrides)
            custom_envs[tag] = {**spec, "env_config": env_config, "config_type": config_type}
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    report = CheckReport(env_type, env_config or None, config_type, seeds)
    if tag is None or _read_as_train_does(tag, custom_envs, report):
        report = check_env(env_type, env_config or None, config_type, seeds=seeds, max_steps=args.max_steps)
    print(report.format())
    if args.json:
        args.json.write_text(json.dumps(report.as_dict(), indent=2))
        print(f"wrote {args.json}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
