"""``AgentConfig``: the ``env_config`` of an ``env_type: agent`` tag, read and checked at start-up."""

from __future__ import annotations

import dataclasses
import shutil
from typing import Any, Callable

from ragen.agents.tasks import TaskSet, is_function_path
from ragen.config_reader import read, setting
from ragen.env import import_object
from ragen.errors import ConfigError

DEFAULT_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """An agent tag's program and tasks: ``entry`` (``package.module:function``, ``def run(task, llm)
    -> float | dict``, async allowed) or ``command`` (a program and its arguments, run as a
    subprocess), never both; ``tasks`` (a JSONL file, or ``package.module:function`` of the seed);
    ``timeout_s`` (an episode's wall time). Build it with ``AgentConfig.read``, which checks it all."""

    tasks: str = setting()
    entry: str | None = None
    command: list[str] | None = None
    timeout_s: float = setting(DEFAULT_TIMEOUT_S, above=0.0)
    # the config path its errors name, custom_envs.<tag>.env_config (not a key of the section)
    where: str = dataclasses.field(default="env_config", init=False, compare=False)

    @classmethod
    def read(cls, tag: str, env_config: Any) -> AgentConfig:
        """The tag's ``env_config`` read and checked: a ``ConfigError`` naming
        ``custom_envs.<tag>.env_config.<key>`` for an unknown key, both or neither of entry and
        command, an entry that does not import or is not callable, a command not found, a
        tasks file missing, empty or with a bad line, a tasks function that does not import."""
        where = f"custom_envs.{tag}.env_config"
        config = read(cls, env_config, where)
        object.__setattr__(config, "where", where)
        if not is_function_path(config.tasks):  # workers may run in another folder than the driver
            object.__setattr__(config, "tasks", TaskSet.absolute(config.tasks))
        config._check()
        return config

    def _check(self) -> None:
        if self.entry is not None and self.command is not None:
            raise ConfigError(f"{self.where}: give entry or command, not both (entry={self.entry!r}, "
                              f"command={self.command!r})")
        if self.entry is None and self.command is None:
            raise ConfigError(f"{self.where}: give entry ('package.module:function', def run(task, llm) -> float | "
                              "dict) or command (a program and its arguments, as a list of strings)")
        if self.entry is not None:
            self.entry_function()
        else:
            self._check_command()
        self.task_set()

    def _check_command(self) -> None:
        if not self.command:
            raise ConfigError(f"{self.where}.command: an empty list; give the program and its arguments, "
                              "e.g. [python, my_agent.py]")
        if shutil.which(self.command[0]) is None:
            raise ConfigError(f"{self.where}.command[0]: no program {self.command[0]!r} on PATH or at that path "
                              "(or it is not executable)")

    def reward_and_success(self) -> str:
        """What a learning curve says of an agent tag's reward and success."""
        tag = self.where.split(".")[1] if self.where.count(".") >= 2 else "agent"
        return (f"{tag}: the reward is what the agent program returned; success is its info's 'success' "
                "where it gives one, else a reward > 0")

    def entry_function(self) -> Callable[..., Any]:
        """The function ``entry`` names, imported; ``ConfigError`` naming the key when it cannot be."""
        fn = import_object(str(self.entry), f"{self.where}.entry", "package.module:function")
        if not callable(fn):
            raise ConfigError(f"{self.where}.entry: {self.entry!r} is not callable, got {fn!r}; name a function "
                              "def run(task: dict, llm) -> float | dict")
        return fn

    def task_set(self) -> TaskSet:
        """The tag's tasks, read (a file) or imported (a function) and checked."""
        return TaskSet.load(self.tasks, f"{self.where}.tasks")
