"""``play_agent``: one episode of an ``env_type: agent`` tag, on a gateway, to its ``Trajectory``.

The episode opens a session of its own on the gateway (its request key the spec's seed and
env id, so its sampling replays), plays the tag's program on the task its seed picks (the
members of a group share a seed, so a task), closes the session (an entry abandoned at its
timeout is refused on every later call), and makes the trajectory from the session's records:
a turn per call the engine answered, its prompt ids as the gateway recorded them (``prompt_start``:
the ids of its segment before it, as an env episode's turn under ``token_history: append``), the
ids sampled with their log-probs, its ``info`` where it stands in the session (``call``, its number;
``segment`` and the ``cause`` that started it, None where it extends the segment; ``endpoint``), and
the episode's reward on the last turn; the program's output (its info, traceback, stdout and stderr)
as ``Trajectory.program``. It ends ``done``;
``error`` where the program failed or made no call (nothing to train), ``timeout`` past its time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Any

from ragen.agents.config import AgentConfig
from ragen.agents.llm import LLM
from ragen.agents.program import ProgramResult, play_program
from ragen.gateway.record import CallRecord
from ragen.gateway.server import GatewayServer
from ragen.rollout.agent_call import AgentCall
from ragen.rollout.types import EnvSpec, StopReason, Trajectory, Turn


def agent_program(spec: EnvSpec) -> tuple[AgentConfig, Any]:
    """The program and tasks of ``spec``'s tag, read once a process (its tasks file read once)."""
    return _program(spec.tag, json.dumps(spec.env_config, sort_keys=True))


@functools.lru_cache(maxsize=64)
def _program(tag: str, env_config: str) -> tuple[AgentConfig, Any]:
    config = AgentConfig.read(tag, json.loads(env_config))
    return config, config.task_set()


def play_agent(spec: EnvSpec, server: GatewayServer, max_abs_reward: float) -> Trajectory:
    """The agent episode of ``spec`` (an ``agent`` tag's) played on ``server``'s engine."""
    config, tasks = agent_program(spec)
    session = server.open_session(seed=spec.seed, env_id=spec.env_id)
    try:
        llm = LLM(server.base_url(session), session.key, server.gateway.link.served_name)
        started = time.time()
        result = play_program(config, tasks.task(spec.seed), llm, max_abs_reward=max_abs_reward)
        ended = time.time()
    finally:
        server.gateway.sessions.close(session.id)
    return trajectory_of(spec, session.records, result, server.gateway.link.decode_text, (started, ended))


def trajectory_of(spec: EnvSpec, records: list[CallRecord], result: ProgramResult, decode: Any,
                  span: tuple[float, float] | None = None) -> Trajectory:
    """The trajectory of an agent episode: a turn per answered call, the reward on the last.
    ``span``: when the program started and ended (epoch seconds): the program's own time before its
    first call is the trajectory's ``reset_s``, and after each call, until the next or its end, that
    turn's ``env_s`` (an env's step after the answer)."""
    answered = [r for r in records if r.error is None and r.finish_reason not in (None, "error")]
    turns = [_turn(r, decode) for r in answered]
    traj = Trajectory(env_id=spec.env_id, group_id=spec.group_id, tag=spec.tag, seed=spec.seed, turns=turns,
                      program=result.output())
    if span is not None and answered:
        traj.reset_s = max(0.0, answered[0].started_at - span[0])
        ends = [r.started_at for r in answered[1:]] + [span[1]]
        turns[:] = [dataclasses.replace(t, env_s=max(0.0, end - r.started_at - r.total_s))
                    for t, r, end in zip(turns, answered, ends)]
    if result.error is not None:
        traj.stop_reason = StopReason.TIMEOUT if result.timed_out else StopReason.ERROR
        traj.error = result.error
    elif not turns:
        traj.stop_reason, traj.error = StopReason.ERROR, "the agent made no call to its session: nothing to train"
    else:
        turns[-1] = dataclasses.replace(turns[-1], reward=result.reward)
        traj.success = bool(result.info.get("success", result.reward > 0))
    return traj


def _turn(record: CallRecord, decode: Any) -> Turn:
    """A call's turn: its messages, tools and answer as ``AgentCall`` holds them in a turn."""
    call = AgentCall.of_record(record)
    return Turn(observation=call.observation, actions_left=0, response=decode(list(record.response_ids)), actions=[],
                executed_actions=[], reward=0.0, penalty=0.0, info=call.info,
                policy_version=record.policy_version or 0, finish_reason=record.finish_reason or "stop",
                response_ids=tuple(record.response_ids),
                logprobs=None if record.logprobs is None else tuple(record.logprobs),
                prompt_ids=tuple(record.prompt_added), prompt_start=record.prompt_start, tool_calls=call.tool_calls)


def call_info(record: CallRecord) -> dict[str, Any]:
    """Where a call stands in its session, its segment's tools and its answer's content: an agent
    turn's ``info`` (``ragen.rollout.agent_call``)."""
    return AgentCall.of_record(record).info
