"""ragen's envs as a verl agent loop: ``RagenEnvAgentLoop``, named ``ragen_env``.

verl (0.9.1, ``pip install -e '.[verl]'``) plays each dataset row with the
agent loop its ``agent_name`` column names; ``python -m ragen.tools.verl_data``
writes rows of ``(tag, seed, split, agent_name=ragen_env)`` and the
``agent_loop_config_path`` file that registers this class:

    - name: ragen_env
      _target_: ragen.verl.agent_loop.RagenEnvAgentLoop
      ragen_config: /abs/path/ragen_config.yaml   # or a config name of ragen's config/
      ragen_overrides: []                          # Hydra overrides, with a config name

One sample is one episode (``play_tokens``): RAGEN's prompts and rewards,
token-exact (``token_history: append``), answers from verl's server manager,
env resets and steps on the env processes of this agent-loop worker
(``EnvSide``) so that verl's event loop only waits for them. The score is the
trajectory's reward, put at the last response token by verl; the episode's
metrics go to ``reward_extra_info``. See docs/verl.md.
"""

from __future__ import annotations

import logging
import threading
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput
from verl.utils.profiler import simple_timer

from ragen.llm.chat_tokens import ChatTokens
from ragen.verl.env_side import EnvSide
from ragen.verl.episode_tokens import play_tokens
from ragen.verl.setup import ENV_LOOP, PROGRAM_LOOP, load_envs

logger = logging.getLogger(__name__)

AGENT_NAME = ENV_LOOP

# One EnvSide and one ChatTokens per agent-loop worker process (verl builds an agent
# loop per sample): the env processes and the template's probe outlive the samples.
_SHARED: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def worker_shared(key: tuple, make) -> Any:
    """The object ``make()`` built once in this agent-loop worker process under ``key``."""
    with _LOCK:
        if key not in _SHARED:
            _SHARED[key] = make()
        return _SHARED[key]


class RagenLoopBase(AgentLoopBase):
    """What ragen's two agent loops share: the ragen config their entry in
    ``agent_loop_config_path`` names (``ragen_config``, ``ragen_overrides``) read once a worker
    (``envs``), the template's ``chat`` tokens, verl's prompt and response lengths, and the
    ``AgentLoopOutput`` of an episode's record (``output``)."""

    name = ""  # the agent_name a dataset row gives the loop

    def __init__(self, *args: Any, ragen_config: str | None = None, ragen_overrides: Any = (),
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not ragen_config:
            raise ValueError(f"agent loop {self.name!r}: its entry in actor_rollout_ref.rollout.agent."
                             "agent_loop_config_path has no ragen_config (a ragen config file, as "
                             "python -m ragen.tools.verl_data writes it, or a config name of ragen's config/)")
        self.ragen_config = str(ragen_config)
        self.agent_workers = int(self.rollout_config.agent.get("num_workers", 1) or 1)
        self.overrides = tuple(str(o) for o in (ragen_overrides or ()))
        self.envs = load_envs(self.ragen_config, self.overrides, self.agent_workers)
        tokenizer = self.tokenizer
        self.chat: ChatTokens = worker_shared(("chat", id(tokenizer)), lambda: ChatTokens.of(tokenizer))
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)

    @staticmethod
    def output(record: Any, sampling_params: dict[str, Any], metrics: dict[str, Any],
               num_turns: int) -> AgentLoopOutput:
        """verl's output of an episode's ``record`` (an ``EpisodeTokens``); ``num_turns``: verl's
        count of messages (the first prompt, then a pair a trained answer)."""
        return AgentLoopOutput(
            prompt_ids=record.prompt_ids,
            response_ids=record.response_ids,
            response_mask=record.response_mask,
            response_logprobs=record.response_logprobs if sampling_params.get("logprobs") else None,
            reward_score=record.reward,
            num_turns=num_turns,
            metrics=AgentLoopMetrics(**metrics),
            extra_fields={"reward_extra_info": record.metrics()},
        )


# Registered by the agent_loop_config_path file alone, never by verl's @register: verl
# imports this module on its first sample, and @register would then replace the file's
# entry (with its ragen_config) by a bare one for every later sample.
class RagenEnvAgentLoop(RagenLoopBase):
    """One ragen env episode per verl sample (see the module docstring)."""

    name = AGENT_NAME

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env_side: EnvSide = worker_shared(("env_side", self.ragen_config, self.overrides),
                                               lambda: EnvSide(self.envs.env_workers, self.envs.env_backend))
        self.vocab_size = len(self.tokenizer)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        spec, config = self.envs.spec(kwargs)
        if spec.is_agent:
            raise ValueError(f"dataset row {kwargs.get('index', '?')}: tag {spec.tag!r} is an agent program "
                             f"(env_type: agent): its rows take agent_name {PROGRAM_LOOP}")
        metrics: dict[str, Any] = {}

        async def generate(prompt_ids: list[int], max_tokens: int):
            output = await self.server_manager.generate(
                request_id=uuid4().hex, prompt_ids=prompt_ids,
                sampling_params={**sampling_params, "max_tokens": max_tokens})
            return output.token_ids, output.log_probs

        with simple_timer("generate_sequences", metrics):
            record = await play_tokens(
                spec, config, self.env_side, self.chat,
                lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), generate,
                response_length=self.response_length, prompt_length=self.prompt_length,
                vocab_size=self.vocab_size)
        if record.failed:
            logger.warning("ragen_env: tag %s seed %s ended in %s: %s", spec.tag, spec.seed,
                           record.trajectory.stop_reason.value, record.trajectory.error)
        return self.output(record, sampling_params, metrics, 2 * record.num_turns + 1)
