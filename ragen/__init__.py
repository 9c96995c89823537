"""ragen: a process-parallel rollout engine for multi-turn RL of language-model agents.

Packages follow the data's way through the system:

- ``ragen.env``: environments (RAGEN's interface), their registry and checker.
- ``ragen.llm``: language-model engines behind one ``generate`` interface.
- ``ragen.llm_agent``: the agent loop: context (prompts, parsing), env state,
  sequential and parallel rollout, the shared inference manager.
- ``ragen.trainer``: GRPO/PPO training on the rollouts.

Beside them, below every package: ``ragen.pickling`` (names what does not
pickle) and ``ragen.config_files`` (where the shipped ``config/`` is); and the
soak command, ``ragen.tools.soak``.
"""

__version__ = "0.1.0"
