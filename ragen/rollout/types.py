"""The vocabulary of a rollout.

- ``EnvSpec``: everything a worker needs to build and reset one env (tag, type,
  config, seed, ids); plain data, so it crosses process boundaries.
- ``Turn``: one exchange: the state shown, the model's answer, the actions
  parsed from it and executed, the reward, the policy version that answered,
  and the tokens: the prompt's ids as the engine saw them (what was added
  since the previous turn), the answer's sampled ids and the log-prob of each
  under the policy that sampled it. ``episode_ids`` puts them together.
- ``Step``: one ``env.step`` within a turn: the action and what the env gave
  back (observation, reward, done); what a replay checks against.
- ``Trajectory``: one env's episode: its turns and a ``StopReason``; an agent
  episode's also its program's output (``ProgramOutput``).
- ``StopReason``: why an episode ended; also used in metric names
  (``rollout/stop/<reason>``).
- ``RolloutResult``: the trajectories of one rollout, in env_id order, with
  the rollout's metrics and timings.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Iterator, Sequence, TypedDict

from ragen.utils import common_prefix_length


AGENT_ENV_TYPE = "agent"  # custom_envs.<tag>.env_type of an agent program (ragen.agents)


class StopReason(StrEnum):
    """Why an episode ended; also used in metric names (``rollout/stop/<reason>``)."""

    DONE = "done"  # the env said done (solved or failed)
    MAX_TURNS = "max_turns"  # agent_proxy.max_turn reached
    ACTION_BUDGET = "action_budget"  # max_actions_per_traj used up
    ERROR = "error"  # the env raised; see Trajectory.error
    TIMEOUT = "timeout"  # an env call or the rollout ran past its limit
    ABORTED = "aborted"  # over-sampling: the rollout had enough groups done first (ragen.rollout.oversample)

    @property
    def failed(self) -> bool:
        """The env failed (error, timeout): its group is never trained."""
        return self in (StopReason.ERROR, StopReason.TIMEOUT)


@dataclass(frozen=True)
class EnvSpec:
    """Everything a worker needs to build and reset one env; plain data that crosses process boundaries."""

    env_id: int
    group_id: int
    tag: str
    seed: int
    env_type: str
    env_config: dict[str, Any]
    config_type: str | None = None
    max_actions_per_traj: int = 10
    env_instruction: str = ""
    # RAGEN's additions to the system message, from the defaults of the env's config class: the
    # meaning of the grid symbols (or the coordinate hint) and the action names (None: not listed)
    state_legend: str = ""
    action_names: tuple[str, ...] | None = None
    max_tokens: int | None = None
    # one worked exchange shown after the system message: (observation, answer);
    # it teaches the answer format and is never trained on
    format_example: tuple[str, str] | None = None
    # how many of this tag's envs one loop steps at once on threads: RAGEN's
    # ``max_workers`` for a ``parallel_friendly`` tag, else 1 (one after another)
    env_threads: int = 1
    # the split, passed to ``reset(seed=..., mode=...)`` when the env's reset
    # takes ``mode`` (RAGEN passes it: "train" or "val")
    mode: str = "train"
    # the env's tools (OpenAI function schemas): its actions are tool calls, their results
    # ``tool`` messages (None: RAGEN's text actions)
    tools: list[dict[str, Any]] | None = None
    # the seed this group was dealt in place of, set aside by the quarantine (ragen.rollout.fill)
    replaces_seed: int | None = None
    # a carried episode (ragen.rollout.oversample): its trajectory so far, which the env is brought
    # back to by stepping its actions again; an ended one is handed back as it is
    resume: "Trajectory | None" = field(default=None, compare=False, repr=False)

    @property
    def is_agent(self) -> bool:
        """An agent program's episode (``env_type: agent``), played on a gateway session, not a turn loop."""
        return self.env_type == AGENT_ENV_TYPE

    @property
    def reuse_key(self) -> tuple:
        """Envs with equal keys are interchangeable: a worker reuses them."""
        return (self.tag, self.env_type, self.config_type, repr(sorted(self.env_config.items())))


@dataclass(frozen=True)
class Step:
    """One ``env.step`` within a turn: the action and what the env gave back."""

    action: str  # the action's name, as executed
    observation: str  # the env's observation after it
    reward: float
    done: bool


@dataclass(frozen=True)
class Turn:
    """One exchange with the model: the state shown, the answer, its actions and their reward."""

    observation: str  # the state shown in this turn's prompt
    actions_left: int  # the action budget shown in this turn's prompt
    response: str  # the model's answer, as generated
    actions: list[str]  # action strings parsed from the answer
    executed_actions: list[str]  # the valid ones, executed in order
    reward: float  # env reward summed over this turn's actions
    penalty: float  # format penalty (no valid action, or some invalid)
    info: dict[str, Any]  # the env's info after the last executed action
    policy_version: int
    finish_reason: str = "stop"
    steps: tuple[Step, ...] = ()  # one per executed action, in order
    env_s: float = field(default=0.0, compare=False)  # time in env.step this turn (a timing: not compared)
    # How the answer was sampled: the engine's token ids of it and each one's log-prob under the
    # distribution it was drawn from (None: the engine gives none); the trainer's off-policy
    # correction reads them. Not compared: an engine's float rounding may depend on the batch.
    response_ids: tuple[int, ...] = field(default=(), compare=False)
    logprobs: tuple[float, ...] | None = field(default=None, compare=False)
    # The prompt's ids as the engine saw them: the first ``prompt_start`` ids of the previous
    # turn's prompt and answer (``episode_ids``), then ``prompt_ids``. A prompt that appends to
    # the episode's ids starts after all of them; one rendered whole shares only a start. Both
    # empty: the engine gave no prompt ids.
    prompt_ids: tuple[int, ...] = field(default=(), compare=False)
    prompt_start: int = field(default=0, compare=False)
    # a tool env's turn: the content of the tool message answering each call, in call order
    # (the step's observation, or why the call was not run)
    tool_results: tuple[str, ...] = ()
    # the calls as a server parsed them (``Completion.tool_calls``; None: the engine's reply had none):
    # what a replay answers with, next to the text
    tool_calls: tuple[dict[str, Any], ...] | None = None
    # what the env said its steps cost (``step_costs``), a list per name with a value per step
    # that gave one (measurements: not compared)
    costs: dict[str, list[float]] = field(default_factory=dict, compare=False)

    @property
    def has_prompt_ids(self) -> bool:
        return bool(self.prompt_ids) or self.prompt_start > 0


def episode_ids(turns: Sequence[Turn]) -> list[int]:
    """The ids of the episode up to the end of its last turn's answer, as the engine saw
    and sampled them: that turn's prompt, then its answer."""
    ids: list[int] = []
    for t in turns:
        del ids[t.prompt_start:]
        ids += t.prompt_ids
        ids += t.response_ids
    return ids


def turn_prompts(turns: Sequence[Turn]) -> Iterator[list[int] | None]:
    """Each turn's whole prompt ids as the engine saw them (None: the engine gave none), one
    turn at a time: all of them at once would take memory growing with the square of the turns."""
    ids: list[int] = []
    for t in turns:
        del ids[t.prompt_start:]
        ids += t.prompt_ids
        yield list(ids) if t.has_prompt_ids else None
        ids += t.response_ids


def prompt_delta(previous: Sequence[int], prompt: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """``(prompt_start, prompt_ids)`` of a turn whose prompt is ``prompt``, after the
    episode's ``previous`` ids (see ``Turn``): an appended prompt starts after all of
    them, one rendered whole after the start it shares."""
    start = common_prefix_length([list(previous), list(prompt)])
    return start, tuple(prompt[start:])


class ProgramOutput(TypedDict):
    """What an agent episode's program gave beside its reward (``Trajectory.program``): the
    ``info`` of a dict result (JSON), the ``traceback`` where an entry raised, and the ``stdout``
    and ``stderr`` it wrote (their captured last part: ``ragen.agents.result.ProgramResult``)."""

    info: dict[str, Any]
    traceback: str | None
    stdout: str
    stderr: str


@dataclass
class Trajectory:
    """One env's episode: its turns and why it ended."""

    env_id: int
    group_id: int
    tag: str
    seed: int
    turns: list[Turn] = field(default_factory=list)
    final_observation: str = ""
    stop_reason: StopReason = StopReason.DONE
    success: bool = False
    error: str | None = None
    # the answer whose actions the env failed on (an error or timeout within a turn): a replay feeds it again
    failed_response: str | None = None
    action_names: list[str] | None = None  # the env's ACTION_LOOKUP names, for records
    # where and how long it ran: records for people, not part of the result (not compared)
    reset_s: float = field(default=0.0, compare=False)
    worker: int | None = field(default=None, compare=False)  # the worker process's pid; None: the driver
    # an agent episode's program output (None: an env's episode). Not compared: its captured text
    # depends on the process it ran in (a warning is printed once a process); ``rollout_digest``
    # covers its info
    program: ProgramOutput | None = field(default=None, compare=False)

    @property
    def reward(self) -> float:
        return sum(t.reward + t.penalty for t in self.turns)

    @property
    def num_actions(self) -> int:
        return sum(len(t.executed_actions) for t in self.turns)


@dataclass
class RolloutResult:
    """The trajectories of one rollout, in env_id order, with its metrics."""

    trajectories: list[Trajectory]
    specs: list[EnvSpec]  # aligned with trajectories
    metrics: dict[str, float] = field(default_factory=dict)
    # group id -> why a training batch leaves the group out ("failed", "no_signal": ragen.rollout.fill)
    dropped_groups: dict[int, str] = field(default_factory=dict)

    @property
    def failed_envs(self) -> list[dict[str, Any]]:
        """Every env that ended in ``error`` or ``timeout``, with what it takes
        to run it alone: tag, env type, seed, turn, the exception, and the command
        that checks it alone (``check``: its env type and whole env config, so it
        runs wherever the tag came from)."""
        from ragen.env.check.command import check_command

        spec_of = {s.env_id: s for s in self.specs}
        out = []
        for t in self.trajectories:
            if t.stop_reason.failed:
                spec = spec_of.get(t.env_id)
                out.append({"env_id": t.env_id, "tag": t.tag, "seed": t.seed, "turn": len(t.turns),
                            "stop_reason": t.stop_reason.value, "error": t.error,
                            "env_type": spec.env_type if spec else None,
                            "check": check_command(spec.env_type, spec.env_config, spec.config_type, t.seed)
                            if spec else None})
        return out


def rollout_digest(trajectories: list[Trajectory]) -> str:
    """sha256 over a canonical serialization of every trajectory's env_id,
    actions, rewards, observations and stop reason, and an agent episode's
    program info (what it returned beside its reward; not its captured output,
    a record for people as an error's text is): equal digests, equal rollouts."""
    rows = []
    for t in sorted(trajectories, key=lambda t: t.env_id):
        row = [t.env_id, t.stop_reason.value, t.final_observation,
               [[x.observation, x.response, x.actions, x.executed_actions, x.reward, x.penalty] for x in t.turns]]
        if t.program is not None:  # an env's episode digests as it always has
            row.append(t.program["info"])
        rows.append(row)
    return hashlib.sha256(json.dumps(rows, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
