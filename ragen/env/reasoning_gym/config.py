"""Configuration of the reasoning-gym env: which dataset, its own options, and the attempts.

``env_config: {dataset: <name>, attempts: 1, <the dataset's own options>}``, and how answers are
scored: ``sandbox`` (the backend the scorer processes run in, as the code env's), ``scorer_wall_s``
(one answer's scoring time) and ``scorer_memory_mb``; and the bounds of a question:
``item_wall_s`` (its making, in a scorer process) and ``max_observation_chars`` (its length).
The dataset's options are read by its own config class (reasoning-gym's
``<Name>Config``) and checked by its ``validate``, here, when the config is
built: an unknown option or value names the key. An unknown dataset name lists
the close matches. reasoning-gym is an optional package
(``pip install -e '.[envs]'``).
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any

from ..config_checks import EnvConfigError, check_int, check_number, check_str
from ..observation_bound import DEFAULT_MAX_OBSERVATION_CHARS, check_max_observation_chars
from ..sandbox import BACKENDS, Limits, SandboxUnavailable, backend
from .scoring import LIFE_CPU_S, START_S

__all__ = ["ReasoningGymEnvConfig", "datasets"]

# the keys of this env; every other key of env_config is the dataset's option
OWN_KEYS = ("dataset", "attempts", "invalid_act", "invalid_act_score", "sandbox", "scorer_wall_s",
            "scorer_memory_mb", "item_wall_s", "max_observation_chars")


def datasets() -> dict[str, tuple[type, type]]:
    """reasoning-gym's datasets: name -> (dataset class, config class)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise EnvConfigError("dataset", "needs the reasoning-gym package: pip install -e '.[envs]' "
                                        f"(or pip install reasoning-gym==0.1.25): {exc}") from None
    return DATASETS


class ReasoningGymEnvConfig:
    """``dataset``: a reasoning-gym dataset name; ``attempts``: answers an episode
    may give (1: one answer ends it; more: a wrong one shows its score and the
    episode goes on); ``sandbox``: ``auto``, ``bwrap``, ``unshare`` or ``none``, what the scorer
    processes run in (``auto`` refuses when none isolates; ``none`` is named to run them unisolated);
    ``scorer_wall_s``: an answer's scoring time, past which it scores 0; ``scorer_memory_mb``: a scorer
    process's memory; ``item_wall_s``: the time a reset's question may take to make (in a scorer
    process, before this one makes it), past which the reset fails; ``max_observation_chars``: the
    longest question; ``options``: the dataset's own options (the other keys)."""

    SHORTHAND_KEY = "dataset"  # python -m ragen.tools.check reasoning_gym:<dataset>

    def __init__(self, dataset: str = "chain_sum", attempts: int = 1, invalid_act: str = "",
                 invalid_act_score: float = 0.0, sandbox: str = "auto", scorer_wall_s: float = 5.0,
                 scorer_memory_mb: int = 1024, item_wall_s: float = 60.0,
                 max_observation_chars: int = DEFAULT_MAX_OBSERVATION_CHARS, **options: Any) -> None:
        self.dataset = check_str("dataset", dataset)
        known = datasets()
        if self.dataset not in known:
            close = difflib.get_close_matches(self.dataset, list(known), n=5, cutoff=0.5)
            hint = f"; close matches: {close}" if close else f"; {len(known)} datasets, e.g. {sorted(known)[:8]}"
            raise EnvConfigError("dataset", f"unknown reasoning-gym dataset {self.dataset!r}{hint}")
        self.attempts = check_int("attempts", attempts, minimum=1, maximum=100)
        self.invalid_act = invalid_act
        self.invalid_act_score = check_number("invalid_act_score", invalid_act_score)
        self.sandbox = check_str("sandbox", sandbox, choices=BACKENDS)
        self.scorer_wall_s = check_number("scorer_wall_s", scorer_wall_s, minimum=0.1, maximum=600)
        self.scorer_memory_mb = check_int("scorer_memory_mb", scorer_memory_mb, minimum=256, maximum=65536)
        self.item_wall_s = check_number("item_wall_s", item_wall_s, minimum=0.1, maximum=600)
        self.max_observation_chars = check_max_observation_chars(max_observation_chars)
        try:
            backend(self.sandbox)  # probed once a process
        except SandboxUnavailable as exc:
            raise EnvConfigError("sandbox", str(exc)) from None
        _, config_cls = known[self.dataset]
        for key in ("seed", "size"):
            if key in options:
                raise EnvConfigError(key, "set by the env: the reset seed picks the item")
        try:
            built = config_cls(**options)
            if hasattr(built, "validate"):  # most datasets' configs have one
                built.validate()
        except TypeError as exc:  # an option the dataset's config does not take
            fields = sorted(getattr(config_cls, "__dataclass_fields__", {}))
            bad = sorted(set(options) - set(fields))
            raise EnvConfigError(bad[0] if bad else "options",
                                 f"not an option of reasoning-gym's {config_cls.__name__} ({exc}); its options: "
                                 f"{[f for f in fields if f not in ('seed', 'size')]}") from None
        except (AssertionError, ValueError) as exc:  # reasoning-gym's validate() asserts
            field = next(iter(options)) if len(options) == 1 else "<dataset options>"
            raise EnvConfigError(field, f"{config_cls.__name__} refuses {options}: {exc}") from None
        self.options = dict(options)

    def scorer_limits(self) -> Limits:
        """The limits of a process that scores this env's answers (``scoring.py``; ``wall_s``: its start)."""
        return Limits(cpu_s=LIFE_CPU_S, wall_s=START_S, memory_mb=self.scorer_memory_mb,
                      processes=16 + (os.cpu_count() or 1), sandbox=self.sandbox)  # numpy's threads, one a core

    def key(self) -> str:
        """The dataset and its options as one string (what picks the generator)."""
        return json.dumps([self.dataset, self.options], sort_keys=True, default=str)

    def __repr__(self) -> str:
        return (f"ReasoningGymEnvConfig(dataset={self.dataset!r}, attempts={self.attempts}, sandbox={self.sandbox!r}, "
                f"scorer_wall_s={self.scorer_wall_s}, scorer_memory_mb={self.scorer_memory_mb}, "
                f"item_wall_s={self.item_wall_s}, max_observation_chars={self.max_observation_chars}, "
                f"options={self.options})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReasoningGymEnvConfig) and self._own() == other._own()

    def _own(self) -> tuple:
        return (self.key(), self.attempts, self.sandbox, self.scorer_wall_s, self.scorer_memory_mb, self.item_wall_s,
                self.max_observation_chars)
