"""``python -m ragen.tools.env_server``: serves a config's tags until a signal,
refuses bad input before it listens, wants its key (made and printed when none
is set) from every client, another local account's included, and a rollout on
parallel workers loses nothing when one of two servers is killed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ragen.rollout.progress import RolloutProgress
from ragen.rollout.types import StopReason, rollout_digest

from tests.rollout_helpers import ROOT

pytestmark = pytest.mark.timeout(180)

HEAVY = ["--config-name", "base-parallel", "benchmark=env_bound_heavy"]
KEY = "the-key-of-this-module's-servers"


@pytest.fixture(autouse=True)
def server_key(monkeypatch):
    """The servers started here (they inherit the environment) and their clients hold one key."""
    monkeypatch.setenv("RAGEN_ENV_KEY", KEY)


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
    (["--tags", "SimpleSokoban", "--max-send-queue-bytes", "0"], "--max-send-queue-bytes must be > 0"),
    (["--tags", "SimpleSokoban", "custom_envs.SimpleSokoban.env_config.dim_x=1"], "dim_x"),
])
def test_bad_input_is_refused_before_it_listens(args, words):
    env = {"RAGEN_ENV_KEY": ""}
    proc = _server("--port", "0", *args, env=env)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and words in err, err
    assert "serving" not in out


def test_without_a_key_set_it_makes_one_prints_it_once_and_wants_it(monkeypatch):
    proc, url = _start("--tags", "SimpleSokoban", "--port", "0", env={"RAGEN_ENV_KEY": ""})
    try:
        line = proc.stdout.readline()
        assert line.startswith("export RAGEN_ENV_KEY="), line
        # the line, pasted into a shell, gives the key to a client
        shell = subprocess.run(["bash"], input=line + 'printf %s "$RAGEN_ENV_KEY"\n', capture_output=True, text=True,
                               timeout=30)
        key = shell.stdout
        assert len(key) >= 40 and key != KEY
        from ragen.env import make_env
        from ragen.env.remote import RemoteEnvError

        with pytest.raises(RemoteEnvError, match="401"):
            make_env("remote", {"url": url}).reset(seed=1)
        monkeypatch.setenv("RAGEN_ENV_KEY", key)
        env = make_env("remote", {"url": url})
        assert "#" in env.reset(seed=1)
        env.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert key not in out  # printed once


# A client of another account: the system's Python (the owner's may sit in a home others cannot
# read), the standard library only, a WebSocket session by hand. It first tries to read the secret
# itself, then asks the code env to.
OTHER_CLIENT = r"""
import base64, json, os, socket, struct, sys
port, secret = int(sys.argv[1]), sys.argv[2]
try:
    open(secret).read()
    direct = "read"
except OSError as exc:
    direct = type(exc).__name__
s = socket.create_connection(("127.0.0.1", port), timeout=60)
head = ["GET /CodeRepair/ws HTTP/1.1", "Host: 127.0.0.1", "Upgrade: websocket", "Connection: Upgrade",
        "Sec-WebSocket-Version: 13", "Sec-WebSocket-Key: " + base64.b64encode(os.urandom(16)).decode()]
if os.environ.get("KEY"):
    head.append("Authorization: Bearer " + os.environ["KEY"])
s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
f = s.makefile("rb")
status = int(f.readline().split()[1])
while f.readline().strip():
    pass
replies = []
if status == 101:
    def send(message):
        data, mask = json.dumps(message).encode(), os.urandom(4)
        n = len(data)
        size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
        s.sendall(bytes([0x81]) + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))
    def recv():
        n = f.read(2)[1] & 0x7F
        n = struct.unpack(">H", f.read(2))[0] if n == 126 else struct.unpack(">Q", f.read(8))[0] if n == 127 else n
        return json.loads(f.read(n))
    send({"type": "reset", "data": {"seed": 0}})
    replies.append(recv())
    send({"type": "step", "data": {"message": "raise Exception('SECRET:' + open(%r).read())" % secret}})
    replies.append(recv())
print(json.dumps({"direct": direct, "status": status, "replies": replies}))
"""


@pytest.fixture
def other_account():
    """A second OS account, made for the test and removed after it (root only: CI runs as root)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("making a second account needs root and useradd")
    if not Path("/usr/bin/python3").is_file():
        pytest.skip("the second account runs the system's Python, /usr/bin/python3")
    name = f"ragenkey{os.getpid() % 100000}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                   capture_output=True, timeout=60)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=60)


def test_another_account_cannot_run_code_through_a_loopback_code_env_server(other_account, tmp_path):
    """On a shared host any account reaches 127.0.0.1: without the key, the code env would run its
    code as the server's owner (and read the owner's files)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    secret = home / "secret"
    secret.write_text("the owner's secret")
    secret.chmod(0o600)
    proc, url = _start("--tags", "CodeRepair", "--port", "0", env={"RAGEN_ENV_KEY": ""})
    try:
        key = proc.stdout.readline().split("=", 1)[1].split()[0]

        def as_other(client_key):
            run = subprocess.run(["/usr/bin/python3", "-c", OTHER_CLIENT, url.rsplit(":", 1)[1], str(secret)],
                                 user=other_account, group=other_account, extra_groups=[], cwd="/",
                                 env={"PATH": "/usr/bin:/bin", "KEY": client_key}, capture_output=True, text=True,
                                 timeout=120)
            assert run.returncode == 0, run.stderr
            return run.stdout, json.loads(run.stdout)

        out, without = as_other("")
        assert without["direct"] == "PermissionError"  # the account cannot read the file itself
        assert without["status"] == 401 and not without["replies"] and "owner's secret" not in out
        out, wrong = as_other("not-the-key")
        assert wrong["status"] == 401 and "owner's secret" not in out
        _, holder = as_other(key)  # what the key guards: a session on the code env
        assert holder["status"] == 101 and holder["replies"][0]["data"]["observation"]["text"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


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
