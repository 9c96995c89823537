"""ragen's agent programs as a verl agent loop: ``RagenAgentLoop``, named ``ragen_agent``.

A dataset row of an ``env_type: agent`` tag (``python -m ragen.tools.verl_data`` names this loop
in its ``agent_name``) is one agent episode, as in ragen's own rollout: the tag's program plays the
task the row's seed picks, calling its own session of a gateway (``AgentGateway``, one per
agent-loop worker); each call's prompt ids go to verl's server manager and the ids it sampled come
back with their log-probs. The sample is the episode's first segment (``agent_record``): its first
call's prompt, then each call's sampled ids (mask 1) and what the next call's prompt adds (mask 0),
and the program's reward (0 for an episode in error) at the last token. verl takes one sequence a
sample: the calls of later segments are played and counted (``ragen/untrained_calls``), not
trained. Registered by the ``agent_loop_config_path`` file, as ``ragen_env`` is::

    - name: ragen_agent
      _target_: ragen.verl.agent_program_loop.RagenAgentLoop
      ragen_config: /abs/path/ragen_config.yaml

See docs/verl.md.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
from verl.utils.profiler import simple_timer

from ragen.verl.agent_gateway import AgentGateway
from ragen.verl.agent_loop import RagenLoopBase, worker_shared
from ragen.verl.episode_tokens import agent_record
from ragen.verl.server_link import VerlEpisode
from ragen.verl.setup import ENV_LOOP, PROGRAM_LOOP

logger = logging.getLogger(__name__)

AGENT_NAME = PROGRAM_LOOP
_warned_segments = False


class RagenAgentLoop(RagenLoopBase):
    """One ragen agent program's episode per verl sample (see the module docstring)."""

    name = AGENT_NAME

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tokenizer, chat = self.tokenizer, self.chat
        loop = self.envs.loops["train"]
        served_name = str(self.config.actor_rollout_ref.model.path)
        # agent.max_concurrent is over all of verl's agent-loop workers
        workers = self.agent_workers
        self.gateway: AgentGateway = worker_shared(
            ("agent_gateway", self.ragen_config, self.overrides, id(tokenizer)),
            lambda: AgentGateway(chat, tokenizer, served_name, loop.sampling,
                                 max(1, loop.agent_max_concurrent // workers), loop.engine_timeout_s))

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        global _warned_segments
        spec, config = self.envs.spec(kwargs)
        if not spec.is_agent:
            raise ValueError(f"dataset row {kwargs.get('index', '?')}: tag {spec.tag!r} is an env, not an agent "
                             f"program (env_type: agent): its rows take agent_name {ENV_LOOP}")
        episode = VerlEpisode(asyncio.get_running_loop(), self.server_manager, dict(sampling_params),
                              self.prompt_length, self.response_length)
        metrics: dict[str, Any] = {}
        with simple_timer("generate_sequences", metrics):
            trajectory = await self.gateway.play(spec, config.max_abs_reward, episode)
        record = agent_record(trajectory, self.prompt_length, self.response_length, episode.truncated)
        if record.failed:
            logger.warning("ragen_agent: tag %s seed %s ended in %s: %s", spec.tag, spec.seed,
                           trajectory.stop_reason.value, trajectory.error)
        if record.untrained_calls and not _warned_segments:
            _warned_segments = True
            logger.warning("ragen_agent: an episode of tag %s has calls outside its first segment (a call rewrote "
                           "its history); verl trains one sequence a sample, its first segment: the others are "
                           "counted in ragen/untrained_calls", spec.tag)
        return self.output(record, sampling_params, metrics, 2 * (record.num_turns - record.untrained_calls) + 1)
