"""The Responses API's subset that the OpenAI Agents SDK uses by default: text and function calls.

``read_responses`` turns a ``/v1/responses`` request into the ``ChatCall`` the gateway
plays: ``instructions`` as the system message; ``input`` as text or as items (messages
with text content, ``function_call`` items, which join the assistant message before them
as its tool calls, and ``function_call_output`` items, as tool messages); tools in the
Responses form (``{"type": "function", "name", "parameters"}``). A call that repeats the
previous response's output items therefore extends its segment, as a chat call does.
``previous_response_id`` is refused (nothing is stored: send the whole input).
``response_object`` and ``ResponseEvents`` give the answer back as a ``response`` and
as its stream of events (``response.created`` ... ``response.completed``), its text
streamed as the engine samples it.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Iterable, Iterator

from ragen.gateway.api_error import ApiError, bad_field
from ragen.gateway.calls import ChatCall, read_chat
from ragen.gateway.replies import Answer, tool_call_objects

_IGNORED_ITEMS = ("reasoning",)  # items the gateway's own answers never hold; a client may echo another's


def read_responses(body: Any, max_messages: int) -> ChatCall:
    """``body`` of ``/v1/responses`` as a ``ChatCall`` (``ApiError`` 400 naming the field)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    if body.get("previous_response_id") is not None:
        raise bad_field("previous_response_id", "null: responses are not stored, send the whole input",
                        body["previous_response_id"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_field("instructions", "a string", instructions)
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += _messages(body.get("input"))
    chat = {"model": body.get("model", ""), "messages": messages, "tools": _tools(body.get("tools")),
            "tool_choice": _tool_choice(body.get("tool_choice")), "stream": body.get("stream", False),
            "max_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p")}
    try:
        return read_chat(chat, max_messages)
    except ApiError as exc:  # name the field as the client sent it
        raise ApiError(exc.status, _responses_names(exc.message), param=_responses_names(exc.param or "") or None,
                       code=exc.code) from None


def _messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_field("input", "a string or a non-empty list of input items", items)
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": item.get("content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if not isinstance(call["id"], str):
                raise bad_field(f"input[{i}].call_id", "a string", call["id"])
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise bad_field(f"input[{i}].output", "a string", output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": output})
        elif kind not in _IGNORED_ITEMS:
            raise bad_field(f"input[{i}].type", "message, function_call or function_call_output", kind)
    return messages


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise bad_field("tools", "a list of function tools", tools)
    out = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_field(f"tools[{j}]", 'a function tool {"type": "function", "name", "parameters"} '
                            "(only function tools are served)", tool)
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":  # {"type": "function", "name": ...}
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _responses_names(text: str) -> str:
    """A chat field's name as the Responses API calls it."""
    return text.replace("max_tokens", "max_output_tokens").replace("messages", "input")


def response_object(answer: Answer, call: ChatCall, status: str = "completed") -> dict[str, Any]:
    """A ``response`` object of ``answer`` (``status`` in_progress: before it, with no output)."""
    usage = answer.usage
    done = status != "in_progress"
    incomplete = done and answer.finish_reason == "length"
    return {
        "id": answer.id, "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if incomplete else status, "background": False, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": None, "max_output_tokens": call.sampling.max_tokens, "max_tool_calls": None,
        "model": answer.model, "output": output_items(answer) if done else [], "parallel_tool_calls": True,
        "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
        "store": False, "temperature": call.sampling.temperature, "text": {"format": {"type": "text"}},
        "tool_choice": "auto", "tools": [{"type": "function", **t["function"]} for t in call.tools or ()],
        "top_logprobs": 0, "top_p": call.sampling.top_p, "truncation": "disabled",
        "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]} if done else None,
        "user": None, "metadata": {},
    }


def output_items(answer: Answer) -> list[dict[str, Any]]:
    """The answer's output items: its text as a message (where it has text), then each call."""
    items: list[dict[str, Any]] = []
    if answer.content or not answer.calls:
        items.append({"type": "message", "id": f"msg_{answer.id}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": answer.content, "annotations": []}]})
    for call in tool_call_objects(answer):
        items.append({"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


class ResponseEvents:
    """The events of one streamed response, numbered: ``head`` (``response.created`` and
    ``response.in_progress``, sent before the engine answers), ``delta`` (the message item
    opened at its first text, then its text as the engine samples it), then ``tail`` (the
    rest of its text and the message done, each function call item, ``response.completed``
    with the whole response); ``error`` (an error event in place of the tail)."""

    named = True  # each event's line names its type, as the Responses API's stream does

    def __init__(self, call: ChatCall, response_id: str) -> None:
        self.call = call
        self.id = response_id
        self._numbers = itertools.count()
        self._opened = False  # the message item is open: its text is streaming

    def _numbered(self, events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**event, "sequence_number": next(self._numbers)} for event in events]

    def head(self) -> list[dict[str, Any]]:
        shell = response_object(Answer(self.id, self.call.model, "", (), "stop", 0, (), None), self.call, "in_progress")
        return self._numbered({"type": kind, "response": shell} for kind in ("response.created",
                                                                                "response.in_progress"))

    def delta(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        opening = [] if self._opened else list(_message_opened(0, f"msg_{self.id}"))
        self._opened = True
        return self._numbered(opening + [_text_delta(0, f"msg_{self.id}", text)])

    def tail(self, answer: Answer, rest: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for index, item in enumerate(output_items(answer)):
            if item["type"] == "message" and self._opened:
                events += [_text_delta(index, item["id"], rest)] if rest else []
                events += _message_closed(index, item)
            else:
                events += _item_events(index, item)
        events.append({"type": "response.completed", "response": response_object(answer, self.call)})
        return self._numbered(events)

    def error(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        return self._numbered([{"type": "error", **body}])


def _message_opened(index: int, item_id: str) -> Iterator[dict[str, Any]]:
    yield {"type": "response.output_item.added", "output_index": index,
           "item": {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}}
    yield {"type": "response.content_part.added", "output_index": index, "item_id": item_id, "content_index": 0,
           "part": {"type": "output_text", "text": "", "annotations": []}}


def _text_delta(index: int, item_id: str, text: str) -> dict[str, Any]:
    return {"type": "response.output_text.delta", "output_index": index, "item_id": item_id, "content_index": 0,
            "delta": text}


def _message_closed(index: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    where = {"output_index": index, "item_id": item["id"]}
    text = item["content"][0]["text"]
    yield {"type": "response.output_text.done", **where, "content_index": 0, "text": text}
    yield {"type": "response.content_part.done", **where, "content_index": 0,
           "part": {"type": "output_text", "text": text, "annotations": []}}
    yield {"type": "response.output_item.done", "output_index": index, "item": item}


def _item_events(index: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A whole output item's events: added, its text or arguments, done."""
    if item["type"] == "message":
        yield from _message_opened(index, item["id"])
        yield _text_delta(index, item["id"], item["content"][0]["text"])
        yield from _message_closed(index, item)
        return
    where = {"output_index": index, "item_id": item["id"]}
    yield {"type": "response.output_item.added", "output_index": index,
           "item": {**item, "arguments": "", "status": "in_progress"}}
    yield {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]}
    yield {"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]}
    yield {"type": "response.output_item.done", "output_index": index, "item": item}
