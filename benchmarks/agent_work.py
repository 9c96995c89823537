"""The agent of the ``agent`` benchmark preset (config/benchmark/agent.yaml): a growing chat of
``calls`` calls, each after ``work_s`` seconds of its own CPU work (a busy loop on the thread's CPU
clock: CPU time, whatever else runs), as an agent that parses, plans or runs tools between calls.

``task(seed)`` reads both from the environment (``RAGEN_BENCH_AGENT_CALLS``, ``RAGEN_BENCH_AGENT_WORK_S``;
4 and 0.05), which the benchmark's overrides cannot reach inside a task.
"""

from __future__ import annotations

import os
import time


def task(seed: int) -> dict:
    return {"seed": seed, "calls": int(os.environ.get("RAGEN_BENCH_AGENT_CALLS", "4")),
            "work_s": float(os.environ.get("RAGEN_BENCH_AGENT_WORK_S", "0.05"))}


def busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def run(task: dict, llm) -> dict:
    messages = [{"role": "user", "content": f"Plan step 1 of task {task['seed']}."}]
    answer = ""
    for i in range(task["calls"]):
        busy(task["work_s"])
        reply = llm.client.chat.completions.create(model=llm.model, messages=messages, max_tokens=16)
        answer = reply.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"Step {i + 2}."}]
    return {"reward": float(len(answer) % 2), "calls": task["calls"]}
