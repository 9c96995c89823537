"""Tool calls: the OpenAI function schemas an env declares, and the calls a model makes.

- ``check_tools(tools, where)``: a tool list as a config gives it, checked:
  each ``{"type": "function", "function": {"name", "description", "parameters"}}``
  with a unique name and ``parameters`` a JSON Schema that a call can be checked
  against in bounded time (``ragen.llm.tool_schema``); ValueError naming ``where``
  and the tool. ``declared_tools(config, where)``: those an env config declares, checked so.
- ``tools_system_text(tools)``: the Hermes/Qwen2.5 block that lists the tools in
  the system message, for a chat template that does not render ``tools=``.
- ``ToolCall`` (a call of a declared tool with arguments that match its
  parameters) and ``BadCall`` (what the model wrote and why it is not one).
- ``parse_hermes(text, tools)``: the ``<tool_call>{json}</tool_call>`` blocks
  of an answer, in order (hf and vLLM engines, or any engine's text);
  ``read_server_calls(tool_calls, tools)``: the ``tool_calls`` an
  OpenAI-compatible server parsed itself. ``PARSERS`` names both.

Both parsers never raise on what a model wrote: JSON nested deeper than
``MAX_NESTING``, an integer longer than Python reads (4,300 digits), a number
no float holds, an escaped lone surrogate, or arguments that do not match the
schema (or whose ``pattern`` searches pass the answer's budget) are a ``BadCall``
saying why, which the turn loop shows the model with the format penalty.
"""

from __future__ import annotations

import json
import math
import reprlib
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jsonschema
from referencing.exceptions import Unresolvable

from ragen.errors import RagenError
from ragen.llm.tool_schema import PatternTimeout, check_parameters, pattern_budget, validator

PARSERS = ("hermes", "server")
# the deepest [ and { a call may nest: far beyond any tool's arguments, far within the recursion
# limit of the JSON reader, the schema check, and the pickling of a trajectory
MAX_NESTING = 64
MAX_ERROR_CHARS = 300  # a BadCall's reason at most (a schema error quotes the value it refused)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_FORMAT = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
# the answer after the thoughts when a turn's actions are tool calls
FORMAT_TOOLS = ('<think> [Your thoughts] </think> followed by one or more tool calls, each '
                '<tool_call> {"name": <function-name>, "arguments": <args-json-object>} </tool_call>')


@dataclass(frozen=True)
class ToolCall:
    """A call of a declared tool, its arguments matching the tool's parameters."""

    name: str
    arguments: dict[str, Any]

    def action(self) -> dict[str, Any]:
        """What the env's ``step`` receives: ``{"name": ..., "arguments": {...}}``."""
        return {"name": self.name, "arguments": self.arguments}

    @property
    def text(self) -> str:
        """The call as one line of JSON (a turn's action, as records show it)."""
        return json.dumps(self.action(), ensure_ascii=False)


@dataclass(frozen=True)
class BadCall:
    """A call the model wrote that is not a ``ToolCall``: its text and why."""

    text: str
    error: str


def check_tools(tools: Any, where: str) -> list[dict[str, Any]]:
    """``tools`` as plain OpenAI function schemas; ValueError naming ``where`` when one is not."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ValueError(f"{where}: tools must be a non-empty list of OpenAI function schemas "
                         f'({{"type": "function", "function": {{"name", "description", "parameters"}}}}), '
                         f"got {tools!r:.80}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"{where}: tools[{i}]"
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(function, Mapping):
            raise ValueError(f'{at} must be {{"type": "function", "function": {{...}}}}, got {tool!r:.80}')
        name = function.get("name")
        if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{at}.function.name must be a name of letters, digits, _ and -, got {name!r}")
        if name in names:
            raise ValueError(f"{at}: two tools are named {name!r}")
        names.add(name)
        if not isinstance(function.get("description", ""), str):
            raise ValueError(f"{at}.function.description must be a string")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
            raise ValueError(f'{at} ({name}).function.parameters must be a JSON Schema of "type": "object" '
                             f"(the arguments are an object), got {parameters!r:.80}")
        check_parameters(parameters, f"{at} ({name}).function.parameters")
    return [json.loads(json.dumps(t)) for t in tools]  # plain dicts and lists, as data crossing processes is


def declared_tools(config: Any, where: str) -> list[dict[str, Any]] | None:
    """The tools an env's config (its built config object, or a plain dict) declares in ``tools``,
    checked by ``check_tools``; None when it declares none."""
    tools = config.get("tools") if isinstance(config, Mapping) else getattr(config, "tools", None)
    return None if tools is None else check_tools(tools, where)


def tools_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool list as the Hermes/Qwen2.5 chat template writes it into the system message."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and "
            f"arguments within <tool_call></tool_call> XML tags:\n{CALL_FORMAT}")


def call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """A call as the Hermes form writes it (what a scripted policy answers)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)}, ensure_ascii=False)}\n{CALL_CLOSE}"


def parse_hermes(text: str, tools: Sequence[Mapping[str, Any]]) -> list[ToolCall | BadCall]:
    """The calls of an answer, in order: each ``<tool_call>`` block after the answer's first
    ``</think>`` (its whole text when it has none), as reasoning parsers split an answer: a
    ``</think>`` a call's argument holds is the call's text. A block that is not closed (an answer
    cut at its token limit) is a ``BadCall``; so is JSON that is not a call of a declared
    tool with matching arguments."""
    with pattern_budget():  # one answer's calls share it
        return _hermes_calls(text, tools)


def _hermes_calls(text: str, tools: Sequence[Mapping[str, Any]]) -> list[ToolCall | BadCall]:
    think_end = text.find("</think>")
    start = think_end + len("</think>") if think_end >= 0 else 0
    calls: list[ToolCall | BadCall] = []
    while (opened := text.find(CALL_OPEN, start)) >= 0:
        body_start = opened + len(CALL_OPEN)
        closed = text.find(CALL_CLOSE, body_start)
        if closed < 0:
            calls.append(BadCall(text[opened:], f"{CALL_OPEN} is not closed with {CALL_CLOSE}"))
            break
        body = text[body_start:closed].strip()
        start = closed + len(CALL_CLOSE)
        call, why = _json(body)
        if why is not None:
            calls.append(BadCall(body, why))
            continue
        if not isinstance(call, dict):
            calls.append(BadCall(body, 'not a JSON object {"name": ..., "arguments": {...}}'))
            continue
        calls.append(_checked(body, call.get("name"), call.get("arguments", {}), tools))
    return calls


def read_server_calls(tool_calls: Sequence[Any], tools: Sequence[Mapping[str, Any]]) -> list[ToolCall | BadCall]:
    """The calls a server parsed (OpenAI's ``tool_calls``: ``{"function": {"name", "arguments"}}``,
    the arguments a JSON string), checked as ``parse_hermes`` checks its own."""
    with pattern_budget():  # one answer's calls share it
        return [_server_call(raw, tools) for raw in tool_calls]


def _server_call(raw: Any, tools: Sequence[Mapping[str, Any]]) -> ToolCall | BadCall:
    function = raw.get("function") if isinstance(raw, Mapping) else None
    if not isinstance(function, Mapping):
        return BadCall(_shown(raw), 'not {"function": {"name", "arguments"}}')
    name, arguments = function.get("name"), function.get("arguments", "{}")
    try:
        if not isinstance(arguments, str):  # a server that decoded them: checked as their text is
            arguments = json.dumps(arguments, default=str)
        body = json.dumps({"name": name, "arguments": arguments}, default=str)
    except (RecursionError, ValueError) as exc:  # decoded values nested thousands deep, or a huge integer
        return BadCall(_shown(function), f"the call is {_unreadable(exc)}")
    return _checked(body, name, arguments, tools)


def _shown(value: Any) -> str:
    """A value a server decoded, as a ``BadCall`` records it: cut in depth and length, never raising."""
    try:
        return reprlib.repr(value)
    except ValueError:  # an integer past int's string limit
        return f"<a {type(value).__name__} too large to show>"


class _NotFinite(RagenError, ValueError):
    """A number JSON a model wrote reads as NaN or infinite (``NaN``, ``Infinity``, ``1e999``)."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(text)
    return value


def _no_constant(text: str) -> float:
    raise _NotFinite(text)


def _json(text: str) -> tuple[Any, str | None]:
    """``text`` read as JSON, or None and why it is not JSON this reader takes (model output: it
    may be nested thousands deep, hold an integer of thousands of digits, or a number no float holds)."""
    if _nested_deeper(text, MAX_NESTING):
        return None, f"nested deeper than {MAX_NESTING} levels of [ and {{"
    try:
        value = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON: {exc}"
    except (ValueError, RecursionError) as exc:  # ValueError: an integer longer than int's string limit
        return None, _unreadable(exc)
    if "\\u" in text:  # an escape may decode to a lone surrogate, which no UTF-8 record or file can hold
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError as exc:
            return None, f"not valid JSON here: {exc.object[exc.start]!r} is a lone surrogate, not text"
    return value, None


def _unreadable(exc: Exception) -> str:
    """Why JSON a model wrote cannot be read or written here (``exc``: what the reader raised)."""
    if isinstance(exc, RecursionError):
        return f"nested deeper than {MAX_NESTING} levels of [ and {{"
    if isinstance(exc, _NotFinite):
        return f"not valid JSON here: the number {str(exc)[:40]} is not a finite float"
    return f"not valid JSON here: an integer of more than {sys.get_int_max_str_digits()} digits"


def _nested_deeper(text: str, limit: int) -> bool:
    """Whether ``text``'s [ and { (outside JSON strings) nest deeper than ``limit``: read in one pass,
    before a recursive reader meets them."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def _checked(body: str, name: Any, arguments: Any, tools: Sequence[Mapping[str, Any]]) -> ToolCall | BadCall:
    """The call of ``name`` with ``arguments`` (an object, or JSON text of one), or why it is not one."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if not isinstance(name, str) or name not in by_name:
        return BadCall(body, _short(f"no tool is named {name!r} (the tools: {', '.join(by_name)})"))
    if isinstance(arguments, str):  # OpenAI's form: the arguments as JSON text
        arguments, why = _json(arguments)
        if why is not None:
            return BadCall(body, f"the arguments of {name} are {why}")
    if not isinstance(arguments, dict):
        return BadCall(body, f"the arguments of {name} must be a JSON object, got {arguments!r:.80}")
    parameters = by_name[name].get("parameters")
    if parameters is not None:
        try:
            error = jsonschema.exceptions.best_match(validator(json.dumps(parameters, sort_keys=True))
                                                     .iter_errors(arguments))
        except PatternTimeout as exc:
            return BadCall(body, _short(f"the arguments of {name} cannot be checked against its parameters: {exc}"))
        # ArithmeticError: a huge integer against a float's multipleOf; RecursionError, Unresolvable: tools
        # that did not pass check_tools (a caller's own), a recursive or remote $ref (never fetched)
        except (RecursionError, ArithmeticError, Unresolvable) as exc:
            return BadCall(body, _short(f"the arguments of {name} cannot be checked against its parameters: "
                                        f"{type(exc).__name__}: {exc}"))
        if error is not None:
            where = "/".join(str(p) for p in error.path)
            return BadCall(body, _short(f"the arguments of {name} do not match its parameters"
                                        f"{' at ' + where if where else ''}: {_schema_reason(error)}"))
    return ToolCall(name, arguments)


def _schema_reason(error: Any) -> str:
    """jsonschema's message, or for a length bound the lengths (its message quotes the whole value)."""
    if error.validator in ("maxLength", "minLength") and isinstance(error.instance, str):
        return f"{len(error.instance)} characters, where its {error.validator} is {error.validator_value}"
    return error.message


def _short(reason: str) -> str:
    """A reason the model reads, cut to ``MAX_ERROR_CHARS`` (a schema's message quotes the whole value)."""
    return reason if len(reason) <= MAX_ERROR_CHARS else reason[:MAX_ERROR_CHARS - 3] + "..."
