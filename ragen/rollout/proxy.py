"""LLMAgentProxy: the rollout entry point, sequential or parallel by config.

``AgentSetup.from_config(cfg)`` reads every rollout section of the Hydra
config into its typed dataclass (``ragen.rollout.config``: ``agent_proxy``,
``es_manager``, ``ctx_manager``, ``llm_server``, ``seed``, ``dask``, ``ray``),
checks ``custom_envs``, and holds the sections whole (``setup.agent_proxy.
parallel_n_jobs``), all before any model loads; errors name the key.
``LLMAgentProxy(setup, engine).rollout(split)`` plays the next rollout of the
``train`` or ``val`` env set:

- ``use_parallel_rollout: false``: RAGEN's loop in the driver, one batched
  engine call per turn over all active envs (the reference, and for debugging);
- ``use_parallel_rollout: true``: ``ParallelRolloutManager`` over joblib
  workers, all talking to one ``SharedLLMInferenceManager`` around the engine.

Both give the same trajectories for a deterministic policy. While a rollout
runs, a ``RolloutProgress`` shows envs finished, turns and the engine's batch
size (a bar on a terminal, log lines elsewhere; nothing for rollouts under
2 s); one summary line follows each rollout. At most
``max_concurrent_rollouts`` rollouts run at once (one semaphore for training
rollouts, baseline and periodic evaluation).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ragen.llm.types import Engine, SamplingParams
from ragen.rollout.workers.cluster import ClusterConfig
from ragen.rollout.backends.ahead import RolloutAhead, response_tokens, staleness
from ragen.rollout.backends.fully_async import GroupsInFlight
from ragen.rollout.context import ContextConfig
from ragen.config_reader import to_plain
from ragen.rollout.config import (AgentProxyConfig, CtxManagerConfig, EsManagerConfig, LlmServerConfig, SeedConfig,
                                    read_rollout_sections)
from ragen.rollout.envs import EnvStateManager, compute_metrics
from ragen.rollout.backends.parallel import ParallelRolloutManager
from ragen.rollout.progress import RolloutProgress
from ragen.rollout.loop import KeptEnvs, LoopConfig, run_envs
from ragen.serving import DirectClient, SharedLLMInferenceManager
from ragen.rollout.types import RolloutResult

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
    es: dict[str, EnvStateManager]
    cluster: ClusterConfig = ClusterConfig()

    @classmethod
    def from_config(cls, cfg: Mapping) -> "AgentSetup":
        cfg = to_plain(cfg)
        sections = read_rollout_sections(cfg)
        ap: AgentProxyConfig = sections["agent_proxy"]
        gen = sections["ctx_manager"].generation
        seed: SeedConfig = sections["seed"]
        es_cfg: EsManagerConfig = sections["es_manager"]
        context = ContextConfig(
            action_sep=ap.action_sep,
            max_actions_per_turn=ap.max_actions_per_turn,
            enable_think=ap.enable_think,
            max_context_window=ap.max_context_window,
            use_turn_scores=ap.use_turn_scores,
            reward_grouping=ap.reward_normalization.grouping,
            reward_method=ap.reward_normalization.method,
        )
        sampling = SamplingParams(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
                                  max_tokens=gen.response_length, seed=seed.train)
        val_sampling = SamplingParams(**{**sampling.to_dict(), "seed": seed.val})
        loop = LoopConfig(
            context=context,
            sampling=sampling,
            max_turn=ap.max_turn,
            format_penalty=es_cfg.format_penalty,
            env_timeout_s=ap.env_timeout_s or None,
            pipeline_depth=ap.pipeline_depth,
            env_retries=ap.env_retries,
        )
        val_loop = LoopConfig(**{**loop.__dict__, "sampling": val_sampling})
        custom_envs = cfg.get("custom_envs")
        if not isinstance(custom_envs, Mapping) or not custom_envs:
            raise ValueError("custom_envs is missing or empty: add config/envs.yaml to the defaults list")
        es = {split: EnvStateManager(split, getattr(es_cfg, split), custom_envs, getattr(seed, split))
              for split in ("train", "val")}
        server: LlmServerConfig = sections["llm_server"]
        return cls(
            agent_proxy=ap,
            es_manager=es_cfg,
            ctx_manager=sections["ctx_manager"],
            llm_server=server,
            seed=seed,
            loop=loop,
            val_loop=val_loop,
            es=es,
            cluster=ClusterConfig(
                dask_scheduler_address=sections["dask"].scheduler_address or None,
                dask_n_workers=sections["dask"].n_workers,
                ray_address=sections["ray"].address or None,
                advertise_host=server.advertise_host or None,
            ),
        )


class LLMAgentProxy:
    def __init__(self, setup: AgentSetup, engine: Engine) -> None:
        self.setup = setup
        self.engine = engine
        ap = setup.agent_proxy
        self._semaphore = threading.BoundedSemaphore(ap.max_concurrent_rollouts)
        logger.info("[Concurrency] Set max concurrent rollouts to %d", ap.max_concurrent_rollouts)
        self.shared: SharedLLMInferenceManager | None = None
        self.parallel: ParallelRolloutManager | None = None
        self._kept_envs = KeptEnvs()
        self._lock = threading.Lock()  # the engine lock of the sequential path
        self._rollouts_running = 0  # the engine's per-episode caches are freed when none is
        self._running_lock = threading.Lock()
        if ap.use_parallel_rollout or ap.rollout_mode == "fully_async":
            self.shared = SharedLLMInferenceManager(
                engine, max_batch_size=ap.max_batch_size, coalesce_wait_s=ap.coalesce_wait_s,
                host=setup.llm_server.host, port=setup.llm_server.port, max_message_bytes=ap.max_message_bytes,
            )
            self._lock = self.shared.engine_lock
        if ap.use_parallel_rollout:
            self.parallel = ParallelRolloutManager(
                self.shared, n_jobs=ap.parallel_n_jobs, backend=ap.parallel_backend,
                max_env_num_per_worker=ap.max_env_num_per_worker,
                fallback_to_sequential=ap.fallback_to_sequential,
                rollout_timeout_s=ap.rollout_timeout_s or None,
                engine_timeout_s=ap.engine_timeout_s or None,
                cluster=setup.cluster,
            )
        self._ahead: RolloutAhead | None = None
        self._groups_in_flight: GroupsInFlight | None = None
        self._async_counts: dict[str, Any] = {"dropped_stale": 0, "tokens_dropped": 0, "staleness": []}
        # What exists now (modules, the model, the engine, the workers' handles) lives about as
        # long as the proxy: out of the collector's sight (until close), a full collection no
        # longer walks it. Those walks, set off by the objects rollouts create (trajectories,
        # unpickled from the workers), stalled one rollout in two or three by 10-80 ms (the
        # overhead and mixed presets: mean wall 33.5 -> 27.9 ms and 519 -> 504 ms sequentially).
        gc.collect()
        gc.freeze()

    # ----- training batches (sync, generate-ahead, fully async) -----------------
    def next_train_batch(self, policy_version: int) -> RolloutResult:
        """The next training batch under the configured mode: a synchronous
        rollout (``async_generation_ratio: 0``), one generated ahead in the
        background (``k > 0``; never more than ``k`` versions old), or
        ``env_groups`` groups from the fully-async groups in flight."""
        ap = self.setup.agent_proxy
        if ap.rollout_mode == "fully_async":
            return self._fully_async_batch(policy_version)
        if ap.async_generation_ratio == 0:
            return self.rollout("train")
        if self._ahead is None:
            self._ahead = RolloutAhead(lambda: self.rollout("train"), ap.async_generation_ratio)
        return self._ahead.get(policy_version)

    def _fully_async_batch(self, policy_version: int) -> RolloutResult:
        es = self.setup.es["train"]
        ap = self.setup.agent_proxy
        bound = max(1, ap.async_generation_ratio)
        if self._groups_in_flight is None:
            self._groups_in_flight = GroupsInFlight(
                es, self.shared.client(timeout_s=ap.engine_timeout_s or None), self.setup.loop,
                max_inflight_groups=ap.max_inflight_groups,
                n_jobs=-1 if ap.parallel_n_jobs == "auto" else ap.parallel_n_jobs,
                backend="threading" if ap.parallel_backend == "threading" else "loky",
                max_version_span=bound, partial_rollout=ap.partial_rollout,
                # `bound` batches drawn ahead of the trainer: a group drawn while it trains on version v
                # is taken, in order, at version v + bound at the latest
                ahead_groups=bound * es.env_groups)
        t0 = time.perf_counter()
        groups = []
        # coarse: envs of the groups taken for this batch, as they come (no turns: the
        # groups in flight belong to no one batch)
        with RolloutProgress(es.num_envs, "train (fully async)") as progress:
            while len(groups) < es.env_groups:
                for index, trajs in self._groups_in_flight.get_batch(es.env_groups - len(groups)):
                    lag = staleness(trajs, policy_version)
                    # a partial group's turns each carry their version (and log-probs): it is trained on
                    # whole; a restarting one older than the bound is dropped
                    if lag > bound and not ap.partial_rollout:
                        self._async_counts["dropped_stale"] += 1
                        self._async_counts["tokens_dropped"] += response_tokens(trajs)
                        continue
                    self._async_counts["staleness"].append(lag)
                    groups.append((index, trajs))
                    progress.envs_finished(len(trajs))
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
            m.update({f"async/{k}" if k.startswith("tokens") else f"async/groups_{k}": float(v)
                      for k, v in self._groups_in_flight.counts.items()})
            m["async/dropped_stale"] = m.get("async/dropped_stale", 0.0) + self._async_counts["dropped_stale"]
            m["async/tokens_dropped"] = float(self._async_counts["tokens_dropped"])
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
                rollout_index: int | None = None, progress: RolloutProgress | None = None) -> RolloutResult:
        """The next rollout of ``split`` (or the one numbered ``rollout_index``:
        same index, same seeds). ``progress``: the one to tell (the rollout
        closes it); by default a bar on a terminal, log lines elsewhere."""
        if split not in self.setup.es:
            raise ValueError(f"unknown split {split!r}; choose 'train' or 'val'")
        specs = self.setup.es[split].make_specs(rollout_index)
        config = self.setup.loop if split == "train" else self.setup.val_loop
        with self._semaphore:  # the bar's clock starts once the rollout may run
            with self._running_lock:
                self._rollouts_running += 1
            try:
                # the engine's counts over this rollout (rollouts at once, or generating ahead, add theirs)
                before = _engine_counts(self.engine)
                with progress if progress is not None else RolloutProgress(len(specs), split) as progress:
                    if self.parallel is not None:
                        result = self.parallel.rollout(specs, config, fault=fault, progress=progress)
                    else:
                        result = self._sequential(specs, config, progress)
                prefilled, reused, evicted = (b - a for a, b in zip(before, _engine_counts(self.engine)))
                # the memory kept for next turns at the rollout's end, and the episodes let go to stay in bound
                turn_cache = getattr(self.engine, "turn_cache", None)
                cache_mb = turn_cache.bytes / 2**20 if turn_cache is not None else None
            finally:
                with self._running_lock:
                    self._rollouts_running -= 1
                    # every episode of this rollout has ended: unless another rollout or the
                    # fully-async groups still run episodes, nothing the engine keeps is needed
                    if self._rollouts_running == 0 and self._groups_in_flight is None:
                        self.engine.release_cache()
        m = result.metrics
        if prefilled or reused:
            m.update({"engine/prefill_tokens": float(prefilled), "engine/reused_tokens": float(reused),
                      "engine/prefix_reuse": reused / (prefilled + reused)})
        if cache_mb is not None:
            m.update({"engine/turn_cache_mb": cache_mb, "engine/turn_cache_evicted": float(evicted)})
        logger.info(
            "[Rollout] %s: %d envs in %.2f s | engine %.2f s, %d calls, mean batch %.1f%s | env %.2f s | "
            "waiting for the model %.2f s | fallbacks %d | success %.3f",
            split, len(specs), m.get("timing/rollout_s", 0.0), m.get("timing/engine_s", 0.0),
            int(m.get("engine/calls", 0)), m.get("engine/mean_batch_size", 0.0),
            f", prompt tokens {m['engine/prefix_reuse']:.0%} reused" if "engine/prefix_reuse" in m else "",
            m.get("timing/env_s", 0.0), m.get("timing/wait_llm_s", 0.0), int(m.get("parallel/fallbacks", 0)),
            m.get("rollout/success", 0.0))
        for f in result.failed_envs:
            logger.warning("[Rollout] %s: env_id %d (tag %s, seed %d) ended in %s at turn %d: %s | check it alone: "
                           "python -m ragen.tools.check %s --first-seed %d", split, f["env_id"], f["tag"], f["seed"],
                           f["stop_reason"], f["turn"], f["error"], f["tag"], f["seed"])
        return result

    def _sequential(self, specs, config: LoopConfig, progress: RolloutProgress | None = None) -> RolloutResult:
        t0 = time.perf_counter()
        client = _LockedClient(self.engine, self._lock, progress)
        # one stream: one engine call per turn over all active envs
        trajectories, stats = run_envs(specs, client, LoopConfig(**{**config.__dict__, "pipeline_depth": 1}),
                                       kept_envs=self._kept_envs, isolate_errors=True,
                                       on_finished=progress.envs_finished if progress is not None else None)
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
        gc.unfreeze()  # what was frozen at the start is the collector's again (a cycle of it may be garbage now)

    def __enter__(self) -> "LLMAgentProxy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _engine_counts(engine: Engine) -> tuple[int, int, int]:
    """The engine's prompt tokens computed and reused so far, and the episodes its turn cache
    evicted (0 for what an engine does not count)."""
    turn_cache = getattr(engine, "turn_cache", None)
    return (getattr(engine, "tokens_prefilled", 0), getattr(engine, "tokens_reused", 0),
            turn_cache.evicted if turn_cache is not None else 0)


class _LockedClient(DirectClient):
    """The sequential rollout's client: engine calls under the engine lock,
    each one told to the rollout's progress."""

    def __init__(self, engine: Engine, lock: threading.Lock, progress: RolloutProgress | None = None) -> None:
        super().__init__(engine)
        self._engine_lock = lock
        self._progress = progress

    def wait_any(self):
        if self._progress is not None and self._queue:
            self._progress.engine_batch(len(self._queue[0][1]))  # the call about to run
        with self._engine_lock:
            ticket, completions = super().wait_any()
        if self._progress is not None:
            self._progress.answered(len(completions))
        return ticket, completions
