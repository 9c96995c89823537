"""AgentTrainer: the RL loop around the rollout engine.

One step rolls out (``LLMAgentProxy``: synchronous, generated ahead or fully async), makes the batch
of the kept groups with their advantages (``ragen.trainer.samples``), updates the policy
(``PPOActor``) and makes the engine answer with the new weights (``ragen.trainer.policy``, policy
version + 1). Around it: validation on the ``val`` env set (``val_before_train``, ``test_freq``),
rollout dumps (``trainer.rollout_data_dir``), checkpoints and resume in the run folder
(``ragen.trainer.checkpoint``; on resume the metrics log is cut back to the checkpoint's step). Every
trainer and rollout key, the batch sizes against the train env count, the engine kind,
``model_path`` and the run folder are checked before any model loads.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ragen.agents.config import AgentConfig
from ragen.allocator import give_back
from ragen.env import make_env_config
from ragen.errors import RagenError
from ragen.llm.chat_tokens import ChatTokens
from ragen.llm.default_model import resolve_model_path
from ragen.llm.replicas import ReplicaSet
from ragen.rollout.proxy import LLMAgentProxy
from ragen.rollout.backends.ahead import staleness
from ragen.rollout.context import ContextManager
from ragen.rollout.dump import dump_name, write_dump
from ragen.rollout.types import RolloutResult
from ragen.trainer import checkpoint as ckpt
from ragen.trainer.actor import PPOActor, adapter_off_reference, frozen_copy_reference
from ragen.trainer.core import Sample
from ragen.trainer.memory import StepMemory
from ragen.trainer.policy import apply_lora, load_trainable_state, merged_weights, trainable_state, transformers_copy
from ragen.trainer.samples import make_samples, rename_rollout_metrics
from ragen.trainer.startup import CheckedRun, check_run
from ragen.trainer.tracking import CURVE_FILE, METRICS_FILE, Tracking, plot_learning_curve, summary_line, \
    truncate_metrics
from ragen.viewer.curve import curve_notes

logger = logging.getLogger(__name__)


class TrainingFailed(RagenError, RuntimeError):
    """The run learned nothing: ``trainer.max_failed_steps`` steps in a row failed, or it ended
    without one update. train.py says why in one line and exits 1."""


def step_failure(metrics: Mapping[str, float], failed_envs: list[dict[str, Any]]) -> str | None:
    """Why a training step failed, or None: no optimizer step happened, or more than half of the
    train rollout's envs ended in error or timeout (the first one named)."""
    n = metrics.get("train/n_trajectories", 0.0)
    failed = metrics.get("train/stop/error", 0.0) + metrics.get("train/stop/timeout", 0.0)
    if n and failed > n / 2:
        first = failed_envs[0] if failed_envs else None
        example = (f"; the first: tag {first['tag']}, seed {first['seed']}: {first['error']}" if first else "")
        return f"{failed:.0f} of {n:.0f} envs of the train rollout ended in error or timeout{example}"
    if not metrics.get("actor/n_optimizer_steps", 0.0):
        return "no update (no group of the batch had a sample to train: see the warnings above)"
    return None


class AgentTrainer:
    """See the module docstring. Build with ``AgentTrainer(cfg)``; run with ``fit()``."""

    def __init__(self, cfg: Mapping[str, Any] | CheckedRun, engine: Any = None,
                 console: Callable[[str], None] | None = None) -> None:
        # ---- start-up checks (cfg may be check_run's record of them): no model is loaded before all pass
        checked = cfg if isinstance(cfg, CheckedRun) else check_run(cfg, engine)
        plain = checked.plain
        self.config = checked.config
        self.setup = checked.setup
        self.memory = StepMemory()
        self.engine_name = checked.engine_name
        self.correction = checked.correction
        self.model_path = checked.model_path
        self.run_dir = Path(self.config.run.default_local_dir).expanduser().resolve()
        resume_step = self._check_run_dir()

        # ---- build: engine (loads the model), trainable policy, proxy
        torch.manual_seed(self.config.seed)  # LoRA's initialization draws from the global generator
        self._owns_engine = engine is None
        if engine is None:
            from ragen.llm import make_engine

            engine = make_engine(checked.engine_cfg, self.model_path)
        self.engine = engine
        self.proxy = None
        try:
            self._build(plain, resume_step, console)
        except BaseException:
            if self.proxy is not None:
                self.proxy.close()
            if self._owns_engine:
                engine.close()
            raise

    def _build(self, plain: Mapping[str, Any], resume_step: int | None,
               console: Callable[[str], None] | None) -> None:
        engine = self.engine
        self.model, self.tokenizer = self._policy_model(engine)
        self.peft_model = None
        if self.config.use_lora:
            self.peft_model = apply_lora(self.model, self.config.model)
        self.policy = self.peft_model if self.peft_model is not None else self.model
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        sampling = self.setup.loop.sampling
        # log-probs are scored at the temperature the rollout sampled with (greedy: the model's own)
        temperature = 1.0 if sampling.greedy else float(sampling.temperature)
        reference = None
        if self.config.actor.use_kl_loss:
            reference = (adapter_off_reference(self.peft_model, pad, self.config, temperature)
                         if self.peft_model is not None
                         else frozen_copy_reference(self.model, pad, self.config, temperature))
        self.proxy = LLMAgentProxy(self.setup, engine)
        shares_weights = self.engine_name == "hf"
        self.actor = PPOActor(self.policy, self.config, pad, reference=reference,
                              weights_lock=(lambda: self.proxy.engine_lock) if shares_weights else None,
                              temperature=temperature, correction=self.correction)
        self.ctx = ContextManager(self.setup.loop.context)
        # the template and tokenizer the engine built prompts with (a vLLM engine's are the same files)
        self.chat = engine.chat if self.engine_name == "hf" else ChatTokens.of(self.tokenizer, self.model)
        self.global_step = 0
        self.curve_path: Path | None = None  # the learning curve fit() drew, if it could
        logger.info("trainable parameters: %d (%s); off-policy correction: %s%s", self.actor.num_trainable,
                    f"LoRA rank {self.config.model.lora_rank}" if self.config.use_lora else "full fine-tuning",
                    self.correction, f" (cap {self.config.actor.tis_cap:g})" if self.correction != "none" else "")
        if resume_step is not None:
            self._load(resume_step)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._marked_latest = False  # `latest` points here once the run has written a step
        self._save_config(plain)
        self.tracking = Tracking(self.run_dir, self.config.loggers, self.config.run.project_name,
                                 self.config.run.experiment_name, config=plain, console=console)

    # ------------------------------------------------------------ construction helpers

    def _check_run_dir(self) -> int | None:
        """The checkpoint step to resume from, or None for a fresh run."""
        existing = ckpt.list_checkpoints(self.run_dir)
        if self.config.run.resume:
            step = ckpt.latest_checkpoint(self.run_dir)
            if step is not None:
                return step
            latest = self.run_dir.parent / ckpt.LATEST_RUN
            if not self.run_dir.exists() and latest.is_dir() and ckpt.latest_checkpoint(latest) is not None:
                # a fresh run folder (the default, one per run): resume means the newest run
                self.run_dir = latest.resolve()
                logger.info("trainer.resume: continuing the newest run of %s, %s", latest.parent, self.run_dir)
                return ckpt.latest_checkpoint(self.run_dir)
            logger.warning("trainer.resume is true but %s holds no checkpoint: starting from step 0 (to continue "
                           "an earlier run, name its folder: trainer.default_local_dir=%s)", self.run_dir,
                           latest if latest.is_dir() else "<its run folder>")
        elif existing:
            raise ValueError(
                f"trainer.default_local_dir={str(self.run_dir)!r} already holds checkpoints (steps {existing}); "
                "set trainer.resume=true to continue that run, or name another trainer.default_local_dir "
                "(config/trainer_defaults.yaml's default is a fresh folder per run)"
            )
        stale = self.run_dir / METRICS_FILE
        if stale.is_file():
            logger.warning("%s is from a run that saved no checkpoint; starting it afresh", stale)
            stale.unlink()
        return None

    def _policy_model(self, engine: Any) -> tuple[Any, Any]:
        if self.engine_name == "hf":
            return engine.model, engine.tokenizer
        # vllm: the engine's weights live in its own runtime; train a transformers copy and push weights.
        return transformers_copy(self.model_path or resolve_model_path(getattr(engine, "model_path", "default")))

    def _save_config(self, plain: Mapping[str, Any]) -> None:
        try:
            from omegaconf import OmegaConf

            # the config as read (not resolved again: the run folder's time stamp would be read afresh)
            OmegaConf.save(OmegaConf.create(plain), self.run_dir / "config.yaml")
        except Exception:  # a record for people; the run does not depend on it
            logger.debug("could not write config.yaml", exc_info=True)

    # ------------------------------------------------------------ the loop

    def fit(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, float]:
        """Train to ``total_training_steps``; return the last step's metrics."""
        cfg = self.config.run
        last: dict[str, float] = {}
        self._first_step, self._failed_envs = self.global_step, []
        if cfg.val_before_train and self.global_step == 0:
            t0 = time.perf_counter()
            last = {**self.validate(step=0), "timing/val_s": time.perf_counter() - t0,
                    "policy_version": self.engine.policy_version}
            self.tracking.log(last, step=0)
            self.tracking.summary("baseline " + summary_line({"step": 0, **last}, cfg.total_training_steps))
        failed_in_a_row, updated = 0, False
        for step in range(self.global_step + 1, cfg.total_training_steps + 1):
            t0 = time.perf_counter()
            metrics = self.train_step(step)
            why = step_failure(metrics, self._failed_envs)
            updated = updated or bool(metrics.get("actor/n_optimizer_steps", 0.0))
            failed_in_a_row = failed_in_a_row + 1 if why else 0
            if why:
                logger.warning("step %d failed (%d in a row; the run stops at trainer.max_failed_steps=%d): %s",
                               step, failed_in_a_row, cfg.max_failed_steps, why)
            if failed_in_a_row >= cfg.max_failed_steps:
                self._log_step({**metrics, "step": step}, step)
                raise TrainingFailed(f"{failed_in_a_row} steps in a row failed (trainer.max_failed_steps="
                                     f"{cfg.max_failed_steps}); step {step}: {why}")
            if cfg.test_freq > 0 and (step % cfg.test_freq == 0 or step == cfg.total_training_steps):
                tv = time.perf_counter()
                metrics.update(self.validate(step))
                metrics["timing/val_s"] = time.perf_counter() - tv
            metrics["timing/step_s"] = time.perf_counter() - t0
            metrics["step"] = step
            self.global_step = step
            self._log_step(metrics, step)
            self.tracking.summary(summary_line(metrics, cfg.total_training_steps))
            if (cfg.save_freq > 0 and step % cfg.save_freq == 0) or step == cfg.total_training_steps:
                self.save()
            if on_step is not None:
                on_step(step, metrics)
            last = metrics
        self.curve_path = self.plot()
        if not updated and cfg.total_training_steps > self._first_step:
            raise TrainingFailed(f"no update happened in steps {self._first_step + 1}-{cfg.total_training_steps}: "
                                 f"{step_failure(last, self._failed_envs) or 'see the warnings above'}")
        return last

    def _log_step(self, metrics: dict[str, float], step: int) -> None:
        self.tracking.log(metrics, step=step)
        self._wrote_a_step()

    def _wrote_a_step(self) -> None:
        """The run wrote a step (its metrics or a checkpoint): the first time, ``latest`` points at
        its folder, so that ``latest`` is the newest run with a step (one killed before has none)."""
        if not self._marked_latest:
            ckpt.mark_latest_run(self.run_dir)
            self._marked_latest = True

    def train_step(self, step: int) -> dict[str, float]:
        version = self.engine.policy_version
        give_back()  # what validation freed stays out of this step's peak
        self.memory.start()
        t0 = time.perf_counter()
        # synchronous, generated ahead (async_generation_ratio) or fully async, as configured
        result = self.proxy.next_train_batch(version)
        self._failed_envs = result.failed_envs
        rollout_s = time.perf_counter() - t0
        metrics = rename_rollout_metrics(result.metrics, "train")
        metrics["timing/rollout_s"] = rollout_s
        metrics.update(self.proxy.async_metrics())
        metrics.update(self._dump(result, "train", step))
        lag = staleness(result.trajectories, version)
        metrics["train/policy_lag"] = float(lag)
        setup = self.proxy.setup
        if lag and setup.agent_proxy.plan.ahead == "none":
            logger.warning("step %d: the rollout was answered by policy version %d, %d behind the trainer's %d",
                           step, version - lag, lag, version)
        t1 = time.perf_counter()
        samples, batch_metrics = self.make_samples(result)
        metrics.update(batch_metrics)
        if samples:  # how many versions behind the trainer each sample's oldest answer is
            lags = [version - s.policy_version for s in samples]
            metrics["off_policy/version_lag_mean"] = sum(lags) / len(lags)
            metrics["off_policy/version_lag_max"] = float(max(lags))
        give_back()  # the rollout's caches, freed at its end, before the update's activations
        t2 = time.perf_counter()
        metrics.update(self.actor.update(samples, step))
        t3 = time.perf_counter()
        self.sync_weights()
        t4 = time.perf_counter()
        # the update's parts: the samples and their advantages, the actor's update (its old-policy and
        # reference log-probs included), the weight push
        metrics["timing/samples_s"], metrics["timing/actor_s"], metrics["timing/sync_weights_s"] = \
            t2 - t1, t3 - t2, t4 - t3
        metrics["timing/update_s"] = t4 - t1
        metrics["policy_version"] = self.engine.policy_version
        metrics.update(self.memory.metrics())
        return metrics

    def validate(self, step: int | None = None) -> dict[str, float]:
        """A validation rollout; ``step`` names its dump (``val_step_<step>``) when rollouts are dumped."""
        with self.proxy.generation_paused():  # background generation waits while we evaluate
            result = self.proxy.rollout("val")
        metrics = rename_rollout_metrics(result.metrics, "val")
        metrics.update(self._dump(result, "val", self.global_step if step is None else step))
        return metrics

    def _dump(self, result: RolloutResult, split: str, step: int) -> dict[str, float]:
        """Write the rollout to ``trainer.rollout_data_dir`` (when set), in this (the driver's) process."""
        directory = self.config.run.rollout_data_dir
        if not directory:
            return {}
        t0 = time.perf_counter()
        loop = self.setup.loop if split == "train" else self.setup.val_loop
        path = write_dump(directory, dump_name(split, step), result, loop, split=split, step=step)
        logger.debug("dumped the %s rollout of step %d to %s", split, step, path)
        return {f"timing/dump_{split}_s": time.perf_counter() - t0}

    # ------------------------------------------------------------ batch

    def make_samples(self, result: RolloutResult) -> tuple[list[Sample], dict[str, float]]:
        """Training samples of the kept groups, with their advantages, and batch metrics."""
        return make_samples(result, self.ctx, self.chat, self.config, self.setup.loop.context)

    # ------------------------------------------------------------ weights

    def sync_weights(self) -> int:
        """Make the engine answer with the new weights; return the new policy version."""
        if self.engine_name == "hf":
            # The engine holds these very tensors: the optimizer stepped under its lock.
            if isinstance(self.engine, ReplicaSet):  # the primary does; the other replicas copy them
                with self.proxy.engine_lock:
                    return self.engine.load_weights(self._merged_weights(), skip_primary=True)
            return self.engine.bump_policy_version()
        before = self.engine.policy_version
        with self.proxy.engine_lock:
            self.engine.load_weights(self._merged_weights())
        if self.engine.policy_version == before:
            self.engine.bump_policy_version()
        return self.engine.policy_version

    def _merged_weights(self) -> list[tuple[str, torch.Tensor]]:
        return merged_weights(self.model, self.peft_model)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores of the model: all of it, or the LoRA adapter's tensors."""
        return trainable_state(self.model, self.peft_model)

    # ------------------------------------------------------------ checkpoints

    def save(self) -> Path:
        state = {
            "step": self.global_step,
            "policy_version": self.engine.policy_version,
            "model": self.trainable_state(),
            "lora": self.peft_model is not None,
            "optimizer": self.actor.optimizer.state_dict(),
            "rng": ckpt.rng_state(),
            "es_manager": {split: es.state_dict() for split, es in self.setup.es.items()},
            # the groups an over-sampled rollout carries to the next
            "over_sample": self.proxy.over_sample.state_dict() if self.proxy.over_sample is not None else None,
        }
        meta = {"policy_version": self.engine.policy_version, "lora_rank": self.config.model.lora_rank,
                "experiment_name": self.config.run.experiment_name}
        path = ckpt.save_checkpoint(self.run_dir, self.global_step, state, meta,
                                    peft_model=self.peft_model, max_to_keep=self.config.run.max_actor_ckpt_to_keep)
        self._wrote_a_step()
        return path

    def _load(self, step: int) -> None:
        rank = ckpt.load_meta(self.run_dir, step).get("lora_rank")
        if rank is not None and rank != self.config.model.lora_rank:
            raise ValueError(
                f"the checkpoint of step {step} in {self.run_dir} was written with actor_rollout_ref.model.lora_rank="
                f"{rank}, this run has actor_rollout_ref.model.lora_rank={self.config.model.lora_rank}: set it to "
                f"{rank} to resume, or start a new run (in a fresh run folder, without trainer.resume)"
            )
        state = ckpt.load_checkpoint(self.run_dir, step)
        if bool(state.get("lora")) != (self.peft_model is not None):
            raise ValueError(
                f"the checkpoint of step {step} in {self.run_dir} was written "
                f"{'with' if state.get('lora') else 'without'} LoRA; actor_rollout_ref.model.lora_rank must match"
            )
        with self.proxy.engine_lock:
            load_trainable_state(self.model, self.peft_model, state["model"])
        self.actor.optimizer.load_state_dict(state["optimizer"])
        for split, es_state in state["es_manager"].items():
            self.setup.es[split].load_state_dict(es_state)
        carried = state.get("over_sample")
        if carried is not None and self.proxy.over_sample is not None:
            try:
                self.proxy.over_sample.load_state_dict(carried, self.setup.es["train"])
            except ValueError as exc:  # a damaged entry, named
                raise ckpt.damaged(self.run_dir, step, str(exc)) from None
        elif isinstance(carried, dict) and carried.get("carried"):
            logger.warning("the checkpoint of step %d holds %d groups an over-sampled rollout carried; this run does "
                           "not over-sample (agent_proxy.over_sample=1.0): they are left out", step,
                           len(carried["carried"]))
        ckpt.set_rng_state(state["rng"])
        self.global_step = int(state["step"])
        if self.engine_name == "hf":
            if isinstance(self.engine, ReplicaSet):
                self.engine.load_weights(self._merged_weights(), skip_primary=True)
            self.engine.policy_version = int(state["policy_version"])
        else:
            self.engine.load_weights(self._merged_weights())
            self.engine.policy_version = int(state["policy_version"])
        dropped = truncate_metrics(self.run_dir / METRICS_FILE, self.global_step)
        logger.info("resumed from the checkpoint of step %d (policy version %d)%s", self.global_step,
                    self.engine.policy_version, f"; dropped {dropped} later metric rows" if dropped else "")

    # ------------------------------------------------------------ end

    def plot(self) -> Path | None:
        """Draw ``learning_curve.png``; return its path, or None where it was not drawn (the log says why)."""
        try:
            path = plot_learning_curve(self.run_dir / METRICS_FILE, self.run_dir / CURVE_FILE,
                                       title=f"{self.config.run.project_name}/{self.config.run.experiment_name}",
                                       notes=curve_notes(self._env_configs()))
        except ModuleNotFoundError as exc:  # matplotlib (or a module it needs) is not installed
            logger.warning("no learning curve drawn: %s; install it to draw %s", exc, CURVE_FILE)
            return None
        except Exception:  # a missing plot must not fail a finished run
            logger.exception("could not draw the learning curve")
            return None
        logger.info("learning curve: %s", path)
        return path

    def _env_configs(self) -> list[Any]:
        """One env config per train and val tag: what the learning curve's notes read."""
        configs: dict[str, Any] = {}
        for maker in self.setup.es.values():
            for spec in maker.make_specs(0):
                if spec.tag in configs:
                    continue
                configs[spec.tag] = AgentConfig.read(spec.tag, spec.env_config) if spec.is_agent else \
                    make_env_config(spec.env_type, spec.env_config, spec.config_type, spec.tag)
        return list(configs.values())

    def close(self) -> None:
        self.proxy.close()
        self.tracking.close()
        if self._owns_engine:  # an engine handed in belongs to the caller
            self.engine.close()

    def __enter__(self) -> "AgentTrainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
