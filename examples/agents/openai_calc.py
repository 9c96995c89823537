"""A calculator agent on the plain ``openai`` client: a chat with one tool, at most ``MAX_TURNS``
calls, each tool call answered with the calculator's result until the model answers in text.

``run(task, llm)`` is the ``entry`` of ``config/agent_openai.yaml``; ``solve`` takes any client,
so ``calc_cli.py`` runs the same agent as a command.
"""

from __future__ import annotations

import json
from typing import Any

from examples.agents.calc import INSTRUCTIONS, MAX_TURNS, TOOL, calculate, score


def tool_result(name: str, arguments: str) -> str:
    """What the model reads for its call: the calculator's result, or why the call is not one."""
    if name != "calculator":
        return f"error: no tool {name!r}; the only tool is calculator"
    try:
        expression = json.loads(arguments).get("expression")
    except (ValueError, AttributeError):
        return 'error: the arguments must be a JSON object {"expression": "..."}'
    return calculate(expression) if isinstance(expression, str) else 'error: give "expression" as a string'


def solve(task: dict[str, Any], client: Any, model: str, max_turns: int = MAX_TURNS) -> dict[str, Any]:
    """The agent on ``task`` with ``client`` (an ``openai.OpenAI``): its ``calc.score``."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS},
                                      {"role": "user", "content": task["question"]}]
    calls = 0
    for _ in range(max_turns):
        message = client.chat.completions.create(model=model, messages=messages, tools=[TOOL]).choices[0].message
        if not message.tool_calls:
            return score(task, message.content or "", calls)
        # the answer sent back as it came, so the next call extends this one (one segment)
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": tool_result(call.function.name, call.function.arguments)})
    return score(task, "", calls, stopped="max_turns")


def run(task: dict[str, Any], llm: Any) -> dict[str, Any]:
    return solve(task, llm.client, llm.model)
