"""One episode as one straight function: ``play_episode``, and the ``Episode`` it plays.

The episode resets its env, then asks for a completion, applies the answer
(``ragen.rollout.turn``) and adds the turn, until the env ends: it ends here
when the env says done, its action budget is spent or it played ``max_turn``
turns. It yields each turn's ``GenerationRequest``, receives its
``Completion`` and returns the ``Trajectory``. Whoever drives it decides when
to ask and with which other episodes' requests (the rollout's ``Scheduler``,
replay through it, ``EnvStateManager``, verl's agent loop); closing it ends
the episode where it stands. ``EnvTurns`` holds what every turn needs: the
prompts, the env calls within their limits, retries and error endings.
docs/layout.md's "How an episode ends" names every end and where it is set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, TypeVar

from ragen.llm.types import Completion, GenerationRequest
from ragen.rollout.context import ContextManager
from ragen.rollout.env_calls import EnvCaller, KeptEnvs, end_in_error, guard, reset, resume
from ragen.rollout.episode_state import Episode
from ragen.rollout.loop_config import LoopConfig, LoopStats
from ragen.rollout.turn import Played, apply_answer
from ragen.rollout.types import EnvSpec, StopReason, Trajectory, episode_ids

T = TypeVar("T")


def play_episode(episode: Episode, turns: EnvTurns) -> Generator[GenerationRequest, Completion, Trajectory]:
    """The episode played to its end, one request a turn."""
    turns.reset(episode)
    while episode.active:
        completion = yield turns.request(episode)
        played = turns.apply(episode, completion)
        if played is None:  # the env failed, and its episode ended
            continue
        turn, done = played
        episode.add(turn)
        if done:
            episode.finish(StopReason.DONE)
        elif episode.actions_left <= 0:
            episode.finish(StopReason.ACTION_BUDGET)
        elif turns.max_turn is not None and len(episode.traj.turns) >= turns.max_turn:
            episode.finish(StopReason.MAX_TURNS)
    return episode.traj


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

    def start(self, spec: EnvSpec) -> Episode:
        """The episode of ``spec``, to be played by ``play_episode`` with these turns."""
        episode = Episode(spec)
        episode.run = play_episode(episode, self)
        return episode

    @property
    def max_turn(self) -> int | None:
        """The turns an episode plays at most (None: no limit)."""
        return self.config.max_turn

    def reset(self, episode: Episode) -> None:
        """The env reset; a carried episode's brought back to where it stood (``env_calls.resume``),
        or, where it had ended, its trajectory handed back as it is."""
        carried = episode.spec.resume
        if carried is None:
            self.guarded(episode, reset, self.kept_envs, self.call)
        elif carried.stop_reason is StopReason.ABORTED:
            self.guarded(episode, resume, self.kept_envs, self.call)
        else:
            episode.traj = dataclasses.replace(carried)
            episode.active = False

    def apply(self, episode: Episode, completion: Completion) -> Played | None:
        """The answer applied (``turn.apply_answer``): the turn and whether the env said done, or
        None where the env failed and its episode ended (retried first, as ``env_calls.guard`` says)."""
        return self.guarded(episode, apply_answer, completion, self.ctx, self.config, self.call, answer=completion)

    def guarded(self, episode: Episode, fn: Callable[..., T], *args: Any, answer: Completion | None = None) -> T | None:
        """``fn(episode, *args)``, retried and ended as the env's failures are (``env_calls.guard``)."""
        return guard(episode, self.stats, self.isolate, self.config, self.call, fn, episode, *args, answer=answer)

    def end(self, episode: Episode, reason: StopReason, message: str) -> None:
        """The env ends in ``reason`` where the engine, not the env, is at fault: alone,
        whether or not errors are isolated (a re-run would wait for the same engine)."""
        end_in_error(episode, reason, self.stats, True, cause=None, message=message)

    def abort(self, episode: Episode) -> None:
        """The env ends ``aborted``: the rollout had enough groups done first (over-sampling)."""
        episode.finish(StopReason.ABORTED)

    def refuse(self, episode: Episode, message: str) -> None:
        """The env ends in error for a request that could not be sent (as an env's failure is)."""
        end_in_error(episode, StopReason.ERROR, self.stats, self.isolate, cause=None, message=message)

    def request(self, episode: Episode) -> GenerationRequest:
        """The env's prompt for its next turn. With ``token_history: append`` it carries
        the episode's ids so far: the engine appends the new message's tokens to them."""
        turns = episode.traj.turns
        messages = self.ctx.build_messages(episode.spec, turns, episode.observation, episode.actions_left)
        history = None
        if self.ctx.config.token_history == "append" and turns and turns[-1].has_prompt_ids:
            history = episode_ids(turns)
        return GenerationRequest(
            messages=messages,
            history_token_ids=history,
            # the messages up to the last answer are the history's
            history_messages=_after_last_answer(messages) if history is not None else 0,
            env_id=episode.spec.env_id,
            turn=len(turns),
            seed=episode.spec.seed,
            max_tokens=episode.spec.max_tokens,
            last_turn=len(turns) + 1 >= self.config.max_turn,
            answer_prefix=self.ctx.answer_prefix,
            tools=episode.spec.tools,
        )

    def close(self) -> None:
        self.call.close()


def _after_last_answer(messages: list[dict[str, str]]) -> int:
    """The index after the last assistant message."""
    return next(i + 1 for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant")
