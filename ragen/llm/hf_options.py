"""The hf engine as the config check reads it, before torch is imported: its name, its
options and their checks (``ragen.llm.check_engine_config``); ``HFEngine`` is built on it."""

from __future__ import annotations

from typing import Any

from ragen.errors import ConfigError
from ragen.llm.types import Engine


class HFOptions(Engine):
    """``engine.*`` of ``engine=hf``, read without building the engine (or importing torch)."""

    name = "hf"
    returns_logprobs = True
    config_keys = ("device", "dtype", "max_batch_size", "prefix_cache", "turn_cache_mb")

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        max_batch_size = options.get("max_batch_size", 64)
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ConfigError(f"engine.max_batch_size={max_batch_size!r} must be an integer >= 1")
        prefix_cache = options.get("prefix_cache", True)
        if not isinstance(prefix_cache, bool):
            raise ConfigError(f"engine.prefix_cache must be true or false, got {prefix_cache!r}")
        turn_cache_mb = options.get("turn_cache_mb", 2048)
        if isinstance(turn_cache_mb, bool) or not isinstance(turn_cache_mb, (int, float)) or turn_cache_mb < 0:
            raise ConfigError(f"engine.turn_cache_mb must be a number >= 0 (0: off), got {turn_cache_mb!r}")
