"""A calculator agent on LangGraph: ``create_react_agent`` (its prebuilt ReAct graph) over
``langchain-openai``'s ``ChatOpenAI`` on the episode's session, with one tool.

The graph's ``recursion_limit`` bounds it to ``MAX_TURNS`` model calls (each call and its tool
round are two steps of the graph); past it, the run ends with reward 0. The tool node answers a
call with bad arguments with an error the model reads, and a call whose arguments are not JSON
(``invalid_tool_calls``) ends the graph with that message as the final answer.
"""

from __future__ import annotations

import warnings
from typing import Any

import httpx
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

from examples.agents.calc import INSTRUCTIONS, MAX_TURNS, calculate, score


def run(task: dict[str, Any], llm: Any) -> dict[str, Any]:
    calls = 0

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression of numbers, + - * / and parentheses, e.g. 37 * 41 + 5."""
        nonlocal calls
        calls += 1
        return calculate(expression)

    # an HTTP client of its own, closed as the episode ends (ChatOpenAI's default is cached per base URL)
    with httpx.Client() as http:
        model = ChatOpenAI(model=llm.model, base_url=llm.base_url, api_key=llm.api_key, http_client=http)
        with warnings.catch_warnings():  # langgraph 1.x: "create_react_agent has been moved"; still its ReAct graph
            warnings.filterwarnings("ignore", message="create_react_agent has been moved")
            agent = create_react_agent(model, [calculator], prompt=INSTRUCTIONS)
        try:
            state = agent.invoke({"messages": [("user", task["question"])]}, {"recursion_limit": 2 * MAX_TURNS})
        except GraphRecursionError:
            return score(task, "", calls, stopped="recursion_limit")
    return score(task, str(state["messages"][-1].content), calls)
