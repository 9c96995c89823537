"""The gateway's answers in OpenAI's shapes: chat completions and completions, whole or as stream chunks.

``Answer`` is what a call came to: the text the client sees as ``content``, the tool
calls read from the model's text by the Hermes parser (the arguments as a JSON
string), the finish reason (``stop``, ``length`` or ``tool_calls``), the token
counts and the log-prob of each sampled token. A streamed call's chunks
(``ChatChunks``, ``TextChunks``) carry its text as it is sampled, then the
rest of the answer once it is whole.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from ragen.llm.tool_calls import CALL_OPEN, ToolCall, parse_hermes


@dataclass(frozen=True)
class Answer:
    """One call's answer."""

    id: str  # chatcmpl-... / cmpl-...
    model: str
    content: str
    calls: tuple[tuple[str, dict[str, Any]], ...]  # (name, arguments)
    finish_reason: str
    prompt_tokens: int
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    call_ids: tuple[str, ...] = ()

    @property
    def usage(self) -> dict[str, int]:
        n = len(self.response_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}


def read_answer(text: str, finish_reason: str, tools: Sequence[dict[str, Any]] | None,
                tool_choice: Any) -> tuple[str, tuple[tuple[str, dict[str, Any]], ...], str]:
    """The model's text as the client's content, tool calls and finish reason: with tools (and a
    tool choice other than none), the valid Hermes calls, the content then the text before
    the first; a call that is not valid stays in the content as the model wrote it."""
    if not tools or tool_choice == "none" or CALL_OPEN not in text:
        return text, (), finish_reason
    valid = [c for c in parse_hermes(text, tools) if isinstance(c, ToolCall)]
    if not valid or len(valid) != text.count(CALL_OPEN):
        return text, (), finish_reason
    content = text[:text.find(CALL_OPEN)].rstrip()
    return content, tuple((c.name, c.arguments) for c in valid), "tool_calls"


def answer_message(answer: Answer) -> dict[str, Any]:
    """The answer as an assistant message (its content, and its tool calls where it made any): what
    a call's record keeps, and what a call that extends it repeats."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.calls:
        message["tool_calls"] = tool_call_objects(answer)
    return message


def chat_completion(answer: Answer, decode: Callable[[list[int]], str] | None) -> dict[str, Any]:
    """A ``chat.completion`` object."""
    message = answer_message(answer)
    if answer.calls and not answer.content:
        message["content"] = None
    return {"id": answer.id, "object": "chat.completion", "created": int(time.time()), "model": answer.model,
            "choices": [{"index": 0, "message": message, "logprobs": _chat_logprobs(answer, decode),
                         "finish_reason": answer.finish_reason}],
            "usage": answer.usage}


class ChatChunks:
    """The ``chat.completion.chunk`` objects of one streamed call: ``head`` (the role, sent before
    the engine answers), ``delta`` (content as the engine samples it), then ``tail`` (the rest
    of the content with the answer's log-probs, its tool calls, the finish reason and, with
    ``include_usage``, a last chunk with the usage and no choices); ``error`` (the error body in
    place of the tail)."""

    named = False  # an event's line is its data alone

    def __init__(self, model: str, chunk_id: str, include_usage: bool,
                 decode: Callable[[list[int]], str] | None) -> None:
        self.base = {"id": chunk_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
        self.usage: dict[str, Any] = {"usage": None} if include_usage else {}
        self.include_usage = include_usage
        self.decode = decode

    def _chunk(self, delta: dict[str, Any], logprobs: Any = None, finish_reason: str | None = None) -> dict[str, Any]:
        return {**self.base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                          "finish_reason": finish_reason}], **self.usage}

    def head(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def delta(self, text: str) -> list[dict[str, Any]]:
        return [self._chunk({"content": text})] if text else []

    def tail(self, answer: Answer, rest: str) -> Iterator[dict[str, Any]]:
        logprobs = _chat_logprobs(answer, self.decode)
        if rest or logprobs is not None:
            yield self._chunk({"content": rest}, logprobs)
        if answer.calls:
            yield self._chunk({"tool_calls": [{"index": j, **c} for j, c in enumerate(tool_call_objects(answer))]})
        yield self._chunk({}, finish_reason=answer.finish_reason)
        if self.include_usage:
            yield {**self.base, "choices": [], "usage": answer.usage}

    @staticmethod
    def error(body: dict[str, Any]) -> list[dict[str, Any]]:
        return [body]


def text_completion(answer: Answer, decode: Callable[[list[int]], str] | None) -> dict[str, Any]:
    """A ``text_completion`` object."""
    return {"id": answer.id, "object": "text_completion", "created": int(time.time()), "model": answer.model,
            "choices": [{"index": 0, "text": answer.content, "logprobs": _text_logprobs(answer, decode),
                         "finish_reason": answer.finish_reason}],
            "usage": answer.usage}


class TextChunks:
    """The ``text_completion`` objects of one streamed completions call: ``delta`` (text as the
    engine samples it), then ``tail`` (the rest of the text with the answer's log-probs and
    finish reason, then, with ``include_usage``, the usage); ``error`` (the error body in place
    of the tail)."""

    named = False

    def __init__(self, model: str, chunk_id: str, include_usage: bool,
                 decode: Callable[[list[int]], str] | None) -> None:
        self.base = {"id": chunk_id, "object": "text_completion", "created": int(time.time()), "model": model}
        self.include_usage = include_usage
        self.decode = decode

    def head(self) -> list[dict[str, Any]]:
        return []

    def delta(self, text: str) -> list[dict[str, Any]]:
        return [{**self.base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}] \
            if text else []

    def tail(self, answer: Answer, rest: str) -> Iterator[dict[str, Any]]:
        yield {**self.base, "choices": [{"index": 0, "text": rest, "logprobs": _text_logprobs(answer, self.decode),
                                         "finish_reason": answer.finish_reason}]}
        if self.include_usage:
            yield {**self.base, "choices": [], "usage": answer.usage}

    @staticmethod
    def error(body: dict[str, Any]) -> list[dict[str, Any]]:
        return [body]


def tool_call_objects(answer: Answer) -> list[dict[str, Any]]:
    return [{"id": call_id, "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
            for call_id, (name, arguments) in zip(answer.call_ids, answer.calls)]


def _chat_logprobs(answer: Answer, decode: Callable[[list[int]], str] | None) -> dict[str, Any] | None:
    if answer.logprobs is None or decode is None:
        return None
    content = []
    for token_id, logprob in zip(answer.response_ids, answer.logprobs):
        text = decode([token_id])
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")),
                        "top_logprobs": []})
    return {"content": content}


def _text_logprobs(answer: Answer, decode: Callable[[list[int]], str] | None) -> dict[str, Any] | None:
    if answer.logprobs is None or decode is None:
        return None
    tokens = [decode([i]) for i in answer.response_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": list(answer.logprobs), "top_logprobs": None, "text_offset": offsets}
