"""``EngineStats``: what an engine has counted since it was built, one typed record
that every engine (and a set of replicas, summed) fills in and the rollout's
metrics read (``engine/prefill_tokens``, ``engine/reused_tokens``, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class EngineStats:
    """An engine's cumulative counts; 0 for what an engine does not count.

    ``tokens_sampled``: answer tokens sampled, counted as they are (``HFEngine``: each decoding
    step, so the count grows inside one long call), or as each answer comes back (vLLM, the
    scripted engine); ``tokens_prefilled`` and ``tokens_reused``: prompt tokens computed, and those whose KV came
    from a prefix computed once for several requests (``HFEngine``); ``turn_cache_bytes`` and
    ``turn_cache_evicted``: what the per-episode KV cache holds and the episodes it let go
    (None: the engine keeps none); ``history_divergences``: appended prompts whose template
    rewrote earlier turns; ``token_prompt_fallbacks``: requests a server took as messages where
    token ids were meant (``OpenAIEngine``); ``replicas``: with replicas, ``Router.counts()``.
    """

    tokens_sampled: int = 0
    tokens_prefilled: int = 0
    tokens_reused: int = 0
    turn_cache_bytes: int | None = None
    turn_cache_evicted: int = 0
    history_divergences: int = 0
    token_prompt_fallbacks: int = 0
    replicas: dict[str, float] = field(default_factory=dict)

    @classmethod
    def summed(cls, parts: Sequence[EngineStats], replicas: dict[str, float]) -> EngineStats:
        """The counts of several engines together, with their router's ``replicas`` counts."""
        caches = [p.turn_cache_bytes for p in parts if p.turn_cache_bytes is not None]
        return cls(tokens_sampled=sum(p.tokens_sampled for p in parts),
                   tokens_prefilled=sum(p.tokens_prefilled for p in parts),
                   tokens_reused=sum(p.tokens_reused for p in parts),
                   turn_cache_bytes=sum(caches) if caches else None,
                   turn_cache_evicted=sum(p.turn_cache_evicted for p in parts),
                   history_divergences=sum(p.history_divergences for p in parts),
                   token_prompt_fallbacks=sum(p.token_prompt_fallbacks for p in parts),
                   replicas=dict(replicas))

    def counts(self) -> dict[str, float]:
        """The counts under their rollout metric names (``engine/...``)."""
        return {"engine/prefill_tokens": float(self.tokens_prefilled),
                "engine/reused_tokens": float(self.tokens_reused),
                "engine/turn_cache_evicted": float(self.turn_cache_evicted),
                "engine/history_divergences": float(self.history_divergences),
                "engine/token_prompt_fallbacks": float(self.token_prompt_fallbacks),
                **self.replicas}
