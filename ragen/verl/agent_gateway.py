"""``AgentGateway``: agent programs' episodes played for verl's samples, on one gateway per process.

verl runs each agent-loop worker's samples on one event loop. An agent program is a blocking
program with its own thread (or subprocess) calling an OpenAI-compatible endpoint, so each episode
(``play_agent``: a session of its own, the program on the task its seed picks, the trajectory from
the session's call records) runs on a thread of this gateway's pool, and the sample's coroutine
only awaits it. The gateway serves on loopback (a free port); its calls reach verl's server manager
through ``ServerManagerClient``, on the event loop of the sample they belong to. At most
``max_concurrent`` episodes play at once; the others wait for a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
from typing import Any

from ragen.gateway.gateway import Gateway, GatewaySettings
from ragen.gateway.link import ManagerLink, token_decoder
from ragen.gateway.server import GatewayServer
from ragen.llm.chat_tokens import ChatTokens
from ragen.llm.types import SamplingParams
from ragen.rollout.agent_episode import play_agent
from ragen.rollout.agent_play import DEFAULT_CALL_TIMEOUT_S
from ragen.rollout.types import EnvSpec, StopReason, Trajectory
from ragen.verl.server_link import ServerManagerClient, VerlEpisode

logger = logging.getLogger(__name__)


class AgentGateway:
    """A gateway over verl's server manager and a pool of ``max_concurrent`` episode threads (module
    docstring). ``chat`` and ``tokenizer``: the model's; ``sampling``: the rollout's (each answer's cap
    and stop strings; verl's sampling decides the rest); ``call_timeout_s``: a call's wait for verl."""

    def __init__(self, chat: ChatTokens, tokenizer: Any, served_name: str, sampling: SamplingParams,
                 max_concurrent: int, call_timeout_s: float | None = None) -> None:
        timeout_s = call_timeout_s or DEFAULT_CALL_TIMEOUT_S
        self.client = ServerManagerClient(set(chat.end_texts), token_decoder(tokenizer, skip_special_tokens=True),
                                          len(tokenizer) if tokenizer is not None else None)
        link = ManagerLink(self.client, chat, served_name, None, tokenizer, timeout_s)
        # sessions are closed by their episodes: none expires on its own, and each episode has room
        settings = GatewaySettings(max_sessions=max_concurrent, session_ttl_s=0.0, call_timeout_s=timeout_s,
                                   max_connections=max(512, 8 * max_concurrent))
        self.server = GatewayServer(Gateway(link, sampling, settings))
        self.pool = concurrent.futures.ThreadPoolExecutor(max_concurrent, thread_name_prefix="ragen-verl-agent")
        self._env_ids = itertools.count()

    async def play(self, spec: EnvSpec, max_abs_reward: float, episode: VerlEpisode) -> Trajectory:
        """``spec``'s agent episode, its calls answered for ``episode`` (verl's sample)."""
        env_id = next(self._env_ids)  # the key its session's calls are found by
        with self.client.episode(env_id, episode):
            future = asyncio.get_running_loop().run_in_executor(
                self.pool, play_agent, dataclasses.replace(spec, env_id=env_id), self.server, max_abs_reward)
            try:
                trajectory = await future
            except Exception as exc:  # the gateway refused its session, or a bug of ours: this episode alone
                logger.warning("agent episode of tag %s seed %s could not be played: %s", spec.tag, spec.seed, exc)
                trajectory = Trajectory(env_id=env_id, group_id=spec.group_id, tag=spec.tag, seed=spec.seed,
                                        stop_reason=StopReason.ERROR, error=f"the agent episode could not be "
                                        f"played: {type(exc).__name__}: {exc}")
        return dataclasses.replace(trajectory, env_id=spec.env_id)

    def close(self) -> None:
        self.server.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
