"""``AgentCall``: one answered call of an agent episode, as its ``Turn`` holds it, and read back.

An agent turn (``ragen.rollout.agent_episode``) holds its call linearly: ``observation`` is the
JSON text of the messages the call added after those its segment held (all of them for a
segment's first call; for a call that extends, those after the previous answer as the client
repeated it; "" for a completions call, whose prompt is text), ``info`` where it stands in the
session (``call``, ``segment``, ``cause``, ``endpoint``), its segment's ``tools`` on the
segment's first call where it has any, and the answer's ``content`` as the client got it; the
answer's tool calls are ``Turn.tool_calls``. ``call_messages`` rebuilds each call's whole
messages as sent, one call at a time. ``AgentCall.of_turn`` reads a turn back, raising
``ValueError`` naming the field at fault (a dump is input).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ragen.gateway.record import CallRecord
from ragen.rollout.json_types import MAX_NESTING, depth, is_a, short, type_name
from ragen.rollout.types import Turn

COMPLETIONS = "completions"  # the endpoint whose calls have a text prompt, not messages


@dataclass(frozen=True)
class AgentCall:
    """One answered call: where it stands, the messages it added, its segment's tools (on the
    segment's first call) and its answer as the client got it (None: a completions call)."""

    index: int  # the call's number in its session
    segment: int
    cause: str | None  # why its segment started with it ("first", a key of gateway.segments.BREAKS); None: extends
    endpoint: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    answer: dict[str, Any] | None

    @classmethod
    def of_record(cls, record: CallRecord) -> AgentCall:
        return cls(record.index, record.segment, record.cause, record.endpoint, list(record.messages),
                   record.tools, record.answer)

    @property
    def observation(self) -> str:
        """The turn's ``observation``: the added messages as JSON ("" for a completions call)."""
        return "" if self.endpoint == COMPLETIONS else json.dumps(self.messages, ensure_ascii=False)

    @property
    def info(self) -> dict[str, Any]:
        """The turn's ``info``."""
        info: dict[str, Any] = {"call": self.index, "segment": self.segment, "cause": self.cause,
                                "endpoint": self.endpoint}
        if self.tools:
            info["tools"] = self.tools
        if self.answer is not None:
            info["content"] = self.answer.get("content") or ""
        return info

    @property
    def tool_calls(self) -> tuple[dict[str, Any], ...] | None:
        """The turn's ``tool_calls``: the answer's, as the client got them (None: it made none)."""
        calls = (self.answer or {}).get("tool_calls")
        return tuple(calls) if calls else None

    @classmethod
    def of_turn(cls, turn: Turn, where: str) -> AgentCall:
        """The call a turn holds; ``ValueError`` naming ``where`` and the field that is not one."""
        info = turn.info
        for key, hint in (("call", int), ("segment", int), ("cause", str | None), ("endpoint", str),
                          ("tools", list[dict[str, Any]] | None), ("content", str | None)):
            if not is_a(info.get(key), hint):
                raise ValueError(f"{where}.info.{key}: expected {type_name(hint)} (an agent call's), got "
                                 f"{short(info.get(key))}")
        endpoint = info["endpoint"]
        messages: list[dict[str, Any]] = []
        if endpoint != COMPLETIONS:
            try:
                messages = json.loads(turn.observation)
            except (ValueError, RecursionError):
                raise ValueError(f"{where}.observation: not the JSON of an agent call's messages") from None
            if not isinstance(messages, list) or depth(messages) > MAX_NESTING:
                raise ValueError(f"{where}.observation: expected a JSON list of messages, got {short(messages)}")
            for m, message in enumerate(messages):
                if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                        and isinstance(message.get("content"), str)):
                    raise ValueError(f"{where}.observation: message {m} is {short(message)}; expected "
                                     '{"role": str, "content": str, ...}')
        answer = None
        if endpoint != COMPLETIONS:
            answer = {"role": "assistant", "content": info.get("content") or ""}
            if turn.tool_calls:
                answer["tool_calls"] = list(turn.tool_calls)
        return cls(info["call"], info["segment"], info["cause"], endpoint, messages, info.get("tools"), answer)


def call_messages(calls: Sequence[AgentCall]) -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """Each call's whole messages as sent and its tools: a segment's first call's own, then for each
    call that extends it the messages before, the previous answer and its own. One call at a time
    (each list is a new one): every call's at once would grow with the square of the calls. A
    completions call yields no messages and ends the chat its segment had."""
    held: list[dict[str, Any]] = []
    tools = None
    last_answer: dict[str, Any] | None = None
    for call in calls:
        if call.cause is not None or call.endpoint == COMPLETIONS:
            held, tools = [], call.tools
        elif last_answer is not None:
            held.append(last_answer)
        held.extend(call.messages)
        yield list(held), tools
        last_answer = call.answer
