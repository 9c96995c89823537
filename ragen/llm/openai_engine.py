"""An engine over an OpenAI-compatible server (e.g. ``vllm serve``).

``OpenAIEngine`` posts each request as token ids to ``{base_url}/completions``
when it has the server's tokenizer, else as chat messages to
``{base_url}/chat/completions``. It is a
``StreamingEngine``: the server batches continuously, so each request's
completion is handed back as soon as its reply is in.

- *Streaming*: ``submit(requests, sampling)`` returns one future per request;
  each request goes to a thread pool of ``max_concurrency`` workers, so at most
  that many are in flight and the rest wait in the pool's queue. ``generate``
  submits and waits for all, in request order.
- *Per-request seed*: ``seed = request_seed(sampling.seed, request.key)``, plus
  ``temperature``, ``top_p``, ``max_tokens`` (``token_limit``: the smaller
  of the request's and the sampling's), ``stop``; ``top_k`` only when set (not an OpenAI field; vLLM
  accepts it).
- *Transport* (``ragen.llm.openai_http``): retries of connection errors,
  timeouts, 429 and 5xx (``max_retries``, ``backoff_s``), the socket timeout of
  an attempt (``timeout_s``) and the episode's session header.
- *Failure is data, not an exception*: a request that still fails after its
  retries (a dropped connection, a timeout, an error status) resolves its
  future with a ``Completion`` with ``finish_reason="error"`` and empty text,
  and the error is logged as a warning naming its env and turn. The other
  requests are unaffected; the turn loop ends that env in ``error``. One of
  several servers (``engine.base_urls``: ``fail_over``) fails the future with
  ``ServerUnavailable`` instead, and the replicas (``ragen.llm.replicas``)
  send the request to another server; a refusal (HTTP 4xx) stays an error
  completion, since every server would refuse it.
- *Malformed replies* (``ragen.llm.openai_replies``): ``MalformedReply``, a
  ``ServerUnavailable`` naming the server and route: not retried (the server
  answered), it is that request's error completion, or with ``fail_over`` the
  server's failure, and another server takes the request.
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
- *Token prompts* (``ragen.llm.openai_tokens``): with ``tokenizer``, each
  prompt goes as the ids ``prompt_ids(request)`` to ``/completions``; the
  completion's prompt ids are those the server reports it sampled after. A
  request whose ``prompt_token_ids`` are given (the gateway's) goes as those
  ids with or without a tokenizer, and never as messages: where the server
  takes no token prompt, it is an error completion whose text says so.
- *Fallback to messages, never a silent mix* (requests without given prompt
  ids): without a tokenizer, or once the server refused token prompts (an HTTP
  4xx on ``/completions`` where the same request as messages is answered, or a
  reply without token ids), requests go to ``/chat/completions`` as messages. One warning per engine names the server
  and why, and ``stats().token_prompt_fallbacks`` counts each request sent so (the
  rollout metric ``engine/token_prompt_fallbacks``). A refusal is remembered:
  later requests go straight to the chat path. There, prompts are the server's
  render of the messages, not the ids sampled so far.
- *Tools*: a request's ``tools`` go with it to ``/chat/completions`` as
  ``tools``, and the ``tool_calls`` of the reply's message (a server started
  with a tool parser, e.g. ``vllm serve --enable-auto-tool-choice
  --tool-call-parser hermes``) are the completion's, none when the message
  has none (``ctx_manager.tool_parser: server`` reads them). Tool results go back as ``tool`` messages with a
  ``tool_call_id``, after an assistant message of the answer's text (no
  ``tool_calls`` field: a server that checks the pairing, as OpenAI's own
  does, refuses them). On ``/completions`` the tools are in the prompt ids.
- *Token ids on the chat path*: the chat API does not return them, so they are
  empty lists, unless the server sends them (vLLM does when
  ``return_token_ids`` is set).
- *Log-probs*: the body asks for ``"logprobs": true`` (``logprobs``, on by
  default); what they mean, and what a reply without them gives:
  ``ragen.llm.openai_replies``. For a server that rejects the field (an HTTP
  400 naming it), set ``engine.logprobs=false``: nothing is asked, every
  completion has None.
- *Streamed ids*: the server is asked for whole answers (no ``"stream": true``),
  so a request with ``stream_tokens`` gets no partials (``submit_reporting`` is
  ``submit``): its completion carries every id.
- *Model name*: ``model``, else ``model_path`` (when not ``default``), else
  the server's first model from ``GET {base_url}/models``, asked by the first
  ``submit`` (which waits for it) and kept. ``max_model_len``: the context that
  model's entry there lists (``vllm serve`` does), asked once; None where
  the server does not say.

The policy version is the caller's bookkeeping: the engine cannot see the
server's weights, so whoever updates them calls ``bump_policy_version()``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from ragen.errors import ConfigError
from ragen.llm.chat_tokens import ChatTokens
from ragen.llm.default_model import resolve_model_path
from ragen.llm.openai_http import (SESSION_HEADER, HTTPTransport, MalformedReply, RefusedError, ServerUnavailable,
                                   checked_url, session_key)
from ragen.llm.openai_replies import ReplyReader, finish_reason
from ragen.llm.openai_tokens import NoTokenPrompts, complete_ids, load_tokenizer, vocab_size
from ragen.llm.pending import PendingFutures
from ragen.llm.types import Completion, GenerationRequest, SamplingParams, StreamingEngine, request_seed

logger = logging.getLogger(__name__)

__all__ = ["OpenAIEngine", "ServerUnavailable", "MalformedReply", "SESSION_HEADER", "session_key"]

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
            raise ConfigError(f"engine.logprobs must be true or false, got {logprobs!r}")
        if int(max_concurrency) < 1:
            raise ConfigError(f"engine.max_concurrency={max_concurrency} must be >= 1")
        if float(timeout_s) <= 0:
            raise ConfigError(f"engine.timeout_s={timeout_s} must be > 0")
        if int(max_retries) < 0:
            raise ConfigError(f"engine.max_retries={max_retries} must be >= 0")
        self.base_url = checked_url(base_url, "engine.base_url")
        self.http = HTTPTransport(self.base_url, api_key, float(timeout_s), int(max_retries), float(backoff_s))
        # one of several servers (engine.base_urls): a request the server does not answer within
        # its retries fails its future with ServerUnavailable, and the replicas send it elsewhere
        self.fail_over = bool(fail_over)
        self.model = model
        self.max_concurrency = int(max_concurrency)
        self.return_token_ids = bool(return_token_ids)
        self.returns_logprobs = logprobs  # asked for; a server may still send none
        # the server's tokenizer (its template's ChatTokens): prompts go as token ids
        if tokenizer is not None:
            tokenizer = load_tokenizer(tokenizer)
            self.chat = ChatTokens.of(tokenizer)
            self.vocab_size = vocab_size(tokenizer)  # what a reply's ids are checked against
        self.replies = ReplyReader(self.base_url, self.vocab_size)
        # why requests go as messages (no tokenizer, or the server refused token prompts); None: as ids
        self._messages_why: str | None = None if self.chat is not None else (
            "engine.tokenizer is not set (set it to the folder or cached id of the model the server runs)")
        self._warned_messages = False
        # pool threads build prompts one at a time: the tokenizer and the divergence count are shared
        self._prompt_lock = threading.Lock()
        self._warn_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="openai-engine")
        self._model_lock = threading.Lock()
        self._context_asked, self._context = False, None  # the server's max_model_len, asked once
        # the futures handed out and not yet resolved; close() cancels them
        self._pending = PendingFutures("the OpenAIEngine is closed")

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        value = options.get("tokenizer")
        if value is None:
            return
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"engine.tokenizer must be null, 'default', a local model folder or a cached model id, "
                              f"got {value!r}")
        if value != "default":
            try:
                resolve_model_path(value)
            except ValueError:
                raise ConfigError(
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
            raise ConfigError(f"engine.base_urls must be null or a non-empty list of server URLs, got {urls!r}")
        checked = [checked_url(url, f"engine.base_urls[{i}]") for i, url in enumerate(urls)]
        if len(set(checked)) < len(checked):
            raise ConfigError(f"engine.base_urls lists a server twice: {list(urls)!r}")
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
        if self._pending.closed:
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
        given = request.prompt_token_ids is not None  # the caller built the ids (the gateway): as ids or not at all
        as_ids = given or self._messages_why is None  # read once: another request's refusal may change it meanwhile
        ids: list[int] = []
        if as_ids:
            with self._prompt_lock:
                ids = self.prompt_ids(request)
        if limit <= 0:
            return Completion.answering(request, "", ids, [], "length", version,
                                        [] if self.returns_logprobs else None)
        if as_ids:
            try:
                return complete_ids(self.http, self.replies, request, ids,
                                    self._sampling_fields(request, sampling, limit, model), self.returns_logprobs,
                                    version)
            except NoTokenPrompts as exc:
                if given:
                    return self._refused_ids(request, exc, version)
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

    def _complete_messages(self, request: GenerationRequest, sampling: SamplingParams, limit: int, model: str,
                           version: int) -> Completion:
        """The request's messages sent to ``/chat/completions``."""
        messages = [dict(m) for m in request.messages]
        if request.answer_prefix:
            messages.append({"role": "assistant", "content": request.answer_prefix})
        body = {**self._sampling_fields(request, sampling, limit, model), "messages": messages}
        if request.tools:
            body["tools"] = request.tools
        if self.return_token_ids:
            body["return_token_ids"] = True
        if self.returns_logprobs:
            body["logprobs"] = True
        if request.answer_prefix:
            body.update(_CONTINUE_FIELDS)
        route = "/chat/completions"
        try:
            reply = self.http.post(route, body, session_key(request))
        except RefusedError as exc:
            why: Any = exc
            if request.answer_prefix:
                why = (f"{exc} -- the request carries an answer prefix, sent with "
                       f"{', '.join(f'{k}={json.dumps(v)}' for k, v in _CONTINUE_FIELDS.items())} and the "
                       f"prefix as a last assistant message: the server must support these chat-completions "
                       f"fields (vllm serve and SGLang do)")
            self._warn_failed(request, why)
            return self._error(request, version)
        return self._chat_completion(request, reply, route, version)

    def _chat_completion(self, request: GenerationRequest, reply: Any, route: str, version: int) -> Completion:
        """The completion in a ``/chat/completions`` reply."""
        replies = self.replies
        choice = replies.choice(reply, route)
        message = choice.get("message")
        if message is not None and not isinstance(message, dict):
            raise replies.malformed(route, f"choices[0].message is not an object (got {message!r:.80})")
        text = replies.text((message or {}).get("content"), route, "choices[0].message.content")
        response_ids = replies.ids(choice.get("token_ids") or [], route, "choices[0].token_ids")
        prompt_ids = replies.ids(reply.get("prompt_token_ids") or choice.get("prompt_token_ids") or [], route,
                                 "prompt_token_ids")
        logprobs = replies.chat_logprobs(choice, response_ids) if self.returns_logprobs else None
        completion = Completion.answering(request, text, prompt_ids, response_ids, finish_reason(choice), version,
                                          logprobs)
        if not request.tools:
            return completion
        # a server with a tool parser leaves the field out (vllm serve: null) when it found no call
        tool_calls = (message or {}).get("tool_calls") or []
        if not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls):
            raise replies.malformed(route, f"choices[0].message.tool_calls is not a list of objects "
                                           f"(got {tool_calls!r:.80})")
        return dataclasses.replace(completion, tool_calls=tool_calls)

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

    def _refused_ids(self, request: GenerationRequest, why: NoTokenPrompts, version: int) -> Completion:
        """The error completion of a request whose prompt ids were given (``prompt_token_ids``)
        and whose token prompt the server refused: as messages, the server would sample after its
        own render of them, not the ids given. Its text says why."""
        text = (f"the server at {self.base_url} refused this request's token prompt ({why}); its prompt is given "
                f"as token ids (prompt_token_ids), which are sent as ids or not at all, never as messages")
        self._warn_failed(request, text)
        return Completion.answering(request, text, [], [], "error", version)

    @staticmethod
    def _warn_failed(request: GenerationRequest, error: Any) -> None:
        """The warning that names the env and turn whose request ended in error."""
        logger.warning("OpenAIEngine: request for env %s turn %s failed (finish_reason='error'): %s",
                       request.env_id, request.turn, error)

    @staticmethod
    def _error(request: GenerationRequest, version: int) -> Completion:
        return Completion.answering(request, "", [], [], "error", version)

    # -- the server's model ---------------------------------------------

    def _model_name(self) -> str:
        with self._model_lock:
            if self.model is None:
                models = self.http.call_with_retries("GET", "/models", None)["data"]
                if not models:
                    raise RuntimeError("the server lists no models; set engine.model")
                self.model = str(models[0]["id"])
                logger.info("OpenAIEngine: using the server's model %r", self.model)
            return self.model

    @property
    def max_model_len(self) -> int | None:
        """The server's context: the ``max_model_len`` of its model's ``GET /models`` entry (``vllm serve``
        lists it), asked once; None where the server does not say (or cannot be asked)."""
        with self._model_lock:
            if not self._context_asked:
                self._context_asked = True
                self._context = self._ask_context()
            return self._context

    def _ask_context(self) -> int | None:
        try:
            models = self.http.call_with_retries("GET", "/models", None)["data"]
        except Exception as exc:  # the context is a bound the gateway checks early; the server still checks it
            logger.info("OpenAIEngine: no context length from %s/models (%s)", self.base_url, exc)
            return None
        entries = [m for m in models if isinstance(m, dict)] if isinstance(models, list) else []
        entry = next((m for m in entries if m.get("id") == self.model), entries[0] if entries else {})
        value = entry.get("max_model_len")
        return value if type(value) is int and value > 0 else None

    def close(self) -> None:
        """Cancel every future not yet resolved and stop the pool, without waiting for the server."""
        self.http.closed.set()
        pending = self._pending.close() or []
        self._pool.shutdown(wait=False, cancel_futures=True)
        for future in pending:
            future.cancel()

