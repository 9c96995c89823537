"""The env checker: tells an env author what in an env breaks the rollout engine.

    python -m ragen.tools.check sokoban     (the command line: ``ragen.tools.check``)

Concepts, one module each:

- ``checker``: ``check_env(env_type, env_config, config_type, seeds)`` builds
  the env as a worker does and runs every check (the invariants of DESIGN.md).
- ``report``: ``CheckReport``, a list of ``CheckResult`` (``name``, ``ok``,
  ``status``, ``message``, ``fix``) plus reset/step timings; a status is
  ``pass``, ``fail``, ``warn`` or ``skip``, and the report is ok when nothing
  failed.
"""

from ragen.env.check.checker import check_env
from ragen.env.check.report import CheckReport, CheckResult

__all__ = ["CheckReport", "CheckResult", "check_env"]
