"""Agent frameworks no one here wrote, run unchanged against the gateway but for their base URL
and key: the OpenAI Agents SDK (through its default Responses API and through chat
completions), LangGraph's ReAct agent on ``langchain-openai`` and smolagents' tool-calling
agent. Each plays a one-tool task on the scripted policy below; every call is recorded with
a log-prob for each sampled token, its segment and the cause of each break. Each test skips,
naming the package, where it is missing (the dev extra has them)."""

from __future__ import annotations

import asyncio

import pytest

from ragen.llm.tool_calls import call_text
from tests.test_gateway import serve

ANSWER = "It is sunny in Paris."


def weather_policy(prompt: str, rng) -> tuple[str, float] | None:
    """With the weather tool's result in the conversation, the answer (through smolagents'
    ``final_answer`` tool where it is listed); with the weather tool listed, a call of it."""
    if "weather_result" in prompt:
        if "final_answer" in prompt:
            return call_text("final_answer", {"answer": ANSWER}), -1.0
        return ANSWER, -1.0
    if "get_weather" in prompt:
        return call_text("get_weather", {"city": "Paris"}), -0.5
    return None


def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: The city's name.
    """
    return f"weather_result: sunny in {city}"


@pytest.fixture()
def gateway():
    from ragen.llm.scripted import ScriptedEngine

    with serve(engine=ScriptedEngine(answers="tests.test_gateway_agents:weather_policy")) as server:
        yield server


def _check_records(session, calls: int) -> None:
    records = session.records
    assert len(records) == calls and all(r.error is None for r in records)
    for r in records:
        assert r.logprobs is not None and len(r.logprobs) == len(r.response_ids) > 0
        assert r.segment >= 0 and (r.cause is None) == (r.prompt_start > 0)
    assert records[0].cause == "first"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_the_openai_agents_sdk_runs_a_function_tool(gateway, api):
    agents = pytest.importorskip("agents", reason="openai-agents (pip install openai-agents)")
    from openai import AsyncOpenAI

    session = gateway.open_session()
    client = AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)
    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel("any-model", client) if api == "responses" else \
        agents.OpenAIChatCompletionsModel("any-model", client)
    agent = agents.Agent(name="weather", instructions="You answer weather questions.", model=model,
                         tools=[agents.function_tool(get_weather)])
    result = asyncio.run(agents.Runner.run(agent, "What's the weather in Paris?"))
    assert ANSWER in result.final_output
    _check_records(session, 2)
    assert session.records[1].cause is None  # the tool round trip extends the first call's segment
    assert {r.endpoint for r in session.records} == {"responses" if api == "responses" else "chat.completions"}


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")  # langgraph 1.x; still its ReAct agent
def test_a_langgraph_react_agent_runs_a_tool(gateway):
    pytest.importorskip("langgraph", reason="langgraph (pip install langgraph)")
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai (pip install langchain-openai)")
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    session = gateway.open_session()
    model = langchain_openai.ChatOpenAI(model="any-model", base_url=gateway.base_url(session), api_key=session.key,
                                        max_retries=0)
    agent = create_react_agent(model, [tool(get_weather)])
    state = agent.invoke({"messages": [("user", "What's the weather in Paris?")]})
    assert ANSWER in state["messages"][-1].content
    _check_records(session, 2)
    assert session.records[1].cause is None


@pytest.mark.timeout(120)
def test_a_smolagents_tool_calling_agent_runs_a_tool(gateway):
    smolagents = pytest.importorskip("smolagents", reason="smolagents (pip install smolagents)")

    session = gateway.open_session()
    model = smolagents.OpenAIServerModel(model_id="any-model", api_base=gateway.base_url(session),
                                         api_key=session.key)
    agent = smolagents.ToolCallingAgent(tools=[smolagents.tool(get_weather)], model=model, max_steps=3)
    assert ANSWER in str(agent.run("What's the weather in Paris?"))
    _check_records(session, 2)
    # smolagents writes the history as text of its own (the call as "Calling tools: [...]", the
    # result as a user message): its second call does not repeat the first's answer, so it starts
    # a segment of its own, and says why
    assert session.records[1].cause == "history_rewritten"
