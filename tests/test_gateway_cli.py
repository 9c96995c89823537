"""``python -m ragen.tools.gateway``: the ``gateway`` config section read with errors naming the key, the
configured engine served as the gateway with the rollout's sampling, a first session printed as two shell
lines, and every session written (``--record``) when it closes or the command is interrupted."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from ragen.config_files import compose
from ragen.config_reader import read
from ragen.gateway.gateway import GatewaySettings
from ragen.gateway.recording import read_session
from ragen.llm import make_engine
from ragen.tools.gateway import ServedGateway, check_config, main, shell_lines

from tests.rollout_helpers import ROOT

openai = pytest.importorskip("openai", reason="the openai client (pip install openai; the dev extra has it)")

MESSAGES = [{"role": "user", "content": "Available actions: Up, Down, Left, Right."}]


@pytest.fixture(scope="module")
def base():
    """config/base.yaml with the scripted engine, as plain data (composed once: Hydra takes a while)."""
    return compose("base", ["engine=scripted"])


def _with(cfg, **gateway):
    cfg = copy.deepcopy(cfg)
    cfg["gateway"].update(gateway)
    return cfg


@pytest.mark.timeout(60)
def test_the_gateway_section_is_read_with_errors_naming_the_key(base, monkeypatch):
    monkeypatch.delenv("RAGEN_GATEWAY_KEY", raising=False)
    run = check_config(base)
    assert run.settings.port == 8400  # the command line's port
    assert run.settings == GatewaySettings(port=8400)  # every other key: the code's default
    assert read(GatewaySettings, None, "gateway") == GatewaySettings()
    assert run.key_generated and run.key and run.key not in repr(run)
    cases = [
        ({"max_sesions": 3}, r"gateway.max_sesions is not a known key \(did you mean 'max_sessions'\?\)"),
        ({"port": 70000}, r"gateway.port must be <= 65535"),
        ({"port": "80"}, r"gateway.port must be an integer"),
        ({"max_calls_per_session": 0}, r"gateway.max_calls_per_session must be >= 1"),
        ({"call_timeout_s": 0}, r"gateway.call_timeout_s must be > 0"),
        ({"max_context": 1}, r"gateway.max_context must be >= 2"),
        ({"host": "::1"}, r"gateway.host='::1' cannot be listened on: the gateway listens on IPv4 only"),
        ({"host": ""}, r"gateway.host must be the address to listen on"),
        ({"key_env": "MY KEY"}, r"gateway.key_env must name an environment variable"),
        # beyond loopback, a generated key would let strangers open sessions
        ({"host": "0.0.0.0"}, r"gateway.host='0.0.0.0' is beyond this machine: set the server's key in the "
                              r"environment variable RAGEN_GATEWAY_KEY \(gateway.key_env\)"),
    ]
    for gateway, message in cases:
        with pytest.raises(ValueError, match=message):
            check_config(_with(base, **gateway))
    with pytest.raises(ValueError, match=r"gatway is not a known key \(did you mean 'gateway'\?\)"):
        check_config({**base, "gatway": {}})
    monkeypatch.setenv("MY_GATEWAY_KEY", "sk-mine")
    run = check_config(_with(base, host="0.0.0.0", key_env="MY_GATEWAY_KEY"))
    assert (run.key, run.key_generated) == ("sk-mine", False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("override, message", [
    ("+gateway.max_sesions=3", "error: gateway.max_sesions is not a known key (did you mean 'max_sessions'?)"),
    ("gateway.max_sesions=3", "error: Could not override 'gateway.max_sesions'"),  # Hydra's: one line, no traceback
    ("gateway.io_timeout_s=0", "error: gateway.io_timeout_s must be > 0"),
])
def test_the_command_refuses_a_bad_config_in_one_line_before_the_engine_is_built(override, message, capsys):
    assert main(["engine=scripted", override]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(message) and "Traceback" not in err


def _post(url: str, key: str) -> dict:
    request = urllib.request.Request(url, data=b"{}", method="POST", headers={"Authorization": f"Bearer {key}",
                                                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.mark.timeout(60)
def test_the_configured_engine_is_served_with_the_rollouts_sampling_and_open_sessions_are_written_at_close(
        base, tmp_path):
    cfg = copy.deepcopy(base)
    cfg["ctx_manager"]["generation"]["response_length"] = 7
    run = check_config(_with(cfg, port=0, served_name="my-policy"))
    engine = make_engine(run.engine_cfg, run.model_path)
    served = ServedGateway(run, engine, tmp_path)
    try:
        assert served.server.gateway.sampling == run.setup.loop.sampling  # the rollout's, seeded from seed.train
        first = served.sessions.open()
        base_url, key = (line.split("=", 1)[1] for line in shell_lines(served, first).splitlines())
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)
        reply = client.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=500)
        assert reply.usage.completion_tokens == 7 and reply.choices[0].finish_reason == "length"  # the rollout's cap
        assert [m.id for m in client.models.list()] == ["my-policy"]
        more = _post(f"{served.root}/sessions", run.key)  # the server's key opens more
        openai.OpenAI(base_url=more["base_url"], api_key=more["api_key"], max_retries=0,
                      timeout=30).chat.completions.create(model="m", messages=MESSAGES)
    finally:
        served.close()
        engine.close()
    for session_id, calls in ((first.id, 1), (more["id"], 1)):
        assert read_session(tmp_path / f"{session_id}.jsonl").header["calls"] == calls
    assert served.recorder.written == 2 and len(served.sessions) == 0


@pytest.mark.timeout(60)
def test_the_command_prints_a_session_for_a_shell_and_writes_it_when_interrupted(tmp_path):
    """The one subprocess test: the two lines on stdout work with the openai client, Ctrl-C writes the record."""
    env = {k: v for k, v in os.environ.items() if k != "RAGEN_GATEWAY_KEY"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    process = subprocess.Popen([sys.executable, "-m", "ragen.tools.gateway", "--record", str(tmp_path / "rec"),
                                "engine=scripted", "gateway.port=0"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        lines = [process.stdout.readline().rstrip("\n") for _ in range(2)]
        assert re.fullmatch(r"OPENAI_BASE_URL=http://127\.0\.0\.1:\d+/sessions/[0-9a-f]+/v1", lines[0]), lines
        assert re.fullmatch(r"OPENAI_API_KEY=[\w-]+", lines[1]), lines
        values = dict(line.split("=", 1) for line in lines)
        client = openai.OpenAI(base_url=values["OPENAI_BASE_URL"], api_key=values["OPENAI_API_KEY"],
                               max_retries=0, timeout=30)
        assert client.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert out == ""  # nothing on stdout but the two lines
    assert "POST" in err and "/sessions" in err and "export RAGEN_GATEWAY_KEY=" in err
    session_id = values["OPENAI_BASE_URL"].split("/sessions/")[1].split("/")[0]
    log = read_session(tmp_path / "rec" / f"{session_id}.jsonl")
    assert log.header["calls"] == 1 and log.records[0].response_ids


@pytest.mark.timeout(60)
def test_serving_closes_and_writes_the_sessions_idle_past_their_ttl(base, tmp_path):
    run = check_config(_with(base, port=0, session_ttl_s=0.1))
    engine = make_engine(run.engine_cfg, run.model_path)
    served = ServedGateway(run, engine, tmp_path)
    stop = threading.Event()
    serving = threading.Thread(target=served.serve, args=(stop,))
    serving.start()
    try:
        session = served.sessions.open()  # no call comes: it expires with no one opening another
        deadline = time.monotonic() + 20
        while not (tmp_path / f"{session.id}.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_session(tmp_path / f"{session.id}.jsonl").header["calls"] == 0
        metrics = served.sessions.metrics()
        assert (metrics["sessions_open"], metrics["sessions_expired"]) == (0, 1)
    finally:
        stop.set()
        serving.join()
        served.close()
        engine.close()


@pytest.mark.timeout(60)
def test_a_port_in_use_is_an_error_naming_gateway_port(base):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        run = check_config(_with(base, port=port))
        engine = make_engine(run.engine_cfg, run.model_path)
        with pytest.raises(OSError, match=f"gateway.port={port}: cannot listen on 127.0.0.1:{port}"):
            ServedGateway(run, engine)
        engine.close()
