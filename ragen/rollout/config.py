"""The rollout sections of the Hydra config, one typed dataclass each.

``agent_proxy``, ``es_manager``, ``ctx_manager``, ``llm_server``, ``seed``,
``dask`` and ``ray`` (RAGEN's key names). A field's default is the key's
default when a config leaves it out; ``config/base.yaml`` lists every key
again, because Hydra's ``agent_proxy.X=...`` override needs it there, and
``tests/test_config_reader.py`` checks that the YAML, the README and these
defaults agree. ``read_rollout_sections(cfg)`` reads them all with
``ragen.config_reader.read``: an unknown key, a wrong type or an out-of-range
number is a ``ConfigError`` (a ``ValueError``) naming the key, before any model
loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from ragen.config_reader import read, setting
from ragen.env.reward_bound import DEFAULT_MAX_ABS_REWARD
from ragen.errors import ConfigError
from ragen.llm.types import SamplingParams
from ragen.rollout.context import SAMPLE_SHAPES, ContextConfig
from ragen.serving import wire
from ragen.serving.address import check_listen_address

logger = logging.getLogger(__name__)

BACKENDS = ("loky", "threading", "multiprocessing", "sequential", "dask", "ray")  # agent_proxy.parallel_backend
ROLLOUT_MODES = ("sync", "fully_async")
FULLY_ASYNC_BACKENDS = ("loky", "threading")  # agent_proxy.parallel_backend with rollout_mode: fully_async
ROLLOUT_FILTERS = ("none", "nonzero_variance")  # agent_proxy.rollout_filter
UNFINISHED = ("carry", "abort")  # agent_proxy.unfinished


@dataclass(frozen=True)
class RewardNormalization:
    """``agent_proxy.reward_normalization``: how the trainer normalizes episode scores (over which
    groups, by which method)."""

    # ContextConfig's reward_grouping and reward_method, which check them
    grouping: str = ContextConfig.reward_grouping
    method: str = ContextConfig.reward_method


def check_n_jobs(n_jobs: Any) -> None:
    """``agent_proxy.parallel_n_jobs``: auto, -1 or a positive integer; ``ConfigError`` naming the key otherwise."""
    if n_jobs == "auto" or (isinstance(n_jobs, int) and not isinstance(n_jobs, bool) and (n_jobs == -1 or n_jobs >= 1)):
        return
    raise ConfigError(f"agent_proxy.parallel_n_jobs must be auto (sized from each rollout), -1 (one worker per "
                      f"core) or a positive integer, got {n_jobs!r}")


TIMEOUT_KEYS = ("rollout_timeout_s", "env_timeout_s", "engine_timeout_s")  # agent_proxy.*: > 0, or null


def check_time_limit(key: str, value: Any) -> None:
    """``agent_proxy.<key>``: a time limit in seconds, > 0, or None for no limit
    (0 is refused: it would read as "no limit" in one place and "at once" in another)."""
    if value is not None and not value > 0:
        shown = f"{value:g}" if isinstance(value, (int, float)) else repr(value)
        raise ConfigError(f"agent_proxy.{key} must be > 0 seconds, got {shown}; for no limit write null")


# An engine that never answers a request must not hold its env (or, in lockstep turns, its worker)
# for ever; long enough for a large batch of long answers on a CPU.
DEFAULT_ENGINE_TIMEOUT_S = 600.0

ENV_LEVEL_ASYNC = ("auto", True, False)


def check_env_level_async(value: Any) -> None:
    """``agent_proxy.env_level_async``: auto, true or false; ``ConfigError`` naming the key otherwise."""
    if value == "auto" or isinstance(value, bool):
        return
    raise ConfigError(f"agent_proxy.env_level_async must be auto (env-level turns when the engine streams "
                      f"completions), true or false, got {value!r}")


def env_level_for(value: Any, streams: bool, engine: str, streaming_engines: str) -> bool:
    """Whether turns run env-level for ``agent_proxy.env_level_async=value`` on an engine that
    does or does not stream; ``ConfigError`` for ``true`` on one that does not."""
    check_env_level_async(value)
    if value is True and not streams:
        raise ConfigError(f"agent_proxy.env_level_async=true needs an engine that streams completions "
                          f"({streaming_engines}); engine {engine!r} answers whole batches: set "
                          f"agent_proxy.env_level_async to auto or false")
    return streams if value == "auto" else bool(value)


# Workers per core at most: a worker mostly waits for the engine, so a few per
# core can still overlap env work with generation; beyond that more processes
# only cost memory and start-up.
MAX_JOBS_PER_CORE = 4


def cap_n_jobs(n_jobs: Any, cores: int | None = None, key: str = "agent_proxy.parallel_n_jobs") -> Any:
    """A worker count (``key``) above ``MAX_JOBS_PER_CORE`` x the cores:
    capped there, with a warning naming the key; anything else as it is."""
    if not isinstance(n_jobs, int) or n_jobs < 1:
        return n_jobs
    if cores is None:
        import joblib

        cores = joblib.cpu_count()
    cap = MAX_JOBS_PER_CORE * max(1, cores)
    if n_jobs <= cap:
        return n_jobs
    logger.warning("%s=%d is more than %d workers per core (%d cores): capped at %d",
                   key, n_jobs, MAX_JOBS_PER_CORE, cores, cap)
    return cap


AHEAD = ("none", "batches", "groups")  # RolloutPlan.ahead


@dataclass(frozen=True)
class RolloutPlan:
    """RAGEN's three rollout knobs read once (``AgentProxyConfig.plan``): where episodes run,
    ``workers`` (``use_parallel_rollout``) or the calling thread, and how far generation runs
    ahead of the trainer, ``ahead``: ``none``; whole ``batches`` (``async_generation_ratio: k >
    0``); or ``groups`` kept in flight (``rollout_mode: fully_async``), at most ``bound``
    policy versions ahead."""

    workers: bool = False
    ahead: str = "none"
    bound: int = 0

    @property
    def serves(self) -> bool:
        """Whether episodes ask a shared manager for answers (workers, or groups in flight)."""
        return self.workers or self.ahead == "groups"


@dataclass(frozen=True)
class AgentProxyConfig:
    """``agent_proxy.*``: the turn loop, prompts, and the rollout engine."""

    max_turn: int = setting(5, minimum=1)
    # the prompt and parsing keys: ContextConfig's defaults; it is built from them (context_config) and
    # checks their values
    action_sep: str = ContextConfig.action_sep
    max_actions_per_turn: int = ContextConfig.max_actions_per_turn
    enable_think: bool = ContextConfig.enable_think
    # full | limited_multi_turn | single_turn: the prompt's layout (RAGEN's); the last two show the
    # last max_context_window turns, the current one included (-1 or 0: all)
    context_window_mode: str = ContextConfig.context_window_mode
    max_context_window: int = ContextConfig.max_context_window
    use_turn_scores: bool = ContextConfig.use_turn_scores
    reward_normalization: RewardNormalization = field(default_factory=RewardNormalization)
    # rollout engine
    use_parallel_rollout: bool = False
    # -1: one worker per available core; auto: sized from each rollout (ragen.rollout.workers.autosize);
    # N: at most N workers, never more than a rollout's groups, capped (with a warning) at
    # MAX_JOBS_PER_CORE x the cores on this machine's backends
    parallel_n_jobs: Any = -1  # checked by check_n_jobs (auto, -1 or a positive integer)
    parallel_backend: str = setting("loky", choices=BACKENDS)
    max_env_num_per_worker: int | None = setting(None, minimum=1)
    pipeline_depth: int = setting(2, minimum=1)
    max_batch_size: int = setting(256, minimum=1)
    coalesce_wait_s: float = setting(0.0005, minimum=0.0)
    fallback_to_sequential: bool = True
    # time limits in seconds, > 0; null: no limit (0 is refused: it would read as "none" or "at once")
    rollout_timeout_s: float | None = setting(None, minimum=0.0)
    env_timeout_s: float | None = setting(None, minimum=0.0)
    env_retries: int = setting(1, minimum=0)
    # per engine answer a worker waits for; with env-level turns, per request (its env ends in timeout)
    engine_timeout_s: float | None = setting(DEFAULT_ENGINE_TIMEOUT_S, minimum=0.0)
    # auto: each env takes its next turn as soon as its own answer is in, when the engine streams
    # completions; true: the same, refused at start-up with an engine that cannot; false: lockstep turns
    env_level_async: Any = "auto"  # checked by check_env_level_async
    # the longest message between a worker and the shared manager (a frame's length is 4 bytes);
    # an env whose request would pass it ends in error
    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES  # checked by wire.check_max_message_bytes
    max_concurrent_rollouts: int = setting(1, minimum=1)
    # asynchronous training
    async_generation_ratio: int = setting(0, minimum=0)
    rollout_mode: str = setting("sync", choices=ROLLOUT_MODES)
    max_inflight_groups: int = setting(8, minimum=1)
    # fully_async: a group that weight updates interrupt goes on with the new weights (each turn
    # keeps its version); false: it restarts from its first turn when they span over the bound
    partial_rollout: bool = True
    # a training batch of whole groups of signal (ragen.rollout.fill): a group with an env in error or
    # timeout is never trained; nonzero_variance drops the groups whose rewards all agree too; up to
    # max_refill rounds of fresh groups replace the dropped ones (sync rollouts)
    rollout_filter: str = setting("none", choices=ROLLOUT_FILTERS)
    max_refill: int = setting(0, minimum=0)
    # a (tag, seed) that ends in error in quarantine_after consecutive rollouts is not dealt for
    # quarantine_rollouts rollouts (its group plays the next free seed); null: never quarantined
    quarantine_after: int | None = setting(None, minimum=1)
    quarantine_rollouts: int = setting(10, minimum=1)
    # over-sampling (ragen.rollout.oversample): a training rollout starts ceil(over_sample x env_groups)
    # groups and ends once env_groups of them ended; the unfinished ones are carried into the next
    # rollout (at most max_carry_staleness policy versions behind) or aborted (sync rollouts)
    over_sample: float = setting(1.0, minimum=1.0)
    unfinished: str = setting("carry", choices=UNFINISHED)
    max_carry_staleness: int = setting(1, minimum=1)

    @property
    def plan(self) -> RolloutPlan:
        """``use_parallel_rollout``, ``rollout_mode`` and ``async_generation_ratio`` as one plan."""
        if self.rollout_mode == "fully_async":
            return RolloutPlan(self.use_parallel_rollout, "groups", max(1, self.async_generation_ratio))
        if self.async_generation_ratio > 0:
            return RolloutPlan(self.use_parallel_rollout, "batches", self.async_generation_ratio)
        return RolloutPlan(self.use_parallel_rollout)

    def __post_init__(self) -> None:
        check_n_jobs(self.parallel_n_jobs)
        check_env_level_async(self.env_level_async)
        wire.check_max_message_bytes(self.max_message_bytes, "agent_proxy.max_message_bytes", least=1 << 16)
        for key in TIMEOUT_KEYS:
            check_time_limit(key, getattr(self, key))
        if self.plan.ahead == "groups" and self.parallel_backend not in FULLY_ASYNC_BACKENDS:
            raise ConfigError(f"agent_proxy.parallel_backend={self.parallel_backend!r}: rollout_mode fully_async "
                              f"keeps its groups in flight on this machine, on one of {FULLY_ASYNC_BACKENDS}")
        if self.max_refill and self.plan.ahead != "none":
            raise ConfigError(f"agent_proxy.max_refill={self.max_refill}: refilled groups are played at once, with "
                              f"the trainer's weights; rollout_mode={self.rollout_mode} and async_generation_ratio="
                              f"{self.async_generation_ratio} play batches in the background: set max_refill=0, or "
                              f"rollout_mode=sync and async_generation_ratio=0")
        if self.over_sample > 1 and self.plan.ahead != "none":
            raise ConfigError(f"agent_proxy.over_sample={self.over_sample:g}: over-sampling cuts the tail of a "
                              f"synchronous rollout; rollout_mode={self.rollout_mode} and async_generation_ratio="
                              f"{self.async_generation_ratio} generate in the background, where no rollout waits for "
                              f"its slowest group: set over_sample=1.0, or rollout_mode=sync and "
                              f"async_generation_ratio=0")


@dataclass(frozen=True)
class EnvConfigs:
    """``es_manager.<split>.env_configs``: the ``custom_envs`` tags of a split and how many groups
    play each."""

    tags: tuple[str, ...] = ()
    n_groups: tuple[int, ...] = setting((), minimum=1)


@dataclass(frozen=True)
class EnvTagConfig:
    """``custom_envs.<tag>``: an env type and its config, and how the loop plays it."""

    env_type: str = setting()
    config_type: str | None = None
    env_config: Any = None  # checked by the env's config class (ragen.env.make_env_config)
    max_actions_per_traj: int = setting(10, minimum=1)
    env_instruction: str | None = ""
    max_tokens: int | None = setting(None, minimum=1)
    format_example: Any = None  # {observation, answer}: checked where it is read
    # RAGEN's keys (its defaults: false, 1): the envs of a parallel_friendly
    # tag are reset and stepped on a thread pool of max_workers.
    parallel_friendly: bool = False
    max_workers: int = setting(1, minimum=1)


# The envs of one rollout (env_groups x group_size of a split) at most: every env is an object in a
# worker and a trajectory in the driver, so a count far past it takes the machine's memory; and a
# worker may ask for all of its envs' turns in one message, which carries at most wire.MAX_REQUESTS.
MAX_ENVS_PER_ROLLOUT = wire.MAX_REQUESTS


@dataclass(frozen=True)
class EnvSplitConfig:
    """``es_manager.train`` / ``es_manager.val``: groups x group_size envs, a tag per group."""

    env_groups: int = setting(minimum=1, maximum=MAX_ENVS_PER_ROLLOUT)
    group_size: int = setting(minimum=1, maximum=MAX_ENVS_PER_ROLLOUT)
    env_configs: EnvConfigs = field(default_factory=EnvConfigs)

    def check_env_count(self, key: str) -> None:
        """``ConfigError`` naming ``key`` (``es_manager.<split>``) when its envs pass ``MAX_ENVS_PER_ROLLOUT``."""
        n = self.env_groups * self.group_size
        if n > MAX_ENVS_PER_ROLLOUT:
            raise ConfigError(f"{key}: env_groups x group_size = {self.env_groups} x {self.group_size} = {n} envs, "
                              f"more than the {MAX_ENVS_PER_ROLLOUT} envs one rollout plays at most")


SPLITS = ("train", "val")


@dataclass(frozen=True)
class EsManagerConfig:
    """``es_manager``: the train and val env sets, the penalty of an answer without valid
    actions, and the bound on a step's reward. A config may leave out a split that nothing
    plays (RAGEN's ``EnvStateManager`` reads only its mode's); ``split(name)`` gives a split to
    play, or a ``ConfigError`` naming it."""

    train: EnvSplitConfig | None = None
    val: EnvSplitConfig | None = None
    format_penalty: float = -0.1
    # a step's reward beyond +-this (or not finite) ends its env in error: one such reward in a
    # group's sum makes the group's advantages NaN or swamps every other
    max_abs_reward: float = setting(DEFAULT_MAX_ABS_REWARD, above=0.0)

    def __post_init__(self) -> None:
        for name in SPLITS:
            if getattr(self, name) is not None:
                getattr(self, name).check_env_count(f"es_manager.{name}")
        if not abs(self.format_penalty) <= self.max_abs_reward:
            raise ConfigError(f"es_manager.format_penalty={self.format_penalty:g} is beyond "
                              f"es_manager.max_abs_reward={self.max_abs_reward:g}: a penalty is a reward too")

    def split(self, name: str) -> EnvSplitConfig:
        """``es_manager.<name>``; ``ConfigError`` when the config leaves it out."""
        if getattr(self, name) is None:
            raise ConfigError(f"es_manager.{name} is missing: give it env_groups, group_size and env_configs")
        return getattr(self, name)


@dataclass(frozen=True)
class GenerationConfig:
    """``ctx_manager.generation.*``: the sampling of the rollout (SamplingParams' defaults)."""

    response_length: int = setting(SamplingParams.max_tokens, minimum=1)
    temperature: float = setting(SamplingParams.temperature, minimum=0.0)
    top_p: float = setting(SamplingParams.top_p, above=0.0, maximum=1.0)
    top_k: int = setting(SamplingParams.top_k, minimum=-1)


@dataclass(frozen=True)
class CtxManagerConfig:
    """``ctx_manager``: the sampling of the rollout's answers, and how prompts and training
    sequences hold earlier answers' tokens (``ContextConfig``)."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    token_history: str = ContextConfig.token_history  # checked by ContextConfig
    train_end_after_cut: bool = ContextConfig.train_end_after_cut
    tool_parser: str = ContextConfig.tool_parser  # checked by ContextConfig


@dataclass(frozen=True)
class LlmServerConfig:
    """``llm_server.*``: where the shared inference manager listens for workers."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    advertise_host: str | None = None  # how workers reach the driver; null: found for you

    def __post_init__(self) -> None:
        check_listen_address(self.host, self.port)


@dataclass(frozen=True)
class SeedConfig:
    """``seed``: the first seed of the train and val env sets (and of the engine's sampling for
    each)."""

    train: int = 0
    val: int = 0


@dataclass(frozen=True)
class DaskConfig:
    """``dask``: the scheduler the dask backend's workers belong to (none: a local cluster for the
    run)."""

    scheduler_address: str | None = None
    n_workers: int | None = setting(None, minimum=1)


@dataclass(frozen=True)
class RayConfig:
    """``ray``: the Ray cluster the ray backend's workers belong to (none: ``RAY_ADDRESS`` or a new
    local Ray)."""

    address: str | None = None


@dataclass(frozen=True)
class AgentSection:
    """``agent``: how the episodes of ``env_type: agent`` tags run and train (docs/agents.md).

    ``sample_shape``: segment, a training sample per segment of an episode (its calls that extend
    one token sequence), sharing the episode's advantage; call, a sample per call.
    ``max_concurrent``: agent episodes running at once in a rollout, over all its workers."""

    sample_shape: str = setting(ContextConfig.agent_sample_shape, choices=SAMPLE_SHAPES)
    max_concurrent: int = setting(64, minimum=1)


# section name -> its dataclass
ROLLOUT_SECTIONS: dict[str, type] = {
    "agent_proxy": AgentProxyConfig,
    "es_manager": EsManagerConfig,
    "ctx_manager": CtxManagerConfig,
    "llm_server": LlmServerConfig,
    "seed": SeedConfig,
    "dask": DaskConfig,
    "ray": RayConfig,
    "agent": AgentSection,
}


def read_rollout_sections(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Section name -> its dataclass instance, read from the whole config; the prompt keys' values are
    checked too, by the ``ContextConfig`` they make."""
    sections = {name: read(cls, cfg.get(name), name) for name, cls in ROLLOUT_SECTIONS.items()}
    context_config(sections)
    return sections


def context_config(sections: Mapping[str, Any]) -> ContextConfig:
    """The ``ContextConfig`` of the ``agent_proxy`` and ``ctx_manager`` sections (``read_rollout_sections``)."""
    ap: AgentProxyConfig = sections["agent_proxy"]
    ctx: CtxManagerConfig = sections["ctx_manager"]
    return ContextConfig(
        action_sep=ap.action_sep,
        max_actions_per_turn=ap.max_actions_per_turn,
        enable_think=ap.enable_think,
        context_window_mode=ap.context_window_mode,
        max_context_window=ap.max_context_window,
        use_turn_scores=ap.use_turn_scores,
        reward_grouping=ap.reward_normalization.grouping,
        reward_method=ap.reward_normalization.method,
        response_length=ctx.generation.response_length,
        token_history=ctx.token_history,
        train_end_after_cut=ctx.train_end_after_cut,
        tool_parser=ctx.tool_parser,
        agent_sample_shape=sections["agent"].sample_shape if "agent" in sections else ContextConfig.agent_sample_shape,
    )
