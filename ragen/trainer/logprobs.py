"""Token log-probs of the model's own tokens, for the actor, its references and the old policy.

``sequence_logprobs``: log pi(token | prefix) of the
model's own tokens, with the entropy of the next-token distribution there.
The output layer runs only at the positions that predict a loss token, a
chunk of them at a time (``token_stats``), and each chunk's
full-vocabulary logits are made again in the backward pass instead of
being kept for it.
Sequences of one group start with the same prompt; that *shared prefix* is
run once instead of once per member: with short rests (a single-turn task's
answers) in one packed row after it, each rest attending to the prompt and
to itself; with long ones (multi-turn episodes) as a batch that reads the
prompt's key/value cache, repeated for the members (which keeps gradients
exact). The tokens that every sequence of a batch
starts with (a system prompt, a worked example) are run once for the whole
batch, across its micro-batches: the *prompt root* (``prompt_root``), whose
gradient is carried through it once, summed. On a CPU most tokens of an agent
episode are prompt, so this is the largest saving of the update.
Logits are divided by the rollout's sampling temperature first (1 for greedy
decoding), so the policy scored is the distribution the engine sampled from.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import DynamicCache

from ragen.llm.transformers_compat import checkpointable_layer
from ragen.trainer import precision
from ragen.trainer.config import DEFAULT_CHUNK_SIZE
from ragen.trainer.core import Sample, group_indices, loss_positions
from ragen.utils import common_prefix_length

# Below this many shared tokens a separate prefix pass costs more than it saves.
MIN_SHARED_PREFIX = 8

# enable_gradient_checkpointing: auto checkpoints the layers of a mini-batch whose micro-batches hold this
# many tokens or more (the default job's hold about 3,400; 3-turn Sokoban's 6,400, whose activations at
# micro batch 8 would take several GB)
AUTO_CHECKPOINT_TOKENS = 4096


@dataclass
class TokenStats:
    """Per micro-batch: values at the loss tokens, flattened in sample order."""

    logp: torch.Tensor  # (n_tokens,)
    entropy: torch.Tensor  # (n_tokens,)
    counts: list[int]  # loss tokens per sample


def _chunk_stats(hidden: torch.Tensor, targets: torch.Tensor, head: Any, temperature: float,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) and the entropy at the rows of ``hidden`` (positions, model width), from the
    output layer's logits divided by ``temperature``, in float32; the entropy has a gradient only
    ``with_entropy``."""
    with torch.autocast(hidden.device.type, enabled=False):  # float32 logits under a bf16 autocast too
        logits = head(hidden.float()).float()
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None])[:, 0] - logz
    with contextlib.nullcontext() if with_entropy else torch.no_grad():
        entropy = logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def token_stats(hidden: torch.Tensor, targets: torch.Tensor, head: Any, temperature: float = 1.0,
                with_entropy_grad: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) and the entropy at each row of ``hidden`` (the last layer's states at the
    positions that predict ``targets``), ``chunk_size`` rows at a time. With gradients on, each
    chunk's logits are made again in the backward pass rather than kept (activation
    checkpointing), so no full-vocabulary tensor outlives its chunk."""
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        args = (hidden[start: start + chunk_size], targets[start: start + chunk_size], head, temperature,
                with_entropy_grad)
        if torch.is_grad_enabled():
            logp, entropy = checkpoint(_chunk_stats, *args, use_reentrant=False)
        else:
            logp, entropy = _chunk_stats(*args)
        logps.append(logp)
        entropies.append(entropy)  # without a gradient unless with_entropy_grad (made under no_grad)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)


def _model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


def sequence_logprobs(
    model: Any,
    samples: Sequence[Sample],
    pad_token_id: int = 0,
    with_entropy_grad: bool = False,
    share_prefix: bool = True,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    checkpoint_layers: bool = False,
    root: PromptRoot | None = None,
    autocast: torch.dtype | None = None,
) -> TokenStats:
    """Log-probs (and entropies) of each sample's loss tokens under ``model`` with its logits
    divided by ``temperature`` (the sampling temperature; 1 for greedy decoding).

    The model's decoder runs over the tokens; its output layer only at the positions that
    predict a loss token, ``chunk_size`` of them at a time (``token_stats``). Samples with
    the same ``group_key`` whose token lists share at least ``MIN_SHARED_PREFIX`` leading
    tokens are run as one packed row (short suffixes) or as one prefix pass plus a batch of
    suffixes (``_Passes.shared_prefix``); the rest as one left-padded batch (after a ``root``:
    as one more group whose prefix is the root). Gradients flow when the caller has them enabled; results are in sample order
    either way. ``checkpoint_layers`` (with gradients on): each decoder layer keeps only its
    input for the backward pass and runs again there (``layers_checkpointed``). ``root``: the
    prompt every sample starts with, already run (``prompt_root``); the passes start after it.
    ``autocast``: the decoder's compute dtype (``ragen.trainer.precision``); the output layer
    stays in float32.
    """
    device = _model_device(model)
    decoder = model.get_decoder()
    checkpoint_layers = checkpoint_layers and torch.is_grad_enabled()
    if root is not None:
        root.check(samples)
    run = _Passes(decoder, model.get_output_embeddings(), device, pad_token_id, with_entropy_grad,
                  temperature, chunk_size, read_only_prefix=checkpoint_layers, root=root)
    with layers_checkpointed(decoder) if checkpoint_layers else contextlib.nullcontext(), \
            precision.autocast(device, autocast):
        return run.all(samples, share_prefix)


@dataclass
class PromptRoot:
    """The tokens every sample of a batch starts with, run once for the batch: the keys and
    values of each layer there (``kv``), which the passes of ``sequence_logprobs`` read.

    With gradients on, ``kv`` are detached copies of the root pass's outputs: each micro-batch's
    backward pass adds its gradient to them, and ``backward()`` carries the sum through the
    root's own pass once (the same gradient as a root pass per micro-batch, summed)."""

    ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    made: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # with the root pass's graph

    @property
    def length(self) -> int:
        return len(self.ids)

    def check(self, samples: Sequence[Sample]) -> None:
        for s in samples:
            if s.input_ids[: self.length] != self.ids:
                raise ValueError("a sample does not start with the prompt root it was given")

    def backward(self) -> None:
        """Carry the gradient the micro-batches left on ``kv`` through the root pass (once)."""
        if self.made is None:
            return
        outputs, grads = [], []
        for made, read in zip(self.made, self.kv):
            for out, leaf in zip(made, read):
                if leaf.grad is not None:
                    outputs.append(out)
                    grads.append(leaf.grad)
        self.made = None
        if outputs:
            torch.autograd.backward(outputs, grads)


def prompt_root(model: Any, samples: Sequence[Sample], checkpoint_layers: bool = False,
                autocast: torch.dtype | None = None) -> PromptRoot | None:
    """The tokens every sample starts with, up to the token before the first answer token, run
    through the model's decoder once; None where they are fewer than ``MIN_SHARED_PREFIX`` or
    there is one sample. Gradients flow when the caller has them enabled: then the caller calls
    ``backward()`` after the backward passes of the batches that read the root. ``autocast``: as
    ``sequence_logprobs``'s."""
    firsts = [pos[0] for pos in map(loss_positions, samples) if pos]
    if len(samples) < 2 or not firsts:
        return None
    length = min(common_prefix_length([s.input_ids for s in samples]), min(firsts) - 1)
    if length < MIN_SHARED_PREFIX:
        return None
    ids = list(samples[0].input_ids[:length])
    device = _model_device(model)
    with precision.autocast(device, autocast):
        return _run_root(model.get_decoder(), ids, device, checkpoint_layers)


def _run_root(decoder: Any, ids: list[int], device: torch.device, checkpoint_layers: bool) -> PromptRoot:
    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    if not torch.is_grad_enabled():
        cache = decoder(input_ids=tokens, use_cache=True).past_key_values
        return PromptRoot(ids, [(layer.keys, layer.values) for layer in cache.layers])
    if checkpoint_layers:
        cache = _RecordOnce()
        with layers_checkpointed(decoder):
            decoder(input_ids=tokens, past_key_values=cache, use_cache=True)
    else:
        cache = decoder(input_ids=tokens, use_cache=True).past_key_values
    made = [(layer.keys, layer.values) for layer in cache.layers]
    kv = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in made]
    return PromptRoot(ids, kv, made)


def can_checkpoint_layers(decoder: Any) -> bool:
    """Whether ``layers_checkpointed`` works on ``decoder`` (a transformers with the switch, layers that have it)."""
    try:
        return bool(_checkpointable_layers(decoder))
    except ValueError:
        return False


def _checkpointable_layers(decoder: Any) -> list[Any]:
    """The decoder's layers that transformers' switch checkpoints; ValueError where it has no switch."""
    layer_type = checkpointable_layer()
    return [m for m in decoder.modules() if isinstance(m, layer_type)]


def layers_checkpointed(decoder: Any) -> contextlib.AbstractContextManager:
    """Activation checkpointing of the decoder's layers while the context is open: a layer keeps
    only its input for the backward pass, which runs it again. transformers' own switch
    (``GradientCheckpointingLayer``), on for these layers alone: in training mode for its
    check, their sub-modules (dropout) left as they are, and the prefix cache kept, which is
    safe because the suffix pass reads it without writing (``_ReadOnlyCache``)."""
    layers = _checkpointable_layers(decoder)
    if not layers:
        raise ValueError(f"actor_rollout_ref.model.enable_gradient_checkpointing: {type(decoder).__name__} has no "
                         "layers transformers can checkpoint")
    return _Checkpointed(layers)


class _Checkpointed:
    """The checkpointing switches of ``layers``, on while the context is open, as they were after."""

    _SWITCHES = ("training", "gradient_checkpointing", "_can_checkpoint_with_cache", "_gradient_checkpointing_func")

    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers
        self.saved: list[dict[str, Any]] = []

    def __enter__(self) -> None:
        self.saved = [{k: layer.__dict__[k] for k in self._SWITCHES if k in layer.__dict__} for layer in self.layers]
        run_again = functools.partial(checkpoint, use_reentrant=False)
        for layer in self.layers:
            layer.training = True  # the layer's own flag only, which its switch reads
            layer.gradient_checkpointing = True
            layer._can_checkpoint_with_cache = True
            layer._gradient_checkpointing_func = run_again

    def __exit__(self, *exc: Any) -> None:
        for layer, saved in zip(self.layers, self.saved):
            for k in self._SWITCHES:
                if k in saved:
                    setattr(layer, k, saved[k])
                elif k in layer.__dict__:
                    delattr(layer, k)


class _RecordOnce(DynamicCache):
    """The prefix pass's cache under layer checkpointing: each layer's keys and values are kept
    when the layer first runs, not again when it runs again for the backward pass (which then
    sees the cache its first run saw: ``base``, the prompt root's, or empty)."""

    def __init__(self, base: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        super().__init__(base) if base else super().__init__()
        self.base = base
        self.recorded: set[int] = set()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.recorded:
            if not self.base:
                return key_states, value_states
            keys, values = self.base[layer_idx]
            return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)
        self.recorded.add(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class _ReadOnlyCache(DynamicCache):
    """A shared prefix's keys and values that a pass reads without adding its own: each layer's
    ``update`` returns the prefix's states followed by the new ones (as ``DynamicCache`` does)
    and keeps nothing, so a layer run again for the backward pass sees the same prefix."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)


@dataclass(frozen=True)
class _Passes:
    """The forward passes of ``sequence_logprobs``: the model's decoder (its last layer's states,
    normalized) and its output layer (``head``), applied at the loss positions alone."""

    decoder: Any
    head: Any
    device: torch.device
    pad_token_id: int
    with_entropy_grad: bool
    temperature: float
    chunk_size: int
    read_only_prefix: bool = False  # the suffix pass reads the prefix's cache without adding to it
    root: PromptRoot | None = None  # the prompt every sample starts with, already run

    @property
    def start(self) -> int:
        """Where the passes start: after the prompt root, or at the first token."""
        return self.root.length if self.root is not None else 0

    def root_cache(self) -> DynamicCache | None:
        """A fresh cache holding the prompt root's keys and values (None without a root): read-only
        under layer checkpointing, so that a layer run again sees what its first run saw."""
        if self.root is None:
            return None
        return _ReadOnlyCache(self.root.kv) if self.read_only_prefix else DynamicCache(self.root.kv)

    def all(self, samples: Sequence[Sample], share_prefix: bool) -> TokenStats:
        """Every sample: those of a group sharing a long enough prefix in one prefix pass, the rest
        padded (or, after a prompt root, in one batch that starts there)."""
        per_sample: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(samples)
        start = self.start
        rest: list[int] = []
        clusters = group_indices([s.group_key for s in samples]) if share_prefix else {}
        if not share_prefix:
            rest = list(range(len(samples)))
        for members in clusters.values():
            if len(members) < 2:
                rest += members
                continue
            seqs = [samples[i].input_ids for i in members]
            first_loss = min(pos[0] for pos in (loss_positions(samples[i]) for i in members) if pos)
            # The token before the first answer token stays in the suffix: its logits score that answer token.
            shared = min(common_prefix_length(seqs), first_loss - 1)
            if shared - start < MIN_SHARED_PREFIX:
                rest += members
                continue
            for i, out in zip(members, self.shared_prefix([samples[i] for i in members], shared)):
                per_sample[i] = out
        if rest:
            rest.sort()
            together = [samples[i] for i in rest]
            outs = self.padded(together) if self.root is None else self.shared_prefix(together, start)
            for i, out in zip(rest, outs):
                per_sample[i] = out
        logps = [p[0] for p in per_sample]  # type: ignore[index]
        ents = [p[1] for p in per_sample]  # type: ignore[index]
        return TokenStats(logp=torch.cat(logps), entropy=torch.cat(ents), counts=[len(x) for x in logps])

    def shared_prefix(self, samples: Sequence[Sample], shared: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``samples`` share their first ``shared`` tokens: those run once (after the prompt root,
        when there is one), then the rest of each sample, reading their cache: in one row
        (``packed``) where the rests are no longer in all than the prefix, else right-padded."""
        n = len(samples)
        base = self.root.kv if self.root is not None else None
        start = self.start
        suffixes = [s.input_ids[shared:] for s in samples]
        total, width = sum(map(len, suffixes)), max(map(len, suffixes))
        if total <= shared:
            return self.packed(samples, start, shared)
        if shared > start:
            prefix = torch.tensor([samples[0].input_ids[start:shared]], dtype=torch.long, device=self.device)
            after_root = {} if base is None else {  # the root's keys come first
                "attention_mask": torch.ones((1, shared), dtype=torch.long, device=self.device),
                "position_ids": torch.arange(start, shared, device=self.device).unsqueeze(0)}
            if self.read_only_prefix:
                recorded = _RecordOnce(base)
                self.decoder(input_ids=prefix, past_key_values=recorded, use_cache=True, **after_root)
                cache = _ReadOnlyCache([(layer.keys, layer.values) for layer in recorded.layers])
            else:
                cache = self.decoder(input_ids=prefix, past_key_values=DynamicCache(base) if base else None,
                                     use_cache=True, **after_root).past_key_values
        else:  # the prompt root is the whole shared prefix
            cache = self.root_cache()
        # Every member attends to the same prefix keys/values; repeat_interleave is differentiable,
        # so the prefix's gradient is the sum over members, as in n separate passes.
        cache.batch_repeat_interleave(n)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long, device=self.device)
        for row, suffix in enumerate(suffixes):  # right padding: pads come after every real token
            ids[row, : len(suffix)] = torch.tensor(suffix, dtype=torch.long)
        mask = torch.ones((n, shared + width), dtype=torch.long, device=self.device)
        positions = (shared + torch.arange(width, device=self.device)).unsqueeze(0).expand(n, -1)
        hidden = self.decoder(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                              use_cache=True).last_hidden_state
        return self.at_loss_positions(hidden, samples, [row * width - shared for row in range(n)])

    def packed(self, samples: Sequence[Sample], start: int, shared: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One row: the samples' common tokens from ``start`` (after the prompt root) to
        ``shared``, then each sample's rest, which attends to the prompt and to its own earlier
        tokens: one pass, no copy of the prompt per sample, no padding. For rests no longer in
        all than the prompt (a single-turn task's answers), where the row's attention over the
        other rests costs less than the copies."""
        lengths = [shared - start] + [len(s.input_ids) - shared for s in samples]
        part = torch.repeat_interleave(torch.arange(len(lengths), device=self.device),
                                       torch.tensor(lengths, device=self.device))  # 0: the prompt
        within = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        own = (part[:, None] == part[None, :]) & (within[None, :] <= within[:, None])
        mask = torch.cat([torch.ones((len(part), start), dtype=torch.bool, device=self.device),
                          own | ((part[:, None] > 0) & (part[None, :] == 0))], dim=1)  # a rest sees the prompt
        positions = torch.where(part == 0, start + within, shared + within)
        ids = torch.tensor([samples[0].input_ids[start:shared] + [t for s in samples for t in s.input_ids[shared:]]],
                           dtype=torch.long, device=self.device)
        cache = self.root_cache()
        # a 4D mask is used as given: True where a token attends
        hidden = self.decoder(input_ids=ids, attention_mask=mask[None, None], position_ids=positions[None],
                              past_key_values=cache, use_cache=cache is not None).last_hidden_state
        offsets = itertools.accumulate(lengths[:-1])  # where each rest starts in the row
        return self.at_loss_positions(hidden, samples, [o - shared for o in offsets])

    def padded(self, samples: Sequence[Sample]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = len(samples)
        width = max(len(s.input_ids) for s in samples)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((n, width), dtype=torch.long, device=self.device)
        offsets = []
        for row, s in enumerate(samples):  # left padding, as in generation
            off = width - len(s.input_ids)
            ids[row, off:] = torch.tensor(s.input_ids, dtype=torch.long)
            mask[row, off:] = 1
            offsets.append(row * width + off)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.decoder(input_ids=ids, attention_mask=mask, position_ids=positions,
                              use_cache=False).last_hidden_state
        return self.at_loss_positions(hidden, samples, offsets)

    def at_loss_positions(self, hidden: torch.Tensor, samples: Sequence[Sample],
                          starts: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample, its loss tokens' log-probs and entropies. With the pass's states in one
        list (``hidden`` flattened over its rows), the state that predicts the token at
        position ``p`` of ``samples[i]`` is state ``starts[i] + p - 1``."""
        states = hidden.reshape(-1, hidden.shape[-1])
        rows, targets, counts = [], [], []
        for sample, start in zip(samples, starts):
            pos = loss_positions(sample)
            rows.append(torch.tensor(pos, dtype=torch.long, device=self.device) - 1 + start)
            targets.append(torch.tensor([sample.input_ids[p] for p in pos], dtype=torch.long, device=self.device))
            counts.append(len(pos))
        logp, entropy = token_stats(states[torch.cat(rows)], torch.cat(targets), self.head, self.temperature,
                                    self.with_entropy_grad, self.chunk_size)
        return list(zip(torch.split(logp, counts), torch.split(entropy, counts)))
