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

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput
from verl.utils.profiler import simple_timer

from ragen.llm.chat_tokens import ChatTokens
from ragen.verl.agent_gateway import AgentGateway
from ragen.verl.agent_loop import worker_shared
from ragen.verl.episode_tokens import agent_record
from ragen.verl.server_link import VerlEpisode
from ragen.verl.setup import ENV_LOOP, PROGRAM_LOOP, load_envs

logger = logging.getLogger(__name__)

AGENT_NAME = PROGRAM_LOOP
_warned_segments = False


class RagenAgentLoop(AgentLoopBase):
    """One ragen agent program's episode per verl sample (see the module docstring)."""

    def __init__(self, *args: Any, ragen_config: str | None = None, ragen_overrides: Any = (),
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not ragen_config:
            raise ValueError(f"agent loop {AGENT_NAME!r}: its entry in actor_rollout_ref.rollout.agent."
                             "agent_loop_config_path has no ragen_config (a ragen config file, as "
                             "python -m ragen.tools.verl_data writes it, or a config name of ragen's config/)")
        agent_workers = int(self.rollout_config.agent.get("num_workers", 1) or 1)
        overrides = tuple(str(o) for o in (ragen_overrides or ()))
        self.envs = load_envs(str(ragen_config), overrides, agent_workers)
        tokenizer = self.tokenizer
        chat: ChatTokens = worker_shared(("chat", id(tokenizer)), lambda: ChatTokens.of(tokenizer))
        loop = self.envs.loops["train"]
        served_name = str(self.config.actor_rollout_ref.model.path)
        # agent.max_concurrent is over all of verl's agent-loop workers
        self.gateway: AgentGateway = worker_shared(
            ("agent_gateway", str(ragen_config), overrides, id(tokenizer)),
            lambda: AgentGateway(chat, tokenizer, served_name, loop.sampling,
                                 max(1, loop.agent_max_concurrent // agent_workers), loop.engine_timeout_s))
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)

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
        logprobs = record.response_logprobs if sampling_params.get("logprobs") else None
        return AgentLoopOutput(
            prompt_ids=record.prompt_ids,
            response_ids=record.response_ids,
            response_mask=record.response_mask,
            response_logprobs=logprobs,
            reward_score=record.reward,
            # verl counts messages: the first prompt, then a pair a trained call
            num_turns=2 * (record.num_turns - record.untrained_calls) + 1,
            metrics=AgentLoopMetrics(**metrics),
            extra_fields={"reward_extra_info": record.metrics()},
        )
