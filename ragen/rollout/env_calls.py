"""An env's calls in the turn loop: reset and step within a time limit, on
instances kept between rollouts, retried on a fresh instance when they fail,
their outputs checked; an answer applied as actions (``apply_answer``)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import math
import reprlib
import threading
import time
import traceback
from collections import defaultdict
from typing import Any, Iterator, Sequence

from ragen.env.base import action_lookup, plain_info, reset_takes_mode
from ragen.errors import RagenError
from ragen.llm.tool_calls import BadCall, ToolCall
from ragen.llm.types import Completion
from ragen.rollout.context import ContextManager
from ragen.rollout.loop_config import LoopConfig, LoopStats
from ragen.rollout.types import EnvSpec, Step, StopReason, Trajectory, Turn, episode_ids, prompt_delta
from ragen.rollout.workers.executors import DaemonThreadPool

logger = logging.getLogger(__name__)

_ERRORS_LOCK = threading.Lock()


class EnvTimeout(RagenError):
    """An env call ran past ``LoopConfig.env_timeout_s``."""


class EnvError(RagenError):
    """An env raised or timed out where errors are not isolated (``isolate_errors=False``):
    the caller decides what becomes of every env of the call (a parallel worker's are re-run
    by the fallback)."""


class KeptEnvs:
    """Env instances kept between rollouts, by ``EnvSpec.reuse_key``."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[Any]] = defaultdict(list)
        self.created = 0
        self._lock = threading.Lock()  # envs of a parallel_friendly tag are acquired on several threads

    def acquire(self, spec: EnvSpec) -> Any:
        with self._lock:
            free = self._free.get(spec.reuse_key)
            if free:
                return free.pop()
            self.created += 1
        from ragen.env import make_env

        return make_env(spec.env_type, spec.env_config, config_type=spec.config_type, tag=spec.tag)

    def release(self, spec: EnvSpec, env: Any) -> None:
        self._free[spec.reuse_key].append(env)

    def __len__(self) -> int:
        return sum(len(v) for v in self._free.values())

    def close(self) -> None:
        for envs in self._free.values():
            for env in envs:
                try:
                    env.close()
                except Exception:  # closing is best effort
                    logger.debug("env close failed", exc_info=True)
        self._free.clear()


class EnvCaller:
    """Runs env calls, with a time limit when one is set.

    A call past its limit leaves its thread behind (a thread cannot be killed);
    the env is then abandoned and a fresh thread serves the next calls. Each
    calling thread has its own helper thread, so envs stepped at once on a
    ``parallel_friendly`` tag's threads are timed apart.
    """

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._helpers: list[DaemonThreadPool] = []

    def __call__(self, fn, *args, **kwargs):
        if not self.timeout_s:
            return fn(*args, **kwargs)
        helper = getattr(self._local, "helper", None)
        if helper is None:
            # daemon threads: a call abandoned past its limit must not keep the process from exiting
            helper = self._local.helper = DaemonThreadPool(1, thread_name_prefix="ragen-env")
            self._helpers.append(helper)
        future = helper.submit(fn, *args, **kwargs)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            helper.shutdown(wait=False)
            self._local.helper = None
            raise EnvTimeout(f"env call {getattr(fn, '__name__', fn)} took longer than {self.timeout_s} s") from None

    def close(self) -> None:
        for helper in self._helpers:
            helper.shutdown(wait=False)


class EnvThreads:
    """Runs env work for a list of slots: one after another, except the slots
    of a tag with ``env_threads > 1`` (RAGEN's ``parallel_friendly`` with
    ``max_workers``), which run at once on that many threads.

    Each job touches only its own slot and env, so running them at once never
    changes a result. A job's exception is raised after every job of the call
    has ended, the first in slot order, so no env is still stepping when the
    caller handles it.
    """

    def __init__(self) -> None:
        self._executors: dict[int, DaemonThreadPool] = {}  # by thread count

    def run(self, jobs: list[tuple["EnvSlot", Any]]) -> None:
        by_tag: dict[str, list[Any]] = defaultdict(list)
        for slot, job in jobs:
            if slot.spec.env_threads > 1:
                by_tag[slot.spec.tag].append((slot, job))
            else:
                job()
        futures = []
        for tag_jobs in by_tag.values():
            if len(tag_jobs) == 1:
                tag_jobs[0][1]()
                continue
            n = tag_jobs[0][0].spec.env_threads
            executor = self._executors.get(n)
            if executor is None:
                executor = DaemonThreadPool(n, thread_name_prefix="ragen-envs")
                self._executors[n] = executor
            futures += [executor.submit(job) for _, job in tag_jobs]
        # Bounded: each job is one env call sequence, itself bounded by
        # env_timeout_s when set (the call runs on the EnvCaller's thread).
        concurrent.futures.wait(futures)
        for f in futures:
            f.result()

    def close(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=False)  # every job has ended: run() waits for them


class EnvSlot:
    """One env's live state during the loop."""

    def __init__(self, spec: EnvSpec) -> None:
        self.spec = spec
        self.env: Any = None
        self.traj = Trajectory(env_id=spec.env_id, group_id=spec.group_id, tag=spec.tag, seed=spec.seed)
        self.observation = ""
        self.actions_left = spec.max_actions_per_traj
        self.active = True
        self.lookup: dict[str, Any] | None = None  # lower-case action name -> action id
        self.reported = False  # its end was told to the progress callback
        self.timed = False  # its end was counted in the loop's first and last env end

    def finish(self, reason: StopReason, error: str | None = None) -> None:
        self.active = False
        self.traj.stop_reason = reason
        self.traj.error = error
        self.traj.final_observation = self.observation


def guard(slot: EnvSlot, stats: LoopStats, isolate: bool, config: LoopConfig, call: EnvCaller, fn, *args) -> None:
    """``fn(*args)`` for one env; when the env raises or times out, it is
    retried up to ``config.env_retries`` times on a fresh instance brought to
    where the failed one was (``_rebuild``), then ends its own trajectory in
    ``error``/``timeout`` (or raises ``EnvError`` when not ``isolate``)."""
    if not slot.active:
        return
    saved = (slot.observation, slot.actions_left)
    for attempt in range(config.env_retries + 1):
        try:
            if attempt:
                _rebuild(slot, call, expect=saved[0] if fn is apply_answer else None)
                if fn is reset:  # the rebuild was the reset
                    return
            fn(*args)
            return
        except (Exception, EnvTimeout) as exc:  # an env's own code failed
            slot.observation, slot.actions_left = saved
            slot.env = None  # a failed env's state is unknown: never reuse it
            message = f"{type(exc).__name__}: {exc}"
            if attempt < config.env_retries:
                with _ERRORS_LOCK:
                    stats.env_retries += 1
                logger.warning("%s failed at turn %d: %s; retrying on a fresh instance (%d of %d)",
                               describe(slot), len(slot.traj.turns), message, attempt + 1, config.env_retries)
                continue
            logger.debug("%s", traceback.format_exc())
            if fn is apply_answer:  # args: (slot, completion, ...); the turn is lost, its answer kept for a replay
                slot.traj.failed_response = args[1].text
            timed_out = isinstance(exc, (EnvTimeout, TimeoutError))  # the loop's limit, or the env's own (a remote env's)
            end_in_error(slot, StopReason.TIMEOUT if timed_out else StopReason.ERROR, stats, isolate, cause=exc,
                         message=message)
            return


def describe(slot: EnvSlot) -> str:
    """The env as log lines and errors name it."""
    return f"env_id {slot.spec.env_id} (tag {slot.spec.tag}, seed {slot.spec.seed})"


def end_in_error(slot: EnvSlot, reason: StopReason, stats: LoopStats, isolate: bool, cause: BaseException | None,
                  message: str) -> None:
    """The env ends its trajectory with ``reason`` (error or timeout) and
    ``message``, counted in ``stats``; when not ``isolate``, ``EnvError``
    instead."""
    where = describe(slot)
    with _ERRORS_LOCK:  # envs of a parallel_friendly tag fail on several threads at once
        stats.env_errors += 1
    if not isolate:
        raise EnvError(f"{where}: {message}") from cause
    logger.warning("%s ended in %s at turn %d: %s", where, reason.value, len(slot.traj.turns), message)
    slot.finish(reason, message)


def _rebuild(slot: EnvSlot, call: EnvCaller, expect: str | None) -> None:
    """A fresh instance of the slot's env (not a kept one), reset with the
    same seed, with every recorded action stepped again; ``expect``: the
    observation the failed instance had shown, which the replay must give."""
    from ragen.env import make_env

    spec = slot.spec
    slot.env = make_env(spec.env_type, spec.env_config, config_type=spec.config_type, tag=spec.tag)
    reset_env(slot, call)
    for _ in _step_again(slot, call, slot.traj.turns):
        pass
    if expect is not None and slot.observation != expect:
        raise RuntimeError("replaying the recorded actions on a fresh instance gave another state than the failed "
                           "one had: the env is not deterministic for its seed, so it cannot be retried "
                           "(set agent_proxy.env_retries=0 for it)")


def _step_again(slot: EnvSlot, call: EnvCaller, turns: Sequence[Turn]) -> Iterator[tuple[int, Step, Any, Any]]:
    """Every recorded step of ``turns`` taken again on the slot's env, its observation read: the
    turn's number, the step's record, and the reward and end the env gave this time."""
    for i, turn in enumerate(turns, 1):
        for step in turn.steps:
            obs, r, done, _ = call(slot.env.step, stepped_action(slot, step.action))
            slot.observation = _observation(obs, "step")
            yield i, step, r, done


def stepped_action(slot: EnvSlot, name: str) -> Any:
    """What the env's ``step`` got for an executed action recorded as ``name``: its id in the
    env's lookup, a tool call's ``{"name", "arguments"}``, or the name itself."""
    if slot.spec.tools:
        return json.loads(name)
    return slot.lookup[name.lower()] if slot.lookup is not None else name


def reset(slot: EnvSlot, kept_envs: KeptEnvs, call: EnvCaller) -> None:
    t0 = time.perf_counter()
    slot.env = kept_envs.acquire(slot.spec)
    reset_env(slot, call)
    slot.traj.reset_s = time.perf_counter() - t0


def resume(slot: EnvSlot, kept_envs: KeptEnvs, call: EnvCaller) -> None:
    """A carried episode (``spec.resume``, cut short by an earlier rollout) brought back to where it
    stood: its env reset with its seed and every recorded action stepped again, each giving what it
    gave then (else the env is not deterministic for its seed: ``CarryDiverged``), and its turns
    taken over as they were (their answers, versions and log-probs)."""
    carried = slot.spec.resume
    reset(slot, kept_envs, call)
    steps = 0
    for i, step, r, done in _step_again(slot, call, carried.turns):
        # no bound: the recorded reward passed it when played; a reward that differs diverges
        if (slot.observation, _reward(r, math.inf, _step_where(slot, i, steps + 1)), bool(done)) \
                != (step.observation, step.reward, step.done):
            raise CarryDiverged(
                f"stepping its recorded action {step.action!r} again (turn {i}) gave another observation, reward "
                f"or end than it did: the env is not deterministic for its seed, so its episode cannot be carried "
                f"to the next rollout (set agent_proxy.unfinished=abort)")
        steps += 1
    slot.traj.turns = list(carried.turns)  # once all of them replayed: a retry starts from the reset
    slot.actions_left -= steps
    slot.traj.success = carried.success


class CarryDiverged(RagenError, RuntimeError):
    """A carried episode's env, stepped again, did not give what it gave the first time."""


def reset_env(slot: EnvSlot, call: EnvCaller) -> None:
    """The slot's env reset with its seed (and its mode, where ``reset`` takes one); its
    observation and action lookup read."""
    kwargs = {"mode": slot.spec.mode} if reset_takes_mode(type(slot.env)) else {}
    slot.observation = _observation(call(slot.env.reset, seed=slot.spec.seed, **kwargs), "reset")
    lookup = action_lookup(slot.env)
    if lookup:
        slot.traj.action_names = [str(v) for v in lookup.values()]
        slot.lookup = {str(v).lower(): k for k, v in lookup.items()}


class EnvOutputError(RagenError):
    """An env returned a value the loop cannot use (an observation that is not
    text, a reward that is not a finite number or is beyond
    ``es_manager.max_abs_reward``): it ends that env in ``error``, as an
    exception raised by the env would."""


def _observation(obs: Any, method: str) -> str:
    """``obs`` as the loop takes it: text, never ``str()`` of another object (the model would see its repr)."""
    if not isinstance(obs, str):
        raise EnvOutputError(f"{method} returned an observation of type {type(obs).__name__} "
                             f"({reprlib.repr(obs)}), not str: return the text the agent sees (e.g. self.render())")
    return obs


def _reward(r: Any, max_abs: float, where: str) -> float:
    """A step's reward as a number: a Python int or float as it is (a prompt shows the sum as RAGEN
    does, ``0`` or ``0.0``), anything else as a float. A string, a non-number, a NaN/infinite one or
    one beyond +-``max_abs`` (``es_manager.max_abs_reward``) is refused, naming ``where`` (the tag
    and the step): one of these in a sum makes the group's advantages and the rollout's reward
    metrics NaN, or swamps every other reward."""
    try:
        value = None if isinstance(r, (str, bytes)) else float(r)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int too large for a float
        value = None
    if value is None:
        raise EnvOutputError(f"step returned a reward of type {type(r).__name__} ({reprlib.repr(r)}), "
                             f"not a number ({where}): return the reward as a float")
    if not math.isfinite(value):
        raise EnvOutputError(f"step returned the reward {value}, not a finite number ({where})")
    if abs(value) > max_abs:
        raise EnvOutputError(f"step returned the reward {value:g}, beyond es_manager.max_abs_reward={max_abs:g} "
                             f"({where}): return a smaller reward, or raise the bound")
    return r if type(r) in (int, float) else value


def _step_where(slot: EnvSlot, turn: int, step: int) -> str:
    """A step as a reward error names it: the env's tag, the step's number in the episode and its turn."""
    return f"tag {slot.spec.tag}, step {step} of the episode, turn {turn}"


def apply_answer(slot: EnvSlot, completion: Completion, ctx: ContextManager, config: LoopConfig, call: EnvCaller) -> None:
    """The answer parsed into actions (a tool env's: into tool calls) and applied
    (``apply_actions``), within ``config.max_turn`` turns. An answer the parser fails on is
    the model's mistake, never the env's: no action, the format penalty, and (a tool env's)
    the reason as the call's error."""
    tools = slot.spec.tools
    try:
        parsed = ctx.parse_calls(completion, tools) if tools else ctx.parse_response(completion.text)
    except Exception as exc:  # broad: the parsers read only the model's text, whatever it made them raise
        logger.warning("%s: the parser failed on the answer at turn %d, which takes the format penalty: %s: %s",
                       describe(slot), len(slot.traj.turns), type(exc).__name__, exc, exc_info=True)
        parsed = [BadCall(completion.text, f"the answer could not be read ({type(exc).__name__})")] if tools else []
    if tools:
        apply_tool_calls(slot, parsed, completion, config.format_penalty, call, config.max_turn,
                         max_abs_reward=config.max_abs_reward)
        return
    apply_actions(slot, parsed, completion, config.format_penalty, call, config.max_turn,
                  max_abs_reward=config.max_abs_reward)


def apply_tool_calls(slot: EnvSlot, calls: list[ToolCall | BadCall], completion: Completion,
                     format_penalty: float, call: EnvCaller, max_turn: int | None, *, max_abs_reward: float) -> None:
    """A tool env's turn: each valid call stepped as an action (``{"name", "arguments"}``),
    as ``apply_actions`` steps actions (a call that does not parse or match its tool is
    dropped, with the format penalty); the turn's ``tool_results`` answer every call in
    order: its step's observation, the parse error, or why it was not run."""
    valid = [(c.text, c.action()) for c in calls if isinstance(c, ToolCall)]
    apply_actions(slot, [c.text for c in calls], completion, format_penalty, call, max_turn, valid=valid,
                  max_abs_reward=max_abs_reward)
    turn = slot.traj.turns[-1]
    observations = iter(s.observation for s in turn.steps)
    results = []
    for n, c in enumerate(calls, 1):
        if isinstance(c, BadCall):
            results.append(f"Error in tool call {n}: {c.error}")
        else:
            results.append(next(observations, "Not run: the episode ended before this call."))
    server_calls = None if completion.tool_calls is None else tuple(completion.tool_calls)
    slot.traj.turns[-1] = dataclasses.replace(turn, tool_results=tuple(results), tool_calls=server_calls)


def apply_actions(slot: EnvSlot, actions: list[str], completion: Completion, format_penalty: float,
                  call: EnvCaller, max_turn: int | None, valid: list[tuple[str, Any]] | None = None, *,
                  max_abs_reward: float) -> None:
    """One turn: the actions the env knows (its lookup, any case; the others dropped) stepped
    within the action budget until one ends the env, recorded as a ``Turn`` of ``completion``'s
    answer, with ``format_penalty`` when an action was dropped or none was given. The env
    ends when it is done, its action budget is spent, or it played ``max_turn`` turns (None:
    no limit). ``valid``: the (name, action) pairs to step, where the caller read them. A
    step's reward beyond +-``max_abs_reward``, or an episode total that is not finite, raises
    ``EnvOutputError`` (the env then ends in error)."""
    if valid is None and slot.lookup is not None:
        valid = [(a, slot.lookup[a.lower()]) for a in actions if isinstance(a, str) and a.lower() in slot.lookup]
    elif valid is None:
        valid = [(a, a) for a in actions]
    budget = slot.actions_left
    shown = slot.observation
    # an int 0 until a step adds to it: a prompt shows the turn's reward as str(), as RAGEN does
    reward, done, info, executed, steps, costs = 0, False, {}, [], [], {}
    turn_no = len(slot.traj.turns) + 1
    steps_before = sum(len(t.steps) for t in slot.traj.turns)
    total_before = slot.traj.reward
    t0 = time.perf_counter()
    for name, action in valid[:budget]:
        obs, r, done, step_info = call(slot.env.step, action)
        _add_costs(costs, slot.env)
        where = _step_where(slot, turn_no, steps_before + len(steps) + 1)
        r = _reward(r, max_abs_reward, where)
        slot.observation = _observation(obs, "step")
        reward += r
        if not math.isfinite(total_before + reward):
            raise EnvOutputError(f"the episode's reward came to {total_before + reward}, not a finite number, "
                                 f"with the reward {r:g} ({where})")
        info.update(plain_info(step_info))
        executed.append(name)
        steps.append(Step(action=name, observation=slot.observation, reward=r, done=bool(done)))
        slot.actions_left -= 1
        if done:
            break
    env_s = time.perf_counter() - t0
    penalty = format_penalty if (not valid or len(valid) != len(actions)) else 0.0
    prompt_start, prompt_ids = _prompt_ids(slot, completion)
    slot.traj.turns.append(
        Turn(
            observation=shown,
            actions_left=budget,
            response=completion.text,
            actions=list(actions),
            executed_actions=executed,
            reward=reward,
            penalty=penalty,
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
    )
    if info.get("success"):
        slot.traj.success = True
    if done:
        slot.finish(StopReason.DONE)
    elif slot.actions_left <= 0:
        slot.finish(StopReason.ACTION_BUDGET)
    elif max_turn is not None and len(slot.traj.turns) >= max_turn:
        slot.finish(StopReason.MAX_TURNS)


def _add_costs(costs: dict[str, list[float]], env: Any) -> None:
    """The env's ``step_costs`` of the step it just took, added to ``costs``; a value that is not
    a finite number is left out (a cost is a measurement, never a reason to end the env)."""
    given = getattr(env, "step_costs", None)
    if not isinstance(given, dict):
        return
    for name, value in given.items():
        if isinstance(name, str) and isinstance(value, (int, float)) and math.isfinite(value):
            costs.setdefault(name, []).append(float(value))


def _prompt_ids(slot: EnvSlot, completion: Completion) -> tuple[int, tuple[int, ...]]:
    """Where the turn's prompt ids start in the episode's, and the ids from there."""
    if completion.prompt_start:  # sent as the ids after the episode's, which the request carried
        return completion.prompt_start, tuple(completion.prompt_token_ids)
    if completion.prompt_token_ids:
        return prompt_delta(episode_ids(slot.traj.turns), completion.prompt_token_ids)
    return 0, ()
