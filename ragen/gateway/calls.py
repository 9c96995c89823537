"""A client's request read into what the gateway plays: ``read_chat`` (``/v1/chat/completions``)
and ``read_text`` (``/v1/completions``). Every field is checked; a wrong one is an ``ApiError``
(400) naming it.

Messages are read into three forms: ``shown`` (what the chat template renders: the role, the
content as text, an assistant's tool calls written in the Hermes form the model writes them
in, a tool message's ``tool_call_id``), ``said`` (what a call must repeat to extend the
one before: each message's role, text and tool calls by name and arguments; tool call ids
are left out, as clients renumber them), and ``kept`` (what a call's record keeps: an OpenAI
chat message with the role, the content as text, an assistant's ``tool_calls`` and a tool
message's ``tool_call_id``, which ``read_chat`` reads back to the same ``shown`` and ``said``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ragen.gateway.api_error import ApiError, bad_field
from ragen.llm.tool_calls import call_text, check_tools

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "none", "required")
MAX_STOPS = 4  # OpenAI's


@dataclass(frozen=True)
class Sampling:
    """What the client asked of the sampler (the rollout's settings win over most of it)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(frozen=True)
class ChatCall:
    """A chat completions request, read."""

    model: str
    shown: list[dict[str, str]]
    said: tuple[tuple[Any, ...], ...]
    kept: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any  # "auto" | "none" | "required" | a function's name (str in a one-item tuple)
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class TextCall:
    """A completions request, read: the prompt as text or as token ids."""

    model: str
    prompt_text: str | None
    prompt_ids: list[int] | None
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def read_chat(body: Any, max_messages: int) -> ChatCall:
    """``body`` of ``/v1/chat/completions`` as a ``ChatCall``."""
    body = _object(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_field("messages", "a non-empty list of messages", raw)
    if len(raw) > max_messages:
        raise ApiError(400, f"messages holds {len(raw)} messages, more than this gateway's bound of {max_messages}",
                       param="messages", code="too_many_messages")
    read = [_message(m, f"messages[{i}]") for i, m in enumerate(raw)]
    tools = _tools(body.get("tools"))
    return ChatCall(model=_model(body), shown=[r[0] for r in read], said=tuple(r[1] for r in read),
                    kept=[r[2] for r in read], tools=tools,
                    tool_choice=_tool_choice(body.get("tool_choice"), tools), sampling=_sampling(body, chat=True),
                    stream=_stream(body), include_usage=_include_usage(body))


def read_text(body: Any) -> TextCall:
    """``body`` of ``/v1/completions`` as a ``TextCall``."""
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    text, ids = None, None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        ids = list(prompt)
    else:
        raise bad_field("prompt", "a string or a non-empty list of token ids (one prompt: a batch is refused)",
                        prompt)
    if body.get("echo"):
        raise bad_field("echo", "false (the prompt is not echoed)", body.get("echo"))
    return TextCall(model=_model(body), prompt_text=text, prompt_ids=ids, sampling=_sampling(body, chat=False),
                    stream=_stream(body), include_usage=_include_usage(body))


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise bad_field("n", "1 (one choice a call: each call is one sample of the policy)", n)
    return body


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise bad_field("model", "a string (any name: the session's engine answers)", model)
    return model


def _message(m: Any, where: str) -> tuple[dict[str, str], tuple[Any, ...], dict[str, Any]]:
    if not isinstance(m, dict):
        raise bad_field(where, "an object with role and content", m)
    role = m.get("role")
    if role not in ROLES:
        raise bad_field(f"{where}.role", f"one of {', '.join(ROLES)}", role)
    text = _content(m.get("content"), f"{where}.content", optional=role == "assistant")
    role = "system" if role == "developer" else role
    calls = _tool_calls(m.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else ()
    shown = {"role": role, "content": "\n".join([text] * bool(text) + [call_text(n, a) for n, a in calls])}
    if role == "tool":
        call_id = m.get("tool_call_id", "")
        if not isinstance(call_id, str):
            raise bad_field(f"{where}.tool_call_id", "a string", call_id)
        shown["tool_call_id"] = call_id
    said = (role, text, tuple((n, json.dumps(a, sort_keys=True)) for n, a in calls))
    kept: dict[str, Any] = {"role": role, "content": text}
    if calls:
        ids = [c.get("id") for c in m["tool_calls"]]
        kept["tool_calls"] = [{**({"id": i} if isinstance(i, str) else {}), "type": "function",
                               "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}}
                              for i, (n, a) in zip(ids, calls)]
    if role == "tool":
        kept["tool_call_id"] = shown["tool_call_id"]
    return shown, said, kept


def _content(content: Any, where: str, optional: bool) -> str:
    """A message's content as text: a string, or the text of a list of text parts."""
    if content is None and optional:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_text", "output_text") or not isinstance(part.get("text"), str):
                raise bad_field(f"{where}[{j}]", 'a text part {"type": "text", "text": ...} (only text is served)',
                                part)
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_field(where, "a string or a list of text parts", content)


def _tool_calls(calls: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """An assistant message's tool calls as (name, arguments)."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise bad_field(where, "a list of tool calls", calls)
    read = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise bad_field(f"{where}[{j}].function.name", "a string", name)
        arguments = function.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise bad_field(f"{where}[{j}].function.arguments", "a JSON object (as a string)", arguments)
        read.append((name, parsed))
    return read


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None or tools == []:
        return None
    try:
        return check_tools(tools, "tools")
    except ValueError as exc:
        raise ApiError(400, str(exc), param="tools", code="invalid_value") from None


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> Any:
    if choice is None:
        return "auto" if tools else "none"
    if choice in TOOL_CHOICES:
        if choice != "none" and not tools:
            raise bad_field("tool_choice", "'none' or absent when no tools are given", choice)
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    names = [t["function"]["name"] for t in tools or ()]
    if name not in names:
        raise bad_field("tool_choice", f"'auto', 'none', 'required' or one of the tools ({', '.join(names)})",
                        choice)
    return (name,)


def _sampling(body: Mapping[str, Any], chat: bool) -> Sampling:
    max_tokens = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None \
        else body.get("max_tokens")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise bad_field("max_tokens", "an integer >= 1", max_tokens)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad_field("seed", "an integer", seed)
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise bad_field("stop", f"a string or a list of at most {MAX_STOPS} non-empty strings", stop)
    logprobs, top = body.get("logprobs"), body.get("top_logprobs", 0)
    if chat and not isinstance(logprobs, (bool, type(None))):
        raise bad_field("logprobs", "true or false", logprobs)
    if not chat and logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= 5):
        raise bad_field("logprobs", "null or an integer from 0 to 5", logprobs)
    if top is not None and (not _is_int(top) or not 0 <= top <= 20):
        raise bad_field("top_logprobs", "an integer from 0 to 20", top)
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stops,
                    logprobs=bool(logprobs) if chat else logprobs is not None, top_logprobs=top or 0)


def _number(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or not low <= value <= high:
        raise bad_field(key, f"a number from {low:g} to {high:g}", value)
    return float(value)


def _stream(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, (bool, type(None))):
        raise bad_field("stream", "true or false", stream)
    return bool(stream)


def _include_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_field("stream_options", "an object", options)
    return bool(options.get("include_usage", False))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
