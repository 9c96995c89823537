"""The command line that checks one env alone: what a rollout prints beside an env that failed.

``check_command(env_type, env_config, config_type, seed)`` names the env as its worker built it
(the env type, its config type, and the whole ``env_config`` as JSON in ``--env-config``), so
the command runs wherever the tag came from: ``config/envs.yaml``, a user's own config, or an
override on the command line.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from typing import Any

__all__ = ["check_command"]


def check_command(env_type: str, env_config: Mapping[str, Any] | None, config_type: str | None, seed: int) -> str:
    """``python -m ragen.tools.check`` with the env's type, config and ``--first-seed seed``, quoted for a shell."""
    argv = ["python", "-m", "ragen.tools.check", env_type]
    if config_type:
        argv += ["--config-type", config_type]
    if env_config:
        argv += ["--env-config", json.dumps(env_config, ensure_ascii=False, default=str)]
    argv += ["--first-seed", str(seed)]
    return shlex.join(argv)
