"""Configuration of the reasoning-gym env: which dataset, its own options, and the attempts.

``env_config: {dataset: <name>, attempts: 1, <the dataset's own options>}``.
The dataset's options are read by its own config class (reasoning-gym's
``<Name>Config``) and checked by its ``validate``, here, when the config is
built: an unknown option or value names the key. An unknown dataset name lists
the close matches. reasoning-gym is an optional package
(``pip install -e '.[envs]'``).
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from ..config_checks import EnvConfigError, check_int, check_number, check_str

__all__ = ["ReasoningGymEnvConfig", "datasets"]

# the keys of this env; every other key of env_config is the dataset's option
OWN_KEYS = ("dataset", "attempts", "invalid_act", "invalid_act_score")


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
    episode goes on); ``options``: the dataset's own options (the other keys)."""

    SHORTHAND_KEY = "dataset"  # python -m ragen.tools.check reasoning_gym:<dataset>

    def __init__(self, dataset: str = "chain_sum", attempts: int = 1, invalid_act: str = "",
                 invalid_act_score: float = 0.0, **options: Any) -> None:
        self.dataset = check_str("dataset", dataset)
        known = datasets()
        if self.dataset not in known:
            close = difflib.get_close_matches(self.dataset, list(known), n=5, cutoff=0.5)
            hint = f"; close matches: {close}" if close else f"; {len(known)} datasets, e.g. {sorted(known)[:8]}"
            raise EnvConfigError("dataset", f"unknown reasoning-gym dataset {self.dataset!r}{hint}")
        self.attempts = check_int("attempts", attempts, minimum=1, maximum=100)
        self.invalid_act = invalid_act
        self.invalid_act_score = check_number("invalid_act_score", invalid_act_score)
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

    def key(self) -> str:
        """The dataset and its options as one string (what picks the generator)."""
        return json.dumps([self.dataset, self.options], sort_keys=True, default=str)

    def __repr__(self) -> str:
        return f"ReasoningGymEnvConfig(dataset={self.dataset!r}, attempts={self.attempts}, options={self.options})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReasoningGymEnvConfig) and (self.key(), self.attempts) == (other.key(), other.attempts)
