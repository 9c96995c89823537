"""A tiny random-weight chat model, built in-process for fast tests.

``build_tiny_model(path, seed)`` writes a folder that ``from_pretrained`` loads:

- a *tokenizer* trained here with the ``tokenizers`` library (byte-level BPE on a
  small built-in corpus of agent answers, action names and digits, so any text
  encodes), wrapped as ``PreTrainedTokenizerFast`` with ``<|endoftext|>`` (pad),
  ``<|im_start|>`` and ``<|im_end|>`` (eos) and a ChatML chat template; the
  answer tags ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` are single,
  ordinary (not special) tokens, so decoding keeps them;
- a *model*: a Llama-style causal LM (2 layers, hidden size 64) with random
  weights drawn from ``seed``.

No downloads; the same seed gives the same files. The weights are random, so
the text is gibberish: this model tests machinery (padding, sampling, stop
reasons, training steps), not quality.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = (
    "<think> I should move Up then Left to reach the goal. </think> <answer> Up || Left </answer>",
    "<think> The box is below me, so I push Down. </think> <answer> Down </answer>",
    "<think> Move Right twice. </think> <answer> Right || Right </answer>",
    "Available actions: Up, Down, Left, Right. You can take up to 3 actions per turn.",
    "Using the numbers 3 5 2 7, make 16. <answer> 3 + 5 * 2 - 7 + 9 - 8 / 4 </answer>",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 50 100 + - * / = ( )",
    "You are a helpful assistant. The player is at P, the target is at T, walls are #.",
    "State: the goal is reached. Reward: 1.0. Turn 1 of 5. Invalid action.",
    "system user assistant",
)


def build_tiny_tokenizer():
    """A ``PreTrainedTokenizerFast`` trained in-process (deterministic)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    backend.train_from_iterator(list(_CORPUS) * 4, trainer)
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in TAG_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        padding_side="left",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(path: str | os.PathLike, seed: int = 0, **sizes) -> str:
    """Write a tiny random Llama-style chat model and its tokenizer to ``path``;
    return it. ``sizes``: ``LlamaConfig`` fields that replace the tiny ones
    (``benchmarks/random_model.py`` makes it as large as SmolLM2-135M)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(**{
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        # Larger than the usual 0.02 so that random logits depend on the context
        # (tests of padding and sampling need tokens that differ per prompt).
        "initializer_range": 0.3,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **sizes,
    })
    # A private RNG state: building the model must not move the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    logger.debug("built tiny model (seed %d, vocab %d) in %s", seed, len(tokenizer), out)
    return str(out)
