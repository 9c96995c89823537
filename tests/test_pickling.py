"""``ragen.pickling.describe_unpicklable``: names the key, field or attribute
that does not pickle, for the rollout's and the env checker's errors; and what
crosses to the driver (a trajectory with its program output) does pickle."""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor

import pytest

from ragen.agents.result import ProgramResult
from ragen.pickling import describe_unpicklable
from ragen.rollout.types import StopReason, Trajectory


@dataclasses.dataclass
class _Config:
    size: int
    hook: object


class _Env:
    def __init__(self) -> None:
        self.size = 3
        self.score = lambda x: x


@pytest.mark.timeout(30)
def test_describe_unpicklable_names_the_key():
    assert describe_unpicklable({"a": 1, "b": [2]}, "env_config") is None
    text = describe_unpicklable({"a": 1, "hook": threading.Lock()}, "custom_envs.X.env_config")
    assert text.startswith("custom_envs.X.env_config.hook (a _thread.lock")


@pytest.mark.timeout(30)
def test_describe_unpicklable_names_a_field_an_attribute_or_the_whole():
    text = describe_unpicklable(_Config(3, threading.Lock()), "_Config")
    assert text.startswith("_Config.hook (a _thread.lock: TypeError")
    assert describe_unpicklable(_Env(), "_Env").startswith("_Env.score (a lambda: ")
    # nothing inside to blame: the object itself, with the error
    text = describe_unpicklable(threading.Lock(), "env_config")
    assert text.startswith("env_config (TypeError: ") and "pickle" in text


@pytest.mark.timeout(120)
def test_an_agent_episodes_trajectory_crosses_a_process_with_its_program_output():
    """A worker process hands trajectories to the driver pickled: the program output comes with them."""
    output = ProgramResult(error="boom", info={"answer": [4]}, stdout="<b>out</b>\n", stderr="é\n",
                           traceback="Traceback (most recent call last):\nRuntimeError: boom\n").output()
    sent = Trajectory(env_id=3, group_id=1, tag="CalcAgent", seed=7, stop_reason=StopReason.ERROR, error="boom",
                      program=output)
    assert describe_unpicklable(sent, "trajectory") is None
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        back = pool.submit(dataclasses.replace, sent).result(timeout=100)  # a copy made in the other process
    assert back == sent and back.program == output and back.program is not output
