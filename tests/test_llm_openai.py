"""OpenAIEngine against a small fake OpenAI-compatible server on 127.0.0.1:
answers, request fields, log-probs (parsed, missing, malformed, turned off),
retries after a 500 and after dropped connections, a hanging request turned
into an error completion, malformed replies (not JSON, no choices, token ids
out of range) turned into errors naming the server and route, the
concurrency bound, futures resolved as their replies come in, close() with
requests in flight, and the turn loop with no barrier between envs over the
server."""

from __future__ import annotations

import logging
import json
import re
import threading
import time
from concurrent.futures import CancelledError
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ragen.llm import make_engine
from ragen.llm.openai_engine import OpenAIEngine
from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import GenerationRequest, SamplingParams, request_seed
from ragen.rollout.batching import EnvLevel
from ragen.rollout.scheduler import KeptEnvs, run_envs
from ragen.rollout.types import StopReason
from ragen.serving import DirectClient, StreamingDirectClient

from tests.rollout_helpers import custom_envs, loop_config, specs_for

HANG_LIMIT_S = 5.0  # a hanging request never holds the server longer than this
LOGPROBS = [-0.5, -1.25, 0.0]  # the fake server's, one per token of token_ids [1, 2, 3]


class FakeServer:
    """Chat completions keyed by the last user message:

    - ``FAIL_ONCE:<tag>``: HTTP 500 the first time, then an answer;
    - ``HANG``: no answer until the server stops (or ``HANG_LIMIT_S``);
    - ``HOLD``: answers once ``release`` is set (or the server stops, or ``HANG_LIMIT_S``);
    - ``SLOW``: answers after 0.1 s;
    - ``BAD``: HTTP 400;
    - ``DROP_MID:<k>:<tag>``: the first k attempts get the headers and half the
      body, then the connection closes; ``DROP_NOW:<k>:<tag>``: closed with no reply;
    - anything else: answers at once, ``<answer>{prompt}|{seed}</answer>``, or
      the ``policy``'s answer (a ``ScriptedEngine``, keyed by the body's seed)
      when one is given. A body whose seed is in ``drop_seeds`` is always dropped
      mid-reply.

    The prompt is the last user message. As ``vllm serve`` does, a body with
    ``continue_final_message`` continues its last (assistant) message: the reply
    is what the policy writes after that prefix (without a policy, the usual
    answer). ``refuse_continue``: such a body gets an HTTP 400 naming the field,
    as a server without the extension answers.

    ``attempts`` counts the requests per prompt. Each recorded body carries the
    request's ``X-Session-ID`` header as ``"session"``.

    Log-probs (when the body asks for them): ``LOGPROBS``, except for prompts
    ``NO_LOGPROBS`` (no field), ``NULL_LOGPROBS`` (null), ``TEXT_LOGPROBS`` (strings),
    ``SHORT_LOGPROBS`` (one per token less).

    ``/completions`` takes token prompts (a list of ids), as ``vllm serve``
    does: with a ``tokenizer`` (ChatML), the prompt is decoded into messages and
    an answer prefix, answered as above, and the answer's ids are its tokens and
    ``<|im_end|>``; its log-probs ``-0.1 * (i + 1)`` (``token_logprobs``); the
    prompt ids are echoed (``shifted_prompt_ids``: the last one changed).
    ``token_prompts``: ``"refuse"`` answers an HTTP 400 (a server that takes
    text prompts only), ``"no_ids"`` answers without token ids (a server
    without ``return_token_ids``).

    ``max_model_len``: listed in the ``/models`` entry, as ``vllm serve`` lists its context.

    ``bad_reply`` spoils every answer of either route (``BAD_REPLIES``: not JSON,
    no choices, token ids out of range, ...). While ``failing`` is set, every
    POST gets an HTTP 500 (counted in ``failures``).
    """

    def __init__(self, lifetime_s: float = 60.0, policy: ScriptedEngine | None = None,
                 drop_seeds: frozenset[int] = frozenset(), refuse_continue: bool = False,
                 tokenizer=None, token_prompts: str = "take", shifted_prompt_ids: bool = False,
                 bad_reply: str = "", max_model_len: int | None = None):
        assert not bad_reply or bad_reply in BAD_REPLIES, bad_reply
        self.bad_reply = bad_reply
        self.failing = False
        self.failures = 0
        self.bodies: list[dict] = []
        self.token_bodies: list[dict] = []  # the /completions bodies
        self.tokenizer = tokenizer
        self.token_prompts = token_prompts
        self.shifted_prompt_ids = shifted_prompt_ids
        self.refuse_continue = refuse_continue
        self.failed: set[str] = set()
        self.attempts: dict[str, int] = {}
        self.policy = policy
        self.drop_seeds = drop_seeds
        self.release = threading.Event()
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def _send(self, code, payload, cut=False):
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: len(data) // 2] if cut else data)
                self.close_connection = True  # with a cut body: the client reads a short reply

            def do_GET(self):
                if self.path.endswith("/models"):
                    entry = {"id": "fake-model"}
                    if max_model_len is not None:
                        entry["max_model_len"] = max_model_len
                    self._send(200, {"object": "list", "data": [entry]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if server.failing:
                    with server.lock:
                        server.failures += 1
                    self._send(500, {"error": "the server is down"})
                    return
                if not self.path.endswith("/chat/completions"):
                    with server.lock:
                        server.token_bodies.append({**body, "session": self.headers.get("X-Session-ID")})
                    self._send(*server.spoiled(*server.complete_ids(body)))
                    return
                prompt = last_user(body)
                with server.lock:
                    server.bodies.append({**body, "auth": self.headers.get("Authorization"),
                                          "session": self.headers.get("X-Session-ID")})
                    server.attempts[prompt] = attempt = server.attempts.get(prompt, 0) + 1
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    answer = self._answer(body)
                finally:
                    # before the reply goes out: once the client has it, it may send its next request
                    with server.lock:
                        server.in_flight -= 1
                drop = body["seed"] in server.drop_seeds
                if prompt.startswith(("DROP_MID:", "DROP_NOW:")):
                    drop = attempt <= int(prompt.split(":")[1])
                if drop and prompt.startswith("DROP_NOW:"):
                    answer = None
                if answer is not None:
                    try:
                        self._send(*server.spoiled(*answer), cut=drop)
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the client gave up (timeout)

            def _answer(self, body):
                prompt = last_user(body)
                messages, prefix = body["messages"], ""
                if body.get("continue_final_message"):
                    if server.refuse_continue:
                        return 400, {"object": "error", "message": "continue_final_message: Extra inputs are "
                                                                   "not permitted", "type": "BadRequestError"}
                    messages, prefix = messages[:-1], messages[-1]["content"]
                if prompt.startswith("FAIL_ONCE:") and prompt not in server.failed:
                    server.failed.add(prompt)
                    return 500, {"error": "try again"}
                if prompt == "BAD":
                    return 400, {"error": "bad request"}
                if prompt == "HANG":
                    server.stopping.wait(HANG_LIMIT_S)
                    return None
                if prompt == "HOLD":
                    server.release.wait(HANG_LIMIT_S)
                if prompt == "SLOW":
                    time.sleep(0.1)
                finish = "length" if body["max_tokens"] < 5 else "stop"
                if server.policy is not None:
                    text = server.policy.answer_text(
                        GenerationRequest(messages, seed=body["seed"], answer_prefix=prefix,
                                          tools=body.get("tools")), SamplingParams())
                else:
                    text = f"<answer>{prompt}|{body['seed']}</answer>"
                choice = {"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": text}}
                if body.get("tools") and "<tool_call>" in text:  # vLLM's hermes tool parser
                    calls = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
                    choice["message"] = {"role": "assistant", "content": text[:text.find("<tool_call>")],
                                         "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
                                             "name": json.loads(c)["name"],
                                             "arguments": json.dumps(json.loads(c)["arguments"])}}
                                             for i, c in enumerate(calls)]}
                reply = {"id": "x", "object": "chat.completion", "model": body["model"], "choices": [choice]}
                if body.get("return_token_ids"):
                    choice["token_ids"] = [1, 2, 3]
                    reply["prompt_token_ids"] = [7, 8]
                if body.get("logprobs"):
                    values = {"NO_LOGPROBS": None, "NULL_LOGPROBS": None, "TEXT_LOGPROBS": ["-0.5"] * 3,
                              "SHORT_LOGPROBS": LOGPROBS[:2]}.get(prompt, LOGPROBS)
                    if prompt != "NO_LOGPROBS":
                        choice["logprobs"] = None if values is None else {"content": [
                            {"token": f"t{i}", "logprob": v, "bytes": [116], "top_logprobs": []}
                            for i, v in enumerate(values)]}
                return 200, reply

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        # Stops by itself even if a test forgets to.
        self.watchdog = threading.Timer(lifetime_s, self.stop)
        self.watchdog.daemon = True
        self.watchdog.start()

    def complete_ids(self, body):
        """The ``/completions`` reply to a token prompt (see the class docstring)."""
        if self.token_prompts == "refuse" or not isinstance(body["prompt"], list):
            return 400, {"object": "error", "message": "prompt: Input should be a valid string",
                         "type": "BadRequestError"}
        ids = body["prompt"]
        messages, prefix = parse_chatml(self.tokenizer.decode(ids))
        if self.policy is not None:
            text = self.policy.answer_text(GenerationRequest(messages, seed=body["seed"], answer_prefix=prefix),
                                           SamplingParams())
        else:
            text = f"<answer>{len(ids)}|{body['seed']}</answer>"
        answer_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        answer_ids += [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        finish = "length" if len(answer_ids) > body["max_tokens"] else "stop"
        answer_ids = answer_ids[: body["max_tokens"]]
        choice = {"index": 0, "finish_reason": finish, "text": self.tokenizer.decode(answer_ids,
                                                                                     skip_special_tokens=True)}
        if self.token_prompts != "no_ids" and body.get("return_token_ids"):
            choice["token_ids"] = answer_ids
            choice["prompt_token_ids"] = ids[:-1] + [ids[-1] + 1] if self.shifted_prompt_ids else ids
        if body.get("logprobs") is not None:
            choice["logprobs"] = {"tokens": [f"t{i}" for i in answer_ids], "text_offset": [0] * len(answer_ids),
                                  "token_logprobs": token_logprobs(len(answer_ids)), "top_logprobs": None}
        return 200, {"id": "x", "object": "text_completion", "model": body["model"], "choices": [choice]}

    def spoiled(self, code, payload):
        """``(code, payload)``, a 200 spoiled as ``bad_reply`` says."""
        if code != 200 or not self.bad_reply:
            return code, payload
        if self.bad_reply == "not_json":
            return code, b"<html><body>502 Bad Gateway</body></html>"
        payload = json.loads(json.dumps(payload))  # a copy
        choice = payload["choices"][0]
        ids = {"negative_ids": [-1], "huge_ids": [2**32], "float_ids": [1.5], "past_vocab": [10**6]}
        if self.bad_reply == "no_choices":
            del payload["choices"]
        elif self.bad_reply == "empty_choices":
            payload["choices"] = []
        elif self.bad_reply == "choice_not_object":
            payload["choices"] = ["hello"]
        elif self.bad_reply == "text_not_string":
            if "message" in choice:
                choice["message"]["content"] = 5
            else:
                choice["text"] = 5
        elif self.bad_reply == "negative_prompt_ids":
            choice["prompt_token_ids"] = payload["prompt_token_ids"] = [5, -3]
        else:
            choice["token_ids"] = [1] + ids[self.bad_reply]
            if isinstance(choice.get("logprobs"), dict) and "token_logprobs" in choice["logprobs"]:
                choice["logprobs"]["token_logprobs"] = [-0.1, -0.2]
        return code, payload

    def stop(self):
        self.stopping.set()
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.watchdog.cancel()


# what FakeServer(bad_reply=...) spoils its answers with
BAD_REPLIES = ("not_json", "no_choices", "empty_choices", "choice_not_object", "text_not_string",
               "negative_ids", "huge_ids", "float_ids", "past_vocab", "negative_prompt_ids")


def token_logprobs(n: int) -> list[float]:
    return [-0.1 * (i + 1) for i in range(n)]


def parse_chatml(text: str) -> tuple[list[dict[str, str]], str]:
    """The messages of a ChatML prompt and the text after its generation prompt (the answer prefix)."""
    messages = [{"role": r, "content": c} for r, c in re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", text, re.S)]
    return messages, text.rsplit("<|im_start|>assistant\n", 1)[-1]


def last_user(body):
    return next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")


def other_warnings(caplog) -> list[str]:
    """The warnings logged, but the one that says requests go as messages (no engine.tokenizer)."""
    return [r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and "go as chat messages" not in r.getMessage()]


@pytest.fixture
def server():
    fake = FakeServer()
    yield fake
    fake.stop()


def req(content, env_id=0, turn=0, seed=0, max_tokens=None):
    return GenerationRequest([{"role": "user", "content": content}], env_id=env_id, turn=turn, seed=seed,
                             max_tokens=max_tokens)


def test_answers_in_order_with_request_fields(server):
    engine = make_engine({"name": "openai", "base_url": server.base_url, "api_key": "sk-test", "model": "m1"}, None)
    sampling = SamplingParams(temperature=0.5, top_p=0.9, top_k=20, max_tokens=64, seed=3, stop=["</answer>"])
    reqs = [req(f"q{i}", env_id=i, turn=2, seed=9) for i in range(6)] + [req("short", max_tokens=2)]
    completions = engine.generate(reqs, sampling)
    for r, c in zip(reqs, completions):
        assert c.text == f"<answer>{r.messages[-1]['content']}|{request_seed(3, r.key)}</answer>"
        assert (c.env_id, c.turn, c.policy_version) == (r.env_id, r.turn, 0)
        assert c.prompt_token_ids == [] and c.response_token_ids == []
    assert [c.finish_reason for c in completions] == ["stop"] * 6 + ["length"]
    body = next(b for b in server.bodies if b["messages"][-1]["content"] == "q1")
    assert body["model"] == "m1" and body["auth"] == "Bearer sk-test"
    assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"], body["n"]) == (0.5, 0.9, 20, 64, 1)
    assert body["stop"] == ["</answer>"] and "return_token_ids" not in body and body["logprobs"] is True
    assert next(b for b in server.bodies if b["messages"][-1]["content"] == "short")["max_tokens"] == 2
    engine.close()


def test_model_name_from_the_server_and_token_ids(server):
    engine = OpenAIEngine(server.base_url, return_token_ids=True)
    c = engine.generate([req("hi")], SamplingParams(temperature=0.0))[0]
    assert server.bodies[-1]["model"] == "fake-model" and "top_k" not in server.bodies[-1]
    assert (c.prompt_token_ids, c.response_token_ids) == ([7, 8], [1, 2, 3])
    engine.bump_policy_version()
    assert engine.generate([req("hi")], SamplingParams())[0].policy_version == 1
    engine.close()
    # model_path names the model when the config does not
    assert make_engine({"name": "openai", "base_url": server.base_url}, "org/my-model").model == "org/my-model"


def test_logprobs_are_asked_for_and_parsed(server):
    engine = OpenAIEngine(server.base_url, model="m", return_token_ids=True)
    assert engine.returns_logprobs
    completions = engine.generate([req("hi"), req("none", max_tokens=0)], SamplingParams(temperature=0.7))
    assert server.bodies[-1]["logprobs"] is True and len(server.bodies) == 1
    assert completions[0].response_token_ids == [1, 2, 3] and completions[0].logprobs == LOGPROBS
    assert completions[1].logprobs == [] and completions[1].response_token_ids == []  # no tokens, no log-probs
    engine.close()


def test_missing_or_malformed_logprobs_give_none_and_one_warning(server, caplog):
    engine = OpenAIEngine(server.base_url, model="m", return_token_ids=True, max_concurrency=2)
    bad = ["NO_LOGPROBS", "NULL_LOGPROBS", "TEXT_LOGPROBS", "SHORT_LOGPROBS"]
    with caplog.at_level("WARNING", logger="ragen.llm.openai_engine"):
        first = engine.generate([req(p, env_id=i) for i, p in enumerate(bad + ["fine"])], SamplingParams())
        again = engine.generate([req(p) for p in bad], SamplingParams())
    assert [c.finish_reason for c in first + again] == ["stop"] * 9  # no crash, no error completions
    assert [c.logprobs for c in first] == [None] * 4 + [LOGPROBS]
    assert all(c.logprobs is None and c.response_token_ids == [1, 2, 3] for c in again)
    warnings = other_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "no usable log-probs" in warnings[0] and "off-policy correction falls back to none" in warnings[0]
    engine.close()
    # once per engine: another engine warns (once) again
    other = OpenAIEngine(server.base_url, model="m")
    with caplog.at_level("WARNING", logger="ragen.llm.openai_engine"):
        caplog.clear()
        assert other.generate([req("NO_LOGPROBS")] * 3, SamplingParams())[0].logprobs is None
    assert len(other_warnings(caplog)) == 1
    other.close()


def test_logprobs_can_be_turned_off(server, caplog):
    engine = make_engine({"name": "openai", "base_url": server.base_url, "model": "m", "logprobs": False}, None)
    assert not engine.returns_logprobs
    with caplog.at_level("WARNING", logger="ragen.llm.openai_engine"):
        c = engine.generate([req("hi")], SamplingParams())[0]
    assert "logprobs" not in server.bodies[-1] and c.logprobs is None and c.finish_reason == "stop"
    assert not other_warnings(caplog)  # not asked for, so nothing to warn about
    engine.close()
    with pytest.raises(ValueError, match="engine.logprobs must be true or false"):
        OpenAIEngine(server.base_url, logprobs="false")


def test_server_error_is_retried(server):
    engine = OpenAIEngine(server.base_url, model="m", max_retries=2, backoff_s=0.01)
    completions = engine.generate([req("FAIL_ONCE:a"), req("fine")], SamplingParams())
    assert [c.finish_reason for c in completions] == ["stop", "stop"]
    assert completions[0].text.startswith("<answer>FAIL_ONCE:a|")
    assert sum(b["messages"][-1]["content"] == "FAIL_ONCE:a" for b in server.bodies) == 2
    engine.close()


def test_hanging_and_bad_requests_become_error_completions(server, caplog):
    engine = OpenAIEngine(server.base_url, model="m", timeout_s=0.3, max_retries=1, backoff_s=0.01)
    start = time.perf_counter()
    with caplog.at_level("WARNING", logger="ragen.llm.openai_engine"):
        completions = engine.generate([req("ok", env_id=0), req("HANG", env_id=1), req("BAD", env_id=2)],
                                      SamplingParams())
    assert time.perf_counter() - start < HANG_LIMIT_S  # gave up on the hang, did not wait it out
    assert [c.finish_reason for c in completions] == ["stop", "error", "error"]
    assert completions[1].text == "" and completions[1].env_id == 1
    assert sum(b["messages"][-1]["content"] == "HANG" for b in server.bodies) == 2  # 1 try + 1 retry
    assert sum(b["messages"][-1]["content"] == "BAD" for b in server.bodies) == 1  # 4xx: no retry
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "env 1" in messages and "timed out" in messages.lower() and "HTTP 400" in messages
    engine.close()


def test_the_answer_prefix_is_continued_by_the_server():
    """The prefix goes as a last assistant message with continue_final_message (vLLM's and
    SGLang's extension); the completion is the server's reply: what follows the prefix."""
    server = FakeServer(policy=ScriptedEngine(seed=1))
    engine = OpenAIEngine(server.base_url, model="m")
    try:
        messages = [{"role": "system", "content": "Your available actions are:\nUp, Down\nup to 2 actions"},
                    {"role": "user", "content": "State 1"}]
        reqs = [GenerationRequest(messages, env_id=i, seed=i, answer_prefix="<think>") for i in range(4)]
        plain = engine.generate([replace(r, answer_prefix="") for r in reqs], SamplingParams())
        prefixed = engine.generate(reqs, SamplingParams())
        for r, a, b in zip(reqs, plain, prefixed):
            assert a.text.startswith("<think>") and b.text == a.text[len("<think>"):]
            body = next(x for x in server.bodies[4:] if x["seed"] == request_seed(0, r.key))
            assert body["messages"] == messages + [{"role": "assistant", "content": "<think>"}]
            assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
        assert not any("continue_final_message" in x or "add_generation_prompt" in x
                       for x in server.bodies[:4])  # no prefix: a plain chat request
    finally:
        engine.close()
        server.stop()


def test_a_server_that_refuses_the_continue_fields_says_so(caplog):
    server = FakeServer(refuse_continue=True)
    engine = OpenAIEngine(server.base_url, model="m", max_retries=2, backoff_s=0.01)
    try:
        with caplog.at_level("WARNING", logger="ragen.llm.openai_engine"):
            prefixed, plain = engine.generate([GenerationRequest([{"role": "user", "content": "q"}], env_id=3,
                                                                 answer_prefix="<think>"), req("q")], SamplingParams())
        assert prefixed.finish_reason == "error" and plain.finish_reason == "stop"
        assert len(server.bodies) == 2  # refused: not retried
        message = " ".join(r.getMessage() for r in caplog.records)
        assert "env 3" in message and "HTTP 400" in message
        assert "continue_final_message=true" in message and "add_generation_prompt=false" in message
        assert "must support" in message
    finally:
        engine.close()
        server.stop()


def test_unreachable_server_gives_error_completions():
    engine = OpenAIEngine("http://127.0.0.1:9/v1", model="m", timeout_s=0.5, max_retries=1, backoff_s=0.01)
    assert [c.finish_reason for c in engine.generate([req("a"), req("b")], SamplingParams())] == ["error"] * 2
    no_model = OpenAIEngine("http://127.0.0.1:9/v1", timeout_s=0.5, max_retries=0)
    assert no_model.generate([req("a")], SamplingParams())[0].finish_reason == "error"


def test_concurrency_is_bounded(server):
    engine = OpenAIEngine(server.base_url, model="m", max_concurrency=3)
    start = time.perf_counter()
    completions = engine.generate([req("SLOW", env_id=i) for i in range(9)], SamplingParams())
    assert all(c.finish_reason == "stop" for c in completions)
    assert server.max_in_flight == 3  # never more, and the pool was used
    assert time.perf_counter() - start >= 0.3  # 9 requests / 3 at a time * 0.1 s
    engine.close()


def wait_for(condition, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.01)


@pytest.mark.timeout(30)
def test_submit_resolves_each_future_when_its_reply_is_in(server):
    engine = OpenAIEngine(server.base_url, model="m", max_concurrency=2)
    assert engine.streams
    slow, fast = engine.submit([req("HOLD", env_id=0), req("fast", env_id=1)], SamplingParams(seed=4))
    assert fast.result(timeout=5).text == f"<answer>fast|{request_seed(4, (0, 1, 0))}</answer>"
    assert not slow.done()  # answered out of order: the fast one did not wait for it
    server.release.set()
    assert slow.result(timeout=5).finish_reason == "stop" and slow.result().env_id == 0
    engine.close()


@pytest.mark.timeout(30)
def test_submit_keeps_at_most_max_concurrency_requests_in_flight(server):
    engine = OpenAIEngine(server.base_url, model="m", max_concurrency=3)
    futures = engine.submit([req("HOLD", env_id=i) for i in range(7)], SamplingParams())
    wait_for(lambda: server.in_flight == 3)
    time.sleep(0.2)  # the queued four stay queued while three are held
    assert len(server.bodies) == 3 and not any(f.done() for f in futures)
    server.release.set()
    assert [f.result(timeout=5).env_id for f in futures] == list(range(7))
    assert server.max_in_flight == 3 and len(server.bodies) == 7
    engine.close()


@pytest.mark.timeout(30)
def test_dropped_connections_are_retried(server):
    engine = OpenAIEngine(server.base_url, model="m", max_retries=2, backoff_s=0.01)
    prompts = ["DROP_MID:2:a", "DROP_NOW:2:b", "fine"]
    futures = engine.submit([req(p, env_id=i) for i, p in enumerate(prompts)], SamplingParams())
    completions = [f.result(timeout=10) for f in futures]
    assert [c.finish_reason for c in completions] == ["stop"] * 3
    assert [c.text.split("|")[0] for c in completions] == [f"<answer>{p}" for p in prompts]
    assert [server.attempts[p] for p in prompts] == [3, 3, 1]  # two dropped, then the answer
    engine.close()


@pytest.mark.timeout(30)
def test_a_request_dropped_every_time_becomes_an_error_completion(server, caplog):
    engine = OpenAIEngine(server.base_url, model="m", max_retries=1, backoff_s=0.01)
    prompts = ["DROP_MID:99:a", "fine", "DROP_NOW:99:b", "fine too"]
    with caplog.at_level("WARNING", logger="ragen.llm.openai_engine"):
        futures = engine.submit([req(p, env_id=i, turn=5) for i, p in enumerate(prompts)], SamplingParams())
        completions = [f.result(timeout=10) for f in futures]  # a Completion, never an exception
    assert [c.finish_reason for c in completions] == ["error", "stop", "error", "stop"]
    assert completions[0].text == "" and (completions[2].env_id, completions[2].turn) == (2, 5)
    assert server.attempts["DROP_MID:99:a"] == server.attempts["DROP_NOW:99:b"] == 2  # 1 try + 1 retry
    warnings = other_warnings(caplog)
    assert len(warnings) == 2
    assert "env 0 turn 5" in warnings[0] + warnings[1] and "env 2 turn 5" in warnings[0] + warnings[1]
    assert "IncompleteRead" in " ".join(warnings) and "RemoteDisconnected" in " ".join(warnings)
    engine.close()


def failure_warnings(caplog) -> list[str]:
    """The warnings that a request ended in error."""
    return [r.getMessage() for r in caplog.records if "finish_reason='error'" in r.getMessage()]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad, why", [
    ("negative_ids", "token id -1 is negative"), ("huge_ids", f"token id {2**32} is outside 32 bits"),
    ("float_ids", "token id 1.5 is not an integer"), ("negative_prompt_ids", "token id -3 is negative"),
    ("not_json", "not JSON"), ("no_choices", "no choices"), ("empty_choices", "no choices"),
    ("choice_not_object", "no choices"), ("text_not_string", "not a string")])
def test_a_malformed_reply_is_an_error_naming_the_server_and_route(bad, why, caplog):
    """Token ids out of range, a reply that is not JSON, without choices or with the wrong
    types: that request's error completion (no ids reach the rollout), and a warning that
    names the env, the server and the route. The server answered: no retry."""
    server = FakeServer(bad_reply=bad)
    engine = OpenAIEngine(server.base_url, model="m", return_token_ids=True, max_retries=2, backoff_s=0.01)
    try:
        with caplog.at_level("WARNING", logger="ragen.llm.openai_engine"):
            completion = engine.generate([req("q", env_id=3, turn=1)], SamplingParams())[0]
    finally:
        engine.close()
        server.stop()
    assert completion.finish_reason == "error"
    assert (completion.text, completion.prompt_token_ids, completion.response_token_ids) == ("", [], [])
    (warning,) = failure_warnings(caplog)
    assert "env 3 turn 1" in warning and f"malformed reply from {server.base_url}/chat/completions" in warning
    assert why in warning, warning
    assert server.attempts["q"] == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad, why", [("past_vocab", "token id 1000000 is outside the vocabulary's"),
                                      ("negative_ids", "token id -1 is negative"),
                                      ("negative_prompt_ids", "token id -3 is negative"),
                                      ("not_json", "not JSON"), ("no_choices", "no choices")])
def test_a_malformed_reply_to_a_token_prompt_is_an_error_not_a_switch_to_messages(bad, why, tiny_model_path,
                                                                                   tiny_tokenizer, caplog):
    server = FakeServer(tokenizer=tiny_tokenizer, bad_reply=bad)
    engine = OpenAIEngine(server.base_url, model="m", tokenizer=tiny_model_path, max_retries=2, backoff_s=0.01)
    try:
        with caplog.at_level("WARNING", logger="ragen.llm.openai_engine"):
            completion = engine.generate([req("q", env_id=2)], SamplingParams())[0]
    finally:
        engine.close()
        server.stop()
    assert completion.finish_reason == "error" and completion.response_token_ids == []
    (warning,) = failure_warnings(caplog)
    assert f"malformed reply from {server.base_url}/completions" in warning and why in warning, warning
    assert len(server.token_bodies) == 1 and not server.bodies and engine.stats().token_prompt_fallbacks == 0
    assert engine.vocab_size == len(tiny_tokenizer)  # the tiny model's config says the same


@pytest.mark.timeout(120)
def test_ids_out_of_range_end_the_envs_in_error_not_the_parallel_rollout(caplog):
    """Workers hold ids as unsigned 32-bit integers: a server's negative id, let through,
    failed the worker and then the sequential fallback, naming neither server nor env."""
    from ragen.llm_agent import LLMAgentProxy

    from tests.rollout_helpers import agent_setup

    server = FakeServer(policy=ScriptedEngine(malformed_rate=0.1), bad_reply="negative_ids")
    engine = OpenAIEngine(server.base_url, model="m", return_token_ids=True)
    try:
        with caplog.at_level(logging.WARNING):
            with LLMAgentProxy(agent_setup(use_parallel_rollout=True), engine) as proxy:
                result = proxy.rollout("val", rollout_index=1)
    finally:
        engine.close()
        server.stop()
    assert result.trajectories and all(t.stop_reason == StopReason.ERROR for t in result.trajectories)
    assert (f"malformed reply from {server.base_url}/chat/completions: choices[0].token_ids: token id -1 is "
            f"negative") in caplog.text


def test_the_vocabulary_is_the_larger_of_the_tokenizers_and_the_model_configs(tiny_tokenizer, tmp_path):
    """Models pad their embedding past the tokenizer (a server may sample a padded id): the
    model folder's config.json counts when it says more."""
    tiny_tokenizer.save_pretrained(tmp_path)
    assert OpenAIEngine("http://127.0.0.1:9/v1", tokenizer=str(tmp_path)).vocab_size == len(tiny_tokenizer)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": len(tiny_tokenizer) + 64}))
    assert OpenAIEngine("http://127.0.0.1:9/v1", tokenizer=str(tmp_path)).vocab_size == len(tiny_tokenizer) + 64
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": len(tiny_tokenizer) + 8}}))
    assert OpenAIEngine("http://127.0.0.1:9/v1", tokenizer=str(tmp_path)).vocab_size == len(tiny_tokenizer) + 8
    assert OpenAIEngine("http://127.0.0.1:9/v1").vocab_size is None  # no tokenizer: 32 bits is the bound


@pytest.mark.timeout(30)
def test_close_resolves_every_future_at_once(server):
    engine = OpenAIEngine(server.base_url, model="m", max_concurrency=2, timeout_s=30)
    futures = engine.submit([req("HOLD", env_id=i) for i in range(6)], SamplingParams())
    waiting: list[BaseException] = []

    def generate() -> None:
        try:
            engine.generate([req("HOLD", env_id=9)], SamplingParams())
        except BaseException as exc:  # handed to the test
            waiting.append(exc)

    caller = threading.Thread(target=generate, daemon=True)
    caller.start()
    wait_for(lambda: server.in_flight == 2)  # two in flight, five queued
    start = time.perf_counter()
    engine.close()
    assert time.perf_counter() - start < 1.0  # does not wait for the server
    assert all(f.cancelled() for f in futures)  # in flight and queued alike
    with pytest.raises(CancelledError):
        futures[0].result(timeout=0)
    caller.join(1.0)  # a caller waiting in generate sees the cancel
    assert not caller.is_alive() and len(waiting) == 1 and isinstance(waiting[0], CancelledError)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([req("late")], SamplingParams())
    server.release.set()
    time.sleep(0.1)  # the held replies come in and change nothing
    assert all(f.cancelled() for f in futures) and len(server.bodies) == 2


@pytest.mark.timeout(30)
def test_close_stops_a_request_waiting_to_retry(server):
    engine = OpenAIEngine(server.base_url, model="m", max_retries=3, backoff_s=10.0)
    before = set(threading.enumerate())
    (future,) = engine.submit([req("DROP_NOW:99:a")], SamplingParams())
    wait_for(lambda: server.attempts.get("DROP_NOW:99:a") == 1)
    engine.close()
    assert future.cancelled()
    pool_threads = [t for t in set(threading.enumerate()) - before if t.name.startswith("openai-engine")]
    assert len(pool_threads) == 1
    for t in pool_threads:
        t.join(2.0)  # the backoff wait ends with close(), not after its 10 s
    assert not any(t.is_alive() for t in pool_threads)
    assert server.attempts["DROP_NOW:99:a"] == 1


def env_level_setup(drop_env: int | None = None):
    """Specs, a loop config and a fake server answering with the scripted policy;
    every request of env ``drop_env`` (by its request seed) dropped mid-reply."""
    specs = specs_for(["FrozenLake", "Bandit", "SimpleSokoban"], [2, 1, 1], 2, custom_envs(), seed=7)
    config = loop_config(max_turn=3)
    drop = frozenset()
    if drop_env is not None:
        spec = next(s for s in specs if s.env_id == drop_env)
        drop = frozenset(request_seed(config.sampling.seed, (spec.seed, spec.env_id, t)) for t in range(3))
    return specs, config, FakeServer(policy=ScriptedEngine(malformed_rate=0.1), drop_seeds=drop)


@pytest.mark.timeout(120)
def test_env_level_over_the_server_gives_the_lockstep_trajectories():
    specs, config, server = env_level_setup()
    engine = OpenAIEngine(server.base_url, model="m", max_concurrency=4)
    try:
        reference, _ = run_envs(specs, DirectClient(engine), config, kept_envs=KeptEnvs())
        got, stats = run_envs(specs, StreamingDirectClient(engine), config, kept_envs=KeptEnvs(), batching=EnvLevel())
    finally:
        engine.close()
        server.stop()
    assert got == reference
    assert all(t.finish_reason == "stop" for tr in got for t in tr.turns)
    assert any(t.executed_actions for tr in got for t in tr.turns)  # the policy's answers were played
    assert stats.requests == stats.submits == sum(len(tr.turns) for tr in got)  # one request an env and turn


@pytest.mark.timeout(120)
def test_every_request_carries_its_episode_as_the_session_key():
    """``X-Session-ID`` is ``{seed}-{env_id}``: one value for all turns of an episode (a router
    keeps them on one server), another for each other episode, group members included."""
    specs, config, server = env_level_setup()
    engine = OpenAIEngine(server.base_url, model="m", max_concurrency=4)
    try:
        got, _ = run_envs(specs, StreamingDirectClient(engine), config, kept_envs=KeptEnvs(), batching=EnvLevel())
    finally:
        engine.close()
        server.stop()
    episode = {request_seed(config.sampling.seed, (s.seed, s.env_id, t)): s for s in specs for t in range(3)}
    sessions = [body["session"] for body in server.bodies]
    assert sessions == [f"{episode[b['seed']].seed}-{episode[b['seed']].env_id}" for b in server.bodies]
    assert len(sessions) == sum(len(tr.turns) for tr in got) > len(specs)  # later turns keep their episode's key
    assert len({s.seed for s in specs}) < len(set(sessions)) == len(specs)  # group members share a seed, not a key


def run_with_a_dropped_env(drop_env: int):
    """The env-level trajectories with ``drop_env``'s requests dropped, and the reference without."""
    specs, config, server = env_level_setup()
    engine = OpenAIEngine(server.base_url, model="m", max_concurrency=4)
    try:
        reference, _ = run_envs(specs, DirectClient(engine), config, kept_envs=KeptEnvs())
    finally:
        engine.close()
        server.stop()
    specs, config, server = env_level_setup(drop_env)
    engine = OpenAIEngine(server.base_url, model="m", max_concurrency=4, max_retries=1, backoff_s=0.01)
    try:
        got, _ = run_envs(specs, StreamingDirectClient(engine), config, kept_envs=KeptEnvs(), batching=EnvLevel())
    finally:
        engine.close()
        server.stop()
    return specs, reference, got


@pytest.mark.timeout(120)
def test_an_env_whose_requests_fail_ends_in_error_and_the_others_finish(caplog):
    with caplog.at_level(logging.WARNING):
        specs, reference, got = run_with_a_dropped_env(drop_env=3)
    index = next(i for i, s in enumerate(specs) if s.env_id == 3)
    assert [t for i, t in enumerate(got) if i != index] == [t for i, t in enumerate(reference) if i != index]
    assert got[index].stop_reason == StopReason.ERROR and not got[index].turns
    assert "could not answer its request of turn 0" in got[index].error
    assert "env 3 turn 0" in caplog.text  # the engine's warning says why, in the rollout log


# -- token prompts: /completions with the ids the engine builds -----------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)


def fallback_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "go as chat messages" in r.getMessage()]


CHAT = [{"role": "system", "content": "Available actions: Up, Down. You can take up to 2 actions per turn."},
        {"role": "user", "content": "State 1"}]


def test_token_prompts_go_to_completions_and_a_second_turn_appends(tiny_model_path, tiny_tokenizer, caplog):
    server = FakeServer(tokenizer=tiny_tokenizer)
    engine = make_engine({"name": "openai", "base_url": server.base_url, "model": "m",
                          "tokenizer": tiny_model_path}, None)
    sampling = SamplingParams(temperature=0.5, top_p=0.9, top_k=20, max_tokens=64, seed=3, stop=["</answer>"])
    try:
        with caplog.at_level("WARNING", logger="ragen.llm.openai_engine"):
            first = engine.generate([GenerationRequest(CHAT, env_id=4, turn=0, seed=9, answer_prefix="<think>")],
                                    sampling)[0]
            body = server.token_bodies[-1]
            assert body["prompt"] == engine.chat.full(CHAT, "<think>") == first.prompt_token_ids
            assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"], body["n"]) == \
                (0.5, 0.9, 20, 64, 1)
            assert body["seed"] == request_seed(3, (9, 4, 0)) and body["stop"] == ["</answer>"]
            assert body["session"] == "9-4"  # the episode's key, on the token path too
            assert body["return_token_ids"] is True and body["logprobs"] == 0 and "messages" not in body
            assert first.text == f"<answer>{len(body['prompt'])}|{body['seed']}</answer>"
            assert first.response_token_ids[-1] == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
            assert first.logprobs == token_logprobs(len(first.response_token_ids))
            assert first.finish_reason == "stop" and first.env_id == 4

            # the next turn: the ids so far (prompt and sampled answer), then the new message's tokens
            history = first.prompt_token_ids + first.response_token_ids
            messages = CHAT + [{"role": "assistant", "content": "<think>" + first.text},
                               {"role": "user", "content": "State 2"}]
            second = engine.generate([GenerationRequest(messages, env_id=4, turn=1, seed=9, answer_prefix="<think>",
                                                        history_token_ids=history, history_messages=3)],
                                     sampling)[0]
        sent = server.token_bodies[-1]["prompt"]
        assert server.token_bodies[-1]["session"] == "9-4"  # the next turn: the same key
        assert sent[:len(history)] == history and sent == second.prompt_token_ids
        assert sent == engine.chat.append(history, messages, 3, "<think>")[0]
        assert tiny_tokenizer.decode(sent[len(history):]).endswith("<|im_start|>user\nState 2<|im_end|>\n"
                                                                   "<|im_start|>assistant\n<think>")
        assert not server.bodies and engine.stats().token_prompt_fallbacks == 0  # no chat request, nothing counted
        assert not caplog.records
    finally:
        engine.close()
        server.stop()


def test_a_zero_token_limit_sends_nothing_and_keeps_the_prompt_ids(tiny_model_path, tiny_tokenizer):
    server = FakeServer(tokenizer=tiny_tokenizer)
    engine = OpenAIEngine(server.base_url, model="m", tokenizer=tiny_model_path)
    try:
        c = engine.generate([req("q", max_tokens=0)], SamplingParams())[0]
        assert c.prompt_token_ids == engine.chat.full(req("q").messages) and c.response_token_ids == []
        assert c.finish_reason == "length" and not server.token_bodies and not server.bodies
    finally:
        engine.close()
        server.stop()


def test_without_a_tokenizer_requests_go_as_messages_warned_once_and_counted(server, caplog):
    engine = OpenAIEngine(server.base_url, model="m")
    assert engine.chat is None
    with caplog.at_level("WARNING", logger="ragen.llm.openai_engine"):
        engine.generate([req(f"q{i}", env_id=i) for i in range(3)], SamplingParams())
        engine.generate([req("q", max_tokens=0)], SamplingParams())  # nothing sent: not counted
        engine.generate([req("again")], SamplingParams())
    assert engine.stats().token_prompt_fallbacks == 4 and not server.token_bodies
    (warning,) = fallback_warnings(caplog)
    assert server.base_url in warning and "engine.tokenizer is not set" in warning
    engine.close()


@pytest.mark.parametrize("mode, why", [("refuse", "HTTP 400"), ("no_ids", "carries no token ids")])
def test_a_server_that_refuses_token_prompts_switches_to_messages_once(mode, why, tiny_model_path, tiny_tokenizer,
                                                                        caplog):
    server = FakeServer(tokenizer=tiny_tokenizer, token_prompts=mode)
    engine = OpenAIEngine(server.base_url, model="m", tokenizer=tiny_model_path, max_concurrency=1,
                          return_token_ids=True)
    try:
        with caplog.at_level("WARNING", logger="ragen.llm.openai_engine"):
            first = engine.generate([req("q0"), req("q1", env_id=1)], SamplingParams())
            later = engine.generate([req(f"later{i}", env_id=i) for i in range(3)], SamplingParams())
        # the first request tried ids, was refused, and went as messages; every later one went straight there
        assert len(server.token_bodies) == 1 and len(server.bodies) == 5
        assert [c.finish_reason for c in first + later] == ["stop"] * 5
        assert first[0].text == f"<answer>q0|{request_seed(0, (0, 0, 0))}</answer>"
        assert first[0].prompt_token_ids == [7, 8]  # the server's prompt ids on the chat path
        assert engine.stats().token_prompt_fallbacks == 5
        (warning,) = fallback_warnings(caplog)
        assert server.base_url in warning and "refused a token prompt" in warning and why in warning
    finally:
        engine.close()
        server.stop()


def test_a_request_refused_as_messages_too_is_an_error_not_a_switch(tiny_model_path, tiny_tokenizer):
    """A 4xx for the request itself (e.g. too long a prompt) does not turn token prompts off."""
    server = FakeServer(tokenizer=tiny_tokenizer, token_prompts="refuse")
    engine = OpenAIEngine(server.base_url, model="m", tokenizer=tiny_model_path)
    try:
        assert engine.generate([req("BAD")], SamplingParams())[0].finish_reason == "error"
        assert engine.stats().token_prompt_fallbacks == 0
        engine.generate([req("q")], SamplingParams())  # still tried as ids first, then refused for good
        assert len(server.token_bodies) == 2 and engine.stats().token_prompt_fallbacks == 1
    finally:
        engine.close()
        server.stop()


def test_other_prompt_ids_from_the_server_are_the_completions_and_warn_once(tiny_model_path, tiny_tokenizer,
                                                                           caplog):
    server = FakeServer(tokenizer=tiny_tokenizer, shifted_prompt_ids=True)
    engine = OpenAIEngine(server.base_url, model="m", tokenizer=tiny_model_path)
    try:
        with caplog.at_level("WARNING", logger="ragen.llm.openai_engine"):
            completions = engine.generate([req(f"q{i}", env_id=i) for i in range(3)], SamplingParams())
        sent = [body["prompt"] for body in server.token_bodies]
        assert sorted(sent) == sorted(engine.chat.full(req(f"q{i}").messages) for i in range(3))
        # the ids the server says it sampled after (its last one changed), not those sent
        assert sorted(c.prompt_token_ids for c in completions) == sorted(ids[:-1] + [ids[-1] + 1] for ids in sent)
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "other prompt ids than those sent" in warnings[0]
    finally:
        engine.close()
        server.stop()


def test_given_prompt_ids_go_as_those_ids_with_or_without_a_tokenizer(tiny_tokenizer):
    """A request whose prompt ids are given (the gateway's) goes to /completions as them, even where
    every other request goes as messages (no engine.tokenizer here)."""
    server = FakeServer(tokenizer=tiny_tokenizer)
    engine = OpenAIEngine(server.base_url, model="m")
    ids = tiny_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = tiny_tokenizer(ids, add_special_tokens=False)["input_ids"]
    try:
        given = GenerationRequest(CHAT, env_id=2, prompt_token_ids=ids)
        plain, first = engine.generate([req("q"), given], SamplingParams())
        assert len(server.bodies) == 1 and [b["prompt"] for b in server.token_bodies] == [ids]
        assert first.prompt_token_ids == ids and first.response_token_ids and first.finish_reason == "stop"
        assert first.logprobs == token_logprobs(len(first.response_token_ids))
        assert engine.stats().token_prompt_fallbacks == 1  # the plain request alone went as messages
    finally:
        engine.close()
        server.stop()


@pytest.mark.parametrize("mode", ["refuse", "no_ids"])
def test_given_prompt_ids_a_server_takes_no_token_prompt_for_are_an_error_never_messages(mode, tiny_model_path,
                                                                                        tiny_tokenizer):
    server = FakeServer(tokenizer=tiny_tokenizer, token_prompts=mode)
    engine = OpenAIEngine(server.base_url, model="m", tokenizer=tiny_model_path)
    try:
        ids = engine.chat.full(CHAT)
        (c,) = engine.generate([GenerationRequest(CHAT, prompt_token_ids=ids)], SamplingParams())
        assert c.finish_reason == "error" and "prompt_token_ids" in c.text and "never as messages" in c.text
        assert not server.bodies and [b["prompt"] for b in server.token_bodies] == [ids]
        assert engine.stats().token_prompt_fallbacks == 0
    finally:
        engine.close()
        server.stop()


def test_the_context_is_the_servers_max_model_len_where_it_lists_one(server):
    listing = FakeServer(max_model_len=300)
    try:
        assert OpenAIEngine(listing.base_url).max_model_len == 300
        assert OpenAIEngine(server.base_url, model="m").max_model_len is None  # not listed
        assert OpenAIEngine("http://127.0.0.1:9/v1", max_retries=0).max_model_len is None  # no server
    finally:
        listing.stop()


def test_the_tokenizer_option_is_checked(tmp_path):
    with pytest.raises(ValueError, match="engine.tokenizer="):
        make_engine({"name": "openai", "tokenizer": str(tmp_path / "missing")}, None)
    with pytest.raises(ValueError, match="engine.tokenizer must be null"):
        make_engine({"name": "openai", "tokenizer": 3}, None)
    with pytest.raises(ValueError, match="engine.tokenizer=.*no chat template"):
        OpenAIEngine("http://127.0.0.1:9/v1", tokenizer=type("T", (), {"chat_template": None})())


@pytest.mark.timeout(180)
def test_a_rollout_over_token_prompts_plays_as_over_messages_and_counts_fallbacks(tiny_model_path, tiny_tokenizer):
    """The scripted policy behind the server: token prompts give the trajectories that messages
    give; a server that refuses them gives the same, with every request counted in the metrics."""
    from ragen.rollout.backends.sequential import SequentialRollout

    specs = specs_for(["FrozenLake", "Bandit", "SimpleSokoban"], [2, 1, 1], 2, custom_envs(), seed=7)
    config = loop_config(max_turn=3)
    results = {}
    for label, kwargs, tokenizer in [("messages", {}, None), ("ids", {}, tiny_model_path),
                                     ("refused", {"token_prompts": "refuse"}, tiny_model_path)]:
        server = FakeServer(policy=ScriptedEngine(malformed_rate=0.1), tokenizer=tiny_tokenizer, **kwargs)
        engine = OpenAIEngine(server.base_url, model="m", tokenizer=tokenizer, return_token_ids=True)
        backend = SequentialRollout(engine)
        try:
            results[label] = backend.rollout(specs, config)
        finally:
            backend.close()
            engine.close()
            server.stop()
    ids, messages, refused = results["ids"], results["messages"], results["refused"]
    assert ids.trajectories == messages.trajectories == refused.trajectories
    assert any(t.executed_actions for tr in ids.trajectories for t in tr.turns)
    requests = sum(len(tr.turns) for tr in ids.trajectories)
    assert ids.metrics["engine/token_prompt_fallbacks"] == 0  # every prompt went as ids: reported as 0
    assert messages.metrics["engine/token_prompt_fallbacks"] == refused.metrics["engine/token_prompt_fallbacks"] \
        == requests
    later = [t for tr in ids.trajectories for t in tr.turns[1:]]
    assert later and all(t.prompt_start > 0 for t in later)  # later turns appended to the episode's ids


# -- opt-in: a real `vllm serve` of the default model -------------------------------------------
# RAGEN_OPENAI_TEST_URL=http://127.0.0.1:PORT/v1 for a server started with
#   <vllm venv>/bin/python -m vllm.entrypoints.openai.api_server \
#       --model <resolve_model_path('default')> --dtype float32 --enforce-eager --port PORT
REAL_URL = __import__("os").environ.get("RAGEN_OPENAI_TEST_URL")


@pytest.mark.skipif(not REAL_URL, reason="set RAGEN_OPENAI_TEST_URL to a vllm server of the default model")
@pytest.mark.timeout(300)
def test_a_real_vllm_server_takes_token_prompts_as_it_answers_messages(caplog):
    ids_engine = OpenAIEngine(REAL_URL, tokenizer="default", return_token_ids=True)
    chat_engine = OpenAIEngine(REAL_URL, return_token_ids=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    first = GenerationRequest(CHAT, env_id=0, turn=0, seed=1)
    try:
        with caplog.at_level("WARNING", logger="ragen.llm.openai_engine"):
            a = ids_engine.generate([first], greedy)[0]
            assert not caplog.records  # the server took the ids and reported the same prompt ids
        b = chat_engine.generate([first], greedy)[0]
        assert a.prompt_token_ids == b.prompt_token_ids  # our render is the server's
        assert (a.text, a.response_token_ids, a.finish_reason) == (b.text, b.response_token_ids, b.finish_reason)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        history = a.prompt_token_ids + a.response_token_ids
        messages = CHAT + [{"role": "assistant", "content": a.text}, {"role": "user", "content": "State 2"}]
        caplog.clear()  # the chat engine's warning (no tokenizer)
        with caplog.at_level("WARNING", logger="ragen.llm.openai_engine"):
            c = ids_engine.generate([GenerationRequest(messages, env_id=0, turn=1, seed=1, history_token_ids=history,
                                                       history_messages=3)], greedy)[0]
            assert not caplog.records
        assert c.prompt_token_ids[:len(history)] == history and c.response_token_ids and c.finish_reason != "error"
        assert len(c.logprobs) == len(c.response_token_ids)
        assert ids_engine.stats().token_prompt_fallbacks == 0
    finally:
        ids_engine.close()
        chat_engine.close()


# RAGEN_OPENAI_TOOLS=1 too when that server was started with --enable-auto-tool-choice --tool-call-parser hermes
@pytest.mark.skipif(not (REAL_URL and __import__("os").environ.get("RAGEN_OPENAI_TOOLS")),
                    reason="set RAGEN_OPENAI_TEST_URL and RAGEN_OPENAI_TOOLS=1 for a vllm server with a tool parser")
@pytest.mark.timeout(300)
def test_a_real_vllm_server_with_a_tool_parser_plays_a_tool_env_both_ways():
    from tests.test_tool_calls import counter_tag

    specs = specs_for(["Counter"], [2], 1, custom_envs(Counter=counter_tag()))
    for kw, parser in (({}, "server"), ({"tokenizer": "default"}, "hermes")):
        loop = loop_config(max_turn=3)
        loop = replace(loop, context=replace(loop.context, tool_parser=parser),
                       sampling=replace(loop.sampling, temperature=0.0, max_tokens=40))
        engine = OpenAIEngine(REAL_URL, **kw)
        try:
            trajs, _ = run_envs(specs, DirectClient(engine), loop, kept_envs=KeptEnvs(), isolate_errors=True)
            assert all(t.stop_reason is StopReason.MAX_TURNS and len(t.turns) == 3 for t in trajs)
            # the server took the tools and the tool messages (none is an error) and said which calls it parsed
            assert all(x.finish_reason != "error" for t in trajs for x in t.turns)
            if parser == "server":
                assert all(x.tool_calls is not None for t in trajs for x in t.turns)
            else:
                assert engine.stats().token_prompt_fallbacks == 0
        finally:
            engine.close()
