"""An agent episode of an ``entry``: ``run(task, llm)`` in a thread of its own, within its time limit.

An async entry runs on a fresh event loop in that thread. What the thread prints is captured
(``ragen.agents.capture``). A Python thread cannot be killed: at the timeout the episode ends
``timed_out`` and its thread is left running as a daemon; the caller closes the episode's
session, so every call the thread makes after is refused.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import traceback
from typing import Any, Callable

from ragen.agents.capture import Output
from ragen.agents.config import AgentConfig
from ragen.agents.llm import LLM
from ragen.agents.result import ProgramResult, read_result
from ragen.env.reward_bound import EnvOutputError
from ragen.errors import ConfigError


def run_entry(config: AgentConfig, task: dict[str, Any], llm: LLM, max_abs_reward: float) -> ProgramResult:
    """``config.entry`` (or its verifiers environment) played on ``task`` with ``llm``, to its ``ProgramResult``."""
    source = config.program
    try:
        fn = config.entry_function()
    except ConfigError as exc:  # a worker whose path cannot import what the driver could
        return ProgramResult(error=str(exc))
    output, ended, box = Output(), threading.Event(), {}
    thread = threading.Thread(target=_play, args=(fn, task, llm, output, box, ended), daemon=True,
                              name=f"ragen-agent-{config.program}")
    thread.start()
    if not ended.wait(config.timeout_s):
        return ProgramResult(error=f"{source} ran past timeout_s={config.timeout_s:g}", timed_out=True,
                             stdout=output.stdout.text(), stderr=output.stderr.text())
    captured = {"stdout": output.stdout.text(), "stderr": output.stderr.text()}
    if "error" in box:
        return ProgramResult(error=f"{source} {box['error']}", traceback=box["traceback"], **captured)
    try:
        reward, info = read_result(box["value"], max_abs_reward, source, config.where)
    except EnvOutputError as exc:
        return ProgramResult(error=str(exc), **captured)
    return ProgramResult(reward=reward, info=info, **captured)


def _play(fn: Callable[..., Any], task: dict[str, Any], llm: LLM, output: Output, box: dict[str, Any],
          ended: threading.Event) -> None:
    with output.captured():
        try:
            value = fn(task, llm)
            if inspect.isawaitable(value):
                value = asyncio.run(_closing(value, llm))
            box["value"] = value
        except BaseException as exc:  # broad: whatever the entry raises (SystemExit too) ends its episode only
            box["error"] = f"raised {type(exc).__name__}: {exc}"
            box["traceback"] = traceback.format_exc()
        finally:
            ended.set()


async def _closing(awaitable: Any, llm: LLM) -> Any:
    try:
        return await awaitable
    finally:
        await llm.aclose()  # on the loop its connections belong to, which ends with this run
