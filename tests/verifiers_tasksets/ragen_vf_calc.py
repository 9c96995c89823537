"""A multi-turn verifiers tool taskset for tests/test_agent_verifiers.py: add two numbers with the
``add`` tool of its toolset (an MCP server verifiers starts for each episode, ``python -m
ragen_vf_calc``), then answer; scored by its rubric (``correct``; ``tool_calls``, a metric).

A top-level module: verifiers 0.4.0 resolves a taskset id to a top-level module, and runs a
toolset's module as a program (the test puts this folder on the path and on PYTHONPATH)."""

import re

import verifiers.v1 as vf


class CalcToolsConfig(vf.ToolsetConfig):
    pass


class CalcTools(vf.Toolset[CalcToolsConfig, vf.State]):
    TOOL_PREFIX = "calc"

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return f"sum={a + b}"


class CalcData(vf.TaskData):
    a: int
    b: int


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [CalcTools(CalcToolsConfig())]

    @vf.reward
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return 1.0 if numbers and int(numbers[-1]) == task.a + task.b else 0.0

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        for a, b in [(2, 3), (10, 20), (7, 8)]:
            yield CalcTask(CalcData(a=a, b=b, prompt=f"Use the add tool to add {a} and {b}, then say the sum."),
                           self.config.task)


__all__ = ["CalcTaskset"]

if __name__ == "__main__":
    CalcTools.run()
