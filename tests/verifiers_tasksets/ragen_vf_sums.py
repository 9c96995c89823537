"""A single-turn verifiers taskset for tests/test_agent_verifiers.py: add two numbers, scored by
its rubric (``correct``: the last number of the reply is the sum; ``reply_chars``, a metric).

A top-level module: verifiers 0.4.0 resolves a taskset id to a top-level module (the test puts
this folder on the path)."""

import re

import verifiers.v1 as vf


class SumData(vf.TaskData):
    a: int
    b: int


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.stop
    async def one_answer(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=2.0)
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return 1.0 if numbers and int(numbers[-1]) == task.a + task.b else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


async def broken_reward(trace: vf.Trace) -> float:
    """A reward plugged by config (``taskset.task.rewards``) that fails: its episode ends in error."""
    raise ValueError("this reward cannot score")


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        raise RuntimeError("the tests give this taskset its tasks as verifiers.dataset")


__all__ = ["SumTaskset"]
