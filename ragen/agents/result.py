"""``ProgramResult``: how an agent episode ended; and what its program gave back read as a
reward and its info (``read_result``, ``read_reward_line``)."""

from __future__ import annotations

import dataclasses
import json
import reprlib
from collections.abc import Mapping
from typing import Any

from ragen.env.reward_bound import EnvOutputError, checked_reward


@dataclasses.dataclass(frozen=True)
class ProgramResult:
    """An agent episode's end: its ``reward`` and ``info`` (what a dict result held beside the
    reward); or its ``error`` (reward 0.0), ``timed_out`` where it ran past its time; its captured
    ``stdout`` and ``stderr`` (the last 64 KiB of each); an entry's ``traceback`` where it raised."""

    reward: float = 0.0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False
    stdout: str = ""
    stderr: str = ""
    traceback: str | None = None

    def output(self) -> dict[str, Any]:
        """What an agent episode's trajectory keeps of it beside the reward and error
        (``ragen.rollout.types.ProgramOutput``): its info, traceback, stdout and stderr."""
        return {"info": self.info, "traceback": self.traceback, "stdout": self.stdout, "stderr": self.stderr}


def read_result(value: Any, max_abs: float, source: str, where: str) -> tuple[float, dict[str, Any]]:
    """(reward, info) of ``value``, what ``source`` (an entry, a command) gave back: a number, or a
    dict of ``reward`` and JSON-able info. ``EnvOutputError`` naming ``source`` and ``where`` (the
    tag's config) for anything else, or a reward not finite or beyond +-``max_abs``."""
    info: dict[str, Any] = {}
    reward = value
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise EnvOutputError(f"{source} returned a dict without 'reward' (keys {sorted(map(str, value))}) "
                                 f"({where}): put the episode's reward under 'reward'")
        reward = value["reward"]
        info = {k: v for k, v in value.items() if k != "reward"}
    if reward is None or isinstance(reward, (str, bytes, bool, list, tuple, Mapping)):
        raise EnvOutputError(f"{source} returned a {type(reward).__name__} ({reprlib.repr(reward)}), not a "
                             f"reward: return a float or a dict with 'reward' (a number) ({where})")
    reward = float(checked_reward(reward, max_abs, where, source))
    for key, item in info.items():
        try:
            json.dumps({key: item}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise EnvOutputError(f"{source} returned info that is not JSON: {key!r} ({exc}) ({where}): keep "
                                 "info to JSON's types, it goes in the dump") from None
    return reward, info


def read_reward_line(stdout: str, max_abs: float, source: str, where: str) -> tuple[float, dict[str, Any]]:
    """(reward, info) of a command's last non-empty line of ``stdout``: a number, or a JSON object
    with ``reward``; ``EnvOutputError`` naming ``source`` otherwise."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise EnvOutputError(f"{source} printed nothing on stdout ({where}): print the reward, a number or "
                             "a JSON object with 'reward', as its last line")
    last = lines[-1]
    try:
        value: Any = float(last)
    except ValueError:
        try:
            value = json.loads(last)
        except ValueError:
            value = None
    if not isinstance(value, (float, dict)):
        raise EnvOutputError(f"{source}: the last line of its stdout, {reprlib.repr(last)}, is neither a number "
                             f"nor a JSON object with 'reward' ({where})")
    return read_result(value, max_abs, source, where)
