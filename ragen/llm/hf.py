"""A transformers engine with a batch-independent sampler.

``HFEngine`` renders each request with the tokenizer's chat template
(``add_generation_prompt=True``) and its ``answer_prefix`` (the completion is
what follows the prefix), left-pads a chunk of prompts and runs its own
decode loop (a forward pass with the KV cache per token; position ids from the
attention mask's cumulative sum, so left padding does not shift positions).

*Batch independence*: each request samples with its own random stream
(``ragen.llm.hf_sampling``), so it gets the same tokens alone or in any batch.

*Prefix sharing* (``prefix_cache``, on by default): a chunk's identical
prompts (a GRPO group's members share one) are prefilled once and their KV
cache gathered into every row that asked for them; and the distinct prompts'
common start (system message, instruction, format example) is prefilled once
for all of them, their remaining tokens after it (rows padded between the two;
positions from the mask, so nothing shifts). Sampling stays per row. Across
calls, ``turn_cache`` (``ragen.llm.turn_cache``, ``turn_cache_mb``) keeps each
episode's cache (its prompt and answer; none at its ``last_turn``, which has no
next prompt), and the episode's next prompt, which
starts with them, computes only the tokens after the start they share; rows
with cached starts of different lengths are left-padded into one batch cache.
It is bounded, least recently used out, cleared whenever the policy version
changes, and freed by ``release_cache`` (the rollout calls it at its end). The engine counts the prompt tokens it computed and those it
reused (``stats()``: ``tokens_prefilled``, ``tokens_reused``); ``prefix_cache=False``
computes every row's prompt in full, as before. Both reuses apply to models
whose cache is plain full-attention layers (``DynamicLayer``); others (sliding
window, linear attention) share identical prompts only.

*Stopping*: at EOS or the chat end token (``<|im_end|>``), at a
``sampling.stop`` string (cut from the text, like OpenAI/vLLM; its tokens stay in
the ids) -> ``"stop"``; at ``max_tokens`` (the smaller of the request's and the sampling's)
-> ``"length"``. The final EOS token is kept in ``response_token_ids`` (the
policy learns to stop) and left out of the text.

*Streaming* (``generate_reporting``): each decode step tells the call's
``TokenSink`` the token just chosen for every running request that asked
(``stream_tokens``); rows that do not stream cost nothing more.

*Bad ids*: a request whose history ids the model has no embedding for
(``vocab_size``: the input embedding's rows) is answered alone with an error
completion naming the id; the other requests of the call are generated.

*One model*: ``.model``, ``.tokenizer`` and ``.device`` are the objects the
trainer updates in place; the engine can also be built around an existing
model and tokenizer, so there is never a second copy. ``policy_version``
counts updates (``bump_policy_version`` or ``load_weights``). Generation runs
under ``torch.no_grad`` in eval mode and restores every module's train/eval
flag afterwards.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ragen.llm.chat_tokens import ChatTokens, stop_token_ids
from ragen.llm.default_model import resolve_model_path
from ragen.llm.hf_device import resolve_device, resolve_dtype
from ragen.llm.hf_options import HFOptions
from ragen.llm.hf_sampling import choose, request_uniforms
from ragen.llm.stats import EngineStats
from ragen.llm.transformers_compat import dtype_kwarg
from ragen.llm.turn_cache import Hit, TurnCache
from ragen.llm.types import (Completion, GenerationRequest, SamplingParams, TokenSink, request_seed,
                             token_id_error)
from ragen.utils import common_prefix_length

logger = logging.getLogger(__name__)

_MIN_SHARED_TOKENS = 16  # a shorter common start is not worth its own forward pass


def _plain_cache_layers(model: Any) -> bool:
    """Whether the model's KV cache is full-attention ``DynamicLayer``s (no sliding window,
    no linear attention): the layout ``HFEngine`` can assemble row by row."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    try:
        layers = DynamicCache(config=model.config).layers
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        logger.info("HFEngine: no prefix reuse beyond identical prompts (%s's cache: %s)", type(model).__name__, exc)
        return False
    return all(type(layer) is DynamicLayer for layer in layers)


def _vocab_size(model: Any) -> int | None:
    """The ids the model has an embedding for: its input embedding's rows (the config's vocab_size else)."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError, TypeError):
        size = getattr(getattr(model, "config", None), "vocab_size", None)
        return size if isinstance(size, int) else None


class _Reports:
    """A call's ``TokenSink`` as the decode loop of each chunk tells it: by row of the chunk, kept
    to the rows that stream and told by their index in the call (``good``: the call's index of
    each request generated)."""

    def __init__(self, sink: TokenSink, good: list[int]) -> None:
        self.sink = sink
        self.good = good

    def of_chunk(self, requests: Sequence[GenerationRequest],
                 chunk: list[int]) -> Callable[[dict[int, list[int]]], None] | None:
        rows = {row: self.good[i] for row, i in enumerate(chunk) if requests[i].stream_tokens}
        if not rows:
            return None

        def tell(new: dict[int, list[int]]) -> None:
            told = {rows[row]: ids for row, ids in new.items() if row in rows}
            if told:
                self.sink(told)
        return tell


class HFEngine(HFOptions):
    """transformers causal LM behind ``generate``; see the module docstring. Its name and
    options, and their checks, are ``HFOptions``'s."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        max_batch_size: int = 64,
        prefix_cache: bool = True,
        turn_cache_mb: float = 2048,
    ) -> None:
        super().__init__()
        self.check_options({"max_batch_size": max_batch_size, "prefix_cache": prefix_cache,
                            "turn_cache_mb": turn_cache_mb})
        self.max_batch_size = int(max_batch_size)
        self.prefix_cache = prefix_cache
        if model is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            path = resolve_model_path(model_path)
            self.device = resolve_device(device)
            torch_dtype = resolve_dtype(dtype, self.device)
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **dtype_kwarg(torch_dtype))
            model.to(self.device)
            model.eval()
            logger.info("HFEngine loaded %s on %s (%s)", path, self.device, torch_dtype)
        else:
            if tokenizer is None:
                raise ValueError("HFEngine(model=...) needs the model's tokenizer too (tokenizer=...)")
            # A shared model stays where its owner put it: no copy, no move.
            self.device = next(model.parameters()).device
        self.model = model
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; HFEngine renders requests with "
                "tokenizer.apply_chat_template (set tokenizer.chat_template)"
            )
        self.stop_token_ids = stop_token_ids(tokenizer, model)
        self.vocab_size = _vocab_size(model)
        self.chat = ChatTokens.of(tokenizer, model)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else min(self.stop_token_ids, default=0))
        params = inspect.signature(model.forward).parameters
        self._logits_kwarg = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        # Starts computed once and episodes' caches kept between calls are assembled into a
        # batch cache by hand: only for models whose cache is plain full-attention layers.
        self._assemble = prefix_cache and _plain_cache_layers(model)
        self.turn_cache = (TurnCache(int(turn_cache_mb * 2**20))
                           if self._assemble and turn_cache_mb > 0 else None)
        self._turn_cache_version = self.policy_version
        # generate() flips the model to eval and back: one call at a time.
        self._lock = threading.Lock()

    @classmethod
    def replica_options(cls, options: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """``engine.replicas`` copies; with ``device`` ``auto`` or ``cuda`` and that many GPUs,
        one on each (``cuda:0``, ``cuda:1``, ...), else all on the one device."""
        replicas = super().replica_options(options)
        device = str(options.get("device", "auto"))
        if len(replicas) > 1 and device in ("auto", "cuda") and torch.cuda.device_count() >= len(replicas):
            return [(f"{i} (cuda:{i})", {**o, "device": f"cuda:{i}"}) for i, (_, o) in enumerate(replicas)]
        return [(f"{name} ({resolve_device(device)})", o) for name, o in replicas]

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], model_path: str | None = None) -> "HFEngine":
        return cls(model_path, **cfg)

    # -- weights ----------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> int:
        """Copy tensors into the model by parameter/buffer name; bump the policy version.

        The trainer usually updates ``.model`` in place and calls
        ``bump_policy_version()``; this is for weights that live elsewhere.
        """
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        targets = dict(self.model.named_parameters())
        targets.update(dict(self.model.named_buffers()))
        with torch.no_grad():
            for name, tensor in items:
                if name not in targets:
                    raise KeyError(f"load_weights: the model has no parameter or buffer named {name!r}")
                targets[name].copy_(tensor.to(device=targets[name].device, dtype=targets[name].dtype))
        return self.bump_policy_version()

    def bump_policy_version(self) -> int:
        version = super().bump_policy_version()
        self.release_cache()  # the old weights' keys and values
        return version

    def stats(self) -> EngineStats:
        """The engine's counts, with what its turn cache holds and the episodes it let go."""
        stats = super().stats()
        if self.turn_cache is not None:
            stats.turn_cache_bytes, stats.turn_cache_evicted = self.turn_cache.bytes, self.turn_cache.evicted
        return stats

    def release_cache(self) -> None:
        """Free the turn cache now, unless a call is running: that call, or the next, finds the
        version changed and clears it then (a rollout's end with a call running frees nothing)."""
        if self.turn_cache is not None and self._lock.acquire(blocking=False):
            try:
                self.turn_cache.clear()
                self._turn_cache_version = self.policy_version
            finally:
                self._lock.release()

    # -- generation -------------------------------------------------------

    def encode_prompt(self, messages: Sequence[Mapping[str, str]], answer_prefix: str = "") -> list[int]:
        """The prompt ids of ``messages`` rendered whole, ending with ``answer_prefix``."""
        return self.chat.full(messages, answer_prefix)

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Completion]:
        return self.generate_reporting(requests, sampling, None)

    def generate_reporting(self, requests: Sequence[GenerationRequest], sampling: SamplingParams,
                           on_tokens: TokenSink | None) -> list[Completion]:
        """``generate``; each decode step tells ``on_tokens`` the token it chose for every request
        with ``stream_tokens`` still running."""
        if not requests:
            return []
        refused = self._refused(requests)
        good = [i for i in range(len(requests)) if i not in refused]
        report = None
        if on_tokens is not None and any(requests[i].stream_tokens for i in good):
            report = _Reports(on_tokens, good)
        with self._lock:
            done = iter(self._generate([requests[i] for i in good], sampling, report) if good else ())
        return [refused[i] if i in refused else next(done) for i in range(len(requests))]

    def _refused(self, requests: Sequence[GenerationRequest]) -> dict[int, Completion]:
        """Error completions, by index, of the requests whose given ids (prompt or history) the
        model has no embedding for: in the batch, one would fail every request of the call (IndexError)."""
        refused = {}
        for i, request in enumerate(requests):
            for name in ("prompt_token_ids", "history_token_ids"):
                problem = token_id_error(getattr(request, name) or (), self.vocab_size)
                if problem is not None:
                    logger.warning("HFEngine: request for env %s turn %s refused: its %s: %s",
                                   request.env_id, request.turn, name, problem)
                    refused[i] = Completion.answering(request, f"its {name}: {problem}", [], [], "error",
                                                      self.policy_version)
                    break
        return refused

    def _generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams,
                  report: _Reports | None = None) -> list[Completion]:
        began = time.perf_counter()
        prompts = [self.prompt_ids(r) for r in requests]
        limits = [max(0, r.token_limit(sampling)) for r in requests]
        seeds = [request_seed(sampling.seed, r.key) for r in requests]
        episodes = [(r.seed, r.env_id) for r in requests]
        last = [r.last_turn for r in requests]
        if self.turn_cache is not None and self._turn_cache_version != self.policy_version:
            self.turn_cache.clear()  # keys and values of the old weights
            self._turn_cache_version = self.policy_version
        # Similar lengths together: less padding, and identical prompts side by side (shared
        # in a chunk); results do not depend on the grouping.
        order = sorted(range(len(requests)), key=lambda i: (len(prompts[i]), prompts[i]))
        results: list[tuple[list[int], str, list[float]] | None] = [None] * len(requests)
        with self._inference():
            for first in range(0, len(order), self.max_batch_size):
                chunk = order[first : first + self.max_batch_size]
                outputs = self._generate_chunk([prompts[i] for i in chunk], [limits[i] for i in chunk],
                                               [seeds[i] for i in chunk], [episodes[i] for i in chunk],
                                               [last[i] for i in chunk], sampling,
                                               None if report is None else report.of_chunk(requests, chunk))
                for i, output in zip(chunk, outputs):
                    results[i] = output
        completions = []
        for request, prompt, (response_ids, finish_reason, logprobs) in zip(requests, prompts, results):
            text, finish_reason = self._response_text(response_ids, finish_reason, sampling.stop)
            completions.append(Completion.answering(request, text, prompt, response_ids, finish_reason,
                                                    self.policy_version, logprobs))
        logger.debug(
            "HFEngine: %d requests, %d response tokens in %.2f s",
            len(requests), sum(len(c.response_token_ids) for c in completions), time.perf_counter() - began,
        )
        return completions

    def complete_ids(self, prompt_ids: Sequence[int], max_tokens: int, sampling: SamplingParams,
                     seed: int = 0) -> tuple[list[int], list[float], str]:
        """One answer to ``prompt_ids`` as given, as a token-in, token-out server gives
        it: (its ids, each one's log-prob, "stop" | "length"). No turn cache."""
        problem = token_id_error(prompt_ids, self.vocab_size)
        if problem is not None:
            raise ValueError(f"HFEngine.complete_ids: prompt_ids: {problem}")
        with self._lock, self._inference():
            cache, self.turn_cache = self.turn_cache, None
            try:
                ((ids, reason, logprobs),) = self._generate_chunk([list(prompt_ids)], [max(0, max_tokens)], [seed],
                                                                  [(0, 0)], [True], sampling)
            finally:
                self.turn_cache = cache
        return ids, logprobs, reason

    @contextlib.contextmanager
    def _inference(self) -> Iterator[None]:
        """The model in eval mode without gradients, each module's mode restored after."""
        modes = {module: module.training for module in self.model.modules()}
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for module, training in modes.items():
                module.training = training

    def _generate_chunk(self, prompts: list[list[int]], limits: list[int], seeds: list[int],
                        episodes: list[tuple[int, int]], last: list[bool], sampling: SamplingParams,
                        report: Callable[[dict[int, list[int]]], None] | None = None,
                        ) -> list[tuple[list[int], str, list[float]]]:
        """Each row's (ids, finish reason, log-probs); ``report``: told each step's new token of every
        row still running, by row (it keeps those of the rows that stream)."""
        batch = len(prompts)
        responses: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        reasons: list[str | None] = ["length" if limit == 0 else None for limit in limits]
        steps = max(limits)
        if steps == 0:
            return [([], "length", []) for _ in range(batch)]
        extra = {self._logits_kwarg: 1} if self._logits_kwarg else {}
        past, logits, mask = self._prefill(prompts, episodes, extra)
        uniforms = None if sampling.greedy else request_uniforms(seeds, steps, self.device)
        stop_strings = [s for s in sampling.stop if s]
        tail = 4 * max((len(s) for s in stop_strings), default=0) + 2
        for step in range(steps):
            if step:  # the last tokens chosen, at the next position of each row
                positions = mask.sum(-1, keepdim=True) - 1
                out = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions,
                                 past_key_values=past, use_cache=True, **extra)
                past = out.past_key_values
                logits = out.logits[:, -1, :].float()
            tokens, token_logprobs = choose(logits, sampling, None if uniforms is None else uniforms[:, step])
            running = [r is None for r in reasons]
            # counted as sampled: a rollout's progress reads it while this call runs
            self._stats.tokens_sampled += sum(running)
            for row, (token, logprob) in enumerate(zip(tokens.tolist(), token_logprobs.tolist())):
                if reasons[row] is not None:
                    continue
                responses[row].append(token)
                logprobs[row].append(logprob)
                if token in self.stop_token_ids:
                    reasons[row] = "stop"
                elif stop_strings and self._hits_stop_string(responses[row][-tail:], stop_strings):
                    reasons[row] = "stop"
                elif len(responses[row]) >= limits[row]:
                    reasons[row] = "length"
            if report is not None:
                report({row: responses[row][-1:] for row, n in enumerate(running) if n})
            if all(r is not None for r in reasons):
                break
            # Finished rows keep decoding (their tokens are ignored): cheaper than
            # re-slicing the cache, and it leaves the other rows untouched.
            mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=-1)
        if self.turn_cache is not None:
            self._keep(past, mask, prompts, responses, episodes, last)
        return [(resp, reason or "length", lps) for resp, reason, lps in zip(responses, reasons, logprobs)]

    def _keep(self, past: Any, mask: torch.Tensor, prompts: list[list[int]], responses: list[list[int]],
              episodes: list[tuple[int, int]], last: list[bool]) -> None:
        """Keep each row's cache for its episode's next turn: its prompt and its answer but the
        last token (never fed back); the steps a finished row kept decoding are not kept. An
        episode at its last turn has no next one: its earlier turn's entry goes, nothing is kept."""
        rows = []
        for row, (prompt, response, episode, final) in enumerate(zip(prompts, responses, episodes, last)):
            if final:
                self.turn_cache.discard(episode)
                continue
            tokens = prompt + response[:-1]
            rows.append((episode, row, tokens, mask[row].nonzero().squeeze(-1)[: len(tokens)]))
        self.turn_cache.put([(layer.keys, layer.values) for layer in past.layers], rows)

    def _prefill(self, prompts: list[list[int]], episodes: list[tuple[int, int]],
                 extra: dict[str, int]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The KV cache, last-position logits (float) and attention mask of ``prompts``, one
        row each. With ``prefix_cache``, each distinct prompt is computed once (its rows
        gathered from it), after the longest start that is already computed: its episode's
        cache from an earlier call (``turn_cache``), or else the common start of the prompts
        without one, computed once for all of them."""
        total = sum(len(p) for p in prompts)
        if not self.prefix_cache:
            self._stats.tokens_prefilled += total
            return self._forward(prompts, extra)
        where: dict[tuple[int, ...], int] = {}
        rows = [where.setdefault(tuple(p), len(where)) for p in prompts]
        distinct = [list(p) for p in where]
        starts: list[Hit | None] = [None] * len(distinct)
        if self.turn_cache is not None:
            for row, episode in zip(rows, episodes):
                hit = self.turn_cache.get(episode, distinct[row])
                if hit and hit.length >= _MIN_SHARED_TOKENS and hit.length > getattr(starts[row], "length", 0):
                    starts[row] = hit
        rest = [d for d, start in enumerate(starts) if start is None]
        shared = common_prefix_length([distinct[d] for d in rest]) if len(rest) > 1 and self._assemble else 0
        shared = min([shared] + [len(distinct[d]) - 1 for d in rest])  # every row keeps a token to compute
        if shared >= _MIN_SHARED_TOKENS:
            start_cache = self._forward([distinct[rest[0]][:shared]], extra)[0]
            common = Hit(shared, [(layer.keys, layer.values) for layer in start_cache.layers], 0,
                         torch.arange(shared, device=self.device))
            for d in rest:
                starts[d] = common
        else:
            shared = 0
        lengths = [start.length if start else 0 for start in starts]
        past, past_mask = self._assemble_cache(starts)
        past, logits, mask = self._forward([p[n:] for p, n in zip(distinct, lengths)], extra, past, past_mask)
        computed = shared + sum(len(p) - n for p, n in zip(distinct, lengths))
        self._stats.tokens_prefilled += computed
        self._stats.tokens_reused += total - computed
        if len(distinct) < len(prompts):
            index = torch.tensor(rows, device=self.device)
            past.batch_select_indices(index)
            logits, mask = logits[index], mask[index]
        return past, logits, mask

    def _assemble_cache(self, starts: list[Hit | None]) -> tuple[Any, torch.Tensor | None]:
        """One batch cache from each row's computed start (or none), left-padded to the longest,
        and its attention mask; (None, None) when no row has one."""
        width = max((start.length for start in starts if start), default=0)
        if width == 0:
            return None, None
        from transformers.cache_utils import DynamicCache

        mask = torch.zeros((len(starts), width), dtype=torch.long, device=self.device)
        for row, start in enumerate(starts):
            if start:
                mask[row, width - start.length:] = 1
        layers = []
        for index, (keys, values) in enumerate(starts[next(i for i, s in enumerate(starts) if s)].layers):
            batch_keys = keys.new_zeros((len(starts), keys.shape[1], width, keys.shape[3]))
            batch_values = values.new_zeros((len(starts), values.shape[1], width, values.shape[3]))
            for row, start in enumerate(starts):
                if start:
                    source_keys, source_values = start.layers[index]
                    batch_keys[row, :, width - start.length:] = source_keys[start.row][:, start.columns]
                    batch_values[row, :, width - start.length:] = source_values[start.row][:, start.columns]
            layers.append((batch_keys, batch_values))
        return DynamicCache(ddp_cache_data=layers), mask

    def _forward(self, prompts: list[list[int]], extra: dict[str, int], past: Any = None,
                 past_mask: torch.Tensor | None = None) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One forward pass over left-padded ``prompts`` after ``past`` (a cache whose attention
        mask is ``past_mask``, or None): the cache, the last position's logits and the whole
        attention mask. Padding sits between each row's cached start and its prompt; positions
        come from the mask."""
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        if past_mask is not None:
            mask = torch.cat([past_mask, mask], dim=-1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, mask.shape[1] - width:]
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=past,
                         use_cache=True, **extra)
        return out.past_key_values, out.logits[:, -1, :].float(), mask

    def _hits_stop_string(self, ids: list[int], stop_strings: list[str]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in stop_strings)

    def _response_text(self, ids: list[int], finish_reason: str, stop: Sequence[str]) -> tuple[str, str]:
        body = ids[:-1] if ids and ids[-1] in self.stop_token_ids else ids
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        cuts = [text.find(s) for s in stop if s and s in text]
        if cuts:
            return text[: min(cuts)], "stop"
        return text, finish_reason

