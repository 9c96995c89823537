"""How gateway calls reach the engine: ``ManagerLink``, through the ``SharedLLMInferenceManager``.

A call is one ``GenerationRequest`` whose prompt is given as ids, sent on the
calling thread's own connection to the manager, so it is coalesced with every
other request in flight (the rollout workers' too), routed over replicas with
their failover, and waits at the weight-swap gate and for ``abort`` as theirs do.
A streamed call asks for its ids as they are sampled (``on_tokens``): the
manager's partials reach that callback on the calling thread while it waits.
The link also holds what the gateway needs of the engine's model: its chat
template and tokenizer (``ChatTokens``), a decoder for token texts
(``decode``), one for answers as the engine writes their text (``decode_text``:
special tokens left out), its context length and its served name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterator

from ragen.gateway.api_error import ApiError
from ragen.llm.chat_tokens import ChatTokens
from ragen.llm.types import Completion, EngineError, GenerationRequest, SamplingParams


class ManagerLink:
    """The engine behind a ``SharedLLMInferenceManager``, reached over ``client`` (a
    ``SharedLLMClient``: its connections are the calling threads' own) as a worker reaches it, with
    the engine's ``chat`` tokens and ``tokenizer`` (None: utf-8 bytes, the scripted engine's) built
    in the process the link lives in; ``ManagerLink.of(manager)`` builds one in the manager's own
    process. ``timeout_s`` bounds each call's wait for its answer (a 504 past it)."""

    def __init__(self, client: Any, chat: ChatTokens, served_name: str, max_context: int | None = None,
                 tokenizer: Any = None, timeout_s: float = 600.0) -> None:
        self._client = client
        self.chat = chat
        self.timeout_s = timeout_s
        self.served_name = served_name
        self.max_context = max_context
        self.decode = token_decoder(tokenizer)
        self.decode_text = token_decoder(tokenizer, skip_special_tokens=True)

    @classmethod
    def of(cls, manager: Any, timeout_s: float = 600.0, served_name: str | None = None) -> ManagerLink:
        """The link of ``manager``'s engine, in the manager's process (its chat tokens, tokenizer,
        context and name read from the engine)."""
        engine = manager.engine
        chat = getattr(engine, "chat", None)
        if not isinstance(chat, ChatTokens):
            raise ApiError(500, f"the engine {getattr(engine, 'name', type(engine).__name__)!r} has no chat template "
                           "and tokenizer here, which the gateway builds each call's token ids with (an "
                           "OpenAI-compatible engine needs engine.tokenizer)", code="no_tokenizer")
        return cls(manager.client(timeout_s), chat,
                   served_name or str(getattr(engine, "model_name", None) or engine.name), engine_context(engine),
                   getattr(engine, "tokenizer", None), timeout_s)

    @contextlib.contextmanager
    def expecting(self) -> Iterator[None]:
        """A call is being read and rendered: its request is on its way. The manager's coalescer
        counts it as an open stream, so an engine call about to start waits for it (within the
        coalescer's budget) rather than leaving it for the next call."""
        self._client.open_streams(1, announced=False)  # the rollout announced its env streams only
        try:
            yield
        finally:
            self._client.close_stream()  # at once: a held close would keep the next engine call waiting for it

    def generate(self, request: GenerationRequest, sampling: SamplingParams,
                 on_tokens: Callable[[list[int]], None] | None = None) -> Completion:
        """The engine's completion of ``request`` (its ``prompt_token_ids`` given), with its whole
        prompt ids; ``ApiError`` 502 for an engine failure, 504 past ``timeout_s``. ``on_tokens``:
        told the answer's new ids as the engine samples them (on this thread; what it raises
        abandons the call and comes out of here)."""
        client = self._client
        told = None if on_tokens is None else (lambda _index, ids: on_tokens(ids))
        ticket = client.submit([request], sampling, on_tokens=told)
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                got = client.wait_any(max(0.0, deadline - time.monotonic()))
                if got is None:
                    client.abandon(ticket)
                    raise ApiError(504, f"the engine gave no answer within {self.timeout_s:g} s "
                                   "(gateway.call_timeout_s)", code="engine_timeout")
                if got[0] == ticket:
                    break
        except EngineError as exc:
            raise ApiError(504 if exc.timed_out else 502, f"the engine failed on the call: {exc}",
                           code="engine_error") from None
        except BaseException:  # on_tokens failed (its client went away): nobody reads the answer
            client.abandon(ticket)
            raise
        completion = got[1][0]
        if completion.finish_reason == "error":
            raise ApiError(502, f"the engine failed on the call: {completion.text or 'no reason given'}",
                           code="engine_error")
        if completion.prompt_start:  # the ids after those the request gave
            completion = dataclasses.replace(
                completion, prompt_token_ids=list(request.prompt_token_ids[:completion.prompt_start]) +
                list(completion.prompt_token_ids), prompt_start=0)
        return completion


def engine_context(engine: Any) -> int | None:
    """The most tokens a prompt and its answer may hold on ``engine``'s model, where it says."""
    for owner, name in ((getattr(getattr(engine, "model", None), "config", None), "max_position_embeddings"),
                        (engine, "max_model_len")):
        value = getattr(owner, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def token_decoder(tokenizer: Any, skip_special_tokens: bool = False) -> Callable[[list[int]], str]:
    """Token ids as text on an engine's ``tokenizer`` (None, the scripted engine's: utf-8 bytes)."""
    if tokenizer is not None and hasattr(tokenizer, "decode"):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
