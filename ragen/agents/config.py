"""``AgentConfig``: the ``env_config`` of an ``env_type: agent`` tag, read and checked at start-up."""

from __future__ import annotations

import dataclasses
import functools
import shutil
from typing import Any, Callable

from ragen.agents.tasks import TaskSet, is_function_path
from ragen.agents.verifiers import VerifiersConfig
from ragen.config_reader import read, setting
from ragen.env import import_object
from ragen.errors import ConfigError

DEFAULT_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """An agent tag's program and tasks: ``entry`` (``package.module:function``, ``def run(task, llm)
    -> float | dict``, async allowed), ``command`` (a program and its arguments, run as a
    subprocess) or ``verifiers`` (a verifiers environment, ``ragen.agents.verifiers``), one of the
    three; ``tasks`` (a JSONL file, or ``package.module:function`` of the seed; a verifiers
    environment has its own); ``timeout_s`` (an episode's wall time). Build it with
    ``AgentConfig.read``, which checks it all."""

    tasks: str | None = None
    entry: str | None = None
    command: list[str] | None = None
    verifiers: VerifiersConfig | None = None
    timeout_s: float = setting(DEFAULT_TIMEOUT_S, above=0.0)
    # the config path its errors name, custom_envs.<tag>.env_config (not a key of the section)
    where: str = dataclasses.field(default="env_config", init=False, compare=False)

    @classmethod
    def read(cls, tag: str, env_config: Any) -> AgentConfig:
        """The tag's ``env_config`` read and checked: a ``ConfigError`` naming
        ``custom_envs.<tag>.env_config.<key>`` for an unknown key, not one of entry, command and
        verifiers, an entry that does not import or is not callable, a command not found, a
        tasks file missing, empty or with a bad line, a tasks function that does not import, a
        verifiers environment that does not load (``ragen.agents.verifiers``)."""
        where = f"custom_envs.{tag}.env_config"
        config = read(cls, env_config, where)
        object.__setattr__(config, "where", where)
        # workers may run in another folder than the driver
        if config.tasks is not None and not is_function_path(config.tasks):
            object.__setattr__(config, "tasks", TaskSet.absolute(config.tasks))
        if config.verifiers is not None:
            object.__setattr__(config, "verifiers", config.verifiers.located(f"{where}.verifiers"))
        config._check()
        return config

    def _check(self) -> None:
        given = {key: value for key, value in (("entry", self.entry), ("command", self.command),
                                               ("verifiers", self.verifiers)) if value is not None}
        if len(given) > 1:
            raise ConfigError(f"{self.where}: give one of entry, command and verifiers, not {' and '.join(given)}")
        if not given:
            raise ConfigError(f"{self.where}: give entry ('package.module:function', def run(task, llm) -> float | "
                              "dict), command (a program and its arguments, as a list of strings) or verifiers "
                              "(a verifiers environment: taskset, dataset)")
        if self.verifiers is not None and self.tasks is not None:
            raise ConfigError(f"{self.where}.tasks: a verifiers environment's tasks are its taskset's (or "
                              "verifiers.dataset); leave this key out")
        if self.verifiers is None and self.tasks is None:
            raise ConfigError(f"{self.where}.tasks is missing")
        if self.entry is not None:
            self.entry_function()
        elif self.command is not None:
            self._check_command()
        self.task_set()

    def portable(self, env_config: dict[str, Any]) -> dict[str, Any]:
        """``env_config`` with its files as this process found them (absolute): workers may run in
        another folder than the driver."""
        portable = dict(env_config)
        if self.tasks is not None:
            portable["tasks"] = self.tasks
        if self.verifiers is not None and self.verifiers.dataset is not None:
            portable["verifiers"] = {**env_config["verifiers"], "dataset": self.verifiers.dataset}
        return portable

    @property
    def program(self) -> str:
        """The program, as errors name it."""
        if self.verifiers is not None:
            return f"verifiers taskset {self.verifiers.taskset}"
        return f"entry {self.entry}" if self.entry is not None else f"command {self.command}"

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
        if self.verifiers is not None:
            return (f"{tag}: the reward is the verifiers rubric's (the sum of each trace's weighted @vf.reward "
                    "scores); success is a reward > 0")
        return (f"{tag}: the reward is what the agent program returned; success is its info's 'success' "
                "where it gives one, else a reward > 0")

    def entry_function(self) -> Callable[..., Any]:
        """The function an entry episode runs: the one ``entry`` names, imported (``ConfigError``
        naming the key when it cannot be); a verifiers environment's episode."""
        if self.verifiers is not None:
            from ragen.agents.verifiers_episode import play

            return functools.partial(play, self.verifiers)
        fn = import_object(str(self.entry), f"{self.where}.entry", "package.module:function")
        if not callable(fn):
            raise ConfigError(f"{self.where}.entry: {self.entry!r} is not callable, got {fn!r}; name a function "
                              "def run(task: dict, llm) -> float | dict")
        return fn

    def task_set(self) -> Any:
        """The tag's tasks, read (a file) or imported (a function) and checked; a verifiers
        environment's, loaded (``LoadedTaskset``). Each has ``task(seed) -> dict``."""
        if self.verifiers is not None:
            return self.verifiers.loaded()
        return TaskSet.load(str(self.tasks), f"{self.where}.tasks")
