"""A calculator agent on smolagents: a ``ToolCallingAgent`` with one ``Tool``, on
``OpenAIServerModel`` (smolagents' OpenAI client) pointed at the episode's session.

smolagents writes its history as text of its own (a call as "Calling tools: [...]", its result as
a user message), so each of its calls starts a segment of its own (docs/agents.md, *What is
recorded*): an episode trains as one sample per call. It answers through its ``final_answer``
tool. ``max_steps`` bounds it to ``MAX_TURNS`` model calls: ``MAX_TURNS - 1`` steps, and where no
step gave a final answer, the one call smolagents then makes for it. A step whose answer is no
call, or a call it cannot run, is an error the model reads in the next step.
"""

from __future__ import annotations

from typing import Any

import smolagents

from examples.agents.calc import INSTRUCTIONS, MAX_TURNS, calculate, score


class Calculator(smolagents.Tool):
    """The calculator as a smolagents tool; ``calls`` counts the times it ran."""

    name = "calculator"
    description = "Evaluate an arithmetic expression of numbers, + - * / and parentheses."
    inputs = {"expression": {"type": "string", "description": "The expression, e.g. 37 * 41 + 5"}}
    output_type = "string"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, expression: str) -> str:
        self.calls += 1
        return calculate(expression)


def run(task: dict[str, Any], llm: Any) -> dict[str, Any]:
    calculator = Calculator()
    model = smolagents.OpenAIServerModel(model_id=llm.model, api_base=llm.base_url, api_key=llm.api_key)
    agent = smolagents.ToolCallingAgent(tools=[calculator], model=model, instructions=INSTRUCTIONS,
                                        max_steps=MAX_TURNS - 1, verbosity_level=smolagents.LogLevel.OFF)
    final = agent.run(task["question"])
    return score(task, "" if final is None else str(final), calculator.calls)
