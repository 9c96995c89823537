"""LLMAgentProxy: the rollout entry point, RAGEN's API over a ``RolloutBackend``.

``AgentSetup.from_config(cfg)`` reads every rollout section of the Hydra
config into its typed dataclass (``ragen.rollout.config``: ``agent_proxy``,
``es_manager``, ``ctx_manager``, ``llm_server``, ``seed``, ``dask``, ``ray``),
checks ``custom_envs``, and holds the sections whole (``setup.agent_proxy.
parallel_n_jobs``), all before any model loads; errors name the key.
``LLMAgentProxy(setup, engine).rollout(split)`` plays the next rollout of the
``train`` or ``val`` env set:

the backend ``make_backend`` built from ``agent_proxy`` (sequential or
parallel, generating ahead or fully asynchronous: ``ragen.rollout.backends``)
plays it. ``next_train_batch(version)`` is the trainer's: the next training
batch, which an asynchronous backend may have generated ahead.

Every backend gives the same trajectories for a deterministic policy. While a
rollout runs, a ``RolloutProgress`` shows envs finished, turns and the
engine's batch size (a bar on a terminal, log lines elsewhere; nothing for
rollouts under 2 s); one summary line follows each rollout.
"""

from __future__ import annotations

import gc
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ragen.config_reader import to_plain
from ragen.llm.types import Engine, SamplingParams
from ragen.rollout.backends import make_backend
from ragen.rollout.config import (AgentProxyConfig, CtxManagerConfig, EsManagerConfig, LlmServerConfig, SeedConfig,
                                  context_config, read_rollout_sections)
from ragen.rollout.envs import EnvSpecMaker
from ragen.rollout.fill import Quarantine, fill_batch
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.oversample import OverSample
from ragen.rollout.progress import RolloutProgress
from ragen.rollout.types import RolloutResult
from ragen.rollout.workers.cluster import ClusterConfig, check_installed
from ragen.serving.gate import EngineGate

logger = logging.getLogger(__name__)


@dataclass
class AgentSetup:
    """The rollout sections of the config, read once, and what the proxy builds from them:
    the turn loop's settings per split, the env state managers, the cluster keys."""

    agent_proxy: AgentProxyConfig
    es_manager: EsManagerConfig
    ctx_manager: CtxManagerConfig
    llm_server: LlmServerConfig
    seed: SeedConfig
    loop: LoopConfig
    val_loop: LoopConfig
    es: dict[str, EnvSpecMaker]
    cluster: ClusterConfig = ClusterConfig()

    @classmethod
    def from_config(cls, cfg: Mapping) -> "AgentSetup":
        cfg = to_plain(cfg)
        sections = read_rollout_sections(cfg)
        ap: AgentProxyConfig = sections["agent_proxy"]
        gen = sections["ctx_manager"].generation
        seed: SeedConfig = sections["seed"]
        es_cfg: EsManagerConfig = sections["es_manager"]
        context = context_config(sections)

        def loop_config(sampling_seed: int) -> LoopConfig:
            sampling = SamplingParams(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
                                      max_tokens=gen.response_length, seed=sampling_seed)
            return LoopConfig(context=context, sampling=sampling, max_turn=ap.max_turn,
                              format_penalty=es_cfg.format_penalty, max_abs_reward=es_cfg.max_abs_reward,
                              env_timeout_s=ap.env_timeout_s, env_retries=ap.env_retries,
                              env_level_async=ap.env_level_async,
                              engine_timeout_s=ap.engine_timeout_s,
                              agent_max_concurrent=sections["agent"].max_concurrent)

        if ap.plan.workers:
            check_installed(ap.parallel_backend)  # dask's and ray's packages are extras
        custom_envs = cfg.get("custom_envs")
        if not isinstance(custom_envs, Mapping) or not custom_envs:
            raise ValueError("custom_envs is missing or empty: add config/envs.yaml to the defaults list")
        es = {split: EnvSpecMaker(split, es_cfg.split(split), custom_envs, getattr(seed, split))
              for split in ("train", "val")}
        for split, maker in es.items():
            maker.check_context(context)
            maker.check_agents(ap)
            if ap.quarantine_after is not None:
                maker.quarantine = Quarantine(ap.quarantine_after, ap.quarantine_rollouts, split)
        server: LlmServerConfig = sections["llm_server"]
        return cls(
            agent_proxy=ap,
            es_manager=es_cfg,
            ctx_manager=sections["ctx_manager"],
            llm_server=server,
            seed=seed,
            loop=loop_config(seed.train),
            val_loop=loop_config(seed.val),
            es=es,
            cluster=ClusterConfig(
                dask_scheduler_address=sections["dask"].scheduler_address or None,
                dask_n_workers=sections["dask"].n_workers,
                ray_address=sections["ray"].address or None,
                advertise_host=server.advertise_host or None,
            ),
        )


class LLMAgentProxy:
    """RAGEN's rollout entry point: ``rollout(split)`` plays the next rollout of
    the ``train`` or ``val`` env set on the backend the config names, and
    ``next_train_batch(version)`` hands the trainer its next batch."""

    def __init__(self, setup: AgentSetup, engine: Engine) -> None:
        self.setup = setup
        self.engine = engine
        ap = setup.agent_proxy
        self.backend = make_backend(ap, engine, setup.llm_server, setup.cluster)
        self.shared = self.backend.serving  # the SharedLLMInferenceManager of parallel and fully-async rollouts
        self.over_sample = OverSample(ap.over_sample, ap.unfinished, ap.max_carry_staleness) \
            if ap.over_sample > 1 else None
        logger.info("[Concurrency] Set max concurrent rollouts to %d", ap.max_concurrent_rollouts)
        # What exists now (modules, the model, the engine, the workers' handles) lives about as long
        # as the proxy: frozen, full collections no longer walk it, which the objects rollouts create
        # (trajectories unpickled from the workers) would otherwise set off again and again.
        gc.collect()
        gc.freeze()

    def next_train_batch(self, policy_version: int) -> RolloutResult:
        """The next training batch: a rollout now, or one generated ahead (at
        most ``async_generation_ratio`` versions old), or completed fully-async groups,
        or, over-sampled, the groups that ended first (``ragen.rollout.oversample``);
        its groups with a failed env, or no signal under ``rollout_filter``, named as
        dropped, and refilled up to ``max_refill`` rounds (``ragen.rollout.fill``)."""
        ap, maker, loop = self.setup.agent_proxy, self.setup.es["train"], self.setup.loop
        if self.over_sample is None:
            result = self.backend.rollout(maker, loop, policy_version=policy_version)
        else:
            specs = self.over_sample.deal(maker, policy_version)
            result = self.over_sample.cut(self.backend.rollout(
                specs, loop, policy_version=policy_version, enough=maker.env_groups,
                progress=RolloutProgress(len(specs), "train")))
        self._record("train", result)

        def play(specs: list) -> RolloutResult:
            more = self.backend.rollout(specs, loop, policy_version=policy_version)
            self._record("train", more)
            return more

        return fill_batch(result, play, maker, ap.rollout_filter, ap.max_refill)

    def _record(self, split: str, result: RolloutResult) -> None:
        """A rollout of ``split``, told to its quarantine (when one is kept), which its metrics report."""
        quarantine = self.setup.es[split].quarantine
        if quarantine is not None:
            quarantine.record(result.trajectories)
            # the (tag, seed) set aside now, and the groups of this rollout dealt in their place
            result.metrics["quarantine/held"] = float(len(quarantine.held))
            result.metrics["quarantine/replaced_groups"] = float(len(
                {s.group_id for s in result.specs if s.replaces_seed is not None}))

    @contextmanager
    def generation_paused(self) -> Iterator[None]:
        """Validation runs in here: background generate-ahead stops first
        (the fully-async rollout keeps generating train groups; evaluation uses
        the synchronous path)."""
        with self.backend.paused():
            yield

    def async_metrics(self) -> dict[str, float]:
        """Waiting times, drops and staleness of the asynchronous modes."""
        return self.backend.metrics()

    @property
    def engine_lock(self) -> EngineGate:
        """Held around every engine call; the trainer holds it to swap weights."""
        return self.backend.engine_lock

    def rollout(self, split: str = "train", rollout_index: int | None = None,
                progress: RolloutProgress | None = None) -> RolloutResult:
        """The next rollout of ``split`` (or the one numbered ``rollout_index``:
        same index, same seeds), played now. ``progress``: the one to tell (the
        rollout closes it); by default a bar on a terminal, log lines elsewhere."""
        if split not in self.setup.es:
            raise ValueError(f"unknown split {split!r}; choose 'train' or 'val'")
        specs = self.setup.es[split].make_specs(rollout_index)
        loop = self.setup.loop if split == "train" else self.setup.val_loop
        if progress is None:
            progress = RolloutProgress(len(specs), split)
        result = self.backend.rollout(specs, loop, progress=progress)
        self._record(split, result)
        return result

    def close(self) -> None:
        self.backend.close()  # and the shared manager it built
        gc.unfreeze()  # what was frozen at the start is the collector's again (a cycle of it may be garbage now)

    def __enter__(self) -> "LLMAgentProxy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
