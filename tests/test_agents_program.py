"""``ragen.agents``: an agent tag's config checked at start-up, tasks by seed, the episode's ``llm``,
and ``play_program`` running an entry (in a thread) or a command (a process group) to its result."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time

import pytest

from ragen.agents.config import AgentConfig
from ragen.agents.llm import LLM
from ragen.agents.program import ProgramResult, play_program
from ragen.agents.tasks import TaskError
from ragen.errors import ConfigError
from tests import agent_programs as programs

TASK = {"a": 2, "b": 3}
LLM_OFF = LLM("http://127.0.0.1:9/sessions/0/v1", "sk-episode-key", "m")  # never called by these programs


@pytest.fixture
def tasks_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"a": i, "b": 10}) + "\n" for i in range(3)))
    return str(path)


def config(tasks_file, **keys) -> AgentConfig:
    return AgentConfig.read("Calc", {"tasks": tasks_file, **keys})


def entry(tasks_file, name: str, **keys) -> AgentConfig:
    return config(tasks_file, entry=f"tests.agent_programs:{name}", **keys)


# --- the config, checked at start-up ---

@pytest.mark.timeout(30)
@pytest.mark.parametrize("keys, message", [
    ({"entry": "tests.agent_programs:add", "command": ["true"]}, r"custom_envs.Calc.env_config: give entry or command"),
    ({}, r"custom_envs.Calc.env_config: give entry .* or command"),
    ({"entry": "tests.no_such_module:run"}, r"custom_envs.Calc.env_config.entry: cannot import 'tests.no_such_module:run'"),
    ({"entry": "tests.agent_programs:nope"}, r"custom_envs.Calc.env_config.entry: cannot import .* no attribute 'nope'"),
    ({"entry": "tests.agent_programs:NOT_CALLABLE"}, r"custom_envs.Calc.env_config.entry: .* is not callable, got 42"),
    ({"entry": "run_it"}, r"custom_envs.Calc.env_config.entry: 'run_it' is not an import path"),
    ({"command": []}, r"custom_envs.Calc.env_config.command: an empty list"),
    ({"command": ["no-such-program-xyz", "a"]}, r"custom_envs.Calc.env_config.command\[0\]: no program 'no-such-program-xyz'"),
    ({"command": "python agent.py"}, r"custom_envs.Calc.env_config.command must be a list"),
    ({"entry": "tests.agent_programs:add", "timeout": 5}, r"custom_envs.Calc.env_config.timeout is not a known key \(did you mean 'timeout_s'\?\)"),
    ({"entry": "tests.agent_programs:add", "timeout_s": 0}, r"custom_envs.Calc.env_config.timeout_s must be > 0"),
])
def test_a_bad_agent_config_is_refused_naming_its_key(tasks_file, keys, message):
    with pytest.raises(ConfigError, match=message):
        config(tasks_file, **keys)


@pytest.mark.timeout(30)
def test_a_bad_tasks_file_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    for text, message in [(None, r"env_config.tasks: no file .*t.jsonl"),
                          ("", r"env_config.tasks: .*t.jsonl holds no task"),
                          ("\n  \n", r"env_config.tasks: .*t.jsonl holds no task"),
                          ('{"a": 1}\n{"a": 2}\n{"a": \n', r"env_config.tasks: .*t.jsonl line 3 is not JSON"),
                          ('{"a": 1}\n[1, 2]\n', r"env_config.tasks: .*t.jsonl line 2 is a list, not a JSON object")]:
        if text is not None:
            path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            AgentConfig.read("Calc", {"entry": "tests.agent_programs:add", "tasks": str(path)})
    with pytest.raises(ConfigError, match=r"custom_envs.Calc.env_config.tasks: cannot import 'tests.agent_programs:nope'"):
        AgentConfig.read("Calc", {"entry": "tests.agent_programs:add", "tasks": "tests.agent_programs:nope"})
    with pytest.raises(ConfigError, match=r"custom_envs.Calc.env_config.tasks is missing"):
        AgentConfig.read("Calc", {"entry": "tests.agent_programs:add"})


@pytest.mark.timeout(30)
def test_a_good_config_reads_its_keys(tasks_file):
    cfg = config(tasks_file, command=["python3", "agent.py"], timeout_s=12)
    assert (cfg.entry, cfg.command, cfg.timeout_s) == (None, ["python3", "agent.py"], 12.0)
    assert entry(tasks_file, "add").timeout_s == 300.0


# --- tasks by seed ---

@pytest.mark.timeout(30)
def test_a_seed_picks_the_task_of_a_file_and_a_group_shares_it(tasks_file):
    tasks = config(tasks_file, entry="tests.agent_programs:add").task_set()
    assert [tasks.task(seed)["a"] for seed in (0, 1, 2, 3, 7)] == [0, 1, 2, 0, 1]
    first = tasks.task(5)
    first["a"] = "changed by an agent"  # each episode gets its own copy
    assert tasks.task(5) == {"a": 2, "b": 10}


@pytest.mark.timeout(30)
def test_a_seed_is_passed_to_a_tasks_function(tasks_file):
    tasks = AgentConfig.read("Calc", {"entry": "tests.agent_programs:add",
                                      "tasks": "tests.agent_programs:task_of"}).task_set()
    assert tasks.task(7) == {"seed": 7, "a": 7, "b": 1} == tasks.task(7)
    wrong = AgentConfig.read("Calc", {"entry": "tests.agent_programs:add",
                                      "tasks": "tests.agent_programs:not_a_task"}).task_set()
    with pytest.raises(TaskError, match=r"tests.agent_programs:not_a_task\(3\) returned a list, not a dict"):
        wrong.task(3)


# --- llm ---

@pytest.mark.timeout(30)
def test_llm_holds_the_session_and_makes_its_clients_when_asked():
    llm = LLM("http://127.0.0.1:1/sessions/ab/v1", "sk-secret", "served")
    assert "sk-secret" not in repr(llm)
    client, async_client = llm.client, llm.async_client
    assert client is llm.client and async_client is llm.async_client
    assert str(client.base_url).rstrip("/") == llm.base_url and client.api_key == "sk-secret"
    assert str(async_client.base_url).rstrip("/") == llm.base_url and async_client.api_key == "sk-secret"
    llm.close()


@pytest.mark.timeout(30)
def test_llm_without_openai_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)
    with pytest.raises(ImportError, match=r"pip install openai.*dev extra"):
        LLM("http://x/v1", "k", "m").client


# --- entries ---

@pytest.mark.timeout(30)
def test_an_entry_returns_a_float_or_a_dict_of_reward_and_info(tasks_file):
    result = play_program(entry(tasks_file, "add"), TASK, LLM_OFF)
    assert (result.reward, result.info, result.error, result.timed_out) == (5.0, {}, None, False)
    result = play_program(entry(tasks_file, "with_info"), TASK, LLM_OFF)
    assert (result.reward, result.info, result.error) == (0.5, {"answer": 5, "steps": [1, 2]}, None)
    assert result.stdout == "thinking about 2\n" and result.stderr == "a warning\n"


@pytest.mark.timeout(30)
def test_an_async_entry_runs_on_an_event_loop_of_its_own(tasks_file):
    result = play_program(entry(tasks_file, "async_add"), TASK, LLM_OFF)
    assert (result.reward, result.info, result.error) == (5.0, {"loop": True}, None)
    assert result.stdout == "from the event loop\n"


@pytest.mark.timeout(30)
def test_an_entry_that_raises_ends_in_error_with_its_traceback(tasks_file):
    result = play_program(entry(tasks_file, "raises"), TASK, LLM_OFF)
    assert result.error == "entry tests.agent_programs:raises raised ValueError: no answer for this task"
    assert result.reward == 0.0 and not result.timed_out
    assert "Traceback" in result.traceback and "in raises" in result.traceback
    result = play_program(entry(tasks_file, "exits"), TASK, LLM_OFF)  # sys.exit in an entry ends its episode only
    assert result.error.startswith("entry tests.agent_programs:exits raised SystemExit: 3")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name, message", [
    ("returns_text", r"returned a str \('high'\), not a reward: return a float or a dict with 'reward'"),
    ("returns_nan", r"returned the reward nan, not a finite number"),
    ("returns_huge", r"returned the reward 1e\+12, beyond es_manager.max_abs_reward=1e\+06"),
    ("returns_object", r"returned info that is not JSON: 'thing'"),
])
def test_an_entry_that_returns_no_reward_ends_in_error_naming_what_came_back(tasks_file, name, message):
    result = play_program(entry(tasks_file, name), TASK, LLM_OFF)
    assert result.error is not None and result.reward == 0.0
    assert f"tests.agent_programs:{name}" in result.error
    assert re.search(message, result.error), result.error


@pytest.mark.timeout(30)
def test_an_entry_that_hangs_ends_timed_out_and_its_thread_is_left_as_a_daemon(tasks_file):
    programs.RELEASE.clear()
    try:
        result = play_program(entry(tasks_file, "hangs", timeout_s=0.3), TASK, LLM_OFF)
        assert result.timed_out and result.reward == 0.0
        assert result.error == "entry tests.agent_programs:hangs ran past timeout_s=0.3"
        assert result.stdout == "started\n"
        left = [t for t in threading.enumerate() if t.name.startswith("ragen-agent")]
        assert left and all(t.daemon for t in left)
    finally:
        programs.RELEASE.set()


@pytest.mark.timeout(60)
def test_episodes_at_once_in_threads_each_capture_their_own_output(tasks_file):
    cfg = entry(tasks_file, "says")
    results: dict[int, ProgramResult] = {}

    def play(i):
        results[i] = play_program(cfg, {"marker": f"episode-{i}"}, LLM_OFF)

    threads = [threading.Thread(target=play, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, result in results.items():
        assert result.stdout == f"episode-{i}\n" * 200 and result.stderr == f"episode-{i}\n" * 200


@pytest.mark.timeout(30)
def test_captured_output_is_bounded_to_its_last_part(tasks_file):
    result = play_program(entry(tasks_file, "floods"), TASK, LLM_OFF)
    assert result.reward == 1.0 and len(result.stdout) == 64 * 1024
    assert result.stdout.endswith("line 019999\n")


# --- commands ---

def command(tasks_file, argv, **keys) -> AgentConfig:
    return config(tasks_file, command=argv, **keys)


@pytest.mark.timeout(30)
def test_a_command_reads_its_task_on_stdin_and_prints_its_reward_last(tasks_file):
    result = play_program(command(tasks_file, programs.PRINTS_SUM), TASK, LLM_OFF)
    assert (result.reward, result.info, result.error) == (5, {}, None)
    assert result.stdout == "working\n5\n\n"
    result = play_program(command(tasks_file, programs.PRINTS_OBJECT), TASK, LLM_OFF)
    assert (result.reward, result.info, result.error) == (0.25, {"answer": 2, "calls": 2}, None)


@pytest.mark.timeout(30)
def test_a_command_that_fails_ends_in_error_with_its_stderr_kept(tasks_file):
    result = play_program(command(tasks_file, programs.FAILS), TASK, LLM_OFF)
    assert result.error.startswith("command ") and "exited with status 3" in result.error
    assert result.stderr == "it went wrong\n" and result.reward == 0.0 and not result.timed_out
    result = play_program(command(tasks_file, programs.PRINTS_WORDS), TASK, LLM_OFF)
    assert "the last line of its stdout, 'the answer is four', is neither a number nor a JSON object" in result.error


def _gone(pgid: int, within_s: float = 5.0) -> bool:
    """No live process in group ``pgid`` once those killed have had ``within_s`` to finish dying (a
    member killed by SIGKILL runs its exit for a moment after its pipes close); a killed member
    reparented to init may stay a zombie (dead, holding nothing) until init reaps it."""
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except (OSError, ValueError):  # not a process, or one that just ended
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(entry)
        if not alive or time.monotonic() > deadline:
            return alive == []
        time.sleep(0.05)


@pytest.mark.timeout(30)
def test_a_command_that_ignores_sigterm_is_killed_with_its_whole_group(tasks_file):
    result = play_program(command(tasks_file, programs.IGNORES_TERM, timeout_s=1.0), TASK, LLM_OFF, grace_s=0.5)
    assert result.timed_out and result.reward == 0.0
    assert "ran past timeout_s=1" in result.error and result.error.endswith("then SIGKILL after 0.5 s)")
    pgid = int(result.stdout.split()[0])
    assert _gone(pgid)


@pytest.mark.timeout(30)
def test_a_command_that_handles_sigterm_has_its_grace_to_end(tasks_file):
    result = play_program(command(tasks_file, programs.CLEANS_UP, timeout_s=3.0), TASK, LLM_OFF, grace_s=20)
    assert result.timed_out and result.stderr == "cleaned up\n"
    assert result.error.endswith("was killed (SIGTERM to its process group)")


@pytest.mark.timeout(30)
def test_a_command_leaves_no_process_behind_when_it_ends(tasks_file):
    result = play_program(command(tasks_file, programs.LEAVES_CHILD), TASK, LLM_OFF)
    assert result.reward == 1.0 and result.error is None
    assert _gone(int(result.stdout.split()[0]))


@pytest.mark.timeout(30)
def test_a_command_sees_its_own_session_and_none_of_the_parents_keys(tasks_file, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-parent")
    monkeypatch.setenv("OPENAI_ORG_ID", "org-parent")
    monkeypatch.setenv("RAGEN_GATEWAY_KEY", "sk-server")
    before = dict(os.environ)
    llm = LLM("http://127.0.0.1:8/sessions/ab/v1", "sk-episode", "m")
    result = play_program(command(tasks_file, programs.SHOWS_ENV), TASK, llm)
    assert result.info["env"] == {"OPENAI_BASE_URL": llm.base_url, "OPENAI_API_BASE": llm.base_url,
                                  "OPENAI_API_KEY": "sk-episode"}
    assert dict(os.environ) == before  # nothing of the session set in the rollout's own process


@pytest.mark.timeout(30)
def test_a_command_flooding_stdout_is_bounded_and_its_reward_still_read(tasks_file):
    result = play_program(command(tasks_file, programs.FLOODS), TASK, LLM_OFF)
    assert result.reward == 0.75 and len(result.stdout) == 64 * 1024


# --- a real session of the gateway ---

@pytest.fixture(scope="module")
def gateway():
    pytest.importorskip("openai", reason="the openai client (pip install openai; the dev extra has it)")
    from tests.test_gateway import serve

    with serve() as server:
        yield server


def llm_of(server, session) -> LLM:
    return LLM(server.base_url(session), session.key, server.gateway.link.served_name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["chats", "chats_async"])
def test_an_entry_talks_to_its_gateway_session_and_returns_a_reward(tasks_file, gateway, name):
    session = gateway.open_session(seed=1, env_id=0)
    llm = llm_of(gateway, session)
    result = play_program(entry(tasks_file, name), {"q": "What is 2 + 3?"}, llm)
    llm.close()
    gateway.gateway.sessions.close(session.id)
    assert result.error is None and result.reward == (1.0 if name == "chats" else 0.5)
    (record,) = session.records
    assert record.response_ids and result.info["answer"]


@pytest.mark.timeout(60)
def test_a_timed_out_entry_whose_session_is_closed_is_refused_when_it_calls_late(tasks_file, gateway):
    import openai

    programs.RELEASE.clear()
    programs.LATE.clear()
    session = gateway.open_session()
    result = play_program(entry(tasks_file, "calls_late", timeout_s=0.2), TASK, llm_of(gateway, session))
    assert result.timed_out
    gateway.gateway.sessions.close(session.id)  # the caller closes the session the moment the episode ends
    programs.RELEASE.set()
    left = [t for t in threading.enumerate() if t.name.startswith("ragen-agent")]
    for t in left:
        t.join(10)
    assert isinstance(programs.LATE["error"], openai.APIStatusError)
    assert programs.LATE["error"].status_code == 404 and session.records == []
