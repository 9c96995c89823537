"""Remote envs (``env_type: remote``) against env servers: what a local env
shows, the server's bounds and key, servers that fail in every way a server
can, and a rollout that loses nothing when a server dies."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace

import pytest

from ragen.env import make_env, make_env_config
from ragen.env.check.checker import check_env
from ragen.env.remote import RemoteEnvError, RemoteEnvTimeout
from ragen.env.remote.protocol import ProtocolError, parse_reply, session_url
from ragen.env.remote.server import EnvServer
from ragen.env.remote.servers import ServerChoice
from ragen.llm.scripted import ScriptedEngine
from ragen.rollout.envs import tag_spec
from ragen.rollout.types import StopReason, rollout_digest

from tests.rollout_helpers import custom_envs, loop_config, sequential, specs_for
from tests.unread_peer import kernel_buffers

pytestmark = pytest.mark.timeout(120)

SOKOBAN = {"env_type": "sokoban", "env_config": {"dim_x": 6, "dim_y": 6, "num_boxes": 1}}
KEY = "the-key-of-this-module's-servers"


@pytest.fixture(autouse=True)
def client_key(monkeypatch):
    """The clients here hold the key every server here is made with (``env_server``)."""
    monkeypatch.setenv("RAGEN_ENV_KEY", KEY)


def env_server(makers, **kw):
    return EnvServer(makers, key=KEY, **kw)


def sokoban():
    return make_env(SOKOBAN["env_type"], SOKOBAN["env_config"])


@pytest.fixture
def server():
    with env_server({"S": sokoban, "L": lambda: make_env("frozen_lake", {})}) as srv:
        yield srv


def remote(url, **kw):
    return make_env("remote", {"url": url, "tag": "S", **kw})


# ----- config: refused when read --------------------------------------------------------------------------

@pytest.mark.parametrize("env_config, field, words", [
    ({}, "url", "not both"),
    ({"url": "http://127.0.0.1:1", "urls": ["http://127.0.0.1:2"]}, "url", "not both"),
    ({"url": "ftp://127.0.0.1:1"}, "url", "not an http:// or https://"),
    ({"url": "ws://127.0.0.1:1"}, "url", "not an http:// or https://"),
    ({"url": "http://:80"}, "url", "names no host"),
    ({"url": "http://127.0.0.1:99999"}, "url", "out of range"),
    ({"urls": []}, "urls", "non-empty list"),
    ({"urls": ["http://127.0.0.1:1", "http://127.0.0.1:1/"]}, "urls", "listed twice"),
    ({"urls": ["http://127.0.0.1:1", "file:///etc"]}, "urls[1]", "not an http"),
    ({"url": "http://127.0.0.1:1", "tag": "a/b"}, "tag", "env tag"),
    ({"url": "http://127.0.0.1:1", "timeout_s": 0}, "timeout_s", ""),
])
def test_bad_urls_and_values_are_refused_naming_the_key(env_config, field, words):
    with pytest.raises(ValueError) as info:
        make_env_config("remote", env_config, tag="R")
    assert str(info.value).startswith(f"custom_envs.R.env_config.{field}:")
    assert words in str(info.value)


def test_a_server_beyond_loopback_needs_the_key_in_the_environment(monkeypatch):
    monkeypatch.delenv("RAGEN_ENV_KEY", raising=False)
    with pytest.raises(ValueError, match=r"env_config.url: 'http://10.1.2.3:8101' is beyond loopback.*RAGEN_ENV_KEY"):
        make_env_config("remote", {"url": "http://10.1.2.3:8101"}, tag="R")
    make_env_config("remote", {"url": "http://localhost:8101"}, tag="R")  # loopback: no key needed
    monkeypatch.setenv("MY_KEY", "s3cret")
    cfg = make_env_config("remote", {"urls": ["https://envs.example.org/sokoban"], "key_env": "MY_KEY"}, tag="R")
    assert cfg.servers == ("https://envs.example.org/sokoban",)


def test_session_urls_follow_the_servers_scheme_and_tag():
    assert session_url("http://127.0.0.1:8101", "SimpleSokoban") == "ws://127.0.0.1:8101/SimpleSokoban/ws"
    assert session_url("https://h.example/base", None) == "wss://h.example/base/ws"


@pytest.mark.parametrize("raw, words", [
    ("<html>", "not JSON"), ("[1]", "not a JSON object"),
    ('{"type": "error", "data": {"message": "boom", "code": "EXECUTION_ERROR"}}', "EXECUTION_ERROR): boom"),
    ('{"type": "state", "data": {}}', "expected an 'observation'"),
    ('{"type": "observation", "data": {"observation": "x"}}', "not a JSON object"),
    ('{"type": "observation", "data": {"observation": {}, "done": "no"}}', "not true or false"),
])
def test_replies_that_are_not_the_protocols_are_refused(raw, words):
    with pytest.raises(ProtocolError) as info:
        parse_reply(raw)
    assert words in str(info.value)


def test_servers_are_picked_in_turn_and_one_that_failed_is_left_out_for_a_while():
    now = [0.0]
    choice = ServerChoice(("a", "b", "c"), down_for_s=10, clock=lambda: now[0])
    assert [choice.pick() for _ in range(4)] == ["a", "b", "c", "a"]
    choice.mark_down("b")
    assert [choice.pick() for _ in range(3)] == ["c", "a", "c"]
    assert choice.pick(avoid="a") == "c"
    now[0] = 0.5
    for s in ("a", "c"):
        choice.mark_down(s)
    now[0] = 1.0
    assert choice.pick() == "b"  # every one down: the one down longest
    now[0] = 10.2
    assert choice.down() == ["a", "c"] and choice.pick() == "b"


# ----- a remote env shows what the local env shows ---------------------------------------------------------

def test_a_remote_env_plays_as_the_local_one(server):
    env, local = remote(server.url), sokoban()
    for seed in (0, 5):
        assert env.reset(seed=seed) == local.reset(seed=seed)
        assert env.ACTION_LOOKUP == local.ACTION_LOOKUP  # ids keep their type across JSON
        for action in (1, 4, 4, 2, 3, 1):
            assert env.step(action) == local.step(action)
    assert server.sessions_served == 1  # one session, kept across resets
    env.close()


def test_int_rewards_stay_int_and_the_server_tells_its_state(server):
    env, local = make_env("remote", {"url": server.url, "tag": "L"}), make_env("frozen_lake", {})
    env.reset(seed=3), local.reset(seed=3)
    got, want = env.step(1), local.step(1)
    assert got == want and type(got[1]) is type(want[1])
    env._ws.send(json.dumps({"type": "state"}))
    assert json.loads(env._ws.recv(timeout=5))["data"] == {"tag": "L", "seed": 3, "step_count": 1}


def test_health_and_unknown_paths(server):
    with urllib.request.urlopen(server.url + "/health", timeout=5) as response:
        health = json.loads(response.read())
    assert health == {"status": "healthy", "tags": ["S", "L"]}
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server.url + "/nope/ws", timeout=5)
    info.value.close()
    assert info.value.code == 404
    with pytest.raises(RemoteEnvError, match="cannot open a session.*404"):
        make_env("remote", {"url": server.url, "tag": "Nope"}).reset(seed=0)
    with pytest.raises(RemoteEnvError, match="404"):  # two tags: no /ws of its own
        make_env("remote", {"url": server.url}).reset(seed=0)


def test_a_server_of_one_tag_serves_it_at_ws_as_openenv_does():
    with env_server({"S": sokoban}) as srv:
        assert make_env("remote", {"url": srv.url}).reset(seed=2) == sokoban().reset(seed=2)


def test_a_session_the_server_closed_while_idle_is_opened_again_at_reset():
    with env_server({"S": sokoban}, idle_timeout_s=0.2) as srv:
        env = remote(srv.url)
        env.reset(seed=1)
        time.sleep(0.6)
        assert env.reset(seed=1) == sokoban().reset(seed=1)
        assert srv.sessions_served == 2
        time.sleep(0.6)
        with pytest.raises(RemoteEnvError, match="connection closed during step"):
            env.step(1)  # a step has no state to open again with: the rollout's retry replays it


class _FailsAtStep2:
    def reset(self, seed=None):
        self.steps = 0
        return f"seed {seed}"

    def step(self, action):
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("the env's own bug")
        return "ok", 0.0, False, {}


def test_an_env_error_on_the_server_fails_that_call_and_names_the_server():
    with env_server({"S": _FailsAtStep2}) as srv:
        env = remote(srv.url)
        env.reset(seed=0)
        env.step("a")
        with pytest.raises(RemoteEnvError, match=rf"env server {srv.url}: step: .*EXECUTION_ERROR.*the env's own bug"):
            env.step("a")
        assert env.reset(seed=3) == "seed 3"  # a fresh session after the failed one
        assert srv.sessions_served == 2


def test_a_remote_env_pickles_and_opens_its_own_session(server):
    import pickle

    env = remote(server.url)
    env.reset(seed=4)
    clone = pickle.loads(pickle.dumps(env))
    assert clone.reset(seed=4) == env.reset(seed=4)


def test_the_env_checker_passes_a_remote_env(server):
    report = check_env("remote", {"url": server.url, "tag": "S"}, seeds=3, max_steps=8)
    assert report.ok, report.format()


# ----- the server's bounds and key -------------------------------------------------------------------------

def test_sessions_beyond_the_bound_are_refused():
    with env_server({"S": sokoban}, max_sessions=1) as srv:
        first = remote(srv.url)
        first.reset(seed=0)
        with pytest.raises(RemoteEnvError, match=rf"env server {srv.url}: cannot open a session.*503"):
            remote(srv.url).reset(seed=0)
        first.close()
        time.sleep(0.2)
        assert remote(srv.url).reset(seed=0) == sokoban().reset(seed=0)


def test_a_request_over_the_servers_bound_closes_that_session_only():
    with env_server({"S": sokoban}, max_message_bytes=2048) as srv:
        env, other = remote(srv.url), remote(srv.url)
        env.reset(seed=0), other.reset(seed=0)
        with pytest.raises(RemoteEnvError, match="refused the step request as larger than its --max-message-bytes"):
            env.step("x" * 10_000)
        assert other.step(1) == (lambda e: (e.reset(seed=0), e.step(1))[1])(sokoban())


class _BigAnswers:
    """Each reset answered with OBSERVATION_BYTES of text: a client that does not read fills every buffer soon."""

    def reset(self, seed=None):
        return "x" * OBSERVATION_BYTES

    def step(self, action):
        return "x", 0, False, {}

    def close(self):
        pass


OBSERVATION_BYTES = 64 << 10


def _raw_session(srv, tag="S"):
    """A session opened by hand on a socket that reads nothing after the handshake."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # before connecting: no autotuning
    sock.settimeout(5)
    sock.connect((srv.host, srv.port))
    sock.sendall((f"GET /{tag}/ws HTTP/1.1\r\nHost: {srv.host}:{srv.port}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                  f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {KEY}\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _text_frame(text: str) -> bytes:
    """A masked WebSocket text frame, as a client sends it (payloads under 126 bytes)."""
    payload, mask = text.encode(), os.urandom(4)
    assert len(payload) < 126
    return bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _wait_for(what, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _send_threads():
    return [t for t in threading.enumerate() if t.name == "ragen-env-send" and t.is_alive()]


@pytest.mark.timeout(90)
def test_a_client_that_never_reads_loses_its_session_and_frees_its_slot(caplog):
    """A client sends resets and reads none of the answers (issue 59): once
    what waits for it passes max_send_queue_bytes, its connection is closed
    with a warning naming it, and its slot goes to the next client, where
    its session used to hold the only slot for as long as it kept still."""
    bound = 1 << 20
    resets = (kernel_buffers() + bound) // OBSERVATION_BYTES + 16  # answers past the kernel's buffers and the bound
    with caplog.at_level(logging.WARNING), \
            env_server({"S": _BigAnswers}, max_sessions=1, max_send_queue_bytes=bound) as srv:
        stuck = _raw_session(srv)
        try:
            assert _wait_for(lambda: srv.sessions == 1, 10)
            peer = "%s:%d" % stuck.getsockname()[:2]
            reset = _text_frame(json.dumps({"type": "reset", "data": {"seed": 0}}))
            for _ in range(resets):
                try:
                    stuck.sendall(reset)
                except OSError:  # the server stopped reading (it is stuck), or closed the connection
                    break
            assert _wait_for(lambda: srv.sessions == 0, 20), "the client that never reads still holds its session"
            try:  # the connection is closed: what the kernel still held, then the end
                while stuck.recv(1 << 20):
                    pass
            except ConnectionResetError:
                pass
        finally:
            stuck.close()  # on a stuck server, this frees its session thread
        warnings = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert len(warnings) == 1 and peer in warnings[0] and "max_send_queue_bytes=1048576" in warnings[0], warnings
        assert remote(srv.url).reset(seed=0) == "x" * OBSERVATION_BYTES  # the only slot is free
    assert _wait_for(lambda: not _send_threads(), 5)


@pytest.mark.timeout(90)
def test_a_client_that_stops_reading_and_sending_is_closed_when_idle():
    """Answers past what the kernel holds, under the bound, and then nothing:
    the session's thread is not stuck sending them, so the idle timeout
    closes the session and frees its slot."""
    resets = kernel_buffers() // OBSERVATION_BYTES + 16
    with env_server({"S": _BigAnswers}, max_sessions=1, idle_timeout_s=0.5, max_send_queue_bytes=64 << 20) as srv:
        stuck = _raw_session(srv)
        try:
            assert _wait_for(lambda: srv.sessions == 1, 10)
            reset = _text_frame(json.dumps({"type": "reset", "data": {"seed": 0}}))
            for _ in range(resets):
                stuck.sendall(reset)
            assert _wait_for(lambda: srv.sessions == 0, 20), "the idle session is still open"
        finally:
            stuck.close()
        assert remote(srv.url).reset(seed=0) == "x" * OBSERVATION_BYTES


@pytest.mark.timeout(90)
def test_a_client_that_reads_late_gets_every_answer_in_order():
    """Answers past what the kernel holds, under the bound, wait in the
    session's queue while its client does not read, and reach it in order
    once it does; its session goes on and closes cleanly."""
    from websockets.sync.client import connect

    resets = kernel_buffers() // OBSERVATION_BYTES + 32  # the client's own queue holds 16 of them
    with env_server({"S": _BigAnswers}, max_send_queue_bytes=64 << 20) as srv:
        sock = socket.create_connection((srv.host, srv.port), timeout=10)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        with connect(f"ws://{srv.host}:{srv.port}/S/ws", sock=sock, max_size=None,
                     additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            for seed in range(resets):
                ws.send(json.dumps({"type": "reset", "data": {"seed": seed}}))
            assert _wait_for(_send_threads, 20), "the answers never waited in the session's queue"
            for _ in range(resets):
                assert parse_reply(ws.recv(timeout=10)).observation["text"] == "x" * OBSERVATION_BYTES
            ws.send(json.dumps({"type": "state"}))
            assert json.loads(ws.recv(timeout=10))["data"] == {"tag": "S", "seed": resets - 1, "step_count": 0}
    assert _wait_for(lambda: srv.sessions == 0 and not _send_threads(), 10)


def test_the_send_queue_bound_is_checked():
    with pytest.raises(ValueError, match="max_send_queue_bytes must be a positive integer, got 0"):
        env_server({"S": sokoban}, max_send_queue_bytes=0)


def test_the_key_is_required_and_a_refusal_names_the_variable(monkeypatch):
    with EnvServer({"S": sokoban}, key="s3cret") as srv:
        monkeypatch.delenv("RAGEN_ENV_KEY", raising=False)
        with pytest.raises(RemoteEnvError, match=r"cannot open a session.*401.*in the environment variable "
                                                 r"RAGEN_ENV_KEY \(env_config.key_env\), which is unset here"):
            remote(srv.url).reset(seed=0)
        monkeypatch.setenv("RAGEN_ENV_KEY", "wrong")
        with pytest.raises(RemoteEnvError, match="401.*which holds another key here"):
            remote(srv.url).reset(seed=0)
        monkeypatch.setenv("RAGEN_ENV_KEY", "s3cret")
        assert remote(srv.url).reset(seed=0) == sokoban().reset(seed=0)
        monkeypatch.setenv("MY_KEY", "s3cret")
        assert remote(srv.url, key_env="MY_KEY").reset(seed=1) == sokoban().reset(seed=1)


def test_a_server_given_no_key_makes_one_and_wants_it_on_loopback_too(monkeypatch):
    with EnvServer({"S": sokoban}) as srv, EnvServer({"S": sokoban}) as other:
        assert len(srv.key) >= 40 and srv.key != other.key
        monkeypatch.delenv("RAGEN_ENV_KEY")
        with pytest.raises(RemoteEnvError, match="401"):
            remote(srv.url).reset(seed=0)
        monkeypatch.setenv("RAGEN_ENV_KEY", srv.key)
        assert remote(srv.url).reset(seed=0) == sokoban().reset(seed=0)
        with pytest.raises(urllib.error.HTTPError) as info:  # a bare WebSocket handshake, no key
            urllib.request.urlopen(urllib.request.Request(srv.url + "/S/ws", headers={
                "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
                "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}), timeout=5)
        info.value.close()
        assert info.value.code == 401
        with urllib.request.urlopen(srv.url + "/health", timeout=5) as response:  # health needs none
            assert json.loads(response.read())["status"] == "healthy"


def test_a_key_in_the_url_is_refused_at_config_read():
    with pytest.raises(ValueError, match=r"env_config.url: the URL holds a user or key: give the env server's key "
                                         r"in the environment variable RAGEN_ENV_KEY") as info:
        make_env_config("remote", {"url": "http://ragen:s3cret@127.0.0.1:8101"}, tag="R")
    assert "s3cret" not in str(info.value)


# ----- servers that answer garbage, hang, or too much ------------------------------------------------------

class RawServer:
    """A WebSocket server whose session handler is given: a server that misbehaves."""

    def __init__(self, handler):
        from websockets.sync.server import serve

        self.stop = threading.Event()
        self._server = serve(lambda ws: handler(ws, self.stop), "127.0.0.1", 0)
        self.url = "http://127.0.0.1:%d" % self._server.socket.getsockname()[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self._server.shutdown()


def _answer(text):
    def handler(ws, stop):
        for _ in ws:
            ws.send(text)
    return handler


def _hang(ws, stop):
    for _ in ws:
        stop.wait(30)


def test_a_server_answering_garbage_fails_the_call_naming_it():
    with RawServer(_answer("<html>hello</html>")) as srv:
        with pytest.raises(RemoteEnvError, match=rf"env server {srv.url}: reset: the reply is not JSON"):
            remote(srv.url).reset(seed=0)


def test_a_server_that_hangs_times_out_naming_it():
    with RawServer(_hang) as srv:
        t0 = time.monotonic()
        with pytest.raises(RemoteEnvTimeout, match=rf"env server {srv.url}: no answer to reset within .*0.3 s"):
            remote(srv.url, timeout_s=0.3).reset(seed=0)
        assert time.monotonic() - t0 < 5


def test_a_huge_observation_is_refused_at_the_clients_bound():
    huge = json.dumps({"type": "observation", "data": {"observation": {"text": "x" * 3_000_000}, "done": False}})
    with RawServer(_answer(huge)) as srv:
        with pytest.raises(RemoteEnvError, match=r"larger than env_config.max_message_bytes=1048576"):
            remote(srv.url, max_message_bytes=1024 * 1024).reset(seed=0)


def test_a_server_that_is_not_there_or_not_websocket_fails_the_call_naming_it():
    import http.server

    with pytest.raises(RemoteEnvError, match=r"env server http://127.0.0.1:9: cannot open a session"):
        remote("http://127.0.0.1:9", connect_timeout_s=2).reset(seed=0)
    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = "http://127.0.0.1:%d" % httpd.server_address[1]
        with pytest.raises(RemoteEnvError, match=rf"env server {url}: cannot open a session"):
            remote(url, connect_timeout_s=2).reset(seed=0)
    finally:
        httpd.shutdown()


# ----- in a rollout ----------------------------------------------------------------------------------------

def _envs(urls, **env_config):
    return custom_envs(RemoteSokoban={"env_type": "remote",
                                      "env_config": {"urls": urls, "tag": "SimpleSokoban", **env_config}})


def _served():
    envs = custom_envs()
    spec = tag_spec("SimpleSokoban", envs)
    return lambda: make_env(spec["env_type"], spec["env_config"], tag="SimpleSokoban")


def test_a_remote_tag_takes_the_served_tags_prompt_and_keys():
    local, far = (tag_spec(t, _envs(["http://127.0.0.1:1"])) for t in ("SimpleSokoban", "RemoteSokoban"))
    for key in ("env_instruction", "state_legend", "action_names", "max_actions_per_traj", "max_tokens",
                "format_example"):
        assert far[key] == local[key], key
    assert far["env_type"] == "remote"
    own = tag_spec("R", custom_envs(R={"env_type": "remote", "max_tokens": 7, "env_instruction": "mine",
                                       "env_config": {"url": "http://127.0.0.1:1", "tag": "SimpleSokoban"}}))
    assert (own["max_tokens"], own["env_instruction"]) == (7, "mine")


def test_a_rollout_of_remote_envs_is_the_rollout_of_local_ones():
    with env_server({"SimpleSokoban": _served()}) as a, env_server({"SimpleSokoban": _served()}) as b:
        local = sequential(specs_for(["SimpleSokoban"], [4], 2, custom_envs()), loop_config())
        far = sequential(specs_for(["RemoteSokoban"], [4], 2, _envs([a.url, b.url])), loop_config())
        assert rollout_digest(far) == rollout_digest(local)
        assert a.sessions_served and b.sessions_served  # spread over both


class _StopsServer(ScriptedEngine):
    """The scripted policy, shutting a server down once it has answered ``at`` requests."""

    def __init__(self, server, at):
        super().__init__(malformed_rate=0.1)
        self.server, self.at, self.answered = server, at, 0

    def generate(self, requests, sampling):
        self.answered += len(requests)
        if self.answered >= self.at and self.server is not None:
            self.server.shutdown()
            self.server = None
        return super().generate(requests, sampling)


def test_a_server_that_dies_mid_rollout_loses_nothing():
    local = sequential(specs_for(["SimpleSokoban"], [4], 2, custom_envs()), loop_config())
    with env_server({"SimpleSokoban": _served()}) as a, env_server({"SimpleSokoban": _served()}) as b:
        engine = _StopsServer(a, at=12)  # during the second turn of 8 envs
        far = sequential(specs_for(["RemoteSokoban"], [4], 2, _envs([a.url, b.url])),
                         replace(loop_config(), env_retries=2), engine=engine)
    assert rollout_digest(far) == rollout_digest(local)
    assert all(t.stop_reason is not StopReason.ERROR for t in far)


def test_without_retries_a_dead_servers_envs_end_in_error_naming_it():
    with env_server({"SimpleSokoban": _served()}) as a:
        url = a.url
        engine = _StopsServer(a, at=4)
        far = sequential(specs_for(["RemoteSokoban"], [2], 2, _envs([url])), replace(loop_config(), env_retries=0),
                         engine=engine)
    failed = [t for t in far if t.stop_reason is StopReason.ERROR]
    assert failed and all(f"env server {url}" in t.error for t in failed)
    assert len(far) == 4


def test_a_tag_the_server_does_not_serve_is_named_with_the_tags_it_does():
    """Issue 59, item 15: a wrong tag got a bare "HTTP 404"."""
    with env_server({"HeavySokoban": _served()}) as srv:
        far = sequential(specs_for(["RemoteSokoban"], [1], 2, _envs([srv.url])), replace(loop_config(), env_retries=0))
    assert [t.stop_reason for t in far] == [StopReason.ERROR] * 2
    assert all("env_config.tag='SimpleSokoban'" in t.error and "['HeavySokoban']" in t.error for t in far), far[0].error


def test_a_hanging_server_ends_its_envs_in_timeout():
    with RawServer(_hang) as srv:
        far = sequential(specs_for(["RemoteSokoban"], [1], 2, _envs([srv.url], timeout_s=0.3)),
                         replace(loop_config(), env_retries=0))
    assert [t.stop_reason for t in far] == [StopReason.TIMEOUT] * 2
    assert all(f"env server {srv.url}" in t.error for t in far)


@pytest.mark.parametrize("max_abs_reward, error_has", [
    (1e6, "step returned the reward 1e+308, beyond es_manager.max_abs_reward=1e+06 (tag RemoteBad, step 1 of the "
          "episode, turn "),
    (1.5e308, "the episode's reward came to inf, not a finite number, with the reward 1e+308 (tag RemoteBad, step 2 "
              "of the episode, turn "),
])
def test_a_server_reporting_1e308_twice_ends_its_env_in_error_and_no_advantage_is_nan(max_abs_reward, error_has):
    """Issue 58: each 1e308 passes a finiteness check, their sum is inf, and GRPO's advantages were NaN."""
    import math

    from ragen.rollout.fill import FAILED, group_drops
    from ragen.trainer.core import compute_advantages
    from tests.test_env_outputs import bad_tag

    seeds = sorted({s.seed for s in specs_for(["Bad"], [2], 2, custom_envs(Bad=bad_tag()))})
    bad = bad_tag("huge_reward", bad_seed=seeds[0])
    def served():
        return make_env(bad["env_type"], bad["env_config"], config_type=bad["config_type"], tag="Bad")

    with env_server({"Bad": served}) as srv:
        envs = custom_envs(Bad=bad, RemoteBad={"env_type": "remote", "env_config": {"url": srv.url, "tag": "Bad"}})
        far = sequential(specs_for(["RemoteBad"], [2], 2, envs), replace(loop_config(), max_abs_reward=max_abs_reward))
    hit = [t for t in far if t.seed == seeds[0]]
    assert len(hit) == 2 and all(t.stop_reason is StopReason.ERROR and error_has in t.error for t in hit), \
        [t.error for t in hit]
    drops = group_drops(far, "none")
    assert drops == {hit[0].group_id: FAILED}
    kept = [t for t in far if t.group_id not in drops]
    advantages = compute_advantages([t.reward for t in kept], [t.group_id for t in kept], [t.tag for t in kept],
                                    loop_config().context)
    assert len(kept) == 2 and all(math.isfinite(a) for a in advantages)
