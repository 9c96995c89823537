"""The vocabulary of language-model engines.

- ``GenerationRequest``: one chat prompt, keyed by ``(seed, env_id, turn)`` so a
  policy's randomness can be tied to the request, never to batch order;
  ``last_turn`` says that no turn of its episode follows (nothing to keep for one);
  ``answer_prefix`` is text the answer starts with, after the template's
  generation prompt (the completion holds only what follows it);
  ``history_token_ids`` are the ids of the conversation so far, as the engine
  saw and sampled them: the prompt is those ids and the template's tokens of
  the messages after ``history_messages`` (``ChatTokens.append``);
  ``prompt_token_ids``, where given, are the prompt itself, neither rendered
  nor appended to (the gateway's, which builds each call's ids); ``tools``
  are the env's tools (OpenAI function schemas) for the template;
  ``stream_tokens`` asks for the answer's ids as they are sampled (the
  gateway's streamed calls), besides its completion.
- ``SamplingParams``: how to decode (``temperature == 0`` means greedy).
- ``Completion``: the answer text, prompt and response token ids, the log-prob
  of each response token under the distribution it was sampled from, why it
  stopped, and the policy version and replica that produced it.
- ``Engine``: ``generate(requests, sampling) -> completions``, one completion per
  request, in request order.
- ``StreamingEngine``: an engine that batches continuously, whose
  ``submit(requests, sampling)`` returns a future per request, resolved as
  soon as that request is done.
- ``TokenSink``: what ``Engine.generate_reporting`` and
  ``StreamingEngine.submit_reporting`` tell, for one call, as the requests
  that asked (``stream_tokens``) grow: ``{index of the request in the call:
  its new ids}``, every id before the request's completion is out, so that
  what a request was told joins to its ``response_token_ids``. An engine
  that cannot tell sooner tells nothing: the completion carries every id.

All three data classes are plain, JSON-able data: they cross process
boundaries (``to_dict`` / ``from_dict``); the engine itself never does.

``request_seed(sampling_seed, key)`` is the one place where a request's
randomness is derived: every engine seeds its per-request sampler from it.
``token_id_error(ids, vocab_size)`` is the one check that ids are token ids;
``StreamingEngine.checked`` the one check that a ``submit`` kept its contract.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from concurrent.futures import Future, InvalidStateError
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Self, Sequence

from ragen.errors import RagenError
from ragen.llm.chat_tokens import ChatTokens
from ragen.llm.stats import EngineStats

logger = logging.getLogger(__name__)


def request_seed(sampling_seed: int, key: Sequence[int]) -> int:
    """A 31-bit seed from an engine-level seed and a request key.

    A hash, not ``hash()`` (salted per process) and not a running RNG (order
    dependent), so the same request gets the same seed in every process, batch
    and order. 31 bits fit every server's ``seed`` field.
    """
    text = ",".join(str(int(x)) for x in (sampling_seed, *key))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


# Token ids cross processes as unsigned 32-bit integers (ragen.serving.wire).
TOKEN_ID_LIMIT = 1 << 32


def token_id_error(ids: Sequence[Any], vocab_size: int | None = None) -> str | None:
    """Why ``ids`` are not token ids, or None when they are: each must be an int (not a
    bool) in ``0 .. vocab_size - 1``, or ``0 .. 2**32 - 1`` when the vocabulary is unknown."""
    if not ids:
        return None
    if any(type(i) is not int for i in ids):
        bad = next(i for i in ids if type(i) is not int)
        return f"token id {bad!r} is not an integer"
    limit = TOKEN_ID_LIMIT if vocab_size is None else vocab_size
    low, high = min(ids), max(ids)
    if low < 0:
        return f"token id {low} is negative"
    if high >= limit:
        where = f"the vocabulary's {vocab_size} ids" if vocab_size is not None else "32 bits"
        return f"token id {high} is outside {where} (0..{limit - 1})"
    return None


class EngineUnavailable(RagenError, RuntimeError):
    """No part of the engine can answer any request (every replica is down): a rollout
    stops with this error rather than ending each env that asked."""


class EngineError(RagenError, RuntimeError):
    """The engine failed on a request (raised in the client); ``ticket``: that request's, where known;
    ``timed_out``: the manager gave up waiting for the engine's answer; ``unavailable``: the
    engine can answer no request at all."""

    def __init__(self, message: str, ticket: int | None = None, timed_out: bool = False,
                 unavailable: bool = False) -> None:
        super().__init__(message)
        self.ticket = ticket
        self.timed_out = timed_out
        self.unavailable = unavailable  # the engine can answer no request (EngineUnavailable)


class _PlainData:
    """A frozen dataclass of JSON-able fields that crosses process boundaries as a dict."""

    def to_dict(self) -> dict[str, Any]:
        # Shallow: these classes hold only JSON-able values, and dataclasses.asdict's
        # deep copy is the largest cost of sending thousands of prompts. Their
        # instance dict is exactly their fields (frozen, nothing cached on them),
        # and copying it is cheaper than reading dataclasses.fields.
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        return cls(**d)


@dataclass(frozen=True)
class GenerationRequest(_PlainData):
    """One chat prompt to answer, keyed by ``(seed, env_id, turn)``."""

    messages: list[dict[str, str]]  # [{"role": "system"|"user"|"assistant", "content": str}]
    env_id: int = 0
    turn: int = 0
    seed: int = 0  # the env's seed for this rollout
    max_tokens: int | None = None  # per-request cap (the env's max_tokens), within the sampling's; None: sampling's
    last_turn: bool = False  # the episode's last possible turn: no next prompt continues this one
    # text the answer starts with, placed after the chat template's generation prompt (RAGEN's
    # "<think>"); the completion's text and token ids are what the model writes after it
    answer_prefix: str = ""
    # the ids of messages[:history_messages] as the engine saw and sampled them (the previous
    # prompt, then its answer): the prompt is these ids, then the template's tokens of the rest
    # (ChatTokens.append); None: every message rendered and tokenized
    history_token_ids: list[int] | None = None
    history_messages: int = 0
    # the env's tools as OpenAI function schemas, passed to the chat template (None: no tools)
    tools: list[dict[str, Any]] | None = None
    # the prompt as ids, given whole: the engine samples after them, rendering nothing (None: the
    # messages rendered, or appended to history_token_ids)
    prompt_token_ids: list[int] | None = None
    # its ids told as they are sampled (TokenSink), besides its completion; False: the
    # completion alone (what crosses the wire for the rollout is then as it always was)
    stream_tokens: bool = False

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.seed, self.env_id, self.turn)

    def token_limit(self, sampling: SamplingParams) -> int:
        """The most tokens its answer may have: the smaller of its own cap (a tag's ``max_tokens``) and
        the sampling's (``ctx_manager.generation.response_length``)."""
        return sampling.max_tokens if self.max_tokens is None else min(self.max_tokens, sampling.max_tokens)


@dataclass(frozen=True)
class SamplingParams(_PlainData):
    """How to decode (``temperature == 0`` means greedy)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    max_tokens: int = 128
    seed: int = 0  # engine-level seed, combined with each request's key
    stop: list[str] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


# the finish reason of the answer a manager gives in place of a completion once the rollout that
# asked has enough groups done (over-sampling: ``SharedLLMInferenceManager.abort``)
ABORTED = "aborted"


@dataclass(frozen=True)
class Completion(_PlainData):
    """The answer to one request, with its tokens and the policy version that produced it."""

    text: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "error" | ABORTED
    policy_version: int
    env_id: int = 0
    turn: int = 0
    # log p of each response token under the distribution it was sampled from (temperature,
    # top-k, top-p applied); None: the engine gives none
    logprobs: list[float] | None = None
    # > 0: the prompt is the first ``prompt_start`` ids of the request's ``prompt_token_ids`` (where
    # given, else of its ``history_token_ids``), then ``prompt_token_ids`` (what crosses to a worker:
    # it holds those ids already)
    prompt_start: int = 0
    replica: int = 0  # which of the engine's replicas answered (ragen.llm.replicas); 0 for one engine
    # the tool calls a server parsed from the answer (OpenAI's ``tool_calls``); None: not parsed by the engine
    tool_calls: list[dict[str, Any]] | None = None

    @classmethod
    def answering(cls, request: GenerationRequest, text: str, prompt_token_ids: list[int],
                  response_token_ids: list[int], finish_reason: str, policy_version: int,
                  logprobs: list[float] | None = None) -> Self:
        """The completion of ``request`` (its ``env_id`` and ``turn``)."""
        return cls(text, prompt_token_ids, response_token_ids, finish_reason, policy_version, request.env_id,
                   request.turn, logprobs)


# {the request's index in the engine call: the ids it sampled since it was last told}
TokenSink = Callable[[dict[int, list[int]]], None]


class Engine(ABC):
    """One language model behind ``generate``.

    ``policy_version`` counts weight updates: the trainer calls
    ``bump_policy_version()`` after it changed the weights the engine uses, and
    every completion records the version that produced it. ``stats()`` is what
    the engine has counted (``EngineStats``), each engine filling in its own part.

    An engine that tokenizes has ``chat`` (its template's ``ChatTokens``) and
    builds each prompt with ``prompt_ids(request)``, counting in
    ``history_divergences`` the appended prompts whose template rewrote earlier
    turns. ``vocab_size`` is the number of token ids the engine's model knows,
    where the engine knows it (None: unknown).
    """

    name: str = "engine"
    streams: bool = False  # a StreamingEngine: completions come back one by one as they are done
    # whether completions carry ``logprobs`` (the trainer's off-policy correction needs them);
    # an engine that asks a server for them may still get none back, and says so per completion
    returns_logprobs: bool = False
    vocab_size: int | None = None  # the token ids its model knows, where the engine knows them

    def __init__(self) -> None:
        self.policy_version = 0
        self._stats = EngineStats()  # what the engine counts as it goes; stats() hands out a copy
        self.chat: ChatTokens | None = None

    def stats(self) -> EngineStats:
        """What the engine has counted so far (a copy: later counting leaves it as it is)."""
        return dataclasses.replace(self._stats, replicas=dict(self._stats.replicas))

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The request's prompt ids: its ``prompt_token_ids`` where given, else its history
        ids and the template's tokens of the messages after them, or all its messages rendered. A template that rewrites the
        history is counted and named once in a warning; the ids sampled still lead."""
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if self.chat is None:
            raise RuntimeError(f"engine {self.name!r} has no chat template to build prompt ids with")
        ids, diverged = self.chat.request_ids(request)
        if diverged:
            if not self._stats.history_divergences:
                logger.warning(
                    "the chat template of %s rewrites earlier turns once later ones follow (e.g. drops their "
                    "<think>): prompts keep the tokens sampled before, so they differ from a full render of the "
                    "same messages (engine/history_divergences counts them; ctx_manager.token_history=rerender "
                    "renders every prompt whole)", self.chat.name or self.name)
            self._stats.history_divergences += 1
        return ids

    @abstractmethod
    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Completion]:
        """One completion per request, in request order."""

    def generate_reporting(self, requests: Sequence[GenerationRequest], sampling: SamplingParams,
                           on_tokens: TokenSink) -> list[Completion]:
        """``generate``, telling ``on_tokens`` the new ids of the requests with ``stream_tokens``
        while they are sampled. This engine tells none: each completion carries its ids."""
        return self.generate(requests, sampling)

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """ValueError naming the ``engine.<key>`` whose value this engine refuses,
        read before anything is built or loaded (``ragen.llm.check_engine_config``)."""

    @classmethod
    def streams_with(cls, options: dict[str, Any]) -> bool:
        """Whether the engine built from ``options`` streams completions (read before it is built)."""
        return cls.streams

    # the keys that ask for several replicas of this engine (``ragen.llm.replicas``); () for none
    replica_keys: tuple[str, ...] = ("replicas", "routing")

    @classmethod
    def replica_options(cls, options: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """``(name, options)`` of each replica that ``options`` asks for: ``engine.replicas``
        copies (ValueError naming the key when it is not an integer >= 1). ``options`` is
        left without the replica keys."""
        count = options.pop("replicas", 1)
        options.pop("routing", None)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"engine.replicas must be an integer >= 1, got {count!r}")
        return [(str(i), dict(options)) for i in range(count)]

    @property
    def label(self) -> str:
        """The engine as messages name it: its name and class."""
        return f"engine {self.name!r} ({type(self).__name__})"

    def bump_policy_version(self) -> int:
        self.policy_version += 1
        return self.policy_version

    def release_cache(self) -> None:
        """Free what the engine keeps between calls for episodes in flight; called when none
        is (the end of a rollout). Engines that keep nothing do nothing."""

    def close(self) -> None:
        pass


CLOSED_BEFORE_ANSWER = "the engine was closed before this request was answered"


def resolve(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` with ``result``, or with ``error`` when given, unless its caller
    cancelled it first."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass  # the caller cancelled it


class StreamingEngine(Engine):
    """An engine that batches continuously: each request joins the running
    batch as it arrives, and its completion comes back as soon as it is done,
    whatever the other requests still need.

    ``submit(requests, sampling)`` returns one ``concurrent.futures.Future``
    per request, resolved with its ``Completion`` (or the engine's error).
    ``generate`` submits and waits for all: a streaming engine serves the
    batch path too, where a call lasts as long as its longest answer.
    """

    streams = True

    @abstractmethod
    def submit(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Future]:
        """One future per request, in request order."""

    def submit_reporting(self, requests: Sequence[GenerationRequest], sampling: SamplingParams,
                         on_tokens: TokenSink) -> list[Future]:
        """``submit``, telling ``on_tokens`` the new ids of the requests with ``stream_tokens``
        while they are sampled, each before its future is resolved. This engine tells none."""
        return self.submit(requests, sampling)

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Completion]:
        futures = self.checked(self.submit(requests, sampling), len(requests))
        # Unbounded wait on each future: an engine resolves every future it hands out, with
        # its completion or an error (close() fails the ones still running).
        return [f.result() for f in futures]

    def generate_reporting(self, requests: Sequence[GenerationRequest], sampling: SamplingParams,
                           on_tokens: TokenSink) -> list[Completion]:
        futures = self.checked(self.submit_reporting(requests, sampling, on_tokens), len(requests))
        return [f.result() for f in futures]

    def checked(self, got: Any, n: int) -> list[Future]:
        """``got``, what ``submit`` returned for ``n`` requests, as their futures; TypeError naming
        the engine and what it returned when that is not one future per request (the futures
        in it are cancelled: their requests fail)."""
        error = _futures_error(got, n)
        if error is None:
            return list(got)
        for f in got if isinstance(got, (list, tuple)) else ():
            if isinstance(f, Future):
                f.cancel()
        raise TypeError(f"the {self.label} broke its contract: {error}")


def _futures_error(got: Any, n: int) -> str | None:
    """Why ``got``, what ``StreamingEngine.submit`` returned for ``n`` requests, is not one
    ``concurrent.futures.Future`` per request, or None when it is."""
    if not isinstance(got, (list, tuple)):
        what = "None" if got is None else f"a {type(got).__name__}"
        return f"submit returned {what} for {n} requests, not a list of {n} futures"
    bad = next((i for i, f in enumerate(got) if not isinstance(f, Future)), None)
    if bad is not None:
        return f"submit returned {type(got[bad]).__name__}, not a Future, at position {bad} of its list"
    if len(got) != n:
        return f"submit returned {len(got)} futures for {n} requests"
    return None
