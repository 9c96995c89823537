"""A rollout: env specs played to trajectories by the scheduler, on one of several backends.

- ``types``: the data that crosses processes (``EnvSpec``, ``Trajectory``,
  ``Turn``, ``StopReason``, ``RolloutResult``).
- ``config``: the rollout sections of the config, read and checked once.
- ``envs``: the env set of a split (groups, seeds, specs); ``context``: prompts
  from env state, answers parsed to actions, trajectories to training data.
- ``episode``: one env's episode as one generator (``play_episode``), which
  decides its ordinary ends; ``episode_state``: the ``Episode`` it plays;
  ``turn``: an answer applied (``apply_answer``); ``env_calls``: the env's
  lifecycle (kept instances, time limits, retries, resume); ``scheduler``:
  many episodes through an ``LLMClient``'s streams, formed by ``batching``'s
  policies (lockstep, env-level).
- ``backends``: ``RolloutBackend`` and its siblings (sequential, parallel,
  generate-ahead, fully-async), built by ``make_backend`` from the config.
- ``workers``: executors, clusters, worker sizing and the group queue of the
  parallel backends.
- ``metrics``, ``progress``, ``dump``: what a rollout reports and writes down.
- ``proxy``: ``LLMAgentProxy``, RAGEN's entry point, delegating to a backend.
"""
