"""Agent examples: one calculator agent for each way of writing one, each trained by
``python train.py --config-name agent_<name>`` (docs/agents.md, *Examples*).

- ``calc``: the shared task: the calculator tool (an ``ast`` walk, never ``eval``), the reward,
  the tasks file ``calc.jsonl``;
- ``openai_calc``: the plain ``openai`` client (``agent_openai``);
- ``agents_sdk_calc``: the OpenAI Agents SDK (``agent_agents_sdk``);
- ``langgraph_calc``: LangGraph's ReAct agent on ``langchain-openai`` (``agent_langgraph``);
- ``smolagents_calc``: smolagents' ``ToolCallingAgent`` (``agent_smolagents``);
- ``calc_cli.py``: ``openai_calc``'s agent as a command-line program (``agent_command``).
"""
