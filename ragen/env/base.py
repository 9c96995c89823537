"""RAGEN's environment interface.

An env module written for RAGEN imports these names and runs unchanged:

- ``BaseEnv``: ``reset(seed=None, **kwargs) -> observation text`` and
  ``step(action) -> (observation, reward, done, info)``; ``info`` carries at
  least ``action_is_valid``, ``action_is_effective`` and ``success``.
- ``BaseDiscreteActionEnv``: actions are integer ids; ``ACTION_LOOKUP`` maps
  id -> action name and ``get_all_actions()`` lists the ids.
- ``BaseLanguageBasedEnv``: the action is the answer text itself.
- ``BaseEnvConfig``: the dataclass every env config derives from;
  ``ToolFormConfig`` one whose env also takes tool calls (``tool_calls``).

The base ``__init__`` never overwrites a ``config`` the subclass set before
calling it (RAGEN's modules set theirs first). Each env owns its random
generator, seeded in ``reset`` (``make_rng`` builds it); nothing random is global, so instances in different threads or processes
never disturb each other. ``BaseDiscreteActionEnv.is_valid_action`` is the one
test of whether a step's action is an id of ``ACTION_LOOKUP``, and
``unchanged_step`` the one result of an action that changes nothing.

An env may say what its last step cost beyond the time it took: ``step_costs``,
a mapping of names to numbers that it sets afresh in every ``step`` (the code
env's ``sandbox_cpu_s``, the search env's ``retrieval_s``). The turn loop keeps
them beside the turn, outside its results (they vary from run to run), and a
rollout's metrics report their sums and percentiles (``costs/<name>_*``).

An env that needs something outside itself (the search env's retrieval server)
says in ``preflight()`` why it cannot play now, or None; the env checker fails
on what it says.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .config_checks import check_bool, check_number


@dataclass
class BaseEnvConfig:
    """Base of every env config; subclasses add their own fields."""

    invalid_act: str = ""
    invalid_act_score: float = 0.0

    def __post_init__(self) -> None:
        self.invalid_act_score = check_number("invalid_act_score", self.invalid_act_score)

    def reward_and_success(self) -> str | None:
        """What an episode's reward and its success measure, where they measure different things
        (a learning curve shows both, and says this beside them); None: nothing to say."""
        return None


@dataclass
class ToolFormConfig(BaseEnvConfig):
    """The config of an env that also takes its actions as tool calls: with ``tool_calls:
    true`` its ``tools`` are the class's ``TOOLS`` (OpenAI function schemas), else None."""

    TOOLS: ClassVar[list[dict[str, Any]]] = []
    tool_calls: bool = False

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return self.TOOLS if self.tool_calls else None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tool_calls = check_bool("tool_calls", self.tool_calls)


class BaseEnv(ABC):
    """The env interface: ``reset(seed)`` returns the first observation text, ``step(action)``
    returns ``(observation, reward, done, info)``; ``step_costs``: what the last step cost
    (see the module docstring), None when the env does not say."""

    step_costs: dict[str, float] | None = None

    def __init__(self, config: Any = None) -> None:
        # RAGEN's env modules set ``self.config`` (and their lookups) first and
        # call the base ``__init__`` after, with no arguments; RAGEN's base sets
        # nothing, so ours must not overwrite what the subclass already set.
        if config is not None or "config" not in self.__dict__:
            self.config = config

    @abstractmethod
    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Start an episode and return the first observation text."""

    @abstractmethod
    def step(self, action: Any) -> tuple[str, float, bool, dict]:
        """Apply one action: (observation, reward, done, info)."""

    def compute_reward(self, *args: Any, **kwargs: Any) -> float:
        return 0.0

    def render(self, mode: str = "text") -> str:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def preflight(self) -> str | None:
        """Why the env cannot play now (a server it needs does not answer), or None when it can."""
        return None


class BaseDiscreteActionEnv(BaseEnv):
    """An env whose actions are the integer ids of ``ACTION_LOOKUP`` (id -> action name)."""

    ACTION_LOOKUP: dict[int, str] = {}

    def get_all_actions(self) -> list[int]:
        return list(self.ACTION_LOOKUP)

    def is_valid_action(self, action: Any) -> bool:
        """Whether ``action`` is one of the integer ids of ``ACTION_LOOKUP``.

        Text, ``None``, floats and bools are not ids (bool is an int subclass,
        but ``True`` as an action is a parsing bug, not "action 1").
        """
        return (
            isinstance(action, numbers.Integral)
            and not isinstance(action, bool)
            and int(action) in self.ACTION_LOOKUP
        )


def make_rng(seed: int | None) -> tuple[int, np.random.Generator]:
    """(seed, generator) for an episode: the env's own RNG, never a global one.

    ``None`` draws a fresh seed from OS entropy and returns it, so the episode
    can still be replayed. Negative seeds are valid and differ from positive
    ones (numpy accepts only non-negative seeds, so they are taken mod 2**64).
    """
    if seed is None:
        seed = int(np.random.SeedSequence().entropy)
    elif isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer or None, got {seed!r}")
    seed = int(seed)
    return seed, np.random.default_rng(seed % 2**64 if seed < 0 else seed)


def function_tool(name: str, description: str, **parameters: str) -> dict[str, Any]:
    """An OpenAI function schema whose parameters are required strings (name -> description)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": list(parameters),
                       "properties": {k: {"type": "string", "description": d} for k, d in parameters.items()}}}}


def tool_argument(action: Any, tool: str, argument: str) -> str | None:
    """The string ``argument`` of a tool env's action when it is a call of ``tool``
    (``{"name", "arguments"}``, as the turn loop steps a tool call), else None."""
    if not isinstance(action, dict) or action.get("name") != tool:
        return None
    value = (action.get("arguments") or {}).get(argument)
    return value if isinstance(value, str) else None


def unchanged_step(observation: str, valid: bool, done: bool, success: bool,
                   invalid_act_score: float) -> tuple[str, float, bool, dict]:
    """The step result of an action that changes nothing: an invalid one
    (reward ``invalid_act_score``; the episode goes on as it was) or a valid
    one after the episode ended (reward int 0, as gymnasium's FrozenLake gives)."""
    info = {"action_is_valid": valid, "action_is_effective": False, "success": success}
    return observation, (0 if valid else invalid_act_score), done, info


class BaseLanguageBasedEnv(BaseEnv):
    """An env whose action is the answer text itself."""


def action_lookup(env: Any) -> dict[Any, Any] | None:
    """The env's actions, id -> name: its ``ACTION_LOOKUP``, or else its config's ``action_lookup``
    (RAGEN's); None when it has neither (the env steps the names as they are)."""
    return getattr(env, "ACTION_LOOKUP", None) or getattr(getattr(env, "config", None), "action_lookup", None) or None


def plain_info(info: Any) -> dict[str, Any]:
    """The JSON-able scalars of a step's info (numpy scalars converted): what the rollout records."""
    out: dict[str, Any] = {}
    if not isinstance(info, dict):
        return out
    for k, v in info.items():
        if hasattr(v, "item") and callable(v.item):
            try:
                v = v.item()
            except (ValueError, TypeError):
                continue
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[str(k)] = v
    return out


@functools.lru_cache(maxsize=None)
def reset_takes_mode(env_cls: type) -> bool:
    """Whether ``env_cls.reset`` has a ``mode`` parameter (RAGEN's envs do;
    ours and many users' take ``**kwargs`` and need not see it)."""
    try:
        return "mode" in inspect.signature(env_cls.reset).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented reset: no signature
        return False
