"""What the turn loop is given besides its specs and client (``LoopConfig``)
and what it counts while it plays (``LoopStats``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from ragen.llm.types import SamplingParams
from ragen.rollout.config import (AgentProxyConfig, AgentSection, EsManagerConfig, check_env_level_async,
                                  check_time_limit)
from ragen.rollout.context import ContextConfig


@dataclass(frozen=True)
class LoopConfig:
    """Everything the loop needs besides specs and a client (plain, picklable).
    ``AgentSetup.from_config`` builds it from the config sections; its
    defaults are theirs (``ragen.rollout.config``)."""

    context: ContextConfig = field(default_factory=ContextConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_turn: int = AgentProxyConfig.max_turn
    format_penalty: float = EsManagerConfig.format_penalty
    max_abs_reward: float = EsManagerConfig.max_abs_reward  # a step's reward beyond +-this ends its env in error
    env_timeout_s: float | None = AgentProxyConfig.env_timeout_s  # per reset/step; None: no limit
    env_retries: int = AgentProxyConfig.env_retries  # retries of a failing env on a fresh instance
    # auto | True | False: env-level turns (auto: when the client's engine streams completions)
    env_level_async: Any = AgentProxyConfig.env_level_async
    # env-level turns: the longest wait for one env's answer (it then ends in timeout); None: none
    engine_timeout_s: float | None = AgentProxyConfig.engine_timeout_s
    # agent.max_concurrent: agent episodes at once in a rollout, over all its workers
    agent_max_concurrent: int = AgentSection.max_concurrent

    def __post_init__(self) -> None:
        check_time_limit("env_timeout_s", self.env_timeout_s)
        check_time_limit("engine_timeout_s", self.engine_timeout_s)
        check_env_level_async(self.env_level_async)


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
    # when the first and the last env ended (time.monotonic(): one clock for the processes of a machine)
    first_done: float = math.inf
    last_done: float = -math.inf

    def __add__(self, other: "LoopStats") -> "LoopStats":
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
                  if f.name not in ("first_done", "last_done")}
        return LoopStats(**summed, first_done=min(self.first_done, other.first_done),
                         last_done=max(self.last_done, other.last_done))

    def env_done(self, now: float) -> None:
        self.first_done = min(self.first_done, now)
        self.last_done = max(self.last_done, now)

    @property
    def done_spread_s(self) -> float | None:
        """From the first env's end to the last's; None when none ended (or on another machine's clock)."""
        return self.last_done - self.first_done if self.last_done >= self.first_done else None
