"""Agent programs as episodes: an ``env_type: agent`` tag's contract and the runner of one episode.

- ``config``: ``AgentConfig``, the tag's ``env_config`` (an ``entry``, a ``command`` or a
  ``verifiers`` environment, its ``tasks``, ``timeout_s``), checked at start-up;
- ``tasks``: ``TaskSet``, the task a seed picks (a group shares its seed, so its task);
- ``llm``: ``LLM``, what an entry gets as ``llm``: its session's base URL, key and model, and
  ``openai`` clients made when first used;
- ``capture``: the stdout and stderr of each entry's thread, kept apart from every other's;
- ``result``: what a program gave back read as a reward and its info;
- ``entry`` and ``command``: an episode of each kind, to its outcome within its time limit;
- ``verifiers`` and ``verifiers_episode``: a verifiers environment's config and tasks, and one
  of its episodes, played as an entry is;
- ``program``: ``play_program``, any kind to a ``ProgramResult``.

See docs/agents.md, *The agent contract*.
"""
