"""``ServerManagerClient``: a gateway's calls answered by verl's server manager, token in, token out.

A ``ManagerLink`` sends each call from the thread that serves it (``submit``, then ``wait_any``);
this client runs it on the event loop of the verl sample it belongs to, as
``server_manager.generate(request_id, prompt_ids=, sampling_params=)`` with verl's sampling and the
call's ``max_tokens``, and gives back our ``Completion``: the ids sampled and their log-probs, the
text (the end token left out, special tokens skipped, cut at a stop string), "stop" or "length".

Each sample registers its episode (``VerlEpisode``) under the env id its gateway session carries.
The episode's first segment is verl's sample, so its calls are bounded to fit it: the episode's
first call's prompt within ``prompt_length`` (verl's ``data.max_prompt_length``), every call's prompt
and answer within that first prompt and ``response_length`` (``data.max_response_length``). An
answer is capped to that room; a call with none left is refused as an OpenAI server refuses a
context too long (400 ``context_length_exceeded``), and the episode is marked truncated.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from uuid import uuid4

from ragen.gateway.api_error import ApiError
from ragen.llm.types import Completion, EngineError, GenerationRequest, SamplingParams, token_id_error

ABORTED = ("aborted", "abort")  # verl's stop reasons for a request its server dropped


@dataclass
class VerlEpisode:
    """One verl sample's agent episode, as its calls need it: verl's event loop and server manager,
    its sampling (``run``'s ``sampling_params``) and the sample's lengths."""

    loop: asyncio.AbstractEventLoop
    server_manager: Any
    sampling_params: dict[str, Any]
    prompt_length: int
    response_length: int
    # the server manager's sticky-session key: the episode's calls go to the server holding its prefix
    request_id: str = field(default_factory=lambda: uuid4().hex)
    first_prompt: int | None = None  # the ids of the episode's first call's prompt
    truncated: bool = False  # a call was refused, or an answer cut, for the sample's room
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def room(self, prompt_tokens: int) -> int:
        """How many ids a call's answer may have after a prompt of ``prompt_tokens`` (module
        docstring); ``ApiError`` 400 when none."""
        with self.lock:
            if self.first_prompt is None:
                if prompt_tokens > self.prompt_length:
                    self.truncated = True
                    raise ApiError(400, f"the episode's first prompt has {prompt_tokens} tokens, more than verl's "
                                   f"data.max_prompt_length={self.prompt_length}", param="messages",
                                   code="context_length_exceeded")
                self.first_prompt = prompt_tokens
            room = self.first_prompt + self.response_length - prompt_tokens
            if room < 1:
                self.truncated = True
                raise ApiError(400, f"the prompt has {prompt_tokens} tokens, leaving no room in verl's sample (the "
                               f"episode's first prompt of {self.first_prompt} and data.max_response_length="
                               f"{self.response_length})", param="messages", code="context_length_exceeded")
            return room


class ServerManagerClient:
    """A ``ManagerLink``'s client over verl's server manager (module docstring). ``ends``: the ids that
    end an answer; ``decode_text(ids)``: an answer's text, special tokens skipped; ``vocab_size``: the
    model's, to refuse a reply with ids it does not have."""

    def __init__(self, ends: set[int], decode_text: Callable[[list[int]], str], vocab_size: int | None = None) -> None:
        self.ends = set(ends)
        self.decode_text = decode_text
        self.vocab_size = vocab_size
        self._episodes: dict[int, VerlEpisode] = {}
        self._lock = threading.Lock()
        self._tickets = itertools.count(1)
        self._local = threading.local()  # the calling thread's call in flight

    @contextlib.contextmanager
    def episode(self, env_id: int, episode: VerlEpisode) -> Iterator[VerlEpisode]:
        """``episode``'s calls (those of sessions with ``env_id``) answered while inside."""
        with self._lock:
            if env_id in self._episodes:
                raise ValueError(f"env id {env_id} has an episode already")
            self._episodes[env_id] = episode
        try:
            yield episode
        finally:
            with self._lock:
                del self._episodes[env_id]

    def open_streams(self, n: int, announced: bool = True) -> None:
        """Nothing to coalesce here: verl's servers batch what they are sent."""

    def close_stream(self) -> None:
        """See ``open_streams``."""

    def submit(self, requests: list[GenerationRequest], sampling: SamplingParams, hold: bool = False,
               on_tokens: Callable[[int, list[int]], None] | None = None) -> int:
        (request,) = requests  # the gateway sends one request a call
        with self._lock:
            episode = self._episodes.get(request.env_id)
        if episode is None:
            raise ApiError(502, f"no verl sample holds env id {request.env_id}: its episode ended",
                           code="engine_error")
        prompt = list(request.prompt_token_ids or ())
        room = episode.room(len(prompt))
        max_tokens = min(sampling.max_tokens, room)
        params = {**episode.sampling_params, "max_tokens": max_tokens}
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        future = asyncio.run_coroutine_threadsafe(
            episode.server_manager.generate(episode.request_id, prompt_ids=prompt, sampling_params=params),
            episode.loop)
        ticket = next(self._tickets)
        self._local.pending = (ticket, future, request, prompt, max_tokens, max_tokens == room, sampling.stop,
                               on_tokens, episode)
        return ticket

    def wait_any(self, timeout: float | None = None) -> tuple[int, list[Completion]] | None:
        ticket, future, request, prompt, max_tokens, at_room, stop, on_tokens, episode = self._local.pending
        try:
            output = future.result(timeout)
        except concurrent.futures.TimeoutError:
            return None  # the link abandons the call
        except Exception as exc:  # noqa: BLE001 - the server manager's failure (or a cancel) is this call's
            self._local.pending = None
            raise EngineError(f"verl's server manager failed: {type(exc).__name__}: {exc}", ticket) from exc
        self._local.pending = None
        completion = self._completion(request, prompt, output, max_tokens, stop, ticket)
        if at_room and len(completion.response_token_ids) >= max_tokens:
            episode.truncated = True
        if on_tokens is not None:
            on_tokens(0, list(completion.response_token_ids))
        return ticket, [completion]

    def abandon(self, ticket: int) -> None:
        pending = getattr(self._local, "pending", None)
        if pending is not None and pending[0] == ticket:
            pending[1].cancel()  # cancels the request on verl's loop
            self._local.pending = None

    def _completion(self, request: GenerationRequest, prompt: list[int], output: Any, max_tokens: int,
                    stop: list[str], ticket: int) -> Completion:
        """Our completion of verl's ``TokenOutput``; ``EngineError`` for a reply that is none."""
        if output.stop_reason in ABORTED:
            raise EngineError("verl's server aborted the call", ticket)
        ids, logprobs = list(output.token_ids), output.log_probs
        problem = token_id_error(ids, self.vocab_size)
        if problem is None and logprobs is not None and len(logprobs) != len(ids):
            problem = f"{len(logprobs)} log-probs for {len(ids)} token ids"
        if problem is not None:
            raise EngineError(f"verl's server replied with what are not answer ids: {problem}", ticket)
        ended = bool(ids) and ids[-1] in self.ends
        text = self.decode_text(ids[:-1] if ended else ids)
        finish = "stop" if ended or len(ids) < max_tokens else "length"
        cuts = [text.find(s) for s in stop if s and s in text]
        if cuts:
            text, finish = text[:min(cuts)], "stop"
        steps = (getattr(output, "extra_fields", None) or {}).get("global_steps")
        return Completion.answering(request, text, prompt, ids, finish, steps if isinstance(steps, int) else 0,
                                    None if logprobs is None else [float(x) for x in logprobs])
