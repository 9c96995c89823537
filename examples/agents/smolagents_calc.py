"""A calculator agent on smolagents: a ``ToolCallingAgent`` with one ``Tool``, on
``OpenAIServerModel`` (smolagents' OpenAI client) pointed at the episode's session.

smolagents writes its history as text of its own (a call as "Calling tools: [...]", its result as
a user message), so each of its calls starts a segment of its own (docs/agents.md, *What is
recorded*): an episode trains as one sample per call. It answers through its ``final_answer``
tool. ``max_steps`` bounds it to ``MAX_TURNS`` model calls: ``MAX_TURNS - 1`` steps, and where no
step gave a final answer, the one call smolagents then makes for it. A step whose answer is no
call, or a call it cannot run, is an error the model reads in the next step.

Its system prompt is a short one (``SYSTEM_PROMPT``), in place of smolagents' default of about
900 tokens of worked examples: every call carries it again, in a sample of its own, and on a CPU
the default made a training step of 8 episodes take over ten minutes. smolagents' other
templates are its own.
"""

from __future__ import annotations

import importlib.resources
from typing import Any

import smolagents
import yaml

from examples.agents.calc import INSTRUCTIONS, MAX_TURNS, calculate, score


SYSTEM_PROMPT = """You solve tasks with tool calls: call one tool at a time, and give your final answer by \
calling final_answer.
{%- if custom_instructions %}
{{ custom_instructions }}
{%- endif %}"""


def prompt_templates() -> dict[str, Any]:
    """smolagents' templates for a ``ToolCallingAgent``, with ``SYSTEM_PROMPT`` as its system prompt."""
    source = importlib.resources.files("smolagents.prompts").joinpath("toolcalling_agent.yaml")
    return {**yaml.safe_load(source.read_text()), "system_prompt": SYSTEM_PROMPT}


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
    agent = smolagents.ToolCallingAgent(tools=[calculator], model=model, prompt_templates=prompt_templates(),
                                        instructions=INSTRUCTIONS, max_steps=MAX_TURNS - 1,
                                        verbosity_level=smolagents.LogLevel.OFF)
    final = agent.run(task["question"])
    return score(task, "" if final is None else str(final), calculator.calls)
