"""The hf engine's sampler, independent of the batch: a token per row from the logits.

Each request samples with its own random stream, seeded
by ``request_seed(sampling.seed, request.key)``; a token is drawn by inverting
the request's CDF at that stream's next uniform. A request therefore gets the
same tokens alone or in any batch, in any order (up to float noise from
different matmul shapes). ``temperature == 0`` is greedy.
"""

from __future__ import annotations

import torch

from ragen.llm.types import SamplingParams


def request_uniforms(seeds: list[int], steps: int, device: torch.device) -> torch.Tensor:
    """One CPU stream per request, drawn up front: row i's t-th token uses ``[i, t]``
    whatever else is in the batch."""
    return torch.stack(
        [torch.rand(steps, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds]
    ).to(device)


def choose(logits: torch.Tensor, sampling: SamplingParams,
           uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row (argmax, or the inverse CDF of the filtered distribution at
    ``uniforms``) and its log-prob under the distribution it was drawn from: temperature,
    top-k and top-p applied and renormalized; for greedy, the model's own (temperature 1)."""
    if sampling.greedy or uniforms is None:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    logits = logits / float(sampling.temperature)
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, index = torch.sort(probs, dim=-1, descending=True, stable=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        sorted_probs = sorted_probs.masked_fill(cumulative - sorted_probs >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, index, sorted_probs)
    cdf = probs.double().cumsum(dim=-1)
    targets = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp(max=vocab - 1)
    # log p(token) after filtering: the log-softmax there, less the log of the mass kept
    logprobs = (torch.log_softmax(logits.double(), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
                - cdf[:, -1].log())
    return tokens, logprobs.float()
