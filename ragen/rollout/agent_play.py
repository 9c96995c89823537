"""Agent episodes in a rollout's process: ``play_agents`` runs the ``env_type: agent`` specs a worker
(or the sequential backend) was given, many at once, each on its own session of a gateway that this
process serves for the call.

- ``AgentModel``: what a process needs of the engine's model to serve the agents' calls: its chat
  template and tokenizer (``ChatTokens``, rebuilt where it is unpickled), its served name and context
  length. The backend reads it from its engine once and sends it in each ``WorkerTask``.
- ``play_agents``: a ``GatewayServer`` on loopback (a free port), its calls sent to the engine over
  ``client`` (the worker's tagged ``SharedLLMClient``: they are coalesced with every other request
  and answered ``aborted`` with the rollout's), at most ``max_concurrent`` episodes at once on a
  thread pool; the trajectories in the order of the specs. The server is closed after, with every
  session (no thread or session is left behind; an entry abandoned at its timeout is refused on
  every later call).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, Callable, Sequence

from ragen.errors import ConfigError
from ragen.gateway.gateway import Gateway, GatewaySettings
from ragen.gateway.link import ManagerLink, engine_context
from ragen.gateway.server import GatewayServer
from ragen.llm.chat_tokens import ChatTokens
from ragen.llm.types import Completion, GenerationRequest, SamplingParams
from ragen.rollout.agent_episode import play_agent
from ragen.rollout.loop_config import LoopStats
from ragen.rollout.types import EnvSpec, StopReason, Trajectory

logger = logging.getLogger(__name__)
# the openai client (httpx) logs each call of every agent at info, which the rollout's own lines say as
# much as; a level set before is kept
if logging.getLogger("httpx").level == logging.NOTSET:
    logging.getLogger("httpx").setLevel(logging.WARNING)

# a call's wait for the engine where the rollout sets none (agent_proxy.engine_timeout_s: null)
DEFAULT_CALL_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class AgentModel:
    """The engine's model as a gateway needs it (plain data, picklable)."""

    chat: ChatTokens
    served_name: str
    max_context: int | None = None
    tokenizer: Any = None  # None: utf-8 bytes (the scripted engine's)

    @classmethod
    def of(cls, engine: Any) -> "AgentModel":
        """The model of ``engine``; ``ConfigError`` when it has no chat template and tokenizer here
        (an OpenAI-compatible engine without ``engine.tokenizer``)."""
        chat = getattr(engine, "chat", None)
        if not isinstance(chat, ChatTokens):
            raise ConfigError(f"env_type: agent tags need the engine's chat template and tokenizer, to record each "
                              f"call's exact tokens; the engine {getattr(engine, 'name', type(engine).__name__)!r} has "
                              "none here (an OpenAI-compatible engine needs engine.tokenizer)")
        return cls(chat, str(getattr(engine, "model_name", None) or engine.name), engine_context(engine),
                   getattr(engine, "tokenizer", None))


class EngineLinkClient:
    """A ``ManagerLink``'s client over an engine in this process, for the sequential backend (no
    manager): each call on its caller's thread, under the engine ``gate``; a streamed call is told
    its ids at the end. Its engine calls are counted (as a ``DirectClient``'s) and told to
    ``progress``."""

    def __init__(self, engine: Any, gate: Any, progress: Any = None) -> None:
        self.engine = engine
        self.gate = gate
        self.progress = progress
        self.engine_time_s = 0.0
        self.engine_calls = 0
        self.batch_sizes: list[int] = []
        self._tickets = itertools.count(1)
        self._local = threading.local()

    def open_streams(self, n: int, announced: bool = True) -> None:
        pass

    def close_stream(self, hold: bool = False) -> None:
        pass

    def submit(self, requests: list[GenerationRequest], sampling: SamplingParams, hold: bool = False,
               on_tokens: Callable[[int, list[int]], None] | None = None) -> int:
        ticket = next(self._tickets)
        self._local.pending = (ticket, requests, sampling, on_tokens)
        return ticket

    def wait_any(self, timeout: float | None = None) -> tuple[int, list[Completion]]:
        ticket, requests, sampling, on_tokens = self._local.pending
        self._local.pending = None
        with self.gate:
            if self.progress is not None:
                self.progress.engine_batch(len(requests))
            t0 = time.perf_counter()
            completions = self.engine.generate(requests, sampling)
            self.engine_time_s += time.perf_counter() - t0
            self.engine_calls += 1
            self.batch_sizes.append(len(requests))
        if self.progress is not None:
            self.progress.answered(len(completions))
        if on_tokens is not None:
            for i, completion in enumerate(completions):
                on_tokens(i, list(completion.response_token_ids))
        return ticket, completions

    def abandon(self, ticket: int) -> None:
        self._local.pending = None


def play_agents(specs: Sequence[EnvSpec], client: Any, model: AgentModel, sampling: SamplingParams,
                max_abs_reward: float, max_concurrent: int, call_timeout_s: float | None = None,
                on_finished: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
    """The trajectories of the agent ``specs``, in their order, played at most ``max_concurrent`` at
    once on a gateway over ``client`` (module docstring). ``on_finished``: told each spec whose
    episode ended (its trajectory), on the calling thread. An episode whose player failed (not its
    program: ``play_agent`` keeps those) ends in ``error``; the others are kept."""
    if not specs:
        return []
    timeout_s = call_timeout_s or DEFAULT_CALL_TIMEOUT_S
    link = ManagerLink(client, model.chat, model.served_name, model.max_context, model.tokenizer, timeout_s)
    # sessions are closed by their episodes: none expires on its own, and each episode has room
    settings = GatewaySettings(max_sessions=max(1, len(specs)), session_ttl_s=0.0, call_timeout_s=timeout_s,
                               max_connections=max(512, 8 * len(specs)))
    server = GatewayServer(Gateway(link, sampling, settings))

    try:
        with concurrent.futures.ThreadPoolExecutor(min(max_concurrent, len(specs)),
                                                   thread_name_prefix="ragen-agent") as pool:
            futures = {pool.submit(play_agent, spec, server, max_abs_reward): spec for spec in specs}
            done = {}
            for future in concurrent.futures.as_completed(futures):
                spec = futures[future]
                done[spec.env_id] = _outcome(future, spec)
                if on_finished is not None:
                    on_finished(done[spec.env_id])
            return [done[spec.env_id] for spec in specs]
    finally:
        server.close()


def _outcome(future: concurrent.futures.Future, spec: EnvSpec) -> Trajectory:
    try:
        return future.result()
    except Exception as exc:  # the gateway refused its session, or a bug of ours: this episode alone
        logger.warning("agent episode env_id %d (tag %s) could not be played: %s", spec.env_id, spec.tag, exc)
        return Trajectory(env_id=spec.env_id, group_id=spec.group_id, tag=spec.tag, seed=spec.seed,
                          stop_reason=StopReason.ERROR, error=f"the agent episode could not be played: "
                          f"{type(exc).__name__}: {exc}")


def agent_stats(trajectories: Sequence[Trajectory]) -> LoopStats:
    """What agent episodes add to a rollout's loop counts: the programs' own time before their first
    call (as env resets) and between calls (as env steps), and the episodes in error or timeout."""
    stats = LoopStats(env_reset_s=sum(t.reset_s for t in trajectories),
                      env_step_s=sum(turn.env_s for t in trajectories for turn in t.turns),
                      env_errors=sum(t.stop_reason in (StopReason.ERROR, StopReason.TIMEOUT) for t in trajectories))
    return stats
