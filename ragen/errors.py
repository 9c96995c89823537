"""The one error family: every exception class of ragen derives from ``RagenError``.

A caller catches ``RagenError`` for any of them, or a member for one kind.
Each member keeps its standard base (a config error is a ``ValueError``, a
timeout a ``TimeoutError``), so ``except ValueError`` still catches it. A bare
``ValueError`` or ``RuntimeError`` is outside the family: a wrong argument,
and config checks outside the reader that are not yet ``ConfigError`` (the
``trainer`` sections', an engine's options).

The errors several layers raise live here, in the lowest layer:
``ConfigError`` (the config reader, the rollout sections, the env registry,
``EnvConfigError``) and ``ProtocolError`` (the LLM manager's wire and the
remote env's messages). The others live beside the code that raises them:
``EnvError``, ``EnvTimeout`` (``ragen.rollout.env_calls``), ``EngineError``,
``EngineUnavailable`` (``ragen.llm.types``), ``RolloutError``
(``ragen.rollout.backends``), ``CheckpointError`` (``ragen.trainer.checkpoint``),
``DumpError`` (``ragen.rollout.dump``). ``ragen.env.sandbox`` alone stays
outside: a created account's system Python runs a copy of it, so it imports
nothing but the standard library.

This module imports nothing from ``ragen``: every layer builds on it.
"""

from __future__ import annotations

__all__ = ["ConfigError", "ProtocolError", "RagenError"]


class RagenError(Exception):
    """The base of every exception class of ragen: catch it for any of them."""


class ConfigError(RagenError, ValueError):
    """A config key or value is wrong; the message names the key."""


class ProtocolError(RagenError, ValueError, RuntimeError):
    """A message broke its protocol: a frame or reply of the LLM manager's wire
    (too long, not a reply), or a remote env server's message that is not one
    of OpenEnv's. Both a ``ValueError`` (bad data read) and a ``RuntimeError``:
    callers of either protocol catch it as one of those."""
