"""What a vLLM engine's log-probs are, and how they are read from vLLM's outputs.

Every request asks for ``logprobs=0``, for which vLLM returns, per
generated token, ``{token_id: Logprob}`` holding just the sampled token;
``Completion.logprobs`` is that ``.logprob`` for each response token. What the
number means depends on vLLM's ``logprobs_mode`` (an ``LLM`` argument, one per
engine): V1's default, ``raw_logprobs``, is the log-softmax of the model's raw
logits, before temperature, top-k and top-p, so at temperature 0.7 it is not
the distribution the token was drawn from. The engine starts vLLM with
``logprobs_mode="processed_logprobs"``: the log-softmax after temperature and
top-k/top-p masking (renormalized over the tokens kept), i.e. the log-prob
under the sampling distribution actually used; a greedy request gets the
model's own distribution (temperature 1), as in ``HFEngine``. (Read in vLLM
0.32.0's ``v1/sample``; on CUDA that mode also turns FlashInfer's sampler off
for the PyTorch one.) A vLLM without ``logprobs_mode`` (older than about 0.10)
is started without it and the engine warns: its V1 gives raw log-probs, its V0
processed ones.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

logger = logging.getLogger(__name__)

# vLLM's log-probs of the distribution sampled from (temperature, top-k, top-p applied)
LOGPROBS_MODE = "processed_logprobs"


def logprobs_mode_kwargs(vllm: Any) -> dict[str, str]:
    """``{"logprobs_mode": ...}`` where this vLLM's ``EngineArgs`` has the field (about 0.10 on)."""
    try:
        supported = "logprobs_mode" in inspect.signature(vllm.EngineArgs).parameters
    except (AttributeError, TypeError, ValueError):
        supported = False
    if supported:
        return {"logprobs_mode": LOGPROBS_MODE}
    logger.warning(
        "vllm %s has no logprobs_mode: completions carry its default log-probs (V1: the raw model's, "
        "before temperature/top-k/top-p, so off by the temperature when sampling; V0: the sampling "
        "distribution's); a recent vLLM gives the sampling distribution's",
        getattr(vllm, "__version__", "?"),
    )
    return {}


def sampled_logprobs(sample: Any) -> list[float] | None:
    """The sampled tokens' log-probs from a vLLM ``CompletionOutput`` (asked with
    ``logprobs=0``: one ``{token_id: Logprob}`` per generated token), or None where
    they are missing or do not line up with the tokens."""
    steps, token_ids = sample.logprobs, list(sample.token_ids)
    if steps is None or len(steps) != len(token_ids):
        return None
    try:
        return [float(step[token].logprob) for step, token in zip(steps, token_ids)]
    except (KeyError, TypeError, AttributeError):
        return None
