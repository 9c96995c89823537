"""A calculator agent on the OpenAI Agents SDK (``agents``, pip install openai-agents): an
``Agent`` with one ``function_tool``, run by ``Runner`` for at most ``MAX_TURNS`` model calls,
through the SDK's default Responses API on the episode's session.

The SDK answers a call with bad arguments with an error the model reads (its tool's
``failure_error_function``); what it raises for a model that misbehaves (``ModelBehaviorError``)
or gives no final answer within the turns (``MaxTurnsExceeded``) ends the run with reward 0, not
in error: a bad answer is the model's to learn from. Any other error is the episode's.
"""

from __future__ import annotations

from typing import Any

import agents

from examples.agents.calc import INSTRUCTIONS, MAX_TURNS, calculate, score


async def run(task: dict[str, Any], llm: Any) -> dict[str, Any]:
    agents.set_tracing_disabled(True)  # else the SDK sends its traces to OpenAI
    calls = 0

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

        Args:
            expression: The expression, e.g. 37 * 41 + 5
        """
        nonlocal calls
        calls += 1
        return calculate(expression)

    model = agents.OpenAIResponsesModel(llm.model, llm.async_client)
    agent = agents.Agent(name="calculator", instructions=INSTRUCTIONS, model=model, tools=[calculator])
    try:
        result = await agents.Runner.run(agent, task["question"], max_turns=MAX_TURNS)
    except (agents.MaxTurnsExceeded, agents.ModelBehaviorError) as exc:  # the model's doing
        return score(task, "", calls, stopped=type(exc).__name__)
    return score(task, str(result.final_output), calls)
