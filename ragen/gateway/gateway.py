"""``Gateway``: a session's calls played on the engine, each with its exact tokens recorded.

A chat call's prompt is built by the session's ``SessionTokens`` (appended to the
segment's ids where the call extends the previous one) and sent to the engine as
ids, sampled with the rollout's settings: its temperature, top-p and the seed of
the request's key win over the client's, and its ``max_tokens`` caps the
client's, which is cut further to the room the model's context leaves. What the
rollout's settings overrode is recorded on each call and logged once a session.
Every call is audited: the engine must have sampled after exactly the ids sent
(``drift`` counts any that did not; ``unaudited`` the calls of an engine that
reports no prompt ids), and ``retokenize_drift`` counts the answers
whose text would not encode back to the ids sampled (what a gateway that
re-tokenizes would have trained on wrongly). A streamed call passes ``on_tokens``,
told the answer's ids as the engine samples them; its answer is read from the
completion as any call's is.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

from ragen.config_reader import setting
from ragen.errors import ConfigError
from ragen.gateway.api_error import ApiError
from ragen.gateway.calls import ChatCall, Sampling, TextCall
from ragen.gateway.link import ManagerLink
from ragen.gateway.record import CallRecord
from ragen.gateway.replies import Answer, answer_message, read_answer
from ragen.gateway.segments import Prompt, said_answer
from ragen.gateway.session import Session, Sessions
from ragen.llm.types import Completion, GenerationRequest, SamplingParams
from ragen.serving.address import check_listen_address

logger = logging.getLogger(__name__)

OnTokens = Callable[[list[int]], None]  # a streamed call's new ids, as the engine samples them


GATEWAY_KEY_ENV = "RAGEN_GATEWAY_KEY"  # gateway.key_env's default


@dataclass(frozen=True)
class GatewaySettings:
    """``gateway.*`` of the config: where the gateway listens, its key, its served name and its
    bounds. ``read(GatewaySettings, cfg["gateway"], "gateway")`` checks every value (a
    ``ConfigError`` naming the key); the fields' defaults are the keys' defaults."""

    host: str = "127.0.0.1"  # 0.0.0.0: other machines too, which needs the key given (key_env)
    port: int = setting(0, minimum=0, maximum=65535)  # 0: a free port (config/base.yaml: 8400, the command line's)
    # the environment variable holding the server's key (the one that opens sessions); unset: a new
    # key, on loopback only. Never the key itself: a config and a command line are readable by others.
    key_env: str = GATEWAY_KEY_ENV
    served_name: str | None = None  # the model name /v1/models lists; None: the engine's
    max_sessions: int = setting(256, minimum=1)  # open at once; the next is a 429 with Retry-After
    session_ttl_s: float = setting(600.0, minimum=0.0)  # a session idle this long is closed (0: never)
    max_calls_per_session: int = setting(8, minimum=1)  # in flight at once; the next is a 429
    max_messages: int = setting(2048, minimum=1)  # in one chat call
    max_body_bytes: int = setting(8 << 20, minimum=1)  # of one request; a larger one is a 413
    max_connections: int = setting(512, minimum=1)  # open HTTP connections; the next is refused with a 503
    call_timeout_s: float = setting(600.0, above=0.0)  # one call's wait for the engine; a 504 past it
    # prompt and answer tokens; None: the model's where it says
    max_context: int | None = setting(None, minimum=2)
    io_timeout_s: float = setting(60.0, above=0.0)  # a client that sends or reads nothing this long is dropped

    def __post_init__(self) -> None:
        check_listen_address(self.host, self.port, "gateway")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.key_env):
            raise ConfigError(f"gateway.key_env must name an environment variable (letters, digits and _), "
                              f"got {self.key_env!r}")


class Gateway:
    """Sessions and their calls over one engine link, sampled with the rollout's ``sampling``."""

    def __init__(self, link: ManagerLink, sampling: SamplingParams, settings: GatewaySettings | None = None,
                 sessions: Sessions | None = None) -> None:
        settings = settings if settings is not None else GatewaySettings()
        self.link = link
        self.sampling = sampling
        self.settings = settings
        self.max_context = settings.max_context or link.max_context
        # not `sessions or`: Sessions has a length, and none open reads as false
        self.sessions = sessions if sessions is not None else Sessions(link.chat, settings.max_sessions,
                                                                       settings.session_ttl_s)

    def chat(self, session: Session, call: ChatCall, record: CallRecord, on_tokens: OnTokens | None = None) -> Answer:
        """The chat call played: its prompt, the engine's answer, its record filled; ``on_tokens``:
        told the answer's ids as they are sampled (a streamed call)."""
        with self.link.expecting():
            return self._chat(session, call, record, on_tokens)

    def _chat(self, session: Session, call: ChatCall, record: CallRecord, on_tokens: OnTokens | None) -> Answer:
        prompt = session.tokens.prompt(call)
        record.messages = call.kept[prompt.held:]
        record.tools = call.tools if prompt.cause is not None else None
        completion = self._generate(session, record, prompt, call.sampling, call.shown, call.tools, on_tokens)
        content, calls, finish = read_answer(completion.text, completion.finish_reason, call.tools,
                                             call.tool_choice)
        session.tokens.answered(call, prompt, completion.response_token_ids, said_answer(content, calls))
        record.finish_reason = finish
        # named by the session's request key, not its random id: a client repeats them into its next messages,
        # which the episode's record keeps, so an episode played again gives the same messages
        call_ids = tuple(f"call_{session.seed}_{session.env_id}_{record.index}_{j}" for j in range(len(calls)))
        answer = Answer(f"chatcmpl-{session.id}-{record.index}", call.model or self.link.served_name, content, calls,
                        finish, len(prompt.ids), tuple(completion.response_token_ids),
                        None if completion.logprobs is None else tuple(completion.logprobs), call_ids)
        record.answer = answer_message(answer)
        return answer

    def text(self, session: Session, call: TextCall, record: CallRecord, on_tokens: OnTokens | None = None) -> Answer:
        """The completions call played: its prompt ids (the text encoded as it is, no template)."""
        with self.link.expecting():
            return self._text(session, call, record, on_tokens)

    def _text(self, session: Session, call: TextCall, record: CallRecord, on_tokens: OnTokens | None) -> Answer:
        ids = call.prompt_ids if call.prompt_ids is not None else self.link.chat.encode(call.prompt_text or "")
        if not ids:
            raise ApiError(400, "prompt encodes to no tokens", param="prompt", code="invalid_value")
        prompt = session.tokens.text_prompt(ids)
        messages = [{"role": "user", "content": call.prompt_text or ""}]
        completion = self._generate(session, record, prompt, call.sampling, messages, None, on_tokens)
        session.tokens.answered_text(prompt, completion.response_token_ids)
        record.finish_reason = completion.finish_reason
        return Answer(f"cmpl-{session.id}-{record.index}", call.model or self.link.served_name, completion.text, (),
                      completion.finish_reason, len(prompt.ids), tuple(completion.response_token_ids),
                      None if completion.logprobs is None else tuple(completion.logprobs))

    def _generate(self, session: Session, record: CallRecord, prompt: Prompt, asked: Sampling,
                  messages: list[dict[str, str]], tools: list[dict[str, Any]] | None,
                  on_tokens: OnTokens | None) -> Completion:
        """The engine's completion of ``prompt``, audited, with the record's prompt and answer filled."""
        record.segment, record.cause, record.prompt_start = prompt.segment, prompt.cause, prompt.start
        record.prompt_added = prompt.added
        sampling = self._sampling(session, record, asked, len(prompt.ids))
        request = GenerationRequest(messages=messages, env_id=session.env_id, turn=record.index, seed=session.seed,
                                    tools=tools, prompt_token_ids=prompt.ids)
        t0 = time.perf_counter()
        completion = self.link.generate(request, sampling, on_tokens)
        record.engine_s = time.perf_counter() - t0
        if not completion.prompt_token_ids:  # an engine that reports no prompt ids cannot be audited
            session.count("unaudited")
        elif completion.prompt_token_ids != prompt.ids:
            session.count("drift")
            logger.warning("gateway session %s call %d: the engine sampled after other ids than the %d sent",
                           session.id, record.index, len(prompt.ids))
        if self.link.chat.encode(completion.text) != list(completion.response_token_ids):
            session.count("retokenize_drift")
        record.response_ids = list(completion.response_token_ids)
        record.logprobs = None if completion.logprobs is None else list(completion.logprobs)
        record.policy_version, record.replica = completion.policy_version, completion.replica
        return completion

    def _sampling(self, session: Session, record: CallRecord, asked: Sampling, prompt_tokens: int) -> SamplingParams:
        """The rollout's sampling for this call: its answer capped by the client's max_tokens and the
        context's room; what the client asked that it overrides recorded (and logged once a session)."""
        base = self.sampling
        room = None if self.max_context is None else self.max_context - prompt_tokens
        if room is not None and room < 1:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens, leaving no room in the model's context of "
                           f"{self.max_context} tokens (gateway.max_context)", param="messages",
                           code="context_length_exceeded")
        limit = min(x for x in (base.max_tokens, asked.max_tokens, room) if x is not None)
        overrides = {k: v for k, v in (("temperature", asked.temperature), ("top_p", asked.top_p),
                                       ("seed", asked.seed)) if v is not None and v != getattr(base, k)}
        if asked.max_tokens is not None and asked.max_tokens > base.max_tokens:
            overrides["max_tokens"] = asked.max_tokens
        record.overrides = overrides
        if overrides and not session.overrides_logged:
            session.overrides_logged = True
            logger.info("gateway session %s: the rollout's sampling wins over the client's %s (temperature %g, "
                        "top_p %g, at most %d tokens, the seed of each request's key)", session.id,
                        ", ".join(f"{k}={v}" for k, v in overrides.items()), base.temperature, base.top_p,
                        base.max_tokens)
        return dataclasses.replace(base, max_tokens=limit, stop=self.stops(asked))

    def stops(self, asked: Sampling) -> list[str]:
        """The stop strings of a call: the rollout's, then the client's."""
        return list(self.sampling.stop) + list(asked.stop)
