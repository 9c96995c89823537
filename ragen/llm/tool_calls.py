"""Tool calls: the OpenAI function schemas an env declares, and the calls a model makes.

- ``check_tools(tools, where)``: a tool list as a config gives it, checked:
  each ``{"type": "function", "function": {"name", "description", "parameters"}}``
  with a unique name and ``parameters`` valid JSON Schema (``jsonschema``'s
  check of the schema's own draft); ValueError naming ``where`` and the tool.
- ``tools_system_text(tools)``: the Hermes/Qwen2.5 block that lists the tools in
  the system message, for a chat template that does not render ``tools=``.
- ``ToolCall`` (a call of a declared tool with arguments that match its
  parameters) and ``BadCall`` (what the model wrote and why it is not one).
- ``parse_hermes(text, tools)``: the ``<tool_call>{json}</tool_call>`` blocks
  of an answer, in order (hf and vLLM engines, or any engine's text);
  ``read_server_calls(tool_calls, tools)``: the ``tool_calls`` an
  OpenAI-compatible server parsed itself. ``PARSERS`` names both.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jsonschema

PARSERS = ("hermes", "server")
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
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.SchemaError as exc:
            path = "/".join(str(p) for p in exc.path) or "(root)"
            raise ValueError(f"{at} ({name}).function.parameters is not valid JSON Schema at {path}: "
                             f"{exc.message}") from None
    return [json.loads(json.dumps(t)) for t in tools]  # plain dicts and lists, as data crossing processes is


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
    """The calls of an answer, in order: each ``<tool_call>`` block after the answer's last
    ``</think>`` (its whole text when it has none). A block that is not closed (an answer
    cut at its token limit) is a ``BadCall``; so is JSON that is not a call of a declared
    tool with matching arguments."""
    think_end = text.rfind("</think>")
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
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(BadCall(body, f"not valid JSON: {exc}"))
            continue
        if not isinstance(call, dict):
            calls.append(BadCall(body, 'not a JSON object {"name": ..., "arguments": {...}}'))
            continue
        calls.append(_checked(body, call.get("name"), call.get("arguments", {}), tools))
    return calls


def read_server_calls(tool_calls: Sequence[Any], tools: Sequence[Mapping[str, Any]]) -> list[ToolCall | BadCall]:
    """The calls a server parsed (OpenAI's ``tool_calls``: ``{"function": {"name", "arguments"}}``,
    the arguments a JSON string), checked as ``parse_hermes`` checks its own."""
    calls: list[ToolCall | BadCall] = []
    for raw in tool_calls:
        function = raw.get("function") if isinstance(raw, Mapping) else None
        if not isinstance(function, Mapping):
            calls.append(BadCall(json.dumps(raw, default=str), 'not {"function": {"name", "arguments"}}'))
            continue
        arguments = function.get("arguments", "{}")
        body = json.dumps({"name": function.get("name"), "arguments": arguments}, default=str)
        calls.append(_checked(body, function.get("name"), arguments, tools))
    return calls


def _checked(body: str, name: Any, arguments: Any, tools: Sequence[Mapping[str, Any]]) -> ToolCall | BadCall:
    """The call of ``name`` with ``arguments`` (an object, or JSON text of one), or why it is not one."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if not isinstance(name, str) or name not in by_name:
        return BadCall(body, f"no tool is named {name!r} (the tools: {', '.join(by_name)})")
    if isinstance(arguments, str):  # OpenAI's form: the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return BadCall(body, f"the arguments of {name} are not valid JSON: {exc}")
    if not isinstance(arguments, dict):
        return BadCall(body, f"the arguments of {name} must be a JSON object, got {arguments!r:.80}")
    parameters = by_name[name].get("parameters")
    if parameters is not None:
        error = jsonschema.exceptions.best_match(_validator(json.dumps(parameters, sort_keys=True))
                                                 .iter_errors(arguments))
        if error is not None:
            where = "/".join(str(p) for p in error.path)
            return BadCall(body, f"the arguments of {name} do not match its parameters"
                                 f"{' at ' + where if where else ''}: {error.message}")
    return ToolCall(name, arguments)


@functools.lru_cache(maxsize=256)
def _validator(parameters: str) -> Any:
    """A validator of one tool's parameters (its JSON text: a key that hashes), built once."""
    schema = json.loads(parameters)
    return jsonschema.validators.validator_for(schema)(schema)
