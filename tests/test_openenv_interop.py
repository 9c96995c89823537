"""OpenEnv's side of the protocol, in OpenEnv's own code: an env server made by
OpenEnv's scaffold (``openenv init``, unchanged) played as a remote tag, and
OpenEnv's own client playing our env server.

Opt-in: openenv-core pulls in gradio, fastmcp and more, so it lives in its own
venv (docs/envs.md)::

    python -m venv /tmp/openenv-venv && /tmp/openenv-venv/bin/pip install openenv-core==0.3.0
    RAGEN_OPENENV_PYTHON=/tmp/openenv-venv/bin/python python -m pytest tests/test_openenv_interop.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from ragen.env import make_env
from ragen.env.remote.server import EnvServer
from ragen.rollout.types import StopReason

from tests.rollout_helpers import custom_envs, loop_config, sequential, specs_for

OPENENV_PYTHON = os.environ.get("RAGEN_OPENENV_PYTHON", "/tmp/openenv-venv/bin/python")

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not Path(OPENENV_PYTHON).is_file(),
                       reason=f"needs a Python with openenv-core (RAGEN_OPENENV_PYTHON; {OPENENV_PYTHON} is not "
                              "there); see this module's docstring"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def openenv_echo(tmp_path_factory):
    """OpenEnv's scaffolded echo env, served by OpenEnv's server (uvicorn), at its URL."""
    where = tmp_path_factory.mktemp("openenv")
    subprocess.run([OPENENV_PYTHON, "-m", "openenv.cli", "init", "echo_game"], cwd=where, check=True,
                   capture_output=True, timeout=120)
    port = _free_port()
    proc = subprocess.Popen([OPENENV_PYTHON, "-m", "uvicorn", "server.app:app", "--host", "127.0.0.1",
                             "--port", str(port)], cwd=where / "echo_game", stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("OpenEnv's echo server did not come up")
            time.sleep(0.5)
    yield url
    proc.kill()
    proc.wait(timeout=10)


def test_an_openenv_server_is_a_remote_env(openenv_echo):
    env = make_env("remote", {"url": openenv_echo, "observation_field": "echoed_message"})
    assert env.reset(seed=1) == "Echo Game environment ready!"
    assert env.step("hello") == ("hello", pytest.approx(0.5), False, {})
    env.close()


def test_an_openenv_server_plays_as_a_tag_in_a_rollout(openenv_echo):
    envs = custom_envs(Echo={"env_type": "remote", "env_instruction": "Say something.", "max_actions_per_traj": 3,
                             "env_config": {"url": openenv_echo, "observation_field": "echoed_message"}})
    time.sleep(0.5)  # the scaffold serves one session at a time: the last test's must have closed
    (traj,) = sequential(specs_for(["Echo"], [1], 1, envs), loop_config(max_turn=2))
    assert traj.stop_reason in (StopReason.MAX_TURNS, StopReason.ACTION_BUDGET), traj.error
    executed = [a for turn in traj.turns for a in turn.executed_actions]
    assert executed and traj.turns[-1].steps[-1].observation == executed[-1]  # it echoed our action


CLIENT = """
import json, os, sys
from openenv.core import GenericEnvClient
# OpenEnv's client takes no headers: the key goes as the URL's user:key, which websockets sends as Basic auth
base_url = sys.argv[1].replace("http://", "http://ragen:" + os.environ["KEY"] + "@", 1)
with GenericEnvClient(base_url=base_url).sync() as env:
    first = env.reset(seed=3)
    out = [first.observation["text"]]
    for action in (1, 4, 2):
        r = env.step({"message": action})
        out.append([r.observation["text"], r.reward, r.done])
print(json.dumps(out))
"""


def test_openenvs_client_plays_our_env_server():
    def sokoban():
        return make_env("sokoban", {"dim_x": 6, "dim_y": 6, "num_boxes": 1})

    with EnvServer({"S": sokoban}) as server:
        run = subprocess.run([OPENENV_PYTHON, "-c", CLIENT, server.url + "/S"], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "KEY": server.key})
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    local = sokoban()
    want = [local.reset(seed=3)] + [list(local.step(a)[:3]) for a in (1, 4, 2)]
    assert got == want

