"""One scheduler drives many episodes: ``run_envs(specs, client, config)``.

Each spec is played by ``play_episode`` (``ragen.rollout.episode``); the
``Scheduler`` sends the episodes' requests through an ``LLMClient``'s streams,
formed by a batching policy (``ragen.rollout.batching``: RAGEN's lockstep
turns, pipelined streams, env-level turns), hands each answer back to its
episode, and ends an episode whose request the engine could not answer.
With ``take`` it also takes chunks of groups from the rollout's queue as it
frees up. The envs of a tag with ``parallel_friendly: true`` (RAGEN's key)
are reset and stepped ``max_workers`` at a time on threads; others one after
another. ``KeptEnvs`` keeps env instances between rollouts.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ragen.llm.types import ABORTED, Completion
from ragen.rollout.batching import Batching, choose_batching
from ragen.rollout.env_calls import EnvError, EnvThreads, KeptEnvs
from ragen.rollout.episode import EnvTurns
from ragen.rollout.episode_state import Episode
from ragen.rollout.loop_config import LoopConfig, LoopStats
from ragen.rollout.types import EnvSpec, StopReason, Trajectory
from ragen.serving.client import LLMClient, Stream
from ragen.serving.transport import Transport
from ragen.serving.wire import MessageTooLarge

__all__ = ["EnvError", "GroupCount", "KeptEnvs", "LoopConfig", "LoopStats", "Scheduler", "run_envs"]

logger = logging.getLogger(__name__)


def run_envs(
    specs: Sequence[EnvSpec],
    transport: Transport,
    config: LoopConfig,
    kept_envs: KeptEnvs | None = None,
    isolate_errors: bool = True,
    *,
    batching: Batching | None = None,
    take: Callable[[], list[EnvSpec]] | None = None,
    on_finished: Callable[[int], None] | None = None,
    groups_done: Callable[[int], bool] | None = None,
) -> tuple[list[Trajectory], LoopStats]:
    """Play every spec to the end over ``LLMClient(transport)``; one trajectory per
    spec, in spec order.

    ``isolate_errors``: an env that raises (or times out) ends its own
    trajectory with stop reason ``error`` (``timeout``) and the others go on;
    otherwise the first failure raises ``EnvError`` (workers do this, so the
    fallback re-runs what the worker played). ``batching``: the policy that
    forms the streams (None: ``choose_batching`` from the config and
    ``transport.streams``). ``take``: pull-based work: each call returns the
    specs of one more chunk of whole groups, a stream of its own already
    opened by the manager, until it returns none; their trajectories follow
    the specs'. ``on_finished(n)``: ``n`` more envs ended (for progress); it
    must not raise. ``groups_done(n)``: ``n`` more
    groups ended whole, none of their envs in error, timeout or aborted; it
    returns whether the rollout has enough of them (over-sampling), and then
    every episode still playing ends ``aborted``, its request cancelled. An
    answer the manager gives as ``aborted`` (the driver counted enough groups
    over every worker) does the same.
    """
    client = LLMClient(transport)
    turns = EnvTurns(config, kept_envs if kept_envs is not None else KeptEnvs(), isolate_errors)
    scheduler = Scheduler(client, turns, batching or choose_batching(config, client.streams), on_finished,
                          groups_done)
    episodes = [turns.start(s) for s in specs]
    try:
        scheduler.play(episodes, take)
        return [e.traj for e in episodes], turns.stats
    except BaseException:  # any failure, an interrupt too: answers in flight would be stale
        client.reset()
        raise
    finally:
        scheduler.close()


@dataclass(eq=False)
class Scheduler:
    """The episodes of one ``run_envs`` call, played in the client's streams: a stream is
    a list of episodes with one request in flight (``inflight``). A stream asks for its
    first answers as soon as its own envs are reset, and answers that arrive while later
    envs reset are handled between two resets. Streams that ride along (``riders``) join
    the next request of another stream answered in the same engine call, so that a
    worker's chunk streams merge back into its first ones."""

    client: LLMClient
    turns: EnvTurns
    batching: Batching
    on_finished: Callable[[int], None] | None = None
    groups_done: Callable[[int], bool] | None = None
    inflight: dict[Stream, list[Episode]] = field(default_factory=dict)
    deadlines: dict[Stream, float] = field(default_factory=dict)  # bounded waits: when each stream's ends
    riders: set[Stream] = field(default_factory=set)
    stopping: bool = False  # enough groups are done: what still plays ends aborted
    groups: dict[int, list[Episode]] = field(default_factory=dict)  # with groups_done: the members of each

    def __post_init__(self) -> None:
        self.stats = self.turns.stats
        self.threads = EnvThreads()

    def add(self, episodes: list[Episode]) -> None:
        """Episodes to play; with ``groups_done``, counted in their groups."""
        if self.groups_done is not None:
            for e in episodes:
                self.groups.setdefault(e.spec.group_id, []).append(e)

    def play(self, episodes: list[Episode], take: Callable[[], list[EnvSpec]] | None) -> None:
        """Every episode, and those of the chunks ``take`` gives (added to ``episodes``), to its end."""
        created = self.turns.kept_envs.created
        self.add(episodes)
        batches = self.batching.streams(episodes)
        try:
            for stream, batch in zip(self.client.open(len(batches)), batches):
                self.start(stream, batch)
            if take is not None:
                self.take_chunks(episodes, take)
            self.stats.envs_created = self.turns.kept_envs.created - created
            while self.inflight:
                self.wait_some()
                if self.stopping:
                    self.abort_waiting()
        finally:
            self.client.close()  # the streams left open, and held closes and cancels
        self.release_ended(episodes)

    def take_chunks(self, episodes: list[Episode], take: Callable[[], list[EnvSpec]]) -> None:
        """Chunks from ``take``, each started as the policy's streams, until it gives none."""
        limit = self.batching.max_live_envs
        while True:
            while self.inflight and limit is not None and sum(e.active for e in episodes) >= limit:
                self.wait_some()  # no room for another chunk until envs end
            taken = [] if self.stopping else [self.turns.start(s) for s in take()]
            if not taken:
                return
            self.stats.chunks += 1
            self.add(taken)
            episodes += taken
            batches = self.batching.chunk_streams(taken, self.client.open_streams)
            for stream, (batch, rider) in zip(self.client.open(len(batches), opened=1), batches):
                self.start(stream, batch, rider)

    def start(self, stream: Stream, batch: list[Episode], rider: bool = False) -> None:
        """The batch's envs reset and its first request sent; answers that
        arrive meanwhile are handled between two resets."""
        for chunk in _reset_chunks(batch):
            t0 = time.perf_counter()
            self.threads.run([(e, e.job()) for e in chunk])
            self.stats.env_reset_s += time.perf_counter() - t0
            while self.inflight and (answered := self.client.wait(block=False)):
                self.handle(self.answers(answered))  # keep the model busy while later envs reset
        self.ended(batch)
        self.submit(stream, batch, rider)

    def wait_some(self) -> None:
        """The next answers waited for and handled; when a bounded wait runs out first,
        the envs whose wait ended end in ``timeout``."""
        t0 = time.perf_counter()
        limit = None if not self.deadlines else max(0.0, min(self.deadlines.values()) - time.monotonic())
        answered = self.client.wait(limit)
        self.stats.wait_s += time.perf_counter() - t0
        if not answered:
            self.expire()
        self.handle(self.answers(answered))

    def answers(self, answered: list[Stream]) -> list[tuple[Stream, list[Completion]]]:
        """The answered streams with their completions. An engine's error for one stream's
        request ends its envs alone where the policy says the engine, not the worker, is
        at fault; otherwise, and when the engine can answer no request at all (every
        replica down), it is raised."""
        got = []
        for stream in answered:
            self.deadlines.pop(stream, None)
            exc = stream.error()
            if exc is None:
                got.append((stream, stream.future.result()))
            elif exc.unavailable or not self.batching.ends_alone(exc):
                raise exc
            elif exc.timed_out:  # the manager's own engine_timeout_s ran out first
                self.end_waiting(stream, StopReason.TIMEOUT, str(exc))
            else:
                self.end_waiting(stream, StopReason.ERROR, f"the engine failed on its request: {exc}")
        return got

    def expire(self) -> None:
        """The envs whose request's wait ran past ``engine_timeout_s`` end in ``timeout``."""
        now = time.monotonic()
        for stream in [s for s, d in self.deadlines.items() if d <= now]:
            stream.cancel()
            self.end_waiting(stream, StopReason.TIMEOUT, f"no answer from the engine within "
                             f"agent_proxy.engine_timeout_s={self.turns.config.engine_timeout_s:g} s")

    def end_waiting(self, stream: Stream, reason: StopReason, message: str) -> None:
        """The envs waiting for the stream's answer end in ``reason``, and the stream closes."""
        self.deadlines.pop(stream, None)
        self.riders.discard(stream)
        batch = self.inflight.pop(stream)
        for episode in batch:
            self.end(episode, reason, message)
        self.ended(batch)
        stream.close()

    def end(self, episode: Episode, reason: StopReason, message: str) -> None:
        """The episode ended from outside: the engine at fault (``EnvTurns.end``), or enough groups
        done (``aborted``)."""
        if reason is StopReason.ABORTED:
            self.turns.abort(episode)
        else:
            self.turns.end(episode, reason, message)
        episode.close()

    def abort_waiting(self) -> None:
        """Enough groups are done: every request in flight cancelled, its envs ended ``aborted``."""
        for stream in list(self.inflight):
            stream.cancel()
            self.end_waiting(stream, StopReason.ABORTED, "")

    def handle(self, answers: list[tuple[Stream, list[Completion]]]) -> None:
        """Answers that arrived together (one engine call's): the riders among them are
        stepped first and join the next request of the first other stream answered with
        them, closing their own, so the streams a worker opened chunk by chunk merge back
        into its first ones once they are in step (one request per stream and turn).
        The policy's own streams never merge: they overlap env steps with the engine
        when the coalescer does not wait for them all."""
        answers = sorted(answers, key=lambda a: a[0] not in self.riders)  # stable: riders first
        hosts = sum(s not in self.riders for s, _ in answers)
        joined: list[Episode] = []
        # envs on threads step together across streams; others each before its stream's next request
        together = any(e.spec.env_threads > 1 for s, _ in answers for e in self.inflight[s])
        batches = self.step(answers) if together else None
        for i, (stream, completions) in enumerate(answers):
            rider = stream in self.riders
            self.riders.discard(stream)
            batch = batches[i] if together else self.step([(stream, completions)])[0]
            if rider and (hosts or (i + 1 < len(answers))):
                joined += batch  # into the next answered stream's request
                stream.close()
            else:
                self.submit(stream, batch + joined, rider)
                joined = []

    def step(self, answers: list[tuple[Stream, list[Completion]]]) -> list[list[Episode]]:
        """The answered streams' episodes played to their next request, all of them in one
        ``EnvThreads.run`` (so that the envs of a ``parallel_friendly`` tag step at once even
        when each is a stream of its own, as with env-level turns); returns each stream's."""
        batches, answered = [], []
        for stream, completions in answers:
            batch = self.inflight.pop(stream)
            for episode, completion in zip(batch, completions):
                if completion.finish_reason == ABORTED:  # the driver counted enough groups over the workers
                    self.stopping = True
                    self.end(episode, StopReason.ABORTED, "")
                elif completion.finish_reason == "error":
                    self.end(episode, StopReason.ERROR, (
                        f"the engine could not answer its request of turn {len(episode.traj.turns)}"
                        + (f": {completion.text}" if completion.text else " (its warning above says why)")))
                else:
                    answered.append((episode, episode.job(completion)))
            batches.append(batch)
        t0 = time.perf_counter()
        self.threads.run(answered)
        self.stats.env_step_s += time.perf_counter() - t0
        for batch in batches:
            self.ended(batch)
        return batches

    def submit(self, stream: Stream, batch: list[Episode], rider: bool) -> None:
        """The next requests of the batch's playing episodes, on ``stream``; the stream closes
        when none of them plays on. An episode whose request would take the message past the
        manager's limit ends in ``error`` (the largest first, until the rest fit). Once enough
        groups are done, they end ``aborted`` instead."""
        active = [e for e in batch if e.request is not None]
        if self.stopping:
            for e in active:
                self.end(e, StopReason.ABORTED, "")
            active = []
        while active:
            try:
                stream.submit([e.request for e in active], self.turns.config.sampling, hold=self.batching.hold)
                break
            except MessageTooLarge as exc:
                for i in exc.refused:
                    self.turns.refuse(active[i], (
                        f"MessageTooLarge: its request to the LLM manager ({exc.request_sizes.get(i, 0)} bytes) "
                        f"takes a message of {exc.size} bytes past the limit of {exc.limit} bytes; raise "
                        f"agent_proxy.max_message_bytes or make the env's observations shorter"))
                    active[i].close()
                active = [e for e in active if e.request is not None]
        self.ended(batch)  # episodes whose request was too large for the manager
        if not active:
            stream.close()
            return
        self.inflight[stream] = active
        if self.batching.bounded_wait and self.turns.config.engine_timeout_s is not None:
            self.deadlines[stream] = time.monotonic() + self.turns.config.engine_timeout_s
        self.stats.requests += len(active)
        self.stats.submits += 1
        if rider:
            self.riders.add(stream)

    def ended(self, batch: list[Episode]) -> None:
        """The batch's episodes that ended since last looked at: told to ``on_finished``
        and their envs given back to ``kept_envs`` at once (a chunk taken later reuses them)."""
        self.report_finished(batch)
        self.release_ended(batch)

    def release_ended(self, batch: list[Episode]) -> None:
        for episode in batch:
            if not episode.active and not episode.timed:
                episode.timed = True
                self.stats.env_done(time.monotonic())
            if not episode.active and episode.env is not None:
                self.turns.kept_envs.release(episode.spec, episode.env)
                episode.env = None

    def report_finished(self, batch: list[Episode]) -> None:
        """The envs that ended told to ``on_finished``, and the groups they complete to ``groups_done``."""
        ended = [e for e in batch if not e.active and not e.reported]
        for episode in ended:
            episode.reported = True
        if ended and self.on_finished is not None:
            self.on_finished(len(ended))
        if ended and self.groups_done is not None and not self.stopping:
            complete = {e.spec.group_id for e in ended}
            # each group once: when its last member is reported
            whole = sum(all(map(_ended_whole, self.groups[g])) for g in complete)
            if whole and self.groups_done(whole):
                self.stopping = True

    def close(self) -> None:
        self.threads.close()
        self.turns.close()


class GroupCount:
    """Groups ended whole, counted up to ``enough`` (thread-safe: told from the connections of
    every worker); ``add(n)`` says whether there are enough."""

    def __init__(self, enough: int) -> None:
        self.enough = enough
        self.done = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> bool:
        with self._lock:
            self.done += n
            return self.done >= self.enough


def _ended_whole(episode: Episode) -> bool:
    """The env's end was reported, and it neither failed nor was aborted (one a rollout has enough of)."""
    stop = episode.traj.stop_reason
    return episode.reported and not stop.failed and stop is not StopReason.ABORTED


def _reset_chunks(stream: list[Episode]) -> list[list[Episode]]:
    """The stream's episodes in the order their envs are reset: one at a time, except
    the envs of a tag with ``env_threads > 1``, reset together (at the place of the
    tag's first env)."""
    chunks: list[list[Episode]] = []
    together: dict[str, list[Episode]] = {}
    for episode in stream:
        spec = episode.spec
        if spec.env_threads <= 1:
            chunks.append([episode])
        elif spec.tag in together:
            together[spec.tag].append(episode)
        else:
            together[spec.tag] = [episode]
            chunks.append(together[spec.tag])
    return chunks
