"""``python -m ragen.tools.env_server``: serves a config's tags until a signal,
refuses bad input before it listens, and a rollout on parallel workers loses
nothing when one of two servers is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from ragen.rollout.progress import RolloutProgress
from ragen.rollout.types import StopReason, rollout_digest

from tests.rollout_helpers import ROOT

pytestmark = pytest.mark.timeout(180)

HEAVY = ["--config-name", "base-parallel", "benchmark=env_bound_heavy"]


def _server(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "ragen.tools.env_server", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _start(*args, env=None):
    proc = _server(*args, env=env)
    line = proc.stdout.readline()  # the address, or EOF when it exits: bounded by the test's timeout
    assert line.startswith("serving "), (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line.split(" at ")[1].strip()


def test_it_serves_until_sigterm_and_says_how_many_sessions():
    proc, url = _start("--tags", "SimpleSokoban,LargerSokoban", "--port", "0")
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            assert json.loads(response.read())["tags"] == ["SimpleSokoban", "LargerSokoban"]
        from ragen.env import make_env

        env = make_env("remote", {"url": url, "tag": "LargerSokoban"})
        assert "#" in env.reset(seed=1)
        env.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "stopped after 1 sessions" in out


@pytest.mark.parametrize("args, words", [
    (["--tags", "NoSuchTag"], "tag 'NoSuchTag' is not in custom_envs"),
    (["--tags", " , "], "--tags names no tag"),
    (["--tags", "SimpleSokoban", "--max-sessions", "0"], "--max-sessions must be > 0"),
    (["--tags", "SimpleSokoban", "--host", "0.0.0.0"], "beyond loopback: set a shared key in the environment variable"),
    (["--tags", "SimpleSokoban", "custom_envs.SimpleSokoban.env_config.dim_x=1"], "dim_x"),
])
def test_bad_input_is_refused_before_it_listens(args, words):
    env = {"RAGEN_ENV_KEY": ""}
    proc = _server("--port", "0", *args, env=env)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and words in err, err
    assert "serving" not in out


def test_a_remote_tag_cannot_be_served():
    proc = _server("--port", "0", "--tags", "R",
                   '+custom_envs.R={env_type: remote, env_config: {url: "http://127.0.0.1:1"}}')
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "custom_envs.R is a remote env" in err


def _heavy_config(envs, urls=None):
    from ragen.config_files import compose

    plain = compose("base-parallel", ["benchmark=env_bound_heavy"])
    tag = "HeavySokoban"
    if urls:
        tag = "RemoteHeavySokoban"
        plain["custom_envs"][tag] = {"env_type": "remote", "env_config": {"urls": urls, "tag": "HeavySokoban"}}
    plain["es_manager"]["train"].update(env_groups=envs, env_configs={"tags": [tag], "n_groups": [envs]})
    plain["agent_proxy"].update(use_parallel_rollout=True, parallel_backend="loky", parallel_n_jobs=2,
                                env_retries=2)
    return plain


def _rollout(plain, kill=None):
    from ragen.llm import make_engine
    from ragen.llm_agent import AgentSetup, LLMAgentProxy

    class KillsAServer(RolloutProgress):
        def answered(self, n):
            super().answered(n)
            if kill is not None and self.turns >= kill[0] and kill[1].poll() is None:
                kill[1].send_signal(signal.SIGKILL)

    setup = AgentSetup.from_config(plain)
    engine = make_engine(plain["engine"], plain["model_path"])
    try:
        with LLMAgentProxy(setup, engine) as proxy:
            return proxy.rollout("train", progress=KillsAServer(setup.es["train"].num_envs, disable=True))
    finally:
        engine.close()


def test_a_parallel_rollout_loses_nothing_when_a_server_is_killed():
    envs = 12
    local = _rollout(_heavy_config(envs))
    servers = [_start("--tags", "HeavySokoban", "--port", "0", *HEAVY) for _ in range(2)]
    try:
        result = _rollout(_heavy_config(envs, [u for _, u in servers]), kill=(2 * envs, servers[0][0]))
        assert servers[0][0].wait(timeout=10) == -signal.SIGKILL
    finally:
        for proc, _ in servers:
            proc.kill()
            proc.communicate(timeout=10)
    assert rollout_digest(result.trajectories) == rollout_digest(local.trajectories)
    assert len(result.trajectories) == envs
    assert all(t.stop_reason not in (StopReason.ERROR, StopReason.TIMEOUT) for t in result.trajectories)
    assert result.metrics["rollout/env_retries"] > 0
