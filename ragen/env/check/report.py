"""What the env checker reports: one ``CheckResult`` per check, gathered in a
``CheckReport``.

- A *status* is ``pass``, ``fail`` (the rollout engine would break or give
  wrong results), ``warn`` (suspicious, the engine still works) or ``skip``
  (an earlier failure makes the check meaningless). ``CheckResult.ok`` is
  False only for ``fail``; ``CheckReport.ok`` is True when nothing failed.
- A report also holds what was checked (env type, env config, config type,
  seeds) and the reset/step timings, and renders as text (``format``) or as
  JSON-ready data (``as_dict``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CheckReport", "CheckResult"]


@dataclass
class CheckResult:
    """The outcome of one check: its name, status, what was found and how to fix it."""

    name: str
    status: str  # pass | fail | warn | skip
    message: str
    fix: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "fail"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "status": self.status, "message": self.message, "fix": self.fix}


@dataclass
class CheckReport:
    """Every check's result for one env type and config, with the seeds checked and the reset/step timings."""

    env_type: str
    env_config: Any
    config_type: str | None
    seeds: list[int]
    results: list[CheckResult] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # reset_/step_ mean_ms, p95_ms, n

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def __getitem__(self, name: str) -> CheckResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(name)

    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "fail"]

    def warnings(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "warn"]

    def add(self, name: str, status: str, message: str, fix: str = "") -> CheckResult:
        result = CheckResult(name, status, message, fix)
        self.results.append(result)
        return result

    def as_dict(self) -> dict[str, Any]:
        return {"env_type": self.env_type, "env_config": _jsonable(self.env_config), "config_type": self.config_type,
                "seeds": self.seeds, "ok": self.ok, "results": [r.as_dict() for r in self.results],
                "timings": self.timings}

    def format(self) -> str:
        lines = [f"env check: {self.env_type}" + (f" (config_type {self.config_type})" if self.config_type else "")
                 + f", seeds {_seed_range(self.seeds)}"]
        for r in self.results:
            lines.append(f"  {r.status.upper():5} {r.name:16} {r.message}")
            if r.fix and r.status in ("fail", "warn"):
                lines.append(f"  {'':5} {'':16} fix: {r.fix}")
        n_fail, n_warn = len(self.failures()), len(self.warnings())
        lines.append(("OK" if self.ok else "FAILED") + f": {n_fail} failed, {n_warn} warning(s), "
                     f"{sum(r.status == 'pass' for r in self.results)} passed")
        return "\n".join(lines)


def _seed_range(seeds: Sequence[int]) -> str:
    if seeds and list(seeds) == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}..{seeds[-1]}"
    return ", ".join(map(str, seeds))


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except (TypeError, ValueError):
        return repr(x)
