"""TrainerConfig: the training keys of the Hydra config, read and checked at start-up.

RAGEN's (verl's) key names, from ``config/trainer_defaults.yaml``:

- ``trainer.*``: the run (steps, validation and checkpoint cadence, run dir,
  resume, loggers);
- ``actor_rollout_ref.actor.*``: the PPO update (mini/micro batches, epochs,
  clip range, gradient clipping, entropy bonus, KL to a reference, off-policy
  correction, optimizer);
- ``actor_rollout_ref.model.*``: LoRA (``lora_rank > 0``) or full fine-tuning;
- ``actor_rollout_ref.rollout.*``: group filtering and the longest training
  sequence;
- ``algorithm.*``: the advantage estimator.

Each section is a typed dataclass here (``TrainerSection``,
``ActorRolloutRefSection``, ``AlgorithmSection``), read by
``ragen.config_reader.read``: unknown keys, wrong types and out-of-range
numbers are errors naming the key. Their defaults are the keys' defaults;
``config/trainer_defaults.yaml`` sets the default job's values (and
``tests/test_config_reader.py`` lists where they differ, and why).
``TrainerConfig.from_config(cfg)`` reads them once at start-up into one
``TrainerConfig`` that holds each section whole (``run``, ``actor``,
``model``, ``rollout``, ``algorithm``), passed as it is to the trainer and the
actor; only the values derived from several keys are properties (the
loggers, the seed, ``use_lora``; the clip range on ``ActorSection``). It touches no model;
``check_against(train_batch_size, engine_name)`` checks the keys that depend
on the rollout config.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Mapping

from ragen.allocator import CHOICES as ALLOCATORS
from ragen.config_reader import check_keys, read, setting, to_plain
from ragen.errors import ConfigError
from ragen.llm.transformers_compat import checkpointable_layer
from ragen.rollout.config import ROLLOUT_SECTIONS, SeedConfig

# The choices of the keys, here rather than beside the code that acts on them (ragen.trainer.core,
# .logprobs, .precision), so that the config is read and checked without importing torch.
ADV_ESTIMATORS = ("grpo", "reinforce")
CORRECTIONS = ("none", "tis", "decoupled")
KL_TYPES = ("low_var_kl", "kl", "mse")
AUTOCAST_CHOICES = ("none", "bf16")
# Loss positions whose logits are made at once: a chunk's full-vocabulary logits in float32
# (positions x vocabulary x 4 bytes: 50 MB at 256 x 49,152) are the largest tensor of the update.
DEFAULT_CHUNK_SIZE = 256

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")
TRAINABLE_ENGINES = ("hf", "vllm")


@dataclass(frozen=True)
class TrainerSection:
    """``trainer.*``: the run."""

    default_local_dir: str = setting()  # the run folder (trainer_defaults.yaml: a fresh one per run)
    project_name: str = "ragen"
    experiment_name: str = "default"
    total_training_steps: int = setting(20, minimum=1)
    test_freq: int = 5  # <= 0: no periodic validation (the last step is still validated)
    save_freq: int = 10  # <= 0: only the last step is saved
    val_before_train: bool = True
    resume: bool = False  # continue from the latest checkpoint in default_local_dir (a fresh one: the newest run's)
    logger: str | list[str] = setting(default_factory=lambda: ["console", "jsonl"])
    max_actor_ckpt_to_keep: int | None = setting(None, minimum=1)
    seed: int | None = None  # None: seed.train
    allocator: str = setting("auto", choices=ALLOCATORS)  # train.py's malloc (ragen.allocator)
    rollout_data_dir: str | None = None  # verl's key: dump every rollout here (ragen.rollout.dump); None: off
    # steps in a row that failed (no update, or most of the train rollout's envs in error or timeout) before
    # the run stops and train.py exits 1; a run that ends without one update exits 1 too
    max_failed_steps: int = setting(3, minimum=1)

    def __post_init__(self) -> None:
        if not self.default_local_dir or self.default_local_dir == "None":
            raise ConfigError("trainer.default_local_dir must name the run folder")
        names = [self.logger] if isinstance(self.logger, str) else self.logger
        for name in names:
            if name not in LOGGERS:
                raise ConfigError(f"trainer.logger: unknown logger {name!r}; choose from {LOGGERS}")
        for name, module in (("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")):
            if name in names and not _importable(module):
                raise ConfigError(f"trainer.logger asks for {name!r} but {module} is not installed; "
                                  f"install it or remove {name!r} from trainer.logger")


@dataclass(frozen=True)
class OptimSection:
    """``actor_rollout_ref.actor.optim.*``: the AdamW optimizer."""

    lr: float = setting(1e-5, minimum=0.0)
    weight_decay: float = setting(0.01, minimum=0.0)
    betas: tuple[float, float] = (0.9, 0.999)

    def __post_init__(self) -> None:
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"actor_rollout_ref.actor.optim.betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.lr == 0.0:
            raise ConfigError("actor_rollout_ref.actor.optim.lr is 0: nothing would be trained")


@dataclass(frozen=True)
class ActorSection:
    """``actor_rollout_ref.actor.*``: the PPO update."""

    ppo_mini_batch_size: int = setting(32, minimum=1)
    ppo_micro_batch_size_per_gpu: int = setting(8, minimum=1)
    ppo_epochs: int = setting(1, minimum=1)
    clip_ratio: float = setting(0.2, minimum=0.0)
    clip_ratio_low: float | None = setting(None, minimum=0.0)  # None: clip_ratio
    clip_ratio_high: float | None = setting(None, minimum=0.0)  # None: clip_ratio
    grad_clip: float = setting(1.0, minimum=0.0)
    entropy_coeff: float = 0.0
    logprob_chunk_size: int = setting(DEFAULT_CHUNK_SIZE, minimum=1)  # loss positions whose logits are made at once
    autocast: str = setting("none", choices=AUTOCAST_CHOICES)  # the decoder's compute dtype (ragen.trainer.precision)
    use_kl_loss: bool = False
    kl_loss_coef: float = setting(0.001, minimum=0.0)
    kl_loss_type: str = setting("low_var_kl", choices=KL_TYPES)
    loss_agg_mode: str = setting("token-mean", choices=LOSS_AGG_MODES)
    shuffle: bool = True
    # none | tis | decoupled (ragen.trainer.core.importance_weights); None: tis when the
    # engine returns log-probs, else none
    off_policy_correction: str | None = setting(None, choices=CORRECTIONS)
    tis_cap: float = setting(2.0, minimum=1.0)  # C: the largest importance weight (tis), or the last kept (decoupled)
    optim: OptimSection = field(default_factory=OptimSection)

    def correction(self, engine_returns_logprobs: bool) -> str:
        """The off-policy correction in force with an engine that does (not) return log-probs."""
        if self.off_policy_correction is None:
            return "tis" if engine_returns_logprobs else "none"
        return self.off_policy_correction

    @property
    def clip_range(self) -> tuple[float, float]:
        """(low, high): clip_ratio_low / clip_ratio_high, each clip_ratio when unset."""
        return (self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low,
                self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high)

    def __post_init__(self) -> None:
        a = "actor_rollout_ref.actor"
        low = self.clip_range[0]
        if low >= 1.0:
            raise ConfigError(f"{a}.clip_ratio_low (or clip_ratio) must be < 1, got {low}")
        if self.ppo_micro_batch_size_per_gpu > self.ppo_mini_batch_size:
            raise ConfigError(
                f"{a}.ppo_micro_batch_size_per_gpu ({self.ppo_micro_batch_size_per_gpu}) is larger than "
                f"{a}.ppo_mini_batch_size ({self.ppo_mini_batch_size}); make it <= the mini-batch"
            )


@dataclass(frozen=True)
class ModelSection:
    """``actor_rollout_ref.model.*``: LoRA (``lora_rank > 0``) or full fine-tuning."""

    lora_rank: int = setting(0, minimum=0)
    lora_alpha: float = setting(16.0, minimum=0.0)
    target_modules: str | list[str] = "all-linear"
    share_prefix: bool = True
    # true: each decoder layer keeps only its input for the backward pass and runs again there; auto: for
    # mini-batches whose micro-batches hold AUTO_CHECKPOINT_TOKENS tokens or more, where the model can
    enable_gradient_checkpointing: bool | str = setting("auto", choices=("auto",))

    def __post_init__(self) -> None:
        if self.enable_gradient_checkpointing not in (True, False, "auto"):
            raise ConfigError("actor_rollout_ref.model.enable_gradient_checkpointing must be true, false or auto, "
                              f"got {self.enable_gradient_checkpointing!r}")
        if self.enable_gradient_checkpointing is True:
            checkpointable_layer()
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ConfigError("actor_rollout_ref.model.target_modules must be 'all-linear' or a list of module "
                              "names, got []")


@dataclass(frozen=True)
class RolloutSection:
    """``actor_rollout_ref.rollout.*``: group filtering and the longest training sequence."""

    rollout_filter_ratio: float = setting(1.0, above=0.0, maximum=1.0)
    max_model_len: int | None = setting(None, minimum=2)


@dataclass(frozen=True)
class ActorRolloutRefSection:
    """``actor_rollout_ref.*``: the model, actor and rollout sections."""

    model: ModelSection = field(default_factory=ModelSection)
    actor: ActorSection = field(default_factory=ActorSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)


@dataclass(frozen=True)
class AlgorithmSection:
    """``algorithm.*``: the advantage estimator."""

    adv_estimator: str = setting("grpo", choices=ADV_ESTIMATORS)
    norm_adv_by_std_in_grpo: bool = True


# section name -> its dataclass
TRAINER_SECTIONS: dict[str, type] = {
    "trainer": TrainerSection,
    "actor_rollout_ref": ActorRolloutRefSection,
    "algorithm": AlgorithmSection,
}

# The top-level keys of a training config: the typed sections, and those read elsewhere
# (engine: ragen.llm.make_engine; custom_envs: the env registry; benchmark: test_parallel_rollout.py;
# gateway: ragen.gateway.GatewaySettings, read by python -m ragen.tools.gateway).
TOP_LEVEL_KEYS = (*ROLLOUT_SECTIONS, *TRAINER_SECTIONS, "engine", "custom_envs", "model_path", "benchmark",
                  "gateway")


def check_top_level(cfg: Mapping) -> None:
    """A misspelt section name (``+agent_proxi.max_turn=3``) is an error, not a section nobody reads."""
    check_keys(cfg, TOP_LEVEL_KEYS, "")


def _default_run() -> TrainerSection:
    return TrainerSection(default_local_dir="runs/ragen/default")


@dataclass(frozen=True)
class TrainerConfig:
    """The trainer's sections, each whole, read once at start-up and passed to
    the parts that need them (``config.run.total_training_steps``,
    ``config.actor.ppo_epochs``, ``config.actor.optim.lr``, ...); only the
    values derived from several keys are properties here. Build it from a
    config with ``from_config``; for a variant, ``dataclasses.replace`` a
    section (``replace(cfg, actor=replace(cfg.actor, ppo_epochs=2))``)."""

    run: TrainerSection = field(default_factory=_default_run)  # trainer.*
    actor: ActorSection = field(default_factory=ActorSection)  # actor_rollout_ref.actor.*
    model: ModelSection = field(default_factory=ModelSection)  # actor_rollout_ref.model.*
    rollout: RolloutSection = field(default_factory=RolloutSection)  # actor_rollout_ref.rollout.*
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)  # algorithm.*
    seed_train: int = 0  # seed.train: the trainer's seed when trainer.seed is unset

    @property
    def loggers(self) -> list[str]:
        """``trainer.logger`` as a list, with ``jsonl`` always on: the jsonl log is
        what resume, the learning curve and the tests read."""
        logger = self.run.logger
        logger = [logger] if isinstance(logger, str) else list(logger)
        return list(dict.fromkeys([*logger, "jsonl"]))

    @property
    def seed(self) -> int:
        """The trainer's own randomness (mini-batch order, LoRA init): trainer.seed, else seed.train."""
        return self.seed_train if self.run.seed is None else self.run.seed

    @property
    def use_lora(self) -> bool:
        return self.model.lora_rank > 0

    @classmethod
    def from_config(cls, cfg: Mapping) -> "TrainerConfig":
        cfg = to_plain(cfg)
        # seed first: trainer.seed defaults to ${seed.train}, so a bad seed.train must be named as itself
        seed: SeedConfig = read(SeedConfig, cfg.get("seed"), "seed")
        run: TrainerSection = read(TrainerSection, cfg.get("trainer"), "trainer")
        arr: ActorRolloutRefSection = read(ActorRolloutRefSection, cfg.get("actor_rollout_ref"), "actor_rollout_ref")
        algorithm: AlgorithmSection = read(AlgorithmSection, cfg.get("algorithm"), "algorithm")
        return cls(run=run, actor=arr.actor, model=arr.model, rollout=arr.rollout, algorithm=algorithm,
                   seed_train=seed.train)

    def check_against(self, train_batch_size: int, engine_name: str, engine_returns_logprobs: bool = True) -> None:
        """Checks that need the rollout config: batch sizes, a trainable engine, and log-probs
        from it where the off-policy correction cannot do without them."""
        a, actor = "actor_rollout_ref.actor", self.actor
        if actor.ppo_mini_batch_size > train_batch_size:
            raise ConfigError(
                f"{a}.ppo_mini_batch_size ({actor.ppo_mini_batch_size}) is larger than the train batch "
                f"(es_manager.train.env_groups x group_size = {train_batch_size} episodes); make it <= "
                f"{train_batch_size}"
            )
        if actor.ppo_micro_batch_size_per_gpu > train_batch_size:
            raise ConfigError(
                f"{a}.ppo_micro_batch_size_per_gpu ({actor.ppo_micro_batch_size_per_gpu}) is larger than the "
                f"train batch ({train_batch_size} episodes)"
            )
        if engine_name not in TRAINABLE_ENGINES:
            raise ConfigError(
                f"engine.name={engine_name!r} cannot be trained (its weights are out of reach); "
                f"train with one of {TRAINABLE_ENGINES} (e.g. engine=hf)"
            )
        if actor.off_policy_correction == "decoupled" and not engine_returns_logprobs:
            raise ConfigError(
                f"{a}.off_policy_correction=decoupled needs the log-prob of every sampled token, and "
                f"engine {engine_name!r} returns none; use tis or none"
            )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
