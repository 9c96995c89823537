"""``ragen.pickling.describe_unpicklable``: names the key, field or attribute
that does not pickle, for the rollout's and the env checker's errors."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from ragen.pickling import describe_unpicklable


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
