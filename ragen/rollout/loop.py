"""The turn loop, shared by the sequential and the parallel rollout.

``run_envs(specs, client, config)`` plays every spec to the end and returns one
``Trajectory`` per spec, in spec order. Per turn: the prompt from the env's
state (``ContextManager``), the model's answer through an ``LLMClient``
(``ragen.serving.client``), its actions parsed and mapped to ids through the
env's ``ACTION_LOOKUP`` (unknown names dropped), and ``env.step`` for each
action within the budget. ``KeptEnvs`` keeps env instances between rollouts.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import logging
import math
import os
import reprlib
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, Callable, Sequence

from ragen.llm.types import Completion, GenerationRequest, SamplingParams
from ragen.rollout.config import AgentProxyConfig, EsManagerConfig, check_time_limit
from ragen.rollout.context import ContextConfig, ContextManager
from ragen.rollout.workers.executors import DaemonThreadPool
from ragen.serving.client import LLMClient
from ragen.serving.wire import MessageTooLarge
from ragen.rollout.workers.schedule import groups_of
from ragen.rollout.types import EnvSpec, Step, StopReason, Trajectory, Turn
from ragen.utils import deal

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopConfig:
    """Everything the loop needs besides specs and a client (plain, picklable).
    ``AgentSetup.from_config`` builds it from the config sections; its
    defaults are theirs (``ragen.rollout.config``)."""

    context: ContextConfig = field(default_factory=ContextConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_turn: int = AgentProxyConfig.max_turn
    format_penalty: float = EsManagerConfig.format_penalty
    env_timeout_s: float | None = AgentProxyConfig.env_timeout_s  # per reset/step; None: no limit
    pipeline_depth: int = AgentProxyConfig.pipeline_depth
    env_retries: int = AgentProxyConfig.env_retries  # retries of a failing env on a fresh instance

    def __post_init__(self) -> None:
        check_time_limit("env_timeout_s", self.env_timeout_s)


_ERRORS_LOCK = threading.Lock()


class EnvTimeout(Exception):
    """An env call ran past ``LoopConfig.env_timeout_s``."""


class EnvError(Exception):
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


class _Caller:
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


class _EnvThreads:
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

    def run(self, jobs: list[tuple["_EnvSlot", Any]]) -> None:
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
        # env_timeout_s when set (the call runs on the _Caller's thread).
        concurrent.futures.wait(futures)
        for f in futures:
            f.result()

    def close(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=False)  # every job has ended: run() waits for them


def _plain_info(info: Any) -> dict[str, Any]:
    """Keep the JSON-able scalars of an env's info (numpy scalars converted)."""
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


class _EnvSlot:
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

    def finish(self, reason: StopReason, error: str | None = None) -> None:
        self.active = False
        self.traj.stop_reason = reason
        self.traj.error = error
        self.traj.final_observation = self.observation


@dataclass
class LoopStats:
    """What one ``run_envs`` call spent and counted; a worker's add up (``+``)."""

    env_reset_s: float = 0.0
    env_step_s: float = 0.0
    wait_s: float = 0.0
    requests: int = 0
    submits: int = 0
    env_errors: int = 0  # envs that ended in error or timeout
    env_retries: int = 0  # retries of failed envs on fresh instances
    envs_created: int = 0  # 0 once a worker keeps its envs between rollouts
    chunks: int = 0  # chunks of groups taken from the rollout's queue (pull-based work)

    def __add__(self, other: "LoopStats") -> "LoopStats":
        return LoopStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def run_envs(
    specs: Sequence[EnvSpec],
    client: LLMClient,
    config: LoopConfig,
    kept_envs: KeptEnvs | None = None,
    isolate_errors: bool = True,
    fault: dict[str, int] | None = None,
    on_finished: Callable[[int], None] | None = None,
    take: Callable[[], list[EnvSpec]] | None = None,
    max_live_envs: int | None = None,
) -> tuple[list[Trajectory], LoopStats]:
    """Play every spec to the end; one trajectory per spec, in spec order.

    ``isolate_errors``: an env that raises (or times out) ends its own
    trajectory with stop reason ``error`` (``timeout``) and the others go on;
    otherwise the first failure raises ``EnvError`` (workers do this, so the
    fallback re-runs what the worker played). ``fault``: ``{"exit_at_turn": k}``
    makes the calling process exit at turn k (fault injection for benchmarks
    and tests).
    ``on_finished(n)``: ``n`` more envs ended (for progress), told just before
    the stream's next request or its close; it must not raise.

    ``take``: pull-based work (``ragen.rollout.workers.schedule``): besides
    ``specs``, each call returns the specs of one more chunk of whole groups,
    a stream of its own already opened by the manager, until it returns none.
    The loop takes the next chunk as soon as the last one is reset and its
    requests are sent, while fewer than ``max_live_envs`` envs are playing
    (None: no limit); trajectories come back in the order the specs came.
    """
    loop = _TurnLoop(client, config, kept_envs if kept_envs is not None else KeptEnvs(), isolate_errors, fault,
                     on_finished)
    slots = [_EnvSlot(s) for s in specs]
    try:
        loop.play(slots, take, max_live_envs)
        return [s.traj for s in slots], loop.stats
    except BaseException:
        client.reset()
        raise
    finally:
        loop.close()


@dataclass(eq=False)
class _TurnLoop:
    """The envs of one ``run_envs`` call, played in streams.

    Envs are split into ``pipeline_depth`` streams of whole groups, each with
    at most one request in flight (``inflight``, by the client's ticket):
    while one stream waits for the model, another steps its envs. A stream
    asks for its first answers as soon as its own envs are reset, and answers
    that arrive while later envs reset are handled between two resets. A
    trajectory depends only on its own env and the answers to its own
    requests, so the split never changes results. With pull-based work
    (``take``) each chunk of groups taken starts as a stream of its own;
    those past ``pipeline_depth`` (``riders``) join another stream answered in
    the same engine call (``handle``).

    The envs of a tag with ``parallel_friendly: true`` (RAGEN's key) are reset
    and stepped ``max_workers`` at a time on threads (``EnvSpec.env_threads``);
    other envs one after another.
    """

    client: LLMClient
    config: LoopConfig
    kept_envs: KeptEnvs
    isolate: bool
    fault: dict[str, int] | None
    on_finished: Callable[[int], None] | None
    stats: LoopStats = field(default_factory=LoopStats)
    inflight: dict[int, list[_EnvSlot]] = field(default_factory=dict)
    riders: set[int] = field(default_factory=set)
    open_streams: int = 0

    def __post_init__(self) -> None:
        self.ctx = ContextManager(self.config.context)
        self.call = _Caller(self.config.env_timeout_s)
        self.threads = _EnvThreads()

    def play(self, slots: list[_EnvSlot], take: Callable[[], list[EnvSpec]] | None,
             max_live_envs: int | None) -> None:
        """Every env of ``slots``, and of the chunks ``take`` gives (added to
        ``slots``), played to its end."""
        created = self.kept_envs.created
        streams = _split_streams(slots, self.config.pipeline_depth) if slots else []
        if streams:
            self.client.open_streams(len(streams))
        self.open_streams = len(streams)
        try:
            for stream in streams:
                self.start(stream)
            if take is not None:
                self.take_chunks(slots, take, max_live_envs)
            self.stats.envs_created = self.kept_envs.created - created
            while self.inflight:
                self.wait_some()
        finally:
            for _ in range(self.open_streams):
                self.client.close_stream()
        self.release_ended(slots)

    def take_chunks(self, slots: list[_EnvSlot], take: Callable[[], list[EnvSpec]],
                    max_live_envs: int | None) -> None:
        """Chunks from ``take``, each started as a stream, until it gives none."""
        while True:
            while self.inflight and max_live_envs is not None and sum(s.active for s in slots) >= max_live_envs:
                self.wait_some()  # no room for another chunk until envs end
            taken = [_EnvSlot(s) for s in take()]
            if not taken:
                return
            self.open_streams += 1
            self.stats.chunks += 1
            slots += taken
            self.start(taken, rider=self.open_streams > self.config.pipeline_depth)

    def start(self, stream: list[_EnvSlot], rider: bool = False) -> None:
        """The stream's envs reset and its first request sent; answers that
        arrive meanwhile are handled between two resets."""
        for chunk in _reset_chunks(stream):
            t0 = time.perf_counter()
            self.threads.run([self._guarded(slot, _reset, self.kept_envs, self.call) for slot in chunk])
            self.stats.env_reset_s += time.perf_counter() - t0
            while self.inflight and self.client.ready():  # keep the model busy while later envs reset
                self.handle(self.gather())
        self.report_finished(stream)
        self.release_ended(stream)
        self.submit(stream, rider)

    def wait_some(self) -> None:
        """The next answers waited for and handled."""
        t0 = time.perf_counter()
        got = self.gather()
        self.stats.wait_s += time.perf_counter() - t0
        self.handle(got)

    def gather(self) -> list[tuple[int, list[Completion]]]:
        """The next answer and every other one already here."""
        got = [self.client.wait_any()]
        while self.inflight and self.client.ready():
            got.append(self.client.wait_any())
        return got

    def handle(self, answers: list[tuple[int, list[Completion]]]) -> None:
        """Answers that arrived together (one engine call's): the riders
        among them are stepped first and join the next request of the first
        other stream answered with them, closing their own, so the streams
        a worker opened chunk by chunk merge back into pipeline_depth once
        they are in step (one request per stream and turn, fewer messages).
        Streams of the first pipeline_depth never merge: they overlap env
        steps with the engine when the coalescer does not wait for them all."""
        answers = sorted(answers, key=lambda a: a[0] not in self.riders)  # stable: riders first
        hosts = sum(t not in self.riders for t, _ in answers)
        joined: list[_EnvSlot] = []
        for i, (ticket, completions) in enumerate(answers):
            rider = ticket in self.riders
            self.riders.discard(ticket)
            batch = self.step(ticket, completions)
            if rider and (hosts or (i + 1 < len(answers))):
                joined += batch  # into the next answered stream's request
                self.client.close_stream()
                self.open_streams -= 1
            else:
                self.submit(batch + joined, rider)
                joined = []

    def step(self, ticket: int, completions: list[Completion]) -> list[_EnvSlot]:
        """The answered batch's envs stepped; returns the batch."""
        batch = self.inflight.pop(ticket)
        if len(completions) != len(batch):
            raise RuntimeError(f"engine answered {len(completions)} completions for {len(batch)} requests")
        if self.fault and batch and len(batch[0].traj.turns) + 1 >= self.fault.get("exit_at_turn", 1 << 30):
            logger.warning("fault injection: process %d exits now", os.getpid())
            os._exit(3)
        t0 = time.perf_counter()
        self.threads.run([self._guarded(slot, _apply, completion, self.ctx, self.config, self.call)
                          for slot, completion in zip(batch, completions)])
        self.stats.env_step_s += time.perf_counter() - t0
        self.report_finished(batch)
        self.release_ended(batch)
        return batch

    def submit(self, batch: list[_EnvSlot], rider: bool) -> None:
        """The batch's next request; its stream closes when none of its envs plays on."""
        ticket = self.send(batch)
        self.report_finished(batch)  # envs whose request was too large for the manager
        if ticket is None:
            self.client.close_stream()
            self.open_streams -= 1
        elif rider:
            self.riders.add(ticket)

    def send(self, stream: list[_EnvSlot]) -> int | None:
        """The next request of the stream's active envs: its ticket; None when none is active.
        An env whose request would take the message past the manager's limit ends
        in ``error`` (the largest first, until the rest fit); the others are sent."""
        active = [s for s in stream if s.active]
        if not active:
            return None
        requests = [self.request(s) for s in active]
        while True:
            try:
                ticket = self.client.submit(requests, self.config.sampling)
                break
            except MessageTooLarge as exc:
                for i in exc.refused:
                    _end_in_error(active[i], StopReason.ERROR, self.stats, self.isolate, cause=None, message=(
                        f"MessageTooLarge: its request to the LLM manager ({exc.request_sizes.get(i, 0)} bytes) "
                        f"takes a message of {exc.size} bytes past the limit of {exc.limit} bytes; raise "
                        f"agent_proxy.max_message_bytes or make the env's observations shorter"))
                refused = set(exc.refused)
                keep = [i for i in range(len(active)) if i not in refused]
                active, requests = [active[i] for i in keep], [requests[i] for i in keep]
                if not active:
                    return None
        self.inflight[ticket] = active
        self.stats.requests += len(requests)
        self.stats.submits += 1
        return ticket

    def request(self, slot: _EnvSlot) -> GenerationRequest:
        """The env's prompt for its next turn."""
        turns = slot.traj.turns
        return GenerationRequest(
            messages=self.ctx.build_messages(slot.spec, turns, slot.observation, slot.actions_left,
                                             slot.traj.action_names),
            env_id=slot.spec.env_id,
            turn=len(turns),
            seed=slot.spec.seed,
            max_tokens=slot.spec.max_tokens,
            last_turn=len(turns) + 1 >= self.config.max_turn,
        )

    def _guarded(self, slot: _EnvSlot, fn: Callable[..., None], *args: Any) -> tuple[_EnvSlot, Any]:
        """A job for ``_EnvThreads``: ``fn(slot, *args)`` under ``_guard``."""
        return slot, functools.partial(_guard, slot, self.stats, self.isolate, self.config, self.call, fn, slot, *args)

    def release_ended(self, batch: list[_EnvSlot]) -> None:
        """Ended envs go back to kept_envs at once: a chunk taken later reuses them."""
        for slot in batch:
            if not slot.active and slot.env is not None:
                self.kept_envs.release(slot.spec, slot.env)
                slot.env = None

    def report_finished(self, slots: list[_EnvSlot]) -> None:
        """Tell ``on_finished`` of the slots that ended since they were last looked at."""
        if self.on_finished is None:
            return
        n = 0
        for s in slots:
            if not s.active and not s.reported:
                s.reported = True
                n += 1
        if n:
            self.on_finished(n)

    def close(self) -> None:
        self.threads.close()
        self.call.close()


def _reset_chunks(stream: list[_EnvSlot]) -> list[list[_EnvSlot]]:
    """The stream's envs in the order they are reset: one at a time, except
    the envs of a tag with ``env_threads > 1``, reset together (at the place
    of the tag's first env)."""
    chunks: list[list[_EnvSlot]] = []
    together: dict[str, list[_EnvSlot]] = {}
    for slot in stream:
        if slot.spec.env_threads <= 1:
            chunks.append([slot])
        elif slot.spec.tag in together:
            together[slot.spec.tag].append(slot)
        else:
            together[slot.spec.tag] = [slot]
            chunks.append(together[slot.spec.tag])
    return chunks


def stream_count(specs: Sequence[EnvSpec], depth: int) -> int:
    """How many micro-batches (streams) ``run_envs`` splits these specs into."""
    return max(1, min(depth, len({s.group_id for s in specs})))


def _split_streams(slots: list[_EnvSlot], depth: int) -> list[list[_EnvSlot]]:
    """``depth`` micro-batches of whole groups (fewer when there are fewer
    groups), dealt out in turn so that each gets a share of every tag."""
    members = groups_of(slots, attrgetter("spec.group_id"))
    depth = stream_count([s.spec for s in slots], depth)
    return [[s for g in hand for s in g] for hand in deal(members, depth)]


def _guard(slot: _EnvSlot, stats: LoopStats, isolate: bool, config: LoopConfig, call: _Caller, fn, *args) -> None:
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
                _rebuild(slot, call, expect=saved[0] if fn is _apply else None)
                if fn is _reset:  # the rebuild was the reset
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
                               _where(slot), len(slot.traj.turns), message, attempt + 1, config.env_retries)
                continue
            logger.debug("%s", traceback.format_exc())
            if fn is _apply:  # args: (slot, completion, ...); the turn is lost, its answer kept for a replay
                slot.traj.failed_response = args[1].text
            _end_in_error(slot, StopReason.TIMEOUT if isinstance(exc, EnvTimeout) else StopReason.ERROR, stats,
                          isolate, cause=exc, message=message)
            return


def _where(slot: _EnvSlot) -> str:
    return f"env_id {slot.spec.env_id} (tag {slot.spec.tag}, seed {slot.spec.seed})"


def _end_in_error(slot: _EnvSlot, reason: StopReason, stats: LoopStats, isolate: bool, cause: BaseException | None,
                  message: str) -> None:
    """The env ends its trajectory with ``reason`` (error or timeout) and
    ``message``, counted in ``stats``; when not ``isolate``, ``EnvError``
    instead."""
    where = _where(slot)
    with _ERRORS_LOCK:  # envs of a parallel_friendly tag fail on several threads at once
        stats.env_errors += 1
    if not isolate:
        raise EnvError(f"{where}: {message}") from cause
    logger.warning("%s ended in %s at turn %d: %s", where, reason.value, len(slot.traj.turns), message)
    slot.finish(reason, message)


def _rebuild(slot: _EnvSlot, call: _Caller, expect: str | None) -> None:
    """A fresh instance of the slot's env (not a kept one), reset with the
    same seed, with every recorded action stepped again; ``expect``: the
    observation the failed instance had shown, which the replay must give."""
    from ragen.env import make_env

    spec = slot.spec
    slot.env = make_env(spec.env_type, spec.env_config, config_type=spec.config_type, tag=spec.tag)
    _reset_env(slot, call)
    for turn in slot.traj.turns:
        for name in turn.executed_actions:
            action = slot.lookup[name.lower()] if slot.lookup is not None else name
            slot.observation = _observation(call(slot.env.step, action)[0], "step")
    if expect is not None and slot.observation != expect:
        raise RuntimeError("replaying the recorded actions on a fresh instance gave another state than the failed "
                           "one had: the env is not deterministic for its seed, so it cannot be retried "
                           "(set agent_proxy.env_retries=0 for it)")


def _reset(slot: _EnvSlot, kept_envs: KeptEnvs, call: _Caller) -> None:
    t0 = time.perf_counter()
    slot.env = kept_envs.acquire(slot.spec)
    _reset_env(slot, call)
    slot.traj.reset_s = time.perf_counter() - t0


def _reset_env(slot: _EnvSlot, call: _Caller) -> None:
    kwargs = {"mode": slot.spec.mode} if _takes_mode(type(slot.env)) else {}
    slot.observation = _observation(call(slot.env.reset, seed=slot.spec.seed, **kwargs), "reset")
    lookup = getattr(slot.env, "ACTION_LOOKUP", None)
    if lookup:
        slot.traj.action_names = [str(v) for v in lookup.values()]
        slot.lookup = {str(v).lower(): k for k, v in lookup.items()}


@functools.lru_cache(maxsize=None)
def _takes_mode(env_cls: type) -> bool:
    """Whether ``env_cls.reset`` has a ``mode`` parameter (RAGEN's envs do;
    ours and many users' take ``**kwargs`` and need not see it)."""
    try:
        return "mode" in inspect.signature(env_cls.reset).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented reset: no signature
        return False


class EnvOutputError(Exception):
    """An env returned a value the loop cannot use (an observation that is not
    text, a reward that is not a finite number): it ends that env in
    ``error``, as an exception raised by the env would."""


def _observation(obs: Any, method: str) -> str:
    """``obs`` as the loop takes it: text, never ``str()`` of another object (the model would see its repr)."""
    if not isinstance(obs, str):
        raise EnvOutputError(f"{method} returned an observation of type {type(obs).__name__} "
                             f"({reprlib.repr(obs)}), not str: return the text the agent sees (e.g. self.render())")
    return obs


def _reward(r: Any) -> float:
    """A step's reward as a float; a string, a non-number or a NaN/infinite one is refused, since one
    of these in a sum makes every reward metric of the rollout NaN."""
    try:
        value = None if isinstance(r, (str, bytes)) else float(r)
    except (TypeError, ValueError):
        value = None
    if value is None:
        raise EnvOutputError(f"step returned a reward of type {type(r).__name__} ({reprlib.repr(r)}), "
                             "not a number: return the reward as a float")
    if not math.isfinite(value):
        raise EnvOutputError(f"step returned the reward {value}, not a finite number")
    return value


def _apply(slot: _EnvSlot, completion: Completion, ctx: ContextManager, config: LoopConfig, call: _Caller) -> None:
    actions = ctx.parse_response(completion.text)
    if slot.lookup is not None:
        valid = [(a, slot.lookup[a.lower()]) for a in actions if a.lower() in slot.lookup]
    else:
        valid = [(a, a) for a in actions]
    budget = slot.actions_left
    shown = slot.observation
    reward, done, info, executed, steps = 0.0, False, {}, [], []
    t0 = time.perf_counter()
    for name, action in valid[:budget]:
        obs, r, done, step_info = call(slot.env.step, action)
        r = _reward(r)
        slot.observation = _observation(obs, "step")
        reward += r
        info.update(_plain_info(step_info))
        executed.append(name)
        steps.append(Step(action=name, observation=slot.observation, reward=r, done=bool(done)))
        slot.actions_left -= 1
        if done:
            break
    env_s = time.perf_counter() - t0
    penalty = config.format_penalty if (not valid or len(valid) != len(actions)) else 0.0
    slot.traj.turns.append(
        Turn(
            observation=shown,
            actions_left=budget,
            response=completion.text,
            actions=actions,
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
        )
    )
    if info.get("success"):
        slot.traj.success = True
    if done:
        slot.finish(StopReason.DONE)
    elif slot.actions_left <= 0:
        slot.finish(StopReason.ACTION_BUDGET)
    elif len(slot.traj.turns) >= config.max_turn:
        slot.finish(StopReason.MAX_TURNS)
