"""``VerifiersConfig``: an agent tag's ``env_config.verifiers``, a verifiers environment as the agent
program (prime-rl's ``verifiers``, its 0.4.0 API, ``verifiers.v1``), and its tasks.

The section names a verifiers taskset by its id (``taskset``, verifiers' ``--env.taskset.id``: an
importable top-level module whose ``__all__`` exports one ``vf.Taskset``), where its tasks come
from (``dataset``, a local JSONL of the taskset's ``TaskData``, one task a line; else the
taskset's own ``load()``) and the rest of verifiers' ``EnvConfig`` (``env``). ``loaded()`` checks
it all once a process: the env builds, every task reads. Each episode then plays the task its
seed picks (``ragen.agents.verifiers_episode``). verifiers is imported only here, when a tag
uses it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
from typing import Any

from ragen.agents.tasks import TaskSet, json_objects
from ragen.config_reader import setting
from ragen.errors import ConfigError

SUBPROCESS_RUNTIME = {"type": "subprocess"}
CHAT_HARNESS = "null"  # verifiers' tool-less chat loop with MCP tools: the harness of a taskset that ships none


@dataclasses.dataclass(frozen=True)
class VerifiersConfig:
    """A verifiers environment: ``taskset`` (its id), ``dataset`` (a JSONL of its ``TaskData``; None:
    the taskset's own ``load()``), ``env`` (verifiers' ``EnvConfig`` fields beside the taskset id,
    e.g. ``agent: {max_turns: 4}``)."""

    taskset: str = setting()
    dataset: str | None = None
    env: dict[str, Any] | None = None
    where: str = dataclasses.field(default="env_config.verifiers", init=False, compare=False)

    def located(self, where: str) -> VerifiersConfig:
        """This section at config path ``where``, its dataset path absolute (workers may run in
        another folder than the driver)."""
        config = dataclasses.replace(self, dataset=None if self.dataset is None else TaskSet.absolute(self.dataset))
        object.__setattr__(config, "where", where)
        return config

    def loaded(self) -> LoadedTaskset:
        """The env config and tasks, built and checked once a process; ``ConfigError`` naming the
        key at fault."""
        return _load(self.taskset, self.dataset, json.dumps(self.env or {}, sort_keys=True), self.where)


@dataclasses.dataclass(frozen=True)
class LoadedTaskset:
    """A verifiers taskset ready to play: ``env_config`` (the ``vf.EnvConfig`` each episode's env is
    built from), its ``task_type`` and ``task_config``, and its ``tasks`` (``TaskData``)."""

    env_config: Any
    task_type: Any
    task_config: Any
    tasks: tuple[Any, ...]
    source: str

    def task(self, seed: int) -> dict[str, Any]:
        """The task of ``seed`` (line ``seed % len``), as its ``TaskData``'s JSON: a fresh dict each call."""
        return self.tasks[seed % len(self.tasks)].model_dump(mode="json", exclude_none=True)

    def task_of(self, data: dict[str, Any]) -> Any:
        """The ``vf.Task`` of a task's JSON (what ``task`` gave)."""
        return self.task_type(self.task_type.data_type().model_validate(data), self.task_config)


def verifiers_module(where: str) -> Any:
    """``verifiers.v1``, or a ``ConfigError`` naming ``where`` when verifiers is not installed."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ConfigError(f"{where}: needs the verifiers package ({exc}): pip install 'verifiers==0.4.0' "
                          "(the verifiers extra, in an environment of its own: see docs/agents.md)") from None
    return vf


@functools.lru_cache(maxsize=16)
def _load(taskset: str, dataset: str | None, env_json: str, where: str) -> LoadedTaskset:
    vf = verifiers_module(where)
    from verifiers.v1.utils.loaders import taskset_class

    try:
        taskset_class(taskset)
    except (ImportError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{where}.taskset: {taskset!r} is not a verifiers taskset: {exc}") from None
    env_config = _env_config(vf, taskset, json.loads(env_json), f"{where}.env")
    try:
        env = vf.load_environment(env_config)
    except Exception as exc:  # broad: whatever the env's own constructor raises is its config's fault
        raise ConfigError(f"{where}: the verifiers env of taskset {taskset!r} does not build: "
                          f"{type(exc).__name__}: {exc}") from None
    task_type = env.taskset.task_type()
    if dataset is not None:
        tasks = _read_dataset(dataset, task_type.data_type(), env.taskset.system_prompt, f"{where}.dataset")
    else:
        tasks = _own_tasks(env.taskset, taskset, f"{where}.taskset")
    return LoadedTaskset(env_config, task_type, env.taskset.config.task, tasks,
                         dataset if dataset is not None else f"taskset {taskset}")


def _env_config(vf: Any, taskset: str, env: dict[str, Any], where: str) -> Any:
    """verifiers' ``EnvConfig`` of ``env`` with the taskset id, and what runs here: each role's runtime
    a local subprocess unless ``env`` sets it, the chat harness where the taskset ships none (verifiers'
    default, ``bash``, runs commands on the host), one interception server (the episode gives it the
    session's key)."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import default_harness_id, harness_config_type

    if "interception" in env:
        raise ConfigError(f"{where}.interception: ragen serves each episode's model calls through an interception "
                          "server of its own; leave this key out")
    raw = copy.deepcopy(env)
    spec = raw.get("taskset", {})
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}.taskset must be a mapping of the taskset's config fields, got {spec!r}")
    if spec.get("id", taskset) != taskset:
        raise ConfigError(f"{where}.taskset.id: {spec['id']!r} is not the verifiers.taskset {taskset!r}; give the "
                          "id once, as verifiers.taskset")
    raw["taskset"] = {**spec, "id": taskset}
    raw["interception"] = {"type": "server"}
    try:
        config = vf.resolve_env_config(raw)
        harness = harness_config_type(CHAT_HARNESS).model_validate({"id": CHAT_HARNESS}) \
            if default_harness_id(taskset) == "bash" else None
        roles = {}
        for name, role in agent_config_fields(config).items():
            update: dict[str, Any] = {}
            if "runtime" not in role.model_fields_set:
                update["runtime"] = vf.SubprocessConfig(**SUBPROCESS_RUNTIME)
            if role.harness is None and harness is not None:
                update["harness"] = harness
            roles[name] = role.model_copy(update=update)
        return config.model_copy(update=roles)
    except (ImportError, TypeError, ValueError, AttributeError) as exc:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"{where}: not a verifiers EnvConfig: {_said(exc, where)}") from None


def _said(exc: Exception, where: str) -> str:
    """``exc`` on one line; a pydantic error as each field's key under ``where`` and what is wrong with it."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors())
    return f"{type(exc).__name__}: {exc}"


def _read_dataset(path: str, data_type: Any, system_prompt: str | None, where: str) -> tuple[Any, ...]:
    """The ``TaskData`` of each non-blank line of the JSONL ``path``, each checked."""
    fields = set(data_type.model_fields)
    tasks = []
    for number, _, row in json_objects(path, where, f"the fields of {data_type.__name__}",
                                       "a JSONL file of the taskset's tasks, one TaskData (a JSON object of its "
                                       "fields) a line"):
        unknown = sorted(set(row) - fields)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: {path} line {number}: {unknown[0]!r} is not a field of "
                              f"{data_type.__name__}{hint}; its fields are {sorted(fields)}")
        try:
            data = data_type.model_validate(row)
        except ValueError as exc:
            raise ConfigError(f"{where}: {path} line {number} is not a {data_type.__name__}: "
                              f"{_said(exc, data_type.__name__)}") from None
        update = {"idx": len(tasks)} if system_prompt is None else {"idx": len(tasks), "system_prompt": system_prompt}
        tasks.append(data.model_copy(update=update))
    return tuple(tasks)


def _own_tasks(taskset: Any, name: str, where: str) -> tuple[Any, ...]:
    """The tasks of the taskset's own ``load()`` (it may read or download whatever it reads)."""
    if not taskset.bounded:
        raise ConfigError(f"{where}: the taskset {name!r} is infinite; give its tasks as verifiers.dataset "
                          "(a JSONL of its TaskData)")
    try:
        tasks = tuple(task.data for task in taskset)
    except Exception as exc:  # broad: the taskset's own loader
        raise ConfigError(f"{where}: the taskset {name!r} could not load its tasks: {type(exc).__name__}: {exc}; "
                          "give them as verifiers.dataset (a JSONL of its TaskData)") from None
    if not tasks:
        raise ConfigError(f"{where}: the taskset {name!r} loaded no task")
    return tasks
