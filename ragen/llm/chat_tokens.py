"""The token side of a chat template, shared by the engines that tokenize
(transformers and vLLM): a request's prompt ids (its answer prefix included), and
the ids that end an answer."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

# End-of-turn tokens of common chat templates; an answer ends at any of them.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]], answer_prefix: str = "") -> list[int]:
    """The prompt ids of ``messages``, rendered by the tokenizer's chat template, with
    ``answer_prefix`` after its generation prompt: template text and prefix tokenized as
    one text, as RAGEN builds its prompts (the model writes what follows the prefix)."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    text += answer_prefix
    # The template already holds its special tokens; do not add a BOS again.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer: Any, model: Any = None) -> set[int]:
    """The ids that end an answer: the tokenizer's EOS, the EOS of the model's
    generation config (one id or several) when a model is given, and the chat
    end-of-turn tokens the vocabulary has."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if config_eos is not None:
        ids.update(int(t) for t in (config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]))
    vocab = tokenizer.get_vocab()
    ids.update(int(vocab[t]) for t in CHAT_END_TOKENS if t in vocab)
    return ids
