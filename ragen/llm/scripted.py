"""A scripted policy: a deterministic stand-in for a language model.

``ScriptedEngine`` answers in the agent format ``<think>...</think><answer>...</answer>``
without any model, so the rollout machinery can be tested and benchmarked
without torch:

- *Choices* (which actions, how many, which arithmetic expression, whether the
  answer is malformed) come from a generator seeded by ``request_seed`` of
  (engine seed, sampling seed, request key): the same request gets the same
  answer in any batch, order or process. Nothing global is random.
- *Actions*: the names follow ``Available actions:`` on its line, or on the
  next line after RAGEN's ``Your available actions are:``; ``up to N actions``
  gives the most per turn, joined by ``" || "``. Without such a line (language
  tasks such as Countdown), the answer is a short expression over integers
  from the last user message, e.g. ``3 + 5 * 2``.
- *Answer prefix*: the answer is written whole; when it starts with the
  request's ``answer_prefix`` (RAGEN's ``<think>``), the completion is the rest
  (its text, bytes and log-probs), and the prompt ids end with the prefix. A
  prefix that opens the answer tag (``<answer>``, RAGEN without thinking) gets
  an answer without a thought, whatever ``think`` says.
- *Answers of a task* (``answers: package.module:function``): a function of
  the request's whole prompt text and its seeded generator that returns the
  answer and its log-probability, or None for the default answer; e.g. the
  code env's pool of right and wrong programs
  (``ragen.env.code.pool:scripted_answer``). The text ends with the
  request's tools as the Hermes block lists them, when it has tools; an
  answer that starts with ``<tool_call>`` follows the thoughts as it is.
- *Malformed answers* at rate ``malformed_rate``: no tags, empty answer,
  unknown action, unclosed tag or nested tags, so parsers meet every defect.
- *Tokens*: a byte-level tokenizer (utf-8 bytes: ``vocab_size`` 256) of a
  plain rendering of the messages (``byte_chat``; a request's history ids are
  taken as they are and the new messages' bytes appended); ``max_tokens``
  truncates the response (finish reason ``length``).
- *Log-probs*: the log-probability of the choices that made the answer (each
  uniform among its options; the malformed draw at ``malformed_rate``), on
  the first response token, 0 on the rest (they follow from the choices).
- *Cost model* of a GPU engine: each ``generate`` call sleeps
  ``base_s + per_token_s * response tokens in the call`` (a sleep, so it holds
  no CPU, as a GPU-bound call would not).
- *Continuous batching* (``engine.continuous_batching``, a ``DecodeModel``):
  ``ScriptedStreamingEngine`` gives the same answers, each returned at the
  decode step where its request ends. The engine runs decode steps of
  ``step_s + step_per_request_s x running requests`` (times ``time_scale``);
  a request joins at the next step boundary and runs for its own number of
  steps, drawn from its request seed (lognormal: ``tokens_median``,
  ``tokens_sigma``, at most ``tokens_max``). The steps are waits, not work;
  ``steps`` and ``running_sum`` count the steps run and the requests running
  summed over them (their ratio: the mean batch decoded).
- *Streaming* (``stream_tokens``, told to a ``TokenSink``): the answer's ids in
  ``PIECES`` parts, the call's wait spread between them; on the continuous
  engine, each part at its share of the request's decode steps.
"""

from __future__ import annotations

import logging
import math
import random
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ragen.config_reader import read, setting
from ragen.errors import ConfigError
from ragen.llm.chat_tokens import ChatTokens
from ragen.llm.pending import PendingFutures, fail_closed
from ragen.llm.tool_calls import CALL_OPEN, tools_system_text
from ragen.llm.types import (Completion, Engine, GenerationRequest, SamplingParams,
                              StreamingEngine, TokenSink, request_seed)

logger = logging.getLogger(__name__)

ACTION_SEPARATOR = " || "
PIECES = 4  # the parts in which a streaming request's answer is told (stream_tokens)
MALFORMED_KINDS = ("no_tags", "empty_answer", "unknown_action", "unclosed_tag", "nested_tags")

# "Available actions: A, B" on one line, or RAGEN's "Your available actions are:" and the
# names on the next line
_ACTIONS_LINE = re.compile(r"^[^\S\n]*(?:your[^\S\n]+)?available actions(?:[^\S\n]+are)?[^\S\n]*:"
                           r"[^\S\n]*(?:\n[^\S\n]*)?(\S[^\n]*?)[^\S\n]*$", re.IGNORECASE | re.MULTILINE)
_MAX_ACTIONS = re.compile(r"up to (\d+) actions?", re.IGNORECASE)
_INTEGER = re.compile(r"\d+")
_THOUGHTS = (
    "Let me look at the state.",
    "I should move closer to the goal.",
    "Try something simple.",
    "Check the numbers first.",
)
_OPERATORS = ("+", "-", "*")


def _import_answers(path: str | None) -> Any:
    """The function ``engine.answers`` names (``package.module:function``), or None."""
    if path is None:
        return None
    import importlib

    module, sep, name = str(path).partition(":")
    try:
        fn = getattr(importlib.import_module(module), name) if sep and module and name else None
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"engine.answers={path!r}: cannot import it: {type(exc).__name__}: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"engine.answers={path!r}: expected 'package.module:function', a function of the prompt "
                          "text and a random.Random that returns (answer, log-probability) or None")
    return fn


def render_messages(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
    """The plain text that the byte tokenizer encodes as the prompt: the scripted chat template."""
    parts = [f"<|{m.get('role', 'user')}|>\n{m.get('content', '')}\n" for m in messages]
    return "".join(parts) + ("<|assistant|>\n" if add_generation_prompt else "")


def byte_chat() -> ChatTokens:
    """The scripted engine's template (``render_messages``) and byte tokenizer (utf-8 bytes)."""
    return ChatTokens(render_messages, _utf8, {}, "scripted", source=(byte_chat, ()))


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def last_user_message(messages: Sequence[Mapping[str, str]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            return m.get("content", "")
    return messages[-1].get("content", "") if messages else ""


def parse_action_space(prompt: str) -> tuple[list[str], int]:
    """Action names and the most actions per turn (1 when not stated)."""
    match = _ACTIONS_LINE.search(prompt)
    if match is None:
        return [], 1
    names = [n.strip().strip(".").strip() for n in match.group(1).split(",")]
    names = [n for n in names if n]
    limit = _MAX_ACTIONS.search(prompt)
    return names, (max(1, int(limit.group(1))) if limit else 1)


class ScriptedEngine(Engine):
    """Deterministic fake policy; see the module docstring."""

    name = "scripted"
    returns_logprobs = True
    config_keys = ("seed", "malformed_rate", "base_s", "per_token_s", "think", "return_prompt_ids",
                   "max_actions", "continuous_batching", "answers")

    def __init__(
        self,
        *,
        seed: int = 0,
        malformed_rate: float = 0.0,
        base_s: float = 0.0,
        per_token_s: float = 0.0,
        think: bool = True,
        return_prompt_ids: bool = True,
        max_actions: int = 5,
        answers: str | None = None,
    ) -> None:
        super().__init__()
        self.check_options({"malformed_rate": malformed_rate, "base_s": base_s, "per_token_s": per_token_s,
                            "max_actions": max_actions})
        self.seed = int(seed)
        self.malformed_rate = float(malformed_rate)
        self.base_s = float(base_s)
        self.per_token_s = float(per_token_s)
        self.think = bool(think)
        self.return_prompt_ids = bool(return_prompt_ids)
        self.chat = byte_chat()
        self.vocab_size = 256  # its token ids are utf-8 bytes
        # RAGEN's prompt states only the episode's action budget ("up to N actions"), not a
        # turn's: a model's answer holds a few; the script's at most this many
        self.max_actions = int(max_actions)
        self.answers = _import_answers(answers)
        self._closed = False

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        malformed_rate = options.get("malformed_rate", 0.0)
        if not 0.0 <= float(malformed_rate) <= 1.0:
            raise ConfigError(f"engine.malformed_rate={malformed_rate} must be within [0, 1]")
        max_actions = options.get("max_actions", 5)
        if isinstance(max_actions, bool) or not isinstance(max_actions, int) or max_actions < 1:
            raise ConfigError(f"engine.max_actions={max_actions!r} must be an integer >= 1")
        base_s, per_token_s = options.get("base_s", 0.0), options.get("per_token_s", 0.0)
        if base_s < 0 or per_token_s < 0:
            raise ConfigError(f"engine.base_s={base_s} and engine.per_token_s={per_token_s} must be >= 0")
        if options.get("continuous_batching") is not None:
            if base_s or per_token_s:
                raise ConfigError("engine.base_s and engine.per_token_s time whole calls; with "
                                  "engine.continuous_batching the decode steps time each request: set one of the two")
            decode = options["continuous_batching"]
            if not isinstance(decode, DecodeModel):
                read(DecodeModel, decode, "engine.continuous_batching")

    @classmethod
    def streams_with(cls, options: dict[str, Any]) -> bool:
        return options.get("continuous_batching") is not None

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], model_path: str | None = None) -> "ScriptedEngine":
        """The scripted policy has no weights: ``model_path`` is unused. With
        ``continuous_batching`` set, the engine that batches continuously."""
        cfg = dict(cfg)
        decode = cfg.pop("continuous_batching", None)
        if decode is not None:
            return ScriptedStreamingEngine(continuous_batching=decode, **cfg)
        return cls(**cfg)

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Completion]:
        return self.generate_reporting(requests, sampling, None)

    def generate_reporting(self, requests: Sequence[GenerationRequest], sampling: SamplingParams,
                           on_tokens: TokenSink | None) -> list[Completion]:
        """``generate``; the answers of the requests with ``stream_tokens`` told to ``on_tokens`` in
        ``PIECES`` parts, the call's wait spread between them."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        completions = [self._complete(r, sampling) for r in requests]
        n_tokens = sum(len(c.response_token_ids) for c in completions)
        delay = self.base_s + self.per_token_s * n_tokens
        told = {} if on_tokens is None else {i: c.response_token_ids for i, (r, c) in
                                             enumerate(zip(requests, completions)) if r.stream_tokens}
        if told:
            for k in range(PIECES):
                if delay > 0:
                    time.sleep(delay / PIECES)
                part = {i: piece(ids, k, k + 1) for i, ids in told.items()}
                on_tokens({i: ids for i, ids in part.items() if ids})
        elif delay > 0:
            time.sleep(delay)
        self._stats.tokens_sampled += n_tokens
        return completions

    def close(self) -> None:
        """Later calls raise, as a stopped engine's would."""
        self._closed = True
        super().close()

    def answer_text(self, request: GenerationRequest, sampling: SamplingParams) -> str:
        """The answer's text after the request's prefix, untruncated (a completion's text
        without a token limit); a pure function of its inputs."""
        return self._after_prefix(request, self._answer(request, sampling)[0])

    @staticmethod
    def _after_prefix(request: GenerationRequest, answer: str) -> str:
        """What follows the request's ``answer_prefix`` in ``answer``: the rest when the
        answer starts with it, else all of it (the script wrote no prefix)."""
        prefix = request.answer_prefix
        return answer[len(prefix):] if prefix and answer.startswith(prefix) else answer

    def _answer(self, request: GenerationRequest, sampling: SamplingParams) -> tuple[str, float]:
        """The full answer and the log-probability of the script's choices that made it."""
        # random.Random, not numpy: seeding one per request is much cheaper, and this
        # engine's own CPU time counts against the driver in benchmarks
        rng = random.Random(request_seed(self.seed, (sampling.seed, *request.key)))
        prompt = last_user_message(request.messages)
        names, max_actions = parse_action_space(prompt)
        if not names:  # instructions may sit in an earlier (system) message
            names, max_actions = parse_action_space("\n".join(m.get("content", "") for m in request.messages))
        given = self.answers(self._prompt_text(request), rng) if self.answers is not None else None
        if given is not None:
            answer, logp = given
        elif names:
            answer, logp = self._actions(rng, names, min(max_actions, self.max_actions))
        else:
            answer, logp = self._expression(rng, prompt)
        thought = _THOUGHTS[rng.randrange(len(_THOUGHTS))]
        # a prefix that opens the answer tag (RAGEN without thinking) leaves no room for a thought
        thinks = self.think and not request.answer_prefix.startswith("<answer>")
        think = f"<think>{thought}</think>" if thinks else ""
        if thinks:
            logp -= math.log(len(_THOUGHTS))
        # Always drawn, so the well-formed answers do not shift with the rate.
        malformed = rng.random() < self.malformed_rate
        kind = MALFORMED_KINDS[rng.randrange(len(MALFORMED_KINDS))]
        if given is not None and answer.startswith(CALL_OPEN):  # tool calls stand after the thoughts as they are
            return f"{think}{answer}", logp
        if not malformed:
            return f"{think}<answer>{answer}</answer>", logp + math.log1p(-self.malformed_rate)
        logp += math.log(self.malformed_rate) - math.log(len(MALFORMED_KINDS))
        if kind == "no_tags":
            return answer, logp
        if kind == "empty_answer":
            return f"{think}<answer></answer>", logp
        if kind == "unknown_action":
            return f"{think}<answer>{'Jump' if names else 'banana'}</answer>", logp
        if kind == "unclosed_tag":
            return f"{think}<answer>{answer}", logp
        return f"{think}<answer><answer>{answer}</answer></answer>", logp

    @staticmethod
    def _prompt_text(request: GenerationRequest) -> str:
        """What an ``answers`` function reads: the messages' contents, then the request's
        tools as the Hermes block lists them."""
        text = "\n".join(m.get("content", "") for m in request.messages)
        return text + "\n" + tools_system_text(request.tools) if request.tools else text

    def _complete(self, request: GenerationRequest, sampling: SamplingParams) -> Completion:
        answer, logp = self._answer(request, sampling)
        text = self._after_prefix(request, answer)
        response_ids = list(text.encode("utf-8"))
        limit = request.token_limit(sampling)
        finish_reason = "stop"
        if len(response_ids) > limit:
            response_ids = response_ids[: max(0, limit)]
            text = bytes(response_ids).decode("utf-8", errors="ignore")
            finish_reason = "length"
        prompt_ids = self.prompt_ids(request) if self.return_prompt_ids else []
        # the choices' log-probability on the first token (every later byte follows from
        # them with probability 1): the tokens' log-probs sum to the answer's
        logprobs = [logp] + [0.0] * (len(response_ids) - 1) if response_ids else []
        return Completion.answering(request, text, prompt_ids, response_ids, finish_reason, self.policy_version,
                                    logprobs)

    @staticmethod
    def _actions(rng: random.Random, names: list[str], max_actions: int) -> tuple[str, float]:
        count = rng.randint(1, max_actions)
        text = ACTION_SEPARATOR.join(names[rng.randrange(len(names))] for _ in range(count))
        return text, -math.log(max_actions) - count * math.log(len(names))

    @staticmethod
    def _expression(rng: random.Random, prompt: str) -> tuple[str, float]:
        numbers = _INTEGER.findall(prompt)
        if not numbers:
            return str(rng.randrange(10)), -math.log(10)
        drawn = rng.randint(2, 4)
        count = min(len(numbers), drawn)
        # every draw of 2..4 that min() maps to this count, then the ordered pick, then the operators
        logp = math.log(sum(min(len(numbers), d) == count for d in (2, 3, 4)) / 3)
        logp -= sum(math.log(len(numbers) - i) for i in range(count)) + (count - 1) * math.log(len(_OPERATORS))
        picked = [numbers[i] for i in rng.sample(range(len(numbers)), count)]
        parts = [picked[0]]
        for number in picked[1:]:
            parts += [_OPERATORS[rng.randrange(len(_OPERATORS))], number]
        return " ".join(parts), logp


CLOSE_WAIT_S = 5.0  # how long close() waits for the decode thread, which sleeps one step at most


@dataclass(frozen=True)
class DecodeModel:
    """``engine.continuous_batching``: the cost of a decode step and the number of steps each request runs."""

    step_s: float = setting(0.015, above=0.0)
    step_per_request_s: float = setting(0.0, minimum=0.0)
    tokens_median: float = setting(100.0, above=0.0)
    tokens_sigma: float = setting(1.0, minimum=0.0)
    tokens_max: int = setting(2048, minimum=1)
    time_scale: float = setting(1.0, above=0.0)  # applied to every step's cost

    def step_cost(self, running: int) -> float:
        return (self.step_s + self.step_per_request_s * running) * self.time_scale

    def tokens(self, seed: int) -> int:
        """The steps a request runs, from its seed: the same in every process, batch and order."""
        draw = self.tokens_median * math.exp(self.tokens_sigma * random.Random(seed).gauss(0.0, 1.0))
        return max(1, min(self.tokens_max, round(draw)))


def piece(ids: list[int], start: int, end: int) -> list[int]:
    """Parts ``start`` to ``end`` of the ``PIECES`` parts of ``ids``."""
    return ids[len(ids) * start // PIECES: len(ids) * end // PIECES]


@dataclass(eq=False)
class _Running:
    future: Future
    request: GenerationRequest
    sampling: SamplingParams
    left: int  # decode steps still to run
    # a request that streams: its sink, its index in its submit and its answer's ids (told by parts)
    sink: TokenSink | None = None
    index: int = 0
    ids: list[int] | None = None
    steps: int = 0  # its decode steps in all
    told: int = 0  # the parts told

    def due(self) -> int:
        """The parts of its answer that its steps run so far have reached."""
        return (self.steps - self.left) * PIECES // self.steps

    def until_part(self) -> int:
        """The steps until its next part is due (its steps left, when it does not stream)."""
        if self.sink is None:
            return self.left
        ran = self.steps - self.left
        return min(self.left, max(1, -(-(self.told + 1) * self.steps // PIECES) - ran))


class ScriptedStreamingEngine(ScriptedEngine, StreamingEngine):
    """``ScriptedEngine``'s answers, each returned at the decode step where its
    request ends; see the module docstring."""

    def __init__(self, *, continuous_batching: DecodeModel | Mapping[str, Any] | None = None, **scripted: Any) -> None:
        super().__init__(**scripted)  # checks the scripted options
        decode = continuous_batching if continuous_batching is not None else {}
        self.decode = decode if isinstance(decode, DecodeModel) else read(DecodeModel, decode,
                                                                          "engine.continuous_batching")
        # the cost models together (the built DecodeModel is not read again)
        self.check_options({"base_s": self.base_s, "per_token_s": self.per_token_s,
                            "continuous_batching": self.decode})
        self.steps = 0
        self.running_sum = 0
        self._cond = threading.Condition()
        self._waiting: list[_Running] = []  # join at the next step boundary
        self._running: list[_Running] = []
        self._pending = PendingFutures()  # the futures not resolved yet; close() fails them
        self._closed = False
        self._thread = threading.Thread(target=self._decode, name="ragen-scripted-decode", daemon=True)
        self._thread.start()

    generate = StreamingEngine.generate  # submit and wait: not ScriptedEngine's timed call
    generate_reporting = StreamingEngine.generate_reporting

    def submit(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Future]:
        return self.submit_reporting(requests, sampling, None)

    def submit_reporting(self, requests: Sequence[GenerationRequest], sampling: SamplingParams,
                         on_tokens: TokenSink | None) -> list[Future]:
        """``submit``; each request with ``stream_tokens`` tells ``on_tokens`` its answer in ``PIECES``
        parts, each at its share of the request's decode steps, the last before its future resolves."""
        entries = [_Running(Future(), r, sampling, self.decode_steps(r, sampling)) for r in requests]
        for i, e in enumerate(entries):
            if on_tokens is not None and e.request.stream_tokens:
                e.sink, e.index, e.steps = on_tokens, i, e.left
                e.ids = self._complete(e.request, sampling).response_token_ids
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._pending.add(e.future for e in entries)
            self._waiting += entries
            self._cond.notify_all()
        return [e.future for e in entries]

    def decode_steps(self, request: GenerationRequest, sampling: SamplingParams) -> int:
        """The decode steps ``request`` runs (its answer's length in the timing model)."""
        # the answer's key and one more element: a seed of its own, apart from the answer's choices
        return self.decode.tokens(request_seed(self.seed, (sampling.seed, *request.key, 1)))

    def _decode(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._running or self._waiting):
                    self._cond.wait()  # unbounded: idle until a request arrives or close() (a daemon thread)
                if self._closed:
                    return
                self._running += self._waiting
                self._waiting = []
                running = len(self._running)
                steps = self._run_steps(self.decode.step_cost(running), min(e.until_part() for e in self._running))
                if self._closed:
                    return
                self.steps += steps
                self.running_sum += steps * running
                for e in self._running:
                    e.left -= steps
                done = [e for e in self._running if e.left <= 0]
                # a cancelled request leaves the batch (vLLM aborts it)
                for e in self._running:
                    if e.left > 0 and e.future.cancelled():
                        self._pending.discard(e.future)
                self._running = [e for e in self._running if e.left > 0 and not e.future.cancelled()]
                told = [(e, e.due()) for e in self._running if e.sink is not None and e.due() > e.told]
            for e, due in told:  # outside the lock, as the futures' callbacks
                self._tell(e, due)
            for e in done:  # outside the lock: a future's callbacks may submit again
                self._resolve(e)

    def _run_steps(self, step: float, most: int) -> int:
        """Wait (the lock released) while up to ``most`` steps of ``step`` seconds
        run; fewer when a request arrives, which joins at the next boundary."""
        start = time.monotonic()
        end = start + most * step
        while not self._closed:
            now = time.monotonic()
            if now >= end:
                return most
            if self._waiting:
                steps = min(most, int((now - start) / step) + 1)  # the step under way ends first
                boundary = start + steps * step
                while not self._closed and time.monotonic() < boundary:
                    self._cond.wait(boundary - time.monotonic())
                return steps
            self._cond.wait(end - now)
        return 0

    @staticmethod
    def _tell(entry: _Running, due: int) -> None:
        """The parts of a streaming request's answer up to ``due``, to its sink."""
        ids = piece(entry.ids or [], entry.told, due)
        entry.told = due
        if ids and entry.sink is not None:
            entry.sink({entry.index: ids})

    def _resolve(self, entry: _Running) -> None:
        if entry.future.cancelled():  # by whoever gave up on it
            self._pending.discard(entry.future)
            return
        if entry.sink is not None:
            self._tell(entry, PIECES)
        try:
            completion: Completion = self._complete(entry.request, entry.sampling)
        except Exception as exc:  # handed to whoever waits for this request
            self._pending.settle(entry.future, error=exc)
            return
        self._stats.tokens_sampled += len(completion.response_token_ids)
        self._pending.settle(entry.future, completion)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._waiting, self._running = [], []
            self._cond.notify_all()
        self._thread.join(CLOSE_WAIT_S)
        fail_closed(self._pending.close() or [])
        super().close()
