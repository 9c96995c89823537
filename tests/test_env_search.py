"""The search env against a real retrieval server (BM25 over the shipped corpus):
the server's API (RAGEN's client, unchanged, calls it), its key and bounds, the
env's episodes and rewards, and servers that are down, slow or answer garbage."""

from __future__ import annotations

import base64
import importlib.util
import json
import logging
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ragen.env import make_env, make_env_config
from ragen.env.check.checker import check_env
from ragen.env.search.client import RetrievalError, RetrievalTimeout, retrieve
from ragen.env.search.corpus import load_corpus, questions, shipped_corpus
from ragen.env.search.env import f1_score, normalize_answer
from ragen.env.search.pool import scripted_answer
from ragen.env.search.server import RetrievalServer
from ragen.llm.tool_calls import call_text
from ragen.rollout.types import StopReason

from tests.rollout_helpers import ROOT, custom_envs, loop_config, sequential, specs_for

pytestmark = pytest.mark.timeout(120)
pytest.importorskip("bm25s", reason="the retrieval server's BM25: pip install -e '.[envs]' (bm25s==0.3.16)")


KEY = "the-key-of-this-module's-server"


@pytest.fixture(scope="module", autouse=True)
def client_key():
    """The clients here hold the key the server here is made with (forked children too)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAGEN_RETRIEVAL_KEY", KEY)
        yield


@pytest.fixture(scope="module")
def server():
    with RetrievalServer(shipped_corpus(filler=2000), key=KEY) as srv:
        yield srv


def _post(url, body: bytes, key=KEY):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url + "/retrieve", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


# ----- corpus and server ------------------------------------------------------------------------------------

def test_every_question_is_answered_by_a_document():
    text = "\n".join(d.contents for d in shipped_corpus())
    qs = questions()
    assert len(qs) >= 1000 and len({q.question for q in qs}) == len(qs)
    assert all(q.answer in text for q in qs)
    assert questions() == qs  # the same every time


def test_the_server_answers_as_ragens_retrieval_server_does(server):
    q = next(q for q in questions() if q.hops == 1)
    status, body = _post(server.url, json.dumps({"query": q.question, "top_k": 3}).encode())
    assert status == 200 and body["method"] == "bm25" and body["num_results"] == 3
    assert set(body["results"][0]) == {"id", "content", "score"} and q.answer in body["results"][0]["content"]
    with urllib.request.urlopen(server.url + "/health", timeout=10) as response:
        health = json.loads(response.read())
    assert health["status"] == "healthy" and health["corpus_size"] == len(shipped_corpus(filler=2000))


@pytest.mark.parametrize("body, status, words", [
    (b"not json", 400, "not JSON"),
    (b'{"top_k": 3}', 400, "Missing 'query'"),
    (b'{"query": "x", "top_k": 500}', 400, "top_k must be an integer from 1 to 50"),
    (json.dumps({"query": "x" * 3000}).encode(), 400, "longer than 2000"),
    (b'{"query": "' + b"x" * 70_000 + b'"}', 413, "at most 65536 bytes"),
])
def test_bad_requests_are_refused_with_the_reason(server, body, status, words):
    got, payload = _post(server.url, body)
    assert got == status and words in payload["error"]


def test_a_search_without_the_key_is_refused_and_names_the_variable(server, monkeypatch):
    q = json.dumps({"query": "town", "top_k": 2}).encode()
    for key in (None, "wrong", KEY[:-1]):
        status, body = _post(server.url, q, key=key)
        assert status == 401 and "needs its key" in body["error"] and "results" not in body
    basic = base64.b64encode(f"anyone:{KEY}".encode()).decode()  # a netrc file's or a URL's user:key
    request = urllib.request.Request(server.url + "/retrieve", data=q, headers={"Authorization": f"Basic {basic}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read())["num_results"] == 2
    monkeypatch.delenv("RAGEN_RETRIEVAL_KEY")
    with pytest.raises(RetrievalError, match=r"HTTP 401: .*needs its key.* environment variable RAGEN_RETRIEVAL_KEY "
                                             r"\(env_config.key_env\), which is unset here"):
        retrieve(server.url, "town", 2, 10)
    env = make_env("search", {"server_url": server.url})
    env.reset(seed=0)
    with pytest.raises(RetrievalError, match="401"):
        env.step("search[town]")
    monkeypatch.setenv("MY_KEY", KEY)
    env = make_env("search", {"server_url": server.url, "key_env": "MY_KEY"})
    env.reset(seed=0)
    assert "[Document 1]" in env.step("search[town]")[0]


def test_a_server_given_no_key_makes_one(monkeypatch):
    with RetrievalServer(shipped_corpus()[:10]) as a, RetrievalServer(shipped_corpus()[:10]) as b:
        assert len(a.key) >= 40 and a.key != b.key != KEY
        with pytest.raises(RetrievalError, match="401"):
            retrieve(a.url, "town", 1, 10)
        monkeypatch.setenv("RAGEN_RETRIEVAL_KEY", a.key)
        assert retrieve(a.url, "town", 1, 10)


def test_a_server_beyond_loopback_or_a_key_in_the_url_is_refused_at_config_read(monkeypatch):
    monkeypatch.delenv("RAGEN_RETRIEVAL_KEY")
    with pytest.raises(ValueError, match=r"env_config.server_url: 'http://10.1.2.3:8000' is beyond loopback.*"
                                         r"RAGEN_RETRIEVAL_KEY"):
        make_env_config("search", {"server_url": "http://10.1.2.3:8000"}, tag="S")
    with pytest.raises(ValueError, match=r"env_config.server_url: the URL holds a user or key") as info:
        make_env_config("search", {"server_url": "http://me:s3cret@127.0.0.1:8000"}, tag="S")
    assert "s3cret" not in str(info.value)


def test_ragens_own_retrieval_client_runs_against_the_server(server, tmp_path, monkeypatch):
    """Unchanged: it sends no key of its own, and requests reads one from a netrc file."""
    spec = importlib.util.spec_from_file_location("ragen_retrieval_client",
                                                  ROOT / "tests" / "fixtures" / "ragen" / "search" / "retrieval_client.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("NETRC", str(netrc_with(tmp_path, KEY)))
    client = module.RetrievalClient(server_url=server.url, max_results=3)
    assert client.available
    q = next(q for q in questions() if q.hops == 1)
    shown = client.search(q.question)
    assert shown.startswith("[Document 1] (ID: town-") and q.answer in shown


def netrc_with(folder: Path, key: str) -> Path:
    """A netrc file (0600) giving 127.0.0.1 the key: what a client reads it from, such as RAGEN's."""
    path = folder / "netrc"
    path.touch(mode=0o600)
    path.write_text(f"machine 127.0.0.1 login ragen password {key}\n")
    return path


def test_a_corpus_file_is_read_and_bad_lines_are_named(tmp_path):
    good = tmp_path / "c.jsonl"
    good.write_text('{"id": "a", "contents": "alpha"}\n\n{"id": "b", "text": "beta"}\n')
    assert [d.contents for d in load_corpus(good)] == ["alpha", "beta"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "contents": "alpha"}\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a corpus line"):
        load_corpus(bad)


def test_the_command_line_serves_until_sigterm_and_prints_a_key_it_made(tmp_path, monkeypatch):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f"doc {i} about tea"}) + "\n" for i in range(5)))
    proc = subprocess.Popen([sys.executable, "-m", "ragen.tools.retrieval_server", "--corpus", str(corpus),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    try:
        line = proc.stdout.readline()  # bounded by the test's timeout
        assert line.startswith("serving 5 documents at "), proc.stderr.read()
        url = line.split(" at ")[1].strip()
        export = proc.stdout.readline()
        assert export.startswith("export RAGEN_RETRIEVAL_KEY="), export
        key = export.split("=", 1)[1].split()[0]
        with pytest.raises(RetrievalError, match="401"):
            retrieve(url, "tea", 2, 10)  # this module's key is not the one it made
        monkeypatch.setenv("RAGEN_RETRIEVAL_KEY", key)
        assert retrieve(url, "tea", 2, 10)[0]["content"].endswith("about tea")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "stopped after 1 searches" in out and key not in out


# ----- the env ----------------------------------------------------------------------------------------------

def test_an_episode_searches_then_answers(server):
    env = make_env("search", {"server_url": server.url, "top_k": 2})
    seed = next(s for s in range(100) if questions()[s].hops == 1)
    q = questions()[seed]
    assert env.reset(seed=seed) == f"Question: {q.question}\nAvailable actions: search[<query>], finish[<answer>]"
    obs, reward, done, info = env.step(f"search[{q.question}]")
    assert (reward, done, info["action_type"]) == (0.0, False, "search")
    assert obs.startswith(f"Search results for '{q.question}':\n[Document 1]") and q.answer in obs
    obs, reward, done, info = env.step(f"  FINISH[ {q.answer.upper()} ] ")
    assert (reward, done, info["success"]) == (1.0, True, True)


def test_rewards_exact_match_and_f1():
    assert normalize_answer("The  Blue, cheese!") == "blue cheese"
    assert f1_score("blue cheese", "cheese") == pytest.approx(2 / 3)
    env = make_env("search", {"server_url": "http://127.0.0.1:9"})
    seed = next(s for s in range(200) if questions()[s].question.startswith("Who is the mayor of") and
                questions()[s].hops == 1)
    env.reset(seed=seed)
    first = questions()[seed].answer.split()[0]
    assert env.step(f"finish[{first}]")[1] == pytest.approx(2 / 3)  # half the name: F1 2/3 over the threshold
    em = make_env("search", {"server_url": "http://127.0.0.1:9", "reward": "em"})
    em.reset(seed=seed)
    assert em.step(f"finish[{first}]")[1:3] == (0.0, True)


def test_invalid_actions_change_nothing_and_searches_are_bounded(server):
    env = make_env("search", {"server_url": server.url, "max_steps": 2})
    shown = env.reset(seed=0)
    for bad in ("look around", "search[]", "finish [", 3):
        obs, reward, done, info = env.step(bad)
        assert (obs, done, info["action_is_valid"]) == (shown, False, False)
    env.step("search[tea]")
    obs, reward, done, _ = env.step("search[town]")
    assert done and reward == 0.0 and obs.endswith("Episode ended without an answer.")


def test_a_query_over_the_bound_is_an_invalid_action_naming_it_and_nothing_is_sent(server):
    """Issue 58: the server refuses a query over 2,000 characters (HTTP 400), which raised RetrievalError
    and ended the env in error; the long query is the model's mistake, told to it."""
    env = make_env("search", {"server_url": server.url, "max_steps": 2})
    env.reset(seed=0)
    sent = server.requests
    obs, reward, done, info = env.step("search[" + "town " * 600 + "]")
    assert (reward, done, info["action_is_valid"]) == (0.0, False, False)
    assert obs.startswith("Your query has 2999 characters; a query may have at most 2000.") and \
        obs.endswith("Available actions: search[<query>], finish[<answer>]")
    assert server.requests == sent and env.render() == obs
    obs, _, done, _ = env.step({"name": "search", "arguments": {"query": "x" * 2001}})
    assert "at most 2000" in obs and not done and server.requests == sent
    obs, _, done, info = env.step("search[" + "t" * 2000 + "]")  # at the bound: sent
    assert info["action_is_valid"] and server.requests == sent + 1 and not done
    short = make_env("search", {"server_url": server.url, "max_query_chars": 10})
    short.reset(seed=0)
    assert "at most 10." in short.step("search[eleven char]")[0]


def long_query_first(prompt, rng):
    """A search over the bound first (text or tool form); once told the limit, the scripted reader."""
    if "at most 2000" in prompt or "maxLength is 2000" in prompt:
        return scripted_answer(prompt, rng)
    query = "town " * 600
    return (call_text("search", {"query": query}) if "<tools>" in prompt else f"search[{query}]"), 0.0


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool_calls"])
def test_in_a_rollout_a_long_query_is_the_models_mistake_and_the_episode_goes_on(server, tools):
    from dataclasses import replace

    from ragen.llm.scripted import ScriptedEngine

    envs = custom_envs(S={"env_type": "search", "max_actions_per_traj": 5, "env_instruction": "Answer.",
                          "max_tokens": 4000, "env_config": {"server_url": server.url, "tool_calls": tools}})
    loop = loop_config(max_turn=5)
    loop = replace(loop, sampling=replace(loop.sampling, max_tokens=4000), env_retries=0)
    trajs = sequential(specs_for(["S"], [3], 1, envs), loop,
                       engine=ScriptedEngine(answers="tests.test_env_search:long_query_first"))
    for t in trajs:
        assert t.stop_reason is StopReason.DONE and t.error is None and len(t.turns) >= 3, (t.stop_reason, t.error)
        first = t.turns[0]
        if tools:  # a call off the schema: not run, the format penalty, and the reason as its tool message
            assert first.executed_actions == [] and first.penalty == loop.format_penalty
            assert first.tool_results[0] == ("Error in tool call 1: the arguments of search do not match its "
                                             "parameters at query: 3000 characters, where its maxLength is 2000")
        else:  # an invalid action of the env: its observation names the limit
            assert "a query may have at most 2000" in t.turns[1].observation


@pytest.mark.parametrize("env_config, key", [
    ({"server_url": "ftp://127.0.0.1:1"}, "server_url"), ({"server_url": "http://127.0.0.1:1", "reward": "x"}, "reward"),
    ({"server_url": "http://127.0.0.1:1", "top_k": 0}, "top_k"),
    ({"server_url": "http://127.0.0.1:1", "max_query_chars": 0}, "max_query_chars"),
])
def test_bad_values_are_refused_naming_the_key(env_config, key):
    with pytest.raises(ValueError, match=rf"custom_envs.S.env_config.{key}:"):
        make_env_config("search", env_config, tag="S")


def test_a_server_that_is_down_at_start_up_is_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        make_env("search", {"server_url": "http://127.0.0.1:7"}, tag="S")
    assert "the retrieval server http://127.0.0.1:7 does not answer /health" in caplog.text


def test_the_env_checker_passes_the_search_env(server):
    report = check_env("search", {"server_url": server.url}, seeds=3, max_steps=4)
    assert report.ok, report.format()


# ----- servers that fail -----------------------------------------------------------------------------------

class _Bad(ThreadingHTTPServer):
    def __init__(self, answer):
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                answer(self)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()


def _garbage(handler):
    handler.send_response(200)
    handler.send_header("Content-Length", "6")
    handler.end_headers()
    handler.wfile.write(b"<html>")


def _slow(handler):
    time.sleep(2)


def test_servers_that_fail_end_the_search_naming_them():
    with pytest.raises(RetrievalError, match=r"retrieval server http://127.0.0.1:9: cannot connect"):
        retrieve("http://127.0.0.1:9", "q", 3, 5)
    for answer, error, words in ((_garbage, RetrievalError, "no list of results"), (_slow, RetrievalTimeout, "0.3 s")):
        bad = _Bad(answer)
        try:
            with pytest.raises(error, match=rf"retrieval server {bad.url}: .*{words}"):
                retrieve(bad.url, "q", 3, 0.3)
        finally:
            bad.shutdown()
            bad.server_close()


def test_in_a_rollout_a_dead_server_ends_its_envs_in_error_and_a_slow_one_in_timeout():
    for answer, reason in ((None, StopReason.ERROR), (_slow, StopReason.TIMEOUT)):
        bad = _Bad(answer) if answer else None
        url = bad.url if bad else "http://127.0.0.1:9"
        envs = custom_envs(S={"env_type": "search", "max_actions_per_traj": 3, "env_instruction": "Answer.",
                              "env_config": {"server_url": url, "timeout_s": 0.3}})
        from dataclasses import replace

        trajs = sequential(specs_for(["S"], [2], 1, envs), replace(loop_config(), env_retries=0),
                           engine=_search_engine())
        if bad:
            bad.shutdown()
            bad.server_close()
        assert [t.stop_reason for t in trajs] == [reason] * 2
        assert all(f"retrieval server {url}" in t.error for t in trajs)


def _search_engine():
    from ragen.llm.scripted import ScriptedEngine

    return ScriptedEngine(answers="ragen.env.search.pool:scripted_answer")


def test_the_scripted_reader_plays_whole_episodes_against_the_server(server):
    envs = custom_envs(S={"env_type": "search", "max_actions_per_traj": 5, "env_instruction": "Answer.",
                          "env_config": {"server_url": server.url}})
    trajs = sequential(specs_for(["S"], [12], 1, envs), loop_config(max_turn=5), engine=_search_engine())
    assert all(t.stop_reason is StopReason.DONE and len(t.turns) >= 2 for t in trajs)  # a search, then the answer
    assert sum(t.success for t in trajs) >= 4
    assert scripted_answer("no question here", random.Random(0)) is None
    latencies = [c for t in trajs for turn in t.turns for c in turn.costs.get("retrieval_s", [])]
    searches = sum(a.startswith("search[") for t in trajs for turn in t.turns for a in turn.executed_actions)
    assert len(latencies) == searches > 0 and min(latencies) > 0  # each search's round trip, measured


def test_a_two_hop_question_takes_two_searches(server):
    seed = next(s for s in range(len(questions())) if questions()[s].hops == 2)
    env = make_env("search", {"server_url": server.url})
    prompt, rng, actions = env.reset(seed=seed), random.Random(0), []
    done = False
    while not done:
        action, _ = scripted_answer(prompt, rng)
        actions.append(action.split("[")[0])
        obs, reward, done, _ = env.step(action)
        prompt += "\n" + obs
    assert actions == ["search", "search", "finish"]


def _searches_in_a_fork(url: str, queue) -> None:
    from ragen.env.search import client

    pool = client._pool()
    results = [len(retrieve(url, f"town {i}", 2, 10.0)) for i in range(20)]
    queue.put((id(pool), results))


def test_a_forked_process_searches_on_connections_of_its_own(server):
    """The multiprocessing backend forks: a child that kept the parent's kept-alive connections
    would read answers meant for the parent (or another child) on them."""
    import multiprocessing

    from ragen.env.search import client

    assert retrieve(server.url, "town", 2, 10.0)  # the parent holds a kept-alive connection now
    parent = id(client._pool())
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    children = [ctx.Process(target=_searches_in_a_fork, args=(server.url, queue)) for _ in range(3)]
    for p in children:
        p.start()
    got = [queue.get(timeout=60) for _ in children]
    for p in children:
        p.join(timeout=30)
    assert all(pid_pool != parent and results == [2] * 20 for pid_pool, results in got)
    assert retrieve(server.url, "town", 2, 10.0)
