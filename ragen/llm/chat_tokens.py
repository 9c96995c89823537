"""The token side of a chat template: a request's prompt ids, and the ids that end an answer.

``ChatTokens`` builds a prompt in one of two ways:

- ``full(messages, answer_prefix)``: the template's text of every message,
  the generation prompt and the answer prefix, tokenized as one text, as
  RAGEN builds its prompts (the model writes what follows the prefix);
- ``append(history_ids, messages, history_messages, answer_prefix)``: the ids
  of the conversation so far (the previous prompt and the answer the engine
  sampled after it), then the tokens of what the template adds: the end of
  the answer's turn (unless the answer ended with it), the messages after
  ``history_messages``, the generation prompt and the answer prefix. Earlier
  answers stay the tokens that were sampled: decode then encode is not the
  identity (byte-level BPE merges differently across a cut; invalid bytes come
  back as replacement characters).

What the template adds is read from renders of a placeholder conversation
(system, user, assistant) with and without the new messages, so it works for
any template that renders a conversation as the render of its start followed
by more text. ``append`` also renders the request's messages whole and says
whether the template *diverges* there: whether it rewrites earlier turns once
later ones follow (some drop the ``<think>`` of earlier answers), so that the
appended prompt's text is not the full render of the same messages.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Callable, Mapping, Sequence

# End-of-turn tokens of common chat templates; an answer ends at any of them.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

Messages = Sequence[Mapping[str, str]]
# a conversation probe: system, user, and an assistant answer whose end the template closes
_PROBE = ({"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"})


class ChatTokens:
    """One chat template and tokenizer: prompts rendered whole or appended to the ids so far.

    ``render(messages, add_generation_prompt) -> str`` is the template,
    ``encode(text) -> ids`` the tokenizer (no special tokens added),
    ``end_texts`` the ids that end an answer with the text each stands for.
    """

    def __init__(self, render: Callable[[Messages, bool], str], encode: Callable[[str], list[int]],
                 end_texts: Mapping[int, str], name: str = "") -> None:
        self.render = render
        self.encode = encode
        self.end_texts = dict(end_texts)
        self.name = name

    @classmethod
    def of(cls, tokenizer: Any, model: Any = None) -> "ChatTokens":
        """The ``ChatTokens`` of a transformers tokenizer (and the model's extra end ids)."""
        vocab = tokenizer.get_vocab()
        names = {i: t for t, i in vocab.items()}

        def render(messages: Messages, add_generation_prompt: bool) -> str:
            return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)

        def encode(text: str) -> list[int]:
            # the template already holds its special tokens: no BOS added again
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        ends = stop_token_ids(tokenizer, model)
        return cls(render, encode, {i: names.get(i, "") for i in ends}, str(getattr(tokenizer, "name_or_path", "")))

    def full(self, messages: Messages, answer_prefix: str = "") -> list[int]:
        """The prompt ids of ``messages`` rendered whole, ending with ``answer_prefix``."""
        return self.encode(self.render(messages, True) + answer_prefix)

    def append(self, history_ids: Sequence[int], messages: Messages, history_messages: int,
               answer_prefix: str = "") -> tuple[list[int], bool]:
        """``history_ids`` (the ids of ``messages[:history_messages]``, ending with an
        assistant answer as sampled), then the template's tokens of the rest; and whether
        the template diverges here (see the module docstring). A template whose renders
        do not extend one another at all gets the full render, counted as diverged."""
        probe = self._probe
        new = list(messages[history_messages:])
        if probe is None:
            return self.full(messages, answer_prefix), True
        base, done, close = probe
        grown = self.render(base + new, True)
        if not grown.startswith(done):
            return self.full(messages, answer_prefix), True
        added = grown[len(done):] + answer_prefix
        last = history_ids[-1] if history_ids else None
        end = self.end_texts.get(last) if last is not None else None
        if end and close.startswith(end):  # the answer ended its own turn
            close = close[len(end):]
        before = self.render(messages[:history_messages], False)
        whole = self.render(messages, True) + answer_prefix
        diverged = whole != before + added
        return list(history_ids) + self.encode(close + added), diverged

    def request_ids(self, request: Any) -> tuple[list[int], bool]:
        """A ``GenerationRequest``'s prompt ids and whether the template diverged: its
        messages ``full`` without history ids, else ``append``ed to them."""
        if request.history_token_ids is None:
            return self.full(request.messages, request.answer_prefix), False
        return self.append(request.history_token_ids, request.messages, request.history_messages,
                           request.answer_prefix)

    def closing(self) -> str:
        """The text the template puts after an answer's content (its end of turn); "" when
        the template cannot be read that way."""
        probe = self._probe
        return probe[2] if probe else ""

    @cached_property
    def _probe(self) -> tuple[list[dict[str, str]], str, str] | None:
        """The placeholder conversation, its render and the text that closes its answer;
        None when the template's renders do not extend one another."""
        for base in (list(_PROBE), list(_PROBE[1:])):  # some templates refuse a system message
            try:
                opened = self.render(base[:-1], True)
                done = self.render(base, False)
            except Exception:  # noqa: BLE001 - a template may raise on any role it refuses
                continue
            answer = base[-1]["content"]
            if done.startswith(opened + answer):
                return base, done, done[len(opened) + len(answer):]
        return None


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
