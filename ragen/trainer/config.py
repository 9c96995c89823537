"""TrainerConfig: the training keys of the Hydra config, read and checked at start-up.

RAGEN's (verl's) key names, from ``config/trainer_defaults.yaml``:

- ``trainer.*``: the run (steps, validation and checkpoint cadence, run dir,
  resume, loggers);
- ``actor_rollout_ref.actor.*``: the PPO update (mini/micro batches, epochs,
  clip range, gradient clipping, entropy bonus, KL to a reference, optimizer);
- ``actor_rollout_ref.model.*``: LoRA (``lora_rank > 0``) or full fine-tuning;
- ``actor_rollout_ref.rollout.*``: group filtering and the longest training
  sequence;
- ``algorithm.*``: the advantage estimator.

``TrainerConfig.from_config(cfg)`` touches no model; ``check_against(setup,
engine_name)`` checks the keys that depend on the rollout config. Every error
names its key and says what would be valid.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Mapping

from ragen.llm_agent.es_manager import to_plain
from ragen.trainer.core import ADV_ESTIMATORS, KL_TYPES

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")
TRAINABLE_ENGINES = ("hf", "vllm")
_MISSING = object()


def _get(cfg: Mapping, dotted: str, default: Any = _MISSING) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is _MISSING:
                raise ValueError(f"{dotted} is missing (see config/trainer_defaults.yaml)")
            return default
        node = node[part]
    return node


def _int(cfg: Mapping, key: str, default: Any = _MISSING, minimum: int | None = None,
         allow_none: bool = False) -> Any:
    value = _get(cfg, key, default)
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {value}")
    return value


def _float(cfg: Mapping, key: str, default: Any = _MISSING, minimum: float | None = None,
           maximum: float | None = None, allow_none: bool = False) -> Any:
    value = _get(cfg, key, default)
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{key} must be <= {maximum}, got {value}")
    return float(value)


def _bool(cfg: Mapping, key: str, default: Any = _MISSING) -> bool:
    value = _get(cfg, key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


@dataclass
class TrainerConfig:
    # trainer.*
    project_name: str = "ragen"
    experiment_name: str = "default"
    total_training_steps: int = 20
    test_freq: int = 5  # <= 0: no periodic validation (the last step is still validated)
    save_freq: int = 10  # <= 0: only the last step is saved
    val_before_train: bool = True
    default_local_dir: str = "runs/ragen/default"
    resume: bool = False
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    max_ckpt_to_keep: int | None = None
    seed: int = 0  # the trainer's own randomness (mini-batch order, LoRA init)
    # actor_rollout_ref.actor.*
    ppo_mini_batch_size: int = 32
    ppo_micro_batch_size_per_gpu: int = 8
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    grad_clip: float = 1.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"
    shuffle: bool = True
    lr: float = 1e-5
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    # actor_rollout_ref.model.*
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: Any = "all-linear"
    share_prefix: bool = True
    # actor_rollout_ref.rollout.*
    rollout_filter_ratio: float = 1.0
    max_model_len: int | None = None
    # algorithm.*
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True

    @property
    def use_lora(self) -> bool:
        return self.lora_rank > 0

    @classmethod
    def from_config(cls, cfg: Mapping) -> "TrainerConfig":
        cfg = to_plain(cfg)
        t, a, m, r, al = "trainer", "actor_rollout_ref.actor", "actor_rollout_ref.model", \
            "actor_rollout_ref.rollout", "algorithm"
        logger = _get(cfg, f"{t}.logger", ["console", "jsonl"])
        if isinstance(logger, str):
            logger = [logger]
        if not isinstance(logger, list) or not all(isinstance(x, str) for x in logger):
            raise ValueError(f"{t}.logger must be a list of names from {LOGGERS}, got {logger!r}")
        for name in logger:
            if name not in LOGGERS:
                raise ValueError(f"{t}.logger: unknown logger {name!r}; choose from {LOGGERS}")
        for name, module in (("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")):
            if name in logger and not _importable(module):
                raise ValueError(f"{t}.logger asks for {name!r} but {module} is not installed; "
                                 f"install it or remove {name!r} from {t}.logger")
        # The jsonl log is what resume, the learning curve and the tests read: always on.
        logger = list(dict.fromkeys([*logger, "jsonl"]))

        clip = _float(cfg, f"{a}.clip_ratio", 0.2, minimum=0.0)
        clip_low = _float(cfg, f"{a}.clip_ratio_low", None, minimum=0.0, allow_none=True)
        clip_high = _float(cfg, f"{a}.clip_ratio_high", None, minimum=0.0, allow_none=True)
        clip_low = clip if clip_low is None else clip_low
        clip_high = clip if clip_high is None else clip_high
        if clip_low >= 1.0:
            raise ValueError(f"{a}.clip_ratio_low (or clip_ratio) must be < 1, got {clip_low}")

        optim = f"{a}.optim"
        betas = _get(cfg, f"{optim}.betas", [0.9, 0.999])
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2
                and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
            raise ValueError(f"{optim}.betas must be two numbers in [0, 1), got {betas!r}")

        target_modules = _get(cfg, f"{m}.target_modules", "all-linear")
        names_ok = isinstance(target_modules, list) and target_modules and all(isinstance(x, str) for x in target_modules)
        if not (isinstance(target_modules, str) or names_ok):
            raise ValueError(f"{m}.target_modules must be 'all-linear' or a list of module names, "
                             f"got {target_modules!r}")

        estimator = _get(cfg, f"{al}.adv_estimator", "grpo")
        if estimator not in ADV_ESTIMATORS:
            raise ValueError(f"{al}.adv_estimator: unknown {estimator!r}; choose one of {ADV_ESTIMATORS}")
        kl_type = _get(cfg, f"{a}.kl_loss_type", "low_var_kl")
        if kl_type not in KL_TYPES:
            raise ValueError(f"{a}.kl_loss_type: unknown {kl_type!r}; choose one of {KL_TYPES}")
        agg = _get(cfg, f"{a}.loss_agg_mode", "token-mean")
        if agg not in LOSS_AGG_MODES:
            raise ValueError(f"{a}.loss_agg_mode: unknown {agg!r}; choose one of {LOSS_AGG_MODES}")

        out = cls(
            project_name=str(_get(cfg, f"{t}.project_name", "ragen")),
            experiment_name=str(_get(cfg, f"{t}.experiment_name", "default")),
            total_training_steps=_int(cfg, f"{t}.total_training_steps", 20, minimum=1),
            test_freq=_int(cfg, f"{t}.test_freq", 5),
            save_freq=_int(cfg, f"{t}.save_freq", 10),
            val_before_train=_bool(cfg, f"{t}.val_before_train", True),
            default_local_dir=str(_get(cfg, f"{t}.default_local_dir")),
            resume=_bool(cfg, f"{t}.resume", False),
            logger=logger,
            max_ckpt_to_keep=_int(cfg, f"{t}.max_actor_ckpt_to_keep", None, minimum=1, allow_none=True),
            seed=_int(cfg, f"{t}.seed", _get(cfg, "seed.train", 0)),
            ppo_mini_batch_size=_int(cfg, f"{a}.ppo_mini_batch_size", 32, minimum=1),
            ppo_micro_batch_size_per_gpu=_int(cfg, f"{a}.ppo_micro_batch_size_per_gpu", 8, minimum=1),
            ppo_epochs=_int(cfg, f"{a}.ppo_epochs", 1, minimum=1),
            clip_ratio_low=clip_low,
            clip_ratio_high=clip_high,
            grad_clip=_float(cfg, f"{a}.grad_clip", 1.0, minimum=0.0),
            entropy_coeff=_float(cfg, f"{a}.entropy_coeff", 0.0),
            use_kl_loss=_bool(cfg, f"{a}.use_kl_loss", False),
            kl_loss_coef=_float(cfg, f"{a}.kl_loss_coef", 0.001, minimum=0.0),
            kl_loss_type=kl_type,
            loss_agg_mode=agg,
            shuffle=_bool(cfg, f"{a}.shuffle", True),
            lr=_float(cfg, f"{optim}.lr", 1e-5, minimum=0.0),
            weight_decay=_float(cfg, f"{optim}.weight_decay", 0.01, minimum=0.0),
            betas=(float(betas[0]), float(betas[1])),
            lora_rank=_int(cfg, f"{m}.lora_rank", 0, minimum=0),
            lora_alpha=_float(cfg, f"{m}.lora_alpha", 16, minimum=0.0),
            target_modules=target_modules,
            share_prefix=_bool(cfg, f"{m}.share_prefix", True),
            rollout_filter_ratio=_float(cfg, f"{r}.rollout_filter_ratio", 1.0),
            max_model_len=_int(cfg, f"{r}.max_model_len", None, minimum=2, allow_none=True),
            adv_estimator=estimator,
            norm_adv_by_std_in_grpo=_bool(cfg, f"{al}.norm_adv_by_std_in_grpo", True),
        )
        if not 0.0 < out.rollout_filter_ratio <= 1.0:
            raise ValueError(f"{r}.rollout_filter_ratio must be in (0, 1], got {out.rollout_filter_ratio}")
        if out.ppo_micro_batch_size_per_gpu > out.ppo_mini_batch_size:
            raise ValueError(
                f"{a}.ppo_micro_batch_size_per_gpu ({out.ppo_micro_batch_size_per_gpu}) is larger than "
                f"{a}.ppo_mini_batch_size ({out.ppo_mini_batch_size}); make it <= the mini-batch"
            )
        if out.lr == 0.0:
            raise ValueError(f"{optim}.lr is 0: nothing would be trained")
        if not out.default_local_dir or out.default_local_dir == "None":
            raise ValueError(f"{t}.default_local_dir must name the run folder")
        return out

    def check_against(self, train_batch_size: int, engine_name: str) -> None:
        """Checks that need the rollout config: batch sizes and a trainable engine."""
        a = "actor_rollout_ref.actor"
        if self.ppo_mini_batch_size > train_batch_size:
            raise ValueError(
                f"{a}.ppo_mini_batch_size ({self.ppo_mini_batch_size}) is larger than the train batch "
                f"(es_manager.train.env_groups x group_size = {train_batch_size} episodes); make it <= "
                f"{train_batch_size}"
            )
        if self.ppo_micro_batch_size_per_gpu > train_batch_size:
            raise ValueError(
                f"{a}.ppo_micro_batch_size_per_gpu ({self.ppo_micro_batch_size_per_gpu}) is larger than the "
                f"train batch ({train_batch_size} episodes)"
            )
        if engine_name not in TRAINABLE_ENGINES:
            raise ValueError(
                f"engine.name={engine_name!r} cannot be trained (its weights are out of reach); "
                f"train with one of {TRAINABLE_ENGINES} (e.g. engine=hf)"
            )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
