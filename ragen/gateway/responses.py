"""The Responses API's subset that the OpenAI Agents SDK uses by default: text and function calls.

``read_responses`` turns a ``/v1/responses`` request into the ``ChatCall`` the gateway
plays: ``instructions`` as the system message; ``input`` as text or as items (messages
with text content, ``function_call`` items, which join the assistant message before them
as its tool calls, and ``function_call_output`` items, as tool messages); tools in the
Responses form (``{"type": "function", "name", "parameters"}``). A call that repeats the
previous response's output items therefore extends its segment, as a chat call does.
``previous_response_id`` is refused (nothing is stored: send the whole input).
``response_object`` and ``response_events`` give the answer back as a ``response`` and
as its stream of events (``response.created`` ... ``response.completed``).
"""

from __future__ import annotations

import time
from typing import Any, Iterator

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


def response_events(answer: Answer | None, call: ChatCall, response_id: str) -> Iterator[dict[str, Any]]:
    """The stream of a response: ``response.created`` and ``response.in_progress`` first (``answer``
    None: only those, sent before the answer is there), then each output item added, its text or
    arguments, and done, then ``response.completed`` with the whole response."""
    if answer is None:
        shell = Answer(response_id, call.model, "", (), "stop", 0, (), None)
        for kind in ("response.created", "response.in_progress"):
            yield {"type": kind, "response": response_object(shell, call, "in_progress")}
        return
    for index, item in enumerate(output_items(answer)):
        yield from _item_events(index, item)
    yield {"type": "response.completed", "response": response_object(answer, call)}


def _item_events(index: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    where = {"output_index": index, "item_id": item["id"]}
    if item["type"] == "message":
        text = item["content"][0]["text"]
        yield {"type": "response.output_item.added", "output_index": index,
               "item": {**item, "status": "in_progress", "content": []}}
        part = {"type": "output_text", "text": "", "annotations": []}
        yield {"type": "response.content_part.added", **where, "content_index": 0, "part": part}
        yield {"type": "response.output_text.delta", **where, "content_index": 0, "delta": text}
        yield {"type": "response.output_text.done", **where, "content_index": 0, "text": text}
        yield {"type": "response.content_part.done", **where, "content_index": 0, "part": {**part, "text": text}}
    else:
        yield {"type": "response.output_item.added", "output_index": index,
               "item": {**item, "arguments": "", "status": "in_progress"}}
        yield {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]}
        yield {"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]}
    yield {"type": "response.output_item.done", "output_index": index, "item": item}
