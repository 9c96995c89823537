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
by more text. With ``tools`` (OpenAI function schemas), every render
passes them to the template (``tools=``); a template that does not render
them gets them as the Hermes/Qwen2.5 block at the end of the system message
(``ragen.llm.tool_calls.tools_system_text``), so the model always sees them.
``append`` also renders the request's messages whole and says
whether the template *diverges* there: whether it rewrites earlier turns once
later ones follow (some drop the ``<think>`` of earlier answers), so that the
appended prompt's text is not the full render of the same messages.
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any, Callable, Mapping, Sequence

from ragen.llm.tool_calls import tools_system_text

# End-of-turn tokens of common chat templates; an answer ends at any of them.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

Messages = Sequence[Mapping[str, str]]
Tools = Sequence[Mapping[str, Any]]
# a conversation probe: system, user, and an assistant answer whose end the template closes
_PROBE = ({"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"})


class ChatTokens:
    """One chat template and tokenizer: prompts rendered whole or appended to the ids so far.

    ``render(messages, add_generation_prompt) -> str`` is the template,
    ``encode(text) -> ids`` the tokenizer (no special tokens added),
    ``end_texts`` the ids that end an answer with the text each stands for;
    ``render_tools(messages, add_generation_prompt, tools) -> str``, where given,
    the template's render with ``tools=``.
    """

    def __init__(self, render: Callable[[Messages, bool], str], encode: Callable[[str], list[int]],
                 end_texts: Mapping[int, str], name: str = "",
                 render_tools: Callable[[Messages, bool, Tools], str] | None = None,
                 source: tuple[Callable[..., "ChatTokens"], tuple[Any, ...]] | None = None) -> None:
        self.render = render
        self.encode = encode
        self.end_texts = dict(end_texts)
        self.name = name
        self.render_tools = render_tools
        # how to build it again in another process (a function and its picklable arguments): its
        # functions are closures, which do not pickle
        self.source = source
        self._probes: dict[str, tuple[list[dict[str, str]], str, str] | None] = {}

    def __reduce__(self) -> tuple[Callable[..., "ChatTokens"], tuple[Any, ...]]:
        if self.source is None:
            raise TypeError(f"ChatTokens {self.name!r} was built from functions and cannot be sent to another "
                            "process: build it with ChatTokens.of(tokenizer) there")
        return self.source

    @classmethod
    def of(cls, tokenizer: Any, model: Any = None) -> "ChatTokens":
        """The ``ChatTokens`` of a transformers tokenizer (and the model's extra end ids)."""
        names = {i: t for t, i in tokenizer.get_vocab().items()}
        ends = stop_token_ids(tokenizer, model)
        return _of_tokenizer(tokenizer, {i: names.get(i, "") for i in ends})

    def text(self, messages: Messages, add_generation_prompt: bool, tools: Tools | None = None) -> str:
        """The template's text of ``messages``, with ``tools`` where given (module docstring)."""
        if not tools:
            return self.render(messages, add_generation_prompt)
        if self.renders_tools:
            return self.render_tools(messages, add_generation_prompt, tools)
        return self.render(with_tools_in_system(messages, tools), add_generation_prompt)

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the template writes a ``tools=`` list into its prompt itself."""
        if self.render_tools is None:
            return False
        probe = [{"type": "function", "function": {"name": "ragen_probe_tool", "description": "probe",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        messages = [{"role": "user", "content": "u"}]
        try:
            return "ragen_probe_tool" in self.render_tools(messages, True, probe)
        except Exception:  # noqa: BLE001 - a template may raise on tools it cannot render
            return False

    def full(self, messages: Messages, answer_prefix: str = "", tools: Tools | None = None) -> list[int]:
        """The prompt ids of ``messages`` rendered whole, ending with ``answer_prefix``."""
        return self.encode(self.text(messages, True, tools) + answer_prefix)

    def append(self, history_ids: Sequence[int], messages: Messages, history_messages: int,
               answer_prefix: str = "", tools: Tools | None = None) -> tuple[list[int], bool]:
        """``history_ids`` (the ids of ``messages[:history_messages]``, ending with an
        assistant answer as sampled), then the template's tokens of the rest; and whether
        the template diverges here (see the module docstring). A template whose renders
        do not extend one another at all gets the full render, counted as diverged."""
        probe = self._probe(tools)
        new = list(messages[history_messages:])
        if probe is None:
            return self.full(messages, answer_prefix, tools), True
        base, done, close = probe
        grown = self.text(base + new, True, tools)
        if not grown.startswith(done):
            return self.full(messages, answer_prefix, tools), True
        added = grown[len(done):] + answer_prefix
        last = history_ids[-1] if history_ids else None
        end = self.end_texts.get(last) if last is not None else None
        if end and close.startswith(end):  # the answer ended its own turn
            close = close[len(end):]
        before = self.text(messages[:history_messages], False, tools)
        whole = self.text(messages, True, tools) + answer_prefix
        diverged = whole != before + added
        return list(history_ids) + self.encode(close + added), diverged

    def request_ids(self, request: Any) -> tuple[list[int], bool]:
        """A ``GenerationRequest``'s prompt ids and whether the template diverged: its
        ``prompt_token_ids`` where given, its messages ``full`` without history ids, else
        ``append``ed to them."""
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids), False
        if request.history_token_ids is None:
            return self.full(request.messages, request.answer_prefix, request.tools), False
        return self.append(request.history_token_ids, request.messages, request.history_messages,
                           request.answer_prefix, request.tools)

    def closing(self) -> str:
        """The text the template puts after an answer's content (its end of turn); "" when
        the template cannot be read that way."""
        probe = self._probe(None)
        return probe[2] if probe else ""

    def _probe(self, tools: Tools | None) -> tuple[list[dict[str, str]], str, str] | None:
        """The placeholder conversation, its render (with ``tools``) and the text that closes
        its answer; None when the template's renders do not extend one another."""
        key = json.dumps(tools, sort_keys=True) if tools else ""
        if key in self._probes:
            return self._probes[key]
        found = None
        for base in (list(_PROBE), list(_PROBE[1:])):  # some templates refuse a system message
            try:
                opened = self.text(base[:-1], True, tools)
                done = self.text(base, False, tools)
            except Exception:  # noqa: BLE001 - a template may raise on any role it refuses
                continue
            answer = base[-1]["content"]
            if done.startswith(opened + answer):
                found = base, done, done[len(opened) + len(answer):]
                break
        self._probes[key] = found
        return found


def _of_tokenizer(tokenizer: Any, end_texts: Mapping[int, str]) -> ChatTokens:
    """``ChatTokens.of``'s result from the tokenizer and its end ids (what it is rebuilt from when it
    is unpickled: a transformers tokenizer pickles)."""
    def render(messages: Messages, add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    def render_tools(messages: Messages, add_generation_prompt: bool, tools: Tools) -> str:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, tools=list(tools),
                                             add_generation_prompt=add_generation_prompt)

    def encode(text: str) -> list[int]:
        # the template already holds its special tokens: no BOS added again
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return ChatTokens(render, encode, end_texts, str(getattr(tokenizer, "name_or_path", "")), render_tools,
                      source=(_of_tokenizer, (tokenizer, dict(end_texts))))


def with_tools_in_system(messages: Messages, tools: Tools) -> list[Mapping[str, str]]:
    """``messages`` with the Hermes tool block at the end of the system message (a system
    message of its own first when there is none)."""
    block = tools_system_text(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = first.get("content", "") + "\n\n" + block
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


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
