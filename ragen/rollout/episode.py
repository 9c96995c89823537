"""One episode as one straight function: ``play_episode``.

The episode resets its env, then asks for a completion, applies the answer and
repeats until the env ends; it yields each turn's ``GenerationRequest``,
receives its ``Completion`` and returns the ``Trajectory``. Whoever drives it
decides when to ask and with which other episodes' requests (the rollout's
``Scheduler``, replay through it, ``EnvStateManager``); closing it ends the
episode where it stands. ``EnvTurns`` holds what every turn needs: the
prompts, the env calls within their limits, retries and error endings.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

from ragen.llm.types import Completion, GenerationRequest
from ragen.rollout.context import ContextManager
from ragen.rollout.env_calls import EnvCaller, EnvSlot, KeptEnvs, apply_answer, end_in_error, guard, reset, resume
from ragen.rollout.loop_config import LoopConfig, LoopStats
from ragen.rollout.types import StopReason, Trajectory, episode_ids

Episode = Generator[GenerationRequest, Completion, Trajectory]


def play_episode(slot: EnvSlot, turns: "EnvTurns") -> Episode:
    """The env of ``slot`` played to its end, one request a turn."""
    turns.reset(slot)
    while slot.active:
        completion = yield turns.request(slot)
        turns.apply(slot, completion)
    return slot.traj


@dataclass(eq=False)
class EnvTurns:
    """What a turn of any episode of one rollout call needs: the prompts (``ContextManager``),
    env calls within ``config.env_timeout_s`` on instances from ``kept_envs``, and what to do
    when an env fails: with ``isolate``, retry it on a fresh instance and then end its own
    episode in error; without, raise ``EnvError``. ``stats`` counts errors and retries."""

    config: LoopConfig
    kept_envs: KeptEnvs
    isolate: bool
    stats: LoopStats = field(default_factory=LoopStats)

    def __post_init__(self) -> None:
        self.ctx = ContextManager(self.config.context)
        self.call = EnvCaller(self.config.env_timeout_s)

    def reset(self, slot: EnvSlot) -> None:
        """The env reset; a carried episode's brought back to where it stood (``env_calls.resume``),
        or, where it had ended, its trajectory handed back as it is."""
        carried = slot.spec.resume
        if carried is None:
            self.guarded(slot, reset, self.kept_envs, self.call)
        elif carried.stop_reason is StopReason.ABORTED:
            self.guarded(slot, resume, self.kept_envs, self.call)
        else:
            slot.traj = dataclasses.replace(carried)
            slot.active = False

    def apply(self, slot: EnvSlot, completion: Completion) -> None:
        self.guarded(slot, apply_answer, completion, self.ctx, self.config, self.call)

    def guarded(self, slot: EnvSlot, fn: Callable[..., None], *args: Any) -> None:
        """``fn(slot, *args)``, retried and ended as the env's failures are (``env_calls.guard``)."""
        guard(slot, self.stats, self.isolate, self.config, self.call, fn, slot, *args)

    def end(self, slot: EnvSlot, reason: StopReason, message: str) -> None:
        """The env ends in ``reason`` where the engine, not the env, is at fault: alone,
        whether or not errors are isolated (a re-run would wait for the same engine)."""
        end_in_error(slot, reason, self.stats, True, cause=None, message=message)

    def abort(self, slot: EnvSlot) -> None:
        """The env ends ``aborted``: the rollout had enough groups done first (over-sampling)."""
        slot.finish(StopReason.ABORTED)

    def refuse(self, slot: EnvSlot, message: str) -> None:
        """The env ends in error for a request that could not be sent (as an env's failure is)."""
        end_in_error(slot, StopReason.ERROR, self.stats, self.isolate, cause=None, message=message)

    def request(self, slot: EnvSlot) -> GenerationRequest:
        """The env's prompt for its next turn. With ``token_history: append`` it carries
        the episode's ids so far: the engine appends the new message's tokens to them."""
        turns = slot.traj.turns
        messages = self.ctx.build_messages(slot.spec, turns, slot.observation, slot.actions_left)
        history = None
        if self.ctx.config.token_history == "append" and turns and turns[-1].has_prompt_ids:
            history = episode_ids(turns)
        return GenerationRequest(
            messages=messages,
            history_token_ids=history,
            # the messages up to the last answer are the history's
            history_messages=_after_last_answer(messages) if history is not None else 0,
            env_id=slot.spec.env_id,
            turn=len(turns),
            seed=slot.spec.seed,
            max_tokens=slot.spec.max_tokens,
            last_turn=len(turns) + 1 >= self.config.max_turn,
            answer_prefix=self.ctx.answer_prefix,
            tools=slot.spec.tools,
        )

    def close(self) -> None:
        self.call.close()


def _after_last_answer(messages: list[dict[str, str]]) -> int:
    """The index after the last assistant message."""
    return next(i + 1 for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant")


class Playing:
    """One episode being driven: its slot, its generator and the request it waits on
    (None once it ended)."""

    __slots__ = ("slot", "run", "request")

    def __init__(self, slot: EnvSlot, turns: EnvTurns) -> None:
        self.slot = slot
        self.run = play_episode(slot, turns)
        self.request: GenerationRequest | None = None

    def advance(self, completion: Completion | None = None) -> None:
        """The episode played to its next request (``completion``: the answer to the last)."""
        try:
            self.request = self.run.send(completion)
        except StopIteration:
            self.request = None

    @property
    def ended(self) -> bool:
        """Whether the episode has ended: returned, closed, or stopped by an exception."""
        return self.run.gi_frame is None

    def job(self, completion: Completion | None = None) -> Callable[[], None]:
        """``advance`` as a job for ``EnvThreads``."""
        return functools.partial(self.advance, completion)

    def close(self) -> None:
        """Ended from outside: the generator closes where it stands."""
        self.request = None
        self.run.close()
