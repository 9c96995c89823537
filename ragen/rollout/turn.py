"""A turn: the model's answer applied to its episode's env.

``apply_answer`` parses the answer into actions (a tool env's: into tool
calls), steps those the env knows within the episode's action budget until the
env says done, and returns the ``Turn`` it played and whether the env said
done. It never ends the episode: ``play_episode`` adds the turn and checks the
limits (done, the action budget, ``max_turn``); an env's failure raised here is
``EnvTurns``'s to retry or end.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

from ragen.env.base import plain_info
from ragen.llm.tool_calls import BadCall, ToolCall
from ragen.llm.types import Completion
from ragen.rollout.context import ContextManager
from ragen.rollout.env_calls import (EnvCaller, EnvOutputError, checked_observation, checked_reward, describe,
                                     step_where)
from ragen.rollout.episode_state import Episode
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.types import Step, Turn, episode_ids, prompt_delta

logger = logging.getLogger(__name__)

Played = tuple[Turn, bool]  # the turn, and whether the env said done


def apply_answer(episode: Episode, completion: Completion, ctx: ContextManager, config: LoopConfig,
                 call: EnvCaller) -> Played:
    """The answer parsed into actions (a tool env's: into tool calls) and applied
    (``apply_actions``). An answer the parser fails on is the model's mistake, never the
    env's: no action, the format penalty, and (a tool env's) the reason as the call's error."""
    tools = episode.spec.tools
    try:
        parsed = ctx.parse_calls(completion, tools) if tools else ctx.parse_response(completion.text)
    except Exception as exc:  # broad: the parsers read only the model's text, whatever it made them raise
        logger.warning("%s: the parser failed on the answer at turn %d, which takes the format penalty: %s: %s",
                       describe(episode), len(episode.traj.turns), type(exc).__name__, exc, exc_info=True)
        parsed = [BadCall(completion.text, f"the answer could not be read ({type(exc).__name__})")] if tools else []
    if tools:
        return apply_tool_calls(episode, parsed, completion, config.format_penalty, call,
                                max_abs_reward=config.max_abs_reward)
    return apply_actions(episode, parsed, completion, config.format_penalty, call,
                         max_abs_reward=config.max_abs_reward)


def apply_tool_calls(episode: Episode, calls: list[ToolCall | BadCall], completion: Completion,
                     format_penalty: float, call: EnvCaller, *, max_abs_reward: float) -> Played:
    """A tool env's turn: each valid call stepped as an action (``{"name", "arguments"}``),
    as ``apply_actions`` steps actions (a call that does not parse or match its tool is
    dropped, with the format penalty); the turn's ``tool_results`` answer every call in
    order: its step's observation, the parse error, or why it was not run."""
    valid = [(c.text, c.action()) for c in calls if isinstance(c, ToolCall)]
    turn, done = apply_actions(episode, [c.text for c in calls], completion, format_penalty, call, valid=valid,
                               max_abs_reward=max_abs_reward)
    observations = iter(s.observation for s in turn.steps)
    results = []
    for n, c in enumerate(calls, 1):
        if isinstance(c, BadCall):
            results.append(f"Error in tool call {n}: {c.error}")
        else:
            results.append(next(observations, "Not run: the episode ended before this call."))
    server_calls = None if completion.tool_calls is None else tuple(completion.tool_calls)
    return dataclasses.replace(turn, tool_results=tuple(results), tool_calls=server_calls), done


def apply_actions(episode: Episode, actions: list[str], completion: Completion, format_penalty: float,
                  call: EnvCaller, valid: list[tuple[str, Any]] | None = None, *, max_abs_reward: float) -> Played:
    """One turn: the actions the env knows (its lookup, any case; the others dropped) stepped
    within the action budget until one ends the env, as a ``Turn`` of ``completion``'s answer,
    with ``format_penalty`` when an action was dropped or none was given. ``valid``: the
    (name, action) pairs to step, where the caller read them. A step's reward beyond
    +-``max_abs_reward``, or an episode total that is not finite, raises ``EnvOutputError``."""
    if valid is None and episode.lookup is not None:
        valid = [(a, episode.lookup[a.lower()]) for a in actions
                 if isinstance(a, str) and a.lower() in episode.lookup]
    elif valid is None:
        valid = [(a, a) for a in actions]
    budget, shown = episode.actions_left, episode.observation
    t0 = time.perf_counter()
    steps, reward, costs, info, done = _step(episode, valid[:budget], call, max_abs_reward)
    env_s = time.perf_counter() - t0
    prompt_start, prompt_ids = _prompt_ids(episode, completion)
    turn = Turn(
        observation=shown,
        actions_left=budget,
        response=completion.text,
        actions=list(actions),
        executed_actions=[s.action for s in steps],
        reward=reward,
        penalty=format_penalty if (not valid or len(valid) != len(actions)) else 0.0,
        info=info,
        policy_version=completion.policy_version,
        finish_reason=completion.finish_reason,
        steps=tuple(steps),
        env_s=env_s,
        response_ids=tuple(completion.response_token_ids),
        logprobs=None if completion.logprobs is None else tuple(completion.logprobs),
        prompt_ids=prompt_ids,
        prompt_start=prompt_start,
        costs=costs,
    )
    return turn, done


def _step(episode: Episode, valid: list[tuple[str, Any]], call: EnvCaller,
          max_abs_reward: float) -> tuple[list[Step], float, dict[str, list[float]], dict[str, Any], bool]:
    """The (name, action) pairs stepped in order until the env says done: each step's record,
    their reward, the env's costs, the steps' info merged, and whether the env said done. Each
    step takes one action from the episode's budget and shows its observation."""
    turn_no = len(episode.traj.turns) + 1
    steps_before = sum(len(t.steps) for t in episode.traj.turns)
    total_before = episode.traj.reward
    reward: float = 0  # an int 0 until a step adds to it: a prompt shows the turn's reward as str(), as RAGEN does
    steps: list[Step] = []
    costs: dict[str, list[float]] = {}
    info: dict[str, Any] = {}
    done = False
    for name, action in valid:
        obs, r, done, step_info = call(episode.env.step, action)
        _add_costs(costs, episode.env)
        where = step_where(episode, turn_no, steps_before + len(steps) + 1)
        r = checked_reward(r, max_abs_reward, where)
        episode.observation = checked_observation(obs, "step")
        reward += r
        if not math.isfinite(total_before + reward):
            raise EnvOutputError(f"the episode's reward came to {total_before + reward}, not a finite number, "
                                 f"with the reward {r:g} ({where})")
        info.update(plain_info(step_info))
        steps.append(Step(action=name, observation=episode.observation, reward=r, done=bool(done)))
        episode.actions_left -= 1
        if done:
            break
    return steps, reward, costs, info, bool(done)


def _add_costs(costs: dict[str, list[float]], env: Any) -> None:
    """The env's ``step_costs`` of the step it just took, added to ``costs``; a value that is not
    a finite number is left out (a cost is a measurement, never a reason to end the env)."""
    given = getattr(env, "step_costs", None)
    if not isinstance(given, dict):
        return
    for name, value in given.items():
        if isinstance(name, str) and isinstance(value, (int, float)) and math.isfinite(value):
            costs.setdefault(name, []).append(float(value))


def _prompt_ids(episode: Episode, completion: Completion) -> tuple[int, tuple[int, ...]]:
    """Where the turn's prompt ids start in the episode's, and the ids from there."""
    if completion.prompt_start:  # sent as the ids after the episode's, which the request carried
        return completion.prompt_start, tuple(completion.prompt_token_ids)
    if completion.prompt_token_ids:
        return prompt_delta(episode_ids(episode.traj.turns), completion.prompt_token_ids)
    return 0, ()
