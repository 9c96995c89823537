"""``ragen.errors``: every exception class of ragen is a ``RagenError`` and keeps its standard base."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import ragen
from ragen.errors import ConfigError, ProtocolError, RagenError

# A created account's system Python runs a copy of it: it imports the standard library only.
OUTSIDE = {"ragen.env.sandbox"}


def _exception_classes() -> tuple[dict[str, type], list[str]]:
    """Every exception class defined in a module of ragen, by dotted name; and the modules
    that cannot be imported here (an optional package missing), each read with ``ast`` instead."""
    found: dict[str, type] = {}
    unimportable = []
    for info in pkgutil.walk_packages(ragen.__path__, "ragen."):
        if info.name in OUTSIDE:
            continue
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            assert exc.name and not exc.name.startswith("ragen"), f"{info.name}: {exc}"
            unimportable.append(info.name)
            continue
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                found[f"{info.name}.{obj.__qualname__}"] = obj
    return found, unimportable


@pytest.mark.timeout(120)
def test_every_exception_class_of_ragen_is_a_ragen_error():
    found, unimportable = _exception_classes()
    assert len(found) > 40  # the walk saw the package, not an empty list
    assert sorted(name for name, cls in found.items() if not issubclass(cls, RagenError)) == []
    # a module not importable here (verl's agent loop without verl) defines no class on a builtin exception
    builtin_errors = {n for n, v in vars(builtins).items() if inspect.isclass(v) and issubclass(v, BaseException)}
    loose = []
    for name in unimportable:
        path = Path(importlib.util.find_spec(name).origin)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id in builtin_errors
                                                      for b in node.bases):
                loose.append(f"{name}.{node.name}")
    assert loose == []


def test_the_sandbox_stays_outside_and_imports_no_ragen_module():
    """It imports the package ``ragen`` only for its folder (what a sandboxed Python may import)."""
    from ragen.env import sandbox

    imports = [n for n in ast.walk(ast.parse(Path(sandbox.__file__).read_text()))
               if isinstance(n, (ast.Import, ast.ImportFrom))]
    modules = [a.name for n in imports if isinstance(n, ast.Import) for a in n.names]
    modules += ["." * n.level + (n.module or "") for n in imports if isinstance(n, ast.ImportFrom)]
    assert [m for m in modules if m.startswith((".", "ragen."))] == []
    assert not issubclass(sandbox.SandboxError, RagenError)


def _cls(dotted: str) -> type:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


# Each class with the standard bases callers catch it by.
STANDARD_BASES = {
    "ragen.errors.ConfigError": (ValueError,),
    "ragen.errors.ProtocolError": (ValueError, RuntimeError),
    "ragen.env.EnvImportError": (ImportError, ValueError, ConfigError),
    "ragen.env.allowed.EnvTypeNotAllowed": (ValueError,),
    "ragen.env.config_checks.EnvConfigError": (ValueError, ConfigError),
    "ragen.env.reasoning_gym.scoring.QuestionError": (RuntimeError,),
    "ragen.env.remote.env.RemoteEnvError": (RuntimeError,),
    "ragen.env.remote.env.RemoteEnvTimeout": (RuntimeError, TimeoutError),
    "ragen.env.search.client.RetrievalError": (RuntimeError,),
    "ragen.env.search.client.RetrievalTimeout": (RuntimeError, TimeoutError),
    "ragen.llm.openai_http.MalformedReply": (RuntimeError,),
    "ragen.llm.openai_http.RefusedError": (RuntimeError,),
    "ragen.llm.openai_http.ServerUnavailable": (RuntimeError,),
    "ragen.llm.openai_tokens.NoTokenPrompts": (RuntimeError,),
    "ragen.llm.routing.NoReplicaLeft": (RuntimeError,),
    "ragen.llm.tool_calls._NotFinite": (ValueError,),
    "ragen.llm.types.EngineError": (RuntimeError,),
    "ragen.llm.types.EngineUnavailable": (RuntimeError,),
    "ragen.rollout.backends.parallel.RolloutError": (RuntimeError,),
    "ragen.rollout.dump.DumpError": (ValueError,),
    "ragen.rollout.env_calls.CarryDiverged": (RuntimeError,),
    "ragen.rollout.json_types.BadField": (ValueError,),
    "ragen.serving.gate.GateTimeout": (TimeoutError,),
    "ragen.serving.messages.BadMessage": (ValueError,),
    "ragen.serving.messages._OverBound": (ValueError,),
    "ragen.serving.wire.AuthenticationError": (ConnectionError,),
    "ragen.serving.wire.MessageTooLarge": (ValueError, RuntimeError, ProtocolError),
    "ragen.trainer.checkpoint.CheckpointError": (ValueError,),
    "ragen.trainer.trainer.TrainingFailed": (RuntimeError,),
    "ragen.viewer.curve.ViewerError": (ValueError,),
}


@pytest.mark.parametrize("dotted", sorted(STANDARD_BASES))
def test_each_error_keeps_its_standard_base(dotted):
    cls = _cls(dotted)
    assert issubclass(cls, RagenError)
    for base in STANDARD_BASES[dotted]:
        assert issubclass(cls, base), f"{dotted} is no longer a {base.__name__}"


def test_the_wire_and_the_remote_env_share_one_protocol_error():
    from ragen.env.remote import protocol
    from ragen.serving import wire

    assert wire.ProtocolError is protocol.ProtocolError is ProtocolError
    with pytest.raises(ProtocolError, match="not JSON"):
        protocol.parse_reply(b"<html>")
    with pytest.raises(RuntimeError, match="exceeds the limit"):
        raise wire.MessageTooLarge(10, 5)


def test_the_config_reader_raises_a_config_error_naming_the_key():
    from ragen.config_reader import check_setting, read
    from ragen.rollout.config import AgentProxyConfig

    with pytest.raises(ConfigError, match="agent_proxy.max_turnz is not a known key"):
        read(AgentProxyConfig, {"max_turnz": 3}, "agent_proxy")
    with pytest.raises(ConfigError, match="agent_proxy.max_turn must be an integer"):
        read(AgentProxyConfig, {"max_turn": "three"}, "agent_proxy")
    with pytest.raises(ConfigError, match="n must be >= 1"):
        check_setting("n", 0, minimum=1)
    with pytest.raises(ConfigError, match="agent_proxy.over_sample"):  # a section's own check
        read(AgentProxyConfig, {"over_sample": 1.5, "rollout_mode": "fully_async"}, "agent_proxy")


def test_an_env_config_that_cannot_be_built_is_a_config_error():
    from ragen.env import EnvImportError, make_env_config

    with pytest.raises(ConfigError, match=r"custom_envs.t.env_type: unknown env type 'nope'"):
        make_env_config("nope", {}, tag="t")
    with pytest.raises(ConfigError, match=r"custom_envs.t.env_config.sizee: unknown key"):
        make_env_config("sokoban", {"sizee": 3}, tag="t")
    with pytest.raises(EnvImportError, match="cannot import"):
        make_env_config("no_such_module_xyz:Env", {}, tag="t")


def test_the_trainer_sections_and_the_engines_options_raise_config_errors_naming_the_key():
    from ragen.llm.hf_options import HFOptions
    from ragen.llm.scripted import ScriptedEngine
    from ragen.llm.vllm_engine import VLLMEngine
    from ragen.trainer.config import OptimSection, TrainerSection

    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.optim.lr is 0"):
        OptimSection(lr=0.0)
    with pytest.raises(ConfigError, match="trainer.logger: unknown logger 'nope'"):
        TrainerSection(default_local_dir="run", logger="nope")
    with pytest.raises(ConfigError, match="engine.max_batch_size=0"):
        HFOptions.check_options({"max_batch_size": 0})
    with pytest.raises(ConfigError, match="engine.malformed_rate=2"):
        ScriptedEngine.check_options({"malformed_rate": 2})
    with pytest.raises(ConfigError, match="engine.data_parallel_size must be an integer"):
        VLLMEngine.check_options({"data_parallel_size": 0})
