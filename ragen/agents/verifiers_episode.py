"""``play``: one episode of a verifiers environment against an episode's gateway session.

verifiers runs an episode as it does in its own evals: ``Env.run_episode`` over a fresh env, the
harness's program calling verifiers' interception server, which relays each call to the
session (``EvalClient``) and records the trace; the task's ``@vf.reward`` functions then score it.
Two things are set here so it runs offline, on the gateway:

- the session's key goes straight to the interception server's client for the session, never
  into the process environment (verifiers reads a key from an environment variable);
- verifiers' chat program (its ``null`` and ``bash`` harnesses) runs on this Python, which has
  its packages: a subprocess runtime otherwise prepares it a uv environment, installing uv and
  downloading the packages as the episode starts.

The reward is the sum of the episode's traces' rewards (a trace's: the weighted sum of its
``@vf.reward`` scores); the info keeps each trace's rewards, metrics, stop condition, turns and
info. An episode that verifiers ends not ok raises, naming its errors.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import tempfile
from typing import Any

from ragen.agents.llm import LLM
from ragen.agents.verifiers import VerifiersConfig
from ragen.errors import RagenError

# the api_key_var of the client config: never set, the client is given the session's key
UNSET_KEY_VAR = "RAGEN_VERIFIERS_KEY_NOT_FROM_ENVIRONMENT"


class VerifiersEpisodeError(RagenError, RuntimeError):
    """verifiers ended the episode not ok (its harness, tools, scoring or env failed)."""


async def play(config: VerifiersConfig, task: dict[str, Any], llm: LLM) -> dict[str, Any]:
    """The episode of ``task`` (a ``TaskData``'s JSON) played on ``llm``'s session: its reward and info."""
    import verifiers.v1 as vf
    from verifiers.v1.clients.eval import EvalClient

    loaded = config.loaded()
    _chat_program_on_this_python()
    env = vf.load_environment(loaded.env_config)  # one env an episode: it holds its serving resources
    client_config = vf.EvalClientConfig(base_url=llm.base_url, api_key_var=UNSET_KEY_VAR)
    client = EvalClient(client_config)
    client.api_key = llm.api_key
    try:
        async with env.serving():
            # the server's client for this endpoint, as its _client() would make it, with the key
            env._interception.clients[client_config.model_dump_json()] = client
            episode = await env.run_episode(loaded.task_of(task), vf.ModelContext(model=llm.model,
                                                                                   client=client_config))
    finally:
        await client.close()
    return result_of(episode)


def result_of(episode: Any) -> dict[str, Any]:
    """An ok episode's reward and info; ``VerifiersEpisodeError`` naming the errors of one not ok."""
    if not episode.ok:
        errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
        for error in errors:
            if error.traceback:
                print(error.traceback, file=sys.stderr)
        said = "; ".join(f"{e.type}: {e.message}" for e in errors) or "no error recorded"
        raise VerifiersEpisodeError(f"the verifiers episode was not ok: {said}")
    return {"reward": sum(t.reward for t in episode.traces), "traces": [_trace_info(t) for t in episode.traces]}


def _trace_info(trace: Any) -> dict[str, Any]:
    return {"agent": trace.agent.name, "reward": trace.reward,
            "rewards": {name: None if r is None else {"score": r.score, "weight": r.weight}
                        for name, r in trace.rewards.items()},
            "metrics": dict(trace.metrics), "stop_condition": trace.stop_condition, "turns": trace.num_turns,
            "info": trace.model_dump(mode="json", include={"info"})["info"]}


@functools.lru_cache(maxsize=1)
def _chat_program_on_this_python() -> None:
    """verifiers' chat program, marked prepared with this Python as its interpreter: the
    subprocess runtime looks a script up by its path (``<scripts_dir>/<sha256>.py``) before it
    would prepare a uv environment for it."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = os.path.join(SubprocessRuntime.scripts_dir, f"{hashlib.sha256(data).hexdigest()}.py")
    os.makedirs(SubprocessRuntime.scripts_dir, exist_ok=True)
    with tempfile.NamedTemporaryFile("wb", dir=SubprocessRuntime.scripts_dir, delete=False) as f:
        f.write(data)
    os.replace(f.name, path)  # whole, whatever another process writes beside it
    SubprocessRuntime._interpreters[path] = sys.executable
