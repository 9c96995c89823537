"""A training run's start-up checks: ``check_run`` reads the whole config and checks it, without
importing torch or loading a model.

``AgentTrainer`` starts with them, and train.py runs them before it imports the trainer, so a bad
key is one error line within a second rather than after torch and transformers have loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ragen.config_reader import to_plain
from ragen.llm import STREAMING_ENGINES, check_engine_config, engine_returns_logprobs, engine_streams
from ragen.llm.default_model import resolve_model_path
from ragen.rollout.config import env_level_for
from ragen.rollout.proxy import AgentSetup
from ragen.trainer.config import TrainerConfig, check_top_level


@dataclass(frozen=True)
class CheckedRun:
    """A training config that passed the start-up checks, read into what the trainer is built from."""

    plain: dict[str, Any]  # the config as plain data, resolved once (the run folder's time stamp with it)
    config: TrainerConfig
    setup: AgentSetup
    engine_cfg: dict[str, Any]  # engine.*
    engine_name: str
    correction: str  # the off-policy correction in force with this engine
    model_path: str | None  # resolved; None where the engine was given


def check_run(cfg: Mapping[str, Any], engine: Any = None) -> CheckedRun:
    """Every check of ``cfg`` that needs no model; ValueError naming the key at fault. ``engine``:
    an engine built already, whose name and abilities count instead of ``engine.*``."""
    plain = to_plain(cfg)
    check_top_level(plain)
    config = TrainerConfig.from_config(plain)
    setup = AgentSetup.from_config(plain)
    engine_cfg = dict(plain.get("engine") or {})
    if engine is None:
        check_engine_config(engine_cfg)
    engine_name = str(getattr(engine, "name", None) or engine_cfg.get("name"))
    env_level_for(setup.agent_proxy.env_level_async,
                  bool(getattr(engine, "streams", False)) if engine is not None else engine_streams(engine_cfg),
                  engine_name, STREAMING_ENGINES)
    returns_logprobs = (bool(getattr(engine, "returns_logprobs", False)) if engine is not None
                        else engine_returns_logprobs(engine_name))
    config.check_against(setup.es["train"].num_envs, engine_name, returns_logprobs)
    model_path = resolve_model_path(plain.get("model_path", "default")) if engine is None else None
    return CheckedRun(plain=plain, config=config, setup=setup, engine_cfg=engine_cfg, engine_name=engine_name,
                      correction=config.actor.correction(returns_logprobs), model_path=model_path)
