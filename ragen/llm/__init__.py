"""Language-model engines behind one ``generate`` interface.

An *engine* turns a batch of ``GenerationRequest``s into ``Completion``s (see
``ragen.llm.types``). ``make_engine(engine_cfg, model_path)`` picks one by the
config's ``name``:

- ``scripted``: a deterministic fake policy with a GPU-like cost model, for
  tests and benchmarks (``ragen.llm.scripted``; no torch).
- ``hf``: transformers on CPU or GPU with a batch-independent sampler; the
  trainer updates its model in place (``ragen.llm.hf``).
- ``vllm``: an adapter over vLLM's async engine, which streams completions
  (``engine.streaming: false``: over ``vllm.LLM``) (``ragen.llm.vllm_engine``).
- ``openai``: an OpenAI-compatible chat-completions server, e.g. ``vllm
  serve`` (``ragen.llm.openai_engine``).

``model_path`` is resolved by ``ragen.llm.default_model.resolve_model_path``:
``"default"`` is the embedded SmolLM2-135M-Instruct. Heavy imports (torch,
transformers, vllm) happen only inside the engine that is chosen.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from ragen.config_reader import check_keys, read, to_plain
from ragen.llm.types import Completion, Engine, GenerationRequest, SamplingParams, request_seed

__all__ = [
    "Completion",
    "Engine",
    "GenerationRequest",
    "SamplingParams",
    "request_seed",
    "make_engine",
    "check_engine_config",
    "engine_returns_logprobs",
    "engine_streams",
    "STREAMING_ENGINES",
    "ENGINE_CLASSES",
    "ScriptedEngine",
    "HFEngine",
    "VLLMEngine",
    "OpenAIEngine",
]

# name -> "module:Class"; modules are imported only when their engine is chosen.
ENGINE_CLASSES: dict[str, str] = {
    "hf": "ragen.llm.hf:HFEngine",
    "vllm": "ragen.llm.vllm_engine:VLLMEngine",
    "openai": "ragen.llm.openai_engine:OpenAIEngine",
    "scripted": "ragen.llm.scripted:ScriptedEngine",
}


# name -> "module:Class" of what the config check reads (name, options, their checks), where the
# engine's own module imports torch: the check runs before torch is imported
_OPTIONS_CLASSES: dict[str, str] = {"hf": "ragen.llm.hf_options:HFOptions"}


def _load_class(name: str, table: Mapping[str, str] = ENGINE_CLASSES) -> type:
    module_name, _, class_name = table.get(name, ENGINE_CLASSES[name]).partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def _options_class(name: str) -> type[Engine]:
    """The class that says engine ``name``'s options, streaming and log-probs, without torch."""
    return _load_class(name, _OPTIONS_CLASSES)


def check_engine_config(engine_cfg: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(name, options)`` of the ``engine`` section: the name must be a known
    engine and every other key one of its options (ValueError naming the key)."""
    cfg = to_plain(engine_cfg)
    name = cfg.pop("name", None)
    if name not in ENGINE_CLASSES:
        raise ValueError(
            f"engine.name={name!r} is not a known engine; choose one of {sorted(ENGINE_CLASSES)}"
        )
    engine_class = _options_class(name)
    keys = (*engine_class.config_keys, *engine_class.replica_keys)
    if "replicas" in cfg and "replicas" not in keys:
        raise ValueError(
            f"engine.replicas is not an option of engine {name!r}: "
            + ("vLLM spreads itself over GPUs with engine.data_parallel_size" if name == "vllm"
               else "list the servers in engine.base_urls"))
    check_keys(cfg, keys, "engine", hint=f"; the options of engine {name!r} are {sorted(keys)}")
    replicas, _ = _replicas(engine_class, cfg)
    for _, options in replicas:
        engine_class.check_options(options)
    return name, cfg


def _replicas(engine_class: type[Engine], cfg: dict[str, Any]) -> tuple[list[tuple[str, dict[str, Any]]], Any]:
    """The ``(name, options)`` of each replica, and ``engine.routing`` read (None when it is not set)."""
    routing = None
    if "routing" in cfg:
        from ragen.llm.routing import Routing

        routing = read(Routing, cfg["routing"], "engine.routing")
    return engine_class.replica_options(dict(cfg)), routing


# which engines stream completions (``Engine.streams_with``), for errors that say which to choose
STREAMING_ENGINES = ("engine=vllm (engine.streaming: true, its default), engine=openai, or engine=scripted with "
                     "engine.continuous_batching")


def engine_streams(engine_cfg: Mapping[str, Any]) -> bool:
    """Whether the engine ``engine_cfg`` describes streams completions (without building it)."""
    name, cfg = check_engine_config(engine_cfg)
    return bool(_options_class(name).streams_with(cfg))


def engine_returns_logprobs(name: str) -> bool:
    """Whether the engine called ``name`` returns sampled tokens' log-probs (without building it)."""
    return bool(_options_class(name).returns_logprobs)


def make_engine(engine_cfg: Mapping[str, Any], model_path: str | None = None) -> Engine:
    """Build the engine named by ``engine_cfg["name"]``.

    The other keys are that engine's options (see ``config/engine/<name>.yaml``);
    an unknown key is an error rather than silently ignored. Several replicas
    (``engine.replicas``; openai: ``engine.base_urls``) are built as one engine
    that routes among them (``ragen.llm.replicas``).
    """
    name, cfg = check_engine_config(engine_cfg)
    engine_class = _load_class(name)
    replicas, routing = _replicas(engine_class, cfg)
    if len(replicas) == 1:
        return engine_class.from_config(replicas[0][1], model_path)
    from ragen.llm.replicas import replicate
    from ragen.llm.routing import Routing

    return replicate([(label, lambda options=options: engine_class.from_config(options, model_path))
                      for label, options in replicas], routing or Routing())


def __getattr__(attr: str) -> Any:
    # Lazy engine classes: `from ragen.llm import HFEngine` imports torch only then.
    for name, target in ENGINE_CLASSES.items():
        if target.endswith(":" + attr):
            return _load_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
