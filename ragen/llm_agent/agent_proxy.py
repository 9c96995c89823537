"""LLMAgentProxy: the rollout entry point, sequential or parallel by config.

``AgentSetup.from_config(cfg)`` reads and checks every rollout key of the Hydra
config (``agent_proxy.*``, ``es_manager.*``, ``ctx_manager.generation.*``,
``custom_envs``, ``seed.*``) before any model loads; errors name the key.
``LLMAgentProxy(setup, engine).rollout(split)`` plays the next rollout of the
``train`` or ``val`` env set:

- ``use_parallel_rollout: false``: RAGEN's loop in the driver, one batched
  engine call per turn over all active envs (the reference, and for debugging);
- ``use_parallel_rollout: true``: ``ParallelRolloutManager`` over joblib
  workers, all talking to one ``SharedLLMInferenceManager`` around the engine.

Both give the same trajectories for a deterministic policy. At most
``max_concurrent_rollouts`` rollouts run at once (one semaphore for training
rollouts, baseline and periodic evaluation).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

from ragen.llm.types import Engine, SamplingParams
from ragen.llm_agent.ctx_manager import ContextConfig
from ragen.llm_agent.es_manager import EnvStateManager, compute_metrics, to_plain
from ragen.llm_agent.parallel_rollout import BACKENDS, ParallelRolloutManager
from ragen.llm_agent.rollout_loop import DirectClient, EnvPool, LoopConfig, run_envs
from ragen.llm_agent.shared_llm import SharedLLMInferenceManager
from ragen.llm_agent.types import RolloutResult

logger = logging.getLogger(__name__)


def _get(cfg: Mapping, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _number(cfg: Mapping, key: str, default: Any, kind=float, minimum: float | None = None,
            allow_none: bool = False) -> Any:
    value = _get(cfg, key, default)
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ValueError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {value}")
    return kind(value)


@dataclass
class AgentSetup:
    loop: LoopConfig
    val_loop: LoopConfig
    es: dict[str, EnvStateManager]
    use_parallel_rollout: bool
    parallel_n_jobs: int
    parallel_backend: str
    max_env_num_per_worker: int | None
    max_batch_size: int
    coalesce_wait_s: float
    fallback_to_sequential: bool
    rollout_timeout_s: float | None
    engine_timeout_s: float | None
    max_concurrent_rollouts: int
    host: str
    port: int

    @classmethod
    def from_config(cls, cfg: Mapping) -> "AgentSetup":
        cfg = to_plain(cfg)
        ap = "agent_proxy"
        rn = _get(cfg, f"{ap}.reward_normalization", {}) or {}
        context = ContextConfig(
            action_sep=str(_get(cfg, f"{ap}.action_sep", "||")),
            max_actions_per_turn=_number(cfg, f"{ap}.max_actions_per_turn", 5, int, 1),
            enable_think=bool(_get(cfg, f"{ap}.enable_think", True)),
            max_context_window=_number(cfg, f"{ap}.max_context_window", -1, int, -1),
            use_turn_scores=bool(_get(cfg, f"{ap}.use_turn_scores", False)),
            reward_grouping=str(rn.get("grouping", "state")),
            reward_method=str(rn.get("method", "identity")),
        )
        gen = "ctx_manager.generation"
        sampling = SamplingParams(
            temperature=_number(cfg, f"{gen}.temperature", 1.0, float, 0.0),
            top_p=_number(cfg, f"{gen}.top_p", 1.0, float, 0.0),
            top_k=_number(cfg, f"{gen}.top_k", -1, int, -1),
            max_tokens=_number(cfg, f"{gen}.response_length", 128, int, 1),
            seed=_number(cfg, "seed.train", 0, int),
        )
        if not 0.0 < sampling.top_p <= 1.0:
            raise ValueError(f"{gen}.top_p must be in (0, 1], got {sampling.top_p}")
        val_sampling = SamplingParams(**{**sampling.to_dict(), "seed": _number(cfg, "seed.val", 0, int)})
        pipeline_depth = _number(cfg, f"{ap}.pipeline_depth", 1, int, 1)
        loop = LoopConfig(
            context=context,
            sampling=sampling,
            max_turn=_number(cfg, f"{ap}.max_turn", 5, int, 1),
            format_penalty=_number(cfg, "es_manager.format_penalty", -0.1, float),
            env_timeout_s=_number(cfg, f"{ap}.env_timeout_s", None, float, 0.0, allow_none=True) or None,
            pipeline_depth=pipeline_depth,
        )
        val_loop = LoopConfig(**{**loop.__dict__, "sampling": val_sampling})
        custom_envs = _get(cfg, "custom_envs")
        if not isinstance(custom_envs, Mapping) or not custom_envs:
            raise ValueError("custom_envs is missing or empty: add config/envs.yaml to the defaults list")
        es = {}
        for split in ("train", "val"):
            split_cfg = _get(cfg, f"es_manager.{split}")
            if split_cfg is None:
                raise ValueError(f"es_manager.{split} is missing")
            es[split] = EnvStateManager(split, split_cfg, custom_envs, _number(cfg, f"seed.{split}", 0, int))
        backend = str(_get(cfg, f"{ap}.parallel_backend", "loky"))
        if backend not in BACKENDS:
            raise ValueError(f"{ap}.parallel_backend: unknown {backend!r}; choose one of {BACKENDS}")
        n_jobs = _number(cfg, f"{ap}.parallel_n_jobs", -1, int, -1)
        if n_jobs == 0:
            raise ValueError(f"{ap}.parallel_n_jobs must be -1 (one per core) or >= 1, got 0")
        return cls(
            loop=loop,
            val_loop=val_loop,
            es=es,
            use_parallel_rollout=bool(_get(cfg, f"{ap}.use_parallel_rollout", False)),
            parallel_n_jobs=n_jobs,
            parallel_backend=backend,
            max_env_num_per_worker=_number(cfg, f"{ap}.max_env_num_per_worker", None, int, 1, allow_none=True),
            max_batch_size=_number(cfg, f"{ap}.max_batch_size", 256, int, 1),
            coalesce_wait_s=_number(cfg, f"{ap}.coalesce_wait_s", 0.02, float, 0.0),
            fallback_to_sequential=bool(_get(cfg, f"{ap}.fallback_to_sequential", True)),
            rollout_timeout_s=_number(cfg, f"{ap}.rollout_timeout_s", None, float, 0.0, allow_none=True) or None,
            engine_timeout_s=_number(cfg, f"{ap}.engine_timeout_s", None, float, 0.0, allow_none=True) or None,
            max_concurrent_rollouts=_number(cfg, f"{ap}.max_concurrent_rollouts", 1, int, 1),
            host=str(_get(cfg, "llm_server.host", "127.0.0.1")),
            port=_number(cfg, "llm_server.port", 0, int, 0),
        )


class LLMAgentProxy:
    def __init__(self, setup: AgentSetup, engine: Engine) -> None:
        self.setup = setup
        self.engine = engine
        self._semaphore = threading.BoundedSemaphore(setup.max_concurrent_rollouts)
        logger.info("[Concurrency] Set max concurrent rollouts to %d", setup.max_concurrent_rollouts)
        self.shared: SharedLLMInferenceManager | None = None
        self.parallel: ParallelRolloutManager | None = None
        self._pool = EnvPool()
        self._lock = threading.Lock()  # the engine lock of the sequential path
        if setup.use_parallel_rollout:
            self.shared = SharedLLMInferenceManager(
                engine, max_batch_size=setup.max_batch_size, coalesce_wait_s=setup.coalesce_wait_s,
                host=setup.host, port=setup.port,
            )
            self._lock = self.shared.engine_lock
            self.parallel = ParallelRolloutManager(
                self.shared, n_jobs=setup.parallel_n_jobs, backend=setup.parallel_backend,
                max_env_num_per_worker=setup.max_env_num_per_worker,
                fallback_to_sequential=setup.fallback_to_sequential,
                rollout_timeout_s=setup.rollout_timeout_s,
                engine_timeout_s=setup.engine_timeout_s,
            )

    @property
    def engine_lock(self) -> threading.Lock:
        """Held around every engine call; the trainer holds it to swap weights."""
        return self._lock

    def rollout(self, split: str = "train", fault: dict[str, Any] | None = None,
                rollout_index: int | None = None) -> RolloutResult:
        """The next rollout of ``split`` (or the one numbered ``rollout_index``:
        same index, same seeds)."""
        if split not in self.setup.es:
            raise ValueError(f"unknown split {split!r}; choose 'train' or 'val'")
        specs = self.setup.es[split].make_specs(rollout_index)
        config = self.setup.loop if split == "train" else self.setup.val_loop
        with self._semaphore:
            if self.parallel is not None:
                return self.parallel.rollout(specs, config, fault=fault)
            return self._sequential(specs, config)

    def _sequential(self, specs, config: LoopConfig) -> RolloutResult:
        t0 = time.perf_counter()
        client = _LockedClient(self.engine, self._lock)
        # one stream: one engine call per turn over all active envs
        trajectories, stats = run_envs(specs, client, LoopConfig(**{**config.__dict__, "pipeline_depth": 1}),
                                       pool=self._pool, isolate_errors=True)
        metrics = compute_metrics(trajectories)
        sizes = client.batch_sizes
        metrics.update({
            "timing/env_reset_s": stats.env_reset_s,
            "timing/env_step_s": stats.env_step_s,
            "timing/env_s": stats.env_reset_s + stats.env_step_s,
            "timing/wait_llm_s": stats.wait_s,
            "timing/engine_s": client.engine_time_s,
            "engine/calls": float(client.engine_calls),
            "engine/requests": float(sum(sizes)),
            "engine/mean_batch_size": sum(sizes) / len(sizes) if sizes else 0.0,
            "engine/max_batch_size": float(max(sizes)) if sizes else 0.0,
            "parallel/fallbacks": 0.0,
            "timing/rollout_s": time.perf_counter() - t0,
        })
        return RolloutResult(trajectories=trajectories, specs=list(specs), metrics=metrics)

    def close(self) -> None:
        if self.parallel is not None:
            self.parallel.close()
        if self.shared is not None:
            self.shared.close()
        self._pool.close()

    def __enter__(self) -> "LLMAgentProxy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _LockedClient(DirectClient):
    def __init__(self, engine: Engine, lock: threading.Lock) -> None:
        super().__init__(engine)
        self._engine_lock = lock

    def wait_any(self):
        with self._engine_lock:
            return super().wait_any()
