"""The turn loop, shared by the sequential and the parallel rollout.

``run_envs(specs, client, config)`` plays every spec to the end and returns one
``Trajectory`` per spec, in spec order. Per turn: the prompt from the env's
state (``ContextManager``), the model's answer through an ``LLMClient``
(``ragen.serving.client``), its actions parsed and mapped to ids through the
env's ``ACTION_LOOKUP`` (unknown names dropped), and ``env.step`` for each
action within the budget. ``KeptEnvs`` keeps env instances between rollouts.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Callable, Sequence

from ragen.llm.types import Completion, GenerationRequest
from ragen.rollout.context import ContextManager
from ragen.rollout.env_calls import (EnvCaller, EnvError, EnvSlot, EnvThreads, KeptEnvs, apply_answer, end_in_error,
                                     guard, reset)
from ragen.rollout.loop_config import LoopConfig, LoopStats
from ragen.rollout.types import EnvSpec, StopReason, Trajectory, episode_ids
from ragen.rollout.workers.schedule import groups_of
from ragen.serving.client import LLMClient
from ragen.llm.types import EngineError
from ragen.serving.wire import MessageTooLarge
from ragen.utils import deal

__all__ = ["EnvError", "KeptEnvs", "LoopConfig", "LoopStats", "run_envs", "stream_count"]

logger = logging.getLogger(__name__)


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
    pipeline_depth: int = 1,
    env_timeout_s: float | None = None,
    env_level: bool | None = None,
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

    ``pipeline_depth``: the streams the specs are split into (one: RAGEN's
    loop, one engine call a turn). ``env_timeout_s``: a limit on each env call
    where ``config.env_timeout_s`` sets none (the fallback's). ``env_level``:
    every env a stream of its own, with no barrier between envs: an env takes
    its next turn as soon as its own answer is in and its step done (for a
    client whose engine answers requests as they finish: ``client.streams``);
    None: as ``config.env_level_async`` says (auto: when the client streams).
    Env-level, each request is waited for at most ``config.engine_timeout_s``
    (its env then ends in ``timeout``), an engine's error for one request ends
    that env in ``error``, and requests that became ready together go out in
    one message.
    """
    if env_level is None:
        mode = config.env_level_async
        env_level = bool(getattr(client, "streams", False)) if mode == "auto" else bool(mode)
    loop = _TurnLoop(client, config, kept_envs if kept_envs is not None else KeptEnvs(), isolate_errors, fault,
                     on_finished, pipeline_depth, config.env_timeout_s or env_timeout_s, env_level)
    slots = [EnvSlot(s) for s in specs]
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
    pipeline_depth: int
    env_timeout_s: float | None
    env_level: bool = False
    stats: LoopStats = field(default_factory=LoopStats)
    inflight: dict[int, list[EnvSlot]] = field(default_factory=dict)
    deadlines: dict[int, float] = field(default_factory=dict)  # env-level: by ticket, when its wait ends
    riders: set[int] = field(default_factory=set)
    open_streams: int = 0

    def __post_init__(self) -> None:
        self.ctx = ContextManager(self.config.context)
        self.call = EnvCaller(self.env_timeout_s)
        self.threads = EnvThreads()

    def play(self, slots: list[EnvSlot], take: Callable[[], list[EnvSpec]] | None,
             max_live_envs: int | None) -> None:
        """Every env of ``slots``, and of the chunks ``take`` gives (added to
        ``slots``), played to its end."""
        created = self.kept_envs.created
        streams = ([[s] for s in slots] if self.env_level else _split_streams(slots, self.pipeline_depth)) \
            if slots else []
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
            self.client.flush()  # held closes and cancels
        self.release_ended(slots)

    def take_chunks(self, slots: list[EnvSlot], take: Callable[[], list[EnvSpec]],
                    max_live_envs: int | None) -> None:
        """Chunks from ``take``, each started as a stream, until it gives none."""
        while True:
            while self.inflight and max_live_envs is not None and sum(s.active for s in slots) >= max_live_envs:
                self.wait_some()  # no room for another chunk until envs end
            taken = [EnvSlot(s) for s in take()]
            if not taken:
                return
            self.stats.chunks += 1
            slots += taken
            if self.env_level:  # an env a stream: the chunk's own, and one more for each other env
                if len(taken) > 1:
                    self.client.open_streams(len(taken) - 1)
                self.open_streams += len(taken)
                for slot in taken:
                    self.start([slot])
                continue
            self.open_streams += 1
            self.start(taken, rider=self.open_streams > self.pipeline_depth)

    def start(self, stream: list[EnvSlot], rider: bool = False) -> None:
        """The stream's envs reset and its first request sent; answers that
        arrive meanwhile are handled between two resets."""
        for chunk in _reset_chunks(stream):
            t0 = time.perf_counter()
            self.threads.run([self._guarded(slot, reset, self.kept_envs, self.call) for slot in chunk])
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
        """The next answer and every other one already here; none when a
        request's wait ran out (env-level: its env ended in ``timeout``). An
        engine's error for one ticket ends its envs alone where the engine,
        not the worker, is at fault: env-level always, lockstep when the
        manager timed it out; otherwise, and when the engine can answer no
        request at all (every replica down), it is raised."""
        got: list[tuple[int, list[Completion]]] = []
        while self.inflight and (not got or self.client.ready()):
            limit = None if got or not self.deadlines else max(0.0, min(self.deadlines.values()) - time.monotonic())
            try:
                answer = self.client.wait_any(timeout=limit)
            except EngineError as exc:
                if exc.ticket not in self.inflight or exc.unavailable or not (self.env_level or exc.timed_out):
                    raise
                if exc.timed_out:  # the manager's own engine_timeout_s ran out first
                    self.end_waiting(exc.ticket, StopReason.TIMEOUT, str(exc))
                else:
                    self.end_waiting(exc.ticket, StopReason.ERROR, f"the engine failed on its request: {exc}")
                continue
            if answer is None:
                self.expire()
                return got
            self.deadlines.pop(answer[0], None)
            got.append(answer)
        return got

    def expire(self) -> None:
        """The envs whose request's wait ran past ``engine_timeout_s`` end in ``timeout``."""
        now = time.monotonic()
        for ticket in [t for t, d in self.deadlines.items() if d <= now]:
            self.client.abandon(ticket)
            self.end_waiting(ticket, StopReason.TIMEOUT, f"no answer from the engine within "
                             f"agent_proxy.engine_timeout_s={self.config.engine_timeout_s:g} s")

    def end_waiting(self, ticket: int, reason: StopReason, message: str) -> None:
        """The envs waiting for ``ticket`` end in ``reason``, and their stream closes. The engine is
        at fault, not the env: they end alone whether or not errors are isolated (a re-run would
        wait for the same engine)."""
        self.deadlines.pop(ticket, None)
        self.riders.discard(ticket)
        batch = self.inflight.pop(ticket)
        for slot in batch:
            end_in_error(slot, reason, self.stats, True, cause=None, message=message)
        self.report_finished(batch)
        self.release_ended(batch)
        self.client.close_stream()
        self.open_streams -= 1

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
        joined: list[EnvSlot] = []
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

    def step(self, ticket: int, completions: list[Completion]) -> list[EnvSlot]:
        """The answered batch's envs stepped; returns the batch."""
        batch = self.inflight.pop(ticket)
        if len(completions) != len(batch):
            raise RuntimeError(f"engine answered {len(completions)} completions for {len(batch)} requests")
        if self.fault and batch and len(batch[0].traj.turns) + 1 >= self.fault.get("exit_at_turn", 1 << 30):
            logger.warning("fault injection: process %d exits now", os.getpid())
            os._exit(3)
        answered = []
        for slot, completion in zip(batch, completions):
            if completion.finish_reason == "error":  # the engine's fault: see end_waiting
                end_in_error(slot, StopReason.ERROR, self.stats, True, cause=None, message=(
                    f"the engine could not answer its request of turn {len(slot.traj.turns)}"
                    + (f": {completion.text}" if completion.text else " (its warning above says why)")))
            else:
                answered.append((slot, completion))
        t0 = time.perf_counter()
        self.threads.run([self._guarded(slot, apply_answer, completion, self.ctx, self.config, self.call)
                          for slot, completion in answered])
        self.stats.env_step_s += time.perf_counter() - t0
        self.report_finished(batch)
        self.release_ended(batch)
        return batch

    def submit(self, batch: list[EnvSlot], rider: bool) -> None:
        """The batch's next request; its stream closes when none of its envs plays on."""
        ticket = self.send(batch)
        self.report_finished(batch)  # envs whose request was too large for the manager
        if ticket is None:
            self.client.close_stream()
            self.open_streams -= 1
        elif rider:
            self.riders.add(ticket)

    def send(self, stream: list[EnvSlot]) -> int | None:
        """The next request of the stream's active envs: its ticket; None when none is active.
        An env whose request would take the message past the manager's limit ends
        in ``error`` (the largest first, until the rest fit); the others are sent."""
        active = [s for s in stream if s.active]
        if not active:
            return None
        requests = [self.request(s) for s in active]
        while True:
            try:
                ticket = self.client.submit(requests, self.config.sampling, hold=self.env_level)
                break
            except MessageTooLarge as exc:
                for i in exc.refused:
                    end_in_error(active[i], StopReason.ERROR, self.stats, self.isolate, cause=None, message=(
                        f"MessageTooLarge: its request to the LLM manager ({exc.request_sizes.get(i, 0)} bytes) "
                        f"takes a message of {exc.size} bytes past the limit of {exc.limit} bytes; raise "
                        f"agent_proxy.max_message_bytes or make the env's observations shorter"))
                refused = set(exc.refused)
                keep = [i for i in range(len(active)) if i not in refused]
                active, requests = [active[i] for i in keep], [requests[i] for i in keep]
                if not active:
                    return None
        self.inflight[ticket] = active
        if self.env_level and self.config.engine_timeout_s is not None:
            self.deadlines[ticket] = time.monotonic() + self.config.engine_timeout_s
        self.stats.requests += len(requests)
        self.stats.submits += 1
        return ticket

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
            history_messages=len(messages) - 1 if history is not None else 0,
            env_id=slot.spec.env_id,
            turn=len(turns),
            seed=slot.spec.seed,
            max_tokens=slot.spec.max_tokens,
            last_turn=len(turns) + 1 >= self.config.max_turn,
            answer_prefix=self.ctx.answer_prefix,
        )

    def _guarded(self, slot: EnvSlot, fn: Callable[..., None], *args: Any) -> tuple[EnvSlot, Any]:
        """A job for ``EnvThreads``: ``fn(slot, *args)`` under ``guard``."""
        return slot, functools.partial(guard, slot, self.stats, self.isolate, self.config, self.call, fn, slot, *args)

    def release_ended(self, batch: list[EnvSlot]) -> None:
        """Ended envs go back to kept_envs at once: a chunk taken later reuses them."""
        for slot in batch:
            if not slot.active and not slot.timed:
                slot.timed = True
                self.stats.env_done(time.monotonic())
            if not slot.active and slot.env is not None:
                self.kept_envs.release(slot.spec, slot.env)
                slot.env = None

    def report_finished(self, slots: list[EnvSlot]) -> None:
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


def _reset_chunks(stream: list[EnvSlot]) -> list[list[EnvSlot]]:
    """The stream's envs in the order they are reset: one at a time, except
    the envs of a tag with ``env_threads > 1``, reset together (at the place
    of the tag's first env)."""
    chunks: list[list[EnvSlot]] = []
    together: dict[str, list[EnvSlot]] = {}
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


def _split_streams(slots: list[EnvSlot], depth: int) -> list[list[EnvSlot]]:
    """``depth`` micro-batches of whole groups (fewer when there are fewer
    groups), dealt out in turn so that each gets a share of every tag."""
    members = groups_of(slots, attrgetter("spec.group_id"))
    depth = stream_count([s.spec for s in slots], depth)
    return [[s for g in hand for s in g] for hand in deal(members, depth)]


