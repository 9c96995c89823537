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
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ragen.llm.types import Engine, SamplingParams
from ragen.llm_agent.cluster import ClusterConfig
from ragen.llm_agent.async_rollout import GroupsInFlight, RolloutAhead, staleness
from ragen.llm_agent.ctx_manager import ContextConfig
from ragen.llm_agent.es_manager import EnvStateManager, compute_metrics, to_plain
from ragen.llm_agent.parallel_rollout import BACKENDS, ParallelRolloutManager
from ragen.llm_agent.rollout_loop import KeptEnvs, LoopConfig, run_envs
from ragen.llm_agent.inference import DirectClient, SharedLLMInferenceManager, check_listen_address
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


def _text(cfg: Mapping, key: str) -> str | None:
    value = _get(cfg, key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key} must be a string or null, got {value!r}")
    return value or None


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
    rollout_mode: str = "sync"
    async_generation_ratio: int = 0
    max_inflight_groups: int = 8
    cluster: ClusterConfig = ClusterConfig()

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
            env_retries=_number(cfg, f"{ap}.env_retries", 1, int, 0),
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
        rollout_mode = str(_get(cfg, f"{ap}.rollout_mode", "sync"))
        if rollout_mode not in ("sync", "fully_async"):
            raise ValueError(f"{ap}.rollout_mode: unknown {rollout_mode!r}; choose 'sync' or 'fully_async'")
        n_jobs = _number(cfg, f"{ap}.parallel_n_jobs", -1, int, -1)
        host, port = check_listen_address(_get(cfg, "llm_server.host", "127.0.0.1"), _get(cfg, "llm_server.port", 0))
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
            coalesce_wait_s=_number(cfg, f"{ap}.coalesce_wait_s", 0.002, float, 0.0),
            fallback_to_sequential=bool(_get(cfg, f"{ap}.fallback_to_sequential", True)),
            rollout_timeout_s=_number(cfg, f"{ap}.rollout_timeout_s", None, float, 0.0, allow_none=True) or None,
            engine_timeout_s=_number(cfg, f"{ap}.engine_timeout_s", None, float, 0.0, allow_none=True) or None,
            max_concurrent_rollouts=_number(cfg, f"{ap}.max_concurrent_rollouts", 1, int, 1),
            host=host,
            port=port,
            rollout_mode=rollout_mode,
            async_generation_ratio=_number(cfg, f"{ap}.async_generation_ratio", 0, int, 0),
            max_inflight_groups=_number(cfg, f"{ap}.max_inflight_groups", 8, int, 1),
            cluster=ClusterConfig(
                dask_scheduler_address=_text(cfg, "dask.scheduler_address"),
                dask_n_workers=_number(cfg, "dask.n_workers", None, int, 1, allow_none=True),
                ray_address=_text(cfg, "ray.address"),
                advertise_host=_text(cfg, "llm_server.advertise_host"),
            ),
        )


class LLMAgentProxy:
    def __init__(self, setup: AgentSetup, engine: Engine) -> None:
        self.setup = setup
        self.engine = engine
        self._semaphore = threading.BoundedSemaphore(setup.max_concurrent_rollouts)
        logger.info("[Concurrency] Set max concurrent rollouts to %d", setup.max_concurrent_rollouts)
        self.shared: SharedLLMInferenceManager | None = None
        self.parallel: ParallelRolloutManager | None = None
        self._kept_envs = KeptEnvs()
        self._lock = threading.Lock()  # the engine lock of the sequential path
        if setup.use_parallel_rollout or setup.rollout_mode == "fully_async":
            self.shared = SharedLLMInferenceManager(
                engine, max_batch_size=setup.max_batch_size, coalesce_wait_s=setup.coalesce_wait_s,
                host=setup.host, port=setup.port,
            )
            self._lock = self.shared.engine_lock
        if setup.use_parallel_rollout:
            self.parallel = ParallelRolloutManager(
                self.shared, n_jobs=setup.parallel_n_jobs, backend=setup.parallel_backend,
                max_env_num_per_worker=setup.max_env_num_per_worker,
                fallback_to_sequential=setup.fallback_to_sequential,
                rollout_timeout_s=setup.rollout_timeout_s,
                engine_timeout_s=setup.engine_timeout_s,
                cluster=setup.cluster,
            )
        self._ahead: RolloutAhead | None = None
        self._groups_in_flight: GroupsInFlight | None = None
        self._async_counts: dict[str, Any] = {"dropped_stale": 0, "staleness": []}

    # ----- training batches (sync, generate-ahead, fully async) -----------------
    def next_train_batch(self, policy_version: int) -> RolloutResult:
        """The next training batch under the configured mode: a synchronous
        rollout (``async_generation_ratio: 0``), one generated ahead in the
        background (``k > 0``; never more than ``k`` versions old), or
        ``env_groups`` groups from the fully-async groups in flight."""
        setup = self.setup
        if setup.rollout_mode == "fully_async":
            return self._fully_async_batch(policy_version)
        if setup.async_generation_ratio == 0:
            return self.rollout("train")
        if self._ahead is None:
            self._ahead = RolloutAhead(lambda: self.rollout("train"), setup.async_generation_ratio)
        return self._ahead.get(policy_version)

    def _fully_async_batch(self, policy_version: int) -> RolloutResult:
        es = self.setup.es["train"]
        if self._groups_in_flight is None:
            self._groups_in_flight = GroupsInFlight(
                es, self.shared.client(timeout_s=self.setup.engine_timeout_s), self.setup.loop,
                max_inflight_groups=self.setup.max_inflight_groups, n_jobs=self.setup.parallel_n_jobs,
                backend="threading" if self.setup.parallel_backend == "threading" else "loky",
                max_version_span=max(1, self.setup.async_generation_ratio))
        bound = max(1, self.setup.async_generation_ratio)
        t0 = time.perf_counter()
        groups = []
        while len(groups) < es.env_groups:
            for index, trajs in self._groups_in_flight.get_batch(es.env_groups - len(groups)):
                lag = staleness(trajs, policy_version)
                if lag > bound:
                    self._async_counts["dropped_stale"] += 1
                    continue
                self._async_counts["staleness"].append(lag)
                groups.append((index, trajs))
        groups.sort(key=lambda g: g[0])
        trajectories = [t for _, trajs in groups for t in trajs]
        specs = [s for index, _ in groups for s in es.group_specs(index)]
        metrics = compute_metrics(trajectories)
        metrics["timing/rollout_s"] = time.perf_counter() - t0
        return RolloutResult(trajectories=trajectories, specs=specs, metrics=metrics)

    @contextmanager
    def generation_paused(self) -> Iterator[None]:
        """Validation runs in here: background generate-ahead stops first
        (the fully-async rollout keeps generating train groups; evaluation uses
        the synchronous path)."""
        if self._ahead is None:
            yield
            return
        with self._ahead.paused():
            yield

    def async_metrics(self) -> dict[str, float]:
        """Waiting times, drops and staleness of the asynchronous modes."""
        m: dict[str, float] = {}
        lags = list(self._async_counts["staleness"])
        if self._ahead is not None:
            st = self._ahead.stats
            lags += st.staleness
            m.update({"async/trainer_wait_s": st.trainer_wait_s, "async/generator_wait_s": st.generator_wait_s,
                      "async/dropped_stale": float(st.dropped_stale), "async/produced": float(st.produced)})
        if self._groups_in_flight is not None:
            m.update({f"async/groups_{k}": float(v) for k, v in self._groups_in_flight.counts.items()})
            m["async/dropped_stale"] = m.get("async/dropped_stale", 0.0) + self._async_counts["dropped_stale"]
            m["async/queued_groups"] = float(self._groups_in_flight.queued())
        if lags:
            m["async/staleness_mean"] = sum(lags) / len(lags)
            m["async/staleness_max"] = float(max(lags))
        return m

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
                result = self.parallel.rollout(specs, config, fault=fault)
            else:
                result = self._sequential(specs, config)
        m = result.metrics
        logger.info(
            "[Rollout] %s: %d envs in %.2f s | engine %.2f s, %d calls, mean batch %.1f | env %.2f s | "
            "waiting for the model %.2f s | fallbacks %d | success %.3f",
            split, len(specs), m.get("timing/rollout_s", 0.0), m.get("timing/engine_s", 0.0),
            int(m.get("engine/calls", 0)), m.get("engine/mean_batch_size", 0.0), m.get("timing/env_s", 0.0),
            m.get("timing/wait_llm_s", 0.0), int(m.get("parallel/fallbacks", 0)), m.get("rollout/success", 0.0))
        for f in result.failed_envs:
            logger.warning("[Rollout] %s: env_id %d (tag %s, seed %d) ended in %s at turn %d: %s | check it alone: "
                           "python -m ragen.env.check %s --first-seed %d", split, f["env_id"], f["tag"], f["seed"],
                           f["stop_reason"], f["turn"], f["error"], f["tag"], f["seed"])
        return result

    def _sequential(self, specs, config: LoopConfig) -> RolloutResult:
        t0 = time.perf_counter()
        client = _LockedClient(self.engine, self._lock)
        # one stream: one engine call per turn over all active envs
        trajectories, stats = run_envs(specs, client, LoopConfig(**{**config.__dict__, "pipeline_depth": 1}),
                                       kept_envs=self._kept_envs, isolate_errors=True)
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
            "rollout/env_retries": float(stats.env_retries),
            "timing/rollout_s": time.perf_counter() - t0,
        })
        return RolloutResult(trajectories=trajectories, specs=list(specs), metrics=metrics)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
        if self._groups_in_flight is not None:
            self._groups_in_flight.close()
        if self.parallel is not None:
            self.parallel.close()
        if self.shared is not None:
            self.shared.close()
        self._kept_envs.close()

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
