"""``play_program``: one agent episode, an entry or a command, played to its ``ProgramResult``."""

from __future__ import annotations

from typing import Any

from ragen.agents.command import GRACE_S, run_command
from ragen.agents.config import AgentConfig
from ragen.agents.entry import run_entry
from ragen.agents.llm import LLM
from ragen.agents.result import ProgramResult
from ragen.env.reward_bound import DEFAULT_MAX_ABS_REWARD

__all__ = ["ProgramResult", "play_program"]


def play_program(config: AgentConfig, task: dict[str, Any], llm: LLM, *,
                 max_abs_reward: float = DEFAULT_MAX_ABS_REWARD, grace_s: float = GRACE_S) -> ProgramResult:
    """The program of ``config`` played on ``task`` against ``llm``'s session, within
    ``config.timeout_s``. It never raises for what the program does: a failure, a result that is
    no reward (or one beyond +-``max_abs_reward``) and a timeout are the result's ``error``. It
    returns at the timeout; the caller then closes the session, so that an entry's abandoned
    thread is refused on every later call. ``grace_s``: a command's time between SIGTERM and SIGKILL."""
    if config.command is None:  # an entry, or a verifiers environment's episode: a function on a thread
        return run_entry(config, task, llm, max_abs_reward)
    return run_command(config, task, llm, max_abs_reward, grace_s)
