"""An engine over an OpenAI-compatible server (e.g. ``vllm serve``).

``OpenAIEngine`` posts each request with the standard library only
(``urllib.request`` + ``json``): as token ids to ``{base_url}/completions``
when it has the server's tokenizer, else as chat messages to
``{base_url}/chat/completions``. It is a
``StreamingEngine``: the server batches continuously, so each request's
completion is handed back as soon as its reply is in.

- *Streaming*: ``submit(requests, sampling)`` returns one future per request;
  each request goes to a thread pool of ``max_concurrency`` workers, so at most
  that many are in flight and the rest wait in the pool's queue. ``generate``
  submits and waits for all, in request order.
- *Per-request seed*: ``seed = request_seed(sampling.seed, request.key)``, plus
  ``temperature``, ``top_p``, ``max_tokens`` (the request's, else the
  sampling's), ``stop``; ``top_k`` only when set (not an OpenAI field; vLLM
  accepts it).
- *Retries*: connection errors, timeouts, HTTP 429 and 5xx are retried
  ``max_retries`` times with exponential backoff (``backoff_s``, doubling);
  other 4xx are not (the request itself is wrong). ``timeout_s`` is the socket
  timeout of one attempt: no connect or read of a pool thread waits longer.
- *Failure is data, not an exception*: a request that still fails after its
  retries (a dropped connection, a timeout, an error status) resolves its
  future with a ``Completion`` with ``finish_reason="error"`` and empty text,
  and the error is logged as a warning naming its env and turn. The other
  requests are unaffected; the turn loop ends that env in ``error``. One of
  several servers (``engine.base_urls``: ``fail_over``) fails the future with
  ``ServerUnavailable`` instead, and the replicas (``ragen.llm.replicas``)
  send the request to another server; a refusal (HTTP 4xx) stays an error
  completion, since every server would refuse it.
- *Malformed replies*: a reply that is not JSON, has no ``choices``, has
  fields of the wrong type, or token ids (prompt or response) that are not
  ids of the model (negative, not integers, past 32 bits, or past
  ``vocab_size`` when there is a tokenizer) is ``MalformedReply``, a
  ``ServerUnavailable`` naming the server and route: not retried (the server
  answered), it is that request's error completion, or with ``fail_over``
  the server's failure, and another server takes the request.
- *Close*: ``close()`` cancels every future not yet resolved, queued or in
  flight (``future.result()`` raises ``CancelledError``), and returns without
  waiting for the server: no retry starts after it, and a pool thread still in
  an HTTP call ends with its socket timeout. ``submit`` after ``close()``
  raises ``RuntimeError``.
- *Answer prefix*: a request's ``answer_prefix`` goes as a last message
  ``{"role": "assistant", "content": prefix}`` with ``"continue_final_message":
  true, "add_generation_prompt": false`` (the chat-completions extension of
  ``vllm serve`` and SGLang): the server renders the generation prompt and the
  prefix, and replies with what the model writes after it. A server that
  refuses those fields (an HTTP 4xx) gives error completions whose warning
  names them; a server that ignores them answers a new turn instead, so use a
  server that supports them.
- *Token prompts*: with ``tokenizer`` (the folder or cached id of the model the
  server runs, or ``default``), each prompt is ``prompt_ids(request)``: the
  request's history ids (the ids sampled so far) and the template's tokens of
  its new messages, ending with its answer prefix. It goes as ``"prompt": ids``
  to ``/completions`` (vLLM takes a list of token ids as a prompt) with the same
  sampling fields, seed and ``"return_token_ids": true``; log-probs are asked as
  ``"logprobs": 0`` (the sampled tokens only). The completion is
  ``choices[0].text``, its ``token_ids`` and ``logprobs.token_logprobs``; its
  prompt ids are the ids sent (a server that reports other prompt ids is
  named in one warning: the server and the tokenizer disagree).
  ``vocab_size`` is the larger of ``len(tokenizer)`` and the ``vocab_size``
  of the ``config.json`` beside it: models pad their embedding past the
  tokenizer, and a server may sample a padded id.
- *Fallback to messages, never a silent mix*: without a tokenizer, or once the
  server refused token prompts (an HTTP 4xx on ``/completions`` where the same
  request as messages is answered, or a reply without token ids), requests go
  to ``/chat/completions`` as messages. One warning per engine names the server
  and why, and ``stats().token_prompt_fallbacks`` counts each request sent so (the
  rollout metric ``engine/token_prompt_fallbacks``). A refusal is remembered:
  later requests go straight to the chat path. There, prompts are the server's
  render of the messages, not the ids sampled so far.
- *Token ids on the chat path*: the chat API does not return them, so they are
  empty lists, unless the server sends them (vLLM does when
  ``return_token_ids`` is set).
- *Log-probs*: the body asks for ``"logprobs": true`` (``logprobs``, on by
  default) and ``Completion.logprobs`` is the ``logprob`` of each entry of
  ``choices[0].logprobs.content`` (one per generated token). What they mean is
  the server's choice: OpenAI's are the sampled tokens' log-probs; ``vllm
  serve`` (V1) returns the raw model's (before temperature, top-k, top-p)
  unless it is started with ``--logprobs-mode processed_logprobs`` (then those
  of the distribution it sampled from, which is what off-policy correction
  wants; see ``ragen/llm/vllm_engine.py``). A reply without them (field missing
  or null), or with anything but a list of numbers (or, when the server sends
  token ids, not one per token), gives ``logprobs=None`` for that completion
  and one warning per engine: off-policy correction then falls back to none.
  For a server that rejects the field (an HTTP 400 naming it), set
  ``engine.logprobs=false``: nothing is asked, every completion has None.
  On ``/completions`` they are ``choices[0].logprobs.token_logprobs``, under
  the same rules.
- *Session key*: every request carries the header ``X-Session-ID:
  {seed}-{env_id}`` (``session_key``), the episode's identity: the same for
  every turn of an episode, different across episodes and rollouts. A router in
  front of several servers (vllm-router's ``consistent_hash`` and
  ``sticky_least_loaded``) sends an episode's turns to one server, whose prefix
  cache holds the episode so far; a single ``vllm serve`` ignores the header.
- *Model name*: ``model``, else ``model_path`` (when not ``default``), else
  the server's first model from ``GET {base_url}/models``, asked by the first
  ``submit`` (which waits for it) and kept.

The policy version is the caller's bookkeeping: the engine cannot see the
server's weights, so whoever updates them calls ``bump_policy_version()``.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from ragen.llm.chat_tokens import ChatTokens
from ragen.llm.default_model import resolve_model_path
from ragen.llm.pending import PendingFutures
from ragen.llm.types import (Completion, GenerationRequest, SamplingParams, StreamingEngine, request_seed,
                              token_id_error)

logger = logging.getLogger(__name__)


class _RetryableError(Exception):
    pass


class ServerUnavailable(RuntimeError):
    """The server gave no usable answer to a request: none within its retries (connection
    refused or dropped, timeouts, 429 or 5xx every time), or a malformed one."""


class MalformedReply(ServerUnavailable):
    """The server's reply is not a completion: not JSON, no choices, a field of the wrong
    type, or token ids that are not the model's."""


class _RefusedError(RuntimeError):
    """An HTTP 4xx other than 429: the server refuses the request itself (no retry)."""


class _NoTokenPrompts(RuntimeError):
    """The server cannot take a token prompt or return the sampled ids: the request goes as messages."""


# The header a router reads as the session key (vllm-router checks it first, before any body field).
SESSION_HEADER = "X-Session-ID"


def session_key(request: GenerationRequest) -> str:
    """The episode's identity, ``{seed}-{env_id}``: the same for all its turns, sent as ``SESSION_HEADER``."""
    return f"{request.seed}-{request.env_id}"


# The body fields that continue a request's answer prefix (vLLM's and SGLang's extension).
_CONTINUE_FIELDS = {"continue_final_message": True, "add_generation_prompt": False}


class OpenAIEngine(StreamingEngine):
    """OpenAI-compatible chat completions, a future per request (``submit``); see the module docstring."""

    name = "openai"
    config_keys = (
        "base_url",
        "api_key",
        "model",
        "max_concurrency",
        "timeout_s",
        "max_retries",
        "backoff_s",
        "return_token_ids",
        "logprobs",
        "tokenizer",
    )
    replica_keys = ("base_urls", "routing")

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000/v1",
        *,
        api_key: str | None = "EMPTY",
        model: str | None = None,
        max_concurrency: int = 16,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        return_token_ids: bool = False,
        logprobs: bool = True,
        tokenizer: Any = None,
        fail_over: bool = False,
    ) -> None:
        super().__init__()
        if tokenizer is None or isinstance(tokenizer, str):
            self.check_options({"tokenizer": tokenizer})
        if not isinstance(logprobs, bool):
            raise ValueError(f"engine.logprobs must be true or false, got {logprobs!r}")
        if int(max_concurrency) < 1:
            raise ValueError(f"engine.max_concurrency={max_concurrency} must be >= 1")
        if float(timeout_s) <= 0:
            raise ValueError(f"engine.timeout_s={timeout_s} must be > 0")
        if int(max_retries) < 0:
            raise ValueError(f"engine.max_retries={max_retries} must be >= 0")
        self.base_url = _checked_url(base_url, "engine.base_url")
        # one of several servers (engine.base_urls): a request the server does not answer within
        # its retries fails its future with ServerUnavailable, and the replicas send it elsewhere
        self.fail_over = bool(fail_over)
        self.api_key = api_key
        self.model = model
        self.max_concurrency = int(max_concurrency)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.return_token_ids = bool(return_token_ids)
        self.returns_logprobs = logprobs  # asked for; a server may still send none
        self._warned_no_logprobs = False
        # the server's tokenizer (its template's ChatTokens): prompts go as token ids
        if tokenizer is not None:
            tokenizer = _load_tokenizer(tokenizer)
            self.chat = ChatTokens.of(tokenizer)
            self.vocab_size = _vocab_size(tokenizer)  # what a reply's ids are checked against
        # why requests go as messages (no tokenizer, or the server refused token prompts); None: as ids
        self._messages_why: str | None = None if self.chat is not None else (
            "engine.tokenizer is not set (set it to the folder or cached id of the model the server runs)")
        self._warned_messages = False
        self._warned_prompt_ids = False
        # pool threads build prompts one at a time: the tokenizer and the divergence count are shared
        self._prompt_lock = threading.Lock()
        self._warn_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="openai-engine")
        self._model_lock = threading.Lock()
        # the futures handed out and not yet resolved; close() cancels them
        self._pending = PendingFutures("the OpenAIEngine is closed")
        self._closed = threading.Event()  # ends a retry's back-off

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        value = options.get("tokenizer")
        if value is None:
            return
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"engine.tokenizer must be null, 'default', a local model folder or a cached model id, "
                             f"got {value!r}")
        if value != "default":
            try:
                resolve_model_path(value)
            except ValueError:
                raise ValueError(
                    f"engine.tokenizer={value!r} is not 'default', not a local folder, and not a model id in the "
                    f"local Hugging Face cache (nothing is downloaded): set it to the model the server runs, or "
                    f"null to send chat messages") from None

    @classmethod
    def replica_options(cls, options: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """One replica per ``engine.base_urls`` entry (null: the one ``base_url``)."""
        urls = options.pop("base_urls", None)
        options.pop("routing", None)
        if urls is None:
            return [(str(options.get("base_url", "")), options)]
        if isinstance(urls, str) or not isinstance(urls, (list, tuple)) or not urls:
            raise ValueError(f"engine.base_urls must be null or a non-empty list of server URLs, got {urls!r}")
        checked = [_checked_url(url, f"engine.base_urls[{i}]") for i, url in enumerate(urls)]
        if len(set(checked)) < len(checked):
            raise ValueError(f"engine.base_urls lists a server twice: {list(urls)!r}")
        if len(checked) == 1:
            return [(checked[0], {**options, "base_url": checked[0]})]
        return [(url, {**options, "base_url": url, "fail_over": True}) for url in checked]

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], model_path: str | None = None) -> "OpenAIEngine":
        cfg = dict(cfg)
        if cfg.get("model") is None and model_path not in (None, "default"):
            cfg["model"] = str(model_path)
        return cls(**cfg)

    # -- generation -------------------------------------------------------

    def submit(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Future]:
        if self._closed.is_set():
            raise RuntimeError("the OpenAIEngine is closed")
        futures: list[Future] = [Future() for _ in requests]
        if not requests:
            return futures
        version = self.policy_version
        try:
            model = self._model_name()
        except Exception as exc:
            if self.fail_over:
                unavailable = ServerUnavailable(f"cannot find a model name at {self.base_url}/models: {exc}")
                for future in futures:
                    future.set_exception(unavailable)
                return futures
            for future, request in zip(futures, requests):
                self._warn_failed(request, f"cannot find a model name at {self.base_url}/models: {exc}")
                future.set_result(self._error(request, version))
            return futures
        with self._pending.adding(futures):  # close() either sees these futures or comes after
            for future, request in zip(futures, requests):
                self._pool.submit(self._answer, future, request, sampling, model, version)
        return futures

    def _answer(self, future: Future, request: GenerationRequest, sampling: SamplingParams, model: str,
                version: int) -> None:
        """Resolve ``future`` with the request's completion, unless close() cancelled it."""
        if future.done():  # cancelled while queued
            self._pending.discard(future)
            return
        completion: Completion | None = None
        error: ServerUnavailable | None = None
        try:
            completion = self._complete(request, sampling, model, version)
        except ServerUnavailable as exc:  # no usable answer within its retries
            if self.fail_over:  # another server takes the request
                error = exc
            else:
                self._warn_failed(request, exc)
                completion = self._error(request, version)
        except Exception as exc:  # failure is data: this request's completion is an error, the others go on
            self._warn_failed(request, repr(exc))
            completion = self._error(request, version)
        self._pending.settle(future, completion, error)  # unless close() cancelled it

    def _complete(self, request: GenerationRequest, sampling: SamplingParams, model: str, version: int) -> Completion:
        limit = request.token_limit(sampling)
        as_ids = self._messages_why is None  # read once: another request's refusal may change it meanwhile
        ids: list[int] = []
        if as_ids:
            with self._prompt_lock:
                ids = self.prompt_ids(request)
        if limit <= 0:
            return Completion.answering(request, "", ids, [], "length", version,
                                        [] if self.returns_logprobs else None)
        if as_ids:
            try:
                return self._complete_ids(request, ids, sampling, limit, model, version)
            except _NoTokenPrompts as exc:
                completion = self._complete_messages(request, sampling, limit, model, version)
                if completion.finish_reason == "error":  # refused as messages too: the request is at fault
                    return completion
                self._messages_why = self._messages_why or f"the server refused a token prompt: {exc}"
                self._count_fallback()
                return completion
        self._count_fallback()
        return self._complete_messages(request, sampling, limit, model, version)

    def _sampling_fields(self, request: GenerationRequest, sampling: SamplingParams, limit: int,
                         model: str) -> dict[str, Any]:
        """The body fields both endpoints share: model, sampling, seed, stop, top-k."""
        body: dict[str, Any] = {
            "model": model,
            "temperature": max(0.0, float(sampling.temperature)),
            "top_p": float(sampling.top_p),
            "max_tokens": int(limit),
            "seed": request_seed(sampling.seed, request.key),
            "n": 1,
        }
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.top_k > 0:
            body["top_k"] = int(sampling.top_k)
        return body

    def _complete_ids(self, request: GenerationRequest, ids: list[int], sampling: SamplingParams, limit: int,
                      model: str, version: int) -> Completion:
        """The request's prompt ids sent to ``/completions``; ``_NoTokenPrompts`` when the
        server refuses them (an HTTP 4xx) or answers without the sampled ids."""
        body = {**self._sampling_fields(request, sampling, limit, model), "prompt": ids, "return_token_ids": True}
        if self.returns_logprobs:
            body["logprobs"] = 0  # the sampled tokens' own, no alternatives
        route = "/completions"
        try:
            reply = self._post_with_retries(route, body, session_key(request))
        except _RefusedError as exc:
            raise _NoTokenPrompts(str(exc)) from exc
        choice = self._choice(reply, route)
        text = self._text(choice.get("text"), route, "choices[0].text")
        if not isinstance(choice.get("token_ids"), list):
            raise _NoTokenPrompts(f"its reply from {self.base_url}{route} carries no token ids "
                                  f"(choices[0].token_ids, asked with return_token_ids)")
        response_ids = self._ids(choice["token_ids"], route, "choices[0].token_ids")
        echoed = choice.get("prompt_token_ids") or reply.get("prompt_token_ids")
        if echoed and self._ids(echoed, route, "prompt_token_ids") != ids:
            self._warn_prompt_ids(request, ids, echoed)
        logprobs = None
        if self.returns_logprobs:
            raw = choice.get("logprobs")
            logprobs = self._checked_logprobs(raw.get("token_logprobs") if isinstance(raw, dict) else None,
                                              response_ids, raw)
        return Completion.answering(request, text, ids, response_ids,
                                    "length" if choice.get("finish_reason") == "length" else "stop", version, logprobs)

    def _complete_messages(self, request: GenerationRequest, sampling: SamplingParams, limit: int, model: str,
                           version: int) -> Completion:
        """The request's messages sent to ``/chat/completions``."""
        messages = [dict(m) for m in request.messages]
        if request.answer_prefix:
            messages.append({"role": "assistant", "content": request.answer_prefix})
        body = {**self._sampling_fields(request, sampling, limit, model), "messages": messages}
        if self.return_token_ids:
            body["return_token_ids"] = True
        if self.returns_logprobs:
            body["logprobs"] = True
        if request.answer_prefix:
            body.update(_CONTINUE_FIELDS)
        route = "/chat/completions"
        try:
            reply = self._post_with_retries(route, body, session_key(request))
        except _RefusedError as exc:
            why: Any = exc
            if request.answer_prefix:
                why = (f"{exc} -- the request carries an answer prefix, sent with "
                       f"{', '.join(f'{k}={json.dumps(v)}' for k, v in _CONTINUE_FIELDS.items())} and the "
                       f"prefix as a last assistant message: the server must support these chat-completions "
                       f"fields (vllm serve and SGLang do)")
            self._warn_failed(request, why)
            return self._error(request, version)
        choice = self._choice(reply, route)
        message = choice.get("message")
        if message is not None and not isinstance(message, dict):
            raise self._malformed(route, f"choices[0].message is not an object (got {message!r:.80})")
        text = self._text((message or {}).get("content"), route, "choices[0].message.content")
        response_ids = self._ids(choice.get("token_ids") or [], route, "choices[0].token_ids")
        prompt_ids = self._ids(reply.get("prompt_token_ids") or choice.get("prompt_token_ids") or [], route,
                               "prompt_token_ids")
        return Completion.answering(
            request,
            text,
            prompt_ids,
            response_ids,
            "length" if choice.get("finish_reason") == "length" else "stop",
            version,
            self._logprobs(choice, response_ids) if self.returns_logprobs else None,
        )

    def _malformed(self, route: str, why: str) -> MalformedReply:
        return MalformedReply(f"malformed reply from {self.base_url}{route}: {why}")

    def _choice(self, reply: Any, route: str) -> dict[str, Any]:
        """The reply's first choice; MalformedReply unless it is an object with a list of choices."""
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self._malformed(route, f"no choices (got {json.dumps(reply)[:200]})")
        return choices[0]

    def _text(self, value: Any, route: str, field: str) -> str:
        """``value`` as the answer's text ("" when missing); MalformedReply unless a string."""
        if value is None:
            return ""
        if not isinstance(value, str):
            raise self._malformed(route, f"{field} is not a string (got {value!r:.80})")
        return value

    def _ids(self, value: Any, route: str, field: str) -> list[int]:
        """``value`` as token ids; MalformedReply naming ``field`` unless it is a list of the
        model's ids: the rollout sends ids as unsigned 32-bit integers and trains on them."""
        error = token_id_error(value, self.vocab_size) if isinstance(value, list) else "not a list"
        if error is not None:
            raise self._malformed(route, f"{field}: {error}")
        return value

    def _logprobs(self, choice: Mapping[str, Any], response_ids: list[int]) -> list[float] | None:
        """The sampled tokens' log-probs from ``choice["logprobs"]["content"]``, or None
        (and the engine's one warning) when the reply has none or they are malformed."""
        raw = choice.get("logprobs")
        content = raw.get("content") if isinstance(raw, dict) else None
        values = None
        if isinstance(content, list) and all(isinstance(entry, dict) for entry in content):
            values = [entry.get("logprob") for entry in content]
        return self._checked_logprobs(values, response_ids, raw)

    def _checked_logprobs(self, values: Any, response_ids: list[int], raw: Any) -> list[float] | None:
        """``values`` as floats when they are a list of numbers, one per response token (when
        the server sent the tokens); else None and the engine's one warning (about ``raw``)."""
        if isinstance(values, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            if not response_ids or len(values) == len(response_ids):  # not aligned: worse than none
                return [float(v) for v in values]
        self._warn_no_logprobs(raw)
        return None

    def _count_fallback(self) -> None:
        """Count a request sent as messages; the first one warns, naming the server and why."""
        with self._warn_lock:
            self._stats.token_prompt_fallbacks += 1
            if self._warned_messages:
                return
            self._warned_messages = True
        logger.warning(
            "OpenAIEngine: requests to %s go as chat messages, not token ids: %s. Their prompts are the server's "
            "render of the messages, not the ids sampled so far (engine/token_prompt_fallbacks counts them; said "
            "once per engine)", self.base_url, self._messages_why)

    def _warn_prompt_ids(self, request: GenerationRequest, sent: list[int], echoed: Any) -> None:
        with self._warn_lock:
            if self._warned_prompt_ids:
                return
            self._warned_prompt_ids = True
        logger.warning(
            "OpenAIEngine: the server at %s reports other prompt ids than those sent for env %s turn %s "
            "(%d sent, %d reported; first difference at %d): engine.tokenizer and the server's model may "
            "disagree; completions keep the ids sent (said once per engine)",
            self.base_url, request.env_id, request.turn, len(sent), len(echoed),
            next((i for i, (a, b) in enumerate(zip(sent, echoed)) if a != int(b)), min(len(sent), len(echoed))))

    def _warn_no_logprobs(self, got: Any) -> None:
        with self._warn_lock:
            if self._warned_no_logprobs:
                return
            self._warned_no_logprobs = True
        logger.warning(
            "OpenAIEngine: the server at %s returned no usable log-probs (got %.100r), so completions carry "
            "logprobs=None and off-policy correction falls back to none (said once per engine)",
            self.base_url, got,
        )

    @staticmethod
    def _warn_failed(request: GenerationRequest, error: Any) -> None:
        """The warning that names the env and turn whose request ended in error."""
        logger.warning("OpenAIEngine: request for env %s turn %s failed (finish_reason='error'): %s",
                       request.env_id, request.turn, error)

    @staticmethod
    def _error(request: GenerationRequest, version: int) -> Completion:
        return Completion.answering(request, "", [], [], "error", version)

    # -- HTTP -------------------------------------------------------------

    def _model_name(self) -> str:
        with self._model_lock:
            if self.model is None:
                models = self._call_with_retries("GET", "/models", None)["data"]
                if not models:
                    raise RuntimeError("the server lists no models; set engine.model")
                self.model = str(models[0]["id"])
                logger.info("OpenAIEngine: using the server's model %r", self.model)
            return self.model

    def _post_with_retries(self, route: str, body: dict[str, Any], session: str | None = None) -> dict[str, Any]:
        return self._call_with_retries("POST", route, body, session)

    def _call_with_retries(self, method: str, route: str, body: dict[str, Any] | None,
                           session: str | None = None) -> dict[str, Any]:
        for attempt in range(self.max_retries + 1):
            try:
                return self._call(method, route, body, session)
            except _RetryableError as exc:
                if attempt == self.max_retries:
                    raise ServerUnavailable(f"{exc} (after {attempt + 1} attempts)") from exc
                delay = self.backoff_s * (2**attempt)
                logger.debug("OpenAIEngine: %s; retry %d in %.2f s", exc, attempt + 1, delay)
                if self._closed.wait(delay):  # close() ends the wait: no retry after it
                    raise ServerUnavailable(f"{exc}; the engine was closed before a retry") from exc
        raise AssertionError("unreachable")

    def _call(self, method: str, route: str, body: dict[str, Any] | None,
              session: str | None = None) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if session is not None:
            headers[SESSION_HEADER] = session
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        http_request = urllib.request.Request(self.base_url + route, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(http_request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            message = f"HTTP {exc.code} from {self.base_url}{route}: {detail}"
            if exc.code == 429 or exc.code >= 500:
                raise _RetryableError(message) from exc
            raise _RefusedError(message) from exc
        except (urllib.error.URLError, http.client.HTTPException, socket.timeout, TimeoutError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise _RetryableError(f"{type(exc).__name__} from {self.base_url}{route}: {reason}") from exc
        try:
            return json.loads(raw)
        except ValueError as exc:  # not JSON, or not text: e.g. a proxy's error page
            raise self._malformed(route, f"not JSON ({exc}): {raw[:100]!r}") from None

    def close(self) -> None:
        """Cancel every future not yet resolved and stop the pool, without waiting for the server."""
        self._closed.set()
        pending = self._pending.close() or []
        self._pool.shutdown(wait=False, cancel_futures=True)
        for future in pending:
            future.cancel()


def _load_tokenizer(tokenizer: Any) -> Any:
    """``engine.tokenizer``: a transformers tokenizer as it is, or one loaded from a local
    folder, a cached model id or ``default`` (never downloaded); it must have a chat template."""
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        path = resolve_model_path(tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"engine.tokenizer={getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat template: "
                         f"token prompts are built with it; use the server's model folder, or null to send messages")
    return tokenizer


def _vocab_size(tokenizer: Any) -> int:
    """The ids the server's model may return: ``len(tokenizer)``, or the ``vocab_size`` of the
    model's config.json beside the tokenizer when larger (an embedding padded past the tokenizer)."""
    size = len(tokenizer)
    path = os.path.join(str(getattr(tokenizer, "name_or_path", "") or ""), "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):  # no model config beside the tokenizer: its length is all we know
        return size
    sections = [config, config.get("text_config")] if isinstance(config, dict) else []
    for section in sections:
        value = section.get("vocab_size") if isinstance(section, dict) else None
        if type(value) is int:
            size = max(size, value)
    return size


def _checked_url(url: Any, key: str) -> str:
    """``url`` without a trailing slash; ValueError naming ``key`` unless it is an http(s) URL with a host."""
    parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{key}={url!r} is not a server URL such as http://127.0.0.1:8000/v1")
    return url.rstrip("/")
